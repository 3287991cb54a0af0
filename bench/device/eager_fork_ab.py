"""Two-class plans' eager calls with and without the stage-1 fork, after the cheaper launch path (one device call).

``fasttree.attention._FORK_EAGER_MIN_PAIRS`` decides which plans fork their two stage-1 launches
onto two streams in eager calls (graph captures always fork). It was set when a launch cost
~10 us of host time; with ints for addresses and Triton's C launch called directly (v19) the
trade-off may have moved. For every two-class paper case, with the default threshold and with
0 (every two-class plan forks), alternated: ``do_bench`` eager time, 20 eager calls back to
back, and one graph replay at a time with L2 cleared (``graph cold``), plus the 20-call graph
replay::

    python3 bench/device/eager_fork_ab.py --out $OUT/eager_fork_ab.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import fasttree as ft
from bench.common import environment, random_case
from fasttree import attention
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from fasttree.toolkit.timing import eager_loop_time_us, eager_time_us, graph_cold_time_us, graph_time_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    default = attention._FORK_EAGER_MIN_PAIRS
    rows = []
    for case in PAPER_SUITE:
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
            if not all(plan.units_per_class()):
                continue
            q, k, v, sample, ref = random_case(tree, hq, hkv, 128, seed=case, samples=16)
            row = {"case": f"{case}/{heads}", "pairs": int(plan.kv_indices.size * hkv), "default_forks": None}
            for mode in ("default", "fork", "default", "fork"):
                attention._FORK_EAGER_MIN_PAIRS = default if mode == "default" else 0
                plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)  # fork mode is cached per plan
                out = torch.full_like(q, float("nan"))
                call = lambda q=q, k=k, v=v, plan=plan, out=out: ft.tree_attention(q, k, v, plan, out=out)  # noqa: E731
                call()
                call()
                torch.cuda.synchronize()
                res = {
                    "err": ft.max_relative_error(out[torch.as_tensor(sample, device="cuda")], ref),
                    "eager_us": eager_time_us(call, rep_ms=50),
                    "eager_loop_us": eager_loop_time_us(call)["median"],
                    "graph_cold_us": graph_cold_time_us(call, rep_ms=50),
                    "graph_us": graph_time_us(call)["median"],
                }
                if mode == "default":
                    row["default_forks"] = row["pairs"] >= default
                for key, val in res.items():
                    row.setdefault(f"{mode}_{key}", []).append(val)
            rows.append(row)
            brief = {k: round(float(np.mean(v)), 1) for k, v in row.items() if isinstance(v, list) and "err" not in k}
            print(row["case"], row["default_forks"], json.dumps(brief), flush=True)
    attention._FORK_EAGER_MIN_PAIRS = default
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
