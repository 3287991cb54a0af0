"""Stage 1 for single-query units: decode-style attention without tensor cores.

A unit with one query and a small GQA ratio fills only ``g`` of the (at least 16) matrix
rows of :mod:`.tree_attention`'s tiles, and its program spends more time moving tiles
through shared memory than reading KV. Here one program handles one such unit for
``BLOCK_R`` query heads (``BLOCK_R // BLOCK_G`` KV heads): it gathers ``BLOCK_N`` tokens
x those KV heads x ``HEAD_DIM`` straight into registers (a token's heads are adjacent in
the pool, so each token is one contiguous run), forms scores and outputs with fp32
multiply-adds and reductions, and writes the output or an fp32 partial + natural-log LSE
exactly as the tiled kernel does.

Row ``r`` of the program is query head ``kv_head(r) * GROUP + r % BLOCK_G`` with
``kv_head(r) = pid1 * (BLOCK_R // BLOCK_G) + r // BLOCK_G``; rows past ``GROUP`` within a
KV head, or past the last KV head, are masked.
"""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def single_query_units_kernel(
    Q,  # [n_queries, Hq, D], fp16/bf16
    K,  # [pool_slots, Hkv, D]
    V,  # [pool_slots, Hkv, D]
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # [n_partial_rows, Hq, D], fp32
    PartLse,  # [n_partial_rows, Hq], fp32
    KvIndices,  # int32 [n_kv_entries]
    UnitKvStart,  # int32 [n_units]
    UnitKvLen,  # int32 [n_units]
    UnitQStart,  # int32 [n_units]
    PairQuery,  # int32 [n_pairs]
    PairOutRow,  # int32 [n_pairs]; -1: write Out directly
    unit_offset,  # first single-query unit
    num_kv_heads,
    qk_scale,  # sm_scale * log2(e)
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    stride_ln,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= GROUP
    BLOCK_R: tl.constexpr,  # query-head rows per program, a multiple of BLOCK_G
    BLOCK_N: tl.constexpr,
):
    unit = tl.program_id(0) + unit_offset
    kv_start = tl.load(UnitKvStart + unit)
    kv_len = tl.load(UnitKvLen + unit)
    pair = tl.load(UnitQStart + unit)
    qid = tl.load(PairQuery + pair).to(tl.int64)
    out_row = tl.load(PairOutRow + pair)

    r = tl.arange(0, BLOCK_R)
    kv_head = tl.program_id(1) * (BLOCK_R // BLOCK_G) + r // BLOCK_G
    gi = r % BLOCK_G
    r_valid = (gi < GROUP) & (kv_head < num_kv_heads)
    head = kv_head * GROUP + gi
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    rd_mask = r_valid[:, None] & d_valid[None, :]
    q = tl.load(Q + qid * stride_qn + head[:, None] * stride_qh + d[None, :], mask=rd_mask, other=0.0)
    q = q.to(tl.float32) * qk_scale

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    kh_off = kv_head[None, :, None] * stride_kh + d[None, None, :]
    vh_off = kv_head[None, :, None] * stride_vh + d[None, None, :]
    for start in range(0, kv_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_len
        slot = tl.load(KvIndices + kv_start + n, mask=n_ok, other=0).to(tl.int64)
        mask3 = n_ok[:, None, None] & rd_mask[None, :, :]
        k = tl.load(K + slot[:, None, None] * stride_kn + kh_off, mask=mask3, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :, :], 2)  # [BLOCK_N, BLOCK_R]
        s = tl.where(n_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(V + slot[:, None, None] * stride_vn + vh_off, mask=mask3, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32), 0)
        m_i = m_new

    o = acc / l_i[:, None]
    if out_row < 0:
        tl.store(
            Out + qid * stride_on + head[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty), mask=rd_mask
        )
    else:
        prow = out_row.to(tl.int64)
        tl.store(PartO + prow * stride_pn + head[:, None] * stride_ph + d[None, :], o, mask=rd_mask)
        lse = (m_i + tl.log2(l_i)) * LN2
        tl.store(PartLse + prow * stride_ln + head, lse, mask=r_valid)
