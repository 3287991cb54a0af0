"""Groups' slots in two parts (the tree's slot array and the chains' runs of it): a packed plan
gathers from the parts what it gathers from the joined list, and the groups read as before."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
from trees import random_tree

import fasttree as ft
from fasttree import native, plan_arrays
from fasttree.costs import PaddingCost
from fasttree.groups import ChainedSlots, Groups
from fasttree.packing import BinLayout, _Bins, bin_layout
from fasttree.planner import _build_groups, _chain_layout, greedy_edge_assignment

pytestmark = pytest.mark.skipif(native.planner_library() is None, reason="no C compiler: the numpy path is all")

_COSTS = (
    PaddingCost(0.66, 0.33, 0.1, 16, (4, 1), (64, 64)),
    PaddingCost(0.66, 0.33, 0.1, 1, (64, 16), (64, 64)),
    PaddingCost(2.0, 0.1, -5.0, 4, (16, 4), (32, 128)),
)


def _assignments(rng: np.random.Generator, tree: ft.KVTree) -> list[tuple[np.ndarray, bool]]:
    """Each assignment with whether its roots are unmarked: the greedy's, none chained (every
    group a single node), every node chained (roots too) and a random one."""
    greedy, _, _ = greedy_edge_assignment(tree, _COSTS[int(rng.integers(len(_COSTS)))])
    n = tree.n_nodes
    return [
        (greedy, True),
        (np.zeros(n, dtype=np.int8), True),
        (np.ones(n, dtype=np.int8), False),
        ((rng.random(n) < 0.5).astype(np.int8), False),
    ]


def _group_runs(kv_start: np.ndarray, slots: np.ndarray | ChainedSlots, tree: ft.KVTree, nodes: np.ndarray):
    """Each group's KV length: its node's where it reads the tree's slots, else up to the next chain."""
    n_head = tree.slots.size
    chained = kv_start >= n_head
    ends = np.append(np.sort(kv_start[chained]), np.asarray(slots).size)
    kv_len = tree.lengths[nodes].astype(np.int64)
    kv_len[chained] = ends[np.searchsorted(ends, kv_start[chained], side="right")] - kv_start[chained]
    return kv_len, chained


def _units(
    rng: np.random.Generator, kv_start: np.ndarray, kv_len: np.ndarray, n_slots: int
) -> tuple[plan_arrays._Units, int]:
    """Work units: chunks of the groups' runs and runs anywhere in the list, with their number of
    queries (unit ``i`` serves query ``i % n_queries`` and others)."""
    starts, lens = [], []
    for s, n in zip(kv_start.tolist(), kv_len.tolist(), strict=True):
        cut = int(rng.integers(1, 200))
        for a in range(s, s + n, cut):
            starts.append(a)
            lens.append(min(cut, s + n - a))
    for _ in range(int(rng.integers(0, 20))):  # across the parts and the chains' runs
        a = int(rng.integers(0, n_slots))
        starts.append(a)
        lens.append(int(rng.integers(1, n_slots - a + 1)))
    start, length = np.array(starts, dtype=np.int64), np.array(lens, dtype=np.int64)
    keep = length > 0
    start, length = start[keep], length[keep]
    n_queries = int(rng.integers(1, min(40, start.size) + 1))
    queries = [np.union1d(rng.choice(n_queries, int(rng.integers(0, 6))), [i % n_queries]) for i in range(start.size)]
    q_len = np.array([q.size for q in queries], dtype=np.int64)
    pair_query = np.concatenate(queries).astype(np.int64)
    pair_start = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int64)
    return plan_arrays._Units(start, length, pair_start, q_len, pair_query), n_queries


