"""The report of ``fasttree-tune run``: a markdown summary and PNG plots, and the per-bucket numbers every
summary of a tuning run prints (:func:`bucket_summaries`, :func:`results_table`: the terminal table of
``tune``, ``export`` and ``run`` and the report's table are the same text).

Plots (matplotlib, Agg backend): per bucket study, the optimisation history (with the exported config's
objective marked) and the parameter importances (Optuna's own matplotlib visualisations), and per
held-out bucket the predicted latency of every workload step with the tuned config and with the defaults.
"""

from __future__ import annotations

import hashlib
import io
import logging
import warnings
from pathlib import Path
from typing import Any

__all__ = ["OBJECTIVE_NOTE", "bucket_summaries", "results_table", "write_report"]

logger = logging.getLogger(__name__)

#: What the two kinds of numbers of :func:`results_table` mean (printed under it).
OBJECTIVE_NOTE = (
    "objective: what the study minimises, unitless by default (the sum over workloads of each workload's "
    "predicted time / its time with the defaults, so the defaults score the number of workloads; with "
    "--no-balance, the predicted us of the tuned steps); predicted us: the model's total over every step "
    "of the workloads, each step weighted as its file says. Each ratio is defaults / exported config."
)


def bucket_summaries(results, totals) -> dict[str, dict[str, Any]]:
    """Per bucket label: the numbers of the exported config against the defaults, computed once.

    Parameters
    ----------
    results : dict of Bucket to TuneResult
    totals : dict of Bucket to (float, float)
        Predicted total us of every step with the defaults and with the exported config.

    Returns
    -------
    dict of str to dict
        ``study``, ``complete``, ``pruned``; ``objective_defaults``, ``objective_exported`` and
        ``objective_ratio`` (the study's objective: the exported config is the best trial's, polished,
        when it beats the defaults, else the defaults); ``predicted_us_defaults``,
        ``predicted_us_exported`` and ``predicted_speedup`` (total predicted microseconds).
    """
    out = {}
    for b, r in results.items():
        exported = min(r.predicted_us, r.defaults_predicted_us)  # the config the export holds
        d, t = totals[b]
        out[b.label] = {
            "study": r.study_name,
            "complete": r.n_complete,
            "pruned": r.n_pruned,
            "objective_defaults": r.defaults_predicted_us,
            "objective_exported": exported,
            "objective_ratio": r.defaults_predicted_us / exported,
            "predicted_us_defaults": d,
            "predicted_us_exported": t,
            "predicted_speedup": d / t,
        }
    return out


def results_table(summaries: dict[str, dict[str, Any]]) -> str:
    """The markdown table of :func:`bucket_summaries`, then :data:`OBJECTIVE_NOTE`."""
    lines = [
        "| bucket | study | trials (complete / pruned) | objective: defaults -> exported | objective ratio "
        "| predicted us: defaults -> exported | predicted speedup |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, s in summaries.items():
        lines.append(
            f"| {label} | {s['study']} | {s['complete']} / {s['pruned']} | {s['objective_defaults']:.4g} -> "
            f"{s['objective_exported']:.4g} | {s['objective_ratio']:.3f}x | {s['predicted_us_defaults']:.1f} -> "
            f"{s['predicted_us_exported']:.1f} | {s['predicted_speedup']:.3f}x |"
        )
    return "\n".join(lines) + "\n\n" + OBJECTIVE_NOTE


def _save(fig, path: Path) -> None:
    """Write ``fig`` as a PNG atomically (a crash leaves the old plot or the whole new one) and close it."""
    import matplotlib.pyplot as plt

    from fasttree.fileio import write_atomic

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, png.getvalue())


def _exported_label(r) -> str:
    """What the export holds for the study ``r``, as the history plot's legend names it."""
    if r.predicted_us >= r.defaults_predicted_us:
        return "exported: the defaults"
    if r.polish_moves:
        start = "the defaults" if r.polish_start == "defaults" else f"trial {r.best_trial}"
        return f"exported: {start}, polished ({r.predicted_us:.4g})"
    return f"exported: trial {r.best_trial} ({r.predicted_us:.4g})"


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
            exported = min(r.predicted_us, r.defaults_predicted_us)
            complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            after = max((t.number for t in complete), default=0) + 1  # the polish ran after the trials
            ax.axhline(exported, color="tab:red", lw=0.8, ls=":")
            ax.plot([after], [exported], marker="*", ms=12, color="tab:red", ls="none", label=_exported_label(r))
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


def _run_lines(model: dict[str, Any] | None, elapsed_s: float | None) -> list[str]:
    """The report's header: date, run time and model."""
    from fasttree.traces import utc_now

    lines = [f"- date: {utc_now()[:19]}Z (UTC)"]
    if elapsed_s is not None:
        lines.append(f"- run time: {elapsed_s:.0f} s (to this report)")
    if model:
        path = Path(model["path"])
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "?"
        gpu = f", for the {model['gpu']}" if model.get("gpu") else ""
        lines.append(f"- model: `{path}` (SHA-256 {digest[:16]}...{gpu})")
    return lines


def _heldout_lines(results, judged: dict[str, dict[str, Any]]) -> list[str]:
    tuned = [b.label for b in results]
    lines = ["", "## Held-out workloads (predicted)", ""]
    if judged:
        lines += ["| bucket | workload | speedup |", "|---|---|---:|"]
        for label, h in judged.items():
            note = "" if label in tuned else " (bucket not tuned: the defaults)"
            for w, s in h["workload_speedups"].items():
                lines.append(f"| {label}{note} | {w} | {s:.3f}x |")
        lines.append("")
    lines += [
        f"- {label}: no held-out workloads in this bucket: its exported config is not judged on unseen workloads"
        for label in tuned
        if label not in judged
    ]
    return lines


def write_report(
    out: Path,
    results,
    judged: dict[str, dict[str, Any]],
    *,
    storage,
    folder: Path,
    totals=None,
    model: dict[str, Any] | None = None,
    elapsed_s: float | None = None,
) -> Path:
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
    totals : dict of Bucket to (float, float), optional
        Predicted total us of the tuning steps with the defaults and the exported config: the
        report's table is then :func:`results_table`, the one the command printed (without it,
        the objective columns only).
    model : dict, optional
        ``path`` (the model file, hashed here) and ``gpu``, named in the header.
    elapsed_s : float, optional
        The run's time so far, named in the header.
    """
    import matplotlib

    from fasttree.fileio import write_atomic

    matplotlib.use("Agg")
    plots = _study_plots(out, results, storage, folder) + _step_plots(out, judged)
    lines = ["# fasttree-tune run", "", *_run_lines(model, elapsed_s), "", "## Tuning (predicted by the latency model)"]
    lines.append("")
    if totals is not None:
        lines.append(results_table(bucket_summaries(results, totals)))
    else:
        lines += [
            "| bucket | study | complete / pruned trials | objective: defaults -> exported | objective ratio |",
            "|---|---|---:|---:|---:|",
        ]
        for bucket, r in results.items():
            exported = min(r.predicted_us, r.defaults_predicted_us)
            lines.append(
                f"| {bucket.label} | {r.study_name} | {r.n_complete} / {r.n_pruned} | "
                f"{r.defaults_predicted_us:.4g} -> {exported:.4g} | {r.defaults_predicted_us / exported:.3f}x |"
            )
        lines += ["", OBJECTIVE_NOTE]
    lines += _heldout_lines(results, judged)
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    path = out / "report.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path
