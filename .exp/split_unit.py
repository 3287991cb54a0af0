"""Scratch: the stage-1 unit with its KV tile split across warps by a batched (3-D) dot."""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _kv_tile_split(
    start, kv_start, kv_len, q3, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn, stride_vn, qk_scale,
    row_bit, d, d_valid,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_NS: tl.constexpr, MASKED: tl.constexpr,
    UPCAST_DOT: tl.constexpr, OFFSETS_32: tl.constexpr, BOUNDED: tl.constexpr,
):  # fmt: skip
    n = start + tl.arange(0, SPLIT)[:, None] * BLOCK_NS + tl.arange(0, BLOCK_NS)[None, :]  # [S, NS]
    d3 = d[None, None, :]
    if BOUNDED:
        n_valid = n < kv_len
        slot = tl.load(KvIndices + kv_start + n, mask=n_valid, other=0)
        kv_mask = n_valid[:, :, None] & d_valid[None, None, :]
    else:
        slot = tl.load(KvIndices + kv_start + n)
        kv_mask = d_valid[None, None, :]
    if not OFFSETS_32:
        slot = slot.to(tl.int64)
    k_ptrs = k_base + slot[:, :, None] * stride_kn + d3
    v_ptrs = v_base + slot[:, :, None] * stride_vn + d3
    if BOUNDED or HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q3, tl.permute(k, (0, 2, 1))) * qk_scale  # [S, M, NS]
    if MASKED:
        if BOUNDED:
            bits = tl.load(KvRowMask + kv_start + n, mask=n_valid, other=0)
        else:
            bits = tl.load(KvRowMask + kv_start + n)
        s = tl.where(((bits[:, None, :] >> row_bit[None, :, None]) & 1) != 0, s, float("-inf"))
    elif BOUNDED:
        s = tl.where(n_valid[:, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, :, None])
    l_i = l_i * alpha + tl.sum(p, 2)
    if BOUNDED or HEAD_DIM != BLOCK_D:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, :, None] + tl.dot(p, v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["unit_offset", "stride_ln"])
def units_split_kernel(
    Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask, UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery,
    PairOutRow, unit_offset, qk_scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on,
    stride_oh, stride_pn, stride_ph, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, UPCAST_DOT: tl.constexpr, OFFSETS_32: tl.constexpr = False, PEEL: tl.constexpr = False,
    SPLIT: tl.constexpr = 2,
):  # fmt: skip
    BLOCK_NS: tl.constexpr = BLOCK_N // SPLIT
    unit = tl.program_id(0) + unit_offset
    kv_head = tl.program_id(1)
    kv_start = tl.load(UnitKvStart + unit)
    kv_len = tl.load(UnitKvLen + unit)
    q_start = tl.load(UnitQStart + unit)
    q_len = tl.load(UnitQLen + unit)

    rows = tl.arange(0, BLOCK_M)
    row_query = rows // GROUP
    row_valid = row_query < q_len
    head = kv_head * GROUP + rows % GROUP
    qid = tl.load(PairQuery + q_start + row_query, mask=row_valid, other=0).to(tl.int64)
    out_row = tl.load(PairOutRow + q_start + row_query, mask=row_valid, other=-2)

    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(
        Q + qid[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q3 = tl.broadcast_to(q[None, :, :], (SPLIT, BLOCK_M, BLOCK_D))

    # finite: a split may see no entry of a tile (or of the unit)
    m_i = tl.full([SPLIT, BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([SPLIT, BLOCK_M], tl.float32)
    acc = tl.zeros([SPLIT, BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    row_bit = tl.minimum(row_query, 31)
    if PEEL:
        full = kv_len - kv_len % BLOCK_N
        for start in range(0, full, BLOCK_N):
            m_i, l_i, acc = _kv_tile_split(
                start, kv_start, kv_len, q3, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn,
                stride_vn, qk_scale, row_bit, d, d_valid, HEAD_DIM, BLOCK_D, SPLIT, BLOCK_NS, MASKED, UPCAST_DOT,
                OFFSETS_32, False,
            )  # fmt: skip
        if full < kv_len:
            m_i, l_i, acc = _kv_tile_split(
                full, kv_start, kv_len, q3, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn,
                stride_vn, qk_scale, row_bit, d, d_valid, HEAD_DIM, BLOCK_D, SPLIT, BLOCK_NS, MASKED, UPCAST_DOT,
                OFFSETS_32, True,
            )  # fmt: skip
    else:
        for start in range(0, kv_len, BLOCK_N):
            m_i, l_i, acc = _kv_tile_split(
                start, kv_start, kv_len, q3, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn,
                stride_vn, qk_scale, row_bit, d, d_valid, HEAD_DIM, BLOCK_D, SPLIT, BLOCK_NS, MASKED, UPCAST_DOT,
                OFFSETS_32, True,
            )  # fmt: skip

    # combine the splits' softmax states
    m = tl.max(m_i, 0)  # [M]
    w = tl.exp2(m_i - m[None, :])  # [S, M]
    l_tot = tl.sum(l_i * w, 0)
    acc_tot = tl.sum(acc * w[:, :, None], 0)
    l_tot = tl.maximum(l_tot, 1.0e-30)
    o = acc_tot / l_tot[:, None]
    direct = row_valid & (out_row == -1)
    partial = row_valid & (out_row >= 0)
    tl.store(
        Out + qid[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
        o.to(Out.dtype.element_ty),
        mask=direct[:, None] & d_valid[None, :],
    )
    prow = tl.maximum(out_row, 0).to(tl.int64)
    tl.store(
        PartO + prow[:, None] * stride_pn + head[:, None] * stride_ph + d[None, :],
        o,
        mask=partial[:, None] & d_valid[None, :],
    )
    lse = (m + tl.log2(l_tot)) * LN2
    tl.store(PartLse + prow * stride_ln + head, lse, mask=partial)
