"""Host time of ``TreeAttentionRuntime.plan`` vs ``fasttree.plan`` on serving trees (GPU machine, one-off).

Run as ``python3 bench/device/plan_profile.py`` from the repository root; its output at f2481ad is
``docs/bench/h200/plan_profile_f2481ad.log``. ``rt.plan`` runs first on fresh trees (paying the trees'
first-use indexes), then ``ft.plan`` on the same trees; then a cProfile of ``rt.plan`` on few-shot trees.
Kept as the record of that log; ``python -m bench.plan_host`` is the maintained measurement (fresh trees
for both, best of several passes, JSON output).
"""

import cProfile
import io
import pstats
import time

import torch

import fasttree as ft
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.workloads import iter_serving

HEADS = {"num_q_heads": 32, "num_kv_heads": 32, "head_dim": 128}

for scenario in ["few_shot", "chain_reasoning", "multi_document_qa"]:
    trees = [s.tree for s in iter_serving(scenario, seed=0, steps=51)][3:]
    pool = max(t.max_slot for t in trees) + 2
    rt = TreeAttentionRuntime(
        None, dtype="float16", device="cuda", max_queries=512, max_kv_entries=4 * pool, max_units=1 << 16,
        max_partial_rows=32 * 512, pool_slots=pool, **HEADS,
    )  # fmt: skip
    for tree in trees[:3]:
        rt.plan(tree)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for tree in trees:
        rt.plan(tree)
    t1 = time.perf_counter()
    for tree in trees:
        ft.plan(tree, **HEADS)
    t2 = time.perf_counter()
    n = len(trees)
    print(f"{scenario}: rt.plan {1e3 * (t1 - t0) / n:.3f} ms, ft.plan {1e3 * (t2 - t1) / n:.3f} ms", flush=True)
    if scenario == "few_shot":
        profile = cProfile.Profile()
        profile.enable()
        for tree in trees:
            rt.plan(tree)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue()[:3500])
