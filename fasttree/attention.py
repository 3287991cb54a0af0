"""Host wrappers: validate, allocate, size the grids and launch the tree-attention kernels.

Tensor vocabulary: ``q`` is ``[n_queries, Hq, D]`` (query ``j`` = row ``j``);
``k_cache`` / ``v_cache`` are SGLang-style token pools ``[pool_slots, Hkv, D]``;
outputs are ``[n_queries, Hq, D]`` in ``q``'s dtype. fp16 and bf16 are supported.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers

import numpy as np
import torch
import triton
from triton.runtime.errors import OutOfResources

from .config import FastTreeConfig
from .kernels import (
    merge_many_partials_kernel,
    merge_partials_kernel,
    merge_partials_persistent_kernel,
    tree_attention_persistent_kernel,
    tree_attention_units_kernel,
)
from .plan_arrays import DevicePlan, Plan, TileClass, check_heads, materialize, tenth_longest
from .planner import Groups
from .tree import KVTree

logger = logging.getLogger(__name__)

#: Version of the tree-attention kernels and their launch choices: the newest row of the version
#: table in ``docs/bench/NOTES.md`` that moved the GPU time of an unchanged plan (rows that change
#: only the planner or the host path do not count: v31 changed the planner). Set it to the new
#: row's number when a change moves the GPU time of a plan. The profiler writes it into every trace
#: (``meta.profiler.kernel_version``) and the latency model takes it as a feature, so traces of
#: older kernels still teach it what did not change.
KERNEL_VERSION = 30

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return type(tree_attention_units_kernel).__name__ == "InterpretedFunction"


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Plan) -> torch.device:
    """Raise ValueError naming what is wrong with the tensors of a call of ``plan``; return q's device.

    (Called on every eager call: ``is_cuda`` and one ``device`` per tensor, not ``device.type``,
    which costs several times more.)"""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    device = q.device
    if k_cache.device != device or v_cache.device != device:
        raise ValueError(f"devices differ: q {device}, k_cache {k_cache.device}, v_cache {v_cache.device}")
    if not q.is_cuda and not _interpreting():
        raise ValueError(
            f"tensors are on {device}; tree attention needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
        )
    nq, hq, d = q.shape
    if (nq, hq, d) != (plan.n_queries, plan.num_q_heads, plan.head_dim):
        raise ValueError(
            f"q has shape {tuple(q.shape)} but the plan expects "
            f"[n_queries={plan.n_queries}, Hq={plan.num_q_heads}, D={plan.head_dim}]"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} shapes differ")
    pool, hkv, dk = k_cache.shape
    if hkv != plan.num_kv_heads or dk != plan.head_dim:
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)} but the plan expects "
            f"[pool_slots, Hkv={plan.num_kv_heads}, D={plan.head_dim}]"
        )
    if plan.max_slot >= pool:
        raise ValueError(f"the tree reads pool slot {plan.max_slot} but the KV pool has only {pool} slots")
    return device


def overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a stride of 0, as ``expand`` makes, or strides
    that interleave), so that a kernel writing every element would race: the sizes > 1, sorted by
    stride, must each step over the whole span of the ones below."""
    if t.is_contiguous():  # the usual buffer: one C call
        return False
    span = 1
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size > 1:
            if stride < span:
                return True
            span = stride * size
    return False


def output_like(q: torch.Tensor, out: object) -> torch.Tensor:
    """``out``, checked to fit ``q`` (shape, dtype, device, contiguous last dim, no two elements
    sharing memory), or a new tensor like ``q`` when it is None; raises ValueError naming what
    does not fit."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}) with a contiguous last dim")
    if overlapping(out):
        raise ValueError(f"out's elements overlap in memory (strides {out.stride()}): every output row needs its own")
    return out


def _check_sm_scale(sm_scale: object) -> None:
    if (
        isinstance(sm_scale, bool)
        or not isinstance(sm_scale, numbers.Real)
        or not math.isfinite(sm_scale)
        or sm_scale <= 0
    ):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")


def _device_plan(plan: Plan | DevicePlan, device: torch.device) -> DevicePlan:
    if isinstance(plan, DevicePlan):
        if plan.device != device:
            raise ValueError(f"the plan was uploaded to {plan.device} but the tensors are on {device}")
        return plan
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a fasttree Plan, got {type(plan).__name__}")
    cached = plan._device_cache.get(device)  # what plan.to(device) returns once uploaded, without its checks
    return cached if cached is not None else plan.to(device)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: Plan | DevicePlan,
    sm_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of every query over its root-path context, as planned.

    Parameters
    ----------
    q : Tensor, fp16/bf16 [n_queries, Hq, D], CUDA (CPU under ``TRITON_INTERPRET=1``)
        One decode query per row, in the tree's query order.
    k_cache, v_cache : Tensor, q's dtype [pool_slots, Hkv, D], q's device
        Token pools the tree's slot ids index.
    plan : Plan or DevicePlan
        From :func:`fasttree.plan`; a host plan is uploaded once and cached per device.
    sm_scale : float, optional
        Softmax scale; ``1 / sqrt(D)`` by default.
    out : Tensor, q's dtype [n_queries, Hq, D], optional
        Written in place and returned; its last dim contiguous, no two elements sharing memory
        (an ``expand()``-ed buffer is refused).

    Returns
    -------
    Tensor, q's dtype [n_queries, Hq, D]
    """
    host = plan.plan if isinstance(plan, DevicePlan) else plan
    if not isinstance(host, Plan):
        raise ValueError(f"plan must be a fasttree Plan, got {type(plan).__name__}")
    device = _check_inputs(q, k_cache, v_cache, host)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(host.head_dim)
    elif type(sm_scale) is not float or not 0.0 < sm_scale < math.inf:  # a positive finite float passes at once
        _check_sm_scale(sm_scale)
    out = output_like(q, out)
    dev = _device_plan(plan, device)
    qk_scale = float(sm_scale) * _LOG2E
    fast = _fast_path(host, dev, q, k_cache, v_cache, out)
    if fast is not None:
        entry = host._device_cache.get(fast[0])
        if entry is not None:  # every kernel compiled for these tensors: call the launchers directly
            with _on_device(device):
                _run_direct(entry, fast[1], device, qk_scale)
            return out
    launches = _launches(host, dev, q, k_cache, v_cache, out, qk_scale)
    fork_mode = _fork_mode(host, q, launches)
    forked = _forks(fork_mode)
    compiled = []
    with _on_device(device):
        if forked:
            main, side, _, fork, join = _side_stream(device, _current_stream(device))
            fork.record(main)
            side.wait_event(fork)
        shrink = host.config.num_stages is None  # default stages: fewer where the GPU's shared memory ends
        for i, (kernel, grid, args, constexprs, warps, stages, maxnreg) in enumerate(launches):
            if forked and i == 0:
                with _stream_context(side):
                    compiled.append(_launch(kernel, grid, args, constexprs, warps, stages, maxnreg, shrink))
                join.record(side)
                continue
            compiled.append(_launch(kernel, grid, args, constexprs, warps, stages, maxnreg, shrink))
            if forked and i == 1:
                main.wait_event(join)
    if fast is not None and all(c is not None for c in compiled):
        host._device_cache[fast[0]] = (
            fork_mode,
            tuple(
                _direct_launcher(c, grid, args, constexprs, None if _is_merge(kernel) else _QK_SCALE_ARG)
                for c, (kernel, grid, args, constexprs, *_) in zip(compiled, launches, strict=True)
            ),
        )
    return out


