"""From workloads to tuned portfolios: the steps of ``fasttree-tune run`` for every bucket and target.

For each (bucket, target) job, with ``target`` ``"tree_attention"`` or ``"runtime"``:

1. the tuning steps are thinned (every ``every``-th step of a long serving workload) and weighted so
   that every tree family counts the same and every step of a family too
   (:func:`~fasttree.tuner.objective.balance_families`);
2. an Optuna study runs on that objective (:func:`~fasttree.tuner.study.tune_bucket`), its best
   config is polished by a coordinate search, and each family's own best config is found by a
   coordinate search on its steps alone: together with the best trials, the portfolio candidates;
3. every candidate is predicted on every tuning step and every validation step (other seeds and
   arrivals of the same families: :func:`~fasttree.tuner.portfolio.selection_problem`), and the
   portfolio and its selector are chosen together on the tuning steps under each design, the design
   being chosen on the validation steps (:func:`~fasttree.tuner.portfolio.build_portfolio`);
4. each selector leaf keeps its member only where the validation steps that reach it are predicted
   faster by more than the margin calibrated from the model's held-out errors for the bucket and
   target (``margins``; :mod:`fasttree.costmodel.calibration`), and is fenced by the region of those
   steps; every other leaf serves the defaults (:func:`~fasttree.tuner.portfolio.fence_portfolio`).

Jobs are independent and run in ``jobs`` processes (each loads the model itself).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fasttree.costmodel.calibration import GainMargin
from fasttree.costmodel.gpu import GpuSpec

from .objective import LatencyObjective, WorkloadStep, balance_families, thin_steps
from .portfolio import PortfolioResult, build_portfolio, fence_portfolio, selection_problem
from .space import Bucket
from .study import TuneResult, study_name, tune_bucket

__all__ = ["TARGETS", "BucketTuning", "tune_portfolios"]

logger = logging.getLogger(__name__)

#: What a portfolio serves (the export's entry targets).
TARGETS = ("tree_attention", "runtime")


@dataclass(frozen=True)
class BucketTuning:
    """One job's result: the study's, the portfolio's and how long it took."""

    bucket: Bucket
    target: str
    tune: TuneResult
    portfolio: PortfolioResult
    n_candidates: int
    n_steps: int
    n_valid_steps: int
    elapsed_s: float


def _job(
    bucket: Bucket,
    target: str,
    steps: Sequence[WorkloadStep],
    valid: Sequence[WorkloadStep],
    model_path: str,
    options: Mapping[str, Any],
) -> BucketTuning:
    from fasttree.costmodel.persist import load_model

    t0 = time.perf_counter()
    model, meta = load_model(model_path, force=options.get("force", False))
    gpu = GpuSpec.from_dict(meta["gpu"])
    runtime = target == "runtime"
    train = balance_families(thin_steps(steps, options["every"]), model, gpu, bucket, runtime=runtime)
    objective = LatencyObjective(train, model, gpu, bucket, runtime=runtime)
    result = tune_bucket(
        objective,
        storage=options.get("storage"),
        folder=options["folder"],
        base_name=f"{options['base_name']}-rt" if runtime else options["base_name"],
        n_trials=options["n_trials"],
        timeout=options.get("timeout"),
        seed=options.get("seed", 0),
        progress=False,
        importances=options.get("importances", True),
        polish_passes=options["polish_passes"],
        family_polish=True,
        settings=None if options.get("settings") is None else {**options["settings"], "target": target},
    )
    candidates = list(result.candidates)
    train_problem = selection_problem(objective, candidates)
    valid_steps = thin_steps(valid, options["every"]) if valid else []
    valid_problem = None
    if valid_steps:
        valid_problem = selection_problem(
            LatencyObjective(valid_steps, model, gpu, bucket, runtime=runtime), candidates
        )
    portfolio = build_portfolio(candidates, train_problem, valid_problem, runtime=runtime)
    margin: GainMargin | None = (options.get("margins") or {}).get((bucket.label, target))
    portfolio = fence_portfolio(portfolio, train_problem, valid_problem, None if margin is None else margin.margin)
    calibrated = None if margin is None else {**margin.to_dict(), "source": options.get("calibration")}
    portfolio = replace(portfolio, evidence={**portfolio.evidence, "calibration": calibrated})
    elapsed = time.perf_counter() - t0
    served = sum(leaf["served"] != 0 for leaf in portfolio.evidence["leaves"])
    logger.info(
        "%s %s: %d candidates, %d members, %d of %d leaves kept (margin %s); predicted %.3f of the defaults' time "
        "on the tuning steps, %s on the validation steps (%.0f s)",
        bucket.label, target, len(candidates), len(portfolio.portfolio.members), served,
        sum(leaf["model_pick"] != 0 for leaf in portfolio.evidence["leaves"]),
        "none" if margin is None else f"{margin.margin:.3f}", portfolio.train["objective"],
        "-" if portfolio.valid is None else f"{portfolio.valid['objective']:.3f}", elapsed,
    )  # fmt: skip
    return BucketTuning(
        bucket=bucket,
        target=target,
        tune=result,
        portfolio=portfolio,
        n_candidates=len(candidates),
        n_steps=len(train),
        n_valid_steps=len(valid_steps),
        elapsed_s=elapsed,
    )


