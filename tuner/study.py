"""Optuna studies of the tuner: one per bucket, created or joined, resumed, run to a trial count.

A bucket's study is named ``f"{base}-g{G}-d{D}-{dtype}"`` (:func:`study_name`) in a
storage that :func:`fasttree.tuner.storage.open_storage` opens, so any number of workers,
on any machines that reach the storage, join one study by running the same command. The
first worker to create the study enqueues the published defaults as its first trial; a
worker that joins enqueues them again only when no live trial holds them (e.g. the one
that ran them was killed). Running to ``n_trials`` counts the study's COMPLETE trials,
whoever ran them: a killed run, resumed, runs only what is missing, and pruned (invalid)
or failed trials never count. Concurrent workers may overshoot by the trials in flight
when the count is reached.

The sampler is a seeded multivariate, grouped TPE with the constant liar (concurrent
workers see each other's running trials); with ``worst_step`` the study has two objectives
(total and worst-step latency) and the same TPE samples them multi-objectively. Each
worker gets its own seed stream (``worker``), so concurrent workers do not propose the same
start-up trials. A study remembers what its values mean (GPU, bucket, objectives and a
hash of the workload steps, :meth:`~fasttree.tuner.objective.LatencyObjective.fingerprint`)
and refuses to be continued with another.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import optuna
from optuna.storages import BaseStorage
from optuna.study import MaxTrialsCallback, Study
from optuna.trial import FrozenTrial, TrialState

from fasttree.config import FastTreeConfig
from fasttree.costmodel.gpu import GpuSpec
from fasttree.validation import check_choice, check_int, check_number

from .objective import LatencyObjective, Predictor, WorkloadStep, family_of, runtime_member, steps_by_bucket
from .polish import polish_config
from .space import Bucket, canonical_config, config_from_params, default_params, invalid_reason, neighbour_params
from .storage import StorageSpec, open_storage

__all__ = [
    "MIN_TRIALS_FOR_IMPORTANCE",
    "SETTINGS_ATTR",
    "TuneResult",
    "ensure_defaults",
    "make_sampler",
    "open_study",
    "param_importances",
    "run_trials",
    "study_name",
    "tune_bucket",
    "tune_workload",
]

logger = logging.getLogger(__name__)

#: Completed trials below which :func:`param_importances` gives ``{}`` (too few to rank).
MIN_TRIALS_FOR_IMPORTANCE = 4
#: States of a trial that still holds (or will hold) a value: the defaults are not
#: enqueued again while one of these has them.
_LIVE_STATES = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
#: Study user attribute holding the objective's fingerprint.
_FINGERPRINT_ATTR = "fasttree_objective"
#: Study user attribute holding the settings of the command that tuned it (model, workloads, --every, target,
#: held-out source), which ``fasttree-tune export`` reuses.
SETTINGS_ATTR = "fasttree_settings"


def study_name(base: str, bucket: Bucket) -> str:
    """``f"{base}-g{G}-d{D}-{dtype}"``, the study of ``bucket`` (``ValueError`` on an empty base)."""
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"a study base name must be a non-empty string, got {base!r}")
    return f"{base}-{bucket.label}"


#: Random trials before TPE models the space (Optuna's default is 10). With ~19 parameters,
#: 10 random points left the GQA-4 study of ``fasttree-tune run`` stuck next to the enqueued
#: defaults for 250 trials (239 of them kept ``pack_tokens=1024``), while a study whose random
#: start happened to try ``pack_tokens=0`` found a config predicted 1.25x better.
N_STARTUP_TRIALS = 40


def make_sampler(seed: int | None = 0, *, worker: int = 0) -> optuna.samplers.TPESampler:
    """The tuner's sampler: ``TPESampler(multivariate=True, group=True, constant_liar=True)`` with
    :data:`N_STARTUP_TRIALS` random trials first.

    Parameters
    ----------
    seed : int or None
        Study seed; None draws one from the OS.
    worker : int
        Index of this worker among concurrent workers of one study (>= 0): each gets its
        own seed stream, derived from ``(seed, worker)``.
    """
    worker = check_int("worker", worker, minimum=0)
    if seed is not None:
        seed = check_int("seed", seed, minimum=0, expected="an integer >= 0 or None")
    stream = None if seed is None else int(np.random.SeedSequence([seed, worker]).generate_state(1)[0])
    with warnings.catch_warnings():  # ``group`` is marked experimental; it is what the tuner wants
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            multivariate=True, group=True, seed=stream, constant_liar=True, n_startup_trials=N_STARTUP_TRIALS
        )


def _directions(n_objectives: int) -> list[str]:
    return ["minimize"] * n_objectives


def open_study(
    storage: BaseStorage,
    name: str,
    *,
    n_objectives: int = 1,
    sampler: optuna.samplers.BaseSampler | None = None,
    fingerprint: Mapping[str, Any] | None = None,
) -> tuple[Study, bool]:
    """Create the study ``name`` in ``storage``, or load it when it exists.

    Parameters
    ----------
    storage : optuna.storages.BaseStorage
    name : str
    n_objectives : int
        1 (total latency) or 2 (and worst-step latency).
    sampler : optuna.samplers.BaseSampler, optional
        Default :func:`make_sampler` ``()``.
    fingerprint : mapping, optional
        What the values mean; stored in a new study, compared with a loaded one's.

    Returns
    -------
    study : optuna.study.Study
    created : bool
        Whether this call created it.

    Raises
    ------
    ValueError
        When an existing study has other objectives or another fingerprint.
    """
    check_choice("n_objectives", n_objectives, (1, 2), expected="1 or 2")
    sampler = make_sampler() if sampler is None else sampler
    try:
        study = optuna.create_study(
            storage=storage, study_name=name, sampler=sampler, directions=_directions(n_objectives)
        )
        created = True
        if fingerprint is not None:
            study.set_user_attr(_FINGERPRINT_ATTR, dict(fingerprint))
        logger.info("created study %s", name)
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        created = False
        if len(study.directions) != n_objectives:
            raise ValueError(
                f"study {name} has {len(study.directions)} objective(s), this run {n_objectives}; "
                "use another study name (or the same --worst-step setting)"
            ) from None
        stored = study.user_attrs.get(_FINGERPRINT_ATTR)
        if fingerprint is not None and stored is not None and stored != dict(fingerprint):
            diff = sorted(k for k in set(stored) | set(fingerprint) if stored.get(k) != fingerprint.get(k))
            raise ValueError(
                f"study {name} was made for another objective (differs in {diff}); "
                "its values would not compare: use another study name"
            ) from None
        logger.info("joined study %s (%d trials)", name, len(study.get_trials(deepcopy=False)))
    return study, created


def _same_params(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, float) or isinstance(w, float):
            if not math.isclose(float(v), float(w), rel_tol=0.0, abs_tol=1e-12):
                return False
        elif v != w:
            return False
    return True


def _trial_params(trial: FrozenTrial) -> Mapping[str, Any]:
    """The parameters a trial has or (WAITING) will have."""
    return trial.system_attrs.get("fixed_params") or trial.params


def ensure_defaults(study: Study, params: Mapping[str, Any], *, created: bool) -> bool:
    """Enqueue the defaults' ``params`` unless the study already holds them; True when enqueued.

    The creator of a study always enqueues them. A worker that joined enqueues them
    only when the study has trials but none in a live state (complete, running, waiting)
    with these parameters, i.e. the trial that held them failed; it leaves an empty study
    to its creator, which is enqueueing them. The running trial of a killed worker counts
    as live until the storage's heartbeat marks it failed (RDB storages, after
    :data:`~fasttree.tuner.storage.GRACE_PERIOD_S`; journal files never do).

    Parameters
    ----------
    study : optuna.study.Study
    params : mapping
        :func:`~fasttree.tuner.space.default_params`.
    created : bool
        Whether this worker created the study.

    Returns
    -------
    bool
    """
    if not created:
        trials = study.get_trials(deepcopy=False)
        if not trials:
            return False
        if any(t.state in _LIVE_STATES and _same_params(_trial_params(t), params) for t in trials):
            return False
    study.enqueue_trial(dict(params), user_attrs={"defaults": True})
    logger.info("study %s: defaults enqueued", study.study_name)
    return True


def _count(study: Study, states: Sequence[TrialState]) -> int:
    return len(study.get_trials(deepcopy=False, states=tuple(states)))


class _Progress:
    """Progress of the study's COMPLETE trials towards the target (tqdm, else log lines)."""

    def __init__(self, name: str, target: int, start: int, enabled: bool) -> None:
        self._bar = None
        self._name = name
        self._target = target
        self._last = start
        self._level = logging.INFO if enabled else logging.DEBUG
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is an optional dependency
            logger.info("tqdm is not installed: progress goes to the log")
            return
        self._bar = tqdm(total=target, initial=start, desc=name, unit="trial", dynamic_ncols=True)

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        done = _count(study, (TrialState.COMPLETE,))
        if self._bar is not None:
            self._bar.update(max(0, min(done, self._target) - self._bar.n))
            best = _best_trial(study)
            if best is not None:
                self._bar.set_postfix(best_objective=f"{best.values[0]:.4g}", refresh=False)
        elif done != self._last:
            logger.log(self._level, "%s: %d/%d complete trials", self._name, done, self._target)
        self._last = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _PrunedLimit:
    """Stops the run when this worker pruned ``limit`` trials in a row (a space with no valid point)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.tripped = False

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        self.in_a_row = self.in_a_row + 1 if trial.state == TrialState.PRUNED else 0
        if self.in_a_row >= self.limit:
            self.tripped = True
            study.stop()


def run_trials(
    study: Study,
    objective: Any,
    *,
    n_trials: int,
    timeout: float | None = None,
    progress: bool = False,
    max_pruned_in_a_row: int = 200,
) -> int:
    """Run trials until the study has ``n_trials`` COMPLETE trials or ``timeout`` seconds pass.

    Trials of other workers and of earlier (killed) runs count; pruned and failed ones do
    not. Returns the COMPLETE trials of the study at the end.

    Parameters
    ----------
    study : optuna.study.Study
    objective : callable
        ``objective(trial) -> value(s)``.
    n_trials : int
        Target number of COMPLETE trials of the study (>= 1).
    timeout : float, optional
        Seconds after which no new trial starts.
    progress : bool
        Show a progress bar (tqdm) of the study's COMPLETE trials.
    max_pruned_in_a_row : int
        Stop (with a warning) after this many consecutive pruned trials of this worker.
    """
    n_trials = check_int("n_trials", n_trials, minimum=1)
    if timeout is not None:
        check_number("timeout", timeout, above=0, finite=False, expected="a positive number of seconds or None")
    done = _count(study, (TrialState.COMPLETE,))
    if done >= n_trials:
        logger.info("study %s already has %d complete trials (target %d)", study.study_name, done, n_trials)
        return done
    bar = _Progress(study.study_name, n_trials, done, progress)
    guard = _PrunedLimit(max_pruned_in_a_row)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                study.optimize(
                    objective,
                    n_trials=None,
                    timeout=left,
                    callbacks=[MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE,)), guard, bar],
                )
                break
            except (ValueError, optuna.exceptions.UpdateFinishedTrialError) as exc:
                # Two workers on SQLite (no row locks) can pop the same enqueued trial: the
                # second to finish it cannot tell it (optuna/optuna#4621): a ValueError when
                # its cached trial is already finished, UpdateFinishedTrialError from the
                # storage when only the database knows. Its result is the first one's; this
                # worker goes on with the next trial.
                if isinstance(exc, ValueError) and not str(exc).startswith("Cannot tell a "):
                    raise
                logger.warning("study %s: another worker finished the same trial first (%s)", study.study_name, exc)
    finally:
        bar.close()
    if guard.tripped:
        logger.warning("study %s: %d trials in a row were pruned (invalid); stopped", study.study_name, guard.limit)
    return _count(study, (TrialState.COMPLETE,))


def _best_trial(study: Study) -> FrozenTrial | None:
    """The COMPLETE trial of least total latency (the first objective), or None."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not trials:
        return None
    return min(trials, key=lambda t: (t.values[0], t.number))


