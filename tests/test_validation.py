"""Every ``ValueError`` fasttree raises on bad user input: type and message.

Tree and planner checks are pure numpy; the ``tree_attention`` checks use small CPU
fp16 tensors (the kernels run under the Triton interpreter, see ``conftest.py``).
"""

import math

import numpy as np
import pytest
import torch

import fasttree as ft
import fasttree.attention as attention
from fasttree.plan_arrays import check_heads
from fasttree.toolkit.suite import paper_tree

# ----------------------------------------------------------------------------- KVTree


@pytest.mark.parametrize(
    ("build", "match"),
    [
        pytest.param(lambda: ft.KVTree([], [], [0]), "at least one node", id="empty-tree"),
        pytest.param(lambda: ft.KVTree.from_lengths([], [], [0]), "at least one node", id="empty-tree-from-lengths"),
        pytest.param(lambda: ft.KVTree([-1], [[0]], []), "at least one query", id="no-queries"),
        pytest.param(lambda: ft.KVTree.from_lengths([-1], [2], []), "at least one query", id="no-queries-from-lengths"),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, -2], [1, 1], [0]),
            r"parents\[1\] = -2 is out of range",
            id="parent-below-minus-one",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 2], [1, 1], [0]),
            r"parents\[1\] = 2 is out of range",
            id="parent-equal-to-n",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 7], [1, 1], [0]),
            r"parents\[1\] = 7 is out of range",
            id="parent-above-n",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 1], [1, 1], [0]), "node 1 is its own parent", id="self-parent"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([1, 0], [1, 1], [0]), "contain a cycle", id="two-cycle-without-root"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0, 3, 2], [1, 1, 1, 1], [1]),
            "contain a cycle",
            id="two-cycle-beside-a-valid-tree",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0, 4, 2, 3, 1], [1] * 6, [1, 5]),
            r"contain a cycle \(node [234] never reaches a root\)",
            id="three-cycle-unreachable-from-root",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 2, 3, 1, 1], [1] * 5, [0]),
            "contain a cycle",
            id="cycle-with-tail",
        ),
        pytest.param(lambda: ft.KVTree([-1], [[0, -1, 2]], [0]), r"negative slot id \(-1\)", id="negative-slot"),
        pytest.param(lambda: ft.KVTree([-1], [[2**31]], [0]), "slot id 2147483648, beyond the int32", id="slot-2**31"),
        pytest.param(
            lambda: ft.KVTree([-1], [[2**40]], [0]), "slot id 1099511627776, beyond the int32", id="slot-2**40"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0], [1, 1], [0, -1]),
            r"query_nodes\[1\] = -1 is out of range \[0, 2\)",
            id="query-node-negative",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0], [1, 1], [2]),
            r"query_nodes\[0\] = 2 is out of range \[0, 2\)",
            id="query-node-too-big",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0, -1], [3, 0, 0], [1, 2]),
            r"query 1 \(at node 2\) has an empty context",
            id="query-on-empty-root",
        ),
        pytest.param(
            lambda: ft.KVTree([-1, 0], [[], []], [1]),
            r"query 0 \(at node 1\) has an empty context",
            id="query-on-empty-path",
        ),
        pytest.param(
            lambda: ft.KVTree([-1, 0], [[0]], [0]),
            "node_slots has 1 entries but parents has 2 nodes",
            id="node-slots-count-mismatch",
        ),
        pytest.param(lambda: ft.KVTree([-1.0, 0.0], [[0], [1]], [1]), "parents must hold integers", id="float-parents"),
        pytest.param(
            lambda: ft.KVTree([True, False], [[0], [1]], [1]), "parents must hold integers", id="bool-parents"
        ),
        pytest.param(
            lambda: ft.KVTree([-1, 0], [[0], [1.5]], [1]), r"node_slots\[1\] must hold integers", id="float-slots"
        ),
        pytest.param(
            lambda: ft.KVTree([-1, 0], [[0], [1]], [1.0]), "query_nodes must hold integers", id="float-query-nodes"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0], [1.0, 2.0], [1]), "lengths must hold integers", id="float-lengths"
        ),
        pytest.param(
            lambda: ft.KVTree([[-1, 0]], [[0], [1]], [1]), "parents must be a 1-D integer array", id="2d-parents"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([[-1], [0]], [1, 1], [1]),
            "parents must be a 1-D integer array",
            id="2d-parents-from-lengths",
        ),
        pytest.param(
            lambda: ft.KVTree([-1], [[[0, 1]]], [0]), r"node_slots\[0\] must be a 1-D integer array", id="2d-slots"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1], [1], 0), "query_nodes must be a 1-D integer array", id="0d-queries"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0], [2, -1], [1]), r"lengths\[1\] = -1 is negative", id="neg-length"
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0], [2], [1]),
            "lengths has 1 entries but parents has 2 nodes",
            id="lengths-count-mismatch",
        ),
        pytest.param(
            lambda: ft.KVTree.from_lengths([-1, 0], [2**31, 1], [1]),
            "more than a 2\\*\\*31 slot pool",
            id="too-many-tokens",
        ),
        pytest.param(lambda: ft.KVTree.from_levels([], []), "must be non-empty and of equal length", id="levels-empty"),
        pytest.param(
            lambda: ft.KVTree.from_levels([1, 2], [8]), "must be non-empty and of equal length", id="levels-mismatch"
        ),
        pytest.param(
            lambda: ft.KVTree.from_levels([1, 0, 4], [8, 8, 8]),
            r"every level needs at least one node, got \[1, 0, 4\]",
            id="levels-zero-nodes",
        ),
        pytest.param(
            lambda: ft.KVTree.from_levels([1, 2], [8, -1]), r"lengths\[1\] = -1 is negative", id="levels-neg-tokens"
        ),
        pytest.param(lambda: ft.KVTree.from_levels([1, 2], [0, 0]), "has an empty context", id="levels-no-tokens"),
    ],
)
def test_kvtree_rejects(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_kvtree_accepts_the_boundaries_of_the_rejected_inputs():
    # the largest int32 slot, an internal query and an empty node under a non-empty one are fine
    tree = ft.KVTree([-1, 0, 0], [[2**31 - 1], [], [5]], [0, 1, 2])
    assert tree.max_slot == 2**31 - 1
    assert tree.path_lengths.tolist() == [1, 1, 2]


@pytest.mark.parametrize("case", [0, 16, "1"])
def test_paper_tree_rejects_unknown_case(case):
    with pytest.raises(ValueError, match=r"paper-suite case must be one of 1\.\.15"):
        paper_tree(case)


# ---------------------------------------------------------------------- heads / plan


@pytest.fixture
def tree() -> ft.KVTree:
    """Root of 4 tokens, two children of 3 and 2 tokens each carrying one query; max slot 8."""
    return ft.KVTree.from_lengths([-1, 0, 0], [4, 3, 2], [1, 2])


@pytest.mark.parametrize(
    ("heads", "match"),
    [
        pytest.param((6, 4, 64), r"num_q_heads \(6\) must be a multiple of num_kv_heads \(4\)", id="hq-not-multiple"),
        pytest.param((2, 4, 64), r"num_q_heads \(2\) must be a multiple", id="hq-below-hkv"),
        pytest.param((0, 1, 64), "num_q_heads must be a positive integer, got 0", id="zero-q-heads"),
        pytest.param((-4, 2, 64), "num_q_heads must be a positive integer, got -4", id="negative-q-heads"),
        pytest.param((4, 0, 64), "num_kv_heads must be a positive integer, got 0", id="zero-kv-heads"),
        pytest.param((4, -2, 64), "num_kv_heads must be a positive integer, got -2", id="negative-kv-heads"),
        pytest.param((4.0, 2, 64), "num_q_heads must be a positive integer, got 4.0", id="float-q-heads"),
        pytest.param((4, True, 64), "num_kv_heads must be a positive integer, got True", id="bool-kv-heads"),
        pytest.param((4, 2, 0), "head_dim must be a positive integer, got 0", id="zero-head-dim"),
        pytest.param((4, 2, 15), r"head_dim must be in \[16, 256\], got 15", id="head-dim-15"),
        pytest.param((4, 2, 8), r"head_dim must be in \[16, 256\], got 8", id="head-dim-8"),
        pytest.param((4, 2, 257), r"head_dim must be in \[16, 256\], got 257", id="head-dim-257"),
        pytest.param((4, 2, 512), r"head_dim must be in \[16, 256\], got 512", id="head-dim-512"),
    ],
)
def test_plan_rejects_bad_heads(tree, heads, match):
    hq, hkv, d = heads
    with pytest.raises(ValueError, match=match):
        check_heads(hq, hkv, d)
    with pytest.raises(ValueError, match=match):
        ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    with pytest.raises(ValueError, match=match):
        ft.plan_query_separated(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)


@pytest.mark.parametrize("heads", [(4, 4, 16), (32, 8, 128), (16, 1, 256), (np.int64(8), np.int64(2), np.int64(64))])
def test_check_heads_accepts_valid_heads(heads):
    hq, hkv, d = heads
    assert check_heads(hq, hkv, d) == hq // hkv


@pytest.mark.parametrize("not_a_tree", [None, [-1, 0], "tree"])
def test_plan_rejects_non_kvtree(not_a_tree):
    with pytest.raises(ValueError, match="plan\\(\\) needs a KVTree"):
        ft.plan(not_a_tree, num_q_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("not_a_config", [{}, "config", ft.FastTreeConfig().to_dict()])
def test_plan_rejects_non_config(tree, not_a_config):
    with pytest.raises(ValueError, match="config must be a FastTreeConfig or a Portfolio, got"):
        ft.plan(tree, not_a_config, num_q_heads=4, num_kv_heads=2, head_dim=16)


def test_plan_rejects_query_tile_over_256_rows(tree):
    config = ft.FastTreeConfig(q_tile_queries=(64, 16))
    with pytest.raises(ValueError, match="64 queries x GQA group size 16 = 1024 rows exceeds the kernel limit of 256"):
        ft.plan(tree, config, num_q_heads=16, num_kv_heads=1, head_dim=16)


def test_plan_rejects_default_tile_when_group_exceeds_256_rows(tree):
    # with the default tiles a group of 512 heads still needs 512 rows for a single query
    with pytest.raises(ValueError, match="1 queries x GQA group size 512 = 512 rows"):
        ft.plan(tree, num_q_heads=512, num_kv_heads=1, head_dim=16)


def test_plan_query_separated_rejects_nonpositive_split(tree):
    for split in (0, -128):
        with pytest.raises(ValueError, match=f"kv_split_size must be >= 1, got {split}"):
            ft.plan_query_separated(tree, num_q_heads=4, num_kv_heads=2, head_dim=16, kv_split_size=split)


# ---------------------------------------------------------------------- tree_attention

HQ, HKV, D, POOL = 4, 2, 16, 9


@pytest.fixture
def plan(tree) -> ft.Plan:
    return ft.plan(tree, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)


@pytest.fixture
def inputs(tree, plan) -> dict:
    """Valid keyword arguments of ``tree_attention`` for the fixture tree (pool of exactly 9 slots)."""
    assert plan.max_slot == POOL - 1
    gen = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(tree.n_queries, HQ, D, generator=gen).half(),
        "k_cache": torch.randn(POOL, HKV, D, generator=gen).half(),
        "v_cache": torch.randn(POOL, HKV, D, generator=gen).half(),
        "plan": plan,
    }


def test_valid_inputs_match_the_reference(tree, inputs):
    out = ft.tree_attention(**inputs)
    ref = ft.reference_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], tree)
    assert out.shape == (tree.n_queries, HQ, D)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def _replace(key, make):
    """Case transform: ``kw[key] = make(kw)``."""

    def apply(kw):
        kw[key] = make(kw)

    return apply


