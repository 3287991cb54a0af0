"""Property-based tests (Hypothesis): any tree, any valid config, any planner rule and any head
shape give a plan that reads every query's context exactly once; an extended plan does too;
the kernels agree with the float64 reference on such plans (NaN-poisoned outputs, fp16 and
bf16); a runtime's steps are exact or refused whole, with the capacity named; the adapters
rebuild every request's context; bad inputs are refused before any launch, and junk (any nested
lists, scalars, strings, NaN) given as a config, a tree or a server's view raises ValueError and
nothing else; the shipped latency model scores any plan with a finite positive latency.
Hypothesis shrinks a failing case to a small tree and config.

The trees mix forests, queries at internal nodes, empty non-root nodes, 1-token and
tile-boundary lengths, and slots scattered over a larger pool. Configs cover the whole space
``FastTreeConfig`` accepts (extreme gammas, 1-token splits, every KV tile, packing off and on,
explicit or derived query tiles, warps and stages). ``FASTTREE_HYPOTHESIS_SCALE=20`` multiplies
the example counts for a longer hunt (every property held at 20 for plans, extensions and adapters
and at 10 for the kernels and the runtime, 2026-12-01).
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from plan_checks import assert_covers_contexts_once, assert_partials_consistent
from test_planner import check_plan

import fasttree as ft
from fasttree.adapter import tree_from_radix_nodes, tree_from_req_to_token, tree_from_token_slots
from fasttree.plan_extend import PlanExtender
from fasttree.reference import max_relative_error, reference_attention

LENGTHS = (0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129)
GQA = (1, 2, 4, 7, 8, 16)
#: Multiplies every test's example count: ``FASTTREE_HYPOTHESIS_SCALE=20 pytest tests/test_properties.py``
#: hunts longer than CI does.
SCALE = float(os.environ.get("FASTTREE_HYPOTHESIS_SCALE", "1"))
SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much]


def examples(n: int) -> settings:
    """Settings for ``n`` examples (times :data:`SCALE`), no deadline (the interpreter is slow).

    At the default scale the examples are derandomised, so CI runs the same cases every time; a
    larger scale draws new ones on every run."""
    return settings(
        max_examples=max(1, round(n * SCALE)), deadline=None, suppress_health_check=SLOW_OK, derandomize=SCALE <= 1
    )


@st.composite
def kv_trees(draw, *, max_nodes: int = 24, lengths: tuple[int, ...] = LENGTHS) -> ft.KVTree:
    """A forest with queries on any nodes; rejected (``assume``) when a query's context is empty."""
    n = draw(st.integers(1, max_nodes))
    n_roots = draw(st.integers(1, min(n, 3)))
    parents = [-1] * n_roots + [draw(st.integers(0, i - 1)) for i in range(n_roots, n)]
    order = draw(st.permutations(range(n)))  # node ids in any order: parents need not come first
    new_id = {old: new for new, old in enumerate(order)}
    relabelled = [-1] * n
    for old, p in enumerate(parents):
        relabelled[new_id[old]] = -1 if p < 0 else new_id[p]
    node_len = draw(st.lists(st.sampled_from(lengths), min_size=n, max_size=n))
    query_nodes = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n + 2))
    total = sum(node_len)
    gap = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    pool = np.random.default_rng(seed).permutation(total + gap)[:total] if draw(st.booleans()) else np.arange(total)
    bounds = np.concatenate([[0], np.cumsum(node_len)]).astype(np.int64)
    slots = [pool[bounds[i] : bounds[i + 1]] for i in range(n)]
    try:
        return ft.KVTree(relabelled, slots, query_nodes)
    except ValueError as exc:  # a query whose whole root path is empty nodes
        assume("empty context" not in str(exc))
        raise


def _pair(draw, values) -> tuple[int, int]:
    return draw(st.sampled_from(values)), draw(st.sampled_from(values))


