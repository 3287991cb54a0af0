"""fasttree.tuner.portfolio on synthetic selection problems: when a selector leaves the defaults (margin,
tree and family losses), the greedy portfolio choice, ``score`` by hand, ``build_portfolio``'s choice
of a design on the validation trees, and ``fence_portfolio``: a leaf serves its member only where the
validation trees' predicted gain exceeds the calibrated margin, fenced by their region."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if torch.cuda.is_available() and importlib.util.find_spec("optuna") is None:  # the device image (conftest.py)
    pytest.skip("the tuner needs Optuna", allow_module_level=True)

from fasttree import FastTreeConfig, Portfolio, Selector
from fasttree.export import ConfigExport, ExportEntry, ExportGuard, write_export
from fasttree.portfolio import TREE_FEATURES
from fasttree.tuner.portfolio import (
    DESIGNS,
    EVIDENCE_MIN_TREES,
    VALID_TREE_LOSS,
    SelectionProblem,
    SelectionRules,
    build_portfolio,
    choose_portfolio,
    fence_portfolio,
    fit_selector,
    score,
)

Q = TREE_FEATURES.index("log2_queries")
SMALL = (0.0, 1.0, 2.0, 3.0, 4.0)
LARGE = (6.0, 7.0, 8.0, 9.0, 10.0)
#: Candidate configs by column; they differ in planning fields only, so they may serve the runtime too.
CONFIGS = (FastTreeConfig(), FastTreeConfig(alpha=0.4), FastTreeConfig(gamma=-0.5), FastTreeConfig(pack_tokens=0))


def _problem(queries, family, *columns, names=None, seed=0, layout=(8, 4)) -> SelectionProblem:
    """Trees with ``log2_queries`` = ``queries`` and noise in the other features, all at head layout
    ``layout``; ratio column 0 the defaults, then ``columns``."""
    queries = np.asarray(queries, dtype=np.float64)
    features = np.random.default_rng(seed).uniform(0.0, 1.0, size=(queries.size, len(TREE_FEATURES)))
    features[:, Q] = queries
    family = np.asarray(family)
    names = names or tuple(f"f{i}" for i in range(int(family.max()) + 1))
    ratio = np.column_stack([np.ones(queries.size), *[np.asarray(c, dtype=np.float64) for c in columns]])
    return SelectionProblem(features, ratio, family, names, np.tile(layout, (queries.size, 1)))


def _cycle(values, n: int) -> np.ndarray:
    return np.resize(np.asarray(values, dtype=np.float64), n)


def _leaves(selector: Selector) -> list[int]:
    return [m for f, m in zip(selector.feature, selector.member, strict=True) if f < 0]


def _picks(problem: SelectionProblem, selector: Selector) -> np.ndarray:
    return np.array([selector.member_of(x) for x in problem.features])


# ------------------------------------------------------------------------- the problem
def test_problem_weights_count_every_family_the_same_and_refuse_bad_input():
    p = _problem([1, 2, 3, 4], [0, 0, 0, 1], [0.9, 0.9, 0.9, 0.9])
    np.testing.assert_allclose(p.weight, [1 / 6, 1 / 6, 1 / 6, 1 / 2])
    assert p.n_candidates == 2
    with pytest.raises(ValueError, match="column 0"):
        SelectionProblem(p.features, np.column_stack([p.ratio[:, 1], p.ratio[:, 0]]), p.family, p.family_names)
    with pytest.raises(ValueError, match="features"):
        SelectionProblem(p.features[:, :3], p.ratio, p.family, p.family_names)
    with pytest.raises(ValueError, match="family"):
        SelectionProblem(p.features, p.ratio, np.array([0, 0, 0, 2]), p.family_names)
    with pytest.raises(ValueError, match="positive"):
        SelectionProblem(p.features, p.ratio * np.array([1.0, -1.0]), p.family, p.family_names)
    with pytest.raises(ValueError, match="defaults"):
        fit_selector(p, [1])


# ---------------------------------------------------------------------- the selector
def _large_trees_of_one_family() -> tuple[SelectionProblem, np.ndarray]:
    # family 0: 16 small and 16 large trees; family 1: 32 small trees. The candidate is 30% faster on
    # family 0's large trees and 10% slower on every other tree.
    queries = np.concatenate([_cycle(SMALL, 16), _cycle(LARGE, 16), _cycle(SMALL, 32)])
    family = np.repeat([0, 0, 1], [16, 16, 32])
    large = queries > 5
    return _problem(queries, family, np.where(large, 0.7, 1.1)), large


def test_selector_splits_where_a_candidate_wins_and_keeps_the_defaults_elsewhere():
    problem, large = _large_trees_of_one_family()
    rules = SelectionRules(margin=0.05, max_depth=2, min_leaf=4)
    selector, objective = fit_selector(problem, [0, 1], rules)
    # one split on the tree's queries, between the small (<= 4) and the large (>= 6) trees
    assert selector.feature == (Q, -1, -1)
    assert 4.0 < selector.threshold[0] < 6.0
    assert _leaves(selector) == [0, 1]
    np.testing.assert_array_equal(_picks(problem, selector), large.astype(int))
    # family 0: half its trees 0.7, half 1.0 -> 0.85; family 1: 1.0 -> mean 0.925
    assert objective == pytest.approx(0.925)
    s = score(problem, [0, 1], selector)
    assert s["objective"] == pytest.approx(objective)
    assert s["families"] == pytest.approx({"f0": 0.85, "f1": 1.0})
    assert s["worst_tree"] == 1.0 and s["picks"] == [48, 16] and s["regret"] == pytest.approx(0.0)
    choice = choose_portfolio(problem, rules)
    assert choice.members == (0, 1) and choice.objective == pytest.approx(0.925)


def test_a_gain_below_the_margin_is_never_picked():
    queries = np.concatenate([_cycle(SMALL, 16), _cycle(LARGE, 16)])
    problem = _problem(queries, np.repeat([0, 1], 16), np.full(32, 0.97))
    for depth in (0, 1, 3):
        rules = SelectionRules(margin=0.05, max_depth=depth, min_leaf=1)
        selector, objective = fit_selector(problem, [0, 1], rules)
        assert set(_leaves(selector)) == {0} and objective == 1.0
        assert choose_portfolio(problem, rules).members == (0,)
    # a margin below the gain picks it (the rule, not the problem, kept it out)
    selector, objective = fit_selector(problem, [0, 1], SelectionRules(margin=0.02, max_depth=0))
    assert _leaves(selector) == [1] and objective == pytest.approx(0.97)


def test_a_leaf_is_not_switched_when_its_best_member_makes_one_tree_slower():
    queries = _cycle(SMALL + LARGE, 20)
    column = np.full(20, 0.8)
    column[5] = 1.05  # one tree 5% slower, the leaf 19% faster
    problem = _problem(queries, np.repeat([0, 1], 10), column)
    selector, objective = fit_selector(problem, [0, 1], SelectionRules(max_depth=0, tree_loss=0.0))
    assert _leaves(selector) == [0] and objective == pytest.approx(1.0)
    selector, objective = fit_selector(problem, [0, 1], SelectionRules(max_depth=0, tree_loss=0.1))
    assert _leaves(selector) == [1] and objective == pytest.approx((19 * 0.8 + 1.05) / 20)
    # deeper selectors may switch part of the trees, never the slower one
    for depth, min_leaf in ((1, 2), (2, 4), (3, 1)):
        selector, _ = fit_selector(problem, [0, 1], SelectionRules(max_depth=depth, min_leaf=min_leaf))
        assert score(problem, [0, 1], selector)["worst_tree"] <= 1.0
        assert _picks(problem, selector)[5] == 0


def test_a_family_that_would_lose_keeps_its_leaf_on_the_defaults():
    # one leaf (depth 0): family 0 30% faster, family 1 10% slower (each tree within tree_loss) -> 10% overall
    problem = _problem(_cycle(SMALL, 32), np.repeat([0, 1], 16), np.repeat([0.7, 1.1], 16))
    rules = SelectionRules(max_depth=0, tree_loss=0.2, family_loss=0.0)
    selector, objective = fit_selector(problem, [0, 1], rules)
    assert _leaves(selector) == [0] and objective == pytest.approx(1.0)
    selector, objective = fit_selector(problem, [0, 1], SelectionRules(max_depth=0, tree_loss=0.2, family_loss=0.15))
    assert _leaves(selector) == [1] and objective == pytest.approx(0.9)
    # deeper selectors may switch leaves of family 0's trees, never a leaf that holds one of family 1
    selector, _ = fit_selector(problem, [0, 1], SelectionRules(max_depth=3, min_leaf=2, tree_loss=0.2))
    assert not _picks(problem, selector)[16:].any()
    assert score(problem, [0, 1], selector)["families"]["f1"] == 1.0


# ------------------------------------------------------------------------ the members
def _four_groups() -> SelectionProblem:
    """Four groups of 16 trees (one family each, told apart by their queries): candidate 1 is 25%
    faster on groups 0 and 1, candidate 2 40% faster on group 0, candidate 3 40% faster on group 1."""
    group = np.repeat([0, 1, 2, 3], 16)
    on = lambda *groups, r: np.where(np.isin(group, groups), r, 1.0)  # noqa: E731
    return _problem(group * 3.0, group, on(0, 1, r=0.75), on(0, r=0.6), on(1, r=0.6))


def test_choose_portfolio_stops_at_max_members_and_drops_members_no_leaf_names():
    problem = _four_groups()
    rules = SelectionRules(margin=0.05, max_depth=2, min_leaf=8)
    one = choose_portfolio(problem, rules, max_members=1)
    assert one.members == (0,) and one.objective == 1.0 and set(_leaves(one.selector)) == {0}
    # round 1: candidate 1 (0.875) beats 2 and 3 (0.9 each)
    two = choose_portfolio(problem, rules, max_members=2)
    assert two.members == (0, 1) and two.objective == pytest.approx(0.875)
    # round 2: 2 and 3 tie (0.8375); the first is kept; candidate 1 still serves group 1
    three = choose_portfolio(problem, rules, max_members=3)
    assert three.members == (0, 1, 2) and three.objective == pytest.approx(0.8375)
    assert sorted(set(_leaves(three.selector))) == [1, 2]
    # round 3: 3 takes group 1 from 1, which no leaf names any more: it is dropped, the leaves renumbered
    four = choose_portfolio(problem, rules, max_members=4)
    assert four.members == (0, 2, 3) and four.objective == pytest.approx(0.8)
    assert sorted(set(_leaves(four.selector))) == [1, 2]
    assert score(problem, four.members, four.selector)["objective"] == pytest.approx(0.8)
    np.testing.assert_array_equal(_picks(problem, four.selector), np.repeat([1, 2, 2, 2], 16))  # 3 is 1.0 on 2, 3
    # a round must gain min_gain: 0.875 -> 0.8375 is 0.0375
    assert choose_portfolio(problem, rules, max_members=4, min_gain=0.05).members == (0, 1)
    with pytest.raises(ValueError):
        choose_portfolio(problem, rules, max_members=0)


def test_score_by_hand():
    # trees 0-2 in family "a" (weight 1/6 each), tree 3 in family "b" (1/2); trees 0 and 1 go left
    problem = _problem([1, 1, 2, 2], [0, 0, 0, 1], [0.5, 1.2, 0.8, 0.9], [0.9, 0.7, 1.0, 0.6], names=("a", "b"))
    selector = Selector(feature=(Q, -1, -1), threshold=(1.5, 0, 0), left=(1, -1, -1), right=(2, -1, -1),
                        member=(0, 1, 2))  # fmt: skip
    s = score(problem, (0, 1, 2), selector)
    # picked: column 1 on trees 0, 1 (0.5, 1.2), column 2 on trees 2, 3 (1.0, 0.6)
    assert s["families"] == pytest.approx({"a": (0.5 + 1.2 + 1.0) / 3, "b": 0.6})
    assert s["objective"] == pytest.approx((0.5 + 1.2 + 1.0) / 6 + 0.6 / 2)  # 0.75
    assert s["worst_tree"] == pytest.approx(1.2)
    assert s["picks"] == [0, 2, 2]
    best = (0.5 + 0.7 + 0.8) / 6 + 0.6 / 2  # the best member per tree
    assert s["regret"] == pytest.approx(0.75 / best - 1)
    # member positions name candidate columns: swapped, the left trees get column 2 and the right column 1
    s = score(problem, (0, 2, 1), selector)
    assert s["families"] == pytest.approx({"a": (0.9 + 0.7 + 0.8) / 3, "b": 0.9})
    assert s["worst_tree"] == pytest.approx(0.9)
    # the defaults alone score exactly 1
    d = score(problem, (0,), Selector())
    assert d["objective"] == pytest.approx(1.0) and d["families"] == {"a": 1.0, "b": 1.0}
    assert (d["worst_tree"], d["picks"], d["regret"]) == (1.0, [4], pytest.approx(0.0))


# ------------------------------------------------------------------- build_portfolio
def _split_problem(small, large, seed: int, n: int = 32) -> SelectionProblem:
    """Two families of ``n`` trees each, half small and half large; candidate 1 ``small`` / ``large`` on
    them (scalars or per-tree arrays over the 2n trees), candidate 2 20% slower everywhere."""
    queries = np.tile(np.concatenate([_cycle(SMALL, n // 2), _cycle(LARGE, n // 2)]), 2)
    is_large = queries > 5
    column = np.where(is_large, large, small)
    return _problem(queries, np.repeat([0, 1], n), column, np.full(2 * n, 1.2), seed=seed)


#: depth 0 (one leaf for the bucket), depth 1, and a margin nothing passes
D_ONE_LEAF, D_SPLIT, D_CAUTIOUS = (0.05, 2, 0, 8), (0.05, 2, 1, 8), (0.5, 2, 1, 8)
TREE_LOSS = SelectionRules(tree_loss=0.1)


def test_build_portfolio_keeps_the_best_design_that_passes_the_validation_constraints():
    # tuning: the candidate is 30% faster on large trees and 4% slower on small ones (within tree_loss);
    # one leaf switches every tree (0.87), a split only the large ones (0.85)
    train = _split_problem(1.04, 0.7, seed=1)
    # validation: 10% faster on small trees too, but one of them is 4% slower: the one-leaf design scores
    # better (about 0.80) and fails the validation tree limit, the split passes (0.85), the cautious one
    # passes at 1.0
    small = np.full(64, 0.9)
    small[0] = 1.04
    valid = _split_problem(small, 0.7, seed=2, n=32)
    result = build_portfolio(CONFIGS[:3], train, valid, designs=[D_ONE_LEAF, D_SPLIT, D_CAUTIOUS],
                             base_rules=TREE_LOSS)  # fmt: skip
    one_leaf, split, cautious = result.tried
    assert one_leaf["valid"]["objective"] < split["valid"]["objective"] < cautious["valid"]["objective"]
    assert one_leaf["valid"]["worst_tree"] > 1 + VALID_TREE_LOSS
    assert cautious["valid"]["objective"] == 1.0
    assert (result.rules.margin, result.rules.max_depth, result.rules.min_leaf) == (0.05, 1, 8)
    assert result.rules.tree_loss == 0.1  # the base rules' losses are kept
    assert result.valid == split["valid"] and result.valid["objective"] == pytest.approx(0.85)
    assert result.train == split["train"] and result.train["objective"] == pytest.approx(0.85)
    p = result.portfolio
    assert p.members == (FastTreeConfig(), CONFIGS[1]) and not p.runtime
    assert [one_leaf["members"], split["members"], cautious["members"]] == [2, 2, 1]


def test_build_portfolio_falls_back_to_the_defaults_when_no_design_passes():
    train = _split_problem(1.04, 0.7, seed=1)
    # every validation tree 1% slower: within the tree limit, but every family would lose
    valid = _split_problem(1.01, 1.01, seed=2)
    result = build_portfolio(CONFIGS[:3], train, valid, designs=[D_ONE_LEAF, D_SPLIT], base_rules=TREE_LOSS)
    assert len(result.tried) == 2 and all(t["members"] == 2 for t in result.tried)
    assert all(max(t["valid"]["families"].values()) > 1.0 for t in result.tried)
    assert result.portfolio == Portfolio()
    assert result.rules.margin == 0.05
    assert result.train["objective"] == 1.0 and result.valid["objective"] == 1.0
    assert result.valid["picks"] == [64]


def test_build_portfolio_without_validation_takes_the_most_cautious_design():
    train = _split_problem(1.04, 0.7, seed=1)
    result = build_portfolio(CONFIGS[:3], train, designs=[D_ONE_LEAF, D_SPLIT, D_CAUTIOUS], base_rules=TREE_LOSS)
    assert result.valid is None and result.rules.margin == 0.5
    assert result.portfolio == Portfolio()
    result = build_portfolio(CONFIGS[:3], train, designs=[D_ONE_LEAF, D_SPLIT], base_rules=TREE_LOSS)
    assert (result.rules.margin, result.rules.max_depth) == (0.05, 0)  # the shallower of equal margins


@pytest.mark.parametrize("runtime", [False, True])
def test_built_selector_round_trips_and_names_only_existing_members(runtime):
    # the default designs, four candidates: 1 wins on large trees, 2 nowhere, 3 on the small ones of family 0
    train = _split_problem(1.0, 0.7, seed=3)
    valid = _split_problem(1.0, 0.72, seed=4)
    extra_train = np.where((train.features[:, Q] < 5) & (train.family == 0), 0.7, 1.0)
    extra_valid = np.where((valid.features[:, Q] < 5) & (valid.family == 0), 0.72, 1.0)
    train = SelectionProblem(train.features, np.column_stack([train.ratio, extra_train]), train.family,
                             train.family_names, train.layouts)  # fmt: skip
    valid = SelectionProblem(valid.features, np.column_stack([valid.ratio, extra_valid]), valid.family,
                             valid.family_names, valid.layouts)  # fmt: skip
    result = build_portfolio(CONFIGS, train, valid, runtime=runtime)
    assert len(result.tried) == len(DESIGNS)
    p = result.portfolio
    assert p.runtime is runtime and p.members[0] == FastTreeConfig()
    assert set(p.members) <= set(CONFIGS) and CONFIGS[2] not in p.members  # the slower candidate is never kept
    assert CONFIGS[1] in p.members
    leaves = _leaves(p.selector)
    assert set(leaves) <= set(range(len(p.members))) and p.selector.n_members <= len(p.members)
    assert set(leaves) | {0} == set(range(len(p.members)))  # every member but the defaults is named
    assert Selector.from_dict(p.selector.to_dict()) == p.selector
    assert Portfolio.from_dict(p.to_dict()) == p
    assert result.valid["worst_tree"] <= 1 + VALID_TREE_LOSS
    assert max(result.valid["families"].values()) <= 1.0 and result.valid["objective"] < 1.0
    # fenced (each leaf by its validation trees), an export entry holds it as it is; unfenced it does not
    target = "runtime" if runtime else "tree_attention"
    fenced = fence_portfolio(result, train, valid, 0.1).portfolio
    assert fenced.regions is not None and fenced.selector == p.selector  # 28% faster: every leaf kept
    entry = ExportEntry("NVIDIA H200", 4, 128, "float16", fenced, {}, target=target, guard=ExportGuard.current())
    again = ConfigExport.from_dict(ConfigExport((entry,), {}).to_dict())
    assert again.entries[0].portfolio == fenced
    unfenced = ExportEntry("NVIDIA H200", 4, 128, "float16", p, {}, target=target, guard=ExportGuard.current())
    with pytest.raises(ValueError, match="no region of evidence"):
        ConfigExport((unfenced,), {}).to_dict()


# ------------------------------------------------------------------- fence_portfolio
def _fenced_case(large_valid, *, n: int = 32, layout=(8, 4)):
    """A split portfolio (candidate 1 on the large trees) built on a tuning problem where candidate 1 is 30%
    faster on the large trees and 4% slower on the small ones, and a validation problem whose large trees are
    ``large_valid`` (scalar or per-tree) with candidate 1."""
    train = _split_problem(1.04, 0.7, seed=1)
    valid = _split_problem(1.0, large_valid, seed=2, n=n)
    if layout != (8, 4):
        valid = SelectionProblem(valid.features, valid.ratio, valid.family, valid.family_names,
                                 np.tile(layout, (valid.ratio.shape[0], 1)))  # fmt: skip
    result = build_portfolio(CONFIGS[:3], train, valid, designs=[D_SPLIT])
    assert result.portfolio.members == (FastTreeConfig(), CONFIGS[1]) and _leaves(result.portfolio.selector) == [0, 1]
    return result, train, valid


@pytest.mark.parametrize(
    ("margin", "served"), [(0.0, True), (0.149, True), ("gain", False), (0.151, False), (None, False)]
)
def test_a_leaf_serves_its_member_only_when_its_predicted_gain_exceeds_the_margin(margin, served):
    # the validation trees of the large leaf are predicted 15% faster (0.85): kept below a 15% margin only
    result, train, valid = _fenced_case(0.85)
    if margin == "gain":  # exactly the predicted gain: not more
        margin = next(d for d in fence_portfolio(result, train, valid, 0.0).evidence["leaves"] if d["model_pick"])
        margin = margin["predicted_gain"]
    fenced = fence_portfolio(result, train, valid, margin)
    p = fenced.portfolio
    assert p.members == result.portfolio.members  # the members stay: candidates for confirm
    assert _leaves(p.selector) == ([0, 1] if served else [0, 0])
    (leaf,) = [d for d in fenced.evidence["leaves"] if d["model_pick"]]
    assert leaf["predicted_gain"] == pytest.approx(0.15) and leaf["trees"] == 32 and leaf["served"] == int(served)
    assert fenced.evidence["margin"] == margin and fenced.evidence["split"] == "validation"
    large = valid.features[:, Q] > 5
    picks = np.array([p.member_at(x, (8, 4)) for x in valid.features])
    np.testing.assert_array_equal(picks, large.astype(int) if served else 0)
    # the scores follow the fenced picks
    assert fenced.valid["objective"] == pytest.approx(0.925 if served else 1.0)
    assert fenced.valid["picks"] == ([32, 32] if served else [64, 0])


def test_a_kept_leaf_is_fenced_by_its_validation_trees():
    result, train, valid = _fenced_case(0.7)
    p = fence_portfolio(result, train, valid, 0.1).portfolio
    region = p.regions[2]
    large = valid.features[valid.features[:, Q] > 5]
    assert (region.evidence, region.trees, region.layouts) == ("predicted", 32, ((8, 4),))
    np.testing.assert_array_equal(region.lo, large.min(axis=0))
    np.testing.assert_array_equal(region.hi, large.max(axis=0))
    # a large tree at another layout, or with features beyond the validation trees', gets the defaults
    inside = large[0]
    assert p.member_at(inside, (8, 4)) == 1 and p.member_at(inside, (1, 4)) == 0
    beyond = inside.copy()
    beyond[Q] = region.hi[Q] + 1.0  # more queries than any validation tree
    assert p.member_at(beyond, (8, 4)) == 0
    assert result.portfolio.member_at(beyond) == 1  # the unfenced selector would have served it


def test_a_leaf_with_a_tree_predicted_slower_or_too_few_trees_serves_the_defaults():
    slower = np.full(64, 0.7)
    slower[50] = 1.01  # one large validation tree predicted 1% slower: its leaf keeps the defaults
    result, train, valid = _fenced_case(slower)
    assert _leaves(fence_portfolio(result, train, valid, 0.0).portfolio.selector) == [0, 0]
    # two validation trees per family in the leaf: 4 reach it, fewer than 5 do not suffice
    result, train, valid = _fenced_case(0.7, n=4)
    assert _leaves(fence_portfolio(result, train, valid, 0.1).portfolio.selector) == [0, 1]
    assert EVIDENCE_MIN_TREES == 4
    assert _leaves(fence_portfolio(result, train, valid, 0.1, min_trees=5).portfolio.selector) == [0, 0]


def test_without_validation_the_tuning_trees_are_the_evidence():
    result, train, _ = _fenced_case(0.7)
    fenced = fence_portfolio(result, train, None, 0.1)
    assert fenced.evidence["split"] == "tuning" and fenced.valid is None
    assert fenced.portfolio.regions[2].trees == 32 and fenced.train["objective"] == pytest.approx(0.85)


def test_fencing_needs_layouts_and_a_margin_below_one():
    result, train, valid = _fenced_case(0.7)
    bare = SelectionProblem(valid.features, valid.ratio, valid.family, valid.family_names)
    with pytest.raises(ValueError, match="layouts"):
        fence_portfolio(result, train, bare, 0.1)
    with pytest.raises(ValueError, match="margin"):
        fence_portfolio(result, train, valid, 1.0)
    with pytest.raises(ValueError, match="layouts must be"):
        SelectionProblem(valid.features, valid.ratio, valid.family, valid.family_names, np.zeros((64, 2)))


def test_a_fenced_export_round_trips_and_serves_only_its_evidence(tmp_path):
    result, train, valid = _fenced_case(0.7, layout=(2, 4))
    fenced = fence_portfolio(result, train, valid, 0.1).portfolio
    entry = ExportEntry("NVIDIA H200", 4, 128, "float16", fenced, {}, target="tree_attention",
                        guard=ExportGuard.current())  # fmt: skip
    path = write_export(tmp_path / "e.json", ConfigExport((entry,), {}))
    from fasttree.export import read_export

    back = read_export(path)
    assert back.entries[0].portfolio == fenced
    x = valid.features[valid.features[:, Q] > 5][3]
    shape = {"gpu": "NVIDIA H200", "head_dim": 128, "dtype": "float16"}
    assert back.lookup(**shape, num_q_heads=8, num_kv_heads=2)[0].member_at(x) == 1
    assert back.lookup(**shape, num_q_heads=4, num_kv_heads=1)[0].member_at(x) == 0
