"""Refine an export's configs by timing them on the GPU (``fasttree-tune refine``).

The tuner (:mod:`fasttree.tuner`) picks each bucket's config against the learned latency
model, on a CPU. Where the model ranks configs wrongly, the export it writes is not the
fastest config on the GPU (on the serving scenarios' trees the H200's best measured configs
took 0.70-0.95x the tuned ones' time; ``docs/results/costmodel_decode_check.md``). This
module closes that gap on the GPU machine, without Optuna or a model: for one bucket it
starts from the export's config and runs a coordinate search over the config fields
(:data:`COORDINATES`), timing :class:`fasttree.runtime.TreeAttentionRuntime` -- the serving
path -- by CUDA-graph replay on the bucket's workload trees.

Objective: the geometric mean over workloads of (summed time of the workload's trees) /
(the same for the starting config), so a long workload does not drown the others. A move
is kept when it lowers the objective by more than ``min_gain``; the search stops after
``passes`` passes or a pass without a move.

Imports torch, numpy and fasttree only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from triton.runtime.errors import OutOfResources

from ..config import FastTreeConfig
from ..runtime import TreeAttentionRuntime
from ..tree import KVTree
from ..validation import check_int, check_number

__all__ = [
    "COORDINATES",
    "RuntimeBench",
    "SearchResult",
    "coordinate_name",
    "coordinate_search",
    "graph_timer",
    "parse_fields",
    "search_provenance",
]

logger = logging.getLogger(__name__)

#: Options tried for each coordinate: a scalar field, or one side ``(field, index)`` of a pair.
COORDINATES: dict[str | tuple[str, int], tuple[Any, ...]] = {
    ("kv_split_sizes", 0): (256, 384, 512, 768, 1024, 2048),
    ("kv_split_sizes", 1): (32, 64, 128, 256),
    "pack_tokens": (0, 256, 512, 768, 1024, 2048),
    "pack_min_units": (132, 264, 528),
    ("num_warps", 0): (4, 8),
    ("num_warps", 1): (2, 4, 8),
    ("num_stages", 0): (2, 3, 4, 5),  # 64-row tiles: a second K/V buffer from 5 stages (82 -> 115 KB)
    # 16-row tiles pipeline their gathered K/V through shared memory only from 5 stages on
    # (Triton 3.6 on sm_90 gives the indirect loads one buffer at 2-4 stages, two at 5-6, three at 7-8): on the
    # H200's Llama serving trees 6 stages took 4-8% off stage 1 (docs/history.md)
    ("num_stages", 1): (2, 3, 4, 5, 6, 8),
    ("kv_tile", 0): (32, 64, 128),
    ("kv_tile", 1): (32, 64, 128),
    "gamma": (-10.0, 0.1, 0.5, 2.0, 10.0),
    "para_threshs1": ((66, 264), (132, 528), (264, 1056)),
}

#: ``(runtime, q, k_cache, v_cache, out) -> us``: the time of one planned ``runtime.forward``.
Timer = Callable[[TreeAttentionRuntime, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], float]


def coordinate_name(coord: str | tuple[str, int]) -> str:
    """``"gamma"`` or ``"kv_split_sizes[0]"``."""
    return coord if isinstance(coord, str) else f"{coord[0]}[{coord[1]}]"


def parse_fields(text: str) -> dict[str | tuple[str, int], tuple[Any, ...]]:
    """The coordinates named in a comma list such as ``"pack_tokens,kv_split_sizes[0]"``.

    Raises
    ------
    ValueError
        On an empty list or an unknown name (the message lists the known ones).
    """
    names = {coordinate_name(c): c for c in COORDINATES}
    fields = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in fields if f not in names]
    if unknown or not fields:
        raise ValueError(f"unknown or no fields {unknown or text!r}; choose from {', '.join(names)}")
    return {names[f]: COORDINATES[names[f]] for f in fields}


def _field(coord: str | tuple[str, int]) -> str:
    """The config field a coordinate sets."""
    return coord if isinstance(coord, str) else coord[0]


def _with_value(config: FastTreeConfig, coord: str | tuple[str, int], value: Any) -> FastTreeConfig:
    """``config`` with one coordinate set (``ValueError`` when that is not a valid config)."""
    if isinstance(coord, str):
        return dataclasses.replace(config, **{coord: value})
    name, i = coord
    pair = list(getattr(config, name))
    pair[i] = value
    return dataclasses.replace(config, **{name: tuple(pair)})


def _candidates(config: FastTreeConfig, coord, options) -> Iterator[tuple[Any, FastTreeConfig]]:
    """The valid configs one coordinate away from ``config``, skipping its current value."""
    current = getattr(config, coord) if isinstance(coord, str) else getattr(config, coord[0])[coord[1]]
    for value in options:
        if value == current:
            continue
        try:
            yield value, _with_value(config, coord, value)
        except ValueError as exc:
            logger.debug("skip %s = %r: %s", coordinate_name(coord), value, exc)


def _objective(sums: Mapping[str, float], base: Mapping[str, float]) -> float:
    """Geometric mean over workloads of the time ratio to ``base``."""
    return math.exp(sum(math.log(sums[w] / base[w]) for w in base) / len(base))


@dataclasses.dataclass
class SearchResult:
    """What :func:`coordinate_search` found.

    Attributes
    ----------
    config : FastTreeConfig
        The best config (the start when no move gained enough).
    start_us, best_us : dict of str to float
        Summed time per workload of the start and the best config (us).
    objective : float
        Geometric mean of ``best_us / start_us`` over workloads (<= 1).
    evaluations : int
        Configs measured, the start included.
    moves : list
        ``[coordinate, value, objective]`` of every kept move, in order.
    failed : list
        ``[coordinate, value, error]`` of configs the GPU could not run (too much shared memory).
    """

    config: FastTreeConfig
    start_us: dict[str, float]
    best_us: dict[str, float]
    objective: float
    evaluations: int
    moves: list = dataclasses.field(default_factory=list)
    failed: list = dataclasses.field(default_factory=list)


def coordinate_search(
    start: FastTreeConfig,
    measure: Callable[[FastTreeConfig], Mapping[str, float]],
    *,
    coordinates: Mapping | None = None,
    passes: int = 2,
    min_gain: float = 0.015,
    skip_errors: tuple[type[BaseException], ...] = (OutOfResources, RuntimeError),
    group_size: int | None = None,
    head_dim: int | None = None,
) -> SearchResult:
    """Coordinate search from ``start``.

    Parameters
    ----------
    start : FastTreeConfig
        A ``num_warps=None`` start (warps derived from the GQA ratio) searches warps from its
        :meth:`~fasttree.FastTreeConfig.launch_warps` for ``group_size``; a ``num_stages=None``
        one searches stages from its :meth:`~fasttree.FastTreeConfig.launch_stages` for
        ``group_size`` and ``head_dim``.
    measure : callable
        ``config -> {workload: summed us}``; the same workloads on every call. A
        :class:`RuntimeBench` also gives the GQA ratio and head dim when ``group_size`` or
        ``head_dim`` is None.
    coordinates : mapping, optional
        Coordinate -> options (default :data:`COORDINATES`), tried in this order every pass.
    passes : int
        At most this many passes (>= 1).
    min_gain : float
        A move is kept when it lowers the objective by more than this fraction (in [0, 1)).
    skip_errors : tuple of exception types
        Errors of ``measure`` that mean "this config cannot run here" (recorded in ``failed``
        and skipped); the default covers launches the GPU refuses. Other errors propagate.
    group_size : int, optional
        GQA ratio of the workloads (``num_q_heads // num_kv_heads``).
    head_dim : int, optional
        Head dim of the workloads.
    """
    passes = check_int("passes", passes, minimum=1)
    min_gain = check_number("min_gain", min_gain, minimum=0, below=1)
    coordinates = COORDINATES if coordinates is None else coordinates
    g = group_size if group_size is not None else getattr(measure, "group_size", None)
    d = head_dim if head_dim is not None else getattr(measure, "head_dim", None)
    if start.num_warps is None and any(_field(c) == "num_warps" for c in coordinates):
        if g is None:
            raise ValueError("start has num_warps=None (derived from the GQA ratio): pass group_size")
        start = dataclasses.replace(start, num_warps=start.launch_warps(g))
    if start.num_stages is None and any(_field(c) == "num_stages" for c in coordinates):
        if g is None or d is None:
            raise ValueError("start has num_stages=None (derived from the GQA ratio and head dim): pass "
                             "group_size and head_dim")  # fmt: skip
        start = dataclasses.replace(start, num_stages=start.launch_stages(g, d))
    base = dict(measure(start))
    if not base or min(base.values()) <= 0:
        raise ValueError(f"measure(start) must give positive times per workload, got {base}")
    result = SearchResult(start, base, base, 1.0, 1)
    for p in range(passes):
        moved = False
        for coord, options in coordinates.items():
            name = coordinate_name(coord)
            for value, config in _candidates(result.config, coord, options):
                try:
                    sums = dict(measure(config))
                except skip_errors as exc:  # e.g. a launch the GPU cannot run (shared memory, registers)
                    first = (str(exc).splitlines() or [type(exc).__name__])[0]
                    logger.debug("  %s = %r failed: %s", name, value, first)
                    result.failed.append([name, value, first])
                    continue
                result.evaluations += 1
                obj = _objective(sums, base)
                logger.debug("  pass %d %s = %r: %.4f (best %.4f)", p, name, value, obj, result.objective)
                if obj < result.objective * (1 - min_gain):
                    result.config, result.best_us, result.objective, moved = config, sums, obj, True
                    result.moves.append([name, value, obj])
                    logger.info("  pass %d: keep %s = %r (objective %.4f)", p, name, value, obj)
        if not moved:
            break
    return result


def graph_timer(rt: TreeAttentionRuntime, q, k_cache, v_cache, out) -> float:
    """GPU time (us) of one ``rt.forward`` call: median of CUDA-graph replays."""
    from .timing import graph_time_us

    return graph_time_us(lambda: rt.forward(q, k_cache, v_cache, out=out), budget_s=0.1)["median"]


graph_timer.needs_cuda = True  # type: ignore[attr-defined]  # CUDA-graph replay: 'refine' checks for a GPU first


class RuntimeBench:
    """The trees of one bucket's workloads and inputs sized for all of them; measures configs.

    Parameters
    ----------
    trees : mapping of str to sequence of KVTree
        Workload name -> its trees (at least one workload, each with at least one tree).
    num_q_heads, num_kv_heads, head_dim : int
    dtype : torch.dtype
    device : torch.device or str
    timer : callable, optional
        :data:`Timer`; default :func:`graph_timer` (CUDA).
    seed : int
        Seed of the random q, k_cache and v_cache (N(0, 1)).
    """

    def __init__(
        self,
        trees: Mapping[str, Sequence[KVTree]],
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        timer: Timer | None = None,
        seed: int = 0,
    ) -> None:
        self.trees = {name: list(ts) for name, ts in trees.items()}
        if not self.trees or any(not ts for ts in self.trees.values()):
            raise ValueError("RuntimeBench needs at least one workload, each with at least one tree")
        self.heads = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        self.group_size = num_q_heads // num_kv_heads
        self.head_dim = head_dim
        every = [t for ts in self.trees.values() for t in ts]
        self.rows = max(t.n_queries for t in every)
        self.slots = max(t.max_slot + 1 for t in every)
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        self.q = rand(self.rows, num_q_heads, head_dim)
        self.k = rand(self.slots, num_kv_heads, head_dim)
        self.v = rand(self.slots, num_kv_heads, head_dim)
        self.out = torch.empty_like(self.q)
        self.timer = timer or graph_timer

    def __call__(self, config: FastTreeConfig) -> dict[str, float]:
        """Summed time (us) of each workload's trees under ``config``."""
        return {name: sum(times) for name, times in self.times(config).items()}

    def times(self, config: FastTreeConfig) -> dict[str, list[float]]:
        """Time (us) of each workload's trees, in order, under ``config``."""
        rt = TreeAttentionRuntime(
            config,
            **self.heads,
            dtype=self.q.dtype,
            device=self.q.device,
            max_queries=self.rows,
            max_kv_entries=8 * self.slots,
            max_units=1 << 16,
            max_partial_rows=64 * self.rows,
            pool_slots=self.slots,
            extend_steps=0,  # every tree planned with the config under test
        )
        out = {}
        for name, trees in self.trees.items():
            out[name] = []
            for tree in trees:
                rt.plan(tree)
                out[name].append(self.timer(rt, self.q, self.k, self.v, self.out))
        return out


def search_provenance(
    method: str, start: FastTreeConfig, entry: Any, found: SearchResult, seconds: float
) -> dict[str, Any]:
    """The provenance of an export entry written from a search: where it started and what it measured.

    ``entry`` is the export entry the search started from (None: the defaults).
    """
    return {
        "method": method,
        "started_from": "export entry" if entry else "FastTreeConfig defaults",
        "start_provenance": dict(entry.provenance) if entry else {},
        "start_config": start.to_dict(),
        "measured_start_us": found.start_us,
        "measured_tuned_us": found.best_us,
        "measured_objective": found.objective,
        "evaluations": found.evaluations,
        "moves": found.moves,
        "search_seconds": round(seconds, 1),
    }
