"""``fasttree-tune tune``, ``export``, ``run``, ``validate`` and ``refine``: the tuner's subcommands.

Optuna, scikit-learn and matplotlib are imported only when one of them runs
(``pip install -e '.[tune]'``); ``validate`` and ``refine`` run on a GPU machine and never
import Optuna. The options the tuning subcommands share (model, storage, study name, trials,
seed) come from parent parsers, :func:`_study_options` and :func:`_trial_options`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from ..toolkit import shipped
from ..validation import check_number
from .args import duration_arg, int_at_least, progress_bar_wanted

__all__ = ["add_tune_commands"]

logger = logging.getLogger("fasttree.cli")

#: Defaults of ``fasttree-tune run``: the shipped model and workloads are package data
#: (:mod:`fasttree.toolkit.shipped`), found from any folder; the measurement traces that ``--refit``
#: fits on only in a source checkout (None elsewhere: ``--refit`` then needs ``--traces``).
RUN_TRACES = shipped.measurement_traces()
RUN_WORKLOADS = str(shipped.workloads_path())
RUN_HELDOUT = str(shipped.workloads_path(heldout=True))
RUN_MODEL = str(shipped.model_path())
RUN_OUT = "fasttree-run"
#: The files ``run`` writes into ``--out`` that a rerun replaces only with ``--overwrite``.
RUN_OUTPUTS = ("export.json", "report.md", "report.json")
#: How help texts name the shipped data.
_SHIPPED_MODEL = "the shipped H200 model (package data: fasttree/costmodel/data/h200_latency_model.skops)"
_SHIPPED_WORKLOADS = "the shipped workloads (package data: fasttree/toolkit/data/workloads)"
_SHIPPED_HELDOUT = "the shipped held-out workloads (package data: fasttree/toolkit/data/workloads_heldout)"
RUN_TRIALS = 250
#: ``run`` tunes on every 4th step of each long workload (``--every``).
RUN_EVERY = 4
#: Passes of the polish after each study (``fasttree.tuner.polish``); ``export`` uses it too.
POLISH_PASSES = 2
#: Seconds per bucket after which ``run`` starts no new trial (keeps the main job under 10 minutes).
RUN_TIMEOUT_S = 150.0


def _study_options(*, every: int = 1) -> argparse.ArgumentParser:
    """Options shared by the subcommands that open tuning studies; ``every`` is ``--every``'s default."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("study")
    g.add_argument(
        "--storage",
        default=None,
        metavar="URL_OR_PATH",
        help="where the studies live: a SQLite file (.db), a journal file (.log), or a database URL "
        "(postgresql://user@host/db, mysql://..., sqlite:///path); workers on many machines join one "
        "study through a shared database (default: fasttree-tune.db in the output folder)",
    )
    g.add_argument(
        "--study",
        default="fasttree",
        metavar="NAME",
        help="study base name; each (GQA ratio, head dim, dtype) bucket gets NAME-g<G>-d<D>-<dtype> (default fasttree)",
    )
    g.add_argument("--model", default=RUN_MODEL, metavar="MODEL", help=f"latency model (default: {_SHIPPED_MODEL})")
    g.add_argument("--force", action="store_true", help="use a model fitted for another GPU or feature schema")
    g.add_argument(
        "--no-balance",
        dest="balance",
        action="store_false",
        help="minimise the predicted total time of all steps (default: every workload weighs the same: the "
        "objective is the sum over workloads of predicted time / time with the defaults)",
    )
    g.add_argument(
        "--every",
        type=int_at_least(1),
        default=every,
        metavar="K",
        help="tune on every K-th step of each workload of more than 64 steps, weighted K (consecutive decode "
        f"steps differ by a token; default {every}; 'run' tunes with {RUN_EVERY}, and 'export' of its studies "
        f"needs --every {RUN_EVERY} too)",
    )
    g.add_argument("--worst-step", action="store_true", help="second objective: the worst step's latency")
    g.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip bad workload lines (counted and logged) instead of stopping; 'export' of the studies must skip "
        "them too",
    )
    g.add_argument(
        "--runtime",
        action="store_true",
        help="predict each step as the production runtime (TreeAttentionRuntime) plans and launches it, not as "
        "tree_attention does (the model needs runtime traces: 'fasttree-tune profile --runtime')",
    )
    return p