def _run_direct(entry: tuple, ptrs: tuple, device: torch.device, qk_scale: float) -> None:
    """Call a plan's cached direct launchers (``entry``: fork mode and launchers) on the current stream."""
    fork_mode, launchers = entry
    stream = _current_stream(device)
    if _forks(fork_mode):  # the two tile classes' stage-1 launches run side by side
        main, side, side_raw, fork, join = _side_stream(device, stream)
        fork.record(main)
        side.wait_event(fork)
        launchers[0](side_raw, *ptrs, qk_scale)
        join.record(side)
        launchers[1](stream, *ptrs, qk_scale)
        main.wait_event(join)
        for launch in launchers[2:]:
            launch(stream, *ptrs, qk_scale)
    else:
        for launch in launchers:
            launch(stream, *ptrs, qk_scale)


def _stage1_launches(launches: list[tuple]) -> int:
    """How many of ``launches`` (from :func:`_launches`) are stage-1 launches (they come first)."""
    return sum(1 for kernel, *_ in launches if kernel is tree_attention_units_kernel)


#: A plan's stage-1 launches run side by side: never, only under CUDA-graph capture, always.
_FORK_NEVER, _FORK_CAPTURED, _FORK_ALWAYS = 0, 1, 2
#: Plans reading at least this many (KV entry, KV head) pairs fork in eager calls too (below it:
#: only under graph capture). The fork's events cost host time. When a launch cost ~10 us of host
#: time, back-to-back eager calls of the smaller two-class suite plans (6/gqa4, 9/gqa4, 11/gqa16,
#: 13/gqa16) took 5-8 us longer forked, hence a threshold of 2^19 pairs. With the direct launchers'
#: int addresses and C launch (H200, `docs/bench/h200/eager_fork_ab_3957674.json`), forking every
#: two-class plan made one call at a time (do_bench) 2-6 us shorter on all of them (6/gqa4 45.8 ->
#: 40.0 us, within 8 us of the same call replayed from a graph with L2 cleared), and back-to-back
#: calls moved -5.6 to +7.6 us (no better or worse on the whole): every two-class plan forks.
_FORK_EAGER_MIN_PAIRS = 0


def _fork_mode(host: Plan, q: torch.Tensor, launches: list[tuple]) -> int:
    """When a call of ``host`` with these launches runs its two stage-1 launches side by side."""
    if not (_FORK_STAGE1 and _is_cuda(q) and not _interpreting() and _stage1_launches(launches) == 2):
        return _FORK_NEVER
    return _FORK_ALWAYS if host.kv_indices.size * host.num_kv_heads >= _FORK_EAGER_MIN_PAIRS else _FORK_CAPTURED


def _forks(mode: int) -> bool:
    """Whether this call forks (``mode`` from :func:`_fork_mode`)."""
    return mode == _FORK_ALWAYS or (mode == _FORK_CAPTURED and _capturing())


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_current_stream_capturing()


#: Whether two-class plans run their stage-1 launches side by side (:func:`_side_stream`); read when
#: a plan's launches for a tensor layout are first built (an A/B switch for benchmarks).
_FORK_STAGE1 = True

#: Makes a ``torch.cuda.Stream`` current (what Triton's JIT and :func:`_launch` launch on).
_stream_context = torch.cuda.stream

#: Per (device index, raw handle of the launching stream): that stream, a side stream, the side
#: stream's raw handle, and the fork and join events (see :func:`_side_stream`).
_SIDE_STREAMS: dict[tuple[int, int], tuple] = {}
#: Entries kept at most (torch's stream pool recycles a few dozen handles per device).
_MAX_SIDE_STREAMS = 64


