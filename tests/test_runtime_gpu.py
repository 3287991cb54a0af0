"""TreeAttentionRuntime on the GPU (``pytest -m gpu``): CUDA-graph capture once, replay with a new tree
every step, against a fresh eager call and the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attention import TOL
from trees import random_tree

import fasttree as ft
from fasttree.launch_variants import launch_variant
from fasttree.runtime import StepGraphs, TreeAttentionRuntime
from fasttree.toolkit.workloads import iter_serving

pytestmark = pytest.mark.gpu

_SAMPLED = 64


def _check(out, q, k, v, tree, dtype, seed) -> float:
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(tree.n_queries, size=min(tree.n_queries, _SAMPLED), replace=False))
    ref = ft.reference_attention(q, k, v, tree, queries=rows)
    err = ft.max_relative_error(out[torch.as_tensor(rows, device=out.device)], ref)
    assert err <= TOL[dtype], err
    return err


def capture_layers(rt: TreeAttentionRuntime, tree, q, ks, vs, outs) -> torch.cuda.CUDAGraph:
    """Plan ``tree``, run one eager step (``rt.forward`` for every layer's pools into ``outs``,
    which compiles the kernels) and return the same step captured as a CUDA graph."""

    def step():
        for k, v, out in zip(ks, vs, outs, strict=True):
            rt.forward(q, k, v, out=out)

    rt.plan(tree)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.parametrize("scenario", ["few_shot", "multi_document_qa", "chain_reasoning", "multi_level_system_prompts"])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("launches", [1, 2])
def test_graph_replay_with_a_new_tree_every_step(scenario, heads, launches):
    """The fixed launch (max_variants=0): three layers captured once; each later step plans a new
    tree and replays the graph."""
    hq, hkv = heads
    d, dtype, layers, rows = 128, torch.float16, 3, 256
    trees = [s.tree for s in iter_serving(scenario, seed=3, steps=40)][::8]
    pool = max(t.max_slot for t in trees) + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    ks = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    vs = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    q = torch.empty(rows, hq, d, device="cuda", dtype=dtype)
    outs = [torch.empty(rows, hq, d, device="cuda", dtype=dtype) for _ in range(layers)]
    rt = TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda",
        max_queries=rows, max_kv_entries=4 * pool, pool_slots=pool, stage1_launches=launches, max_variants=0,
    )  # fmt: skip

    q.normal_(generator=gen)
    graph = capture_layers(rt, trees[0], q, ks, vs, outs)
    for i, tree in enumerate(trees[1:]):
        info = rt.plan(tree)
        assert info.variant_id == 0
        q.normal_(generator=gen)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = tree.n_queries
        for layer in range(layers):
            eager = torch.full_like(outs[layer], float("nan"))
            rt.forward(q, ks[layer], vs[layer], out=eager)
            assert torch.equal(outs[layer][:n], eager[:n]), (i, layer)
            fresh = ft.tree_attention(q[:n], ks[layer], vs[layer], info.plan)
            assert ft.max_relative_error(outs[layer][:n], fresh) <= TOL[dtype]
            _check(outs[layer][:n], q[:n], ks[layer], vs[layer], tree, dtype, seed=i * layers + layer)


@pytest.mark.parametrize("scenario", ["few_shot", "multi_document_qa", "chain_reasoning", "multi_level_system_prompts"])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "dtype"),
    [
        (32, 32, 128, torch.float16),
        (32, 8, 128, torch.float16),
        (16, 1, 128, torch.bfloat16),
        (28, 4, 64, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("max_variants", [32, 2])
def test_variant_graphs_replay_a_new_tree_every_step(scenario, hq, hkv, d, dtype, max_variants):
    """Launch variants: StepGraphs captures one graph of three layers per variant met and replays
    the one of each step's plan; every replay of a plan's own variant equals tree_attention on the
    same plan bit for bit (same kernels, tiles and order), and every replay the reference. With
    max_variants=2 most plans run a covering variant or a new id that replaces the least recently
    used variant (its graph is never replayed again), in the same graphs object."""
    layers, rows = 3, 256
    trees = [s.tree for s in iter_serving(scenario, seed=3, steps=60)][::3]
    pool = max(t.max_slot for t in trees) + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    ks = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    vs = [torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers)]
    q = torch.empty(rows, hq, d, device="cuda", dtype=dtype)
    outs = [torch.empty(rows, hq, d, device="cuda", dtype=dtype) for _ in range(layers)]
    rt = TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda", max_queries=rows,
        max_kv_entries=max(int(t.path_lengths[t.query_nodes].sum()) for t in trees), pool_slots=pool,
        query_centric="never", max_variants=max_variants,
    )  # fmt: skip

    def step():
        for k, v, out in zip(ks, vs, outs, strict=True):
            rt.forward(q, k, v, out=out)

    graphs = StepGraphs(step, [rt])
    ids = set()
    for i, tree in enumerate(trees):
        info = rt.plan(tree)
        ids.add(info.variant_id)
        q.normal_(generator=gen)
        for o in outs:
            o.fill_(float("nan"))
        graphs.replay()
        torch.cuda.synchronize()
        n = tree.n_queries
        assert len(rt.variants) <= max_variants
        for layer in range(layers):
            fresh = ft.tree_attention(q[:n], ks[layer], vs[layer], info.plan)
            if info.variant_id and info.variant == launch_variant(info.plan, rt._target):
                assert torch.equal(outs[layer][:n], fresh), (i, layer)
            else:
                assert ft.max_relative_error(outs[layer][:n], fresh) <= TOL[dtype]
            assert torch.isnan(outs[layer][n:]).all()
            _check(outs[layer][:n], q[:n], ks[layer], vs[layer], tree, dtype, seed=i * layers + layer)
    assert len(graphs) == len(ids) == graphs.captures
    assert len(ids) > 1  # the steps met several variants


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(16, 16, 64), (32, 8, 128), (28, 4, 128), (32, 4, 256), (16, 1, 128)])
@pytest.mark.parametrize(("launches", "max_variants"), [(1, 0), (2, 0), ("auto", 32)])
def test_random_forests_through_one_runtime(hq, hkv, d, dtype, launches, max_variants):
    rng = np.random.default_rng(hq * 1000 + hkv * 10 + d)
    rt = TreeAttentionRuntime(
        ft.FastTreeConfig(kv_tile=(32, 32)) if d == 256 else None,
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda",
        max_queries=512, max_kv_entries=1 << 17, pool_slots=1 << 16, stage1_launches=launches,
        max_variants=max_variants,
    )  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(1 << 16, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1 << 16, hkv, d, device="cuda", dtype=dtype, generator=gen)
    q = torch.randn(512, hq, d, device="cuda", dtype=dtype, generator=gen)
    for i in range(6):
        tree = random_tree(rng, max_nodes=60, max_len=900)
        if tree.n_queries > 512 or tree.max_slot >= 1 << 16:
            continue
        rt.plan(tree)
        out = torch.full_like(q, float("nan"))
        rt.forward(q, k, v, out=out)
        n = tree.n_queries
        assert torch.isnan(out[n:]).all()
        _check(out[:n], q[:n], k, v, tree, dtype, seed=i)


def test_one_graph_per_batch_bucket():
    """Graphs captured for batch buckets 64 and 256 on slices of one buffer; each step plans with rows=bucket."""
    hq, hkv, d, dtype = 32, 8, 128, torch.float16
    large = [s.tree for s in iter_serving("few_shot", seed=5, steps=30)][::10]
    small = [s.tree for s in iter_serving("few_shot", seed=6, steps=30, max_batch=48)][::10]
    assert max(t.n_queries for t in small) <= 64 < min(t.n_queries for t in large)
    trees = large + small
    pool = max(t.max_slot for t in trees) + 1
    gen = torch.Generator(device="cuda").manual_seed(2)
    k = torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen)
    q = torch.randn(256, hq, d, device="cuda", dtype=dtype, generator=gen)
    out = torch.empty_like(q)
    rt = TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda",
        max_queries=256, max_kv_entries=4 * pool, pool_slots=pool, max_variants=0,
    )  # fmt: skip
    graphs = {}
    for bucket in (64, 256):
        rt.plan(small[0], rows=bucket)
        rt.forward(q[:bucket], k, v, out=out[:bucket])
        torch.cuda.synchronize()
        graphs[bucket] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bucket]):
            rt.forward(q[:bucket], k, v, out=out[:bucket])
    for i, tree in enumerate([small[0], large[0], small[1], large[1], small[2], large[2]]):
        bucket = 64 if tree.n_queries <= 64 else 256
        rt.plan(tree, rows=bucket)
        out.fill_(float("nan"))
        graphs[bucket].replay()
        torch.cuda.synchronize()
        n = tree.n_queries
        _check(out[:n], q[:n], k, v, tree, dtype, seed=100 + i)


def test_buffers_larger_than_the_device_are_refused_before_allocating():
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    rows = total // (32 * 129 * 4) + 1  # fp32 partials of 32 heads x 128 dims alone exceed the device
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(ValueError, match="max_partial_rows"):
        TreeAttentionRuntime(
            None, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.float16, device="cuda",
            max_queries=64, max_kv_entries=4096, max_partial_rows=int(rows),
        )  # fmt: skip
    assert torch.cuda.memory_allocated() == allocated
