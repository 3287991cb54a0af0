"""16-row tiles with each KV tile split across the warps (``KV_SPLIT``): an A/B on the GPU.

The 16-row tile class (MHA packed units, the Llama decode trees; GQA 4 small units) runs at
about 0.70 of the HBM floor. Its warps split the tile's KV columns of one 16-row matrix, so
every KV tile needs the row maxima and sums exchanged across warps and the P operand moved
through shared memory (9 barriers per tile in the sm_90 PTX at 2 or 4 warps). With
``KV_SPLIT = num_warps`` the kernel runs the tile as a batched (3-D) dot, one batch per warp
over its own run of the tile's entries with its own softmax state, combined once per unit
(2 barriers per tile, no shared-memory stores; registers 187-255 instead of 148-196).

This times, by CUDA-graph replay of each plan's stage-1 launches alone, the library's 16-row
launches as planned (``production``: the config's warps, stages and KV tile, the register
cap of :func:`fasttree.attention.small_tile_maxnreg`) against the same launches with
``KV_SPLIT`` at several warps / stages / KV tiles (no register cap), on

* the 45 paper cases (default config) and
* the Llama (32/32) and Mistral (32/8) decode trees of the four serving scenarios (steps 10,
  25, 39; the refined export's configs).

Outputs (direct rows, partial rows and LSEs) of every variant are compared with production's
on the same inputs (poisoned with NaN before each run)::

    python3 bench/device/split_warps_ab.py --out $OUT/split_warps_ab.json

Result (``docs/bench/h200/split_warps_ab_fbd7fef.json``): slower. The decode trees' stage 1
took 1.22x production's time at 2 warps (Llama 1.06-1.26x, Mistral 1.23-1.57x) and 1.52x at
4; the paper suite 1.06x at 2 warps (MHA 11-15 0.90-0.94x, where the v10 sweep found plain
2-warp tiles 0.80-0.87x) and 1.35x at 4. Each warp holding the whole 16-row accumulator and
query tile costs more than the per-tile exchange saved. The kernel's ``KV_SPLIT`` was removed
after this run: rerun it at commit fbd7fef.
"""

from __future__ import annotations

import argparse
import math

import torch

import fasttree as ft
from bench.common import geomean, write_device_result
from fasttree import attention as att
from fasttree.export import read_export
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

D = 128
MODELS = {"llama": (32, 32), "mistral": (32, 8)}
SCENARIOS = ("multi_document_qa", "few_shot", "multi_level_system_prompts", "chain_reasoning")
STEPS = (10, 25, 39)
#: name -> (num_warps, num_stages or None for the config's, BLOCK_N or None for the plan's); KV_SPLIT = num_warps
VARIANTS = {
    "w2": (2, None, None),
    "w4": (4, None, None),
    "w2s3": (2, 3, None),
    "w2s5": (2, 5, None),
    "w4s2": (4, 2, None),
    "w4s3": (4, 3, None),
    "w4s4": (4, 4, None),
    "w4n128": (4, 3, 128),
    "w8n128": (8, 3, 128),
}


def stage1(plan, q, k, v, out):
    launches = att._launches(plan, plan.to(q.device), q, k, v, out, 1.0 / math.sqrt(D) * 1.4426950408889634)
    return [e for e in launches if e[0] is att.tree_attention_units_kernel]


def split_launches(launches, warps, stages, block_n):
    """The 16-row launches with KV_SPLIT = warps (BLOCK_N at least 16 per split), the rest unchanged."""
    out = []
    for kernel, grid, args, cx, w, s, maxnreg in launches:
        if cx[3] <= 16:  # constexprs: (d, block_d, group, block_m, block_n, ..., KV_SPLIT last)
            bn = max(block_n or cx[4], 16 * warps)
            cx, w, s, maxnreg = (*cx[:4], bn, *cx[5:-1], warps), warps, stages or s, None
        out.append((kernel, grid, args, cx, w, s, maxnreg))
    return out