def _trial_options(*, timeout: float | None = None) -> argparse.ArgumentParser:
    """Options of the subcommands that run trials; ``timeout`` is ``--timeout``'s default (seconds per bucket)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("trials")
    g.add_argument(
        "--trials",
        type=int_at_least(1),
        default=RUN_TRIALS,
        metavar="N",
        help=f"complete trials per bucket study, counting earlier runs and other workers (default {RUN_TRIALS})",
    )
    g.add_argument(
        "--timeout",
        type=duration_arg,
        default=timeout,
        metavar="DURATION",
        help="stop starting trials of a bucket after this time ('90s', '5m'); default: "
        + ("none" if timeout is None else f"{timeout:.0f}s per bucket"),
    )
    g.add_argument("--seed", type=int_at_least(0), default=0, help="sampler seed (default 0)")
    g.add_argument(
        "--worker",
        type=int_at_least(0),
        default=0,
        metavar="K",
        help="this worker's index when several run one study (distinct seeds; default 0)",
    )
    g.add_argument(
        "--polish-passes",
        type=int_at_least(0),
        default=POLISH_PASSES,
        metavar="N",
        help="passes of the coordinate search on the model that polishes each study's best config "
        f"(0: none; default {POLISH_PASSES})",
    )
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (there is none either when stderr is not a terminal: a log gets no \\r frames)",
    )
    return p


def add_tune_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``tune``, ``export``, ``run``, ``validate``, ``refine`` and ``bench`` to the ``fasttree-tune``
    subparsers ``sub``."""
    for add in (_add_tune, _add_export, _add_run, _add_validate, _add_refine, _add_bench):
        add(sub, common)


