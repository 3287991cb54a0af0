"""A/B on the GPU: long units that fit the small tile kept out of large-tile bins (``_SOLO_MIN_TOKENS``).

Packing puts every unit shorter than ``pack_tokens`` into bins; with GQA a bin fills the
large tile (64 rows), so a one-query unit of 256 tokens (4 rows with GQA 4) does 4x its
matrix work there. ``fasttree.plan_arrays._SOLO_MIN_TOKENS`` keeps units of at least that
many tokens, whose rows fit the small tile, out of the bins. For the paper-suite cases whose
plan it changes (6/gqa4, 8/gqa4, 8/gqa16, 9/gqa4; 8/mha as a control it leaves alone) and
a few serving trees (default config and the polished export's GQA-4 config), graph-replay
time of ``tree_attention`` per threshold (None = off), twice in alternation (best kept), and
the largest difference of the output from the threshold-off plan's.

    python bench/device/solo_ab.py OUT.json

(A second mode, ``--share`` at 85069fd, measured a token-share floor that the rule then had:
``docs/bench/h200/solo_share_85069fd.json``; dropping it saved 3-12% on 20 GQA-4 serving trees,
so it was removed.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import fasttree as ft
from bench.common import switched
from fasttree import plan_arrays
from fasttree.export import read_export
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

THRESHOLDS = (None, 64, 128, 256)
CASES = [(8, "gqa4"), (8, "gqa16"), (6, "gqa4"), (9, "gqa4"), (8, "mha")]


def trees():
    for case, heads in CASES:
        hq, hkv = PAPER_HEADS[heads]
        yield f"{case}/{heads}", paper_tree(case), hq, hkv, None
    polished = read_export("docs/tune/polished/export.json")
    cfg4 = polished.lookup(gpu=torch.cuda.get_device_name(), num_q_heads=32, num_kv_heads=8, head_dim=128,
                           dtype="float16")[0]  # fmt: skip
    for scenario in ("multi_level_system_prompts", "multi_document_qa", "few_shot"):
        steps = list(iter_serving(scenario, seed=0, steps=40))
        for i in (10, 39):
            for name, cfg in (("default", None), ("polished", cfg4)):
                yield f"{scenario}[{i}]/gqa4/{name}", steps[i].tree, 32, 8, cfg


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    rows = []
    settings = ("tokens", THRESHOLDS)
    for label, tree, hq, hkv, cfg in trees():
        torch.manual_seed(0)
        q = torch.randn(tree.n_queries, hq, 128, device=dev, dtype=torch.float16)
        k = torch.randn(tree.max_slot + 1, hkv, 128, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        res: dict = {"case": label}
        ref = None
        for _rep in range(2):
            for th in settings[1]:
                with switched(plan_arrays, "_SOLO_MIN_TOKENS", th):
                    plan = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
                out.fill_(float("nan"))

                def call(plan=plan, q=q, k=k, v=v, out=out):
                    ft.tree_attention(q, k, v, plan, out=out)

                call()
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.clone()
                res[f"diff_{th}"] = float((out.float() - ref.float()).abs().max())
                res[f"units_{th}"] = list(plan.units_per_class())
                t = graph_time_us(call)["median"]
                res[f"graph_{th}"] = min(t, res.get(f"graph_{th}", float("inf")))
        rows.append(res)
        base = res[f"graph_{settings[1][0]}"]
        times = " ".join(f"{th}: {res[f'graph_{th}']:.1f} ({res[f'graph_{th}'] / base:.3f})" for th in settings[1])
        print(label, times, "maxdiff", max(res[f"diff_{th}"] for th in settings[1]), flush=True)
    Path(out_path).write_text(json.dumps({"setting": settings[0], "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[-1])
