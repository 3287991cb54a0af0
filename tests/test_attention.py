"""Kernels against the float64 reference on random trees (interpreter on the CPU, CUDA on the device).

Outputs are poisoned with NaN before each run; every element must be written and the
norm-wise relative error must stay within the dtype's bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from plan_checks import TREE_PLANS
from trees import random_tree

import fasttree as ft
from fasttree import attention, launch_rules, launcher
from fasttree.launch_rules import GpuTarget
from fasttree.plan_arrays import TileClass
from fasttree.toolkit.suite import paper_tree

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (GQA ratio, KV heads, head dim, dtype): GQA 1/4/7/16, D 64/128 (+256 and a padded 96)
SHAPES = [
    (1, 2, 64, torch.float16),
    (4, 1, 64, torch.bfloat16),
    (7, 1, 64, torch.float16),
    (16, 1, 64, torch.bfloat16),
    (4, 2, 128, torch.float16),
    (1, 1, 128, torch.bfloat16),
    (8, 1, 256, torch.float16),
    (2, 1, 96, torch.bfloat16),
]


def make_inputs(tree: ft.KVTree, hq: int, hkv: int, d: int, dtype, device, gen: torch.Generator):
    pool = tree.max_slot + 1 + int(torch.randint(0, 8, (1,), generator=gen))
    q = torch.randn(tree.n_queries, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(pool, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(pool, hkv, d, generator=gen).to(dtype).to(device)
    return q, k, v


def check_against_reference(out: torch.Tensor, q, k, v, tree: ft.KVTree, sm_scale=None) -> float:
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison survived)"
    ref = ft.reference_attention(q.cpu(), k.cpu(), v.cpu(), tree, sm_scale)
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err <= TOL[q.dtype], f"relative error {err:.2e} > {TOL[q.dtype]:.0e}"
    return err


#: Positions of ``OFFSETS_32``, ``PEEL`` and ``HEADS_FASTEST`` among a stage-1 launch's constexprs.
_OFFSETS_32, _PEEL, _HEADS_FASTEST = 7, 8, 9


def _h200_like(device) -> GpuTarget:
    """An H200's launch facts (132 SMs, sm_90), on the CPU interpreter as a target without PDL or
    register caps, so that the one-wave launch rules apply there too."""
    if torch.device(device).type == "cuda":
        return GpuTarget(cuda=True, major=9, sms=132)
    return GpuTarget(cuda=False, major=9, sms=132)


def _launches(plan, q, k, v, out, target=None) -> list[tuple]:
    """The launches :func:`fasttree.tree_attention` would make for these tensors with its default
    scale (``target``: the device's own by default)."""
    target = GpuTarget.of(q.device, launcher.interpreting()) if target is None else target
    qk_scale = attention.LOG2E / math.sqrt(plan.head_dim)
    return attention.plan_launches(plan, plan.to(q.device), q, k, v, out, qk_scale, target)


def _run(launches, *, constexpr=None, transpose_grid=False) -> torch.Tensor:
    """Run ``launches`` (from :func:`_launches`) with some stage-1 constexprs replaced
    (``constexpr``: position -> value) and, with ``transpose_grid``, the stage-1 grids' two
    dimensions swapped; returns their output tensor."""
    for kernel, grid, args, constexprs, warps, stages, maxnreg in launches:
        if kernel is attention.tree_attention_units_kernel:
            constexprs = tuple((constexpr or {}).get(i, c) for i, c in enumerate(constexprs))
            grid = grid[::-1] if transpose_grid else grid
        launcher.launch(kernel, grid, args, constexprs, warps, stages, maxnreg)
    return launches[0][2][3]  # a stage-1 launch's out


def run_poisoned(fn, q) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    result = fn(out)
    assert result.data_ptr() == out.data_ptr()
    return out


@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), SHAPES)
def test_tree_attention_matches_reference_on_random_forests(g, hkv, d, dtype, device):
    rng = np.random.default_rng(1000 * g + d + hkv)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    for _ in range(5):
        tree = random_tree(rng, max_nodes=20, max_len=300)
        cfg = ft.FastTreeConfig(
            gamma=float(rng.choice([0.1, -10.0, 10.0])),
            kv_split_sizes=(int(rng.choice([64, 1024])), int(rng.choice([16, 32]))),
            kv_tile=(int(rng.choice([16, 32, 64])), int(rng.choice([16, 32]))),
        )
        plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d)
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[4]])
def test_long_groups_left_whole_match_reference(g, hkv, d, dtype, device):
    # para_threshs1 of 1: every phase has enough units uncut, so groups longer than the big split
    # stay whole (long single units, fewer partials); random forests with internal-node queries
    rng = np.random.default_rng(300 + g + d)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    whole = 0
    for _ in range(6):
        tree = random_tree(rng, max_nodes=20, max_len=400)
        cfg = ft.FastTreeConfig(kv_split_sizes=(64, 16), para_threshs1=(1, 1), kv_tile=(16, 32))
        plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, rules=TREE_PLANS)
        whole += int(plan.unit_kv_len.max()) > 64
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)
    assert whole >= 2, "too few plans kept a group longer than the big split whole"


@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), SHAPES[:4])
def test_query_separated_attention_matches_reference(g, hkv, d, dtype, device):
    rng = np.random.default_rng(77 + g)
    gen = torch.Generator().manual_seed(5 + g)
    tree = random_tree(rng, max_nodes=10, max_len=100)
    q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
    out = ft.query_separated_attention(q, k, v, tree, kv_split_size=48)
    check_against_reference(out, q, k, v, tree)


def test_paper_case1_four_heads(device):
    tree = ft.KVTree.from_levels([1, 2, 64], [8, 256, 32])
    gen = torch.Generator().manual_seed(0)
    for hkv in (4, 1):
        plan = ft.plan(tree, num_q_heads=4, num_kv_heads=hkv, head_dim=64)
        q, k, v = make_inputs(tree, 4, hkv, 64, torch.float16, device, gen)
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)


