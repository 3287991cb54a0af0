"""Host time of ``TreeAttentionRuntime.plan`` per decode step, extended vs fresh (one device call).

For the Llama (32/32) and Mistral (32/8) shapes and the four serving scenarios of
``bench.decode`` (stable pool slots, export ``docs/tune/export_measured.json``), the workload's
trees go through two runtimes in step order: ``extend_steps=8`` (the default) and ``0`` (every
step planned afresh). Before each ``plan`` the GPU runs ~8 ms of work and the host synchronises,
as in the decode loop, and each tree is planned as a new object (no planner index cached on
it by the warm pass: ``bench.decode.as_new_tree``). Per step: the plan time, whether it was
extended, and for extended steps the time of ``PlanExtender.extend`` and of the upload.

Usage (repository root, after ``pip install -e .``)::

    python3 bench/device/plan_extend_time.py --out $OUT/plan_extend_time.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.common import environment
from bench.decode import as_new_tree, make_workload
from fasttree.runtime import TreeAttentionRuntime

CYCLES = 16_000_000  # ~8 ms at ~2 GHz
SHAPES = {"llama": (32, 32), "mistral": (32, 8)}


def _timed(obj, name: str, sink: list) -> None:
    """Wrap ``obj.name`` so each call appends its duration (s) to ``sink``."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    rows = []
    for model, (hq, hkv) in SHAPES.items():
        for scenario in ("multi_level_system_prompts", "few_shot", "chain_reasoning", "multi_document_qa"):
            w = make_workload(scenario, seed=0, warmup=3, steps=48, max_batch=None, vocab=32000)
            row: dict = {"model": model, "scenario": scenario}
            for steps in (8, 0):
                rt = TreeAttentionRuntime(
                    "docs/tune/export_measured.json", num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                    dtype=torch.float16, device=dev, max_queries=w.max_rows, max_kv_entries=4 * w.pool_rows,
                    max_units=1 << 16, max_partial_rows=32 * w.max_rows, pool_slots=w.pool_rows, extend_steps=steps,
                )  # fmt: skip
                for t in w.trees:  # warm: as the benchmark's compile pass
                    rt.plan(t)
                ext_s: list = []
                upload_s: list = []
                if rt._extender is not None:
                    rt._extender.reset()
                    _timed(rt._extender, "extend", ext_s)
                _timed(rt, "_upload", upload_s)
                total, extended = [], []
                for t in w.trees:
                    t = as_new_tree(t)  # no planner index cached by the warm pass, as a server's new tree
                    torch.cuda._sleep(CYCLES)
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    up = rt.plan(t)
                    total.append(time.perf_counter() - t0)
                    extended.append(up.extended)
                total_a, ext_a = np.array(total[3:]), np.array(extended[3:])
                key = f"extend{steps}"
                row[f"{key}_plan_ms_mean"] = 1e3 * float(total_a.mean())
                row[f"{key}_extended_steps"] = int(ext_a.sum())
                if ext_a.any():
                    row[f"{key}_extended_ms_mean"] = 1e3 * float(total_a[ext_a].mean())
                    row[f"{key}_extend_call_ms_mean"] = 1e3 * float(np.array(ext_s[3:])[ext_a].mean())
                    row[f"{key}_upload_ms_mean_extended"] = 1e3 * float(np.array(upload_s[3:])[ext_a].mean())
                if (~ext_a).any():
                    row[f"{key}_fresh_ms_mean"] = 1e3 * float(total_a[~ext_a].mean())
                row[f"{key}_steps"] = int(total_a.size)
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(gpu=True), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
