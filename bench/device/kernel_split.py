"""Per-kernel GPU times (torch.profiler) of tree_attention vs the runtime's launches on some suite cases.

One-off diagnosis (GPU machine): ``python3 bench/device/kernel_split.py``; its output at eacd0ca is
``docs/bench/h200/kernel_split_runtime_eacd0ca.log`` (it stopped at 1/gqa16 on a capacity error).
"""

import collections
import functools
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fasttree as ft
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree

D = 128
CASES = [(1, "mha"), (6, "mha"), (9, "mha"), (11, "mha"), (8, "mha"), (5, "mha"), (1, "gqa16"), (4, "gqa16")]


def kernel_times(fn, n=30):
    """Mean GPU time per call (us) and launches per call of every kernel ``fn`` runs."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    total, count = collections.defaultdict(float), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            count[e.name] += 1
    return {name[:48]: (total[name] / n, count[name] // n) for name in total}


for case, heads in CASES:
    hq, hkv = PAPER_HEADS[heads]
    tree = paper_tree(case)
    n, pool = tree.n_queries, tree.max_slot + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(pool, hkv, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    q = torch.randn(n, hq, D, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty_like(q)
    plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
    classes = [(c.block_m, c.block_n, c.masked, c.num_warps) for c in plan.tile_classes]
    print(f"== {case}/{heads}: classes {classes} units {plan.class_unit_ptr} partial rows {plan.n_partial_rows}")
    dev_plan = plan.to("cuda")
    for name, (t, c) in sorted(kernel_times(functools.partial(ft.tree_attention, q, k, v, dev_plan, out=out)).items()):
        print(f"   tree_attention {name:48s} {t:8.1f} us x{c}")
    for launches in (1, 2):
        rt = TreeAttentionRuntime(
            None, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16, device="cuda",
            max_queries=n, max_kv_entries=16 * pool, max_units=1 << 16, pool_slots=pool, stage1_launches=launches,
        )  # fmt: skip
        rt.plan(tree)
        for name, (t, c) in sorted(kernel_times(functools.partial(rt.forward, q, k, v, out=out)).items()):
            print(f"   runtime l{launches} {name:48s} {t:8.1f} us x{c}  programs {rt._programs}")
    sys.stdout.flush()