def test_custom_scale_non_contiguous_pool_and_plan_reuse(device):
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(11)
    tree = random_tree(rng, max_nodes=8, max_len=64)
    plan = ft.plan(tree, num_q_heads=4, num_kv_heads=2, head_dim=64)
    # k/v as views into one [pool, 2, Hkv, D] buffer: strided in the slot dimension
    kv = torch.randn(tree.max_slot + 1, 2, 2, 64, generator=gen).half().to(device)
    k, v = kv[:, 0], kv[:, 1]
    for _ in range(2):  # the uploaded plan is cached and reused
        q = torch.randn(tree.n_queries, 4, 64, generator=gen).half().to(device)
        out = run_poisoned(lambda o, q=q: ft.tree_attention(q, k, v, plan, 0.3, out=o), q)
        check_against_reference(out, q, k, v, tree, 0.3)
    dev_plan = plan.to(device)
    assert plan.to(device) is dev_plan  # uploaded once, cached
    out2 = ft.tree_attention(q, k, v, dev_plan, 0.3)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_non_blocking_upload_gives_the_same_arrays_and_output(device):
    """``plan.to(device, non_blocking=True)`` (pinned copy on CUDA, a plain copy on the CPU) uploads
    the same arrays, cached like a blocking upload, and the call reading them is correct."""
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    tree = random_tree(rng, max_nodes=10, max_len=80)
    plan = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=64)
    other = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=64)
    dev = plan.to(device, non_blocking=True)
    assert plan.to(device) is dev  # cached: later calls do not copy again
    ref_dev = other.to(device)
    assert torch.equal(dev.buffer.cpu(), ref_dev.buffer.cpu()) and dev.buffer.device.type == device.type
    q, k, v = make_inputs(tree, 8, 2, 64, torch.float16, device, gen)
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, dev, out=o), q)
    check_against_reference(out, q, k, v, tree)


def test_single_token_contexts(device):
    # every query reads exactly one token: softmax of one element, output = v
    tree = ft.KVTree.from_lengths([-1, -1, -1], [1, 1, 1], [2, 0, 1, 1])
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_inputs(tree, 8, 2, 64, torch.float16, device, gen)
    out = ft.tree_attention(q, k, v, ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=64))
    slots = tree.slots[tree.query_nodes].astype(np.int64)
    want = v.cpu()[slots].repeat_interleave(4, dim=1)
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize(("chain", "dtype"), [(40, torch.float16), (70, torch.bfloat16)])
def test_queries_with_dozens_of_partials(chain, dtype, device):
    # a chain of short nodes, a query at each, kept apart (no edge concatenated): the leaf
    # query gets one partial per node, more than one merge step's worth; the others fewer
    parents = [-1, *range(chain - 1)]
    lengths = [int(x) for x in np.random.default_rng(chain).integers(1, 40, chain)]
    queries = [*range(chain), chain - 1]
    tree = ft.KVTree.from_lengths(parents, lengths, queries)
    config = ft.FastTreeConfig(alpha=0.0, beta=0.0, gamma=-10.0, pack_tokens=0)  # padding free: only gamma decides
    plan = ft.plan(tree, config, num_q_heads=4, num_kv_heads=2, head_dim=64)
    assert int(plan.query_num_partials.max()) >= chain
    gen = torch.Generator().manual_seed(chain)
    q, k, v = make_inputs(tree, 4, 2, 64, dtype, device, gen)
    launches = _launches(plan, q, k, v, q)
    assert launches[-1][0] is attention.merge_many_partials_kernel
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize("most", [2, 6, 7, 12])
def test_merge_kernel_is_chosen_by_the_most_partials_of_a_query(most):
    # a chain of `most` nodes with one query at its leaf and one at its root, kept apart
    tree = ft.KVTree.from_lengths([-1, *range(most - 1)], [20] * most, [most - 1, 0])
    config = ft.FastTreeConfig(alpha=0.0, beta=0.0, gamma=-10.0, pack_tokens=0)
    plan = ft.plan(tree, config, num_q_heads=8, num_kv_heads=2, head_dim=64, rules=TREE_PLANS)
    assert launch_rules.merge_max_partials(plan) == most
    q = torch.empty(2, 8, 64, dtype=torch.float16)
    launches = _launches(plan, q, q, q, q)
    many = most >= launch_rules.MANY_PARTIALS
    assert launches[-1][0] is (attention.merge_many_partials_kernel if many else attention.merge_partials_kernel)
    assert launch_rules.merge_heads_per_program(plan) == (1 if many else 4)


def test_launch_cache_key_tells_specialisations_apart():
    from fasttree.launcher import _arg_spec

    a16 = torch.empty(64, dtype=torch.float16)
    b16 = torch.empty(64, dtype=torch.bfloat16)
    assert _arg_spec(a16) != _arg_spec(b16)  # same alignment, other element type
    assert _arg_spec(a16) != _arg_spec(a16[1:])  # 2-byte offset breaks 16-byte alignment
    assert _arg_spec(1) != _arg_spec(17)  # Triton turns 1 into a constant
    assert _arg_spec(16) != _arg_spec(17)  # and tracks divisibility by 16
    assert _arg_spec(2**31) != _arg_spec(2**31 - 16)  # and 64-bit width
    assert _arg_spec(32) == _arg_spec(48)


