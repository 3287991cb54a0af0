"""Programmatic dependent launch (:func:`fasttree.launch_rules.pdl_wait` decides which launches use
it): the launch options it sets and, on the GPU (``pytest -m gpu``), that it changes no output bit
in eager calls, forked two-class calls and graph replay, and that the runtime's graph replayed with
a new tree every step stays correct."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attention import TOL
from test_runtime_gpu import capture_layers
from trees import random_tree

import fasttree as ft
from fasttree import attention, launcher
from fasttree.launch_rules import GpuTarget
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.workloads import iter_serving


class _RecordingKernel:
    """Stands for a Triton kernel: ``kernel[grid](*args, **options)`` records the options."""

    def __init__(self) -> None:
        self.options: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.options.append(options)

        return launch


@pytest.mark.parametrize("gdc_wait", [0, 1, 2])
def test_launch_with_gdc_wait_asks_triton_for_pdl(monkeypatch, gdc_wait):
    """``launch`` compiles a kernel whose last constexpr (``GDC_WAIT``) is non-zero with ``launch_pdl``:
    the wait and the launch attribute always go together."""
    kernel = _RecordingKernel()
    monkeypatch.setattr(launcher, "GDC_KERNELS", frozenset({kernel}))
    monkeypatch.setattr(launcher, "interpreting", lambda: True)  # the JIT path, no cache
    launcher.launch(kernel, (1, 1), (torch.zeros(1),), (128, gdc_wait), 4, 2)
    assert kernel.options[-1].get("launch_pdl", False) is bool(gdc_wait)
    other = _RecordingKernel()  # a kernel without GDC_WAIT: a trailing True is another flag
    launcher.launch(other, (1, 1), (torch.zeros(1),), (128, True), 4, 2)
    assert "launch_pdl" not in other.options[-1]


# ------------------------------------------------------------------------- GPU
_needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs an sm_90+ GPU"
)


def _case(seed: int, hq: int, hkv: int, d: int, dtype):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, max_nodes=40, max_len=600)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tree.n_queries, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(tree.max_slot + 1, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(tree.max_slot + 1, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return tree, q, k, v


def _calls(plan, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """An eager call's output and a graph replay's (two calls captured, outputs poisoned first)."""
    eager = ft.tree_attention(q, k, v, plan, out=torch.full_like(q, float("nan"))).clone()
    out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(2):
            ft.tree_attention(q, k, v, plan, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return eager, out.clone()


def _without_pdl(plan, q, k, v) -> torch.Tensor:
    """The plan's launches with every ``GDC_WAIT`` 0 (no programmatic dependent launch), run one
    after the other on the current stream."""
    out = torch.full_like(q, float("nan"))
    target = GpuTarget.of(q.device, False)
    qk_scale = attention.LOG2E / float(plan.head_dim) ** 0.5
    for kernel, grid, args, constexprs, warps, stages, maxnreg in attention.plan_launches(
        plan, plan.to(q.device), q, k, v, out, qk_scale, target
    ):
        launcher.launch(kernel, grid, args, (*constexprs[:-1], 0), warps, stages, maxnreg)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "dtype"),
    [
        (32, 32, 128, torch.float16),
        (32, 8, 128, torch.bfloat16),
        (16, 1, 64, torch.float16),
        (28, 4, 256, torch.bfloat16),
    ],
)
def test_tree_attention_with_pdl_is_bit_identical(seed, hq, hkv, d, dtype):
    tree, q, k, v = _case(seed, hq, hkv, d, dtype)
    config = ft.FastTreeConfig(kv_split_sizes=(256, 64))  # splits: merged queries in most trees
    plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    base = _without_pdl(plan, q, k, v)
    ref = ft.reference_attention(q, k, v, tree)
    assert ft.max_relative_error(base, ref) <= TOL[dtype]
    eager, replayed = _calls(plan, q, k, v)
    # the direct launchers (cached by the first call) too
    direct = ft.tree_attention(q, k, v, plan, out=torch.full_like(q, float("nan")))
    for name, t in (("eager", eager), ("graph", replayed), ("direct", direct)):
        torch.testing.assert_close(t, base, rtol=0, atol=0, msg=name)


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_runtime_graph_with_pdl_replays_new_trees(launches, heads):
    hq, hkv = heads
    d, dtype, layers, rows = 128, torch.float16, 3, 256
    trees = [s.tree for s in iter_serving("multi_document_qa", seed=5, steps=40)][::8]
    pool = max(t.max_slot for t in trees) + 1
    gen = torch.Generator(device="cuda").manual_seed(1)
    ks = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    vs = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    q = torch.randn(rows, hq, d, device="cuda", dtype=dtype, generator=gen)
    rt = TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda",
        max_queries=rows, max_kv_entries=4 * pool, pool_slots=pool, stage1_launches=launches, max_variants=0,
    )  # fmt: skip
    outs = [torch.empty(rows, hq, d, device="cuda", dtype=dtype) for _ in range(layers)]
    graph = capture_layers(rt, trees[0], q, ks, vs, outs)
    for tree in trees[1:]:
        rt.plan(tree)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer, o in enumerate(outs):
            ref = ft.reference_attention(q[: tree.n_queries], ks[layer], vs[layer], tree)
            assert ft.max_relative_error(o[: tree.n_queries], ref) <= TOL[dtype]