@st.composite
def configs(draw, *, group_size: int) -> ft.FastTreeConfig:
    """Any config ``FastTreeConfig`` accepts whose query tiles fit ``group_size``."""
    if draw(st.booleans()):
        q_tiles = None
    else:
        most = max(1, 256 // group_size)
        small = draw(st.integers(1, min(most, 16)))
        q_tiles = (draw(st.integers(small, most)), small)
    kv = _pair(draw, (16, 32, 64, 128, 256, 512))
    big = draw(st.sampled_from((1, 16, 64, 100, 1024, 1 << 20)))
    small_split = draw(st.sampled_from((1, 7, 16, 128, 512)))
    return ft.FastTreeConfig(
        alpha=draw(st.floats(0, 2)),
        beta=draw(st.floats(0, 2)),
        gamma=draw(st.one_of(st.sampled_from((-10.0, 10.0, 0.0)), st.floats(-1, 1))),
        q_tile_queries=q_tiles,
        kv_tile=kv,
        kv_split_sizes=(big, small_split),
        para_threshs1=(draw(st.integers(0, 700)), draw(st.integers(0, 700))),
        para_threshs2=(draw(st.integers(0, 300)), draw(st.integers(0, 300))),
        num_warps=draw(st.one_of(st.none(), st.tuples(st.sampled_from((1, 2, 4, 8)), st.sampled_from((1, 2, 4, 8))))),
        num_stages=draw(st.one_of(st.none(), st.tuples(st.integers(1, 6), st.integers(1, 6)))),
        pack_tokens=draw(st.sampled_from((0, 16, 100, 512, 1024, 4096))),
        pack_min_units=draw(st.integers(0, 600)),
    )


RULES = ("solo_units", "balanced_bins", "whole_groups", "wide_units", "aligned_blocks", "all_large_without_large")


@st.composite
def planned(draw, *, max_nodes: int = 24, lengths: tuple[int, ...] = LENGTHS, head_dims=(16, 64, 128, 256)):
    """(tree, plan, plan_args) for a drawn tree, head shape, config and planner rules (``plan_args``:
    the config, heads and rules the plan was made with, the keyword arguments of
    :func:`fasttree.plan`; a plan the crossover rule hands to plain decode carries decode's config)."""
    tree = draw(kv_trees(max_nodes=max_nodes, lengths=lengths))
    g = draw(st.sampled_from(GQA))
    hkv = draw(st.integers(1, 3))
    d = draw(st.sampled_from(head_dims))
    config = draw(configs(group_size=g))
    rules = ft.PlanRules(
        **{name: draw(st.booleans()) for name in RULES},
        wide_head_small_split=draw(st.sampled_from((0, 16, 64))),
        wide_head_small_split_programs=draw(st.sampled_from((24, 10**6))),
        crossover_wave_programs=draw(st.sampled_from((0, 132))),
    )
    plan_args = {"config": config, "num_q_heads": g * hkv, "num_kv_heads": hkv, "head_dim": d, "rules": rules}
    return tree, ft.plan(tree, **plan_args), plan_args


@examples(150)
@given(planned())
def test_any_plan_reads_each_context_once(case):
    """Coverage, partial rows and unit shapes hold for every tree, config, rule set and head shape;
    the plan reads only the tree's slots and is the same when planned again."""
    tree, plan, plan_args = case
    check_plan(tree, plan)
    assert plan.n_queries == tree.n_queries
    assert np.isin(plan.kv_indices, tree.slots).all()
    assert int(plan.kv_indices.max()) <= tree.max_slot
    for name in ("kv_indices", "unit_kv_start", "unit_kv_len", "unit_q_start", "unit_q_len", "pair_out_row"):
        assert getattr(plan, name).dtype == np.int32, name
    again = ft.plan(ft.planner.unprepared(tree), **plan_args)
    for name in ("kv_indices", "kv_row_mask", "unit_kv_len", "unit_q_len", "pair_query", "pair_out_row"):
        np.testing.assert_array_equal(getattr(again, name), getattr(plan, name))


@st.composite
def growing_trees(draw):
    """A tree whose queries each sit alone on their own node, and the slots of three more decode
    steps (one new token per query, at fresh pool slots)."""
    tree = draw(kv_trees(max_nodes=16))
    assume(bool(np.all(tree.subtree_queries[tree.query_nodes] == 1)))
    start = tree.max_slot + 1 + draw(st.integers(0, 5))
    n = tree.n_queries
    steps = [np.arange(start + i * n, start + (i + 1) * n)[::-1] for i in range(3)]
    return tree, steps


@examples(80)
@given(growing_trees(), st.sampled_from(GQA), st.data())
def test_extended_plans_read_each_context_once(case, g, data):
    """Plans extended to appended tokens cover the grown contexts exactly once, like a fresh plan
    (their units need no longer be sorted by KV length, so the unit-order check is left out)."""
    tree, steps = case
    config = data.draw(configs(group_size=g))
    heads = {"num_q_heads": g, "num_kv_heads": 1, "head_dim": 64}
    ext = PlanExtender(max_steps=8)
    plan = ft.plan(tree, config, **heads)
    ext.remember(tree, plan)
    for new_slots in steps:
        was_empty = bool(np.any(tree.lengths[tree.query_nodes] == 0))
        tree = tree.append_tokens(new_slots)
        extended = ext.extend(tree)
        if extended is None:  # only an empty node that grew has no entry to extend after (documented)
            assert was_empty, "a tree that only grew non-empty private nodes must extend"
            extended = ft.plan(tree, config, **heads)
        else:
            assert_covers_contexts_once(tree, extended)
            assert_partials_consistent(extended)
            starts = extended.unit_kv_start.astype(np.int64)
            assert np.all(starts + extended.unit_kv_len <= extended.kv_indices.size)
            # units keep their queries and partial rows; only their KV grew
            np.testing.assert_array_equal(extended.unit_q_len, plan.unit_q_len)
            assert np.all(extended.unit_kv_len >= plan.unit_kv_len)
        ext.remember(tree, extended)
        plan = extended


@examples(30)
@given(
    planned(max_nodes=8, lengths=(0, 1, 2, 16, 17, 33, 40), head_dims=(16, 32)),
    st.sampled_from((torch.float16, torch.bfloat16)),
    st.integers(0, 2**31 - 1),
)
def test_kernels_match_the_reference_on_any_plan(case, dtype, seed):
    """tree_attention on a drawn plan (Triton interpreter on the CPU; the GPU elsewhere) writes every
    output element (NaN-poisoned first) within tolerance of the float64 reference."""
    tree, plan, plan_args = case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = plan_args["num_q_heads"], plan_args["num_kv_heads"], plan_args["head_dim"]
    q = torch.randn(tree.n_queries, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(tree.max_slot + 1, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(tree.max_slot + 1, hkv, d, generator=gen).to(device, dtype)
    out = torch.full_like(q, float("nan"))
    ft.tree_attention(q, k, v, plan, out=out)
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison survived)"
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    assert max_relative_error(out, reference_attention(q, k, v, tree)) <= tol


@st.composite
def request_slot_lists(draw):
    """Slot lists of requests that share prefixes: each request extends a random earlier one's
    prefix (or starts fresh) with new slots."""
    n = draw(st.integers(1, 12))
    lists: list[list[int]] = []
    fresh = 0
    for _ in range(n):
        base: list[int] = []
        if lists and draw(st.booleans()):
            parent = draw(st.sampled_from(lists))
            base = parent[: draw(st.integers(0, len(parent)))]
        grow = draw(st.integers(0 if base else 1, 20))
        lists.append(base + list(range(fresh, fresh + grow)))
        fresh += grow + draw(st.integers(0, 3))
    return lists


@examples(150)
@given(request_slot_lists())
def test_adapters_rebuild_every_request_context(lists):
    """Both adapters give each request its own slot list as its context, and share every common prefix."""
    tree = tree_from_token_slots(lists)
    indptr, slots = tree.query_slots()
    for j, want in enumerate(lists):
        assert slots[indptr[j] : indptr[j + 1]].tolist() == want
    width = max(len(x) for x in lists) + 2
    table = np.full((len(lists) + 1, width), -7, dtype=np.int64)  # row 0 unused, padding poisoned
    for i, x in enumerate(lists):
        table[i + 1, : len(x)] = x
    rows = np.arange(1, len(lists) + 1)
    lens = np.array([len(x) for x in lists])
    same = tree_from_req_to_token(table, rows, lens)
    assert same.num_tokens == tree.num_tokens
    indptr2, slots2 = same.query_slots()
    np.testing.assert_array_equal(indptr2, indptr)
    np.testing.assert_array_equal(slots2, slots)
    # a token two requests share is stored once
    assert tree.num_tokens == len({(tuple(x[: i + 1])) for x in lists for i in range(len(x))})


@pytest.mark.parametrize("bad", ["slot", "dtype", "heads"])
@given(kv_trees(max_nodes=6, lengths=(1, 5, 16)))
@examples(10)
def test_bad_inputs_are_refused_before_any_launch(bad, tree):
    """A pool too small for the tree's slots, a q of another dtype, or heads the plan was not made
    for: a ValueError that names the problem, and the output left untouched."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = ft.plan(tree, num_q_heads=4, num_kv_heads=2, head_dim=16)
    q = torch.randn(tree.n_queries, 4, 16, dtype=torch.float16, device=device)
    pool = tree.max_slot + 1
    k = torch.randn(pool, 2, 16, dtype=torch.float16, device=device)
    if bad == "slot":
        k, match = k[: pool - 1], "slot"
    elif bad == "dtype":
        q, match = q.to(torch.bfloat16), "dtype"
    else:
        q, match = torch.randn(tree.n_queries, 8, 16, dtype=torch.float16, device=device), r"Hq=4"
    v = torch.randn_like(k)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match=match):
        ft.tree_attention(q, k, v, plan, out=out)
    assert bool((out == 7.0).all())


def test_extension_refuses_a_shared_node():
    """append_tokens on a query that shares its node: a clear error (the tree must be rebuilt)."""
    tree = ft.KVTree.from_lengths([-1, 0], [4, 3], [1, 1])
    with pytest.raises(ValueError, match="other queries read too"):
        tree.append_tokens([10, 11])
    assert_covers_contexts_once(tree, ft.plan(tree, num_q_heads=1, num_kv_heads=1, head_dim=16))


@st.composite
def runtime_steps(draw):
    """A runtime's small capacities and config, and 2 to 8 decode steps (enough uploads for each
    staging buffer to be reused with another plan's layout): each a new drawn tree, or the last
    tree with one more token per query (an extension) when its queries sit alone."""
    queries = draw(st.integers(4, 40))
    caps = {
        "max_queries": queries,
        "max_kv_entries": draw(st.sampled_from((64, 300, 4096))),
        "max_units": max(queries, draw(st.sampled_from((4, 64, 4096)))),  # the runtime needs one per query
        "max_partial_rows": draw(st.sampled_from((8, 64, 1024))),
        # few variant ids: later plans often run a covering variant, whose grids exceed their units and
        # merge list (the idle programs and the merge filler then run)
        "max_variants": draw(st.sampled_from((0, 1, 2, 32))),
    }
    g = draw(st.sampled_from((1, 2, 4)))
    config = draw(configs(group_size=g))
    trees = [draw(kv_trees(max_nodes=8, lengths=(0, 1, 2, 16, 17, 33)))]
    for _ in range(draw(st.integers(1, 7))):
        last = trees[-1]
        if draw(st.booleans()) and bool(np.all(last.subtree_queries[last.query_nodes] == 1)):
            start = last.max_slot + 1
            trees.append(last.append_tokens(np.arange(start, start + last.n_queries)))
        else:
            trees.append(draw(kv_trees(max_nodes=8, lengths=(0, 1, 2, 16, 17, 33))))
    return caps, g, config, trees


CAPACITY_WORDS = ("max_queries", "max_kv_entries", "max_units", "max_partial_rows", "max_pairs", "rows")


@examples(20)
@given(runtime_steps(), st.integers(0, 2**31 - 1))
def test_runtime_steps_are_exact_or_refused_whole(case, seed):
    """Every step either runs within tolerance of the float64 reference, touching no row past its
    queries, or is refused with an error naming the capacity, leaving the previous plan in place
    (the next forward still computes the previous tree); a tree within max_queries whose context
    entries fit max_kv_entries is never refused (the capacity guarantee)."""
    caps, g, config, trees = case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hkv, d = 2, 16
    pool = max(t.max_slot for t in trees) + 1
    rt = ft.TreeAttentionRuntime(
        config, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, dtype=torch.float16, device=device,
        pool_slots=pool, **caps,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    rows = caps["max_queries"]
    k = torch.randn(pool, hkv, d, generator=gen).to(device, torch.float16)
    v = torch.randn(pool, hkv, d, generator=gen).to(device, torch.float16)
    current = None
    for tree in trees:
        q = torch.randn(rows, g * hkv, d, generator=gen).to(device, torch.float16)
        try:
            rt.plan(tree)
        except ValueError as exc:
            assert any(w in str(exc) for w in CAPACITY_WORDS) or "queries" in str(exc), str(exc)
            context = int(tree.path_lengths[tree.query_nodes].sum())
            assert tree.n_queries > rows or context > caps["max_kv_entries"], str(exc)
        else:
            current = tree
        if current is None:
            continue
        out = torch.full_like(q, float("nan"))
        rt.forward(q, k, v, out=out)
        n = current.n_queries
        assert torch.isnan(out[n:]).all(), "a row past the plan's queries was written"
        ref = reference_attention(q[:n], k, v, current)
        assert max_relative_error(out[:n], ref) <= 2e-3


JUNK_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=3)
)  # fmt: skip
JUNK = st.recursive(JUNK_SCALARS, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
JUNK_ARRAYS = st.one_of(
    JUNK, st.lists(st.integers(-5, 40), max_size=8), st.lists(st.lists(st.integers(-3, 60), max_size=5), max_size=8)
)
CONFIG_KEYS = ("schema_version", "alpha", "gamma", "kv_tile", "kv_split_sizes", "q_tile_queries", "num_warps",
               "num_stages", "pack_tokens", "para_threshs2", "unknown")  # fmt: skip


def _valueerror_or_nothing(fn, *args, **kwargs) -> None:
    """Run ``fn``; a ValueError (the library's error for bad input) is fine, any other exception fails."""
    with contextlib.suppress(ValueError):
        fn(*args, **kwargs)


@examples(300)
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), st.one_of(JUNK, st.dictionaries(st.text(max_size=2), JUNK))))
def test_junk_configs_raise_valueerror(data):
    """Any JSON-like dict: a config or a ValueError, never a TypeError or a crash further in."""
    _valueerror_or_nothing(lambda: ft.FastTreeConfig.from_dict(data).query_tiles(4))