def param_importances(study: Study) -> dict[str, float]:
    """Optuna's parameter importances (PED-ANOVA) of the total latency; ``{}`` when there are
    fewer than :data:`MIN_TRIALS_FOR_IMPORTANCE` COMPLETE trials or they cannot be ranked."""
    n = _count(study, (TrialState.COMPLETE,))
    if n < MIN_TRIALS_FOR_IMPORTANCE:
        logger.info("study %s: %d complete trials, too few for parameter importances", study.study_name, n)
        return {}
    try:
        with warnings.catch_warnings():  # it reminds that low values are the good ones: they are
            warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes", category=UserWarning)
            # pack_min_units exists only with packing on: PED-ANOVA notes its thin regimes
            warnings.filterwarnings("ignore", message="Some regimes for parameter", category=UserWarning)
            scores = optuna.importance.get_param_importances(study, target=lambda t: t.values[0])
    except (RuntimeError, ValueError, ZeroDivisionError) as exc:
        logger.info("study %s: no parameter importances (%s)", study.study_name, exc)
        return {}
    return {k: float(v) for k, v in scores.items() if math.isfinite(v)}


@dataclass(frozen=True)
class TuneResult:
    """Outcome of tuning one bucket.

    Attributes
    ----------
    study_name : str
    bucket : Bucket
    best_config : FastTreeConfig
        Config of the COMPLETE trial of least predicted total latency, polished by
        :func:`~fasttree.tuner.polish.polish_config` when ``polish_moves`` is not empty.
    best_trial : int
        That trial's number.
    predicted_us, worst_step_us : float
        ``best_config``'s predicted weighted total and worst-step latency.
    defaults_predicted_us, defaults_worst_step_us : float
        The same for ``FastTreeConfig()``.
    n_complete, n_pruned, n_failed : int
        Trials of the study by state.
    importances : dict of str to float
        :func:`param_importances`.
    elapsed_s : float
        Wall time of this call.
    trial_predicted_us : float
        The best trial's own predicted total (before the polish; NaN when not recorded).
    polish_moves : list
        ``[coordinate, value, objective ratio]`` of the kept moves of the polish that won (empty
        when no polish beat the best trial).
    polish_evaluations : int
        Configs the polishes evaluated (0: no polish).
    polish_start : str
        Where the winning polish started: ``"best trial"``, ``"defaults"`` or ``""`` (none won).
    candidates : tuple of FastTreeConfig
        Configs for a portfolio (:func:`candidate_configs`): the defaults first, then the best
        config, the best trials overall and the best trial of each tree family.
    """

    study_name: str
    bucket: Bucket
    best_config: FastTreeConfig
    best_trial: int
    predicted_us: float
    worst_step_us: float
    defaults_predicted_us: float
    defaults_worst_step_us: float
    n_complete: int
    n_pruned: int
    n_failed: int
    importances: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    trial_predicted_us: float = math.nan
    polish_moves: list = field(default_factory=list)
    polish_evaluations: int = 0
    polish_start: str = ""
    candidates: tuple[FastTreeConfig, ...] = ()

    @property
    def speedup(self) -> float:
        """Predicted defaults / tuned total latency."""
        return self.defaults_predicted_us / self.predicted_us if self.predicted_us > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "study_name": self.study_name,
            "group_size": self.bucket.group_size,
            "head_dim": self.bucket.head_dim,
            "dtype": self.bucket.dtype,
            "best_config": self.best_config.to_dict(),
            "best_trial": self.best_trial,
            "predicted_us": self.predicted_us,
            "worst_step_us": self.worst_step_us,
            "defaults_predicted_us": self.defaults_predicted_us,
            "defaults_worst_step_us": self.defaults_worst_step_us,
            "speedup": self.speedup,
            "n_complete": self.n_complete,
            "n_pruned": self.n_pruned,
            "n_failed": self.n_failed,
            "importances": dict(self.importances),
            "elapsed_s": self.elapsed_s,
        }


