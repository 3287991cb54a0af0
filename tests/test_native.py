"""The native planner cores: the same results as the numpy paths, bit for bit, and a fallback (CPU)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_plan_extend import CONFIGS, grow
from trees import random_tree

import fasttree as ft
from fasttree import native
from fasttree.costs import PaddingCost
from fasttree.packing import _aligned_blocks, _bin_members, _Candidates, _gather_runs, _row_mask
from fasttree.plan_arrays import DEVICE_ARRAYS
from fasttree.plan_extend import PlanExtender
from fasttree.planner import _build_groups, _chain_layout, greedy_edge_assignment, unprepared
from fasttree.toolkit.family_suite import FAMILY_CASES, family_tree
from fasttree.toolkit.suite import paper_tree

pytestmark = pytest.mark.skipif(native.planner_library() is None, reason="no C compiler: the numpy path is all")


def _costs(rng: np.random.Generator) -> list[PaddingCost]:
    """The defaults' costs and random ones: negative weights, non-power-of-2 and unequal tiles."""
    out = [PaddingCost(0.66, 0.33, 0.1, 4, (16, 4), (64, 64)), PaddingCost(0.66, 0.33, 0.1, 1, (64, 16), (64, 64))]
    for _ in range(4):
        tq1 = int(rng.choice([1, 2, 3, 4, 16]))
        weights = (float(rng.uniform(-0.5, 2.0)), float(rng.uniform(-0.5, 2.0)), float(rng.uniform(-10, 10)))
        q_tiles = (tq1 * int(rng.integers(1, 5)), tq1)
        kv_tiles = (int(rng.choice([16, 32, 64, 100])), int(rng.choice([16, 32, 64, 128])))
        out.append(PaddingCost(*weights, int(rng.choice([1, 4, 7, 16])), q_tiles, kv_tiles))
    return out


def _same(a, b) -> bool:
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("seed", range(40))
def test_native_greedy_equals_both_numpy_paths_on_random_forests(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, max_nodes=int(rng.choice([3, 40, 400])), max_len=int(rng.choice([5, 300, 3000])))
    for cost in _costs(rng):
        native_result = greedy_edge_assignment(tree, cost, native=True)
        assert _same(native_result, greedy_edge_assignment(tree, cost, native=False, scalar_edges=10**9))
        assert _same(native_result, greedy_edge_assignment(tree, cost, native=False, scalar_edges=0))


def test_native_greedy_equals_numpy_on_the_paper_suite_and_the_families():
    rng = np.random.default_rng(0)
    trees = [paper_tree(c) for c in range(1, 16)] + [family_tree(fc) for fc in FAMILY_CASES[::4]]
    for tree in trees:
        for cost in _costs(rng)[:3]:
            fast = greedy_edge_assignment(tree, cost, native=True)
            assert _same(fast, greedy_edge_assignment(tree, cost, native=False))


@pytest.mark.parametrize("seed", range(30))
def test_native_chains_equal_numpys_for_greedy_and_random_assignments(seed):
    rng = np.random.default_rng(100 + seed)
    tree = random_tree(rng, max_nodes=int(rng.choice([5, 60, 500])), max_len=int(rng.choice([3, 300])))
    greedy, _, _ = greedy_edge_assignment(tree, _costs(rng)[0])
    random_assign = (rng.random(tree.n_nodes) < 0.6).astype(np.int8)  # roots marked too
    for assign, unmarked in ((greedy, True), (random_assign, False)):
        nodes = np.sort(rng.choice(tree.n_nodes, size=int(rng.integers(1, tree.n_nodes + 1)), replace=False))
        for fill_tokens in (0, 8192):  # numpy's strided copies, or its gathers
            want = _chain_layout(tree, assign, nodes, roots_unmarked=unmarked, fill_tokens=fill_tokens, native=False)
            got = _chain_layout(tree, assign, nodes, roots_unmarked=unmarked, fill_tokens=fill_tokens, native=True)
            assert _same([got[0], got[1]()], [want[0], want[1]()])


