"""The kernel benchmark's cases as a child process rebuilds them: random inputs of a case, its key
in the summaries, and the JSON description the FlashInfer probe (:mod:`.flashinfer_baseline`)
passes to its child processes (:mod:`.kernel_bench` and the probe both use them; neither imports
the other at module level)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

import fasttree as ft

from .bench_common import DTYPES
from .family_suite import SUITES, FamilyCase, family_tree
from .suite import PAPER_HEADS, paper_tree

__all__ = ["case_inputs", "case_key", "probe_inputs", "probe_item"]


def case_inputs(
    tree: ft.KVTree, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A case's random N(0, 1) inputs: q ``[n_queries, hq, d]`` and k, v ``[max_slot + 1, hkv, d]``,
    ``dtype`` on the CUDA device, drawn from a generator seeded by ``seed`` and the head shape."""
    gen = torch.Generator(device="cuda").manual_seed(1000 * seed + hq + hkv)
    pool = tree.max_slot + 1
    q = torch.randn(tree.n_queries, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def case_key(case: int | str, heads: str) -> str:
    """A row's name in the summaries and in the FlashInfer probe: ``case/heads``."""
    return f"{case}/{heads}"


def probe_item(args: argparse.Namespace, *, case: int | None = None, heads: str | None = None,
               family: FamilyCase | None = None) -> dict[str, Any]:  # fmt: skip
    """The JSON description of a paper case (``case``, ``heads``) or a case of a family suite
    (``family``) that :func:`probe_inputs` rebuilds in the FlashInfer probe's child process."""
    if family is not None:
        hq, hkv = family.heads
        suite = next((name for name, cases in SUITES.items() if family in cases), None)
        if suite is None:  # a drawn case (the heldout suite): the item carries the case itself
            return {"key": case_key(family.name, f"{hq}/{hkv}"), "suite": "heldout", "name": family.name,
                    "family": dataclasses.asdict(family)}  # fmt: skip
        return {"key": case_key(family.name, f"{hq}/{hkv}"), "suite": suite, "name": family.name}
    return {"key": case_key(case, heads), "suite": "paper", "case": case, "heads": heads,
            "head_dim": args.head_dim, "dtype": args.dtype}  # fmt: skip


def probe_inputs(item: dict[str, Any]) -> tuple[ft.KVTree, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree and the inputs (:func:`case_inputs`) of the case :func:`probe_item` described."""
    fc = None
    if item["suite"] == "heldout":  # a drawn case: the item carries it
        fc = FamilyCase(**{**item["family"], "heads": tuple(item["family"]["heads"])})
    elif item["suite"] in SUITES:
        (fc,) = [c for c in SUITES[item["suite"]] if c.name == item["name"]]
    if fc is not None:
        tree = family_tree(fc)
        return (tree, *case_inputs(tree, *fc.heads, fc.head_dim, DTYPES[fc.dtype], fc.seed))
    hq, hkv = PAPER_HEADS[item["heads"]]
    tree = paper_tree(item["case"])
    return (tree, *case_inputs(tree, hq, hkv, item["head_dim"], DTYPES[item["dtype"]], item["case"]))
