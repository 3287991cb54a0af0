"""Packing small units into masked units: the bins, their masks and the plans that use them."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner import check_plan
from trees import random_tree

import fasttree as ft
from fasttree.packing import MAX_PACK_QUERIES, pack_units
from fasttree.toolkit.suite import paper_tree


def _units(q_lists, kv_lens):
    """Unit arrays for units with the given query lists and KV lengths (slots 0, 1, 2, ...)."""
    q_len = np.array([len(x) for x in q_lists])
    pair_start = np.concatenate([[0], np.cumsum(q_len)[:-1]])
    kv_len = np.array(kv_lens)
    kv_start = np.concatenate([[0], np.cumsum(kv_len)[:-1]])
    return dict(
        kv_start=kv_start,
        kv_len=kv_len,
        pair_start=pair_start,
        q_len=q_len,
        pair_query=np.concatenate([np.array(x) for x in q_lists]),
        kv_slots=np.arange(int(kv_len.sum()), dtype=np.int32) + 1000,
    )


def test_bins_follow_blocks_and_budget():
    # 8 one-query units of 10 tokens, queries 0..7 in DFS order; 4 queries and 25 tokens per bin
    u = _units([[j] for j in range(8)], [10] * 8)
    p = pack_units(**u, eligible=np.ones(8, bool), query_rank=np.arange(8), capacity=4, budget=25)
    # per block of 4 queries the runs are units {0, 1, 2} and {3}: one bin + one unit left alone
    assert p.n_packed == 6
    assert p.is_bin.tolist() == [False, False, True, True]
    # units 3 and 7 keep their KV; they read 20 of 80 input slots, so only theirs are kept
    for u_i, (start, n) in zip((3, 7), zip(p.kv_start[:2], p.kv_len[:2], strict=True), strict=True):
        np.testing.assert_array_equal(p.kv_slots[start : start + n], 1000 + 10 * u_i + np.arange(10))
    assert p.kv_slots.size == 20 + 60
    b = 2
    s, n = int(p.kv_start[b]), int(p.kv_len[b])
    assert n == 30
    np.testing.assert_array_equal(p.kv_slots[s : s + n], 1000 + np.arange(30))
    np.testing.assert_array_equal(p.kv_row_mask[s : s + n], np.repeat([1, 2, 4], 10))
    assert (p.q_len[b], p.pair_query[p.pair_start[b] : p.pair_start[b] + 3].tolist()) == (3, [0, 1, 2])
    assert p.pair_present[p.pair_start[b] : p.pair_start[b] + 3].all()
    assert np.all(p.kv_row_mask[:20] == -1)


def test_shared_queries_share_a_row_and_holes_are_absent():
    # units over queries {0, 2} and {2}: one bin with rows 0..2; row 1 serves nobody
    u = _units([[0, 2], [2]], [5, 7])
    p = pack_units(**u, eligible=np.ones(2, bool), query_rank=np.arange(3), capacity=4, budget=100)
    assert p.is_bin.tolist() == [True]
    assert p.pair_query.tolist() == [0, 1, 2]
    assert p.pair_present.tolist() == [True, False, True]
    s = int(p.kv_start[0])
    np.testing.assert_array_equal(p.kv_row_mask[s : s + 12], [0b101] * 5 + [0b100] * 7)


def test_bin_rows_start_at_its_lowest_query():
    # queries 2 and 3 of a 4-query block: the bin has 2 rows, not 4
    u = _units([[2], [3]], [5, 6])
    p = pack_units(**u, eligible=np.ones(2, bool), query_rank=np.arange(4), capacity=4, budget=100)
    assert (p.q_len.tolist(), p.pair_query.tolist()) == ([2], [2, 3])
    np.testing.assert_array_equal(p.kv_row_mask[int(p.kv_start[0]) :], [1] * 5 + [2] * 6)


def test_dfs_rank_not_query_id_decides_blocks():
    # query ids 0..3 sit at DFS ranks 3, 0, 2, 1: blocks of 2 ranks hold queries {1, 3} and {2, 0}
    u = _units([[0], [1], [2], [3]], [4, 4, 4, 4])
    rank = np.array([3, 0, 2, 1])
    p = pack_units(**u, eligible=np.ones(4, bool), query_rank=rank, capacity=2, budget=100)
    bins = [p.pair_query[p.pair_start[b] : p.pair_start[b] + p.q_len[b]].tolist() for b in range(2)]
    assert bins == [[1, 3], [2, 0]]


def test_units_across_blocks_are_cut_and_ineligible_units_stay():
    # unit 0 (queries 1, 2) crosses blocks {0, 1} / {2, 3}: each piece joins its block's bin
    u = _units([[1, 2], [0], [3], [4]], [4, 4, 4, 4])
    eligible = np.array([True, True, True, False])
    p = pack_units(**u, eligible=eligible, query_rank=np.arange(5), capacity=2, budget=100)
    assert p.is_bin.tolist() == [False, True, True]
    s3 = int(p.kv_start[0])  # unit 3 is left alone
    np.testing.assert_array_equal(p.kv_slots[s3 : s3 + 4], 1000 + 12 + np.arange(4))
    bins = [p.pair_query[p.pair_start[b] : p.pair_start[b] + p.q_len[b]].tolist() for b in (1, 2)]
    assert bins == [[0, 1], [2, 3]]
    # unit 0's 4 tokens appear in both bins, each time for its query there only
    for b, want in ((1, [1] * 4 + [2] * 4), (2, [1] * 4 + [2] * 4)):
        s0 = int(p.kv_start[b])
        np.testing.assert_array_equal(p.kv_row_mask[s0 : s0 + 8], want)
        np.testing.assert_array_equal(
            np.sort(p.kv_slots[s0 : s0 + 8]), 1000 + np.sort([0, 1, 2, 3, 4 * b, 4 * b + 1, 4 * b + 2, 4 * b + 3])
        )


def test_a_cut_unit_alone_in_its_block_still_becomes_a_bin():
    u = _units([[0, 1, 2, 3]], [5])
    p = pack_units(**u, eligible=np.ones(1, bool), query_rank=np.arange(4), capacity=2, budget=100)
    assert p is None  # one unit: nothing to pack
    u = _units([[0, 1, 2], [3]], [5, 2])
    p = pack_units(**u, eligible=np.ones(2, bool), query_rank=np.arange(4), capacity=2, budget=100)
    assert p.is_bin.tolist() == [True, True] and p.q_len.tolist() == [2, 2]


def test_balanced_runs_leave_no_short_last_bin():
    # a block of 4 queries: a 528-token unit they share, then one 16-token leaf each (592 tokens);
    # a budget of 574 fills a bin with all but the last leaf, which stays a plain unit
    u = _units([[0, 1, 2, 3], [0], [1], [2], [3]], [528, 16, 16, 16, 16])
    kw = dict(eligible=np.ones(5, bool), query_rank=np.arange(4), capacity=4, budget=574)
    fill = pack_units(**u, **kw)
    assert fill.is_bin.tolist() == [False, True] and fill.kv_len.tolist() == [16, 576]
    balanced = pack_units(**u, **kw, balanced=True)  # round(592 / 574) = 1 bin
    assert balanced.is_bin.tolist() == [True] and balanced.kv_len.tolist() == [592]
    assert balanced.q_len.tolist() == [4] and balanced.pair_present.all()


@pytest.mark.parametrize(
    ("budget", "want"), [(40, [30, 30]), (25, [30, 30]), (20, [20, 20, 20]), (50, [60]), (70, [60])]
)
def test_balanced_runs_split_a_block_evenly(budget, want):
    # six 10-token units of one 8-query block: round(60 / budget) bins of about equal tokens
    u = _units([[j] for j in range(6)], [10] * 6)
    p = pack_units(**u, eligible=np.ones(6, bool), query_rank=np.arange(8), capacity=8, budget=budget, balanced=True)
    assert p.is_bin.all() and p.kv_len.tolist() == want
    assert sorted(p.pair_query[p.pair_present].tolist()) == list(range(6))


@pytest.mark.parametrize("case", [11, 15])
def test_gqa16_deep_tree_bins_hold_whole_blocks(case):
    # paper cases 11-15 at GQA 16: filled bins left a 16-token leaf per 4-query block in a second,
    # 16-row tile class with a merge (512 partial rows); balanced bins hold whole blocks
    tree = paper_tree(case)
    plan = ft.plan(tree, num_q_heads=16, num_kv_heads=1, head_dim=128)
    assert plan.n_partial_rows == 0
    assert plan.stats()["units"][1] == 0
    check_plan(tree, plan)


def test_balanced_bins_rule():
    tree = paper_tree(11)
    filled = ft.plan(tree, num_q_heads=16, num_kv_heads=1, head_dim=128, rules=ft.PlanRules(balanced_bins=False))
    assert filled.n_partial_rows == 512  # as before balanced runs (the latency model re-plans such traces)
    check_plan(tree, filled)
    # MHA's 16-query bins live in the small tile: they are filled either way
    mha = [ft.plan(paper_tree(1), num_q_heads=32, num_kv_heads=32, head_dim=128, rules=ft.PlanRules(balanced_bins=b))
           for b in (True, False)]  # fmt: skip
    assert mha[0].n_partial_rows == mha[1].n_partial_rows
    np.testing.assert_array_equal(mha[0].unit_kv_len, mha[1].unit_kv_len)


@pytest.mark.parametrize(("capacity", "budget"), [(0, 10), (MAX_PACK_QUERIES + 1, 10), (4, 0)])
def test_pack_units_rejects_bad_sizes(capacity, budget):
    u = _units([[0], [1]], [4, 4])
    with pytest.raises(ValueError, match=r"(capacity|budget) must be"):
        pack_units(**u, eligible=np.ones(2, bool), query_rank=np.arange(2), capacity=capacity, budget=budget)


@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (16, 1)])
def test_deep_tree_packs_its_leaves(heads):
    tree = paper_tree(10)  # 1024 leaves of 16 tokens
    hq, hkv = heads
    off = ft.plan(tree, ft.FastTreeConfig(pack_tokens=0), num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    on = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    check_plan(tree, on)
    assert on.tile_classes[0].masked or on.tile_classes[1].masked
    assert on.n_units * 2 <= off.n_units
    assert on.n_partial_rows <= off.n_partial_rows


def test_pack_min_units_keeps_small_trees_parallel():
    tree = ft.KVTree.from_levels([1, 64], [8, 32])
    cfg = ft.FastTreeConfig(pack_min_units=512)
    plan = ft.plan(tree, cfg, num_q_heads=32, num_kv_heads=32, head_dim=128)
    check_plan(tree, plan)
    assert plan.units_per_class()[1] * 32 >= 512
    greedy = ft.plan(tree, cfg.with_(pack_min_units=0), num_q_heads=32, num_kv_heads=32, head_dim=128)
    assert greedy.units_per_class()[1] < plan.units_per_class()[1]


def test_random_packed_plans_cover_contexts_once():
    rng = np.random.default_rng(7)
    masked = 0
    for _ in range(60):
        tree = random_tree(rng, max_nodes=40, max_len=64)
        g = int(rng.choice([1, 2, 4, 16]))
        cfg = ft.FastTreeConfig(
            pack_tokens=int(rng.choice([8, 32, 300])),
            pack_min_units=int(rng.choice([0, 64])),
            q_tile_queries=(int(rng.choice([16, 64])) // min(g, 16) or 1, 1 + int(rng.integers(0, 16 // g or 1))),
            kv_split_sizes=(128, int(rng.choice([16, 64]))),
        )
        cfg = cfg.with_(q_tile_queries=(max(cfg.q_tile_queries), cfg.q_tile_queries[1]))
        plan = ft.plan(tree, cfg, num_q_heads=g, num_kv_heads=1, head_dim=64)
        check_plan(tree, plan)
        masked += plan.tile_classes[1].masked
    assert masked >= 20


def _matrix_work(plan) -> int:
    """Padded matrix rows x KV tokens of the plan's stage-1 units, all KV heads."""
    ptr, work = plan.class_unit_ptr, 0
    for c in (0, 1):
        work += int(plan.unit_kv_len[ptr[c] : ptr[c + 1]].astype(np.int64).sum()) * plan.tile_classes[c].block_m
    return work * plan.num_kv_heads


