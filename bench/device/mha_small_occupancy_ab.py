"""More MHA 16-row programs per SM (smaller KV tiles, register caps) at 2 warps: an A/B on the GPU.

At 2 warps and 3 stages (the default for MHA since v23) a 16-row launch with 64-token KV tiles
needs about 39 KB of shared memory, so 5 programs (10 warps) share an SM. This times the
MHA 16-row launches of the paper suite (default config) and of the Llama decode trees (the
refined export: 2 warps, 5 stages) as planned (``planned``) against the same launches with
``(BLOCK_N, num_stages, maxnreg)`` overrides, by CUDA-graph replay of each plan's stage-1
launches alone, the outputs compared with the planned launches' (poisoned with NaN first)::

    python3 bench/device/mha_small_occupancy_ab.py --out $OUT/mha_small_occupancy_ab.json
"""

from __future__ import annotations

import argparse

import torch

import fasttree as ft
from bench.common import geomean, write_device_result
from bench.stage1_ab import max_abs_diff, poisoned_outputs, run_launches, stage1_launches
from fasttree.export import read_export
from fasttree.toolkit.suite import paper_tree
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

D = 128
SCENARIOS = ("multi_document_qa", "few_shot", "multi_level_system_prompts", "chain_reasoning")
STEPS = (10, 25, 39)
#: name -> (BLOCK_N or None for the plan's, num_stages or None for the plan's, maxnreg or None)
VARIANTS = {
    "n32": (32, None, None),
    "cap128": (None, None, 128),
    "n32cap128": (32, None, 128),
    "n32cap96": (32, None, 96),
    "s2": (None, 2, None),
    "n32s2cap128": (32, 2, 128),
}


def override(launches, block_n, stages, maxnreg):
    out = []
    for kernel, grid, args, cx, w, s, cap in launches:
        if cx[3] <= 16:  # constexprs: (d, block_d, group, block_m, block_n, ...)
            cx = (*cx[:4], block_n or cx[4], *cx[5:])
            s, cap = stages or s, maxnreg
        out.append((kernel, grid, args, cx, w, s, cap))
    return out


def measure(plan, q, k, v) -> dict | None:
    out = torch.full_like(q, float("nan"))
    launches = stage1_launches(plan, q, k, v, out)
    if not any(cx[3] <= 16 for _, _, _, cx, _, _, _ in launches):
        return None
    ref = poisoned_outputs(lambda: run_launches(launches), plan, out)
    res = {"planned": graph_time_us(lambda: run_launches(launches))["median"], "diff": {},
           "classes": [(cx[3], cx[4], w, s, cap) for _, _, _, cx, w, s, cap in launches]}  # fmt: skip
    for name, (bn, st, cap) in VARIANTS.items():
        ls = override(launches, bn, st, cap)
        res["diff"][name] = max_abs_diff(ref, poisoned_outputs(lambda ls=ls: run_launches(ls), plan, out))
        res[name] = graph_time_us(lambda ls=ls: run_launches(ls))["median"]
    return res


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    todo = [("paper", f"{c}/mha", paper_tree(c), None) for c in range(1, 16)]
    config, _ = read_export("docs/tune/export_measured.json").lookup(
        gpu=torch.cuda.get_device_name(0), num_q_heads=32, num_kv_heads=32, head_dim=D, dtype=torch.float16
    )
    for scenario in SCENARIOS:
        steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
        todo += [("decode", f"llama {scenario} {i}", steps[i].tree, config) for i in STEPS]
    for group, name, tree, cfg in todo:
        gen = torch.Generator(device="cuda").manual_seed(len(rows))
        slots = tree.max_slot + 1
        q, k, v = randn(gen, tree.n_queries, 32, D), randn(gen, slots, 32, D), randn(gen, slots, 32, D)
        r = measure(ft.plan(tree, cfg, num_q_heads=32, num_kv_heads=32, head_dim=D), q, k, v)
        if r is None:
            continue
        rows.append({"set": group, "name": name, **r})
        print(f"{name}: planned {r['planned']:.1f} "
              + " ".join(f"{n}:{r[n] / r['planned']:.3f}" for n in VARIANTS), flush=True)  # fmt: skip
    summary = {}
    for group in ("paper", "decode"):
        sel = [r for r in rows if r["set"] == group]
        for n in VARIANTS:
            ratios = [r[n] / r["planned"] for r in sel]
            summary[f"{group}/{n}"] = {"geomean": geomean(ratios), "min": min(ratios), "max": max(ratios),
                                       "max_diff": max(r["diff"][n] for r in sel)}  # fmt: skip
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