# GQA 1/4/7/16 and D 64/128/256: packed (masked) small units, forced on with pack_min_units=0
@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), [*SHAPES[:4], SHAPES[6]])
def test_packed_units_match_reference(g, hkv, d, dtype, device):
    rng = np.random.default_rng(500 + 10 * g + d)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    packed = 0
    for _ in range(4):
        tree = random_tree(rng, max_nodes=30, max_len=40)
        cfg = ft.FastTreeConfig(
            pack_tokens=int(rng.choice([16, 40, 256])),
            pack_min_units=0,
            q_tile_queries=(int(rng.choice([8, 16])), int(rng.choice([1, 2, 4]))),
            kv_tile=(16, int(rng.choice([16, 32]))),
            kv_split_sizes=(64, int(rng.choice([8, 32]))),
            gamma=float(rng.choice([0.1, -10.0])),
        )
        plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, rules=TREE_PLANS)
        packed += plan.tile_classes[1].masked
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)
    assert packed >= 2, "too few of the random plans packed units; the test would not cover the masked path"


@pytest.mark.parametrize(("g", "hkv", "q_tiles"), [(4, 2, None), (1, 1, (32, 8)), (16, 1, None)])
def test_packed_units_in_both_tile_classes(g, hkv, q_tiles, device):
    # internal-node queries and three levels of short nodes: bins fill large and small tiles
    rng = np.random.default_rng(g + 100 * hkv)
    gen = torch.Generator().manual_seed(g)
    parents = [-1, -1, 0, 0, 0, 1, 1, 1, *rng.integers(2, 8, size=40)]
    lengths = [20, 9, *rng.integers(1, 24, size=46)]
    queries = [*range(8, 48), 2, 5, 5, 0]
    tree = ft.KVTree.from_lengths(parents, lengths, queries)
    cfg = ft.FastTreeConfig(
        q_tile_queries=q_tiles, pack_tokens=64, pack_min_units=0, kv_tile=(16, 16), para_threshs1=(0, 0)
    )
    tree_plan = TREE_PLANS.with_(crossover_margin=0.0)  # this small forest costs more than decode at GQA 16
    plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=64, rules=tree_plan)
    assert plan.tile_classes[0].masked
    assert plan.tile_classes[1].masked or g == 16  # GQA 16: one query fills a small tile
    q, k, v = make_inputs(tree, g * hkv, hkv, 64, torch.float16, device, gen)
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    check_against_reference(out, q, k, v, tree)


def test_packed_unit_of_32_queries_uses_the_mask_sign_bit(device):
    # a root shared by 64 one-query leaves, 32-row tiles: each packed unit holds 32 queries, so
    # the last one's bit is the int32 sign bit (the kernel's shift must keep it)
    tree = ft.KVTree.from_lengths([-1] + [0] * 64, [10] + [4] * 64, list(range(1, 65)))
    cfg = ft.FastTreeConfig(
        q_tile_queries=(32, 8), pack_tokens=512, pack_min_units=0, kv_tile=(16, 16), para_threshs1=(0, 0)
    )
    plan = ft.plan(tree, cfg, num_q_heads=2, num_kv_heads=2, head_dim=32, rules=TREE_PLANS)
    assert plan.tile_classes[0].masked and plan.unit_q_len.max() == 32
    assert (plan.kv_row_mask == np.int32(-(2**31))).any()  # bit 31 alone: the 32nd query's leaf
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_inputs(tree, 2, 2, 32, torch.bfloat16, device, gen)
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, 128, 16, 4, 512, 132), 128),  # 2 waves at 3 programs per SM, 1 at 4
        ((1, 128, 16, 4, 384, 132), None),  # one wave either way
        ((1, 128, 16, 4, 2048, 132), 128),  # 6 -> 4 waves
        ((1, 128, 16, 4, 10240, 132), None),  # 26 waves: the tail is small
        ((4, 128, 16, 4, 512, 132), None),  # GQA: several heads per query
        ((1, 256, 16, 4, 512, 132), None),  # head dim 256 needs its registers
        ((1, 128, 64, 4, 512, 132), None),  # large tiles
        ((1, 128, 16, 2, 512, 132), None),  # other warps: the counts do not apply
        ((1, 128, 16, 4, 512, 0), None),  # no GPU
    ],
)
def test_small_tile_register_cap_only_where_it_saves_a_wave(args, expected):
    assert launch_rules.small_tile_maxnreg(*args) == expected


def _tile(block_m=16, block_n=64, num_warps=4, num_stages=3):
    return TileClass(queries=1, block_m=block_m, block_n=block_n, split=128, num_warps=num_warps,
                     num_stages=num_stages)  # fmt: skip


