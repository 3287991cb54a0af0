"""16-row tiles split over KV parts (``KV_SPLIT``) vs not, by CUDA-graph replay (one device call).

``fasttree.attention.SMALL_TILE_KV_SPLIT`` stacks a 16-row tile's rows 2 or 4 times into one
matrix, each copy over a part of every KV tile (warpgroup MMAs on Hopper instead of 16-row
``mma.sync`` with a cross-warp exchange per tile). For the paper suite (default config) and
for decode-step trees of ``bench.decode``'s scenarios (export config, Llama 32/32 and Mistral
32/8 heads), ``tree_attention`` is timed with the split off, 2 and 4, each plan made afresh
per setting and checked against the float64 reference on sampled queries::

    python3 bench/device/kv_split_ab.py --out $OUT/kv_split_ab.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import fasttree as ft
from bench.common import environment
from bench.decode import make_workload
from fasttree import attention
from fasttree.export import read_export
from fasttree.suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from fasttree.timing import graph_time_us

SPLITS = (1, 2, 4)
DECODE = (("llama", 32, "multi_document_qa"), ("llama", 32, "few_shot"), ("llama", 32, "multi_level_system_prompts"),
          ("mistral", 8, "multi_document_qa"), ("mistral", 8, "few_shot"))  # fmt: skip


def time_tree(tree, cfg, hq, hkv, seed) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tree.n_queries, hq, 128, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(tree.max_slot + 1, hkv, 128, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(k.shape, device="cuda", dtype=torch.float16, generator=gen)
    sample = np.sort(np.random.default_rng(seed).choice(tree.n_queries, min(24, tree.n_queries), replace=False))
    ref = ft.reference_attention(q, k, v, tree, queries=sample)
    res = {}
    for split in SPLITS:
        attention.SMALL_TILE_KV_SPLIT = split
        plan = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
        out = torch.full_like(q, float("nan"))
        ft.tree_attention(q, k, v, plan, out=out)
        torch.cuda.synchronize()
        err = ft.max_relative_error(out[torch.as_tensor(sample, device="cuda")], ref)
        used = any(n and attention.small_tile_kv_split(tc.block_m, tc.block_n) > 1
                   for tc, n in zip(plan.tile_classes, plan.units_per_class(), strict=True))  # fmt: skip
        t = graph_time_us(lambda plan=plan, out=out: ft.tree_attention(q, k, v, plan, out=out))["median"]
        res[str(split)] = {"graph_us": t, "err": err, "split_used": bool(used)}
    attention.SMALL_TILE_KV_SPLIT = 1
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(str(c) for c in PAPER_SUITE))
    args = p.parse_args()
    rows = []
    for case in (int(c) for c in args.cases.split(",")):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            res = time_tree(tree, ft.FastTreeConfig(), hq, hkv, seed=100 * case + hkv)
            rows.append({"kind": "paper", "case": f"{case}/{heads}", **res})
            print(f"{case}/{heads}", " ".join(f"{s}:{r['graph_us']:.1f}{'*' if r['split_used'] else ''}"
                                               for s, r in res.items()), flush=True)  # fmt: skip
    export = read_export("docs/tune/export_measured.json")
    for model, hkv, scenario in DECODE:
        cfg, _ = export.lookup(gpu=torch.cuda.get_device_name(0), num_q_heads=32, num_kv_heads=hkv, head_dim=128,
                               dtype="float16")  # fmt: skip
        w = make_workload(scenario, seed=0, warmup=3, steps=48, max_batch=None, vocab=32000)
        for step in (10, 30, 45):
            res = time_tree(w.trees[step], cfg, 32, hkv, seed=step)
            rows.append({"kind": "decode", "case": f"{model}/{scenario}/{step}", **res})
            print(model, scenario, step, " ".join(f"{s}:{r['graph_us']:.1f}{'*' if r['split_used'] else ''}"
                                                  for s, r in res.items()), flush=True)  # fmt: skip
    summary = {}
    for kind in ("paper", "decode"):
        sel = [r for r in rows if r["kind"] == kind]
        for split in SPLITS[1:]:
            ratio = [r[str(split)]["graph_us"] / r["1"]["graph_us"] for r in sel]
            summary[f"{kind}_geomean_time_ratio_split{split}"] = float(np.exp(np.mean(np.log(ratio))))
            summary[f"{kind}_max_err_split{split}"] = max(r[str(split)]["err"] for r in sel)
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
