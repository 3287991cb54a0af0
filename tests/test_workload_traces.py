"""The committed workload traces are valid and exactly what the generator writes."""

from __future__ import annotations

from pathlib import Path

import fasttree as ft
from fasttree.toolkit import workload_traces
from fasttree.toolkit.workloads import SCENARIOS
from fasttree.traces import decode_tree, read_traces

COMMITTED = Path(__file__).resolve().parents[1] / "fasttree" / "toolkit" / "data" / "workloads"


def test_generator_writes_every_scenario_and_model(tmp_path):
    written = workload_traces.write_all(tmp_path, steps=5, seed=3)
    assert written["paper_suite.jsonl.gz"] == 45
    for scenario in SCENARIOS:
        for model, (hq, hkv, d) in workload_traces.MODELS.items():
            records = read_traces(tmp_path / f"{scenario}_{model}.jsonl.gz", kind="workload").records
            assert [r["workload"]["step"] for r in records] == list(range(5))
            assert {(r["num_q_heads"], r["num_kv_heads"], r["head_dim"]) for r in records} == {(hq, hkv, d)}
            assert all(r["workload"]["scenario"] == scenario for r in records)


def test_committed_workload_traces_are_reproducible(tmp_path):
    workload_traces.write_all(tmp_path)  # the defaults the committed files were made with
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(p.name for p in COMMITTED.glob("*.jsonl.gz"))
    for name in names:
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), name


def test_committed_heldout_workloads_are_reproducible_and_differ(tmp_path):
    heldout = COMMITTED.parent / "workloads_heldout"
    workload_traces.write_all(tmp_path, seed=1, paper_suite=False)  # as traces/README.md says
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(p.name for p in heldout.glob("*.jsonl.gz"))
    assert "paper_suite.jsonl.gz" not in names
    for name in names:
        assert (tmp_path / name).read_bytes() == (heldout / name).read_bytes(), name
        assert (tmp_path / name).read_bytes() != (COMMITTED / name).read_bytes(), f"{name}: same as the tuning set"


def test_committed_workloads_plan():
    records = read_traces(COMMITTED, kind="workload").records
    assert len(records) == 45 + 256 * len(SCENARIOS) * len(workload_traces.MODELS)
    for r in records[::97]:
        tree = decode_tree(r["workload"]["tree"])
        plan = ft.plan(tree, num_q_heads=r["num_q_heads"], num_kv_heads=r["num_kv_heads"], head_dim=r["head_dim"])
        assert plan.n_queries == tree.n_queries
