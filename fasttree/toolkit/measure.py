"""Measure one design point on the GPU and turn the outcome into a trace record.

:func:`measure_point` builds the point's tree, plans it, checks the output against the
float64 reference (optionally), times the kernels by CUDA-graph replay and eagerly, and
returns a measurement record (:func:`fasttree.traces.measurement_record`). Any failure
(planning, compilation, out of memory, a wrong result) becomes a ``status: "failed"``
record (:func:`failed_record`); one that leaves the GPU unusable raises
:class:`DeviceLostError` carrying that record. torch is imported inside the functions.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..traces import measurement_record
from ..tree import KVTree
from .design import DesignPoint, point_identity, point_launch, point_tree
from .environment import collect_env

__all__ = [
    "CHECK_QUERIES",
    "TOLERANCE",
    "DeviceLostError",
    "error_text",
    "failed_record",
    "measure_point",
    "point_plan",
    "runtime_for",
]

#: Largest per-query relative error accepted against the float64 reference.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
#: Timing of one point: calls per CUDA graph (fewer when they would pass GRAPH_MAX_MS),
#: replays and replay budget; the eager ``do_bench`` warm-up and repetition (ms).
GRAPH_CALLS, GRAPH_REPLAYS, GRAPH_BUDGET_S, GRAPH_MAX_MS = 10, 20, 0.1, 2.0
EAGER_WARMUP_MS, EAGER_REP_MS = 2.0, 10.0
#: Queries checked against the reference (a sample when the tree has more).
CHECK_QUERIES = 16


class DeviceLostError(RuntimeError):
    """The GPU is unusable after a failure (a sticky CUDA error): the process cannot measure on.

    Attributes
    ----------
    record : dict
        The failed record of the point that broke the device (the driver writes it).
    """

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def error_text(exc: BaseException) -> str:
    """``"{type}: {message}"`` of an exception on one line, at most 2,000 characters (a record's ``error``)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    text = " ".join(text.split())  # one line
    return text[:2000]


def failed_record(
    point: DesignPoint,
    env: dict[str, Any],
    error: str,
    *,
    tree: KVTree | None = None,
    plan: Any = None,
    correct: bool | None = None,
    max_rel_err: float | None = None,
) -> dict[str, Any]:
    """A ``status: "failed"`` measurement record of ``point``.

    Parameters
    ----------
    point : DesignPoint
    env : dict
        :func:`fasttree.toolkit.environment.collect_env` output.
    error : str
        What went wrong (exception type and message), non-empty.
    tree : KVTree, optional
        The point's tree when already built.
    plan : Plan or dict, optional
        The plan when planning succeeded.
    correct, max_rel_err
        The correctness check's outcome when a wrong result is the failure.
    """
    if not error:
        raise ValueError("a failed record needs a non-empty error")
    return measurement_record(
        env=env,
        tree=point_tree(point) if tree is None else tree,
        **point_identity(point),
        params=dict(point.params) or None,
        plan=plan,
        status="failed",
        error=error,
        correct=correct,
        max_rel_err=max_rel_err,
    )


def _synchronize(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _device_healthy(device: Any) -> bool:
    import torch

    try:
        _synchronize(device)
        return float(torch.ones(1, device=device).add_(1).item()) == 2.0
    except Exception:
        return False


def _inputs(point: DesignPoint, tree: KVTree, device: Any):
    import torch

    dtype = getattr(torch, point.dtype)
    gen = torch.Generator(device=device).manual_seed(point.seed)
    pool = tree.max_slot + 1
    q = torch.randn(tree.n_queries, point.num_q_heads, point.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(pool, point.num_kv_heads, point.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(pool, point.num_kv_heads, point.head_dim, device=device, dtype=dtype, generator=gen)
    return q, k, v


def point_plan(point: DesignPoint, tree: KVTree):
    """The plan the point's launches run: ``fasttree.plan``'s, or the runtime's own for a runtime point
    (with launch variants it plans with ``tree_attention``'s rules, as the runtime then does)."""
    heads = {"num_q_heads": point.num_q_heads, "num_kv_heads": point.num_kv_heads, "head_dim": point.head_dim}
    if point.runtime:
        from ..plan_rules import PlanRules
        from ..runtime_planning import plan_for_runtime

        launch = point_launch(point)
        stage1, centric = launch["stage1_launches"], launch["query_centric"]
        rules = PlanRules.runtime(stage1, variants=point.variants)
        return plan_for_runtime(
            tree, point.config, **heads, stage1_launches=stage1, query_centric=centric, rules=rules
        )[0]
    import fasttree as ft

    return ft.plan(tree, point.config, **heads)


def runtime_for(point: DesignPoint, tree: KVTree, plan, device: Any):
    """A :class:`fasttree.runtime.TreeAttentionRuntime` for the point, its capacities those of
    ``plan`` (the runtime's own plan of ``tree``), with ``tree`` planned and uploaded: with its
    launch variants (as servers run it) for a point with ``variants``, else its fixed persistent
    launch (``max_variants=0``)."""
    import torch

    from ..runtime import TreeAttentionRuntime

    launch = point_launch(point)
    rt = TreeAttentionRuntime(
        point.config, num_q_heads=point.num_q_heads, num_kv_heads=point.num_kv_heads, head_dim=point.head_dim,
        dtype=getattr(torch, point.dtype), device=device, max_queries=tree.n_queries,
        max_kv_entries=max(1, int(plan.kv_indices.size)), max_units=max(tree.n_queries, plan.n_units),
        max_partial_rows=max(1, int(plan.n_partial_rows)), max_pairs=max(tree.n_queries, int(plan.pair_query.size)),
        pool_slots=tree.max_slot + 1, query_centric=launch["query_centric"],
        stage1_launches=launch["stage1_launches"], extend_steps=0,
        **({} if point.variants else {"max_variants": 0}),
    )  # fmt: skip
    rt.plan(tree)
    return rt


class _Launch:
    """One point's device inputs and the call that runs its kernels on them.

    :meth:`prepare` allocates; :meth:`release` drops every device buffer (and the plan), so
    that a failure can free the GPU's memory before asking whether the device is healthy.
    """

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.q = self.k = self.v = self.out = self.runtime = None

    def prepare(self, point: DesignPoint, tree: KVTree, device: Any) -> None:
        """Draw N(0, 1) ``q``/``k``/``v`` in the point's dtype; size a runtime for a runtime point."""
        import torch

        self.q, self.k, self.v = _inputs(point, tree, device)
        self.out = torch.empty_like(self.q)
        if point.runtime:
            self.runtime = runtime_for(point, tree, self.plan, device)

    def __call__(self):
        if self.runtime is not None:
            return self.runtime.forward(self.q, self.k, self.v, out=self.out)
        import fasttree as ft

        return ft.tree_attention(self.q, self.k, self.v, self.plan, out=self.out)

    def release(self) -> None:
        self.q = self.k = self.v = self.out = self.runtime = self.plan = None


def _check_output(point: DesignPoint, tree: KVTree, launch: _Launch, device: Any) -> tuple[bool, float | None]:
    """Run the kernels once on NaN-filled output and compare up to :data:`CHECK_QUERIES` sampled
    queries with the float64 reference: ``(correct, worst relative error)``, the error None when
    the output is not finite."""
    import torch

    import fasttree as ft

    launch.out.fill_(float("nan"))
    launch()
    _synchronize(device)
    rng = np.random.default_rng(point.seed)
    rows = np.sort(rng.choice(tree.n_queries, min(tree.n_queries, CHECK_QUERIES), replace=False))
    ref = ft.reference_attention(launch.q, launch.k, launch.v, tree, queries=rows)
    out = launch.out
    if not bool(torch.isfinite(out).all()):
        return False, None
    err = ft.max_relative_error(out[torch.as_tensor(rows, device=out.device)], ref)
    return err <= TOLERANCE[point.dtype], err


def _timing(launch: _Launch, graph_budget_s: float, eager_rep_ms: float) -> dict[str, Any]:
    """The record's ``timing``: CUDA-graph replay and an eager repetition of the call."""
    from .timing import eager_time_us, graph_time_us

    graph = graph_time_us(
        launch, calls=GRAPH_CALLS, replays=GRAPH_REPLAYS, budget_s=graph_budget_s, max_graph_ms=GRAPH_MAX_MS
    )
    eager = eager_time_us(launch, warmup_ms=EAGER_WARMUP_MS, rep_ms=eager_rep_ms)
    return {"graph_us": graph, "eager_us": {"median": eager}}


def _profiler_meta(launch: _Launch, wall_s: float) -> dict[str, Any]:
    """``meta.profiler`` of an ok record: the wall time, whether the two stage-1 launches of a
    two-class plan ran side by side (the latency model's ``stage1_overlap``; always so for
    ``tree_attention``'s launches), which kernels ran (its ``kernel_version``), and a runtime's
    persistent stage-1 programs per launch."""
    from ..versions import KERNEL_VERSION

    rt = launch.runtime
    info: dict[str, Any] = {
        "wall_s": round(wall_s, 4),
        "stage1_overlap": True if rt is None else rt.stage1_launches == 1,
        "kernel_version": KERNEL_VERSION,
    }
    if rt is not None:  # as sized from the compiled kernels
        info["runtime_programs"] = list(rt.stage1_programs)
    return info


def _failure(
    point: DesignPoint,
    env: dict[str, Any],
    tree: KVTree,
    summary: dict[str, Any],
    exc: Exception,
    launch: _Launch,
    device: Any,
    *,
    correct: bool | None,
    err: float | None,
) -> dict[str, Any]:
    """The failed record of an exception after planning; frees the point's device memory first and
    raises :class:`DeviceLostError` when the device is unusable."""
    import torch

    record = failed_record(point, env, error_text(exc), tree=tree, plan=summary, correct=correct, max_rel_err=err)
    launch.release()
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    if not _device_healthy(device):
        raise DeviceLostError(f"the GPU is unusable after point {point.index}: {record['error']}", record) from exc
    return record


def measure_point(
    point: DesignPoint,
    *,
    device: Any = "cuda",
    check: bool = True,
    env: dict[str, Any] | None = None,
    graph_budget_s: float = GRAPH_BUDGET_S,
    eager_rep_ms: float = EAGER_REP_MS,
    tree: KVTree | None = None,
) -> dict[str, Any]:
    """Measure one design point on the GPU and return its trace record.

    Builds the tree (:func:`~fasttree.toolkit.design.point_tree`), draws N(0, 1)
    ``q``/``k``/``v`` in the point's dtype, plans it with the point's config, times
    ``tree_attention`` (or, for a runtime point,
    :meth:`fasttree.runtime.TreeAttentionRuntime.forward` of a runtime sized to the plan) by
    CUDA-graph replay (:func:`fasttree.toolkit.timing.graph_time_us`) and eagerly
    (:func:`fasttree.toolkit.timing.eager_time_us`, a short repetition), and stores
    :func:`fasttree.traces.plan_summary` of the plan. With ``check``, first compares the
    output of up to :data:`CHECK_QUERIES` sampled queries with
    :func:`fasttree.reference_attention` (worst per-query relative error against
    :data:`TOLERANCE`).

    Every failure is returned as a ``status: "failed"`` record naming the exception:
    planning errors, kernel compilation or launch errors, out of memory, non-finite or
    wrong output (then ``correct`` is false and no timing is taken).

    Parameters
    ----------
    point : DesignPoint
    device : str or torch.device
        A CUDA device.
    check : bool
        Check the output against the float64 reference.
    env : dict, optional
        :func:`~fasttree.toolkit.environment.collect_env` output (collected when None); its
        ``gpu_name`` enters the key.
    graph_budget_s : float
        Replay budget of the graph timing.
    eager_rep_ms : float
        Repetition time of the eager timing.
    tree : KVTree, optional
        The tree to measure instead of the point's sampled one (e.g. a workload step's,
        with the point's ``family`` and ``seed`` naming where it came from).

    Returns
    -------
    dict
        A measurement record (not yet validated; :class:`~fasttree.traces.TraceWriter` does that).

    Raises
    ------
    DeviceLostError
        When a failure left the GPU unusable (a sticky CUDA error); its ``record`` is
        the point's failed record.
    """
    from ..traces import plan_summary

    env = collect_env(device) if env is None else env
    t0 = time.perf_counter()
    tree = point_tree(point) if tree is None else tree
    try:
        launch = _Launch(point_plan(point, tree))
    except Exception as exc:
        return failed_record(point, env, "PlanError: " + error_text(exc), tree=tree)
    summary = plan_summary(launch.plan)
    correct: bool | None = None
    err: float | None = None
    try:
        launch.prepare(point, tree, device)
        if check:
            correct, err = _check_output(point, tree, launch, device)
            if not correct:
                tol = TOLERANCE[point.dtype]
                what = "non-finite output" if err is None else f"max relative error {err:.3g} > {tol}"
                return failed_record(
                    point, env, f"WrongResult: {what}", tree=tree, plan=summary, correct=False, max_rel_err=err
                )
        timing = _timing(launch, graph_budget_s, eager_rep_ms)
        record = measurement_record(
            env=env,
            tree=tree,
            **point_identity(point),
            params=dict(point.params) or None,
            plan=summary,
            status="ok",
            timing=timing,
            correct=correct,
            max_rel_err=err,
        )
        record["meta"] = {"profiler": _profiler_meta(launch, time.perf_counter() - t0)}
        return record
    except Exception as exc:
        return _failure(point, env, tree, summary, exc, launch, device, correct=correct, err=err)
