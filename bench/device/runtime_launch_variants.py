"""The runtime's stage-1 launch variants vs tree_attention on the paper suite (GPU machine, one-off).

``python3 bench/device/runtime_launch_variants.py [heads] [name:cap,...]``: graph-replay medians, fp16,
head dim 128, one run.
Variants: ``l1`` one launch for both tile classes; ``l2`` one per class; ``l2cap1`` one per class with
the small class's launch capped at 168 registers (3 programs per SM at 4 warps); ``l2cap`` the same
cap on slot 0 too when its tile has <= 32 rows. Output at eacd0ca (before the cap became the
runtime's rule for MHA): ``docs/bench/h200/runtime_launches_ab_eacd0ca.log``.
"""

import functools
import json
import math
import os
import sys

import numpy as np
import torch

import fasttree as ft
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from fasttree.toolkit.timing import graph_time_us

D = 128
VARIANTS = {"l1": (1, (None, None)), "l2": (2, (None, None)), "l2cap1": (2, (None, 168)), "l2cap": (2, ("small", 168))}
if len(sys.argv) > 2:  # e.g. "l2cap1:168,l2cap128:128": one launch per class, small-tile caps
    VARIANTS = {name: (2, (None, int(cap))) for name, _, cap in (v.partition(":") for v in sys.argv[2].split(","))}
HEADS = sys.argv[1].split(",") if len(sys.argv) > 1 else sorted(PAPER_HEADS)
trees = {c: paper_tree(c) for c in sorted(PAPER_SUITE)}
pool = max(t.max_slot for t in trees.values()) + 1
rows_max = max(t.n_queries for t in trees.values())
gen = torch.Generator(device="cuda").manual_seed(0)
rows = []
for heads in HEADS:
    hq, hkv = PAPER_HEADS[heads]
    k = torch.randn(pool, hkv, D, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(pool, hkv, D, device="cuda", dtype=torch.float16, generator=gen)
    q_all = torch.randn(rows_max, hq, D, device="cuda", dtype=torch.float16, generator=gen)
    out_all = torch.empty_like(q_all)
    runtimes = {}
    for name, (launches, caps) in VARIANTS.items():
        rt = TreeAttentionRuntime(
            None, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16, device="cuda",
            max_queries=rows_max, max_kv_entries=4 * pool, max_units=1 << 16, pool_slots=pool,
            stage1_launches=launches,
        )  # fmt: skip
        cap0 = (168 if rt.slots[0][0] <= 32 else None) if caps[0] == "small" else caps[0]
        rt._maxnreg = [cap0, caps[1]]
        runtimes[name] = rt
    for case, tree in trees.items():
        n = tree.n_queries
        q, out = q_all[:n], out_all[:n]
        plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
        base = graph_time_us(functools.partial(ft.tree_attention, q, k, v, plan, out=out))["median"]
        sample = np.sort(np.random.default_rng(case).choice(n, size=min(n, 64), replace=False))
        ref = ft.reference_attention(q, k, v, tree, queries=sample)
        row = {"case": case, "heads": heads, "tree_attention_us": base, "us": {}, "programs": {}, "err": 0.0}
        for name, rt in runtimes.items():
            rt.plan(tree)
            out_all.fill_(float("nan"))
            rt.forward(q_all, k, v, out=out_all)
            err = ft.max_relative_error(out_all[torch.as_tensor(sample, device="cuda")], ref)
            row["err"] = max(row["err"], err)
            row["us"][name] = graph_time_us(functools.partial(rt.forward, q_all, k, v, out=out_all))["median"]
            row["programs"][name] = list(rt._programs)
        rows.append(row)
        times = " ".join(f"{k} {v:.1f}" for k, v in row["us"].items())
        print(f"{case}/{heads}: ta {base:.1f} {times} err {row['err']:.1e} progs {row['programs']}", flush=True)
for h in ["gqa16", "gqa4", "mha", None]:
    sel = [r for r in rows if h is None or r["heads"] == h]
    geo = {
        name: math.exp(np.mean([math.log(r["us"][name] / r["tree_attention_us"]) for r in sel])) for name in VARIANTS
    }
    print(h or "all", {name: round(g, 3) for name, g in geo.items()})
with open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_ab.json"), "w") as f:
    json.dump(rows, f, indent=1)