@pytest.mark.parametrize("heads", [(32, 8), (16, 1)])
def test_long_one_query_leaves_stay_out_of_large_bins(heads):
    # case 8: 1024 private 256-token leaves; in 64-row bins each would do 4x its 16-row tile's work
    tree = paper_tree(8)
    hq, hkv = heads
    solo = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    no_solo = ft.PlanRules(solo_units=False, crossover_margin=0.0)  # at 16/1 the binned plan goes to decode
    binned = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, rules=no_solo)
    check_plan(tree, solo)
    leaves = tree.n_queries
    small = solo.class_unit_ptr[2] - solo.class_unit_ptr[1]
    assert small >= leaves and not solo.tile_classes[1].masked
    assert _matrix_work(solo) * 1.8 < _matrix_work(binned)  # 8/gqa4: 0.39x, 8/gqa16: 0.53x
    assert solo.stats()["kv_tokens_read"] == binned.stats()["kv_tokens_read"]


@pytest.mark.parametrize("case", [6, 9, 10])
def test_little_waste_keeps_long_units_in_bins(case):
    # below solo_min_waste_flops the bins' fewer programs and partials pay (measured, 6/gqa4 and 9/gqa4)
    tree = paper_tree(case)
    rules = (ft.PlanRules(), ft.PlanRules(solo_units=False), ft.PlanRules(solo_min_waste_flops=0))
    plans = [ft.plan(tree, num_q_heads=32, num_kv_heads=8, head_dim=128, rules=r) for r in rules]
    assert plans[0].units_per_class() == plans[1].units_per_class()
    assert np.array_equal(plans[0].unit_kv_len, plans[1].unit_kv_len)
    # without the waste bound 6's and 9's long units do stay out (the bound keeps them in); 10 has none
    assert (plans[2].units_per_class() != plans[0].units_per_class()) == (case != 10)


