"""Stage 1 of tree attention: one program per (work unit, KV head), one launch per tile class.

Two kernels share the unit's code (:func:`_attend_unit`):

- :func:`tree_attention_units_kernel`: a grid of (the class's units, KV heads), sized by the
  host for each plan (:func:`fasttree.tree_attention`), or fixed by a runtime *launch variant*
  (at least the class's units) over the plan arrays at fixed addresses, where
  :func:`relocate_plan_kernel` copies each uploaded plan and leaves empty units past the plan's
  (no query, no KV entry): a CUDA graph captured for a variant replays every later plan of it.
- :func:`tree_attention_persistent_kernel`: a fixed number of programs that loop over the
  (unit, KV head) items of both tile classes' unit ranges, with every plan array and the
  ranges read from one device buffer behind a header (:mod:`fasttree.runtime`): the launch
  does not depend on the plan, so a CUDA graph captured once replays any later plan
  uploaded into the buffer.

A unit is a chunk of one context-query group's KV (gathered through pool slot ids)
and a tile of that group's queries, or (``MASKED`` classes) a packed unit: several
small units' KV back to back, each entry with a bit mask of the rows' queries that
attend it. The program packs the ``GROUP`` query heads that
share its KV head for each query of the tile into ``BLOCK_M`` matrix rows
(row ``r`` is query ``r // GROUP``, head ``r % GROUP``), runs an online softmax over the
chunk in ``BLOCK_N``-token tiles with fp32 accumulators, and writes, per row, either the
final output (queries with a single partial) or a normalised fp32 partial output and
its natural-log LSE; :mod:`.merge` combines the partials.

Two launch-time switches the host sets per launch (:mod:`fasttree.attention`):
``OFFSETS_32`` forms the gathered K/V addresses from int32 offsets where every offset of
the slots read fits, and ``PEEL`` runs a unit's whole KV tiles without masks, then one
masked tail tile (:func:`_kv_tile` holds the online-softmax update of one tile).
``GDC_WAIT`` (every kernel of the package has it) is non-zero when the host launches the
kernel with programmatic dependent launch (sm_90+): the grid may then start while the
previous grid of the stream finishes, and waits until that grid's memory operations are
complete and visible (``griddepcontrol.wait``) before it touches what that grid may write
(Q, the pools, the partials, the counters). 1: the wait is the first instruction. 2
("early"): every program first lets the next grid of the stream launch
(``griddepcontrol.launch_dependents``; that grid waits for this one's results itself), then
reads the plan's arrays for its first item (uploaded before any kernel that reads them) and
only then waits, so those dependent reads overlap the prior grid's tail.

(A variant that merged partials in stage 1 through per-(query, head) atomic counters
removed the merge launch but was 1.2-1.4x slower on plans with many small units on the
H200: the barrier, acquire-release atomics and extra registers lengthen every program;
see docs/history.md.)
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LN2 = tl.constexpr(0.6931471805599453)


# The plan buffer's header (fasttree.runtime.PLAN_HEADER lays it out; both must agree): the
# int32 offsets of the plan arrays in the buffer, then the unit range of each launch slot, then
# the merge counts.
HDR_KV_INDICES = tl.constexpr(0)
HDR_KV_ROW_MASK = tl.constexpr(1)
HDR_UNIT_KV_START = tl.constexpr(2)
HDR_UNIT_KV_LEN = tl.constexpr(3)
HDR_UNIT_Q_START = tl.constexpr(4)
HDR_UNIT_Q_LEN = tl.constexpr(5)
HDR_PAIR_QUERY = tl.constexpr(6)
HDR_PAIR_OUT_ROW = tl.constexpr(7)
HDR_QUERY_PARTIAL_START = tl.constexpr(8)
HDR_QUERY_NUM_PARTIALS = tl.constexpr(9)
HDR_MERGE_QUERIES = tl.constexpr(10)
HDR_SLOT_RANGES = tl.constexpr(11)  # (first unit, end) of slot 0, then of slot 1
HDR_MERGE_COUNTS = tl.constexpr(15)  # merged queries of the few-partials kernel, then of the many-partials one
HDR_CLASS_RANGES = tl.constexpr(17)  # (first unit, end) of tile class 0, then of class 1 (launch variants)
HDR_UNIT_LEADS = tl.constexpr(21)  # empty units a launch variant runs before the plan's class-0, class-1 units
HDR_MERGE_FILL_END = tl.constexpr(23)  # where the last relocated plan's merge list ended
HDR_WORDS_END = tl.constexpr(24)  # the end of the last array (merge_queries) of the uploaded plan


@triton.jit
def _kv_tile(
    start, kv_start, kv_len, q, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn, stride_vn, qk_scale,
    row_bit, d, d_valid,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    UPCAST_DOT: tl.constexpr, OFFSETS_32: tl.constexpr, BOUNDED: tl.constexpr,
):  # fmt: skip
    """The online-softmax update of one KV tile (entries ``start:start + BLOCK_N`` of the unit):
    returns the new ``(m_i, l_i, acc)``. ``BOUNDED``: the tile may reach past the unit's
    ``kv_len`` entries (masked loads and scores); else it lies wholly inside."""
    n = start + tl.arange(0, BLOCK_N)
    if BOUNDED:
        n_valid = n < kv_len
        slot = tl.load(KvIndices + kv_start + n, mask=n_valid, other=0)
        kv_mask = n_valid[:, None] & d_valid[None, :]
    else:
        slot = tl.load(KvIndices + kv_start + n)
        kv_mask = d_valid[None, :]
    if not OFFSETS_32:
        slot = slot.to(tl.int64)
    k_ptrs = k_base + slot[:, None] * stride_kn + d[None, :]
    v_ptrs = v_base + slot[:, None] * stride_vn + d[None, :]
    if BOUNDED or HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        if BOUNDED:
            bits = tl.load(KvRowMask + kv_start + n, mask=n_valid, other=0)
        else:
            bits = tl.load(KvRowMask + kv_start + n)
        s = tl.where(((bits[None, :] >> row_bit[:, None]) & 1) != 0, s, float("-inf"))
    elif BOUNDED:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if BOUNDED or HEAD_DIM != BLOCK_D:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_i, acc


@triton.jit
def _attend_unit(
    unit,
    kv_head,
    Q,
    K,
    V,
    Out,
    PartO,
    PartLse,
    KvIndices,
    KvRowMask,
    UnitKvStart,
    UnitKvLen,
    UnitQStart,
    UnitQLen,
    PairQuery,
    PairOutRow,
    qk_scale,
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
    MASKED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    PEEL: tl.constexpr,
    WAIT: tl.constexpr = False,
):
    """One (unit, KV head): attention of the unit's query tile over its KV chunk.

    ``OFFSETS_32``: every K/V element offset of the pools' slots the plan reads fits in int32
    (the host checks), so the gathered tiles' addresses are formed from 32-bit offsets, not
    64-bit ones (fewer registers and instructions per gathered row; H200 serving trees: 1-3%
    less stage-1 time). ``PEEL``: the unit's whole KV tiles
    run without masks, then one masked tail tile (see :func:`_kv_tile`). ``WAIT``: wait for the
    prior grid (``griddepcontrol.wait``) after reading the plan's arrays, before Q and the pools.
    An empty unit (no query, no KV entry) reads nothing past its arrays and writes nothing."""
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
    if WAIT:
        gdc_wait()

    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(
        Q + qid[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    if MASKED:
        # finite: a row may see no entry of a whole tile (or of the unit), and
        # exp2(-inf - -inf) would poison it
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    row_bit = tl.minimum(row_query, 31)  # MASKED: the row's bit in an entry's mask
    # PEEL: the unit's whole BLOCK_N tiles without masks (index, K/V and row-mask loads
    # unpredicated, no bound on the scores), then one masked tail tile; else every tile masked
    if PEEL:
        full = kv_len - kv_len % BLOCK_N
        for start in range(0, full, BLOCK_N):
            m_i, l_i, acc = _kv_tile(
                start, kv_start, kv_len, q, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn,
                stride_vn, qk_scale, row_bit, d, d_valid, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, UPCAST_DOT, OFFSETS_32,
                False,
            )  # fmt: skip
        if full < kv_len:
            m_i, l_i, acc = _kv_tile(
                full, kv_start, kv_len, q, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn,
                stride_vn, qk_scale, row_bit, d, d_valid, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, UPCAST_DOT, OFFSETS_32,
                True,
            )  # fmt: skip
    else:
        for start in range(0, kv_len, BLOCK_N):
            m_i, l_i, acc = _kv_tile(
                start, kv_start, kv_len, q, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn,
                stride_vn, qk_scale, row_bit, d, d_valid, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, UPCAST_DOT, OFFSETS_32,
                True,
            )  # fmt: skip

    if MASKED:
        l_i = tl.maximum(l_i, 1.0e-30)  # rows that saw nothing (never stored): no 0 / 0
    o = acc / l_i[:, None]
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
    lse = (m_i + tl.log2(l_i)) * LN2
    tl.store(PartLse + prow * stride_ln + head, lse, mask=partial)


# unit_offset (0 for the first tile class, its unit count for the second) and stride_ln (the
# query-head count) only feed scalar address arithmetic: not specialising them on their value
# halves the compiled variants of a config and costs nothing.
@triton.jit(do_not_specialize=["unit_offset", "stride_ln"])
def tree_attention_units_kernel(
    Q,  # [n_queries, Hq, D], fp16/bf16
    K,  # [pool_slots, Hkv, D]
    V,  # [pool_slots, Hkv, D]
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # [n_partial_rows, Hq, D], fp32
    PartLse,  # [n_partial_rows, Hq], fp32
    KvIndices,  # int32 [n_kv_entries]
    KvRowMask,  # int32 [n_kv_entries]: bit p = the unit's pair p attends the entry (MASKED only)
    UnitKvStart,  # int32 [n_units]
    UnitKvLen,  # int32 [n_units]
    UnitQStart,  # int32 [n_units]
    UnitQLen,  # int32 [n_units]
    PairQuery,  # int32 [n_pairs]
    PairOutRow,  # int32 [n_pairs]; -1: write Out directly, -2: write nothing
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
    stride_pn,
    stride_ph,
    stride_ln,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # the class holds packed units: apply KvRowMask
    UPCAST_DOT: tl.constexpr,  # only under the Triton interpreter, whose bf16 tl.dot is wrong
    OFFSETS_32: tl.constexpr = False,  # K/V offsets of the slots read fit in int32 (see _attend_unit)
    PEEL: tl.constexpr = False,  # whole KV tiles unmasked, then a masked tail (see _attend_unit)
    HEADS_FASTEST: tl.constexpr = False,  # grid (KV heads, units): a unit's heads launch together
    GDC_WAIT: tl.constexpr = 0,  # programmatic dependent launch: 0 off, 1 wait first, 2 early (module doc)
):
    if GDC_WAIT == 2:
        gdc_launch_dependents()
    if GDC_WAIT == 1:
        gdc_wait()
    if HEADS_FASTEST:
        unit, kv_head = tl.program_id(1), tl.program_id(0)
    else:
        unit, kv_head = tl.program_id(0), tl.program_id(1)
    _attend_unit(
        unit + unit_offset, kv_head, Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask,
        UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery, PairOutRow, qk_scale, stride_qn, stride_qh,
        stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_pn, stride_ph, stride_ln,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_N, MASKED, UPCAST_DOT, OFFSETS_32, PEEL, GDC_WAIT == 2,
    )  # fmt: skip


@triton.jit
def _fill(Fixed, lo, hi, value):
    """``Fixed[lo:hi] = value``, this program's share (programs along axis 1 split the range)."""
    offs = tl.arange(0, 1024)
    for start in range(lo + tl.program_id(1) * 1024, hi, tl.num_programs(1) * 1024):
        i = start + offs
        tl.store(Fixed + i, tl.zeros([1024], tl.int32) + value, mask=i < hi)


