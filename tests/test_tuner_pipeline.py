"""From workload steps to a portfolio: tree families (``family_of``), family balancing, the selection
problem of a ``LatencyObjective`` on small real trees under a stub latency model, ``build_portfolio`` and
``fence_portfolio`` on its predictions, and small ``tune_portfolios`` runs with the shipped model."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

if torch.cuda.is_available() and importlib.util.find_spec("optuna") is None:  # the device image (conftest.py)
    pytest.skip("the tuner needs Optuna", allow_module_level=True)

import fasttree as ft
from fasttree import FastTreeConfig, Portfolio, tree_features
from fasttree.costmodel.calibration import GainMargin
from fasttree.costmodel.features import FEATURE_NAMES, features_of_plans
from fasttree.costmodel.gpu import gpu_spec
from fasttree.toolkit.shipped import model_path, workloads_path
from fasttree.toolkit.validate import family_of_record
from fasttree.traces import read_traces
from fasttree.tuner import Bucket, LatencyObjective, WorkloadStep, steps_by_bucket
from fasttree.tuner.objective import balance_families, family_of, runtime_member
from fasttree.tuner.pipeline import tune_portfolios
from fasttree.tuner.portfolio import DESIGNS, build_portfolio, fence_portfolio, score, selection_problem

ROOT = Path(__file__).resolve().parents[1]
MODEL = model_path()
GPU = gpu_spec("NVIDIA H200")
G4 = Bucket(4, 128, "float16")
HEADS = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SMALL_TILES = FastTreeConfig(kv_tile=(32, 32))
#: The defaults, a config the stub model predicts 40% faster on trees of 64 queries or more (10% slower
#: below), and one it predicts the same as the defaults everywhere.
CONFIGS = (FastTreeConfig(), SMALL_TILES, FastTreeConfig(alpha=0.4))
N_QUERIES = FEATURE_NAMES.index("n_queries")
KV_TILE = FEATURE_NAMES.index("c0_block_n")


class TileModel:
    """A stub latency model: 10 + queries us, times 0.6 on trees of 64 queries or more planned with
    32-token KV tiles and 1.1 on smaller trees planned with them."""

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X)
        n = X[:, N_QUERIES]
        factor = np.where(X[:, KV_TILE] == 32, np.where(n >= 64, 0.6, 1.1), 1.0)
        return (10.0 + n) * factor


def _steps(queries, prefix: int, weight: float = 1.0) -> list[WorkloadStep]:
    """Trees of two families: ``few_shot`` (a prefix and a leaf per query) and ``serving/chat`` (a prefix,
    two branches, a leaf per query), one of each per entry of ``queries``."""
    out = []
    for i, q in enumerate(queries):
        tree = ft.KVTree.from_levels([1, q], [prefix + 7 * i, 20 + i])
        out.append(WorkloadStep(tree, 32, 8, weight, f"few_shot/families/seed0/step{i}"))
    for i, q in enumerate(queries):
        tree = ft.KVTree.from_levels([1, 2, q], [prefix + 5 * i, 64, 12 + i])
        out.append(WorkloadStep(tree, 32, 8, weight, f"serving/chat/seed0/step{i}"))
    return out


#: small trees' queries: each a tree plan with either KV tile (at 2 queries the 32-token tiles' plan is decode's)
SMALL_Q, LARGE_Q = (5, 4, 8, 16, 32, 6, 12, 24), (64, 96, 128, 192, 256, 80, 160, 72)


@pytest.fixture(scope="module")
def train_steps() -> list[WorkloadStep]:
    return _steps(SMALL_Q + LARGE_Q, prefix=300)


@pytest.fixture(scope="module")
def valid_steps() -> list[WorkloadStep]:
    return _steps((3, 10, 40, 20, 100, 70, 200, 120), prefix=900)


def _large(steps) -> np.ndarray:
    return np.array([s.tree.n_queries >= 64 for s in steps])


# ------------------------------------------------------------------------- families
@pytest.mark.parametrize(
    ("label", "family"),
    [
        ("few_shot/families/seed0/step3", "few_shot"),
        ("serving/chat/seed1/step17", "serving/chat"),
        ("serving/few_shot/seed0/step0", "serving/few_shot"),
        ("paper/paper_suite_gqa4/seedNone/step1", "paper"),
        ("serving", "serving"),
        ("", ""),
    ],
)
def test_family_of_a_step_label(label, family):
    step = WorkloadStep(ft.KVTree.from_levels([1, 2], [10, 3]), 4, 1, label=label)
    assert family_of(step) == family


def test_family_of_a_step_is_the_family_of_its_record():
    paths = [
        workloads_path() / "paper_suite.jsonl.gz",
        workloads_path("heldout") / "few_shot_mistral_7b.jsonl.gz",
        workloads_path("heldout") / "families_mistral_7b.jsonl.gz",
    ]
    seen = set()
    for path in paths:
        records = read_traces(path, kind="workload").records
        for r in records[:: max(1, len(records) // 9)]:
            ((step,),) = steps_by_bucket([r]).values()
            assert family_of(step) == family_of_record(r)
            seen.add(family_of(step))
    assert {"paper", "serving/few_shot", "paper_random"} <= seen and len(seen) >= 5


class ZeroModel:
    """A broken stub model: every step takes 0 us."""

    def predict(self, X: np.ndarray) -> np.ndarray:
        return np.zeros(len(X))


def test_balance_families_refuses_a_model_predicting_no_time():
    steps = [WorkloadStep(ft.KVTree.from_levels([1, 4], [100, 9]), 32, 8, 1.0, "a/x/seed0/step0")]
    with pytest.raises(ValueError, match="must be positive and finite"):
        balance_families(steps, ZeroModel(), GPU, G4)


def test_balance_families_counts_every_family_and_every_step_of_a_family_the_same():
    tree = lambda q, p: ft.KVTree.from_levels([1, q], [p, 9])  # noqa: E731
    steps = [
        WorkloadStep(tree(4, 100), 32, 8, 1.0, "a/x/seed0/step0"),
        WorkloadStep(tree(64, 2000), 32, 8, 1.0, "b/x/seed0/step0"),
        WorkloadStep(tree(8, 200), 32, 8, 3.0, "b/x/seed1/step0"),  # a tree plan with either KV tile
        *[WorkloadStep(tree(q, 500 + q), 32, 8, 16.0, f"serving/chat/seed0/step{q}") for q in (2, 16, 100, 200, 7)],
    ]
    model = TileModel()
    for runtime in (False, True):
        balanced = balance_families(steps, model, GPU, G4, runtime=runtime)
        assert [(s.tree, s.label) for s in balanced] == [(s.tree, s.label) for s in steps]
        base = LatencyObjective(steps, model, GPU, G4, runtime=runtime).defaults.step_us
        share = np.array([s.weight for s in balanced]) * base  # each step's weighted defaults time
        # three families: each 1/3, shared equally by its steps whatever their size and input weight
        np.testing.assert_allclose(share, [1 / 3] + [1 / 6] * 2 + [1 / 15] * 5, rtol=1e-12)
        objective = LatencyObjective(balanced, model, GPU, G4, runtime=runtime)
        assert objective.defaults.total_us == pytest.approx(1.0, rel=1e-12)
        same = balance_families([replace(s, weight=1.0) for s in steps], model, GPU, G4, runtime=runtime)
        assert [s.weight for s in same] == pytest.approx([s.weight for s in balanced], rel=1e-12)
    # kernels' objective: the mean over families of each family's mean step ratio
    objective = LatencyObjective(balance_families(steps, model, GPU, G4), model, GPU, G4)
    ratio = objective.evaluate(SMALL_TILES).step_us / objective.defaults.step_us
    by_family = {"a": ratio[:1].mean(), "b": ratio[1:3].mean(), "serving/chat": ratio[3:].mean()}
    assert objective.evaluate(SMALL_TILES).total_us == pytest.approx(np.mean(list(by_family.values())), rel=1e-12)
    assert objective.family_ratios(objective.evaluate(SMALL_TILES)) == pytest.approx(by_family, rel=1e-12)
    assert by_family["b"] == pytest.approx((0.6 + 1.1) / 2)  # one large tree, one small


# ------------------------------------------------------------------ selection problem
def test_selection_problem_predicts_every_candidate_on_every_step(train_steps):
    objective = LatencyObjective(train_steps, TileModel(), GPU, G4)
    problem = selection_problem(objective, CONFIGS)
    n = len(train_steps)
    assert problem.family_names == ("few_shot", "serving/chat")
    np.testing.assert_array_equal(problem.family, np.repeat([0, 1], n // 2))
    np.testing.assert_array_equal(problem.features, np.stack([tree_features(s.tree) for s in train_steps]))
    np.testing.assert_allclose(problem.ratio[:, 0], 1.0)
    np.testing.assert_allclose(problem.ratio[:, 1], np.where(_large(train_steps), 0.6, 1.1), rtol=1e-12)
    np.testing.assert_allclose(problem.ratio[:, 2], 1.0, rtol=1e-12)
    np.testing.assert_allclose(problem.weight, 1 / n)  # two families of n / 2 trees
    np.testing.assert_array_equal(problem.layouts, np.tile([8, 4], (n, 1)))  # 32/8 heads: 8 KV heads, GQA 4
    with pytest.raises(ValueError, match="FastTreeConfig"):
        selection_problem(objective, CONFIGS[1:])
    # for the runtime the KV tile is a launch field every member keeps at the defaults': nothing changes
    runtime = selection_problem(LatencyObjective(train_steps, TileModel(), GPU, G4, runtime=True), CONFIGS)
    np.testing.assert_allclose(runtime.ratio, 1.0, rtol=1e-12)


def test_build_portfolio_on_the_predictions_switches_only_the_large_trees(train_steps, valid_steps):
    model = TileModel()
    train = selection_problem(LatencyObjective(train_steps, model, GPU, G4), CONFIGS)
    valid_objective = LatencyObjective(valid_steps, model, GPU, G4)
    valid = selection_problem(valid_objective, CONFIGS)
    result = build_portfolio(CONFIGS, train, valid)
    assert len(result.tried) == len(DESIGNS)
    portfolio = result.portfolio
    assert portfolio.members == (FastTreeConfig(), SMALL_TILES)
    # half of each family's trees are large: (0.6 + 1) / 2
    assert result.train["objective"] == pytest.approx(0.8) and result.valid["objective"] == pytest.approx(0.8)
    assert result.valid["worst_tree"] == 1.0 and result.valid["regret"] == pytest.approx(0.0)
    for steps in (train_steps, valid_steps):
        picked = [portfolio.select(s.tree) for s in steps]
        assert picked == [SMALL_TILES if large else FastTreeConfig() for large in _large(steps)]
    # planning with the portfolio itself and predicting again gives the validation score
    plans = [ft.plan(s.tree, portfolio, **HEADS) for s in valid_steps]
    ratio = model.predict(features_of_plans(plans, GPU)) / valid_objective.defaults.step_us
    half = len(valid_steps) // 2
    expected = {"few_shot": ratio[:half].mean(), "serving/chat": ratio[half:].mean()}
    assert result.valid["families"] == pytest.approx(expected, rel=1e-12)
    assert score(valid, (0, 1), portfolio.selector) == result.valid
    # fenced: the validation trees of the large leaf are predicted 40% faster
    fenced = fence_portfolio(result, train, valid, 0.3)
    region = fenced.portfolio.regions[2]
    assert region.layouts == ((8, 4),) and region.trees == int(_large(valid_steps).sum()) == 8
    served = fenced.portfolio.for_heads(32, 8)
    assert [served.select(s.tree) for s in valid_steps] == [
        SMALL_TILES if large else FastTreeConfig() for large in _large(valid_steps)
    ]
    assert fenced.valid == result.valid  # every validation tree of the leaf lies in its region
    # the tuning trees' prefixes (300 tokens) are shorter than any validation tree's (900): outside the box
    assert [served.select(s.tree) for s in train_steps] == [FastTreeConfig()] * len(train_steps)
    assert fenced.train["objective"] == 1.0 and fenced.train["picks"] == [len(train_steps), 0]
    assert portfolio.for_heads(32, 8).select(train_steps[-1].tree) == SMALL_TILES  # unfenced: served
    assert fenced.portfolio.for_heads(8, 2).select(valid_steps[-1].tree) == FastTreeConfig()  # 2 KV heads: outside
    # a margin above the predicted 40% gain keeps the defaults everywhere, the member kept as a candidate
    cautious = fence_portfolio(result, train, valid, 0.45)
    assert cautious.portfolio.members == portfolio.members and not any(cautious.portfolio.selector.member)
    assert cautious.valid["objective"] == 1.0
    # the runtime cannot change KV tiles: its portfolio is the defaults alone
    rt = [LatencyObjective(s, model, GPU, G4, runtime=True) for s in (train_steps, valid_steps)]
    rt_result = build_portfolio(CONFIGS, *(selection_problem(o, CONFIGS) for o in rt), runtime=True)
    assert rt_result.portfolio == Portfolio(runtime=True)
    assert rt_result.valid["objective"] == pytest.approx(1.0)


# --------------------------------------------------------------------- tune_portfolios
def test_tune_portfolios_on_a_few_paper_trees(tmp_path):
    paper = steps_by_bucket(read_traces(workloads_path() / "paper_suite.jsonl.gz", kind="workload").records)
    train = {G4: paper[G4][:4]}
    valid = {G4: paper[G4][4:7]}
    margins = {(G4.label, "tree_attention"): GainMargin(margin=0.0, pairs=40, quantile=0.8)}
    results = tune_portfolios(train, valid, MODEL, folder=tmp_path, base_name="t", n_trials=2, polish_passes=0,
                              every=16, jobs=1, importances=False, margins=margins, calibration="here")  # fmt: skip
    assert [(r.bucket, r.target) for r in results] == [(G4, "tree_attention"), (G4, "runtime")]
    kernels, runtime = results
    assert (kernels.tune.study_name, runtime.tune.study_name) == ("t-g4-d128-float16", "t-rt-g4-d128-float16")
    for r in results:
        assert (r.n_steps, r.n_valid_steps) == (4, 3) and r.tune.n_complete == 2
        assert r.n_candidates == len(r.tune.candidates) >= 2 and r.tune.candidates[0] == FastTreeConfig()
        p = r.portfolio
        assert p.portfolio.runtime is (r.target == "runtime")
        assert p.portfolio.members[0] == FastTreeConfig() and set(p.portfolio.members) <= set(r.tune.candidates)
        assert p.train["objective"] <= 1.0 + 1e-12  # the rules never let a tuning family lose
        assert p.valid is not None and sum(p.valid["picks"]) == 3 and len(p.tried) == len(DESIGNS)
        assert r.elapsed_s > 0
        assert p.evidence["split"] == "validation" and len(p.evidence["leaves"]) == sum(
            f < 0 for f in p.portfolio.selector.feature
        )
    # the calibrated target records its margin; the other, without one, serves the defaults everywhere
    assert kernels.portfolio.evidence["margin"] == 0.0
    assert kernels.portfolio.evidence["calibration"] == {"margin": 0.0, "pairs": 40, "quantile": 0.8, "source": "here"}
    assert runtime.portfolio.evidence["margin"] is None and runtime.portfolio.evidence["calibration"] is None
    assert not any(runtime.portfolio.portfolio.selector.member)
    # the runtime's candidates keep the defaults' launch fields
    assert all(runtime_member(c) == c for c in runtime.tune.candidates)
    # without validation steps: the most cautious design
    (alone,) = tune_portfolios(train, {}, MODEL, targets=("tree_attention",), folder=tmp_path, base_name="t",
                               n_trials=2, polish_passes=0, every=16, jobs=1, importances=False)  # fmt: skip
    assert alone.n_valid_steps == 0 and alone.portfolio.valid is None
    assert alone.portfolio.rules.margin == max(d[0] for d in DESIGNS)
    assert alone.tune.n_complete == 2  # the study of the first call, joined: no new trial
