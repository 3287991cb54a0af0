"""Stage 1 of tree attention as a tile stream: a fixed number of programs per KV head,
each walking a contiguous range of KV tiles.

The host cuts every unit's KV into ``BLOCK_N``-token tiles and lists the tiles of one
tile class back to back (a unit's tiles are adjacent); program ``p`` handles tiles
``ProgTiles[p]:ProgTiles[p + 1]``, whose boundaries fall between units. Each loop
iteration is one tile: it loads the unit's query rows, gathers the tile's K and V through
the pool slot ids, and updates the online softmax; the last tile of a unit writes the
unit's output (or fp32 partial + natural-log LSE, as :mod:`.tree_attention`) and resets
the state. Because the tile metadata is indexed by the loop counter alone, the compiler
can prefetch the next tiles' KV while the current one computes, across unit boundaries:
many tiny units (deep trees) no longer pay one memory round trip chain each.

Tile metadata (int32, four per tile ``t``, loaded as one vector): the tile's first
entry in ``KvIndices``; the unit's first pair; a word packing the valid tokens (bits
0-9), the unit's query count (bits 10-19), a last-tile flag (bit 20) and a first-tile
flag (bit 21); padding. The query rows are loaded on a unit's first tile only.
"""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
META_TOKENS_MASK = tl.constexpr(1023)
META_QUERIES_SHIFT = tl.constexpr(10)
META_LAST_SHIFT = tl.constexpr(20)
META_FIRST_SHIFT = tl.constexpr(21)


@triton.jit
def tree_attention_stream_kernel(
    Q,  # [n_queries, Hq, D], fp16/bf16
    K,  # [pool_slots, Hkv, D]
    V,  # [pool_slots, Hkv, D]
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # [n_partial_rows, Hq, D], fp32
    PartLse,  # [n_partial_rows, Hq], fp32
    KvIndices,  # int32 [n_kv_entries]
    TileInfo,  # int32 [n_tiles, 4]: (first KvIndices entry, first pair, meta, 0)
    ProgTiles,  # int32 [n_programs + 1] per class, back to back
    PairQuery,  # int32 [n_pairs]
    PairOutRow,  # int32 [n_pairs]; -1: write Out directly
    prog_offset,  # first ProgTiles entry of the launched tile class
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # only under the Triton interpreter, whose bf16 tl.dot is wrong
):
    prog = tl.program_id(0) + prog_offset
    kv_head = tl.program_id(1)
    t_begin = tl.load(ProgTiles + prog)
    t_end = tl.load(ProgTiles + prog + 1)

    rows = tl.arange(0, BLOCK_M)
    row_query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    four = tl.arange(0, 4)
    q = tl.zeros([BLOCK_M, BLOCK_D], Q.dtype.element_ty)
    for t in range(t_begin, t_end):
        info = tl.load(TileInfo + t * 4 + four)
        kv_pos = tl.sum(tl.where(four == 0, info, 0))
        q_pos = tl.sum(tl.where(four == 1, info, 0))
        meta = tl.sum(tl.where(four == 2, info, 0))
        n_valid = meta & META_TOKENS_MASK
        q_len = (meta >> META_QUERIES_SHIFT) & META_TOKENS_MASK
        first = ((meta >> META_FIRST_SHIFT) & 1) != 0
        row_valid = row_query < q_len
        qid = tl.load(PairQuery + q_pos + row_query, mask=row_valid, other=0).to(tl.int64)
        q_new = tl.load(
            Q + qid[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
            mask=(row_valid & first)[:, None] & d_valid[None, :],
            other=0.0,
        )
        q = tl.where(first, q_new, q)
        n_ok = n < n_valid
        slot = tl.load(KvIndices + kv_pos + n, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_valid[None, :]
        k = tl.load(k_base + slot[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vn + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)
        if UPCAST_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
        if ((meta >> META_LAST_SHIFT) & 1) != 0:
            o = acc / l_i[:, None]
            out_row = tl.load(PairOutRow + q_pos + row_query, mask=row_valid, other=0)
            direct = row_valid & (out_row < 0)
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
            lse = (m_i + tl.log2(l_i)) * LN2
            tl.store(PartLse + prow * stride_ln + head, lse, mask=partial)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
