"""Analytic GPU simulator of one tree-attention call: the baseline the learned model must beat.

For each tile class (one launch of ``U_c x Hkv`` programs) and the merge pass:

1. **Occupancy.** Programs resident per SM, limited by warps (``max_warps_per_sm //
   num_warps``), shared memory (``num_stages`` K and V tiles plus the query tile) and
   the per-SM block limit.
2. **Program cost.** A program's SM time is the largest of its memory time (bytes over
   the SM's share of DRAM bandwidth, ``eff_bw * hbm / sm_count``; a program on a
   half-empty GPU may draw up to ``sm_bw_boost`` shares), its tensor time (padded
   flops over ``eff_flops * tensor_flops / sm_count``) and its latency
   (``c_prog_us / occupancy + c_iter_us * iterations``: resident programs overlap their
   prologues, but each program's chain of KV tiles -- index load, gathered K, QK^T,
   softmax, gathered V, PV -- runs at its own pace), times a register-spill slowdown when the
   accumulator and score tiles need more registers per thread than there are.
3. **Schedule.** Programs, longest first, are list-scheduled onto the SMs (each goes to
   the least loaded SM; past :data:`_EXACT_ROUNDS` rounds the rest is spread evenly):
   the class's time is the most loaded SM (waves and the tail of one long unit).
4. **Total.** Class times plus the merge's (one program per merged query and head block,
   fp32 partial traffic plus ``c_merge_us`` per program), plus ``c_launch_us`` per launch.

:func:`simulate_batch` runs the same arithmetic for many plans at once (the batched
feature path).

The constants in :class:`SimParams` are physical guesses. Reported on its own, the
simulator gets a two-parameter calibration on the training traces (a line in log-log
space, :class:`fasttree.costmodel.evaluate.SimulatorBaseline`); the learned model uses its
outputs as features.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from fasttree.validation import check_number

from .gpu import GpuSpec
from .work import ClassWork, MergeWork, PlanWork, WorkBatch

__all__ = [
    "SimBatch",
    "SimParams",
    "SimResult",
    "makespan",
    "occupancy",
    "regs_per_thread",
    "simulate",
    "simulate_batch",
    "spill_factor",
]

#: Rounds of exact list scheduling (``sm_count`` programs each) before the rest is spread evenly.
_EXACT_ROUNDS = 64


@dataclass(frozen=True)
class SimParams:
    """Constants of the simulator (times in microseconds).

    Attributes
    ----------
    eff_bw : float
        Achievable fraction of the DRAM bandwidth.
    eff_flops : float
        Achievable fraction of the tensor-core rate.
    sm_bw_boost : float
        How many SM shares of bandwidth one program may draw when few programs run.
    c_prog_us : float
        Fixed latency of one program (prologue, query load, epilogue).
    c_iter_us : float
        Latency of one inner-loop KV tile (index load, gathered K/V loads, two MMAs),
        not hidden by other resident programs (0.7 us: the best training-set MAPE and
        top-1 score of 0.3, 0.5, 0.7 and 1.0 on the H200 traces).
    c_merge_us : float
        Latency of one merge program.
    c_launch_us : float
        Cost of one kernel launch inside a CUDA graph.
    spill_regs : float
        fp32 words per thread (accumulator ``block_m x D`` plus scores ``block_m x
        block_n`` over the program's threads) above which the compiler spills.
    spill_per_word : float
        Slowdown per spilled word: a program's cost is multiplied by
        ``1 + spill_per_word * (words - spill_regs)`` (the H200 traces: 256-384 words
        run about 10x slower than the simulator without it, 512 and more 20-40x).
    spill_cap : float
        Largest spill slowdown.
    """

    eff_bw: float = 0.8
    eff_flops: float = 0.5
    sm_bw_boost: float = 4.0
    c_prog_us: float = 1.5
    c_iter_us: float = 0.7
    c_merge_us: float = 1.0
    c_launch_us: float = 2.0
    spill_regs: float = 224.0
    spill_per_word: float = 0.1
    spill_cap: float = 50.0

    def to_dict(self) -> dict[str, float]:
        """JSON-ready fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> SimParams:
        """Inverse of :meth:`to_dict`; unknown keys or non-positive values are a ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"simulator parameters must be a dict, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown simulator parameters {sorted(unknown)}")
        checked = {
            k: check_number(f"simulator parameter {k}", v, above=0, expected="a positive finite number")
            for k, v in d.items()
        }
        return cls(**checked)


@dataclass(frozen=True)
class SimResult:
    """Simulated time of one call (microseconds) and how it splits.

    Attributes
    ----------
    total_us : float
    class_us : tuple of float
        Time of each tile class's launch (0 when empty).
    merge_us : float
    launch_us : float
    occupancy : tuple of int
        Resident programs per SM of each class.
    waves : tuple of float
        Programs per (SM x occupancy) of each class.
    mem_us, tensor_us, latency_us : float
        Sums over the launches of the GPU-wide memory, tensor and latency bounds (the
        three parts of the programs' cost, spread over all SMs).
    """

    total_us: float
    class_us: tuple[float, float]
    merge_us: float
    launch_us: float
    occupancy: tuple[int, int]
    waves: tuple[float, float]
    mem_us: float
    tensor_us: float
    latency_us: float


def occupancy(work: ClassWork, gpu: GpuSpec, head_dim: int, elem_bytes: int) -> int:
    """Programs of a tile class resident per SM (at least 1)."""
    by_warps = gpu.max_warps_per_sm // max(1, work.num_warps)
    smem = (max(1, work.num_stages) * work.block_n * 2 + work.block_m) * head_dim * elem_bytes
    by_smem = gpu.smem_per_sm // max(1, smem)
    return int(max(1, min(by_warps, by_smem, gpu.max_programs_per_sm)))


def regs_per_thread(work: ClassWork, head_dim: int) -> float:
    """fp32 words each thread of a program holds: the output accumulator and the score tile."""
    return (work.block_m * head_dim + work.block_m * work.block_n) / (32.0 * max(1, work.num_warps))


def spill_factor(work: ClassWork, head_dim: int, p: SimParams) -> float:
    """Slowdown of a class's programs from register spilling (1 when none)."""
    over = regs_per_thread(work, head_dim) - p.spill_regs
    return float(min(p.spill_cap, 1.0 + p.spill_per_word * max(0.0, over)))


def makespan(costs: np.ndarray, machines: int) -> float:
    """Most loaded of ``machines`` after list-scheduling ``costs`` (any order; longest first is used)."""
    if costs.size == 0:
        return 0.0
    c = np.sort(costs)[::-1]
    if c.size <= machines:
        return float(c[0])
    loads = np.zeros(machines)
    rounds = min(-(-c.size // machines), _EXACT_ROUNDS)
    for r in range(rounds):
        chunk = c[r * machines : (r + 1) * machines]
        loads = np.sort(loads)
        loads[: chunk.size] += chunk  # the longest of the round to the least loaded SM
    rest = c[rounds * machines :]
    if rest.size:
        loads = np.sort(loads)
        total = loads.sum() + rest.sum()
        return float(max(loads[-1], total / machines))
    return float(loads.max())


def _class_time(work: ClassWork, gpu: GpuSpec, p: SimParams, head_dim: int, elem: int, hkv: int):
    if work.programs == 0:
        return 0.0, 1, 0.0, 0.0, 0.0, 0.0
    occ = occupancy(work, gpu, head_dim, elem)
    sms = gpu.sm_count
    bw_share = p.eff_bw * gpu.hbm_bytes_per_s / sms  # bytes/s of one SM when all stream
    fl_share = p.eff_flops * gpu.tensor_flops / sms
    active = min(work.programs, sms)
    boost = min(p.sm_bw_boost, sms / active)
    iters = np.repeat(work.prog_iterations.astype(np.float64), hkv)
    # spread the class's bytes and flops over its programs in proportion to their tiles
    share = iters / max(iters.sum(), 1.0)
    mem = work.bytes * share / (bw_share * boost) * 1e6
    tensor = work.flops * share / fl_share * 1e6
    latency = p.c_prog_us / occ + p.c_iter_us * iters  # the tile loop's chain is not hidden
    cost = np.maximum(np.maximum(mem, tensor), latency) * spill_factor(work, head_dim, p)
    t = makespan(cost, sms)
    return t, occ, work.programs / (sms * occ), mem.sum() / sms, tensor.sum() / sms, latency.sum() / sms


def _merge_time(m: MergeWork, gpu: GpuSpec, p: SimParams) -> float:
    if m.programs == 0:
        return 0.0
    bw = p.eff_bw * gpu.hbm_bytes_per_s
    per_prog_latency = p.c_merge_us * (1.0 + m.partials / max(m.queries, 1) / 8.0)
    occ = 16  # 4-warp programs with no shared memory to speak of
    latency = m.programs * per_prog_latency / (gpu.sm_count * occ)
    return float(max(m.bytes / bw * 1e6, latency, p.c_merge_us))


def simulate(work: PlanWork, gpu: GpuSpec, params: SimParams | None = None) -> SimResult:
    """Simulated GPU time of one call of the plan whose work is ``work``.

    Parameters
    ----------
    work : PlanWork
        :func:`fasttree.costmodel.work.plan_work` of the plan.
    gpu : GpuSpec
    params : SimParams, optional
        Defaults: :class:`SimParams` ``()``.

    Returns
    -------
    SimResult
    """
    p = SimParams() if params is None else params
    parts = [_class_time(c, gpu, p, work.head_dim, work.elem_bytes, work.num_kv_heads) for c in work.classes]
    merge_us = _merge_time(work.merge, gpu, p)
    launch_us = p.c_launch_us * work.launches
    class_us = (parts[0][0], parts[1][0])
    return SimResult(
        total_us=float(sum(class_us) + merge_us + launch_us),
        class_us=class_us,
        merge_us=merge_us,
        launch_us=launch_us,
        occupancy=(parts[0][1], parts[1][1]),
        waves=(parts[0][2], parts[1][2]),
        mem_us=float(parts[0][3] + parts[1][3]),
        tensor_us=float(parts[0][4] + parts[1][4]),
        latency_us=float(parts[0][5] + parts[1][5]),
    )


@dataclass(frozen=True)
class SimBatch:
    """:class:`SimResult` of many plans, field by field (one row per plan, ``[n, 2]`` per tile class)."""

    total_us: np.ndarray
    class_us: np.ndarray
    merge_us: np.ndarray
    launch_us: np.ndarray
    occupancy: np.ndarray
    waves: np.ndarray
    mem_us: np.ndarray
    tensor_us: np.ndarray
    latency_us: np.ndarray


def _makespans(cost: np.ndarray, seg: np.ndarray, lo: np.ndarray, programs: np.ndarray, hkv: np.ndarray, sms: int):
    """:func:`makespan` of many classes at once.

    Class ``k`` runs ``programs[k]`` programs: each of its units ``lo[k]:lo[k + 1]`` of
    ``cost`` (unit costs, ``seg`` the class of each unit) ``hkv[k]`` times. The rounds of
    list scheduling run for all classes together (zero-cost padding where a class has
    fewer programs left than SMs, which leaves its loads unchanged).
    """
    out = np.zeros(programs.size)
    busy = programs > 0
    if not np.count_nonzero(busy):
        return out
    # longest first within every class (units are usually sorted already)
    if np.count_nonzero((cost[1:] > cost[:-1]) & (seg[1:] == seg[:-1])):
        cost = cost[np.lexsort((-cost, seg))]
    out[busy] = np.maximum.reduceat(cost, lo[:-1][busy])  # one program per SM at most: the longest
    many = (programs > sms).nonzero()[0]
    if many.size == 0:
        return out
    p_many = programs[many]
    rounds = np.minimum(-(-p_many // sms), _EXACT_ROUNDS)
    by_rounds = np.argsort(-rounds, kind="stable")
    many, p_many, rounds = many[by_rounds], p_many[by_rounds], rounds[by_rounds]
    h = hkv[many][:, None]
    first = lo[many][:, None]
    loads = np.zeros((many.size, sms))
    lane = np.arange(sms)
    for r in range(int(rounds[0])):
        a = int(np.count_nonzero(rounds > r))
        k = r * sms + lane[None, :]  # programs of this round
        valid = k < p_many[:a, None]
        chunk = np.where(valid, cost[np.where(valid, first[:a] + k // h[:a], 0)], 0.0)
        loads[:a] = np.sort(loads[:a], axis=1)
        loads[:a] += chunk  # the longest of the round to the least loaded SM
    loads.sort(axis=1)
    done = rounds * sms
    rest = p_many > done
    span = loads[:, -1].copy()
    for j in rest.nonzero()[0].tolist():
        # programs past the exact rounds are spread evenly (summed as makespan() sums them)
        k = many[j]
        c = np.repeat(cost[lo[k] : lo[k + 1]], hkv[k])
        total = loads[j].sum() + c[done[j] :].sum()
        span[j] = max(span[j], total / sms)
    out[many] = span
    return out


def simulate_batch(work: WorkBatch, gpu: GpuSpec, params: SimParams | None = None) -> SimBatch:
    """:func:`simulate` of many plans at once: the same numbers (same operations, in the same order), as arrays.

    Parameters
    ----------
    work : WorkBatch
        :func:`fasttree.costmodel.work.plan_work_batch` of the plans.
    gpu : GpuSpec
    params : SimParams, optional
        Defaults: :class:`SimParams` ``()``.

    Returns
    -------
    SimBatch
    """
    p = SimParams() if params is None else params
    n = len(work)
    c = work.classes
    sms = gpu.sm_count
    programs = c["programs"].ravel()
    busy = programs > 0
    hkv = np.repeat(work.num_kv_heads, 2)
    d = np.repeat(work.head_dim, 2)
    eb = np.repeat(work.elem_bytes, 2)
    bm, bn = c["block_m"].ravel(), c["block_n"].ravel()
    warps = np.maximum(1, c["num_warps"].ravel())
    # occupancy() and spill_factor() per class
    smem = (np.maximum(1, c["num_stages"].ravel()) * bn * 2 + bm) * d * eb
    occ = np.maximum(1, np.minimum(np.minimum(gpu.max_warps_per_sm // warps, gpu.smem_per_sm // np.maximum(1, smem)),
                                   gpu.max_programs_per_sm))  # fmt: skip
    occ = np.where(busy, occ, 1)
    regs = (bm * d + bm * bn) / (32.0 * warps)
    spill = np.minimum(p.spill_cap, 1.0 + p.spill_per_word * np.maximum(0.0, regs - p.spill_regs))
    # per-unit program costs, as _class_time computes them per program
    bw_share = p.eff_bw * gpu.hbm_bytes_per_s / sms
    fl_share = p.eff_flops * gpu.tensor_flops / sms
    boost = np.minimum(p.sm_bw_boost, sms / np.maximum(1, np.minimum(programs, sms)))
    lo = work.unit_ptr
    seg = np.repeat(np.arange(2 * n), np.diff(lo))
    it = work.unit_iterations.astype(np.float64)
    share = it / np.maximum(c["iterations"].ravel().astype(np.float64), 1.0)[seg]
    mem = c["bytes"].ravel()[seg] * share / (bw_share * boost[seg]) * 1e6
    tensor = c["flops"].ravel()[seg] * share / fl_share * 1e6
    latency = p.c_prog_us / occ[seg] + p.c_iter_us * it
    cost = np.maximum(np.maximum(mem, tensor), latency) * spill[seg]
    class_us = _makespans(cost, seg, lo, programs, hkv, sms)

    # GPU-wide memory, tensor and latency bounds: sums over every class's programs, added
    # as _class_time adds them (numpy's pairwise sum over the programs), then over classes
    parts = np.zeros((3, 2 * n))
    terms = np.stack([mem, tensor, latency])
    for k in busy.nonzero()[0].tolist():
        units = terms[:, lo[k] : lo[k + 1]]
        parts[:, k] = (units if hkv[k] == 1 else np.repeat(units, hkv[k], axis=1)).sum(axis=1)
    parts = (parts / sms).reshape(3, n, 2)
    parts = parts[:, :, 0] + parts[:, :, 1]

    # the merge pass
    m_busy = work.merge_programs > 0
    per_prog = p.c_merge_us * (1.0 + work.merge_partials / np.maximum(work.merge_queries, 1) / 8.0)
    m_latency = work.merge_programs * per_prog / (sms * 16)
    merge_us = np.maximum(np.maximum(work.merge_bytes / (p.eff_bw * gpu.hbm_bytes_per_s) * 1e6, m_latency),
                          p.c_merge_us)  # fmt: skip
    merge_us = np.where(m_busy, merge_us, 0.0)
    launch_us = p.c_launch_us * work.launches
    class_us = class_us.reshape(n, 2)
    return SimBatch(
        total_us=class_us[:, 0] + class_us[:, 1] + merge_us + launch_us,
        class_us=class_us,
        merge_us=merge_us,
        launch_us=launch_us,
        occupancy=occ.reshape(n, 2),
        waves=(programs / (sms * occ)).reshape(n, 2),
        mem_us=parts[0],
        tensor_us=parts[1],
        latency_us=parts[2],
    )