def tune_bucket(
    objective: LatencyObjective,
    *,
    storage: str | os.PathLike | StorageSpec | BaseStorage | None = None,
    folder: str | os.PathLike = ".",
    base_name: str = "fasttree",
    n_trials: int = 200,
    timeout: float | None = None,
    seed: int | None = 0,
    worker: int = 0,
    progress: bool = False,
    importances: bool = True,
    polish_passes: int = 2,
    family_polish: bool = False,
    settings: Mapping[str, Any] | None = None,
) -> TuneResult:
    """Create or join the bucket's study, run it to ``n_trials`` COMPLETE trials, report the best.

    With one objective and ``polish_passes > 0``, a coordinate search on the same objective
    (:func:`~fasttree.tuner.polish.polish_config`) then runs from the best trial's config and
    from the defaults; the result is the best of the trial and the two polished configs. With
    ``family_polish``, a coordinate search from the defaults on each tree family's steps alone
    (:func:`~fasttree.tuner.objective.family_of`) adds each family's best config to the
    portfolio candidates.

    Parameters
    ----------
    objective : LatencyObjective
        The bucket's objective (its ``bucket``, ``gpu`` and ``n_objectives`` decide the
        study name, space and directions).
    storage : str, PathLike, StorageSpec, optuna storage or None
        See :func:`fasttree.tuner.storage.open_storage`; None: a SQLite file in ``folder``.
    folder : str or PathLike
        Folder of the default SQLite file.
    base_name : str
        Study base name; the study is :func:`study_name` ``(base_name, bucket)``.
    n_trials : int
        Target COMPLETE trials of the study (counting earlier runs and other workers).
    timeout : float, optional
        Seconds after which this worker starts no new trial.
    seed : int or None
        Sampler seed (see :func:`make_sampler`).
    worker : int
        This worker's index among concurrent workers of the study.
    progress : bool
        Show a progress bar.
    importances : bool
        Compute parameter importances.
    polish_passes : int
        Passes of the polish (>= 0; 0: none). Ignored with two objectives.
    family_polish : bool
        Also polish from the defaults on each family's steps (``polish_passes`` passes, at least 1).
    settings : mapping, optional
        JSON values: the settings of the command that tunes (model, workloads, ...), stored in the study's
        user attribute :data:`SETTINGS_ATTR` before any trial runs.

    Returns
    -------
    TuneResult

    Raises
    ------
    ValueError
        On bad arguments, a study made for another objective, or no COMPLETE trial.
    """
    polish_passes = check_int("polish_passes", polish_passes, minimum=0)
    t0 = time.monotonic()
    bucket = objective.bucket
    name = study_name(base_name, bucket)
    study = _bucket_study(objective, open_storage(storage, folder=folder), name, make_sampler(seed, worker=worker))
    if settings is not None:
        study.set_user_attr(SETTINGS_ATTR, dict(settings))
    run_trials(study, objective, n_trials=n_trials, timeout=timeout, progress=progress)
    best = _best_trial(study)
    if best is None:
        raise ValueError(f"study {name} has no complete trial")
    trial_config = config_from_params(best.params, bucket.group_size, bucket.head_dim)
    if objective.runtime:  # what the objective evaluated
        trial_config = runtime_member(trial_config)
    trial_us = float(best.values[0])
    polished = _Polished(trial_config, trial_us)
    if polish_passes and objective.n_objectives == 1:
        polished = _polish(objective, trial_config, trial_us, polish_passes)
    if objective.runtime:
        polished = replace(polished, config=runtime_member(polished.config))
    polished = replace(polished, config=canonical_config(polished.config, bucket.group_size, bucket.head_dim))
    worst = float(best.user_attrs.get("worst_step_us", math.nan))
    if polished.moves:
        worst = objective.evaluate(polished.config).worst_us
    base = objective.defaults
    trials = study.get_trials(deepcopy=False)
    result = TuneResult(
        study_name=name,
        bucket=bucket,
        best_config=polished.config,
        best_trial=best.number,
        predicted_us=polished.predicted_us,
        worst_step_us=worst,
        defaults_predicted_us=base.total_us,
        defaults_worst_step_us=base.worst_us,
        n_complete=sum(t.state == TrialState.COMPLETE for t in trials),
        n_pruned=sum(t.state == TrialState.PRUNED for t in trials),
        n_failed=sum(t.state == TrialState.FAIL for t in trials),
        importances=param_importances(study) if importances else {},
        elapsed_s=time.monotonic() - t0,
        trial_predicted_us=trial_us,
        polish_moves=polished.moves,
        polish_evaluations=polished.evaluations,
        polish_start=polished.start,
        candidates=tuple(
            dict.fromkeys(
                candidate_configs(trials, objective, polished.config)
                + (_family_polishes(objective, max(1, polish_passes)) if family_polish else ())
            )
        ),
    )
    logger.info(
        "%s: best trial %d scores %.4g, %.4g polished (defaults %.4g, %.3fx) after %d complete trials",
        name,
        result.best_trial,
        result.trial_predicted_us,
        result.predicted_us,
        result.defaults_predicted_us,
        result.speedup,
        result.n_complete,
    )
    return result


