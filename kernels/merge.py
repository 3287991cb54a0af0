"""Stage 2 of tree attention: merge each query's partial results.

One program per (merged query, block of ``BLOCK_H`` query heads); small head blocks
keep many programs in flight when few queries have many partials. With partial
outputs ``o_i`` and natural-log LSEs ``lse_i``::

    lse = m + log(sum_i exp(lse_i - m)),   o = sum_i exp(lse_i - lse) * o_i

computed online over the query's contiguous partial rows.
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
