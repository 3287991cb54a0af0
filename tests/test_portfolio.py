"""fasttree.portfolio: the tree features a selector splits on, per-tree selection (deterministic and
fast on the paper suite's largest trees), abstention outside a leaf's region of evidence, and the
checks of Portfolio, Selector and LeafRegion."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

import fasttree as ft
from fasttree import FastTreeConfig, KVTree, LeafRegion, Portfolio, Selector, tree_features
from fasttree.portfolio import LAUNCH_FIELDS, MAX_MEMBERS, MAX_SELECTOR_DEPTH, TREE_FEATURES, head_layout
from fasttree.toolkit.suite import PAPER_SUITE, paper_tree

F = {name: i for i, name in enumerate(TREE_FEATURES)}
DEFAULTS = FastTreeConfig()
A = FastTreeConfig(alpha=0.4, pack_tokens=0)
B = FastTreeConfig(kv_split_sizes=(256, 64), gamma=-1.0)
C = FastTreeConfig(kv_tile=(32, 32), num_warps=(8, 4))


def _features(tree: KVTree) -> dict[str, float]:
    return dict(zip(TREE_FEATURES, tree_features(tree).tolist(), strict=True))


def _split(feature: str, threshold: float, left: int, right: int) -> Selector:
    """One split: trees with ``feature <= threshold`` get member ``left``, the others ``right``."""
    return Selector(
        feature=(F[feature], -1, -1), threshold=(threshold, 0.0, 0.0), left=(1, -1, -1), right=(2, -1, -1),
        member=(0, left, right),
    )  # fmt: skip


#: Depth 2: queries first, then sharing (reads per token) on the small side and depth on the large side.
TWO_LEVELS = Selector(
    feature=(F["log2_queries"], F["reads_per_token"], F["depth"], -1, -1, -1, -1),
    threshold=(6.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0),
    left=(1, 3, 5, -1, -1, -1, -1),
    right=(2, 4, 6, -1, -1, -1, -1),
    member=(0, 0, 1, 0, 2, 3, 1),
)
FOUR = Portfolio(members=(DEFAULTS, A, B, C), selector=TWO_LEVELS)


# ------------------------------------------------------------------------ tree features


def test_features_of_a_tree_with_an_internal_query_and_a_shared_leaf():
    # node 0 (root, 10 tokens) -> 1 (4 tokens) -> 3 (2 tokens); 0 -> 2 (6 tokens)
    # queries: one at node 1 (internal), one at node 3, two at node 2
    tree = KVTree.from_lengths([-1, 0, 0, 1], [10, 4, 6, 2], [1, 3, 2, 2])
    f = _features(tree)
    assert list(f) == list(TREE_FEATURES)
    assert f["log2_queries"] == 2.0  # 4 queries
    assert f["log2_nodes"] == 2.0  # 4 nodes
    assert f["depth"] == 2.0  # node 3
    assert f["log2_tokens"] == pytest.approx(math.log2(22))
    # contexts 14 (node 1), 16 (node 3), 16 and 16 (node 2): 62 tokens read
    assert f["reads_per_token"] == pytest.approx(62 / 22)
    assert f["log2_mean_context"] == pytest.approx(math.log2(62 / 4))
    assert f["log2_max_context"] == 4.0
    # only node 3 is read by one query (node 1: two, node 2: two, the root: four)
    assert f["private_share"] == pytest.approx(2 / 22)


def test_features_of_a_forest_with_an_unread_root():
    # two roots: node 0 (5 tokens, one query) and node 1 (3 tokens no query reads)
    tree = KVTree.from_lengths([-1, -1], [5, 3], [0])
    f = _features(tree)
    assert (f["log2_queries"], f["log2_nodes"], f["depth"]) == (0.0, 1.0, 0.0)
    assert f["log2_tokens"] == 3.0
    assert f["reads_per_token"] == pytest.approx(5 / 8)
    assert f["log2_mean_context"] == pytest.approx(math.log2(5))
    assert f["log2_max_context"] == pytest.approx(math.log2(5))
    assert f["private_share"] == pytest.approx(5 / 8)


def test_features_of_a_paper_suite_tree():
    # from_levels((1, 3, 6), (100, 20, 5)): a root, 3 children, 6 leaves (two per child), one query per leaf
    tree = KVTree.from_levels((1, 3, 6), (100, 20, 5))
    f = _features(tree)
    tokens = 100 + 3 * 20 + 6 * 5
    assert f["log2_queries"] == pytest.approx(math.log2(6))
    assert f["log2_nodes"] == pytest.approx(math.log2(10))
    assert f["depth"] == 2.0
    assert f["log2_tokens"] == pytest.approx(math.log2(tokens))
    assert f["reads_per_token"] == pytest.approx(6 * 125 / tokens)
    assert f["log2_mean_context"] == pytest.approx(math.log2(125))
    assert f["log2_max_context"] == pytest.approx(math.log2(125))
    assert f["private_share"] == pytest.approx(30 / tokens)  # the leaves; each middle node has two queries


def test_features_of_unshared_chains():
    # three one-node requests, no sharing: every token private and read once
    tree = KVTree.from_lengths([-1, -1, -1], [7, 9, 16], [0, 1, 2])
    f = _features(tree)
    assert f["reads_per_token"] == 1.0 and f["private_share"] == 1.0
    assert f["log2_mean_context"] == pytest.approx(math.log2(32 / 3))
    assert f["log2_max_context"] == 4.0
    assert f["depth"] == 0.0


def test_features_do_not_depend_on_slot_order():
    a = KVTree([-1, 0, 0], [np.arange(8), np.arange(8, 12), np.arange(12, 15)], [1, 2])
    b = KVTree([-1, 0, 0], [np.arange(100, 108)[::-1], [3, 1, 2, 0], [50, 40, 60]], [1, 2])
    np.testing.assert_array_equal(tree_features(a), tree_features(b))
    assert tree_features(a).dtype == np.float64 and tree_features(a).shape == (len(TREE_FEATURES),)


# ---------------------------------------------------------------------------- selection


@pytest.mark.parametrize(
    ("levels", "member"),
    [
        (((1, 32), (512, 16)), 2),  # 32 queries, 16.5 reads per token (> 2)
        (((32,), (64,)), 0),  # 32 unshared requests: 1 read per token
        (((1, 4, 16, 128), (64, 16, 16, 8)), 3),  # 128 queries, depth 3
        (((1, 2, 4, 8, 16, 128), (64, 16, 16, 8, 8, 8)), 1),  # 128 queries, depth 5
    ],
)
def test_select_walks_the_selector(levels, member):
    tree = KVTree.from_levels(*levels)
    assert FOUR.member_of(tree) == member
    assert FOUR.select(tree) is FOUR.members[member]


def test_select_on_either_side_of_one_split():
    portfolio = Portfolio(members=(DEFAULTS, A), selector=_split("private_share", 0.5, 1, 0))
    shared = KVTree.from_levels((1, 8), (1000, 10))  # 80 of 1080 tokens private
    private = KVTree.from_levels((1, 8), (10, 1000))  # 8000 of 8010
    assert _features(shared)["private_share"] <= 0.5 < _features(private)["private_share"]
    assert portfolio.select(shared) == A and portfolio.select(private) == DEFAULTS
    # a threshold equal to the feature sends the tree left
    at = _features(shared)["private_share"]
    assert Portfolio(members=(DEFAULTS, A), selector=_split("private_share", at, 1, 0)).select(shared) == A


def test_a_one_member_portfolio_always_selects_it():
    only = Portfolio(members=(C,))
    assert only.select(paper_tree(1)) is C and only.member_of(paper_tree(9)) == 0


def test_selection_is_deterministic():
    trees = [paper_tree(c) for c in PAPER_SUITE]
    first = [FOUR.member_of(t) for t in trees]
    assert len(set(first)) > 1  # the suite lands on several members: a fixed answer would not pass
    for _ in range(3):
        assert [FOUR.member_of(t) for t in trees] == first
    # a copy of the portfolio (rebuilt from JSON) and rebuilt trees give the same answers
    again = Portfolio.from_dict(json.loads(json.dumps(FOUR.to_dict())))
    assert [again.member_of(paper_tree(c)) for c in PAPER_SUITE] == first
    assert [FOUR.select(t) for t in trees] == [FOUR.members[m] for m in first]


def _deep_selector(depth: int) -> Selector:
    """A full tree of ``depth`` levels cycling through the features, leaves cycling through 4 members."""
    feature, threshold, left, right, member = [], [], [], [], []
    n_inner = 2**depth - 1
    for i in range(2 ** (depth + 1) - 1):
        if i < n_inner:
            feature.append(i % len(TREE_FEATURES))
            threshold.append(float(i % 5) + 0.5)
            left.append(2 * i + 1)
            right.append(2 * i + 2)
            member.append(0)
        else:
            feature.append(-1)
            threshold.append(0.0)
            left.append(-1)
            right.append(-1)
            member.append(i % 4)
    return Selector(tuple(feature), tuple(threshold), tuple(left), tuple(right), tuple(member))


def _select_us(portfolio: Portfolio, tree: KVTree) -> float:
    """Median time of one ``portfolio.select(tree)`` (us) over 15 blocks of 40 calls, after a warm-up."""
    portfolio.select(tree)
    blocks = []
    for _ in range(15):
        t0 = time.perf_counter()
        for _ in range(40):
            portfolio.select(tree)
        blocks.append((time.perf_counter() - t0) / 40 * 1e6)
    return float(np.median(blocks))


def test_selection_takes_under_100_us_on_the_largest_paper_trees():
    """Every paper-suite tree (up to 1401 nodes, 1024 queries, 279k tokens), through the deepest selector
    the format takes. The issue's target is 20 us per tree on an idle core; this shared core gets a loose
    bound (the measured times are printed: ``pytest -s``)."""
    portfolio = Portfolio(members=(DEFAULTS, A, B, C), selector=_deep_selector(MAX_SELECTOR_DEPTH))
    worst = 0.0
    for case in PAPER_SUITE:
        tree = paper_tree(case)
        us = _select_us(portfolio, tree)
        print(f"paper case {case} ({tree.n_nodes} nodes, {tree.num_tokens} tokens): select {us:.1f} us")
        worst = max(worst, us)
    assert worst < 100.0, f"{worst:.1f} us per tree"


# --------------------------------------------------------------------- portfolio checks


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ((), "a portfolio holds 1 to 16 configs, got 0"),
        ([DEFAULTS] * (MAX_MEMBERS + 1), "a portfolio holds 1 to 16 configs, got 17"),
        ((DEFAULTS, {"alpha": 0.5}), "members must be FastTreeConfig objects"),
        ((DEFAULTS, None), "members must be FastTreeConfig objects"),
        ((DEFAULTS, A.to_dict()), "members must be FastTreeConfig objects"),
    ],
    ids=["empty", "17 members", "dict member", "None member", "config dict"],
)
def test_portfolio_refuses_bad_members(members, match):
    with pytest.raises(ValueError, match=match):
        Portfolio(members=members, selector=Selector())


def test_sixteen_members_are_accepted_and_a_list_becomes_a_tuple():
    members = [DEFAULTS.with_(pack_tokens=64 * i) for i in range(MAX_MEMBERS)]
    portfolio = Portfolio(members=members, selector=Selector(member=(MAX_MEMBERS - 1,)))
    assert isinstance(portfolio.members, tuple) and len(portfolio.members) == MAX_MEMBERS
    assert portfolio.select(paper_tree(1)) == members[-1]


@pytest.mark.parametrize(
    ("members", "selector"),
    [
        ((DEFAULTS,), Selector(member=(1,))),
        ((DEFAULTS, A), _split("depth", 1.0, 0, 2)),
        ((DEFAULTS, A, B, C), _split("depth", 1.0, 4, 0)),
    ],
)
def test_portfolio_refuses_a_selector_naming_a_member_beyond_it(members, selector):
    with pytest.raises(ValueError, match=rf"the selector names member {selector.n_members - 1}, the portfolio has"):
        Portfolio(members=members, selector=selector)


def test_portfolio_refuses_a_non_selector():
    with pytest.raises(ValueError, match="selector must be a Selector"):
        Portfolio(members=(DEFAULTS, A), selector={"member": [1]})


def test_runtime_portfolio_members_share_the_launch_fields():
    Portfolio(members=(DEFAULTS, A, B), selector=Selector(member=(2,)), runtime=True)
    launch = [("kv_tile", (32, 32)), ("num_warps", (8, 4)), ("num_stages", (2, 2)), ("q_tile_queries", (16, 4))]
    for name, value in launch:
        with pytest.raises(ValueError, match=rf"member 1 differs from member 0 in launch fields \['{name}'\]"):
            Portfolio(members=(DEFAULTS, DEFAULTS.with_(**{name: value})), selector=Selector(member=(1,)), runtime=True)
        # for tree_attention (runtime=False) they may differ
        Portfolio(members=(DEFAULTS, DEFAULTS.with_(**{name: value})), selector=Selector(member=(1,)))
    assert set(LAUNCH_FIELDS) == {"q_tile_queries", "kv_tile", "num_warps", "num_stages"}
    assert Portfolio(members=(B, A), runtime=True).launch_config is B


def _everywhere(selector: Selector, layouts=((2, 4),)) -> tuple:
    """Regions for ``selector``: a wide box at ``layouts`` on every leaf naming a member other than 0."""
    wide = LeafRegion(lo=(-1e9,) * len(TREE_FEATURES), hi=(1e9,) * len(TREE_FEATURES), layouts=layouts, trees=5,
                      evidence="measured")  # fmt: skip
    return tuple(wide if f < 0 and m else None for f, m in zip(selector.feature, selector.member, strict=True))


@pytest.mark.parametrize(
    "portfolio",
    [
        FOUR,
        Portfolio(),
        Portfolio(members=(DEFAULTS, A), runtime=True),
        Portfolio(members=(DEFAULTS, A, B, C), selector=TWO_LEVELS, regions=_everywhere(TWO_LEVELS)),
    ],
)
def test_portfolio_round_trip(portfolio):
    data = portfolio.to_dict()
    assert set(data) == {"members", "regions", "selector", "runtime"}
    assert (data["regions"] is None) == (portfolio.regions is None)
    assert Portfolio.from_dict(data) == portfolio
    assert Portfolio.from_dict(json.loads(json.dumps(data))) == portfolio  # through JSON text (lists)
    assert data["selector"]["features"] == list(TREE_FEATURES)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("runtime"), "fields members, regions, selector and runtime"),
        (lambda d: d.pop("regions"), "fields members, regions, selector and runtime"),
        (lambda d: d.__setitem__("regions", {}), "portfolio.regions must be a list or null"),
        (lambda d: d.__setitem__("regions", [None] * 7), "leaf 4 names member 2 but has no region"),
        (lambda d: d.__setitem__("members", ()), "portfolio.members must be a list"),
        (lambda d: d.__setitem__("members", []), "portfolio.members count must be"),
        (lambda d: d.__setitem__("runtime", "no"), "portfolio.runtime must be a bool"),
        (lambda d: d["selector"].__setitem__("features", list(TREE_FEATURES[:-1])), "fitted on features"),
        (lambda d: d["selector"].__setitem__("member", [0, 0, 1, 0, 2, 3, 4]), "names member 4"),
    ],
)
def test_portfolio_from_dict_refuses(mutate, match):
    data = FOUR.to_dict()
    mutate(data)
    with pytest.raises(ValueError, match=match):
        Portfolio.from_dict(data)


# ---------------------------------------------------------------------- selector checks


def test_selector_children_come_after_their_parent():
    with pytest.raises(ValueError, match=r"node 1 has child 0 \(children come after their parent\)"):
        Selector(feature=(-1, 0, -1), threshold=(0.0, 1.0, 0.0), left=(-1, 0, -1), right=(-1, 2, -1), member=(0, 0, 1))
    with pytest.raises(ValueError, match="node 0 has child 0"):
        Selector(feature=(0, -1), threshold=(1.0, 0.0), left=(0, -1), right=(1, -1), member=(0, 1))
    with pytest.raises(ValueError, match="node 0 has child 5"):
        Selector(feature=(0, -1, -1), threshold=(1.0, 0.0, 0.0), left=(1, -1, -1), right=(5, -1, -1), member=(0, 0, 1))


def test_selector_depth_is_bounded():
    assert len(_deep_selector(MAX_SELECTOR_DEPTH).feature) == 2 ** (MAX_SELECTOR_DEPTH + 1) - 1
    with pytest.raises(ValueError, match=rf"{MAX_SELECTOR_DEPTH + 1} levels deep, more than {MAX_SELECTOR_DEPTH}"):
        _deep_selector(MAX_SELECTOR_DEPTH + 1)


def test_selector_refuses_features_of_another_version():
    data = TWO_LEVELS.to_dict()
    assert Selector.from_dict(data) == TWO_LEVELS
    for features in ([*TREE_FEATURES, "kv_heads"], list(reversed(TREE_FEATURES)), TREE_FEATURES[:4]):
        with pytest.raises(ValueError, match="fitted on features"):
            Selector.from_dict({**data, "features": list(features)})
    with pytest.raises(ValueError, match="splits on feature 8; there are 8"):
        Selector(feature=(8, -1, -1), threshold=(0.0, 0.0, 0.0), left=(1, -1, -1), right=(2, -1, -1), member=(0, 0, 1))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"feature": ()}, "equally long, non-empty"),
        ({"member": (0, 1)}, "equally long, non-empty"),
        ({"member": (True,)}, "selector.member must hold integers"),
        ({"threshold": (math.nan,)}, "selector.threshold must hold finite numbers"),
        ({"threshold": (math.inf,)}, "selector.threshold must hold finite numbers"),
        ({"feature": (0.0,)}, "selector.feature must hold integers"),
    ],
)
def test_selector_refuses_bad_node_arrays(kw, match):
    with pytest.raises(ValueError, match=match):
        Selector(**kw)


def test_selector_refuses_a_negative_member():
    with pytest.raises(ValueError, match="member"):
        Portfolio(members=(DEFAULTS, A), selector=Selector(member=(-1,)))


def test_selector_leaf_and_member():
    x = np.zeros(len(TREE_FEATURES))
    x[F["log2_queries"]] = 7.0
    x[F["depth"]] = 5.0
    assert TWO_LEVELS.leaf_of(x) == 6 and TWO_LEVELS.member_of(x) == 1
    x[F["depth"]] = 3.0  # on the threshold: left
    assert TWO_LEVELS.leaf_of(x) == 5 and TWO_LEVELS.member_of(x) == 3
    assert TWO_LEVELS.n_members == 4
    assert Selector().n_members == 1 and Selector().member_of(x) == 0


def test_plan_takes_a_portfolio():
    tree = KVTree.from_levels((1, 2, 4), (40, 20, 6))
    portfolio = Portfolio(members=(DEFAULTS, B), selector=Selector(member=(1,)))
    plan = ft.plan(tree, portfolio, num_q_heads=8, num_kv_heads=2, head_dim=64)
    assert plan.config == B
    with pytest.raises(ValueError, match="FastTreeConfig or a Portfolio"):
        ft.plan(tree, [B], num_q_heads=8, num_kv_heads=2, head_dim=64)


# ------------------------------------------------------------------ regions of evidence

#: Two leaves split on the queries: up to 64 queries (log2 6) the defaults, more queries member 1 (A).
SPLIT_Q = _split("log2_queries", 6.0, 0, 1)
#: One leaf: member 1 (A) for every tree, unless its region says otherwise.
ALWAYS = Selector(member=(1,))
#: Trees of 128 queries under a 256-token prefix: member 1's evidence trees (their private leaves 16-64 tokens).
EVIDENCE_TREES = [KVTree.from_levels((1, 128), (256, n)) for n in (16, 32, 64)]


def _region_of(trees, layouts, evidence="measured") -> LeafRegion:
    return LeafRegion.of_trees(np.stack([tree_features(t) for t in trees]), layouts, evidence)


def _fenced(layouts=((2, 16),), selector=ALWAYS) -> Portfolio:
    """``selector`` (member 1 on its last leaf) with that leaf fenced by the box of EVIDENCE_TREES at ``layouts``."""
    region = _region_of(EVIDENCE_TREES, list(layouts) * 3 if len(layouts) == 1 else layouts)
    return Portfolio(
        members=(DEFAULTS, A), selector=selector, regions=(None,) * (len(selector.feature) - 1) + (region,)
    )


def test_a_region_is_the_box_and_layouts_of_its_trees():
    region = _region_of(EVIDENCE_TREES, [(2, 16), (2, 16), (4, 16)])
    x = np.stack([tree_features(t) for t in EVIDENCE_TREES])
    assert region.lo == tuple(x.min(axis=0)) and region.hi == tuple(x.max(axis=0))
    assert region.layouts == ((2, 16), (4, 16)) and region.trees == 3 and region.evidence == "measured"
    assert region.lo[F["log2_queries"]] == region.hi[F["log2_queries"]] == 7.0
    assert region.lo[F["log2_max_context"]] < region.hi[F["log2_max_context"]]
    assert all(region.contains(v) for v in x)  # bounds included
    outside = x[0].copy()
    outside[F["log2_tokens"]] = region.hi[F["log2_tokens"]] + 0.01
    assert not region.contains(outside)


def test_inside_the_box_at_a_covered_layout_the_leaf_member_is_served():
    portfolio = _fenced(selector=SPLIT_Q).for_heads(32, 2)
    assert portfolio.layout == (2, 16)
    between = KVTree.from_levels((1, 128), (256, 40))  # inside the box, not one of its trees
    for tree in [*EVIDENCE_TREES, between]:
        assert portfolio.member_of(tree) == 1 and portfolio.select(tree) == A
    assert portfolio.select(KVTree.from_levels((1, 32), (256, 32))) == DEFAULTS  # the defaults' leaf


def test_a_tree_at_a_layout_the_region_does_not_list_gets_the_defaults():
    # the measured failure: the leaf's trees ran at 2 KV heads; one KV head (tensor parallelism) is another grid
    fenced = _fenced()
    tree = EVIDENCE_TREES[1]
    assert fenced.for_heads(32, 2).select(tree) == A
    assert fenced.for_heads(16, 1).select(tree) == DEFAULTS
    assert fenced.for_heads(64, 4).member_of(tree) == 0
    assert fenced.member_at(tree_features(tree), (2, 16)) == 1 and fenced.member_at(tree_features(tree), (1, 16)) == 0
    # unbound (no layout known), nothing is known to be covered
    assert fenced.layout is None and fenced.select(tree) == DEFAULTS
    # a region listing both layouts serves both
    both = _fenced(layouts=((2, 16), (1, 16), (1, 16))).for_heads(16, 1)
    assert both.select(tree) == A


@pytest.mark.parametrize(
    "tree",
    [
        KVTree.from_levels((2, 16), (30000, 40)),  # two 30k-token documents, 8 questions each
        KVTree.from_levels((1, 128), (30000, 32)),  # a 30k-token prefix: tokens and contexts beyond the box
        KVTree.from_levels((1, 128), (256, 1024)),  # long private leaves: private share and contexts beyond
        KVTree.from_levels((1, 2, 128), (256, 64, 32)),  # one level deeper than every evidence tree
    ],
    ids=["long documents", "long prefix", "long leaves", "deeper"],
)
def test_a_tree_outside_the_box_gets_the_defaults(tree):
    fenced = _fenced().for_heads(32, 2)
    assert Portfolio(members=(DEFAULTS, A), selector=ALWAYS).select(tree) == A  # the selector alone: member 1
    assert fenced.select(tree) == DEFAULTS and fenced.member_of(tree) == 0


def test_binding_a_layout():
    fenced = _fenced()
    bound = fenced.for_heads(32, 2)
    assert bound.for_heads(32, 2) is bound and bound == Portfolio(
        members=fenced.members, selector=fenced.selector, regions=fenced.regions, layout=(2, 16)
    )
    assert bound.to_dict() == fenced.to_dict()  # the layout is not part of the format
    plain = Portfolio(members=(DEFAULTS, A), selector=ALWAYS)
    assert plain.for_heads(32, 2) is plain  # no regions: the layout changes nothing
    assert head_layout(64, 8) == (8, 8)
    for hq, hkv in ((32, 3), (0, 1), (8, 0), (8.0, 2)):
        with pytest.raises(ValueError, match=r"num_q_heads|num_kv_heads"):
            fenced.for_heads(hq, hkv)
    with pytest.raises(ValueError, match="layout must hold"):
        Portfolio(members=(DEFAULTS, A), selector=ALWAYS, regions=fenced.regions, layout=(2,))


def test_plan_follows_the_region():
    tree = EVIDENCE_TREES[0]
    fenced = _fenced()
    assert ft.plan(tree, fenced.for_heads(32, 2), num_q_heads=32, num_kv_heads=2, head_dim=64).config == A
    assert ft.plan(tree, fenced.for_heads(16, 1), num_q_heads=16, num_kv_heads=1, head_dim=64).config == DEFAULTS


def test_regions_must_fence_exactly_the_tuned_leaves():
    region = _region_of(EVIDENCE_TREES, [(2, 16)] * 3)
    with pytest.raises(ValueError, match="one item per selector node"):
        Portfolio(members=(DEFAULTS, A), selector=SPLIT_Q, regions=(None, region))
    with pytest.raises(ValueError, match="leaf 2 names member 1 but has no region"):
        Portfolio(members=(DEFAULTS, A), selector=SPLIT_Q, regions=(None, None, None))
    with pytest.raises(ValueError, match="node 1 serves no member but the defaults"):
        Portfolio(members=(DEFAULTS, A), selector=SPLIT_Q, regions=(None, region, region))
    with pytest.raises(ValueError, match="must be a LeafRegion or None"):
        Portfolio(members=(DEFAULTS, A), selector=SPLIT_Q, regions=(None, None, region.to_dict()))
    # regions of a selector that serves only the defaults: the same as none
    assert Portfolio(members=(DEFAULTS, A), regions=(None,)).regions is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"lo": (0.0,) * 7}, "region.lo must hold 8 finite numbers"),
        ({"hi": (math.nan,) * 8}, "region.hi must hold 8 finite numbers"),
        ({"lo": (2.0,) * 8}, "region.lo must not exceed region.hi"),
        ({"layouts": ()}, "1 to 64 head layouts"),
        ({"layouts": ((2, 0),)}, "pairs of ints >= 1"),
        ({"layouts": ((2,),)}, "pairs of ints >= 1"),
        ({"trees": 0}, "region.trees must be"),
        ({"evidence": "guessed"}, "region.evidence must be one of"),
    ],
)
def test_a_region_refuses(kw, match):
    ok = {"lo": (0.0,) * 8, "hi": (1.0,) * 8, "layouts": ((2, 16),), "trees": 3, "evidence": "predicted"}
    LeafRegion(**ok)
    with pytest.raises(ValueError, match=match):
        LeafRegion(**{**ok, **kw})
    with pytest.raises(ValueError, match="fields"):
        LeafRegion.from_dict({**LeafRegion(**ok).to_dict(), "margin": 0.1})


def test_selection_with_regions_stays_fast():
    """The region check adds a box test to the walk: the largest paper trees stay well under 100 us."""
    portfolio = _fenced().for_heads(32, 2)
    tree = paper_tree(max(PAPER_SUITE, key=lambda c: paper_tree(c).num_tokens))
    us = _select_us(portfolio, tree)
    print(f"select with a region: {us:.1f} us")
    assert us < 100.0


def test_an_unbound_portfolio_serves_its_member_at_a_covered_layout_in_plan_and_runtime():
    """A portfolio with regions passed straight to ft.plan or the runtime (not bound with
    for_heads) serves its leaf's member at the head layout its region covers, the defaults at
    another: the entry points bind the layout they plan at."""
    import torch

    from fasttree.runtime import TreeAttentionRuntime

    pf = Portfolio(members=(DEFAULTS, A), selector=Selector(member=(1,)), regions=_everywhere(Selector(member=(1,))))
    assert pf.layout is None
    tree = paper_tree(9)
    covered = ft.plan(tree, pf, num_q_heads=8, num_kv_heads=2, head_dim=64)  # layout (2, 4)
    other = ft.plan(tree, pf, num_q_heads=8, num_kv_heads=1, head_dim=64)
    assert covered.config == A and other.config == DEFAULTS
    runtime_pf = Portfolio(members=(DEFAULTS, DEFAULTS.with_(alpha=0.4)), selector=Selector(member=(1,)),
                           regions=_everywhere(Selector(member=(1,))), runtime=True)  # fmt: skip
    for hkv, member in ((2, 1), (1, 0)):
        rt = TreeAttentionRuntime(runtime_pf, num_q_heads=8, num_kv_heads=hkv, head_dim=64, dtype=torch.float16,
                                  device="cpu", max_queries=16, max_kv_entries=1 << 14)  # fmt: skip
        assert rt.portfolio.member_of(tree) == member
