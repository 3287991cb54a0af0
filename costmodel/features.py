"""Features of a plan for the learned latency model: work counts, GPU facts and the simulator's answer.

One row per (plan, GPU), columns :data:`FEATURE_NAMES` in that order
(:data:`FEATURE_SCHEMA_VERSION` changes whenever they do). Every feature comes from the
plan the real planner made, never from the raw config alone, so the model sees what the
kernels do: programs, rows and padded rows, KV tokens and padded tokens, bytes and flops
per tile class, the merge's work, launches, and the simulator's time split
(:mod:`fasttree.costmodel.simulator`, run with fixed default constants).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fasttree.versions import KERNEL_VERSION

from .gpu import GpuSpec
from .resources import COMPILED_FIELDS, compiled_features
from .simulator import SimParams, SimResult, regs_per_thread, simulate, simulate_batch
from .work import CLASS_FIELDS, PlanWork, plan_work, plan_work_batch

__all__ = [
    "FEATURE_NAMES",
    "FEATURE_SCHEMA_VERSION",
    "KERNEL_VERSION_COLUMN",
    "RUNTIME_COLUMN",
    "SIM_TOTAL",
    "STAGE1_OVERLAP",
    "features_of_plan",
    "features_of_plans",
    "features_of_work",
    "mark_runtime",
    "published_cost",
]

#: Version of :data:`FEATURE_NAMES` and their meaning; a saved model records it. 3: the register
#: and spill features come from kernels compiled with the JIT's launch-time specialisation
#: (``bench.kernel_resources``), no longer from unspecialised ones. 4: ``stage1_overlap``. 5:
#: ``kernel_version``. 6: ``runtime_launch`` (:func:`mark_runtime`).
FEATURE_SCHEMA_VERSION = 6

_CLASS_FIELDS = CLASS_FIELDS
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
    *(f"c{c}_{name}" for c in (0, 1) for name in COMPILED_FIELDS),
    "stage1_overlap",
    "kernel_version",
    "runtime_launch",
)
#: Column of the simulator's total time (the residual model's baseline).
SIM_TOTAL = FEATURE_NAMES.index("sim_total_us")
#: Column that says the two tile classes' stage-1 launches run side by side: 1 when both have
#: programs, as ``fasttree.tree_attention`` runs them from kernel v17 on; the dataset sets it
#: to 0 for traces measured before (:func:`fasttree.costmodel.dataset.measured_with_overlap`).
STAGE1_OVERLAP = FEATURE_NAMES.index("stage1_overlap")
#: Column of the kernels' version (:data:`fasttree.versions.KERNEL_VERSION`, the row of
#: ``docs/history.md``'s version table): the running kernels' for a plan, the measured ones' for a
#: trace (:func:`fasttree.costmodel.dataset.measured_kernel_version`), so one model learns from traces
#: of every kernel version and predicts the current one.
KERNEL_VERSION_COLUMN = FEATURE_NAMES.index("kernel_version")
#: Column that says the plan runs as :class:`fasttree.runtime.TreeAttentionRuntime` launches it
#: (persistent kernels, one or two stage-1 launches and a merge launch every step): 1, or 0 for
#: ``fasttree.tree_attention``'s per-plan launches (:func:`mark_runtime`).
RUNTIME_COLUMN = FEATURE_NAMES.index("runtime_launch")
_LAUNCHES = FEATURE_NAMES.index("launches")


def mark_runtime(X: np.ndarray, stage1_launches) -> np.ndarray:
    """Mark feature rows (in place) as plans that the runtime launches; returns ``X``.

    The rows must be features of the runtime's view of its plans
    (:func:`fasttree.runtime_planning.plan_as_launched`). Sets :data:`RUNTIME_COLUMN` to 1, the
    launches to the runtime's (its stage-1 launches and the merge, whatever the plan holds), and
    ``stage1_overlap`` to 0 where two stage-1 launches run one after the other.

    Parameters
    ----------
    X : ndarray, float64 [n, len(FEATURE_NAMES)]
    stage1_launches : int or array-like of int [n]
        1 or 2 (resolved) per row.

    Raises
    ------
    ValueError
        On a stage-1 launch count other than 1 or 2.
    """
    launches = np.broadcast_to(np.asarray(stage1_launches), (X.shape[0],))
    if not np.all((launches == 1) | (launches == 2)):
        raise ValueError("stage1_launches must be 1 or 2 per row")
    X[:, RUNTIME_COLUMN] = 1.0
    X[:, _LAUNCHES] = launches + 1
    X[:, STAGE1_OVERLAP] = np.where(launches == 2, 0.0, X[:, STAGE1_OVERLAP])
    return X


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
        *_compiled(work, c0),
        *_compiled(work, c1),
        float(c0.programs > 0 and c1.programs > 0),
        float(KERNEL_VERSION),
        0.0,
    ]
    return np.asarray(row, dtype=np.float64)


def _compiled(work: PlanWork, c) -> tuple[float, ...]:
    return compiled_features(
        work.head_dim, c.block_m, c.block_n, c.masked, c.num_warps, c.num_stages,
        programs=c.programs, iterations=c.iterations,
    )  # fmt: skip


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


def features_of_plans(plans, gpu: GpuSpec, *, elem_bytes: int | Sequence[int] = 2) -> np.ndarray:
    """Feature rows of many plans at once: :func:`features_of_plan` of each, as one matrix.

    The work counts and the simulator run on the whole batch
    (:func:`~fasttree.costmodel.work.plan_work_batch`,
    :func:`~fasttree.costmodel.simulator.simulate_batch`), with the arithmetic of
    :func:`features_of_plan` operation for operation, so the rows are the same numbers
    (``tests/test_costmodel_predict.py`` checks it on held-out traces).

    Parameters
    ----------
    plans : sequence of Plan
        At least one.
    gpu : GpuSpec
    elem_bytes : int or sequence of int
        Bytes per Q/K/V element, for all plans or one per plan.

    Returns
    -------
    ndarray, float64 [len(plans), len(FEATURE_NAMES)]

    Raises
    ------
    ValueError
        On no plans or a wrong number of ``elem_bytes``.
    """
    work = plan_work_batch(plans, elem_bytes=elem_bytes)
    sim = simulate_batch(work, gpu, SimParams())
    n = len(work)
    c = work.classes
    X = np.empty((n, len(FEATURE_NAMES)))
    col = iter(range(len(FEATURE_NAMES)))

    def put(*values) -> None:
        for v in values:
            X[:, next(col)] = v

    put(gpu.sm_count, gpu.hbm_bytes_per_s / 1e12, gpu.tensor_flops / 1e12)
    put(work.num_q_heads, work.num_kv_heads, work.num_q_heads // work.num_kv_heads, work.head_dim)
    put(work.n_queries, work.unique_kv_tokens)
    put(*(c[name][:, k] for k in (0, 1) for name in _CLASS_FIELDS))
    regs = (c["block_m"] * work.head_dim[:, None] + c["block_m"] * c["block_n"]) / (
        32.0 * np.maximum(1, c["num_warps"])
    )
    put(regs[:, 0], regs[:, 1], sim.occupancy[:, 0], sim.occupancy[:, 1], sim.waves[:, 0], sim.waves[:, 1])
    put(work.merge_programs, work.merge_queries, work.merge_partials, work.merge_max_partials, work.merge_bytes)
    put(work.launches)
    mode = np.array(work.tile_mode)
    put(*((mode == t).astype(np.float64) for t in _TILE_MODES))
    min_bytes = work.min_bytes
    useful = c["useful_flops"][:, 0] + c["useful_flops"][:, 1]
    roofline = np.maximum(min_bytes / gpu.hbm_bytes_per_s, useful / gpu.tensor_flops)
    put(c["bytes"][:, 0] + c["bytes"][:, 1] + work.merge_bytes, c["flops"][:, 0] + c["flops"][:, 1], min_bytes)
    put(roofline * 1e6, sim.class_us[:, 0], sim.class_us[:, 1], sim.merge_us, sim.launch_us)
    put(sim.mem_us, sim.tensor_us, sim.latency_us, sim.total_us)
    compiled = np.array(
        [
            [
                compiled_features(
                    work.head_dim[i], c["block_m"][i, k], c["block_n"][i, k], c["masked"][i, k],
                    c["num_warps"][i, k], c["num_stages"][i, k], programs=c["programs"][i, k],
                    iterations=c["iterations"][i, k],
                )
                for k in (0, 1)
            ]
            for i in range(n)
        ]
    ).reshape(n, 2 * len(COMPILED_FIELDS))  # fmt: skip
    put(*compiled.T)
    put(((c["programs"][:, 0] > 0) & (c["programs"][:, 1] > 0)).astype(np.float64))
    put(float(KERNEL_VERSION))
    put(0.0)
    if next(col, None) is not None:
        raise AssertionError("internal error: features_of_plans filled fewer columns than FEATURE_NAMES")
    return X
