"""Stage-1 launches of one plan for the device A/B scripts: build, run and compare them.

A/B scripts time ``fasttree.tree_attention``'s stage-1 launches alone (graph replay) with
one setting changed, and compare each variant's outputs (direct rows, partial rows and LSEs)
with the planned launches' on the same inputs, every buffer poisoned with NaN first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

import fasttree
from fasttree import attention as att

#: One launch as ``fasttree.attention._launches`` gives it:
#: ``(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg)``.
Launch = tuple


def stage1_launches(plan: fasttree.Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor) -> list[Launch]:  # fmt: skip
    """The stage-1 (units kernel) launches of ``tree_attention(q, k, v, plan, out=out)``."""
    scale = 1.0 / math.sqrt(plan.head_dim) * math.log2(math.e)
    launches = att._launches(plan, plan.to(q.device), q, k, v, out, scale)
    return [e for e in launches if e[0] is att.tree_attention_units_kernel]


def run_launches(launches: list[Launch]) -> None:
    """Launch each entry through the library's cached launch path."""
    for kernel, grid, args, constexprs, warps, stages, maxnreg in launches:
        att._launch(kernel, grid, args, constexprs, warps, stages, maxnreg)


def poisoned_outputs(
    run: Callable[[], None], plan: fasttree.Plan, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of ``out`` and the plan's partial rows and LSEs after ``run()``, all poisoned with NaN first."""
    part_o, part_lse = att._workspace(plan, out.device)
    for b in (out, part_o, part_lse):
        b.fill_(float("nan"))
    run()
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    rows = plan.n_partial_rows
    return out.clone(), part_o[:rows].clone(), part_lse[:rows].clone()


def max_abs_diff(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """Largest absolute difference of finite entries; ``inf`` when the finite entries differ."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        fin = torch.isfinite(x)
        if not bool((fin == torch.isfinite(y)).all()):
            return float("inf")
        if fin.any():
            worst = max(worst, float((x[fin].float() - y[fin].float()).abs().max()))
    return worst
