"""A/B of stage-1 launch variants on the paper suite (private switches of ``tree_attention``).

For every case and head layout, measures the plan of each variant by CUDA-graph replay
(the per-unit tiled kernel alone; with the single-query kernel for one-query units in
several shapes; register caps), checks each against the float64 reference on
sampled queries (outputs poisoned first), and writes a JSON file plus a markdown table
of geometric means relative to the per-unit grid. Needs a CUDA GPU::

    python -m bench.ab [--cases 1,...,15] [--heads mha,gqa4,gqa16] [--out docs/bench]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fasttree as ft
from bench.common import anchor_rows, environment, write_atomic
from fasttree.suite import PAPER_HEADS, paper_tree
from fasttree.timing import graph_time_us

log = logging.getLogger("bench.ab")

#: name -> (config changes, single-query kernel (rows, tokens, warps) or None, register cap per class)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[int, int, int] | None, tuple[int | None, int | None]]] = {
    "units": ({}, None, (None, None)),
    "sq_4_16_w4": ({}, (4, 16, 4), (None, None)),
    "sq_4_32_w4": ({}, (4, 32, 4), (None, None)),
    "sq_8_16_w4": ({}, (8, 16, 4), (None, None)),
    "sq_4_16_w2": ({}, (4, 16, 2), (None, None)),
    "sq_2_16_w2": ({}, (2, 16, 2), (None, None)),
    "sq_4_8_w2": ({}, (4, 8, 2), (None, None)),
    "sq_4_16_w4_k16w2": ({"kv_tile": (32, 16), "num_warps": (4, 2)}, (4, 16, 4), (None, None)),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(str(c) for c in range(1, 16)))
    p.add_argument("--heads", default="mha,gqa4,gqa16")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--label", default="h200")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    names = args.variants.split(",")
    anchors = anchor_rows()
    rows = []
    for case in (int(c) for c in args.cases.split(",")):
        tree = paper_tree(case)
        for heads in args.heads.split(","):
            hq, hkv = PAPER_HEADS[heads]
            gen = torch.Generator(device="cuda").manual_seed(1000 * case + hq + hkv)
            q = torch.randn(tree.n_queries, hq, 128, device="cuda", dtype=torch.float16, generator=gen)
            k = torch.randn(tree.max_slot + 1, hkv, 128, device="cuda", dtype=torch.float16, generator=gen)
            v = torch.randn_like(k)
            sample = np.sort(np.random.default_rng(case).choice(tree.n_queries, min(tree.n_queries, 64), replace=False))
            ref = ft.reference_attention(q, k, v, tree, queries=sample)
            out = torch.empty_like(q)
            row: dict[str, Any] = {"case": case, "heads": heads, "times_us": {}, "max_rel_err": {}}
            anchor = anchors.get((case, heads))
            if anchor:
                row["published_us"] = anchor["published_fasttree_graph_us"]
                row["floor_us"] = anchor["roofline_floor_us"]
            for name in names:
                changes, pps, regs = VARIANTS[name]
                try:
                    plan = ft.plan(tree, ft.FastTreeConfig(**changes), num_q_heads=hq, num_kv_heads=hkv, head_dim=128)

                    def fn(plan=plan, pps=pps, regs=regs, q=q, k=k, v=v, out=out):
                        return ft.tree_attention(q, k, v, plan, out=out, _single=pps, _maxnreg=regs)

                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    sel = out[torch.as_tensor(sample, device="cuda")]
                    err = ft.max_relative_error(sel, ref) if bool(torch.isfinite(sel).all()) else float("nan")
                    row["max_rel_err"][name] = err
                    row["times_us"][name] = graph_time_us(fn)["median"]
                except Exception as exc:  # recorded, not fatal
                    log.warning("%s on %d/%s failed: %s", name, case, heads, exc)
            log.info("%d/%s %s", case, heads, {n: round(t, 1) for n, t in row["times_us"].items()})
            rows.append(row)
            torch.cuda.empty_cache()

    def geo(x):
        return float(np.exp(np.mean(np.log(x)))) if len(x) else float("nan")

    lines = [
        f"# Stage-1 launch variants A/B ({args.label})",
        "",
        "| variant | geomean vs units | worst | geomean vs published | slower than published | worst err |",
        "|:---|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for name in names:
        rel = [
            r["times_us"][name] / r["times_us"]["units"]
            for r in rows
            if name in r["times_us"] and "units" in r["times_us"]
        ]
        pub = [r["published_us"] / r["times_us"][name] for r in rows if name in r["times_us"] and "published_us" in r]
        errs = [r["max_rel_err"].get(name, np.nan) for r in rows]
        summary[name] = {
            "geo_vs_units": geo(rel),
            "worst_vs_units": max(rel, default=np.nan),
            "geo_vs_published": geo(pub),
            "slower_than_published": int(sum(x < 1 for x in pub)),
            "worst_err": float(np.nanmax(errs)) if errs else None,
        }
        s = summary[name]
        lines.append(
            f"| {name} | {s['geo_vs_units']:.3f} | {s['worst_vs_units']:.3f} | {s['geo_vs_published']:.3f} "
            f"| {s['slower_than_published']} | {s['worst_err']:.1e} |"
        )
    lines += ["", "| case | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        lines.append(
            f"| {r['case']}/{r['heads']} | "
            + " | ".join(f"{r['times_us'].get(n, float('nan')):.1f}" for n in names)
            + " |"
        )
    report = {
        "env": environment(gpu=True),
        "variants": {
            n: {"config": VARIANTS[n][0], "single_query": VARIANTS[n][1], "maxnreg": VARIANTS[n][2]} for n in names
        },
        "rows": rows,
        "summary": summary,
    }
    write_atomic(args.out / f"ab_{args.label}.json", json.dumps(report, indent=1) + "\n")
    md = "\n".join(lines) + "\n"
    write_atomic(args.out / f"ab_{args.label}.md", md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