@triton.jit(do_not_specialize=["unit_region", "sentinel"])
def relocate_plan_kernel(
    PlanBuf,  # int32: header (HDR_*), then the uploaded plan's arrays back to back
    Fixed,  # int32: the plan arrays at fixed offsets (DstOffsets), unit arrays split by tile class
    DstOffsets,  # int32 [N_ARRAYS]: each array's offset in Fixed
    unit_region,  # a unit array's class-1 part starts at unit_region in Fixed
    sentinel,  # the merge list's filler: a query id whose partial count is 0
    N_ARRAYS: tl.constexpr,
    FIRST_UNIT_ARRAY: tl.constexpr,  # the 4 unit arrays' index among the arrays
    MERGE_ARRAY: tl.constexpr,  # the merge list's index among the arrays
    BLOCK: tl.constexpr,
):
    """Copy array ``program_id(0)`` of the uploaded plan to its fixed offset (programs along axis 1
    share its words): what a launch variant's :func:`tree_attention_units_kernel` and merge
    launches read through fixed pointers, so a CUDA graph of them replays every plan of their
    variant. An array's length is the distance to the next array's offset (the last one's end is
    header word ``HDR_WORDS_END``; a unit array's, the plan's units): its padding is copied too, which
    the runtime zeroes (a per-query array's padding lands on queries past the plan's, the merge
    list's filler among them, which must have no partials); a unit array's class-1 units
    move to ``unit_region``. Each class's units follow ``HDR_UNIT_LEADS`` empty units (zeros): the
    programs a variant's grid bucket has beyond the plan's units come first in the grid, and finish
    at once, instead of last, after the plan's longest units. Past the plan's merge list, up to
    where the last relocated plan's ended (``HDR_MERGE_FILL_END``), the merge list gets
    ``sentinel``: a variant's merge programs past the plan's find nothing to do there."""
    a = tl.program_id(0)
    src = tl.load(PlanBuf + a)
    if a + 1 < N_ARRAYS:
        n = tl.load(PlanBuf + a + 1) - src
    else:
        n = tl.load(PlanBuf + HDR_WORDS_END) - src
    dst = tl.load(DstOffsets + a)
    is_unit = (a >= FIRST_UNIT_ARRAY) & (a < FIRST_UNIT_ARRAY + 4)
    n0 = tl.load(PlanBuf + HDR_CLASS_RANGES + 1)  # class 1 starts here
    n_all = tl.load(PlanBuf + HDR_CLASS_RANGES + 3)
    lead0 = tl.load(PlanBuf + HDR_UNIT_LEADS)
    lead1 = tl.load(PlanBuf + HDR_UNIT_LEADS + 1)
    if is_unit:
        n = n_all
    if a == MERGE_ARRAY:  # its entries, not its aligned length: the filler follows them
        n = tl.load(PlanBuf + HDR_MERGE_COUNTS) + tl.load(PlanBuf + HDR_MERGE_COUNTS + 1)
    offs = tl.arange(0, BLOCK)
    for start in range(tl.program_id(1) * BLOCK, n, tl.num_programs(1) * BLOCK):
        i = start + offs
        valid = i < n
        w = tl.load(PlanBuf + src + i, mask=valid)
        to = i
        if is_unit:
            to = tl.where(i < n0, lead0 + i, unit_region + lead1 + i - n0)
        tl.store(Fixed + dst + to, w, mask=valid)
    if is_unit:
        _fill(Fixed + dst, 0, lead0, 0)
        _fill(Fixed + dst + unit_region, 0, lead1, 0)
    if a == MERGE_ARRAY:
        _fill(Fixed + dst, n, tl.load(PlanBuf + HDR_MERGE_FILL_END), sentinel)