def _side_stream(device: torch.device, stream: int) -> tuple:
    """``(main, side, side_raw, fork, join)`` for running a plan's two stage-1 launches side by side.

    A plan with two tile classes launches one stage-1 kernel per class; they write disjoint
    partial rows and output rows, so the first runs on a side stream forked from the
    launching stream (``fork`` recorded there, waited by the side stream) while the second
    runs on the launching stream, which waits for ``join`` (recorded on the side stream after
    its launch) before the merge. The long, compute-bound class and the short, memory-bound
    one then share the GPU instead of running one after the other (H200, paper suite: 0.68-0.98x
    of the one-stream time on the 11 two-class plans; bit-identical results). Under CUDA-graph
    capture the fork and join become the graph's edges. One side stream per launching stream,
    so calls on different streams do not wait for each other.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, stream)
    entry = _SIDE_STREAMS.get(key)
    if entry is None:
        if len(_SIDE_STREAMS) >= _MAX_SIDE_STREAMS:  # streams made per call would grow it without end
            _SIDE_STREAMS.clear()
        main = torch.cuda.current_stream(index)
        if main.cuda_stream != stream:
            raise RuntimeError("the launching stream is not the current stream")  # callers pass the current one
        side = torch.cuda.Stream(device=torch.device("cuda", index))
        entry = _SIDE_STREAMS[key] = (main, side, side.cuda_stream, torch.cuda.Event(), torch.cuda.Event())
    return entry


def _launches(
    host: Plan,
    dev: DevicePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qk_scale: float,
) -> list[tuple]:
    """(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg) of each launch of one call.

    Stage-1 arguments start with ``q, k_cache, v_cache, out`` and hold ``qk_scale`` at
    :data:`_QK_SCALE_ARG`; the merge's start with ``out``: :func:`_direct_launcher` relies
    on these positions.
    """  # fmt: skip
    a = dev.arrays
    part_o, part_lse = _workspace(host, q.device)
    ptr = host.class_unit_ptr
    hq, d = host.num_q_heads, host.head_dim
    block_d = triton.next_power_of_2(d)
    upcast = _interpreting() and q.dtype == torch.bfloat16
    offsets_32 = kv_offsets_fit_int32(host.max_slot, k_cache, v_cache)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    # two non-empty classes: two stage-1 launches, which fork (_fork_mode) where they run on a GPU
    forked = _FORK_STAGE1 and all(host.units_per_class())
    pdl_stage1 = pdl_launch("stage1_forked" if forked else "stage1", q)
    pdl_merge = pdl_launch("merge", q)
    sms = _launch_sms(q)  # 0: no one-wave launch choice
    out_launches = []
    for c, tc in enumerate(host.tile_classes):
        n_units = ptr[c + 1] - ptr[c]
        if n_units == 0:
            continue
        args = (
            q, k_cache, v_cache, out, part_o, part_lse, a["kv_indices"], a["kv_row_mask"], a["unit_kv_start"],
            a["unit_kv_len"], a["unit_q_start"], a["unit_q_len"], a["pair_query"], a["pair_out_row"],
            ptr[c], qk_scale, *strides, out.stride(0), out.stride(1),
            part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        )  # fmt: skip
        lengths = host.unit_kv_len[ptr[c] : ptr[c + 1]]
        items = n_units * host.num_kv_heads
        block_n = launch_kv_tile(host.group_size, d, tc, lengths, items, sms)
        num_stages = tc.num_stages  # stages the config sets are kept; its defaults may deepen
        if host.config.num_stages is None:
            num_stages = launch_num_stages(host.group_size, d, tc, items, sms)
        peel = peel_tiles(tc.block_m, float(np.mean(-(-lengths // block_n))))
        grid, heads_fastest = units_grid(n_units, host.num_kv_heads)
        constexprs = (d, block_d, host.group_size, tc.block_m, block_n, tc.masked, upcast, offsets_32, peel,
                      heads_fastest, pdl_stage1)  # fmt: skip
        maxnreg = None
        if host.group_size == 1 and tc.block_m <= 16 and _is_cuda(q) and not _interpreting():
            maxnreg = small_tile_maxnreg(host.group_size, d, tc.block_m, tc.num_warps, items, _sm_count(q.device))
        out_launches.append(
            (tree_attention_units_kernel, grid, args, constexprs, tc.num_warps, num_stages, maxnreg)
        )  # fmt: skip
    n_merge = int(host.merge_queries.size)
    if n_merge:
        args = (
            out, part_o, part_lse, a["merge_queries"], a["query_partial_start"], a["query_num_partials"],
            out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        )  # fmt: skip
        most = merge_max_partials(host)
        if most >= _MANY_PARTIALS:
            block_p = min(_MERGE_PARTIALS_PER_STEP, triton.next_power_of_2(most))
            warps = 1 if block_p * block_d <= 512 else 2 if block_p * block_d <= 2048 else 4
            out_launches.append(
                (merge_many_partials_kernel, (n_merge, hq), args, (d, block_p, block_d, pdl_merge), warps, 1, None)
            )
        else:
            block_h = min(triton.next_power_of_2(hq), _MERGE_HEADS)
            out_launches.append(
                (
                    merge_partials_kernel,
                    (n_merge, triton.cdiv(hq, block_h)),
                    args,
                    (hq, d, block_h, block_d, pdl_merge),
                    4,
                    3,
                    None,
                )
            )
    return out_launches


_INT32_MAX = 2**31 - 1

#: Whether stage 1 hands out its (unit, KV head) items with the KV heads fastest (the kernels'
#: ``HEADS_FASTEST``): a unit's heads then run together and read each gathered slot's K and V
#: rows of every head, which are contiguous in the pools, at about the same time. Otherwise the
#: units are fastest (every unit of KV head 0, then of head 1, ...), and the programs running at
#: one time read one or a few heads' rows of many slots, ``Hkv * D`` elements apart. On the H200
#: (``bench/device/heads_fastest_ab.py``) heads fastest took 0.95x the runtime's time on Llama
#: decode trees (0.83-1.01x), 0.98x on Mistral's, and 0.997x on the paper suite's MHA and GQA-4
#: stage-1 launches. Read when launches are set up, and by :class:`fasttree.runtime.TreeAttentionRuntime`
#: when it is built (an A/B switch for benchmarks: plans made before a change keep their cached
#: launchers).
_HEADS_FASTEST = True
#: The largest second grid dimension a CUDA launch takes.
_MAX_GRID_Y = 65535


def units_grid(n_units: int, num_kv_heads: int) -> tuple[tuple[int, int], bool]:
    """The per-plan stage-1 grid of ``n_units`` units and ``num_kv_heads`` KV heads, and its
    ``HEADS_FASTEST``: ``(heads, units)`` with :data:`_HEADS_FASTEST` (programs launch with
    the first dimension fastest) when the units fit the grid's second dimension, else
    ``(units, heads)``."""
    if _HEADS_FASTEST and n_units <= _MAX_GRID_Y:
        return (num_kv_heads, n_units), True
    return (n_units, num_kv_heads), False


#: Which stage-1 launches run a unit's whole KV tiles without masks, then one masked tail tile
#: (the kernels' ``PEEL``): ``"auto"`` (:func:`peel_tiles`' rule), ``"none"``, ``"large"`` (tiles of
#: more than 16 rows), ``"small"`` (16 rows) or ``"all"``. Read at each launch's set-up (an A/B
#: switch for benchmarks: plans made before a change keep their cached launchers).
_PEEL_TILES = "auto"
#: Fewest KV tiles per unit, on average over a launch's units, for ``"auto"`` to peel: the tail
#: tile outside the pipelined loop costs about what the unmasked tiles save on units of 1.75-1.9
#: tiles (H200: 2/gqa16 and 6/gqa16 +4-5%), while units of 2.75 and more gained 1-12%.
_PEEL_MIN_TILES = 2.5


def peel_tiles(block_m: int, mean_tiles: float | None = None) -> bool:
    """Whether a stage-1 launch of ``block_m``-row tiles peels its units' tail tile (``PEEL``).

    ``"auto"``: tiles of more than 16 rows whose units average at least :data:`_PEEL_MIN_TILES`
    KV tiles (``mean_tiles``; None, as for the runtime's launches, which serve every later
    plan: not checked). On the H200 paper suite (``bench/device/peel_ab.py``) peeling the
    64-row launches took 0.977x the time on geomean (GQA 4 down to 0.89x) and left the serving
    runtime's decode trees unchanged (0.998x); peeling 16-row launches cost up to 9% there.
    """
    rule = _PEEL_TILES
    if rule == "auto":
        return block_m > 16 and (mean_tiles is None or mean_tiles >= _PEEL_MIN_TILES)
    if rule == "all":
        return True
    if rule == "large":
        return block_m > 16
    if rule == "small":
        return block_m <= 16
    return False


def kv_offsets_fit_int32(max_slot: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the stage-1 kernels may form K/V addresses from int32 offsets (``OFFSETS_32``).

    True when, in both pools, the element offset of every (slot, KV head, dim) with slot <=
    ``max_slot`` (``slot * stride(0) + head * stride(1) + dim``) is at most ``2**31 - 1``.
    The answer depends only on ``max_slot``, the pools' strides and their head and dim
    sizes, so launchers cached by plan and tensor layout stay valid.
    """
    _, hkv, d = k_cache.shape
    for t in (k_cache, v_cache):
        s0, s1 = t.stride(0), t.stride(1)
        if max_slot * s0 + (hkv - 1) * s1 + d - 1 > _INT32_MAX:
            return False
    return True


