"""Should MHA's large-tile units be packed into 16-query bins (``plan_arrays._PACK_WIDE_UNITS``)?

Packing cuts a unit into one piece per block of a bin's queries, and every piece reads the
unit's whole KV. For GQA a bin holds a large tile's queries, so no unit is cut for its width;
for MHA a bin holds 16 queries (a 16-row tile) while a large-tile unit has up to 64, so a
short shared node read by 64 queries is read up to 4 times instead of once: 11/mha reads
51,200 KV tokens per head for 21,120 unique (its top 448 tokens in each of 64 bins). Keeping
such units whole (in the 64-row class, merged with the bins' partials) reads 28,160 there, and
10-45% fewer on the 13 MHA paper cases and 8-18% fewer on Llama's few-shot, multi-level and
chain decode trees, at the price of a merge.

This times both settings by CUDA-graph replay, on the plans the setting changes:

* ``tree_attention`` on the paper cases (default config), checked against the float64
  reference;
* ``tree_attention`` and ``TreeAttentionRuntime.forward`` (the serving path, the refined
  export's configs) on the Llama and Mistral trees of the four serving scenarios (steps 10,
  25, 39).

With ``--heldout FIRST:END`` it also times both settings on MHA trees the paper suite does not
hold: every tree family's trees of seeds ``FIRST..END-1`` (``fasttree.toolkit.workloads.sample_tree``)
whose plans the setting changes. Every row records the KV tokens the whole units save per partial
row they add (``tokens_saved_per_partial``), the measure a per-tree choice between the two plans
would read; ``--rounds`` times each setting that many times in turn (medians). ::

    python3 bench/device/pack_wide_ab.py --out $OUT/pack_wide_ab.json
    python3 bench/device/pack_wide_ab.py --heldout 1000:1040 --rounds 3 --no-decode --out $OUT/wide_heldout.json
"""

from __future__ import annotations

import argparse

import torch

import fasttree as ft
from bench.common import (
    checked_graph_time,
    geomean,
    random_case,
    seed_range,
    serving_inputs,
    switched,
    time_serving_trees,
    timed_in_turn,
    write_device_result,
)
from fasttree import plan_arrays
from fasttree.cli import _int_at_least
from fasttree.export import read_export
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.workloads import TREE_FAMILIES, iter_serving, sample_tree

D = 128
SETTINGS = {"packed": True, "whole": False}
SCENARIOS = ("multi_document_qa", "few_shot", "multi_level_system_prompts", "chain_reasoning")
STEPS = (10, 25, 39)


def plans(tree, config, hq, hkv) -> dict[str, ft.Plan]:
    out = {}
    for name, wide in SETTINGS.items():
        with switched(plan_arrays, "_PACK_WIDE_UNITS", wide):
            out[name] = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
    return out


def differ(a: ft.Plan, b: ft.Plan) -> bool:
    return a.stats() != b.stats() or a.n_partial_rows != b.n_partial_rows


def describe(plan: ft.Plan) -> dict:
    s = plan.stats()
    return {"kv_tokens_read": int(s["kv_tokens_read"]), "units": [int(u) for u in s["units"]],
            "partial_rows": int(plan.n_partial_rows)}  # fmt: skip


def timed_pair(tree: ft.KVTree, hq: int, hkv: int, data_seed: int, rounds: int, **ids) -> dict | None:
    """Both settings' plans of ``tree`` timed in turn (None when the setting changes no plan)."""
    ps = plans(tree, None, hq, hkv)
    if not differ(ps["packed"], ps["whole"]):
        return None
    q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=data_seed, samples=16)
    calls = {name: (lambda plan=plan: checked_graph_time(plan, q, k, v, sample, ref)) for name, plan in ps.items()}
    timed = timed_in_turn(calls, rounds)
    row = {**ids, **{name: {**timed[name], **describe(plan)} for name, plan in ps.items()}}
    saved = row["packed"]["kv_tokens_read"] - row["whole"]["kv_tokens_read"]
    added = row["whole"]["partial_rows"] - row["packed"]["partial_rows"]
    row["tokens_saved_per_partial"] = saved / added if added > 0 else None
    label = " ".join(f"{key}={value}" for key, value in ids.items())
    print(f"{label}: packed {row['packed']['graph_us']:.1f} whole {row['whole']['graph_us']:.1f} "
          f"({row['whole']['graph_us'] / row['packed']['graph_us']:.3f}) saved/added {saved}/{added} err "
          f"{row['packed']['err']:.1e}/{row['whole']['err']:.1e}", flush=True)  # fmt: skip
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    positive = _int_at_least(1, "an integer >= 1")
    p.add_argument("--out", required=True)
    p.add_argument("--heldout", type=seed_range, help="FIRST:END seeds of the tree families' MHA trees to time too")
    p.add_argument("--rounds", type=positive, default=1, help="timings per setting, taken in turn (median)")
    p.add_argument("--no-decode", action="store_true", help="skip the serving trees")
    args = p.parse_args()
    paper = []
    for case in range(1, 16):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            row = timed_pair(tree, hq, hkv, case, args.rounds, case=case, heads=heads)
            if row is not None:
                paper.append(row)
    heldout = []
    for family in sorted(TREE_FAMILIES) if args.heldout else ():
        for seed in args.heldout:
            row = timed_pair(sample_tree(family, seed), 32, 32, seed, args.rounds, family=family, seed=seed)
            if row is not None:
                heldout.append(row)
    decode = []
    scenarios = () if args.no_decode else SCENARIOS
    export = read_export("docs/tune/export_measured.json")
    gpu = torch.cuda.get_device_name(0)
    for model, (hq, hkv) in {"llama": (32, 32), "mistral": (32, 8)}.items():
        config, _ = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16)
        for scenario in scenarios:
            steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
            trees = [steps[i].tree for i in STEPS]
            if not any(differ(*plans(t, config, hq, hkv).values()) for t in trees):
                continue
            q, k, v, out = serving_inputs(trees, hq, hkv, D)
            row = {"model": model, "scenario": scenario}
            for name, wide in SETTINGS.items():
                with switched(plan_arrays, "_PACK_WIDE_UNITS", wide):
                    row[name] = time_serving_trees(config, trees, q, k, v, out)
            decode.append(row)
            print(f"{model} {scenario}: runtime {row['whole']['runtime_us'] / row['packed']['runtime_us']:.3f} "
                  f"tree_attention {row['whole']['tree_attention_us'] / row['packed']['tree_attention_us']:.3f} "
                  f"err {row['packed']['max_err']:.1e}/{row['whole']['max_err']:.1e}", flush=True)  # fmt: skip
    summary = {
        "paper_whole_over_packed": geomean([r["whole"]["graph_us"] / r["packed"]["graph_us"] for r in paper]),
        "paper_worst": max((r["whole"]["graph_us"] / r["packed"]["graph_us"] for r in paper), default=None),
        "paper_best": min((r["whole"]["graph_us"] / r["packed"]["graph_us"] for r in paper), default=None),
        "decode_runtime_whole_over_packed": geomean(
            [r["whole"]["runtime_us"] / r["packed"]["runtime_us"] for r in decode]
        ),
        "decode_tree_attention_whole_over_packed": geomean(
            [r["whole"]["tree_attention_us"] / r["packed"]["tree_attention_us"] for r in decode]
        ),
        "heldout_trees": len(heldout),
        "heldout_whole_over_packed": geomean([r["whole"]["graph_us"] / r["packed"]["graph_us"] for r in heldout]),
    }
    write_device_result(args.out, summary, paper=paper, heldout=heldout, decode=decode, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
