"""Refine an export's configs by timing them on the GPU, on serving-scenario trees.

The Optuna tuner (:mod:`fasttree.tuner`) picks each bucket's config against the learned
latency model, on a CPU. Where that model ranks configs wrongly, the export it writes is
not the fastest config on the GPU. This step runs on the GPU (no Optuna, no model): for
each model shape it starts from the export's entry for that bucket and runs a coordinate
search over the config fields, timing :class:`fasttree.runtime.TreeAttentionRuntime` by
CUDA-graph replay on trees of the serving scenarios, and writes a new export whose entries
carry the measured gain in their provenance. Entries of other buckets are copied unchanged.

The refined entries are ``runtime`` entries of export format 3: a portfolio of the defaults
(member 0) and the refined config (member 1), whose selector picks member 1 for every tree inside
the region of the searched trees (their feature box at the model's head layout; the defaults
elsewhere), and the guard of the installed kernels and defaults. A runtime portfolio's members share the launch
fields (:data:`fasttree.portfolio.LAUNCH_FIELDS`), so a refined config whose launch fields left
the defaults' keeps only its plan-level changes (the dropped values are logged and recorded in
the provenance); when nothing else moved, no entry is written for the bucket. The search starts
from the start export's runtime entry for the bucket, its last portfolio member (a version-1
entry's one config). Entries of the start export that format 3 cannot hold (version-1 entries,
and version-2 entries whose selector names tuned members without regions of evidence) are not
copied (re-tune or re-confirm those buckets).
The search and the measurement are :mod:`fasttree.toolkit.refine`'s (``fasttree-tune refine`` runs
them on workload traces); this script feeds them the serving scenarios' trees.

The trees come from :func:`fasttree.toolkit.workloads.iter_serving` with ``--seed`` (default 1),
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
import sys
import time
from pathlib import Path

import numpy as np
import torch

import fasttree as ft
from bench.decode import MODELS
from fasttree.export import ConfigExport, ExportEntry, ExportGuard, read_export, write_export
from fasttree.portfolio import LAUNCH_FIELDS, LeafRegion, Portfolio, Selector, head_layout
from fasttree.toolkit.bench_common import environment
from fasttree.toolkit.refine import RuntimeBench, Timer, coordinate_search, parse_fields, search_provenance
from fasttree.toolkit.workloads import SCENARIOS, iter_serving

log = logging.getLogger("bench.tune_measured")

#: The refined entries' selector: member 1, the refined config, for every tree.
REFINED_MEMBER = Selector(member=(1,))


def runtime_member(config: ft.FastTreeConfig) -> tuple[ft.FastTreeConfig | None, dict]:
    """``config`` as member 1 of a runtime portfolio whose member 0 is ``FastTreeConfig()``.

    Returns the member (``config`` with the defaults' launch fields; None when nothing else
    differs from the defaults) and the launch fields that were dropped, ``{field: value}``.
    """
    defaults = ft.FastTreeConfig()
    dropped = {f: getattr(config, f) for f in LAUNCH_FIELDS if getattr(config, f) != getattr(defaults, f)}
    if not dropped:
        return config, {}
    member = dataclasses.replace(config, **{f: getattr(defaults, f) for f in dropped})
    return (None if member == defaults else member), dropped


def serving_trees(scenarios: list[str], *, seed: int, steps: int, trees: int) -> dict[str, list[ft.KVTree]]:
    """``trees`` evenly spaced steps of each scenario's first ``steps`` (from the second quarter on)."""
    by_scenario = {}
    for name in scenarios:
        served = list(iter_serving(name, seed=seed, steps=steps))
        picks = np.unique(np.linspace(len(served) // 4, len(served) - 1, trees).round().astype(int))
        by_scenario[name] = [served[i].tree for i in picks]
    return by_scenario


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
    if args.fields is not None:
        try:
            args.fields = parse_fields(args.fields)
        except ValueError as exc:
            p.error(str(exc))
    return args


def main(argv: list[str] | None = None, *, timer: Timer | None = None) -> int:
    """Entry point; ``timer`` replaces the graph-replay timer (tests)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    start_export = read_export(args.export)
    entries = {(e.gpu, *e.bucket, e.target): e for e in start_export.entries if e.write_problem() is None}
    for e in start_export.entries:
        if e.write_problem() is not None:
            log.info("not copied: the entry for %r bucket %s %s: %s", e.gpu, e.bucket, e.target, e.write_problem())
    for name in args.models:
        spec = MODELS[name]
        portfolio, entry = start_export.lookup(
            gpu=gpu, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype,
            target="runtime",
        )  # fmt: skip
        # the search refines one config: the runtime portfolio's last member (a version-1 entry's one
        # config; the defaults when the export has no runtime entry for the bucket)
        start = portfolio.members[-1]
        t0 = time.perf_counter()
        trees = serving_trees(args.scenarios, seed=args.seed, steps=args.steps, trees=args.trees)
        heads = {"num_q_heads": spec.num_q_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim}
        bench = RuntimeBench(trees, **heads, dtype=dtype, device=device, timer=timer, seed=args.seed)
        log.info("%s: %s trees per scenario from %s", name, args.trees, "its export entry" if entry else "defaults")
        found = coordinate_search(start, bench, coordinates=args.fields, passes=args.passes, min_gain=args.min_gain)
        seconds = time.perf_counter() - t0
        group = spec.num_q_heads // spec.num_kv_heads
        method = "bench.tune_measured: coordinate search timed by CUDA-graph replay"
        provenance = {
            **search_provenance(method, start, entry, found, seconds),
            "model": spec.name,
            "scenarios": args.scenarios,
            "seed": args.seed,
            "trees_per_scenario": args.trees,
        }
        log.info(
            "%s: objective %.4f after %d evaluations in %.0f s; moves %s",
            name, found.objective, found.evaluations, seconds, found.moves,
        )  # fmt: skip
        member, dropped = runtime_member(found.config)
        if member is None:
            log.info(
                "%s: no entry written: the refined config differs from the defaults only in launch fields %s, "
                "which a runtime portfolio's members share with member 0 (the defaults)", name, dropped,
            )  # fmt: skip
            continue
        if dropped:
            log.info(
                "%s: launch fields %s dropped from the refined config (a runtime portfolio's members share member "
                "0's); the measured times include them", name, dropped,
            )  # fmt: skip
            provenance["launch_fields_dropped"] = dropped
        searched = [t for ts in trees.values() for t in ts]
        region = LeafRegion.of_trees(
            [ft.tree_features(t) for t in searched],
            [head_layout(spec.num_q_heads, spec.num_kv_heads)] * len(searched),
            "measured",
        )
        new = ExportEntry(
            gpu, group, spec.head_dim, args.dtype,
            Portfolio(members=(ft.FastTreeConfig(), member), selector=REFINED_MEMBER, runtime=True,
                      regions=(region,)),
            provenance, target="runtime", guard=ExportGuard.current(),
        )  # fmt: skip
        entries[(gpu, *new.bucket, new.target)] = new
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
