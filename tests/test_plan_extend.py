"""PlanExtender: extended plans read every query's context exactly once (as fresh plans do),
give the reference's attention, and the extender declines every tree that is not a pure
growth of private nodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plan_checks import assert_covers_contexts_once, assert_partials_consistent
from test_attention import check_against_reference, make_inputs, run_poisoned
from trees import random_tree

import fasttree as ft
from fasttree.plan_extend import PlanExtender

HEADS = [(32, 32, 128), (32, 8, 128), (16, 2, 64), (8, 1, 64)]
CONFIGS = [
    ft.FastTreeConfig(),
    ft.FastTreeConfig(pack_tokens=0),
    ft.FastTreeConfig(
        pack_tokens=64, pack_min_units=0, kv_tile=(16, 16), kv_split_sizes=(64, 32), para_threshs1=(0, 0)
    ),
    ft.FastTreeConfig(gamma=10.0),  # query-centric
]


def node_slot_lists(tree: ft.KVTree) -> list[np.ndarray]:
    return [tree.slots[tree.slot_indptr[i] : tree.slot_indptr[i + 1]].astype(np.int64) for i in range(tree.n_nodes)]


def grow(tree: ft.KVTree, rng: np.random.Generator, *, p: float = 0.7, max_new: int = 3) -> ft.KVTree:
    """``tree`` with random private nodes (one query reads them, >= 1 token) grown by 1..max_new
    tokens at new pool slots (scattered above the tree's slots), and a few unread nodes grown."""
    slots = node_slot_lists(tree)
    sq = tree.subtree_queries
    nxt = tree.max_slot + 1 + int(rng.integers(0, 5))
    grown = 0
    for i in range(tree.n_nodes):
        can = (sq[i] == 1 and tree.lengths[i] > 0) or sq[i] == 0
        if can and rng.random() < p:
            k = int(rng.integers(1, max_new + 1))
            new = nxt + rng.permutation(2 * k)[:k]
            nxt += 2 * k
            slots[i] = np.concatenate([slots[i], new])
            grown += 1
    return ft.KVTree(tree.parents, slots, tree.query_nodes)


def check(tree: ft.KVTree, plan: ft.Plan) -> None:
    assert_covers_contexts_once(tree, plan)
    assert_partials_consistent(plan)
    assert np.all(plan.unit_kv_len >= 1)
    assert np.all(plan.unit_kv_start.astype(np.int64) + plan.unit_kv_len <= plan.kv_indices.size)
    assert plan.kv_indices.dtype == np.int32 and plan.unit_kv_start.dtype == np.int32
    assert plan.kv_row_mask.size in (0, plan.kv_indices.size)
    assert plan.max_slot == tree.max_slot


@pytest.mark.parametrize("max_new", [1, 3])  # 1: every grown node gains one token (a decode step)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("heads", HEADS)
def test_extended_plans_read_every_context_once(config, heads, max_new):
    hq, hkv, d = heads
    rng = np.random.default_rng(hq + 7 * hkv + 13 * d + 101 * CONFIGS.index(config) + max_new)
    extended = 0
    for _ in range(12):
        tree = random_tree(rng, max_nodes=30, max_len=80)
        ext = PlanExtender(max_steps=4)
        plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        ext.remember(tree, plan)
        for _step in range(4):
            nxt = grow(tree, rng, max_new=max_new)
            got = ext.extend(nxt)
            growable = (tree.subtree_queries == 1) & (tree.lengths > 0)
            changed = (nxt.lengths != tree.lengths)[tree.subtree_queries > 0]
            if changed.any() and growable.any():
                assert got is not None, "a growth of private nodes only must be extended"
            if got is None:
                got = ft.plan(nxt, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
            else:
                extended += 1
                assert got is not plan or np.array_equal(nxt.lengths, tree.lengths)
            check(nxt, got)
            ext.remember(nxt, got)
            tree, plan = nxt, got
    assert extended >= 12


def test_extension_keeps_the_tokens_of_a_unit_in_order():
    # a private leaf's new slots go right after its last token, inside the same unit
    tree = ft.KVTree.from_lengths([-1, 0, 0], [40, 5, 7], [1, 2])
    plan = ft.plan(tree, num_q_heads=8, num_kv_heads=8, head_dim=64)
    ext = PlanExtender()
    ext.remember(tree, plan)
    slots = node_slot_lists(tree)
    slots[1] = np.concatenate([slots[1], [100, 90]])
    nxt = ft.KVTree(tree.parents, slots, tree.query_nodes)
    got = ext.extend(nxt)
    assert got is not None
    check(nxt, got)
    kv = got.kv_indices.tolist()
    leaf = slots[1].tolist()  # read in order somewhere (packing may have copied the old run into a bin)
    assert any(kv[at : at + len(leaf)] == leaf for at in range(len(kv)) if kv[at] == leaf[0])
    assert got.n_units == plan.n_units and got.kv_indices.size == plan.kv_indices.size + 2


def test_identical_tree_reuses_the_plan_and_counts_a_step():
    tree = random_tree(np.random.default_rng(3), max_nodes=10)
    plan = ft.plan(tree, num_q_heads=4, num_kv_heads=4, head_dim=64)
    ext = PlanExtender(max_steps=2)
    ext.remember(tree, plan)
    same = ft.KVTree(tree.parents, node_slot_lists(tree), tree.query_nodes)
    assert ext.extend(same) is plan
    ext.remember(same, plan)
    assert ext.steps == 1


def _base():
    # root (shared, 20) -> 3 private leaves (10 each), one query per leaf; node 4: no query
    tree = ft.KVTree(
        [-1, 0, 0, 0, 0],
        [np.arange(20), np.arange(20, 30), np.arange(30, 40), np.arange(40, 50), np.arange(50, 52)],
        [1, 2, 3],
    )
    plan = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=64)
    ext = PlanExtender(max_steps=3)
    ext.remember(tree, plan)
    return tree, plan, ext


def _with(tree: ft.KVTree, *, node: int | None = None, slots=None, parents=None, queries=None) -> ft.KVTree:
    s = node_slot_lists(tree)
    if node is not None:
        s[node] = np.asarray(slots)
    return ft.KVTree(tree.parents if parents is None else parents, s,
                     tree.query_nodes if queries is None else queries)  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["shared_grew", "parents", "queries_order", "old_slot_changed", "shrank", "extra_query", "new_node"],
)
def test_declines_trees_that_are_not_private_growth(case):
    tree, _plan, ext = _base()
    if case == "shared_grew":
        nxt = _with(tree, node=0, slots=np.arange(21))
    elif case == "parents":
        nxt = _with(tree, parents=[-1, 0, 0, 1, 0])
    elif case == "queries_order":
        nxt = _with(tree, queries=[2, 1, 3])
    elif case == "old_slot_changed":
        nxt = _with(tree, node=1, slots=[*range(20, 29), 99, 100])  # grew, but an old token moved
    elif case == "shrank":
        nxt = _with(tree, node=1, slots=np.arange(20, 29))
    elif case == "extra_query":
        nxt = _with(tree, queries=[1, 2, 3, 3])
    else:
        s = node_slot_lists(tree)
        nxt = ft.KVTree([-1, 0, 0, 0, 0, 1], [*s, np.array([60])], [1, 2, 3])
    assert ext.extend(nxt) is None