_LONG = np.full(40, 288, dtype=np.int32)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((16, 128, _tile(), _LONG, 256, 132, 0), 128),  # 4/gqa16: one wave of 288-token units
        ((4, 128, _tile(), _LONG, 396, 132, 0), 128),  # exactly one wave at 3 programs per SM
        ((4, 128, _tile(), _LONG, 397, 132, 0), 64),  # a second wave: throughput-bound
        ((16, 128, _tile(), _LONG, 1024, 132, 0), 64),  # 8/gqa16: 2.6 waves
        ((1, 128, _tile(), _LONG, 256, 132, 0), 64),  # MHA
        ((16, 256, _tile(), _LONG, 256, 132, 0), 64),  # head dim 256: the wide tile would not fit 3 per SM
        ((16, 64, _tile(), _LONG, 256, 132, 0), 128),
        ((16, 128, _tile(block_m=64), _LONG, 256, 132, 0), 64),  # 64-row tiles
        ((16, 128, _tile(block_n=32), _LONG, 256, 132, 0), 32),  # a shrunk or configured tile stays
        ((16, 128, _tile(num_warps=2), _LONG, 256, 132, 0), 64),
        ((16, 128, _tile(num_stages=5), _LONG, 256, 132, 0), 64),  # two K/V buffers
        ((16, 128, _tile(), np.full(40, 64, dtype=np.int32), 256, 132, 0), 64),  # short units: one tile each
        ((16, 128, _tile(), np.r_[np.full(35, 64), np.full(5, 200)].astype(np.int32), 256, 132, 0), 128),  # p90 long
        ((16, 128, _tile(), np.r_[np.full(36, 64), np.full(4, 200)].astype(np.int32), 256, 132, 0), 64),
        ((16, 128, _tile(), np.zeros(0, dtype=np.int32), 0, 132, 0), 64),
        ((16, 128, _tile(), _LONG, 256, 0, 0), 64),  # no GPU
    ],
)
def test_wide_kv_tile_only_for_one_wave_gqa_small_classes(args, expected):
    assert launch_rules.launch_kv_tile(*args) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((8, 256, _tile(block_m=64), _LONG, 256, 132, 32), 32),  # the cap: 64-row class at head dim 256
        ((1, 256, _tile(block_m=32), _LONG, 256, 132, 32), 32),
        ((8, 256, _tile(block_m=64, block_n=16), _LONG, 256, 132, 32), 16),  # a smaller tile stays
        ((8, 256, _tile(block_m=16), _LONG, 256, 132, 32), 64),  # 16-row classes keep theirs
        ((8, 128, _tile(block_m=64), _LONG, 256, 132, 32), 64),  # head dim 128: no cap
        ((8, 256, _tile(block_m=64), _LONG, 256, 132, 0), 64),  # 0: the rule is off
        ((8, 256, _tile(block_m=64), _LONG, 256, 0, 32), 32),  # a shared-memory rule: no SM count needed
    ],
)
def test_wide_head_cap_shrinks_only_wide_tiles_above_head_dim_128(args, expected):
    assert launch_rules.launch_kv_tile(*args) == expected


def test_an_all_large_mha_plan_runs_its_64_row_tiles_at_4_warps(device):
    """MHA at head dim 256, two queries: the plan is all-large, so its class 1 holds 64-row tiles and
    launches them at the large class's 4 warps (MHA's small class has 2), with the wide-head cap's
    32-token KV tiles; the result matches the float64 reference (compiled on a GPU)."""
    tree = ft.KVTree.from_lengths([-1, 0, 1, 0, 3], [134, 1, 79, 171, 111], [2, 4])
    all_large = TREE_PLANS.with_(all_large_without_large=True)  # the runtime's rule
    plan = ft.plan(tree, num_q_heads=2, num_kv_heads=2, head_dim=256, rules=all_large)
    target = _h200_like(device)
    (launch,) = launch_rules.stage1_launches(plan, target)
    assert plan.tile_mode == "all_large" and (launch.block_m, launch.block_n, launch.num_warps) == (64, 32, 4)
    gen = torch.Generator().manual_seed(13)
    q, k, v = make_inputs(tree, 2, 2, 256, torch.bfloat16, device, gen)
    out = run_poisoned(lambda o: _run(_launches(plan, q, k, v, o, target)), q)
    check_against_reference(out, q, k, v, tree)


def test_all_small_and_all_large_plans_of_a_small_tree_match_reference(device):
    """Two requests over a shared prefix at GQA 4: with ``all_large_without_large`` (the runtime's
    rule) they are planned all-large at the small split (7 units of 64-row tiles), by default
    all-small; each matches the float64 reference."""
    tree = ft.KVTree.from_lengths([-1, 0, 0], [40, 300, 260], [1, 2])
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_inputs(tree, 4, 1, 64, torch.float16, device, gen)
    all_large = ft.plan(
        tree, num_q_heads=4, num_kv_heads=1, head_dim=64,
        rules=TREE_PLANS.with_(all_large_without_large=True),
    )  # fmt: skip
    default = ft.plan(tree, num_q_heads=4, num_kv_heads=1, head_dim=64, rules=TREE_PLANS)
    assert (all_large.tile_mode, all_large.n_units, all_large.tile_classes[1].block_m) == ("all_large", 7, 64)
    assert (default.tile_mode, default.tile_classes[1].block_m) == ("all_small", 16)
    for plan in (all_large, default):
        out = run_poisoned(lambda o, plan=plan: _run(_launches(plan, q, k, v, o, _h200_like(device))), q)
        check_against_reference(out, q, k, v, tree)


