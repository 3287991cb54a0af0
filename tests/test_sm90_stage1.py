"""The sm_90 Gluon stage 1 (``PlanRules.sm90_stage1``): which launches take it (CPU), what they pass
it (CPU), and its results against the float64 reference through ``tree_attention`` and the runtime
(``gpu``, sm_90 only). Its offline compile for sm_90a is in ``test_compile_sm90.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_attention import check_against_reference, make_inputs, run_poisoned
from trees import random_tree, shared_forest

import fasttree as ft
from fasttree import attention, launch_rules
from fasttree.kernels import tree_attention_units_kernel, tree_attention_units_sm90_kernel
from fasttree.launch_rules import SM90_TILES, GpuTarget, sm90_tile, stage1_launches, warp_specialized_stage1

H100 = GpuTarget(cuda=True, major=9, sms=132)
ON = ft.PlanRules.defaults().with_(sm90_stage1=True)
OFF = ft.PlanRules.defaults().with_(sm90_stage1=False)

needs_gluon = pytest.mark.skipif(tree_attention_units_sm90_kernel is None, reason="this Triton has no Gluon for Hopper")


def _two_class_tree() -> ft.KVTree:
    """A 4k-token prefix read by 64 queries (64-row tiles at GQA 16) and 40 lone 900-token requests
    (16-row tiles)."""
    n, solo = 64, 40
    return ft.KVTree.from_lengths(
        [-1] + [0] * n + [-1] * solo, [4000] + [40] * n + [900] * solo, list(range(1, n + solo + 1))
    )


def test_the_rule_is_on_by_default_and_only_for_64_row_tiles_on_sm90():
    assert ft.PlanRules.defaults().sm90_stage1 is True
    assert {d for d, _ in SM90_TILES} == {128}  # D 64 and 256 measured no better (docs/history.md)
    for block_m, d, target, on, expected in (
        (64, 128, H100, True, True),
        (64, 64, H100, True, False),  # head dims without a tile
        (64, 256, H100, True, False),
        (64, 128, H100, False, False),  # the rule off
        (32, 128, H100, True, False),  # another tile class
        (16, 128, H100, True, False),
        (64, 96, H100, True, False),  # a head dim without a tile
        (64, 128, GpuTarget(cuda=True, major=8, sms=108), True, False),  # not sm_90
        (64, 128, GpuTarget(cuda=True, major=10, sms=148), True, False),
        (64, 128, GpuTarget(cuda=False, major=9, sms=132), True, False),  # the interpreter
    ):
        got = warp_specialized_stage1(on, target, block_m, d)
        assert got == (expected and tree_attention_units_sm90_kernel is not None), (block_m, d, target, on)


@needs_gluon
def test_stage1_launches_flag_the_64_row_class_only_where_the_plan_rules_say():
    tree = _two_class_tree()
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128}
    on, off = ft.plan(tree, **heads, rules=ON), ft.plan(tree, **heads, rules=OFF)
    assert [tc.block_m for tc in on.tile_classes] == [64, 16]
    flags = [(s.block_m, s.warp_specialized) for s in stage1_launches(on, H100)]
    assert flags == [(64, True), (16, False)]
    assert not any(s.warp_specialized for s in stage1_launches(off, H100))
    assert not any(s.warp_specialized for s in stage1_launches(on, GpuTarget(cuda=False, major=9, sms=132)))
    # everything else of the launches as without the rule: the same plan, the same Triton launches
    for a, b in zip(stage1_launches(on, H100), stage1_launches(off, H100), strict=True):
        assert a.n_units == b.n_units and a.block_n == b.block_n and a.num_warps == b.num_warps


@needs_gluon
@pytest.mark.parametrize("offsets_32", [True, False])
def test_kernel_launches_pass_the_gluon_kernel_the_triton_kernels_arguments(offsets_32):
    """The Gluon launch takes the Triton launch's arguments and grid, its constexprs by name (its
    tile from ``SM90_TILES``, ``GDC_WAIT`` last), 4 warps (the consumer warpgroup) and the tile's
    register cap; the 16-row class keeps the Triton kernel."""
    tree = _two_class_tree()
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128}
    plans = {rules: ft.plan(tree, **heads, rules=rules) for rules in (ON, OFF)}
    q = torch.randn(tree.n_queries, 16, 128).half()
    k = torch.randn(tree.max_slot + 1, 1, 128).half()
    out = torch.empty_like(q)
    launches = {}
    for rules, p in plans.items():
        dev = p.to(q.device)
        part_o, part_lse = attention._workspace(p, q.device)
        launches[rules] = attention.kernel_launches(
            stage1_launches(p, H100), None, dev.arrays, part_o, part_lse, q, k, k, out, 0.5, H100,
            offsets_32=offsets_32,
        )  # fmt: skip
    plan = plans[ON]
    (g_kernel, g_grid, g_args, g_const, g_warps, _, g_maxnreg), small = launches[ON]
    (t_kernel, t_grid, t_args, *_), t_small = launches[OFF]
    assert g_kernel is tree_attention_units_sm90_kernel and t_kernel is tree_attention_units_kernel
    assert small[0] is tree_attention_units_kernel and small[1] == t_small[1] and small[3] == t_small[3]
    assert g_grid == t_grid
    for i, (a, b) in enumerate(zip(g_args, t_args, strict=True)):
        if not isinstance(a, torch.Tensor):
            assert a == b, i
        elif i in (4, 5):  # each plan's own partials workspace
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
        else:  # q, k, v, out, and the plan arrays of the same plan (the rule changes launches only)
            assert a is b or torch.equal(a, b), i
    names = [p.name for p in tree_attention_units_sm90_kernel.params if p.is_constexpr]
    tile = sm90_tile(128, offsets_32)
    assert dict(zip(names, g_const, strict=True)) == {
        "HEAD_DIM": 128, "GROUP": 16, "BLOCK_M": 64, "BLOCK_N": tile.block_n, "MASKED": plan.tile_classes[0].masked,
        "OFFSETS_32": offsets_32, "HEADS_FASTEST": g_const[6], "STAGES": tile.stages,
        "LOADER_WARPS": tile.loader_warps, "LOADER_REGS": tile.loader_regs, "GDC_WAIT": g_const[-1],
    }  # fmt: skip
    assert names[-1] == "GDC_WAIT" and g_const[-1] == launch_rules.pdl_wait("stage1_forked", H100)
    assert (g_warps, g_maxnreg) == (4, tile.maxnreg)


# ----------------------------------------------------------------------------------------- GPU
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _sm90() or tree_attention_units_sm90_kernel is None, reason="needs an sm_90 GPU")

#: (GQA ratio, KV heads, head dim, dtype, queries per large tile): the head dim the kernel runs at,
#: GQA 1 (MHA), 4, 7, 8 and 16, one to four KV heads, fp16 and bf16
GPU_SHAPES = [
    (16, 1, 128, torch.float16, 4),
    (8, 2, 128, torch.bfloat16, 8),
    (4, 4, 128, torch.float16, 16),
    (16, 2, 128, torch.bfloat16, 4),
    (8, 1, 128, torch.float16, 8),
    (4, 2, 128, torch.bfloat16, 16),
    (7, 1, 128, torch.float16, 8),
    (1, 2, 128, torch.bfloat16, 64),
]


def _count_gluon_launches(monkeypatch) -> list:
    seen = []
    real = attention.launch

    def recording(kernel, *args, **kw):
        seen.append(kernel is tree_attention_units_sm90_kernel)
        return real(kernel, *args, **kw)

    monkeypatch.setattr(attention, "launch", recording)
    return seen


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("g", "hkv", "d", "dtype", "q_tile"), GPU_SHAPES)
@pytest.mark.parametrize("pack_tokens", [0, 128])
def test_gluon_stage1_matches_the_reference_on_random_forests(g, hkv, d, dtype, q_tile, pack_tokens, monkeypatch):
    """Forests of shared documents read by many queries (internal ones among them), 1-token and
    long nodes, scattered slots: ``tree_attention`` with the rule on, outputs poisoned, against the
    float64 reference; the Gluon kernel ran on every tree with a 64-row class, and on some."""
    seen = _count_gluon_launches(monkeypatch)
    config = ft.FastTreeConfig(q_tile_queries=(q_tile, 1), pack_tokens=pack_tokens)
    rng = np.random.default_rng(9000 + 10 * g + d + hkv + pack_tokens)
    device = torch.device("cuda")
    ran = 0
    for i in range(5):
        tree = shared_forest(rng, fanout=150 if g == 1 else 40)
        heads = {"num_q_heads": g * hkv, "num_kv_heads": hkv, "head_dim": d}
        plan = ft.plan(tree, config, **heads, rules=ON)
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, device, torch.Generator().manual_seed(i))
        seen.clear()
        out = run_poisoned(lambda o, plan=plan, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=o), q)
        check_against_reference(out, q, k, v, tree)
        counts = np.diff(plan.class_unit_ptr)
        has_64 = any(tc.block_m == 64 for tc, n in zip(plan.tile_classes, counts, strict=True) if n)
        assert any(seen) == has_64
        ran += has_64
    assert ran > 0, "no tree had a 64-row class"


def test_the_gpu_cases_have_64_row_classes():
    """The forests the GPU test draws plan 64-row classes (what it checks) under every shape."""
    for g, hkv, d, _, q_tile in GPU_SHAPES:
        for pack_tokens in (0, 128):
            config = ft.FastTreeConfig(q_tile_queries=(q_tile, 1), pack_tokens=pack_tokens)
            rng = np.random.default_rng(9000 + 10 * g + d + hkv + pack_tokens)
            heads = {"num_q_heads": g * hkv, "num_kv_heads": hkv, "head_dim": d}
            plans = [ft.plan(shared_forest(rng, fanout=150 if g == 1 else 40), config, **heads) for _ in range(5)]
            assert any(p.tile_classes[0].block_m == 64 and p.class_unit_ptr[1] > 0 for p in plans), (g, d, pack_tokens)


@pytest.mark.gpu
@needs_sm90
def test_gluon_stage1_under_pdl_graphs_and_the_runtime(monkeypatch):
    """The rule on through a CUDA graph of ``tree_attention`` (replayed on new inputs) and through a
    runtime's launch variants (its plans' rules switched on), against the float64 reference."""
    device = torch.device("cuda")
    tree = _two_class_tree()
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128}
    plan = ft.plan(tree, **heads, rules=ON).to(device)
    q, k, v = make_inputs(tree, 16, 1, 128, torch.float16, device, torch.Generator().manual_seed(3))
    out = torch.full_like(q, float("nan"))
    ft.tree_attention(q, k, v, plan, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ft.tree_attention(q, k, v, plan, out=out)
    for seed in (4, 5):
        gen = torch.Generator().manual_seed(seed)
        for t in (q, k, v):  # new inputs in the graph's buffers
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(out, q, k, v, tree)

    from runtime_checks import run_poisoned as run_runtime

    seen = _count_gluon_launches(monkeypatch)
    rt = ft.TreeAttentionRuntime(
        None, **heads, dtype="float16", device=device, max_queries=128, max_kv_entries=65536, pool_slots=k.shape[0]
    )
    rt._rules = rt._rules.with_(sm90_stage1=True)
    rng = np.random.default_rng(77)
    for i in range(4):
        t = random_tree(rng, max_nodes=40, max_len=400) if i else tree
        if t.max_slot >= k.shape[0]:
            continue
        rt.plan(t, rows=128)  # one batch bucket for every step
        qq = torch.randn(128, 16, 128, device=device).half()
        err = run_runtime(rt, t, qq, k, v, 128)
        assert err <= 2e-3, err
    assert any(seen)


def test_the_gluon_tile_table_fits_an_sm90_program():
    """Every tile's registers (8 warps x maxnreg) and ring fit an sm_90 SM; the consumer's share
    through setmaxnreg stays within the hardware's 256."""
    for (d, _), t in SM90_TILES.items():
        warps = 4 + t.loader_warps
        assert warps * 32 * t.maxnreg <= 65536
        consumer = min(256, (t.maxnreg * warps - t.loader_regs * t.loader_warps) // 4)
        assert t.loader_regs < t.maxnreg <= consumer
        ring = t.stages * 2 * t.block_n * d * 2 + 64 * d * 2  # K and V tiles (fp16/bf16) and Q
        assert ring <= 227 * 1024
        assert math.log2(t.block_n).is_integer()
