"""Programmatic dependent launch (``fasttree.attention._PDL``): which launches use it, and, on the
GPU (``pytest -m gpu``), that it changes no output bit in eager calls, forked two-class calls, graph
replay, and the runtime's graph replayed with a new tree every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attention import TOL
from test_runtime_gpu import capture_layers
from trees import random_tree

import fasttree as ft
from fasttree import attention
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.workloads import iter_serving


class _FakeGpu:
    is_cuda = True
    device = torch.device("cuda", 0)


@pytest.fixture
def on_hopper(monkeypatch):
    """A CUDA sm_90 device as far as :func:`fasttree.attention.pdl_launch` can tell."""
    monkeypatch.setattr(attention, "_interpreting", lambda: False)
    monkeypatch.setattr(attention, "_compute_capability_major", lambda device: 9)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("none", (0, 0, 0, 0, 0)),
        ("merge", (0, 0, 1, 0, 1)),
        ("all", (1, 1, 1, 1, 1)),
        ("auto", (1, 0, 1, 2, 2)),
        ("early", (2, 0, 2, 2, 2)),
    ],
)
def test_pdl_modes_pick_the_launches(monkeypatch, on_hopper, mode, expected):
    monkeypatch.setattr(attention, "_PDL", mode)
    got = tuple(attention.pdl_launch(kind, _FakeGpu()) for kind in attention._PDL_KINDS)
    assert got == expected


def test_an_unknown_launch_kind_is_named(on_hopper):
    with pytest.raises(ValueError, match=r"launch kind must be one of .*'stage2'"):
        attention.pdl_launch("stage2", _FakeGpu())


def test_pdl_needs_sm90_and_a_cuda_tensor(monkeypatch, on_hopper):
    monkeypatch.setattr(attention, "_PDL", "all")
    monkeypatch.setattr(attention, "_compute_capability_major", lambda device: 8)
    assert not attention.pdl_launch("merge", _FakeGpu())
    monkeypatch.setattr(attention, "_compute_capability_major", lambda device: 9)
    assert not attention.pdl_launch("merge", torch.zeros(1))  # a CPU tensor


def test_pdl_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(attention, "_PDL", "all")
    monkeypatch.setattr(attention, "_interpreting", lambda: True)
    assert not attention.pdl_launch("stage1", _FakeGpu())


def test_an_unknown_pdl_mode_is_named(monkeypatch):
    monkeypatch.setattr(attention, "_PDL", "sometimes")
    with pytest.raises(ValueError, match=r"_PDL must be one of .*'sometimes'"):
        attention.pdl_launch("merge", _FakeGpu())


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
    """``_launch`` compiles a kernel whose last constexpr (``GDC_WAIT``) is True with ``launch_pdl``:
    the wait and the launch attribute always go together."""
    kernel = _RecordingKernel()
    monkeypatch.setattr(attention, "_GDC_KERNELS", frozenset({kernel}))
    monkeypatch.setattr(attention, "_interpreting", lambda: True)  # the JIT path, no cache
    attention._launch(kernel, (1, 1), (torch.zeros(1),), (128, gdc_wait), 4, 2)
    assert kernel.options[-1].get("launch_pdl", False) is bool(gdc_wait)
    other = _RecordingKernel()  # a kernel without GDC_WAIT: a trailing True is another flag
    attention._launch(other, (1, 1), (torch.zeros(1),), (128, True), 4, 2)
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
def test_tree_attention_with_pdl_is_bit_identical(monkeypatch, seed, hq, hkv, d, dtype):
    tree, q, k, v = _case(seed, hq, hkv, d, dtype)
    config = ft.FastTreeConfig(kv_split_sizes=(256, 64))  # splits: merged queries in most trees
    outs = {}
    for mode in ("none", "merge", "all", "auto", "early"):
        monkeypatch.setattr(attention, "_PDL", mode)
        plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)  # fresh launch caches
        outs[mode] = _calls(plan, q, k, v)
        # the direct launchers (cached by the first call) too
        outs[mode + "_direct"] = (ft.tree_attention(q, k, v, plan, out=torch.full_like(q, float("nan"))),)
    ref = ft.reference_attention(q, k, v, tree)
    assert ft.max_relative_error(outs["none"][0], ref) <= TOL[dtype]
    base = outs["none"][0]
    for key, tensors in outs.items():
        for t in tensors:
            torch.testing.assert_close(t, base, rtol=0, atol=0, msg=key)


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_runtime_graph_with_pdl_replays_new_trees_bit_identically(monkeypatch, launches, heads):
    hq, hkv = heads
    d, dtype, layers, rows = 128, torch.float16, 3, 256
    trees = [s.tree for s in iter_serving("multi_document_qa", seed=5, steps=40)][::8]
    pool = max(t.max_slot for t in trees) + 1
    gen = torch.Generator(device="cuda").manual_seed(1)
    ks = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    vs = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    q = torch.randn(rows, hq, d, device="cuda", dtype=dtype, generator=gen)
    results = {}
    for mode in ("none", "auto", "early"):
        monkeypatch.setattr(attention, "_PDL", mode)
        rt = TreeAttentionRuntime(
            None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda",
            max_queries=rows, max_kv_entries=4 * pool, pool_slots=pool, stage1_launches=launches,
        )  # fmt: skip
        outs = [torch.empty(rows, hq, d, device="cuda", dtype=dtype) for _ in range(layers)]
        graph = capture_layers(rt, trees[0], q, ks, vs, outs)
        results[mode] = []
        for tree in trees[1:]:
            rt.plan(tree)
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            results[mode].append([o[: tree.n_queries].clone() for o in outs])
    for i, tree in enumerate(trees[1:]):
        ref = ft.reference_attention(q[: tree.n_queries], ks[-1], vs[-1], tree)
        assert ft.max_relative_error(results["auto"][i][-1], ref) <= TOL[dtype]
        for mode in ("auto", "early"):
            for a, b in zip(results[mode][i], results["none"][i], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
