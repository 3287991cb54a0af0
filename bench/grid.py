"""GPU grid search over a subset of the tuner's space, to check how close the tuned export gets.

Issue 6 asks that the tuned config be within 3% of the best config of a grid search
measured on the GPU over the same space, on a subset. The subset here: the buckets of the
export that the held-out workloads use, ``--steps`` evenly spaced decode steps of each
held-out workload (the steps ``fasttree-tune validate`` samples), and the grid
:func:`grid_configs`, a product over the dimensions the tuner's importances rank highest
(values from the profiler's ranges, which are the tuner's). The export's tuned config and
the defaults are measured in the same run.

Score of a config, as the tuner's balanced objective: the mean over workloads of (summed
step time / the defaults' summed step time); the defaults score 1. Every config is checked
against the float64 reference on the first step of every workload (poisoned output, sampled
queries); a wrong result fails the run. Times are CUDA-graph replay medians. Needs a CUDA GPU::

    python -m bench.grid --export docs/tune/export.json --group-size 1 --out docs/tune/grid
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fasttree as ft
from bench.common import environment, write_atomic
from fasttree.export import read_export
from fasttree.toolkit.profiler import TOLERANCE
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.validate import workload_steps
from fasttree.traces import decode_tree, read_traces

log = logging.getLogger("bench.grid")

#: The grid's dimensions: FastTreeConfig fields (pairs given whole) -> values.
GRID: dict[str, Sequence[Any]] = {
    "gamma": (0.1, 1.0),
    "pack_tokens": (0, 512, 1024, 2048),
    "para_threshs1": ((66, 528), (132, 528), (264, 528)),
    "kv_split_sizes": ((1024, 64), (1024, 128)),
    "kv_tile": ((32, 64), (64, 64)),
    "num_stages": ((3, 3), (3, 4)),
}
CHECK_QUERIES = 8


def grid_configs(base: ft.FastTreeConfig | None = None) -> list[ft.FastTreeConfig]:
    """Every combination of :data:`GRID` applied to ``base`` (the defaults when None)."""
    base = ft.FastTreeConfig() if base is None else base
    names = list(GRID)
    return [replace(base, **dict(zip(names, values, strict=True))) for values in itertools.product(*GRID.values())]


def _inputs(tree: ft.KVTree, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool = tree.max_slot + 1
    q = torch.randn(tree.n_queries, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(pool, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def measure_bucket(
    workloads: Mapping[str, list[Mapping[str, Any]]],
    configs: list[ft.FastTreeConfig],
    *,
    budget_s: float,
) -> np.ndarray:
    """Graph-replay medians (us), shape ``(n_configs, n_workloads, n_steps)`` (NaN where a workload has fewer steps)."""
    n_steps = max(len(s) for s in workloads.values())
    times = np.full((len(configs), len(workloads), n_steps), np.nan)
    for w, (name, steps) in enumerate(workloads.items()):
        for s, r in enumerate(steps):
            tree = decode_tree(r["workload"]["tree"])
            hq, hkv, d, dtype = int(r["num_q_heads"]), int(r["num_kv_heads"]), int(r["head_dim"]), str(r["dtype"])
            q, k, v = _inputs(tree, hq, hkv, d, getattr(torch, dtype), seed=1000 * w + s)
            out = torch.empty_like(q)
            rows = None
            if s == 0:
                rng = np.random.default_rng(w)
                rows = np.sort(rng.choice(tree.n_queries, min(tree.n_queries, CHECK_QUERIES), replace=False))
                ref = ft.reference_attention(q, k, v, tree, queries=rows)
            for c, config in enumerate(configs):
                plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
                if rows is not None:
                    out.fill_(float("nan"))
                    ft.tree_attention(q, k, v, plan, out=out)
                    err = ft.max_relative_error(out[torch.as_tensor(rows, device="cuda")], ref)
                    if not (math.isfinite(err) and err <= TOLERANCE[dtype]):
                        raise RuntimeError(f"{name} step {r['workload']['step']}: {config} wrong, error {err:.3g}")
                call = functools.partial(ft.tree_attention, q, k, v, plan, out=out)
                t = graph_time_us(call, calls=10, replays=20, budget_s=budget_s, max_graph_ms=2.0)
                times[c, w, s] = t["median"]
            log.info("%s step %s: %d configs", name, r["workload"]["step"], len(configs))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", required=True, help="the tuned export (fasttree-tune run writes one)")
    p.add_argument("--workloads", nargs="+", default=["traces/workloads_heldout"], help="workload traces")
    p.add_argument("--group-size", type=int, required=True, help="the bucket's GQA ratio")
    p.add_argument("--steps", type=int, default=2, help="steps per workload (evenly spaced)")
    p.add_argument("--budget-s", type=float, default=0.05, help="graph-replay time budget per measurement")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        p.error("the grid search measures on a CUDA GPU and none is visible")
    export = read_export(args.export)
    records = [
        r
        for r in read_traces(args.workloads, kind="workload").records
        if r["num_q_heads"] // r["num_kv_heads"] == args.group_size
    ]
    if not records:
        p.error(f"no workload lines of GQA ratio {args.group_size} in {' '.join(args.workloads)}")
    workloads = workload_steps(records, args.steps)
    r0 = records[0]
    gpu = torch.cuda.get_device_name()
    tuned, _ = export.lookup(gpu=gpu, num_q_heads=r0["num_q_heads"], num_kv_heads=r0["num_kv_heads"],
                             head_dim=r0["head_dim"], dtype=r0["dtype"])  # fmt: skip
    grid = grid_configs()
    configs = [ft.FastTreeConfig(), tuned, *grid]
    t0 = time.perf_counter()
    times = measure_bucket(workloads, configs, budget_s=args.budget_s)
    wall = time.perf_counter() - t0
    totals = np.nansum(times, axis=2)  # (config, workload)
    ratios = totals / totals[0]
    scores = ratios.mean(axis=1)
    best = 2 + int(np.argmin(scores[2:]))
    label = args.label or f"g{args.group_size}"
    doc = {
        "env": environment(gpu=True),
        "group_size": args.group_size,
        "grid": {k: [list(x) if isinstance(x, tuple) else x for x in v] for k, v in GRID.items()},
        "n_grid_configs": len(grid),
        "workloads": {name: [int(r["workload"]["step"]) for r in steps] for name, steps in workloads.items()},
        "n_measurements": int(np.isfinite(times).sum()),
        "wall_s": wall,
        "tuned_config": tuned.to_dict(),
        "best_grid_config": configs[best].to_dict(),
        "score_defaults": float(scores[0]),
        "score_tuned": float(scores[1]),
        "score_best_grid": float(scores[best]),
        "tuned_over_best_grid": float(scores[1] / scores[best]),
        "tuned_rank_among_grid": int((scores[2:] < scores[1]).sum()) + 1,
        "speedup_tuned_by_workload": dict(zip(workloads, (1 / ratios[1]).tolist(), strict=True)),
        "speedup_best_grid_by_workload": dict(zip(workloads, (1 / ratios[best]).tolist(), strict=True)),
        "scores": scores.tolist(),
        "times_us": times.tolist(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"grid_{label}.json", json.dumps(doc, indent=1) + "\n")
    print(
        f"{gpu} g{args.group_size}: {len(grid)} grid configs x {doc['n_measurements'] // len(configs)} steps "
        f"in {wall:.0f} s; score defaults 1.000, tuned {scores[1]:.4f}, best grid {scores[best]:.4f} "
        f"(tuned/best {scores[1] / scores[best]:.4f}, rank {doc['tuned_rank_among_grid']} of {len(grid) + 1})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
