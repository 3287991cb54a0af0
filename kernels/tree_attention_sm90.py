"""Stage 1 of tree attention for sm_90 (H100/H200) in Gluon: a warp-specialized drop-in for
:func:`fasttree.kernels.tree_attention.tree_attention_units_kernel` on the 64-row tile class.

Same arguments (less ``BLOCK_D``, ``UPCAST_DOT`` and ``PEEL``; plus the ring depth and the loader's
warps and registers) and the same semantics: one program per (unit, KV head); K/V rows gathered
through ``KvIndices`` (pool slots); packed units' ``KvRowMask`` bits (row ``r``'s query is ``r //
GROUP``, its bit ``min(r // GROUP, 31)``); ``PairOutRow`` -1 writes ``Out``, >= 0 an fp32 partial row
and its natural-log LSE, -2 nothing; an empty unit (no KV entry) reads only its unit arrays and
writes nothing; ``MASKED`` starts the running max at a finite -1e30.

Design (FlashAttention-3's, written for this kernel's gathered rows):

* ``gl.warp_specialize`` with two partitions sharing a shared-memory ring of ``STAGES`` K and V
  tiles of ``BLOCK_N`` entries: a loader (``LOADER_WARPS`` warps at ``LOADER_REGS`` registers)
  that gathers the unit's Q tile once, then each KV tile's K rows, V rows (and, ``MASKED``, the
  entries' row-mask words) by pool slot with 16-byte ``cp.async`` (rows are scattered, so TMA
  tiles do not apply), each thread arriving on the stage's "ready" mbarrier when its copies land;
  and the consumer (the default partition, one warpgroup) that runs ``warpgroup_mma`` for
  S = Q K^T (both from shared memory) and O += P V (P from registers) with an fp32 online softmax
  in exp2 (``qk_scale`` holds log2 e), releasing each stage's K and V halves through "empty"
  mbarriers.
* Tile j's QK^T is issued right behind tile j-1's PV, and tile j's softmax runs while that PV is
  in flight; O is rescaled once the PV completes.
* Gluon lowers an ``mbarrier.arrive`` to one thread of its partition, so the consumer's warps
  meet at ``gl.thread_barrier()`` before each release; a proxy fence follows every ready wait
  (``cp.async`` writes through the generic proxy, wgmma reads through the async one).

Launch with ``num_warps=4`` (the consumer warpgroup; the loader's warps come on top) and the
``maxnreg`` of :data:`fasttree.launch_rules.SM90_TILES`, which the loader and the consumer share
through ``setmaxnreg``. ``GDC_WAIT`` (the last constexpr, as in every kernel of the package) is
non-zero under programmatic dependent launch: the program waits for the prior grid first.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def _gather_layout(head_dim, num_warps):
    """Register layout of a gathered [rows, head_dim] tile: 16-byte vectors (8 fp16/bf16), a row's
    vectors on adjacent lanes (up to a warp), warps stacked over rows."""
    vec = 8
    tpw_d = min(32, head_dim // vec)
    return gl.BlockedLayout([1, vec], [32 // tpw_d, tpw_d], [num_warps, 1], [1, 0])


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader_partition(
    Q, K, V, KvIndices, KvRowMask, UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery,
    unit, kv_head, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    q_smem, k_smem, v_smem, bits_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
    HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, MASKED: gl.constexpr, OFFSETS_32: gl.constexpr,
):  # fmt: skip
    """Worker partition: gathers Q once, then K / V (and row masks) of every KV tile into the ring.

    Every thread ends each group of copies with ``cp.async.mbarrier.arrive.noinc`` on the stage's
    ready barrier (initialised to the loader's thread count): the barrier completes when every
    thread's copies have landed. The tail tile repeats the unit's last entry (clamped index), so
    every gathered row is a real, finite row; the consumer masks those columns."""
    NW: gl.constexpr = gl.num_warps()
    kv_start = gl.load(UnitKvStart + unit)
    kv_len = gl.load(UnitKvLen + unit)
    if kv_len > 0:  # an empty unit (no query, no KV entry) reads nothing past its unit arrays
        q_start = gl.load(UnitQStart + unit)
        q_len = gl.load(UnitQLen + unit)
        # one register layout for every gathered tile (Q, K, V) and one column index over the head dim
        gather: gl.constexpr = _gather_layout(HEAD_DIM, NW)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather))
        dk = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gather))
        idx_base = KvIndices + kv_start
        last = kv_len - 1
        # the first tile's slots before anything else: their latency overlaps the Q gather
        slot = gl.load(idx_base + gl.minimum(offs_n, last))

        # Q rows: query r // GROUP of the unit's pairs, head kv_head * GROUP + r % GROUP; rows past
        # the unit's queries are zero-filled (cp.async with a false mask copies zeros)
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather))
        row_query = rows // GROUP
        row_valid = row_query < q_len
        head = kv_head * GROUP + rows % GROUP
        qid = gl.load(PairQuery + q_start + row_query, mask=row_valid, other=0).to(gl.int64)
        q_ptrs = Q + (qid * stride_qn + head * stride_qh)[:, None] + dk[None, :]
        q_mask = row_valid[:, None] & (dk < HEAD_DIM)[None, :]
        cp.async_copy_global_to_shared(q_smem, q_ptrs, mask=q_mask)
        cp.mbarrier_arrive(q_bar, increment_count=False)

        bits_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        offs_b = gl.arange(0, BLOCK_N, layout=bits_layout)
        k_base = K + kv_head * stride_kh
        v_base = V + kv_head * stride_vh
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        for j in range(n_tiles):
            s = j % STAGES
            ph = (j // STAGES) & 1
            # the next tile's slots (clamped: the last tile re-reads its own), one tile ahead
            nxt = gl.load(idx_base + gl.minimum((j + 1) * BLOCK_N + offs_n, last))
            if OFFSETS_32:
                k_off = slot * stride_kn
                v_off = slot * stride_vn
            else:
                k_off = slot.to(gl.int64) * stride_kn
                v_off = slot.to(gl.int64) * stride_vn
            # K half of the stage (and the entries' row masks)
            mbarrier.wait(k_empty.index(s), ph ^ 1)
            cp.async_copy_global_to_shared(k_smem.index(s), k_base + k_off[:, None] + dk[None, :])
            if MASKED:
                nb = gl.minimum(j * BLOCK_N + offs_b, last)
                cp.async_copy_global_to_shared(bits_smem.index(s), KvRowMask + kv_start + nb)
            cp.mbarrier_arrive(k_ready.index(s), increment_count=False)
            # V half
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            cp.async_copy_global_to_shared(v_smem.index(s), v_base + v_off[:, None] + dk[None, :])
            cp.mbarrier_arrive(v_ready.index(s), increment_count=False)
            slot = nxt


@gluon.jit
def _softmax_tile(
    s, j, stage, kv_len, m_i, l_i, qk_scale, bits_smem, row_bit,
    BLOCK_N: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr,
):  # fmt: skip
    """Online-softmax update of KV tile ``j`` (entries ``j * BLOCK_N ...`` of the unit), as
    ``_kv_tile`` of the Triton kernel: returns ``(p, m_new, l_new, alpha)``."""
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s = s * qk_scale
    if MASKED:
        bits = bits_smem.index(stage).load(gl.SliceLayout(0, s_layout))
        bits = gl.where(cols < kv_len, bits, 0)  # the tail's repeated entries attend nothing
        keep = ((bits[None, :] >> row_bit[:, None]) & 1) != 0
        s = gl.where(keep, s, float("-inf"))
    else:
        s = gl.where((cols < kv_len)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer_partition(
    Out, PartO, PartLse, UnitKvLen, UnitQStart, UnitQLen, PairQuery, PairOutRow,
    unit, kv_head, qk_scale, stride_on, stride_oh, stride_pn, stride_ph, stride_ln,
    q_smem, k_smem, v_smem, bits_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
    HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, MASKED: gl.constexpr,
):  # fmt: skip
    """Default partition (one warpgroup): wgmma QK^T and PV, online softmax, epilogue stores."""
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    kv_len = gl.load(UnitKvLen + unit)
    if kv_len > 0:  # an empty unit writes nothing
        q_start = gl.load(UnitQStart + unit)
        q_len = gl.load(UnitQLen + unit)
        # the epilogue's per-row facts first: their loads' latency hides behind the main loop
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        row_query = rows // GROUP
        row_valid = row_query < q_len
        head = kv_head * GROUP + rows % GROUP
        qid = gl.load(PairQuery + q_start + row_query, mask=row_valid, other=0).to(gl.int64)
        out_row = gl.load(PairOutRow + q_start + row_query, mask=row_valid, other=-2)
        # MASKED: row r's bit in an entry's mask is its query's pair position (at most 31)
        row_bit = gl.minimum(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) // GROUP, 31)

        if MASKED:
            # finite: a row may see no entry of a whole tile (or of the unit), and
            # exp2(-inf - -inf) would poison it
            m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
        else:
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        n_tiles = gl.cdiv(kv_len, BLOCK_N)

        mbarrier.wait(q_bar, 0)
        # tile 0: S_0 = Q K_0^T and its softmax (O is still zero: no PV yet)
        mbarrier.wait(k_ready.index(0), 0)
        fence_async_shared()  # cp.async wrote Q and K through the generic proxy; wgmma reads through the async one
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        p, m_i, l_i, alpha = _softmax_tile(
            s, 0, 0, kv_len, m_i, l_i, qk_scale, bits_smem, row_bit, BLOCK_N, MASKED, s_layout
        )
        gl.thread_barrier()  # all 4 warps are past K_0 and its row masks (the arrive is one thread's)
        mbarrier.arrive(k_empty.index(0), count=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            sj = j % STAGES
            sp = (j - 1) % STAGES
            # S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: both in flight at once
            mbarrier.wait(k_ready.index(sj), (j // STAGES) & 1)
            fence_async_shared()
            s_tok = warpgroup_mma(q_smem, k_smem.index(sj).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
            fence_async_shared()
            o_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
            # S_j is done once at most one group (the PV) is pending: its softmax overlaps the PV
            s = warpgroup_mma_wait(1, deps=[s_tok])
            p, m_i, l_i, alpha = _softmax_tile(
                s, j, sj, kv_len, m_i, l_i, qk_scale, bits_smem, row_bit, BLOCK_N, MASKED, s_layout
            )
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(sj), count=1)
            acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
            gl.thread_barrier()
            mbarrier.arrive(v_empty.index(sp), count=1)
            # O (max m_{j-1}) to the new max m_j
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        sl = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(sl), ((n_tiles - 1) // STAGES) & 1)
        fence_async_shared()
        o_tok = warpgroup_mma(p_op, v_smem.index(sl), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])

        if MASKED:
            l_i = gl.maximum(l_i, 1.0e-30)  # rows that saw nothing (never stored): no 0 / 0
        o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        d_ok = (d < HEAD_DIM)[None, :]
        direct = row_valid & (out_row == -1)
        partial = row_valid & (out_row >= 0)
        gl.store(
            Out + (qid * stride_on + head * stride_oh)[:, None] + d[None, :],
            o.to(Out.dtype.element_ty),
            mask=direct[:, None] & d_ok,
        )
        prow = gl.maximum(out_row, 0).to(gl.int64)
        gl.store(PartO + (prow * stride_pn + head * stride_ph)[:, None] + d[None, :], o, mask=partial[:, None] & d_ok)
        lse = gl.convert_layout((m_i + gl.log2(l_i)) * LN2, gl.SliceLayout(1, o_layout))
        gl.store(PartLse + prow * stride_ln + head, lse, mask=partial)


@gluon.jit(do_not_specialize=["unit_offset", "stride_ln"])
def tree_attention_units_sm90_kernel(
    Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask, UnitKvStart, UnitKvLen, UnitQStart, UnitQLen,
    PairQuery, PairOutRow, unit_offset, qk_scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_pn, stride_ph, stride_ln,
    HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    MASKED: gl.constexpr, OFFSETS_32: gl.constexpr, HEADS_FASTEST: gl.constexpr,
    STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, GDC_WAIT: gl.constexpr,
):  # fmt: skip
    """Program (unit, KV head) of one tile class: ``tree_attention_units_kernel``'s arguments (less
    its ``BLOCK_D``, ``UPCAST_DOT`` and ``PEEL``) plus the ring depth and the loader's warps and
    registers. Launch with ``num_warps=4`` (the consumer warpgroup; the loader's warps come on top)."""
    gl.static_assert(BLOCK_M == 64, "one consumer warpgroup: 64-row tiles")
    gl.static_assert(HEAD_DIM == 64 or HEAD_DIM == 128 or HEAD_DIM == 256, "head dim 64, 128 or 256")
    gl.static_assert(gl.num_warps() == 4, "launch with num_warps=4")
    if GDC_WAIT == 2:
        _gdc_launch_dependents()
    if GDC_WAIT != 0:  # programmatic dependent launch: the prior grid's writes first
        _gdc_wait()
    if HEADS_FASTEST:
        unit = gl.program_id(1)
        kv_head = gl.program_id(0)
    else:
        unit = gl.program_id(0)
        kv_head = gl.program_id(1)
    unit = unit + unit_offset

    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    )
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    # the entries' row-mask words, per stage (MASKED only: a placeholder otherwise, never touched)
    BITS_STAGES: gl.constexpr = STAGES if MASKED else 1
    bits_smem = gl.allocate_shared_memory(gl.int32, [BITS_STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    LOADER_THREADS: gl.constexpr = LOADER_WARPS * 32
    mbarrier.init(q_bar, count=LOADER_THREADS)  # every loader thread's noinc cp.async arrive
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=LOADER_THREADS)
        mbarrier.init(v_ready.index(i), count=LOADER_THREADS)
        mbarrier.init(k_empty.index(i), count=1)  # one consumer arrive (after a warpgroup barrier)
        mbarrier.init(v_empty.index(i), count=1)

    gl.warp_specialize([
        (_consumer_partition, (
            Out, PartO, PartLse, UnitKvLen, UnitQStart, UnitQLen, PairQuery, PairOutRow,
            unit, kv_head, qk_scale, stride_on, stride_oh, stride_pn, stride_ph, stride_ln,
            q_smem, k_smem, v_smem, bits_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
            HEAD_DIM, GROUP, BLOCK_M, BLOCK_N, STAGES, MASKED)),
        (_loader_partition, (
            Q, K, V, KvIndices, KvRowMask, UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery,
            unit, kv_head, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
            q_smem, k_smem, v_smem, bits_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
            HEAD_DIM, GROUP, BLOCK_M, BLOCK_N, STAGES, MASKED, OFFSETS_32)),
    ], [LOADER_WARPS], [LOADER_REGS])  # fmt: skip
