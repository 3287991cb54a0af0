"""A/B of a planner switch (a module attribute) on the GPU, on the plans it changes.

Sets ``--switch`` (``module:ATTRIBUTE``, e.g. ``fasttree.plan_arrays:_BALANCED_RUNS``) to each of
``--values`` in turn (the first is the baseline), plans, and times by CUDA-graph replay:

* ``tree_attention`` on the paper cases (default config) whose plan some value changes, each
  value's output checked against the float64 reference on sampled queries;
* ``TreeAttentionRuntime.forward`` (the serving path) and ``tree_attention`` on the Llama and
  Mistral trees of the four serving scenarios (steps 10, 25, 39), with the configs the decode
  benchmark uses (``docs/tune/export_measured.json``), where some value changes a plan;
* with ``--heldout FIRST:END``, ``tree_attention`` on every tree family's trees of those seeds
  (:func:`fasttree.toolkit.workloads.sample_tree`: trees the paper suite does not hold) at the three
  paper head ratios, default config, where some value changes a plan, checked as the paper
  cases are.

With ``--launch`` the switch is a launch switch (e.g. ``fasttree.attention:_PDL``), which changes
no plan: every paper case and serving tree is timed, each value's plan and runtime built and
timed with the switch set. The switch is restored after every use. ::

    python3 bench/device/switch_ab.py --switch fasttree.plan_arrays:_BALANCED_RUNS \\
        --values false,null --out $OUT/balanced_ab.json

Values holding commas take another separator: ``--switch fasttree.planner:_WHOLE_GROUPS_MIN_ITEMS
--values 'null;[1,2]' --sep ';'``. (``run_split_ab_02f073c.json`` came from ``--switch
fasttree.packing:RUN_SPLIT --values fill,balanced,balanced_floor``, a switch of 02f073c that
became ``pack_units(balanced=)``; its ``balanced`` arm is ``_BALANCED_RUNS`` true.
``subtree_blocks_heldout_74e9d2b.json`` came from ``--switch fasttree.packing:_SUBTREE_BLOCKS
--values false,true --heldout 1000:1020``, a switch of 74e9d2b that became ``_ALIGNED_BLOCKS``,
whose ``true`` then also aligned blocks that cut no short unit.)
"""

from __future__ import annotations

import argparse
import importlib
import json
from functools import partial
from typing import Any

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
from fasttree.cli import _int_at_least
from fasttree.export import read_export
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.workloads import TREE_FAMILIES, iter_serving, sample_tree

D = 128
SCENARIOS = ("multi_document_qa", "few_shot", "multi_level_system_prompts", "chain_reasoning")
STEPS = (10, 25, 39)
MODELS = {"llama": (32, 32), "mistral": (32, 8)}


def parse_value(text: str) -> Any:
    """A ``--values`` item: JSON (numbers, true/false, null) when it parses, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def describe(plan: ft.Plan) -> dict:
    s = plan.stats()
    return {"kv_tokens_read": int(s["kv_tokens_read"]), "units": [int(u) for u in s["units"]],
            "partial_rows": int(plan.n_partial_rows), "gflops": float(s["flops"]) / 1e9}  # fmt: skip


def plans(module, attr, values, tree, config, hq, hkv) -> list[ft.Plan]:
    out = []
    for value in values:
        with switched(module, attr, value):
            out.append(ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D))
    return out


def differ(ps: list[ft.Plan]) -> bool:
    first = ps[0]
    return any(p.stats() != first.stats() or p.n_partial_rows != first.n_partial_rows for p in ps[1:])


def _timed_switched(module, attr, value, plan, q, k, v, sample, ref) -> dict:
    """:func:`checked_graph_time` of ``plan`` with the switch set to ``value``."""
    with switched(module, attr, value):
        return checked_graph_time(plan, q, k, v, sample, ref)


def paper_items(cases: list[int] | None = None):
    """``(ids, tree, heads, seed)`` of every paper case (all 15, or ``cases``) and head ratio."""
    for case in cases or range(1, 16):
        tree = paper_tree(case)
        for heads in PAPER_HEADS:
            yield {"case": case, "heads": heads}, tree, heads, case


def heldout_items(seeds: range):
    """``(ids, tree, heads, seed)`` of every tree family's trees drawn with ``seeds`` (trees the
    paper suite does not hold), at each paper head ratio."""
    for family in sorted(TREE_FAMILIES):
        for seed in seeds:
            tree = sample_tree(family, seed)
            for heads in PAPER_HEADS:
                yield {"family": family, "seed": seed, "heads": heads}, tree, heads, seed


def tree_rows(module, attr, values, names, items, launch: bool = False, rounds: int = 1) -> list[dict]:
    """Per item of ``items`` (:func:`paper_items`, :func:`heldout_items`; default config) whose plan
    some value changes (every item with ``launch``): each value's graph time, the median of
    ``rounds`` timings taken in turn (A, B, A, B, ...: the GPU's drift falls on every value alike)."""
    rows = []
    for ids, tree, heads, seed in items:
        hq, hkv = PAPER_HEADS[heads]
        ps = plans(module, attr, values, tree, None, hq, hkv)
        if not launch and not differ(ps):
            continue
        q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=seed, samples=16)
        row = dict(ids)
        calls = {
            name: partial(_timed_switched, module, attr, value, plan, q, k, v, sample, ref)
            for name, value, plan in zip(names, values, ps, strict=True)
        }
        timed = timed_in_turn(calls, rounds)
        for name, plan in zip(names, ps, strict=True):
            row[name] = {**timed[name], **describe(plan)}
        rows.append(row)
        base = row[names[0]]["graph_us"]
        ratios = " ".join(f"{n}:{row[n]['graph_us'] / base:.3f}" for n in names[1:])
        errs = "/".join(f"{row[n]['err']:.1e}" for n in names)
        label = "/".join(str(x) for x in ids.values())
        print(f"{label}: {names[0]} {base:.1f} us {ratios} err {errs}", flush=True)
    return rows