@triton.jit
def _attend_slot_items(
    start, items, n_units, first_unit, Counter, step, Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask,
    UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery, PairOutRow, qk_scale, stride_qn, stride_qh, stride_kn,
    stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_pn, stride_ph, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, UPCAST_DOT: tl.constexpr, OFFSETS_32: tl.constexpr, PEEL: tl.constexpr,
    HEADS_FASTEST: tl.constexpr, num_kv_heads,
):  # fmt: skip
    """One program's items of one launch slot: item ``start``, then (more items than programs) the
    next unstarted one claimed from ``Counter`` as each ends, or else every ``step``-th. Item ``i``
    is unit ``first_unit + i % n_units`` of KV head ``i // n_units``."""
    claim = items > step
    item = start
    while item < items:
        if HEADS_FASTEST:
            unit = item // num_kv_heads
            kv_head = item - unit * num_kv_heads
        else:
            kv_head = item // n_units
            unit = item - kv_head * n_units
        _attend_unit(
            first_unit + unit, kv_head, Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask,
            UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery, PairOutRow, qk_scale, stride_qn, stride_qh,
            stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_pn, stride_ph, stride_ln,
            HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_N, MASKED, UPCAST_DOT, OFFSETS_32, PEEL,
        )  # fmt: skip
        if claim:
            item = step + tl.atomic_add(Counter, 1, sem="relaxed")
        else:
            item += step