#: Programs per SM of the 16-row stage-1 kernel at 4 warps and head dim <= 128 as compiled (159
#: registers on sm_90), and with its registers capped by :func:`capped_registers`.
_SMALL_TILE_PROGRAMS, SMALL_TILE_CAPPED_PROGRAMS = 3, 4
#: Beyond this many waves the tail a cap saves is small and the cap cost 1-4% (H200, 26 waves).
_SMALL_TILE_MAX_WAVES = 8


def capped_registers(num_warps: int, regs_per_sm: int = 65536, programs: int = SMALL_TILE_CAPPED_PROGRAMS) -> int:
    """Registers per thread (a multiple of 8) that let ``programs`` programs of ``num_warps``
    warps share an SM of ``regs_per_sm`` registers (128 for 4 programs of 4 warps on an H100/H200)."""
    return regs_per_sm // (programs * 32 * num_warps) // 8 * 8


def small_tile_maxnreg(
    group_size: int, head_dim: int, block_m: int, num_warps: int, items: int, sms: int
) -> int | None:
    """Register cap of a 16-row MHA tile class's launch, or None (the compiler's choice).

    An MHA class of 16-row tiles (one query per row: memory-bound programs) gets
    :func:`capped_registers` (128 per thread), 4 programs per SM instead of 3,
    when that puts its ``items`` (units x KV heads), at most :data:`_SMALL_TILE_MAX_WAVES`
    waves of the GPU's ``sms`` SMs, into fewer waves. On the H200 paper suite a cap on
    every such launch was 16-23% faster on the MHA cases whose items fill 1-2 waves, 2-6%
    faster on those with 2-6 waves, 1-4% slower on one with 26 waves and up to 15% slower
    where the items already fit one wave (``bench/device/small_class_regs.py``;
    ``docs/bench/NOTES.md``). GQA tiles (several heads per query) gained nothing, nor did
    96 registers.
    """
    if group_size != 1 or head_dim > 128 or block_m > 16 or num_warps != 4 or sms <= 0:
        return None
    waves = -(-items // (_SMALL_TILE_PROGRAMS * sms))
    if waves <= _SMALL_TILE_MAX_WAVES and -(-items // (SMALL_TILE_CAPPED_PROGRAMS * sms)) < waves:
        return capped_registers(num_warps)
    return None


#: Whether :func:`launch_kv_tile` may widen a latency-bound 16-row GQA class's KV tile (A/B switch).
_WIDE_KV_TILE = True
#: The KV tile such a class runs with: 16 x 128-token tiles keep 3 programs per SM on sm_90 at head
#: dim 128 (168 registers, 75 KB of shared memory at up to 4 stages, one K/V buffer).
_WIDE_KV_TILE_TOKENS = 128


def launch_kv_tile(group_size: int, head_dim: int, tc: TileClass, lengths: np.ndarray, items: int, sms: int) -> int:
    """KV tokens per inner-loop tile of one stage-1 launch of tile class ``tc``.

    ``tc.block_n`` (the plan's), except that a 16-row GQA class (several heads per query, 4 or
    more warps, at most 4 stages, head dim <= 128) with a 64-token tile runs 128-token tiles
    when its ``items`` (units x KV heads) fit one wave of the GPU's ``sms`` SMs at 3 programs
    per SM and one unit in ten or more (``lengths``: the class's unit KV lengths) is longer
    than 64 tokens. Such a launch is bound by each program's chain of dependent KV tiles, not
    by the GPU's throughput, so halving the tiles shortens it. On the H200 paper suite (graph
    replay, ``bench/device/tile_variants_ab.py``) that took 1/gqa4, 4/gqa16, 9/gqa4 and
    9/gqa16 to 0.89-0.91x of their time; the same tile on 1,024 items (2.6 waves, 8/gqa16)
    cost 5%, and MHA's 2-warp 16-row tiles lost 10-40% with it. ``sms`` is 0 where the rule does
    not apply (:func:`_launch_sms`: the interpreter, GPUs other than sm_90).
    """
    if (
        not _WIDE_KV_TILE
        or group_size == 1
        or not _one_wave_of_small_tiles(head_dim, tc, items, sms)
        or tc.block_n != 64
        or tc.num_warps < 4
        or lengths.size == 0
    ):
        return tc.block_n
    return _WIDE_KV_TILE_TOKENS if tenth_longest(lengths) > tc.block_n else tc.block_n


#: Whether :func:`launch_num_stages` may deepen a one-wave 16-row MHA class's pipeline (A/B switch).
_DEEP_ONE_WAVE = True
#: Its stages: two gathered K/V buffers (73 KB at head dim 128: 3 programs per SM instead of 5).
_DEEP_ONE_WAVE_STAGES = 5


def launch_num_stages(group_size: int, head_dim: int, tc: TileClass, items: int, sms: int) -> int:
    """Pipeline stages of one stage-1 launch of tile class ``tc``.

    ``tc.num_stages`` (the config's default stages: a config that sets ``num_stages`` keeps
    them, :func:`_launches` does not ask), except that a 16-row MHA class (one query per row, up to 4
    stages: one gathered K/V buffer, head dim <= 128) runs 5 stages, a second buffer, when its
    ``items`` (units x KV heads) fit one wave of the GPU's ``sms`` SMs at the 3 programs per SM
    that leaves room for: the wave count does not change, and each program's chain of KV
    tiles has one more tile in flight. When the deeper buffers would add a wave (2/3/4/mha,
    512 items) they cost 14-18% on the H200 (``bench/device/tile_variants_ab.py``). ``sms`` is 0
    where the rule does not apply (:func:`_launch_sms`).
    """
    if not _DEEP_ONE_WAVE or group_size != 1 or not _one_wave_of_small_tiles(head_dim, tc, items, sms):
        return tc.num_stages
    return _DEEP_ONE_WAVE_STAGES


def _one_wave_of_small_tiles(head_dim: int, tc: TileClass, items: int, sms: int) -> bool:
    """The condition both one-wave rules share: a 16-row class at head dim <= 128 with one gathered
    K/V buffer (up to 4 stages) whose ``items`` fit one wave of ``sms`` SMs at 3 programs per SM."""
    return head_dim <= 128 and tc.block_m == 16 and tc.num_stages <= 4 and items <= _SMALL_TILE_PROGRAMS * sms


#: Compute capability (major) whose occupancy :func:`launch_kv_tile` and :func:`launch_num_stages`
#: assume: 3 programs per SM of 16-row tiles at 75 KB of shared memory each, as on the H100/H200
#: (227 KB per program, 64K registers per SM). GPUs with less shared memory per SM (sm_80: 163 KB,
#: sm_86/89: 99 KB) would fit fewer, so the one-wave rules would add waves there: they keep the plan's
#: launch settings.
_ONE_WAVE_MAJOR = 9


def _launch_sms(q: torch.Tensor) -> int:
    """SMs of the GPU a launch on ``q`` runs on, for the one-wave launch choices; 0 (none) on the CPU
    interpreter and on GPUs of another compute capability than :data:`_ONE_WAVE_MAJOR`."""
    if not _is_cuda(q) or _interpreting() or _compute_capability_major(q.device) != _ONE_WAVE_MAJOR:
        return 0
    return _sm_count(q.device)


_SM_COUNTS: dict[int, int] = {}
_MAJORS: dict[int, int] = {}

#: Which launches go out with programmatic dependent launch (PDL) on GPUs that have it (sm_90+). Such a
#: grid may start while the grid before it on its stream finishes and waits for that grid's results
#: (``GDC_WAIT``): as its first instruction (1), or (2, "early") after reading the plan's arrays for
#: its first item, every program having first let the next grid of the stream launch (see
#: :mod:`fasttree.kernels.tree_attention`). Per launch kind (:func:`pdl_launch`):
#:
#: ========== ======== ============== ======= ===================== =====================
#: mode       stage1   stage1_forked  merge   persistent (runtime)  what it is
#: ========== ======== ============== ======= ===================== =====================
#: ``none``   0        0              0       0                     no PDL
#: ``merge``  0        0              1       1 (merge only)        merges only
#: ``all``    1        1              1       1
#: ``auto``   1        0              1       2                     the default
#: ``early``  2        0              2       2
#: ========== ======== ============== ======= ===================== =====================
#:
#: ``stage1_forked``: one of :func:`tree_attention`'s two stage-1 launches that run side by side. Read
#: when a plan's or a runtime's launches are built (an A/B switch for benchmarks).
#:
#: H200, graph replay of back-to-back calls, outputs bit-identical (``docs/bench/NOTES.md``):
#: ``pdl_ab_e894a7e.json``: ``merge`` 1.003x the time of ``none`` on the paper suite (no gain);
#: ``all`` 0.90-0.98x on the small one-launch GQA plans and the runtime on the serving trees 0.988x,
#: but the forked two-class plans lost (9/gqa4 1.31x, 6/gqa4 1.23x; Mistral serving trees through
#: ``tree_attention`` 1.06-1.16x). ``pdl_auto_ab_c0fe3cc.json`` (``auto`` then without the early
#: runtime): paper 0.981x of ``none``. ``pdl_early_ab_58b9f4d.json``: ``early`` against that
#: ``auto``: the runtime on the serving trees 0.973x (0.94-0.99), but the per-plan kernels 1.017x on
#: the paper suite (1/*, 4/gqa16, 9/gqa16 1.19-1.28x slower), hence early for the runtime only.
_PDL = "auto"
_PDL_MODES = ("none", "merge", "all", "auto", "early")
_PDL_KINDS = ("stage1", "stage1_forked", "merge", "persistent_stage1", "persistent_merge")


def _compute_capability_major(device: torch.device) -> int:
    """Major compute capability of a CUDA device (cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MAJORS:
        _MAJORS[index] = int(torch.cuda.get_device_capability(index)[0])
    return _MAJORS[index]


def pdl_launch(kind: str, q: torch.Tensor) -> int:
    """``GDC_WAIT`` of a ``kind`` launch (:data:`_PDL_KINDS`) for tensors on ``q``'s device under
    :data:`_PDL`: 0 (no programmatic dependent launch), 1 (the wait first) or 2 (early)."""
    if _PDL not in _PDL_MODES:
        raise ValueError(f"fasttree.attention._PDL must be one of {_PDL_MODES}, got {_PDL!r}")
    if kind not in _PDL_KINDS:
        raise ValueError(f"launch kind must be one of {_PDL_KINDS}, got {kind!r}")
    persistent = kind.startswith("persistent")
    if _PDL == "none" or (_PDL == "merge" and not kind.endswith("merge")):
        return 0
    if kind == "stage1_forked" and _PDL in ("auto", "early"):
        return 0
    if not (_is_cuda(q) and not _interpreting() and _compute_capability_major(q.device) >= 9):
        return 0
    if _PDL == "early" or (_PDL == "auto" and persistent):
        return 2
    return 1


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = int(torch.cuda.get_device_properties(index).multi_processor_count)
    return _SM_COUNTS[index]


def merge_max_partials(plan: Plan) -> int:
    """Most partial rows of one merged query of ``plan`` (0 when nothing is merged)."""
    if plan.merge_queries.size == 0:
        return 0
    return int(plan.query_num_partials[plan.merge_queries].max())


def merge_heads_per_program(plan: Plan) -> int:
    """Query heads one program of ``plan``'s merge launch handles (the launch :func:`_launches` picks)."""
    if merge_max_partials(plan) >= _MANY_PARTIALS:
        return 1
    return min(triton.next_power_of_2(plan.num_q_heads), _MERGE_HEADS)


#: Position of ``qk_scale`` among the stage-1 kernel's arguments.
_QK_SCALE_ARG = 15


def _fast_path(host: Plan, dev: DevicePlan, q, k_cache, v_cache, out) -> tuple | None:
    """``(key, pointers)``: the cache key of the direct launchers of this call and what they take
    for ``q, k_cache, v_cache, out`` (:func:`launch_pointers`), or None when the call must go
    through Triton.

    The key holds everything the launches' arguments differ by from one call to another
    besides the tensors' addresses and ``qk_scale``: the dtype, each tensor's 16-byte
    alignment (Triton specialises on it) and the strides. Only the plan's own cached
    device copy qualifies (its arrays and workspace are then fixed for the plan's life).
    """
    if _interpreting() or not _is_cuda(q) or _launch_hooks_active():
        return None
    if host._device_cache.get(dev.device) is not dev:
        return None
    ptrs = launch_pointers(q, k_cache, v_cache, out)
    return ("direct", dev.device, *tensor_layout(q, k_cache, v_cache, out, ptrs)), ptrs


#: Whether direct launchers pass device addresses as ints, which Triton's launcher takes as they
#: are, rather than tensors, for each of which it calls ``data_ptr()`` and asks the driver to check
#: the address (``cuPointerGetAttribute``) on every launch. Read when a launcher is built and by
#: :func:`launch_pointers` (an A/B switch for benchmarks: clear the cached launchers after a change).
_INT_POINTERS = True


def launch_pointers(q, k_cache, v_cache, out) -> tuple:
    """What direct launchers take for ``q, k_cache, v_cache, out``: their addresses as ints (the
    tensors themselves when :data:`_INT_POINTERS` is off). The caller has checked that they are
    CUDA tensors of one device."""
    if _INT_POINTERS:
        return q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
    return q, k_cache, v_cache, out


def tensor_layout(q, k_cache, v_cache, out, ptrs: tuple | None = None) -> tuple:
    """What compiled launches depend on in ``q, k_cache, v_cache, out`` besides their addresses: the
    dtype, each tensor's 16-byte alignment (Triton specialises on it) and the strides of dims 0 and 1
    (``ptrs``: :func:`launch_pointers` of the four, when the caller has it)."""
    sq, sk, sv, so = q.stride(), k_cache.stride(), v_cache.stride(), out.stride()  # one call per tensor
    if ptrs is None or not isinstance(ptrs[0], int):
        ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
    aq, ak, av, ao = ptrs
    return (
        q.dtype, aq % 16 == 0, ak % 16 == 0, av % 16 == 0, ao % 16 == 0,
        sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], so[0], so[1],
    )  # fmt: skip


def _direct_launcher(compiled, grid: tuple[int, int], args: tuple, constexprs: tuple, qk_scale_arg: int | None):
    """A function ``(stream, q, k_cache, v_cache, out, qk_scale)`` calling ``compiled``'s launcher with
    ``args`` in which the per-call values are replaced.

    A stage-1 launch's ``args`` start with ``q, k_cache, v_cache, out`` and hold ``qk_scale`` at
    ``qk_scale_arg``; ``qk_scale_arg=None`` is a merge launch, whose ``args`` start with ``out``
    (the only value that changes). The other tensors (plan arrays, workspace) are fixed: with
    :data:`_INT_POINTERS` the launcher passes their addresses and holds the tensors (``held``) so
    that the addresses stay valid. ``q, k_cache, v_cache, out`` come as :func:`launch_pointers`
    gives them. Serves :func:`tree_attention` and the runtime.
    """
    run, head = _launch_entry(compiled)
    fn = compiled.function
    g0, g1 = grid
    held = args
    if _INT_POINTERS:
        args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    if qk_scale_arg is None:
        rest = (*args[1:], *constexprs)

        def merge(stream, q, k_cache, v_cache, out, qk_scale):
            run(g0, g1, 1, stream, fn, *head, out, *rest)

        merge.held = held
        return merge
    mid = args[4:qk_scale_arg]
    tail = (*args[qk_scale_arg + 1 :], *constexprs)

    def stage1(stream, q, k_cache, v_cache, out, qk_scale):
        run(g0, g1, 1, stream, fn, *head, q, k_cache, v_cache, out, *mid, qk_scale, *tail)

    stage1.held = held
    return stage1


#: Whether direct launchers call the C launch function of Triton's ``CudaLauncher`` themselves
#: (with the arguments its ``__call__`` adds: the cooperative-grid and PDL flags, no scratch
#: buffers) instead of going through that Python ``__call__`` on every launch. Its argument order
#: is Triton's internal: checked against Triton 3.6 only, other versions use ``__call__``. Read
#: when a launcher is built (an A/B switch for benchmarks).
_C_LAUNCH = True
_C_LAUNCH_TRITON = (3, 6)


def _triton_version() -> tuple[int, ...]:
    return tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())