@examples(300)
@given(JUNK_ARRAYS, JUNK_ARRAYS, JUNK_ARRAYS)
def test_junk_trees_raise_valueerror(parents, node_slots, query_nodes):
    """Any nested lists or scalars as a tree's parts: a tree that plans, or a ValueError."""

    def plan(make) -> None:
        ft.plan(make(parents, node_slots, query_nodes), num_q_heads=2, num_kv_heads=1, head_dim=16)

    _valueerror_or_nothing(plan, ft.KVTree)
    _valueerror_or_nothing(plan, ft.KVTree.from_lengths)


@examples(300)
@given(JUNK_ARRAYS, JUNK_ARRAYS, JUNK_ARRAYS, st.booleans())
def test_junk_server_views_raise_valueerror(a, b, c, prune):
    """The adapters on any junk: a tree or a ValueError."""
    _valueerror_or_nothing(tree_from_token_slots, a)
    _valueerror_or_nothing(tree_from_req_to_token, a, b, c)
    _valueerror_or_nothing(tree_from_radix_nodes, a, b, c, prune=prune)


def test_node_slots_that_are_no_sequence_are_named():
    with pytest.raises(ValueError, match="node_slots must be a sequence"):
        ft.KVTree([-1], None, [0])


LAYOUTS = ("contiguous", "padded", "transposed", "expanded", "strided_last")