#: Rules whose choice between packed and whole wide units always packs them, and one that keeps
#: them whole wherever that reads fewer KV tokens (a partial row then costs nothing).
PACKED, WHOLE = ft.PlanRules(wide_units=False), ft.PlanRules(wide_row_tokens=0.0)


@pytest.mark.parametrize("case", [11, 13])
def test_wide_units_kept_whole_read_their_kv_once_per_tile(case):
    """MHA's large-tile units (up to 64 queries) against 16-query bins: packed, each bin re-reads
    their KV; kept whole they read it once per 64-query tile, and the plans still cover every
    context once."""
    tree = paper_tree(case)
    packed = ft.plan(tree, num_q_heads=32, num_kv_heads=32, head_dim=128, rules=PACKED)
    whole = ft.plan(tree, num_q_heads=32, num_kv_heads=32, head_dim=128, rules=WHOLE)
    for plan in (packed, whole):
        check_plan(tree, plan)
    assert packed.units_per_class()[0] == 0 < whole.units_per_class()[0]
    assert whole.stats()["kv_tokens_read"] < 0.6 * packed.stats()["kv_tokens_read"]  # 11/mha: 28,160 vs 51,200
    gqa = [ft.plan(tree, num_q_heads=32, num_kv_heads=8, head_dim=128, rules=r) for r in (PACKED, WHOLE)]
    assert gqa[0].stats() == gqa[1].stats()  # GQA bins hold a large tile


