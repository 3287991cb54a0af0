"""A sample of kernel launches for ``compute-sanitizer --tool memcheck`` on the device.

Run: ``compute-sanitizer --tool memcheck --error-exitcode 99 python tests/memcheck_sample.py``.
Covers both tile classes, merge and direct writes, GQA 7, D 256, bf16, KV tiles of 64
and 128 (masked index loads), a pool exactly as large as the tree, the query-separated
plan, every tile class peeled (unmasked whole KV tiles, head dim 96 padded to 128), the
runtime's persistent kernels (int32 offsets, peeled 64-row slot), the runtime over a small
simulated server's steps, an all-large MHA plan at D 256, the fixed runtime at D 256 (the
wide-head KV-tile cap) and, on sm_90, the Gluon stage 1 (``PlanRules.sm90_stage1``) at head dim
128, GQA 4, 8 and 16, fp16 and bf16, packed and not. ``bench/gpu_check.sh`` runs memcheck with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every tensor its own allocation, so a write past a tensor is
an error, not a write into its neighbour in the caching allocator's segment.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # the repository root: bench (for tiny_server_trees)
from runtime_checks import run_poisoned
from trees import random_tree, tiny_server_trees

import fasttree as ft
from fasttree.toolkit.suite import paper_tree

#: The rules with the sm_90 Gluon stage 1 on (its 64-row classes; the Triton kernel elsewhere).
SM90 = ft.PlanRules.defaults().with_(sm90_stage1=True)
#: A config without packed units (the Gluon kernel's unmasked path).
UNPACKED = ft.FastTreeConfig(pack_tokens=0)


def run(tree, hq, hkv, d, dtype, config=None, query_separated=False, rules=None) -> float:
    gen = torch.Generator().manual_seed(0)
    pool = tree.max_slot + 1  # exactly the tree: any over-read of K/V is out of bounds
    q = torch.randn(tree.n_queries, hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(pool, hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(pool, hkv, d, generator=gen).to(dtype).cuda()
    if query_separated:
        plan = ft.plan_query_separated(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    else:
        plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rules=rules)
    out = ft.tree_attention(q, k, v, plan)
    torch.cuda.synchronize()
    rows = np.arange(min(tree.n_queries, 16))
    ref = ft.reference_attention(q, k, v, tree, queries=rows)
    return float((out[: rows.size].double() - ref).norm() / ref.norm())


def run_peeled(tree, hq, hkv, d, dtype) -> float:
    """Every stage-1 launch peels its tail tile (``PEEL`` forced on, unmasked whole KV tiles), as
    :func:`run` checks it."""
    from fasttree import attention, launcher
    from fasttree.launch_rules import GpuTarget

    gen = torch.Generator().manual_seed(0)
    pool = tree.max_slot + 1
    q = torch.randn(tree.n_queries, hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(pool, hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(pool, hkv, d, generator=gen).to(dtype).cuda()
    plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    out = torch.full_like(q, float("nan"))
    qk_scale = attention.LOG2E / d**0.5
    target = GpuTarget.of(q.device, False)
    for kernel, grid, args, constexprs, warps, stages, maxnreg in attention.plan_launches(
        plan, plan.to(q.device), q, k, v, out, qk_scale, target
    ):
        if kernel is attention.tree_attention_units_kernel:
            constexprs = (*constexprs[:8], True, *constexprs[9:])  # PEEL
        launcher.launch(kernel, grid, args, constexprs, warps, stages, maxnreg)
    torch.cuda.synchronize()
    rows = np.arange(min(tree.n_queries, 16))
    ref = ft.reference_attention(q, k, v, tree, queries=rows)
    return float((out[: rows.size].double() - ref).norm() / ref.norm())


def run_runtime(tree, hq, hkv, d, dtype, max_variants: int = 32) -> float:
    """The runtime's launches (launch variants, or the fixed launch with ``max_variants=0``) on a pool
    exactly as large as the tree."""
    gen = torch.Generator().manual_seed(0)
    pool = tree.max_slot + 1
    q = torch.randn(tree.n_queries, hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(pool, hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(pool, hkv, d, generator=gen).to(dtype).cuda()
    rt = ft.TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device=q.device, max_queries=tree.n_queries,
        max_kv_entries=8 * pool + int(tree.path_lengths[tree.query_nodes].sum()), max_units=1 << 14,
        max_partial_rows=64 * tree.n_queries, pool_slots=pool, max_variants=max_variants,
    )  # fmt: skip
    rt.plan(tree)
    out = rt.forward(q, k, v)
    torch.cuda.synchronize()
    rows = np.arange(min(tree.n_queries, 16))
    ref = ft.reference_attention(q, k, v, tree, queries=rows)
    return float((out[: rows.size].double() - ref).norm() / ref.norm())


def run_runtime_serving(hq, hkv, d, dtype, max_variants: int = 4, device: str = "cuda") -> float:
    """The runtime over a small simulated server's steps (fresh and extended plans, variants reused
    across batch sizes), ``out`` exactly ``max_queries`` rows (12, not a multiple of the plan
    arrays' 32-word alignment: a merge program sent to the filler query would write past it) and
    the pool exactly as large as the steps' slots; the worst relative error over the steps."""
    trees = tiny_server_trees()
    rows = max(t.n_queries for t in trees)
    pool = max(t.max_slot for t in trees) + 1
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(pool, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(pool, hkv, d, generator=gen).to(dtype).to(device)
    rt = ft.TreeAttentionRuntime(
        ft.FastTreeConfig(pack_tokens=16, pack_min_units=0), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        dtype=dtype, device=q.device, max_queries=rows, max_kv_entries=4096, pool_slots=pool,
        max_variants=max_variants,
    )  # fmt: skip
    worst = 0.0
    for tree in trees:
        rt.plan(tree, rows=rows)
        worst = max(worst, run_poisoned(rt, tree, q, k, v, rows))
    return worst


#: Two queries whose MHA plan at head dim 256 is all-large (its small phase has too few units).
ALL_LARGE_TREE = ft.KVTree.from_lengths([-1, 0, 1, 0, 3], [134, 1, 79, 171, 111], [2, 4])


def main() -> int:
    rng = np.random.default_rng(0)
    cases = [
        ("suite 1 mha", lambda: run(paper_tree(1), 32, 32, 128, torch.float16)),
        ("suite 8 gqa16", lambda: run(paper_tree(8), 16, 1, 128, torch.float16)),
        (
            "suite 9 gqa4 kv tile 128",
            lambda: run(paper_tree(9), 32, 8, 128, torch.float16, ft.FastTreeConfig(kv_tile=(128, 64))),
        ),
        ("suite 6 query-separated", lambda: run(paper_tree(6), 16, 1, 128, torch.float16, query_separated=True)),
        ("forest gqa7 d256 bf16", lambda: run(random_tree(rng, max_nodes=80, max_len=700), 14, 2, 256, torch.bfloat16)),
        ("forest gqa1 d64", lambda: run(random_tree(rng, max_nodes=80, max_len=700), 4, 4, 64, torch.float16)),
        (
            "forest gqa4 d96 every class peeled",
            lambda: run_peeled(random_tree(rng, max_nodes=80, max_len=700), 8, 2, 96, torch.float16),
        ),
        (
            "forest gqa1 d128 peeled MHA",
            lambda: run_peeled(random_tree(rng, max_nodes=60, max_len=500), 4, 4, 128, torch.bfloat16),
        ),
        ("runtime gqa4 d128", lambda: run_runtime(random_tree(rng, max_nodes=80, max_len=700), 8, 2, 128, torch.half)),
        ("runtime gqa1 d64", lambda: run_runtime(random_tree(rng, max_nodes=60, max_len=500), 4, 4, 64, torch.half)),
        (
            "fixed runtime gqa4 d128",
            lambda: run_runtime(random_tree(rng, max_nodes=80, max_len=700), 8, 2, 128, torch.half, max_variants=0),
        ),
        (
            "fixed runtime gqa1 d64",
            lambda: run_runtime(random_tree(rng, max_nodes=60, max_len=500), 4, 4, 64, torch.half, max_variants=0),
        ),
        ("runtime serving gqa4 d128", lambda: run_runtime_serving(8, 2, 128, torch.half)),
        ("fixed runtime serving gqa16 d64", lambda: run_runtime_serving(16, 1, 64, torch.half, max_variants=0)),
        (  # class 1 of 64-row tiles at the large class's 4 warps, 32-token KV tiles (the wide-head cap)
            "all-large mha d256 bf16",
            lambda: run(ALL_LARGE_TREE, 2, 2, 256, torch.bfloat16),
        ),
        (  # the fixed launch slots with the wide-head cap
            "fixed runtime gqa8 d256 bf16",
            lambda: run_runtime(random_tree(rng, max_nodes=60, max_len=500), 8, 1, 256, torch.bfloat16, max_variants=0),
        ),
        # the sm_90 Gluon stage 1 (PlanRules.sm90_stage1) on its 64-row classes (head dim 128)
        ("sm90 stage 1 suite 8 gqa16", lambda: run(paper_tree(8), 16, 1, 128, torch.float16, rules=SM90)),
        (
            "sm90 stage 1 forest gqa8 d128 bf16",
            lambda: run(random_tree(rng, max_nodes=80, max_len=700), 16, 2, 128, torch.bfloat16, rules=SM90),
        ),
        (
            "sm90 stage 1 forest gqa16 d128 bf16",
            lambda: run(random_tree(rng, max_nodes=80, max_len=700), 32, 2, 128, torch.bfloat16, rules=SM90),
        ),
        (
            "sm90 stage 1 forest gqa4 d128 unpacked",
            lambda: run(random_tree(rng, max_nodes=80, max_len=700), 16, 4, 128, torch.float16, UNPACKED, rules=SM90),
        ),
    ]
    worst = 0.0
    for name, fn in cases:
        err = fn()
        worst = max(worst, err)
        print(f"{name}: relative error {err:.2e}")
    print(f"memcheck sample done, worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
