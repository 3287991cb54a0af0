"""Prediction throughput of the latency model, planning included (CPU).

Two samples of (tree, config, heads, head dim, dtype):

* ``heldout``: a fixed sample of the ``ok`` measurements of the held-out traces
  (``traces/h200_heldout``), each re-planned as :func:`fasttree.costmodel.dataset.record_plan`
  does (its tree, heads and config);
* ``tuner``: the tuner's use: one config (the defaults) over every workload tree of the shipped
  workloads (``fasttree/toolkit/data/workloads``) with one head setting (default 32 query / 8 KV
  heads, head dim 128, fp16).

Trees are decoded once per distinct tree before timing (a tuner holds its trees), and the
warm-up pass builds the planner's per-tree index (cached on the tree, as in a tuner that
plans one tree under many configs). For each sample, every stage is timed on the whole
sample with :func:`time.perf_counter`, after one warm-up pass, as the median of
``--repeats`` passes, and reported in plans per second:

* ``plan`` (:func:`fasttree.plan`), ``work`` (:func:`~fasttree.costmodel.work.plan_work`),
  ``simulate``, ``features`` (:func:`~fasttree.costmodel.features.features_of_work`) one
  plan at a time, and ``features_of_plan`` (the three together, as the dataset builds rows);
* ``features_of_plans``: the batched feature path of the same plans;
* ``predict``: one :meth:`LatencyModel.predict` call on the sample's feature matrix, and
  ``predict (1 row)``: one call per row (on the first ``--one-row`` rows);
* ``end to end, one by one``: plan + ``features_of_plan`` per job, one batched predict;
* ``end to end, batched``: :func:`fasttree.costmodel.predict.predict_jobs` in this process;
* ``end to end, N processes``: the same over a :class:`~fasttree.costmodel.predict.PredictPool` of
  ``--workers`` processes (started once, holding the trees; its warm-up pass plans in the workers too).

Outputs ``costmodel_throughput_<label>.json`` and ``.md`` under ``--out`` (atomically) and
prints the markdown table. Run from the repository root::

    python -m bench.costmodel_throughput [--sample 512] [--repeats 5] [--workers 2] [--label cpu]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fasttree.config import FastTreeConfig
from fasttree.costmodel.features import features_of_plan, features_of_plans, features_of_work
from fasttree.costmodel.gpu import GpuSpec, gpu_spec
from fasttree.costmodel.persist import load_model
from fasttree.costmodel.predict import PlanJob, PredictPool, elem_bytes_of, plan_job, predict_jobs
from fasttree.costmodel.simulator import SimParams, simulate
from fasttree.costmodel.work import plan_work
from fasttree.fileio import write_atomic
from fasttree.toolkit import shipped
from fasttree.toolkit.bench_common import environment
from fasttree.traces import decode_tree, read_traces

log = logging.getLogger("bench.costmodel_throughput")

TARGET_PLANS_PER_S = 10_000


def _tree_cache() -> Callable[[dict[str, Any]], Any]:
    cache: dict[str, Any] = {}

    def get(encoded: dict[str, Any]):
        key = json.dumps(encoded, sort_keys=True)
        tree = cache.get(key)
        if tree is None:
            tree = cache[key] = decode_tree(encoded)
        return tree

    return get


def heldout_jobs(paths: list[str], sample: int, seed: int) -> tuple[list[PlanJob], GpuSpec]:
    """A fixed sample of the held-out ``ok`` measurements (first line per key) as jobs."""
    ts = read_traces([Path(p) for p in paths], kind="measurement")
    records = list({r["key"]: r for r in reversed(ts.records) if r["status"] == "ok"}.values())[::-1]
    if not records:
        raise ValueError(f"{paths}: no ok measurements")
    if 0 < sample < len(records):
        keep = np.sort(np.random.default_rng(seed).choice(len(records), size=sample, replace=False))
        records = [records[i] for i in keep]
    tree_of = _tree_cache()
    jobs = [
        PlanJob(
            tree_of(r["workload"]["tree"]),
            FastTreeConfig.from_dict(r["config"]),
            r["num_q_heads"],
            r["num_kv_heads"],
            r["head_dim"],
            r["dtype"],
        )
        for r in records
    ]
    return jobs, gpu_spec(records[0]["env"])


def tuner_jobs(paths: list[str], heads: tuple[int, int, int], dtype: str) -> list[PlanJob]:
    """Every workload tree recorded with ``heads`` (Hq, Hkv, D) and ``dtype``, under the default config."""
    ts = read_traces([Path(p) for p in paths], kind="workload")
    hq, hkv, d = heads
    config = FastTreeConfig()
    tree_of = _tree_cache()
    jobs = [
        PlanJob(tree_of(r["workload"]["tree"]), config, hq, hkv, d, dtype)
        for r in ts.records
        if (r["num_q_heads"], r["num_kv_heads"], r["head_dim"], r["dtype"]) == (hq, hkv, d, dtype)
    ]
    if not jobs:
        raise ValueError(f"{paths}: no workload trees with heads {heads} and dtype {dtype}")
    return jobs


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call, and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def bench_sample(
    name: str, jobs: list[PlanJob], gpu: GpuSpec, model, *, repeats: int, one_row: int, pool: PredictPool | None
) -> dict[str, Any]:
    """Plans per second of every stage on one sample."""
    n = len(jobs)
    eb = [elem_bytes_of(j.dtype) for j in jobs]
    seconds: dict[str, float] = {}
    seconds["plan"], plans = timed(lambda: [plan_job(j) for j in jobs], repeats)
    seconds["work"], works = timed(
        lambda: [plan_work(p, elem_bytes=e) for p, e in zip(plans, eb, strict=True)], repeats
    )
    seconds["simulate"], sims = timed(lambda: [simulate(w, gpu, SimParams()) for w in works], repeats)
    seconds["features"], _ = timed(
        lambda: [features_of_work(w, p.tile_mode, gpu, s) for w, p, s in zip(works, plans, sims, strict=True)], repeats
    )
    seconds["features_of_plan"], rows = timed(
        lambda: [features_of_plan(p, gpu, elem_bytes=e) for p, e in zip(plans, eb, strict=True)], repeats
    )
    seconds["features_of_plans"], X = timed(lambda: features_of_plans(plans, gpu, elem_bytes=eb), repeats)
    if not np.allclose(X, np.stack(rows), rtol=1e-12, atol=0.0):
        raise AssertionError(f"{name}: batched features differ from features_of_plan")
    seconds["predict"], pred = timed(lambda: model.predict(X), repeats)
    k = min(one_row, n)
    t_row, _ = timed(lambda: [model.predict(X[i : i + 1]) for i in range(k)], repeats)
    seconds["predict (1 row)"] = t_row * n / k

    def one_by_one():
        return model.predict(
            np.stack([features_of_plan(plan_job(j), gpu, elem_bytes=e) for j, e in zip(jobs, eb, strict=True)])
        )

    seconds["end to end, one by one"], pred_ref = timed(one_by_one, repeats)
    seconds["end to end, batched"], pred_new = timed(lambda: predict_jobs(model, jobs, gpu), repeats)
    if not np.allclose(pred_new, pred_ref, rtol=1e-12, atol=0.0) or not np.allclose(pred, pred_ref, rtol=1e-12):
        raise AssertionError(f"{name}: batched predictions differ from the one-by-one path")
    if pool is not None:
        key = f"end to end, {pool.workers} processes"
        seconds[key], pred_mp = timed(lambda: predict_jobs(model, jobs, gpu, pool=pool), repeats)
        if not np.allclose(pred_mp, pred_ref, rtol=1e-12, atol=0.0):
            raise AssertionError(f"{name}: multi-process predictions differ")
    # the planner alone by tree size: every job timed on its own (one pass), in node-count quartiles
    each = np.empty(n)
    for i, job in enumerate(jobs):
        t0 = time.perf_counter()
        plan_job(job)
        each[i] = time.perf_counter() - t0
    job_nodes = np.array([j.tree.n_nodes for j in jobs])
    edges = np.unique(np.quantile(job_nodes, [0.0, 0.25, 0.5, 0.75, 1.0]).round().astype(int))
    quartile = np.clip(np.searchsorted(edges, job_nodes, side="right") - 1, 0, max(0, edges.size - 2))
    by_size = [
        {
            "nodes": [int(job_nodes[quartile == q].min()), int(job_nodes[quartile == q].max())],
            "plans": int(np.count_nonzero(quartile == q)),
            "plan_per_s": float(np.count_nonzero(quartile == q) / each[quartile == q].sum()),
            "median_plan_ms": float(np.median(each[quartile == q]) * 1e3),
        }
        for q in np.unique(quartile).tolist()
    ]
    trees = {id(j.tree): j.tree for j in jobs}.values()
    nodes = np.array([t.n_nodes for t in trees])
    queries = np.array([t.n_queries for t in trees])
    kv = np.array([p.kv_indices.size for p in plans])
    row = {
        "sample": name,
        "plans": n,
        "trees": len(nodes),
        "median_nodes": float(np.median(nodes)),
        "max_nodes": int(nodes.max()),
        "median_queries": float(np.median(queries)),
        "median_kv_entries": float(np.median(kv)),
        "seconds": seconds,
        "plans_per_s": {stage: n / s for stage, s in seconds.items()},
        "plan_by_tree_size": by_size,
    }
    for stage, s in seconds.items():
        log.info("%s %-26s %10.0f plans/s", name, stage, n / s)
    return row


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace, load: dict) -> str:
    """One table: stages x samples, in plans per second."""
    stages = list(dict.fromkeys(s for r in rows for s in r["plans_per_s"]))
    head = " | ".join(f"{r['sample']} ({r['plans']} plans)" for r in rows)
    lines = [
        f"# Latency-model prediction throughput, planning included ({args.label})",
        "",
        "Generated by `python -m bench.costmodel_throughput` (CPU); do not edit by hand. Plans per second, "
        f"median of {args.repeats} passes over each sample after a warm-up pass (planner index cached on the "
        f"trees). Target: {TARGET_PLANS_PER_S:,} plans/s end to end.",
        "",
        *(
            f"- `{r['sample']}`: {r['plans']} plans of {r['trees']} trees, median {r['median_nodes']:.0f} nodes "
            f"(max {r['max_nodes']}), median {r['median_queries']:.0f} queries, median "
            f"{r['median_kv_entries']:.0f} KV entries per plan"
            for r in rows
        ),
        "",
        f"| stage | {head} |",
        "|:---|" + "---:|" * len(rows),
    ]
    for stage in stages:
        cells = " | ".join(f"{r['plans_per_s'][stage]:,.0f}" if stage in r["plans_per_s"] else "-" for r in rows)
        lines.append(f"| {stage} | {cells} |")
    lines += [
        "",
        "Planner alone by tree size (node-count quartiles of each sample; every plan timed on its own, one pass):",
        "",
        "| sample | nodes | plans | plans/s | median ms |",
        "|:---|:---|---:|---:|---:|",
    ]
    for r in rows:
        for b in r["plan_by_tree_size"]:
            lines.append(
                f"| {r['sample']} | {b['nodes'][0]}-{b['nodes'][1]} | {b['plans']} | {b['plan_per_s']:,.0f} "
                f"| {b['median_plan_ms']:.3f} |"
            )
    lines += [
        "",
        f"- env: {env['cpu_model'] or env['processor'] or env['machine']} ({env['cpu_count']} CPUs), "
        f"python {env['python']}, numpy {env['numpy']}, commit {(env['git_commit'] or 'unknown')[:12]}, "
        f"{env['timestamp_utc']}; load average (1, 5, 15 min) "
        + " -> ".join("/".join(f"{x:.2f}" for x in load[k]) for k in ("start", "end"))
        + " (a shared host: other processes' load lowers every rate, the multi-process one most)",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.costmodel_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=shipped.model_path())
    p.add_argument("--heldout", nargs="+", default=["traces/h200_heldout"])
    p.add_argument("--workloads", nargs="+", default=[str(shipped.workloads_path())])
    p.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D of the tuner sample (default 32,8,128)")
    p.add_argument("--dtype", default="float16", help="dtype of the tuner sample (default float16)")
    p.add_argument("--sample", type=int, default=512, help="held-out measurements sampled (0: all; default 512)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per stage (default 5)")
    p.add_argument("--one-row", type=int, default=64, help="rows predicted one call each (default 64)")
    p.add_argument("--workers", type=int, default=2, help="processes of the multi-process row (<= 1: none)")
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    p.add_argument("--label", default="cpu")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.one_row < 1 or args.sample < 0:
        p.error("--repeats and --one-row must be >= 1, --sample >= 0")
    try:
        args.heads = tuple(int(x) for x in args.heads.split(","))
    except ValueError:
        p.error("--heads must be three integers Hq,Hkv,D")
    if len(args.heads) != 3:
        p.error("--heads must be three integers Hq,Hkv,D")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    env = environment()
    model, meta = load_model(args.model)
    model_gpu = GpuSpec.from_dict(meta["gpu"])
    held, gpu = heldout_jobs(args.heldout, args.sample, args.seed)
    if gpu.name != model_gpu.name:
        raise ValueError(f"{args.model} is for {model_gpu.name}, the held-out traces for {gpu.name}")
    samples = {"heldout": held, "tuner": tuner_jobs(args.workloads, args.heads, args.dtype)}
    trees = list({id(j.tree): j.tree for jobs in samples.values() for j in jobs}.values())
    pool = PredictPool(trees, workers=args.workers) if args.workers > 1 else None
    load = {"start": list(os.getloadavg())}
    try:
        rows = [
            bench_sample(name, jobs, gpu, model, repeats=args.repeats, one_row=args.one_row, pool=pool)
            for name, jobs in samples.items()
        ]
    finally:
        if pool is not None:
            pool.close()
    load["end"] = list(os.getloadavg())
    report = {
        "benchmark": "latency-model prediction throughput, planning included",
        "load_average": load,
        "label": args.label,
        "model": str(args.model),
        "gpu": gpu.to_dict(),
        "heldout": {"paths": args.heldout, "sample": args.sample, "seed": args.seed},
        "tuner": {"paths": args.workloads, "heads": list(args.heads), "dtype": args.dtype, "config": "defaults"},
        "repeats": args.repeats,
        "workers": args.workers,
        "target_plans_per_s": TARGET_PLANS_PER_S,
        "env": env,
        "rows": rows,
    }
    md = markdown(rows, env, args, load)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"costmodel_throughput_{args.label}.json", json.dumps(report, indent=2) + "\n")
    write_atomic(args.out / f"costmodel_throughput_{args.label}.md", md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
