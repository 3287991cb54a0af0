"""Host wrappers of :mod:`bench.model_kernels`: validate, size the grid and launch.

The fused non-attention ops of :mod:`bench.decode`'s decoder. Given ``out=``, nothing is
allocated, so the calls can be captured in a CUDA graph and replayed. Activations are
float16, bfloat16 or float32 (one dtype per call); the RoPE tables are float32. On the CPU
the kernels need ``TRITON_INTERPRET=1`` set before :mod:`bench.model_kernels` is imported.
"""

from __future__ import annotations

import torch
import triton

from bench.model_kernels import rms_norm_kernel, rope_kv_write_kernel, silu_mul_kernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Widest row :func:`rms_norm` normalises in one program.
MAX_HIDDEN = 1 << 16
#: Columns of one :func:`silu_mul` program.
SILU_BLOCK = 1024


def _interpreting() -> bool:
    return type(rms_norm_kernel).__name__ == "InterpretedFunction"


def _check_tensor(name: str, t: object, dim: int, dtypes: tuple[torch.dtype, ...] = _DTYPES) -> torch.Tensor:
    """``t`` is a ``dim``-D tensor of one of ``dtypes``, contiguous in its last dimension, on a usable device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{name} is on {t.device}; the kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    return t


def _check_like(name: str, t: object, ref: torch.Tensor, ref_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` has shape ``shape`` and ``ref``'s dtype and device (and a contiguous last dimension)."""
    _check_tensor(name, t, len(shape))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} on {ref.device}")
    return t