def _laid_out(layout: str, shape: tuple[int, int, int], gen: torch.Generator, device: str, offsets) -> torch.Tensor:
    """A float16 tensor of ``shape`` in one of :data:`LAYOUTS`: a slice of a bigger tensor (``padded``,
    at ``offsets``), slots and heads swapped in memory, a stride-0 first dim, or a strided last dim."""
    n, h, d = shape

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device, torch.float16)

    if layout == "contiguous":
        return rand(n, h, d)
    if layout == "padded":
        a, b, c = offsets
        return rand(n + 3, h + 2, d + 8)[a : a + n, b : b + h, c : c + d]
    if layout == "transposed":
        return rand(h, n, d).transpose(0, 1)
    if layout == "expanded":
        return rand(1, h, d).expand(n, h, d)
    return rand(n, h, 2 * d)[:, :, ::2]


@examples(25)
@given(
    st.tuples(*[st.sampled_from(LAYOUTS)] * 4),
    st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 8)),
    st.integers(0, 2**31 - 1),
)
def test_any_tensor_layout_is_exact_or_refused(layouts, offsets, seed):
    """q, k_cache, v_cache and out as views of any layout: the result matches the reference, or a
    ValueError names the problem (a strided head dim; an out whose rows share memory)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tree = ft.KVTree([-1, 0, 0], [[3, 7, 9], [1, 2], [11, 0, 5, 6]], [1, 2, 2, 0])
    plan = ft.plan(tree, num_q_heads=4, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, out = (
        _laid_out(lay, shape, gen, device, offsets)
        for lay, shape in zip(layouts, [(4, 4, 16), (12, 2, 16), (12, 2, 16), (4, 4, 16)], strict=True)
    )
    if layouts[3] != "expanded":
        out.fill_(float("nan"))
    refused = "strided_last" in layouts or layouts[3] == "expanded"
    if refused:
        with pytest.raises(ValueError, match=r"last|overlap"):
            ft.tree_attention(q, k, v, plan, out=out)
        return
    ft.tree_attention(q, k, v, plan, out=out)
    assert max_relative_error(out, reference_attention(q, k, v, tree)) <= 2e-3


def test_runtime_refuses_an_out_whose_rows_share_memory():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tree = ft.KVTree.from_lengths([-1, 0, 0], [5, 2, 3], [1, 2])
    rt = ft.TreeAttentionRuntime(
        None, num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float16, device=device, max_queries=2,
        max_kv_entries=64,
    )  # fmt: skip
    rt.plan(tree)
    q = torch.randn(2, 2, 16, dtype=torch.float16, device=device)
    kv = torch.randn(10, 1, 16, dtype=torch.float16, device=device)
    out = torch.zeros(1, 2, 16, dtype=torch.float16, device=device).expand(2, 2, 16)
    with pytest.raises(ValueError, match="overlap"):
        rt.forward(q, kv, kv, out=out)
    assert not out.any()


@functools.cache
def _latency_model():
    from fasttree.costmodel.persist import load_model

    model, _ = load_model(
        Path(__file__).parents[1] / "costmodel" / "data" / "h200_latency_model.skops", gpu_name="NVIDIA H200"
    )
    return model


@examples(100)
@given(planned())
def test_the_latency_model_scores_any_plan(case):
    """The tuner's objective on any drawn plan: finite features, the batched rows equal to the single
    ones, and a finite positive latency from the shipped H200 model (else a trial would be refused)."""
    from fasttree.costmodel.features import features_of_plan, features_of_plans
    from fasttree.costmodel.gpu import gpu_spec

    _, plan, _ = case
    gpu = gpu_spec("NVIDIA H200")
    rows = features_of_plans([plan, plan], gpu)
    assert np.isfinite(rows).all()
    np.testing.assert_allclose(rows[0], features_of_plan(plan, gpu).reshape(-1), rtol=1e-12)
    latency = _latency_model().predict(rows)
    assert np.isfinite(latency).all() and (latency > 0).all()