def test_unread_nodes_may_grow_and_max_steps_bounds_the_chain():
    tree, plan, ext = _base()
    for step in range(3):
        nxt = _with(tree, node=4, slots=np.arange(50, 53 + step))  # nobody reads node 4
        nxt = _with(nxt, node=2, slots=[*node_slot_lists(tree)[2], 200 + step])
        got = ext.extend(nxt)
        assert got is not None and got.kv_indices.size == plan.kv_indices.size + 1
        check(nxt, got)
        ext.remember(nxt, got)
        tree, plan = nxt, got
    assert ext.steps == 3
    nxt = _with(tree, node=3, slots=[*node_slot_lists(tree)[3], 300])
    assert ext.extend(nxt) is None  # max_steps reached: plan afresh
    fresh = ft.plan(nxt, num_q_heads=8, num_kv_heads=2, head_dim=64)
    ext.remember(nxt, fresh)
    assert ext.steps == 0
    assert ext.extend(_with(nxt, node=3, slots=[*node_slot_lists(nxt)[3], 301])) is not None


def test_an_extension_is_adopted_only_through_remember():
    tree, _plan, ext = _base()
    a = _with(tree, node=1, slots=[*range(20, 30), 70])
    assert ext.extend(a) is not None  # not remembered: the base stays `tree`
    b = _with(tree, node=2, slots=[*range(30, 40), 71])
    got = ext.extend(b)
    assert got is not None
    check(b, got)
    assert ext.extend(_with(a, node=2, slots=[*range(30, 40), 71])) is not None
    ext.reset()
    assert ext.extend(b) is None