def decode_rows(module, attr, values, names, launch: bool = False) -> list[dict]:
    rows = []
    export = read_export("docs/tune/export_measured.json")
    gpu = torch.cuda.get_device_name(0)
    for model, (hq, hkv) in MODELS.items():
        config, _ = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16)
        for scenario in SCENARIOS:
            steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
            trees = [steps[i].tree for i in STEPS]
            if not launch and not any(differ(plans(module, attr, values, t, config, hq, hkv)) for t in trees):
                continue
            q, k, v, out = serving_inputs(trees, hq, hkv, D)
            row = {"model": model, "scenario": scenario}
            for name, value in zip(names, values, strict=True):
                with switched(module, attr, value):
                    row[name] = time_serving_trees(config, trees, q, k, v, out)
            rows.append(row)
            base = row[names[0]]
            ratios = " ".join(
                f"{n}: runtime {row[n]['runtime_us'] / base['runtime_us']:.3f} "
                f"tree_attention {row[n]['tree_attention_us'] / base['tree_attention_us']:.3f}"
                for n in names[1:]
            )
            errs = "/".join(f"{row[n]['max_err']:.1e}" for n in names)
            print(f"{model} {scenario}: {ratios} err {errs}", flush=True)
    return rows


def summarize(paper: list[dict], decode: list[dict], names: list[str], heldout: list[dict] | None = None) -> dict:
    base = names[0]
    out = {}
    for n in names[1:]:
        r = [row[n]["graph_us"] / row[base]["graph_us"] for row in paper]
        h = [row[n]["graph_us"] / row[base]["graph_us"] for row in heldout or ()]
        out[n] = {
            "paper_changed": len(r),
            "paper_geomean_over_changed": geomean(r),
            "paper_geomean_over_45": geomean(r + [1.0] * (45 - len(r))),
            "paper_best": min(r, default=None),
            "paper_worst": max(r, default=None),
            "paper_max_err": max((row[n]["err"] for row in paper), default=None),
            "decode_runtime": geomean([row[n]["runtime_us"] / row[base]["runtime_us"] for row in decode]),
            "decode_tree_attention": geomean(
                [row[n]["tree_attention_us"] / row[base]["tree_attention_us"] for row in decode]
            ),
            "decode_max_err": max((row[n]["max_err"] for row in decode), default=None),
        }
        if heldout is not None:
            out[n].update(
                heldout_changed=len(h), heldout_geomean_over_changed=geomean(h), heldout_best=min(h, default=None),
                heldout_worst=max(h, default=None),
                heldout_max_err=max((row[n]["err"] for row in heldout), default=None),
            )  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    positive = _int_at_least(1, "an integer >= 1")
    p.add_argument("--switch", required=True, help="module:ATTRIBUTE, e.g. fasttree.plan_arrays:_BALANCED_RUNS")
    p.add_argument("--values", required=True, help="values separated by --sep, the baseline first")
    p.add_argument("--sep", default=",", help="separator of --values (default ','; e.g. ';' for lists)")
    p.add_argument("--no-decode", action="store_true", help="paper cases only")
    p.add_argument("--launch", action="store_true", help="a launch switch: time every case, not only changed plans")
    p.add_argument("--cases", help="paper cases to time, comma-separated (default: all 15)")
    p.add_argument("--rounds", type=positive, default=1, help="timings per paper case and value, taken in turn")
    p.add_argument("--heldout", type=seed_range, help="FIRST:END seeds of every tree family's trees to time too")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    mod_name, _, attr = args.switch.partition(":")
    module = importlib.import_module(mod_name)
    if not attr or not hasattr(module, attr):
        p.error(f"{args.switch!r} names no attribute of {mod_name}")
    names = args.values.split(args.sep)
    values = [parse_value(x) for x in names]
    try:
        cases = [int(c) for c in args.cases.split(",")] if args.cases else None
    except ValueError:
        p.error(f"--cases must be comma-separated case numbers, got {args.cases!r}")
    if cases is not None and not all(1 <= c <= 15 for c in cases):
        p.error(f"--cases must be paper cases 1-15, got {args.cases!r}")
    paper = tree_rows(module, attr, values, names, paper_items(cases), args.launch, args.rounds)
    heldout = None
    if args.heldout:
        heldout = tree_rows(module, attr, values, names, heldout_items(args.heldout), args.launch, args.rounds)
    decode = [] if args.no_decode else decode_rows(module, attr, values, names, args.launch)
    summary = summarize(paper, decode, names, heldout)
    print(json.dumps(summary, indent=1), flush=True)
    extra = {} if heldout is None else {"heldout": heldout}
    write_device_result(args.out, summary, switch=args.switch, values=names, paper=paper, decode=decode, **extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
