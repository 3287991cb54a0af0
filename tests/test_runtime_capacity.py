"""The runtime's capacity guarantee: a tree within ``max_queries`` whose context entries fit
``max_kv_entries`` always plans (the other capacities at their defaults, derived from those two);
outside them, a ``ValueError`` names the limit. Host planning only (CPU; the upload's relocation
runs in the interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trees import random_tree

import fasttree as ft
from fasttree.runtime import CapacityError, TreeAttentionRuntime
from fasttree.toolkit.suite import paper_tree
from fasttree.toolkit.workloads import sample_tree


def _context(tree: ft.KVTree) -> int:
    return int(tree.path_lengths[tree.query_nodes].sum())


def _runtime(device, tree, hq, hkv, d=128, **kw) -> TreeAttentionRuntime:
    """A runtime sized as a server sizes it for ``tree``'s batch: its queries and context entries."""
    caps = TreeAttentionRuntime.capacities(max_queries=tree.n_queries, max_context_tokens=1)
    caps["max_kv_entries"] = _context(tree)
    return TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float16, device=device, **caps, **kw
    )


#: The trees that raised with the default max_partial_rows (paper case 9 at GQA 4, GQA 16 and one KV
#: head; a width-50 few-shot prompt at 16 query heads over one KV head; two 30k-token documents with
#: 8 questions each at every head setting).
_RAISED = [
    ("paper 9", lambda: paper_tree(9), [(32, 8), (32, 2), (16, 1)]),
    ("few-shot width 50", lambda: sample_tree("few_shot", 18, prompt_tokens=4096, n_questions=50), [(16, 1)]),
    (
        "two 30k documents",
        lambda: sample_tree("multi_document", 16, n_documents=2, doc_tokens=(30000, 30000), questions_per_doc=(8, 8)),
        [(32, 32), (32, 8), (16, 1), (4, 1)],
    ),
]


@pytest.mark.parametrize("max_variants", [0, 32])
@pytest.mark.parametrize(("name", "make", "heads"), _RAISED, ids=[r[0] for r in _RAISED])
def test_the_trees_that_raised_now_plan(device, name, make, heads, max_variants):
    tree = make()
    for hq, hkv in heads:
        rt = _runtime(device, tree, hq, hkv, max_variants=max_variants)
        up = rt.plan(tree)
        assert up.plan.n_partial_rows <= rt.max_partial_rows and up.plan.n_units <= rt.max_units
        assert up.plan.pair_query.size <= rt.max_pairs and up.plan.kv_indices.size <= rt.kv_capacity


_FAMILIES = [
    ("multi_document", {"n_documents": 3, "doc_tokens": (8000, 30000), "questions_per_doc": (2, 16)}),
    ("few_shot", {"prompt_tokens": 6000, "n_questions": 64, "question_tokens": (1, 32)}),
    ("beam_search", {"width": 16, "depth": 6, "n_prompts": 3}),
    ("speculative", {"n_requests": 4, "n_token_nodes": 200, "max_depth": 12}),
    ("random_recursive", {"n_nodes": 300, "internal_query_prob": 0.3}),
    ("no_sharing", {"n_requests": 40, "context_tokens": (1, 30000)}),
]


@pytest.mark.parametrize(("family", "params"), _FAMILIES, ids=[f for f, _ in _FAMILIES])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 32), (32, 8), (16, 1), (8, 1)])
def test_no_capacity_exception_within_the_limits(device, family, params, hq, hkv):
    """Random trees of each family, several through one runtime sized for the largest: every one
    plans, and the small capacities (a quarter of the default partial rows) force the bounded plan
    on some, which still fits."""
    trees = [sample_tree(family, seed, **params) for seed in range(3)]
    q = max(t.n_queries for t in trees)
    e = max(_context(t) for t in trees)
    for partial_rows in (None, max(q + 1, 4 * q)):
        rt = TreeAttentionRuntime(
            None, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype=torch.float16, device=device,
            max_queries=q, max_kv_entries=e, max_partial_rows=partial_rows, max_variants=4,
        )  # fmt: skip
        for tree in trees:
            up = rt.plan(tree)
            plan = up.plan
            assert plan.n_partial_rows <= rt.max_partial_rows and plan.n_units <= rt.max_units
            assert plan.pair_query.size <= rt.max_pairs and plan.kv_indices.size <= rt.kv_capacity


