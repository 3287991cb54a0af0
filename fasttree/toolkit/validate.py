"""Measure a tuned export against the defaults on workload traces, on the GPU (``fasttree-tune validate``).

For every workload (one scenario and head shape of the workload traces) a few evenly
spaced decode steps are measured with the export's config for their bucket and with
``FastTreeConfig()``, by the profiler's own measurement (:func:`fasttree.toolkit.measure.measure_point`:
CUDA-graph replay on random inputs, the first step of each workload checked against the
float64 reference). The measured speedup of a workload is the ratio of its summed step
times. Every measurement is appended to a trace file (``meta.split = "validate"``), so
the loop closes: the next fit of the latency model can use them. With a latency model,
its predictions of the same (step, config) pairs give the predicted speedup and the
model's error on them.

Runs on the GPU machine: imports torch, numpy and fasttree (scikit-learn only for the
optional model), never Optuna.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import FastTreeConfig
from ..export import ConfigExport
from ..traces import TraceWriter, decode_tree
from ..validation import check_int
from .design import DesignPoint
from .environment import collect_env
from .measure import measure_point

__all__ = ["WorkloadValidation", "validate_export", "workload_steps"]

logger = logging.getLogger(__name__)


@dataclass
class WorkloadValidation:
    """Measured (and predicted) totals of one workload's sampled steps.

    Attributes
    ----------
    workload : str
        ``family/scenario/seed`` of the workload traces, with the head shape.
    steps : list of int
        The decode steps measured.
    tuned_is_default : bool
        The export has no entry for this bucket (or its entry is the defaults).
    default_us, tuned_us : float
        Summed graph-replay medians of the steps.
    predicted_default_us, predicted_tuned_us : float or None
        The model's sums for the same steps (None without a model).
    """

    workload: str
    steps: list[int]
    tuned_is_default: bool
    default_us: float = 0.0
    tuned_us: float = 0.0
    predicted_default_us: float | None = None
    predicted_tuned_us: float | None = None
    abs_errors: list[float] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """Measured defaults / tuned time."""
        return self.default_us / self.tuned_us if self.tuned_us > 0 else math.nan

    @property
    def predicted_speedup(self) -> float | None:
        """Predicted defaults / tuned time."""
        if self.predicted_default_us is None or not self.predicted_tuned_us:
            return None
        return self.predicted_default_us / self.predicted_tuned_us


def workload_steps(records: Iterable[Mapping[str, Any]], per_workload: int) -> dict[str, list[Mapping[str, Any]]]:
    """Up to ``per_workload`` evenly spaced records of each workload, by ``family/scenario/seed Hq/Hkv``.

    Raises
    ------
    ValueError
        On ``per_workload < 1`` or no workload records.
    """
    per_workload = check_int("steps per workload", per_workload, minimum=1)
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("kind") != "workload":
            raise ValueError(f"expected workload records, got kind {r.get('kind')!r}")
        w = r["workload"]
        name = f"{w['family']}/{w['scenario']}/seed{w['seed']} {r['num_q_heads']}/{r['num_kv_heads']}"
        groups.setdefault(name, []).append(r)
    if not groups:
        raise ValueError("no workload records")
    out = {}
    for name, rs in groups.items():
        idx = np.unique(np.linspace(0, len(rs) - 1, min(per_workload, len(rs))).round().astype(int))
        out[name] = [rs[i] for i in idx]
    return out


def _point(record: Mapping[str, Any], config: FastTreeConfig, index: int) -> DesignPoint:
    w = record["workload"]
    return DesignPoint(
        index=index,
        family=f"{w['family']}/{w['scenario']}",
        seed=int(w["seed"]) if w.get("seed") is not None else 0,
        num_q_heads=int(record["num_q_heads"]),
        num_kv_heads=int(record["num_kv_heads"]),
        head_dim=int(record["head_dim"]),
        dtype=str(record["dtype"]),
        config=config,
        default_config=config == FastTreeConfig(),
        split="validate",
        tree_index=int(w["step"]),
    )


def validate_export(
    export: ConfigExport,
    records: Iterable[Mapping[str, Any]],
    *,
    gpu_name: str,
    steps_per_workload: int = 8,
    writer: TraceWriter | None = None,
    predict: Callable[[list[tuple[Mapping[str, Any], FastTreeConfig]]], np.ndarray] | None = None,
    device: Any = "cuda",
    env: dict[str, Any] | None = None,
    measure: Callable[..., dict[str, Any]] = measure_point,
) -> list[WorkloadValidation]:
    """Measure the export's configs and the defaults on sampled workload steps.

    Parameters
    ----------
    export : ConfigExport
    records : iterable of dict
        Workload trace records.
    gpu_name : str
        The GPU's name as ``torch.cuda.get_device_name()`` reports it (picks the export's entries).
    steps_per_workload : int
        Steps measured per workload (evenly spaced).
    writer : TraceWriter, optional
        Receives every measurement record.
    predict : callable, optional
        ``[(record, config), ...] -> predicted us`` (e.g. the latency model through the planner).
    device : str or torch.device
    env : dict, optional
        :func:`fasttree.toolkit.environment.collect_env` of ``device`` (collected when None).
    measure : callable
        :func:`fasttree.toolkit.measure.measure_point` (replaceable in tests).

    Returns
    -------
    list of WorkloadValidation

    Raises
    ------
    RuntimeError
        When a measurement fails (the failed record is still written).
    """
    env = collect_env(device) if env is None else env
    results = []
    index = 0
    for name, steps in workload_steps(records, steps_per_workload).items():
        r0 = steps[0]
        tuned, _ = export.lookup(
            gpu=gpu_name,
            num_q_heads=r0["num_q_heads"],
            num_kv_heads=r0["num_kv_heads"],
            head_dim=r0["head_dim"],
            dtype=r0["dtype"],
        )
        same = tuned == FastTreeConfig()
        v = WorkloadValidation(workload=name, steps=[int(r["workload"]["step"]) for r in steps], tuned_is_default=same)
        pairs = []
        for i, r in enumerate(steps):
            tree = decode_tree(r["workload"]["tree"])
            times = {}
            for which, config in (("default", FastTreeConfig()), ("tuned", tuned)):
                if which == "tuned" and same:
                    times["tuned"] = times["default"]
                    continue
                rec = measure(_point(r, config, index), device=device, check=i == 0, env=env, tree=tree)
                index += 1
                rec.setdefault("meta", {}).update({"split": "validate", "workload": name, "config": which})
                if writer is not None:
                    writer.append(rec)
                if rec["status"] != "ok":
                    raise RuntimeError(f"{name} step {r['workload']['step']} ({which}): {rec.get('error')}")
                times[which] = float(rec["timing"]["graph_us"]["median"])
                pairs.append((r, config, times[which]))
            v.default_us += times["default"]
            v.tuned_us += times["tuned"]
        if predict is not None:
            pred = np.asarray(predict([(r, c) for r, c, _ in pairs]), dtype=np.float64)
            meas = np.array([t for _, _, t in pairs])
            is_default = np.array([c == FastTreeConfig() for _, c, _ in pairs])
            v.abs_errors = np.abs(pred / meas - 1).tolist()
            v.predicted_default_us = float(pred[is_default].sum())
            v.predicted_tuned_us = float(pred[~is_default].sum()) if (~is_default).any() else v.predicted_default_us
        logger.info("%s: measured %.3fx over %d steps", name, v.speedup, len(steps))
        results.append(v)
    return results
