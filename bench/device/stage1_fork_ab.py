"""A/B on the GPU: a two-class plan's stage-1 launches on one stream vs side by side (fork/join).

For ten paper-suite cases: graph replay, do_bench and the back-to-back eager loop, each
variant planned afresh, twice in alternation (the best of the two is printed). "fork" forces
the side stream in eager calls too (``_FORK_EAGER_MIN_PAIRS = 0``), so the eager columns show
the fork's host cost. Result at 435d943 (before the eager threshold existed):
``docs/bench/h200/fork_ab_435d943.json``.

    python bench/device/stage1_fork_ab.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import fasttree as ft
from fasttree import attention
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.timing import eager_loop_time_us, eager_time_us, graph_time_us

CASES = [(3, "gqa4"), (5, "mha"), (6, "gqa4"), (7, "mha"), (8, "gqa4"), (9, "gqa4"), (11, "gqa16"), (13, "gqa16"),
         (2, "gqa4"), (1, "mha")]  # fmt: skip


def measure(tree, hq: int, hkv: int, fork: bool, q, k, v, out) -> dict[str, float]:
    attention._FORK_STAGE1 = fork
    attention._FORK_EAGER_MIN_PAIRS = 0
    plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)

    def call():
        ft.tree_attention(q, k, v, plan, out=out)

    call()
    call()
    torch.cuda.synchronize()
    return {
        "graph": graph_time_us(call)["median"],
        "dobench": eager_time_us(call),
        "loop": eager_loop_time_us(call)["median"],
    }


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    rows = []
    for case, heads in CASES:
        hq, hkv = PAPER_HEADS[heads]
        tree = paper_tree(case)
        torch.manual_seed(case)
        q = torch.randn(tree.n_queries, hq, 128, device=dev, dtype=torch.float16)
        k = torch.randn(tree.max_slot + 1, hkv, 128, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        res: dict = {"case": f"{case}/{heads}"}
        for rep in range(2):
            for fork in (False, True):
                tag = "fork" if fork else "one"
                for metric, us in measure(tree, hq, hkv, fork, q, k, v, out).items():
                    res[f"{tag}_{metric}{rep}"] = us
        rows.append(res)
        best = {
            f"{t}_{m}": min(res[f"{t}_{m}0"], res[f"{t}_{m}1"])
            for t in ("one", "fork")
            for m in ("graph", "dobench", "loop")
        }
        print(
            res["case"],
            " ".join(f"{m} {best['one_' + m]:.1f} -> {best['fork_' + m]:.1f}" for m in ("graph", "dobench", "loop")),
        )
    Path(out_path).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
