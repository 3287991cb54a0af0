"""Features of a plan for the learned latency model: work counts, GPU facts and the simulator's answer.

One row per (plan, GPU), columns :data:`FEATURE_NAMES` in that order
(:data:`FEATURE_SCHEMA_VERSION` changes whenever they do). Every feature comes from the
plan the real planner made, never from the raw config alone, so the model sees what the
kernels do: programs, rows and padded rows, KV tokens and padded tokens, bytes and flops
per tile class, the merge's work, launches, and the simulator's time split
(:mod:`fasttree.costmodel.simulator`, run with fixed default constants).
"""

from __future__ import annotations

import numpy as np

from .gpu import GpuSpec
from .simulator import SimParams, SimResult, regs_per_thread, simulate
from .work import PlanWork, plan_work

__all__ = [
    "FEATURE_NAMES",
    "FEATURE_SCHEMA_VERSION",
    "SIM_TOTAL",
    "features_of_plan",
    "features_of_work",
    "published_cost",
]

#: Version of :data:`FEATURE_NAMES` and their meaning; a saved model records it.
FEATURE_SCHEMA_VERSION = 1

_CLASS_FIELDS = (
    "programs",
    "block_m",
    "block_n",
    "num_warps",
    "num_stages",
    "masked",
    "rows",
    "padded_rows",
    "kv_tokens",
    "padded_kv_tokens",
    "iterations",
    "max_iterations",
    "bytes",
    "flops",
    "useful_flops",
    "direct_rows",
    "partial_rows",
)
_TILE_MODES = ("two_classes", "all_large", "all_small")

#: Column names, in order.
FEATURE_NAMES: tuple[str, ...] = (
    "gpu_sm_count",
    "gpu_hbm_tbps",
    "gpu_tensor_tflops",
    "num_q_heads",
    "num_kv_heads",
    "gqa",
    "head_dim",
    "n_queries",
    "unique_kv_tokens",
    *(f"c{c}_{name}" for c in (0, 1) for name in _CLASS_FIELDS),
    "c0_regs_per_thread",
    "c1_regs_per_thread",
    "c0_occupancy",
    "c1_occupancy",
    "c0_waves",
    "c1_waves",
    "merge_programs",
    "merge_queries",
    "merge_partials",
    "merge_max_partials",
    "merge_bytes",
    "launches",
    *(f"tile_mode_{m}" for m in _TILE_MODES),
    "total_bytes",
    "total_flops",
    "min_bytes",
    "roofline_us",
    "sim_c0_us",
    "sim_c1_us",
    "sim_merge_us",
    "sim_launch_us",
    "sim_mem_us",
    "sim_tensor_us",
    "sim_latency_us",
    "sim_total_us",
)
#: Column of the simulator's total time (the residual model's baseline).
SIM_TOTAL = FEATURE_NAMES.index("sim_total_us")


def features_of_work(work: PlanWork, tile_mode: str, gpu: GpuSpec, sim: SimResult | None = None) -> np.ndarray:
    """Feature row of a plan's work on ``gpu``.

    Parameters
    ----------
    work : PlanWork
    tile_mode : str
        The plan's ``tile_mode``.
    gpu : GpuSpec
    sim : SimResult, optional
        :func:`simulate` of ``work`` with default constants (computed when None).

    Returns
    -------
    ndarray, float64 [len(FEATURE_NAMES)]
    """
    if sim is None:
        sim = simulate(work, gpu, SimParams())
    c0, c1 = work.classes
    m = work.merge
    total_bytes = c0.bytes + c1.bytes + m.bytes
    total_flops = c0.flops + c1.flops
    roofline = max(work.min_bytes / gpu.hbm_bytes_per_s, (c0.useful_flops + c1.useful_flops) / gpu.tensor_flops)
    row = [
        gpu.sm_count,
        gpu.hbm_bytes_per_s / 1e12,
        gpu.tensor_flops / 1e12,
        work.num_q_heads,
        work.num_kv_heads,
        work.num_q_heads // work.num_kv_heads,
        work.head_dim,
        work.n_queries,
        work.unique_kv_tokens,
        *(float(getattr(c, name)) for c in (c0, c1) for name in _CLASS_FIELDS),
        *(regs_per_thread(c, work.head_dim) for c in (c0, c1)),
        *sim.occupancy,
        *sim.waves,
        m.programs,
        m.queries,
        m.partials,
        m.max_partials,
        m.bytes,
        work.launches,
        *(float(tile_mode == t) for t in _TILE_MODES),
        total_bytes,
        total_flops,
        work.min_bytes,
        roofline * 1e6,
        *sim.class_us,
        sim.merge_us,
        sim.launch_us,
        sim.mem_us,
        sim.tensor_us,
        sim.latency_us,
        sim.total_us,
    ]
    return np.asarray(row, dtype=np.float64)


def features_of_plan(plan, gpu: GpuSpec, *, elem_bytes: int = 2) -> np.ndarray:
    """Feature row of a :class:`fasttree.plan_arrays.Plan` on ``gpu`` (see :func:`features_of_work`)."""
    return features_of_work(plan_work(plan, elem_bytes=elem_bytes), plan.tile_mode, gpu)


def published_cost(plan) -> float:
    """The published planner's own cost of a plan, as a latency predictor (ranks only).

    Over the plan's context-query groups: the useful work ``nQ * g * nK`` plus the padding
    cost ``Cmm(nQ, nK)`` of :class:`fasttree.costs.PaddingCost` (the plan's alpha, beta,
    tile mode and tiles), plus ``gamma`` per partial result (one per group query). Its
    unit is arbitrary, so only rank metrics are meaningful.
    """
    from fasttree.costs import PaddingCost, mode_tiles

    cfg = plan.config
    g = plan.group_size
    q_tiles, kv_tiles = mode_tiles(plan.tile_mode, cfg.query_tiles(g), tuple(cfg.kv_tile))
    cost = PaddingCost(cfg.alpha, cfg.beta, cfg.gamma, g, tuple(q_tiles), tuple(kv_tiles))
    nq = plan.groups.n_queries.astype(np.int64)
    nk = plan.groups.kv_len.astype(np.int64)
    return float((nq * g * nk).sum() + cost.cmm(nq, nk).sum() + cfg.gamma * nq.sum())
