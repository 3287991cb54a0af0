"""bench.tune_measured with a fake timer (CPU): the coordinate search, the format-3 runtime entries it
writes (launch fields kept at the defaults, member 1 fenced by the searched trees' region), the start
entry it refines and the entries it copies."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import fasttree as ft
from bench import tune_measured
from bench.decode import MODELS
from fasttree import ConfigExport, ExportEntry, ExportGuard, FastTreeConfig, LeafRegion, Portfolio, Selector
from fasttree.export import read_export, write_export
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


def _refined_entry(path, device):
    """The refined export's runtime entry of the tiny model's bucket."""
    entries = read_export(path).entries
    (entry,) = [e for e in entries if (e.gpu, e.bucket, e.target) == (_gpu(device), (2, 16, "float16"), "runtime")]
    return entry


def test_search_finds_the_fastest_config(tmp_path, device, caplog):
    caplog.set_level(logging.INFO, logger="bench.tune_measured")
    calls = []
    args = _args(tmp_path, "--fields", "pack_tokens,kv_split_sizes[0]", "--passes", "3", device=device)
    assert tune_measured.main(args, timer=_fake_timer(calls)) == 0
    entry = _refined_entry(tmp_path / "refined.json", device)
    assert entry.target == "runtime" and entry.guard == ExportGuard.current()
    portfolio = entry.portfolio
    assert portfolio.runtime and portfolio.members[0] == FastTreeConfig()
    assert portfolio.selector == Selector(member=(1,))
    tuned = portfolio.members[1]
    assert tuned.pack_tokens == 768
    assert tuned.kv_split_sizes[0] == 256
    # member 1 for every tree like the searched ones, at the model's heads; the defaults elsewhere
    tiny = MODELS["tiny"]
    (searched,) = tune_measured.serving_trees(["few_shot"], seed=1, steps=6, trees=1)["few_shot"]
    (region,) = portfolio.regions
    assert (region.evidence, region.trees, region.layouts) == ("measured", 1, ((tiny.num_kv_heads, 2),))
    served = portfolio.for_heads(tiny.num_q_heads, tiny.num_kv_heads)
    assert served.select(searched) == tuned
    assert served.select(ft.KVTree.from_levels((1, 3), (40, 5))) == FastTreeConfig()  # not like the searched tree
    assert portfolio.for_heads(2 * tiny.num_q_heads, 2 * tiny.num_kv_heads).select(searched) == FastTreeConfig()
    prov = entry.provenance
    assert prov["measured_objective"] < 1
    assert [m[0] for m in prov["moves"]] == ["pack_tokens", "kv_split_sizes[0]"]
    assert prov["evaluations"] == len(calls)  # one tree per scenario, one scenario: one call per evaluation
    assert prov["seed"] == 1
    assert "launch_fields_dropped" not in prov
    json.loads((tmp_path / "refined.json").read_text())
    # the start export (the committed one) holds other buckets: its entries are copied unchanged
    start = read_export("docs/tune/export.json")
    assert start.entries and all(e.bucket != entry.bucket for e in start.entries)
    refined = read_export(tmp_path / "refined.json").entries
    assert sorted(map(repr, refined)) == sorted(map(repr, (*start.entries, entry)))


def _start(tmp_path, gpu: str) -> tuple[Path, ConfigExport]:
    """A start export: both targets of the tiny bucket and of another bucket."""
    guard = ExportGuard.current("e" * 64)
    one = Selector(member=(1,))
    start_config = FastTreeConfig(pack_tokens=256, kv_split_sizes=(512, 128))

    def entry(g, d, config, target):
        n = len(ft.portfolio.TREE_FEATURES)
        region = LeafRegion((-1e6,) * n, (1e6,) * n, ((4, g),), trees=9, evidence="predicted")
        portfolio = Portfolio(members=(FastTreeConfig(), config), selector=one, runtime=target == "runtime",
                              regions=(region,))  # fmt: skip
        return ExportEntry(gpu, g, d, "float16", portfolio, {"study_name": f"g{g}-d{d}-{target}"}, target, guard)

    export = ConfigExport(
        (
            entry(2, 16, start_config, "runtime"),
            entry(2, 16, FastTreeConfig(kv_tile=(32, 32)), "tree_attention"),
            entry(4, 128, FastTreeConfig(gamma=0.5), "runtime"),
            entry(4, 128, FastTreeConfig(num_warps=(8, 4)), "tree_attention"),
        ),
        {"trace_set_hash": "f" * 64},
    )
    return write_export(tmp_path / "start.json", export), export


def test_a_start_is_refined_from_its_runtime_entry_and_other_entries_are_kept(tmp_path, device):
    path, start = _start(tmp_path, _gpu(device))
    (start_entry,) = [e for e in start.entries if e.bucket == (2, 16, "float16") and e.target == "runtime"]
    calls = []
    args = _args(tmp_path, "--fields", "pack_tokens", device=device)
    args[args.index("--export") + 1] = str(path)
    assert tune_measured.main(args, timer=_fake_timer(calls)) == 0
    assert calls[0] == start_entry.portfolio.members[1]  # the search started from the runtime entry's member
    refined = read_export(tmp_path / "refined.json")
    (entry,) = [e for e in refined.entries if e.bucket == (2, 16, "float16") and e.target == "runtime"]
    assert entry.portfolio.members[1] == FastTreeConfig(pack_tokens=768, kv_split_sizes=(512, 128))
    assert entry.provenance["start_provenance"] == {"study_name": "g2-d16-runtime"}
    assert entry.provenance["start_config"] == start_entry.portfolio.members[1].to_dict()
    # every other start entry (the bucket's tree_attention entry, the other bucket's two) is kept unchanged
    assert [e.to_dict() for e in refined.entries if e is not entry] == [
        e.to_dict() for e in start.entries if e is not start_entry
    ]
    assert refined.provenance["trace_set_hash"] == "f" * 64


def _launch_timer(calls, *, plan_level: bool):
    """Faster with a 32-wide small KV tile (a launch field) and, when ``plan_level``, pack_tokens 768."""

    def timer(rt, q, k, v, out):
        calls.append(rt.config)
        c = rt.config
        return 100.0 - 10 * (c.kv_tile[1] == 32) + (abs(c.pack_tokens - 768) / 10 if plan_level else 0.0)

    return timer


def test_a_launch_field_move_is_dropped_from_the_runtime_member(tmp_path, device, caplog):
    caplog.set_level(logging.INFO, logger="bench.tune_measured")
    args = _args(tmp_path, "--fields", "kv_tile[1],pack_tokens", device=device)
    assert tune_measured.main(args, timer=_launch_timer([], plan_level=True)) == 0
    entry = _refined_entry(tmp_path / "refined.json", device)
    assert [m[0] for m in entry.provenance["moves"]] == ["kv_tile[1]", "pack_tokens"]
    assert entry.portfolio.members[1] == FastTreeConfig(pack_tokens=768)  # the defaults' kv_tile
    assert entry.provenance["launch_fields_dropped"] == {"kv_tile": [64, 32]}
    assert any("launch fields" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)


def test_a_search_that_moved_only_launch_fields_writes_no_entry(tmp_path, device, caplog):
    caplog.set_level(logging.INFO, logger="bench.tune_measured")
    args = _args(tmp_path, "--fields", "kv_tile[1],pack_min_units", "--min-gain", "0.05", device=device)
    assert tune_measured.main(args, timer=_launch_timer([], plan_level=False)) == 0
    assert read_export(tmp_path / "refined.json").entries == read_export("docs/tune/export.json").entries
    assert any("no entry written" in r.getMessage() for r in caplog.records)


def test_runtime_member():
    assert tune_measured.runtime_member(FastTreeConfig(gamma=0.5)) == (FastTreeConfig(gamma=0.5), {})
    assert tune_measured.runtime_member(FastTreeConfig(num_stages=(2, 2), gamma=0.5)) == (
        FastTreeConfig(gamma=0.5),
        {"num_stages": (2, 2)},
    )
    assert tune_measured.runtime_member(FastTreeConfig(kv_tile=(32, 32))) == (None, {"kv_tile": (32, 32)})
    assert tune_measured.runtime_member(FastTreeConfig()) == (FastTreeConfig(), {})


def test_min_gain_keeps_the_start_config(tmp_path, device):
    calls = []
    args = _args(tmp_path, "--fields", "pack_min_units", "--min-gain", "0.5", device=device)
    assert tune_measured.main(args, timer=_fake_timer(calls)) == 0
    entry = _refined_entry(tmp_path / "refined.json", device)
    assert entry.provenance["moves"] == []
    assert entry.portfolio.members == (FastTreeConfig(), FastTreeConfig())
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


def test_start_entries_format_3_cannot_hold_are_not_copied(tmp_path, device, caplog):
    caplog.set_level(logging.INFO, logger="bench.tune_measured")
    path, _ = _start(tmp_path, _gpu(device))
    doc = json.loads(path.read_text())
    doc["schema_version"] = 2  # as format 2 wrote it: no regions
    for e in doc["entries"]:
        del e["portfolio"]["regions"]
    path.write_text(json.dumps(doc))
    args = _args(tmp_path, "--fields", "pack_tokens", device=device)
    args[args.index("--export") + 1] = str(path)
    assert tune_measured.main(args, timer=_fake_timer([])) == 0
    refined = read_export(tmp_path / "refined.json").entries
    assert [(e.bucket, e.target) for e in refined] == [((2, 16, "float16"), "runtime")]  # the refined entry alone
    assert (
        sum("not copied" in r.getMessage() and "no region of evidence" in r.getMessage() for r in caplog.records)
        == 4  # every start entry, the refined bucket's runtime entry too (replaced)
    )
