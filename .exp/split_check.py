"""Scratch: interpreter check of the split-KV unit against the library's stage 1."""
import math, sys
import numpy as np, torch
sys.path.insert(0, "/work/main")
sys.path.insert(0, "/work/main/.exp")
import fasttree as ft
import fasttree.attention as att
from tests.trees import random_tree
from split_unit import units_split_kernel

def run(seed, hq, hkv, d, split, dtype=torch.float16):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, max_nodes=12, max_len=150)
    plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    slots = tree.max_slot + 1
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tree.n_queries, hq, d, generator=g).to(dtype)
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    dev = plan.to("cpu")
    launches = att._launches(plan, dev, q, k, v, out, 1.0 / math.sqrt(d) * 1.4426950408889634)
    s1 = [e for e in launches if e[0] is att.tree_attention_units_kernel]
    part_o, part_lse = att._workspace(plan, q.device)
    rows = plan.n_partial_rows
    res = []
    for variant in (0, 1):
        for b in (out, part_o, part_lse): b.fill_(float("nan"))
        for kernel, grid, args, cx, w, st, _ in s1:
            if variant == 0:
                kernel[grid](*args, *cx, num_warps=w, num_stages=st)
            else:
                bn = max(cx[4], 16 * split)
                cx2 = (*cx[:4], bn, *cx[5:])
                units_split_kernel[grid](*args, *cx2, SPLIT=split, num_warps=w, num_stages=st)
        res.append((out.clone(), part_o[:rows].clone(), part_lse[:rows].clone()))
    worst = 0.0
    for a, b in zip(*res):
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        assert bool((fa == fb).all()), "finite pattern differs"
        if fa.any(): worst = max(worst, float((a[fa].float() - b[fa].float()).abs().max()))
    return worst, [(cx[3], cx[4], cx[5], cx[8]) for _, _, _, cx, _, _, _ in s1]

for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for hq, hkv, d in ((4, 4, 64), (8, 2, 64), (4, 1, 32)):
        for split in (2, 4):
            w, cls = run(seed, hq, hkv, d, split)
            print(seed, hq, hkv, d, split, f"{w:.2e}", cls, flush=True)