def candidate_configs(
    trials: Sequence[FrozenTrial], objective: LatencyObjective, best: FastTreeConfig, *, top: int = 6
) -> tuple[FastTreeConfig, ...]:
    """Distinct configs for a portfolio from a study's COMPLETE trials: the defaults, ``best`` (the
    study's polished best), the ``top`` best trials and the best trial of every tree family by its
    ``family_ratio`` user attribute; a runtime objective's configs keep the defaults' launch fields."""
    bucket = objective.bucket

    def usable(config: FastTreeConfig) -> FastTreeConfig | None:
        if objective.runtime:
            config = runtime_member(config)
        config = canonical_config(config, bucket.group_size, bucket.head_dim)
        return config if invalid_reason(config, bucket, objective.gpu) is None else None

    done: list[tuple[FrozenTrial, FastTreeConfig]] = []  # valid trials only, best first
    for trial in sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.values[0]):
        try:
            config = usable(config_from_params(trial.params, bucket.group_size, bucket.head_dim))
        except ValueError:  # a trial of an older space
            continue
        if config is not None:
            done.append((trial, config))
    chosen = [c for _, c in done[:top]]
    families = sorted({f for t, _ in done for f in t.user_attrs.get("family_ratio", {})})
    for family in families:
        scored = [(t, c) for t, c in done if family in t.user_attrs.get("family_ratio", {})]
        if scored:
            chosen.append(min(scored, key=lambda tc: tc[0].user_attrs["family_ratio"][family])[1])
    configs = [c for c in (usable(FastTreeConfig()), usable(best)) if c is not None] + chosen
    return tuple(dict.fromkeys(configs))