@pytest.mark.parametrize("seed", range(30))
def test_native_group_query_lists_equal_numpys(seed):
    rng = np.random.default_rng(300 + seed)
    tree = random_tree(rng, max_nodes=int(rng.choice([4, 50, 400])), max_len=int(rng.choice([2, 200])))
    assign, group_q, group_kv = greedy_edge_assignment(tree, _costs(rng)[int(rng.integers(0, 6))])
    for check in (False, True):
        want = _build_groups(tree, assign, group_q, group_kv, check=check, native=False)
        got = _build_groups(tree, assign, group_q, group_kv, check=check, native=True)
        for name in ("node", "kv_start", "kv_len", "kv_slots", "q_indptr", "q_ids"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    wrong = group_q.copy()
    wrong[np.argmax(wrong)] += 1  # counts the assignment does not give: refused, nothing written past a group
    with pytest.raises(AssertionError, match="group membership"):
        _build_groups(tree, assign, wrong, group_kv, check=False, native=True)


@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (16, 1)])
def test_plans_are_the_same_with_and_without_the_native_cores(monkeypatch, heads):
    rng = np.random.default_rng(7)
    trees = [paper_tree(c) for c in (1, 5, 8, 10, 13)] + [random_tree(rng, max_nodes=300) for _ in range(8)]
    trees += [family_tree(fc) for fc in FAMILY_CASES[::6]]
    configs = [ft.FastTreeConfig(), ft.FastTreeConfig(alpha=1.5, beta=0.1, gamma=2.0, pack_tokens=0)]
    hq, hkv = heads

    def arrays(plan):
        return [getattr(plan, name) for name in DEVICE_ARRAYS]

    native_plans = [arrays(ft.plan(unprepared(t), c, num_q_heads=hq, num_kv_heads=hkv, head_dim=128))
                    for t in trees for c in configs]  # fmt: skip
    monkeypatch.setattr(native, "_LOADED", (None, None))  # the numpy paths from here on
    numpy_plans = [arrays(ft.plan(unprepared(t), c, num_q_heads=hq, num_kv_heads=hkv, head_dim=128))
                   for t in trees for c in configs]  # fmt: skip
    for a, b in zip(native_plans, numpy_plans, strict=True):
        assert _same(a, b)


@pytest.mark.parametrize("seed", range(60))
def test_native_bin_members_equal_numpys(seed):
    """Random eligible units (pairs' ranks in any order, zero-token units too, some with the pairs
    of all units shuffled) under fixed and aligned blocks, filled or balanced runs, several
    capacities and budgets."""
    rng = np.random.default_rng(1000 + seed)
    n_queries = int(rng.integers(1, 400))
    n_units = int(rng.integers(1, 200))
    q_len = rng.integers(1, min(n_queries, 40) + 1, size=n_units)
    unit = np.arange(n_units).repeat(q_len)
    rank = np.concatenate([rng.choice(n_queries, size=int(k), replace=False) for k in q_len])
    if seed % 3 == 0:  # each unit's ranks ascending, as DFS-ordered pairs often are
        ends = np.cumsum(q_len)
        rank = np.concatenate([np.sort(rank[a:b]) for a, b in zip(ends - q_len, ends, strict=True)])
    shuffled = seed % 5 == 2  # pairs in any unit order (the compiled loop sorts them then)
    if shuffled:
        perm = rng.permutation(unit.size)
        unit, rank = unit[perm], rank[perm]
    cands = _Candidates(unit.astype(np.int64), rank.astype(np.int64), q_len)
    kv_len = rng.choice([0, 1, 7, 16, 64, 100, 300], size=n_units)
    capacity = int(rng.choice([1, 4, 8, 16, 31, 32]))
    blocks = [None]
    aligned = None if shuffled else _aligned_blocks(cands, n_queries, capacity)
    if aligned is not None:
        blocks.append(aligned)
    for block in blocks:
        for budget in (1, 64, 1024):
            for balanced in (False, True):
                want = _bin_members(cands, n_queries, capacity, kv_len, budget, balanced, block, native=False)
                got = _bin_members(cands, n_queries, capacity, kv_len, budget, balanced, block, native=True)
                assert got[1] == want[1]
                assert (got[0] is None) == (want[0] is None)
                if want[0] is not None:
                    assert _same(got[0], want[0])


@pytest.mark.parametrize("n_old", [0, 1, 777])
def test_native_row_masks_equal_numpys_with_the_sign_bit(n_old):
    rng = np.random.default_rng(n_old)
    bits = rng.integers(1, 1 << 32, size=200, dtype=np.int64)  # position 31 sets the int32 sign bit
    bits[:3] = (1 << 31, (1 << 32) - 1, 1)
    tokens = rng.integers(0, 40, size=200)
    total = int(tokens.sum())
    want = _row_mask(n_old, bits, tokens, total, native=False)
    got = _row_mask(n_old, bits, tokens, total, native=True)
    assert got.dtype == want.dtype == np.int32 and np.array_equal(got, want)
    with pytest.raises(ValueError, match="do not add up"):
        _row_mask(n_old, bits, tokens, total + 1)