def _wide_plans(tree, **kw) -> dict:
    """The default plan of ``tree`` (MHA 32 heads) and the two it chooses between."""
    heads = dict(num_q_heads=32, num_kv_heads=32, head_dim=128)
    out = {"chosen": ft.plan(tree, **heads, **kw)}
    out["packed"] = ft.plan(tree, **heads, rules=PACKED)
    out["whole"] = ft.plan(tree, **heads, rules=WHOLE)
    return out


def _wide_cost(plan) -> float:
    return plan.stats()["kv_tokens_read"] + ft.PlanRules().wide_row_tokens * plan.n_partial_rows


@pytest.mark.parametrize(("case", "choice"), [(2, "packed"), (6, "packed"), (8, "whole"), (11, "whole"), (14, "whole")])
def test_wide_units_whole_where_fewer_tokens_and_rows_cost_less(case, choice):
    # the paper cases where keeping the wide units whole was faster on the H200 (8, 11-15/mha) and
    # some where it was slower (2, 6/mha): the cost in KV tokens plus partial rows tells them apart
    plans = _wide_plans(paper_tree(case))
    assert plans["packed"].stats() != plans["whole"].stats()
    other = "whole" if choice == "packed" else "packed"
    assert _wide_cost(plans[choice]) < _wide_cost(plans[other])
    assert plans["chosen"].stats() == plans[choice].stats()
    assert plans["chosen"].n_partial_rows == plans[choice].n_partial_rows
    check_plan(paper_tree(case), plans["chosen"])