def _launch_entry(compiled) -> tuple:
    """``(run, head)``: what to call to launch ``compiled`` and the arguments that go between
    ``(grid_x, grid_y, grid_z, stream, function)`` and the kernel's own."""
    launcher = compiled.run
    meta = compiled.packed_metadata
    if _C_LAUNCH and type(launcher).__name__ == "CudaLauncher" and _triton_version() == _C_LAUNCH_TRITON:
        launch = getattr(launcher, "launch", None)
        scratch = getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
        if callable(launch) and not scratch:
            coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
            return launch, (coop, pdl, None, None, meta, None, None, None)
    return launcher, (meta, None, None, None)


def _is_merge(kernel) -> bool:
    return kernel is merge_partials_kernel or kernel is merge_many_partials_kernel


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


#: torch's raw current-device getter (CUDA builds): ``torch.cuda.current_device()`` without its
#: lazy-init check, which an eager call pays on every launch otherwise.
_RAW_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _current_device_index() -> int:
    """Index of the current CUDA device."""
    return _RAW_DEVICE() if _RAW_DEVICE is not None else torch.cuda.current_device()


#: torch's raw current-stream getter (CUDA builds; what Triton's launcher uses): an int handle
#: without building a ``torch.cuda.Stream`` object (about 8 us less per launch on a GPU host).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: torch.device) -> int:
    """Raw handle of the current CUDA stream of ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


#: Query heads merged by one program of :func:`merge_partials_kernel`.
_MERGE_HEADS = 4
#: Plans whose merged queries have up to this many partials less one use :func:`merge_partials_kernel`;
#: from this many on, :func:`merge_many_partials_kernel` (H200, paper suite: it was 3-28% faster on the
#: plans with 7-27 partials per query and up to 6-12% slower on those with 2-5).
_MANY_PARTIALS = 7
#: Partial rows :func:`merge_many_partials_kernel` reads in one step (a query with more takes several).
_MERGE_PARTIALS_PER_STEP = 32

#: Compiled kernels by (kernel, device, constexprs, launch options, argument specialisation).
_COMPILED: dict[tuple, object] = {}
#: Kernels whose last constexpr is ``GDC_WAIT`` (every kernel of :mod:`fasttree.kernels`).
_GDC_KERNELS = frozenset(
    (
        tree_attention_units_kernel, merge_partials_kernel, merge_many_partials_kernel,
        tree_attention_persistent_kernel, merge_partials_persistent_kernel,
    )
)  # fmt: skip


def _arg_spec(arg: object) -> object:
    """What Triton specialises a launch argument on: pointer dtype and 16-byte alignment,
    an int's value 1, divisibility by 16 and width."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31)
    return None