@pytest.mark.parametrize("identity", [0, 500, 5000])
def test_native_gather_of_slot_runs_equals_numpys_and_refuses_runs_outside(identity):
    rng = np.random.default_rng(identity)
    slots = np.concatenate([np.arange(identity), rng.permutation(4000) + identity]).astype(np.int32)
    length = rng.integers(0, 60, size=300)
    start = rng.integers(0, slots.size - 60, size=300)
    want = np.full(int(length.sum()), -7, dtype=np.int32)
    got = want.copy()
    _gather_runs(slots, start, length, want, identity, native=False)
    _gather_runs(slots, start, length, got, identity, native=True)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="outside the slot array"):
        _gather_runs(slots, np.array([slots.size - 5]), np.array([10]), np.empty(10, np.int32), 0)
    with pytest.raises(ValueError, match="not filling"):
        _gather_runs(slots, np.array([0]), np.array([10]), np.empty(12, np.int32), 0)


def test_without_a_compiler_the_planner_runs_numpy_and_says_so(monkeypatch, tmp_path, caplog):
    tree = random_tree(np.random.default_rng(3), max_nodes=30)
    expected = ft.plan(tree, ft.FastTreeConfig(), num_q_heads=8, num_kv_heads=2, head_dim=64)
    monkeypatch.setattr(native, "_LOADED", None)
    monkeypatch.setenv("FASTTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="fasttree.native"):
        assert native.planner_library() is None
        assert native.planner_library() is None  # not retried, logged once
    assert sum("planning with numpy" in r.message for r in caplog.records) == 1
    fresh = unprepared(tree)
    plan = ft.plan(fresh, ft.FastTreeConfig(), num_q_heads=8, num_kv_heads=2, head_dim=64)
    assert np.array_equal(plan.kv_indices, expected.kv_indices) and np.array_equal(plan.unit_q_len, expected.unit_q_len)
    assert not list(tmp_path.rglob("*.so"))


def test_a_broken_compiler_leaves_no_library_behind(monkeypatch, tmp_path):
    script = tmp_path / "badcc"
    script.write_text("#!/bin/sh\necho 'error: nope' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setattr(native, "_LOADED", None)
    monkeypatch.setenv("FASTTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(script))
    assert native.planner_library() is None
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # no library, no temporary file


def test_the_library_is_compiled_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_LOADED", None)
    monkeypatch.setenv("FASTTREE_CACHE_DIR", str(tmp_path))
    lib = native.planner_library()
    assert lib is not None
    built = list((tmp_path / "native").glob("planner-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_LOADED", None)
    assert native.planner_library() is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded from the cache, not compiled again


def test_address_is_the_arrays_data_pointer_for_every_kind_of_array():
    base = np.arange(40, dtype=np.int64)
    read_only = base.copy()
    read_only.flags.writeable = False
    for a in (base, base[5:], read_only, np.empty(0, dtype=np.int32), base[::2], np.zeros((3, 4), np.int8)):
        assert native.address(a) == a.ctypes.data
    assert native._FIELD_TYPE is np.ndarray  # CPython: read from the array object after the first check

    class Sub(np.ndarray):
        pass

    sub = np.arange(6).view(Sub)[1:]
    assert native.address(sub) == sub.ctypes.data  # another type: through the buffer


def test_c_int64_accepts_only_contiguous_native_int64_arrays():
    """What the compiled loops read at an address: C-contiguous, native-endian int64 (any number of
    arrays, empty ones too); int32, uint64, big-endian or strided arrays are refused."""
    base = np.arange(40, dtype=np.int64)
    assert native.c_int64(base, base[5:], np.empty(0, dtype=np.int64), np.longlong([1, 2]))
    assert native.c_int64()
    for bad in (base.astype(np.int32), base.astype(np.uint64), base.astype(">i8"), base[::2], base.astype(float)):
        assert not native.c_int64(base, bad)


def _spy(monkeypatch, module, name: str) -> tuple[list, object]:
    """Record the positional arguments of every call of ``module.name`` (still called); returns the
    list they go to and the real function."""
    seen, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen, real


def _recorded_packed_calls(monkeypatch, trees, heads, configs) -> list[tuple]:
    """The arguments of every ``plan_arrays._packed_arrays`` call (a packed plan's arrays) the
    planner makes on ``trees``."""
    from fasttree import plan_arrays

    calls, real = _spy(monkeypatch, plan_arrays, "_packed_arrays")
    for tree in trees:
        for hq, hkv in heads:
            for cfg in configs:
                ft.plan(unprepared(tree), cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    monkeypatch.setattr(plan_arrays, "_packed_arrays", real)
    return calls


def _assembled(args, native: bool):
    """``packing.assemble_bins`` of a recorded ``_packed_arrays`` call's arguments."""
    from fasttree import packing

    units, layout, kv_slots, query_rank, query_of_rank = args[:5]
    return packing.assemble_bins(
        layout, kv_start=units.kv_start, kv_len=units.kv_len, pair_start=units.pair_start, q_len=units.q_len,
        pair_query=units.pair_query, kv_slots=np.asarray(kv_slots), query_rank=query_rank, query_of_rank=query_of_rank,
        pairs_in_order=True, identity_slots=args[7], native=native,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_native_assembly_of_packed_units_equals_numpys(monkeypatch, seed):
    """Every array of a packed plan (kept units' KV copied out or left in place, bins' rows, masks
    with the sign bit, absent rows, blocks from aligned ranks, unit order and partial rows): the
    one compiled call's (``ft_packed_plan``) and the compiled assembly's are numpy's, dtype for
    dtype."""
    from fasttree import plan_arrays

    rng = np.random.default_rng(900 + seed)
    trees = [random_tree(rng, max_nodes=int(rng.choice([20, 300, 1500])), max_len=int(rng.choice([40, 600])))
             for _ in range(3)]  # fmt: skip
    if seed == 0:
        trees += [paper_tree(c) for c in (2, 6, 9, 13)]
    configs = [ft.FastTreeConfig(), ft.FastTreeConfig(pack_tokens=512, pack_min_units=64)]
    calls = _recorded_packed_calls(monkeypatch, trees, [(32, 32), (32, 8), (16, 1)], configs)
    assert calls and any(args[1].bins.unit.size for args in calls)
    if seed == 0:
        assert {args[1].start_of_rank is None for args in calls} == {True, False}  # fixed and aligned blocks met
    fields = ("kv_start", "kv_len", "pair_start", "q_len", "pair_query", "pair_present", "kv_slots", "kv_row_mask",
              "is_bin")  # fmt: skip
    for args in calls:
        a, b = _assembled(args, native=True), _assembled(args, native=False)
        assert a.n_packed == b.n_packed and a.n_kept == b.n_kept
        for name in fields:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        one = plan_arrays._packed_arrays_native(*args[:1], *args[1:3], *args[4:7])
        steps = plan_arrays._packed_arrays(*args, native=False)
        assert one is not None and one.n_bins == steps.n_bins
        assert one.arrays[-3:] == steps.arrays[-3:]  # partial rows, class boundaries, small bins
        for x, y in zip([*one.arrays[:-3], one.kv_slots, one.kv_row_mask],
                        [*steps.arrays[:-3], steps.kv_slots, steps.kv_row_mask], strict=True):  # fmt: skip
            assert x.dtype == y.dtype == np.int32 and np.array_equal(x, y)


def test_the_one_packed_call_refuses_pieces_out_of_range_and_the_steps_say_why():
    """``ft_packed_plan`` given a piece's unit, rank or tokens out of range, or a bin without its
    first piece, writes nothing past its buffers and leaves the plan to the steps, which raise."""
    from fasttree import plan_arrays
    from fasttree.packing import BinLayout, _Bins

    one = np.ones(1, dtype=np.int64)
    units = plan_arrays._Units(np.zeros(1, np.int64), 4 * one, np.zeros(1, np.int64), one, np.zeros(1, np.int64))
    good = {"unit": np.zeros(1, np.int64), "lowest": np.zeros(1, np.int64), "bits": one, "new_bin": np.ones(1, bool),
            "tokens": 4 * one}  # fmt: skip
    rest = (np.arange(4, dtype=np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64), (1, 1), 1)

    def layout(**pieces) -> BinLayout:
        return BinLayout(_Bins(**pieces), 32, None)

    got = plan_arrays._packed_arrays_native(units, layout(**good), rest[0], *rest[2:])
    assert got is not None and got.kv_slots.size == 4 and got.n_bins == 1
    for name, value in (("unit", one), ("lowest", one), ("tokens", 5 * one), ("new_bin", np.zeros(1, bool))):
        bad = layout(**{**good, name: value})
        assert plan_arrays._packed_arrays_native(units, bad, rest[0], *rest[2:]) is None
        with pytest.raises(ValueError, match="out of range"):
            plan_arrays._packed_arrays(units, bad, *rest)


def test_native_assembly_refuses_pieces_out_of_range():
    from fasttree import packing

    one = np.ones(1, dtype=np.int64)
    args = (np.zeros(1, np.int64), 4 * one, np.zeros(1, np.int64), one, np.zeros(1, np.int64),
            np.arange(4, dtype=np.int32), np.zeros(1, np.int64), 32, True, 0, None)  # fmt: skip
    good = {"unit": np.zeros(1, np.int64), "lowest": np.zeros(1, np.int64), "bits": one, "new_bin": np.ones(1, bool),
            "tokens": 4 * one}  # fmt: skip
    assert packing._assemble(*args, **good, native=True).kv_slots.size == 4
    for name, value in (("unit", one), ("lowest", one), ("tokens", 5 * one), ("new_bin", np.zeros(1, bool))):
        with pytest.raises(ValueError, match="out of range"):
            packing._assemble(*args, **{**good, name: value}, native=True)


@pytest.mark.parametrize("seed", range(4))
def test_native_layout_costs_equal_numpys(monkeypatch, seed):
    """The KV tokens read and partial rows of every bin layout the wide-unit choice compares (fixed
    and aligned blocks) are numpy's; the plans' choices are therefore the same."""
    from fasttree import plan_arrays

    calls, real = _spy(monkeypatch, plan_arrays, "layout_reads_and_rows")
    rng = np.random.default_rng(1300 + seed)
    trees = [random_tree(rng, max_nodes=int(rng.choice([30, 300, 1200])), max_len=600) for _ in range(3)]
    if seed == 0:
        trees += [paper_tree(c) for c in (2, 6, 8, 11, 14)]
    for tree in trees:
        for hq, hkv in ((32, 32), (32, 8)):
            ft.plan(unprepared(tree), ft.FastTreeConfig(), num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    assert any(args[0] is not None for args in calls)
    for args in calls:
        assert real(*args, native=True) == real(*args, native=False)
    if seed == 0:
        assert {args[0].start_of_rank is None for args in calls if args[0] is not None} == {True, False}


@pytest.mark.parametrize("seed", range(5))
def test_native_bin_layouts_equal_numpys(monkeypatch, seed):
    """Every bin layout the planner asks for (fixed blocks, aligned blocks when they pay or always,
    balanced runs, no bin) is numpy's: the same members, flags and block starts, dtype for dtype."""
    from fasttree import packing, plan_arrays

    calls, real = [], packing.bin_layout

    def recording(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(plan_arrays, "bin_layout", recording)
    rng = np.random.default_rng(1500 + seed)
    trees = [random_tree(rng, max_nodes=int(rng.choice([20, 300, 1500])), max_len=int(rng.choice([40, 600])))
             for _ in range(3)]  # fmt: skip
    if seed == 0:
        trees += [paper_tree(c) for c in (2, 6, 8, 9, 13)] + [family_tree(fc) for fc in FAMILY_CASES[::7]]
    configs = [ft.FastTreeConfig(), ft.FastTreeConfig(pack_tokens=512, pack_min_units=64)]
    for tree in trees:
        for hq, hkv in ((32, 32), (32, 8), (16, 1)):
            for cfg in configs:
                ft.plan(unprepared(tree), cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    assert calls
    extra = [dict(c, aligned=True) for c in calls[::5]] + [dict(c, aligned=False) for c in calls[::7]]
    taken = set()
    for kw in calls + extra:
        a, b = real(**kw, native=True), real(**kw, native=False)
        assert (a is None) == (b is None)
        if a is None:
            continue
        taken.add(a.start_of_rank is None)
        assert a.capacity == b.capacity
        assert (a.start_of_rank is None) == (b.start_of_rank is None)
        if a.start_of_rank is not None:
            assert np.array_equal(a.start_of_rank, b.start_of_rank)
        for x, y in zip(a.bins, b.bins, strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y)
    if seed == 0:
        assert taken == {True, False}  # fixed and aligned layouts both met


def test_native_layout_class_reads_equal_numpys(monkeypatch):
    """A laid-out plan's KV tokens by tile class, which decide the crossover with decode before
    the plan's arrays are built: the compiled loop's equal numpy's on paper trees and random
    forests at GQA 16 (fixed and aligned blocks, bins in either class), and an index out of range
    leaves the decision to numpy."""
    from fasttree import plan_arrays

    seen, real = _spy(monkeypatch, plan_arrays, "_laid_out_weighted_reads")
    rng = np.random.default_rng(11)
    trees = [paper_tree(c) for c in (2, 9, 12)] + [random_tree(rng, roots=int(rng.integers(1, 5))) for _ in range(15)]
    for tree in trees:
        for hq, hkv in ((16, 1), (32, 2), (64, 4)):
            ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    with_bins = [a for a in seen if a[1] is not None]
    assert len(seen) >= 40 and len(with_bins) >= 10
    assert any(a[1].start_of_rank is not None for a in with_bins)
    for units, layout, block_m, g, small_queries, n_queries, exponent in seen:
        args = (units, layout, block_m, g, small_queries, n_queries, exponent)
        assert plan_arrays._layout_class_reads_native(units, layout, block_m[1] // g, small_queries, n_queries)
        assert real(*args) == real(*args, native=False)
    units, layout, block_m, g, small_queries, n_queries, _ = with_bins[0]
    bad = layout._replace(bins=layout.bins._replace(unit=layout.bins.unit + units.kv_len.size))
    assert plan_arrays._layout_class_reads_native(units, bad, block_m[1] // g, small_queries, n_queries) is None


def test_native_unit_arrays_equal_numpys(monkeypatch):
    """A plan's tile classes, unit order and int32 unit, pair and partial-row arrays: the compiled
    loop's equal numpy's (dtype and values) on paper trees, random forests and decode plans, with
    packed bins (absent pairs) and without, KV lengths under and over 2**15 (16- and 32-bit sort
    keys); a pair's query out of range leaves them to numpy, and a query without a present pair is
    an internal error."""
    from fasttree import plan_arrays

    seen, real = _spy(monkeypatch, plan_arrays, "_unit_arrays")
    packed, _ = _spy(monkeypatch, plan_arrays, "_packed_arrays")
    rng = np.random.default_rng(5)
    trees = [paper_tree(c) for c in (1, 4, 9, 13)]
    trees += [random_tree(rng, roots=int(rng.integers(1, 5))) for _ in range(12)]
    for tree in trees:
        for hq, hkv in ((32, 32), (32, 8), (16, 1)):
            ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
        ft.plan_query_separated(tree, num_q_heads=8, num_kv_heads=2, head_dim=64)
    for args in packed:  # a packed plan's units (its arrays come from one compiled call)
        p = _assembled(args, native=False)
        units = plan_arrays._Units(p.kv_start, p.kv_len, p.pair_start, p.q_len, p.pair_query)
        seen.append((units, p.n_kept, args[5], p.pair_present, args[6]))
    with_absent = [a for a in seen if a[3] is not None and not a[3].all()]
    assert len(seen) >= 60 and with_absent
    long_units = seen[0][0]._replace(kv_len=seen[0][0].kv_len * 40_000)  # past the 16-bit keys
    cases = [*seen, (long_units, *seen[0][1:])]
    assert int(long_units.kv_len.max()) >= 1 << 15
    for units, n_kept, small, present, n_queries in cases:
        got = plan_arrays._unit_arrays_native(units, n_kept, small, present, n_queries)
        want = real(units, n_kept, small, present, n_queries, native=False)
        assert got is not None and got[-3:] == want[-3:]  # partial rows, class boundaries, small bins
        for x, y in zip(got[:-3], want[:-3], strict=True):
            assert x.dtype == y.dtype == np.int32 and np.array_equal(x, y)
    units, n_kept, small, present, n_queries = with_absent[0]
    bad = units._replace(pair_query=units.pair_query.copy())
    bad.pair_query[-1] = n_queries  # a query id past the last
    assert plan_arrays._unit_arrays_native(bad, n_kept, small, present, n_queries) is None
    with pytest.raises(AssertionError, match="no work unit"):
        plan_arrays._unit_arrays_native(units, n_kept, small, present, n_queries + 1)


def test_deferred_chain_slots_are_the_slots_built_at_once():
    """Groups built with their chains' slots deferred (the crossover's path) read the same slots
    once filled, and the numpy walk gives them too."""
    rng = np.random.default_rng(9)
    chained = 0
    for _ in range(20):
        tree = random_tree(rng, roots=int(rng.integers(1, 4)))
        cost = PaddingCost(0.66, 0.33, 0.1, 16, (4, 1), (64, 64))
        assign, group_q, group_kv = greedy_edge_assignment(tree, cost)
        want = _build_groups(tree, assign, group_q, group_kv, check=False)
        got, fill = _build_groups(tree, assign, group_q, group_kv, check=False, defer_slots=True)
        assert got.kv_slots.size == 0 and np.array_equal(got.kv_start, want.kv_start)
        assert np.array_equal(fill(), want.kv_slots)
        chained += want.kv_slots.size > tree.slots.size
        nodes = want.node
        for native_ in (True, False):
            kv_start, fill = _chain_layout(tree, assign, nodes, roots_unmarked=True, native=native_)
            assert np.array_equal(kv_start, want.kv_start) and np.array_equal(fill(), want.kv_slots)
    assert chained >= 5  # trees whose groups chain several nodes (slots copied past the tree's own)


@pytest.mark.parametrize("seed", range(6))
def test_native_greedy_groups_equal_numpys(seed):
    """The greedy and the groups it keeps in one compiled call equal the numpy path's arrays (dtype
    and values) on random forests with internal queries and paper trees, for the defaults' costs
    and random ones (power-of-two and other query tiles)."""
    from fasttree.planner import _greedy_groups, _Kept

    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, roots=int(rng.integers(1, 4))) for _ in range(6)] + [paper_tree(1 + seed)]
    for tree in trees:
        for cost in _costs(rng):
            assign, group_q, group_kv, kept = _greedy_groups(unprepared(tree), cost)
            w_assign, w_q, w_kv = greedy_edge_assignment(tree, cost, native=False)
            want = _Kept.of(w_q, w_kv)
            assert _same([assign, group_q, group_kv], [w_assign, w_q, w_kv])
            got_kept = [kept.keep, kept.node, kept.count, kept.kv_len]
            assert _same(got_kept, [want.keep, want.node, want.count, want.kv_len])


@pytest.mark.parametrize("n_leaves", [20, 300, 70_000])
def test_native_group_query_lists_sort_ids_out_of_dfs_order(n_leaves):
    """A group whose query ids run against DFS order (queries numbered from the last leaf) is
    sorted by id in the compiled loop as by numpy: by insertion up to 32 ids, by bytes beyond (ids
    past 2**16 too)."""
    parents = np.concatenate([[-1], np.zeros(n_leaves, dtype=np.int64)])
    lengths = np.concatenate([[500], np.ones(n_leaves, dtype=np.int64)])
    query_nodes = np.arange(n_leaves, 0, -1)  # query i sits at leaf n_leaves - i
    tree = ft.KVTree.from_lengths(parents, lengths, query_nodes)
    assign = np.zeros(tree.n_nodes, dtype=np.int8)  # every node its own group: the root's holds all
    group_q, group_kv = tree.subtree_queries.copy(), tree.lengths.copy()
    want = _build_groups(tree, assign, group_q, group_kv, check=True, native=False)
    got = _build_groups(tree, assign, group_q, group_kv, check=True, native=True)
    assert got.q_indptr[1] == n_leaves  # the root's group: every query
    for name in ("q_indptr", "q_ids"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert np.array_equal(got.q_ids[:n_leaves], np.arange(n_leaves))


def test_native_cut_units_equal_numpys(monkeypatch):
    """Groups cut into units (query tiles, KV chunks of one split or a split per group): the
    compiled loop's units equal numpy's on paper trees and random forests at several head
    layouts; a group without tokens leaves them to numpy."""
    from fasttree import plan_arrays

    seen, real = _spy(monkeypatch, plan_arrays, "_cut_units")
    rng = np.random.default_rng(17)
    trees = [paper_tree(c) for c in (5, 8, 9)] + [random_tree(rng, roots=int(rng.integers(1, 5))) for _ in range(10)]
    for tree in trees:
        for hq, hkv in ((32, 32), (32, 8), (16, 1)):
            ft.plan(tree, ft.FastTreeConfig(kv_split_sizes=(256, 64)), num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    cut = 0
    for groups, tile_q, split in seen:
        want = real(groups, tile_q, split, native=False)
        got = plan_arrays._cut_units_native(groups, tile_q, split)
        assert got is not None and _same(got, want)
        cut += got.kv_len.size > groups.kv_len.size
    assert cut >= 20 and any(not isinstance(a[2], int) for a in seen)
    groups, tile_q, split = seen[0]
    empty = ft.groups.Groups(**{**groups.__dict__, "kv_len": np.zeros_like(groups.kv_len)})
    assert plan_arrays._cut_units_native(empty, tile_q, split) is None


@pytest.mark.parametrize("seed", range(8))
def test_native_tree_levels_equal_numpys(seed):
    """A tree's depths, level order and bounds, path lengths and subtree query counts: the compiled
    walk's equal numpy's on random forests (ids in any order, deep chains, given depths), and a
    cycle leaves the error to numpy's path, which names the node."""
    from fasttree.tree import _depths, _levels_native

    rng = np.random.default_rng(300 + seed)
    n = int(rng.choice([1, 7, 300, 5000]))
    order = rng.permutation(n)  # node order[k]'s parent is an earlier node, or a root
    parents = np.full(n, -1, dtype=np.int64)
    for k in range(1, n):
        if rng.random() < 0.9:
            parents[order[k]] = order[int(rng.integers(max(0, k - 3 if seed % 2 else 0), k))]
    lengths = rng.integers(0, 50, size=n).astype(np.int64)
    queries = rng.integers(0, n, size=int(rng.integers(1, 2 * n + 2))).astype(np.int64)
    for depth in (None, _depths(parents)):
        got = _levels_native(parents, lengths, queries, depth)
        want = _levels_native(parents, lengths, queries, depth, native=False)
        assert got is not None and want is None
        depth_np = _depths(parents)
        level_order = depth_np.argsort(kind="stable")
        level_ptr = np.searchsorted(depth_np[level_order], np.arange(int(depth_np.max()) + 2))
        path = lengths.copy()
        sq = np.bincount(queries, minlength=n).astype(np.int64)
        for v in level_order:
            if parents[v] >= 0:
                path[v] += path[parents[v]]
        for v in level_order[::-1]:
            if parents[v] >= 0:
                sq[parents[v]] += sq[v]
        assert _same(got, [depth_np, level_order, level_ptr, path, sq])
    if n >= 3:
        cyclic = parents.copy()
        a, b = order[1], order[2]
        cyclic[a], cyclic[b] = b, a  # a two-node cycle
        assert _levels_native(cyclic, lengths, queries, None) is None
        with pytest.raises(ValueError, match="cycle"):
            ft.KVTree.from_lengths(cyclic, lengths, np.array([0]))


def test_trees_are_the_same_with_and_without_the_native_cores(monkeypatch):
    """Every array of a KVTree (paper, family and random trees) is the same built either way."""
    rng = np.random.default_rng(21)
    specs = [paper_tree(c) for c in (1, 8, 12)] + [random_tree(rng, roots=int(rng.integers(1, 5))) for _ in range(10)]
    specs += [family_tree(fc) for fc in FAMILY_CASES[::9]]
    names = ("parents", "lengths", "slot_indptr", "slots", "query_nodes", "depth", "level_order", "level_ptr",
             "subtree_queries", "path_lengths")  # fmt: skip

    def build(t):
        return ft.KVTree.from_flat(t.parents, t.lengths, t.slots, t.query_nodes)

    native_trees = [build(t) for t in specs]
    monkeypatch.setattr(native, "_LOADED", (None, None))  # the numpy paths from here on
    for t, got in zip(specs, native_trees, strict=True):
        want = build(t)
        assert _same([getattr(got, a) for a in names], [getattr(want, a) for a in names])
        assert len(got.levels) == len(want.levels) and _same(got.levels, want.levels)


def test_native_query_positions_equal_numpys(monkeypatch):
    """The queries' DFS positions (each subtree's first, each query's rank and the inverse) of
    the compiled walk equal numpy's on paper trees, random forests with internal queries and
    family trees, with and without a permutation."""
    from fasttree import planner

    rng = np.random.default_rng(33)
    trees = [paper_tree(c) for c in (1, 9, 13)] + [random_tree(rng, roots=int(rng.integers(1, 5))) for _ in range(12)]
    trees += [family_tree(fc) for fc in FAMILY_CASES[::7]]
    assert all(planner._query_positions_native(t, planner._TreeIndex(t)) is not None for t in trees)
    got = [planner._GroupIndex(t, planner._TreeIndex(t)) for t in trees]
    monkeypatch.setattr(native, "_LOADED", (None, None))  # the numpy paths from here on
    permuted = 0
    for t, g in zip(trees, got, strict=True):
        w = planner._GroupIndex(t, planner._TreeIndex(t))
        assert _same([g.qlo, g.qhi, g.rank, g.query_of_rank], [w.qlo, w.qhi, w.rank, w.query_of_rank])
        assert (g.perm is None) == (w.perm is None)
        permuted += w.perm is not None
    assert permuted >= 3


def _plan_arrays_equal(a: ft.Plan, b: ft.Plan) -> bool:
    return a.max_slot == b.max_slot and all(
        getattr(a, n).dtype == getattr(b, n).dtype and np.array_equal(getattr(a, n), getattr(b, n))
        for n in DEVICE_ARRAYS
    )


@pytest.mark.parametrize("seed", range(12))
def test_native_plan_extension_equals_numpys(seed):
    """Extensions of random trees by private growth (1 or several tokens a node, unread nodes too),
    every config shape (packed row masks, query-centric): the same extended plans and anchors,
    and the same declines (a changed old slot)."""
    rng = np.random.default_rng(900 + seed)
    config = CONFIGS[seed % len(CONFIGS)]
    hq, hkv = [(32, 32), (32, 8), (8, 1)][seed % 3]
    extended = declined = 0
    for _ in range(6):
        tree = random_tree(rng, max_nodes=int(rng.choice([5, 40, 200])), max_len=int(rng.choice([4, 80, 600])))
        plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=64)
        fast, slow = PlanExtender(max_steps=6, native=True), PlanExtender(max_steps=6, native=False)
        fast.remember(tree, plan)
        slow.remember(tree, plan)
        for _step in range(6):
            nxt = grow(tree, rng, max_new=int(rng.choice([1, 3])))
            if rng.random() < 0.15 and nxt.num_tokens:  # an old token moved: both must decline
                slots = nxt.slots.copy()
                slots[int(rng.integers(0, slots.size))] += 10**6
                nxt = ft.KVTree.from_flat(nxt.parents, nxt.lengths, slots, nxt.query_nodes)
            a, b = fast.extend(nxt), slow.extend(nxt)
            assert (a is None) == (b is None)
            if a is None:
                declined += 1
                a = ft.plan(nxt, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=64)
                fast.remember(nxt, a)
                slow.remember(nxt, a)
            else:
                extended += 1
                assert _plan_arrays_equal(a, b)
                fast.remember(nxt, a)
                slow.remember(nxt, b)
                assert np.array_equal(fast._anchor, slow._anchor)
                assert np.array_equal(fast._anchor_unit, slow._anchor_unit)
            tree = nxt
    assert extended > 0
