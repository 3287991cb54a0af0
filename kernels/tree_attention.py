"""Tree attention: one program per (work unit, KV head), the merge of partials fused in.

A unit is a chunk of one context-query group's KV (gathered through pool slot ids)
and a tile of that group's queries. The program packs the ``GROUP`` query heads that
share its KV head for each query of the tile into ``BLOCK_M`` matrix rows (row ``r`` is
query ``r // GROUP``, head ``r % GROUP``) and runs an online softmax over the chunk in
``BLOCK_N``-token tiles with fp32 accumulators.

A row whose query has a single partial result writes the output directly. Otherwise it
writes a normalised fp32 partial output and its natural-log LSE, then increments the
(query, head) counter; the program that brings a counter to the query's partial count
merges all of that query's partials for that head::

    lse = m + log(sum_i exp(lse_i - m)),   o = sum_i exp(lse_i - lse) * o_i

and resets the counter to zero, so counters need no clearing between calls (and the
launches can be captured in a CUDA graph). Each tile class is its own launch (grid
``(units of the class, Hkv)``, first unit ``unit_offset``) with its own ``BLOCK_M`` /
``BLOCK_N`` / pipeline depth, so each compiles to its own register budget; the
counters make the merge work across the launches.
"""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tree_attention_kernel(
    Q,  # [n_queries, Hq, D], fp16/bf16
    K,  # [pool_slots, Hkv, D]
    V,  # [pool_slots, Hkv, D]
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # fp32 [n_partial_rows, Hq, D], contiguous
    PartLse,  # fp32 [n_partial_rows, Hq], contiguous
    Counters,  # int32 [n_queries, Hq], zero between calls
    KvIndices,  # int32 [n_kv_entries]
    UnitKvStart,  # int32 [n_units]
    UnitKvLen,  # int32 [n_units]
    UnitQStart,  # int32 [n_units]
    UnitQLen,  # int32 [n_units]
    PairQuery,  # int32 [n_pairs]
    PairOutRow,  # int32 [n_pairs]; -1: write Out directly
    QueryPartialStart,  # int32 [n_queries]
    QueryNumPartials,  # int32 [n_queries]
    unit_offset,  # first unit of the launched tile class
    qk_scale,  # sm_scale * log2(e)
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # only under the Triton interpreter, whose bf16 tl.dot is wrong
):
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
    out_row = tl.load(PairOutRow + q_start + row_query, mask=row_valid, other=0)

    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(
        Q + qid[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    for start in tl.range(0, kv_len, BLOCK_N, num_stages=NUM_STAGES):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_len
        slot = tl.load(KvIndices + kv_start + n, mask=n_valid, other=0).to(tl.int64)
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + slot[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_valid[None, :], s, float("-inf"))
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

    o = acc / l_i[:, None]
    direct = row_valid & (out_row < 0)
    partial = row_valid & (out_row >= 0)
    out_ptr = Out + qid[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr, o.to(Out.dtype.element_ty), mask=direct[:, None] & d_valid[None, :])

    if tl.max(partial.to(tl.int32), 0) > 0:
        # partial rows: [n_partial_rows, NUM_Q_HEADS, HEAD_DIM] fp32 and [n_partial_rows, NUM_Q_HEADS]
        prow = tl.maximum(out_row, 0).to(tl.int64) * NUM_Q_HEADS + head
        tl.store(PartO + prow[:, None] * HEAD_DIM + d[None, :], o, mask=partial[:, None] & d_valid[None, :])
        tl.store(PartLse + prow, (m_i + tl.log2(l_i)) * LN2, mask=partial)
        tl.debug_barrier()  # every thread's partial stores precede the counter increments
        counter = Counters + qid * NUM_Q_HEADS + head
        done = tl.atomic_add(counter, 1, mask=partial, sem="acq_rel", scope="gpu")
        count = tl.load(QueryNumPartials + qid, mask=partial, other=0)
        last = partial & (done == count - 1)
        n_merge = tl.max(tl.where(last, count, 0), 0)
        if n_merge > 0:
            tl.debug_barrier()  # the acquiring threads' view reaches every thread of the program
            first = tl.load(QueryPartialStart + qid, mask=last, other=0).to(tl.int64)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_M], tl.float32)
            merged = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for i in range(n_merge):
                valid = last & (i < count)
                r = (first + i) * NUM_Q_HEADS + head
                lse_i = tl.load(PartLse + r, mask=valid, other=0.0, cache_modifier=".cg")
                o_i = tl.load(
                    PartO + r[:, None] * HEAD_DIM + d[None, :],
                    mask=valid[:, None] & d_valid[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                m_new = tl.where(valid, tl.maximum(m, lse_i), m)
                m_ref = tl.where(valid, m_new, 0.0)  # keeps -inf - -inf out of inactive rows
                scale = tl.exp(tl.where(valid, m, 0.0) - m_ref)
                w = tl.exp(tl.where(valid, lse_i, float("-inf")) - m_ref)
                total = total * scale + w
                merged = merged * scale[:, None] + w[:, None] * o_i
                m = m_new
            merged = merged / tl.where(last, total, 1.0)[:, None]
            tl.store(out_ptr, merged.to(Out.dtype.element_ty), mask=last[:, None] & d_valid[None, :])
            tl.store(counter, tl.zeros([BLOCK_M], tl.int32), mask=last)
