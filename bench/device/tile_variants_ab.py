"""Config variants of the tile classes on the paper suite, whole calls by CUDA-graph replay.

Each variant is the default ``FastTreeConfig`` with one launch choice of one tile class changed
(query-tile rows, warps, stages, KV tile), planned and timed per case and head ratio, its output
checked against the float64 reference on sampled queries. A variant that cannot compile (shared
memory) is recorded with its error. Ratios are against the default plan of the same run::

    python3 bench/device/tile_variants_ab.py --out $OUT/tile_variants_ab.json [--cases 5,7] [--heads gqa4]
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import fasttree as ft
from bench.common import checked_graph_time, geomean, random_case, timed_in_turn, write_device_result
from fasttree.cli import _int_at_least
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree

D = 128
BASE = ft.FastTreeConfig()


def variants(g: int) -> dict[str, ft.FastTreeConfig]:
    """The default and its one-class variants for GQA group size ``g`` (head dim 128)."""
    qs = BASE.query_tiles(g)[1]
    wl, ws = BASE.launch_warps(g)
    sl, ss = BASE.launch_stages(g, D)
    out = {"default": BASE}
    if 128 // g >= qs:
        out["L_q128_w8"] = BASE.with_(q_tile_queries=(128 // g, qs), num_warps=(8, ws))
        out["L_q128_w8_s3"] = BASE.with_(q_tile_queries=(128 // g, qs), num_warps=(8, ws), num_stages=(3, ss))
    out["L_w8"] = BASE.with_(num_warps=(8, ws))
    out["L_kv128_s3"] = BASE.with_(kv_tile=(128, 64), num_stages=(3, ss))
    out["L_kv32"] = BASE.with_(kv_tile=(32, 64))
    out["S_kv128"] = BASE.with_(kv_tile=(64, 128))
    out["S_kv32"] = BASE.with_(kv_tile=(64, 32))
    out["S_w" + str(2 * ws)] = BASE.with_(num_warps=(wl, 2 * ws))
    out["S_s" + str(ss + 2)] = BASE.with_(num_stages=(sl, ss + 2))
    return out


def split_variants(g: int) -> dict[str, ft.FastTreeConfig]:
    """The default and longer small-class splits (fewer partials and merge work per query)."""
    big = BASE.kv_split_sizes[0]
    return {"default": BASE, **{f"split{s}": BASE.with_(kv_split_sizes=(big, s)) for s in (256, 512, 1024)}}


FAMILIES = {"tiles": variants, "splits": split_variants}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    positive = _int_at_least(1, "an integer >= 1")
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(str(c) for c in range(1, 16)))
    p.add_argument("--heads", default="mha,gqa4,gqa16")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new cases after this many seconds")
    p.add_argument("--family", choices=sorted(FAMILIES), default="tiles")
    p.add_argument("--rounds", type=positive, default=1, help="timings per variant, taken in turn (median kept)")
    args = p.parse_args()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in (int(c) for c in args.cases.split(",")):
        tree = paper_tree(case)
        for heads in args.heads.split(","):
            if time.perf_counter() - t0 > args.budget_s:
                break
            hq, hkv = PAPER_HEADS[heads]
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=case, samples=32)
            row: dict[str, Any] = {"case": case, "heads": heads}
            configs = FAMILIES[args.family](hq // hkv)
            plans = {
                name: ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=D) for name, cfg in configs.items()
            }
            calls = {name: partial(checked_graph_time, plan, q, k, v, sample, ref) for name, plan in plans.items()}
            # a variant that does not compile is a result
            for name, timed in timed_in_turn(calls, args.rounds, keep_errors=True).items():
                s = plans[name].stats()
                row[name] = timed if "error" in timed else {
                    **timed, "units": s["units"], "partial_rows": s["partial_rows"], "q_tiles": s["q_tiles"]
                }  # fmt: skip
            base = row["default"]["graph_us"]
            for r in row.values():
                if isinstance(r, dict) and "graph_us" in r:
                    r["ratio"] = r["graph_us"] / base
            brief = " ".join(f"{n}={r['ratio']:.3f}" for n, r in row.items() if isinstance(r, dict) and "ratio" in r)
            print(case, heads, f"{base:.1f} us", brief, flush=True)
            rows.append(row)
    names = sorted({n for r in rows for n in r if n not in ("case", "heads")})
    summary: dict[str, Any] = {}
    for heads in args.heads.split(","):
        sel = [r for r in rows if r["heads"] == heads]
        summary[heads] = {
            n: round(geomean(r[n]["ratio"] for r in sel if "ratio" in r.get(n, {})), 4) for n in names if n != "default"
        }
    summary["all_correct"] = all(r[n].get("err", 0.0) < 1e-2 for r in rows for n in names if n in r)
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
