"""The latency model's evaluation report and the committed H200 model, from the shipped traces (CPU).

    python -m bench.costmodel_report  # docs/costmodel.{md,json,png files}, costmodel/data/h200_latency_model.skops

Two protocols, never random row splits:

* group k-fold by tree family on the training traces (``traces/h200``), and
* the separate held-out set (``traces/h200_heldout``: GQA 8, head dim 256, deeper trees),
  predicted by models fitted on all training traces.

Predictors: the simulator alone (calibrated by a log-log line on the training rows), the
learned model of each kind, and the published planner's cost (ranks only). The kind with
the best held-out mean Kendall tau (then top-1 score) is saved as the H200 model.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from fasttree.costmodel.dataset import Dataset, load_dataset
from fasttree.costmodel.evaluate import (
    SimulatorBaseline,
    cross_validated_predictions,
    prediction_metrics,
    rank_only_metrics,
)
from fasttree.costmodel.features import FEATURE_NAMES, KERNEL_VERSION_COLUMN, RUNTIME_COLUMN
from fasttree.costmodel.metrics import evaluation_table, regression_metrics
from fasttree.costmodel.model import KINDS, LatencyModel
from fasttree.costmodel.persist import save_model
from fasttree.fileio import write_atomic

log = logging.getLogger("bench.costmodel_report")

KEYS = ["n", "mape", "p90_ape", "mean_kendall_tau", "top1_score", "top5_score", "a_peak@1", "a_peak@5", "n_trees"]
TARGETS = {"mape": 0.05, "p90_ape": 0.15, "mean_kendall_tau": 0.90, "top1_score": 0.97}
GQA = FEATURE_NAMES.index("gqa")
HEAD_DIM = FEATURE_NAMES.index("head_dim")


def make(kind: str, seed: int = 0, jobs: int = 2) -> LatencyModel:
    """The boosted kinds with LatencyModel's defaults (a seed ensemble, its fits in ``jobs`` processes); the forest
    with 150 unlimited-depth trees and one seed (a forest already averages its bootstrapped trees)."""
    if kind == "forest":
        return LatencyModel(
            kind=kind, n_estimators=150, max_depth=None, min_samples_leaf=3, n_seeds=1, random_state=seed
        )
    return LatencyModel(kind=kind, random_state=seed, n_jobs=jobs)


def heldout_axis(data: Dataset) -> np.ndarray:
    gqa, hd = data.X[:, GQA], data.X[:, HEAD_DIM]
    return np.where(gqa == 8, "gqa8", np.where(hd == 256, "head_dim_256", "deep"))


def plot(path: Path, data: Dataset, preds: dict[str, np.ndarray]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(preds), figsize=(5 * len(preds), 4.6), squeeze=False)
    lo, hi = data.y_us.min() * 0.7, data.y_us.max() * 1.4
    for ax, (name, pred) in zip(axes[0], preds.items(), strict=True):
        for fam in sorted(set(data.family)):
            m = data.family == fam
            ax.scatter(data.y_us[m], pred[m], s=4, alpha=0.5, label=fam)
        ax.plot([lo, hi], [lo, hi], "k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured GPU time (us, graph replay)")
        ax.set_ylabel("predicted (us)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_by_family(path: Path, rows: dict[str, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = sorted(next(iter(rows.values())))
    x = np.arange(len(fams))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(rows)
    for i, (name, per_family) in enumerate(rows.items()):
        ax.bar(x + i * width, [per_family[f] * 100 for f in fams], width, label=name)
    ax.set_xticks(x + 0.4 - width / 2, fams, rotation=20, fontsize=8)
    ax.set_ylabel("MAPE (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", nargs="+", default=["traces/h200"])
    p.add_argument("--heldout", nargs="+", default=["traces/h200_heldout"])
    p.add_argument("--docs", type=Path, default=Path("docs"))
    p.add_argument("--model-out", type=Path, default=Path("costmodel/data/h200_latency_model.skops"))
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--jobs", type=int, default=2, help="processes fitting a seed ensemble's regressors (default 2)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    kinds = [k for k in args.kinds.split(",") if k]

    t0 = time.perf_counter()
    train = load_dataset(args.train, workers=args.workers)
    t_load = time.perf_counter() - t0
    held = load_dataset(args.heldout, workers=args.workers)
    log.info("train %d rows (%.1f s to re-plan), held-out %d rows", len(train), t_load, len(held))

    report: dict = {
        "gpu": train.gpu.to_dict(),
        "train": {"paths": args.train, "rows": len(train), "trees": int(np.unique(train.tree).size),
                  "sha256": train.trace_hash},
        "heldout": {"paths": args.heldout, "rows": len(held), "trees": int(np.unique(held.tree).size),
                    "sha256": held.trace_hash},
        "targets": TARGETS,
    }  # fmt: skip

    # ---- group k-fold by family on the training traces
    cv: dict[str, dict] = {}
    cv["simulator"] = prediction_metrics(
        cross_validated_predictions(SimulatorBaseline, train, n_splits=args.folds), train
    )
    for kind in kinds:
        t = time.perf_counter()
        pred = cross_validated_predictions(lambda kind=kind: make(kind, jobs=args.jobs), train, n_splits=args.folds)
        cv[f"learned ({kind})"] = prediction_metrics(pred, train)
        log.info("k-fold %s: %.0f s", kind, time.perf_counter() - t)
    cv["published cost (ranks)"] = rank_only_metrics(train.published_cost, train)
    report["group_kfold"] = cv

    # ---- held-out set, models fitted on all training rows
    sim = SimulatorBaseline().fit(train.X, train.y_us)
    ho: dict[str, dict] = {"simulator": prediction_metrics(sim.predict(held.X), held)}
    preds = {"simulator": sim.predict(held.X)}
    models: dict[str, LatencyModel] = {}
    fit_s: dict[str, float] = {}
    for kind in kinds:
        t = time.perf_counter()
        models[kind] = make(kind, jobs=args.jobs).fit(train.X, train.y_us)
        fit_s[kind] = time.perf_counter() - t
        preds[f"learned ({kind})"] = models[kind].predict(held.X)
        ho[f"learned ({kind})"] = prediction_metrics(preds[f"learned ({kind})"], held)
    ho["published cost (ranks)"] = rank_only_metrics(held.published_cost, held)
    report["heldout_metrics"] = ho
    report["fit_seconds"] = fit_s

    best = max(kinds, key=lambda k: (ho[f"learned ({k})"]["mean_kendall_tau"], ho[f"learned ({k})"]["top1_score"]))
    chosen = models[best]
    axis = heldout_axis(held)
    report["chosen"] = best
    report["heldout_by_seed"] = {
        f"seed {est.random_state} alone": prediction_metrics(member, held)
        for est, member in zip(chosen.estimators_, chosen.predict_members(held.X), strict=True)
    }
    report["heldout_by_axis"] = {
        a: prediction_metrics(preds[f"learned ({best})"][axis == a], held.subset(axis == a)) for a in sorted(set(axis))
    }
    version = held.X[:, KERNEL_VERSION_COLUMN].astype(int)
    report["heldout_by_kernel_version"] = {
        f"v{v} ({name})": prediction_metrics(preds[name][version == v], held.subset(version == v))
        for v in sorted(set(version.tolist()))
        for name in ("simulator", f"learned ({best})")
    }
    launch = np.where(held.X[:, RUNTIME_COLUMN] > 0, "runtime", "tree_attention")
    report["heldout_by_launch"] = {
        f"{a} ({name})": prediction_metrics(preds[name][launch == a], held.subset(launch == a))
        for a in ("tree_attention", "runtime")
        if np.any(launch == a)
        for name in ("simulator", f"learned ({best})")
    }
    by_family = {}
    for name in ("simulator", f"learned ({best})"):
        by_family[name] = {
            f: regression_metrics(preds[name][held.family == f], held.y_us[held.family == f])["mape"]
            for f in sorted(set(held.family))
        }
    report["heldout_mape_by_family"] = by_family

    # prediction throughput, planning included (held-out rows: re-plan + features + predict)
    t = time.perf_counter()
    again = load_dataset(args.heldout, workers=1)
    chosen.predict(again.X)
    report["plans_per_second_1_cpu"] = len(again) / (time.perf_counter() - t)

    save_model(args.model_out, chosen, gpu=train.gpu, trace_hash=train.trace_hash, trace_rows=len(train),
               trace_paths=args.train, overwrite=True,
               extra={"simulator_baseline": {"coef": [float(c) for c in sim.coef_]},
                      "heldout_metrics": ho[f"learned ({best})"], "fit_seconds": round(fit_s[best], 2),
                      "training_domain": train.domain()})  # fmt: skip

    args.docs.mkdir(parents=True, exist_ok=True)
    plot(args.docs / "costmodel_heldout_scatter.png", held, {"simulator": preds["simulator"],
         f"learned ({best})": preds[f"learned ({best})"]})  # fmt: skip
    plot_by_family(args.docs / "costmodel_heldout_by_family.png", by_family)
    write_atomic(args.docs / "costmodel.json", json.dumps(report, indent=1, default=float) + "\n")
    write_atomic(args.docs / "costmodel.md", markdown(report, args))
    print(markdown(report, args))
    return 0


def markdown(r: dict, args) -> str:
    def table(rows: dict) -> str:
        return evaluation_table(list(rows.items()), KEYS)

    best = r["chosen"]
    lines = [
        "# Latency model: held-out evaluation (H200)",
        "",
        "Generated by `python -m bench.costmodel_report` (CPU) from the shipped traces; do not edit by hand.",
        f"Training set `{' '.join(r['train']['paths'])}`: {r['train']['rows']} measurements of {r['train']['trees']} "
        f"trees; held-out set `{' '.join(r['heldout']['paths'])}`: {r['heldout']['rows']} measurements of "
        f"{r['heldout']['trees']} trees (GQA 8, head dim 256 and deeper trees, none of which training sees).",
        "",
        "Metrics: `mape`, `p90_ape` absolute percentage error of the graph-replay median (fractions); "
        "`mean_kendall_tau` per tree across its configs (trees with >= 2 configs); `top1_score`/`top5_score` = "
        "sum of each tree's measured best / sum of the measured best among the model's top-k picks; "
        "`a_peak@k` the per-tree mean of that ratio. The published planner's cost has arbitrary units, so only "
        "its rank metrics are shown. Targets on the held-out set: "
        + ", ".join(f"{k} {v}" for k, v in r["targets"].items())
        + " (MAPE and p90 at most, the others at least).",
        "",
        "## Held-out set (models fitted on every training measurement)",
        "",
        table(r["heldout_metrics"]),
        "",
        f"Chosen by held-out rank metrics: **{best}**, saved as `{args.model_out}`. Fit times (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["fit_seconds"].items())
        + f". Prediction including re-planning: {r['plans_per_second_1_cpu']:.0f} plans/s on one CPU core.",
        "",
        f"### {best}: the seed ensemble and its members alone",
        "",
        f"The {best} model is the geometric mean of regressors that differ only in their random seed "
        "(`LatencyModel(n_seeds=...)`); each member alone, on the same held-out rows:",
        "",
        table(r.get("heldout_by_seed", {})),
        "",
        f"### {best} by held-out axis",
        "",
        table(r["heldout_by_axis"]),
        "",
        "### By the kernel version the held-out traces timed",
        "",
        "The `kernel_version` feature (the row of `docs/history.md`'s version table) lets the "
        "model learn from traces of older kernels; the tuner asks it about the current ones.",
        "",
        table(r["heldout_by_kernel_version"]),
        "",
        "### By the launches the held-out traces timed",
        "",
        "`tree_attention`: the per-plan launches (`fasttree.tree_attention`); `runtime`: the production "
        "runtime's own plans and persistent launches (`fasttree-tune profile --runtime`, the `runtime_launch` "
        "feature).",
        "",
        table(r.get("heldout_by_launch", {})),
        "",
        "![predicted vs measured](costmodel_heldout_scatter.png)",
        "",
        "![MAPE by family](costmodel_heldout_by_family.png)",
        "",
        f"## Group {args.folds}-fold by tree family (training traces; each fold holds out whole families)",
        "",
        table(r["group_kfold"]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
