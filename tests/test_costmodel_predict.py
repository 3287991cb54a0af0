"""Batched features and prediction (fasttree.costmodel.predict) against the one-plan-at-a-time path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from trees import random_tree

import fasttree as ft
from fasttree.costmodel.dataset import record_plan
from fasttree.costmodel.features import FEATURE_NAMES, features_of_plan, features_of_plans
from fasttree.costmodel.gpu import KNOWN_GPUS, gpu_spec
from fasttree.costmodel.persist import load_model
from fasttree.costmodel.predict import (
    PlanJob,
    PredictPool,
    elem_bytes_of,
    features_of_jobs,
    predict_jobs,
    predict_plans,
)
from fasttree.costmodel.simulator import SimParams, simulate, simulate_batch
from fasttree.costmodel.work import plan_work, plan_work_batch, unique_count
from fasttree.planner import prepare
from fasttree.toolkit.suite import paper_tree
from fasttree.traces import decode_tree, read_traces

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "traces" / "h200_heldout"
WORKLOADS = ROOT / "fasttree" / "toolkit" / "data" / "workloads"
MODEL = ROOT / "costmodel" / "data" / "h200_latency_model.skops"
H200 = KNOWN_GPUS["NVIDIA H200"]
H100 = KNOWN_GPUS["NVIDIA H100 80GB HBM3"]


def reference_unique(values: np.ndarray) -> int:
    """Distinct KV indices as the cost model counted them before unique_count (a table)."""
    return int(np.count_nonzero(np.bincount(values, minlength=1))) if values.size else 0


def reference_rows(plans, gpu, elem_bytes) -> np.ndarray:
    """The straightforward path: plan_work, simulate and features_of_work, one plan at a time."""
    return np.stack([features_of_plan(p, gpu, elem_bytes=e) for p, e in zip(plans, elem_bytes, strict=True)])


@pytest.fixture(scope="module")
def heldout():
    """Every 8th ok held-out measurement: (records, plans)."""
    ts = read_traces(HELDOUT, kind="measurement")
    records = [r for r in ts.records if r["status"] == "ok"][::8]
    return records, [record_plan(r) for r in records]


@pytest.fixture(scope="module")
def workload_plans():
    """Workload trees under three head settings, with and without packing, and a deep MHA tree."""
    ts = read_traces(WORKLOADS, kind="workload")
    trees = [decode_tree(r["workload"]["tree"]) for r in ts.records[::40]]
    plans = []
    for i, tree in enumerate(trees):
        hq, hkv = [(32, 32), (32, 8), (16, 1)][i % 3]
        config = ft.FastTreeConfig(pack_tokens=0) if i % 2 else ft.FastTreeConfig()
        plans.append(ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=128))
    # more programs than 64 rounds of list scheduling on 132 SMs (the rest is spread evenly)
    deep = ft.plan(paper_tree(10), ft.FastTreeConfig(pack_tokens=0), num_q_heads=32, num_kv_heads=32, head_dim=128)
    assert max(plan_work(deep).classes[1].programs, plan_work(deep).classes[0].programs) > 64 * 132
    return [*plans, deep]


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)[0]


# ------------------------------------------------------------------ identity
def test_batched_features_equal_the_reference_path_on_heldout(heldout):
    records, plans = heldout
    gpu = gpu_spec(records[0]["env"])
    eb = [elem_bytes_of(r["dtype"]) for r in records]
    X = features_of_plans(plans, gpu, elem_bytes=eb)
    R = reference_rows(plans, gpu, eb)
    assert X.shape == (len(plans), len(FEATURE_NAMES))
    np.testing.assert_allclose(X, R, rtol=1e-12, atol=0)
    assert np.array_equal(X, R), "the batched path repeats the reference arithmetic operation for operation"
    # unique KV tokens as the table counted them
    col = FEATURE_NAMES.index("unique_kv_tokens")
    assert X[:, col].tolist() == [reference_unique(p.kv_indices) for p in plans]


def test_batched_features_equal_the_reference_path_on_workloads(workload_plans):
    for gpu in (H200, dataclasses.replace(H200, sm_count=66), H100):
        X = features_of_plans(workload_plans, gpu)
        np.testing.assert_allclose(X, reference_rows(workload_plans, gpu, [2] * len(workload_plans)), rtol=1e-12)


def test_batched_features_of_one_plan_and_of_a_batch_agree(workload_plans):
    X = features_of_plans(workload_plans, H200)
    for i in (0, len(workload_plans) // 2, len(workload_plans) - 1):
        np.testing.assert_array_equal(features_of_plans([workload_plans[i]], H200)[0], X[i])


def test_simulate_batch_equals_simulate(workload_plans):
    batch = simulate_batch(plan_work_batch(workload_plans), H200, SimParams())
    for i, plan in enumerate(workload_plans):
        sim = simulate(plan_work(plan), H200, SimParams())
        assert batch.total_us[i] == sim.total_us
        assert tuple(batch.class_us[i]) == sim.class_us
        assert tuple(batch.occupancy[i]) == sim.occupancy
        assert (batch.mem_us[i], batch.tensor_us[i], batch.latency_us[i]) == (sim.mem_us, sim.tensor_us, sim.latency_us)


def test_plan_work_batch_equals_plan_work(workload_plans):
    batch = plan_work_batch(workload_plans, elem_bytes=np.full(len(workload_plans), 2))
    for i, plan in enumerate(workload_plans):
        w = plan_work(plan)
        for c in (0, 1):
            assert {k: int(v[i, c]) for k, v in batch.classes.items()} == {
                k: int(getattr(w.classes[c], k)) for k in batch.classes
            }
            lo, hi = batch.unit_ptr[2 * i + c], batch.unit_ptr[2 * i + c + 1]
            assert np.array_equal(batch.unit_iterations[lo:hi], w.classes[c].prog_iterations)
        assert batch.merge_programs[i] == w.merge.programs and batch.merge_bytes[i] == w.merge.bytes
        assert batch.min_bytes[i] == w.min_bytes and batch.launches[i] == w.launches


@pytest.mark.parametrize("seed", range(6))
def test_unique_count_matches_a_table(seed):
    rng = np.random.default_rng(seed)
    # runs of consecutive values, overlapping and repeated, in any order; and scattered values
    starts = rng.integers(0, 5000, size=int(rng.integers(1, 60)))
    lengths = rng.integers(0, 400, size=starts.size)
    runs = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)] + [np.array([7])])
    for values in (runs, rng.permutation(runs), rng.integers(0, 10**6, size=500), np.array([3, 3, 3])):
        values = values.astype(np.int32)
        assert unique_count(values) == reference_unique(values)
    assert unique_count(np.zeros(0, dtype=np.int32)) == 0


def test_random_trees_with_scattered_slots():
    rng = np.random.default_rng(5)
    plans = []
    for i in range(40):
        tree = random_tree(rng, scatter_slots=bool(i % 2))
        hq, hkv = [(8, 8), (8, 2), (16, 1)][i % 3]
        config = ft.FastTreeConfig(pack_tokens=[0, 64, 1024][i % 3], kv_split_sizes=(256, 32))
        plans.append(ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=64))
    eb = [2] * len(plans)
    np.testing.assert_array_equal(features_of_plans(plans, H200), reference_rows(plans, H200, eb))


# ------------------------------------------------------------------ prediction
def test_predict_plans_equals_one_by_one(heldout, model):
    records, plans = heldout
    gpu = gpu_spec(records[0]["env"])
    eb = [elem_bytes_of(r["dtype"]) for r in records]
    batched = predict_plans(model, plans, gpu, elem_bytes=eb, model_gpu=H200)
    rows = [features_of_plan(p, gpu, elem_bytes=e)[None] for p, e in zip(plans, eb, strict=True)]
    one_by_one = np.array([model.predict(row)[0] for row in rows])
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-12)
    assert batched.shape == (len(plans),) and np.all(batched > 0)


def _jobs(records) -> list[PlanJob]:
    return [
        PlanJob(
            decode_tree(r["workload"]["tree"]),
            ft.FastTreeConfig.from_dict(r["config"]),
            r["num_q_heads"],
            r["num_kv_heads"],
            r["head_dim"],
            r["dtype"],
        )
        for r in records
    ]


def test_predict_jobs_plans_and_predicts(heldout, model):
    records, plans = heldout
    gpu = gpu_spec(records[0]["env"])
    jobs = _jobs(records[:40])
    # today's plans (record_plan gives a record the plan it was measured with, which an older planner made)
    plans = [ft.plan(j.tree, j.config, num_q_heads=j.num_q_heads, num_kv_heads=j.num_kv_heads, head_dim=j.head_dim)
             for j in jobs]  # fmt: skip
    expected = predict_plans(model, plans, gpu, elem_bytes=[elem_bytes_of(r["dtype"]) for r in records[:40]])
    np.testing.assert_array_equal(predict_jobs(model, jobs, gpu), expected)
    np.testing.assert_array_equal(features_of_jobs(jobs, gpu), features_of_plans(plans, gpu))


def test_predict_pool_equals_one_process(heldout, model):
    records, _ = heldout
    gpu = gpu_spec(records[0]["env"])
    jobs = _jobs(records[:30])
    outsider = PlanJob(paper_tree(3), ft.FastTreeConfig(), 32, 8, 128)  # a tree the pool was not given
    jobs.append(outsider)
    with PredictPool([j.tree for j in jobs[:-1]], workers=2) as pool:
        np.testing.assert_array_equal(features_of_jobs(jobs, gpu, pool=pool), features_of_jobs(jobs, gpu))
        np.testing.assert_array_equal(predict_jobs(model, jobs[:3], gpu, pool=pool), predict_jobs(model, jobs[:3], gpu))


def test_prepare_builds_the_index_and_leaves_plans_unchanged(heldout):
    records, _ = heldout
    for r in records[:20]:
        args = (ft.FastTreeConfig.from_dict(r["config"]),)
        heads = {"num_q_heads": r["num_q_heads"], "num_kv_heads": r["num_kv_heads"], "head_dim": r["head_dim"]}
        expected = ft.plan(decode_tree(r["workload"]["tree"]), *args, **heads)  # a fresh tree
        tree = decode_tree(r["workload"]["tree"])
        assert prepare(tree) is tree and tree._planner_index is not None
        got = ft.plan(tree, *args, **heads)
        for name in ("kv_indices", "kv_row_mask", "unit_kv_start", "unit_kv_len", "unit_q_start", "pair_out_row"):
            assert np.array_equal(getattr(got, name), getattr(expected, name))
    with pytest.raises(ValueError, match="KVTree"):
        prepare("not a tree")


# ------------------------------------------------------------------ errors
def test_errors(heldout, model):
    _, plans = heldout
    job = PlanJob(paper_tree(1), ft.FastTreeConfig(), 32, 8, 128)
    with pytest.raises(ValueError, match="no plans"):
        features_of_plans([], H200)
    with pytest.raises(ValueError, match="no plans"):
        predict_plans(model, [], H200)
    with pytest.raises(ValueError, match="no jobs"):
        predict_jobs(model, [], H200)
    with pytest.raises(ValueError, match="fitted for"):
        predict_plans(model, plans[:2], H100, model_gpu=H200)
    with pytest.raises(ValueError, match="fitted for"):
        predict_jobs(model, [job], H100, model_gpu=H200)
    with pytest.raises(ValueError, match="elem_bytes"):
        features_of_plans(plans[:3], H200, elem_bytes=[2, 2])
    with pytest.raises(ValueError, match="dtype"):
        predict_jobs(model, [job._replace(dtype="float32")], H200)
    with pytest.raises(ValueError, match="PlanJob"):
        features_of_jobs([(job.tree, job.config, 32, 8, 128)], H200)
    with pytest.raises(ValueError, match="GpuSpec"):
        features_of_jobs([job], "NVIDIA H200")
    with pytest.raises(ValueError, match="workers"):
        PredictPool([job.tree], workers=0)
    with pytest.raises(ValueError, match="KVTree"):
        PredictPool([None])
