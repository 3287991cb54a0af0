"""Run one paper-suite case or one serving decode step a few times (warm), for external profilers
such as Nsight Compute::

    ncu --clock-control none -k regex:tree_attention python -m bench.run_case --case 10 --heads mha
    ncu --clock-control none -k regex:tree_attention python -m bench.run_case --scenario multi_document_qa --step 25

A serving step (``fasttree.toolkit.workloads.iter_serving(scenario, seed=0)``) is planned with the
config ``--export`` gives its heads (the refined export by default), as the decode benchmark's
runtime is.
"""

from __future__ import annotations

import argparse

import torch

import fasttree as ft
from fasttree.export import read_export
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.workloads import SCENARIOS, iter_serving


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_case", description=__doc__.split("\n\n")[0])
    p.add_argument("--case", type=int, help="paper-suite case (1-15)")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="a serving scenario's decode step instead")
    p.add_argument("--step", type=int, default=25, help="the serving step (default 25)")
    p.add_argument("--export", default="docs/tune/export_measured.json", help="config export for --scenario")
    p.add_argument("--heads", default="mha", choices=sorted(PAPER_HEADS))
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args(argv)
    if (args.case is None) == (args.scenario is None):
        p.error("give one of --case and --scenario")
    hq, hkv = PAPER_HEADS[args.heads]
    config = None
    if args.scenario is not None:
        if args.step < 0:
            p.error(f"--step must be >= 0, got {args.step}")
        steps = list(iter_serving(args.scenario, seed=0, steps=args.step + 1))
        tree = steps[args.step].tree
        config, _ = read_export(args.export).lookup(
            gpu=torch.cuda.get_device_name(0), num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype=torch.float16
        )
    else:
        tree = paper_tree(args.case)
    q = torch.randn(tree.n_queries, hq, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(tree.max_slot + 1, hkv, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    out = torch.empty_like(q)
    for _ in range(args.calls):
        ft.tree_attention(q, k, v, plan, out=out)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