def _add_tune(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``tune``: one Optuna study per bucket against the latency model."""
    t = sub.add_parser(
        "tune",
        help="tune configs per bucket against the latency model on workload traces",
        description="Group the workload steps of WORKLOADS by (GQA ratio, head dim, dtype) and run one "
        "Optuna study per bucket (seeded multivariate TPE, the published defaults as the first trial) whose "
        "objective is the model's predicted total latency of the steps, planned by the real planner. "
        "Studies live in --storage and resume: rerunning the same command after a kill runs only the "
        "missing trials, and workers started on other machines with the same --storage and --study join.",
        parents=[*common, _study_options(), _trial_options()],
    )
    t.add_argument("workloads", nargs="+", metavar="WORKLOADS", help="workload trace files or folders")
    t.add_argument(
        "--out",
        default=".",
        metavar="DIR",
        help="FOLDER of the default study storage (fasttree-tune.db: its studies resume; default .)",
    )
    t.add_argument("--export", metavar="FILE", help="also write the tuned configs as an export file")
    t.add_argument("--json", metavar="FILE", help="write the per-bucket results as JSON")
    t.add_argument("--overwrite", action="store_true", help="replace --export and --json if they exist (else: refuse)")
    t.set_defaults(func=_cmd_tune, subparser=t, output_files=("export", "json"), output_folder=True)


def _add_export(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``export``: the best config of each bucket's study as an export file."""
    e = sub.add_parser(
        "export",
        help="write the best config of each bucket's study as an export file",
        description="Read the studies of WORKLOADS' buckets from --storage (no new trials) and write their "
        "best configs, with provenance (model and trace-set hashes, study names, predicted gain over the "
        "defaults), as a schema-versioned JSON export for fasttree.config_from_export.",
        parents=[*common, _study_options()],
    )
    e.add_argument("workloads", nargs="+", metavar="WORKLOADS", help="the workload traces the studies tuned")
    e.add_argument("-o", "--out", required=True, metavar="FILE", help="export FILE to write (.json)")
    e.add_argument("--overwrite", action="store_true", help="replace --out if it exists (else: refuse)")
    e.add_argument("--folder", default=".", metavar="DIR", help="folder of the default storage (default .)")
    e.set_defaults(func=_cmd_export, subparser=e, output_files=("out",))


def _add_run(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``run``: the main job, shipped traces in, tuned export and report out."""
    r = sub.add_parser(
        "run",
        help="the main job: shipped traces in, tuned export and report out",
        description="Load the shipped H200 latency model (or fit it from --traces when it is missing or "
        "--refit is given), tune every bucket of --workloads with the embedded SQLite storage in --out, "
        "write --out/export.json, predict the held-out workloads (--heldout) with the tuned and the "
        "default configs, and write a report (report.md, report.json and PNG plots: optimisation "
        "history, parameter importances, predicted latency per step). Rerunning after a kill resumes the "
        "studies; a finished run's --out is replaced only with --overwrite.",
        parents=[*common, _study_options(every=RUN_EVERY), _trial_options(timeout=RUN_TIMEOUT_S)],
    )
    r.add_argument(
        "--traces",
        default=RUN_TRACES,
        metavar="DIR",
        help="measurement traces to fit the model from (--refit, or a --model that does not exist; default: "
        "traces/h200 of a source checkout; an installed package holds only the fitted model)",
    )
    r.add_argument("--workloads", default=RUN_WORKLOADS, metavar="DIR", help=f"tuning workloads ({_SHIPPED_WORKLOADS})")
    r.add_argument("--heldout", default=RUN_HELDOUT, metavar="DIR", help=f"held-out workloads ({_SHIPPED_HELDOUT})")
    r.add_argument(
        "--out",
        default=RUN_OUT,
        metavar="DIR",
        help=f"output FOLDER: studies, {', '.join(RUN_OUTPUTS)} and plots (default {RUN_OUT})",
    )
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the export and report of a finished run in --out (else: refuse; a killed run resumes either way)",
    )
    r.add_argument("--refit", action="store_true", help="fit the model from --traces even if --model exists")
    r.set_defaults(func=_cmd_run, subparser=r, output_folder_files=RUN_OUTPUTS, output_folder=True)


def _add_validate(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``validate``: a tuned export against the defaults, measured on the GPU."""
    v = sub.add_parser(
        "validate",
        help="measure a tuned export against the defaults on the GPU",
        description="On a CUDA GPU: measure evenly spaced decode steps of each workload in WORKLOADS with "
        "the export's config for their bucket and with the defaults (CUDA-graph replay, the first step "
        "checked against the float64 reference), print the measured speedup per workload next to the "
        "model's prediction and error, and append every measurement to --traces-out (closing the loop: "
        "the next 'fasttree-tune fit' can use them).",
        parents=[*common],
    )
    v.add_argument("--config", required=True, metavar="EXPORT", help="export file ('fasttree-tune run' writes one)")
    v.add_argument(
        "workloads", nargs="*", default=[RUN_HELDOUT], metavar="WORKLOADS", help=f"default: {_SHIPPED_HELDOUT}"
    )
    v.add_argument("--steps", type=int_at_least(1), default=8, metavar="K", help="steps per workload (8)")
    v.add_argument("--model", default=None, metavar="MODEL", help="latency model for predicted speedups")
    v.add_argument("--traces-out", required=True, metavar="PATH", help="measurement trace file to append to")
    v.add_argument("--json", metavar="FILE", help="write the results as JSON")
    v.add_argument("--overwrite", action="store_true", help="replace --json if it exists (else: refuse)")
    v.set_defaults(func=_cmd_validate, subparser=v, output_files=("json",))


def _add_refine(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``refine``: an export's configs refined by timing them on the GPU."""
    f = sub.add_parser(
        "refine",
        help="refine an export's configs by timing them on the GPU",
        description="On a CUDA GPU: for every bucket of WORKLOADS, start from the export's config and run a "
        "coordinate search over the config fields, timing the serving runtime (TreeAttentionRuntime) by "
        "CUDA-graph replay on K evenly spaced steps of each workload; keep a move when it lowers the geometric "
        "mean over workloads of the time ratio to the start by more than --min-gain. Writes a new export "
        "(other entries copied) whose refined entries record the search in their provenance. No Optuna, no model.",
        parents=[*common],
    )
    f.add_argument("--config", required=True, metavar="EXPORT", help="the export to start from")
    f.add_argument("--out", required=True, metavar="FILE", help="the refined export FILE to write")
    f.add_argument("--overwrite", action="store_true", help="replace --out if it exists (else: refuse)")
    f.add_argument(
        "workloads", nargs="*", default=[RUN_WORKLOADS], metavar="WORKLOADS", help=f"default: {_SHIPPED_WORKLOADS}"
    )
    f.add_argument("--steps", type=int_at_least(1), default=3, metavar="K", help="steps per workload (3)")
    f.add_argument("--passes", type=int_at_least(1), default=2, help="search passes (2)")
    f.add_argument("--min-gain", type=float, default=0.015, help="relative gain a move must bring (0.015)")
    f.add_argument("--fields", default=None, help="comma list of coordinates to search (default: all)")
    f.add_argument(
        "--device", default="cuda", help="cuda (default); cpu only for a smoke test under TRITON_INTERPRET=1"
    )
    f.set_defaults(func=_cmd_refine, subparser=f, output_files=("out",))


def _add_bench(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``bench``: the kernel benchmark on the paper suite."""
    b = sub.add_parser(
        "bench",
        help="the kernel benchmark on the paper suite (needs a GPU)",
        description="Run the kernel benchmark (fasttree.toolkit.kernel_bench; 'python -m bench.kernel' in a "
        "source checkout: the paper suite, our kernel vs the published FastTree times, query-separated "
        "attention, SDPA, the ablations and the roofline floor; JSON, markdown and a plot under --out, "
        "default docs/results) with the arguments that follow, e.g. 'fasttree-tune bench -- --heads gqa4 "
        "--out /tmp/b'. Its 'tuned' variant reads docs/tune/export.json from the working folder when "
        "there is one (or --export PATH).",
        parents=[*common],
    )
    b.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments of the benchmark")
    b.set_defaults(func=_cmd_bench, subparser=b)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_model(args: argparse.Namespace):
    """(model, GpuSpec, meta) of ``--model``; a usage error when it cannot be used."""
    from fasttree.costmodel.gpu import GpuSpec
    from fasttree.costmodel.persist import ModelFileError, load_model

    try:
        model, meta = load_model(args.model, force=getattr(args, "force", False))
        gpu = GpuSpec.from_dict(meta["gpu"])
    except FileNotFoundError:
        args.subparser.error(f"--model {args.model} does not exist (fit one with 'fasttree-tune fit')")
    except OSError as exc:
        args.subparser.error(f"--model {args.model}: {exc.strerror or exc}")
    except (ModelFileError, KeyError, ValueError) as exc:
        args.subparser.error(f"--model {args.model}: {exc}")
    return model, gpu, meta


def _workload_steps(args: argparse.Namespace, paths: list[str], what: str):
    """Workload steps of ``paths`` grouped by bucket; a usage error when there are none or they hold more
    tokens than a tuning run takes (:data:`fasttree.traces.MAX_WORKLOAD_TOKENS`)."""
    from fasttree.traces import MAX_WORKLOAD_TOKENS, TraceError, read_traces
    from fasttree.tuner import steps_by_bucket

    try:
        ts = read_traces(paths, kind="workload", skip_invalid=getattr(args, "skip_invalid", False))
        records = ts.records
        for name, line, reason in ts.invalid[:20]:  # read_traces logs how many, and the first
            logger.info("skipped %s:%d: %s", name, line, reason)
        tokens = sum(sum(r["workload"]["tree"]["lengths"]) for r in records)
        if tokens > MAX_WORKLOAD_TOKENS:
            raise ValueError(
                f"the workload steps hold {tokens} KV tokens in all, more than a tuning run takes "
                f"({MAX_WORKLOAD_TOKENS}, MAX_WORKLOAD_TOKENS); tune fewer files at a time"
            )
        grouped = steps_by_bucket(records)
    except (TraceError, ValueError, OSError) as exc:
        args.subparser.error(f"{what} {' '.join(paths)}: {exc}")
    if not grouped:
        args.subparser.error(f"{what} {' '.join(paths)}: no workload lines")
    return grouped


def _warn_outside_training(grouped, meta: dict[str, Any]) -> None:
    """A WARNING per bucket whose GQA ratio or head dim the model never saw (``extra.training_domain``, which
    ``fasttree-tune fit`` records): the model's predictions there, and the configs tuned on them, are
    extrapolations."""
    domain = meta.get("extra", {}).get("training_domain")
    if not isinstance(domain, dict):
        logger.info("the model records no training domain (GQA ratios, head dims): buckets are not checked against it")
        return
    known = {"GQA ratio": domain.get("group_sizes", []), "head dim": domain.get("head_dims", [])}
    for b in grouped:
        outside = [
            f"{what} {value} (trained on {', '.join(map(str, known[what]))})"
            for what, value in (("GQA ratio", b.group_size), ("head dim", b.head_dim))
            if value not in known[what]
        ]
        if outside:
            logger.warning(
                "bucket %s: %s outside the model's training data: its predictions, and the configs tuned on them, "
                "are extrapolations",
                b.label,
                " and ".join(outside),
            )


def _tune(args: argparse.Namespace, grouped, model, gpu, folder: Path, *, trials: int, meta: dict[str, Any]):
    import optuna

    from fasttree.tuner import tune_workload

    if not logging.getLogger("fasttree").isEnabledFor(logging.DEBUG):
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial only with -v
    from fasttree.tuner import balance_workloads, thin_steps

    _warn_outside_training(grouped, meta)
    raw = grouped
    grouped = {b: thin_steps(steps, args.every) for b, steps in grouped.items()}
    if args.balance:
        grouped = {b: balance_workloads(steps, model, gpu, b, runtime=args.runtime) for b, steps in grouped.items()}

    try:
        return tune_workload(
            grouped,
            model,
            gpu,
            storage=args.storage,
            folder=folder,
            base_name=args.study,
            n_trials=trials,
            timeout=getattr(args, "timeout", None),  # the trial options; 'export' runs no trial
            seed=getattr(args, "seed", 0),
            worker=getattr(args, "worker", 0),
            worst_step=args.worst_step,
            progress=progress_bar_wanted(getattr(args, "progress", False)),
            polish_passes=getattr(args, "polish_passes", POLISH_PASSES),
            runtime=args.runtime,
        )
    except ValueError as exc:
        hint = None
        if "another objective" in str(exc):  # open_study's refusal of a study made with other settings
            try:
                hint = _mismatch_hint(args, raw, grouped, model, gpu, folder)
            except Exception as why:  # only a hint: the refusal stands without it
                logger.debug("no hint for %s: %s", exc, why)
        args.subparser.error(hint or str(exc))


def _mismatch_hint(args: argparse.Namespace, raw, grouped, model, gpu, folder: Path) -> str | None:
    """Which setting of this command differs from the one a bucket's existing study was tuned with
    (``--every``, ``--no-balance``, ``--runtime``), or None when none of them explains it."""
    import optuna

    from fasttree.tuner import LatencyObjective, balance_workloads, open_storage, study_name, thin_steps
    from fasttree.tuner.study import _FINGERPRINT_ATTR

    store = open_storage(args.storage, folder=folder)
    for b, steps in grouped.items():
        name = study_name(args.study, b)
        try:
            stored = optuna.load_study(study_name=name, storage=store).user_attrs.get(_FINGERPRINT_ATTR)
        except KeyError:  # no such study
            continue
        heads = {"worst_step": args.worst_step, "runtime": args.runtime}
        current = LatencyObjective(steps, model, gpu, b, **heads).fingerprint()
        if not stored or stored == current:
            continue
        if stored.get("launch") != current.get("launch"):
            launches = ["tree_attention's launches (no --runtime)", "the runtime's launches (--runtime)"]
            theirs, ours = launches[::-1] if stored.get("launch") else launches
            return (
                f"study {name} was tuned predicting {theirs}, this command predicts {ours}: pass the same "
                "--runtime setting (or another --study)"
            )
        if stored.get("n_steps") != current["n_steps"]:
            every = [k for k in range(1, 257) if len(thin_steps(raw[b], k)) == stored.get("n_steps")]
            if not every:
                return (
                    f"study {name} was tuned on {stored.get('n_steps')} steps, this command reads "
                    f"{current['n_steps']}: other workloads (or another --study)"
                )
            return (
                f"study {name} was tuned with --every {every[0]} ({stored.get('n_steps')} steps), this command "
                f"reads with --every {args.every} ({current['n_steps']} steps): pass --every {every[0]} "
                f"('fasttree-tune run' tunes with --every {RUN_EVERY})"
            )
        thinned = thin_steps(raw[b], args.every)
        other = thinned if args.balance else balance_workloads(thinned, model, gpu, b, runtime=args.runtime)
        if LatencyObjective(other, model, gpu, b, **heads).fingerprint() == stored:
            flag = "with" if args.balance else "without"
            return f"study {name} was tuned {flag} --no-balance: pass the same --no-balance setting"
        return f"study {name} was tuned on other workload steps (same count, other trees or weights)"
    return None


def _results_table(results, totals) -> str:
    """The per-bucket table every tuning command prints and ``run``'s report holds (one computation:
    :func:`fasttree.tuner.report.bucket_summaries`)."""
    from fasttree.tuner.report import results_table

    return results_table(_summaries(results, totals))


def _summaries(results, totals) -> dict[str, dict[str, Any]]:
    from fasttree.tuner.report import bucket_summaries

    return bucket_summaries(results, totals)


def _predicted_totals(grouped, results, model, gpu, runtime: bool) -> dict:
    """Per bucket: (defaults, exported config) predicted total us over the steps with their own weights."""
    from fasttree.tuner import LatencyObjective

    out = {}
    for b, r in results.items():
        objective = LatencyObjective(grouped[b], model, gpu, b, runtime=runtime)
        out[b] = (objective.defaults.total_us, objective.evaluate(_chosen(r)).total_us)
    return out


def _chosen(r):
    """The config exported for a bucket: the best trial's when the objective ranks it above the defaults."""
    return r.best_config if r.predicted_us < r.defaults_predicted_us else _defaults()


def _export_of(results, totals, gpu, meta: dict[str, Any], model_path: Path, runtime: bool):
    from fasttree import __version__
    from fasttree.export import ConfigExport, ExportEntry
    from fasttree.traces import utc_now

    entries = []
    for b, r in results.items():
        default_us, tuned_us = totals[b]
        entries.append(
            ExportEntry(
                gpu=gpu.name,
                group_size=b.group_size,
                head_dim=b.head_dim,
                dtype=b.dtype,
                config=_chosen(r),
                provenance={
                    "study_name": r.study_name,
                    "n_trials": r.n_complete,
                    "best_trial": r.best_trial,
                    "best_trial_objective": r.trial_predicted_us,
                    "polish_moves": r.polish_moves,
                    "polish_start": r.polish_start,
                    "polish_evaluations": r.polish_evaluations,
                    "predicted_default_us": default_us,
                    "predicted_tuned_us": tuned_us,
                    "predicted_gain": 1.0 - tuned_us / default_us,
                    "objective_default": r.defaults_predicted_us,
                    "objective_tuned": min(r.predicted_us, r.defaults_predicted_us),
                },
            )
        )
    return ConfigExport(
        entries=tuple(entries),
        provenance={
            "created_utc": utc_now(),
            "fasttree_version": __version__,
            "trace_set_hash": str(meta.get("trace_set", {}).get("sha256", "")),
            "model_hash": _sha256_file(model_path),
            "model_path": str(model_path),
            "predicted_launches": "runtime" if runtime else "tree_attention",
        },
    )


def _defaults():
    from fasttree.config import FastTreeConfig

    return FastTreeConfig()


def _write_export(args: argparse.Namespace, path: str, export, *, overwrite: bool) -> None:
    from fasttree.export import write_export

    try:
        write_export(path, export, overwrite=overwrite)
    except FileExistsError as exc:
        args.subparser.error(f"{exc}; pass --overwrite to replace it")


def _cmd_tune(args: argparse.Namespace) -> int:
    from fasttree.fileio import write_atomic

    model, gpu, meta = _load_model(args)
    grouped = _workload_steps(args, args.workloads, "WORKLOADS")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = _tune(args, grouped, model, gpu, Path(args.out), trials=args.trials, meta=meta)
    totals = _predicted_totals(grouped, results, model, gpu, args.runtime)
    print(_results_table(results, totals))
    if args.json:
        write_atomic(args.json, json.dumps({b.label: r.to_dict() for b, r in results.items()}, indent=1) + "\n")
    if args.export:
        export = _export_of(results, totals, gpu, meta, Path(args.model), args.runtime)
        _write_export(args, args.export, export, overwrite=args.overwrite)
        print(f"export: {args.export}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from fasttree.tuner.storage import DEFAULT_DB_NAME

    if args.storage is None and not (Path(args.folder) / DEFAULT_DB_NAME).exists():
        args.subparser.error(f"no --storage given and no {DEFAULT_DB_NAME} in {args.folder}: nothing was tuned there")
    model, gpu, meta = _load_model(args)
    grouped = _workload_steps(args, args.workloads, "WORKLOADS")
    results = _tune(args, grouped, model, gpu, Path(args.folder), trials=1, meta=meta)  # runs no trial in a tuned study
    totals = _predicted_totals(grouped, results, model, gpu, args.runtime)
    export = _export_of(results, totals, gpu, meta, Path(args.model), args.runtime)
    _write_export(args, args.out, export, overwrite=args.overwrite)
    print(_results_table(results, totals))
    print(f"export: {args.out}")
    return 0


def _fit_model(args: argparse.Namespace, path: Path) -> None:
    from fasttree.costmodel.dataset import load_dataset
    from fasttree.costmodel.model import LatencyModel

    from .costmodel import fit_and_save

    if args.traces is None:
        why = "--refit fits" if args.refit else f"--model {args.model} does not exist, so run fits"
        args.subparser.error(
            f"{why} the model from measurement traces: pass --traces DIR (traces/h200 of a source checkout; "
            "an installed package holds only the fitted model)"
        )
    try:
        data = load_dataset(args.traces)
    except (ValueError, OSError) as exc:
        args.subparser.error(f"--traces {args.traces}: {exc}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fit_s, _ = fit_and_save(LatencyModel(n_jobs=-1), data, path, trace_paths=[str(args.traces)], overwrite=True)
    print(f"fitted {path} on {len(data)} measurements in {fit_s:.0f} s")


def _cmd_run(args: argparse.Namespace) -> int:
    from fasttree.fileio import write_atomic

    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = Path(args.model)
    if args.refit or not model_path.exists():
        if args.refit:
            model_path = out / "latency_model.json"
            args.model = str(model_path)
        _fit_model(args, model_path)
    model, gpu, meta = _load_model(args)
    grouped = _workload_steps(args, [args.workloads], "--workloads")
    heldout = _workload_steps(args, [args.heldout], "--heldout") if args.heldout else {}
    print(f"model {model_path} ({gpu.name}); {sum(map(len, grouped.values()))} tuning steps in {len(grouped)} buckets")
    results = _tune(args, grouped, model, gpu, out, trials=args.trials, meta=meta)
    totals = _predicted_totals(grouped, results, model, gpu, args.runtime)
    export = _export_of(results, totals, gpu, meta, model_path, args.runtime)
    _write_export(args, str(out / "export.json"), export, overwrite=True)
    judged = _heldout_predictions(heldout, export, model, gpu, args.runtime)
    from fasttree.tuner.report import write_report

    report = write_report(out, results, judged, storage=args.storage, folder=out, totals=totals,
                          model={"path": model_path, "gpu": gpu.name}, elapsed_s=time.perf_counter() - t0)  # fmt: skip
    summary = {
        "gpu": gpu.name,
        "model": str(model_path),
        "buckets": {b.label: r.to_dict() for b, r in results.items()},
        "exported": _summaries(results, totals),
        "heldout": judged,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    write_atomic(out / "report.json", json.dumps(summary, indent=1, default=float) + "\n")
    print(_results_table(results, totals))
    for label, h in judged.items():
        print(
            f"held-out {label}: {h['steps']} steps, predicted defaults {h['defaults_us']:.0f} us, "
            f"tuned {h['tuned_us']:.0f} us ({h['speedup']:.3f}x; per workload: geomean "
            f"{h['geomean_workload_speedup']:.3f}x, worst {h['worst_workload_speedup']:.3f}x)"
        )
    print(f"export: {out / 'export.json'}; report: {report}; {summary['elapsed_s']:.0f} s")
    return 0


def _heldout_predictions(heldout, export, model, gpu, runtime: bool) -> dict[str, dict[str, Any]]:
    """Per bucket of the held-out workloads: predicted latency with the export's config and the defaults."""
    from fasttree.tuner import LatencyObjective, workload_of

    judged = {}
    for bucket, steps in heldout.items():
        config, _ = export.lookup(
            gpu=gpu.name,
            num_q_heads=steps[0].num_q_heads,
            num_kv_heads=steps[0].num_kv_heads,
            head_dim=bucket.head_dim,
            dtype=bucket.dtype,
        )
        objective = LatencyObjective(steps, model, gpu, bucket, runtime=runtime)
        tuned, base = objective.evaluate(config), objective.defaults
        # per workload (scenario and model shape): the target is judged per workload, not only in sum
        by_workload: dict[str, list[int]] = {}
        for i, s in enumerate(steps):
            by_workload.setdefault(workload_of(s), []).append(i)
        ratios = {w: float(base.step_us[idx].sum() / tuned.step_us[idx].sum()) for w, idx in by_workload.items()}
        judged[bucket.label] = {
            "steps": len(steps),
            "defaults_us": base.total_us,
            "tuned_us": tuned.total_us,
            "speedup": base.total_us / tuned.total_us,
            "workload_speedups": ratios,
            "geomean_workload_speedup": math.exp(sum(math.log(v) for v in ratios.values()) / len(ratios)),
            "worst_workload_speedup": min(ratios.values()),
            "step_defaults_us": base.step_us.tolist(),
            "step_tuned_us": tuned.step_us.tolist(),
        }
    return judged


def _predictor(args: argparse.Namespace):
    """``[(record, config), ...] -> predicted us`` with ``--model`` (None without one)."""
    if not args.model:
        return None
    import numpy as np

    import fasttree as ft
    from fasttree.costmodel.features import features_of_plans
    from fasttree.traces import decode_tree

    model, gpu, _ = _load_model(args)

    def predict(pairs) -> np.ndarray:
        plans = [
            ft.plan(decode_tree(r["workload"]["tree"]), c, num_q_heads=r["num_q_heads"],
                    num_kv_heads=r["num_kv_heads"], head_dim=r["head_dim"])
            for r, c in pairs
        ]  # fmt: skip
        return model.predict(features_of_plans(plans, gpu))

    return predict


def _cmd_validate(args: argparse.Namespace) -> int:
    import torch

    from fasttree.export import read_export
    from fasttree.fileio import write_atomic
    from fasttree.toolkit.validate import validate_export
    from fasttree.traces import TraceError, TraceWriter, read_traces

    if not torch.cuda.is_available():
        args.subparser.error("validate measures on a CUDA GPU and none is visible")
    try:
        export = read_export(args.config)
        records = read_traces(args.workloads, kind="workload").records
    except (TraceError, ValueError, OSError) as exc:
        args.subparser.error(str(exc))
    if not records:
        args.subparser.error(f"no workload lines in {' '.join(args.workloads)}")
    predict = _predictor(args)
    gpu_name = torch.cuda.get_device_name()
    with TraceWriter(args.traces_out) as writer:
        results = validate_export(export, records, gpu_name=gpu_name, steps_per_workload=args.steps, writer=writer,
                                  predict=predict)  # fmt: skip
    lines = ["| workload | steps | defaults (us) | tuned (us) | measured speedup | predicted | model MAPE |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for v in results:
        pred = f"{v.predicted_speedup:.3f}x" if v.predicted_speedup else "-"
        mape = f"{sum(v.abs_errors) / len(v.abs_errors):.3f}" if v.abs_errors else "-"
        tag = " (defaults)" if v.tuned_is_default else ""
        lines.append(f"| {v.workload}{tag} | {len(v.steps)} | {v.default_us:.1f} | {v.tuned_us:.1f} | "
                     f"{v.speedup:.3f}x | {pred} | {mape} |")  # fmt: skip
    speedups = [v.speedup for v in results]
    geo = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
    lines.append(f"\ngeomean measured speedup {geo:.3f}x, worst {min(speedups):.3f}x ({gpu_name})")
    print("\n".join(lines))
    if args.json:
        rows = [dict(vars(v), speedup=v.speedup, predicted_speedup=v.predicted_speedup) for v in results]
        doc = {"gpu": gpu_name, "geomean_speedup": geo, "worst_speedup": min(speedups), "workloads": rows}
        write_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    return 0


def _cmd_refine(args: argparse.Namespace) -> int:
    import os

    import torch

    from fasttree.export import ConfigExport, ExportEntry, read_export, write_export
    from fasttree.toolkit.refine import RuntimeBench, coordinate_search, parse_fields, search_provenance
    from fasttree.toolkit.validate import workload_steps
    from fasttree.traces import TraceError, decode_tree, read_traces

    if args.device.split(":")[0] not in ("cuda", "cpu"):
        args.subparser.error(f"--device must be cuda or cpu, got {args.device!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        args.subparser.error("refine measures on a CUDA GPU and none is visible")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        args.subparser.error("--device cpu needs TRITON_INTERPRET=1 (a smoke test: its times mean nothing)")
    try:
        check_number("--min-gain", args.min_gain, minimum=0, below=1)
        coordinates = None if args.fields is None else parse_fields(args.fields)
        export = read_export(args.config)
        records = read_traces(args.workloads, kind="workload").records
        steps = workload_steps(records, args.steps)
    except (TraceError, ValueError, OSError) as exc:
        args.subparser.error(str(exc))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    buckets: dict[tuple, dict[str, list]] = {}
    for name, rs in steps.items():
        r = rs[0]
        key = (int(r["num_q_heads"]), int(r["num_kv_heads"]), int(r["head_dim"]), str(r["dtype"]))
        buckets.setdefault(key, {})[name] = [decode_tree(x["workload"]["tree"]) for x in rs]
    entries = {(e.gpu, *e.bucket): e for e in export.entries}
    lines = ["| bucket | workload | start (us) | refined (us) | ratio |", "|---|---|---:|---:|---:|"]
    for (hq, hkv, d, dtype), trees in buckets.items():
        start, entry = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
        logger.info("bucket %d/%d D %d %s: %d workloads, start from %s", hq, hkv, d, dtype, len(trees),
                 "the export's entry" if entry else "the defaults")  # fmt: skip
        t0 = time.perf_counter()
        bench = RuntimeBench(trees, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=getattr(torch, dtype),
                             device=device)  # fmt: skip
        found = coordinate_search(start, bench, coordinates=coordinates, passes=args.passes, min_gain=args.min_gain)
        seconds = time.perf_counter() - t0
        method = "fasttree-tune refine: coordinate search timed by CUDA-graph replay of the runtime"
        provenance = {
            **search_provenance(method, start, entry, found, seconds),
            "workloads": sorted(trees),
            "steps_per_workload": args.steps,
            "failed": found.failed,
        }
        new = ExportEntry(gpu, hq // hkv, d, dtype, found.config, provenance)
        entries[(gpu, *new.bucket)] = new
        for w in sorted(trees):
            a, b = found.start_us[w], found.best_us[w]
            lines.append(f"| g{hq // hkv} D{d} {dtype} | {w} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
        lines.append(f"| g{hq // hkv} D{d} {dtype} | geomean ({found.evaluations} configs, {seconds:.0f} s) | | | "
                     f"{found.objective:.3f} |")  # fmt: skip
    provenance = {**export.provenance, "refined_by": "fasttree-tune refine", "refined_from": str(args.config)}
    write_export(args.out, ConfigExport(tuple(entries.values()), provenance), overwrite=args.overwrite)
    print("\n".join(lines))
    print(f"wrote {args.out} ({gpu})")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from ..toolkit.kernel_bench import main as bench_main

    rest = list(args.bench_args)
    return bench_main(rest[1:] if rest[:1] == ["--"] else rest, prog="fasttree-tune bench --")