@pytest.mark.parametrize("seed", range(12))
def test_bounded_plan_fits_any_capacities_at_the_limits(device, seed):
    """The bound of bounded_plan's docstring, on random forests and capacities drawn down to their
    minimum (max_units = max_pairs = max_queries): the plan fits and covers every query's context."""
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, max_nodes=30, max_len=400)
    q = tree.n_queries + int(rng.integers(0, 4))
    low = int(rng.integers(q, 3 * q + 2))
    rt = TreeAttentionRuntime(
        None, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float16, device=device, max_queries=q,
        max_kv_entries=max(1, _context(tree)), max_units=low, max_pairs=max(q, low - int(rng.integers(0, 2))),
        max_partial_rows=int(rng.integers(1, 3 * q + 2)),
    )  # fmt: skip
    plan = rt.bounded_plan(tree)
    assert plan.n_units <= rt.max_units and plan.pair_query.size <= rt.max_pairs
    assert plan.n_partial_rows <= rt.max_partial_rows and plan.kv_indices.size == _context(tree)
    up = rt.plan(tree)  # the planner's own plan, or the bounded one when that is over a capacity
    assert up.plan.n_units <= rt.max_units


def test_bounded_plan_is_correct(device):
    """A step served by the bounded plan (tiny partial-row capacity) equals the float64 reference."""
    rng = np.random.default_rng(3)
    tree = random_tree(rng, max_nodes=12, max_len=150)
    rt = TreeAttentionRuntime(
        None, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float16, device=device,
        max_queries=tree.n_queries, max_kv_entries=_context(tree), max_partial_rows=tree.n_queries + 1,
        max_units=tree.n_queries + 1, max_pairs=tree.n_queries + 1, pool_slots=tree.max_slot + 1,
    )  # fmt: skip
    up = rt.plan(tree)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tree.n_queries, 4, 16, generator=gen).to(device, torch.float16)
    k = torch.randn(tree.max_slot + 1, 2, 16, generator=gen).to(device, torch.float16)
    v = torch.randn(tree.max_slot + 1, 2, 16, generator=gen).to(device, torch.float16)
    out = rt.forward(q, k, v, out=torch.full_like(q, float("nan")))
    assert ft.max_relative_error(out, ft.reference_attention(q, k, v, tree)) < 2e-3
    assert up.bounded or up.plan.n_units <= tree.n_queries + 1


def test_outside_the_limits_the_error_names_them(device):
    tree = sample_tree("multi_document", 16, n_documents=2, doc_tokens=(30000, 30000), questions_per_doc=(8, 8))
    rt = TreeAttentionRuntime(
        None, num_q_heads=16, num_kv_heads=1, head_dim=128, dtype=torch.float16, device=device,
        max_queries=tree.n_queries, max_kv_entries=tree.num_tokens, max_partial_rows=tree.n_queries + 1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="max_kv_entries") as err:
        rt.plan(tree)
    assert isinstance(err.value.__cause__, CapacityError)
    with pytest.raises(ValueError, match="max_units=3 is below max_queries=4"):
        TreeAttentionRuntime(
            None, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float16, device=device, max_queries=4,
            max_kv_entries=64, max_units=3,
        )  # fmt: skip


def test_capacities_helper():
    assert TreeAttentionRuntime.capacities(max_queries=256, max_context_tokens=32768) == {
        "max_queries": 256,
        "max_kv_entries": 256 * 32768,
    }
    with pytest.raises(ValueError, match="max_context_tokens"):
        TreeAttentionRuntime.capacities(max_queries=4, max_context_tokens=0)


def _suite_cases():
    from fasttree.toolkit.family_suite import FAMILY_CASES, family_tree
    from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE

    for case in PAPER_SUITE:
        for heads, (hq, hkv) in PAPER_HEADS.items():
            yield f"paper {case} {heads}", (lambda c=case: paper_tree(c)), hq, hkv, 128
    for fc in FAMILY_CASES:
        yield fc.name, (lambda fc=fc: family_tree(fc)), fc.heads[0], fc.heads[1], fc.head_dim


