"""The default ``pack_min_units`` (264, from the v8 sweep) against 132, 167 and 528 under today's kernel.

``pack_min_units`` lowers packing's token budget until about that many packed units x KV heads
share the eligible tokens, so small trees keep the GPU busy. On GQA-16 deep trees (11-15) the
default leaves 256 short units in a 16-row class with 16-token KV tiles and a merge, where the
GQA-16 serving export's 167 packs them into the 64-row bins (no merge); that export ran those
cases in 19 us against the default's 24 (`docs/bench/kernel_h200_v23.md`, `tuned`). This times
whole ``tree_attention`` calls (CUDA-graph replay, checked against the float64 reference) of
the 45 paper cases with the default config and with each other value, on the cases whose plan
the value changes::

    python3 bench/device/pack_min_units_ab.py --out $OUT/pack_min_units_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses

import fasttree as ft
from bench.common import checked_graph_time, geomean, random_case, write_device_result
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree

D = 128
VALUES = (132, 167, 528)


def signature(plan: ft.Plan) -> tuple:
    s = plan.stats()
    return (int(s["kv_tokens_read"]), tuple(int(u) for u in s["units"]), plan.n_partial_rows, plan.tile_mode,
            tuple((c.block_m, c.block_n) for c in plan.tile_classes))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    base = ft.FastTreeConfig()
    rows = []
    for case in range(1, 16):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            plan = ft.plan(tree, base, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
            others = {}
            for value in VALUES:
                other = ft.plan(tree, dataclasses.replace(base, pack_min_units=value), num_q_heads=hq,
                                num_kv_heads=hkv, head_dim=D)  # fmt: skip
                if signature(other) != signature(plan):
                    others[value] = other
            if not others:
                continue
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=case, samples=16)
            row = {"case": case, "heads": heads, "default": checked_graph_time(plan, q, k, v, sample, ref)}
            for value in VALUES:  # unchanged plans: the default's time
                row[str(value)] = checked_graph_time(others[value], q, k, v, sample, ref) if value in others else None
            rows.append(row)
            b = row["default"]["graph_us"]
            ratios = " ".join(f"{v}:{row[str(v)]['graph_us'] / b:.3f}" for v in VALUES if row[str(v)] is not None)
            print(f"{case}/{heads}: default {b:.1f} {ratios}", flush=True)
    summary = {}
    for value in VALUES:
        ratios = [(r[str(value)]["graph_us"] if r[str(value)] else r["default"]["graph_us"]) / r["default"]["graph_us"]
                  for r in rows]  # fmt: skip
        errs = [r[str(value)]["err"] for r in rows if r[str(value)]]
        summary[str(value)] = {"geomean_over_changed_cases": geomean(ratios), "min": min(ratios), "max": max(ratios),
                               "n_changed": len(errs), "max_err": max(errs, default=None)}  # fmt: skip
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
