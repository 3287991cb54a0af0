"""The kernel benchmark's suite of other tree families: trees and head shapes a new user tries.

The paper suite (:mod:`.suite`) is 15 trees at head dim 128, fp16. This suite adds, fixed
before measuring: forests with queries at internal nodes, speculative token trees, beam-search
forests, long documents, wide few-shot prompts and batches with no sharing, at GQA 1/4/7/8/16
and one KV head (tensor-parallel shapes: 4, 8 or 16 query heads over one KV head), head dims
64/128/256, fp16 and bf16. Each case is ``(name, family, seed, params, (Hq, Hkv), D, dtype)``;
:func:`family_tree` builds its tree deterministically.

The last three cases were added after a crossover A/B on the H200 found them losing to
query-separated decode (independent requests at 16 query heads over 2 or 4 KV heads, and a
smaller forest with internal queries at one KV head; ``docs/history.md``): the suite keeps every
tree a fix must hold on.

:func:`heldout_cases` draws a fresh sample instead (the ``heldout`` suite): trees of every family,
their sizes drawn by the family's generator from a seed the caller picks, so that a change decided
on the fixed suites is checked on trees it was not chosen on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..tree import KVTree
from .workloads import TREE_FAMILIES, sample_tree

__all__ = [
    "CROSSOVER_CASES",
    "FAMILY_CASES",
    "HELDOUT_SHAPES",
    "SUITES",
    "FamilyCase",
    "family_tree",
    "format_shape",
    "heldout_cases",
    "parse_shape",
]

#: A shape string's dtype tags (:func:`parse_shape`, :func:`format_shape`) and the dtype names they stand for.
_SHAPE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def format_shape(heads: tuple[int, int], head_dim: int, dtype: str) -> str:
    """A head layout ``((Hq, Hkv), D, dtype name)`` written ``HQxHKV/dD/DTYPE`` (``8x1/d256/bf16``):
    what :func:`parse_shape` reads."""
    tag = next(short for short, name in _SHAPE_DTYPES.items() if name == dtype)
    return f"{heads[0]}x{heads[1]}/d{head_dim}/{tag}"


@dataclass(frozen=True)
class FamilyCase:
    """One case of the families suite.

    Attributes
    ----------
    name : str
        Unique label (family, tree and head shape).
    family : str
        A key of :data:`fasttree.toolkit.workloads.TREE_FAMILIES`.
    seed : int
        The tree's seed.
    params : dict
        The family's size parameters.
    heads : (int, int)
        ``(Hq, Hkv)``.
    head_dim : int
    dtype : str
        ``"float16"`` or ``"bfloat16"``.
    """

    name: str
    family: str
    seed: int
    params: dict[str, Any] = field(default_factory=dict)
    heads: tuple[int, int] = (32, 8)
    head_dim: int = 128
    dtype: str = "float16"


_TREES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "forest_internal": ("random_recursive", 11, {"n_nodes": 600, "max_node_tokens": 512, "internal_query_prob": 0.3}),
    "token_tree": ("speculative", 12, {"n_requests": 8, "n_token_nodes": 128, "max_depth": 8}),
    "token_tree_1k": ("speculative", 13, {"n_requests": 4, "n_token_nodes": 256, "max_depth": 12}),
    "beams": ("beam_search", 14, {"width": 8, "depth": 8, "n_prompts": 4}),
    "beams_wide": ("beam_search", 15, {"width": 16, "depth": 4, "n_prompts": 8}),
    "long_docs": (
        "multi_document", 16,
        {"n_documents": 2, "doc_tokens": (30000, 30000), "questions_per_doc": (8, 8)},
    ),
    "many_docs": ("multi_document", 17, {"n_documents": 24, "doc_tokens": (1000, 4000)}),
    "few_shot_wide": ("few_shot", 18, {"prompt_tokens": 4096, "n_questions": 50}),
    "few_shot_512": ("few_shot", 19, {"prompt_tokens": 2048, "n_questions": 512}),
    "no_sharing_2k": ("no_sharing", 20, {"n_requests": 64, "context_tokens": (2048, 2048)}),
    "no_sharing_mixed": ("no_sharing", 21, {"n_requests": 256, "context_tokens": (16, 8192)}),
    "paper_random": ("paper_random", 22, {"levels": 4, "max_leaves": 256}),
    "no_sharing_4k": ("no_sharing", 101, {"n_requests": 32, "context_tokens": (4096, 4096)}),
    "forest_internal_400": (
        "random_recursive", 31, {"n_nodes": 400, "max_node_tokens": 512, "internal_query_prob": 0.3},
    ),
}  # fmt: skip

#: (tree, (Hq, Hkv), D, dtype) of each case.
_SHAPES: tuple[tuple[str, tuple[int, int], int, str], ...] = (
    ("forest_internal", (32, 32), 128, "float16"),
    ("forest_internal", (32, 2), 128, "float16"),
    ("forest_internal", (16, 1), 128, "float16"),
    ("token_tree", (28, 4), 128, "float16"),
    ("token_tree", (32, 32), 128, "float16"),
    ("token_tree_1k", (32, 2), 128, "bfloat16"),
    ("token_tree_1k", (32, 4), 64, "bfloat16"),
    ("beams", (28, 4), 128, "float16"),
    ("beams", (32, 8), 256, "bfloat16"),
    ("beams_wide", (32, 32), 128, "float16"),
    ("beams_wide", (8, 1), 128, "float16"),
    ("long_docs", (16, 1), 128, "float16"),
    ("long_docs", (32, 8), 128, "float16"),
    ("long_docs", (32, 32), 128, "float16"),
    ("long_docs", (4, 1), 128, "bfloat16"),
    ("many_docs", (28, 4), 128, "float16"),
    ("many_docs", (32, 4), 64, "bfloat16"),
    ("few_shot_wide", (16, 1), 128, "float16"),
    ("few_shot_wide", (32, 8), 256, "bfloat16"),
    ("few_shot_512", (32, 4), 64, "bfloat16"),
    ("few_shot_512", (8, 1), 128, "float16"),
    ("few_shot_512", (32, 32), 128, "float16"),
    ("no_sharing_2k", (16, 1), 128, "float16"),
    ("no_sharing_2k", (32, 8), 128, "float16"),
    ("no_sharing_2k", (32, 32), 128, "float16"),
    ("no_sharing_mixed", (28, 4), 128, "bfloat16"),
    ("paper_random", (32, 4), 64, "bfloat16"),
    ("paper_random", (16, 2), 256, "bfloat16"),
    ("paper_random", (32, 2), 128, "float16"),
    ("no_sharing_2k", (32, 2), 128, "float16"),
    ("no_sharing_4k", (64, 4), 128, "float16"),
    ("forest_internal_400", (16, 1), 128, "float16"),
)

FAMILY_CASES: tuple[FamilyCase, ...] = tuple(
    FamilyCase(
        name=f"{tree}/{format_shape((hq, hkv), d, dtype)}",
        family=_TREES[tree][0], seed=_TREES[tree][1], params=_TREES[tree][2], heads=(hq, hkv), head_dim=d,
        dtype=dtype,
    )
    for tree, (hq, hkv), d, dtype in _SHAPES
)  # fmt: skip


#: The crossover suite: batches with no or little sharing, where plain split-KV decode
#: (:func:`fasttree.plan_query_separated`) is the bar, at the head layouts of tensor-parallel
#: serving (16 query heads over 1 or 2 KV heads, 32/2, 64/4, 8/1) and of GQA 4-8 models, D 128
#: fp16 and D 256 bf16; fixed before measuring (trees, seeds and shapes chosen as a grid, not from
#: results). ``(name, family, seed, params)`` x ``(Hq, Hkv), D, dtype``.
_CROSSOVER_TREES: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("ns16x2k", 201, {"n_requests": 16, "context_tokens": (2048, 2048)}),
    ("ns32x4k", 202, {"n_requests": 32, "context_tokens": (4096, 4096)}),
    ("ns64x1-4k", 203, {"n_requests": 64, "context_tokens": (1024, 4096)}),
    ("ns128x512-2k", 204, {"n_requests": 128, "context_tokens": (512, 2048)}),
    ("ns256x256-1k", 205, {"n_requests": 256, "context_tokens": (256, 1024)}),
    ("ns96x16-8k", 206, {"n_requests": 96, "context_tokens": (16, 8192)}),
)
_CROSSOVER_FORESTS: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("forest400", 207, {"n_nodes": 400, "max_node_tokens": 512, "internal_query_prob": 0.3}),
    ("forest600x256", 208, {"n_nodes": 600, "max_node_tokens": 256, "internal_query_prob": 0.3}),
)
_CROSSOVER_SHAPES: tuple[tuple[tuple[int, int], int, str], ...] = (
    ((16, 1), 128, "float16"), ((32, 2), 128, "float16"), ((64, 4), 128, "float16"), ((8, 1), 256, "bfloat16"),
    ((32, 8), 128, "float16"),
)  # fmt: skip


def _case(name: str, family: str, seed: int, params: dict[str, Any], heads, d: int, dtype: str) -> FamilyCase:
    return FamilyCase(name=f"{name}/{format_shape(heads, d, dtype)}", family=family, seed=seed, params=params,
                      heads=heads, head_dim=d, dtype=dtype)  # fmt: skip


CROSSOVER_CASES: tuple[FamilyCase, ...] = tuple(
    _case(name, "no_sharing", seed, params, heads, d, dtype)
    for name, seed, params in _CROSSOVER_TREES
    for heads, d, dtype in _CROSSOVER_SHAPES
) + tuple(
    _case(name, "random_recursive", seed, params, heads, d, dtype)
    for name, seed, params in _CROSSOVER_FORESTS
    for heads, d, dtype in _CROSSOVER_SHAPES[:4]
)

#: The kernel benchmark's suites of family cases, by ``--suite`` name.
SUITES: dict[str, tuple[FamilyCase, ...]] = {"families": FAMILY_CASES, "crossover": CROSSOVER_CASES}


#: Head layouts of the ``heldout`` suite by default, ``((Hq, Hkv), D, dtype)``: MHA, GQA 4, 7, 8 and
#: 16, one KV head, head dims 64/128/256, fp16 and bf16 (the shapes the families suite covers).
HELDOUT_SHAPES: tuple[tuple[tuple[int, int], int, str], ...] = (
    ((32, 32), 128, "float16"), ((32, 8), 128, "float16"), ((28, 4), 128, "float16"), ((32, 4), 64, "bfloat16"),
    ((16, 1), 128, "float16"), ((8, 1), 256, "bfloat16"), ((16, 2), 256, "bfloat16"), ((32, 8), 256, "bfloat16"),
)  # fmt: skip


def parse_shape(text: str) -> tuple[tuple[int, int], int, str]:
    """A head layout written ``HQxHKV/dD/DTYPE`` (``8x1/d256/bf16``; dtype ``fp16`` or ``bf16``), as
    ``((Hq, Hkv), D, dtype name)``; ``ValueError`` names what is wrong."""
    parts = text.strip().split("/")
    try:
        hq, hkv = (int(x) for x in parts[0].split("x"))
        d = int(parts[1].removeprefix("d")) if parts[1].startswith("d") else -1
        dtype = _SHAPE_DTYPES[parts[2]]
    except (ValueError, IndexError, KeyError):
        msg = f"shape {text!r}: expected HQxHKV/dD/DTYPE such as 8x1/d256/bf16 (dtype fp16 or bf16)"
        raise ValueError(msg) from None
    if len(parts) != 3 or hq < 1 or hkv < 1 or hq % hkv or not 16 <= d <= 256:
        raise ValueError(f"shape {text!r}: Hq must be a positive multiple of Hkv and D in [16, 256]")
    return (hq, hkv), d, dtype


def heldout_cases(
    seed: int,
    n_trees: int,
    shapes: tuple[tuple[tuple[int, int], int, str], ...] = HELDOUT_SHAPES,
    families: tuple[str, ...] | None = None,
    params: dict[str, Any] | None = None,
) -> tuple[FamilyCase, ...]:
    """``n_trees`` cases of the ``heldout`` suite: case ``i`` is a tree of family ``i mod F`` of
    ``families`` (default: every key of :data:`~fasttree.toolkit.workloads.TREE_FAMILIES`, sorted)
    drawn with seed ``seed + i`` and the family's own size ranges, at head layout
    ``shapes[i mod len(shapes)]``. The same arguments give the same cases; pick a ``seed`` no
    earlier decision used. ``families`` narrows a draw to the trees a rule acts on (random
    recursive forests for the crossover's plain decode, say), and ``params`` (keyword parameters
    every named family's generator takes, e.g. ``{"context_tokens": (1024, 4096)}`` for
    ``no_sharing``) narrows their size ranges; a parameter a family refuses is a ``ValueError``
    here, before any case is built."""
    if n_trees < 1 or seed < 0 or not shapes:
        raise ValueError(f"heldout_cases needs n_trees >= 1, seed >= 0 and a shape, got {n_trees}, {seed}, {shapes}")
    if families is None:
        families = tuple(sorted(TREE_FAMILIES))
    unknown = [f for f in families if f not in TREE_FAMILIES]
    if not families or unknown:
        raise ValueError(f"heldout_cases needs families among {sorted(TREE_FAMILIES)}, got {list(families)}")
    cases = []
    params = dict(params or {})
    for family in families if params else ():
        try:
            sample_tree(family, seed, **params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"heldout_cases: family {family} refuses params {params}: {exc}") from None
    for i in range(n_trees):
        heads, d, dtype = shapes[i % len(shapes)]
        family = families[i % len(families)]
        cases.append(_case(f"{family}#{seed + i}", family, seed + i, params, tuple(heads), d, dtype))
    return tuple(cases)


def family_tree(case: FamilyCase) -> KVTree:
    """The tree of ``case`` (deterministic: the family's generator with the case's seed)."""
    return sample_tree(case.family, case.seed, **case.params)