def test_wide_head_kv_tile_rule_launches_match_reference(device):
    """At head dim 256 the default rules (``PlanRules.wide_head_kv_tile=32``) launch the 32-row class
    with 32-token KV tiles, and the result matches the float64 reference (the cap off keeps 64)."""
    tree = ft.KVTree.from_lengths([-1, 0, 0, 1, 2], [200, 90, 37, 1, 150], [1, 2, 3, 4, 4])
    # gamma < 0 groups shared prefixes with their queries; para_threshs2 keeps both tile classes
    cfg = ft.FastTreeConfig(q_tile_queries=(4, 1), pack_tokens=0, para_threshs2=(1, 1), gamma=-10.0)
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_inputs(tree, 8, 1, 256, torch.bfloat16, device, gen)
    capped = ft.plan(tree, cfg, num_q_heads=8, num_kv_heads=1, head_dim=256, rules=TREE_PLANS)
    uncapped = ft.plan(tree, cfg, num_q_heads=8, num_kv_heads=1, head_dim=256,
                       rules=TREE_PLANS.with_(wide_head_kv_tile=0))  # fmt: skip
    target = _h200_like(device)
    wide = [s for s in launch_rules.stage1_launches(capped, target) if s.block_m >= 32]
    assert wide and all(s.block_n == 32 for s in wide)
    assert all(s.block_n == 64 for s in launch_rules.stage1_launches(uncapped, target) if s.block_m >= 32)
    out = run_poisoned(lambda o: _run(_launches(capped, q, k, v, o, target)), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(("g", "q_tiles", "pack_tokens"), [(8, (2, 2), 0), (16, None, 0), (16, None, 1024)])
def test_wide_kv_tile_launch_matches_reference(g, q_tiles, pack_tokens, device, monkeypatch):
    """A one-wave 16-row GQA class launched with 128-token KV tiles (launches sized for an H200's
    132 SMs) reads its units' tail tiles masked and matches the float64 reference."""
    tree = ft.KVTree.from_lengths([-1, 0, 0, 1, 2], [200, 90, 37, 1, 150], [1, 2, 3, 4, 4])
    cfg = ft.FastTreeConfig(gamma=10.0, kv_split_sizes=(512, 512), pack_tokens=pack_tokens, q_tile_queries=q_tiles)
    plan = ft.plan(tree, cfg, num_q_heads=g, num_kv_heads=1, head_dim=64, rules=TREE_PLANS)
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_inputs(tree, g, 1, 64, torch.float16, device, gen)
    launches = _launches(plan, q, k, v, torch.empty_like(q), target=_h200_like(device))
    small = [c for _, _, _, c, *_ in launches if len(c) > 10 and c[3] == 16]
    assert small and all(c[4] == 128 for c in small)
    out = run_poisoned(lambda o: _run(_launches(plan, q, k, v, o, _h200_like(device))), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, 128, _tile(num_warps=2), 384, 132), 5),  # 1/mha: one wave at 3 programs per SM
        ((1, 128, _tile(num_warps=2), 396, 132), 5),
        ((1, 128, _tile(num_warps=2), 512, 132), 3),  # 2/3/4/mha: the second buffer would add a wave
        ((4, 128, _tile(), 256, 132), 3),  # GQA: the wide KV tile instead
        ((1, 256, _tile(num_warps=2), 384, 132), 3),
        ((1, 128, _tile(block_m=64), 384, 132), 3),
        ((1, 128, _tile(num_stages=5), 384, 132), 5),
        ((1, 128, _tile(num_stages=6), 384, 132), 6),  # configured deeper: kept
        ((1, 128, _tile(num_warps=2), 384, 0), 3),  # no GPU
    ],
)
def test_deeper_pipeline_only_for_one_wave_mha_small_classes(args, expected):
    assert launch_rules.launch_num_stages(*args) == expected


@pytest.mark.parametrize(("target", "one_wave_sms", "pdl"), [
    (GpuTarget(cuda=True, major=9, sms=132), 132, True), (GpuTarget(cuda=True, major=8, sms=108), 0, False),
    (GpuTarget(cuda=True, major=10, sms=148), 0, True), (GpuTarget(cuda=False), 0, False),
])  # fmt: skip
def test_one_wave_rules_only_on_the_measured_gpu_generation(target, one_wave_sms, pdl):
    assert target.one_wave_sms == one_wave_sms
    assert target.pdl is pdl
    assert launch_rules.pdl_wait("stage1", target) == (1 if pdl else 0)


def test_interpreter_target_has_no_gpu_facts():
    target = GpuTarget.of(torch.device("cpu"), interpreting=True)
    assert target == GpuTarget(cuda=False) and target.one_wave_sms == 0 and not target.pdl


@pytest.mark.parametrize(("kind", "wait"), [
    ("stage1", 1), ("stage1_forked", 0), ("merge", 1), ("persistent_stage1", 2), ("persistent_merge", 2),
])  # fmt: skip
def test_pdl_waits_per_launch_kind(kind, wait):
    assert launch_rules.pdl_wait(kind, GpuTarget(cuda=True, major=9, sms=132)) == wait
    assert launch_rules.pdl_wait(kind, GpuTarget(cuda=True, major=8, sms=108)) == 0


def test_pdl_wait_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="launch kind must be one of"):
        launch_rules.pdl_wait("stage2", GpuTarget(cuda=True, major=9, sms=132))


@pytest.mark.parametrize(("num_stages", "expected"), [(None, 5), ((3, 3), 3), ((4, 4), 4)])
def test_deeper_pipeline_keeps_stages_a_config_sets(num_stages, expected, device):
    tree = paper_tree(1)  # MHA: 384 (unit, KV head) items of 16-row tiles, one wave of 132 SMs
    plan = ft.plan(tree, ft.FastTreeConfig(num_stages=num_stages), num_q_heads=32, num_kv_heads=32, head_dim=64)
    q, k, v = make_inputs(tree, 32, 32, 64, torch.float16, device, torch.Generator().manual_seed(0))
    launches = _launches(plan, q, k, v, torch.empty_like(q), target=_h200_like(device))
    small = [stages for _, _, _, c, _, stages, _ in launches if len(c) > 10 and c[3] == 16]
    assert small and all(st == expected for st in small)