def _check_disjoint(name: str, t: torch.Tensor, others: dict[str, torch.Tensor | None]) -> None:
    """``t`` shares no storage with the named inputs (an output written while they are read)."""
    storage = t.untyped_storage().data_ptr()
    for other_name, other in others.items():
        if other is not None and t.numel() and other.numel() and other.untyped_storage().data_ptr() == storage:
            raise ValueError(f"{name} must not share memory with {other_name}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of the rows of ``x``, after adding ``delta`` to ``x`` in place (when given).

    ``x += delta`` (in fp32, rounded once to ``x``'s dtype), then
    ``out = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype) * weight``: the rounding of
    :func:`bench.decode.rms_norm` after ``x.add_(delta)``.

    Parameters
    ----------
    x : Tensor, float16 / bfloat16 / float32 [rows, hidden]
        The residual stream; updated in place when ``delta`` is given. Last dim contiguous.
    weight : Tensor, x's dtype [hidden]
    eps : float
        Added to the mean square (> 0).
    delta : Tensor, x's dtype [rows, hidden], optional
        The residual update (a sub-layer's output).
    out : Tensor, x's dtype [rows, hidden], optional
        Receives the normalised rows (allocated when None); must not overlap ``x`` or ``delta``.

    Returns
    -------
    Tensor, x's dtype [rows, hidden]
        ``out``.

    Raises
    ------
    ValueError
        On a shape, dtype, device, layout or ``eps`` the kernel does not take.
    """
    _check_tensor("x", x, 2)
    rows, hidden = x.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"x has {hidden} columns; rms_norm takes at most {MAX_HIDDEN}")
    _check_like("weight", weight, x, "x", (hidden,))
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if delta is not None:
        _check_like("delta", delta, x, "x", (rows, hidden))
        _check_disjoint("delta", delta, {"x": x})
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_like("out", out, x, "x", (rows, hidden))
        _check_disjoint("out", out, {"x": x, "delta": delta})
    if rows == 0 or hidden == 0:
        return out
    block = triton.next_power_of_2(hidden)
    has_delta = delta is not None
    rms_norm_kernel[(rows,)](
        x, delta if has_delta else x, weight, out,
        x.stride(0), delta.stride(0) if has_delta else 0, out.stride(0), hidden, float(eps),
        HAS_DELTA=has_delta, BLOCK=block, num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return out


def _rope_table(name: str, t: object, ref: torch.Tensor, rows: int, half: int) -> torch.Tensor:
    """A float32 ``[rows, half]`` or ``[rows, 1, half]`` table as ``[rows, half]``."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3):
        raise ValueError(f"{name} must be a float32 tensor [rows, D / 2] or [rows, 1, D / 2]")
    _check_tensor(name, t, t.dim(), (torch.float32,))
    shape = (rows, half) if t.dim() == 2 else (rows, 1, half)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but qkv on {ref.device}")
    return t.view(rows, half) if t.dim() == 2 else t.squeeze(1)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    *,
    out: torch.Tensor,
) -> torch.Tensor:
    """RoPE on the q and k heads of a fused QKV projection; k and v written into the KV pools.

    One launch doing what :func:`bench.decode.pre_attention` does with
    :func:`bench.decode.apply_rope` and two ``index_copy_``: with ``a, b`` the two halves of
    a head, ``cat(a cos - b sin, b cos + a sin)`` in fp32, rounded to the dtype; q heads into
    ``out``, k heads into ``k_pool[write_slots[row]]``, v heads copied into
    ``v_pool[write_slots[row]]``. A slot outside ``[0, pool_rows)`` is skipped (no bounds
    check on the host: it would synchronise); rows sharing a slot leave one of their values.

    Parameters
    ----------
    qkv : Tensor, float16 / bfloat16 / float32 [rows, (Hq + 2 Hkv) D]
        Each row: the ``Hq`` q heads, then the ``Hkv`` k heads, then the ``Hkv`` v heads.
    cos, sin : Tensor, float32 [rows, 1, D / 2] or [rows, D / 2]
        Each row's rotation angles.
    write_slots : Tensor, int32 / int64 [rows]
        The pool row each row's k and v go to.
    k_pool, v_pool : Tensor, qkv's dtype [pool_rows, Hkv, D]
        Updated in place (views of a larger pool are fine: last dim contiguous).
    out : Tensor, qkv's dtype [rows, Hq, D]
        Receives the rotated q (a required argument: its shape gives ``Hq`` and ``D``).

    Returns
    -------
    Tensor, qkv's dtype [rows, Hq, D]
        ``out``.

    Raises
    ------
    ValueError
        On a shape, dtype, device or layout the kernel does not take.
    """
    _check_tensor("qkv", qkv, 2)
    _check_tensor("out", out, 3)
    rows, width = qkv.shape
    _, hq, d = out.shape
    if hq < 1 or d < 2 or d % 2:
        raise ValueError(f"out must be [rows, Hq >= 1, D] with an even D >= 2, got shape {tuple(out.shape)}")
    _check_like("out", out, qkv, "qkv", (rows, hq, d))
    _check_tensor("k_pool", k_pool, 3)
    pool_rows, hkv = k_pool.shape[:2]
    if hkv < 1:
        raise ValueError(f"k_pool must have at least one KV head, got shape {tuple(k_pool.shape)}")
    _check_like("k_pool", k_pool, qkv, "qkv", (pool_rows, hkv, d))
    _check_like("v_pool", v_pool, qkv, "qkv", (pool_rows, hkv, d))
    if width != (hq + 2 * hkv) * d:
        raise ValueError(
            f"qkv has {width} columns but out [.., Hq={hq}, D={d}] and k_pool [.., Hkv={hkv}, D={d}] "
            f"need (Hq + 2 Hkv) D = {(hq + 2 * hkv) * d}"
        )
    cos2 = _rope_table("cos", cos, qkv, rows, d // 2)
    sin2 = _rope_table("sin", sin, qkv, rows, d // 2)
    _check_tensor("write_slots", write_slots, 1, (torch.int32, torch.int64))
    if write_slots.shape[0] != rows:
        raise ValueError(f"write_slots must have shape ({rows},), got {tuple(write_slots.shape)}")
    if write_slots.device != qkv.device:
        raise ValueError(f"write_slots is on {write_slots.device} but qkv on {qkv.device}")
    _check_disjoint("out", out, {"qkv": qkv, "k_pool": k_pool, "v_pool": v_pool})
    _check_disjoint("k_pool", k_pool, {"qkv": qkv, "v_pool": v_pool})
    _check_disjoint("v_pool", v_pool, {"qkv": qkv})
    if rows == 0:
        return out
    block_half = triton.next_power_of_2(d // 2)
    rope_kv_write_kernel[(rows, hq + hkv)](
        qkv, out, k_pool, v_pool, write_slots, cos2, sin2,
        qkv.stride(0), out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), cos2.stride(0), sin2.stride(0), pool_rows,
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_HALF=block_half,
        num_warps=1 if block_half <= 64 else 2,
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU activation ``silu(gate) * up`` of a fused gate/up projection.

    silu in fp32, rounded to the dtype (as ``torch.nn.functional.silu``), then the product
    in fp32, rounded once (as torch's ``*``).

    Parameters
    ----------
    gate_up : Tensor, float16 / bfloat16 / float32 [rows, 2 I]
        Each row: the ``I`` gate columns, then the ``I`` up columns. Last dim contiguous.
    out : Tensor, gate_up's dtype [rows, I], optional
        Receives the activation (allocated when None); must not overlap ``gate_up``.

    Returns
    -------
    Tensor, gate_up's dtype [rows, I]
        ``out``.

    Raises
    ------
    ValueError
        On a shape, dtype, device or layout the kernel does not take.
    """
    _check_tensor("gate_up", gate_up, 2)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even number of columns [rows, 2 I], got {width}")
    inter = width // 2
    if out is None:
        out = gate_up.new_empty((rows, inter))
    else:
        _check_like("out", out, gate_up, "gate_up", (rows, inter))
        _check_disjoint("out", out, {"gate_up": gate_up})
    if rows == 0 or inter == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
    )
    return out
