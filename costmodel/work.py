"""Work counts of a plan, per tile class and for the merge: what the kernels will do.

:func:`plan_work` reads a :class:`fasttree.plan_arrays.Plan` (host arrays only, no GPU)
and counts, per tile class, the programs the launch starts, their rows and padded rows,
KV tokens and padded tokens, inner-loop iterations, bytes and tensor-core flops, and for
the merge pass its programs and bytes. The simulator and the features are built on it.

Dimension names: ``Hq``/``Hkv`` query/KV heads, ``g = Hq / Hkv``, ``D`` head dim,
``U_c`` units of tile class ``c``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fasttree.attention import merge_heads_per_program
from fasttree.tree import ragged_arange

__all__ = ["ClassWork", "MergeWork", "PlanWork", "plan_work"]

#: Bytes of one index (int32 ``kv_indices``) and one row-mask entry per KV token.
_INDEX_BYTES = 4
#: fp32 partial output and LSE bytes.
_F32 = 4


@dataclass(frozen=True)
class ClassWork:
    """What one tile class's launch does.

    Attributes
    ----------
    programs : int
        Programs launched: ``U_c * Hkv``.
    block_m, block_n, num_warps, num_stages : int
        The class's launch shape.
    masked : bool
    rows : int
        Matrix rows that serve a query, over all programs (pairs x g x Hkv).
    padded_rows : int
        ``programs * block_m``.
    kv_tokens : int
        KV tokens read, over all programs.
    padded_kv_tokens : int
        KV tokens rounded up to whole ``block_n`` tiles, over all programs.
    iterations : int
        Inner-loop tiles, over all programs.
    max_iterations : int
        Inner-loop tiles of the longest program.
    prog_iterations : ndarray, int64 [U_c]
        Inner-loop tiles of each unit's programs (one per KV head), decreasing.
    bytes : int
        DRAM bytes the programs move: K and V tiles, indices (and masks), queries, outputs.
    flops : int
        Tensor-core flops including padding: ``4 * block_m * padded tokens * D`` per program.
    useful_flops : int
        ``4 * rows * tokens * D`` (no padding).
    direct_rows, partial_rows : int
        Output rows written to ``out`` directly and to the fp32 partial buffer (x Hq).
    """

    programs: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    masked: bool
    rows: int
    padded_rows: int
    kv_tokens: int
    padded_kv_tokens: int
    iterations: int
    max_iterations: int
    prog_iterations: np.ndarray
    bytes: int
    flops: int
    useful_flops: int
    direct_rows: int
    partial_rows: int


@dataclass(frozen=True)
class MergeWork:
    """The merge pass: one program per (merged query, block of heads); the block is the launch's own
    (:func:`fasttree.attention.merge_heads_per_program`).

    Attributes
    ----------
    programs : int
    queries : int
        Queries with two or more partials.
    partials : int
        Partial rows read (summed over merged queries).
    max_partials : int
        Partials of the query with the most.
    bytes : int
        fp32 partials and LSEs read, outputs written.
    """

    programs: int
    queries: int
    partials: int
    max_partials: int
    bytes: int


@dataclass(frozen=True)
class PlanWork:
    """Work of a whole plan: two tile classes and the merge."""

    classes: tuple[ClassWork, ClassWork]
    merge: MergeWork
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    n_queries: int
    unique_kv_tokens: int
    elem_bytes: int

    @property
    def launches(self) -> int:
        """Kernel launches of one call."""
        return sum(c.programs > 0 for c in self.classes) + (self.merge.programs > 0)

    @property
    def kv_bytes(self) -> int:
        """K and V bytes read by the tile classes."""
        return sum(c.kv_tokens for c in self.classes) * 2 * self.head_dim * self.elem_bytes

    @property
    def min_bytes(self) -> int:
        """Bytes any kernel must move: unique K/V rows once, queries read, outputs written."""
        kv = self.unique_kv_tokens * self.num_kv_heads * 2 * self.head_dim * self.elem_bytes
        qo = 2 * self.n_queries * self.num_q_heads * self.head_dim * self.elem_bytes
        return kv + qo


def _class_work(plan, c: int, elem: int) -> ClassWork:
    tc = plan.tile_classes[c]
    lo, hi = plan.class_unit_ptr[c], plan.class_unit_ptr[c + 1]
    hkv, d, g = plan.num_kv_heads, plan.head_dim, plan.group_size
    kv_len = plan.unit_kv_len[lo:hi].astype(np.int64)
    q_len = plan.unit_q_len[lo:hi].astype(np.int64)
    iters = -(-kv_len // tc.block_n)
    units = int(kv_len.size)
    programs = units * hkv
    kv_tokens = int(kv_len.sum()) * hkv
    padded = int(iters.sum()) * tc.block_n * hkv
    # rows that serve a query: pairs that write something (packed units may hold absent rows)
    if units:
        out_rows = plan.pair_out_row[ragged_arange(plan.unit_q_start[lo:hi].astype(np.int64), q_len)]
        present = int((out_rows != -2).sum())
        direct = int((out_rows == -1).sum())
        partial = present - direct
        pair_tokens = int((kv_len * q_len).sum())
    else:
        present = direct = partial = pair_tokens = 0
    rows = present * g * hkv
    index_bytes = _INDEX_BYTES * (2 if tc.masked else 1)  # kv_indices (and kv_row_mask) per token
    bytes_ = (
        kv_tokens * (2 * d * elem + index_bytes)  # K and V rows, indices
        + rows * d * elem  # queries
        + direct * g * hkv * d * elem  # outputs written directly
        + partial * g * hkv * (d + 1) * _F32  # fp32 partial outputs and LSEs
    )
    return ClassWork(
        programs=programs,
        block_m=tc.block_m,
        block_n=tc.block_n,
        num_warps=tc.num_warps,
        num_stages=tc.num_stages,
        masked=bool(tc.masked),
        rows=rows,
        padded_rows=programs * tc.block_m,
        kv_tokens=kv_tokens,
        padded_kv_tokens=padded,
        iterations=int(iters.sum()) * hkv,
        max_iterations=int(iters.max()) if units else 0,
        prog_iterations=iters,
        bytes=int(bytes_),
        flops=4 * tc.block_m * padded * d,
        useful_flops=4 * pair_tokens * g * hkv * d,
        direct_rows=direct * g * hkv,
        partial_rows=partial * g * hkv,
    )


def plan_work(plan, *, elem_bytes: int = 2) -> PlanWork:
    """Count the work of ``plan`` (a :class:`fasttree.plan_arrays.Plan`).

    Parameters
    ----------
    plan : Plan
        A host plan (``fasttree.plan(...)``).
    elem_bytes : int
        Bytes per Q/K/V element (2 for fp16 and bf16).

    Returns
    -------
    PlanWork
    """
    hq, d = plan.num_q_heads, plan.head_dim
    merged = plan.merge_queries.astype(np.int64)
    parts = plan.query_num_partials.astype(np.int64)[merged]
    merge = MergeWork(
        programs=int(merged.size) * -(-hq // merge_heads_per_program(plan)),
        queries=int(merged.size),
        partials=int(parts.sum()),
        max_partials=int(parts.max()) if parts.size else 0,
        bytes=int(parts.sum()) * hq * (d + 1) * _F32 + int(merged.size) * hq * d * elem_bytes,
    )
    read = plan.kv_indices
    unique = int(np.count_nonzero(np.bincount(read, minlength=1))) if read.size else 0
    return PlanWork(
        classes=(_class_work(plan, 0, elem_bytes), _class_work(plan, 1, elem_bytes)),
        merge=merge,
        num_q_heads=hq,
        num_kv_heads=plan.num_kv_heads,
        head_dim=d,
        n_queries=plan.n_queries,
        unique_kv_tokens=unique,
        elem_bytes=elem_bytes,
    )
