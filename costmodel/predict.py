"""Batched latency prediction: plans (or planning jobs) in, predicted GPU times out.

The latency model's input is one feature row per plan
(:mod:`fasttree.costmodel.features`). Building rows one plan at a time pays numpy's
per-call overhead many times per plan; this module builds them for a whole batch
(:func:`~fasttree.costmodel.features.features_of_plans`) and predicts them with one
call of the model. With planning included (:func:`predict_jobs`), the planner
dominates (0.6-0.8 ms per plan of a 150-node workload tree on one core,
``docs/results/costmodel_throughput_cpu.md``), so jobs can also be spread over worker
processes (:class:`PredictPool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

import numpy as np

from fasttree.config import FastTreeConfig
from fasttree.plan_arrays import Plan
from fasttree.planner import plan
from fasttree.planner import prepare as prepare_tree
from fasttree.runtime_planning import plan_as_launched, resolve_stage1_launches
from fasttree.tree import KVTree
from fasttree.validation import check_int

from .features import FEATURE_NAMES, features_of_plans, mark_runtime
from .gpu import GpuSpec

__all__ = [
    "ELEM_BYTES",
    "PlanJob",
    "PredictPool",
    "elem_bytes_of",
    "features_of_jobs",
    "plan_job",
    "predict_jobs",
    "predict_plans",
]

#: Bytes per Q/K/V element of each trace ``dtype``.
ELEM_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2}


class PlanJob(NamedTuple):
    """One call to plan and predict: a tree, a config and the attention's shape.

    Attributes
    ----------
    tree : KVTree
    config : FastTreeConfig
    num_q_heads, num_kv_heads, head_dim : int
    dtype : str
        A key of :data:`ELEM_BYTES`.
    runtime : bool
        Predict the plan as :class:`fasttree.runtime.TreeAttentionRuntime` plans and launches it
        (``stage1_launches`` and ``query_centric`` ``"auto"``), not as ``fasttree.plan`` and
        ``fasttree.tree_attention`` do.
    """

    tree: KVTree
    config: FastTreeConfig
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    runtime: bool = False


def elem_bytes_of(dtype: str) -> int:
    """Bytes per element of ``dtype`` (:data:`ELEM_BYTES`); ``ValueError`` for another."""
    try:
        return ELEM_BYTES[str(dtype)]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(ELEM_BYTES)}, got {dtype!r}") from None


def plan_job(job: PlanJob) -> Plan:
    """The :class:`fasttree.plan_arrays.Plan` of one job (``fasttree.plan``), or for a runtime job the
    runtime's plan with the tile classes it launches (:func:`fasttree.runtime_planning.plan_as_launched`)."""
    heads = {"num_q_heads": job.num_q_heads, "num_kv_heads": job.num_kv_heads, "head_dim": job.head_dim}
    return (plan_as_launched if job.runtime else plan)(job.tree, job.config, **heads)


def _check_gpu(gpu: GpuSpec, model_gpu: GpuSpec | None) -> None:
    if not isinstance(gpu, GpuSpec):
        raise ValueError(f"gpu must be a GpuSpec, got {type(gpu).__name__}")
    if model_gpu is not None and model_gpu.name != gpu.name:
        raise ValueError(f"the model was fitted for {model_gpu.name!r}, not {gpu.name!r}: refit it or pick its GPU")


def _check_jobs(jobs: Sequence[PlanJob]) -> list[PlanJob]:
    jobs = list(jobs)
    if not jobs:
        raise ValueError("no jobs given")
    for i, job in enumerate(jobs):
        if not isinstance(job, PlanJob):
            raise ValueError(f"jobs[{i}] must be a PlanJob, got {type(job).__name__}")
        if not isinstance(job.tree, KVTree) or not isinstance(job.config, FastTreeConfig):
            raise ValueError(f"jobs[{i}] needs a KVTree and a FastTreeConfig")
        elem_bytes_of(job.dtype)
    return jobs


def _features_chunk(jobs: list[PlanJob], gpu: GpuSpec) -> np.ndarray:
    plans = [plan_job(j) for j in jobs]
    X = features_of_plans(plans, gpu, elem_bytes=[elem_bytes_of(j.dtype) for j in jobs])
    runtime = np.array([bool(j.runtime) for j in jobs])
    if runtime.any():
        rows = np.flatnonzero(runtime)
        launches = [resolve_stage1_launches("auto", plans[i].group_size, plans[i].head_dim) for i in rows]
        X[runtime] = mark_runtime(X[runtime], launches)
    return X


#: Chunks of a :class:`PredictPool` batch per worker process.
_CHUNKS_PER_WORKER = 4

#: Trees of the :class:`PredictPool` a worker process serves (set by its initializer).
_WORKER_TREES: tuple[KVTree, ...] = ()


def _init_worker(trees: tuple[KVTree, ...]) -> None:
    global _WORKER_TREES
    _WORKER_TREES = trees


def _worker_chunk(jobs: list[tuple], gpu: GpuSpec) -> np.ndarray:
    # a job's tree is an index into the worker's trees, or a tree sent along
    return _features_chunk([PlanJob(_WORKER_TREES[j[0]] if isinstance(j[0], int) else j[0], *j[1:]) for j in jobs], gpu)


