"""The tuner's objective: a bucket's workload steps -> the model's predicted latency of a config.

:func:`steps_by_bucket` groups workload trace records (:mod:`fasttree.traces`, kind
``"workload"``) into :class:`WorkloadStep` lists per :class:`~fasttree.tuner.space.Bucket`.
:class:`LatencyObjective` evaluates a config on one bucket's steps: the real planner
(:func:`fasttree.plan`, with its default rules, as ``tree_attention``'s plans that the traces
time) plans every step's tree, the feature rows of all plans
(:func:`fasttree.costmodel.features.features_of_plan`) go to the latency model in ONE batched
``predict``, and the objective is the weighted total of the predicted step latencies (us),
optionally with the worst step's as a second objective. With ``runtime=True`` the objective
asks instead about the production runtime: each step planned as
:class:`fasttree.runtime.TreeAttentionRuntime` plans it (its own packing rules, solo units and
query-centric choice: :func:`fasttree.runtime_planning.plan_for_runtime`) and launched as it
launches it (the ``runtime_launch`` feature). Nothing config-dependent is cached: every call
plans and predicts afresh. Only the defaults' evaluation (the baseline every trial is compared
with) is computed once.

Called as an Optuna objective, it suggests the trial's config
(:func:`~fasttree.tuner.space.suggest_config`, invalid ones pruned before any planning)
and records in the trial's user attributes the predicted latency of the trial's config
and of the defaults, the speedup over the defaults, the config itself and the
evaluation time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import optuna

import fasttree as ft
from fasttree.config import FastTreeConfig
from fasttree.costmodel.features import features_of_plans, mark_runtime
from fasttree.costmodel.gpu import GpuSpec
from fasttree.plan_arrays import check_heads
from fasttree.portfolio import LAUNCH_FIELDS
from fasttree.runtime_planning import plan_as_launched, resolve_stage1_launches
from fasttree.traces import decode_tree, encode_tree
from fasttree.tree import KVTree
from fasttree.validation import check_int, check_number

from .space import Bucket, suggest_config

__all__ = [
    "Evaluation",
    "LatencyObjective",
    "PlanningError",
    "Predictor",
    "WorkloadStep",
    "balance_families",
    "family_of",
    "runtime_member",
    "steps_by_bucket",
]

logger = logging.getLogger(__name__)


#: A head dim :func:`fasttree.plan_arrays.check_heads` accepts (steps are checked for their heads only).
_ANY_HEAD_DIM = 128


class PlanningError(ValueError):
    """The planner rejected a config for one of the steps."""


class Predictor(Protocol):
    """What the objective needs of a latency model: predicted us per feature row."""

    def predict(self, X: np.ndarray) -> np.ndarray:  # pragma: no cover - a protocol
        """Predicted latency (us) of each row of ``X``."""
        ...


@dataclass(frozen=True)
class WorkloadStep:
    """One decode step of a workload: its tree, heads and weight.

    Attributes
    ----------
    tree : KVTree
    num_q_heads, num_kv_heads : int
    weight : float
        How much the step counts in the total (>= 0).
    label : str
        Where it came from (for logs), e.g. ``"serving/few_shot/seed0/step17"``.
    """

    tree: KVTree
    num_q_heads: int
    num_kv_heads: int
    weight: float = 1.0
    label: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tree, KVTree):
            raise ValueError(f"a workload step needs a KVTree, got {type(self.tree).__name__}")
        check_heads(self.num_q_heads, self.num_kv_heads, _ANY_HEAD_DIM)
        object.__setattr__(self, "weight", check_number("a step weight", self.weight, minimum=0))


def _record_label(record: Mapping[str, Any]) -> str:
    w = record["workload"]
    parts = [str(w.get("family", "")), str(w.get("scenario", "")), f"seed{w.get('seed')}", f"step{w.get('step')}"]
    return "/".join(p for p in parts if p)


def steps_by_bucket(records: Iterable[Mapping[str, Any]]) -> dict[Bucket, list[WorkloadStep]]:
    """Group workload trace records into steps per bucket (buckets sorted, steps in record order).

    Parameters
    ----------
    records : iterable of dict
        Workload records (``read_traces(paths, kind="workload").records``).

    Returns
    -------
    dict of Bucket to list of WorkloadStep

    Raises
    ------
    ValueError
        On a record that is not a workload record, or on no records at all.
    """
    out: dict[Bucket, list[WorkloadStep]] = {}
    for record in records:
        if record.get("kind") != "workload":
            raise ValueError(f"the tuner takes workload records, got kind {record.get('kind')!r}")
        bucket = Bucket.of(
            num_q_heads=record["num_q_heads"],
            num_kv_heads=record["num_kv_heads"],
            head_dim=record["head_dim"],
            dtype=record["dtype"],
        )
        step = WorkloadStep(
            tree=decode_tree(record["workload"]["tree"]),
            num_q_heads=record["num_q_heads"],
            num_kv_heads=record["num_kv_heads"],
            weight=record.get("weight", 1.0),
            label=_record_label(record),
        )
        out.setdefault(bucket, []).append(step)
    if not out:
        raise ValueError("no workload records")
    return dict(sorted(out.items()))


def workload_of(step: WorkloadStep) -> str:
    """The workload a step belongs to: its label less the step (``family/scenario/seed``)."""
    return step.label.rsplit("/", 1)[0] if "/" in step.label else step.label


def family_of(step: WorkloadStep) -> str:
    """The tree family a step belongs to: a generator family (``few_shot``), ``serving/<scenario>``
    for a serving scenario's steps, ``paper`` for the paper suite."""
    parts = step.label.split("/")
    return "/".join(parts[:2]) if parts[0] == "serving" and len(parts) > 1 else parts[0]


