"""Planner properties: the greedy matches a plain implementation of the notes, every
query reads its context exactly once, partial rows are consistent, plans are
deterministic, and the adaptive passes and ablations behave as documented."""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
from plan_checks import TREE_PLANS, assert_covers_contexts_once, assert_partials_consistent
from trees import random_tree

import fasttree as ft
import fasttree.planner as planner_mod
from fasttree.costs import ALL_LARGE, ALL_SMALL, TWO_CLASSES, PaddingCost, mode_tiles
from fasttree.packing import MAX_PACK_QUERIES
from fasttree.plan_arrays import DEVICE_ARRAYS
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from fasttree.tree import ragged_arange, ragged_gather


# ------------------------------------------------------------------ helpers
def reference_greedy(tree: ft.KVTree, cost: PaddingCost) -> np.ndarray:
    """The notes' greedy, written as plainly as possible (BFS, Python lists)."""
    n = tree.n_nodes
    parents = tree.parents.tolist()
    children = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    nq = tree.subtree_queries.tolist()
    length = tree.lengths.tolist()
    assign = [0] * n
    queue = deque(i for i in range(n) if parents[i] < 0)
    while queue:
        v = queue.popleft()
        n_cur = nq[v]
        for child in children[v]:
            split_kv = (
                cost.cmm_scalar(n_cur, length[v]) + cost.cmm_scalar(nq[child], length[child]) + cost.gamma * nq[child]
            )
            split_q = cost.cmm_scalar(n_cur - nq[child], length[v]) + cost.cmm_scalar(
                nq[child], length[child] + length[v]
            )
            if split_kv > split_q:
                assign[child] = 1
                n_cur -= nq[child]
                length[child] += length[v]
            queue.append(child)
    return np.array(assign, dtype=np.int8)


def random_cost(rng: np.random.Generator) -> PaddingCost:
    g = int(rng.choice([1, 2, 4, 7, 8, 16]))
    cfg = ft.FastTreeConfig(
        q_tile_queries=None if rng.random() < 0.6 else (int(rng.integers(2, 9)), int(rng.integers(1, 3))),
        kv_tile=(int(rng.choice([16, 32, 64])), int(rng.choice([16, 32, 128]))),
    )
    mode = str(rng.choice([TWO_CLASSES, ALL_SMALL, ALL_LARGE]))
    tq, tk = mode_tiles(mode, cfg.query_tiles(g), cfg.kv_tile)
    return PaddingCost(
        float(rng.choice([0.66, 0.1, 1.0])),
        float(rng.choice([0.33, 0.0, 2.0])),
        float(rng.choice([0.1, -10, 10, 0])),
        g,
        tq,
        tk,
    )


def assert_unit_shapes(plan: ft.Plan) -> None:
    ptr = plan.class_unit_ptr
    assert ptr[0] == 0 and ptr[2] == plan.n_units and ptr[0] <= ptr[1] <= ptr[2]
    assert np.all(plan.unit_kv_len >= 1)
    assert np.all(plan.unit_kv_start >= 0)
    assert np.all(plan.unit_kv_start.astype(np.int64) + plan.unit_kv_len <= plan.kv_indices.size)
    assert np.all(plan.unit_q_len >= 1)
    for c in (0, 1):
        tc = plan.tile_classes[c]
        sl = slice(ptr[c], ptr[c + 1])
        q_len, kv_len = plan.unit_q_len[sl], plan.unit_kv_len[sl]
        # packed units (masked class) fill the class's matrix rows, up to 32 queries
        limit = tc.queries
        if tc.masked:
            limit = max(limit, min(tc.block_m // plan.group_size, MAX_PACK_QUERIES))
        assert np.all(q_len <= limit)
        assert np.all(q_len * plan.group_size <= tc.block_m)
        assert np.all(np.diff(kv_len) <= 0), "units of a class must be sorted by decreasing KV length"
    any_masked = plan.tile_classes[0].masked or plan.tile_classes[1].masked
    assert plan.kv_row_mask.size == (plan.kv_indices.size if any_masked else 0)
    small = plan.tile_classes[1].queries
    assert np.all(plan.unit_q_len[: ptr[1]] > small)
    if not plan.tile_classes[1].masked:
        assert np.all(plan.unit_q_len[ptr[1] :] <= small)


def check_plan(tree: ft.KVTree, plan: ft.Plan) -> None:
    assert_covers_contexts_once(tree, plan)
    assert_partials_consistent(plan)
    assert_unit_shapes(plan)


# ------------------------------------------------------------------- greedy
@pytest.mark.parametrize("scalar_edges", [-1, 10**9, planner_mod.SCALAR_EDGES])
def test_greedy_matches_plain_implementation(scalar_edges):
    rng = np.random.default_rng(1234 + scalar_edges % 97)
    for _ in range(150):
        tree = random_tree(rng, max_nodes=120)
        cost = random_cost(rng)
        assign, group_q, _ = ft.greedy_edge_assignment(tree, cost, scalar_edges=scalar_edges)
        np.testing.assert_array_equal(assign, reference_greedy(tree, cost))
        assert np.all(assign[tree.parents < 0] == 0)
        assert np.all(group_q >= 0)


def test_greedy_wide_fanout_runs_match_plain_implementation():
    # many identical siblings: all-1 runs, all-0 runs and alternating patterns
    rng = np.random.default_rng(7)
    for _ in range(30):
        fan = int(rng.integers(60, 400))
        lengths = np.concatenate([[int(rng.choice([1, 8, 16, 256, 2048]))], rng.choice([1, 16, 32, 33], size=fan)])
        parents = np.concatenate([[-1], np.zeros(fan, dtype=np.int64)])
        queries = np.concatenate([np.arange(1, fan + 1), rng.integers(0, fan + 1, size=int(rng.integers(0, 50)))])
        tree = ft.KVTree.from_lengths(parents, lengths, queries)
        cost = random_cost(rng)
        np.testing.assert_array_equal(ft.greedy_edge_assignment(tree, cost)[0], reference_greedy(tree, cost))


# --------------------------------------------------------------------- plans
def test_random_plans_cover_every_context_exactly_once():
    rng = np.random.default_rng(99)
    for _ in range(120):
        tree = random_tree(rng, max_nodes=60)
        hkv = int(rng.choice([1, 2, 4]))
        g = int(rng.choice([1, 4, 7, 16]))
        cfg = ft.FastTreeConfig(
            gamma=float(rng.choice([0.1, -10, 10])),
            kv_split_sizes=(int(rng.choice([64, 1024])), int(rng.choice([1, 16, 128]))),
            para_threshs1=(int(rng.integers(0, 600)), int(rng.integers(0, 600))),
            para_threshs2=(int(rng.integers(0, 300)), int(rng.integers(0, 300))),
        )
        plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=64)
        check_plan(tree, plan)
        # the all-small rule either way keeps every plan valid
        rules = ft.PlanRules.defaults().with_(all_large_without_large=bool(rng.integers(2)))
        check_plan(tree, ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=64, rules=rules))


@pytest.mark.parametrize("case", sorted(PAPER_SUITE))
def test_paper_suite_plans_cover_every_context_exactly_once(case):
    tree = paper_tree(case)
    for hq, hkv in PAPER_HEADS.values():
        check_plan(tree, ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128))


def test_plan_is_deterministic():
    rng = np.random.default_rng(5)
    for _ in range(20):
        tree = random_tree(rng)
        a = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=128)
        b = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=128)
        for name in DEVICE_ARRAYS:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a.class_unit_ptr == b.class_unit_ptr and a.tile_classes == b.tile_classes


