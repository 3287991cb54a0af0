"""Does the decode loop's context slow the host planning? (one device call, single GPU)

The decode benchmark times ``TreeAttentionRuntime.plan`` at 0.8-1.3 ms per step on the GPU host,
while ``bench.plan_host`` there (plans back to back) reads 0.47-0.97 ms and the development machine
0.33-0.50 ms. This script plans the same decode trees (Llama multi-document QA and chain reasoning,
export ``docs/tune/export_measured.json``, every tree planned once beforehand as in the benchmark)
under five contexts, per tree:

* ``back_to_back``: one plan after the other;
* ``after_sync``: ~8 ms of GPU work (``torch.cuda._sleep``), ``torch.cuda.synchronize()``, plan;
* ``after_spin``: the same GPU work, waited for by polling an event (the host thread stays busy);
* ``after_sleep``: ``time.sleep(0.008)``, plan (no GPU);
* ``overlapped``: the GPU work enqueued, the plan while it runs, then the synchronisation.

Usage (repository root, after ``pip install -e .``)::

    python3 bench/device/plan_context.py --out $OUT/plan_context.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.common import environment
from bench.decode import make_workload
from fasttree.runtime import TreeAttentionRuntime

CYCLES = 16_000_000  # ~8 ms at ~2 GHz


def contexts(rt, trees, dev):
    ev = torch.cuda.Event()

    def back_to_back(t):
        t0 = time.perf_counter()
        rt.plan(t)
        return time.perf_counter() - t0

    def after_sync(t):
        torch.cuda._sleep(CYCLES)
        torch.cuda.synchronize(dev)
        return back_to_back(t)

    def after_spin(t):
        torch.cuda._sleep(CYCLES)
        ev.record()
        while not ev.query():
            pass
        return back_to_back(t)

    def after_sleep(t):
        time.sleep(0.008)
        return back_to_back(t)

    def overlapped(t):
        torch.cuda._sleep(CYCLES)
        dt = back_to_back(t)
        torch.cuda.synchronize(dev)
        return dt

    return {f.__name__: f for f in (back_to_back, after_sync, after_spin, after_sleep, overlapped)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    rows = []
    for scenario in ("multi_document_qa", "chain_reasoning", "few_shot"):
        w = make_workload(scenario, seed=0, warmup=3, steps=48, max_batch=None, vocab=32000, slots="contiguous")
        rt = TreeAttentionRuntime(
            "docs/tune/export_measured.json", num_q_heads=32, num_kv_heads=32, head_dim=128, dtype=torch.float16,
            device=dev, max_queries=w.max_rows, max_kv_entries=4 * w.pool_rows, max_units=1 << 16,
            max_partial_rows=32 * w.max_rows, pool_slots=w.pool_rows,
        )  # fmt: skip
        for t in w.trees:
            rt.plan(t)
        torch.cuda.synchronize(dev)
        ctx = contexts(rt, w.trees, dev)
        times = {name: [] for name in ctx}
        for _ in range(args.rounds):  # interleaved, so host drift hits every context alike
            for name, fn in ctx.items():
                times[name].extend(fn(t) for t in w.trees[3:])
        row = {"scenario": scenario, "trees": len(w.trees) - 3}
        for name, ts in times.items():
            row[f"{name}_ms_mean"] = 1e3 * float(np.mean(ts))
            row[f"{name}_ms_p50"] = 1e3 * float(np.median(ts))
        rows.append(row)
        print(scenario, " ".join(f"{n} {row[f'{n}_ms_mean']:.3f}/{row[f'{n}_ms_p50']:.3f}" for n in ctx), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(gpu=True), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
