"""A runtime step checked as the serving tests check it: outputs poisoned, the step's queries
against the float64 reference, the rows past them untouched."""

from __future__ import annotations

import torch

import fasttree as ft


def run_poisoned(
    rt: ft.TreeAttentionRuntime, tree: ft.KVTree, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int
) -> float:
    """Run ``rt``'s current plan (of ``tree``) over the first ``rows`` rows of ``q`` into NaN outputs.

    Parameters
    ----------
    rt : TreeAttentionRuntime
        Planned for ``tree`` (``rt.plan(tree, rows=rows)``).
    tree : KVTree
    q : Tensor [>= rows, Hq, D], the runtime's dtype and device
    k, v : Tensor [pool, Hkv, D], same dtype and device
    rows : int
        The batch bucket the step runs with (at least ``tree.n_queries``).

    Returns
    -------
    float
        The worst relative error of the tree's queries against :func:`fasttree.reference_attention`
        (asserts every row past them is still NaN).
    """
    out = torch.full((rows, *q.shape[1:]), float("nan"), dtype=q.dtype, device=q.device)
    rt.forward(q[:rows], k, v, out=out)
    n = tree.n_queries
    assert torch.isnan(out[n:]).all(), "the runtime wrote rows past the step's queries"
    return ft.max_relative_error(out[:n], ft.reference_attention(q[:n], k, v, tree))
