"""MHA's 16-row tile class at 2 warps instead of 4 (the default config's ``num_warps[1]``): an A/B on the GPU.

The v10 warps sweep (``docs/bench/sweep_h200_v10_warps_0b92d40.md``) found 2 warps on the
small class 0.80-0.91x the time on several MHA cases but 1.35x on 6/gqa16, so the default
stayed at 4; v13 then gave 4-warp MHA launches a 128-register cap where it saves a wave
(:func:`fasttree.attention.small_tile_maxnreg`), and the Llama serving export took 2 warps
and 5 stages for its small class. This times, on the 15 MHA paper cases, the default config
against small-class settings ``(num_warps[1], num_stages[1])`` of (2, 3), (2, 4), (2, 5),
(2, 6), by CUDA-graph replay of whole ``tree_attention`` calls checked against the float64
reference::

    python3 bench/device/mha_small_warps_ab.py --out $OUT/mha_small_warps_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses

import fasttree as ft
from bench.common import checked_graph_time, geomean, random_case, write_device_result
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree

D = 128
#: name -> small class (num_warps, num_stages); the large class keeps the default's
VARIANTS = {"w2s3": (2, 3), "w2s4": (2, 4), "w2s5": (2, 5), "w2s6": (2, 6)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    base = ft.FastTreeConfig()
    rows = []
    for heads in ("mha", "gqa4"):
        hq, hkv = PAPER_HEADS[heads]
        for case in range(1, 16):
            tree = paper_tree(case)
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=case, samples=16)
            row = {"case": case, "heads": heads}
            row["default"] = checked_graph_time(ft.plan(tree, base, num_q_heads=hq, num_kv_heads=hkv, head_dim=D),
                                                q, k, v, sample, ref)  # fmt: skip
            for name, (w, s) in VARIANTS.items():
                cfg = dataclasses.replace(base, num_warps=(base.num_warps[0], w), num_stages=(base.num_stages[0], s))
                plan = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
                row[name] = checked_graph_time(plan, q, k, v, sample, ref)
            rows.append(row)
            b = row["default"]["graph_us"]
            print(f"{case}/{heads}: default {b:.1f} "
                  + " ".join(f"{n}:{row[n]['graph_us'] / b:.3f}" for n in VARIANTS), flush=True)  # fmt: skip
    summary = {}
    for heads in ("mha", "gqa4"):
        sel = [r for r in rows if r["heads"] == heads]
        for n in VARIANTS:
            ratios = [r[n]["graph_us"] / r["default"]["graph_us"] for r in sel]
            summary[f"{heads}/{n}"] = {"geomean": geomean(ratios), "min": min(ratios), "max": max(ratios),
                                       "max_err": max(r[n]["err"] for r in sel)}  # fmt: skip
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
