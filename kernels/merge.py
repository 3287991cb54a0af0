"""Stage 2 of tree attention: merge each query's partial results.

One program per (merged query, block of ``BLOCK_H`` query heads); small head blocks
keep many programs in flight when few queries have many partials. With partial
outputs ``o_i`` and natural-log LSEs ``lse_i``::

    lse = m + log(sum_i exp(lse_i - m)),   o = sum_i exp(lse_i - lse) * o_i

computed online over the query's contiguous partial rows, ``BLOCK_P`` rows at a time so
that a query with many partials (a long context split into many chunks) keeps many
loads in flight instead of waiting for one row after another.
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
    BLOCK_P: tl.constexpr,  # partial rows loaded at once
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
    p = tl.arange(0, BLOCK_P)
    h_off = h[None, :, None] * stride_ph + d[None, None, :]
    for first in range(0, count, BLOCK_P):
        p_valid = first + p < count
        row = start + first + p
        lse = tl.load(
            PartLse + row[:, None] * stride_ln + h[None, :], mask=p_valid[:, None] & h_valid[None, :], other=0.0
        )
        lse = tl.where(p_valid[:, None], lse, float("-inf"))  # [BLOCK_P, BLOCK_H]
        o = tl.load(
            PartO + row[:, None, None] * stride_pn + h_off, mask=p_valid[:, None, None] & mask[None, :, :], other=0.0
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        scale = tl.exp(m - m_new)
        w = tl.exp(lse - m_new[None, :])
        s = s * scale + tl.sum(w, 0)
        acc = acc * scale[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    out = acc / s[:, None]
    tl.store(Out + qid * stride_on + h[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty), mask=mask)
