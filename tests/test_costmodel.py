"""Cost model on the CPU: work counts, simulator, features, the estimator, datasets from traces, evaluation."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

import fasttree as ft
import fasttree.toolkit.profiler as prof
from fasttree.config import DEFAULT_NUM_STAGES_DEEP
from fasttree.costmodel.dataset import load_dataset, record_features, tree_id
from fasttree.costmodel.evaluate import (
    SimulatorBaseline,
    cross_validated_predictions,
    prediction_metrics,
    rank_only_metrics,
)
from fasttree.costmodel.features import FEATURE_NAMES, SIM_TOTAL, features_of_plan, published_cost
from fasttree.costmodel.gpu import KNOWN_GPUS, GpuSpec, gpu_spec
from fasttree.costmodel.model import LatencyModel
from fasttree.costmodel.simulator import SimParams, makespan, simulate
from fasttree.costmodel.work import plan_work
from fasttree.launch_rules import merge_heads_per_program
from fasttree.traces import TraceWriter, measurement_record, read_traces

H200 = KNOWN_GPUS["NVIDIA H200"]
ENV = {
    "gpu_name": "NVIDIA H200",
    "gpu_sm_count": 132,
    "compute_capability": "9.0",
    "memory_clock_mhz": 3201,
    "driver": "0.0",
    "torch": "0",
    "triton": "0",
    "fasttree": ft.__version__,
    "git_commit": None,
}


def forest() -> ft.KVTree:
    # two roots; queries at leaves and at an internal node; a 1-token node
    parents = [-1, 0, 0, 1, 1, -1, 5, 5]
    lengths = [700, 90, 1, 40, 33, 300, 17, 250]
    queries = [3, 3, 4, 2, 1, 6, 7, 7, 7, 5]
    return ft.KVTree.from_lengths(parents, lengths, queries)


def plan_of(tree, config=None, hq=32, hkv=8, d=128):
    return ft.plan(tree, config or ft.FastTreeConfig(), num_q_heads=hq, num_kv_heads=hkv, head_dim=d)


# ------------------------------------------------------------------ work
@pytest.mark.parametrize("pack_tokens", [0, 1024])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 32), (32, 8), (16, 1)])
def test_plan_work_counts_what_the_plan_launches(pack_tokens, hq, hkv):
    tree = forest()
    plan = plan_of(tree, ft.FastTreeConfig(pack_tokens=pack_tokens, kv_split_sizes=(256, 64)), hq, hkv)
    w = plan_work(plan)
    g = hq // hkv
    units = plan.units_per_class()
    assert [c.programs for c in w.classes] == [u * hkv for u in units]
    assert sum(c.kv_tokens for c in w.classes) == int(plan.unit_kv_len.sum()) * hkv
    for c, tc in zip(w.classes, plan.tile_classes, strict=True):
        assert c.padded_kv_tokens >= c.kv_tokens and c.padded_kv_tokens % tc.block_n == 0
        assert c.padded_rows == c.programs * tc.block_m >= c.rows
        assert c.flops == 4 * tc.block_m * c.padded_kv_tokens * plan.head_dim >= c.useful_flops
    # every query row is written once directly or reaches the merge through partials
    written = sum(c.direct_rows + c.partial_rows for c in w.classes)
    assert written == int((plan.pair_out_row != -2).sum()) * g * hkv
    assert sum(c.direct_rows for c in w.classes) == int((plan.query_num_partials == 1).sum()) * hq
    assert w.merge.queries == plan.merge_queries.size
    assert w.merge.programs == plan.merge_queries.size * math.ceil(hq / merge_heads_per_program(plan))
    assert w.merge.partials == int(plan.query_num_partials[plan.merge_queries].sum())
    assert w.unique_kv_tokens == int(tree.lengths.sum()), "every node is read by some query"
    assert w.launches == sum(u > 0 for u in units) + (plan.merge_queries.size > 0)


def test_makespan_is_list_scheduling_longest_first():
    assert makespan(np.array([]), 4) == 0
    assert makespan(np.array([1.0, 5.0, 2.0]), 4) == 5.0  # fewer programs than SMs: the longest
    assert makespan(np.array([3.0, 3, 2, 2, 2]), 2) == 7.0  # LPT: {3, 2, 2} and {3, 2}
    c = np.full(1000, 2.0)
    assert makespan(c, 10) == pytest.approx(200.0)  # 100 waves of equal programs
    rng = np.random.default_rng(0)
    many = rng.uniform(1, 3, 50_000)
    assert many.sum() / 132 <= makespan(many, 132) <= many.sum() / 132 + many.max()


def test_simulator_grows_with_work_and_shrinks_with_a_bigger_gpu():
    small = forest()
    big = ft.KVTree.from_lengths(list(small.parents), [x * 8 for x in small.lengths], list(small.query_nodes))
    t_small = simulate(plan_work(plan_of(small)), H200).total_us
    t_big = simulate(plan_work(plan_of(big)), H200).total_us
    assert 0 < t_small < t_big
    wide = ft.KVTree.from_lengths([-1] + [0] * 400, [4000] + [300] * 400, list(range(1, 401)))
    w = plan_work(plan_of(wide))
    half = dataclasses.replace(H200, sm_count=66, hbm_bytes_per_s=2.4e12, tensor_flops=350e12)  # half a GPU
    full, halved = simulate(w, H200), simulate(w, half)
    assert 1.6 < sum(halved.class_us) / sum(full.class_us) < 2.4
    slow_launch = simulate(w, H200, SimParams(c_launch_us=50.0))
    assert slow_launch.launch_us == 50.0 * w.launches
    r = simulate(w, H200)
    assert r.total_us == pytest.approx(sum(r.class_us) + r.merge_us + r.launch_us)


def test_register_spilling_slows_programs_whose_tiles_do_not_fit_in_registers():
    from fasttree.costmodel.simulator import regs_per_thread, spill_factor

    tree = ft.KVTree.from_lengths([-1] + [0] * 64, [2048] + [64] * 64, list(range(1, 65)))
    fits = ft.FastTreeConfig(q_tile_queries=(16, 4), kv_tile=(64, 64), num_warps=(4, 4))
    spills = dataclasses.replace(fits, kv_tile=(128, 128), num_warps=(2, 2), q_tile_queries=(32, 4))
    w_fit, w_spill = plan_work(plan_of(tree, fits)), plan_work(plan_of(tree, spills))
    big = w_spill.classes[0]
    assert big.block_m == 128 and big.block_n == 128
    assert regs_per_thread(big, 128) == (128 * 128 + 128 * 128) / 64
    assert spill_factor(big, 128, SimParams()) == pytest.approx(1 + 0.1 * (512 - 224))
    assert all(spill_factor(c, 128, SimParams()) == 1.0 for c in w_fit.classes)
    assert spill_factor(big, 128, SimParams(spill_cap=5.0)) == 5.0
    no_spill = SimParams(spill_per_word=1e-9)
    assert simulate(w_spill, H200).class_us[0] > 10 * simulate(w_spill, H200, no_spill).class_us[0]


def test_sim_params_and_gpu_spec_round_trip_and_reject_bad_values():
    p = SimParams(c_iter_us=0.3)
    assert SimParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="unknown simulator parameters"):
        SimParams.from_dict({"warp_speed": 1.0})
    with pytest.raises(ValueError, match="c_iter_us must be a positive"):
        SimParams.from_dict({"c_iter_us": -1.0})
    assert GpuSpec.from_dict(H200.to_dict()) == H200
    with pytest.raises(ValueError, match="sm_count must be a positive"):
        GpuSpec.from_dict({**H200.to_dict(), "sm_count": 0})
    assert gpu_spec(ENV) == H200
    assert gpu_spec({**ENV, "gpu_sm_count": 114}).sm_count == 114
    with pytest.raises(ValueError, match="no GPU facts for 'Imaginary GPU'"):
        gpu_spec("Imaginary GPU")


# ------------------------------------------------------------------ features
def test_feature_row_is_finite_and_carries_the_simulator():
    plan = plan_of(forest())
    x = features_of_plan(plan, H200)
    assert x.shape == (len(FEATURE_NAMES),) and np.all(np.isfinite(x))
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    assert x[SIM_TOTAL] == pytest.approx(simulate(plan_work(plan), H200).total_us)
    named = dict(zip(FEATURE_NAMES, x, strict=True))
    assert named["gqa"] == 4 and named["head_dim"] == 128 and named["gpu_sm_count"] == 132
    assert named[f"tile_mode_{plan.tile_mode}"] == 1.0


def test_published_cost_adds_gamma_per_partial():
    tree = forest()
    a = published_cost(plan_of(tree, ft.FastTreeConfig(gamma=0.0)))
    b = published_cost(plan_of(tree, ft.FastTreeConfig(gamma=0.0)))
    assert a == b > 0
    # an all-separate plan (gamma -10: never concatenate) has one partial per (group, query)
    sep = plan_of(tree, ft.FastTreeConfig(gamma=-10.0))
    nq = int(sep.groups.n_queries.sum())
    g0 = published_cost(dataclasses.replace(sep, config=dataclasses.replace(sep.config, gamma=0.0)))
    assert published_cost(sep) == pytest.approx(g0 - 10.0 * nq)


# ------------------------------------------------------------------ estimator
def synthetic(n=600, seed=0):
    """Feature rows of random trees and configs with a made-up latency: 2 x sim x config-dependent noise."""
    rng = np.random.default_rng(seed)
    pts = prof.design(n, seed, families=["paper_random", "few_shot", "beam_search"])
    plans = [plan_of(prof.point_tree(p), p.config, p.num_q_heads, p.num_kv_heads) for p in pts]
    X = np.stack([features_of_plan(plan, H200) for plan in plans])
    y = 2.0 * X[:, SIM_TOTAL] * np.exp(rng.normal(0, 0.02, n))
    return X, y, pts


def test_latency_model_is_a_scikit_learn_estimator():
    m = LatencyModel(kind="residual", n_estimators=20)
    assert m.get_params()["kind"] == "residual" and clone(m).get_params() == m.get_params()
    with pytest.raises(TypeError):
        LatencyModel("gbrt")  # keyword-only
    with pytest.raises(NotFittedError):
        m.predict(np.ones((1, len(FEATURE_NAMES))))
    X, y, _ = synthetic(120)
    assert m.fit(X, y) is m and len(m.estimators_) == m.n_seeds == 3 and m.n_features_in_ == len(FEATURE_NAMES)
    with pytest.raises(ValueError, match="feature columns"):
        LatencyModel(n_estimators=5).fit(X[:, :10], y)
    with pytest.raises(ValueError, match="positive times"):
        LatencyModel(n_estimators=5).fit(X, -y)
    with pytest.raises(ValueError, match="kind must be one of"):
        LatencyModel(kind="oracle").fit(X, y)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_seeds must be a positive integer"):
            LatencyModel(n_estimators=5, n_seeds=bad).fit(X, y)
    with pytest.raises(ValueError, match="features"):
        m.predict(X[:, :10])


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_seed_ensemble_predicts_the_geometric_mean_of_its_members(n_jobs):
    X, y, _ = synthetic(160, seed=3)
    m = LatencyModel(n_estimators=12, max_depth=3, n_seeds=3, random_state=5, n_jobs=n_jobs).fit(X, y)
    assert [est.random_state for est in m.estimators_] == [5, 6, 7]
    members = [LatencyModel(n_estimators=12, max_depth=3, n_seeds=1, random_state=s).fit(X, y) for s in (5, 6, 7)]
    alone = np.stack([mm.predict(X) for mm in members])
    assert not np.allclose(alone[0], alone[1]), "the seeds should give different fits (subsample 0.5)"
    np.testing.assert_allclose(m.predict(X), np.exp(np.log(alone).mean(axis=0)), rtol=1e-12)
    np.testing.assert_allclose(m.predict_members(X), alone, rtol=1e-12)


@pytest.mark.parametrize("kind", ["gbrt", "forest", "residual"])
def test_each_kind_learns_a_latency_that_follows_the_simulator(kind):
    X, y, _ = synthetic(400)
    m = LatencyModel(kind=kind, n_estimators=60, max_depth=4 if kind != "forest" else None).fit(X[:300], y[:300])
    pred = m.predict(X[300:])
    assert np.all(pred > 0)
    err = np.median(np.abs(pred - y[300:]) / y[300:])
    assert err < (0.05 if kind == "residual" else 0.35), err
    base = SimulatorBaseline().fit(X[:300], y[:300])
    assert base.coef_[1] == pytest.approx(1.0, abs=0.05) and math.exp(base.coef_[0]) == pytest.approx(2.0, rel=0.1)


# ------------------------------------------------------------------ dataset from traces
def synthetic_measure(point, *, device, check, env):
    """A 'measurement' whose time is a made-up function of the real plan (simulator x per-family factor)."""
    tree = prof.point_tree(point)
    plan = plan_of(tree, point.config, point.num_q_heads, point.num_kv_heads, point.head_dim)
    t = simulate(plan_work(plan), H200).total_us * (1.5 if point.family == "few_shot" else 1.0)
    timing = {
        "graph_us": {"median": t, "p20": t, "p80": t, "replays": 5, "calls_per_graph": 1},
        "eager_us": {"median": t},
    }
    return measurement_record(
        env=env, family=point.family, seed=point.seed, tree=tree, num_q_heads=point.num_q_heads,
        num_kv_heads=point.num_kv_heads, head_dim=point.head_dim, dtype=point.dtype, config=point.config,
        plan={"made_up": True}, timing=timing, correct=None, max_rel_err=None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces") / "t.jsonl"
    fams = ["paper_random", "few_shot", "beam_search", "no_sharing"]
    prof.profile(
        out, n=160, seed=3, env=ENV, measure=synthetic_measure, precompile=False, progress=False, families=fams
    )
    return out


def test_dataset_rows_match_the_records(trace_file):
    ds = load_dataset(trace_file, workers=1)
    recs = read_traces(trace_file).records
    assert len(ds) == 160 and ds.X.shape == (160, len(FEATURE_NAMES)) and ds.gpu == H200
    assert ds.y_us.tolist() == [r["timing"]["graph_us"]["median"] for r in recs]
    assert np.allclose(ds.X[7], record_features(recs[7]))
    assert ds.tree.tolist() == [tree_id(r) for r in recs]
    assert len(set(ds.tree.tolist())) == 160 // prof.CONFIGS_PER_TREE, "a tree's configs share its id"
    assert ds.default_config.sum() == 160 // prof.CONFIGS_PER_TREE
    assert set(ds.split) == {"train"} and set(ds.family) <= {"paper_random", "few_shot", "beam_search", "no_sharing"}
    assert np.all(ds.published_cost > 0)
    parallel = load_dataset(trace_file, workers=2)
    assert np.array_equal(parallel.X, ds.X) and parallel.trace_hash == ds.trace_hash
    sub = ds.subset(ds.family == "few_shot")
    assert len(sub) == int((ds.family == "few_shot").sum()) and set(sub.family) == {"few_shot"}


def test_dataset_refuses_mixed_gpus_and_empty_sets(trace_file, tmp_path):
    recs = read_traces(trace_file).records[:3]
    other = copy.deepcopy(recs[0])
    other["env"]["gpu_name"] = "NVIDIA H100 80GB HBM3"
    rebuilt = measurement_record(
        env=other["env"], family=other["workload"]["family"], seed=other["workload"]["seed"],
        tree=other["workload"]["tree"], num_q_heads=other["num_q_heads"], num_kv_heads=other["num_kv_heads"],
        head_dim=other["head_dim"], dtype=other["dtype"], config=other["config"], plan=other["plan"],
        timing=other["timing"], correct=None, max_rel_err=None,
    )  # fmt: skip
    mixed = tmp_path / "mixed.jsonl"
    with TraceWriter(mixed) as w:
        for r in [*recs, rebuilt]:
            w.append(r)
    with pytest.raises(ValueError, match="mix GPUs"):
        load_dataset(mixed, workers=1)
    with pytest.raises(ValueError, match="need at least 10"):
        load_dataset(mixed, workers=1, min_rows=10)
    with pytest.raises(ValueError, match="no trace paths"):
        load_dataset([], workers=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(recs[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_dataset(bad, workers=1)
    assert len(load_dataset(bad, workers=1, skip_invalid=True)) == 1


# ------------------------------------------------------------------ evaluation
def test_group_kfold_holds_out_whole_families_and_metrics_see_the_family_factor(trace_file):
    ds = load_dataset(trace_file, workers=1)
    seen: list[set] = []

    class Spy(SimulatorBaseline):
        def fit(self, X, y):
            rows = {tuple(r) for r in np.round(X[:, :12], 6)}
            seen.append({f for f, x in zip(ds.family, ds.X, strict=True) if tuple(np.round(x[:12], 6)) in rows})
            return super().fit(X, y)

    pred = cross_validated_predictions(Spy, ds, n_splits=4)
    assert len(seen) == 4 and all(len(s) == 3 for s in seen), "each fold trains on three of the four families"
    m = prediction_metrics(pred, ds)
    assert m["n"] == len(ds) and m["n_trees"] == 160 // prof.CONFIGS_PER_TREE
    assert m["mean_kendall_tau"] == pytest.approx(1.0), "the made-up time is monotone in the simulator's"
    few = ds.family == "few_shot"
    ape = np.abs(pred - ds.y_us) / ds.y_us
    assert ape[few].mean() > 0.2 > ape[~few].mean(), "the held-out family's factor cannot be learned"
    ranks = rank_only_metrics(ds.published_cost, ds)
    assert -1.0 <= ranks["mean_kendall_tau"] <= 1.0 and 0 < ranks["top1_score"] <= 1.0
    with pytest.raises(ValueError, match="two families or more"):
        cross_validated_predictions(SimulatorBaseline, ds.subset(few))


# ------------------------------------------------------------------ persistence
def test_saved_model_predicts_the_same_and_carries_its_metadata(tmp_path):
    import zipfile

    from fasttree.costmodel.persist import META_MEMBER, ModelFileError, load_model, save_model

    X, y, _ = synthetic(150)
    m = LatencyModel(kind="gbrt", n_estimators=15, max_depth=3).fit(X, y)
    path = tmp_path / "m.skops"
    meta = save_model(path, m, gpu=H200, trace_hash="ab" * 32, trace_rows=150, extra={"note": "test"})
    loaded, meta2 = load_model(path, gpu_name="NVIDIA H200")
    assert np.array_equal(loaded.predict(X), m.predict(X))
    assert loaded.get_params() == m.get_params()
    assert meta2["trace_set"]["sha256"] == "ab" * 32 and meta2["extra"] == {"note": "test"}
    assert meta2["gpu"] == H200.to_dict() and meta2["versions"] == meta["versions"]
    with pytest.raises(FileExistsError):
        save_model(path, m, gpu=H200, trace_hash="x", trace_rows=1)
    with pytest.raises(ModelFileError, match="fitted on 'NVIDIA H200' traces, not 'NVIDIA H100 80GB HBM3'"):
        load_model(path, gpu_name="NVIDIA H100 80GB HBM3")
    assert load_model(path, gpu_name="NVIDIA H100 80GB HBM3", force=True)[0].predict(X[:3]).shape == (3,)
    with zipfile.ZipFile(path) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    doc = json.loads(members[META_MEMBER])
    params = doc["model_params"]
    for change, match in [
        ({"feature_schema_version": 99}, "feature schema 99"),
        ({"format_version": 2}, "format version 2"),
        ({"format_version": True}, "format version True"),
        ({"model_params": {**params, "n_seeds": 2}}, "n_seeds is 2 but the file holds 3 regressors"),
        ({"format": "pickle"}, "not a fasttree-latency-model file"),
        ({"model_params": {**params, "kind": "forest"}}, "holds a GradientBoostingRegressor"),
        ({"model_params": {**params, "warp": 1}}, "unknown parameters warp"),
        ({"model_params": {}}, "model_params lacks kind"),
        ({"model_params": {**params, "kind": "knn"}}, "kind must be one of"),
        ({"gpu": {"name": "x"}}, "bad gpu entry"),
        ({"trace_set": None}, "trace_set must be an object"),
    ]:
        bad = tmp_path / "bad.skops"
        with zipfile.ZipFile(bad, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, json.dumps({**doc, **change}) if name == META_MEMBER else data)
        with pytest.raises(ModelFileError, match=match):
            load_model(bad)
    for key in ("gpu", "extra", "trace_set"):
        with zipfile.ZipFile(bad, "w") as zf:
            for name, data in members.items():
                trimmed = {k: v for k, v in doc.items() if k != key}
                zf.writestr(name, json.dumps(trimmed) if name == META_MEMBER else data)
        with pytest.raises(ModelFileError, match=f"the metadata lacks {key}"):
            load_model(bad)
    bad.write_text("{torn")
    with pytest.raises(ModelFileError, match=r"a gzip or JSON file.*persist convert"):
        load_model(bad)
    with pytest.raises(ValueError, match="not fitted"):
        save_model(tmp_path / "u.skops", LatencyModel(), gpu=H200, trace_hash="x", trace_rows=0)


@pytest.mark.parametrize("kind", ["forest", "residual"])
def test_every_kind_round_trips_bit_identically(kind, tmp_path):
    from fasttree.costmodel.persist import load_model, save_model

    X, y, _ = synthetic(120, seed=4)
    m = LatencyModel(kind=kind, n_estimators=8, max_depth=3, n_seeds=2).fit(X, y)
    save_model(tmp_path / "m.skops", m, gpu=H200, trace_hash="ef" * 32, trace_rows=120)
    loaded, meta = load_model(tmp_path / "m.skops")
    for est in [*loaded.estimators_, *m.estimators_]:
        if kind == "forest":  # its threads add the trees' outputs in any order: one thread, for bit equality
            est.n_jobs = 1
    assert np.array_equal(loaded.predict(X), m.predict(X)) and meta["model_params"]["kind"] == kind
    assert np.array_equal(loaded.predict_members(X), m.predict_members(X))


# ------------------------------------------------------------------ CLI (the real entry point)
def test_cli_fit_then_evaluate_a_saved_model_and_by_folds(trace_file, tmp_path, capsys):
    from fasttree.cli import main

    model = tmp_path / "m.skops"
    fit = ["fit", str(trace_file), "-o", str(model), "--n-estimators", "20", "--max-depth", "3", "--workers", "1"]
    assert main(fit) == 0
    assert "gbrt model of 160 measurements (NVIDIA H200)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(fit)
    assert exit_info.value.code == 2 and "exists; pass --overwrite" in capsys.readouterr().err
    assert main([*fit, "--overwrite", "--kind", "gbrt"]) == 0
    capsys.readouterr()
    out_json = tmp_path / "ev.json"
    assert main(["evaluate", "--model", str(model), str(trace_file), "--workers", "1", "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "| simulator |" in table and "| learned (gbrt) |" in table and "| published cost (ranks) |" in table
    metrics = json.loads(out_json.read_text())
    assert set(metrics) == {"simulator", "learned (gbrt)", "published cost (ranks)"}
    assert metrics["learned (gbrt)"]["n"] == 160 and 0 <= metrics["learned (gbrt)"]["mape"] < 1
    argv = ["evaluate", str(trace_file), "--folds", "2", "--n-estimators", "10", "--workers", "1", "--kind", "forest"]
    assert main(argv) == 0
    assert "| learned (forest) |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", "--model", str(tmp_path / "missing.json"), str(trace_file)])
    assert exit_info.value.code == 2 and "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", str(tmp_path / "nothing_here"), "-o", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2


def test_compiled_features_come_from_the_ptxas_table():
    from fasttree.costmodel.resources import COMPILED_FIELDS, compiled_features, kernel_resources

    # the default large class at 4 warps: 249 registers, no spills, as the JIT compiles it
    res = kernel_resources(128, 64, 64, True, 4, 3)
    assert res is not None and res.spill_bytes == 0 and 200 < res.regs <= 255 and res.shared > 64 * 1024
    got = compiled_features(128, 64, 64, True, 4, 3, programs=10, iterations=7)
    assert got == (float(res.regs), 0.0, float(res.shared), 0.0)
    spills = kernel_resources(128, 32, 128, True, 4, 1)  # a 32 x 128 tile in one stage spills
    assert spills is not None and spills.spill_bytes > 0 and spills.regs == 255
    got = compiled_features(128, 32, 128, True, 4, 1, programs=10, iterations=7)
    assert got == (255.0, float(spills.spill_bytes), float(spills.shared), float(spills.spill_bytes) * 7)
    assert compiled_features(128, 64, 64, True, 4, 3, programs=0, iterations=0) == (0.0,) * len(COMPILED_FIELDS)
    assert compiled_features(128, 64, 512, True, 4, 3, programs=1, iterations=1) == (-1.0,) * len(COMPILED_FIELDS)


def test_the_ptxas_table_covers_the_profilers_kernel_space():
    from fasttree.costmodel.resources import kernel_resources

    for d in (64, 128, 256):
        for m in (16, 32, 64, 128, 256):
            for n in prof.KV_TILES:
                for w in prof.NUM_WARPS:
                    for s in prof.NUM_STAGES:
                        for masked in (False, True):
                            assert kernel_resources(d, m, n, masked, w, s) is not None, (d, m, n, masked, w, s)
    # and the default stages beyond the profiler's (FastTreeConfig.launch_stages), which the tuner also searches
    for d in (64, 128, 256):
        for m in (16, 32, 64, 128, 256):
            for n in prof.KV_TILES:
                for w in prof.NUM_WARPS:
                    for s in set(DEFAULT_NUM_STAGES_DEEP) - set(prof.NUM_STAGES):
                        for masked in (False, True):
                            assert kernel_resources(d, m, n, masked, w, s) is not None, (d, m, n, masked, w, s)


def test_features_name_the_compiled_facts_of_both_classes():
    names = [n for n in FEATURE_NAMES if n.startswith(("c0_ptx", "c1_ptx", "c0_spill", "c1_spill"))]
    assert names == [
        f"c{c}_{f}" for c in (0, 1) for f in ("ptx_regs", "ptx_spill_bytes", "ptx_shared_bytes", "spill_traffic")
    ]
    tree = forest()
    plan = plan_of(tree, ft.FastTreeConfig(), 32, 8)
    row = dict(zip(FEATURE_NAMES, features_of_plan(plan, H200), strict=True))
    for c in (0, 1):
        if row[f"c{c}_programs"] > 0:
            assert row[f"c{c}_ptx_regs"] > 0 and row[f"c{c}_ptx_shared_bytes"] > 0
        else:
            assert row[f"c{c}_ptx_regs"] == 0


_GQA4 = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
_GQA16 = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128}
_ALL_OFF = {"solo_units": False, "balanced_bins": False, "whole_groups": False}


@pytest.mark.parametrize(
    ("case", "heads", "rules"),
    [
        (8, _GQA4, {}),
        (8, _GQA4, {"solo_units": False}),  # 8/gqa4 plans differently since the solo rule
        (5, _GQA4, {"whole_groups": False}),  # 5/*: the root is no longer cut at 1,024 tokens
        (11, _GQA16, {"balanced_bins": False}),  # 11/gqa16: balanced bins
        (11, _GQA16, _ALL_OFF),
        (5, _GQA16, _ALL_OFF),
    ],
)
def test_record_plan_reproduces_the_measured_plan(case, heads, rules):
    # a record measured before a planner rule must be re-planned as it was measured, a newer one
    # as today
    from fasttree.costmodel.dataset import record_plan
    from fasttree.toolkit.suite import paper_tree
    from fasttree.traces import encode_tree, plan_summary

    tree = paper_tree(case)
    measured = ft.plan(tree, **heads, rules=ft.PlanRules(**rules))
    record = {
        "workload": {"tree": encode_tree(tree)},
        "config": ft.FastTreeConfig().to_dict(),
        **heads,
        "plan": plan_summary(measured),
    }
    got = record_plan(record)
    assert got.units_per_class() == measured.units_per_class()
    assert np.array_equal(got.unit_kv_len, measured.unit_kv_len)
    assert got.n_partial_rows == measured.n_partial_rows
    today = ft.plan(tree, **heads)
    assert (today.stats() != measured.stats()) == bool(rules)  # the case covers the rule


@pytest.mark.parametrize(("folder", "every"), [("h200_heldout", 1), ("h200_validate", 1), ("h200", 25)])
def test_shipped_traces_re_plan_to_their_measured_plans(folder, every):
    # the latency model's features come from re-planned records: a planner change must keep every
    # shipped record reproducible (a new rule needs its switch in costmodel.dataset._RULES)
    from pathlib import Path

    from fasttree.costmodel.dataset import _same_plan, record_plan
    from fasttree.traces import read_traces

    files = sorted((Path(__file__).parents[1] / "traces" / folder).glob("*.jsonl.gz"))
    records = [r for r in read_traces(files, kind="measurement").records if r.get("plan")][::every]
    assert len(records) >= 500
    bad = [r.get("key") for r in records if not _same_plan(record_plan(r), r["plan"])]
    assert not bad, f"{len(bad)} of {len(records)} records re-plan differently, e.g. {bad[:3]}"


def test_stage1_overlap_feature_marks_two_class_plans_measured_side_by_side():
    # v17 (7ada9e2) runs a two-class plan's stage-1 launches side by side; older traces did not
    from fasttree.costmodel.dataset import measured_with_overlap, record_features
    from fasttree.costmodel.features import STAGE1_OVERLAP, features_of_plan
    from fasttree.toolkit.suite import paper_tree
    from fasttree.traces import encode_tree, plan_summary

    heads = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    two = ft.plan(paper_tree(6), **heads)  # 6/gqa4: both tile classes
    one = ft.plan(paper_tree(10), **heads)
    assert min(two.units_per_class()) > 0 and min(one.units_per_class()) == 0
    gpu = H200
    assert features_of_plan(two, gpu)[STAGE1_OVERLAP] == 1.0
    assert features_of_plan(one, gpu)[STAGE1_OVERLAP] == 0.0

    record = {
        "workload": {"tree": encode_tree(paper_tree(6))}, "config": ft.FastTreeConfig().to_dict(), **heads,
        "plan": plan_summary(two), "env": {"git_commit": "6ad7bd2", "gpu_name": "NVIDIA H200", "gpu_sm_count": 132},
    }  # fmt: skip
    assert not measured_with_overlap(record)
    assert record_features(record, gpu)[STAGE1_OVERLAP] == 0.0
    record["env"]["git_commit"] = "cfea378"
    assert measured_with_overlap(record) and record_features(record, gpu)[STAGE1_OVERLAP] == 1.0
    record["meta"] = {"profiler": {"stage1_overlap": False}}  # what the profiler writes wins
    assert not measured_with_overlap(record)


def test_kernel_version_feature_is_the_measured_kernels_for_traces_and_the_running_ones_for_plans():
    # traces of older kernels teach the model what did not change; the tuner asks about today's kernels
    from fasttree.costmodel.dataset import KERNEL_VERSION_OF_COMMIT, measured_kernel_version, record_features
    from fasttree.costmodel.features import KERNEL_VERSION_COLUMN, features_of_plan, features_of_plans
    from fasttree.toolkit.suite import paper_tree
    from fasttree.traces import encode_tree, plan_summary
    from fasttree.versions import KERNEL_VERSION

    heads = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    plan = ft.plan(paper_tree(6), **heads)
    assert features_of_plan(plan, H200)[KERNEL_VERSION_COLUMN] == KERNEL_VERSION
    assert np.all(features_of_plans([plan, plan], H200)[:, KERNEL_VERSION_COLUMN] == KERNEL_VERSION)
    assert max(KERNEL_VERSION_OF_COMMIT.values()) <= KERNEL_VERSION

    record = {
        "workload": {"tree": encode_tree(paper_tree(6))}, "config": ft.FastTreeConfig().to_dict(), **heads,
        "plan": plan_summary(plan), "env": {"git_commit": "cfea378", "gpu_name": "NVIDIA H200", "gpu_sm_count": 132},
    }  # fmt: skip
    assert measured_kernel_version(record) == 17
    assert record_features(record, H200)[KERNEL_VERSION_COLUMN] == 17.0
    record["env"]["git_commit"] = "0123abc"  # a commit the table does not know: taken for today's kernels
    assert measured_kernel_version(record) == KERNEL_VERSION
    record["env"]["git_commit"] = None
    assert measured_kernel_version(record) == KERNEL_VERSION
    record["env"]["git_commit"] = "c072d8c"
    record["meta"] = {"profiler": {"kernel_version": 24}}  # what the profiler writes wins
    assert measured_kernel_version(record) == 24
    for junk in (True, -1, "31", 3.0, None):
        record["meta"] = {"profiler": {"kernel_version": junk}}
        assert measured_kernel_version(record) == 9  # not a version: the commit decides


@pytest.mark.parametrize(("heads", "launches"), [((32, 8, 128), 1), ((32, 32, 128), 2), ((32, 32, 256), 1)])
def test_runtime_records_are_featured_as_the_runtime_plans_and_launches_them(heads, launches):
    # a measurement of the runtime's launches is re-planned with the runtime's own rules, seen with the
    # tiles, warps and stages its launches run, and marked: the runtime_launch column, the runtime's
    # launch count, and no side-by-side stage 1 when its two launches run one after the other
    from fasttree.costmodel.dataset import WIDE_HEAD_CAP_KERNEL, _features_chunk, record_plan
    from fasttree.costmodel.features import _LAUNCHES, RUNTIME_COLUMN, STAGE1_OVERLAP, features_of_plan, mark_runtime
    from fasttree.costmodel.predict import PlanJob, features_of_jobs
    from fasttree.runtime_planning import launch_slots, launch_view, plan_for_runtime
    from fasttree.toolkit.suite import paper_tree
    from fasttree.traces import encode_tree, plan_summary, runtime_launch
    from fasttree.versions import KERNEL_VERSION

    hq, hkv, d = heads
    shape = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    tree, config = paper_tree(6), ft.FastTreeConfig(kv_tile=(64, 32), num_warps=(8, 4), num_stages=(2, 3))
    plan, _ = plan_for_runtime(tree, config, **shape)
    record = {
        "workload": {"tree": encode_tree(tree)}, "config": config.to_dict(), **shape, "plan": plan_summary(plan),
        "env": {"git_commit": "9a6a950", "gpu_name": "NVIDIA H200", "gpu_sm_count": 132},
        "launch": runtime_launch(stage1_launches=launches),
        "meta": {"profiler": {"stage1_overlap": False, "kernel_version": KERNEL_VERSION}},
    }  # fmt: skip
    seen = record_plan(record)
    assert np.array_equal(seen.unit_kv_len, plan.unit_kv_len) and seen.class_unit_ptr == plan.class_unit_ptr
    slots = launch_slots(config, hq // hkv, d, ft.PlanRules.defaults().wide_head_kv_tile)
    for c, tc in enumerate(seen.tile_classes):
        assert (tc.block_m, tc.block_n) == slots[c][:2]
        assert (tc.num_warps, tc.num_stages) == slots[0 if launches == 1 else c][2:]
    # measured before the wide-head KV-tile cap: featured with the tiles it ran
    before = {**record, "meta": {"profiler": {"stage1_overlap": False, "kernel_version": WIDE_HEAD_CAP_KERNEL - 1}}}
    uncapped = launch_slots(config, hq // hkv, d, 0)
    assert all((tc.block_m, tc.block_n) == uncapped[c][:2] for c, tc in enumerate(record_plan(before).tile_classes))
    row = record_features(record, H200)
    assert row[RUNTIME_COLUMN] == 1.0 and row[_LAUNCHES] == launches + 1
    two_classes = min(plan.units_per_class()) > 0
    assert row[STAGE1_OVERLAP] == float(launches == 1 and two_classes)
    # the batched path and a tuner's runtime job give the same row; the same job for tree_attention does not
    assert np.array_equal(_features_chunk([record], H200.to_dict())[0][0], row)
    expected = features_of_plan(launch_view(plan, config, stage1_launches=launches), H200)
    assert np.array_equal(mark_runtime(expected[None, :], launches)[0], row)
    job = PlanJob(tree, config, hq, hkv, d, "float16", runtime=True)
    assert np.array_equal(features_of_jobs([job], H200)[0], row)
    kernels = features_of_jobs([job._replace(runtime=False)], H200)[0]
    assert kernels[RUNTIME_COLUMN] == 0.0
    assert np.array_equal(kernels, features_of_plan(ft.plan(tree, config, **shape), H200))
    with pytest.raises(ValueError, match="stage1_launches must be 1 or 2"):
        mark_runtime(expected[None, :].copy(), 3)


def test_every_shipped_trace_names_the_kernels_it_timed():
    # a line with neither meta.profiler.kernel_version nor a commit in the table would be taken for
    # today's kernels: every shipped measurement must say which kernels it timed
    # the lines are read without validating them (read_traces recomputes every key: ~35 s)
    import json
    from pathlib import Path

    from fasttree.costmodel.dataset import KERNEL_VERSION_OF_COMMIT, _commit, _profiler_info
    from fasttree.traces import _expand, _lines
    from fasttree.versions import KERNEL_VERSION

    root = Path(__file__).parents[1] / "traces"
    unnamed, n = set(), 0
    for path in _expand([root / d for d in ("h200", "h200_heldout", "h200_validate", "h200_smoke")]):
        for _, line in _lines(path):
            r = json.loads(line)
            if r["kind"] != "measurement":
                continue
            n += 1
            version = _profiler_info(r).get("kernel_version")
            assert version is None or 0 <= version <= KERNEL_VERSION
            if version is None and _commit(r) not in KERNEL_VERSION_OF_COMMIT:
                unnamed.add(str(r["env"].get("git_commit")))
    assert n > 40_000
    assert not unnamed, f"commits missing from KERNEL_VERSION_OF_COMMIT: {sorted(unnamed)}"


def test_fit_time_bench_times_the_shipped_ensemble_and_one_seed(trace_file, tmp_path, capsys):
    from bench.costmodel_fit_time import main

    argv = ["--traces", str(trace_file), "--rows", "120", "--jobs", "1", "--out", str(tmp_path), "--label", "t"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "costmodel_fit_time_t.json").read_text())
    assert report["rows"] == 120 and len(report["fit_seconds"]) == 2
    assert all(s > 0 for s in report["fit_seconds"].values())
    assert "gbrt, 1 seed" in (tmp_path / "costmodel_fit_time_t.md").read_text()
    with pytest.raises(SystemExit):
        main(["--traces", str(trace_file), "--rows", "161", "--out", str(tmp_path)])
    assert "the traces hold 160 measurements" in capsys.readouterr().err


def test_all_large_records_are_featured_with_the_warps_their_kernels_ran():
    # an all-large plan's class 1 runs the large tiles: at the large class's warps from
    # ALL_LARGE_WARPS_KERNEL on, at the small class's before it (MHA: 2); 3 stages either way
    from fasttree.costmodel.dataset import ALL_LARGE_WARPS_KERNEL, record_plan
    from fasttree.traces import encode_tree, plan_summary

    parents = [-1] + [0] * 40 + [1] * 30
    tree = ft.KVTree.from_lengths(parents, [64] + [300] * 40 + [8] * 30, list(range(2, 71)))
    config = ft.FastTreeConfig(para_threshs1=(10**6, 10**6), para_threshs2=(0, 10**6))
    heads = {"num_q_heads": 4, "num_kv_heads": 4, "head_dim": 64}
    plan = ft.plan(tree, config, **heads)
    assert plan.tile_mode == "all_large"
    record = {
        "workload": {"tree": encode_tree(tree)}, "config": config.to_dict(), **heads, "plan": plan_summary(plan),
        "env": {"git_commit": None, "gpu_name": "NVIDIA H200", "gpu_sm_count": 132},
    }  # fmt: skip
    for version, launched in ((ALL_LARGE_WARPS_KERNEL, (4, 3)), (ALL_LARGE_WARPS_KERNEL - 1, (2, 3))):
        record["meta"] = {"profiler": {"kernel_version": version}}
        large, small = record_plan(record).tile_classes
        assert (large.num_warps, large.num_stages) == (4, 5)
        assert (small.block_m, small.num_warps, small.num_stages) == (large.block_m, *launched)


def test_a_record_timed_todays_launches_unless_a_later_kernel_change_reaches_it():
    # the held-out traces that calibrate the tuner's margins stay usable where a kernel change
    # does not reach them: the wide-head cap above head dim 128, the all-large warps where the
    # record's config gives its classes different warps
    from fasttree.costmodel.dataset import ALL_LARGE_WARPS_KERNEL, WIDE_HEAD_CAP_KERNEL, timed_todays_launches
    from fasttree.versions import KERNEL_VERSION

    def record(version, head_dim=128, g=4, mode="two_classes", warps=None, runtime=False):
        r = {
            "num_q_heads": 8 * g, "num_kv_heads": 8, "head_dim": head_dim, "plan": {"tile_mode": mode},
            "config": ft.FastTreeConfig(num_warps=warps).to_dict(), "env": {"git_commit": None},
            "meta": {"profiler": {"kernel_version": version}},
        }  # fmt: skip
        if runtime:
            r["launch"] = {"stage1_launches": 1, "query_centric": "auto"}
        return r

    old = WIDE_HEAD_CAP_KERNEL - 2  # 30: before both changes
    assert timed_todays_launches(record(KERNEL_VERSION, head_dim=256, g=1, mode="all_large"))
    assert timed_todays_launches(record(old)) and not timed_todays_launches(record(old - 1))
    assert not timed_todays_launches(record(old, head_dim=256))
    assert timed_todays_launches(record(WIDE_HEAD_CAP_KERNEL, head_dim=256))
    assert timed_todays_launches(record(old, g=4, mode="all_large"))  # GQA: the same warps in both classes
    assert not timed_todays_launches(record(old, g=1, mode="all_large"))  # MHA: 4 and 2 warps
    assert not timed_todays_launches(record(old, g=4, mode="all_large", warps=(8, 4)))
    assert timed_todays_launches(record(old, g=1, mode="all_large", runtime=True))  # the runtime's slot 0 ran it
    assert timed_todays_launches(record(ALL_LARGE_WARPS_KERNEL, g=1, mode="all_large"))
    no_summary = record(old, g=1)
    no_summary["plan"] = None
    assert not timed_todays_launches(no_summary)


def test_the_sm90_stage1_reaches_64_row_tree_attention_records_at_head_dim_128_on_sm90():
    # records of tree_attention plans with a 64-row class at head dim 128 on an sm_90 GPU, measured
    # before the Gluon stage 1, no longer time today's launches; other records, other GPUs and the
    # runtime's fixed launch (Triton) still do
    from fasttree.costmodel.dataset import SM90_STAGE1_KERNEL, timed_todays_launches

    def record(q_tiles, units, g=16, head_dim=128, cc="9.0", runtime=False, version=SM90_STAGE1_KERNEL - 2):
        r = {
            "num_q_heads": 2 * g, "num_kv_heads": 2, "head_dim": head_dim,
            "plan": {"tile_mode": "two_classes", "q_tiles": q_tiles, "units": units},
            "config": ft.FastTreeConfig().to_dict(), "env": {"git_commit": None, "compute_capability": cc},
            "meta": {"profiler": {"kernel_version": version}},
        }  # fmt: skip
        if runtime:
            r["launch"] = {"stage1_launches": 1, "query_centric": "auto"}
        return r

    assert not timed_todays_launches(record([4, 1], [10, 5]))  # 64 rows at GQA 16
    assert timed_todays_launches(record([4, 1], [0, 5]))  # the 64-row class empty
    assert not timed_todays_launches(record([16, 4], [3, 0], g=4))  # 64 rows at GQA 4
    assert timed_todays_launches(record([8, 4], [3, 7], g=4))  # 32 and 16 rows
    assert not timed_todays_launches(record([64, 16], [1, 9], g=1))  # MHA: 64-query tiles
    assert timed_todays_launches(record([4, 1], [10, 5], head_dim=64))  # no Gluon tile at D 64
    assert timed_todays_launches(record([4, 1], [10, 5], head_dim=256))
    assert timed_todays_launches(record([4, 1], [10, 5], cc="8.0"))  # not sm_90
    assert timed_todays_launches(record([4, 1], [10, 5], runtime=True))  # the fixed launch
    assert timed_todays_launches(record([4, 1], [10, 5], version=SM90_STAGE1_KERNEL))
    no_summary = record([4, 1], [10, 5])
    no_summary["plan"] = {"tile_mode": "two_classes"}
    assert not timed_todays_launches(no_summary)


def test_measurements_of_the_runtimes_launch_variants_are_left_out_of_the_dataset(trace_file, tmp_path):
    # validate times the runtime as servers run it; the model's runtime target is the fixed launch
    from fasttree.traces import runtime_launch

    recs = read_traces(trace_file).records[:4]
    variants = copy.deepcopy(recs[0])
    served = measurement_record(
        env=variants["env"], family=variants["workload"]["family"], seed=variants["workload"]["seed"],
        tree=variants["workload"]["tree"], num_q_heads=variants["num_q_heads"],
        num_kv_heads=variants["num_kv_heads"], head_dim=variants["head_dim"], dtype=variants["dtype"],
        config=variants["config"], plan=variants["plan"], timing=variants["timing"], correct=None,
        max_rel_err=None, launch=runtime_launch(stage1_launches=1, variants=True),
    )  # fmt: skip
    path = tmp_path / "with_variants.jsonl"
    with TraceWriter(path) as w:
        for r in [*recs, served]:
            w.append(r)
    ds = load_dataset(path, workers=1)
    assert len(ds) == 4 and served["key"] not in set(ds.keys.tolist())
