"""Run one paper-suite case a few times (warm), for external profilers such as Nsight Compute::

ncu --clock-control none -k regex:tree_attention python -m bench.run_case --case 10 --heads mha
"""

from __future__ import annotations

import argparse

import torch

import fasttree as ft
from fasttree.suite import PAPER_HEADS, paper_tree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_case", description=__doc__.split("\n\n")[0])
    p.add_argument("--case", type=int, required=True)
    p.add_argument("--heads", default="mha", choices=sorted(PAPER_HEADS))
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args(argv)
    hq, hkv = PAPER_HEADS[args.heads]
    tree = paper_tree(args.case)
    q = torch.randn(tree.n_queries, hq, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(tree.max_slot + 1, hkv, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    out = torch.empty_like(q)
    for _ in range(args.calls):
        ft.tree_attention(q, k, v, plan, out=out)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