def test_single_node_groups_read_the_tree_slots_and_chained_ones_the_runs():
    """The planner's groups: a single-node group's run lies in the tree's slot array, a chained
    group's past it (so no unit crosses the parts); the runs are the chains' slots, and the joined
    list is the numpy walk's."""
    rng = np.random.default_rng(5)
    chained_seen = 0
    for _ in range(40):
        tree = random_tree(rng, max_nodes=int(rng.choice([6, 60, 300])), roots=int(rng.integers(1, 4)))
        for cost in _COSTS:
            assign, group_q, group_kv = greedy_edge_assignment(tree, cost)
            groups = _build_groups(tree, assign, group_q, group_kv, check=False)
            want = _build_groups(tree, assign, group_q, group_kv, check=False, native=False)
            source = groups.kv_slot_source
            n_head = tree.slots.size
            single = assign[groups.node] != 1
            assert np.all(groups.kv_start[single] + groups.kv_len[single] <= n_head)
            assert np.all(groups.kv_start[~single] >= n_head)
            if isinstance(source, ChainedSlots):
                chained_seen += 1
                runs = source.runs
                n_runs = runs.size // 2
                src, off = runs[:n_runs], runs[n_runs:]
                assert off[0] == 0 and off[-1] == source.n_tail and np.all(np.diff(off) >= 0)
                gathered = np.concatenate([source.head[a : a + b] for a, b in zip(src, np.diff(off), strict=True)])
                assert np.array_equal(gathered, source.tail)
            assert groups.kv_slots.dtype == want.kv_slots.dtype and np.array_equal(groups.kv_slots, want.kv_slots)
    assert chained_seen >= 20


