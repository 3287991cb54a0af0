"""Tree attention of a plan: :func:`tree_attention`, and the query-separated baseline.

Validates the tensors, sizes each launch of a plan from :mod:`fasttree.launch_rules` and runs
them through :mod:`fasttree.launcher`: one stage-1 launch per tile class (two run side by side on
two streams) and a merge launch where queries have several partials.

Tensor vocabulary: ``q`` is ``[n_queries, Hq, D]`` (query ``j`` = row ``j``);
``k_cache`` / ``v_cache`` are SGLang-style token pools ``[pool_slots, Hkv, D]``;
outputs are ``[n_queries, Hq, D]`` in ``q``'s dtype. fp16 and bf16 are supported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton

from .kernels import (
    merge_many_partials_kernel,
    merge_partials_kernel,
    tree_attention_units_kernel,
    tree_attention_units_sm90_kernel,
)
from .launch_rules import (
    GpuTarget,
    MergeLaunch,
    Stage1Launch,
    kv_offsets_fit_int32,
    merge_launch,
    next_pow2,
    pdl_wait,
    sm90_tile,
    stage1_launches,
    units_grid,
)
from .launcher import (
    current_stream,
    direct_launcher,
    interpreting,
    launch,
    launch_hooks_active,
    launch_pointers,
    on_device,
    side_stream,
    tensor_layout,
)
from .plan_arrays import DevicePlan, Plan
from .query_separated import plan_query_separated
from .tree import KVTree
from .validation import check_number

__all__ = ["output_like", "query_separated_attention", "tree_attention"]

LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: Position of ``qk_scale`` among the stage-1 kernel's arguments.
_QK_SCALE_ARG = 15


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
    if not q.is_cuda and not interpreting():
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
    check_number("sm_scale", sm_scale, above=0.0, expected="a positive finite number")


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

    Raises
    ------
    ValueError
        Before any launch, on tensors that do not fit the plan or each other.
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
    qk_scale = float(sm_scale) * LOG2E
    fast = _fast_path(host, dev, q, k_cache, v_cache, out)
    if fast is not None:
        entry = host._device_cache.get(fast[0])
        if entry is not None:  # every kernel compiled for these tensors: call the launchers directly
            with on_device(device):
                run_direct(entry, fast[1], device, qk_scale)
            return out
    target = _target(q)
    launches = plan_launches(host, dev, q, k_cache, v_cache, out, qk_scale, target)
    forked = _forks(target, launches)
    shrink = host.config.num_stages is None  # default stages: fewer where the GPU's shared memory ends
    with on_device(device):
        compiled = launch_through_triton([(*spec, shrink) for spec in launches], device, forked)
    if fast is not None and all(c is not None for c in compiled):
        host._device_cache[fast[0]] = (forked, direct_launchers(compiled, launches))
    return out


def launch_through_triton(launches: list[tuple], device: torch.device, forked: bool) -> list:
    """Launch ``(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg, shrink_stages)`` each
    through :func:`fasttree.launcher.launch` on the current stream, the first on a side stream beside
    the second when ``forked`` (the two stage-1 launches of a two-class plan); returns the compiled
    kernels (None under the interpreter or launch hooks)."""
    compiled = []
    if forked:
        main, side, _, fork, join = side_stream(device, current_stream(device))
        fork.record(main)
        side.wait_event(fork)
    for i, (kernel, grid, args, constexprs, warps, stages, maxnreg, shrink) in enumerate(launches):
        if forked and i == 0:
            with _stream_context(side):
                compiled.append(launch(kernel, grid, args, constexprs, warps, stages, maxnreg, shrink))
            join.record(side)
            continue
        compiled.append(launch(kernel, grid, args, constexprs, warps, stages, maxnreg, shrink))
        if forked and i == 1:
            main.wait_event(join)
    return compiled


def direct_launchers(compiled: list, launches: list[tuple]) -> tuple:
    """The direct launchers (:func:`fasttree.launcher.direct_launcher`) of ``launches`` (``(kernel,
    grid, args, constexprs, ...)``, as :func:`kernel_launches` gives them) compiled as ``compiled``:
    a stage-1 launch's take ``qk_scale`` at :data:`_QK_SCALE_ARG`, a merge's none."""
    return tuple(
        direct_launcher(c, grid, args, constexprs, None if _is_merge(kernel) else _QK_SCALE_ARG)
        for c, (kernel, grid, args, constexprs, *_) in zip(compiled, launches, strict=True)
    )


def run_direct(entry: tuple, ptrs: tuple, device: torch.device, qk_scale: float) -> None:
    """Call a plan's cached direct launchers (``entry``: whether it forks, and the launchers) on the
    current stream."""
    forked, launchers = entry
    stream = current_stream(device)
    if forked:  # the two tile classes' stage-1 launches run side by side
        main, side, side_raw, fork, join = side_stream(device, stream)
        fork.record(main)
        side.wait_event(fork)
        launchers[0](side_raw, *ptrs, qk_scale)
        join.record(side)
        launchers[1](stream, *ptrs, qk_scale)
        main.wait_event(join)
        for run in launchers[2:]:
            run(stream, *ptrs, qk_scale)
    else:
        for run in launchers:
            run(stream, *ptrs, qk_scale)


#: Makes a ``torch.cuda.Stream`` current (what Triton's JIT and :func:`fasttree.launcher.launch` launch on).
_stream_context = torch.cuda.stream


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _target(q: torch.Tensor) -> GpuTarget:
    """The launch facts of ``q``'s device."""
    return GpuTarget.of(q.device, interpreting())