def balance_families(
    steps: Sequence[WorkloadStep], model: Predictor, gpu: GpuSpec, bucket: Bucket, *, runtime: bool = False
) -> list[WorkloadStep]:
    """The steps re-weighted so that the objective is the mean over families of the mean over each
    family's steps of (predicted time with the config / with the defaults).

    Each step's weight becomes ``1 / (n_families * steps_in_its_family * defaults_us)``: every family
    counts the same whatever its number of steps, every step of a family the same whatever its
    size, and the defaults score exactly 1 (:func:`family_of` names the families).

    Returns
    -------
    list of WorkloadStep
    """
    base = LatencyObjective(steps, model, gpu, bucket, runtime=runtime).defaults.step_us
    bad = [i for i, us in enumerate(base) if not (math.isfinite(float(us)) and us > 0)]
    if bad:
        raise ValueError(
            f"the model predicts {float(base[bad[0]])} us for step {bad[0]} with the defaults: family balancing "
            "divides by the defaults' time, which must be positive and finite (a broken or foreign model?)"
        )
    families = [family_of(s) for s in steps]
    counts: dict[str, int] = {}
    for f in families:
        counts[f] = counts.get(f, 0) + 1
    n = len(counts)
    weights = (1.0 / (n * counts[f] * float(us)) for f, us in zip(families, base, strict=True))
    return [replace(s, weight=w) for s, w in zip(steps, weights, strict=True)]


def runtime_member(config: FastTreeConfig) -> FastTreeConfig:
    """``config`` with the defaults' launch fields (query and KV tiles, warps, stages): what a runtime
    portfolio member may differ in is the planning (:data:`fasttree.portfolio.LAUNCH_FIELDS`)."""
    defaults = FastTreeConfig()
    return replace(config, **{f: getattr(defaults, f) for f in LAUNCH_FIELDS})


def thin_steps(steps: Sequence[WorkloadStep], every: int, *, min_steps: int = 64) -> list[WorkloadStep]:
    """Every ``every``-th step of each workload with more than ``min_steps`` steps, its weight x ``every``.

    Consecutive decode steps of a serving workload differ by a token per request, so a
    stride keeps the workload's shape at a fraction of the planning cost per trial; short
    workloads (e.g. the paper suite's distinct trees) are kept whole.

    Raises
    ------
    ValueError
        On ``every < 1``.
    """
    every = check_int("every", every, minimum=1)
    if every == 1:
        return list(steps)
    counts: dict[str, int] = {}
    for s in steps:
        counts[workload_of(s)] = counts.get(workload_of(s), 0) + 1
    seen: dict[str, int] = {}
    out = []
    for s in steps:
        w = workload_of(s)
        i = seen.get(w, 0)
        seen[w] = i + 1
        if counts[w] <= min_steps:
            out.append(s)
        elif i % every == 0:
            out.append(replace(s, weight=s.weight * every))
    return out