@pytest.mark.parametrize("family", ["speculative", "few_shot", "beam_search"])
def test_wide_unit_choice_takes_the_cheaper_plan_of_random_trees(family):
    from fasttree.toolkit.workloads import sample_tree

    chose = set()
    for seed in range(2000, 2012):
        tree = sample_tree(family, seed)
        plans = _wide_plans(tree)
        if plans["packed"].stats() == plans["whole"].stats():
            assert plans["chosen"].stats() == plans["packed"].stats()
            continue
        cheaper = min(("packed", "whole"), key=lambda name: _wide_cost(plans[name]))
        assert plans["chosen"].stats() == plans[cheaper].stats()
        assert plans["chosen"].n_partial_rows == plans[cheaper].n_partial_rows
        check_plan(tree, plans["chosen"])
        chose.add(cheaper)
    assert chose, f"no {family} tree of these seeds has wide units"


def test_wide_units_false_packs_them():
    plans = _wide_plans(paper_tree(11), rules=ft.PlanRules(wide_units=False))
    assert plans["chosen"].stats() == plans["packed"].stats() != plans["whole"].stats()


# ---------------------------------------------------------------- aligned blocks
def test_aligned_blocks_keep_a_short_unit_whole():
    # queries 0..5; unit 0 = queries {2, 3} (a shared node, 20 tokens) and one leaf per query.
    # Fixed blocks of 4 ranks ({0..3}, {4, 5}) keep unit 0 whole too; shifted by one query
    # ({1, 2}, {3, 4} with capacity 2 from rank 1), the fixed blocks cut it and aligned ones do not.
    u = _units([[1, 2], [0], [1], [2], [3]], [20, 3, 3, 3, 3])
    kw = dict(eligible=np.ones(5, bool), query_rank=np.arange(4), capacity=2, budget=100)
    fixed = pack_units(**u, **kw)  # blocks {0, 1}, {2, 3}: unit 0 is cut, its 20 tokens read twice
    aligned = pack_units(**u, **kw, aligned=True)  # blocks {0}, {1, 2}, {3}
    assert int(fixed.kv_len.sum()) == 20 * 2 + 4 * 3
    assert int(aligned.kv_len.sum()) == 20 + 4 * 3
    # in the aligned bin of queries 1 and 2, unit 0's tokens are attended by both rows
    b = int(np.flatnonzero(aligned.is_bin & (aligned.kv_len > 20))[0])
    s = int(aligned.kv_start[b])
    assert aligned.pair_query[aligned.pair_start[b] : aligned.pair_start[b] + 2].tolist() == [1, 2]
    masks = aligned.kv_row_mask[s : s + int(aligned.kv_len[b])]
    np.testing.assert_array_equal(np.sort(aligned.kv_slots[s : s + 20]), 1000 + np.arange(20))
    assert set(masks[:20].tolist()) == {0b11} and sorted(masks[20:].tolist()) == [0b01] * 3 + [0b10] * 3
    # None: the aligned bins read less and their longest unit is no longer, so they are taken
    chosen = pack_units(**u, **kw, aligned=None)
    assert int(chosen.kv_len.sum()) == int(aligned.kv_len.sum())


