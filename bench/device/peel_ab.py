"""Which tile classes should peel their units' tail KV tile (``fasttree.attention._PEEL_TILES``)?

``bench/device/paper_ab.py`` measured a stage-1 copy that runs a unit's whole ``BLOCK_N`` tiles
unmasked and one masked tail: 0.965x the stage-1 time on the paper suite (GQA cases up to
0.84x), but 1.13-1.15x on Mistral's decode trees (16-row tiles of 128 tokens). The library
kernel now has that body behind ``PEEL``; this times each rule (``none``, ``large``: tiles of
more than 16 rows, ``small``: 16-row tiles, ``all``) by CUDA-graph replay of whole calls:

* ``tree_attention`` on the 45 paper cases (default config), checked against the float64
  reference;
* ``TreeAttentionRuntime.forward`` (the serving path, the refined export's configs) on the
  Llama and Mistral trees of the multi-document and few-shot scenarios (steps 10, 25, 39).

    python3 bench/device/peel_ab.py --out $OUT/peel_ab.json
"""

from __future__ import annotations

import argparse

import torch

import fasttree as ft
from bench.common import checked_graph_time, geomean, random_case, write_device_result
from fasttree import attention as att
from fasttree.export import read_export
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

D = 128
RULES = ("none", "large", "small", "all")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    paper = []
    for case in range(1, 16):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=case, samples=16)
            row = {"case": case, "heads": heads}
            for rule in RULES:
                att._PEEL_TILES = rule
                plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)  # fresh launchers
                row[rule] = checked_graph_time(plan, q, k, v, sample, ref)
            paper.append(row)
            ratios = " ".join(f"{r}:{row[r]['graph_us'] / row['none']['graph_us']:.3f}" for r in RULES)
            print(f"{case}/{heads}: {ratios}", flush=True)
    decode = []
    export = read_export("docs/tune/export_measured.json")
    gpu = torch.cuda.get_device_name(0)
    for model, (hq, hkv) in {"llama": (32, 32), "mistral": (32, 8)}.items():
        config, _ = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16)
        for scenario in ("multi_document_qa", "few_shot"):
            steps = list(iter_serving(scenario, seed=0, steps=40))
            trees = [steps[i].tree for i in (10, 25, 39)]
            slots = max(t.max_slot for t in trees) + 1
            rows = max(t.n_queries for t in trees)
            gen = torch.Generator(device="cuda").manual_seed(7)
            q = torch.randn(rows, hq, D, generator=gen, device="cuda", dtype=torch.float16)
            k = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
            v = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
            out = torch.empty_like(q)
            row = {"model": model, "scenario": scenario}
            for rule in RULES:
                att._PEEL_TILES = rule
                rt = TreeAttentionRuntime(
                    config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16, device="cuda",
                    max_queries=rows, max_kv_entries=8 * slots, max_units=1 << 16, max_partial_rows=64 * rows,
                    pool_slots=slots, extend_steps=0,
                )  # fmt: skip
                total = 0.0
                for tree in trees:
                    rt.plan(tree)
                    total += graph_time_us(lambda rt=rt, q=q, k=k, v=v, out=out: rt.forward(q, k, v, out=out))["median"]
                row[rule] = total
            decode.append(row)
            print(f"{model} {scenario}: " + " ".join(f"{r}:{row[r] / row['none']:.3f}" for r in RULES), flush=True)
    att._PEEL_TILES = "none"
    summary = {
        "paper_time_ratio": {r: geomean([x[r]["graph_us"] / x["none"]["graph_us"] for x in paper]) for r in RULES},
        "paper_worst_ratio": {r: max(x[r]["graph_us"] / x["none"]["graph_us"] for x in paper) for r in RULES},
        "paper_max_err": {r: max(x[r]["err"] for x in paper) for r in RULES},
        "decode_time_ratio": {r: geomean([x[r] / x["none"] for x in decode]) for r in RULES},
        "decode_worst_ratio": {r: max(x[r] / x["none"] for x in decode) for r in RULES},
    }
    write_device_result(args.out, summary, paper=paper, decode=decode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
