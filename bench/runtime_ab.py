"""The runtime's fixed, persistent launches against ``tree_attention``'s per-plan grids, on the paper suite.

For every case: GPU time by CUDA-graph replay of ``tree_attention(q, k, v, plan)`` (a graph per
plan, as the kernel benchmark does) and of ``TreeAttentionRuntime.forward`` (one runtime per head
shape; the case's tree uploaded with ``plan``), measured in the same run, and the runtime's
output checked against the float64 reference on sampled queries. Needs a CUDA GPU::

    python -m bench.runtime_ab [--out docs/bench] [--label runtime_ab_h200]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import torch

import fasttree as ft
from bench.common import TOL, environment, write_atomic
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from fasttree.toolkit.timing import graph_time_us

log = logging.getLogger("bench.runtime_ab")
HEAD_DIM = 128


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--label", default="runtime_ab_h200")
    p.add_argument("--programs-per-sm", type=int, default=None)
    p.add_argument("--waves", default="1,2", help="comma list: one runtime per value (TreeAttentionRuntime waves)")
    p.add_argument(
        "--stage1-launches",
        default="auto",
        help="comma list of auto/1/2, crossed with --waves (TreeAttentionRuntime stage1_launches)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    variants = [
        (n if n == "auto" else int(n), int(w)) for n in args.stage1_launches.split(",") for w in args.waves.split(",")
    ]  # (stage1_launches, waves)
    keys = [f"{'auto' if n == 'auto' else f'l{n}'}w{w}" for n, w in variants]
    trees = {case: paper_tree(case) for case in sorted(PAPER_SUITE)}
    pool = max(t.max_slot for t in trees.values()) + 1
    rows_max = max(t.n_queries for t in trees.values())
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for heads, (hq, hkv) in sorted(PAPER_HEADS.items()):
        k = torch.randn(pool, hkv, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
        v = torch.randn(pool, hkv, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
        q_all = torch.randn(rows_max, hq, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
        out_all = torch.empty_like(q_all)
        runtimes = {
            key: TreeAttentionRuntime(
                None,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_dim=HEAD_DIM,
                dtype=torch.float16,
                device="cuda",
                max_queries=rows_max,
                max_kv_entries=4 * pool,
                max_units=1 << 16,
                pool_slots=pool,
                programs_per_sm=args.programs_per_sm,
                waves=w,
                stage1_launches=n,
                extend_steps=0,  # the same fresh plans as tree_attention's
            )
            for key, (n, w) in zip(keys, variants, strict=True)
        }
        for case, tree in trees.items():
            n = tree.n_queries
            q, out = q_all[:n], out_all[:n]
            plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            base = graph_time_us(functools.partial(ft.tree_attention, q, k, v, plan, out=out))
            rng = np.random.default_rng(case)
            sample = np.sort(rng.choice(n, size=min(n, 64), replace=False))
            ref = ft.reference_attention(q, k, v, tree, queries=sample)
            row = {"case": case, "heads": heads, "tree_attention_us": base["median"], "runtime_us": {},
                   "max_rel_err": 0.0, "programs": {}}  # fmt: skip
            for w, rt in runtimes.items():
                info = rt.plan(tree)
                out_all.fill_(float("nan"))
                rt.forward(q_all, k, v, out=out_all)
                err = ft.max_relative_error(out_all[torch.as_tensor(sample, device="cuda")], ref)
                row["max_rel_err"] = max(row["max_rel_err"], err)
                row["runtime_us"][w] = graph_time_us(functools.partial(rt.forward, q_all, k, v, out=out_all))["median"]
                row["programs"][w] = list(rt._programs)
                row["query_centric"] = info.query_centric
            row["ratio"] = {w: t / base["median"] for w, t in row["runtime_us"].items()}
            row["correct"] = row["max_rel_err"] <= TOL[torch.float16]
            log.info("%s/%s: tree_attention %.1f us, runtime %s, err %.2g", case, heads, base["median"],
                     {w: round(t, 1) for w, t in row["runtime_us"].items()}, row["max_rel_err"])  # fmt: skip
            rows.append(row)
    geo = {key: math.exp(sum(math.log(r["ratio"][key]) for r in rows) / len(rows)) for key in keys}
    by_heads = {
        h: {key: math.exp(np.mean([math.log(r["ratio"][key]) for r in rows if r["heads"] == h])) for key in keys}
        for h in sorted({r["heads"] for r in rows})
    }
    doc = {"env": environment(gpu=True), "variants": keys, "geomean_runtime_over_tree_attention": geo,
           "geomean_by_heads": by_heads, "rows": rows,
           "all_correct": all(r["correct"] for r in rows)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"{args.label}.json", json.dumps(doc, indent=1) + "\n")
    lines = [f"# Runtime vs tree_attention ({doc['env']['gpu_name']}, commit {doc['env']['git_commit']})", "",
             "| case | heads | tree_attention (us) | " + " | ".join(f"runtime {key} (us, ratio)" for key in keys)
             + " | query-centric | error |", "|---|---|---:|" + "---:|" * len(keys) + "---|---:|"]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r['runtime_us'][key]:.1f} ({r['ratio'][key]:.3f})" for key in keys)
        lines.append(f"| {r['case']} | {r['heads']} | {r['tree_attention_us']:.1f} | {cells} | "
                     f"{r['query_centric']} | {r['max_rel_err']:.1e} |")  # fmt: skip
    summary = ", ".join(f"{key}: {g:.3f}" for key, g in geo.items())
    lines.append(
        "\nVariants: l = stage1_launches, w = waves. Geomean runtime / tree_attention by heads: "
        + "; ".join(f"{h}: " + ", ".join(f"{k} {g:.3f}" for k, g in v.items()) for h, v in by_heads.items())
    )
    lines.append(f"\ngeomean runtime / tree_attention: {summary}; all correct: {doc['all_correct']}")
    write_atomic(args.out / f"{args.label}.md", "\n".join(lines) + "\n")
    print(lines[-1].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
