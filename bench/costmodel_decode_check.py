"""How well the committed H200 latency model ranks runtime configs on decode-serving trees (CPU).

    TRITON_INTERPRET=1 python -m bench.costmodel_decode_check    # writes docs/results/costmodel_decode_check.md

Input: the H200 decode config sweeps (``traces/decode_sweeps/decode_config_sweep*_f18595e.json``,
made at f18595e by a one-off GPU sweep script, ``decode_config_sweep.py``, not part of the
repository, with ``--grid one`` and ``--grid combos``): per (model, scenario),
configs (the tuned one of the export they varied, kept as ``traces/decode_sweeps/export_f18595e.json``,
and variations of it) timed by CUDA-graph replay of
``TreeAttentionRuntime.forward`` on three ``iter_serving(scenario, seed=0, steps=40)``
trees (steps 10, 25 and 39). The configs are rebuilt here with the sweeps' own code
(:func:`variants_one_at_a_time`, :func:`variants_combinations`) and
matched to the rows by position (their names are checked too).

Each (tree, config) is planned as the runtime plans it (a ``TreeAttentionRuntime`` on the
CPU, hence ``TRITON_INTERPRET=1``: it may re-plan a step query-centric), then predicted by
the shipped model (``costmodel/data/h200_latency_model.skops``; ``predict_plans``' feature rows and model call), by
the model file's calibrated simulator, and scored by the published planner's cost (ranks
only). Per (model, scenario), the predictions of a config are summed over the three trees
and compared with the measured sum: Kendall tau-b over configs, the fraction of config
pairs measured more than 2% apart that are ordered right, MAPE of the per-tree
predictions, top-1 score (measured best / measured time of the predictor's pick) and the
measured and predicted ratio of the best-measured config to the tuned one.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau

from fasttree.config import FastTreeConfig
from fasttree.costmodel.evaluate import SimulatorBaseline
from fasttree.costmodel.features import KERNEL_VERSION_COLUMN, features_of_plans, mark_runtime, published_cost
from fasttree.costmodel.gpu import GpuSpec
from fasttree.costmodel.persist import load_model
from fasttree.export import read_export
from fasttree.fileio import write_atomic
from fasttree.runtime import TreeAttentionRuntime
from fasttree.runtime_planning import launch_view, resolve_stage1_launches
from fasttree.toolkit import shipped
from fasttree.toolkit.workloads import iter_serving

log = logging.getLogger("bench.costmodel_decode_check")

GPU = "NVIDIA H200"
MODELS = {"llama": (32, 32), "mistral": (32, 8)}
HEAD_DIM = 128
STEPS = (10, 25, 39)
SWEEPS = {
    "traces/decode_sweeps/decode_config_sweep_f18595e.json": "sweep1",
    "traces/decode_sweeps/decode_config_sweep2_f18595e.json": "sweep2",
}
#: Config pairs whose measured sums differ by more than this (relative) count in ``pairs_ok``.
PAIR_GAP = 0.02
PREDICTORS = ("learned", "learned (as tree_attention)", "simulator", "published cost")
#: The kernel version the sweeps timed (``docs/history.md``: f18595e runs the kernels of v14,
#: the newest row before it that moved the per-plan kernels' GPU time; v15 and v16 changed the
#: runtime's item claims and the host path). The learned model is asked about those kernels, not
#: today's, so its ranks compare with what the sweeps measured.
SWEEP_KERNEL_VERSION = 14
#: ``FastTreeConfig()`` as the sweeps ran it (f18595e): explicit warps and stages; since v23/v25 the
#: defaults pick them per head ratio (``None``), so the ``default`` row is rebuilt with these.
SWEEP_DEFAULT_CONFIG = {"num_warps": (4, 4), "num_stages": (3, 3)}


def variants_one_at_a_time(base: FastTreeConfig, model: str) -> list[tuple[str, FastTreeConfig]]:
    """One-at-a-time variations of ``base`` (the first sweep, ``--grid one``), ``base`` first."""
    r = dataclasses.replace
    v = [("tuned", base), ("default", FastTreeConfig())]
    for s in [(512, 64), (2048, 64), (1024, 128), (1024, 32), (512, 128), (4096, 128)]:
        v.append((f"split{s}", r(base, kv_split_sizes=s)))
    for p in [0, 256, 1024, 2048]:
        v.append((f"pack{p}", r(base, pack_tokens=p)))
    for m in [132, 528, 1056]:
        v.append((f"packmin{m}", r(base, pack_min_units=m)))
    for t in [(64, 32), (128, 64), (64, 128), (32, 32)]:
        v.append((f"kvtile{t}", r(base, kv_tile=t)))
    for w in [(4, 2), (8, 4), (4, 8)]:
        v.append((f"warps{w}", r(base, num_warps=w)))
    for s in [(3, 3), (2, 2), (4, 4), (3, 2)]:
        v.append((f"stages{s}", r(base, num_stages=s)))
    for g in [-10.0, 10.0, 0.5]:
        v.append((f"gamma{g}", r(base, gamma=g)))
    v.append(("thresh_small", r(base, para_threshs1=(528, 1056))))
    v.append(("thresh_big", r(base, para_threshs1=(66, 264))))
    return v


def variants_combinations(base: FastTreeConfig, model: str) -> list[tuple[str, FastTreeConfig]]:
    """Combinations around the first sweep's winners for ``model`` (the second sweep, ``--grid combos``),
    ``base`` first."""
    r = dataclasses.replace
    v = [("tuned", base)]
    if model == "llama":
        splits = [(1024, 64), (512, 128), (512, 64), (256, 128), (768, 128), (384, 128)]
        for w, s, p in itertools.product([(4, 4), (4, 2)], splits, [512, 256, 768]):
            v.append((f"w{w}s{s}p{p}", r(base, num_warps=w, kv_split_sizes=s, pack_tokens=p)))
    else:
        splits = [(1024, 128), (512, 128), (256, 128), (384, 128), (768, 128), (512, 64)]
        grid = itertools.product(splits, [(64, 64), (64, 128)], [base.gamma, -10.0], [base.para_threshs1, (66, 264)])
        for s, t, g, th in grid:
            v.append((f"s{s}t{t}g{g}th{th}", r(base, kv_split_sizes=s, kv_tile=t, gamma=g, para_threshs1=th)))
    return v


VARIANTS = {"sweep1": variants_one_at_a_time, "sweep2": variants_combinations}


def runtime_plans(trees, configs, hq: int, hkv: int) -> tuple[list, int, list]:
    """The plan a CPU runtime (the sweeps' capacities) uploads for every (config, tree).

    Also returns how many of those plans the runtime made query-centric, and each plan as the
    runtime launches it (:func:`fasttree.runtime_planning.launch_view`).
    """
    slots = max(t.max_slot + 1 for t in trees)
    nq = max(t.n_queries for t in trees)
    plans, qc, views = [], 0, []
    for cfg in configs:
        rt = TreeAttentionRuntime(
            cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, dtype=torch.float16, device="cpu",
            max_queries=nq, max_kv_entries=8 * slots, max_units=1 << 16, max_partial_rows=64 * nq, pool_slots=slots,
            extend_steps=0, max_variants=0,  # the fixed launch's fresh plans, as the sweeps measured them
        )  # fmt: skip
        for tree in trees:
            up = rt.plan(tree)
            plans.append(up.plan)
            views.append(launch_view(up.plan, cfg, stage1_launches=rt.stage1_launches))
            qc += bool(up.query_centric)
        del rt
    return plans, qc, views


def rank_metrics(score: np.ndarray, meas: np.ndarray) -> dict:
    """Rank metrics of per-config scores (float [n], lower = faster) against measured sums (us, float [n])."""
    pick = int(np.argmin(score))  # first of ties
    i, j = np.triu_indices(meas.size, 1)
    far = np.abs(meas[i] - meas[j]) > PAIR_GAP * np.minimum(meas[i], meas[j])
    agree = np.sign(score[i] - score[j]) * np.sign(meas[i] - meas[j])
    ok = float(np.mean(np.where(agree[far] == 0, 0.5, agree[far] > 0))) if far.any() else float("nan")
    return {
        "tau": float(kendalltau(score, meas).statistic),
        "pairs_ok": ok,
        "n_pairs": int(far.sum()),
        "pick": pick,
        "top1": float(meas.min() / meas[pick]),
        "pick_vs_tuned": float(meas[pick] / meas[0]),
    }


def check_group(rows: list[dict], pred: dict[str, np.ndarray], names: list[str]) -> dict:
    """Metrics of one (model, scenario): ``pred`` maps predictor -> float [n_configs, n_trees]."""
    meas_tree = np.array([r["times_us"] for r in rows], dtype=np.float64)
    meas = np.array([r["sum_us"] for r in rows], dtype=np.float64)
    best = int(np.argmin(meas))
    out = {
        "n": len(rows),
        "best": best,
        "names": names,
        "meas": meas,
        "best_vs_tuned_meas": float(meas[best] / meas[0]),
    }
    for name, p in pred.items():
        s = p.sum(axis=1)
        m = rank_metrics(s, meas)
        m["sum"] = s
        if name != "published cost":  # arbitrary units: ranks only
            m["mape"] = float(np.mean(np.abs(p - meas_tree) / meas_tree))
            m["ratio"] = float(np.median(p / meas_tree))
            m["best_vs_tuned_pred"] = float(s[best] / s[0])
        out[name] = m
    return out


def sweep_base_config(export, hq: int, hkv: int) -> FastTreeConfig:
    """The ``tuned`` config the sweeps varied: the export's runtime entry for the shape.

    The sweeps timed one config per shape, so this needs one: the portfolio's last member (a
    version-1 export, as the sweeps used, holds exactly one config per bucket; a version-2 entry's
    last member is its last tuned config). An export without an entry for the shape is an error:
    the defaults would silently stand in for the config the sweeps measured.
    """
    portfolio, entry = export.lookup(
        gpu=GPU, num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, dtype="float16", target="runtime"
    )
    if entry is None:
        raise ValueError(f"the export serves no runtime entry for {GPU!r} heads {hq}/{hkv} d{HEAD_DIM} float16")
    return portfolio.members[-1]


def run_sweep(path: str, kind: str, model, sim: SimulatorBaseline, gpu: GpuSpec, export) -> list[dict]:
    doc = json.loads(Path(path).read_text())
    if doc["gpu"] != GPU:
        raise ValueError(f"{path}: measured on {doc['gpu']!r}, the model is for {GPU!r}")
    groups = []
    for model_name, (hq, hkv) in MODELS.items():
        base = sweep_base_config(export, hq, hkv)
        for scenario in dict.fromkeys(r["scenario"] for r in doc["results"]):
            rows = [r for r in doc["results"] if r["model"] == model_name and r["scenario"] == scenario]
            if not rows:
                continue
            variants = [
                (name, dataclasses.replace(cfg, **SWEEP_DEFAULT_CONFIG) if name == "default" else cfg)
                for name, cfg in VARIANTS[kind](base, model_name)
            ]
            names = [n for n, _ in variants]
            if names != [r["variant"] for r in rows]:
                raise ValueError(f"{path} {model_name}/{scenario}: rows do not match the regenerated variants")
            steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
            trees = [steps[i].tree for i in STEPS]
            plans, qc, views = runtime_plans(trees, [c for _, c in variants], hq, hkv)
            X_kernels = features_of_plans(plans, gpu)  # the plans as tree_attention would launch them
            X = mark_runtime(features_of_plans(views, gpu), resolve_stage1_launches("auto", hq // hkv, HEAD_DIM))
            X[:, KERNEL_VERSION_COLUMN] = X_kernels[:, KERNEL_VERSION_COLUMN] = SWEEP_KERNEL_VERSION
            shape = (len(variants), len(trees))
            pred = {
                "learned": model.predict(X).reshape(shape),
                "learned (as tree_attention)": model.predict(X_kernels).reshape(shape),
                "simulator": sim.predict(X).reshape(shape),
                "published cost": np.array([published_cost(p) for p in plans]).reshape(shape),
            }
            g = check_group(rows, pred, names)
            g.update(
                configs=[c for _, c in variants],
                file=path,
                sweep=kind,
                model=model_name,
                scenario=scenario,
                query_centric=qc,
                plans=len(plans),
            )
            groups.append(g)
    return groups


def _f(x: float, digits: int = 3) -> str:
    return "—" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def summary_table(groups: list[dict]) -> list[str]:
    lines = [
        "| model | scenario | configs | predictor | tau | pairs >2% ok | MAPE | pred/meas | top-1 | pick "
        "| pick/tuned (meas) | best/tuned meas | best/tuned pred |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for g in groups:
        for name in PREDICTORS:
            m = g[name]
            lines.append(
                f"| {g['model']} | {g['scenario']} | {g['n']} | {name} | {_f(m['tau'])} "
                f"| {_f(m['pairs_ok'])} ({m['n_pairs']}) | {_f(m.get('mape', np.nan))} | {_f(m.get('ratio', np.nan))} "
                f"| {_f(m['top1'])} | `{g['names'][m['pick']]}` | {_f(m['pick_vs_tuned'])} "
                f"| {_f(g['best_vs_tuned_meas'])} | {_f(m.get('best_vs_tuned_pred', np.nan))} |"
            )
    return lines


def detail_table(g: dict, k: int = 3) -> list[str]:
    """Measured best ``k``, the tuned config and the learned model's top ``k``, with measured and predicted sums."""
    meas, pred = g["meas"], g["learned"]["sum"]
    meas_rank = np.argsort(meas, kind="stable")
    pred_rank = np.argsort(pred, kind="stable")
    mr = np.empty_like(meas_rank)
    mr[meas_rank] = np.arange(meas.size)
    pr = np.empty_like(pred_rank)
    pr[pred_rank] = np.arange(pred.size)
    show = list(dict.fromkeys([*meas_rank[:k].tolist(), 0, *pred_rank[:k].tolist()]))
    lines = [
        f"**{g['model']} / {g['scenario']}**",
        "",
        "| config | measured sum (us) | rank | learned sum (us) | rank | pred/meas |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i in show:
        lines.append(
            f"| `{g['names'][i]}` | {meas[i]:.1f} | {mr[i] + 1} | {pred[i]:.1f} | {pr[i] + 1} "
            f"| {pred[i] / meas[i]:.2f} |"
        )
    return [*lines, ""]


def _mean_ranks(g: dict, mask: np.ndarray) -> tuple[float, float]:
    """Mean measured and mean learned-model rank (1 = fastest) of the configs ``mask`` selects."""
    ranks = []
    for v in (g["meas"], g["learned"]["sum"]):
        r = np.empty(v.size)
        r[np.argsort(v, kind="stable")] = np.arange(1, v.size + 1)
        ranks.append(float(r[mask].mean()))
    return ranks[0], ranks[1]


def findings(groups: list[dict], noise: list[float]) -> list[str]:
    lm = [g["learned"] for g in groups]
    taus = [m["tau"] for m in lm]
    pub = [g["published cost"]["tau"] for g in groups]

    def mean_tau(name: str) -> float:
        return float(np.nanmean([g[name]["tau"] for g in groups]))

    by_model = {mn: [m["ratio"] for g, m in zip(groups, lm, strict=True) if g["model"] == mn] for mn in MODELS}
    tile = []
    for g in groups:
        mask = np.array([c.kv_tile == (64, 128) for c in g["configs"]])
        if mask.any() and not mask.all():
            mr, pr = _mean_ranks(g, mask)
            tile.append(f"{g['model']}/{g['scenario']} ({g['sweep']}) {mr:.0f} vs {pr:.0f}")
    return [
        f"- Ranking: Kendall tau of the learned model {min(taus):.2f} to {max(taus):.2f} over the {len(groups)} "
        f"(file, model, scenario) groups (mean {np.mean(taus):.2f}; calibrated simulator {mean_tau('simulator'):.2f}, "
        f"published cost {mean_tau('published cost'):.2f}"
        + (
            f", undefined in {int(np.isnan(pub).sum())} group(s) where it scores every config the same"
            if np.isnan(pub).any()
            else ""
        )
        + f"); pairs of configs measured >2% apart ordered right: {np.mean([m['pairs_ok'] for m in lm]):.2f} on "
        f"average, {min(m['pairs_ok'] for m in lm):.2f} at worst. The tuned config's repeat spread between the two "
        f"files is {min(noise):.2%} to {max(noise):.2%}.",
        f"- Picking: top-1 score {min(m['top1'] for m in lm):.3f} to {max(m['top1'] for m in lm):.3f} (mean "
        f"{np.mean([m['top1'] for m in lm]):.3f}); the model's pick measured {min(m['pick_vs_tuned'] for m in lm):.3f}"
        f" to {max(m['pick_vs_tuned'] for m in lm):.3f}x the tuned config's time. The best measured config is "
        f"{min(g['best_vs_tuned_meas'] for g in groups):.3f} to {max(g['best_vs_tuned_meas'] for g in groups):.3f}x "
        f"the tuned one; the model predicts {min(m['best_vs_tuned_pred'] for m in lm):.3f} to "
        f"{max(m['best_vs_tuned_pred'] for m in lm):.3f}x for that config (less headroom than measured in "
        f"{sum(m['best_vs_tuned_pred'] > g['best_vs_tuned_meas'] for g, m in zip(groups, lm, strict=True))} of "
        f"{len(groups)} groups).",
        f"- Absolute error: per-tree MAPE {min(m['mape'] for m in lm):.2f} to {max(m['mape'] for m in lm):.2f}; median "
        "pred/meas " + ", ".join(f"{mn} {min(v):.2f}-{max(v):.2f}" for mn, v in by_model.items() if v) + ".",
        "- kv_tile (64, 128) configs, mean measured rank vs the model's: " + "; ".join(tile) + ".",
    ]


def small_class_only(groups: list[dict]) -> str:
    """Measured and predicted time / tuned of GQA configs that change only the small class's warps or stages."""
    parts = []
    for g in groups:
        if MODELS[g["model"]][0] == MODELS[g["model"]][1]:
            continue  # MHA: the runtime launches each tile class with its own warps and stages
        base = g["configs"][0]
        ratio = MODELS[g["model"]][0] // MODELS[g["model"]][1]
        base_warps, base_stages = base.launch_warps(ratio), base.launch_stages(ratio, HEAD_DIM)
        resolved = dataclasses.replace(base, num_warps=base_warps, num_stages=base_stages)
        for i, c in enumerate(g["configs"]):
            large = (c.launch_warps(ratio)[0], c.launch_stages(ratio, HEAD_DIM)[0])
            same_large = large == (base_warps[0], base_stages[0])
            rest = dataclasses.replace(c, num_warps=base_warps, num_stages=base_stages)
            if i and c != base and same_large and rest == resolved:
                m, p = g["meas"][i] / g["meas"][0], g["learned"]["sum"][i] / g["learned"]["sum"][0]
                parts.append(f"{g['model']}/{g['scenario']} `{g['names'][i]}` {m:.3f} / {p:.3f}")
    return "; ".join(parts)


def markdown(groups: list[dict], meta: dict, noise: list[float]) -> str:
    lines = [
        "# Latency model vs measured runtime configs on decode-serving trees (H200)",
        "",
        "Generated by `TRITON_INTERPRET=1 python -m bench.costmodel_decode_check` (CPU); do not edit by hand.",
        "",
        "Measured: configs of the runtime (the export's tuned config for the shape, "
        "`traces/decode_sweeps/export_f18595e.json`, and variations of it) timed on the H200 by CUDA-graph "
        "replay of `TreeAttentionRuntime.forward` (median), "
        "on the trees of steps 10, 25 and 39 of `iter_serving(scenario, seed=0, steps=40)`; Llama 32/32 and "
        "Mistral 32/8 heads, head dim 128, fp16, at f18595e (the one-off sweep script `bench/decode_config_sweep.py` "
        "not part of the repository, `--grid one` and `--grid combos`).",
        f"Predicted: `costmodel/data/h200_latency_model.skops` ({meta['model_params']['kind']}, fitted on "
        f"{meta['trace_set']['rows']} measurements of `{' '.join(meta['trace_set']['paths'])}`) for the plan the "
        "runtime uploads (a CPU runtime with the sweep's capacities; query-centric re-planning included; the "
        f"`kernel_version` feature set to the sweeps' kernels, v{SWEEP_KERNEL_VERSION}; the `default` row is "
        "`FastTreeConfig()` as it was then: warps (4, 4), stages (3, 3)), seen as the runtime launches it "
        "(`fasttree.runtime_planning.launch_view` and the `runtime_launch` feature); `learned (as tree_attention)` "
        "asks the same model about the per-plan `tree_attention` launches of those plans instead (the only "
        "question before runtime traces existed); its calibrated simulator (`extra.simulator_baseline`) on the "
        "runtime's view and the published planner's cost (ranks only).",
        "",
        "Columns: `tau` Kendall tau-b of the per-config sums (3 trees) against the measured sums; `pairs >2% ok` "
        "fraction of config pairs measured more than 2% apart that the predictor orders right (ties count half; "
        "pair count in brackets); `MAPE` over the per-tree predictions; `pred/meas` their median ratio; `top-1` "
        "measured best / measured time of the predictor's pick; `pick/tuned` the pick's measured time over the tuned "
        "config's; `best/tuned` the best-measured config's time over the tuned config's, measured and predicted.",
        "",
        "## Findings",
        "",
        *findings(groups, noise),
        "",
        "Caveat: most of the model's traces time the per-plan `fasttree.tree_attention` kernels "
        "(`fasttree/toolkit/profiler.py` `measure_point`: a grid of one program per unit and KV head per tile "
        "class, then the merge); its runtime traces (`fasttree-tune profile --runtime`: SM-sized persistent "
        "grids, one stage-1 launch for both tile classes with the large class's warps and stages unless MHA at D "
        "<= 128) time the v30 kernels (9a6a950), not the v14 ones of these sweeps (f18595e). Configs of the GQA "
        "shape that change only the small class's warps or stages (the runtime's fused launch ignores them), "
        "measured / predicted "
        f"time relative to tuned: {small_class_only(groups) or 'none'}.",
        "",
    ]
    for path in SWEEPS:
        sub = [g for g in groups if g["file"] == path]
        if not sub:
            continue
        lines += [f"## `{path}`", "", *summary_table(sub), ""]
        lines += [
            "Measured best 3, tuned and the learned model's top 3 (sums over the 3 trees; configs with the same "
            "plan get the same prediction, and tied predictions rank in list order):",
            "",
        ]
        for g in sub:
            lines += detail_table(g)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=shipped.model_path())
    p.add_argument("--export", type=Path, default=Path("traces/decode_sweeps/export_f18595e.json"))
    p.add_argument("--out", type=Path, default=Path("docs/results/costmodel_decode_check.md"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if os.environ.get("TRITON_INTERPRET") != "1":
        p.error("set TRITON_INTERPRET=1: the runtime plans on the CPU only under the interpreter")
    model, meta = load_model(args.model, gpu_name=GPU)
    gpu = GpuSpec.from_dict(meta["gpu"])
    sim = SimulatorBaseline.from_coef(meta["extra"]["simulator_baseline"]["coef"])
    export = read_export(args.export)
    groups = []
    for path, kind in SWEEPS.items():
        groups += run_sweep(path, kind, model, sim, gpu, export)
    for g in groups:
        m = g["learned"]
        log.info("%s %s/%s: %d configs, %d plans (%d query-centric), tau %.3f, MAPE %.3f, top-1 %.3f",
                 g["sweep"], g["model"], g["scenario"], g["n"], g["plans"], g["query_centric"], m["tau"], m["mape"],
                 m["top1"])  # fmt: skip
    # the tuned config is in both files: its repeat spread gauges the measurement noise
    tuned = {}
    for g in groups:
        tuned.setdefault((g["model"], g["scenario"]), []).append(g["meas"][0])
    noise = [abs(a - b) / min(a, b) for a, b in (v for v in tuned.values() if len(v) == 2)]
    text = markdown(groups, meta, noise or [float("nan")])
    write_atomic(args.out, text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
