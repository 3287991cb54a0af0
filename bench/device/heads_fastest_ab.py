"""Stage-1 items with the KV heads fastest vs the units fastest: an A/B on the GPU.

A stage-1 item is one (work unit, KV head). Units fastest (the kernels' order before b5e7450:
every unit of KV head 0, longest first, then those of head 1, ...), the programs running at
one time read one or a few heads' 256-byte K and V rows of many slots, rows that lie
``Hkv * D * 2`` bytes apart in the pools. With ``HEADS_FASTEST`` (``fasttree.attention
._HEADS_FASTEST``, the default since b5e7450) a unit's heads run together and read each
slot's rows of all heads, which are contiguous. Results: ``docs/bench/h200/heads_fastest_ab_1231380.json``
(its runtime rows compared one order twice) and ``heads_fastest_ab_runtime_589d1fc.json``.

Timed by CUDA-graph replay, both orders in one run, outputs compared (poisoned with NaN
first):

* ``paper``: the stage-1 launches of ``fasttree.tree_attention`` on the paper suite's MHA and
  GQA-4 cases (GQA 16 has one KV head: nothing changes), the default config;
* ``decode``: the same for Llama (32/32) and Mistral (32/8) decode trees of the four serving
  scenarios (seed 0, steps 10, 25, 39), the refined export's config;
* ``runtime``: ``TreeAttentionRuntime.forward`` (both stage-1 slots and the merge) on those
  decode trees, one runtime per order.

::

    python3 bench/device/heads_fastest_ab.py --out $OUT/heads_fastest_ab.json
"""

from __future__ import annotations

import argparse

import torch

import fasttree as ft
from bench.common import geomean, write_device_result
from bench.stage1_ab import max_abs_diff, poisoned_outputs, run_launches, stage1_launches
from fasttree import attention
from fasttree.export import read_export
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.suite import paper_tree
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

D = 128
SCENARIOS = ("multi_document_qa", "few_shot", "multi_level_system_prompts", "chain_reasoning")
STEPS = (10, 25, 39)
MODELS = {"llama": (32, 32), "mistral": (32, 8)}


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float16)


def per_plan(tree, config, hq, hkv, gen) -> dict:
    slots = tree.max_slot + 1
    q, k, v = randn(gen, tree.n_queries, hq, D), randn(gen, slots, hkv, D), randn(gen, slots, hkv, D)
    plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
    out = torch.full_like(q, float("nan"))
    attention._HEADS_FASTEST = False  # read when the launches are set up
    units = stage1_launches(plan, q, k, v, out)
    attention._HEADS_FASTEST = True
    heads = stage1_launches(plan, q, k, v, out)
    assert all(cx[-1] for *_, cx, _, _, _ in heads) and not any(cx[-1] for *_, cx, _, _, _ in units)
    ref = poisoned_outputs(lambda: run_launches(units), plan, out)
    diff = max_abs_diff(ref, poisoned_outputs(lambda: run_launches(heads), plan, out))
    t = {"units": [], "heads": []}
    for _ in range(2):  # interleaved, the better of two each
        t["units"].append(graph_time_us(lambda: run_launches(units))["median"])
        t["heads"].append(graph_time_us(lambda: run_launches(heads))["median"])
    return {"units": min(t["units"]), "heads": min(t["heads"]), "diff": diff}


def runtime_pair(trees, config, hq, hkv, gen) -> list[dict]:
    slots, nq = max(t.max_slot + 1 for t in trees), max(t.n_queries for t in trees)
    q, k, v = randn(gen, nq, hq, D), randn(gen, slots, hkv, D), randn(gen, slots, hkv, D)
    out = torch.empty_like(q)
    rts = {}
    for name, flag in (("units", False), ("heads", True)):
        attention._HEADS_FASTEST = flag  # read when a runtime is built
        rts[name] = TreeAttentionRuntime(
            config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16, device="cuda",
            max_queries=nq, max_kv_entries=8 * slots, max_units=1 << 16, max_partial_rows=64 * nq, pool_slots=slots,
        )  # fmt: skip
        rts[name].plan(trees[0])
        rts[name].forward(q, k, v, out=out)
    rows = []
    for tree in trees:
        res: dict = {"queries": tree.n_queries, "units": [], "heads": []}
        outs = {}
        for name, rt in rts.items():
            rt.plan(tree)
            out.fill_(float("nan"))
            rt.forward(q, k, v, out=out)
            torch.cuda.synchronize()
            outs[name] = out[: tree.n_queries].clone()
        res["diff"] = max_abs_diff((outs["units"],), (outs["heads"],))
        for _ in range(2):
            for name, rt in rts.items():
                rt.plan(tree)
                res[name].append(graph_time_us(lambda rt=rt: rt.forward(q, k, v, out=out))["median"])
        res["units"], res["heads"] = min(res["units"]), min(res["heads"])
        rows.append(res)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--no-paper", action="store_true")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def show(r):
        rows.append(r)
        print(f"{r['set']:8s} {r['name']:44s} units {r['units']:8.1f} heads {r['heads']:8.1f} "
              f"({r['heads'] / r['units']:.3f}) diff {r['diff']:.1e}", flush=True)  # fmt: skip

    if not args.no_paper:
        for c in range(1, 16):
            for ratio, (hq, hkv) in (("mha", (32, 32)), ("gqa4", (32, 8))):
                show({"set": "paper", "name": f"{c}/{ratio}", **per_plan(paper_tree(c), None, hq, hkv, gen)})
    export = read_export("docs/tune/export_measured.json")
    for model, (hq, hkv) in MODELS.items():
        config, _ = export.lookup(
            gpu=torch.cuda.get_device_name(0), num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16
        )
        for scenario in SCENARIOS:
            steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
            trees = [steps[i].tree for i in STEPS]
            for i, tree in zip(STEPS, trees, strict=True):
                show({"set": "decode", "name": f"{model} {scenario} {i}", **per_plan(tree, config, hq, hkv, gen)})
            for i, r in zip(STEPS, runtime_pair(trees, config, hq, hkv, gen), strict=True):
                show({"set": "runtime", "name": f"{model} {scenario} {i}", **r})
    summary = {}
    for group in ("paper", "decode", "runtime"):
        for tag in ("", "llama", "mistral", "mha", "gqa4"):
            sel = [r for r in rows if r["set"] == group and tag in r["name"]]
            if sel:
                ratios = [r["heads"] / r["units"] for r in sel]
                summary[f"{group}/{tag or 'all'}"] = {
                    "n": len(sel), "geomean": geomean(ratios), "min": min(ratios), "max": max(ratios),
                    "max_diff": max(r["diff"] for r in sel),
                }  # fmt: skip
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