def _launch(
    kernel,
    grid: tuple[int, int],
    args: tuple,
    constexprs: tuple,
    num_warps: int,
    num_stages: int,
    maxnreg: int | None = None,
    shrink_stages: bool = False,
):
    """Launch ``kernel[grid](*args, *constexprs)``; returns the compiled kernel (None under the interpreter or hooks).

    The first launch of a specialisation goes through Triton's JIT (compiling if needed);
    later ones call the compiled kernel's launcher directly, skipping Triton's Python
    argument binding. The cache key holds everything Triton specialises on (see
    :func:`_arg_spec`), so a cached kernel is only reused where the JIT would pick the
    same one. ``constexprs`` are the kernel's trailing ``tl.constexpr`` parameters in
    signature order. ``maxnreg`` caps the registers per thread (None: the compiler's choice).
    A kernel of :data:`_GDC_KERNELS` whose last constexpr (``GDC_WAIT``) is non-zero is compiled to
    launch with programmatic dependent launch (:func:`pdl_launch`); so are its direct launchers.

    With ``shrink_stages`` (the config's stages are its defaults, ``num_stages=None``) a kernel
    whose pipeline needs more shared memory than the GPU gives a program is compiled with fewer
    stages, each try one stage less (logged once per specialisation): the default stages of
    :meth:`fasttree.FastTreeConfig.launch_stages` fit an H100 or H200 but not every GPU.
    Explicit stages that do not fit raise Triton's ``OutOfResources``.
    """
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    if kernel in _GDC_KERNELS and constexprs and constexprs[-1]:  # GDC_WAIT non-zero: launched with PDL
        options["launch_pdl"] = True
    if _interpreting() or _launch_hooks_active():
        kernel[grid](*args, *constexprs, **options)
        return None
    device = args[0].device.index
    key = (kernel, device, constexprs, num_warps, num_stages, maxnreg, tuple(_arg_spec(x) for x in args))
    compiled = _COMPILED.get(key)
    if compiled is None:
        if shrink_stages:
            compiled = _compile_within_shared_memory(kernel, grid, args, constexprs, options)
        else:
            compiled = kernel[grid](*args, *constexprs, **options)
        _COMPILED[key] = compiled
        return compiled
    stream = _current_stream(args[0].device)
    compiled.run(
        grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *constexprs
    )
    return compiled