class PredictPool:
    """Worker processes that plan jobs and build their feature rows, for :func:`features_of_jobs`.

    Planning dominates prediction, and it runs one job per core at best: the pool
    spreads a batch over ``workers`` processes. The trees are handed to the workers once,
    when they start (a tree pickles to about 5 bytes per KV token, as much as it takes to
    plan it); jobs on those trees then travel as an index, a config and the heads. Jobs
    on other trees still work, the tree sent along with the job.

    Parameters
    ----------
    trees : sequence of KVTree
        The trees jobs will be planned on (recognised by identity).
    workers : int
        Processes (>= 1).
    mp_context : multiprocessing context, optional
        Passed to :class:`~concurrent.futures.ProcessPoolExecutor`.
    prepare : bool
        Build the planner's index of every tree (:func:`fasttree.planner.prepare`) before
        the workers start, so that none of them builds it again.

    Examples
    --------
    >>> with PredictPool(trees, workers=2) as pool:  # doctest: +SKIP
    ...     times = predict_jobs(model, jobs, gpu, pool=pool)
    """

    def __init__(self, trees: Sequence[KVTree], *, workers: int = 2, mp_context=None, prepare: bool = True) -> None:
        workers = check_int("workers", workers, minimum=1)
        trees = tuple(trees)
        for i, tree in enumerate(trees):
            if not isinstance(tree, KVTree):
                raise ValueError(f"trees[{i}] must be a KVTree, got {type(tree).__name__}")
        if prepare:  # build the planner's per-tree index here, once, rather than in every worker
            for tree in trees:
                prepare_tree(tree)
        self.workers = workers
        self.trees = trees
        self._index = {id(t): i for i, t in enumerate(trees)}
        self._executor = ProcessPoolExecutor(workers, mp_context=mp_context, initializer=_init_worker,
                                             initargs=(trees,))  # fmt: skip

    def features(self, jobs: Sequence[PlanJob], gpu: GpuSpec) -> np.ndarray:
        """Feature rows of ``jobs`` (float64 [len(jobs), len(FEATURE_NAMES)]), planned in the workers."""
        jobs = _check_jobs(jobs)
        _check_gpu(gpu, None)
        wire = [(self._index.get(id(j.tree), j.tree), *j[1:]) for j in jobs]
        # a few chunks per worker, interleaved: plans cost 0.3-30 ms each, so the pool balances the load
        n_chunks = min(_CHUNKS_PER_WORKER * self.workers, len(jobs))
        parts = list(self._executor.map(_worker_chunk, [wire[i::n_chunks] for i in range(n_chunks)], [gpu] * n_chunks))
        X = np.empty((len(jobs), len(FEATURE_NAMES)))
        for i, part in enumerate(parts):
            X[i::n_chunks] = part
        return X

    def close(self) -> None:
        """Stop the workers."""
        self._executor.shutdown()

    def __enter__(self) -> PredictPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def features_of_jobs(jobs: Sequence[PlanJob], gpu: GpuSpec, *, pool: PredictPool | None = None) -> np.ndarray:
    """Plan every job and build its feature row (:func:`~fasttree.costmodel.features.features_of_plans`).

    Parameters
    ----------
    jobs : sequence of PlanJob
        At least one.
    gpu : GpuSpec
    pool : PredictPool, optional
        Worker processes to plan in (default: this process).

    Returns
    -------
    ndarray, float64 [len(jobs), len(FEATURE_NAMES)]

    Raises
    ------
    ValueError
        On no jobs, a job that is not a :class:`PlanJob` or has an unknown dtype.
    """
    if pool is not None:
        return pool.features(jobs, gpu)
    jobs = _check_jobs(jobs)
    _check_gpu(gpu, None)
    return _features_chunk(jobs, gpu)


def predict_plans(
    model, plans: Sequence[Plan], gpu: GpuSpec, *, elem_bytes: int | Sequence[int] = 2, model_gpu: GpuSpec | None = None
) -> np.ndarray:
    """Predicted GPU time (us) of every plan, from one batched feature matrix and one model call.

    Parameters
    ----------
    model : LatencyModel
        Fitted (e.g. :func:`fasttree.costmodel.persist.load_model`).
    plans : sequence of Plan
        At least one.
    gpu : GpuSpec
        The GPU to predict for.
    elem_bytes : int or sequence of int
        Bytes per Q/K/V element, for all plans or per plan.
    model_gpu : GpuSpec, optional
        The GPU the model was fitted for (``GpuSpec.from_dict(meta["gpu"])``); a
        different GPU name than ``gpu``'s is a ``ValueError``.

    Returns
    -------
    ndarray, float64 [len(plans)]
    """
    _check_gpu(gpu, model_gpu)
    return model.predict(features_of_plans(plans, gpu, elem_bytes=elem_bytes))


def predict_jobs(
    model,
    jobs: Sequence[PlanJob],
    gpu: GpuSpec,
    *,
    pool: PredictPool | None = None,
    model_gpu: GpuSpec | None = None,
) -> np.ndarray:
    """Plan every job and predict its GPU time (us): :func:`features_of_jobs`, then one model call.

    Parameters as :func:`features_of_jobs` and :func:`predict_plans`.

    Returns
    -------
    ndarray, float64 [len(jobs)]
    """
    _check_gpu(gpu, model_gpu)
    return model.predict(features_of_jobs(jobs, gpu, pool=pool))