@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), [SHAPES[1], SHAPES[3], SHAPES[4]])
def test_long_units_kept_out_of_bins_match_reference(g, hkv, d, dtype, device):
    # the solo rule forced on (no waste floor): long one-query leaves run unpacked next to bins
    rules = ft.PlanRules(solo_min_waste_flops=0, solo_min_tokens=24)
    gen = torch.Generator().manual_seed(g + d)
    # a forest: root 0 (9 tokens) -> 3 nodes (5) -> 12 leaves of 30 tokens (solo); root 16 (7) ->
    # 4 nodes (3) -> 16 leaves of 2 tokens (still binned); one query at an internal node
    parents = [-1, 0, 0, 0, *[1 + i // 4 for i in range(12)], -1, 16, 16, 16, 16, *[17 + i // 4 for i in range(16)]]
    lengths = [9, 5, 5, 5, *[30] * 12, 7, 3, 3, 3, 3, *[2] * 16]
    queries = [*range(4, 16), *range(21, 37), 2]
    forest = ft.KVTree.from_lengths(parents, lengths, queries)
    cfg = ft.FastTreeConfig(
        pack_tokens=64, pack_min_units=0, kv_tile=(16, 16), kv_split_sizes=(64, 32), para_threshs1=(0, 0)
    )
    plan = ft.plan(forest, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, rules=rules)
    small = plan.unit_kv_len[plan.class_unit_ptr[1] : plan.class_unit_ptr[2]]
    assert int(np.count_nonzero(small >= 30)) >= 10  # a leaf may be joined to its parent edge
    q, k, v = make_inputs(forest, g * hkv, hkv, d, dtype, device, gen)
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    check_against_reference(out, q, k, v, forest)


@pytest.mark.parametrize(("levels", "g", "hkv", "dtype"), [
    (((1, 2, 8), (64, 40, 4)), 16, 1, torch.float16),
    (((1, 2, 8), (200, 100, 4)), 16, 1, torch.bfloat16),
    (((1, 2, 8), (200, 100, 4)), 4, 2, torch.float16),
])  # fmt: skip
def test_balanced_bins_match_reference(levels, g, hkv, dtype, device):
    # trees whose GQA plans cut packed blocks into balanced bins
    tree = ft.KVTree.from_levels(*levels)
    cfg = ft.FastTreeConfig(pack_min_units=32, para_threshs1=(1, 1), para_threshs2=(1, 1))
    gen = torch.Generator().manual_seed(g + hkv)
    q, k, v = make_inputs(tree, g * hkv, hkv, 64, dtype, device, gen)
    tree_plan = TREE_PLANS.with_(crossover_margin=0.0)  # this small forest costs more than decode at GQA 16
    plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=64, rules=tree_plan)
    assert plan.tile_classes[0].masked or plan.tile_classes[1].masked
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), [SHAPES[1], SHAPES[2], SHAPES[3]])
def test_random_plans_with_solo_units_match_reference(g, hkv, d, dtype, device):
    # random forests (queries at internal nodes, scattered slots) with the solo rule forced on
    rules = TREE_PLANS.with_(solo_min_waste_flops=0, solo_min_tokens=16)
    rng = np.random.default_rng(900 + g)
    gen = torch.Generator().manual_seed(900 + g)
    changed = 0
    for _ in range(4):
        tree = random_tree(rng, max_nodes=24, max_len=48)
        cfg = ft.FastTreeConfig(pack_tokens=64, pack_min_units=0, kv_tile=(16, 16), kv_split_sizes=(64, 32),
                                para_threshs1=(0, 0))  # fmt: skip
        heads = {"num_q_heads": g * hkv, "num_kv_heads": hkv, "head_dim": d}
        plan = ft.plan(tree, cfg, **heads, rules=rules)
        no_solo = rules.with_(solo_units=False)
        changed += plan.units_per_class() != ft.plan(tree, cfg, **heads, rules=no_solo).units_per_class()
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)
    assert changed >= 1, "no random plan used the solo rule; the test would not cover it"


@pytest.mark.parametrize(
    ("max_slot", "stride0", "fits"),
    [
        (0, 2**40, True),  # slot 0 alone: offsets head * stride(1) + dim
        (2**31 // 256 - 1, 256, True),  # last element at 2**31 - 1
        (2**31 // 256, 256, False),  # one slot further: 2**31 + ...
        (1, 2**31, False),
        (2**20, 4096, False),  # a 1M-slot MHA-32 x 128 pool
        (2**18, 4096, True),
    ],
)
def test_int32_kv_offsets_only_where_every_read_offset_fits(max_slot, stride0, fits):
    # meta tensors: any strides without storage; K and V decide together
    k = torch.empty_strided((max_slot + 1, 2, 128), (stride0, 128, 1), device="meta")
    small = torch.empty_strided((max_slot + 1, 2, 128), (256, 128, 1), device="meta")
    assert launch_rules.kv_offsets_fit_int32(max_slot, k, k) is fits
    assert launch_rules.kv_offsets_fit_int32(max_slot, small, k) is fits
    assert launch_rules.kv_offsets_fit_int32(max_slot, k, small) is fits


@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), [(1, 2, 64, torch.float16), (4, 2, 128, torch.bfloat16)])
def test_int32_and_int64_kv_offsets_give_identical_outputs(g, hkv, d, dtype, device):
    rng = np.random.default_rng(31)
    gen = torch.Generator().manual_seed(31)
    tree = random_tree(rng, max_nodes=12, max_len=80)
    plan = ft.plan(tree, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d)
    q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
    assert launch_rules.kv_offsets_fit_int32(plan.max_slot, k, v)
    out32 = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    check_against_reference(out32, q, k, v, tree)
    out64 = run_poisoned(lambda o: _run(_launches(plan, q, k, v, o), constexpr={_OFFSETS_32: False}), q)
    torch.testing.assert_close(out64, out32, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("g", "hkv", "d", "dtype"), [(1, 2, 64, torch.float16), (4, 2, 128, torch.bfloat16), (2, 1, 96, torch.float16)]
)
@pytest.mark.parametrize("peel", [False, True])
def test_peeled_tail_tiles_give_identical_outputs(g, hkv, d, dtype, peel, device):
    # whole KV tiles unmasked + one masked tail tile computes exactly what masking every tile does
    # (head dim 96: the unmasked tiles still mask the padded columns), in tiles of any rows
    rng = np.random.default_rng(41)
    gen = torch.Generator().manual_seed(41)
    for _ in range(2):
        tree = random_tree(rng, max_nodes=14, max_len=150)
        plan = ft.plan(tree, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, rules=TREE_PLANS)
        block_n = min(tc.block_n for tc in plan.tile_classes)
        assert (plan.unit_kv_len > block_n).any() and (plan.unit_kv_len % block_n != 0).any()
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
        as_planned = run_poisoned(lambda o, p=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, p, out=o), q)
        forced = run_poisoned(
            lambda o, p=plan, q=q, k=k, v=v: _run(_launches(p, q, k, v, o), constexpr={_PEEL: peel}), q
        )
        check_against_reference(forced, q, k, v, tree)
        torch.testing.assert_close(forced, as_planned, rtol=0, atol=0)