@pytest.mark.slow
def test_sized_at_its_context_the_runtime_serves_tree_attentions_plan():
    """Every tree of the paper and families suites, through a runtime sized at its queries and
    context entries (as the kernel benchmark sizes it): the launch variants get the plan
    ``ft.plan`` makes (never the bounded fallback), so their time compares with tree_attention's."""
    from fasttree.runtime_planning import plan_for_runtime

    for name, make, hq, hkv, d in _suite_cases():
        tree = make()
        rt = _runtime("cpu", tree, hq, hkv, d)
        plan = ft.plan(tree, ft.FastTreeConfig(), num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        assert plan.kv_indices.size <= rt.kv_capacity, name
        assert plan.n_partial_rows <= rt.max_partial_rows and plan.n_units <= rt.max_units, name
        assert plan.pair_query.size <= rt.max_pairs, name
        served, _ = plan_for_runtime(
            tree, ft.FastTreeConfig(), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
            stage1_launches=rt.stage1_launches, query_centric=rt.query_centric, rules=rt._rules,
        )  # fmt: skip
        assert np.array_equal(served.kv_indices, plan.kv_indices), name


def test_small_batches_plan_within_the_default_capacities(device):
    """A runtime sized at a small batch's queries and context entries, other capacities at their
    defaults, serves the batch's own plan (no retry, no bounded plan): two questions on an 8k-token
    document at 16/1 D 128 (about 137 partial rows, as many as their context over 64) and a drawn
    20-query few-shot tree at 16/2 D 256 (822)."""
    cases = [
        (ft.KVTree.from_lengths([-1, 0, 0], [8000, 700, 750], [1, 2]), (16, 1, 128)),
        (sample_tree("few_shot", 72078), (16, 2, 256)),
    ]
    for tree, (hq, hkv, d) in cases:
        rt = _runtime(device, tree, hq, hkv, d)
        own = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        assert own.n_partial_rows > 16 * tree.n_queries + -(-_context(tree) // 256)  # beyond the other terms
        up = rt.plan(tree)
        assert not up.bounded and up.plan.n_units == own.n_units
        assert np.array_equal(up.plan.kv_indices, own.kv_indices)


def test_a_plan_just_over_a_capacity_keeps_most_of_its_chunks(device):
    """A drawn few-shot tree at 16/2 D 256 needs 822 partial rows; in a runtime holding 819, the
    runtime serves its plan at 1.5x the KV split sizes (the smallest retry that fits, 114 units),
    not at 4x (fewer chunks per group, the plan 0.78x as fast on an H200)."""
    tree = sample_tree("few_shot", 72078)
    heads = {"num_q_heads": 16, "num_kv_heads": 2, "head_dim": 256}
    rt = _runtime(device, tree, 16, 2, 256, max_partial_rows=819)
    own = ft.plan(tree, **heads)
    assert own.n_partial_rows > rt.max_partial_rows  # the premise
    up = rt.plan(tree)
    wider = ft.FastTreeConfig(kv_split_sizes=(1536, 192))
    want = ft.plan(tree, wider, **heads, rules=ft.PlanRules().with_(crossover_margin=0.0))
    assert not up.bounded and np.array_equal(up.plan.kv_indices, want.kv_indices)
    assert up.plan.n_partial_rows <= rt.max_partial_rows
    assert up.plan.config.kv_split_sizes == (1536, 192)


def test_bounded_plan_chunks_no_finer_than_query_separated_decode(device):
    """With room to spare, the bounded plan cuts contexts as query-separated decode does (not into
    the smallest chunks the capacities allow: 64-token chunks of 2k-token requests ran 1.8x slower)."""
    tree = sample_tree("no_sharing", 5, n_requests=64, context_tokens=(1000, 30000))
    rt = _runtime(device, tree, 28, 4)
    own = ft.plan_query_separated(tree, num_q_heads=28, num_kv_heads=4, head_dim=128, num_sms=rt._sm_count)
    bounded = rt.bounded_plan(tree)
    assert bounded.n_units <= own.n_units and bounded.n_units <= rt.max_units
    assert bounded.config.kv_split_sizes[0] >= own.config.kv_split_sizes[0]