def _bucket_study(objective: LatencyObjective, store: BaseStorage, name: str, sampler: Any) -> Study:
    """Open (or create) the bucket's study; a new one gets the defaults, then their one-knob
    neighbours (:func:`~fasttree.tuner.space.neighbour_params`), as its first trials."""
    bucket = objective.bucket
    study, created = open_study(
        store, name, n_objectives=objective.n_objectives, sampler=sampler, fingerprint=objective.fingerprint()
    )
    ensure_defaults(study, default_params(objective.gpu, bucket.group_size, bucket.head_dim), created=created)
    if created:
        for params in neighbour_params(objective.gpu, bucket.group_size, bucket.head_dim):
            study.enqueue_trial(params, user_attrs={"neighbour": True})
    return study


@dataclass(frozen=True)
class _Polished:
    """The config a study's result reports: the best trial's, or a polished one that beats it."""

    config: FastTreeConfig
    predicted_us: float
    moves: list = field(default_factory=list)
    evaluations: int = 0
    start: str = ""  # where the kept polish started ("best trial" or "defaults"), "" for none


def _family_polishes(objective: LatencyObjective, passes: int) -> tuple[FastTreeConfig, ...]:
    """The config a coordinate search from the defaults reaches on each family's steps alone."""
    by_family: dict[str, list[WorkloadStep]] = {}
    for step in objective.steps:
        by_family.setdefault(family_of(step), []).append(step)
    out = []
    for family, steps in sorted(by_family.items()):
        if not any(s.weight > 0 for s in steps):
            continue
        sub = LatencyObjective(steps, objective.model, objective.gpu, objective.bucket, runtime=objective.runtime)
        polish = polish_config(sub, FastTreeConfig(), passes=passes)
        logger.info("%s %s: family polish %.3f of the defaults", objective.bucket.label, family,
                    polish.best_us["total"] / sub.defaults.total_us)  # fmt: skip
        config = runtime_member(polish.config) if objective.runtime else polish.config
        out.append(canonical_config(config, objective.bucket.group_size, objective.bucket.head_dim))
    return tuple(out)


