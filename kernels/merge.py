"""Stage 2 of tree attention: merge each query's partial results.

With partial outputs ``o_i`` and natural-log LSEs ``lse_i`` of a query's contiguous
partial rows::

    M = max_i lse_i,   lse = M + log(sum_i exp(lse_i - M)),   o = sum_i exp(lse_i - lse) * o_i

Two kernels, the host picks one per plan:

- :func:`merge_partials_kernel`: one program per (merged query, block of ``BLOCK_H``
  query heads), reading the partials one row at a time (online). Best when queries
  have a few partials each.
- :func:`merge_many_partials_kernel`: one program per (merged query, query head),
  reading ``BLOCK_P`` partial rows as one ``[BLOCK_P, D]`` tile, so a query's loads are
  all in flight at once. Best when some queries have many partials (long split chains).

Both also run a launch variant of :mod:`fasttree.runtime` (the merge list at a fixed address,
filled past the plan's with a query of no partial, whose programs write nothing), and
:func:`merge_partials_persistent_kernel` runs both for :mod:`fasttree.runtime`: a fixed
number of programs loop over the items of the plan buffer's merge list (its two parts'
lengths read from the buffer's header), so the launch does not depend on the plan.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .tree_attention import (
    HDR_MERGE_COUNTS,
    HDR_MERGE_QUERIES,
    HDR_QUERY_NUM_PARTIALS,
    HDR_QUERY_PARTIAL_START,
)


@triton.jit
def _merge_head_block(
    index,
    head_block,
    Out,
    PartO,
    PartLse,
    MergeQueries,
    QueryPartialStart,
    QueryNumPartials,
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    stride_ln,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WAIT: tl.constexpr = False,
):
    """Merge entry ``index`` of ``MergeQueries``, heads ``head_block * BLOCK_H ...``, one partial row at a time.
    ``WAIT``: wait for the prior grid (``griddepcontrol.wait``) after reading the plan's arrays.
    A query with no partial (a launch variant's filler past the list) writes nothing."""
    qid = tl.load(MergeQueries + index).to(tl.int64)
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = h < NUM_HEADS
    d = tl.arange(0, BLOCK_D)
    mask = h_valid[:, None] & (d < HEAD_DIM)[None, :]
    start = tl.load(QueryPartialStart + qid).to(tl.int64)
    count = tl.load(QueryNumPartials + qid)
    if WAIT:
        gdc_wait()

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(count):
        row = start + i
        lse = tl.load(PartLse + row * stride_ln + h, mask=h_valid, other=0.0)
        o = tl.load(PartO + row * stride_pn + h[:, None] * stride_ph + d[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        scale = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        s = s * scale + w
        acc = acc * scale[:, None] + w[:, None] * o
        m = m_new
    out = acc / s[:, None]
    tl.store(
        Out + qid * stride_on + h[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask & (count > 0),
    )


@triton.jit
def _merge_one_head(
    index,
    head,
    Out,
    PartO,
    PartLse,
    MergeQueries,
    QueryPartialStart,
    QueryNumPartials,
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    stride_ln,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WAIT: tl.constexpr = False,
):
    """Merge entry ``index`` of ``MergeQueries``, one head, ``BLOCK_P`` partial rows at a time.
    ``WAIT``: wait for the prior grid (``griddepcontrol.wait``) after reading the plan's arrays.
    A query with no partial (a launch variant's filler past the list) writes nothing."""
    qid = tl.load(MergeQueries + index).to(tl.int64)
    h = head.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    p = tl.arange(0, BLOCK_P)
    start = tl.load(QueryPartialStart + qid).to(tl.int64)
    count = tl.load(QueryNumPartials + qid)
    if WAIT:
        gdc_wait()

    # pass 1: the largest LSE
    top = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for c in range(0, count, BLOCK_P):
        valid = c + p < count
        lse = tl.load(PartLse + (start + c + p) * stride_ln + h, mask=valid, other=float("-inf"))
        top = tl.maximum(top, lse)
    m = tl.max(top, 0)

    # pass 2: the weighted sum
    s = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(0, count, BLOCK_P):
        valid = c + p < count
        rows = start + c + p
        lse = tl.load(PartLse + rows * stride_ln + h, mask=valid, other=float("-inf"))
        w = tl.exp(lse - m)  # 0 for rows past the query's partials
        o = tl.load(
            PartO + rows[:, None] * stride_pn + h * stride_ph + d[None, :],
            mask=valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        s += w
        acc += tl.sum(w[:, None] * o, 0)
    out = acc / tl.sum(s, 0)
    tl.store(Out + qid * stride_on + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_valid & (count > 0))


@triton.jit
def merge_partials_kernel(
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # [n_partial_rows, Hq, D], fp32
    PartLse,  # [n_partial_rows, Hq], fp32
    MergeQueries,  # int32 [n_merge]
    QueryPartialStart,  # int32 [n_queries]
    QueryNumPartials,  # int32 [n_queries]
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    stride_ln,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GDC_WAIT: tl.constexpr = 0,  # programmatic dependent launch (see .tree_attention)
):
    if GDC_WAIT == 2:  # the next grid may launch now; it waits for this one's results itself
        gdc_launch_dependents()
    if GDC_WAIT == 1:
        gdc_wait()
    _merge_head_block(
        tl.program_id(0), tl.program_id(1), Out, PartO, PartLse, MergeQueries, QueryPartialStart, QueryNumPartials,
        stride_on, stride_oh, stride_pn, stride_ph, stride_ln, NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, GDC_WAIT == 2,
    )  # fmt: skip


@triton.jit
def merge_many_partials_kernel(
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # [n_partial_rows, Hq, D], fp32
    PartLse,  # [n_partial_rows, Hq], fp32
    MergeQueries,  # int32 [n_merge]
    QueryPartialStart,  # int32 [n_queries]
    QueryNumPartials,  # int32 [n_queries]
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    stride_ln,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GDC_WAIT: tl.constexpr = 0,  # programmatic dependent launch (see .tree_attention)
):
    if GDC_WAIT == 2:  # the next grid may launch now; it waits for this one's results itself
        gdc_launch_dependents()
    if GDC_WAIT == 1:
        gdc_wait()
    _merge_one_head(
        tl.program_id(0), tl.program_id(1), Out, PartO, PartLse, MergeQueries, QueryPartialStart, QueryNumPartials,
        stride_on, stride_oh, stride_pn, stride_ph, stride_ln, HEAD_DIM, BLOCK_P, BLOCK_D, GDC_WAIT == 2,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_heads", "stride_ln"])
def merge_partials_persistent_kernel(
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # [max_partial_rows, Hq, D], fp32
    PartLse,  # [max_partial_rows, Hq], fp32
    PlanBuf,  # int32 [plan_words]: header and plan arrays (see .tree_attention)
    Counters,  # int32 [N_COUNTERS]: the stage-1 launches' item counters, zeroed here for the next call
    num_heads,
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    stride_ln,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_COUNTERS: tl.constexpr,
    GDC_WAIT: tl.constexpr = 0,  # programmatic dependent launch (see .tree_attention)
):
    """Both merges in one launch: the first ``header[HDR_MERGE_COUNTS]`` entries of the merge list
    by head blocks, one partial row at a time; the next ``header[HDR_MERGE_COUNTS + 1]`` (queries
    with many partials) per head, ``BLOCK_P`` rows at a time."""
    if GDC_WAIT == 2:
        gdc_launch_dependents()
    if GDC_WAIT == 1:  # before the counters are zeroed and any partial is read
        gdc_wait()
    n_few = tl.load(PlanBuf + HDR_MERGE_COUNTS)
    n_many = tl.load(PlanBuf + HDR_MERGE_COUNTS + 1)
    MergeQueries = PlanBuf + tl.load(PlanBuf + HDR_MERGE_QUERIES)
    QueryPartialStart = PlanBuf + tl.load(PlanBuf + HDR_QUERY_PARTIAL_START)
    QueryNumPartials = PlanBuf + tl.load(PlanBuf + HDR_QUERY_NUM_PARTIALS)
    if GDC_WAIT == 2:  # the plan buffer is uploaded before the graph or stream work that reads it
        gdc_wait()
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    if pid == 0:  # stage 1 is done (stream order): its counters can start over
        tl.store(Counters + tl.arange(0, N_COUNTERS), tl.zeros((N_COUNTERS,), tl.int32))
    n_blocks = tl.cdiv(NUM_HEADS, BLOCK_H)
    items_few = n_few * n_blocks
    for item in range(pid, items_few, step):
        index = item // n_blocks
        _merge_head_block(
            index, item - index * n_blocks, Out, PartO, PartLse, MergeQueries, QueryPartialStart, QueryNumPartials,
            stride_on, stride_oh, stride_pn, stride_ph, stride_ln, NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D,
        )  # fmt: skip
    start = (pid - items_few % step + step) % step
    for item in range(start, n_many * num_heads, step):
        index = item // num_heads
        _merge_one_head(
            n_few + index, item - index * num_heads, Out, PartO, PartLse, MergeQueries, QueryPartialStart,
            QueryNumPartials, stride_on, stride_oh, stride_pn, stride_ph, stride_ln, HEAD_DIM, BLOCK_P, BLOCK_D,
        )  # fmt: skip
