"""The headroom sweep (CPU): its design, the profiler's headroom mode with injected measurements, the
summary on lines whose times are chosen here, and the ``profile --design headroom`` / ``headroom`` CLI.
The GPU test runs a 2-tree x 3-config sweep end to end on CUDA."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from test_profiler import FAKE_ENV

import fasttree as ft
import fasttree.toolkit.profiler as prof
from fasttree.cli import main
from fasttree.portfolio import LAUNCH_FIELDS
from fasttree.toolkit.design import KERNEL_POOL, point_tree
from fasttree.toolkit.headroom import (
    DEFAULT_BUCKETS,
    HEADROOM_BUCKETS,
    HEADROOM_CONFIGS,
    HEADROOM_TREE_SEEDS,
    HEADROOM_TREES,
    check_buckets,
    headroom_configs,
    headroom_design,
    headroom_trees,
)
from fasttree.toolkit.headroom_stats import LARGE_HEADROOM, headroom_summary
from fasttree.toolkit.measure import failed_record
from fasttree.toolkit.profiler import profile
from fasttree.toolkit.workloads import TREE_FAMILIES
from fasttree.traces import _config_dict, measurement_record, read_traces

SMALL_FAMILIES = ["few_shot", "no_sharing"]  # small trees: the fake measurements build them


# ------------------------------------------------------------------ design
def test_default_design_has_the_promised_size_and_is_deterministic():
    points = headroom_design()
    assert len(points) == len(DEFAULT_BUCKETS) * HEADROOM_TREES * HEADROOM_CONFIGS == 6000
    assert (len(DEFAULT_BUCKETS), HEADROOM_TREES, HEADROOM_CONFIGS) == (6, 20, 50)
    assert [p.index for p in points] == list(range(6000))
    assert headroom_design() == points
    assert headroom_design(seed=1) != points
    assert {p.split for p in points} == {"headroom"}
    assert [p.bucket for p in points[:: HEADROOM_TREES * HEADROOM_CONFIGS]] == list(DEFAULT_BUCKETS)


def test_every_tree_of_a_bucket_gets_the_same_configs_the_defaults_first():
    points = headroom_design(buckets=["32x2-d128-fp16", "8x1-d128-bf16"], trees=4, configs=7)
    assert len(points) == 2 * 4 * 7
    trees = {}
    for p in points:
        trees.setdefault(p.tree_index, []).append(p)
    assert sorted(trees) == list(range(8))
    for tree in trees.values():
        assert len(tree) == 7 and len({(p.family, p.seed, p.bucket) for p in tree}) == 1
        assert tree[0].default_config and tree[0].config == ft.FastTreeConfig()
        assert not any(p.default_config for p in tree[1:])
        assert len({p.config for p in tree}) == 7  # distinct
        bucket = HEADROOM_BUCKETS[tree[0].bucket]
        assert [p.config for p in tree] == headroom_configs(bucket, 7)
        assert (tree[0].num_q_heads, tree[0].num_kv_heads, tree[0].head_dim, tree[0].dtype) == (
            bucket.num_q_heads,
            bucket.num_kv_heads,
            bucket.head_dim,
            bucket.dtype,
        )
    # the same trees in every bucket
    first = [(t[0].family, t[0].seed) for i, t in sorted(trees.items()) if i < 4]
    second = [(t[0].family, t[0].seed) for i, t in sorted(trees.items()) if i >= 4]
    assert first == second == headroom_trees(4)


def test_a_buckets_configs_do_not_depend_on_the_other_buckets_measured():
    alone = headroom_design(buckets=["8x1-d128-bf16"], trees=2, configs=5)
    together = headroom_design(buckets=["32x8-d128-fp16", "8x1-d128-bf16"], trees=2, configs=5)
    assert [p.config for p in alone] == [p.config for p in together if p.bucket == "8x1-d128-bf16"]


def test_trees_come_from_several_families_with_seeds_no_workload_trace_uses():
    trees = headroom_trees(HEADROOM_TREES)
    families = [f for f, _ in trees]
    assert families == [list(TREE_FAMILIES)[i % len(TREE_FAMILIES)] for i in range(HEADROOM_TREES)]
    seeds = [s for _, s in trees]
    assert len(set(seeds)) == len(seeds)
    lo, hi = HEADROOM_TREE_SEEDS
    assert all(lo <= s < hi for s in seeds) and lo > 1007  # tuning 0-15 and validation 1000-1007 lie below
    assert headroom_trees(3, families=["beam_search", "few_shot"]) == [
        ("few_shot", headroom_trees(3)[0][1]),
        ("beam_search", headroom_trees(3)[1][1]),
        ("few_shot", headroom_trees(3)[2][1]),
    ]


@pytest.mark.parametrize("name", DEFAULT_BUCKETS)
def test_every_tunable_field_takes_several_values_and_kernels_stay_bounded(name):
    bucket = HEADROOM_BUCKETS[name]
    configs = headroom_configs(bucket)
    g, d = bucket.gqa, bucket.head_dim
    resolved = {
        "q_tile_queries": {c.query_tiles(g) for c in configs},
        "num_warps": {c.launch_warps(g) for c in configs},
        "num_stages": {c.launch_stages(g, d) for c in configs},
    }
    for f in dataclasses.fields(ft.FastTreeConfig):
        values = resolved.get(f.name, {getattr(c, f.name) for c in configs})
        assert len(values) >= 3, (f.name, values)
        for i in (0, 1) if f.name in resolved or isinstance(getattr(configs[0], f.name), tuple) else ():
            assert len({v[i] for v in values}) >= 2, (f.name, i, values)  # each tile class varies
    for f in ("alpha", "beta", "gamma", "para_threshs1", "para_threshs2", "pack_min_units"):
        assert len({getattr(c, f) for c in configs}) >= 20, f
    assert {c.pack_tokens for c in configs} == {0, 256, 512, 1024, 2048}
    kernels = {(c.query_tiles(g), c.kv_tile, c.launch_warps(g), c.launch_stages(g, d)) for c in configs}
    assert len(kernels) <= KERNEL_POOL + 1  # the profiler's pool, and the defaults' own
    # about every fourth config keeps the defaults' kernels and varies the planner alone
    defaults = configs[0]
    planner_only = [c for c in configs[1:] if all(getattr(c, f) == getattr(defaults, f) for f in LAUNCH_FIELDS)]
    assert len(planner_only) >= 10
    assert len({(c.alpha, c.kv_split_sizes, c.pack_tokens) for c in planner_only}) == len(planner_only)


def test_design_rejects_bad_arguments_before_drawing():
    with pytest.raises(ValueError, match="unknown headroom buckets"):
        headroom_design(buckets=["32x8-d128-fp16", "nope"])
    with pytest.raises(ValueError, match="at least one"):
        check_buckets([])
    with pytest.raises(ValueError, match="configs"):
        headroom_design(configs=1)
    with pytest.raises(ValueError, match="trees"):
        headroom_design(trees=0)
    with pytest.raises(ValueError, match="unknown tree families"):
        headroom_design(families=["trees"])
    assert [b.name for b in check_buckets(None)] == list(DEFAULT_BUCKETS)
    assert [b.name for b in check_buckets(["16x1-d128-fp16", "32x32-d128-fp16"])] == [
        "32x32-d128-fp16",
        "16x1-d128-fp16",
    ]


# ------------------------------------------------------------------ the profiler's headroom mode
#: Graph-replay medians (us) per bucket, tree (in design order) and config (defaults first); None: failed.
TIMES = {
    "32x8-d128-fp16": [[10.0, 8.0, 12.0], [10.0, 11.0, 5.0], [10.0, 9.0, 20.0]],
    "8x1-d128-bf16": [[None, 5.0, 5.0], [20.0, None, 10.0], [20.0, 25.0, 30.0]],
}
BUCKETS = list(TIMES)
TREES, CONFIGS = 3, 3


def table_measure(point, *, device, check, env) -> dict:
    """A 'measurement' whose time is TIMES[bucket][tree][config] (a failed record where None)."""
    per_bucket = TREES * CONFIGS
    tree, config = divmod(point.index % per_bucket, CONFIGS)
    t = TIMES[point.bucket][tree][config]
    if t is None:
        return failed_record(point, env, "OutOfResources: shared memory (fake)")
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
        plan={"fake": True},
        timing={
            "graph_us": {"median": t, "p20": t, "p80": t, "replays": 3, "calls_per_graph": 20},
            "eager_us": {"median": 3 * t},
        },
        correct=None,
        max_rel_err=None,
    )


def run_headroom(out, **kw):
    kw.setdefault("buckets", BUCKETS)
    kw.setdefault("trees", TREES)
    kw.setdefault("configs", CONFIGS)
    kw.setdefault("families", SMALL_FAMILIES)
    return profile(
        out, design_name="headroom", env=FAKE_ENV, measure=table_measure, precompile=False, progress=False, **kw
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("headroom") / "headroom.jsonl"
    s = run_headroom(out)
    assert (s.points, s.measured, s.failed) == (18, 16, 2)
    return out


def test_headroom_lines_say_their_design_bucket_and_split(sweep):
    recs = read_traces(sweep, kind="measurement").records
    assert len(recs) == 18
    assert {r["meta"]["design"] for r in recs} == {"headroom"}
    assert {r["meta"]["split"] for r in recs} == {"headroom"}
    assert [r["meta"]["bucket"] for r in recs] == [b for b in BUCKETS for _ in range(TREES * CONFIGS)]
    assert sum(r["meta"]["profiler"]["default_config"] for r in recs) == 2 * TREES


def test_headroom_run_resumes_and_stops_on_its_budget(tmp_path):
    out = tmp_path / "h.jsonl"
    first = run_headroom(out, budget_s=1e-9)
    assert first.stopped_by_budget and first.written == 0
    run_headroom(out, buckets=[BUCKETS[0]])
    again = run_headroom(out)
    assert (again.skipped, again.written) == (9, 9)
    assert len(read_traces(out, kind="measurement")) == 18


def test_profile_refuses_options_of_the_other_design(tmp_path):
    out = tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match="headroom design's size"):
        profile(out, n=10, design_name="headroom", env=FAKE_ENV, measure=table_measure)
    with pytest.raises(ValueError, match="options of the headroom design"):
        profile(out, n=10, trees=3, env=FAKE_ENV, measure=table_measure)
    with pytest.raises(ValueError, match="required"):
        profile(out, env=FAKE_ENV, measure=table_measure)
    with pytest.raises(ValueError, match="no splits"):
        profile(out, design_name="headroom", split="heldout", env=FAKE_ENV, measure=table_measure)
    with pytest.raises(ValueError, match="design_name"):
        profile(out, design_name="grid", env=FAKE_ENV, measure=table_measure)
    with pytest.raises(ValueError, match="unknown headroom buckets"):
        profile(out, design_name="headroom", buckets=["64x1"], env=FAKE_ENV, measure=table_measure)
    assert not out.exists()


# ------------------------------------------------------------------ the summary, numbers worked out by hand
def geomean(*xs: float) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def test_summary_gives_the_hand_computed_oracle(sweep):
    s = headroom_summary(read_traces(sweep).records)
    assert s.gpu == "Fake GPU (tests)" and s.ignored_lines == 0 and s.repeat_lines == 0
    a = s.buckets["tree_attention"]["32x8-d128-fp16"]
    # oracles 10/8, 10/5, 10/9; the defaults second on each tree
    assert a.stats.trees == 3
    assert a.stats.oracle_geomean == pytest.approx(geomean(1.25, 2.0, 10 / 9))
    assert a.stats.oracle_median == pytest.approx(1.25)
    assert a.stats.oracle_max == pytest.approx(2.0)
    assert a.stats.large_share == pytest.approx(2 / 3)
    assert a.stats.defaults == 1.0 and a.stats.defaults_rank_median == 2 and a.stats.configs_median == 3
    # best single config: config 1 (10/8, 10/11, 10/9) beats config 2 (10/12, 2, 0.5) and the defaults
    bucket = HEADROOM_BUCKETS["32x8-d128-fp16"]
    best = headroom_configs(bucket, 3)[1]  # as traces store it: derived warps and stages written out
    assert a.best_single.config == _config_dict(best, bucket.num_q_heads, bucket.num_kv_heads, bucket.head_dim)
    assert a.best_single.geomean == pytest.approx(geomean(1.25, 10 / 11, 10 / 9))
    assert (a.best_single.eligible, a.best_single.not_eligible, a.best_single.is_defaults) == (3, 0, False)
    assert a.stats.best_single_geomean == pytest.approx(a.best_single.geomean)
    assert (a.failed_lines, a.lines, a.excluded_trees, a.incomplete_trees) == (0, 9, [], 0)
    # families: trees 0 and 2 are few_shot, tree 1 no_sharing
    assert a.families["few_shot"].oracle_geomean == pytest.approx(geomean(1.25, 10 / 9))
    assert a.families["no_sharing"].oracle_geomean == pytest.approx(2.0)
    assert a.families["no_sharing"].best_single_geomean == pytest.approx(10 / 11)


def test_summary_leaves_out_failed_lines_and_a_tree_without_defaults(sweep):
    s = headroom_summary(read_traces(sweep).records)
    b = s.buckets["tree_attention"]["8x1-d128-bf16"]
    assert (b.failed_lines, b.lines) == (2, 9)
    assert len(b.excluded_trees) == 1 and "defaults failed: OutOfResources" in b.excluded_trees[0]
    assert b.excluded_trees[0].startswith("few_shot/")
    # used: tree 1 (20, failed, 10) -> 2.0, rank 2 of 2; tree 2 (20, 25, 30) -> 1.0, rank 1 of 3
    assert b.stats.trees == 2
    assert b.stats.oracle_geomean == pytest.approx(math.sqrt(2.0))
    assert b.stats.large_share == pytest.approx(0.5)
    assert b.stats.defaults_rank_median == 1.5 and b.stats.configs_median == 2.5
    # config 1 failed on a used tree: not eligible; config 2 (2.0, 2/3) wins
    assert (b.best_single.eligible, b.best_single.not_eligible) == (2, 1)
    assert b.best_single.geomean == pytest.approx(math.sqrt(2.0 * 20 / 30))
    overall = s.overall["tree_attention"]
    assert overall.trees == 5
    assert overall.oracle_geomean == pytest.approx(geomean(1.25, 2.0, 10 / 9, 2.0, 1.0))
    assert overall.best_single_geomean == pytest.approx(geomean(1.25, 10 / 11, 10 / 9, 2.0, 20 / 30))
    assert s.families["tree_attention"]["no_sharing"].trees == 2
    text = s.markdown()
    assert "| 32x8-d128-fp16 | 3 | 1.406x | 1.250x | 2.000x | 2 (67%) | 1.000x | 2 (of 3) | 1.081x | 0 / 9 |" in text
    assert "in-sample" in text and "left out (no ok defaults line)" in text
    js = json.loads(json.dumps(s.to_json()))
    assert js["targets"]["tree_attention"]["buckets"]["8x1-d128-bf16"]["failed_lines"] == 2
    assert len(js["trees"]) == 5 and js["large_headroom"] == LARGE_HEADROOM


def test_summary_uses_the_first_line_of_a_key_and_ignores_other_designs(sweep, tmp_path):
    recs = read_traces(sweep).records
    repeat = json.loads(json.dumps(recs[1]))  # tree 0's config 1, measured again slower
    repeat["timing"]["graph_us"]["median"] = 100.0
    s = headroom_summary([*recs, repeat, {**recs[0], "meta": {"split": "train"}}])
    assert (s.repeat_lines, s.ignored_lines) == (1, 1)
    assert s.buckets["tree_attention"]["32x8-d128-fp16"].stats.oracle_max == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no measurement line of the headroom design"):
        headroom_summary([{**r, "meta": {}} for r in recs])
    other = {**recs[0], "env": {**recs[0]["env"], "gpu_name": "Other GPU"}}
    with pytest.raises(ValueError, match="several GPUs"):
        headroom_summary([*recs, other])
    newer = json.loads(json.dumps(recs[0]))
    newer["meta"]["profiler"]["kernel_version"] += 1
    with pytest.raises(ValueError, match="several kernel versions"):
        headroom_summary([*recs[1:], newer])


def test_a_tree_cut_short_by_the_budget_is_counted_incomplete(sweep):
    recs = read_traces(sweep).records
    s = headroom_summary(recs[:-1])  # the last tree of the second bucket lost its last config
    b = s.buckets["tree_attention"]["8x1-d128-bf16"]
    assert b.incomplete_trees == 1 and b.configs_max == 3
    assert "fewer configs than the bucket's fullest (3); kept" in s.markdown()


# ------------------------------------------------------------------ CLI
def test_headroom_command_prints_and_writes_and_refuses_to_overwrite(sweep, tmp_path, capsys):
    out, md = tmp_path / "h.json", tmp_path / "h.md"
    assert main(["headroom", str(sweep), "-o", str(out), "--markdown", str(md)]) == 0
    printed = capsys.readouterr().out
    assert "| 32x8-d128-fp16 | 3 | 1.406x" in printed
    assert json.loads(out.read_text())["schema"] == "fasttree-headroom-summary"
    assert md.read_text() in printed
    for flag, path in (("-o", out), ("--markdown", md)):
        path.write_text("keep\n")
        with pytest.raises(SystemExit) as info:
            main(["headroom", str(sweep), flag, str(path)])
        assert info.value.code == 2
        name = "--out" if flag == "-o" else flag
        assert f"{name} {path} exists; pass --overwrite to replace it" in capsys.readouterr().err
        assert path.read_text() == "keep\n"
    assert main(["headroom", str(sweep), "-o", str(out), "--markdown", str(md), "--overwrite"]) == 0
    assert json.loads(out.read_text())["schema"] == "fasttree-headroom-summary"


def test_headroom_command_without_headroom_lines_exits_2(tmp_path, capsys):
    path = tmp_path / "sampled.jsonl"
    prof.profile(path, n=3, seed=1, env=FAKE_ENV, measure=table_measure_sampled, families=SMALL_FAMILIES,
                 precompile=False, progress=False)  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(["headroom", str(path)])
    assert info.value.code == 2
    assert "no measurement line of the headroom design" in capsys.readouterr().err


def table_measure_sampled(point, *, device, check, env) -> dict:
    return table_measure(dataclasses.replace(point, bucket="32x8-d128-fp16", index=0), device=device, check=check,
                         env=env)  # fmt: skip


def test_profile_command_passes_the_headroom_options(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_profile(out, **kw):
        seen.update(kw)
        return prof.ProfileSummary(points=6000, measured=6000, elapsed_s=1.0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prof, "profile", fake_profile)
    out = str(tmp_path / "h.jsonl")
    argv = [
        "profile",
        "--design",
        "headroom",
        "-o",
        out,
        "--budget",
        "8m",
        "--buckets",
        "8x1-d128-bf16,32x32-d128-fp16",
    ]
    assert main([*argv, "--trees", "2", "--configs", "3", "--no-progress"]) == 0
    assert seen["design_name"] == "headroom" and seen["buckets"] == ["8x1-d128-bf16", "32x32-d128-fp16"]
    assert (seen["trees"], seen["configs"], seen["budget_s"]) == (2, 3, 480.0)
    assert "n" not in seen and "split" not in seen
    seen.clear()
    assert main(["profile", "--design", "headroom", "-o", out]) == 0
    assert (seen["buckets"], seen["trees"], seen["configs"]) == (None, None, None)  # the design's defaults
    seen.clear()
    assert main(["profile", "-o", out]) == 0
    assert seen["n"] == 4096 and seen["split"] == "train" and "design_name" not in seen


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--design", "headroom", "-n", "10"], "-n/--points: the headroom design's size"),
        (["--design", "headroom", "--split", "heldout"], "--split heldout: the headroom design has no splits"),
        (["--trees", "3"], "--trees: options of --design headroom"),
        (["--design", "headroom", "--buckets", "64x1-d128-fp16"], "unknown headroom bucket 64x1-d128-fp16"),
        (["--design", "headroom", "--configs", "1"], "argument --configs: expected an integer >= 2"),
        (["--design", "grid"], "argument --design: invalid choice"),
    ],
)
def test_profile_command_refuses_bad_headroom_options(monkeypatch, tmp_path, capsys, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prof, "profile", lambda out, **kw: pytest.fail("profile must not start"))
    with pytest.raises(SystemExit) as info:
        main(["profile", "-o", str(tmp_path / "h.jsonl"), *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ end to end: the real measurement
SMALL_TREE = ft.KVTree.from_lengths([-1, 0, 0, 1], [40, 20, 24, 9], [1, 2, 3, 3, 2])


def test_headroom_sweep_end_to_end_with_the_real_measurement_on_the_cpu(monkeypatch, tmp_path, device):
    """measure_point plans, runs (the Triton interpreter on the CPU) and checks each point; the timers
    are stubbed (one call each) and every tree is one small tree."""
    import fasttree.toolkit.design as design_module
    import fasttree.toolkit.measure as measure_module

    def graph_time_us(fn, **kw):
        fn()
        return {"median": 11.0, "p20": 10.0, "p80": 12.0, "replays": 5, "calls_per_graph": 20}

    def eager_time_us(fn, **kw):
        fn()
        return 33.0

    monkeypatch.setattr(design_module, "point_tree", lambda point: SMALL_TREE)
    monkeypatch.setattr(measure_module, "point_tree", lambda point: SMALL_TREE)
    monkeypatch.setattr("fasttree.toolkit.timing.graph_time_us", graph_time_us)
    monkeypatch.setattr("fasttree.toolkit.timing.eager_time_us", eager_time_us)
    out = tmp_path / "headroom.jsonl"
    s = profile(out, design_name="headroom", buckets=["8x1-d128-bf16"], trees=1, configs=3, device=device,
                env=FAKE_ENV, precompile=False, progress=False, check_every=1)  # fmt: skip
    assert (s.points, s.written) == (3, 3), s.line()
    recs = read_traces(out, kind="measurement").records
    assert all(r["status"] == "ok" and r["correct"] for r in recs), [r["error"] for r in recs]
    assert {(r["meta"]["design"], r["meta"]["bucket"]) for r in recs} == {("headroom", "8x1-d128-bf16")}
    stats = headroom_summary(recs).buckets["tree_attention"]["8x1-d128-bf16"].stats
    assert (stats.trees, stats.oracle_geomean, stats.defaults_rank_median) == (1, 1.0, 1)  # equal stub times


# ------------------------------------------------------------------ end to end on the device
@pytest.mark.gpu
def test_headroom_sweep_end_to_end_on_the_gpu(tmp_path):
    out = tmp_path / "headroom.jsonl"
    s = profile(out, design_name="headroom", buckets=["32x8-d128-fp16"], trees=2, configs=3,
                families=SMALL_FAMILIES, progress=False, check_every=1)  # fmt: skip
    assert (s.points, s.written) == (6, 6), s.line()
    recs = read_traces(out, kind="measurement").records
    assert all(r["status"] == "ok" and r["correct"] for r in recs), [r["error"] for r in recs]
    assert {r["meta"]["design"] for r in recs} == {"headroom"}
    summary = headroom_summary(recs)
    stats = summary.buckets["tree_attention"]["32x8-d128-fp16"].stats
    assert stats.trees == 2 and stats.oracle_geomean >= 1.0 and stats.configs_median == 3
    again = profile(out, design_name="headroom", buckets=["32x8-d128-fp16"], trees=2, configs=3,
                    families=SMALL_FAMILIES, progress=False)  # fmt: skip
    assert (again.skipped, again.written) == (6, 0)


def test_summary_gives_the_hand_computed_in_sample_portfolio(sweep):
    s = headroom_summary(read_traces(sweep).records)
    a = s.buckets["tree_attention"]["32x8-d128-fp16"]
    # defaults 10 on each tree; config 1 (8, 11, 9) alone: 10/8, 1, 10/9; config 2 (12, 5, 20) alone:
    # 1, 2, 1 -> config 2 first (geomean 2^(1/3) > (1.25 * 10/9)^(1/3)), then config 1 too: 1.25, 2, 10/9
    assert a.portfolio_in_sample == pytest.approx([2 ** (1 / 3), geomean(1.25, 2.0, 10 / 9)])
    assert a.portfolio_in_sample[-1] == pytest.approx(a.stats.oracle_geomean)
    # 8x1: config 1 failed on a used tree, so only config 2 may join: trees (20, 10) and (20, 30) -> 2, 1
    b = s.buckets["tree_attention"]["8x1-d128-bf16"]
    assert b.portfolio_in_sample == pytest.approx([math.sqrt(2.0)])
    text = s.markdown()
    assert f"- 32x8-d128-fp16: {2 ** (1 / 3):.3f}x / {geomean(1.25, 2.0, 10 / 9):.3f}x" in text
    js = json.loads(json.dumps(s.to_json()))
    assert js["targets"]["tree_attention"]["buckets"]["8x1-d128-bf16"]["portfolio_in_sample"] == [
        pytest.approx(math.sqrt(2.0), abs=1e-4)
    ]