@pytest.mark.parametrize(("g", "hkv", "d", "dtype"), [(1, 3, 64, torch.float16), (4, 2, 128, torch.bfloat16)])
def test_heads_fastest_item_order_gives_identical_outputs(g, hkv, d, dtype, device):
    # the per-plan grid as (KV heads, units) runs the same programs as (units, KV heads)
    rng = np.random.default_rng(43)
    gen = torch.Generator().manual_seed(43)
    tree = random_tree(rng, max_nodes=14, max_len=150)
    q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
    plan = ft.plan(tree, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d)
    launches = _launches(plan, q, k, v, q)
    stage1 = [(grid, c) for _, grid, _, c, *_ in launches if len(c) > 10]
    assert stage1 and all(c[_HEADS_FASTEST] and grid[0] == hkv for grid, c in stage1)
    fastest = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    units_first = run_poisoned(
        lambda o: _run(_launches(plan, q, k, v, o), constexpr={_HEADS_FASTEST: False}, transpose_grid=True), q
    )
    check_against_reference(fastest, q, k, v, tree)
    torch.testing.assert_close(units_first, fastest, rtol=0, atol=0)


@pytest.mark.parametrize(("stages", "shrink"), [(None, True), ((5, 3), False)])
def test_only_default_stages_may_shrink_to_fit_shared_memory(stages, shrink, device, monkeypatch):
    tree = ft.KVTree.from_levels([1, 4], [100, 20])
    q, k, v = make_inputs(tree, 8, 2, 64, torch.float16, device, torch.Generator().manual_seed(5))
    seen = []
    real = attention.launch

    def recording(*args, **kw):
        seen.append(args[7] if len(args) > 7 else kw.get("shrink_stages", False))
        return real(*args, **kw)

    monkeypatch.setattr(attention, "launch", recording)
    plan = ft.plan(tree, ft.FastTreeConfig(num_stages=stages), num_q_heads=8, num_kv_heads=2, head_dim=64)
    ft.tree_attention(q, k, v, plan)
    assert seen and all(flag is shrink for flag in seen)


@pytest.mark.parametrize(("n_units", "expected"), [
    (500, ((8, 500), True)), (65535, ((8, 65535), True)), (65536, ((65536, 8), False)),
])  # fmt: skip
def test_heads_fastest_grid_keeps_the_units_within_the_grid_limit(n_units, expected):
    assert launch_rules.units_grid(n_units, 8) == expected


@pytest.mark.parametrize(("block_m", "mean_tiles", "expected"), [
    (16, 9.0, False), (64, 1.9, False), (64, 2.5, True), (64, None, True), (32, 12.0, True), (16, None, False),
])  # fmt: skip
def test_peel_rule_by_tile_rows_and_unit_tiles(block_m, mean_tiles, expected):
    assert launch_rules.peel_tiles(block_m, mean_tiles) is expected


@pytest.mark.parametrize(
    ("levels", "tokens", "dtype"),
    [([1, 2, 128], [300, 300, 1], torch.float16), ([1, 4, 128], [700, 200, 2], torch.bfloat16)],
)
def test_mha_plan_with_wide_units_kept_whole_is_correct(levels, tokens, dtype, device):
    # short shared nodes read by many queries: the default plan keeps MHA's 64-query units whole
    # (large tile, merged with the bins' partials) instead of re-reading them in every 16-query bin
    tree = ft.KVTree.from_levels(levels, tokens)
    config = ft.FastTreeConfig(para_threshs1=(1, 1), para_threshs2=(1, 1), pack_min_units=8)
    chosen = ft.plan(tree, config, num_q_heads=2, num_kv_heads=2, head_dim=64)
    packed = ft.plan(tree, config, num_q_heads=2, num_kv_heads=2, head_dim=64, rules=ft.PlanRules(wide_units=False))
    assert chosen.units_per_class()[0] > 0 == packed.units_per_class()[0]
    assert chosen.stats()["kv_tokens_read"] < packed.stats()["kv_tokens_read"] and chosen.n_partial_rows > 0
    q, k, v = make_inputs(tree, 2, 2, 64, dtype, device, torch.Generator().manual_seed(11))
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, chosen, out=o), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(
    ("seed", "heads", "dtype"), [(1, (16, 1), torch.float16), (4, (8, 2), torch.bfloat16), (0, (2, 2), torch.float16)]
)
def test_plan_with_aligned_blocks_is_correct(seed, heads, dtype, device):
    # documents with a few questions each: packing's blocks end at a document's last question, so
    # no document is read by two bins (fewer KV reads than the fixed blocks of the same plan)
    from fasttree.toolkit.workloads import multi_document

    rng = np.random.default_rng(seed)
    tree = multi_document(rng, n_documents=4, doc_tokens=(40, 120), questions_per_doc=(2, 6), question_tokens=(2, 12))
    config = ft.FastTreeConfig(para_threshs1=(1, 1), para_threshs2=(1, 1), pack_min_units=8)
    hq, hkv = heads
    aligned = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, rules=TREE_PLANS)
    fixed_blocks = TREE_PLANS.with_(aligned_blocks=False)
    fixed = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, rules=fixed_blocks)
    assert aligned.stats()["kv_tokens_read"] < fixed.stats()["kv_tokens_read"]
    q, k, v = make_inputs(tree, hq, hkv, 64, dtype, device, torch.Generator().manual_seed(seed))
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, aligned, out=o), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(
    ("g", "hkv", "d", "dtype", "n", "length"),
    [(2, 8, 128, torch.float16, 40, 300), (8, 1, 96, torch.bfloat16, 70, 1000)],
)
def test_equal_lengths_one_wave_matches_the_reference(g, hkv, d, dtype, n, length, device):
    """``equal_lengths_one_wave`` (on by default) where it changes plain decode's chunks:
    a batch of contexts within a tile of each other, more programs than one wave by default,
    scattered slots; the tree plan and plain decode's against the float64 reference, output
    poisoned first."""
    from fasttree.query_separated import plan_query_separated

    off = ft.PlanRules.defaults().with_(equal_lengths_one_wave=False)
    rng = np.random.default_rng(4200 + d)
    heads = {"num_q_heads": g * hkv, "num_kv_heads": hkv, "head_dim": d}
    lens = length - rng.integers(0, 60, n)
    slots = rng.permutation(int(lens.sum()) + 30)
    bounds = np.concatenate([[0], np.cumsum(lens)])
    tree = ft.KVTree([-1] * n, [slots[bounds[j] : bounds[j + 1]] for j in range(n)], list(range(n)))
    fitted = plan_query_separated(tree, **heads)
    assert fitted.n_units < plan_query_separated(tree, **heads, rules=off).n_units
    q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, torch.Generator().manual_seed(4200 + d))
    for plan in (ft.plan(tree, **heads), fitted):
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)