def _polish(objective: LatencyObjective, config: FastTreeConfig, predicted_us: float, passes: int) -> _Polished:
    """Polish from the best trial's config and from the defaults and keep what beats the trial.

    Both starts: TPE's best trials can sit in a worse basin than the defaults' one-knob descent
    reaches (the committed H200 GQA-4 workloads: 4.28 vs 3.98).
    """
    best = _Polished(config, predicted_us)
    evaluations = 0
    starts = [("best trial", config)] + ([("defaults", FastTreeConfig())] if config != FastTreeConfig() else [])
    for label, start in starts:
        polish = polish_config(objective, start, passes=passes)
        evaluations += polish.evaluations
        total = polish.best_us["total"]
        if polish.moves and total < best.predicted_us:
            best = _Polished(polish.config, total, polish.moves, start=label)
    return replace(best, evaluations=evaluations)


def tune_workload(
    records: Iterable[Mapping[str, Any]] | Mapping[Bucket, Sequence[WorkloadStep]],
    model: Predictor,
    gpu: GpuSpec,
    *,
    storage: str | os.PathLike | StorageSpec | BaseStorage | None = None,
    folder: str | os.PathLike = ".",
    base_name: str = "fasttree",
    n_trials: int = 200,
    timeout: float | None = None,
    seed: int | None = 0,
    worker: int = 0,
    worst_step: bool = False,
    progress: bool = False,
    buckets: Iterable[Bucket] | None = None,
    polish_passes: int = 2,
    runtime: bool = False,
    settings: Mapping[str, Any] | None = None,
) -> dict[Bucket, TuneResult]:
    """Tune every bucket of a workload, each in its own study (see :func:`tune_bucket`).

    Parameters
    ----------
    records : iterable of dict, or mapping of Bucket to steps
        Workload trace records, or steps already grouped by :func:`steps_by_bucket`.
    model : Predictor
        The latency model.
    gpu : GpuSpec
        The GPU the model predicts for.
    buckets : iterable of Bucket, optional
        Tune only these (each must be in the workload).
    timeout : float, optional
        Seconds for each bucket.
    storage, folder, base_name, n_trials, seed, worker, worst_step, progress, polish_passes, runtime, settings
        As in :func:`tune_bucket` and :class:`LatencyObjective`.

    Returns
    -------
    dict of Bucket to TuneResult
    """
    grouped = dict(records) if isinstance(records, Mapping) else steps_by_bucket(records)
    chosen = list(grouped) if buckets is None else list(buckets)
    missing = [b.label for b in chosen if b not in grouped]
    if missing:
        raise ValueError(f"buckets {missing} are not in the workload (it has {[b.label for b in grouped]})")
    store = open_storage(storage, folder=folder)
    results: dict[Bucket, TuneResult] = {}
    for bucket in chosen:
        objective = LatencyObjective(grouped[bucket], model, gpu, bucket, worst_step=worst_step, runtime=runtime)
        results[bucket] = tune_bucket(
            objective,
            storage=store,
            base_name=base_name,
            n_trials=n_trials,
            timeout=timeout,
            seed=seed,
            worker=worker,
            progress=progress,
            polish_passes=polish_passes,
            settings=settings,
        )
    return results
