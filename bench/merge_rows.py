"""A/B of the merge kernel's partial rows per load (``BLOCK_P``) on paper-suite cases::

    python -m bench.merge_rows [--cases 5,6,9,10] [--rows 1,4,8]

``BLOCK_P = 1`` is the one-row-at-a-time merge of v4. Prints GPU time (CUDA-graph
replay) per case and setting, and the ratio to the first setting.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fasttree as ft
from fasttree import attention
from fasttree.suite import PAPER_HEADS, paper_tree
from fasttree.timing import graph_time_us


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.merge_rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="5,6,9,10")
    p.add_argument("--rows", default="1,4,8")
    args = p.parse_args(argv)
    settings = [int(r) for r in args.rows.split(",")]
    lines = [
        "| case | " + " | ".join(f"rows {r} us" for r in settings) + " | ratio |",
        "|---|" + "---:|" * (len(settings) + 1),
    ]
    for case in (int(c) for c in args.cases.split(",")):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            q = torch.randn(tree.n_queries, hq, 128, device="cuda", dtype=torch.float16)
            k = torch.randn(tree.max_slot + 1, hkv, 128, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
            out = torch.empty_like(q)
            times = []
            for rows in settings:
                attention._MERGE_ROWS = rows
                times.append(
                    graph_time_us(lambda q=q, k=k, v=v, plan=plan, out=out: ft.tree_attention(q, k, v, plan, out=out))[
                        "median"
                    ]
                )
            ratios = "/".join(f"{t / times[0]:.2f}" for t in times)
            lines.append(f"| {case}/{heads} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {ratios} |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