def _forks(target: GpuTarget, launches: list[tuple]) -> bool:
    """Whether a call's two stage-1 launches (a plan with two non-empty tile classes) run side by
    side on two streams (:func:`fasttree.launcher.side_stream`): on a GPU, always (with the direct
    launchers, eager calls of every two-class plan were 2-6 us shorter forked on the H200)."""
    return target.cuda and sum(1 for kernel, *_ in launches if not _is_merge(kernel)) == 2


def _fast_path(host: Plan, dev: DevicePlan, q, k_cache, v_cache, out) -> tuple | None:
    """``(key, pointers)``: the cache key of the direct launchers of this call and what they take
    for ``q, k_cache, v_cache, out`` (:func:`fasttree.launcher.launch_pointers`), or None when the
    call must go through Triton.

    The key holds everything the launches' arguments differ by from one call to another
    besides the tensors' addresses and ``qk_scale``: the dtype, each tensor's 16-byte
    alignment (Triton specialises on it) and the strides. Only the plan's own cached
    device copy qualifies (its arrays and workspace are then fixed for the plan's life).
    """
    if interpreting() or not _is_cuda(q) or launch_hooks_active():
        return None
    if host._device_cache.get(dev.device) is not dev:
        return None
    ptrs = launch_pointers(q, k_cache, v_cache, out)
    return ("direct", dev.device, *tensor_layout(q, k_cache, v_cache, out, ptrs)), ptrs


def _is_merge(kernel) -> bool:
    return kernel is merge_partials_kernel or kernel is merge_many_partials_kernel


def plan_launches(
    host: Plan,
    dev: DevicePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qk_scale: float,
    target: GpuTarget,
) -> list[tuple]:
    """``(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg)`` of each launch of one call
    of ``host`` on ``target``: a stage-1 launch per non-empty tile class, then the merge, if any
    (:func:`kernel_launches` of the plan's own launch decisions and device arrays)."""
    part_o, part_lse = _workspace(host, q.device)
    return kernel_launches(
        stage1_launches(host, target), merge_launch(host, next_pow2(host.head_dim)), dev.arrays,
        part_o, part_lse, q, k_cache, v_cache, out, qk_scale, target,
        offsets_32=kv_offsets_fit_int32(host.max_slot, k_cache, v_cache),
    )  # fmt: skip


