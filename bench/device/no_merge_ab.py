"""Small paper cases: the default plan vs one unit per query over its whole path (no merge launch).

For trees whose KV is tiny (L2-resident) the grouping saves little and a plan's second launch
(the merge of partial rows) is a large part of its time; torch SDPA on duplicated KV wins
1/2/4/9 at GQA 16 (v20). This times, by CUDA-graph replay, the default plan, the
query-separated plan cut for four waves (the bench's ``query_separated``) and the
query-separated plan with every query's path in one unit (one launch, direct output), each
checked against the float64 reference::

    python3 bench/device/no_merge_ab.py --out $OUT/no_merge_ab.json
"""

from __future__ import annotations

import argparse
import json

import torch

import fasttree as ft
from bench.common import checked_graph_time, environment, random_case
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree

CASES = ("1/gqa16", "2/gqa16", "4/gqa16", "9/gqa16", "6/gqa16", "1/gqa4", "1/mha", "6/gqa4", "9/gqa4", "3/gqa16")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in CASES:
        case, heads = name.split("/")
        tree = paper_tree(int(case))
        hq, hkv = PAPER_HEADS[heads]
        q, k, v, sample, ref = random_case(tree, hq, hkv, 128, seed=int(case), samples=16)
        longest = int(tree.path_lengths[tree.query_nodes].max())
        plans = {
            "default": ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128),
            "query_separated": ft.plan_query_separated(
                tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, num_sms=sms
            ),
            "whole_path": ft.plan_query_separated(
                tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, kv_split_size=longest, num_sms=sms
            ),
        }
        row = {"case": name}
        for label, plan in plans.items():
            row[label] = {**checked_graph_time(plan, q, k, v, sample, ref), "merged": int(plan.merge_queries.size)}
        rows.append(row)
        print(name, " ".join(f"{lb}:{row[lb]['graph_us']:.1f}" for lb in plans), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