def test_aligned_blocks_are_not_taken_when_they_read_more_or_a_unit_grows_much_longer():
    from fasttree.packing import _aligned_blocks_pay, _Bins

    def bins(units, tokens, new_bin):
        n = len(units)
        return _Bins(np.array(units), np.zeros(n, np.int64), np.ones(n, np.int64), np.array(new_bin), np.array(tokens))

    kv_len = np.array([40, 10, 10, 10])
    fixed = bins([0, 1, 0, 2], [40, 10, 40, 10], [True, False, True, False])  # unit 0 in two bins: 110 read, 50 long
    assert _aligned_blocks_pay(kv_len, fixed, bins([0, 1], [40, 10], [True, False]), 1.1)  # 70 read, 50 long
    assert _aligned_blocks_pay(kv_len, fixed, fixed, 1.1)  # equal: taken
    assert not _aligned_blocks_pay(kv_len, fixed, bins([0, 1, 2], [40, 10, 10], [True, False, False]), 1.1)  # 60 > 55
    small = bins([1, 2], [10, 10], [True, False])  # 70 read, 40 long
    assert not _aligned_blocks_pay(kv_len, small, fixed, 1.1)  # reads more
    assert _aligned_blocks_pay(kv_len, small, None, 1.1)  # no bins: 70 read, 40 long
    assert not _aligned_blocks_pay(kv_len, None, fixed, 1.1)
    # through pack_units: the first test's case, with the bound on the longest unit lowered below it
    u = _units([[1, 2], [0], [1], [2], [3]], [20, 3, 3, 3, 3])
    kw = dict(eligible=np.ones(5, bool), query_rank=np.arange(4), capacity=2, budget=100)
    fixed, aligned = pack_units(**u, **kw), pack_units(**u, **kw, aligned=True)
    bound = 0.5 * aligned.kv_len.max() / fixed.kv_len.max()
    np.testing.assert_array_equal(pack_units(**u, **kw, aligned=None, max_longer=bound).kv_len, fixed.kv_len)
    np.testing.assert_array_equal(pack_units(**u, **kw, aligned=None).kv_len, aligned.kv_len)


def test_aligned_blocks_hold_at_most_capacity_and_end_where_no_short_unit_continues():
    from fasttree.packing import _aligned_blocks, _candidates

    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 60))
        cap = int(rng.integers(2, 9))
        spans = [(int(a), int(a + rng.integers(0, 12))) for a in rng.integers(0, n, int(rng.integers(1, 12)))]
        spans = [(a, min(b, n - 1)) for a, b in spans]
        q_lists = [list(range(a, b + 1)) for a, b in spans]
        q_len = np.array([len(x) for x in q_lists])
        pair_start = np.concatenate([[0], np.cumsum(q_len)[:-1]])
        cand = np.arange(len(q_lists))
        pair_query = np.concatenate(q_lists)
        cands = _candidates(np.ones(cand.size, bool), cand, q_len, pair_start, pair_query, np.arange(n), True)
        got = _aligned_blocks(cands, n, cap)
        if got is None:  # the fixed blocks
            continue
        block_of_rank, start_of_rank = got
        starts = np.unique(start_of_rank)
        sizes = np.diff(np.append(starts, n))
        assert sizes.min() >= 1 and sizes.max() <= cap
        np.testing.assert_array_equal(block_of_rank, np.searchsorted(starts, np.arange(n), side="right") - 1)
        short = [(a, b) for a, b in spans if 0 < b - a < cap]
        for s in starts[1:]:
            split = [(a, b) for a, b in short if a < s <= b]
            if split:  # a boundary inside a short unit: no boundary within reach was free of them
                prev = starts[np.searchsorted(starts, s) - 1]
                assert s == prev + cap


def test_aligned_blocks_never_read_more_kv_than_fixed_ones_on_random_trees():
    from fasttree.toolkit.workloads import sample_tree

    changed = 0
    for family in ("multi_document", "beam_search", "paper_random", "random_recursive", "speculative"):
        for seed in range(3000, 3006):
            tree = sample_tree(family, seed)
            for hq, hkv in ((32, 32), (32, 8), (16, 1)):
                kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
                on = ft.plan(tree, **kw, rules=PACKED)
                off = ft.plan(tree, **kw, rules=PACKED.with_(aligned_blocks=False))
                assert int(on.unit_kv_len.sum()) <= int(off.unit_kv_len.sum())
                assert int(on.unit_kv_len.max()) <= 1.1 * int(off.unit_kv_len.max())
                if on.stats() != off.stats():
                    changed += 1
                    check_plan(tree, on)
    assert changed >= 10


def test_aligned_blocks_rule_of_the_plan_rules():
    from fasttree.toolkit.workloads import sample_tree

    tree = sample_tree("multi_document", 1014)
    kw = dict(num_q_heads=16, num_kv_heads=1, head_dim=128)
    on, off = ft.plan(tree, **kw), ft.plan(tree, **kw, rules=ft.PlanRules(aligned_blocks=False))
    assert int(on.unit_kv_len.sum()) < int(off.unit_kv_len.sum())
    assert on.rules.aligned_blocks and not off.rules.aligned_blocks
    assert ft.plan(tree, **kw, rules=ft.PlanRules.runtime(1)).stats() == off.stats()
