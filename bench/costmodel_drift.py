"""Traces of several kernel versions, one latency model: what each training choice predicts (CPU).

    python -m bench.costmodel_drift          # docs/costmodel_drift.{md,json}

The shipped traces time different kernels (the ``kernel_version`` feature: v9 for runs 1-7
and held-out sets 1-2, v11, v14, v17 for run 10 and heldout3, v30 for run 11 and heldout4; see
``traces/README.md``). Each training choice below is fitted and then scored on every held-out
trace file on its own, so the current kernels' held-out set (heldout4) reads apart from the older
ones:

* ``run 11 only``: gbrt on the traces of the current kernels alone;
* ``runs 1-11, no version``: gbrt on every training trace with the ``kernel_version`` column set
  to one constant (the model cannot tell the kernels apart, as before feature schema 5);
* ``runs 1-11 (gbrt)`` and ``runs 1-11 (residual)``: every training trace with the column, as
  ``bench.costmodel_report`` fits the shipped model.

The models are :class:`~fasttree.costmodel.model.LatencyModel` with its defaults; rows are the
files' ``ok`` measurements (one per key), re-planned as measured. Rank metrics need trees with
several configs, which ``heldout1`` (one config per tree) lacks: its row shows MAPE and p90 only.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from fasttree.costmodel.dataset import Dataset, load_dataset
from fasttree.costmodel.evaluate import prediction_metrics
from fasttree.costmodel.features import KERNEL_VERSION_COLUMN
from fasttree.costmodel.metrics import evaluation_table, regression_metrics
from fasttree.costmodel.model import LatencyModel
from fasttree.fileio import write_atomic
from fasttree.toolkit.bench_common import environment

log = logging.getLogger("bench.costmodel_drift")

KEYS = ["n", "mape", "p90_ape", "mean_kendall_tau", "top1_score", "n_trees"]


def stack(parts: list[Dataset]) -> tuple[np.ndarray, np.ndarray]:
    """Feature rows and times of several datasets, in order."""
    return np.vstack([d.X for d in parts]), np.concatenate([d.y_us for d in parts])


def score(pred_us: np.ndarray, data: Dataset) -> dict[str, float]:
    """Every metric where the set has trees of several configs, else the regression metrics alone."""
    try:
        return prediction_metrics(pred_us, data)
    except ValueError:
        return dict(regression_metrics(pred_us, data.y_us), n_trees=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=Path, default=Path("traces/h200"))
    p.add_argument("--heldout", type=Path, default=Path("traces/h200_heldout"))
    p.add_argument("--current", default="run11_", help="file-name prefix of the current kernels' training run")
    p.add_argument("--out", type=Path, default=Path("docs"))
    p.add_argument("--workers", type=int, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    def files(folder: Path) -> list[Path]:
        return sorted(folder.glob("*.jsonl.gz"))

    train = {f.name.split(".")[0]: load_dataset(f, workers=args.workers) for f in files(args.train)}
    held = {f.name.split(".")[0]: load_dataset(f, workers=args.workers) for f in files(args.heldout)}
    current = [d for name, d in train.items() if name.startswith(args.current)]
    if not current:
        raise SystemExit(f"no training file starts with {args.current!r}")
    every = list(train.values())

    X_all, y_all = stack(every)
    X_flat = X_all.copy()
    X_flat[:, KERNEL_VERSION_COLUMN] = 0.0
    choices = {
        "run 11 only": (LatencyModel(), *stack(current), False),
        "runs 1-11, no version": (LatencyModel(), X_flat, y_all, True),
        "runs 1-11 (gbrt)": (LatencyModel(), X_all, y_all, False),
        "runs 1-11 (residual)": (LatencyModel(kind="residual"), X_all, y_all, False),
    }
    report: dict = {
        "env": environment(),
        "train_rows": {k: len(d) for k, d in train.items()},
        "heldout_rows": {k: len(d) for k, d in held.items()},
        "heldout_kernel_version": {k: int(d.X[0, KERNEL_VERSION_COLUMN]) for k, d in held.items()},
        "results": {},
    }
    for name, (model, X, y, flat) in choices.items():
        t = time.perf_counter()
        model.fit(X, y)
        fit_s = time.perf_counter() - t
        rows = {}
        for hname, d in held.items():
            Xh = d.X.copy()
            if flat:
                Xh[:, KERNEL_VERSION_COLUMN] = 0.0
            rows[hname] = score(model.predict(Xh), d)
        report["results"][name] = {"fit_seconds": round(fit_s, 1), "rows": len(y), "heldout": rows}
        log.info("%s: %d rows, fit %.0f s", name, len(y), fit_s)

    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "costmodel_drift.json", json.dumps(report, indent=1, default=float) + "\n")
    md = markdown(report)
    write_atomic(args.out / "costmodel_drift.md", md)
    print(md)
    return 0


def markdown(r: dict) -> str:
    lines = [
        "# Latency model across kernel versions (H200 traces)",
        "",
        "Generated by `python -m bench.costmodel_drift` (CPU); do not edit by hand. Each training choice "
        "is scored on each held-out trace file alone (kernel version of the file in brackets).",
        "",
    ]
    for hname, version in r["heldout_kernel_version"].items():
        rows = [(name, res["heldout"][hname]) for name, res in r["results"].items()]
        lines += [f"## {hname} (v{version}, {r['heldout_rows'][hname]} rows)", "", evaluation_table(rows, KEYS), ""]
    fits = ", ".join(f"{name} {res['rows']} rows in {res['fit_seconds']} s" for name, res in r["results"].items())
    env = r["env"]
    lines += [f"Fits: {fits}. Host: {env['cpu_model']} ({env['cpu_count']} CPUs), commit {env['git_commit']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
