"""Host time of one serving decode step's plan: ``TreeAttentionRuntime.plan`` and ``fasttree.plan``.

For the serving scenarios ``few_shot``, ``chain_reasoning``, ``multi_document_qa`` and
``multi_level_system_prompts`` (the trees of ``fasttree.toolkit.workloads.iter_serving(scenario,
seed=0, steps=51)``, the first 3 skipped) and the head shapes ``(Hq, Hkv, D)`` =
``(32, 32, 128)`` and ``(32, 8, 128)``, this script times

* ``runtime_ms``: ``TreeAttentionRuntime.plan(tree)`` (plan plus staging upload),
* ``runtime_plan_ms``: the runtime's planning alone
  (:func:`fasttree.runtime_planning.plan_for_runtime` as a runtime with launch variants calls it),
  so that ``runtime_ms - runtime_plan_ms`` is the upload's host time (staging, launch variant, copy
  and relocation launch),
* ``plan_ms``: ``fasttree.plan(tree)`` alone, and
* ``tree_ms``: building the tree from a radix cache's view of it
  (:func:`fasttree.adapter.tree_from_radix_nodes` over one numpy array per node, made
  beforehand), which a server pays before either (per head shape alike: no head enters it),

per tree, in milliseconds. Every tree object is planned once (a tree caches its planner
index on first use, as a fresh serving tree would not have it): each repetition regenerates
the scenario's trees. The best of ``--repeats`` repetitions is reported. The runtime is
built on the CPU, so set ``TRITON_INTERPRET=1`` on a machine without a GPU. There its
upload's "device" copy is a CPU tensor copy, which torch runs on ``--threads`` threads
(default 1: with a busy core, a copy split over two OpenMP threads can wait ~8 ms for the
second, a cost the GPU host's asynchronous host-to-device copy does not have), and the
runtime's plan relocation kernel runs in Triton's interpreter (70-800 ms per step on 2 cores):
``runtime_ms`` is host time only on a GPU host; on a CPU the run is a smoke test and
``plan_ms`` the number to read.

Run from the repository root::

    TRITON_INTERPRET=1 python -m bench.plan_host [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import fasttree
from fasttree.adapter import tree_from_radix_nodes
from fasttree.fileio import write_atomic
from fasttree.launcher import interpreting
from fasttree.runtime import TreeAttentionRuntime
from fasttree.runtime_planning import plan_for_runtime
from fasttree.toolkit.bench_common import environment
from fasttree.toolkit.workloads import iter_serving

SCENARIOS = ("few_shot", "chain_reasoning", "multi_document_qa", "multi_level_system_prompts")
HEADS = ((32, 32, 128), (32, 8, 128))
STEPS = 51
SKIP = 3


def serving_trees(scenario: str) -> list[fasttree.KVTree]:
    """Fresh tree objects of the scenario's decode steps (the first ``SKIP`` dropped)."""
    steps = list(iter_serving(scenario, seed=0, steps=STEPS))
    return [s.tree for s in steps[SKIP:]]


def radix_views(trees: list[fasttree.KVTree]) -> list[tuple]:
    """Each tree as a radix cache would hand it over: ``(parents, one int64 array per node,
    query nodes)``, the arguments of :func:`fasttree.adapter.tree_from_radix_nodes`."""
    return [
        (t.parents.copy(), [t.node_slots(i).astype(np.int64) for i in range(t.n_nodes)], t.query_nodes.copy())
        for t in trees
    ]


def tree_build_ms(views: list[tuple], repeats: int) -> float:
    """Best-of-``repeats`` milliseconds per tree of :func:`fasttree.adapter.tree_from_radix_nodes`
    over ``views`` (:func:`radix_views`)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for parents, nodes, queries in views:
            tree_from_radix_nodes(parents, nodes, queries)
        best = min(best, (time.perf_counter() - t0) / len(views) * 1e3)
    return best


def make_runtime(trees: list[fasttree.KVTree], hq: int, hkv: int, d: int, device: str) -> TreeAttentionRuntime:
    pool = max(t.max_slot for t in trees) + 2
    return TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype="float16", device=device,
        max_queries=512, max_kv_entries=4 * pool, max_units=1 << 16, max_partial_rows=32 * 512, pool_slots=pool,
        extend_steps=0,  # the planner's time (no step extends the last plan)
    )  # fmt: skip


def time_per_tree(scenario: str, fn, repeats: int) -> float:
    """Best-of-``repeats`` milliseconds per call of ``fn(tree)`` over fresh trees."""
    best = float("inf")
    for _ in range(repeats):
        trees = serving_trees(scenario)
        t0 = time.perf_counter()
        for t in trees:
            fn(t)
        best = min(best, (time.perf_counter() - t0) / len(trees) * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="repetitions (fresh trees each); the best is reported")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the CPU runtime's copy)")
    ap.add_argument("--device", default=None, help="the runtime's device (default: cuda when available, else cpu)")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda") and not interpreting():
        ap.error(f"the runtime runs on {device} only under TRITON_INTERPRET=1 (set it, or run on a GPU host)")
    torch.set_num_threads(args.threads)

    # what a runtime with launch variants plans with (make_runtime: no export, default rules)
    config, rules = fasttree.FastTreeConfig(), fasttree.PlanRules.defaults()
    rows = []
    head = f"{'scenario':28s} {'heads':>12s} {'nodes':>6s} {'queries':>8s} {'runtime_ms':>11s} {'rt_plan_ms':>11s}"
    head += f" {'plan_ms':>8s}"
    print(head + f" {'tree_ms':>8s}")
    for scenario in SCENARIOS:
        trees = serving_trees(scenario)
        nodes = sum(t.n_nodes for t in trees) / len(trees)
        queries = sum(t.n_queries for t in trees) / len(trees)
        tree_ms = tree_build_ms(radix_views(trees), args.repeats)
        for hq, hkv, d in HEADS:
            rt = make_runtime(trees, hq, hkv, d, device)
            for t in trees[:3]:  # warm-up (imports, first-call costs)
                rt.plan(t)
            runtime_ms = time_per_tree(scenario, rt.plan, args.repeats)
            if device != "cpu":
                torch.cuda.synchronize()
            heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}
            runtime_plan_ms = time_per_tree(
                scenario, lambda t, h=heads: plan_for_runtime(t, config, **h, rules=rules), args.repeats
            )
            plan_ms = time_per_tree(scenario, lambda t, h=heads: fasttree.plan(t, **h), args.repeats)
            row = {
                "scenario": scenario, "heads": [hq, hkv, d], "mean_nodes": nodes, "mean_queries": queries,
                "trees": len(trees), "runtime_ms": runtime_ms, "runtime_plan_ms": runtime_plan_ms, "plan_ms": plan_ms,
                "tree_ms": tree_ms,
            }  # fmt: skip
            rows.append(row)
            shape = f"{hq}/{hkv}/{d}"
            cells = f"{runtime_ms:11.3f} {runtime_plan_ms:11.3f} {plan_ms:8.3f} {tree_ms:8.3f}"
            print(f"{scenario:28s} {shape:>12s} {nodes:6.0f} {queries:8.0f} {cells}")
    if args.json is not None:
        doc = {"env": environment(gpu=device != "cpu"), "device": device, "repeats": args.repeats, "rows": rows}
        write_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