def run(launches):
    for kernel, grid, args, cx, w, s, maxnreg in launches:
        att._launch(kernel, grid, args, cx, w, s, maxnreg)


def snapshot(bufs, rows):
    out, part_o, part_lse = bufs
    return out.clone(), part_o[:rows].clone(), part_lse[:rows].clone()


def max_diff(a, b):
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if not bool((torch.isfinite(x) == torch.isfinite(y)).all()):
            return float("inf")
        fin = torch.isfinite(x)
        if fin.any():
            worst = max(worst, float((x[fin].float() - y[fin].float()).abs().max()))
    return worst


def measure(plan, q, k, v) -> dict | None:
    out = torch.full_like(q, float("nan"))
    launches = stage1(plan, q, k, v, out)
    if not any(cx[3] <= 16 for _, _, _, cx, _, _, _ in launches):
        return None
    part_o, part_lse = att._workspace(plan, q.device)
    bufs, rows = (out, part_o, part_lse), plan.n_partial_rows

    def poisoned(ls):
        for b in bufs:
            b.fill_(float("nan"))
        run(ls)
        torch.cuda.synchronize()
        return snapshot(bufs, rows)

    ref = poisoned(launches)
    res = {"production": graph_time_us(lambda: run(launches))["median"], "diff": {}}
    res["classes"] = [(cx[3], cx[4], w, s, maxnreg) for _, _, _, cx, w, s, maxnreg in launches]
    for name, (w, s, bn) in VARIANTS.items():
        ls = split_launches(launches, w, s, bn)
        try:
            res["diff"][name] = max_diff(ref, poisoned(ls))
            res[name] = graph_time_us(lambda ls=ls: run(ls))["median"]
        except Exception as exc:  # e.g. shared memory beyond the SM's: recorded
            res[name] = float("nan")
            res["diff"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return res


def line(tag, r):
    base = r["production"]
    return f"{tag}: prod {base:.1f} " + " ".join(f"{n}:{r[n] / base:.3f}" for n in VARIANTS)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--skip-paper", action="store_true")
    args = p.parse_args()
    rows = []
    if not args.skip_paper:
        for case in range(1, 16):
            tree = paper_tree(case)
            for heads, (hq, hkv) in PAPER_HEADS.items():
                gen = torch.Generator(device="cuda").manual_seed(case)
                slots = tree.max_slot + 1
                q = torch.randn(tree.n_queries, hq, D, generator=gen, device="cuda", dtype=torch.float16)
                k = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
                v = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
                r = measure(ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=D), q, k, v)
                if r is not None:
                    rows.append({"set": "paper", "case": case, "heads": heads, **r})
                    print(line(f"{case}/{heads}", r), flush=True)
    export = read_export("docs/tune/export_measured.json")
    gpu = torch.cuda.get_device_name(0)
    for model, (hq, hkv) in MODELS.items():
        config, _ = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16)
        for scenario in SCENARIOS:
            steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
            for i in STEPS:
                tree = steps[i].tree
                gen = torch.Generator(device="cuda").manual_seed(i)
                slots = tree.max_slot + 1
                q = torch.randn(tree.n_queries, hq, D, generator=gen, device="cuda", dtype=torch.float16)
                k = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
                v = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
                r = measure(ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D), q, k, v)
                if r is not None:
                    rows.append({"set": "decode", "model": model, "scenario": scenario, "step": i, **r})
                    print(line(f"{model} {scenario} {i}", r), flush=True)
    summary = {}
    for group in ("paper", "decode"):
        sel = [r for r in rows if r["set"] == group]
        for name in VARIANTS:
            ratios = [r[name] / r["production"] for r in sel if r[name] == r[name]]
            errs = [r["diff"][name] for r in sel if isinstance(r["diff"][name], float)]
            summary[f"{group}/{name}"] = {
                "geomean_ratio": geomean(ratios), "min_ratio": min(ratios, default=None),
                "max_ratio": max(ratios, default=None), "n": len(ratios), "max_diff": max(errs, default=None),
            }  # fmt: skip
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