def test_empty_private_node_growth_is_declined():
    # a fresh fork: its private node was empty (the query read the shared node), then gets a token
    tree = ft.KVTree([-1, 0], [np.arange(8), np.zeros(0, dtype=np.int64)], [1])
    ext = PlanExtender()
    ext.remember(tree, ft.plan(tree, num_q_heads=4, num_kv_heads=4, head_dim=64))
    assert ext.extend(ft.KVTree([-1, 0], [np.arange(8), np.array([9])], [1])) is None


@pytest.mark.parametrize("max_steps", [0, -1, 1.5, True])
def test_max_steps_is_validated(max_steps):
    with pytest.raises(ValueError, match="max_steps"):
        PlanExtender(max_steps=max_steps)


@pytest.mark.parametrize(
    ("g", "hkv", "d", "dtype", "config"),
    [
        (1, 2, 64, torch.float16, CONFIGS[0]),
        (4, 2, 128, torch.bfloat16, CONFIGS[2]),
        (8, 1, 64, torch.float16, CONFIGS[0]),
        (7, 1, 256, torch.bfloat16, CONFIGS[1]),
    ],
)
def test_extended_plans_match_reference(g, hkv, d, dtype, config, device):
    rng = np.random.default_rng(31 * g + d)
    gen = torch.Generator().manual_seed(31 * g + d)
    heads = {"num_q_heads": g * hkv, "num_kv_heads": hkv, "head_dim": d}
    tree = random_tree(rng, max_nodes=16, max_len=60)
    ext = PlanExtender()
    plan = ft.plan(tree, config, **heads)
    ext.remember(tree, plan)
    runs = 0
    for _ in range(3):
        nxt = grow(tree, rng, max_new=20)
        got = ext.extend(nxt)
        if got is None:
            got = ft.plan(nxt, config, **heads)
        else:
            runs += 1
        q, k, v = make_inputs(nxt, g * hkv, hkv, d, dtype, device, gen)
        out = run_poisoned(lambda o, p=got, q=q, k=k, v=v: ft.tree_attention(q, k, v, p, out=o), q)
        check_against_reference(out, q, k, v, nxt)
        ext.remember(nxt, got)
        tree = nxt
    assert runs >= 1


def test_adapter_trees_of_consecutive_decode_steps_extend():
    """A server's view through the adapter: requests sharing prefixes each append one token per
    step at a new slot; the trie keeps its node ids, so every step after the first extends."""
    rng = np.random.default_rng(4)
    prefix = rng.permutation(1000)[:300]
    free = iter(rng.permutation(np.arange(1000, 5000)).tolist())
    requests = [
        np.concatenate([prefix[: int(rng.integers(50, 300))], [next(free) for _ in range(5)]]) for _ in range(9)
    ]
    ext = PlanExtender(max_steps=6)
    extended = 0
    for _step in range(6):
        tree = ft.tree_from_token_slots(requests)
        plan = ext.extend(tree)
        if plan is None:
            plan = ft.plan(tree, num_q_heads=16, num_kv_heads=4, head_dim=64)
        else:
            extended += 1
        check(tree, plan)
        ext.remember(tree, plan)
        requests = [np.append(r, next(free)) for r in requests]
    assert extended == 5


