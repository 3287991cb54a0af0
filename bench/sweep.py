"""Sweep kernel launch settings (KV tiles, warps, stages, query tiles) on paper-suite cases.

Measures the default-config plan of each case under every config of a small grid by
CUDA-graph replay (GPU time) and reports, per config, the geometric mean over cases of
its time relative to the first config (the baseline). Needs a CUDA GPU::

    python -m bench.sweep [--cases 1,5,6,8,9,10,11,13] [--heads mha,gqa4,gqa16] [--out docs/bench]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fasttree as ft
from bench.common import environment, write_atomic
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.timing import graph_time_us

log = logging.getLogger("bench.sweep")


def grid() -> list[dict[str, Any]]:
    """Baseline (published defaults) first, then one-at-a-time changes and a few combinations."""
    return [
        {},
        {"num_stages": (3, 3)},
        {"num_stages": (2, 1)},
        {"num_warps": (4, 2)},
        {"num_warps": (8, 4)},
        {"kv_tile": (64, 32)},
        {"kv_tile": (64, 64)},
        {"kv_tile": (128, 64)},
        {"kv_tile": (64, 64), "num_stages": (3, 1)},
        {"q_tile_rows": (128, 16), "num_warps": (8, 4)},
        {"q_tile_rows": (128, 16), "kv_tile": (64, 32), "num_warps": (8, 4)},
        {"kv_tile": (64, 64), "num_warps": (4, 2), "num_stages": (2, 1)},
        {"q_tile_rows": (256, 16), "num_warps": (8, 4)},
    ]


def grid_splits() -> list[dict[str, Any]]:
    """Baseline first, then split sizes, parallelism thresholds, small-class KV tile and warps."""
    return [
        {},
        {"kv_split_sizes": (256, 128)},
        {"kv_split_sizes": (512, 128)},
        {"kv_split_sizes": (256, 64)},
        {"kv_tile": (32, 16)},
        {"num_warps": (4, 2)},
        {"kv_tile": (32, 16), "num_warps": (4, 2)},
        {"para_threshs1": (1056, 1056)},
        {"para_threshs1": (528, 2112)},
        {"kv_split_sizes": (256, 128), "kv_tile": (32, 16), "num_warps": (4, 2)},
        {"kv_split_sizes": (256, 128), "q_tile_rows": (128, 16), "num_warps": (8, 4)},
        {"kv_split_sizes": (256, 64), "para_threshs1": (1056, 1056), "kv_tile": (32, 16)},
    ]


def grid_pack() -> list[dict[str, Any]]:
    """Packing off first (the v4 kernel's plans), then token budgets, program floors and KV tiles."""
    return [
        {"pack_tokens": 0},
        {},
        {"pack_tokens": 1024},
        {"kv_tile": (64, 32)},
        {"pack_tokens": 1024, "kv_tile": (64, 32)},
        {"pack_min_units": 528},
        {"pack_tokens": 1024, "pack_min_units": 528, "kv_tile": (64, 32)},
        {"pack_tokens": 1024, "pack_min_units": 132, "kv_tile": (64, 32)},
        {"pack_tokens": 1024, "kv_tile": (64, 64)},
        {"pack_tokens": 1024, "kv_tile": (64, 32), "num_warps": (4, 2)},
    ]


def grid_warps() -> list[dict[str, Any]]:
    """Defaults first, then warps and stages per tile class (the large class spills at 4 warps on sm_90)."""
    return [
        {},
        {"num_warps": (8, 4)},
        {"num_warps": (8, 4), "num_stages": (2, 3)},
        {"num_warps": (8, 4), "num_stages": (4, 3)},
        {"num_stages": (2, 3)},
        {"num_warps": (4, 8)},
        {"num_warps": (8, 8)},
        {"num_warps": (4, 2)},
        {"num_warps": (8, 2)},
        {"num_stages": (3, 2)},
        {"num_warps": (8, 4), "kv_tile": (32, 64)},
    ]


GRIDS = {"launch": grid, "splits": grid_splits, "pack": grid_pack, "warps": grid_warps}


def make_config(spec: dict[str, Any], group_size: int) -> ft.FastTreeConfig:
    spec = dict(spec)
    rows = spec.pop("q_tile_rows", None)
    if rows is not None:
        spec["q_tile_queries"] = tuple(max(1, r // group_size) for r in rows)
    return ft.FastTreeConfig(**spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1,5,8,10,13")
    p.add_argument("--heads", default="mha,gqa4,gqa16")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--label", default="h200")
    p.add_argument("--grid", default="launch", choices=sorted(GRIDS))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cases = [int(c) for c in args.cases.split(",")]
    heads = args.heads.split(",")
    configs = GRIDS[args.grid]()
    times = np.full((len(configs), len(cases) * len(heads)), np.nan)
    labels = []
    col = 0
    for case in cases:
        tree = paper_tree(case)
        for h in heads:
            hq, hkv = PAPER_HEADS[h]
            g = hq // hkv
            labels.append(f"{case}/{h}")
            gen = torch.Generator(device="cuda").manual_seed(case)
            q = torch.randn(tree.n_queries, hq, 128, device="cuda", dtype=torch.float16, generator=gen)
            k = torch.randn(tree.max_slot + 1, hkv, 128, device="cuda", dtype=torch.float16, generator=gen)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            for i, spec in enumerate(configs):
                try:
                    plan = ft.plan(tree, make_config(spec, g), num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
                    times[i, col] = graph_time_us(
                        lambda plan=plan, q=q, k=k, v=v, out=out: ft.tree_attention(q, k, v, plan, out=out)
                    )["median"]
                except Exception as exc:  # a config that fails to compile or run is recorded, not fatal
                    log.warning("config %d on %s failed: %s", i, labels[-1], exc)
            log.info(
                "%s: baseline %.1f us, best %.1f us (config %d)",
                labels[-1],
                times[0, col],
                np.nanmin(times[:, col]),
                int(np.nanargmin(times[:, col])),
            )
            col += 1
    rel = times / times[0]
    geo = np.exp(np.nanmean(np.log(rel), axis=1))
    order = np.argsort(geo)
    lines = [
        f"# Launch-settings sweep ({args.label})",
        "",
        "| rank | config | geomean time / baseline | worst |",
        "|---:|:---|---:|---:|",
    ]
    for rank, i in enumerate(order):
        lines.append(f"| {rank + 1} | `{json.dumps(configs[i])}` | {geo[i]:.3f} | {np.nanmax(rel[i]):.3f} |")
    best_per_case = {
        labels[c]: {
            "config": int(np.nanargmin(times[:, c])),
            "us": float(np.nanmin(times[:, c])),
            "baseline_us": float(times[0, c]),
        }
        for c in range(len(labels))
    }
    report = {
        "env": environment(gpu=True),
        "configs": configs,
        "cases": labels,
        "times_us": times.tolist(),
        "geomean_rel": geo.tolist(),
        "best_per_case": best_per_case,
    }
    write_atomic(args.out / f"sweep_{args.label}.json", json.dumps(report, indent=1) + "\n")
    md = "\n".join(lines) + "\n"
    write_atomic(args.out / f"sweep_{args.label}.md", md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
