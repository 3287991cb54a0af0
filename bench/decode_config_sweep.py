"""Time runtime configs on decode-serving trees on the GPU (CUDA-graph replay).

For the Llama (32/32) and Mistral (32/8) shapes, head dim 128, fp16: the trees of steps
10, 25 and 39 of ``iter_serving(scenario, seed=0, steps=40)``, and per config the time of
``TreeAttentionRuntime.forward`` on each (median of graph replays), with its roofline
floor. The configs are the export's entry for the shape and variations of it: one field at
a time (``--grid one``) or combinations around the first grid's winners (``--grid combos``).
The results feed ``bench.costmodel_decode_check`` (how well the latency model ranks them);
``bench.tune_measured`` is the search that acts on such measurements.

    python -m bench.decode_config_sweep --grid one --out docs/bench/h200/decode_config_sweep_<commit>.json

The committed ``docs/bench/h200/decode_config_sweep{,2}_f18595e.json`` were made with the
first version of this script (run from a scratch copy, same grids and trees).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch

import fasttree as ft
from bench.common import write_atomic
from fasttree.export import read_export
from fasttree.toolkit.refine import RuntimeBench
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

MODELS = {"llama": (32, 32), "mistral": (32, 8)}
HEAD_DIM = 128
STEPS = (10, 25, 39)
SCENARIOS = ("multi_document_qa", "few_shot")


def variants_one_at_a_time(base: ft.FastTreeConfig, model: str) -> list[tuple[str, ft.FastTreeConfig]]:
    """One-at-a-time variations of ``base`` (the first sweep), ``base`` first."""
    r = dataclasses.replace
    v = [("tuned", base), ("default", ft.FastTreeConfig())]
    for s in [(512, 64), (2048, 64), (1024, 128), (1024, 32), (512, 128), (4096, 128)]:
        v.append((f"split{s}", r(base, kv_split_sizes=s)))
    for p in [0, 256, 1024, 2048]:
        v.append((f"pack{p}", r(base, pack_tokens=p)))
    for m in [132, 528, 1056]:
        v.append((f"packmin{m}", r(base, pack_min_units=m)))
    for t in [(64, 32), (128, 64), (64, 128), (32, 32)]:
        v.append((f"kvtile{t}", r(base, kv_tile=t)))
    for w in [(4, 2), (8, 4), (4, 8)]:
        v.append((f"warps{w}", r(base, num_warps=w)))
    for s in [(3, 3), (2, 2), (4, 4), (3, 2)]:
        v.append((f"stages{s}", r(base, num_stages=s)))
    for g in [-10.0, 10.0, 0.5]:
        v.append((f"gamma{g}", r(base, gamma=g)))
    v.append(("thresh_small", r(base, para_threshs1=(528, 1056))))
    v.append(("thresh_big", r(base, para_threshs1=(66, 264))))
    return v


def variants_combinations(base: ft.FastTreeConfig, model: str) -> list[tuple[str, ft.FastTreeConfig]]:
    """Combinations around the first sweep's winners for ``model`` (the second sweep), ``base`` first."""
    r = dataclasses.replace
    v = [("tuned", base)]
    if model == "llama":
        splits = [(1024, 64), (512, 128), (512, 64), (256, 128), (768, 128), (384, 128)]
        for w, s, p in itertools.product([(4, 4), (4, 2)], splits, [512, 256, 768]):
            v.append((f"w{w}s{s}p{p}", r(base, num_warps=w, kv_split_sizes=s, pack_tokens=p)))
    else:
        splits = [(1024, 128), (512, 128), (256, 128), (384, 128), (768, 128), (512, 64)]
        grid = itertools.product(splits, [(64, 64), (64, 128)], [base.gamma, -10.0], [base.para_threshs1, (66, 264)])
        for s, t, g, th in grid:
            v.append((f"s{s}t{t}g{g}th{th}", r(base, kv_split_sizes=s, kv_tile=t, gamma=g, para_threshs1=th)))
    return v


GRIDS = {"one": variants_one_at_a_time, "combos": variants_combinations}


def _timer(rt, q, k_cache, v_cache, out) -> float:
    """The sweeps' timing: median of CUDA-graph replays within 0.15 s."""
    return graph_time_us(lambda: rt.forward(q, k_cache, v_cache, out=out), budget_s=0.15)["median"]


def sweep_trees(scenario: str) -> list[ft.KVTree]:
    """The trees a sweep times for ``scenario``."""
    steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
    return [steps[i].tree for i in STEPS]


def main(argv: list[str] | None = None) -> int:
    from bench.kernel import roofline_floor_us

    p = argparse.ArgumentParser(prog="python -m bench.decode_config_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="one")
    p.add_argument("--export", default="docs/tune/export.json")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists")
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    export = read_export(args.export)
    results = []
    for model, (hq, hkv) in MODELS.items():
        base, _ = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, dtype="float16")
        for scenario in args.scenarios.split(","):
            trees = sweep_trees(scenario)
            bench = RuntimeBench({scenario: trees}, num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM,
                                 dtype=torch.float16, device=dev, timer=_timer)  # fmt: skip
            floors = [roofline_floor_us(tree, hq, hkv, HEAD_DIM)["floor_us"] for tree in trees]
            for name, cfg in GRIDS[args.grid](base, model):
                t0 = time.time()
                times = bench.times(cfg)[scenario]
                row = {
                    "model": model, "scenario": scenario, "variant": name, "times_us": times, "floors_us": floors,
                    "sum_us": sum(times), "floor_frac": sum(floors) / sum(times), "secs": time.time() - t0,
                }  # fmt: skip
                results.append(row)
                print(f"{model:8s} {scenario:18s} {name:40s} {sum(times):8.1f} us  floor/ours {row['floor_frac']:.3f}")
    write_atomic(args.out, json.dumps({"gpu": gpu, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