def test_query_at_internal_node_and_forest():
    # two roots; queries at a root, at an internal node and at leaves
    tree = ft.KVTree.from_lengths([-1, 0, 1, 1, -1, 4], [5, 3, 2, 4, 6, 1], [0, 1, 2, 3, 5, 4, 1])
    plan = ft.plan(tree, num_q_heads=4, num_kv_heads=4, head_dim=64)
    check_plan(tree, plan)
    indptr, _ = tree.query_slots()
    np.testing.assert_array_equal(np.diff(indptr), [5, 8, 10, 12, 7, 6, 8])


def test_million_token_node_is_split_into_units():
    tree = ft.KVTree.from_lengths([-1, 0, 0, 0], [1_000_000, 1, 1, 3], [1, 2, 3])
    plan = ft.plan(tree, num_q_heads=8, num_kv_heads=1, head_dim=128)
    check_plan(tree, plan)
    # two solo groups of ~1M tokens at one KV head: query-separated chunking, 264 chunks each
    # (para_threshs1[1] = 528 over 2 groups x 1 KV head), 3,840 tokens (a multiple of the KV tile)
    assert plan.unit_kv_len.max() == 3840
    assert plan.n_units >= 2 * (1_000_000 // 3840)
    old = ft.plan(
        tree,
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=128,
        rules=ft.PlanRules(solo_split_max_kv_heads=0, solo_recut=False),
    )
    check_plan(tree, old)
    assert old.unit_kv_len.max() <= max(old.config.kv_split_sizes) and old.n_units >= 1_000_000 // 1024


def test_solo_groups_are_cut_no_finer_than_plain_decode():
    """Independent requests at 16 query heads per KV head. 128 of 2k tokens with 1 or 2 KV heads:
    their solo units are cut as plain split-KV decode cuts them (ceil(528 / (128 x KV heads))
    chunks of 2,048 tokens, rounded up to the KV tile: 448 and 704 tokens), not at the small
    split size (128). 32 of 4k tokens with 4 KV heads (at the small split without the rule):
    each is cut into its share of the 528 programs, ceil(4096 x 528 / (32 x 4096 x 4)) = 5 chunks
    of 832 tokens. With the rules off, 128. (Batches of equal contexts: one-wave chunks off here,
    ``equal_lengths_one_wave`` has its own test.)"""
    rules = ft.PlanRules(equal_lengths_one_wave=False)
    off = rules.with_(solo_split_max_kv_heads=0, solo_recut=False)
    cases = [(ft.KVTree.from_lengths([-1] * 128, [2048] * 128, list(range(128))), 1, 448, 5),
             (ft.KVTree.from_lengths([-1] * 128, [2048] * 128, list(range(128))), 2, 704, 3),
             (ft.KVTree.from_lengths([-1] * 32, [4096] * 32, list(range(32))), 4, 832, 5)]  # fmt: skip
    for tree, hkv, unit, chunks in cases:
        plan = ft.plan(tree, num_q_heads=16 * hkv, num_kv_heads=hkv, head_dim=128, rules=rules)
        check_plan(tree, plan)
        assert plan.unit_kv_len.max() == unit and plan.n_units == tree.n_queries * chunks, hkv
        assert ft.plan(tree, num_q_heads=16 * hkv, num_kv_heads=hkv, head_dim=128, rules=off).unit_kv_len.max() == 128
    # above solo_split_max_kv_heads, groups already cut at the big split keep it
    tree = cases[2][0]
    plan = ft.plan(tree, num_q_heads=32, num_kv_heads=8, head_dim=128, rules=rules)
    assert plan.unit_kv_len.max() == 1024
    with pytest.raises(ValueError, match="solo_split_max_kv_heads"):
        ft.PlanRules(solo_split_max_kv_heads=-1)


def test_solo_share_keeps_unshared_requests_out_of_bins():
    """Independent requests at one KV head waste too little matrix work for the waste test, but
    hold all the KV: the share test keeps them out of the 64-row bins (one query per unit)."""
    tree = ft.KVTree.from_lengths([-1] * 64, [700] * 64, list(range(64)))
    plan = ft.plan(tree, num_q_heads=16, num_kv_heads=1, head_dim=128)
    check_plan(tree, plan)
    assert not any(tc.masked for tc, n in zip(plan.tile_classes, np.diff(plan.class_unit_ptr), strict=True) if n)
    binned = ft.plan(
        tree, num_q_heads=16, num_kv_heads=1, head_dim=128, rules=ft.PlanRules(solo_min_share=2.0, crossover_margin=0.0)
    )
    check_plan(tree, binned)
    assert binned.tile_classes[0].masked and binned.class_unit_ptr[1] > 0


# ---------------------------------------------------------- adaptive passes
def test_small_split_used_when_a_phase_has_few_units():
    tree = ft.KVTree.from_lengths([-1, 0, 0], [4000, 10, 10], [1, 2])
    cfg = ft.FastTreeConfig(para_threshs1=(10**6, 10**6), para_threshs2=(0, 0))
    plan = ft.plan(tree, cfg, num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert plan.tile_mode == TWO_CLASSES
    # every group is in the small phase; the empty large phase keeps the default split
    assert [tc.split for tc in plan.tile_classes] == [cfg.kv_split_sizes[0], cfg.kv_split_sizes[1]]
    assert plan.unit_kv_len.max() <= cfg.kv_split_sizes[1]
    # 8 uncut units x heads are too few for a threshold of 20 (x2 in the small phase): the big
    # split cuts the 4,000-token root, and its 32 units x heads are enough to keep it
    plan_big = ft.plan(tree, cfg.with_(para_threshs1=(20, 20)), num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert plan_big.unit_kv_len.max() == min(4010, cfg.kv_split_sizes[0])
    # thresholds of 0: every phase has enough units, so nothing is cut
    plan_whole = ft.plan(tree, cfg.with_(para_threshs1=(0, 0)), num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert plan_whole.unit_kv_len.max() >= 4000


def test_long_groups_stay_whole_where_a_phase_has_enough_units():
    # paper case 5: a 2,048-token root shared by 1,024 queries; uncut it already gives 512 units
    # x KV heads at GQA 16 (>= para_threshs1[0]), so it is not cut at 1,024 (which would add a
    # partial row and a merge for every query)
    tree = paper_tree(5)
    plan = ft.plan(tree, num_q_heads=16, num_kv_heads=1, head_dim=128)
    check_plan(tree, plan)
    assert plan.unit_kv_len.max() == 2048 and plan.n_partial_rows == 2 * 1024
    always_cut = ft.PlanRules(whole_groups_min_items=(10**9, 10**9))  # the published rule
    cut = ft.plan(tree, num_q_heads=16, num_kv_heads=1, head_dim=128, rules=always_cut)
    check_plan(tree, cut)
    assert cut.unit_kv_len.max() == 1024 and cut.n_partial_rows == 3 * 1024


def test_a_long_group_that_would_be_the_tail_is_still_cut():
    # a 32k-token document read by 64 queries (one 64-query tile) next to 100 short prompts read
    # by 128 queries each: plenty of units x heads uncut, but the document alone would hold 3.7x
    # the phase's KV x heads over para_threshs1[0], so it is cut at the big split as before
    parents, lengths, queries = [-1] + [0] * 64, [32768] + [8] * 64, list(range(1, 65))
    for _ in range(100):
        root = len(parents)
        parents += [-1] + [root] * 128
        lengths += [20] + [4] * 128
        queries += list(range(root + 1, root + 129))
    tree = ft.KVTree.from_lengths(parents, lengths, queries)
    heads = {"num_q_heads": 32, "num_kv_heads": 32, "head_dim": 128}
    plan = ft.plan(tree, **heads)
    check_plan(tree, plan)
    assert plan.unit_kv_len.max() == 1024
    assert ft.plan(tree, **heads, rules=ft.PlanRules(whole_groups_max_tail=100.0)).unit_kv_len.max() == 32768


@pytest.mark.parametrize(("threshs", "cut_small"), [((8, 9), False), ((8, 10), True)])
def test_small_phase_needs_twice_the_threshold_to_stay_whole(threshs, cut_small):
    # 9 one-query chains of 300 tokens (small phase) at 2 KV heads: 18 uncut units x heads, cut
    # once the small threshold doubled exceeds them
    tree = ft.KVTree.from_lengths([-1] * 9, [300] * 9, list(range(9)))
    cfg = ft.FastTreeConfig(kv_split_sizes=(128, 64), para_threshs1=threshs, para_threshs2=(0, 0))
    no_share = ft.PlanRules(solo_min_share=2.0)  # the share test would take every chain out of the pass
    plan = ft.plan(tree, cfg, num_q_heads=8, num_kv_heads=2, head_dim=64, rules=no_share)
    check_plan(tree, plan)
    assert (plan.unit_kv_len.max() <= 128) == cut_small


def test_tile_pass_forces_small_tiles_when_large_phase_is_underfilled():
    # one group with many queries (large phase) next to many small groups
    parents = [-1] + [0] * 40 + [1] * 30
    lengths = [64] + [300] * 40 + [8] * 30
    tree = ft.KVTree.from_lengths(parents, lengths, list(range(2, 71)))
    cfg = ft.FastTreeConfig(para_threshs1=(10**6, 10**6), para_threshs2=(10**6, 0))
    plan = ft.plan(tree, cfg, num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert plan.tile_mode == ALL_SMALL
    assert plan.tile_classes[0].queries == plan.tile_classes[1].queries == cfg.query_tiles(1)[1]
    check_plan(tree, plan)
    cfg_large = cfg.with_(para_threshs2=(0, 10**6))
    plan_large = ft.plan(tree, cfg_large, num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert plan_large.tile_mode == ALL_LARGE
    check_plan(tree, plan_large)
    # class 1 runs the large tiles, so with the large class's warps (MHA's small class has 2), and
    # its own stages (3: the large class's 5 ran these small launches slower)
    large, small = plan_large.tile_classes
    assert (small.block_m, small.num_warps, small.num_stages) == (large.block_m, 4, 3)
    assert cfg.launch_warps(1) == (4, 2) and cfg.launch_stages(1, 64) == (5, 3)


def test_all_large_tiles_without_large_groups_follow_the_rule():
    # every group small (one query per path): the small phase alone has too few units, and the
    # published planner moves it to the large tiles anyway (PlanRules.all_large_without_large, the
    # runtime's rule); by default it is planned all-small (one launch either way, and no 64-row
    # bins packed from its short units)
    tree = ft.KVTree.from_lengths([-1, 0, 1, 0, 3], [134, 1, 79, 171, 111], [2, 4])
    heads = {"num_q_heads": 2, "num_kv_heads": 2, "head_dim": 64}
    published = ft.plan(tree, **heads, rules=TREE_PLANS.with_(all_large_without_large=True))
    kept = ft.plan(tree, **heads, rules=TREE_PLANS)
    assert published.tile_mode == ALL_LARGE and published.tile_classes[1].block_m == 64
    assert kept.tile_mode == ALL_SMALL and [tc.block_m for tc in kept.tile_classes] == [16, 16]
    assert published.units_per_class()[0] == kept.units_per_class()[0] == 0
    for plan in (published, kept):
        check_plan(tree, plan)
    # with a large group beside the small ones, the rule does not apply: all-large either way
    parents = [-1] + [0] * 40 + [1] * 30
    tree = ft.KVTree.from_lengths(parents, [64] + [300] * 40 + [8] * 30, list(range(2, 71)))
    cfg = ft.FastTreeConfig(para_threshs1=(10**6, 10**6), para_threshs2=(0, 10**6))
    for flag in (True, False):
        rules = ft.PlanRules.defaults().with_(all_large_without_large=flag)
        assert ft.plan(tree, cfg, num_q_heads=4, num_kv_heads=4, head_dim=64, rules=rules).tile_mode == ALL_LARGE


def test_tile_pass_needs_a_split_change_first():
    # the published planner only reconsiders tiles when the split pass changed a split
    tree = paper_tree(2)
    cfg = ft.FastTreeConfig(para_threshs1=(0, 0), para_threshs2=(10**6, 10**6))
    assert ft.plan(tree, cfg, num_q_heads=32, num_kv_heads=8, head_dim=128).tile_mode == TWO_CLASSES


# ----------------------------------------------------------------- ablations
def _ones(tree, gamma, split, hq, hkv) -> int:
    cfg = ft.FastTreeConfig(gamma=gamma, kv_split_sizes=(split, min(split, 128)))
    plan = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    return int(plan.edge_assignment.sum())


@pytest.mark.parametrize("case", sorted(PAPER_SUITE))
def test_ablation_gammas_order_concatenation_on_suite(case):
    tree = paper_tree(case)
    for hq, hkv in PAPER_HEADS.values():
        no_greedy = _ones(tree, -10.0, 1024, hq, hkv)
        default = _ones(tree, 0.1, 1024, hq, hkv)
        query_centric = _ones(tree, 10.0, 81920, hq, hkv)
        assert no_greedy <= default <= query_centric


def test_ablation_extremes():
    # gamma = -10 keeps every context in its own group on a long-prefix tree ...
    tree = paper_tree(5)
    plan = ft.plan(tree, ft.FastTreeConfig(gamma=-10.0), num_q_heads=32, num_kv_heads=32, head_dim=128)
    assert plan.edge_assignment.sum() == 0
    assert plan.groups.n_groups == tree.n_nodes
    # ... and gamma = 10 with a huge split concatenates every edge where query tiles
    # cost no padding (GQA 16: one query per small tile): each query reads its whole
    # context in one unit and writes its output directly, with no merge.
    tree = paper_tree(1)
    cfg = ft.FastTreeConfig(gamma=10.0, kv_split_sizes=(81920, 81920))
    plan = ft.plan(tree, cfg, num_q_heads=16, num_kv_heads=1, head_dim=128)
    assert plan.edge_assignment[tree.parents >= 0].all()
    assert plan.merge_queries.size == 0 and plan.n_partial_rows == 0


def test_ragged_gather_matches_concatenation():
    rng = np.random.default_rng(3)
    for _ in range(100):
        lens = rng.integers(0, 6, size=int(rng.integers(1, 20)))
        indptr = np.concatenate([[0], np.cumsum(lens)])
        data = rng.integers(0, 1000, size=int(indptr[-1]))
        rows = rng.integers(0, lens.size, size=int(rng.integers(0, 30)))
        out_ptr, out = ragged_gather(indptr, data, rows)
        want = [data[indptr[r] : indptr[r + 1]] for r in rows]
        np.testing.assert_array_equal(out, np.concatenate(want) if want else data[:0])
        np.testing.assert_array_equal(np.diff(out_ptr), lens[rows])


def test_ragged_arange_matches_concatenation():
    rng = np.random.default_rng(4)
    for _ in range(100):
        n = int(rng.integers(0, 12))
        start, length = rng.integers(-5, 50, size=n), rng.integers(0, 5, size=n)
        want = np.concatenate([np.arange(a, a + b) for a, b in zip(start, length, strict=True)] + [[]])
        np.testing.assert_array_equal(ragged_arange(start, length), want)
        np.testing.assert_array_equal(ragged_arange(start, length, int(length.sum())), want)


# ------------------------------------------------- fast paths vs plain versions
def reference_greedy_state(tree: ft.KVTree, cost: PaddingCost) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plain greedy of ``reference_greedy`` with its query counts and group lengths."""
    assign = reference_greedy(tree, cost)
    n_cur = tree.subtree_queries.copy()
    for c in np.flatnonzero(assign):
        n_cur[tree.parents[c]] -= tree.subtree_queries[c]
    eff = tree.lengths.copy()
    for v in tree.level_order.tolist():  # parents before children
        if assign[v]:
            eff[v] += eff[tree.parents[v]]
    return assign, n_cur, eff


def reference_groups(tree: ft.KVTree, assign: np.ndarray) -> dict[int, tuple[list[int], list[int]]]:
    """node -> (ascending query ids, KV slots top of the chain first), groups with tokens and queries."""
    parents = tree.parents.tolist()
    members: dict[int, list[int]] = {}
    for j, v in enumerate(tree.query_nodes.tolist()):
        members.setdefault(v, []).append(j)
        while parents[v] >= 0:
            if assign[v] == 0:
                members.setdefault(parents[v], []).append(j)
            v = parents[v]
    out = {}
    for v, qs in members.items():
        chain = [v]
        while assign[chain[-1]] == 1 and parents[chain[-1]] >= 0:
            chain.append(parents[chain[-1]])
        slots = [s for u in reversed(chain) for s in tree.node_slots(u).tolist()]
        if slots:
            out[v] = (sorted(qs), slots)
    return out


def _random_tree_any_order(rng: np.random.Generator, **kw) -> ft.KVTree:
    tree = random_tree(rng, **kw)
    if rng.random() < 0.3:  # contiguous slots through from_lengths (its own fill path)
        tree = ft.KVTree.from_lengths(tree.parents, tree.lengths, tree.query_nodes)
    return tree


def test_greedy_counts_and_lengths_match_plain_implementation():
    rng = np.random.default_rng(11)
    for _ in range(150):
        tree = _random_tree_any_order(rng, max_nodes=150)
        cost = random_cost(rng)
        got = ft.greedy_edge_assignment(tree, cost)
        for a, b in zip(got, reference_greedy_state(tree, cost), strict=True):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype


@pytest.mark.parametrize("fill_tokens", [0, planner_mod.STRIDED_FILL_TOKENS, 10**12])
def test_groups_match_plain_membership_and_chains(fill_tokens):
    # every chain fill (strided copies, cumulative sums over indices or over slot ids)
    rng = np.random.default_rng(12 + fill_tokens % 89)
    trees = [paper_tree(case) for case in (1, 4, 6, 8)]
    trees += [_random_tree_any_order(rng, max_nodes=120) for _ in range(120)]
    for tree in trees:
        cost = random_cost(rng)
        if rng.random() < 0.5:  # long 1-chains
            cost = PaddingCost(cost.alpha, cost.beta, 10.0, cost.group_size, cost.q_tiles, cost.kv_tiles)
        assign, group_q, group_kv = ft.greedy_edge_assignment(tree, cost)
        groups = ft.build_groups(tree, assign, group_q, group_kv, strided_fill_tokens=fill_tokens)
        want = reference_groups(tree, assign)
        assert groups.node.tolist() == sorted(want)
        for i, v in enumerate(groups.node.tolist()):
            qs, slots = want[v]
            assert groups.q_ids[groups.q_indptr[i] : groups.q_indptr[i + 1]].tolist() == qs
            start, n = int(groups.kv_start[i]), int(groups.kv_len[i])
            assert groups.kv_slots[start : start + n].tolist() == slots
        assert groups.kv_slots.dtype == np.int32 and groups.q_ids.dtype == np.int64


def test_greedy_does_not_depend_on_scalar_threshold():
    # the plan is a function of the greedy's assignment, so equal assignments make equal plans:
    # random trees with random costs, and the paper trees with the costs ft.plan uses (every mode)
    rng = np.random.default_rng(13)
    cases = [(random_tree(rng, max_nodes=300), random_cost(rng)) for _ in range(40)]
    config = ft.FastTreeConfig()
    q_tiles = config.query_tiles(16)
    for mode in (TWO_CLASSES, ALL_LARGE, ALL_SMALL):
        tq, tk = mode_tiles(mode, q_tiles, config.kv_tile)
        cost = PaddingCost(config.alpha, config.beta, config.gamma, 16, tq, tk)
        cases += [(paper_tree(case), cost) for case in (8, 10, 15)]
    for tree, cost in cases:
        got = [ft.greedy_edge_assignment(tree, cost, scalar_edges=t) for t in (-1, 4, 10**9)]
        for other in got[1:]:
            for a, b in zip(got[0], other, strict=True):
                np.testing.assert_array_equal(a, b)


def test_cached_tree_index_plans_like_a_fresh_tree():
    rng = np.random.default_rng(14)
    for _ in range(10):
        tree = random_tree(rng, max_nodes=200)
        fresh = ft.KVTree(tree.parents, [tree.node_slots(i) for i in range(tree.n_nodes)], tree.query_nodes)
        for hq, hkv in PAPER_HEADS.values():  # the second and later plans reuse the tree's index
            a = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
        b = ft.plan(fresh, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
        for name in DEVICE_ARRAYS:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("case", sorted(PAPER_SUITE))
def test_from_levels_matches_generic_construction(case):
    tree = paper_tree(case)
    generic = ft.KVTree(tree.parents, [tree.node_slots(i) for i in range(tree.n_nodes)], tree.query_nodes)
    for name in ("parents", "lengths", "slot_indptr", "slots", "query_nodes", "depth", "level_order", "level_ptr"):
        np.testing.assert_array_equal(getattr(tree, name), getattr(generic, name))
        assert getattr(tree, name).dtype == getattr(generic, name).dtype
    for name in ("subtree_queries", "path_lengths"):
        np.testing.assert_array_equal(getattr(tree, name), getattr(generic, name))
    assert tree.max_slot == generic.max_slot


def test_class_kv_tile_shrinks_only_for_short_units():
    # 64 leaves of 16 tokens under one 8-token root: the small class holds the leaves
    short = ft.KVTree.from_levels([1, 64], [8, 16])
    unpacked = ft.FastTreeConfig(kv_tile=(64, 64), pack_tokens=0)
    plan = ft.plan(short, unpacked, num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert plan.tile_classes[1].block_n == 16
    check_plan(short, plan)
    # 100-token leaves: the configured tile stays
    long = ft.KVTree.from_levels([1, 64], [8, 100])
    plan = ft.plan(long, ft.FastTreeConfig(kv_tile=(64, 64)), num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert plan.tile_classes[1].block_n == 64
    # never above the configured tile
    plan = ft.plan(long, ft.FastTreeConfig(kv_tile=(16, 16)), num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert {tc.block_n for tc in plan.tile_classes} == {16}


def test_from_flat_matches_the_per_node_constructor_and_validates():
    rng = np.random.default_rng(12)
    for _ in range(5):
        tree = random_tree(rng, max_nodes=20)
        flat = ft.KVTree.from_flat(tree.parents, tree.lengths, tree.slots, tree.query_nodes)
        for name in ("parents", "lengths", "slot_indptr", "slots", "query_nodes", "subtree_queries", "path_lengths"):
            np.testing.assert_array_equal(getattr(flat, name), getattr(tree, name))
    with pytest.raises(ValueError, match="slots has 3 entries but the lengths add up to 4"):
        ft.KVTree.from_flat([-1, 0], [2, 2], [0, 1, 2], [1])
    with pytest.raises(ValueError, match=r"lengths\[1\] = -1 is negative"):
        ft.KVTree.from_flat([-1, 0], [2, -1], [0, 1], [1])
    with pytest.raises(ValueError, match="lengths has 1 entries but parents has 2 nodes"):
        ft.KVTree.from_flat([-1, 0], [2], [0, 1], [1])
    with pytest.raises(ValueError, match="negative slot id"):
        ft.KVTree.from_flat([-1, 0], [1, 1], [0, -5], [1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"solo_units": 1}, "PlanRules.solo_units must be a bool, got 1"),
        ({"solo_min_tokens": 0}, "PlanRules.solo_min_tokens must be a positive integer, got 0"),
        ({"wide_row_tokens": float("nan")}, "PlanRules.wide_row_tokens must be a finite number"),
        ({"aligned_max_longer": -1.0}, "PlanRules.aligned_max_longer must be >= 0"),
        ({"whole_groups_min_items": (1, -1)}, r"PlanRules.whole_groups_min_items\[1\] must be >= 0"),
        ({"wide_head_kv_tile": 48}, r"PlanRules.wide_head_kv_tile must be 0 or a power of two in \[16, 512\], got 48"),
        ({"wide_head_kv_tile": 8}, r"PlanRules.wide_head_kv_tile must be 0 or a power of two"),
        ({"wide_head_kv_tile": -16}, r"PlanRules.wide_head_kv_tile must be 0 or a power of two"),
        ({"wide_head_small_split": -64}, "PlanRules.wide_head_small_split must be a non-negative integer"),
        ({"wide_head_small_split_programs": 0}, "PlanRules.wide_head_small_split_programs must be a positive integer"),
    ],
)
def test_plan_rules_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ft.PlanRules(**kwargs)


def test_plan_refuses_what_is_not_plan_rules():
    with pytest.raises(ValueError, match="rules must be a PlanRules, got dict"):
        ft.plan(paper_tree(1), num_q_heads=4, num_kv_heads=1, head_dim=64, rules={"solo_units": False})


def test_runtime_rules_differ_from_the_defaults_only_where_the_runtime_needs():
    assert ft.PlanRules.defaults() == ft.PlanRules()
    for launches in (1, 2):
        rt = ft.PlanRules.runtime(launches)
        assert (rt.solo_units, rt.wide_units, rt.aligned_blocks) == (launches == 2, False, False)
        assert rt.all_large_without_large and not ft.PlanRules().all_large_without_large
        assert rt.wide_head_small_split == 0 and ft.PlanRules().wide_head_small_split == 64
        assert not rt.equal_lengths_one_wave and ft.PlanRules().equal_lengths_one_wave
        assert not rt.no_sharing_split_by_context and ft.PlanRules().no_sharing_split_by_context
        assert rt.crossover_wave_programs == 0 and ft.PlanRules().crossover_wave_programs == 132
        same = rt.with_(solo_units=True, wide_units=True, aligned_blocks=True)
        same = same.with_(all_large_without_large=False, wide_head_small_split=64, equal_lengths_one_wave=True)
        same = same.with_(no_sharing_split_by_context=True, crossover_wave_programs=132)
        assert same == ft.PlanRules()


def test_wide_head_small_split_caps_the_small_split_above_head_dim_128_only():
    """``PlanRules.wide_head_small_split`` caps the config's small split size above head dim 128
    only: a small tree whose phase takes the small split is cut into units of at most that many
    tokens there (more units), planned as the config with that small split would plan it, and
    left as it was at head dims 64 and 128 or with the cap off (0). The programs limit holds."""
    from fasttree.plan_rules import capped_small_split

    assert ft.PlanRules().wide_head_small_split == 64
    cap64, off = ft.PlanRules().with_(wide_head_small_split=64), ft.PlanRules().with_(wide_head_small_split=0)
    assert capped_small_split(256, 128, cap64) == 64 and capped_small_split(256, 32, cap64) == 32
    assert capped_small_split(128, 128, cap64) == 128 and capped_small_split(256, 128, off) == 128
    tree = ft.KVTree.from_lengths([-1, 0, 0, 0], [900, 300, 500, 700], [1, 2, 3])
    off = TREE_PLANS.with_(wide_head_small_split=0, wide_head_small_split_programs=10**6)  # in every plan
    on = off.with_(wide_head_small_split=64)
    for d in (64, 128, 256):
        heads = {"num_q_heads": 8, "num_kv_heads": 1, "head_dim": d}
        capped, uncapped = ft.plan(tree, **heads, rules=on), ft.plan(tree, **heads, rules=off)
        check_plan(tree, capped)
        if d != 256:
            assert _same_arrays(capped, uncapped)
            continue
        assert capped.n_units > uncapped.n_units  # the small phase cut finer
        as_config = ft.plan(tree, ft.FastTreeConfig(kv_split_sizes=(1024, 64)), **heads, rules=off)
        assert _same_arrays(capped, as_config)
        # at the default limit (24 programs) this 27-unit plan keeps its split
        limited = on.with_(wide_head_small_split_programs=24)
        assert _same_arrays(ft.plan(tree, **heads, rules=limited), uncapped)


def test_wide_head_small_split_programs_limits_the_cap_to_small_launches():
    """With ``PlanRules.wide_head_small_split_programs``, the cap applies only to plans whose units
    x KV heads at the config's split sizes are at most that many: the small tree above (27 units
    uncapped) is capped under a limit of 32 and planned as without the cap under a limit of 24."""
    tree = ft.KVTree.from_lengths([-1, 0, 0, 0], [900, 300, 500, 700], [1, 2, 3])
    heads = {"num_q_heads": 8, "num_kv_heads": 1, "head_dim": 256}
    off = TREE_PLANS.with_(wide_head_small_split=0)
    uncapped = ft.plan(tree, **heads, rules=off)
    rules = TREE_PLANS.with_(wide_head_small_split=64, wide_head_small_split_programs=32)
    capped = ft.plan(tree, **heads, rules=rules)
    check_plan(tree, capped)
    assert capped.n_units > uncapped.n_units
    every = TREE_PLANS.with_(wide_head_small_split=64, wide_head_small_split_programs=10**6)
    assert _same_arrays(capped, ft.plan(tree, **heads, rules=every))
    limited = ft.plan(tree, **heads, rules=rules.with_(wide_head_small_split_programs=24))
    check_plan(tree, limited)
    assert _same_arrays(limited, uncapped)


def test_wide_head_small_split_leaves_plans_without_a_merge_alone():
    """The cap applies only to plans that merge partial results at the config's splits: three
    independent requests of at most 128 tokens (each query one group, no group cut) keep their
    plan, which merges nothing; one request of 200 tokens (cut at the small split, merged) is
    capped, more units and still merged."""
    heads = {"num_q_heads": 8, "num_kv_heads": 1, "head_dim": 256}
    on = TREE_PLANS.with_(wide_head_small_split=64)
    off = TREE_PLANS.with_(wide_head_small_split=0)
    alone = ft.KVTree.from_lengths([-1, -1, -1], [100, 120, 90], [0, 1, 2])
    uncapped = ft.plan(alone, **heads, rules=off)
    assert uncapped.n_partial_rows == 0
    assert _same_arrays(ft.plan(alone, **heads, rules=on), uncapped)
    cut = ft.KVTree.from_lengths([-1, -1, -1], [100, 200, 90], [0, 1, 2])
    uncapped = ft.plan(cut, **heads, rules=off)
    capped = ft.plan(cut, **heads, rules=on)
    check_plan(cut, capped)
    assert uncapped.n_partial_rows > 0 and capped.n_units > uncapped.n_units


# ---------------------------------------------------------- crossover with plain decode
def test_crossover_returns_decode_plan_for_a_forest_at_gqa16():
    """A random forest with internal queries at 16 query heads per KV head: the tree plan's
    64-row bins cost more than decode's 16-row tiles by the crossover test, so plan() returns
    plain split-KV decode's plan; with the rule off, or at GQA 7, the tree plan."""
    from fasttree.costs import QUERY_SEPARATED
    from fasttree.toolkit.family_suite import CROSSOVER_CASES, family_tree

    case = next(c for c in CROSSOVER_CASES if c.name == "forest400/16x1/d128/fp16")
    tree = family_tree(case)
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128}
    plan = ft.plan(tree, **heads)
    decode = ft.plan_query_separated(tree, **heads)
    assert plan.tile_mode == QUERY_SEPARATED
    for name in ("kv_indices", "unit_kv_start", "unit_kv_len", "pair_query", "query_num_partials"):
        np.testing.assert_array_equal(getattr(plan, name), getattr(decode, name))
    check_plan(tree, plan)
    tree_plan = ft.plan(tree, **heads, rules=ft.PlanRules(crossover_margin=0.0))
    assert tree_plan.tile_mode != QUERY_SEPARATED
    check_plan(tree, tree_plan)
    assert ft.plan(tree, num_q_heads=28, num_kv_heads=4, head_dim=128).tile_mode != QUERY_SEPARATED
    # the decode plan carries the caller's rules (their launch rules apply to it)
    uncapped = ft.PlanRules.defaults().with_(wide_head_kv_tile=0)
    assert plan.rules == ft.PlanRules.defaults() and ft.plan(tree, **heads, rules=uncapped).rules == uncapped
    with pytest.raises(ValueError, match="rules must be a PlanRules"):
        ft.plan_query_separated(tree, **heads, rules={"wide_head_kv_tile": 0})


@pytest.mark.parametrize("case", [2, 5, 8, 9, 12])
def test_crossover_keeps_the_tree_plan_of_paper_trees(case):
    from fasttree.costs import QUERY_SEPARATED

    for hq, hkv in ((16, 1), (32, 2)):
        assert ft.plan(paper_tree(case), num_q_heads=hq, num_kv_heads=hkv, head_dim=128).tile_mode != QUERY_SEPARATED


def _same_arrays(a, b) -> bool:
    return a.class_unit_ptr == b.class_unit_ptr and all(
        np.array_equal(getattr(a, n), getattr(b, n)) for n in DEVICE_ARRAYS
    )


def _assembled_weighted_reads(plan, exponent: float) -> float:
    """The crossover test's cost of an assembled plan: each tile class's KV tokens x (rows / 16) **
    exponent."""
    ptr, work = plan.class_unit_ptr, 0.0
    for c, tile in enumerate(plan.tile_classes):
        if ptr[c + 1] > ptr[c]:
            work += int(plan.unit_kv_len[ptr[c] : ptr[c + 1]].sum(dtype=np.int64)) * (tile.block_m / 16) ** exponent
    return work


def test_the_crossover_is_decided_before_the_arrays_at_the_assembled_plans_cost():
    """plan() decides the crossover once the tree plan's units and bins are laid out, before its
    arrays are built. That cost is the assembled plan's to the last bit: with the limit at the
    assembled cost the plan is built (the same arrays), one float below it is abandoned. And
    plan() returns decode's plan exactly where the assembled tree plan costs more than 1.03x
    decode's (paper trees, random forests with internal queries, crossover batches; GQA 4-16,
    packing on and off; all-small trees planned all-small, as by default, and all-large; the
    weight's exponent as by default and raised; the one-wave crossover off, tested on its own)."""
    from fasttree.costs import QUERY_SEPARATED
    from fasttree.toolkit.family_suite import CROSSOVER_CASES, family_tree

    rng = np.random.default_rng(5)
    trees = [paper_tree(c) for c in (2, 6, 9, 11)]
    trees += [random_tree(rng, roots=int(rng.integers(1, 5))) for _ in range(12)]
    trees += [family_tree(c) for c in CROSSOVER_CASES if c.name.endswith("/16x1/d128/fp16")][:6]
    switched = kept = 0
    for tree, (hq, hkv), config, rules in itertools.product(
        trees, ((16, 1), (32, 2), (32, 8)), (ft.FastTreeConfig(), ft.FastTreeConfig(pack_tokens=0)),
        (TREE_PLANS, TREE_PLANS.with_(all_large_without_large=True), TREE_PLANS.with_(crossover_row_exponent=0.75)),
    ):  # fmt: skip
        off = rules.with_(crossover_margin=0.0)
        heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": 128}
        full = ft.plan(tree, config, **heads, rules=off)
        cost = _assembled_weighted_reads(full, rules.crossover_row_exponent)
        g = hq // hkv
        args = (tree, config, rules, g, config.query_tiles(g))
        at_cost = planner_mod._tree_plan(*args, **heads, max_weighted_reads=cost)
        assert at_cost is not None and _same_arrays(at_cost, full)
        assert planner_mod._tree_plan(*args, **heads, max_weighted_reads=np.nextafter(cost, -1.0)) is None
        decode = planner_mod._decode_weighted_reads(tree, g, rules.crossover_row_exponent)
        want = g >= 16 and cost > 1.03 * decode
        got = ft.plan(tree, config, **heads, rules=rules)
        assert (got.tile_mode == QUERY_SEPARATED) == want
        if not want:
            assert _same_arrays(got, full)
        switched += want
        kept += not want
    assert switched >= 6 and kept >= 150


def test_the_crossover_weighs_a_tiles_rows_by_the_rules_exponent():
    """A token read by a tile of ``block_m`` rows weighs ``(block_m / 16) ** exponent``: decode's
    cost scales so at GQA 32 (32-row tiles), and a drawn beam-search tree whose tree plan reads
    half of decode's tokens, all in 64-row tiles (0.94x decode's cost at exponent 0.5, 1.18x at
    0.66), keeps its tree plan at 0.5 and goes to decode at 0.66."""
    from fasttree.costs import QUERY_SEPARATED
    from fasttree.toolkit.workloads import sample_tree

    tree = sample_tree("beam_search", 69084)
    reads = float(np.dot(tree.lengths, tree.subtree_queries))
    for exponent in (0.5, 0.66, 1.0):
        assert planner_mod._decode_weighted_reads(tree, 16, exponent) == reads
        assert planner_mod._decode_weighted_reads(tree, 32, exponent) == pytest.approx(reads * 2**exponent)
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128}
    kept = ft.plan(tree, **heads, rules=ft.PlanRules(crossover_row_exponent=0.5))
    assert kept.tile_mode != QUERY_SEPARATED and {tc.block_m for tc in kept.tile_classes} == {64}
    assert 0.9 < _assembled_weighted_reads(kept, 0.5) / reads < 1.0
    sent = ft.plan(tree, **heads, rules=ft.PlanRules(crossover_row_exponent=0.66))
    assert sent.tile_mode == QUERY_SEPARATED


def test_crossover_wave_programs_sends_small_plans_with_longer_programs_to_decode():
    """``PlanRules.crossover_wave_programs`` (132 by default): where the tree plan and decode's
    plan each fit that many programs and decode's longest program reads fewer KV tiles than the
    tree plan's (two or more), ``ft.plan`` returns decode's plan, the same as
    ``plan_query_separated``; a limit below the tree plan's programs, or a tree whose plan's
    programs read one tile, or a one-unit tree plan (no merge) where decode would merge, keeps
    the tree plan."""
    from fasttree.costs import QUERY_SEPARATED
    from fasttree.planner import decode_shorter_in_one_wave, longest_program_tiles
    from fasttree.toolkit.workloads import sample_tree

    assert ft.PlanRules().crossover_wave_programs == 132
    tree = sample_tree("random_recursive", 18)
    heads = {"num_q_heads": 8, "num_kv_heads": 1, "head_dim": 256}
    kept = ft.plan(tree, **heads, rules=TREE_PLANS)
    assert kept.tile_mode != QUERY_SEPARATED and kept.n_units <= 132 and longest_program_tiles(kept) == 3
    on = ft.PlanRules().with_(crossover_wave_programs=132)
    sent = ft.plan(tree, **heads, rules=on)
    check_plan(tree, sent)
    assert sent.tile_mode == QUERY_SEPARATED and longest_program_tiles(sent) == 1
    assert _same_arrays(sent, ft.plan_query_separated(tree, **heads, rules=on))
    assert _same_arrays(ft.plan(tree, **heads, rules=on.with_(crossover_wave_programs=kept.n_units - 1)), kept)
    assert decode_shorter_in_one_wave(tree, kept, 104) is None  # decode's plan has 105 programs
    one_tile = ft.KVTree.from_lengths([-1, -1], [40, 50], [0, 1])
    assert ft.plan(one_tile, **heads, rules=on).tile_mode != QUERY_SEPARATED
    one_query = ft.KVTree.from_lengths([-1], [104], [0])
    mha = {"num_q_heads": 32, "num_kv_heads": 32, "head_dim": 128}
    whole = ft.plan(one_query, **mha, rules=on)
    split = ft.plan_query_separated(one_query, **mha, rules=on)
    assert whole.tile_mode != QUERY_SEPARATED and whole.n_partial_rows == 0 and longest_program_tiles(whole) == 2
    assert split.n_partial_rows > 0 and longest_program_tiles(split) == 1
    with pytest.raises(ValueError, match="crossover_wave_programs"):
        ft.PlanRules().with_(crossover_wave_programs=-1)


def test_crossover_merge_free_decode_spares_tiny_plans_their_merge():
    """``PlanRules.crossover_merge_free_decode`` (on by default): in the one-wave test, decode's plan
    wherever decode merges nothing and the tree plan merges, both within the wave's programs,
    whatever their KV tiles; every other plan as without it. Decode merges nothing within one wave
    only when every context fits one KV tile, so each tree sent holds contexts of at most 64
    tokens. On tiny random forests (nodes of up to 24 tokens) at the held-out head shapes."""
    from fasttree.costs import QUERY_SEPARATED
    from fasttree.toolkit.family_suite import family_tree, heldout_cases

    on = ft.PlanRules()
    assert on.crossover_merge_free_decode is True  # adopted
    off = on.with_(crossover_merge_free_decode=False)
    sent = 0
    for case in heldout_cases(94000, 42, families=("random_recursive",), params={"max_node_tokens": 24}):
        tree = family_tree(case)
        heads = {"num_q_heads": case.heads[0], "num_kv_heads": case.heads[1], "head_dim": case.head_dim}
        base, plan = ft.plan(tree, **heads, rules=off), ft.plan(tree, **heads, rules=on)
        check_plan(tree, plan)
        decode = ft.plan_query_separated(tree, **heads, rules=on)
        programs = on.crossover_wave_programs // heads["num_kv_heads"]  # units within the one-wave test
        spared = (
            base.tile_mode != QUERY_SEPARATED and base.n_partial_rows > 0 and base.n_units <= programs
            and decode.n_partial_rows == 0 and decode.n_units <= programs
        )  # fmt: skip
        if spared:
            sent += 1
            assert plan.tile_mode == QUERY_SEPARATED and _same_arrays(plan, decode)
            assert int(tree.path_lengths[tree.query_nodes].max()) <= 64
        else:
            assert _same_arrays(plan, base)
    assert sent >= 3  # the draw holds such trees (9 of these 42)


def test_unpacked_max_reads_drops_bins_that_reread_kv():
    """``PlanRules.unpacked_max_reads`` (added off): a plan whose units without bins would read at
    most that many times the packed plan's KV tokens packs nothing, and holds fewer KV entries; every
    other plan is as without it. Off by default, so no default plan changes. On a default held-out
    draw (token trees, beams and random forests are where packing re-reads split units' KV)."""
    from fasttree.plan_rules import ADDED_AS
    from fasttree.toolkit.family_suite import family_tree, heldout_cases

    base = ft.PlanRules()
    field = {f.name: f for f in base.__dataclass_fields__.values()}["unpacked_max_reads"]
    assert base.unpacked_max_reads == field.metadata[ADDED_AS] == 0.0  # off
    on = base.with_(unpacked_max_reads=0.7)
    dropped = 0
    for case in heldout_cases(96000, 40):
        tree = family_tree(case)
        heads = {"num_q_heads": case.heads[0], "num_kv_heads": case.heads[1], "head_dim": case.head_dim}
        packed, plan = ft.plan(tree, **heads, rules=base), ft.plan(tree, **heads, rules=on)
        check_plan(tree, plan)
        if _same_arrays(plan, packed):
            continue
        dropped += 1
        assert plan.kv_row_mask.size == 0 and packed.kv_row_mask.size > 0  # no bins left, there were some
        assert plan.kv_indices.size < packed.kv_indices.size
    assert dropped >= 3  # the draw holds such trees (6 of these 40)
    with pytest.raises(ValueError, match="unpacked_max_reads"):
        base.with_(unpacked_max_reads=-0.5)


def test_query_contexts_match_query_slots(monkeypatch):
    """Decode plans gather each query's context by the compiled chain walk: the same arrays as
    KVTree.query_slots on random forests (queries at roots and internal nodes, scattered slots)
    and on a tree of one-token nodes, with and without the compiled loops."""
    from fasttree.query_separated import query_contexts

    rng = np.random.default_rng(7)
    trees = [random_tree(rng, roots=int(rng.integers(1, 4))) for _ in range(60)]
    trees.append(ft.KVTree.from_lengths([-1, 0, 1, 2, 2], [1, 1, 1, 1, 1], [0, 3, 4, 4]))
    for tree in trees:
        want_ptr, want = tree.query_slots()
        got_ptr, got = query_contexts(tree)
        np.testing.assert_array_equal(got_ptr, want_ptr)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype == np.int32
    import fasttree.query_separated as qs_mod

    monkeypatch.setattr(qs_mod, "planner_library", lambda: None)  # no compiler: the numpy gather
    got_ptr, got = query_contexts(trees[0])
    np.testing.assert_array_equal(got, trees[0].query_slots()[1])


def test_decode_split_by_context_cuts_only_batches_of_one_chunk_per_query():
    """``PlanRules.decode_split_by_context``: where the queries x KV heads alone reach 4 x 132
    programs, plain decode without the rule reads each context whole (one chunk per query, the
    longest the tail); the rule caps the chunk at the summed context x KV heads over 4 x 132
    programs when that is at most four fifths of the longest context.
    600 requests of 64-2,048 tokens at one KV head: 2,048-token chunks, 600 programs; capped, the
    summed context over 528 rounded up to the tile, more programs. Smaller batches (64 requests of
    1-4k) keep the default's chunks; the tree plan's solo units are left alone."""
    from fasttree.plan_arrays import chunked_split
    from fasttree.query_separated import plan_query_separated, query_separated_split

    on = ft.PlanRules.defaults()
    assert on.decode_split_by_context is True  # adopted
    off = on.with_(decode_split_by_context=False)
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128}
    rng = np.random.default_rng(0)
    lens = rng.integers(64, 2049, 600)
    many = ft.KVTree.from_lengths([-1] * 600, lens, list(range(600)))
    base, cut = plan_query_separated(many, **heads, rules=off), plan_query_separated(many, **heads)
    # rules=None is the defaults: the benchmarks' baseline is the plan the crossover returns
    assert np.array_equal(cut.unit_kv_len, plan_query_separated(many, **heads, rules=on).unit_kv_len)
    longest = -(-int(lens.max()) // 64) * 64
    assert base.config.kv_split_sizes[0] == longest and base.n_units == 600
    per_program = -(-int(lens.sum()) // 528)
    capped = -(-per_program // 64) * 64
    assert cut.config.kv_split_sizes[0] == capped < longest and cut.n_units > 600
    for plan in (base, cut):
        check_plan(many, plan)
    assert query_separated_split(2048, 600, 1, 132, 64, context=int(lens.sum())) == capped
    # a cap just below the longest context (more than four fifths of it) is not taken
    assert query_separated_split(2048, 600, 1, 132, 64, context=600 * 1800) == 2048
    # 64 requests of 1-4k at one KV head: 9 chunks of the longest, left as they are
    mixed = ft.KVTree.from_lengths([-1] * 64, rng.integers(1024, 4097, 64), list(range(64)))
    for make in (plan_query_separated, ft.plan):
        a, b = make(mixed, **heads, rules=off), make(mixed, **heads, rules=on)
        for name in ("kv_indices", "unit_kv_start", "unit_kv_len", "pair_query"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert chunked_split(4096, 528, 32, 64, work=32 * 4096) == chunked_split(4096, 528, 32, 64) == 256


def test_one_wave_split_is_the_smallest_tile_multiple_that_fits_the_wave():
    """``one_wave_split``: the chunks of every context x KV heads fit the wave, one tile less does not;
    no chunk size fits when the queries x KV heads alone exceed it (one chunk per query then)."""
    from fasttree.plan_arrays import one_wave_split

    rng = np.random.default_rng(7)
    for _ in range(50):
        lens = rng.integers(1, 9000, int(rng.integers(1, 200))).astype(np.int64)
        heads, wave, tile = int(rng.choice([1, 2, 4, 8])), int(rng.choice([396, 528])), int(rng.choice([32, 64]))

        def count(split, lens=lens, heads=heads):
            return int(np.sum(-(-lens // split))) * heads

        split = one_wave_split(lens, heads, wave, tile)
        assert split % tile == 0 and split >= tile
        if lens.size * heads > wave:
            assert split == -(-int(lens.max()) // tile) * tile
        else:
            assert count(split) <= wave
            assert split == tile or count(split - tile) > wave
    # 32 requests of 4k at one KV head, 396 programs (3 per SM at head dim 256): 384-token chunks, 352 programs
    assert one_wave_split(np.full(32, 4096, dtype=np.int64), 1, 396, 64) == 384


def test_equal_lengths_one_wave_fits_equal_batches_to_one_wave_and_leaves_the_rest():
    """``PlanRules.equal_lengths_one_wave`` (on by default): plain decode's plans, and tree plans of
    batches without sharing, whose contexts are equal to within a KV tile run at most one wave of
    programs at ``decode_programs_per_sm`` per SM (4 above head dim 64 up to 128); mixed lengths,
    head dims 64 and 256 and trees with shared prefixes keep their plans."""
    from fasttree.plan_rules import decode_programs_per_sm

    assert ft.PlanRules.defaults().equal_lengths_one_wave is True
    assert [decode_programs_per_sm(d) for d in (64, 96, 128, 256)] == [None, 4, 4, None]
    off = ft.PlanRules.defaults().with_(equal_lengths_one_wave=False)
    for n, length, hq, hkv, d, today in ((16, 2048, 32, 8, 128, 640), (70, 4096, 8, 1, 96, 560)):
        tree = ft.KVTree.from_lengths([-1] * n, [length] * n, list(range(n)))
        heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}
        wave = decode_programs_per_sm(d) * 132
        for make in (ft.plan_query_separated, ft.plan):
            base, fitted = make(tree, **heads, rules=off), make(tree, **heads)
            assert base.n_units * hkv == today > wave
            assert fitted.n_units * hkv <= wave
            check_plan(tree, fitted)
        # within one tile of each other: still equal; a tile apart: not
        near = ft.KVTree.from_lengths([-1] * n, [length - (i % 2) * 63 for i in range(n)], list(range(n)))
        assert ft.plan_query_separated(near, **heads).n_units * hkv <= wave
    rng = np.random.default_rng(0)
    lens = rng.integers(1024, 4097, 64)
    mixed = ft.KVTree.from_lengths([-1] * 64, lens, list(range(64)))
    shared = ft.KVTree.from_lengths([-1, 0, 0, 0, 0], [4096, 300, 300, 300, 300], [1, 2, 3, 4])
    narrow = ft.KVTree.from_lengths([-1] * 32, [2048] * 32, list(range(32)))
    wide = ft.KVTree.from_lengths([-1] * 32, [4096] * 32, list(range(32)))  # would change at head dim <= 128
    for tree, d, makers in (
        (wide, 256, (ft.plan_query_separated, ft.plan)),
        (mixed, 128, (ft.plan_query_separated, ft.plan)),
        (shared, 128, (ft.plan,)),  # a tree plan with sharing (plain decode of it reads equal contexts)
        (narrow, 64, (ft.plan_query_separated, ft.plan)),
    ):
        heads = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": d}
        for make in makers:
            a, b = make(tree, **heads, rules=off), make(tree, **heads)
            for name in ("kv_indices", "unit_kv_start", "unit_kv_len", "pair_query"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def _independent_requests(n: int, lo: int, hi: int, seed: int) -> ft.KVTree:
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi, n)
    return ft.KVTree.from_lengths([-1] * n, lens, list(range(n)))


def test_no_sharing_split_by_context_caps_long_requests_in_large_batches():
    """``PlanRules.no_sharing_split_by_context`` (on by default, off in the runtime's fixed launch):
    a tree plan of 140 independent requests of 16-1,500 tokens at 16/4 heads (560 items, more than
    ``para_threshs1[1]`` = 528 programs) cuts its longest requests at the big split (1,024)
    without the rule; with it, no unit is longer than the chunk that cuts the summed context x KV
    heads into about 528 programs.
    Fewer items (2 KV heads), a batch with a shared prefix, or a chunk above four fifths of the
    longest request leave the plan as it was."""
    from fasttree.plan_arrays import chunked_split

    assert ft.PlanRules.defaults().no_sharing_split_by_context is True
    assert not any(ft.PlanRules.runtime(n).no_sharing_split_by_context for n in (1, 2))
    assert ft.PlanRules.runtime(1, variants=True).no_sharing_split_by_context
    on = ft.PlanRules.defaults().with_(crossover_margin=0.0)  # tree plans only
    off = on.with_(no_sharing_split_by_context=False)
    tree = _independent_requests(140, 16, 1500, 4180)
    lens = tree.path_lengths[tree.query_nodes]
    heads = {"num_q_heads": 16, "num_kv_heads": 4, "head_dim": 64}
    base, capped = ft.plan(tree, **heads, rules=off), ft.plan(tree, **heads, rules=on)
    check_plan(tree, capped)
    cap = chunked_split(int(lens.max()), 528, 560, 64, int(lens.sum()) * 4)
    assert base.unit_kv_len.max() == 1024 > cap >= capped.unit_kv_len.max()
    assert capped.n_units > base.n_units
    shared = ft.KVTree.from_lengths([-1, 0, 0, *[-1] * 138], [200, 50, 60, *lens[2:]], list(range(1, 141)))
    equal = ft.KVTree.from_lengths([-1] * 140, [1000] * 140, list(range(140)))  # the chunk above 4/5 of 1,000
    for t, hkv in ((tree, 2), (shared, 4), (equal, 4)):
        h = {"num_q_heads": 4 * hkv, "num_kv_heads": hkv, "head_dim": 64}
        assert _same_arrays(ft.plan(t, **h, rules=off), ft.plan(t, **h, rules=on)), hkv