def _non_contiguous_last_dim(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2
    return view


# (case id, transform of the valid kwargs, expected message)
BAD_ATTENTION_INPUTS = [
    ("q-2d", _replace("q", lambda kw: kw["q"].reshape(-1, D)), r"q must be 3-D, got shape \(8, 16\)"),
    ("q-4d", _replace("q", lambda kw: kw["q"][None]), r"q must be 3-D, got shape \(1, 2, 4, 16\)"),
    ("k-2d", _replace("k_cache", lambda kw: kw["k_cache"][:, 0]), "k_cache must be 3-D"),
    ("q-not-tensor", _replace("q", lambda kw: kw["q"].numpy()), r"q must be a torch\.Tensor, got ndarray"),
    ("v-not-tensor", _replace("v_cache", lambda kw: None), r"v_cache must be a torch\.Tensor, got NoneType"),
    ("q-float32", _replace("q", lambda kw: kw["q"].float()), "q must be float16 or bfloat16, got torch.float32"),
    (
        "all-float32",
        lambda kw: kw.update({k: kw[k].float() for k in ("q", "k_cache", "v_cache")}),
        "q must be float16 or bfloat16",
    ),
    ("k-float32", _replace("k_cache", lambda kw: kw["k_cache"].float()), "k_cache must be float16 or bfloat16"),
    ("v-int8", _replace("v_cache", lambda kw: kw["v_cache"].to(torch.int8)), "v_cache must be float16 or bfloat16"),
    ("v-bf16-vs-fp16", _replace("v_cache", lambda kw: kw["v_cache"].bfloat16()), "dtypes differ"),
    ("k-bf16-vs-fp16", _replace("k_cache", lambda kw: kw["k_cache"].bfloat16()), "dtypes differ"),
    (
        "kv-bf16-vs-q-fp16",
        lambda kw: kw.update(k_cache=kw["k_cache"].bfloat16(), v_cache=kw["v_cache"].bfloat16()),
        "dtypes differ: q torch.float16",
    ),
    ("k-on-other-device", _replace("k_cache", lambda kw: kw["k_cache"].to("meta")), "devices differ"),
    ("q-too-many-queries", _replace("q", lambda kw: torch.cat([kw["q"], kw["q"]])), r"q has shape \(4, 4, 16\)"),
    ("q-too-few-queries", _replace("q", lambda kw: kw["q"][:1]), r"but the plan expects \[n_queries=2, Hq=4, D=16\]"),
    ("q-wrong-heads", _replace("q", lambda kw: kw["q"][:, :2]), r"q has shape \(2, 2, 16\) but the plan expects"),
    ("q-wrong-head-dim", _replace("q", lambda kw: torch.zeros(2, HQ, 32).half()), r"q has shape \(2, 4, 32\)"),
    (
        "kv-wrong-hkv",
        lambda kw: kw.update(k_cache=kw["k_cache"][:, :1], v_cache=kw["v_cache"][:, :1]),
        r"k_cache has shape \(9, 1, 16\) but the plan expects \[pool_slots, Hkv=2, D=16\]",
    ),
    (
        "kv-wrong-head-dim",
        lambda kw: kw.update(k_cache=torch.zeros(POOL, HKV, 32).half(), v_cache=torch.zeros(POOL, HKV, 32).half()),
        r"k_cache has shape \(9, 2, 32\) but the plan expects",
    ),
    (
        "k-v-shapes-differ",
        _replace("v_cache", lambda kw: torch.zeros(POOL + 1, HKV, D).half()),
        r"k_cache \(9, 2, 16\) and v_cache \(10, 2, 16\) shapes differ",
    ),
    (
        "pool-one-slot-short",
        lambda kw: kw.update(k_cache=kw["k_cache"][:-1], v_cache=kw["v_cache"][:-1]),
        "the tree reads pool slot 8 but the KV pool has only 8 slots",
    ),
    (
        "pool-empty",
        lambda kw: kw.update(k_cache=kw["k_cache"][:0], v_cache=kw["v_cache"][:0]),
        "the tree reads pool slot 8 but the KV pool has only 0 slots",
    ),
    ("q-strided-last-dim", _replace("q", lambda kw: _non_contiguous_last_dim(kw["q"])), "q must be contiguous"),
    (
        "k-strided-last-dim",
        _replace("k_cache", lambda kw: _non_contiguous_last_dim(kw["k_cache"])),
        "k_cache must be contiguous in its last",
    ),
    (
        "v-strided-last-dim",
        _replace("v_cache", lambda kw: _non_contiguous_last_dim(kw["v_cache"])),
        "v_cache must be contiguous in its last",
    ),
    ("sm-scale-zero", _replace("sm_scale", lambda kw: 0.0), "sm_scale must be a positive finite number, got 0.0"),
    ("sm-scale-int-zero", _replace("sm_scale", lambda kw: 0), "sm_scale must be a positive finite number, got 0"),
    ("sm-scale-negative", _replace("sm_scale", lambda kw: -0.25), "sm_scale must be a positive finite number"),
    ("sm-scale-nan", _replace("sm_scale", lambda kw: math.nan), "sm_scale must be a positive finite number, got nan"),
    ("sm-scale-inf", _replace("sm_scale", lambda kw: math.inf), "sm_scale must be a positive finite number, got inf"),
    ("sm-scale-neg-inf", _replace("sm_scale", lambda kw: -math.inf), "sm_scale must be a positive finite number"),
    ("sm-scale-string", _replace("sm_scale", lambda kw: "0.25"), "sm_scale must be a positive finite number"),
    ("sm-scale-tensor", _replace("sm_scale", lambda kw: torch.tensor(0.25)), "sm_scale must be a positive finite"),
    ("out-wrong-shape", _replace("out", lambda kw: torch.empty(2, HQ, 32).half()), r"out must match q \(\(2, 4, 16\)"),
    ("out-too-few-rows", _replace("out", lambda kw: torch.empty(1, HQ, D).half()), "out must match q"),
    ("out-float32", _replace("out", lambda kw: torch.empty(2, HQ, D)), "out must match q"),
    ("out-bf16", _replace("out", lambda kw: torch.empty(2, HQ, D).bfloat16()), "out must match q"),
    ("out-on-meta", _replace("out", lambda kw: torch.empty(2, HQ, D, device="meta").half()), "out must match q"),
    (
        "out-strided-last-dim",
        _replace("out", lambda kw: _non_contiguous_last_dim(torch.empty(2, HQ, D).half())),
        "with a contiguous last dim",
    ),
    ("plan-is-tree", _replace("plan", lambda kw: ft.KVTree.from_lengths([-1], [1], [0])), "got KVTree"),
    ("plan-is-none", _replace("plan", lambda kw: None), "plan must be a fasttree Plan, got NoneType"),
    ("plan-is-config", _replace("plan", lambda kw: ft.FastTreeConfig()), "plan must be a fasttree Plan"),
    ("plan-on-other-device", _replace("plan", lambda kw: kw["plan"].to("meta")), "uploaded to meta but the tensors"),
]


@pytest.mark.parametrize(("mutate", "match"), [pytest.param(m, msg, id=name) for name, m, msg in BAD_ATTENTION_INPUTS])
def test_tree_attention_rejects(inputs, mutate, match):
    mutate(inputs)
    with pytest.raises(ValueError, match=match):
        ft.tree_attention(**inputs)


def test_tree_attention_accepts_the_valid_variants_of_rejected_inputs(tree, inputs):
    # a bigger pool, a bf16 batch, a strided (but last-dim contiguous) q, an explicit out and scale
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(HQ, tree.n_queries, D, generator=gen).bfloat16().transpose(0, 1)
    k = torch.randn(POOL + 7, HKV, D, generator=gen).bfloat16()
    v = torch.randn(POOL + 7, HKV, D, generator=gen).bfloat16()
    out = torch.full((tree.n_queries, HQ, D), math.nan).bfloat16()
    got = ft.tree_attention(q, k, v, inputs["plan"].to(q.device), 0.3, out=out)
    assert got is out
    ref = ft.reference_attention(q, k, v, tree, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_tree_attention_needs_cuda_outside_the_interpreter(inputs, monkeypatch):
    monkeypatch.setattr(attention, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="tree attention needs a CUDA device"):
        ft.tree_attention(**inputs)


# ------------------------------------------------------------------ no launch on errors


class _NoLaunch:
    """Stands in for a Triton kernel; any launch (``kernel[grid]``) fails the test."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid):
        pytest.fail(f"{self.name} launched with grid {grid}")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(attention, "tree_attention_units_kernel", _NoLaunch("tree_attention_units_kernel"))
    monkeypatch.setattr(attention, "merge_partials_kernel", _NoLaunch("merge_partials_kernel"))
    monkeypatch.setattr(attention, "merge_many_partials_kernel", _NoLaunch("merge_many_partials_kernel"))
    # the fakes are not InterpretedFunctions; keep the CPU tensors acceptable
    monkeypatch.setattr(attention, "interpreting", lambda: True)


def test_no_launch_fixture_catches_a_launch(inputs, no_launch):
    with pytest.raises(pytest.fail.Exception, match="tree_attention_units_kernel launched"):
        ft.tree_attention(**inputs)


@pytest.mark.parametrize(
    "case", ["pool-one-slot-short", "pool-empty", "sm-scale-nan", "out-float32", "kv-wrong-hkv", "plan-on-other-device"]
)
def test_errors_are_raised_before_any_kernel_launch(inputs, no_launch, case):
    (mutate, match) = next((m, msg) for name, m, msg in BAD_ATTENTION_INPUTS if name == case)
    mutate(inputs)
    with pytest.raises(ValueError, match=match):
        ft.tree_attention(**inputs)


def test_out_of_pool_slot_is_an_error_before_launch_with_a_sparse_tree(no_launch):
    # slots far apart: the max slot, not the token count, must bound the pool
    tree = ft.KVTree([-1, 0], [[0, 1], [1000]], [1])
    plan = ft.plan(tree, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    q = torch.zeros(1, HQ, D).half()
    kv = torch.zeros(1000, HKV, D).half()
    with pytest.raises(ValueError, match="the tree reads pool slot 1000 but the KV pool has only 1000 slots"):
        ft.tree_attention(q, kv, kv, plan)


# ------------------------------------------------------------ query_separated_attention


def test_query_separated_attention_rejects_non_3d_tensors(tree, inputs):
    q, k, v = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    with pytest.raises(ValueError, match=r"q must be a 3-D torch\.Tensor"):
        ft.query_separated_attention(q.reshape(-1, D), k, v, tree)
    with pytest.raises(ValueError, match=r"k_cache must be a 3-D torch\.Tensor"):
        ft.query_separated_attention(q, k.numpy(), v, tree)


def test_query_separated_attention_rejects_bad_split(tree, inputs):
    q, k, v = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    with pytest.raises(ValueError, match="kv_split_size must be >= 1, got 0"):
        ft.query_separated_attention(q, k, v, tree, kv_split_size=0)


def test_query_separated_attention_rejects_bad_heads(tree, inputs):
    q = inputs["q"]
    kv = torch.zeros(POOL, 3, D).half()
    with pytest.raises(ValueError, match=r"num_q_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        ft.query_separated_attention(q, kv, kv, tree)


def test_query_separated_attention_rejects_small_pool(tree, inputs, no_launch):
    q, k, v = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    with pytest.raises(ValueError, match="the tree reads pool slot 8 but the KV pool has only 8 slots"):
        ft.query_separated_attention(q, k[:-1], v[:-1], tree)


def test_tree_attention_rejects_bool_scale_and_non_tensor_out(inputs):
    with pytest.raises(ValueError, match="sm_scale"):
        ft.tree_attention(**{**inputs, "sm_scale": True})
    with pytest.raises(ValueError, match=r"out must be a torch\.Tensor"):
        ft.tree_attention(**inputs, out=5)


def test_numpy_float_scales_are_accepted(tree, inputs):
    out = ft.tree_attention(**{**inputs, "sm_scale": np.float32(0.25)})
    ref = ft.reference_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], tree, 0.25)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    assert ft.FastTreeConfig(alpha=np.float32(0.5)).alpha == 0.5


@pytest.mark.parametrize("text", ["[1, 2]", "null", ""])
def test_from_json_text_that_is_not_an_object_is_a_value_error(text):
    with pytest.raises(ValueError, match="JSON"):
        ft.FastTreeConfig.from_json(text)


def test_unsigned_slots_beyond_int64_are_named():
    with pytest.raises(ValueError, match="beyond the int64 range"):
        ft.KVTree([-1], [np.array([2**64 - 1], dtype=np.uint64)], [0])


def test_query_separated_plan_rejects_more_than_256_rows(tree):
    with pytest.raises(ValueError, match="rows"):
        ft.plan_query_separated(tree, num_q_heads=512, num_kv_heads=1, head_dim=64)