def kernel_launches(
    stage1: tuple[Stage1Launch, ...],
    merge: MergeLaunch | None,
    arrays: Mapping[str, torch.Tensor],
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qk_scale: float,
    target: GpuTarget,
    *,
    offsets_32: bool,
    unit_offsets: tuple[int, ...] | None = None,
) -> list[tuple]:
    """``(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg)`` of the launches
    ``stage1`` and ``merge`` decide, over the plan arrays ``arrays`` (by
    :data:`fasttree.plan_arrays.DEVICE_ARRAYS` name, int32 tensors on ``q``'s device) and the
    workspace ``part_o`` (fp32 ``[rows, Hq, D]``) and ``part_lse`` (fp32 ``[rows, Hq]``): what
    :func:`tree_attention` launches for a plan and a runtime launch variant for every plan of it.
    ``unit_offsets``: each stage-1 launch's first unit in the unit arrays (default: its
    ``first_unit``). Stage-1 arguments start with ``q, k_cache,
    v_cache, out`` and hold ``qk_scale`` at :data:`_QK_SCALE_ARG`; the merge's start with ``out``:
    the direct launchers rely on these positions.
    """
    a = arrays
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    block_d = next_pow2(d)
    upcast = interpreting() and q.dtype == torch.bfloat16  # the interpreter's bf16 dots need fp32
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    # two non-empty classes: two stage-1 launches, which run side by side (_forks) on a GPU
    pdl_stage1 = pdl_wait("stage1_forked" if len(stage1) == 2 else "stage1", target)
    pdl_merge = pdl_wait("merge", target)
    offsets = unit_offsets if unit_offsets is not None else tuple(s.first_unit for s in stage1)
    out_launches = []
    for s, first in zip(stage1, offsets, strict=True):
        args = (
            q, k_cache, v_cache, out, part_o, part_lse, a["kv_indices"], a["kv_row_mask"], a["unit_kv_start"],
            a["unit_kv_len"], a["unit_q_start"], a["unit_q_len"], a["pair_query"], a["pair_out_row"],
            first, qk_scale, *strides, out.stride(0), out.stride(1),
            part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        )  # fmt: skip
        grid, heads_fastest = units_grid(s.n_units, hkv)
        if s.warp_specialized:  # the sm_90 Gluon kernel at its own tile: one consumer warpgroup
            t = sm90_tile(d, offsets_32)
            constexprs = (d, hq // hkv, s.block_m, t.block_n, s.masked, offsets_32, heads_fastest, t.stages,
                          t.loader_warps, t.loader_regs, pdl_stage1)  # fmt: skip
            out_launches.append((tree_attention_units_sm90_kernel, grid, args, constexprs, 4, 1, t.maxnreg))
            continue
        constexprs = (d, block_d, hq // hkv, s.block_m, s.block_n, s.masked, upcast, offsets_32, s.peel,
                      heads_fastest, pdl_stage1)  # fmt: skip
        out_launches.append(
            (tree_attention_units_kernel, grid, args, constexprs, s.num_warps, s.num_stages, s.maxnreg)
        )  # fmt: skip
    if merge is not None:
        args = (
            out, part_o, part_lse, a["merge_queries"], a["query_partial_start"], a["query_num_partials"],
            out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        )  # fmt: skip
        if merge.many:
            constexprs = (d, merge.block_p, block_d, pdl_merge)
            out_launches.append(
                (merge_many_partials_kernel, (merge.n_merge, hq), args, constexprs, merge.num_warps, 1, None)
            )
        else:
            grid = (merge.n_merge, triton.cdiv(hq, merge.block_h))
            constexprs = (hq, d, merge.block_h, block_d, pdl_merge)
            out_launches.append((merge_partials_kernel, grid, args, constexprs, merge.num_warps, 3, None))
    return out_launches


def _workspace(plan: Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial-result buffers of a plan on one device, allocated once and reused:
    ``[n_partial_rows, Hq, D]`` outputs and ``[n_partial_rows, Hq]`` LSEs (at least one row).

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
