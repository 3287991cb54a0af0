"""Refine an export's configs by timing them on the GPU, on serving-scenario trees.

The Optuna tuner (:mod:`fasttree.tuner`) picks each bucket's config against the learned
latency model, on a CPU. Where that model ranks configs wrongly, the export it writes is
not the fastest config on the GPU. This step runs on the GPU (no Optuna, no model): for
each model shape it starts from the export's entry for that bucket and runs a coordinate
search over the config fields, timing :class:`fasttree.runtime.TreeAttentionRuntime` by
CUDA-graph replay on trees of the serving scenarios, and writes a new export whose entries
carry the measured gain in their provenance. Entries of other buckets are copied unchanged.

The trees come from :func:`fasttree.workloads.iter_serving` with ``--seed`` (default 1),
so a search does not see the trees of the decode benchmark (``bench.decode`` uses seed 0).

Objective: the geometric mean over scenarios of (summed time of the scenario's trees) /
(the same for the starting config). A move is kept when it lowers the objective by more
than ``--min-gain``; the search stops after ``--passes`` passes or a pass without a move.

    python -m bench.tune_measured --models llama,mistral --out docs/tune/export_measured.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fasttree as ft
from bench.common import environment
from bench.decode import MODELS, ModelSpec
from fasttree.export import ConfigExport, ExportEntry, read_export, write_export
from fasttree.runtime import TreeAttentionRuntime
from fasttree.workloads import SCENARIOS, iter_serving

log = logging.getLogger("bench.tune_measured")

#: Options tried for each coordinate: a scalar field, or one side ``(field, index)`` of a pair.
COORDINATES: dict[str | tuple[str, int], tuple[Any, ...]] = {
    ("kv_split_sizes", 0): (256, 384, 512, 768, 1024, 2048),
    ("kv_split_sizes", 1): (32, 64, 128, 256),
    "pack_tokens": (0, 256, 512, 768, 1024, 2048),
    "pack_min_units": (132, 264, 528),
    ("num_warps", 0): (4, 8),
    ("num_warps", 1): (2, 4, 8),
    ("num_stages", 0): (2, 3, 4),
    ("num_stages", 1): (2, 3, 4),
    ("kv_tile", 0): (32, 64, 128),
    ("kv_tile", 1): (32, 64, 128),
    "gamma": (-10.0, 0.1, 0.5, 2.0, 10.0),
    "para_threshs1": ((66, 264), (132, 528), (264, 1056)),
}

#: A timer: ``(runtime, q, k, v, out) -> us`` for one planned forward call.
Timer = Callable[[TreeAttentionRuntime, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], float]


def coordinate_name(coord: str | tuple[str, int]) -> str:
    """``"gamma"`` or ``"kv_split_sizes[0]"``."""
    return coord if isinstance(coord, str) else f"{coord[0]}[{coord[1]}]"


def with_value(config: ft.FastTreeConfig, coord: str | tuple[str, int], value: Any) -> ft.FastTreeConfig:
    """``config`` with one coordinate set (``ValueError`` when the result is not a valid config)."""
    if isinstance(coord, str):
        return dataclasses.replace(config, **{coord: value})
    name, i = coord
    pair = list(getattr(config, name))
    pair[i] = value
    return dataclasses.replace(config, **{name: tuple(pair)})


def graph_timer(rt: TreeAttentionRuntime, q, k, v, out) -> float:
    """GPU time (us) of one ``rt.forward`` call by CUDA-graph replay (median)."""
    from fasttree.timing import graph_time_us

    return graph_time_us(lambda: rt.forward(q, k, v, out=out), budget_s=0.1)["median"]


@dataclasses.dataclass
class Workload:
    """The search trees of one model shape, by scenario, with inputs sized for all of them."""

    spec: ModelSpec
    trees: dict[str, list[ft.KVTree]]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def rows(self) -> int:
        return self.q.shape[0]


def make_workload(
    spec: ModelSpec, scenarios: list[str], *, seed: int, steps: int, trees: int, dtype, device
) -> Workload:
    """``trees`` evenly spaced steps of each scenario's first ``steps`` and random q/K/V."""
    by_scenario = {}
    for name in scenarios:
        served = list(iter_serving(name, seed=seed, steps=steps))
        picks = np.unique(np.linspace(len(served) // 4, len(served) - 1, trees).round().astype(int))
        by_scenario[name] = [served[i].tree for i in picks]
    every = [t for ts in by_scenario.values() for t in ts]
    rows = max(t.n_queries for t in every)
    slots = max(t.max_slot + 1 for t in every)
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    return Workload(spec, by_scenario, rand(rows, hq, d), rand(slots, hkv, d), rand(slots, hkv, d))


def measure(config: ft.FastTreeConfig, work: Workload, timer: Timer) -> dict[str, float]:
    """Summed time (us) of each scenario's trees under ``config``."""
    spec = work.spec
    rt = TreeAttentionRuntime(
        config,
        num_q_heads=spec.num_q_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=work.q.dtype,
        device=work.q.device,
        max_queries=work.rows,
        max_kv_entries=8 * work.k.shape[0],
        max_units=1 << 16,
        max_partial_rows=64 * work.rows,
        pool_slots=work.k.shape[0],
    )
    out = torch.empty_like(work.q)
    sums = {}
    for name, trees in work.trees.items():
        total = 0.0
        for tree in trees:
            rt.plan(tree)
            total += timer(rt, work.q, work.k, work.v, out)
        sums[name] = total
    return sums


def objective(sums: dict[str, float], base: dict[str, float]) -> float:
    """Geometric mean over scenarios of the time ratio to ``base``."""
    return math.exp(sum(math.log(sums[s] / base[s]) for s in base) / len(base))


def candidates(config: ft.FastTreeConfig, coord, options) -> Iterator[tuple[Any, ft.FastTreeConfig]]:
    """The valid configs one coordinate away from ``config``, skipping its current value."""
    current = getattr(config, coord) if isinstance(coord, str) else getattr(config, coord[0])[coord[1]]
    for value in options:
        if value == current:
            continue
        try:
            yield value, with_value(config, coord, value)
        except ValueError as exc:
            log.debug("skip %s = %r: %s", coordinate_name(coord), value, exc)


def search(
    start: ft.FastTreeConfig,
    work: Workload,
    *,
    timer: Timer,
    coordinates: dict | None = None,
    passes: int = 2,
    min_gain: float = 0.015,
) -> dict[str, Any]:
    """Coordinate search from ``start``; returns the best config and the search record.

    Returns
    -------
    dict
        ``config`` (FastTreeConfig), ``base`` and ``best`` (summed us per scenario),
        ``objective`` (best / base geomean), ``evaluations`` and ``moves``
        (``[coordinate, value, objective]`` in order).
    """
    coordinates = COORDINATES if coordinates is None else coordinates
    base = measure(start, work, timer)
    best, best_sums, best_obj = start, base, 1.0
    evaluations, moves = 1, []
    for p in range(passes):
        moved = False
        for coord, options in coordinates.items():
            for value, config in candidates(best, coord, options):
                try:
                    sums = measure(config, work, timer)
                except Exception as exc:  # a launch the GPU cannot run (shared memory, registers)
                    log.info("  %s = %r failed: %s", coordinate_name(coord), value, str(exc).splitlines()[0])
                    continue
                evaluations += 1
                obj = objective(sums, base)
                log.info("  pass %d %s = %r: %.4f (best %.4f)", p, coordinate_name(coord), value, obj, best_obj)
                if obj < best_obj * (1 - min_gain):
                    best, best_sums, best_obj, moved = config, sums, obj, True
                    moves.append([coordinate_name(coord), value, obj])
                    log.info("  -> keep %s = %r", coordinate_name(coord), value)
        if not moved:
            break
    return {
        "config": best,
        "base": base,
        "best": best_sums,
        "objective": best_obj,
        "evaluations": evaluations,
        "moves": moves,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tune_measured", description=__doc__.split("\n\n")[0])
    p.add_argument("--export", type=Path, default=Path("docs/tune/export.json"), help="the starting export")
    p.add_argument("--out", type=Path, required=True, help="the refined export to write (must not exist)")
    p.add_argument("--models", default="llama,mistral", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of serving scenarios")
    p.add_argument("--seed", type=int, default=1, help="iter_serving seed (bench.decode uses 0)")
    p.add_argument("--steps", type=int, default=48, help="serving steps simulated per scenario")
    p.add_argument("--trees", type=int, default=3, help="trees per scenario, evenly spaced over the steps")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--min-gain", type=float, default=0.015, help="relative gain a move must bring")
    p.add_argument(
        "--fields", default=None, help="comma list of coordinates to search (e.g. pack_tokens,kv_split_sizes[0])"
    )
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for s in args.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    if args.out.exists():
        p.error(f"{args.out} exists; choose another path")
    if min(args.trees, args.passes, args.steps) < 1:
        p.error("--trees, --passes and --steps must be >= 1")
    names = {coordinate_name(c): c for c in COORDINATES}
    if args.fields is not None:
        unknown = [f for f in args.fields.split(",") if f not in names]
        if unknown:
            p.error(f"unknown fields {unknown}; choose from {', '.join(names)}")
        args.fields = {names[f]: COORDINATES[names[f]] for f in args.fields.split(",")}
    return args


def main(argv: list[str] | None = None, *, timer: Timer | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    timer = timer or graph_timer
    dtype = getattr(torch, args.dtype)
    start_export = read_export(args.export)
    entries = {(e.gpu, *e.bucket): e for e in start_export.entries}
    for name in args.models:
        spec = MODELS[name]
        start, entry = start_export.lookup(
            gpu=gpu, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype
        )
        t0 = time.perf_counter()
        work = make_workload(
            spec, args.scenarios, seed=args.seed, steps=args.steps, trees=args.trees, dtype=dtype, device=device
        )
        log.info("%s: %s trees per scenario from %s", name, args.trees, "its export entry" if entry else "defaults")
        found = search(start, work, timer=timer, coordinates=args.fields, passes=args.passes, min_gain=args.min_gain)
        seconds = time.perf_counter() - t0
        group = spec.num_q_heads // spec.num_kv_heads
        provenance = {
            "method": "bench.tune_measured: coordinate search timed by CUDA-graph replay",
            "started_from": "export entry" if entry else "FastTreeConfig defaults",
            "start_provenance": dict(entry.provenance) if entry else {},
            "start_config": start.to_dict(),
            "model": spec.name,
            "scenarios": args.scenarios,
            "seed": args.seed,
            "trees_per_scenario": args.trees,
            "measured_start_us": found["base"],
            "measured_tuned_us": found["best"],
            "measured_objective": found["objective"],
            "evaluations": found["evaluations"],
            "moves": found["moves"],
            "search_seconds": round(seconds, 1),
        }
        new = ExportEntry(gpu, group, spec.head_dim, args.dtype, found["config"], provenance)
        entries[(gpu, *new.bucket)] = new
        log.info(
            "%s: objective %.4f after %d evaluations in %.0f s; moves %s",
            name, found["objective"], found["evaluations"], seconds, found["moves"],
        )  # fmt: skip
    env = environment(gpu=device.type == "cuda")
    export = ConfigExport(
        tuple(entries.values()),
        {**start_export.provenance, "refined_by": "bench.tune_measured", "refined_from": str(args.export),
         "refine_env": {k: str(v) for k, v in env.items()}},
    )  # fmt: skip
    write_export(args.out, export)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
