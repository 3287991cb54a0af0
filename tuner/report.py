"""The text the tuning commands print and ``fasttree-tune run`` writes as ``report.md``.

:func:`study_table` is ``tune``'s per-bucket summary of its studies; :func:`portfolio_table` the
per-(target, bucket) summary of the portfolios ``run`` and ``export`` choose (printed, and the head of
``report.md``); :func:`run_report` the whole ``report.md``. Every number is a prediction of the latency
model; ``fasttree-tune validate`` measures on a GPU.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OBJECTIVE_NOTE", "portfolio_table", "run_report", "study_table"]

#: What :func:`study_table`'s numbers mean (printed under it).
OBJECTIVE_NOTE = (
    "objective: what the study minimises, unitless (each family's mean over its trees of the predicted time "
    "over the defaults' predicted time, averaged over families, so the defaults score 1); speed-up: the "
    "defaults' objective over the tuned config's."
)


def study_table(results) -> str:
    """The markdown table of ``tune``'s studies, then :data:`OBJECTIVE_NOTE`.

    Parameters
    ----------
    results : dict of Bucket to TuneResult
        :func:`fasttree.tuner.tune_workload`'s results.
    """
    lines = [
        "| bucket | study | trials (complete / pruned) | objective: defaults -> tuned | speed-up (objective) |",
        "|---|---|---:|---:|---:|",
    ]
    for b, r in results.items():
        lines.append(
            f"| {b.label} | {r.study_name} | {r.n_complete} / {r.n_pruned} | {r.defaults_predicted_us:.4g} -> "
            f"{r.predicted_us:.4g} | {r.speedup:.3f}x |"
        )
    return "\n".join(lines) + "\n\n" + OBJECTIVE_NOTE


def portfolio_table(results) -> str:
    """The markdown table of the portfolios of ``run`` and ``export``, one row per (target, bucket).

    Parameters
    ----------
    results : list of PortfolioResult
        :func:`fasttree.tuner.pipeline.tune_portfolios`'s results.
    """
    lines = [
        "| target | bucket | members | selector leaves | design (margin, depth, min leaf) | calibrated margin | "
        "leaves served (model's) | predicted tuning | predicted validation | validation trees switched |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        p = r.portfolio
        leaves = sum(f < 0 for f in p.portfolio.selector.feature)
        valid = "-" if p.valid is None else f"{p.valid['objective']:.3f}"
        switched = "-" if p.valid is None else f"{sum(p.valid['picks'][1:])} / {sum(p.valid['picks'])}"
        evidence = p.evidence or {}
        margin = "-" if evidence.get("margin") is None else f"{evidence['margin']:.3f}"
        decided = evidence.get("leaves", [])
        served = f"{sum(d['served'] != 0 for d in decided)} ({sum(d['model_pick'] != 0 for d in decided)})"
        lines.append(
            f"| {r.target} | {r.bucket.label} | {len(p.portfolio.members)} | {leaves} | "
            f"{p.rules.margin}, {p.rules.max_depth}, {p.rules.min_leaf} | {margin} | {served} | "
            f"{p.train['objective']:.3f} | {valid} | {switched} |"
        )
    return "\n".join(lines)


def run_report(results, summary: dict[str, Any], table: str) -> str:
    """``report.md`` of a run: when, with which model, the portfolios, then every family's predicted ratio.

    Parameters
    ----------
    results : list of PortfolioResult
    summary : dict
        ``report.json``'s content: ``date``, ``model``, ``model_sha256``, ``gpu``, ``elapsed_s``.
    table : str
        :func:`portfolio_table` of ``results``.
    """
    lines = [
        "# fasttree-tune run",
        "",
        f"- date: {summary['date']} (UTC); run time {summary['elapsed_s']:.0f} s",
        f"- model: `{summary['model']}` (SHA-256 {summary['model_sha256'][:16]}...), fitted for {summary['gpu']}",
        "",
        "Predicted by the latency model: every ratio is the portfolio's predicted time over the defaults' (mean "
        "over families of each family's mean over its trees), with every tree outside a served leaf's region "
        "given the defaults. A leaf serves the member the model picked only where the validation trees that "
        "reach it are predicted faster by more than the calibrated margin (the model's held-out error on "
        "predicted gains for the bucket and target, `fasttree.costmodel.calibration`; '-': none calibrated, "
        "the defaults everywhere). Measured on a GPU: `fasttree-tune validate`.",
        "",
        table,
        "",
    ]
    for r in results:
        p = r.portfolio
        lines += [f"## {r.target} {r.bucket.label}", "", "| family | tuning | validation |", "|---|---:|---:|"]
        valid = {} if p.valid is None else p.valid["families"]
        for family in sorted(set(p.train["families"]) | set(valid)):
            a = p.train["families"].get(family)
            b = valid.get(family)
            lines.append(f"| {family} | {'-' if a is None else f'{a:.3f}'} | {'-' if b is None else f'{b:.3f}'} |")
        lines.append("")
    return "\n".join(lines) + "\n"
