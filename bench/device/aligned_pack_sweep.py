"""Runtime configs with bigger packing budgets and packing's aligned blocks, on decode-serving trees.

With aligned blocks a document and its questions can share one bin (KV read once, one partial
per query, no merge) once the bin's token budget holds them, which the tuned export's budget
(Llama: 512 tokens) does not. For the Llama (32/32) and Mistral (32/8) shapes, head dim 128,
fp16, this times ``TreeAttentionRuntime.forward`` (CUDA-graph replay, the trees of steps 10, 25,
39 of ``multi_document_qa`` and ``few_shot``, as ``bench.decode_config_sweep``) for the export's
config and for it with ``pack_tokens`` 1024 / 2048 / 4096 and ``pack_min_units`` 132 or the
export's, each with the runtime's fixed blocks and with aligned ones
(``fasttree.runtime_planning.ALIGNED_BLOCKS``), every variant once per round, ``--rounds`` rounds in turn
(median per tree). ::

    python3 bench/device/aligned_pack_sweep.py --rounds 3 --out $OUT/aligned_pack_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

import fasttree as ft
from bench.common import switched, write_device_result
from bench.decode_config_sweep import HEAD_DIM, MODELS, SCENARIOS, _timer, sweep_trees
from fasttree import runtime_planning
from fasttree.cli import _int_at_least
from fasttree.export import read_export
from fasttree.toolkit.refine import RuntimeBench

PACK_TOKENS = (1024, 2048, 4096)


def variants(base: ft.FastTreeConfig) -> list[tuple[str, ft.FastTreeConfig]]:
    """The export's config first, then its packing budgets (``pack{tokens}m{min_units}``)."""
    out = [("tuned", base)]
    for tokens in PACK_TOKENS:
        for min_units in sorted({132, base.pack_min_units}):
            out.append(
                (f"pack{tokens}m{min_units}", dataclasses.replace(base, pack_tokens=tokens, pack_min_units=min_units))
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=_int_at_least(1, "an integer >= 1"), default=3)
    p.add_argument("--export", default="docs/tune/export_measured.json")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    export = read_export(args.export)
    rows = []
    for model, (hq, hkv) in MODELS.items():
        base, _ = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, dtype="float16")
        trees = {s: sweep_trees(s) for s in SCENARIOS}
        bench = RuntimeBench(trees, num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, dtype=torch.float16,
                             device="cuda", timer=_timer)  # fmt: skip
        arms = [(name, cfg, aligned) for name, cfg in variants(base) for aligned in (False, True)]
        timed: dict[tuple[str, bool], list[dict[str, list[float]]]] = {(n, a): [] for n, _, a in arms}
        for _ in range(args.rounds):
            for name, cfg, aligned in arms:
                with switched(runtime_planning, "ALIGNED_BLOCKS", aligned):
                    timed[(name, aligned)].append(bench.times(cfg))
        for name, _, aligned in arms:
            for scenario in SCENARIOS:
                per_tree = np.median([r[scenario] for r in timed[(name, aligned)]], axis=0).tolist()
                row = {"model": model, "scenario": scenario, "variant": name, "aligned": aligned,
                       "times_us": per_tree, "sum_us": float(sum(per_tree))}  # fmt: skip
                rows.append(row)
        for scenario in SCENARIOS:
            ref = next(
                r["sum_us"]
                for r in rows
                if (r["model"], r["scenario"], r["variant"], r["aligned"]) == (model, scenario, "tuned", False)
            )
            for r in rows:
                if (r["model"], r["scenario"]) == (model, scenario):
                    r["vs_tuned"] = r["sum_us"] / ref
                    print(f"{model:8s} {scenario:18s} {r['variant']:16s} aligned={r['aligned']!s:5s} "
                          f"{r['sum_us']:8.1f} us  {r['vs_tuned']:.3f}", flush=True)  # fmt: skip
    summary = {}
    for model in MODELS:
        for scenario in SCENARIOS:
            mine = [r for r in rows if (r["model"], r["scenario"]) == (model, scenario)]
            best = min(mine, key=lambda r: r["sum_us"])
            summary[f"{model}/{scenario}"] = {"best": f"{best['variant']} aligned={best['aligned']}",
                                              "best_vs_tuned": best["vs_tuned"]}  # fmt: skip
    write_device_result(args.out, summary, rounds=args.rounds, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
