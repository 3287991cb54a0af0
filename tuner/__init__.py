"""Optuna tuner of fasttree configs against the learned latency model (installed as ``fasttree.tuner``).

Modules, each with one job:

* :mod:`~fasttree.tuner.space` -- the search space (the profiler's ranges), buckets, the
  shared-memory estimate that prunes invalid configs, the defaults as trial parameters.
* :mod:`~fasttree.tuner.objective` -- a bucket's workload steps -> predicted latency of a
  config (real planner, one batched model prediction per trial).
* :mod:`~fasttree.tuner.storage` -- a ``--storage`` argument -> an Optuna storage (SQLite
  file, journal file or database URL).
* :mod:`~fasttree.tuner.study` -- create or join a bucket's study, run it to a number of
  complete trials (resumable, many workers), best config and parameter importances.
* :mod:`~fasttree.tuner.polish` -- a coordinate search on the same objective from the best
  trial's config (what TPE's sampling can step over).
* :mod:`~fasttree.tuner.portfolio` -- a bucket's portfolio of candidate configs and the selector
  that picks one per tree, chosen together on the model's predictions.
* :mod:`~fasttree.tuner.pipeline` -- every (bucket, target) job of ``fasttree-tune run``: study,
  candidates, portfolio, in parallel processes.

Needs Optuna and scikit-learn (the ``tune`` extra).
"""

from .objective import (
    Evaluation,
    LatencyObjective,
    PlanningError,
    WorkloadStep,
    balance_families,
    family_of,
    runtime_member,
    steps_by_bucket,
    thin_steps,
    workload_of,
)
from .polish import polish_config
from .space import (
    Bucket,
    config_from_params,
    config_smem_bytes,
    default_params,
    invalid_reason,
    plan_smem_bytes,
    search_space,
    suggest_config,
    units_kernel_smem_bytes,
)
from .storage import StorageSpec, open_storage, parse_storage
from .study import (
    TuneResult,
    ensure_defaults,
    make_sampler,
    open_study,
    param_importances,
    run_trials,
    study_name,
    tune_bucket,
    tune_workload,
)

__all__ = [
    "Bucket",
    "Evaluation",
    "LatencyObjective",
    "PlanningError",
    "StorageSpec",
    "TuneResult",
    "WorkloadStep",
    "balance_families",
    "config_from_params",
    "config_smem_bytes",
    "default_params",
    "ensure_defaults",
    "family_of",
    "invalid_reason",
    "make_sampler",
    "open_storage",
    "open_study",
    "param_importances",
    "parse_storage",
    "plan_smem_bytes",
    "polish_config",
    "run_trials",
    "runtime_member",
    "search_space",
    "steps_by_bucket",
    "study_name",
    "suggest_config",
    "thin_steps",
    "tune_bucket",
    "tune_workload",
    "units_kernel_smem_bytes",
    "workload_of",
]
