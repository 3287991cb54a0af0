"""Profiler (CPU): the sampled design, the driver with injected fake measurements (resume, budget,
failures, a SIGKILLed run, GPU worker processes), measure_point under the Triton interpreter with
fake timers, the compile-ahead plumbing and the environment helpers."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

import fasttree as ft
import fasttree.toolkit.design as design_module
import fasttree.toolkit.environment as environment
import fasttree.toolkit.measure as measure_module
import fasttree.toolkit.precompile as precompile
import fasttree.toolkit.profile_loop as profile_loop
import fasttree.toolkit.profiler as prof
from fasttree.runtime_planning import plan_for_runtime
from fasttree.toolkit.profiler import (
    HEADS_BY_GQA,
    DesignPoint,
    DeviceLostError,
    design,
    failed_record,
    measure_point,
    point_key,
    point_tree,
    profile,
)
from fasttree.toolkit.workloads import TREE_FAMILIES
from fasttree.traces import TraceWriter, measurement_key, measurement_record, plan_summary, read_traces, validate

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

FAKE_ENV = {
    "gpu_name": "Fake GPU (tests)",
    "gpu_sm_count": 132,
    "compute_capability": "9.0",
    "memory_clock_mhz": 3201,
    "driver": "0.0",
    "torch": torch.__version__,
    "triton": "0.0",
    "fasttree": ft.__version__,
    "git_commit": None,
}
FAKE_TIMING = {
    "graph_us": {"median": 10.0, "p20": 9.5, "p80": 10.5, "replays": 30, "calls_per_graph": 20},
    "eager_us": {"median": 30.0},
}


# ------------------------------------------------------------------ fake measurements (module level: picklable)
def fake_measure(point: DesignPoint, *, device, check, env) -> dict:
    """An instant 'measurement': a valid ok record with made-up timings."""
    return measurement_record(
        env=env,
        family=point.family,
        seed=point.seed,
        tree=point_tree(point),
        num_q_heads=point.num_q_heads,
        num_kv_heads=point.num_kv_heads,
        head_dim=point.head_dim,
        dtype=point.dtype,
        config=point.config,
        plan={"fake": True, "index": point.index},
        timing=FAKE_TIMING,
        correct=True if check else None,
        max_rel_err=0.0 if check else None,
    )


def slow_measure(point: DesignPoint, *, device, check, env) -> dict:
    time.sleep(0.05)
    return fake_measure(point, device=device, check=check, env=env)


def flaky_measure(point: DesignPoint, *, device, check, env) -> dict:
    """Raises for index % 3 == 1, returns a failed record for index % 3 == 2, else ok."""
    if point.index % 3 == 1:
        raise RuntimeError(f"boom at {point.index}")
    if point.index % 3 == 2:
        return failed_record(point, env, "OutOfResources: shared memory (fake)")
    return fake_measure(point, device=device, check=check, env=env)


def nan_measure(point: DesignPoint, *, device, check, env) -> dict:
    rec = fake_measure(point, device=device, check=check, env=env)
    if point.index == 3:
        rec["timing"]["graph_us"]["median"] = float("nan")
    return rec


def run(out, n, *, measure=fake_measure, **kw):
    kw.setdefault("seed", 7)
    kw.setdefault("precompile", False)
    kw.setdefault("progress", False)
    return profile(out, n=n, env=FAKE_ENV, measure=measure, **kw)


def keys_of(path) -> list[str]:
    return [r["key"] for r in read_traces(path, kind="measurement")]


def design_keys(n, seed=7, **kw) -> set[str]:
    return {point_key(p, FAKE_ENV["gpu_name"]) for p in design(n, seed, **kw)}


# ------------------------------------------------------------------ design
def test_design_is_deterministic_and_a_prefix_of_one_sequence():
    a = design(300, 3)
    assert a == design(300, 3)
    assert design(90, 3) == a[:90], "a shorter design must be the prefix of a longer one (runs extend)"
    assert design(300, 4) != a
    assert [p.index for p in a] == list(range(300))
    assert all(p.design_seed == 3 for p in a)
    assert len({(p.family, p.seed, p.config) for p in a}) == 300
    assert design(0, 3) == []
    assert len(design(3, 3)) == 3


def test_each_tree_is_measured_under_the_defaults_then_distinct_sampled_configs():
    pts = design(100, 0)
    trees = collections.defaultdict(list)
    for p in pts:
        trees[p.tree_index].append(p)
    assert sorted(trees) == list(range(len(trees))) and len(trees) == math.ceil(100 / prof.CONFIGS_PER_TREE)
    for t, group in trees.items():
        assert [p.index for p in group] == list(range(group[0].index, group[0].index + len(group)))
        same = {(p.family, p.seed, p.params, p.num_q_heads, p.num_kv_heads, p.head_dim, p.dtype) for p in group}
        assert len(same) == 1, f"tree {t}: its configs must share the workload"
        assert group[0].default_config and group[0].config == ft.FastTreeConfig()
        rest = group[1:]
        assert not any(p.default_config or p.config == ft.FastTreeConfig() for p in rest)
        assert len({p.config for p in rest}) == len(rest)
        assert len(group) == prof.CONFIGS_PER_TREE or t == len(trees) - 1
    assert len({(p.family, p.seed) for p in pts if p.default_config}) == len(trees)
    assert {p.family for p in pts} == set(TREE_FAMILIES)
    three = design(9, 0, configs_per_tree=3)
    assert [p.tree_index for p in three] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_kernel_settings_come_from_a_bounded_pool_per_gqa_ratio():
    pts = [p for p in design(3000, 4, kernel_pool=12) if not p.default_config]
    for g in (1, 4, 16):
        kernels = {
            (p.config.q_tile_queries, p.config.kv_tile, p.config.num_warps, p.config.num_stages)
            for p in pts
            if p.gqa == g
        }
        assert 6 <= len(kernels) <= 12, (g, len(kernels))
    other = {(p.config.kv_tile, p.config.num_warps) for p in design(400, 5, kernel_pool=12) if not p.default_config}
    assert other != {(p.config.kv_tile, p.config.num_warps) for p in pts[:400]}, "another seed, another pool"
    planner = {(p.config.alpha, p.config.gamma, p.config.para_threshs1) for p in pts}
    assert len(planner) == len(pts), "the planner's knobs are sampled per point, not pooled"


@pytest.mark.parametrize("sm_count", [132, 78])
def test_every_design_point_is_a_valid_config_within_the_search_space(sm_count):
    allowed_heads = {pair for pairs in HEADS_BY_GQA.values() for pair in pairs}
    for p in design(1500, 11, sm_count=sm_count):
        cfg = p.config
        assert ft.FastTreeConfig.from_dict(cfg.to_dict()) == cfg
        g = p.gqa
        assert (p.num_q_heads, p.num_kv_heads) in allowed_heads and 8 <= p.num_q_heads <= 64
        assert p.head_dim in (64, 128, 256) and p.dtype in ("float16", "bfloat16")
        assert p.family in TREE_FAMILIES and 0 <= p.seed < prof.SEED_SPACE
        tiles = cfg.query_tiles(g)  # raises past 256 rows
        assert max(tiles) * g <= 256
        if p.default_config:
            continue
        large, small = cfg.q_tile_queries
        assert large >= small >= 1
        assert large in {max(1, r // g) for r in prof.Q_ROWS_LARGE}
        assert small in {max(1, r // g) for r in prof.Q_ROWS_SMALL}
        assert set(cfg.kv_tile) <= set(prof.KV_TILES)
        assert cfg.kv_split_sizes[0] in prof.SPLITS_LARGE and cfg.kv_split_sizes[1] in prof.SPLITS_SMALL
        for t in (*cfg.para_threshs1, *cfg.para_threshs2):
            assert 0 <= t <= 4 * sm_count
        assert 0.1 <= cfg.alpha <= 2 and 0.05 <= cfg.beta <= 1 and -1 <= cfg.gamma <= 2
        assert set(cfg.num_warps) <= {2, 4, 8} and set(cfg.num_stages) <= {1, 2, 3, 4}
        assert cfg.pack_tokens in prof.PACK_TOKENS and 0 <= cfg.pack_min_units <= 4 * sm_count
    thresholds = [t for p in design(1500, 11, sm_count=sm_count) for t in p.config.para_threshs1]
    assert max(thresholds) > 3 * sm_count, "thresholds should span up to 4x the SM count"


def test_design_covers_families_heads_dims_dtypes_and_knobs():
    pts = [p for p in design(2000, 1) if not p.default_config]
    n = len(pts)
    fam = collections.Counter(p.family for p in pts)
    assert set(fam) == set(TREE_FAMILIES)
    heavy = min(fam["paper_random"], fam["random_recursive"])
    light = max(c for f, c in fam.items() if f not in ("paper_random", "random_recursive"))
    assert heavy > light, f"paper_random and random_recursive should be sampled more: {fam}"
    gqa = collections.Counter(p.gqa for p in pts)
    assert set(gqa) == {1, 4, 16} and min(gqa.values()) > 0.25 * n  # GQA 8 is held out
    dims = collections.Counter(p.head_dim for p in pts)
    assert set(dims) == {64, 128} and 0.12 * n < dims[64] < 0.24 * n  # 256 is held out
    dtypes = collections.Counter(p.dtype for p in pts)
    assert 0.4 * n < dtypes["float16"] < 0.6 * n
    assert {w for p in pts for w in p.config.num_warps} == {2, 4, 8}
    assert {s for p in pts for s in p.config.num_stages} == {1, 2, 3, 4}
    assert {t for p in pts for t in p.config.kv_tile} == set(prof.KV_TILES)
    assert {p.config.kv_split_sizes[0] for p in pts} == set(prof.SPLITS_LARGE)
    assert {p.config.kv_split_sizes[1] for p in pts} == set(prof.SPLITS_SMALL)
    assert {p.config.pack_tokens for p in pts} == set(prof.PACK_TOKENS)
    mha_rows = {p.config.q_tile_queries[0] for p in pts if p.gqa == 1}
    assert mha_rows == set(prof.Q_ROWS_LARGE)
    gammas = np.array([p.config.gamma for p in pts])
    assert gammas.min() < -0.9 and gammas.max() > 1.9 and (gammas < 0).mean() > 0.25


def test_heldout_design_holds_only_what_training_never_samples():
    train = design(3000, 2)
    held = design(600, 2, split="heldout")
    assert all(p.split == "train" for p in train) and all(p.split == "heldout" for p in held)
    assert all(p.config == ft.FastTreeConfig() for p in held if p.default_config)
    assert sum(p.default_config for p in held) == len({p.tree_index for p in held})
    for p in train:
        assert p.gqa != prof.HELDOUT_GQA and p.head_dim != prof.HELDOUT_HEAD_DIM and p.params == ()
    axes = collections.Counter()
    for p in held:
        deep = bool(p.params)
        hits = (p.gqa == prof.HELDOUT_GQA) + (p.head_dim == prof.HELDOUT_HEAD_DIM) + deep
        assert hits == 1, p.describe()  # exactly one held-out axis
        if deep:
            ((knob, value),) = p.params
            name, lo, hi = prof.DEEP_TREES[p.family]
            assert knob == name and lo <= value <= hi
            tree = prof.point_tree(p)
            assert tree.n_queries >= 1
        axes[("gqa8", "head_dim_256", "deep")[[p.gqa == 8, p.head_dim == 256, deep].index(True)]] += 1
    assert min(axes.values()) > 0.25 * len(held), axes
    # paper_random's held-out levels make deeper trees than any training one (beam search and
    # speculative trees are compressed, so their held-out knob shows in lengths and widths instead)
    train_depth = max(int(prof.point_tree(p).depth.max()) for p in train[:600] if p.family == "paper_random")
    held_depth = [int(prof.point_tree(p).depth.max()) for p in held if p.params and p.family == "paper_random"]
    assert held_depth and min(held_depth) > train_depth
    assert design(100, 2, split="heldout") == held[:100]


def test_heldout_design_without_deep_families_uses_two_axes():
    held = design(200, 0, split="heldout", families=["few_shot"])
    assert {p.family for p in held} == {"few_shot"}
    assert all((p.gqa == 8) != (p.head_dim == 256) for p in held)


def test_design_rejects_an_unknown_split():
    with pytest.raises(ValueError, match="split must be one of"):
        design(4, 0, split="test")


def test_design_restricted_to_families():
    pts = design(60, 2, families=["beam_search", "no_sharing"])
    assert {p.family for p in pts} == {"beam_search", "no_sharing"}
    assert design(60, 2, families=["no_sharing", "beam_search"]) == pts  # order of the list does not matter


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": -1},
        {"n": 1.5},
        {"n": 5, "seed": -2},
        {"n": 5, "sm_count": 0},
        {"n": 5, "families": ["nope"]},
        {"n": 5, "families": []},
        {"n": 5, "configs_per_tree": 0},
        {"n": 5, "kernel_pool": 0},
    ],
)
def test_design_rejects_bad_arguments(kwargs):
    n = kwargs.pop("n")
    with pytest.raises(ValueError):
        design(n, **kwargs)


def test_invalid_combinations_are_skipped_deterministically(monkeypatch):
    # 512 rows can never fit in a tile (> 256 for every GQA ratio); 64 small rows exceed 32 large rows
    monkeypatch.setattr(design_module, "Q_ROWS_LARGE", (32, 128, 512))
    monkeypatch.setattr(design_module, "Q_ROWS_SMALL", (8, 64))
    pts = design(400, 5)
    assert pts == design(400, 5)
    assert len(pts) == 400 and [p.index for p in pts] == list(range(400))
    for p in pts:
        if p.default_config:
            continue
        large, small = p.config.q_tile_queries
        assert large * p.gqa <= 256 and large >= small
    assert {p.config.q_tile_queries[0] for p in pts if p.gqa == 1 and not p.default_config} == {32, 128}


def test_a_search_space_without_valid_points_raises(monkeypatch):
    monkeypatch.setattr(design_module, "Q_ROWS_LARGE", (1024,))
    with pytest.raises(ValueError, match="no valid point"):
        design(20, 0)


def test_point_key_is_the_measurement_key():
    p = design(9, 0)[8]
    tree = point_tree(p)
    expected = measurement_key(
        tree,
        family=p.family,
        seed=p.seed,
        num_q_heads=p.num_q_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        dtype=p.dtype,
        config=p.config,
        gpu_name="NVIDIA H200",
    )
    assert point_key(p, "NVIDIA H200") == expected == point_key(p, "NVIDIA H200", tree=tree)
    assert point_key(p, "NVIDIA H100") != expected
    assert fake_measure(p, device="cpu", check=False, env=FAKE_ENV)["key"] == point_key(p, FAKE_ENV["gpu_name"])


# ------------------------------------------------------------------ driver
def test_profile_writes_valid_records_with_run_metadata(tmp_path):
    out = tmp_path / "t.jsonl"
    s = run(out, 25, check_every=10)
    assert (s.measured, s.failed, s.skipped, s.not_started, s.points) == (25, 0, 0, 0, 25)
    ts = read_traces(out)  # strict: raises on any bad line
    assert len(ts) == 25
    assert set(keys_of(out)) == design_keys(25)
    metas = [r["meta"]["profiler"] for r in ts]
    assert len({m["run_id"] for m in metas}) == 1
    assert [m["design_index"] for m in metas] == list(range(25))
    assert all(m["design_seed"] == 7 for m in metas)
    assert [m["default_config"] for m in metas] == [i % prof.CONFIGS_PER_TREE == 0 for i in range(25)]
    checked = [m["design_index"] for m in metas if m["checked"]]
    assert checked == [0, 10, 20]
    assert [r["correct"] for r in ts if r["meta"]["profiler"]["checked"]] == [True] * 3
    assert s.points_per_minute > 0


def test_repeat_measurements_are_extra_lines_of_earlier_keys(tmp_path):
    out = tmp_path / "t.jsonl"
    s = run(out, 30, repeat_every=10)
    recs = read_traces(out).records
    repeats = [r for r in recs if r["meta"]["profiler"].get("repeat")]
    assert (s.measured, s.repeats, len(recs)) == (30, 3, 33)
    firsts = [r for r in recs if not r["meta"]["profiler"].get("repeat")]
    assert [r["meta"]["profiler"]["design_index"] for r in firsts] == list(range(30))
    # after the 10th, 20th and 30th point: the point measured 5 before
    assert [r["meta"]["profiler"]["design_index"] for r in repeats] == [4, 14, 24]
    assert all(r["key"] == firsts[r["meta"]["profiler"]["design_index"]]["key"] for r in repeats)
    assert recs[10]["meta"]["profiler"].get("repeat") and not recs[10]["meta"]["profiler"]["checked"]
    from fasttree.toolkit.trace_stats import trace_stats

    stats = trace_stats(read_traces(out))
    assert stats.repeat_lines == 3 and stats.repeated_keys == 3 and stats.lines == 30
    s = run(out, 40, repeat_every=10)  # resume: repeats of the new points only
    assert (s.skipped, s.measured, s.repeats) == (30, 10, 1)
    with pytest.raises(ValueError, match="repeat_every"):
        run(out, 5, repeat_every=-1)


def test_resume_skips_measured_points_and_a_larger_n_adds_only_new_ones(tmp_path):
    out = tmp_path / "t.jsonl"
    run(out, 20)
    before = out.read_bytes()
    s = run(out, 20)
    assert (s.measured, s.skipped) == (0, 20)
    assert out.read_bytes() == before, "a rerun of a finished design must add nothing"
    s = run(out, 32)
    assert (s.measured, s.skipped) == (12, 20)
    keys = keys_of(out)
    assert len(keys) == len(set(keys)) == 32
    assert set(keys) == design_keys(32)
    # another seed is another design: all new points
    s = run(out, 10, seed=8)
    assert s.skipped == 0 and s.measured == 10
    assert len(set(keys_of(out))) == 42


def test_budget_stops_starting_new_points(tmp_path):
    out = tmp_path / "t.jsonl"
    t0 = time.monotonic()
    s = run(out, 200, measure=slow_measure, budget_s=0.6)
    took = time.monotonic() - t0
    assert s.stopped_by_budget
    assert 1 <= s.measured < 40
    assert s.not_started == 200 - s.measured
    assert len(keys_of(out)) == s.measured
    assert took < 5, f"the budget of 0.6 s was overrun: {took:.1f} s"
    # resuming with a budget continues where the first run stopped
    s2 = run(out, 200, measure=slow_measure, budget_s=0.6)
    assert s2.skipped == s.measured and s2.measured >= 1
    keys = keys_of(out)
    assert len(keys) == len(set(keys)) == s.measured + s2.measured


def test_failures_are_recorded_and_the_run_goes_on(tmp_path):
    out = tmp_path / "t.jsonl"
    s = run(out, 30, measure=flaky_measure)
    assert (s.measured, s.failed, s.not_started) == (10, 20, 0)
    recs = {r["meta"]["profiler"]["design_index"]: r for r in read_traces(out)}
    assert sorted(recs) == list(range(30))
    for i, r in recs.items():
        if i % 3 == 0:
            assert r["status"] == "ok" and r["timing"] is not None
        else:
            assert r["status"] == "failed" and r["timing"] is None and r["plan"] is None
            assert r["meta"]["profiler"]["kernel_version"] == ft.versions.KERNEL_VERSION  # the latency model reads it
            assert r["error"] == (
                f"RuntimeError: boom at {i}" if i % 3 == 1 else "OutOfResources: shared memory (fake)"
            )
    # failed points count as measured: a rerun does not retry them
    s = run(out, 30, measure=fake_measure)
    assert (s.measured, s.skipped) == (0, 30)


def test_an_invalid_record_is_written_as_failed(tmp_path):
    out = tmp_path / "t.jsonl"
    s = run(out, 6, measure=nan_measure)
    assert (s.measured, s.failed) == (5, 1)
    bad = [r for r in read_traces(out) if r["status"] == "failed"]
    assert len(bad) == 1 and bad[0]["meta"]["profiler"]["design_index"] == 3
    assert bad[0]["error"].startswith("InvalidRecord:") and "finite" in bad[0]["error"]


def test_a_measure_with_another_gpu_name_is_refused(tmp_path):
    def other_gpu(point, *, device, check, env):
        return fake_measure(point, device=device, check=check, env={**env, "gpu_name": "Other GPU"})

    with pytest.raises(ValueError, match="key"):
        run(tmp_path / "t.jsonl", 3, measure=other_gpu)


def test_a_lost_device_writes_the_point_and_stops(tmp_path):
    def lost(point, *, device, check, env):
        if point.index == 4:
            raise DeviceLostError("the GPU is unusable (fake)", failed_record(point, env, "CUDA error: fake"))
        return fake_measure(point, device=device, check=check, env=env)

    out = tmp_path / "t.jsonl"
    s = run(out, 10, measure=lost)
    assert s.aborted and "unusable" in s.aborted
    assert (s.measured, s.failed, s.not_started) == (4, 1, 5)
    recs = read_traces(out).records
    assert recs[-1]["status"] == "failed" and recs[-1]["error"] == "CUDA error: fake"
    s = run(out, 10)  # resumes after it
    assert (s.skipped, s.measured) == (5, 5)


def test_profile_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"\.jsonl"):
        run(tmp_path / "t.jsonl.gz", 3)
    for bad in (0, -1.0, "10s", True):
        with pytest.raises(ValueError, match="budget_s"):
            run(tmp_path / "t.jsonl", 3, budget_s=bad)
    with pytest.raises(ValueError, match="unknown tree families"):
        run(tmp_path / "t.jsonl", 3, families=["trees"])
    with pytest.raises(ValueError, match="check_every"):
        run(tmp_path / "t.jsonl", 3, check_every=-1)


def test_profile_without_env_needs_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        profile(tmp_path / "t.jsonl", n=3, measure=fake_measure, precompile=False, progress=False)
    assert not (tmp_path / "t.jsonl").exists()


def test_families_option_restricts_what_is_measured(tmp_path):
    out = tmp_path / "t.jsonl"
    run(out, 12, families=["speculative"])
    assert {r["workload"]["family"] for r in read_traces(out)} == {"speculative"}


def test_progress_falls_back_to_the_log_without_tqdm(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    monkeypatch.setitem(sys.modules, "tqdm.contrib.logging", None)
    caplog.set_level("INFO", logger="fasttree")
    s = run(tmp_path / "t.jsonl", 8, progress=True)
    assert s.measured == 8
    assert "tqdm is not installed" in caplog.text
    assert "8/8 points (0 failed)" in caplog.text
    assert "8 measured, 0 failed, 0 skipped" in caplog.text


def test_progress_bar_with_tqdm(tmp_path, capsys):
    run(tmp_path / "t.jsonl", 8, progress=True)
    err = capsys.readouterr().err
    assert "8/8" in err and "pt" in err


def test_sigkilled_run_then_resume_leaves_whole_lines_and_no_duplicates(tmp_path):
    out = tmp_path / "t.jsonl"
    n = 400
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from test_profiler import FAKE_ENV, slow_measure
        from fasttree.toolkit.profiler import profile
        profile({str(out)!r}, n={n}, seed=7, env=FAKE_ENV, measure=slow_measure, precompile=False, progress=False)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 8:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the profiler ended early: {proc.stderr.read().decode()[-2000:]}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    data = out.read_bytes()
    assert data.endswith(b"\n")
    first = read_traces(out)  # every line valid (strict)
    assert 8 <= len(first) < n
    s = run(out, n)
    assert s.skipped == len(first) and s.measured == n - len(first)
    keys = keys_of(out)
    assert len(keys) == len(set(keys)) == n
    assert set(keys) == design_keys(n)
    assert not out.with_name(out.name + ".torn").exists()


def test_gpu_worker_processes_split_the_points_and_share_the_file(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    s = run(out, 24, gpus=2)
    assert s.gpus == 2
    assert (s.measured, s.failed, s.skipped, s.points) == (24, 0, 0, 24)
    recs = read_traces(out).records
    assert {r["key"] for r in recs} == design_keys(24) and len(recs) == 24
    by_worker = collections.defaultdict(set)
    for r in recs:
        m = r["meta"]["profiler"]
        by_worker[m["gpu_worker"]].add(m["design_index"])
    # worker i measures every 2nd tree from i, each with all its configs
    assert by_worker == {0: {*range(0, 8), *range(16, 24)}, 1: set(range(8, 16))}
    capsys.readouterr()
    s = run(out, 30, gpus=2, progress=True)
    assert (s.measured, s.skipped) == (6, 24)
    assert len(set(keys_of(out))) == 30
    assert "6/6" in capsys.readouterr().err, "one progress bar over both workers' points"


# ------------------------------------------------------------------ measure_point on the CPU (interpreter)
SMALL_TREE = ft.KVTree.from_lengths([-1, 0, 0, 1], [40, 20, 24, 9], [1, 2, 3, 3, 2])


def small_point(**changes) -> DesignPoint:
    fields = dict(
        index=0,
        family="random_recursive",
        seed=3,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype="float16",
        config=ft.FastTreeConfig(kv_tile=(16, 16), kv_split_sizes=(32, 16)),
    )
    fields.update(changes)
    return DesignPoint(**fields)


@pytest.fixture
def cpu_measure(monkeypatch):
    """measure_point with a small tree and timers that call once (the Triton interpreter on the CPU)."""
    calls = []

    def graph_time_us(fn, **kw):
        fn()
        calls.append("graph")
        return {"median": 11.0, "p20": 10.0, "p80": 12.0, "replays": 5, "calls_per_graph": 20}

    def eager_time_us(fn, **kw):
        fn()
        calls.append("eager")
        return 33.0

    monkeypatch.setattr(design_module, "point_tree", lambda point: SMALL_TREE)
    monkeypatch.setattr(measure_module, "point_tree", lambda point: SMALL_TREE)
    monkeypatch.setattr("fasttree.toolkit.timing.graph_time_us", graph_time_us)
    monkeypatch.setattr("fasttree.toolkit.timing.eager_time_us", eager_time_us)
    return calls


def test_measure_point_records_timings_plan_and_check(cpu_measure, tmp_path, device):
    p = small_point()
    rec = measure_point(p, device=device, check=True, env=FAKE_ENV)
    assert validate(rec) == []
    assert rec["status"] == "ok" and rec["error"] is None
    assert rec["correct"] is True and 0 <= rec["max_rel_err"] < 2e-3
    assert rec["timing"] == {
        "graph_us": {"median": 11.0, "p20": 10.0, "p80": 12.0, "replays": 5, "calls_per_graph": 20},
        "eager_us": {"median": 33.0},
    }
    assert rec["plan"]["units"] and rec["plan"]["kv_tokens_read"] > 0
    assert rec["meta"]["profiler"]["stage1_overlap"] is True  # the latency model's stage1_overlap reads it
    assert rec["meta"]["profiler"]["kernel_version"] == ft.versions.KERNEL_VERSION  # and its kernel_version
    assert rec["key"] == measurement_key(
        SMALL_TREE,
        family=p.family,
        seed=p.seed,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype="float16",
        config=p.config,
        gpu_name=FAKE_ENV["gpu_name"],
    )
    assert rec["meta"]["profiler"]["wall_s"] > 0
    assert cpu_measure == ["graph", "eager"]
    unchecked = measure_point(small_point(dtype="bfloat16"), device=device, check=False, env=FAKE_ENV)
    assert unchecked["status"] == "ok" and unchecked["correct"] is None and unchecked["max_rel_err"] is None
    with TraceWriter(tmp_path / "t.jsonl") as w:
        w.append(rec)
        w.append(unchecked)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])  # one fused stage-1 launch (GQA), two (MHA at D <= 128)
def test_measure_point_times_the_runtime_and_keys_its_launch(cpu_measure, device, heads):
    p = small_point(runtime=True, num_q_heads=heads[0], num_kv_heads=heads[1])
    rec = measure_point(p, device=device, check=True, env=FAKE_ENV)
    assert validate(rec) == [] and rec["status"] == "ok" and rec["correct"] is True, rec.get("error")
    launches = 1 if heads[0] != heads[1] else 2
    assert rec["launch"] == {"kind": "runtime", "stage1_launches": launches, "query_centric": "auto"}
    assert rec["key"] == point_key(p, FAKE_ENV["gpu_name"]) != point_key(small_point(), FAKE_ENV["gpu_name"])
    info = rec["meta"]["profiler"]
    assert info["stage1_overlap"] is (launches == 1) and len(info["runtime_programs"]) == launches
    # the summary is the runtime's own plan of the tree (here: no wide units, solo units with two launches)
    plan, _ = plan_for_runtime(SMALL_TREE, p.config, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                               stage1_launches=launches)  # fmt: skip
    assert rec["plan"] == plan_summary(plan)
    assert cpu_measure == ["graph", "eager"]


def test_measure_point_times_the_runtime_as_served_with_its_launch_variants(cpu_measure, device, monkeypatch):
    import fasttree.toolkit.measure as measure_module

    built = []
    real = measure_module.runtime_for

    def spy(point, tree, plan, dev):
        rt = real(point, tree, plan, dev)
        built.append(rt.variants.max_variants)
        return rt

    monkeypatch.setattr(measure_module, "runtime_for", spy)
    fixed, served = small_point(runtime=True), small_point(runtime=True, variants=True)
    a = measure_point(fixed, device=device, check=True, env=FAKE_ENV)
    b = measure_point(served, device=device, check=True, env=FAKE_ENV)
    assert a["status"] == b["status"] == "ok" and a["correct"] is b["correct"] is True, b.get("error")
    assert built[0] == 0 and built[1] > 0  # the fixed launch, then the launch variants
    assert a["launch"]["kind"] == "runtime" and b["launch"]["kind"] == "runtime_variants"
    assert b["key"] == point_key(served, FAKE_ENV["gpu_name"]) != a["key"]


def test_measure_point_records_the_tree_parameters_of_a_deep_point(cpu_measure, device):
    p = dataclasses.replace(small_point(), params=(("levels", 11),), split="heldout")
    ok = measure_point(p, device=device, check=False, env=FAKE_ENV)
    assert validate(ok) == [] and ok["workload"]["params"] == {"levels": 11}
    failed = failed_record(p, FAKE_ENV, "OutOfResources: fake")
    assert failed["workload"]["params"] == {"levels": 11}


def test_heldout_run_marks_every_line(tmp_path):
    out = tmp_path / "heldout.jsonl"
    run(out, 12, split="heldout", measure=flaky_measure)
    recs = list(read_traces(out, kind="measurement"))
    assert len(recs) == 12
    assert {r["meta"]["split"] for r in recs} == {"heldout"}
    train = tmp_path / "train.jsonl"
    run(train, 4)
    assert {r["meta"]["split"] for r in read_traces(train, kind="measurement")} == {"train"}


def test_measure_point_turns_a_planning_error_into_a_failed_record(cpu_measure, device):
    # 64 queries x GQA 16 = 1024 rows > 256: plan() refuses the config
    p = small_point(num_q_heads=16, num_kv_heads=1, config=ft.FastTreeConfig(q_tile_queries=(64, 16)))
    rec = measure_point(p, device=device, check=True, env=FAKE_ENV)
    assert validate(rec) == []
    assert rec["status"] == "failed" and rec["plan"] is None and rec["timing"] is None
    assert rec["error"].startswith("PlanError: ValueError:") and "256" in rec["error"]
    assert cpu_measure == []


def test_measure_point_turns_a_wrong_result_into_a_failed_record(cpu_measure, monkeypatch, device):
    real = ft.tree_attention

    def wrong(q, k, v, plan, **kw):
        out = real(q, k, v, plan, **kw)
        out[0] += 1.0
        return out

    monkeypatch.setattr(ft, "tree_attention", wrong)
    rec = measure_point(small_point(), device=device, check=True, env=FAKE_ENV)
    assert validate(rec) == []
    assert rec["status"] == "failed" and rec["correct"] is False and rec["max_rel_err"] > 0.1
    assert rec["error"].startswith("WrongResult: max relative error")
    assert rec["timing"] is None and rec["plan"] is not None
    assert cpu_measure == [], "a wrong result is not timed"


def test_measure_point_turns_a_kernel_error_into_a_failed_record(cpu_measure, monkeypatch, device):
    def broken(fn, **kw):
        raise RuntimeError("PassManager::run failed (fake compile error)")

    monkeypatch.setattr("fasttree.toolkit.timing.graph_time_us", broken)
    monkeypatch.setattr(measure_module, "_device_healthy", lambda device: True)
    rec = measure_point(small_point(), device=device, check=False, env=FAKE_ENV)
    assert validate(rec) == []
    assert rec["status"] == "failed" and rec["error"] == "RuntimeError: PassManager::run failed (fake compile error)"
    assert rec["plan"] is not None and rec["timing"] is None
    # the same error leaving the device unusable: the record travels with DeviceLostError
    monkeypatch.setattr(measure_module, "_device_healthy", lambda device: False)
    with pytest.raises(DeviceLostError) as info:
        measure_point(small_point(), device=device, check=False, env=FAKE_ENV)
    assert info.value.record["status"] == "failed" and "fake compile error" in info.value.record["error"]


def test_failed_record_needs_an_error():
    with pytest.raises(ValueError):
        failed_record(small_point(), FAKE_ENV, "")


# ------------------------------------------------------------------ compile ahead, environment
def test_record_compiles_hook_records_and_skips_then_restores():
    import triton

    knobs = triton.knobs.runtime
    before = knobs.jit_cache_hook
    found: dict = {}
    with precompile._record_compiles(found):
        hook = knobs.jit_cache_hook
        skip = hook(
            key="k",
            repr="r",
            fn=types.SimpleNamespace(module="fasttree.kernels.tree_attention", name="tree_attention_units_kernel"),
            compile={"specialization_data": '{"x": 1}'},
            is_manual_warmup=False,
            already_compiled=False,
        )
        assert skip is True, "the hook must tell Triton to skip compiling (and launching)"
    assert found == {'{"x": 1}': ("fasttree.kernels.tree_attention", "tree_attention_units_kernel")}
    assert knobs.jit_cache_hook is before


def test_compile_pool_reports_failures_and_respects_the_deadline():
    c = precompile.CompilePool(1)
    try:
        c.compile({"{}": ("no_such_module_for_fasttree_tests", "kernel")}, deadline=None)
        assert (c.compiled, c.failed) == (0, 1)
        t0 = time.monotonic()
        c.compile({'{"a": 1}': ("os", "no_such_function")}, deadline=time.monotonic() - 1)
        assert time.monotonic() - t0 < 5, "an expired deadline must not wait for the workers"
        assert c.compiled == 0 and c.failed in (1, 2)
        assert c.submit({"{}": ("no_such_module_for_fasttree_tests", "kernel")}) == {}, "submitted once only"
    finally:
        c.close()
    error, seconds = precompile._compile_worker("os", "getcwd", "{}")  # os.getcwd has no preload: a clean error
    assert error.startswith("AttributeError") and seconds >= 0


class FakeCompiler:
    """Stands in for the pool of compile workers; logs what the driver asks of it."""

    events: ClassVar[list] = []

    def __init__(self, workers):
        self.events.append(("init", workers))
        self.compiled = self.failed = 0
        self.seconds = 0.5

    def submit(self, specs):
        self.events.append(("compile", sorted(specs)))
        self.compiled += len(specs)
        return sorted(specs)

    def wait(self, submitted, deadline):
        self.events.append(("wait", submitted))

    def close(self):
        self.events.append(("close",))


@pytest.fixture
def fake_compiler(monkeypatch):
    FakeCompiler.events = events = []
    monkeypatch.setattr(profile_loop, "CompilePool", FakeCompiler)
    monkeypatch.setattr(profile_loop, "cuda_device", lambda device: True)

    def measure(point, **kw):
        events.append(("measure", point.index))
        return fake_measure(point, **kw)

    return events, measure


def test_each_batch_is_compiled_ahead_before_it_is_measured(tmp_path, monkeypatch, fake_compiler):
    events, measure = fake_compiler
    monkeypatch.setattr(
        profile_loop, "kernel_specialisations", lambda batch, device: {f"s{p.index}": ("m", "k") for p in batch}
    )
    s = run(tmp_path / "t.jsonl", 10, precompile=True, batch_size=4, compile_workers=3, measure=measure)
    # batch k+1's kernels are queued before batch k is measured, and waited for before it is measured
    assert events == [
        ("init", 3),
        ("compile", ["s0", "s1", "s2", "s3"]),
        ("wait", ["s0", "s1", "s2", "s3"]),
        ("compile", ["s4", "s5", "s6", "s7"]),
        *[("measure", i) for i in range(4)],
        ("wait", ["s4", "s5", "s6", "s7"]),
        ("compile", ["s8", "s9"]),
        *[("measure", i) for i in range(4, 8)],
        ("wait", ["s8", "s9"]),
        ("measure", 8),
        ("measure", 9),
        ("close",),
    ]
    assert (s.measured, s.precompiled, s.precompile_s) == (10, 10, 0.5)
    events.clear()
    run(tmp_path / "t.jsonl", 10, precompile=True, measure=measure)
    assert events == [], "nothing left to measure: no compile workers are started"


def test_a_failing_compile_step_falls_back_to_compiling_in_the_measuring_process(
    tmp_path, monkeypatch, fake_compiler, caplog
):
    events, measure = fake_compiler

    def discover(batch, device):
        if batch[0].index >= 3:
            raise RuntimeError("BrokenProcessPool (fake)")
        return {"s": ("m", "k")}

    monkeypatch.setattr(profile_loop, "kernel_specialisations", discover)
    caplog.set_level("WARNING", logger="fasttree")
    s = run(tmp_path / "t.jsonl", 8, precompile=True, batch_size=3, measure=measure)
    assert s.measured == 8
    assert events == [
        ("init", prof.default_compile_workers()),
        ("compile", ["s"]),
        ("wait", ["s"]),
        ("close",),  # discovering the second batch's kernels failed: no more compiling ahead
        *[("measure", i) for i in range(8)],
    ]
    assert "compiling ahead failed (BrokenProcessPool (fake))" in caplog.text


def test_precompile_is_skipped_without_a_gpu(tmp_path, caplog):
    caplog.set_level("INFO", logger="fasttree")
    s = run(tmp_path / "t.jsonl", 4, precompile=True, device="cpu")
    assert s.measured == 4 and s.precompiled == 0
    assert "not compiling kernels ahead" in caplog.text


def test_git_commit_from_the_environment(monkeypatch):
    monkeypatch.setenv("FASTTREE_GIT_COMMIT", "abc1234")
    assert prof.git_commit() == "abc1234"


def test_nvidia_smi_query(monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[0] == "nvidia-smi" and "-i" in cmd and cmd[-1] == "GPU-123"
        return subprocess.CompletedProcess(cmd, 0, stdout="3201, 570.86.15\n", stderr="")

    monkeypatch.setattr(environment.subprocess, "run", fake_run)
    assert environment._nvidia_smi("GPU-123") == {"memory_clock_mhz": 3201, "driver": "570.86.15"}

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(environment.subprocess, "run", missing)
    assert environment._nvidia_smi("0") == {"memory_clock_mhz": None, "driver": None}


def test_physical_gpu_id(monkeypatch):
    assert environment._physical_gpu_id(types.SimpleNamespace(uuid="abc-1"), 0) == "GPU-abc-1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert environment._physical_gpu_id(types.SimpleNamespace(), 1) == "5"


def test_collect_env_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        prof.collect_env()
    assert prof.device_sm_count() == prof.DEFAULT_SM_COUNT


def test_summary_line_and_rate():
    s = prof.ProfileSummary(points=10, measured=6, failed=2, skipped=1, not_started=1, elapsed_s=30.0)
    assert s.written == 8 and math.isclose(s.points_per_minute, 16.0)
    line = s.line()
    assert "6 measured, 2 failed, 1 skipped" in line and "16.0 points/minute" in line
    assert json.loads(json.dumps(dataclasses.asdict(s)))["measured"] == 6


def test_a_served_runtime_points_plan_is_the_one_its_runtime_uploads():
    from fasttree.runtime import TreeAttentionRuntime
    from fasttree.toolkit.measure import point_plan

    p = small_point(runtime=True, variants=True)
    plan = point_plan(p, SMALL_TREE)
    rt = TreeAttentionRuntime(p.config, num_q_heads=p.num_q_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                              dtype=torch.float16, device="cpu", max_queries=SMALL_TREE.n_queries,
                              max_kv_entries=4 * int(SMALL_TREE.lengths.sum()), pool_slots=SMALL_TREE.max_slot + 1,
                              extend_steps=0)  # fmt: skip
    served = rt.plan(SMALL_TREE).plan
    assert plan_summary(served) == plan_summary(plan)
    assert np.array_equal(served.kv_indices, plan.kv_indices)