def test_append_tokens_is_the_next_steps_tree_and_extends():
    """KVTree.append_tokens: the tree of the requests' contexts with one new token each, with the
    same nodes and queries, so the extender extends it."""
    rng = np.random.default_rng(8)
    prefix = rng.permutation(2000)[:200]
    free = iter(rng.permutation(np.arange(2000, 9000)).tolist())
    contexts = [
        np.concatenate([prefix[: int(rng.integers(1, 200))], [next(free) for _ in range(int(rng.integers(1, 9)))]])
        for _ in range(12)
    ]
    tree = ft.tree_from_token_slots(contexts)
    ext = PlanExtender()
    ext.remember(tree, ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=64))
    for _step in range(3):
        new = np.array([next(free) for _ in contexts])
        nxt = tree.append_tokens(new)
        contexts = [np.append(c, s) for c, s in zip(contexts, new, strict=True)]
        indptr, slots = nxt.query_slots()
        got = [slots[indptr[j] : indptr[j + 1]].tolist() for j in range(len(contexts))]
        assert got == [c.tolist() for c in contexts]
        rebuilt = ft.tree_from_token_slots(contexts)
        for name in ("parents", "lengths", "slots", "query_nodes"):
            np.testing.assert_array_equal(getattr(nxt, name), getattr(rebuilt, name))
        plan = ext.extend(nxt)
        assert plan is not None
        check(nxt, plan)
        ext.remember(nxt, plan)
        tree = nxt


def test_append_tokens_errors():
    tree = ft.KVTree([-1, 0, 0], [np.arange(4), np.arange(4, 6), np.arange(6, 7)], [1, 2])
    with pytest.raises(ValueError, match="slots has 1 entries but the tree has 2 queries"):
        tree.append_tokens([9])
    with pytest.raises(ValueError, match=r"slots\[1\] = -3 is outside the pool slot range"):
        tree.append_tokens([9, -3])
    shared = ft.KVTree([-1, 0], [np.arange(4), np.arange(4, 6)], [1, 1])  # a fork: two queries at one node
    with pytest.raises(ValueError, match="query 0 sits at node 1, which other queries read too"):
        shared.append_tokens([9, 10])
    assert tree.append_tokens([9, 10]).lengths.tolist() == [4, 3, 2]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("config", CONFIGS[:3])
def test_two_private_nodes_ending_in_one_slot_get_no_anchor(native, config):
    """Two private nodes whose last tokens share a pool slot: neither is anchored (an insertion
    after either entry could land in the other's unit), so growing them is planned afresh; with
    distinct last slots both are anchored and the growth extends."""
    parents = [-1, 0, 0]
    for last_b, extends in ((9, False), (8, True)):
        tree = ft.KVTree(parents, [np.arange(4), np.array([4, 9]), np.array([5, last_b])], [1, 2])
        plan = ft.plan(tree, config, num_q_heads=8, num_kv_heads=2, head_dim=64)
        ext = PlanExtender(native=native)
        ext.remember(tree, plan)
        grown = ft.KVTree(parents, [np.arange(4), np.array([4, 9, 10]), np.array([5, last_b, 11])], [1, 2])
        extended = ext.extend(grown)
        assert (extended is not None) == extends
        assert (ext._anchor[1:] >= 0).all() == extends
        if extended is not None:
            check(grown, extended)


def test_a_plan_whose_masks_do_not_match_its_entries_never_reaches_the_compiled_loops():
    """A hand-built plan with fewer row masks than KV entries goes the numpy way, which raises, instead
    of the compiled anchors and insertion reading past the masks."""
    import copy

    rng = np.random.default_rng(3)
    for _ in range(20):
        tree = random_tree(rng, max_nodes=40, max_len=80)
        plan = ft.plan(tree, CONFIGS[2], num_q_heads=8, num_kv_heads=2, head_dim=64)
        if plan.kv_row_mask.size > 1 and tree.n_queries > 1:
            break
    bad = copy.copy(plan)
    bad.__dict__["kv_row_mask"] = plan.kv_row_mask[:1].copy()
    ext = PlanExtender()
    ext.remember(tree, bad)
    with pytest.raises(IndexError):
        ext.extend(grow(tree, rng, p=1.0, max_new=1))
