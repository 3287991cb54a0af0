"""The committed workload traces are valid and exactly what the generator writes."""

from __future__ import annotations

import pytest

import fasttree as ft
from fasttree.toolkit import workload_traces
from fasttree.toolkit.shipped import workloads_path
from fasttree.toolkit.workloads import SCENARIOS, TREE_FAMILIES
from fasttree.traces import decode_tree, read_traces

COMMITTED = workloads_path("tuning")
#: The generator's arguments of each shipped split (the commands of fasttree.toolkit.workload_traces).
SPLITS = {
    "tuning": {"families": 16},
    "heldout": {"seed": 1, "paper_suite": False, "families": 8, "family_seed": 1000},
    "test": {"paper_suite": False, "serving": False, "unseen": 6, "unseen_seed": 100},
}


def test_generator_writes_every_scenario_and_model(tmp_path):
    written = workload_traces.write_all(tmp_path, steps=5, seed=3)
    assert written["paper_suite.jsonl.gz"] == 45
    for scenario in SCENARIOS:
        for model, (hq, hkv, d) in workload_traces.MODELS.items():
            records = read_traces(tmp_path / f"{scenario}_{model}.jsonl.gz", kind="workload").records
            assert [r["workload"]["step"] for r in records] == list(range(5))
            assert {(r["num_q_heads"], r["num_kv_heads"], r["head_dim"]) for r in records} == {(hq, hkv, d)}
            assert all(r["workload"]["scenario"] == scenario for r in records)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_shipped_workloads_are_what_the_generator_writes(tmp_path, split):
    workload_traces.write_all(tmp_path, **SPLITS[split])
    names = sorted(p.name for p in tmp_path.iterdir())
    shipped = workloads_path(split)
    assert names == sorted(p.name for p in shipped.glob("*.jsonl.gz"))
    for name in names:
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name
        if split != "tuning" and (COMMITTED / name).exists():
            assert (tmp_path / name).read_bytes() != (COMMITTED / name).read_bytes(), f"{name}: same as tuning"


def test_committed_workloads_plan():
    records = read_traces(COMMITTED, kind="workload").records
    n_models = len(workload_traces.MODELS)
    assert len(records) == 45 + 256 * len(SCENARIOS) * n_models + 16 * len(TREE_FAMILIES) * n_models
    for r in records[::97]:
        tree = decode_tree(r["workload"]["tree"])
        plan = ft.plan(tree, num_q_heads=r["num_q_heads"], num_kv_heads=r["num_kv_heads"], head_dim=r["head_dim"])
        assert plan.n_queries == tree.n_queries