@triton.jit(do_not_specialize=["num_kv_heads", "stride_ln"])
def tree_attention_persistent_kernel(
    Q,  # [n_queries, Hq, D], fp16/bf16 (rows past the plan's queries are not read)
    K,  # [pool_slots, Hkv, D]
    V,  # [pool_slots, Hkv, D]
    Out,  # [n_queries, Hq, D], q's dtype
    PartO,  # [max_partial_rows, Hq, D], fp32
    PartLse,  # [max_partial_rows, Hq], fp32
    PlanBuf,  # int32 [plan_words]: header (HDR_*) and the plan arrays
    Counters,  # int32 [2]: items of slot 0 and slot 1 claimed past the first wave (zero at launch)
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
    BLOCK_M0: tl.constexpr,  # slot 0 (large query tiles): rows and KV tokens per tile
    BLOCK_N0: tl.constexpr,
    BLOCK_M1: tl.constexpr,  # slot 1 (small query tiles)
    BLOCK_N1: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SLOTS: tl.constexpr = 2,  # 2: both slots; 0 or 1: only that slot (its tile alone sets the registers)
    OFFSETS_32: tl.constexpr = False,  # K/V offsets of every pool slot fit in int32 (see _attend_unit)
    PEEL0: tl.constexpr = False,  # slot 0's / slot 1's units: whole KV tiles unmasked (see _attend_unit)
    PEEL1: tl.constexpr = False,
    HEADS_FASTEST: tl.constexpr = False,  # item i is unit i // num_kv_heads (else KV head i // units)
    GDC_WAIT: tl.constexpr = 0,  # programmatic dependent launch: 0 off, 1 wait first, 2 early (module doc)
):
    """Both launch slots in one launch: the items (unit, KV head) of slot 0, then those of slot 1,
    so programs move on to slot 1 without a launch boundary (``SLOTS`` 0 or 1: one slot's items
    only, from program 0)."""
    if GDC_WAIT == 2:
        gdc_launch_dependents()
    if GDC_WAIT == 1:  # before any load: the prior grid may write Q, the pools, or (a merge) read PartO
        gdc_wait()
    first0 = tl.load(PlanBuf + HDR_SLOT_RANGES)
    n0 = tl.load(PlanBuf + HDR_SLOT_RANGES + 1) - first0
    first1 = tl.load(PlanBuf + HDR_SLOT_RANGES + 2)
    n1 = tl.load(PlanBuf + HDR_SLOT_RANGES + 3) - first1
    # every array starts at a multiple of 32 words (fasttree.runtime aligns them): say so, or the
    # compiler assumes 4-byte alignment and loads indices and masks one word at a time
    KvIndices = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_KV_INDICES), 32)
    KvRowMask = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_KV_ROW_MASK), 32)
    UnitKvStart = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_UNIT_KV_START), 32)
    UnitKvLen = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_UNIT_KV_LEN), 32)
    UnitQStart = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_UNIT_Q_START), 32)
    UnitQLen = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_UNIT_Q_LEN), 32)
    PairQuery = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_PAIR_QUERY), 32)
    PairOutRow = PlanBuf + tl.multiple_of(tl.load(PlanBuf + HDR_PAIR_OUT_ROW), 32)
    if GDC_WAIT == 2:  # the header read; now Q, the pools, the counters and the partials may be touched
        gdc_wait()
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    # items in the per-plan grid's launch order: with HEADS_FASTEST every KV head of unit 0 (the
    # longest), then of unit 1, ..., else every unit of KV head 0 (longest first), then head 1, ...
    # Program p starts with item p of a slot (slot 1's first items continue the rotation where slot 0's
    # ended). When a slot has more items than programs, a program that finishes an item claims the
    # next unstarted one from the slot's counter, as the hardware scheduler hands out a per-plan
    # grid's programs (H200: 0.80-0.97x the time of a static round-robin on the serving scenarios'
    # trees, whose units differ in length; the paper suite's even ones are unchanged). The claim is
    # relaxed: the counter publishes no data, so it need not wait for the item's stores. The
    # runtime's merge launch zeroes the counters for the next call.
    items0 = n0 * num_kv_heads
    items1 = n1 * num_kv_heads
    if SLOTS != 1:
        _attend_slot_items(
            pid, items0, n0, first0, Counters, step, Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask, UnitKvStart,
            UnitKvLen, UnitQStart, UnitQLen, PairQuery, PairOutRow, qk_scale, stride_qn, stride_qh, stride_kn,
            stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_pn, stride_ph, stride_ln, HEAD_DIM, BLOCK_D,
            GROUP, BLOCK_M0, BLOCK_N0, MASKED, UPCAST_DOT, OFFSETS_32, PEEL0, HEADS_FASTEST, num_kv_heads,
        )  # fmt: skip
    if SLOTS != 0:
        start1 = pid
        if SLOTS == 2:
            start1 = (pid - items0 % step + step) % step
        _attend_slot_items(
            start1, items1, n1, first1, Counters + 1, step, Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask,
            UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery, PairOutRow, qk_scale, stride_qn, stride_qh,
            stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_pn, stride_ph, stride_ln, HEAD_DIM,
            BLOCK_D, GROUP, BLOCK_M1, BLOCK_N1, MASKED, UPCAST_DOT, OFFSETS_32, PEEL1, HEADS_FASTEST, num_kv_heads,
        )  # fmt: skip
