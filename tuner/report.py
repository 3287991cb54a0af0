"""The report of ``fasttree-tune run``: a markdown summary and PNG plots.

Plots (matplotlib, Agg backend): per bucket study, the optimisation history and the
parameter importances (Optuna's own matplotlib visualisations), and per held-out bucket
the predicted latency of every workload step with the tuned config and with the defaults.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path
from typing import Any

__all__ = ["write_report"]

logger = logging.getLogger(__name__)


def _save(fig, path: Path) -> None:
    """Write ``fig`` as a PNG atomically (a crash leaves the old plot or the whole new one) and close it."""
    import matplotlib.pyplot as plt

    from fasttree.fileio import write_atomic

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, png.getvalue())


def _study_plots(out: Path, results, storage, folder: Path) -> list[str]:
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    from fasttree.tuner import open_storage

    store = open_storage(storage, folder=folder)
    names = []
    for bucket, r in results.items():
        study = optuna.load_study(study_name=r.study_name, storage=store)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            ax = ovm.plot_optimization_history(study, target=lambda t: t.values[0], target_name="objective")
            ax.axhline(r.defaults_predicted_us, color="k", lw=0.8, ls="--", label="defaults")
            ax.set_yscale("log")
            ax.set_title(f"{bucket.label}: optimisation history")
            ax.legend(fontsize=8)
            name = f"history_{bucket.label}.png"
            _save(ax.figure, out / name)
            names.append(name)
            if r.importances:
                fig, ax = plt.subplots(figsize=(6, 0.3 * len(r.importances) + 1.2))
                items = sorted(r.importances.items(), key=lambda kv: kv[1])
                ax.barh([k for k, _ in items], [v for _, v in items])
                ax.set_xlabel("importance (PED-ANOVA)")
                ax.set_title(f"{bucket.label}: parameter importances")
                name = f"importances_{bucket.label}.png"
                _save(fig, out / name)
                names.append(name)
    return names


def _step_plots(out: Path, judged: dict[str, dict[str, Any]]) -> list[str]:
    import matplotlib.pyplot as plt

    names = []
    for label, h in judged.items():
        fig, ax = plt.subplots(figsize=(9, 3.4))
        ax.plot(h["step_defaults_us"], lw=0.8, label="defaults")
        ax.plot(h["step_tuned_us"], lw=0.8, label="tuned")
        ax.set_xlabel("held-out workload step")
        ax.set_ylabel("predicted latency (us)")
        ax.set_title(f"{label}: predicted latency per step ({h['speedup']:.3f}x in total)")
        ax.legend(fontsize=8)
        name = f"heldout_steps_{label}.png"
        _save(fig, out / name)
        names.append(name)
    return names


def write_report(out: Path, results, judged: dict[str, dict[str, Any]], *, storage, folder: Path) -> Path:
    """Write ``out/report.md`` and its PNG plots; returns the markdown file's path.

    Parameters
    ----------
    out : Path
        Output folder (exists).
    results : dict of Bucket to TuneResult
        :func:`fasttree.tuner.tune_workload`'s results.
    judged : dict of str to dict
        Per held-out bucket label: ``steps``, ``defaults_us``, ``tuned_us``, ``speedup``,
        ``workload_speedups``, ``worst_workload_speedup``, ``step_defaults_us``,
        ``step_tuned_us``.
    storage : str or None
        The studies' storage argument; ``folder`` holds its default file.
    folder : Path
    """
    import matplotlib

    from fasttree.fileio import write_atomic

    matplotlib.use("Agg")
    plots = _study_plots(out, results, storage, folder) + _step_plots(out, judged)
    lines = ["# fasttree-tune run", "", "## Tuning (predicted by the latency model)", ""]
    lines += [
        "The objective is the model's predicted time over the tuning workloads: by default the sum over",
        "workloads of (time / time with the defaults), so the defaults score the number of workloads;",
        "with --no-balance the total predicted us of all steps.",
        "",
    ]
    lines += [
        "| bucket | study | complete / pruned trials | objective: defaults | tuned | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for bucket, r in results.items():
        lines.append(
            f"| {bucket.label} | {r.study_name} | {r.n_complete} / {r.n_pruned} | {r.defaults_predicted_us:.1f} "
            f"| {r.predicted_us:.1f} | {r.speedup:.3f}x |"
        )
    if judged:
        lines += ["", "## Held-out workloads (predicted)", "", "| bucket | workload | speedup |", "|---|---|---:|"]
        for label, h in judged.items():
            for w, s in h["workload_speedups"].items():
                lines.append(f"| {label} | {w} | {s:.3f}x |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    path = out / "report.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path
