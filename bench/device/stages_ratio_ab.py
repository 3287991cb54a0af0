"""Pipeline stages of the large (64-row) tile class per GQA ratio: an A/B on the GPU.

At ebdc5ba (before ``PEEL``) GQA 4's 64-row class at 5 stages took 0.939x the time of 3
stages on the paper suite's GQA-4 cases, GQA 16 1.03x and MHA 1.00x
(``docs/bench/h200/paper_ab_ebdc5ba.json``). This re-measures it on the current kernel for
the paper trees at head ratios 32/32, 32/16, 32/8, 32/4 and 16/1 (head dim 128, fp16): the
default config (stages 3, 3) against stages (5, 3), and (4, 3) for comparison, as

* ``call``: whole ``fasttree.tree_attention`` calls by CUDA-graph replay, each variant's
  output checked against the float64 reference on sampled queries, and
* ``runtime``: ``TreeAttentionRuntime.forward`` with the same configs (its GQA stage 1 is one
  fused launch compiled with the large class's stages for both slots).

::

    python3 bench/device/stages_ratio_ab.py --out $OUT/stages_ratio_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import fasttree as ft
from bench.common import checked_graph_time, geomean, random_case, write_device_result
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.suite import paper_tree
from fasttree.toolkit.timing import graph_time_us

D = 128
HEADS = {"mha": (32, 32), "gqa2": (32, 16), "gqa4": (32, 8), "gqa8": (32, 4), "gqa16": (16, 1)}
VARIANTS = {"s33": (3, 3), "s43": (4, 3), "s53": (5, 3)}


def runtime_time(tree, config, hq, hkv, q, k, v) -> tuple[float, torch.Tensor]:
    rt = TreeAttentionRuntime(
        config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16, device="cuda",
        max_queries=tree.n_queries, max_kv_entries=16 * (tree.max_slot + 1) + 4096, max_units=1 << 17,
        max_partial_rows=64 * tree.n_queries + 4096, pool_slots=k.shape[0],
    )  # fmt: skip
    rt.plan(tree)
    out = torch.full_like(q, float("nan"))
    rt.forward(q, k, v, out=out)
    torch.cuda.synchronize()
    res = out.clone()
    return graph_time_us(lambda: rt.forward(q, k, v, out=out))["median"], res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ratios", default=",".join(HEADS))
    args = p.parse_args()
    rows = []
    for ratio in args.ratios.split(","):
        hq, hkv = HEADS[ratio]
        for c in range(1, 16):
            tree = paper_tree(c)
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=c, samples=64)
            row: dict = {"ratio": ratio, "case": c}
            for name, stages in VARIANTS.items():
                cfg = dataclasses.replace(ft.FastTreeConfig(), num_stages=stages)
                plan = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
                r = checked_graph_time(plan, q, k, v, sample, ref)
                row[f"call_{name}"], row[f"call_err_{name}"] = r["graph_us"], r["err"]
                t, out = runtime_time(tree, cfg, hq, hkv, q, k, v)
                row[f"rt_{name}"] = t
                row[f"rt_err_{name}"] = ft.max_relative_error(out[torch.as_tensor(sample, device="cuda")].double(), ref)
            rows.append(row)
            print(f"{c}/{ratio}: call " + " ".join(f"{n}:{row['call_' + n]:.1f}" for n in VARIANTS)
                  + " | runtime " + " ".join(f"{n}:{row['rt_' + n]:.1f}" for n in VARIANTS), flush=True)  # fmt: skip
    summary = {}
    for ratio in {r["ratio"] for r in rows}:
        sel = [r for r in rows if r["ratio"] == ratio]
        for kind in ("call", "rt"):
            for n in ("s43", "s53"):
                x = [r[f"{kind}_{n}"] / r[f"{kind}_s33"] for r in sel]
                summary[f"{ratio}/{kind}/{n}"] = {"geomean": geomean(x), "min": min(x), "max": max(x)}
        summary[f"{ratio}/max_err"] = max(r[k] for r in sel for k in r if "err" in k)
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
