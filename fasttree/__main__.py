"""``python -m fasttree``: plan and run one paper-suite tree, check it, print a summary.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` (the kernels then run in
Triton's interpreter on the CPU; use few heads, it is slow).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import fasttree as ft
from fasttree.launcher import interpreting
from fasttree.toolkit.suite import PAPER_SUITE, paper_tree

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fasttree",
        description="Plan and run tree attention on one paper-suite tree and check it against a float64 reference.",
    )
    parser.add_argument("--case", type=int, default=1, choices=sorted(PAPER_SUITE), help="paper-suite tree (1-15)")
    parser.add_argument("--num-q-heads", type=int, default=4, help="query heads Hq (default 4)")
    parser.add_argument("--num-kv-heads", type=int, default=1, help="KV heads Hkv (default 1)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim D (default 128)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--version", action="version", version=f"%(prog)s {ft.__version__}")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not interpreting():
        parser.error(
            "no CUDA GPU found: the kernels run on a CUDA GPU, or on the CPU in Triton's interpreter "
            "(slow): set TRITON_INTERPRET=1"
        )
    tree = paper_tree(args.case)
    t0 = time.perf_counter()
    try:
        plan = ft.plan(tree, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    except ValueError as exc:  # heads or head dim the planner refuses
        parser.error(str(exc))
    plan_ms = (time.perf_counter() - t0) * 1e3

    dtype = _DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed)
    shape_kv = (tree.max_slot + 1, args.num_kv_heads, args.head_dim)
    q = torch.randn(tree.n_queries, args.num_q_heads, args.head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(shape_kv, generator=gen).to(dtype).to(device)
    v = torch.randn(shape_kv, generator=gen).to(dtype).to(device)
    t0 = time.perf_counter()
    try:
        out = ft.tree_attention(q, k, v, plan)
    except ValueError as exc:  # arguments the planner took but the kernels cannot run
        parser.error(str(exc))
    if device.type == "cuda":
        torch.cuda.synchronize()
    run_s = time.perf_counter() - t0
    ref = ft.reference_attention(q.cpu(), k.cpu(), v.cpu(), tree)
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()

    mode = "GPU" if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"paper-suite case {args.case}: {tree}")
    print(plan.summary())
    print(f"planning {plan_ms:.2f} ms; kernels on {mode}: {run_s:.2f} s (first call, includes compilation)")
    ok = bool(torch.isfinite(out).all()) and err <= _TOL[dtype]
    print(f"relative error vs float64 reference: {err:.2e} (bound {_TOL[dtype]:.0e}) -> {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
