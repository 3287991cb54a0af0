"""Work counts of a plan, per tile class and for the merge: what the kernels will do.

:func:`plan_work` reads a :class:`fasttree.plan_arrays.Plan` (host arrays only, no GPU)
and counts, per tile class, the programs the launch starts, their rows and padded rows,
KV tokens and padded tokens, inner-loop iterations, bytes and tensor-core flops, and for
the merge pass its programs and bytes. The simulator and the features are built on it.
:func:`plan_work_batch` counts the same for many plans at once, as arrays (the batched
feature path, :func:`fasttree.costmodel.features.features_of_plans`).

Dimension names: ``Hq``/``Hkv`` query/KV heads, ``g = Hq / Hkv``, ``D`` head dim,
``U_c`` units of tile class ``c``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fasttree.launch_rules import merge_heads_per_program
from fasttree.tree import ragged_arange

__all__ = ["ClassWork", "MergeWork", "PlanWork", "WorkBatch", "plan_work", "plan_work_batch", "unique_count"]

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
    (:func:`fasttree.launch_rules.merge_heads_per_program`).

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


def unique_count(values: np.ndarray) -> int:
    """Distinct values of a 1-D array of non-negative integers (a plan's ``kv_indices``).

    KV indices are mostly runs of consecutive slots: the array is cut into maximal runs
    ``v, v + 1, ...`` and the union of their intervals is measured, which reads the
    array once instead of counting into a table as long as the largest value. When the
    runs are short (few tokens per run) a table (``np.bincount``) is used instead.
    """
    n = int(values.size)
    if n == 0:
        return 0
    breaks = np.flatnonzero(values[1:] - values[:-1] != 1)
    n_runs = breaks.size + 1
    if n_runs * 8 > n:
        return int(np.count_nonzero(np.bincount(values, minlength=1)))
    lo = np.empty(n_runs, dtype=np.int64)
    hi = np.empty(n_runs, dtype=np.int64)
    lo[0] = values[0]
    lo[1:] = values[breaks + 1]
    hi[:-1] = values[breaks]
    hi[-1] = values[-1]
    if n_runs > 1:
        order = lo.argsort(kind="stable")
        lo, hi = lo[order], hi[order]
        # a run starts after every value the runs before it (by start) reach
        reach = np.maximum.accumulate(hi)
        np.maximum(lo[1:], reach[:-1] + 1, out=lo[1:])
    return int(np.maximum(hi - lo + 1, 0).sum())


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
    return PlanWork(
        classes=(_class_work(plan, 0, elem_bytes), _class_work(plan, 1, elem_bytes)),
        merge=merge,
        num_q_heads=hq,
        num_kv_heads=plan.num_kv_heads,
        head_dim=d,
        n_queries=plan.n_queries,
        unique_kv_tokens=unique_count(plan.kv_indices),
        elem_bytes=elem_bytes,
    )


#: Per-tile-class fields of :class:`WorkBatch` (arrays [n_plans, 2]), as in :class:`ClassWork`.
CLASS_FIELDS = (
    "programs",
    "block_m",
    "block_n",
    "num_warps",
    "num_stages",
    "masked",
    "rows",
    "padded_rows",
    "kv_tokens",
    "padded_kv_tokens",
    "iterations",
    "max_iterations",
    "bytes",
    "flops",
    "useful_flops",
    "direct_rows",
    "partial_rows",
)


@dataclass(frozen=True)
class WorkBatch:
    """Work of many plans as arrays: :class:`PlanWork` field by field, one row per plan.

    Attributes
    ----------
    classes : dict of str to ndarray, int64 [n, 2]
        Every :data:`CLASS_FIELDS` entry of both tile classes (``masked`` as 0/1).
    unit_iterations : ndarray, int64 [total units]
        ``prog_iterations`` of every (plan, class), back to back: plan ``i``'s class ``c``
        is ``unit_iterations[unit_ptr[2 * i + c]:unit_ptr[2 * i + c + 1]]``.
    unit_ptr : ndarray, int64 [2 * n + 1]
    merge_programs, merge_queries, merge_partials, merge_max_partials, merge_bytes : ndarray, int64 [n]
    num_q_heads, num_kv_heads, head_dim, n_queries, unique_kv_tokens, elem_bytes : ndarray, int64 [n]
    tile_mode : tuple of str
    """

    classes: dict[str, np.ndarray]
    unit_iterations: np.ndarray
    unit_ptr: np.ndarray
    merge_programs: np.ndarray
    merge_queries: np.ndarray
    merge_partials: np.ndarray
    merge_max_partials: np.ndarray
    merge_bytes: np.ndarray
    num_q_heads: np.ndarray
    num_kv_heads: np.ndarray
    head_dim: np.ndarray
    n_queries: np.ndarray
    unique_kv_tokens: np.ndarray
    elem_bytes: np.ndarray
    tile_mode: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.num_q_heads.size)

    @property
    def launches(self) -> np.ndarray:
        """Kernel launches of one call, per plan."""
        return (self.classes["programs"] > 0).sum(axis=1) + (self.merge_programs > 0)

    @property
    def min_bytes(self) -> np.ndarray:
        """:attr:`PlanWork.min_bytes` per plan."""
        kv = self.unique_kv_tokens * self.num_kv_heads * 2 * self.head_dim * self.elem_bytes
        return kv + 2 * self.n_queries * self.num_q_heads * self.head_dim * self.elem_bytes


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, dtype=np.int64)


def _seg_sum(cumsum: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Sums over ``start[k]:end[k]`` from an exclusive cumulative sum (length + 1)."""
    return cumsum[end] - cumsum[start]


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def plan_work_batch(plans, *, elem_bytes: int | np.ndarray | list[int] = 2) -> WorkBatch:
    """:func:`plan_work` of many plans at once (the same numbers, as arrays).

    Parameters
    ----------
    plans : sequence of Plan
        At least one host plan.
    elem_bytes : int or sequence of int
        Bytes per Q/K/V element, for all plans or one per plan.

    Returns
    -------
    WorkBatch

    Raises
    ------
    ValueError
        On no plans, a wrong number of ``elem_bytes``, or a plan whose tile classes do
        not cover its units in order.
    """
    plans = list(plans)
    n = len(plans)
    if n == 0:
        raise ValueError("no plans given")
    eb = _elem_bytes_per_plan(elem_bytes, n)
    hq = np.array([p.num_q_heads for p in plans], dtype=np.int64)
    hkv = np.array([p.num_kv_heads for p in plans], dtype=np.int64)
    d = np.array([p.head_dim for p in plans], dtype=np.int64)
    ptr = _class_unit_ptr(plans)
    shape = _tile_shapes(plans)
    seg = _class_segments(plans, ptr, block_n=shape[:, :, 1])
    classes = _class_fields(seg, shape, hkv=hkv, g=hq // hkv, d=d, eb=eb)
    merge = _merge_work(plans, hq)
    return WorkBatch(
        classes=classes,
        unit_iterations=seg.iters,
        unit_ptr=np.append(seg.lo, seg.hi[-1]),
        merge_programs=merge.programs,
        merge_queries=merge.queries,
        merge_partials=merge.partials,
        merge_max_partials=merge.max_partials,
        merge_bytes=merge.partials * hq * (d + 1) * _F32 + merge.queries * hq * d * eb,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        n_queries=np.array([p.n_queries for p in plans], dtype=np.int64),
        unique_kv_tokens=np.array([unique_count(p.kv_indices) for p in plans], dtype=np.int64),
        elem_bytes=np.ascontiguousarray(eb),
        tile_mode=tuple(p.tile_mode for p in plans),
    )


def _elem_bytes_per_plan(elem_bytes: int | np.ndarray | list[int], n: int) -> np.ndarray:
    """``elem_bytes`` as one int64 value per plan."""
    if np.ndim(elem_bytes) == 0:
        return np.broadcast_to(np.asarray(elem_bytes, dtype=np.int64), (n,))
    eb = np.asarray(elem_bytes, dtype=np.int64)
    if eb.shape != (n,):
        raise ValueError(f"elem_bytes holds {eb.size} values for {n} plans")
    return eb


def _class_unit_ptr(plans: list) -> np.ndarray:
    """Every plan's ``class_unit_ptr`` (int64 ``[n, 3]``), checked to cover its units in order."""
    ptr = np.array([p.class_unit_ptr for p in plans], dtype=np.int64)
    n_units = np.array([p.unit_kv_len.size for p in plans], dtype=np.int64)
    bad = (ptr[:, 0] != 0) | (ptr[:, 2] != n_units) | (ptr[:, 1] < 0) | (ptr[:, 1] > n_units)
    if np.count_nonzero(bad):
        raise ValueError("a plan's tile classes do not cover its units (class_unit_ptr)")
    return ptr


def _tile_shapes(plans: list) -> np.ndarray:
    """``(block_m, block_n, num_warps, num_stages, masked)`` of both tile classes of every plan, int64 ``[n, 2, 5]``."""
    tc = [(c.block_m, c.block_n, c.num_warps, c.num_stages, c.masked) for p in plans for c in p.tile_classes]
    return np.array(tc, dtype=np.int64).reshape(len(plans), 2, 5)


@dataclass(frozen=True)
class _Segments:
    """The units of every (plan, class) back to back, segment ``k = 2 * plan + class`` being
    ``lo[k]:hi[k]``, and per-segment sums (``[n, 2]``) of what the class work needs."""

    lo: np.ndarray
    hi: np.ndarray
    units: np.ndarray  # [n, 2]
    iters: np.ndarray  # KV-tile iterations of every unit
    kv: np.ndarray  # KV tokens
    iterations: np.ndarray
    max_iterations: np.ndarray
    pair_tokens: np.ndarray  # KV tokens x queries over the units
    present: np.ndarray  # pairs that write something
    direct: np.ndarray  # pairs that write the output directly


def _class_segments(plans: list, ptr: np.ndarray, *, block_n: np.ndarray) -> _Segments:
    n = len(plans)
    n_units = ptr[:, 2]
    unit_off = _exclusive_cumsum(n_units)
    seg_lo = (unit_off[:-1, None] + ptr[:, :2]).ravel()
    seg_hi = (unit_off[:-1, None] + ptr[:, 1:]).ravel()
    seg_units = seg_hi - seg_lo
    kv_len = _concat([p.unit_kv_len for p in plans])
    q_len = _concat([p.unit_q_len for p in plans])
    iters = -(-kv_len // np.repeat(block_n.ravel(), seg_units))
    # pairs that write something (-1: directly, >= 0: a partial row; -2: an absent row of a packed unit)
    out_row = _concat([p.pair_out_row for p in plans])
    pair_off = _exclusive_cumsum(np.array([p.pair_out_row.size for p in plans], dtype=np.int64))
    q_start = _concat([p.unit_q_start for p in plans]) + np.repeat(pair_off[:-1], n_units)
    unit_present = _seg_sum(_exclusive_cumsum(out_row != -2), q_start, q_start + q_len)
    unit_direct = _seg_sum(_exclusive_cumsum(out_row == -1), q_start, q_start + q_len)
    max_iters = np.zeros(2 * n, dtype=np.int64)
    full = seg_units > 0
    if np.count_nonzero(full):
        max_iters[full] = np.maximum.reduceat(iters, seg_lo[full])

    def per_class(per_unit: np.ndarray) -> np.ndarray:
        return _seg_sum(_exclusive_cumsum(per_unit), seg_lo, seg_hi).reshape(n, 2)

    return _Segments(
        lo=seg_lo,
        hi=seg_hi,
        units=seg_units.reshape(n, 2),
        iters=iters,
        kv=per_class(kv_len),
        iterations=per_class(iters),
        max_iterations=max_iters.reshape(n, 2),
        pair_tokens=per_class(kv_len * q_len),
        present=per_class(unit_present),
        direct=per_class(unit_direct),
    )


def _class_fields(
    seg: _Segments, shape: np.ndarray, *, hkv: np.ndarray, g: np.ndarray, d: np.ndarray, eb: np.ndarray
) -> dict[str, np.ndarray]:
    """:data:`CLASS_FIELDS` of both tile classes of every plan (``[n, 2]`` each)."""
    block_m, block_n = shape[:, :, 0], shape[:, :, 1]
    hkv2, g2, d2, eb2 = hkv[:, None], g[:, None], d[:, None], eb[:, None]
    partial = seg.present - seg.direct
    programs = seg.units * hkv2
    kv_tokens = seg.kv * hkv2
    padded = seg.iterations * block_n * hkv2
    rows = seg.present * g2 * hkv2
    index_bytes = 4 * (1 + shape[:, :, 4])  # kv_indices (and kv_row_mask) per token
    bytes_ = (
        kv_tokens * (2 * d2 * eb2 + index_bytes)
        + rows * d2 * eb2
        + seg.direct * g2 * hkv2 * d2 * eb2
        + partial * g2 * hkv2 * (d2 + 1) * _F32
    )
    return {
        "programs": programs,
        "block_m": block_m,
        "block_n": block_n,
        "num_warps": shape[:, :, 2],
        "num_stages": shape[:, :, 3],
        "masked": shape[:, :, 4],
        "rows": rows,
        "padded_rows": programs * block_m,
        "kv_tokens": kv_tokens,
        "padded_kv_tokens": padded,
        "iterations": seg.iterations * hkv2,
        "max_iterations": seg.max_iterations,
        "bytes": bytes_,
        "flops": 4 * block_m * padded * d2,
        "useful_flops": 4 * seg.pair_tokens * g2 * hkv2 * d2,
        "direct_rows": seg.direct * g2 * hkv2,
        "partial_rows": partial * g2 * hkv2,
    }


@dataclass(frozen=True)
class _MergeWork:
    """The merge kernel's work per plan: programs, merged queries, their partials and the most of one query."""

    programs: np.ndarray
    queries: np.ndarray
    partials: np.ndarray
    max_partials: np.ndarray


def _merge_work(plans: list, hq: np.ndarray) -> _MergeWork:
    """Partials of every merged query, per plan."""
    n = len(plans)
    n_merged = np.array([p.merge_queries.size for p in plans], dtype=np.int64)
    q_off = _exclusive_cumsum(np.array([p.query_num_partials.size for p in plans], dtype=np.int64))
    merged = _concat([p.merge_queries for p in plans]) + np.repeat(q_off[:-1], n_merged)
    parts = _concat([p.query_num_partials for p in plans])[merged]
    m_off = _exclusive_cumsum(n_merged)
    m_partials = _seg_sum(_exclusive_cumsum(parts), m_off[:-1], m_off[1:])
    m_max = np.zeros(n, dtype=np.int64)
    has = n_merged > 0
    if np.count_nonzero(has):
        m_max[has] = np.maximum.reduceat(parts, m_off[:-1][has])
    heads_per_prog = np.array([merge_heads_per_program(p) if p.merge_queries.size else 1 for p in plans])
    return _MergeWork(
        programs=n_merged * -(-hq // heads_per_prog), queries=n_merged, partials=m_partials, max_partials=m_max
    )
