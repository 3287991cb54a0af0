"""Plan variants of the small GQA-16 paper cases by CUDA-graph replay (one device call).

6/gqa16 is the one paper case slower than the published kernel (v19: 13.0 vs 12.7 us): a
64-row all-large plan of 192 units with 11 partials per query. This times the default plan
and a few alternatives (larger query tiles, longer splits) of cases 1, 2, 4, 6, 9 at
heads 16/1, each checked against the float64 reference, all in one run::

    python3 bench/device/gqa16_plans.py --out $OUT/gqa16_plans.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import fasttree as ft
from bench.common import checked_graph_time, environment, random_case
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree

BASE = ft.FastTreeConfig()
VARIANTS = {
    "default": BASE,
    "q8": replace(BASE, q_tile_queries=(8, 8)),
    "q8_split256": replace(BASE, q_tile_queries=(8, 8), kv_split_sizes=(256, 256)),
    "q8_split512": replace(BASE, q_tile_queries=(8, 8), kv_split_sizes=(512, 512)),
    "q4_split256": replace(BASE, q_tile_queries=(4, 4), kv_split_sizes=(256, 256)),
    "split512": replace(BASE, kv_split_sizes=(512, 512)),
    "q16": replace(BASE, q_tile_queries=(16, 16)),
    "q8_warps8": replace(BASE, q_tile_queries=(8, 8), num_warps=(8, 8)),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="6,1,2,4,9")
    args = p.parse_args()
    hq, hkv = PAPER_HEADS["gqa16"]
    rows = []
    for case in (int(c) for c in args.cases.split(",")):
        tree = paper_tree(case)
        q, k, v, sample, ref = random_case(tree, hq, hkv, 128, seed=case, samples=32)
        row = {"case": case}
        for name, cfg in VARIANTS.items():
            plan = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
            s = plan.stats()
            timed = checked_graph_time(plan, q, k, v, sample, ref)
            row[name] = {**timed, "units": s["units"], "partial_rows": s["partial_rows"],
                         "tile_mode": s["tile_mode"], "q_tiles": s["q_tiles"]}  # fmt: skip
            brief = (s["tile_mode"], s["units"], s["partial_rows"], f"err {timed['err']:.1e}")
            print(case, name, f"{timed['graph_us']:.1f} us", *brief, flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