@dataclass(frozen=True)
class Evaluation:
    """Predicted latency of one config over a bucket's steps.

    Attributes
    ----------
    total_us : float
        Weighted total of the steps' predicted latencies.
    worst_us : float
        Largest predicted latency of a step with weight > 0.
    step_us : ndarray, float64 [n_steps]
        Predicted latency of each step.
    """

    total_us: float
    worst_us: float
    step_us: np.ndarray


class LatencyObjective:
    """Predicted latency of configs on one bucket's workload steps (an Optuna objective).

    Parameters
    ----------
    steps : sequence of WorkloadStep
        The bucket's steps; each step's GQA ratio must be the bucket's.
    model : Predictor
        A fitted latency model (e.g. :func:`fasttree.costmodel.persist.load_model`'s), or
        any object whose ``predict(X)`` returns one latency (us) per feature row.
    gpu : GpuSpec
        The GPU the model predicts for (features and search-space ranges).
    bucket : Bucket
    worst_step : bool
        Also return the worst step's latency, as a second objective.
    runtime : bool
        Predict each step as the production runtime plans and launches it (the model must have
        been fitted with runtime measurements: ``fasttree-tune profile --runtime``), not as
        ``fasttree.plan`` and ``fasttree.tree_attention`` do. A config is then evaluated with the
        defaults' launch fields (:func:`runtime_member`): a runtime portfolio's members share them.

    Attributes
    ----------
    defaults : Evaluation
        The published defaults' evaluation (computed on first use).
    """

    def __init__(
        self,
        steps: Sequence[WorkloadStep],
        model: Predictor,
        gpu: GpuSpec,
        bucket: Bucket,
        *,
        worst_step: bool = False,
        runtime: bool = False,
    ) -> None:
        steps = tuple(steps)
        if not steps:
            raise ValueError(f"bucket {bucket.label} has no workload steps")
        for s in steps:
            if not isinstance(s, WorkloadStep):
                raise ValueError(f"steps must be WorkloadStep objects, got {type(s).__name__}")
            if s.num_q_heads // s.num_kv_heads != bucket.group_size:
                raise ValueError(
                    f"step {s.label or '?'} has {s.num_q_heads}/{s.num_kv_heads} heads, not GQA {bucket.group_size}"
                )
        weights = np.array([s.weight for s in steps], dtype=np.float64)
        if not weights.sum() > 0:
            raise ValueError("the steps' weights sum to 0")
        if not callable(getattr(model, "predict", None)):
            raise ValueError(f"the model needs a predict(X) method, got {type(model).__name__}")
        self._steps = steps
        self._weights = weights
        self._model = model
        self._gpu = gpu
        self._bucket = bucket
        self._worst_step = bool(worst_step)
        self._runtime = bool(runtime)
        self._defaults: Evaluation | None = None

    @property
    def bucket(self) -> Bucket:
        """The bucket."""
        return self._bucket

    @property
    def gpu(self) -> GpuSpec:
        """The GPU."""
        return self._gpu

    @property
    def model(self) -> Predictor:
        """The latency model."""
        return self._model

    @property
    def steps(self) -> tuple[WorkloadStep, ...]:
        """The workload steps."""
        return self._steps

    @property
    def runtime(self) -> bool:
        """Whether the objective predicts the runtime's plans and launches."""
        return self._runtime

    @property
    def n_objectives(self) -> int:
        """1, or 2 with ``worst_step``."""
        return 2 if self._worst_step else 1

    def fingerprint(self) -> dict[str, Any]:
        """What a study's values depend on besides the model: GPU, bucket, objectives, the
        steps (SHA-256 of their trees, heads and weights) and, when it predicts the runtime's
        launches, ``launch: "runtime"``."""
        h = hashlib.sha256()
        for s in self._steps:
            item = [encode_tree(s.tree), s.num_q_heads, s.num_kv_heads, s.weight]
            h.update(json.dumps(item, sort_keys=True, separators=(",", ":")).encode())
        return {
            "gpu": self._gpu.name,
            "bucket": self._bucket.label,
            "n_objectives": self.n_objectives,
            "n_steps": len(self._steps),
            "workload_sha256": h.hexdigest(),
        } | ({"launch": "runtime"} if self._runtime else {})

    def features(self, config: FastTreeConfig) -> np.ndarray:
        """Feature rows (float64 [n_steps, n_features]) of every step planned with ``config``.

        Raises
        ------
        PlanningError
            When the planner rejects ``config`` for a step.
        """
        b = self._bucket
        make_plan = plan_as_launched if self._runtime else ft.plan
        plans = []
        for s in self._steps:
            heads = {"num_q_heads": s.num_q_heads, "num_kv_heads": s.num_kv_heads, "head_dim": b.head_dim}
            try:
                plans.append(make_plan(s.tree, config, **heads))
            except ValueError as exc:
                raise PlanningError(f"step {s.label or '?'}: {exc}") from exc
        X = features_of_plans(plans, self._gpu, elem_bytes=b.elem_bytes)
        if self._runtime:
            mark_runtime(X, resolve_stage1_launches("auto", b.group_size, b.head_dim))
        return X

    def evaluate(self, config: FastTreeConfig) -> Evaluation:
        """Plan every step with ``config``, predict all of them in one batch, and sum.

        Raises
        ------
        PlanningError
            When the planner rejects ``config`` for a step.
        ValueError
            When the model returns the wrong number of predictions, or a non-finite or
            negative one.
        """
        if self._runtime:
            config = runtime_member(config)
        X = self.features(config)
        pred = np.asarray(self._model.predict(X), dtype=np.float64).reshape(-1)
        if pred.shape != (len(self._steps),):
            raise ValueError(f"the model returned {pred.size} predictions for {len(self._steps)} feature rows")
        if not np.all(np.isfinite(pred)) or np.any(pred < 0):
            raise ValueError("the model predicted a non-finite or negative latency")
        total = float(self._weights @ pred)
        worst = float(pred[self._weights > 0].max())
        return Evaluation(total_us=total, worst_us=worst, step_us=pred)

    def family_ratios(self, result: Evaluation) -> dict[str, float]:
        """Per family (:func:`family_of`): the weighted predicted time of ``result`` over the defaults'."""
        base = self.defaults.step_us
        num: dict[str, float] = {}
        den: dict[str, float] = {}
        for s, w, us, d in zip(self._steps, self._weights, result.step_us, base, strict=True):
            f = family_of(s)
            num[f] = num.get(f, 0.0) + w * float(us)
            den[f] = den.get(f, 0.0) + w * float(d)
        return {f: num[f] / den[f] for f in sorted(num) if den[f] > 0}

    @property
    def defaults(self) -> Evaluation:
        """The evaluation of ``FastTreeConfig()``."""
        if self._defaults is None:
            self._defaults = self.evaluate(FastTreeConfig())
        return self._defaults

    def __call__(self, trial: optuna.trial.BaseTrial) -> float | tuple[float, float]:
        """Suggest the trial's config, evaluate it, record it in user attributes, return the objective(s)."""
        config = suggest_config(trial, self._bucket, self._gpu)
        base = self.defaults
        t0 = time.perf_counter()
        try:
            result = self.evaluate(config)
        except PlanningError as exc:  # the space should make this impossible: say so loudly
            trial.set_user_attr("invalid", f"planning failed: {exc}")
            logger.warning("trial %s pruned: planning failed: %s", getattr(trial, "number", "?"), exc)
            raise optuna.TrialPruned(str(exc)) from None
        elapsed = time.perf_counter() - t0
        trial.set_user_attr("predicted_us", result.total_us)
        trial.set_user_attr("worst_step_us", result.worst_us)
        trial.set_user_attr("defaults_predicted_us", base.total_us)
        trial.set_user_attr("defaults_worst_step_us", base.worst_us)
        trial.set_user_attr("speedup_vs_defaults", base.total_us / result.total_us if result.total_us > 0 else None)
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("eval_s", elapsed)
        trial.set_user_attr("family_ratio", self.family_ratios(result))
        if self._worst_step:
            return result.total_us, result.worst_us
        return result.total_us
