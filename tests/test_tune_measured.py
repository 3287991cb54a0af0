"""bench.tune_measured: the coordinate search and the export it writes, with a fake timer (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import tune_measured
from fasttree import FastTreeConfig
from fasttree.export import read_export
from fasttree.toolkit import refine


def _fake_timer(calls):
    """Time = a bowl with its minimum at pack_tokens 768 and the smallest default split size."""

    def timer(rt, q, k, v, out):
        calls.append(rt.config)
        c = rt.config
        return 100.0 + abs(c.pack_tokens - 768) / 10 + c.kv_split_sizes[0] / 100

    return timer


def _args(tmp_path, *extra, device="cpu"):
    return [
        "--export", "docs/tune/export.json", "--out", str(tmp_path / "refined.json"), "--models", "tiny",
        "--scenarios", "few_shot", "--trees", "1", "--steps", "6", "--device", str(device), *extra,
    ]  # fmt: skip


def _gpu(device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def test_search_finds_the_fastest_config_and_keeps_other_entries(tmp_path, device):
    calls = []
    args = _args(tmp_path, "--fields", "pack_tokens,kv_split_sizes[0]", "--passes", "3", device=device)
    assert tune_measured.main(args, timer=_fake_timer(calls)) == 0
    refined = read_export(tmp_path / "refined.json")
    start = read_export("docs/tune/export.json")
    (entry,) = [e for e in refined.entries if e.gpu == _gpu(device) and e.bucket == (2, 16, "float16")]
    assert entry.config.pack_tokens == 768
    assert entry.config.kv_split_sizes[0] == 256
    prov = entry.provenance
    assert prov["measured_objective"] < 1
    assert [m[0] for m in prov["moves"]] == ["pack_tokens", "kv_split_sizes[0]"]
    assert prov["evaluations"] == len(calls)  # one tree per scenario, one scenario: one call per evaluation
    assert prov["seed"] == 1
    # every start entry (other buckets) is kept unchanged
    assert [e.to_dict() for e in refined.entries if e is not entry] == [e.to_dict() for e in start.entries]
    json.loads((tmp_path / "refined.json").read_text())


def test_min_gain_keeps_the_start_config(tmp_path, device):
    calls = []
    args = _args(tmp_path, "--fields", "pack_min_units", "--min-gain", "0.5", device=device)
    assert tune_measured.main(args, timer=_fake_timer(calls)) == 0
    entries = read_export(tmp_path / "refined.json").entries
    (entry,) = [e for e in entries if e.gpu == _gpu(device) and e.bucket == (2, 16, "float16")]
    assert entry.provenance["moves"] == []
    assert entry.config == FastTreeConfig()
    assert len(calls) == 1 + len(refine.COORDINATES["pack_min_units"]) - 1  # the default's value skipped


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fields", "nope"], "unknown or no fields"),
        (["--models", "gpt"], "unknown model"),
        (["--trees", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        tune_measured.main(_args(tmp_path, *extra), timer=_fake_timer([]))
    assert message in capsys.readouterr().err


def test_existing_output_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "refined.json"
    out.write_text("mine")
    with pytest.raises(SystemExit):
        tune_measured.main(_args(tmp_path), timer=_fake_timer([]))
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == "mine"