def test_decode_split_by_context_where_it_cuts_matches_the_reference(device):
    """``decode_split_by_context`` where it changes plain decode's chunks: 80 requests at 8 KV heads
    (640 items, more than 4 x 132 programs: one chunk per query without the rule), mixed lengths,
    scattered slots; the capped chunks against the float64 reference, the uncapped ones too."""
    from fasttree.query_separated import plan_query_separated

    rng = np.random.default_rng(4180)
    lens = rng.integers(8, 300, 80)
    slots = rng.permutation(int(lens.sum()) + 50)
    bounds = np.concatenate([[0], np.cumsum(lens)])
    tree = ft.KVTree([-1] * 80, [slots[bounds[j] : bounds[j + 1]] for j in range(80)], list(range(80)))
    heads = {"num_q_heads": 16, "num_kv_heads": 8, "head_dim": 64}
    on = ft.PlanRules.defaults()
    base = plan_query_separated(tree, **heads, rules=on.with_(decode_split_by_context=False))
    cut = plan_query_separated(tree, **heads)
    assert on.decode_split_by_context and cut.n_units > base.n_units == 80
    q, k, v = make_inputs(tree, 16, 8, 64, torch.bfloat16, device, torch.Generator().manual_seed(4180))
    for plan in (base, cut):
        out = run_poisoned(lambda o, plan=plan: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(
    ("n", "hi", "g", "hkv", "d", "dtype"), [(20, 900, 4, 4, 128, torch.float16), (40, 500, 8, 2, 64, torch.bfloat16)]
)
def test_no_sharing_split_by_context_matches_the_reference(n, hi, g, hkv, d, dtype, device):
    """``no_sharing_split_by_context`` (on by default) against the rule off, where it cuts a batch of
    independent requests finer (a config with ``para_threshs1`` (32, 64), so that a small batch
    fills its programs; tree plans only; packed and unpacked): the plan against the float64
    reference, scattered slots, output poisoned first."""
    on = ft.PlanRules.defaults().with_(crossover_margin=0.0)
    off = on.with_(no_sharing_split_by_context=False)
    config = ft.FastTreeConfig(para_threshs1=(32, 64))
    rng = np.random.default_rng(4300 + n)
    lens = rng.integers(16, hi, n)
    slots = rng.permutation(int(lens.sum()) + 40)
    bounds = np.concatenate([[0], np.cumsum(lens)])
    tree = ft.KVTree([-1] * n, [slots[bounds[j] : bounds[j + 1]] for j in range(n)], list(range(n)))
    heads = {"num_q_heads": g * hkv, "num_kv_heads": hkv, "head_dim": d}
    plan = ft.plan(tree, config, **heads, rules=on)
    assert plan.unit_kv_len.max() < ft.plan(tree, config, **heads, rules=off).unit_kv_len.max()
    q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, torch.Generator().manual_seed(4300 + n))
    out = run_poisoned(lambda o: ft.tree_attention(q, k, v, plan, out=o), q)
    check_against_reference(out, q, k, v, tree)


@pytest.mark.parametrize(
    ("g", "hkv", "d", "dtype"),
    [(4, 1, 64, torch.bfloat16), (16, 1, 128, torch.float16), (8, 2, 64, torch.bfloat16), (8, 1, 256, torch.bfloat16)],
)
def test_decode_split_by_context_matches_the_reference(g, hkv, d, dtype, device):
    """The default rules with ``decode_split_by_context`` (plain decode's chunks from the summed
    context): random forests and independent requests of mixed lengths (default config: solo units;
    a config keeping them whole), tree plans and query-separated plans against the float64
    reference."""
    rules = ft.PlanRules.defaults()
    rng = np.random.default_rng(4100 + 10 * g + hkv + d)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    for i in range(4):
        cfg = None
        if i % 2:  # independent requests of 300-700 tokens, scattered slots
            lens = rng.integers(300, 701, int(rng.integers(2, 5)))
            slots = rng.permutation(int(lens.sum()) + 40)
            bounds = np.concatenate([[0], np.cumsum(lens)])
            nodes = [slots[bounds[j] : bounds[j + 1]] for j in range(lens.size)]
            tree = ft.KVTree([-1] * lens.size, nodes, list(range(lens.size)))
            if i == 3:
                cfg = ft.FastTreeConfig(kv_split_sizes=(1024, 1024), para_threshs1=(1, 1))
        else:
            tree = random_tree(rng, max_nodes=12, max_len=700)
        plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, rules=rules)
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, gen)
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)
        qs = ft.plan_query_separated(tree, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, rules=rules)
        out = run_poisoned(lambda o, qs=qs, q=q, k=k, v=v: ft.tree_attention(q, k, v, qs, out=o), q)
        check_against_reference(out, q, k, v, tree)
