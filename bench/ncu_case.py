"""One attention call of one benchmark tree, bracketed for Nsight Compute.

Builds a tree of the kernel benchmark's suites (or one step of ``bench.decode``'s workloads),
plans it, runs the call once to compile, then runs it once more between
``cudaProfilerStart`` and ``cudaProfilerStop``, so that ``ncu --profile-from-start off`` profiles
exactly that call's launches (stage 1 and the merge). It logs the plan (tile mode, units per
tile class, KV entries) and the stage-1 launches the host chose (tile rows, KV tile, warps,
stages, programs), which ncu's report does not name. Inputs are random normals (seeded), never
zeros.

Run on a GPU machine from the repository root::

    ncu --profile-from-start off --set full -o REPORT \\
        python -m bench.ncu_case --suite crossover --case ns32x4k/8x1/d256/bf16
    ncu --import REPORT.ncu-rep --page details > REPORT.txt

Cases: ``--suite paper --case 9/gqa16`` (paper case and heads, head dim 128, fp16), ``--suite
families|crossover --case NAME`` (a case name of :data:`fasttree.toolkit.family_suite.SUITES`),
``--suite decode --case llama:multi_document_qa:30`` (model, scenario and step of
``bench.decode``'s stable-slot workloads, seed 0). ``--plan query_separated`` profiles plain
split-KV decode of the same tree instead of ``fasttree.plan``'s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

import torch

import fasttree as ft
from fasttree.launch_rules import GpuTarget, stage1_launches
from fasttree.toolkit.family_suite import SUITES, family_tree
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree

log = logging.getLogger("bench.ncu_case")

CASE_SUITES = ("paper", "families", "crossover", "decode")
PLANS = ("fasttree", "query_separated")


@dataclass(frozen=True)
class Case:
    """A tree and the head layout it runs at."""

    name: str
    tree: ft.KVTree
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def resolve_case(suite: str, name: str) -> Case:
    """The tree and head layout ``name`` names in ``suite`` (:data:`CASE_SUITES`); ValueError
    naming what is wrong otherwise."""
    if suite == "paper":
        case, _, heads = name.partition("/")
        if not case.isdigit() or int(case) not in PAPER_SUITE or heads not in PAPER_HEADS:
            raise ValueError(
                f"a paper case is CASE/HEADS with CASE in 1-15 and HEADS in {sorted(PAPER_HEADS)}: {name!r}"
            )
        hq, hkv = PAPER_HEADS[heads]
        return Case(name, paper_tree(int(case)), hq, hkv, 128, torch.float16)
    if suite in ("families", "crossover"):
        found = [c for c in SUITES[suite] if c.name == name]
        if not found:
            names = ", ".join(c.name for c in SUITES[suite])
            raise ValueError(f"no case {name!r} in the {suite} suite; one of: {names}")
        c = found[0]
        return Case(name, family_tree(c), c.heads[0], c.heads[1], c.head_dim, getattr(torch, c.dtype))
    if suite == "decode":
        from bench.decode import MODELS, make_workload
        from fasttree.toolkit.workloads import SCENARIOS

        parts = name.split(":")
        if len(parts) != 3 or parts[0] not in MODELS or parts[1] not in SCENARIOS or not parts[2].isdigit():
            raise ValueError(
                f"a decode case is MODEL:SCENARIO:STEP with MODEL in {sorted(MODELS)} and SCENARIO in "
                f"{sorted(SCENARIOS)}: {name!r}"
            )
        step = int(parts[2])
        spec = MODELS[parts[0]]
        workload = make_workload(parts[1], seed=0, warmup=0, steps=step + 1, max_batch=None, vocab=spec.vocab)
        tree = workload.trees[step]
        return Case(name, tree, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, torch.float16)
    raise ValueError(f"--suite must be one of {CASE_SUITES}, got {suite!r}")


def plan_case(case: Case, which: str) -> ft.Plan:
    """``fasttree.plan`` of the case's tree, or plain decode's (``which="query_separated"``)."""
    heads = {"num_q_heads": case.num_q_heads, "num_kv_heads": case.num_kv_heads, "head_dim": case.head_dim}
    if which == "query_separated":
        return ft.plan_query_separated(case.tree, **heads)
    return ft.plan(case.tree, **heads)


def describe(case: Case, plan: ft.Plan, target: GpuTarget) -> list[str]:
    """Lines naming the plan and the stage-1 launches chosen for it on ``target``."""
    lines = [
        f"{case.name}: {case.tree.n_queries} queries, {case.tree.num_tokens} tokens, heads "
        f"{case.num_q_heads}/{case.num_kv_heads}, D {case.head_dim}, {case.dtype}; plan {plan.tile_mode}, "
        f"units per class {plan.units_per_class()}, {plan.kv_indices.size} KV entries, "
        f"{plan.n_partial_rows} partial rows"
    ]
    for s in stage1_launches(plan, target):
        lines.append(
            f"  stage 1 class {s.tile_class}: {s.n_units} units x {plan.num_kv_heads} KV heads, {s.block_m} rows x "
            f"{s.block_n} KV tokens, {s.num_warps} warps, {s.num_stages} stages, masked {s.masked}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ncu_case", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=CASE_SUITES, required=True)
    p.add_argument("--case", required=True, help="the case (module docstring)")
    p.add_argument("--plan", choices=PLANS, default="fasttree", help="whose plan to run (default: fasttree)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.ncu_case needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        case = resolve_case(args.suite, args.case)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    plan = plan_case(case, args.plan)
    dev = torch.device("cuda")
    for line in describe(case, plan, GpuTarget.of(dev, False)):
        log.info(line)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    q = torch.randn(case.tree.n_queries, case.num_q_heads, case.head_dim, device=dev, dtype=case.dtype, generator=gen)
    shape = (case.tree.max_slot + 1, case.num_kv_heads, case.head_dim)
    k = torch.randn(shape, device=dev, dtype=case.dtype, generator=gen)
    v = torch.randn(shape, device=dev, dtype=case.dtype, generator=gen)
    out = ft.tree_attention(q, k, v, plan)  # compiles and uploads the plan
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ft.tree_attention(q, k, v, plan, out=out)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