def tune_portfolios(
    train: Mapping[Bucket, Sequence[WorkloadStep]],
    valid: Mapping[Bucket, Sequence[WorkloadStep]],
    model_path: str | os.PathLike,
    *,
    targets: Sequence[str] = TARGETS,
    folder: str | os.PathLike = ".",
    storage: str | None = None,
    base_name: str = "fasttree",
    n_trials: int = 200,
    timeout: float | None = None,
    seed: int = 0,
    every: int = 1,
    polish_passes: int = 1,
    jobs: int = 1,
    force: bool = False,
    importances: bool = True,
    settings: Mapping[str, Any] | None = None,
    margins: Mapping[tuple[str, str], GainMargin] | None = None,
    calibration: str | None = None,
) -> list[BucketTuning]:
    """Tune a portfolio for every bucket of ``train`` and every target (see the module docstring).

    Parameters
    ----------
    train, valid : mapping of Bucket to steps
        Tuning and validation steps by bucket (a bucket without validation steps gets the most
        cautious design).
    model_path : str or PathLike
        The latency model file (each job process loads it).
    targets : sequence of {"tree_attention", "runtime"}
    folder, storage, base_name, n_trials, timeout, seed, polish_passes
        As in :func:`~fasttree.tuner.study.tune_bucket`; the runtime's studies are named
        ``<base_name>-rt-...``.
    every : int
        Thin long workloads to every ``every``-th step.
    jobs : int
        Processes (1: in this process).
    force : bool
        Use a model fitted for another GPU or feature schema.
    settings : mapping, optional
        The command's settings, stored in every study with the job's ``target`` added
        (:data:`~fasttree.tuner.study.SETTINGS_ATTR`).
    margins : mapping, optional
        ``(bucket label, target) -> GainMargin``: the calibrated margin a leaf's predicted gain must
        exceed (:func:`fasttree.costmodel.calibration.gain_margins`). A job without one keeps no leaf
        (its portfolio serves the defaults; its members stay as candidates for ``confirm``).
    calibration : str, optional
        Where the margins came from (recorded with them).

    Returns
    -------
    list of BucketTuning
        In (target, bucket) order.
    """
    options = {
        "folder": str(folder), "storage": storage, "base_name": base_name, "n_trials": n_trials, "timeout": timeout,
        "seed": seed, "every": every, "polish_passes": polish_passes, "force": force, "importances": importances,
        "settings": None if settings is None else dict(settings),
        "margins": dict(margins or {}), "calibration": calibration,
    }  # fmt: skip
    work = [(b, t, train[b], valid.get(b, []), str(model_path), options) for t in targets for b in sorted(train)]
    names = {study_name(base_name, b) for b in train}
    logger.info("tuning %d jobs (%s) in %d processes", len(work), ", ".join(sorted(names)), jobs)
    if jobs <= 1 or len(work) == 1:
        return [_job(*w) for w in work]
    Path(folder).mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_job, *zip(*work, strict=True)))
