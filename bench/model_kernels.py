"""Triton kernels of the decode benchmark's non-attention ops (``@triton.jit`` code only).

What a serving engine fuses around the GEMMs of a decoder layer, one launch each:

- :func:`rms_norm_kernel`: the residual add of the previous sub-layer's output (optional)
  and RMSNorm, one program per row.
- :func:`rope_kv_write_kernel`: RoPE on the q and k heads of the QKV projection's output,
  q into its buffer, k and v into the KV pools at each row's write slot, one program per
  (row, q or KV head).
- :func:`silu_mul_kernel`: the SwiGLU activation ``silu(gate) * up``, one program per
  (row, block of ``BLOCK`` columns).

Every rounding step follows the torch ops of :mod:`bench.decode` (fp32 math, one rounding
to the storage dtype where torch rounds). Row offsets are int64, so pools and activations
may exceed 2^31 elements. Host wrappers live in :mod:`bench.model_ops`.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    X,  # [rows, hidden]: the residual stream; updated in place when HAS_DELTA
    Delta,  # [rows, hidden], X's dtype: the residual update (not read unless HAS_DELTA)
    Weight,  # [hidden], X's dtype
    Y,  # [rows, hidden], X's dtype: the normalised rows
    stride_x,
    stride_d,
    stride_y,
    n_cols,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``X += Delta`` (when HAS_DELTA, rounded once to X's dtype), then
    ``Y = (X * rsqrt(mean(X^2) + eps)).to(dtype) * Weight`` with the statistics in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(Delta + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(X + row * stride_x + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * inv_rms).to(X.dtype.element_ty)
    w = tl.load(Weight + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_store(Src, Dst, cos, sin, offs, mask, HALF: tl.constexpr):
    """Rotate the two halves ``a = Src[:HALF]``, ``b = Src[HALF:]`` in fp32 and store
    ``cat(a cos - b sin, b cos + a sin)`` at ``Dst`` in Dst's dtype (masked lanes untouched)."""
    a = tl.load(Src + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(Src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Dst + offs, (a * cos - b * sin).to(Dst.dtype.element_ty), mask=mask)
    tl.store(Dst + HALF + offs, (b * cos + a * sin).to(Dst.dtype.element_ty), mask=mask)


@triton.jit
def rope_kv_write_kernel(
    QKV,  # [rows, (Hq + 2 Hkv) D]: the q heads, then the k heads, then the v heads of each row
    Q,  # [rows, Hq, D], QKV's dtype: the rotated q
    KPool,  # [pool_rows, Hkv, D], QKV's dtype: rotated k written at row WriteSlots[row]
    VPool,  # [pool_rows, Hkv, D], QKV's dtype: v copied to row WriteSlots[row]
    WriteSlots,  # int32 or int64 [rows]
    Cos,  # float32 [rows, D / 2]
    Sin,  # float32 [rows, D / 2]
    stride_qkv,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cos,
    stride_sin,
    pool_rows,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Program ``(row, head)``: ``head < Hq`` rotates q head ``head`` into ``Q``; otherwise KV head
    ``h = head - Hq``: its rotated k goes to ``KPool[slot, h]`` and its v to ``VPool[slot, h]``
    (``slot = WriteSlots[row]``; a slot outside ``[0, pool_rows)`` is not written)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    cos = tl.load(Cos + row * stride_cos + offs, mask=mask, other=0.0)
    sin = tl.load(Sin + row * stride_sin + offs, mask=mask, other=0.0)
    src = QKV + row * stride_qkv + head.to(tl.int64) * HEAD_DIM  # q head `head` or k head `head - Hq`
    if head < NUM_Q_HEADS:
        _rotate_store(src, Q + row * stride_qn + head.to(tl.int64) * stride_qh, cos, sin, offs, mask, HALF)
    else:
        kv_head = (head - NUM_Q_HEADS).to(tl.int64)
        slot = tl.load(WriteSlots + row).to(tl.int64)
        in_pool = (slot >= 0) & (slot < pool_rows)
        write = mask & in_pool
        _rotate_store(src, KPool + slot * stride_kn + kv_head * stride_kh, cos, sin, offs, write, HALF)
        v_src = src + NUM_KV_HEADS * HEAD_DIM  # v head h sits Hkv heads after k head h
        v_dst = VPool + slot * stride_vn + kv_head * stride_vh
        tl.store(v_dst + offs, tl.load(v_src + offs, mask=write, other=0.0), mask=write)
        tl.store(v_dst + HALF + offs, tl.load(v_src + HALF + offs, mask=write, other=0.0), mask=write)


@triton.jit
def silu_mul_kernel(
    GateUp,  # [rows, 2 I]: gate columns, then up columns
    Out,  # [rows, I], GateUp's dtype
    stride_g,
    stride_o,
    n_cols,  # I
    BLOCK: tl.constexpr,
):
    """Program ``(row, block)``: ``Out = silu(gate) * up`` on ``BLOCK`` columns, silu in fp32 rounded
    to the dtype (as torch's ``silu``), then the product in fp32 rounded once (as torch's ``*``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + n_cols + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)
