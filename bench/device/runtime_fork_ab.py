"""A/B on the GPU: the runtime's two MHA stage-1 launches on one stream vs two (fork/join), graph replay.

Llama heads (32/32, D 128, fp16), the refined export's config, three trees of each serving
scenario (seed 0, steps 10, 25, 39); the runtime's cached direct launchers called by hand.
Result at 7ada9e2: ``docs/bench/h200/runtime_fork_ab_7ada9e2.json`` (not adopted: 0.99-1.00x on
multi-document and few-shot trees, 0.93-0.96x on multi-level system prompts).

    python bench/device/runtime_fork_ab.py OUT.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from fasttree.export import read_export
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

SCENARIOS = ("multi_document_qa", "few_shot", "multi_level_system_prompts", "chain_reasoning")


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    cfg, _ = read_export("docs/tune/export_measured.json").lookup(
        gpu=torch.cuda.get_device_name(), num_q_heads=32, num_kv_heads=32, head_dim=128, dtype="float16"
    )
    side = torch.cuda.Stream()
    scale = 1 / math.sqrt(128) * 1.4426950408889634
    rows = []
    for scenario in SCENARIOS:
        steps = list(iter_serving(scenario, seed=0, steps=40))
        trees = [steps[i].tree for i in (10, 25, 39)]
        slots, nq = max(t.max_slot + 1 for t in trees), max(t.n_queries for t in trees)
        q = torch.randn(nq, 32, 128, device=dev, dtype=torch.float16)
        k = torch.randn(slots, 32, 128, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        rt = TreeAttentionRuntime(
            cfg, num_q_heads=32, num_kv_heads=32, head_dim=128, dtype=torch.float16, device=dev, max_queries=nq,
            max_kv_entries=8 * slots, max_units=1 << 16, max_partial_rows=64 * nq, pool_slots=slots,
        )  # fmt: skip
        for tree in trees:
            rt.plan(tree)
            rt.forward(q, k, v, out=out)
            rt.forward(q, k, v, out=out)  # the second call caches the direct launchers
            torch.cuda.synchronize()
            ref = out[: tree.n_queries].clone()
            (launchers,) = list(rt._launchers.values())

            def one(launchers=launchers, q=q, k=k, v=v, out=out):
                s = torch.cuda.current_stream().cuda_stream
                for launch in launchers:
                    launch(s, q, k, v, out, scale)

            def fork(launchers=launchers, q=q, k=k, v=v, out=out):
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                launchers[0](side.cuda_stream, q, k, v, out, scale)
                launchers[1](main.cuda_stream, q, k, v, out, scale)
                main.wait_stream(side)
                launchers[2](main.cuda_stream, q, k, v, out, scale)

            res: dict = {"scenario": scenario, "queries": tree.n_queries}
            for rep in range(2):
                for name, fn in (("one", one), ("fork", fork)):
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    res[name + "_err"] = (out[: tree.n_queries].float() - ref.float()).abs().max().item()
                    res[f"{name}{rep}"] = graph_time_us(fn)["median"]
            rows.append(res)
            o, f = min(res["one0"], res["one1"]), min(res["fork0"], res["fork1"])
            print(f"{scenario:28s} q {tree.n_queries:4d} one {o:7.1f} fork {f:7.1f} ({f / o:.3f})")
    Path(out_path).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
