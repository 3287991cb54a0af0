"""``fasttree.toolkit.validate`` on the CPU: the measuring loop with a stand-in for the GPU measurement."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fasttree import FastTreeConfig
from fasttree.cli import main
from fasttree.export import ConfigExport, ExportEntry
from fasttree.toolkit.shipped import workloads_path
from fasttree.toolkit.validate import validate_export, workload_steps
from fasttree.traces import TraceWriter, measurement_record, read_traces

ROOT = Path(__file__).resolve().parents[1]
RECORDS = read_traces(workloads_path(heldout=True) / "few_shot_mistral_7b.jsonl.gz", kind="workload").records
TUNED = FastTreeConfig(num_warps=(4, 2), kv_tile=(64, 32))
ENV = {"gpu_name": "NVIDIA H200", "gpu_sm_count": 132, "compute_capability": "9.0", "memory_clock_mhz": None,
       "driver": None, "torch": "x", "triton": "x", "fasttree": "0.1.0", "git_commit": None}  # fmt: skip


def fake_measure(point, *, device, check, env, tree):
    import fasttree as ft

    plan = ft.plan(tree, point.config, num_q_heads=point.num_q_heads, num_kv_heads=point.num_kv_heads,
                   head_dim=point.head_dim)  # fmt: skip
    us = 100.0 if point.config == FastTreeConfig() else 80.0
    timing = {"graph_us": {"median": us, "p20": us, "p80": us, "replays": 5, "calls_per_graph": 10},
              "eager_us": {"median": us + 5}}  # fmt: skip
    return measurement_record(env=ENV, family=point.family, seed=point.seed, tree=tree, num_q_heads=point.num_q_heads,
                              num_kv_heads=point.num_kv_heads, head_dim=point.head_dim, dtype=point.dtype,
                              config=point.config, plan=plan, status="ok", timing=timing)  # fmt: skip


def export(gpu="NVIDIA H200") -> ConfigExport:
    return ConfigExport(entries=(ExportEntry(gpu=gpu, group_size=4, head_dim=128, dtype="float16", config=TUNED,
                                             provenance={}),), provenance={})  # fmt: skip


def test_workload_steps_are_evenly_spaced():
    steps = workload_steps(RECORDS, 4)
    assert list(steps) == ["serving/few_shot/seed1 32/8"]
    assert [r["workload"]["step"] for r in steps["serving/few_shot/seed1 32/8"]] == [0, 85, 170, 255]
    with pytest.raises(ValueError, match=">= 1"):
        workload_steps(RECORDS, 0)


def test_validate_measures_both_configs_writes_traces_and_predicts(tmp_path):
    seen = []

    def predict(pairs):
        seen.extend(c for _, c in pairs)
        return np.array([110.0 if c == FastTreeConfig() else 80.0 for _, c in pairs])

    with TraceWriter(tmp_path / "v.jsonl") as w:
        (v,) = validate_export(export(), RECORDS, gpu_name="NVIDIA H200", steps_per_workload=3, writer=w,
                               predict=predict, env=ENV, measure=fake_measure)  # fmt: skip
    assert v.speedup == pytest.approx(100 / 80) and not v.tuned_is_default
    assert v.predicted_speedup == pytest.approx(110 / 80)
    assert np.mean(v.abs_errors) == pytest.approx((0.1 + 0.0) / 2)
    assert seen.count(TUNED) == 3 and seen.count(FastTreeConfig()) == 3
    lines = read_traces(tmp_path / "v.jsonl", kind="measurement").records
    assert len(lines) == 6 and {r["meta"]["split"] for r in lines} == {"validate"}
    assert sorted(r["meta"]["config"] for r in lines) == ["default"] * 3 + ["tuned"] * 3


def test_validate_on_another_gpu_falls_back_to_the_defaults():
    (v,) = validate_export(export("NVIDIA H100"), RECORDS, gpu_name="NVIDIA H200", steps_per_workload=2,
                           env=ENV, measure=fake_measure)  # fmt: skip
    assert v.tuned_is_default and v.speedup == 1.0


def test_validate_cli_needs_a_gpu(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "e.json"
    path.write_text(json.dumps(export().to_dict()))
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--config", str(path), "--traces-out", str(tmp_path / "t.jsonl")])
    assert exc.value.code == 2 and "CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()


def test_validate_path_never_imports_optuna():
    code = (
        "import sys; sys.modules['optuna'] = None\n"  # an import of optuna would raise
        "import fasttree.cli, fasttree.toolkit.validate, fasttree.costmodel.features\n"
        "args = fasttree.cli.build_parser().parse_args(['validate', '--config', 'e.json', '--traces-out', 't.jsonl'])\n"
        "assert args.func.__name__ == '_cmd_validate'\n"
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
