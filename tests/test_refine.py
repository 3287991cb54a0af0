"""``fasttree-tune refine`` and :mod:`fasttree.toolkit.refine` on the CPU, with a stand-in timer (no kernel runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

from fasttree import FastTreeConfig
from fasttree.cli import main
from fasttree.export import read_export
from fasttree.toolkit import refine
from fasttree.toolkit.shipped import workloads_path
from fasttree.traces import read_traces

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ROOT / "docs" / "tune" / "export.json"


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    """Two workloads of one bucket (GQA 4): three few-shot and three multi-document serving steps."""
    keep = []
    for name in ("few_shot_mistral_7b", "multi_document_qa_mistral_7b"):
        records = read_traces(workloads_path() / f"{name}.jsonl.gz", kind="workload").records
        keep += records[40:43]
    path = tmp_path_factory.mktemp("wl") / "serving.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return path


def _bowl(calls: list):
    """A stand-in timer with its minimum at pack_tokens 768 and the smallest split size."""

    def timer(rt, q, k, v, out):
        calls.append(rt.config)
        c = rt.config
        return 100.0 + abs(c.pack_tokens - 768) / 10 + c.kv_split_sizes[0] / 100

    return timer


def test_refine_command_writes_the_fastest_config_and_keeps_other_entries(
    tmp_path, workload, monkeypatch, capsys, device
):
    calls: list = []
    monkeypatch.setattr(refine, "graph_timer", _bowl(calls))
    out = tmp_path / "refined.json"
    argv = ["refine", str(workload), "--config", str(EXPORT), "--out", str(out), "--device", device.type,
            "--steps", "2", "--fields", "pack_tokens,kv_split_sizes[0]", "--passes", "3"]  # fmt: skip
    assert main(argv) == 0
    refined, start = read_export(out), read_export(EXPORT)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    (entry,) = [
        e for e in refined.entries if e.gpu == gpu and e.bucket == (4, 128, "float16") and e.target == "runtime"
    ]
    members = entry.portfolio.members
    assert entry.portfolio.runtime and members[0] == FastTreeConfig()
    assert entry.portfolio.selector.member == (len(members) - 1,)  # measured on these trees: every tree like them
    (region,) = entry.portfolio.regions  # the searched trees' box at their heads (32/8)
    assert (region.evidence, region.trees, region.layouts) == ("measured", 4, ((8, 4),))
    assert members[-1].pack_tokens == 768 and members[-1].kv_split_sizes[0] == 256
    prov = entry.provenance
    assert prov["measured_objective"] < 1 and prov["evaluations"] * 4 == len(calls)  # 2 workloads x 2 steps
    assert {m[0] for m in prov["moves"]} == {"pack_tokens", "kv_split_sizes[0]"}  # the start differs by GPU
    assert sorted(prov["measured_start_us"]) == prov["workloads"] and len(prov["workloads"]) == 2
    others = [e.to_dict() for e in refined.entries if e is not entry]
    key = (gpu, *entry.bucket, "runtime")
    assert others == [e.to_dict() for e in start.entries if (e.gpu, *e.bucket, e.target) != key]
    out = capsys.readouterr().out
    assert "| g4-d128-float16 | geomean" in out  # the one bucket label (fasttree.export.bucket_label)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fields", "nope"], "unknown or no fields"),
        (["--min-gain", "1.5"], "--min-gain must be in [0, 1)"),
        (["--device", "tpu"], "--device must be cuda or cpu"),
    ],
)
def test_refine_usage_errors(tmp_path, workload, capsys, device, extra, message):
    argv = [
        "refine",
        str(workload),
        "--config",
        str(EXPORT),
        "--out",
        str(tmp_path / "r.json"),
        "--device",
        device.type,
    ]
    with pytest.raises(SystemExit):
        main([*argv, *extra])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_refine_never_overwrites_and_needs_the_interpreter_on_cpu(tmp_path, workload, capsys, monkeypatch, device):
    out = tmp_path / "mine.json"
    out.write_text("mine")
    with pytest.raises(SystemExit):
        main(["refine", str(workload), "--config", str(EXPORT), "--out", str(out), "--device", device.type])
    assert "exists" in capsys.readouterr().err and out.read_text() == "mine"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        main(["refine", str(workload), "--config", str(EXPORT), "--out", str(tmp_path / "n.json"), "--device", "cpu"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_search_skips_configs_the_gpu_cannot_run_and_stops_without_a_move():
    seen: list = []

    def measure(config):
        seen.append(config)
        if config.kv_tile[1] == 128:
            raise OutOfResources(300000, 232448, "shared memory")
        return {"a": 100.0 + config.kv_tile[1], "b": 50.0}

    coords = {("kv_tile", 1): (32, 64, 128)}
    found = refine.coordinate_search(FastTreeConfig(), measure, coordinates=coords, passes=5, min_gain=0.0)
    assert found.config.kv_tile[1] == 32 and found.moves == [["kv_tile[1]", 32, pytest.approx((132 / 164) ** 0.5)]]
    assert [f[:2] for f in found.failed] == [["kv_tile[1]", 128], ["kv_tile[1]", 128]]
    assert len(seen) == 1 + 2 + 2  # start; pass 0: 32, 128; pass 1: 64, 128 (no move: stop)
    with pytest.raises(ValueError, match="passes"):
        refine.coordinate_search(FastTreeConfig(), measure, passes=0)


def test_search_over_warps_starts_from_the_ratios_default_warps():
    """A default start (num_warps=None) searches warps from the GQA ratio's defaults: MHA's
    small class at 2 warps, so 4 is a move away; without a ratio it cannot know them."""
    seen = []

    def measure(config):
        seen.append(config.num_warps)
        return {"a": 100.0 - config.num_warps[1]}

    coords = {("num_warps", 1): (2, 4)}
    found = refine.coordinate_search(FastTreeConfig(), measure, coordinates=coords, passes=1, group_size=1)
    assert seen == [(4, 2), (4, 4)] and found.config.num_warps == (4, 4)
    with pytest.raises(ValueError, match="group_size"):
        refine.coordinate_search(FastTreeConfig(), measure, coordinates=coords)


def test_search_over_stages_starts_from_the_buckets_default_stages():
    """A default start (num_stages=None) searches stages from the bucket's defaults: the large
    class at 5 for GQA 4 at head dim 128, at 3 for GQA 16; without the bucket it cannot know them."""
    seen = []

    def measure(config):
        seen.append(config.num_stages)
        return {"a": 100.0 + config.num_stages[0]}

    coords = {("num_stages", 0): (3, 5)}
    found = refine.coordinate_search(FastTreeConfig(), measure, coordinates=coords, passes=1, group_size=4,
                                     head_dim=128)  # fmt: skip
    assert seen == [(5, 3), (3, 3)] and found.config.num_stages == (3, 3)
    seen.clear()
    refine.coordinate_search(FastTreeConfig(), measure, coordinates=coords, passes=1, group_size=16, head_dim=128)
    assert seen[0] == (3, 3)
    with pytest.raises(ValueError, match="head_dim"):
        refine.coordinate_search(FastTreeConfig(), measure, coordinates=coords, group_size=4)