def _compile_within_shared_memory(kernel, grid, args: tuple, constexprs: tuple, options: dict):
    """``kernel[grid](*args, *constexprs, **options)`` (compiling and launching it), retried with one
    pipeline stage less while the compiler reports too little shared memory; returns the compiled kernel."""
    stages = options["num_stages"]
    while True:
        try:
            compiled = kernel[grid](*args, *constexprs, **{**options, "num_stages": stages})
        except OutOfResources as err:
            if getattr(err, "name", None) != "shared memory" or stages <= 1:
                raise
            stages -= 1
            continue
        if stages != options["num_stages"]:
            logger.warning(
                "%s at %d pipeline stages needs more shared memory than this GPU gives a program: "
                "compiled with %d stages", getattr(kernel, "__name__", kernel), options["num_stages"], stages,
            )  # fmt: skip
        return compiled


def _launch_hooks_active() -> bool:
    """Whether a profiler registered Triton launch hooks (then every launch goes through the JIT).

    Triton >= 3.5 keeps the hooks in an always-present ``HookChain``; older ones use None.
    """
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _on_device(device: torch.device):
    """Make ``device`` current for the launches (a no-op when it already is, or on the CPU)."""
    if device.type == "cuda" and device.index != _current_device_index():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _workspace(plan: Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial-result buffers of a plan on one device, allocated once and reused.

    Calls sharing a plan must not run concurrently on different streams.
    """
    key = ("workspace", device)
    ws = plan._device_cache.get(key)
    if ws is None:
        rows = max(1, plan.n_partial_rows)
        ws = (
            torch.empty((rows, plan.num_q_heads, plan.head_dim), dtype=torch.float32, device=device),
            torch.empty((rows, plan.num_q_heads), dtype=torch.float32, device=device),
        )
        plan._device_cache[key] = ws
    return ws


# ------------------------------------------------------------------- baseline
def plan_query_separated(
    tree: KVTree,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_split_size: int | None = None,
    num_sms: int = 132,
    kv_tile: int = 64,
) -> Plan:
    """Plan FlashDecoding-style attention: every query alone over its whole context.

    Each query's root-path KV is cut into chunks of ``kv_split_size`` tokens (by default
    sized so that about four waves of ``num_sms`` programs run); one program handles the
    ``g`` heads of one KV head of one query over one chunk, and chunks are merged.
    """
    check_heads(num_q_heads, num_kv_heads, head_dim)
    kv_indptr, kv_slots = tree.query_slots()
    nq = tree.n_queries
    lens = np.diff(kv_indptr)
    if kv_split_size is None:
        want_chunks = max(1, -(-4 * num_sms // (nq * num_kv_heads)))
        kv_split_size = max(kv_tile, -(-int(lens.max()) // want_chunks))
        kv_split_size = -(-kv_split_size // kv_tile) * kv_tile
    if kv_split_size < 1:
        raise ValueError(f"kv_split_size must be >= 1, got {kv_split_size}")
    groups = Groups(
        node=tree.query_nodes.copy(),
        kv_start=kv_indptr[:-1],
        kv_len=lens,
        kv_slots=kv_slots,
        q_indptr=np.arange(nq + 1, dtype=np.int64),
        q_ids=np.arange(nq, dtype=np.int64),
    )
    config = FastTreeConfig(
        q_tile_queries=(1, 1),
        kv_tile=(kv_tile, kv_tile),
        kv_split_sizes=(kv_split_size, kv_split_size),
        pack_tokens=0,
    )
    return materialize(
        groups,
        q_tiles=(1, 1),
        kv_tiles=(kv_tile, kv_tile),
        group_split=np.full(nq, kv_split_size, dtype=np.int64),
        splits=(kv_split_size, kv_split_size),
        config=config,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        n_queries=nq,
        max_slot=tree.max_slot,
        tile_mode="query_separated",
    )


def query_separated_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: KVTree,
    sm_scale: float | None = None,
    *,
    kv_split_size: int | None = None,
) -> torch.Tensor:
    """Baseline decode attention that ignores sharing: each query reads its whole path.

    Same tensors as :func:`tree_attention`; plans with :func:`plan_query_separated` (on
    every call -- plan once and call :func:`tree_attention` to time the kernel alone).
    """
    for name, t in (("q", q), ("k_cache", k_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D torch.Tensor")
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
    qs_plan = plan_query_separated(
        tree,
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[1],
        head_dim=q.shape[2],
        kv_split_size=kv_split_size,
        num_sms=num_sms,
    )
    return tree_attention(q, k_cache, v_cache, qs_plan, sm_scale)
