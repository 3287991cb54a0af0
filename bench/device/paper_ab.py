"""Paper suite A/B on the GPU: pipeline stages per tile class, and a stage-1 body with a peeled tail.

Two questions, one run, every one of the 45 paper cases (head dim 128, fp16):

1. Configs: the default ``FastTreeConfig`` (stages 3 and 3) against stages (3, 5), (5, 3) and
   (5, 5). Triton 3.6 on sm_90 gives a tile's gathered K/V a second shared-memory buffer only
   from 5 stages on (64-row tiles: 82 -> 115 KB; 16-row: 39 -> 73 KB). Whole calls
   (``tree_attention``) by CUDA-graph replay, each checked against the float64 reference.
2. Kernel body: the default plan's stage-1 launches with every KV tile masked against the
   same launches with ``PEEL`` (the unit's full ``BLOCK_N`` tiles without masks: index, K, V
   and row-mask loads unpredicated, no ``where`` on the scores of a non-masked class; then one
   masked tail tile). Outputs compared on the same inputs. The committed
   ``docs/bench/h200/paper_ab_ebdc5ba.json`` ran a copy of that body in this script, before it
   became the library's ``PEEL``.

Also the peeled body on the serving decode trees of ``small_tile_variants.py`` (step 25).

    python3 bench/device/paper_ab.py --out $OUT/paper_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

import fasttree as ft
from bench.common import checked_graph_time, environment, geomean, random_case
from bench.device.small_tile_variants import diff, run_production, snapshot, stage1_launches
from fasttree import attention as att
from fasttree.export import read_export
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

D = 128
STAGES = {"s33": (3, 3), "s35": (3, 5), "s53": (5, 3), "s55": (5, 5)}


#: Positions of ``OFFSETS_32`` and ``PEEL`` among the units kernel's constexprs (``fasttree.attention._launches``).
_OFFSETS_32, _PEEL = 7, 8


def with_peel(launches, peel: bool):
    """``launches`` with the kernel's ``PEEL`` set to ``peel`` in every one."""
    return [
        (kernel, grid, args, (*constexprs[:_PEEL], peel, *constexprs[_PEEL + 1 :]), *rest)
        for kernel, grid, args, constexprs, *rest in launches
    ]


def body_ab(plan, q, k, v) -> dict:
    """Stage-1 time (us) of every launch masked ("production") and peeled on ``plan``, and their max difference."""
    out = torch.full_like(q, float("nan"))
    launches = stage1_launches(plan, q, k, v, out)
    assert all(c[_OFFSETS_32] for _, _, _, c, *_ in launches), "the pools here give int32 offsets"
    variants = {"production": with_peel(launches, False), "peeled": with_peel(launches, True)}
    part_o, part_lse = att._workspace(plan, q.device)
    rows = plan.n_partial_rows
    results = {}
    snaps = {}
    for name, variant in variants.items():
        for buf in (out, part_o, part_lse):
            buf.fill_(float("nan"))
        run_production(variant)
        torch.cuda.synchronize()
        snaps[name] = snapshot(out, part_o, part_lse, rows)
        results[name] = graph_time_us(lambda variant=variant: run_production(variant))["median"]
    results["max_abs_diff"] = diff(snaps["production"], snaps["peeled"])
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    for case in range(1, 16):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=case, samples=16)
            row = {"case": case, "heads": heads, "configs": {}}
            for label, stages in STAGES.items():
                config = dataclasses.replace(ft.FastTreeConfig(), num_stages=stages)
                plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
                try:
                    row["configs"][label] = checked_graph_time(plan, q, k, v, sample, ref)
                except Exception as exc:  # a config the GPU cannot launch: recorded
                    row["configs"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
            row["body"] = body_ab(plan, q, k, v)
            rows.append(row)
            base = row["configs"]["s33"]["graph_us"]
            print(
                f"{case}/{heads}: "
                + " ".join(f"{n}:{c.get('graph_us', math.nan) / base:.3f}" for n, c in row["configs"].items())
                + f" | body peeled/production {row['body']['peeled'] / row['body']['production']:.3f}"
                f" diff {row['body']['max_abs_diff']:.1e}",
                flush=True,
            )
    decode = []
    export = read_export("docs/tune/export_measured.json")
    for model, (hq, hkv) in {"llama": (32, 32), "mistral": (32, 8)}.items():
        config, _ = export.lookup(
            gpu=torch.cuda.get_device_name(0), num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16
        )
        for scenario in ("multi_document_qa", "few_shot"):
            tree = list(iter_serving(scenario, seed=0, steps=26))[25].tree
            gen = torch.Generator(device="cuda").manual_seed(25)
            slots = tree.max_slot + 1
            q = torch.randn(tree.n_queries, hq, D, generator=gen, device="cuda", dtype=torch.float16)
            k = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
            v = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
            plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
            res = {"model": model, "scenario": scenario, **body_ab(plan, q, k, v)}
            decode.append(res)
            print(f"{model} {scenario}: body peeled/production {res['peeled'] / res['production']:.3f}", flush=True)
    summary = {
        label: geomean(
            [
                r["configs"]["s33"]["graph_us"] / r["configs"][label]["graph_us"]
                for r in rows
                if "graph_us" in r["configs"].get(label, {})
            ]
        )
        for label in STAGES
    }
    summary["peeled_body_time_ratio"] = geomean([r["body"]["peeled"] / r["body"]["production"] for r in rows])
    summary["peeled_body_time_ratio_decode"] = geomean([r["peeled"] / r["production"] for r in decode])
    summary["max_err"] = {
        label: max(r["configs"][label].get("err", math.inf) for r in rows) for label in STAGES
    }  # fmt: skip
    summary["peeled_max_abs_diff"] = max(r["body"]["max_abs_diff"] for r in rows + [{"body": d} for d in decode])
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"env": environment(gpu=True), "rows": rows, "decode": decode, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
