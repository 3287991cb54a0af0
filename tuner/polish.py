"""Polish a tuned config by a coordinate search on the tuner's own objective.

The study's TPE sampler can stay next to a good trial without trying its one-knob
neighbours: a coordinate search over :data:`MODEL_COORDINATES` (values the profiling design
measured) on the same objective finds configs the study missed in tens of evaluations (seconds
on one core). Its configs are portfolio candidates; what they are worth on the GPU is
``fasttree-tune validate``'s to say (``docs/tune/validation.md``).

:func:`fasttree.tuner.tune_bucket` polishes from the best trial and from the defaults and keeps
the best: in a fresh ``fasttree-tune run`` (seed 0, 250 trials per bucket) the best trials of
the GQA-1 and GQA-4 studies sat in worse basins (4.554 and 4.400) than the defaults' descent
reached (4.519 and 3.983), and polishing the next four trials changed nothing.
"""

from __future__ import annotations

from typing import Any

from fasttree.config import FastTreeConfig
from fasttree.toolkit.design import (
    GAMMA_RANGE,
    KV_TILES,
    NUM_STAGES,
    NUM_WARPS,
    PACK_TOKENS,
    SPLITS_LARGE,
    SPLITS_SMALL,
)
from fasttree.toolkit.refine import SearchResult, coordinate_search

from .objective import LatencyObjective, PlanningError
from .space import invalid_reason

__all__ = ["MODEL_COORDINATES", "polish_config"]

#: What the polish tries per coordinate: only values the profiling design measured (the latency
#: model extrapolates elsewhere: the GPU search of ``fasttree-tune refine`` goes wider).
MODEL_COORDINATES: dict[Any, tuple[Any, ...]] = {
    ("kv_split_sizes", 0): SPLITS_LARGE,
    ("kv_split_sizes", 1): SPLITS_SMALL,
    "pack_tokens": PACK_TOKENS,
    "pack_min_units": (132, 264, 528),
    ("num_warps", 0): tuple(w for w in NUM_WARPS if w >= 4),
    ("num_warps", 1): NUM_WARPS,
    ("num_stages", 0): tuple(s for s in NUM_STAGES if s >= 2),
    ("num_stages", 1): tuple(s for s in NUM_STAGES if s >= 2),
    ("kv_tile", 0): tuple(k for k in KV_TILES if k >= 32),
    ("kv_tile", 1): tuple(k for k in KV_TILES if k >= 32),
    "gamma": tuple(g for g in (-1.0, 0.1, 0.5, 1.0, 2.0) if GAMMA_RANGE[0] <= g <= GAMMA_RANGE[1]),
    "para_threshs1": ((66, 264), (132, 528), (264, 1056)),
}


class _InvalidConfigError(Exception):
    """A config the bucket's kernel cannot run (tile rows, shared memory)."""


def polish_config(
    objective: LatencyObjective,
    start: FastTreeConfig,
    *,
    passes: int = 2,
    min_gain: float = 0.002,
    coordinates: dict[Any, tuple[Any, ...]] | None = None,
) -> SearchResult:
    """Coordinate search from ``start`` on ``objective``'s predicted weighted total.

    Candidates the bucket cannot run (:func:`~fasttree.tuner.space.invalid_reason`) or the
    planner rejects are skipped and listed in the result's ``failed``.

    Parameters
    ----------
    objective : LatencyObjective
        A single-objective bucket objective.
    start : FastTreeConfig
        Usually the study's best trial's config.
    passes, min_gain, coordinates
        See :func:`fasttree.toolkit.refine.coordinate_search`; the coordinates default to
        :data:`MODEL_COORDINATES`.

    Returns
    -------
    fasttree.toolkit.refine.SearchResult
        ``best_us["total"]`` is the polished config's predicted weighted total.
    """
    if objective.n_objectives != 1:
        raise ValueError("polish_config needs a single-objective LatencyObjective")

    def measure(config: FastTreeConfig) -> dict[str, float]:
        reason = invalid_reason(config, objective.bucket, objective.gpu)
        if reason is not None:
            raise _InvalidConfigError(reason)
        return {"total": objective.evaluate(config).total_us}

    return coordinate_search(
        start,
        measure,
        coordinates=MODEL_COORDINATES if coordinates is None else coordinates,
        passes=passes,
        min_gain=min_gain,
        skip_errors=(_InvalidConfigError, PlanningError),
        group_size=objective.bucket.group_size,
        head_dim=objective.bucket.head_dim,
    )
