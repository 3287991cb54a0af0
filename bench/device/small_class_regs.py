"""tree_attention with the small tile class's launch capped at fewer registers (more programs per SM).

One-off A/B on the GPU machine: ``python3 bench/device/small_class_regs.py [cases] [heads]``. Every
launch of ``tree_attention_units_kernel`` with a 16-row tile gets ``maxnreg`` = cap (None: the
compiler's 159 at 4 warps, 3 programs per SM); caps 128 and 96 allow 4 and 5. CUDA-graph replay
medians of the default plan in one run, outputs checked against the float64 reference.
"""

import functools
import math
import sys

import numpy as np
import torch

import fasttree as ft
from fasttree import attention
from fasttree.kernels import tree_attention_units_kernel
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from fasttree.toolkit.timing import graph_time_us

D = 128
CAPS = (None, 128, 96)
cases = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else sorted(PAPER_SUITE)
heads_list = sys.argv[2].split(",") if len(sys.argv) > 2 else ["mha", "gqa4", "gqa16"]
_original = attention._launch
state = {"cap": None}


def capped_launch(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg=None, *rest, **kw):
    # constexprs of the units kernel: HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_N, MASKED, UPCAST_DOT
    if kernel is tree_attention_units_kernel and constexprs[3] <= 16 and state["cap"] is not None:
        maxnreg = state["cap"]
    return _original(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg, *rest, **kw)


attention._launch = capped_launch
ratios = {c: [] for c in CAPS[1:]}
for heads in heads_list:
    hq, hkv = PAPER_HEADS[heads]
    for case in cases:
        tree = paper_tree(case)
        n, pool = tree.n_queries, tree.max_slot + 1
        gen = torch.Generator(device="cuda").manual_seed(case)
        k, v = (torch.randn(pool, hkv, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
        q = torch.randn(n, hq, D, device="cuda", dtype=torch.float16, generator=gen)
        plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
        sample = np.sort(np.random.default_rng(case).choice(n, size=min(n, 64), replace=False))
        ref = ft.reference_attention(q, k, v, tree, queries=sample)
        times = {}
        for cap in CAPS:
            state["cap"] = cap
            plan._device_cache.clear()  # drop the cached direct launchers: the next call goes through _launch
            out = torch.full_like(q, float("nan"))
            ft.tree_attention(q, k, v, plan, out=out)
            err = ft.max_relative_error(out[torch.as_tensor(sample, device="cuda")], ref)
            times[cap] = graph_time_us(functools.partial(ft.tree_attention, q, k, v, plan, out=out))["median"]
            assert err < 2e-3, (case, heads, cap, err)
        for cap in CAPS[1:]:
            ratios[cap].append(times[cap] / times[None])
        cells = " ".join(f"cap{c}={t:.1f}" for c, t in times.items())
        print(f"{case}/{heads}: {cells} units/class {plan.units_per_class()}", flush=True)
    for cap in CAPS[1:]:
        sel = ratios[cap][-len(cases) :]
        print(f"{heads} cap {cap}: geomean time ratio {math.exp(np.mean(np.log(sel))):.3f}", flush=True)
for cap in CAPS[1:]:
    print(f"all cap {cap}: geomean time ratio {math.exp(np.mean(np.log(ratios[cap]))):.3f}")