@pytest.mark.parametrize("seed", range(8))
def test_packed_plan_gathers_from_the_parts_what_it_gathers_from_the_list(seed):
    """``ft_packed_plan`` reading the tree's slots and the chains' runs of them builds the arrays the
    joined list gives, through it and through the numpy steps: groups all single nodes, all chained,
    the greedy's and random, units cut from them and runs across the parts and the chains' runs,
    the kept units' KV copied out or left in place."""
    rng = np.random.default_rng(1000 + seed)
    met = set()
    for _ in range(6):
        tree = random_tree(rng, max_nodes=int(rng.choice([5, 40, 200])), max_len=int(rng.choice([40, 400])))
        for assign, unmarked in _assignments(rng, tree):
            nodes = np.sort(rng.choice(tree.n_nodes, size=int(rng.integers(1, tree.n_nodes + 1)), replace=False))
            kv_start, fill = _chain_layout(tree, assign, nodes, roots_unmarked=unmarked, parts=True)
            slots = fill()
            joined = np.asarray(slots)
            kv_len, chained = _group_runs(kv_start, slots, tree, nodes)
            keep = kv_len > 0
            if not keep.any():
                continue
            units, n_queries = _units(rng, kv_start[keep], kv_len[keep], joined.size)
            rank = rng.permutation(n_queries).astype(np.int64)
            of_rank = np.empty(n_queries, dtype=np.int64)
            of_rank[rank] = np.arange(n_queries)
            layout = bin_layout(
                kv_len=units.kv_len, pair_start=units.pair_start, q_len=units.q_len, pair_query=units.pair_query,
                eligible=rng.random(units.kv_len.size) < 0.7, query_rank=rank, capacity=int(rng.choice([1, 4, 32])),
                budget=int(rng.integers(1, 300)), pairs_in_order=True,
            )  # fmt: skip
            if layout is None:
                continue
            small = (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
            got = plan_arrays._packed_arrays_native(units, layout, slots, of_rank, small, n_queries)
            one = plan_arrays._packed_arrays_native(units, layout, joined, of_rank, small, n_queries)
            steps = plan_arrays._packed_arrays(units, layout, slots, rank, of_rank, small, n_queries, native=False)
            assert got is not None and one is not None
            for want in (one, steps):
                assert got.n_bins == want.n_bins and got.arrays[-3:] == want.arrays[-3:]
                for x, y in zip([*got.arrays[:-3], got.kv_slots, got.kv_row_mask],
                                [*want.arrays[:-3], want.kv_slots, want.kv_row_mask], strict=True):  # fmt: skip
                    assert x.dtype == y.dtype == np.int32 and np.array_equal(x, y)
            kept_total = int(units.kv_len.sum() - units.kv_len[layout.bins.unit].sum())  # units no piece took
            met.add((isinstance(slots, ChainedSlots), 2 * kept_total < joined.size, bool(chained.all())))
    assert {(True, True), (True, False), (False, True)} <= {m[:2] for m in met}
    assert (True, True, True) in met or (True, False, True) in met  # every group chained


def test_the_packed_call_refuses_runs_outside_the_tree_slots():
    """Runs that do not cover the tail or read past the head leave the plan to the steps (which
    join the list), reading nothing out of range."""
    head = np.arange(10, dtype=np.int32)
    one = np.ones(1, dtype=np.int64)
    units = plan_arrays._Units(np.array([8], np.int64), 4 * one, np.zeros(1, np.int64), one, np.zeros(1, np.int64))
    pieces = _Bins(unit=np.zeros(1, np.int64), lowest=np.zeros(1, np.int64), bits=one, new_bin=np.ones(1, bool),
                   tokens=4 * one)  # fmt: skip
    layout = BinLayout(pieces, 32, None)

    def chained(runs: list[int]) -> ChainedSlots:
        return ChainedSlots(head, 3, lambda out: out.fill(7), lambda: np.array(runs, dtype=np.int64))

    args = (np.zeros(1, np.int64), (1, 1), 1)
    got = plan_arrays._packed_arrays_native(units, layout, chained([2, 0, 3]), *args)
    assert got is not None and got.kv_slots.tolist() == [8, 9, 2, 3]
    for bad in ([8, 0, 3], [-1, 0, 3], [2, 0, 2], [2, 1, 3], [2, 5, 0, 4, 3]):
        assert plan_arrays._packed_arrays_native(units, layout, chained(bad), *args) is None
    steps = plan_arrays._packed_arrays(units, layout, chained([8, 0, 3]), np.zeros(1, np.int64), *args)
    assert steps.kv_slots.tolist()[-4:] == [8, 9, 7, 7]  # the joined list: the tail fill_tail writes


def test_groups_read_chained_slots_as_one_array():
    """``Groups.kv_slots`` joins a ChainedSlots at its first read and keeps the array; the dataclass
    stays frozen, replaceable, picklable and rebuildable from its ``__dict__``."""
    rng = np.random.default_rng(3)
    head = rng.permutation(50).astype(np.int32)
    tail = head[[4, 5, 6, 20, 21]]
    parts = ChainedSlots(head, 5, lambda out: np.copyto(out, tail), lambda: np.array([4, 20, 0, 3, 5], np.int64))
    n = 3
    kw = dict(
        node=np.arange(n), kv_start=np.array([0, 10, 50]), kv_len=np.array([10, 40, 5]),
        q_indptr=np.arange(n + 1), q_ids=np.arange(n),
    )  # fmt: skip
    groups = Groups(**kw, kv_slots=parts)
    assert groups.kv_slot_source is parts and parts.size == 55
    again = pickle.loads(pickle.dumps(groups))
    rebuilt = Groups(**groups.__dict__)
    joined = groups.kv_slots
    assert joined.dtype == np.int32 and np.array_equal(joined, np.concatenate([head, tail]))
    assert groups.kv_slots is joined and groups.kv_slot_source is joined
    assert not np.shares_memory(joined, head)
    for other in (again, rebuilt, dataclasses.replace(groups, identity_slots=0)):
        assert np.array_equal(other.kv_slots, joined)
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups.kv_slots = joined  # type: ignore[misc]
    plain = Groups(**kw, kv_slots=joined)
    assert plain.kv_slots is joined and plain.kv_slot_source is joined
    assert [f.name for f in dataclasses.fields(Groups)][3] == "kv_slots"


def test_a_plans_joined_slots_share_no_memory_with_other_live_plans():
    """Plans that keep their groups' slots in two parts join them, when read, into memory of their
    own (the reused host memory hands out no slab a live array uses)."""
    cfg = ft.FastTreeConfig()
    rng = np.random.default_rng(11)
    plans = []
    for _ in range(4):
        tree = random_tree(rng, max_nodes=400, max_len=3000, roots=2)
        plans.append(ft.plan(tree, cfg, num_q_heads=32, num_kv_heads=32, head_dim=128))
    assert any(isinstance(p.groups.kv_slot_source, ChainedSlots) for p in plans)
    joined = [p.groups.kv_slots for p in plans]
    for i, slots in enumerate(joined):
        for j, p in enumerate(plans):
            assert not np.shares_memory(slots, p.kv_indices) and not np.shares_memory(slots, p.kv_row_mask)
            if j != i:
                assert not np.shares_memory(slots, joined[j])
