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
"""

import triton
import triton.language as tl


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
):
    qid = tl.load(MergeQueries + tl.program_id(0)).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = h < NUM_HEADS
    d = tl.arange(0, BLOCK_D)
    mask = h_valid[:, None] & (d < HEAD_DIM)[None, :]
    start = tl.load(QueryPartialStart + qid).to(tl.int64)
    count = tl.load(QueryNumPartials + qid)

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
    tl.store(Out + qid * stride_on + h[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty), mask=mask)


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
):
    qid = tl.load(MergeQueries + tl.program_id(0)).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    p = tl.arange(0, BLOCK_P)
    start = tl.load(QueryPartialStart + qid).to(tl.int64)
    count = tl.load(QueryNumPartials + qid)

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
    tl.store(Out + qid * stride_on + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_valid)
