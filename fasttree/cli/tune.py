"""``fasttree-tune tune``, ``export``, ``run``, ``validate`` and ``refine``: the tuner's subcommands.

Optuna, scikit-learn and matplotlib are imported only when one of them runs
(``pip install -e '.[tune]'``); ``validate`` and ``refine`` run on a GPU machine and never
import Optuna. The options the tuning subcommands share (model, storage, study name, trials,
seed) come from parent parsers, :func:`_study_options` and :func:`_trial_options`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
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
RUN_WORKLOADS = str(shipped.workloads_path("tuning"))
RUN_HELDOUT = str(shipped.workloads_path("heldout"))
#: The frozen test of a tuned export (``validate``'s default): families no tuning step or design choice uses.
RUN_TEST = str(shipped.workloads_path("test"))
RUN_MODEL = str(shipped.model_path())
#: The files ``run`` writes into ``--out`` that a rerun replaces only with ``--overwrite``.
RUN_OUTPUTS = ("export.json", "report.md", "report.json")
#: How help texts name the shipped data.
_SHIPPED_MODEL = "the shipped H200 model (package data: fasttree/costmodel/data/h200_latency_model.skops)"
_SHIPPED_WORKLOADS = "the shipped workloads (package data: fasttree/toolkit/data/workloads)"
_SHIPPED_HELDOUT = "the shipped held-out workloads (package data: fasttree/toolkit/data/workloads_heldout)"
_SHIPPED_TEST = "the shipped test workloads (package data: fasttree/toolkit/data/workloads_test)"
RUN_OUT = "fasttree-run"
#: Complete trials per study of ``tune``.
TUNE_TRIALS = 250
#: Complete trials per study of ``run``: a count, not a time budget, so that the same workloads,
#: model and seed give the same export on any machine (a per-study time limit cut the studies at
#: whatever trial the host's speed reached, and the choices near the margin moved with it). Six
#: studies (three buckets, two targets) of 60 trials, their polishes and the portfolio choice take
#: about 2.5 minutes on 2 cores.
RUN_TRIALS = 60
#: Tuning and export use every 16th step of each long workload (``--every``): consecutive decode
#: steps differ by a token, and the portfolio's candidates are planned on every step many times.
RUN_EVERY = 16
#: Passes of the polish after each study (``fasttree.tuner.polish``); ``export`` uses it too.
POLISH_PASSES = 1
#: What ``run`` and ``export`` tune portfolios for.
RUN_TARGETS = ("tree_attention", "runtime")


def _study_options(*, settings_from_study: bool = False) -> argparse.ArgumentParser:
    """Options shared by the subcommands that open tuning studies; with ``settings_from_study`` (``export``),
    ``--model`` and ``--every`` default to what the studies recorded."""
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
        help="study base name; each (GQA ratio, head dim, dtype) bucket gets NAME-g<G>-d<D>-<dtype>, NAME-rt-... "
        "for the runtime (default fasttree)",
    )
    g.add_argument(
        "--model",
        default=None if settings_from_study else RUN_MODEL,
        metavar="MODEL",
        help="latency model (default: "
        + ("the one the studies recorded, else " if settings_from_study else "")
        + f"{_SHIPPED_MODEL})",
    )
    g.add_argument("--force", action="store_true", help="use a model fitted for another GPU or feature schema")
    g.add_argument(
        "--every",
        type=int_at_least(1),
        default=None if settings_from_study else RUN_EVERY,
        metavar="K",
        help="tune on every K-th step of each workload of more than 64 steps (consecutive decode steps differ "
        "by a token; default "
        + ("the K the studies recorded, else " if settings_from_study else "")
        + f"{RUN_EVERY}; 'export' reuses the studies' K)",
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


def _trial_options(*, trials: int) -> argparse.ArgumentParser:
    """Options of the subcommands that run trials; ``trials`` is ``--trials``' default."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("trials")
    g.add_argument(
        "--trials",
        type=int_at_least(1),
        default=trials,
        metavar="N",
        help=f"complete trials per bucket study, counting earlier runs and other workers (default {trials})",
    )
    g.add_argument(
        "--timeout",
        type=duration_arg,
        default=None,
        metavar="DURATION",
        help="also stop starting trials of a bucket after this time ('90s', '5m'; default: none, the trial "
        "count alone, so that a rerun anywhere gives the same studies)",
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


def _target_options(*, settings_from_study: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("portfolios")
    g.add_argument(
        "--targets",
        type=_targets_arg,
        default=None if settings_from_study else RUN_TARGETS,
        metavar="LIST",
        help="what to tune portfolios for: tree_attention, runtime or both, comma separated (default "
        + ("the targets the storage holds studies of: 'tune' makes tree_attention's, 'tune --runtime' the "
           "runtime's)" if settings_from_study else "both)"),
    )  # fmt: skip
    g.add_argument(
        "--jobs",
        type=int_at_least(1),
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="parallel processes, one (bucket, target) each (default: the cores, at most 4)",
    )
    return p


def _targets_arg(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in RUN_TARGETS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(RUN_TARGETS)}, got {text!r}")
    return names


#: ``--heldout`` values: hold out the last fifth of each workload of WORKLOADS / no held-out workloads.
HELDOUT_SPLIT = "split"
HELDOUT_NONE = ("", "none")


def _heldout_option(p: argparse.ArgumentParser, command: str) -> None:
    """``--heldout``: the workloads each portfolio's design is chosen on (a path, ``split`` or ``none``)."""
    default = {
        "tune": "recorded in the studies for 'export'",
        "export": "what the studies recorded, else as 'tune'",
        "run": "",
    }[command]
    p.add_argument(
        "--heldout",
        default=None,
        metavar="PATH|split|none",
        help="held-out (validation) workloads, on which each portfolio's design is chosen: a trace file or folder; "
        "'split': the last fifth of the steps of each workload of "
        + ("--workloads" if command == "run" else "WORKLOADS")
        + ", left out of tuning; 'none': no held-out workloads (the most cautious design). Default: "
        f"{_SHIPPED_HELDOUT} when the workloads are the shipped ones, else 'split'"
        + (f" ({default})" if default else ""),
    )


#: ``--calibration`` value: no held-out traces (every selector leaf then serves the defaults).
CALIBRATION_NONE = "none"


def _calibration_option(p: argparse.ArgumentParser) -> None:
    """``--calibration``: the held-out measurement traces the margin of every bucket is calibrated on."""
    p.add_argument(
        "--calibration",
        default=None,
        metavar="TRACES|none",
        help="measurement traces of the model's GPU that the model was not fitted on (e.g. 'fasttree-tune profile "
        "--split heldout'): the model's error on predicted gains there, per bucket and target, is the margin a "
        "selector leaf's predicted gain must exceed to leave the defaults (fasttree.costmodel.calibration); "
        "'none': no margin, every leaf serves the defaults (the members stay for 'validate' and 'confirm'). "
        "Default: traces/h200_heldout of a source checkout when the model is for its GPU, else none",
    )


def add_tune_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``tune``, ``export``, ``run``, ``validate``, ``refine`` and ``bench`` to the ``fasttree-tune``
    subparsers ``sub``."""
    for add in (_add_tune, _add_export, _add_run, _add_validate, _add_confirm, _add_refine, _add_bench):
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
        parents=[*common, _study_options(), _trial_options(trials=TUNE_TRIALS)],
    )
    t.add_argument("workloads", nargs="+", metavar="WORKLOADS", help="workload trace files or folders")
    t.add_argument(
        "-o",
        "--out",
        default=".",
        metavar="DIR",
        help="output FOLDER: the default study storage (fasttree-tune.db: its studies resume; 'export --studies' "
        "reads it; default .)",
    )
    _heldout_option(t, "tune")
    t.add_argument("--json", metavar="FILE", help="also write the per-bucket results as JSON")
    t.add_argument("--overwrite", action="store_true", help="replace --json if it exists (else: refuse)")
    t.set_defaults(func=_cmd_tune, subparser=t, output_files=("json",), output_folder=True, on_interrupt=_studies_kept)


def _add_export(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``export``: the best config of each bucket's study as an export file."""
    e = sub.add_parser(
        "export",
        help="write the best config of each bucket's study as an export file",
        description="Read the studies of WORKLOADS' buckets that 'fasttree-tune tune' or 'run' made (never runs "
        "a trial: a study that is missing or has no complete trial is an error naming the command that makes it), "
        "find each family's best config and choose each bucket's portfolio and selector on the predictions (the "
        "design on the held-out workloads), and write them, guarded and with provenance, as a schema-versioned "
        "JSON export (fasttree.load_portfolio, docs/export.md). The settings the studies were tuned with "
        "(--model, --every, --heldout, the targets and the workloads, recorded in each study) are reused; an "
        "option given with another value is refused, naming the setting.",
        parents=[*common, _study_options(settings_from_study=True), _target_options(settings_from_study=True)],
    )
    e.add_argument("workloads", nargs="+", metavar="WORKLOADS", help="the workload traces the studies tuned")
    _heldout_option(e, "export")
    _calibration_option(e)
    e.add_argument("-o", "--out", required=True, metavar="FILE", help="export FILE to write (.json)")
    e.add_argument("--overwrite", action="store_true", help="replace --out if it exists (else: refuse)")
    e.add_argument(
        "--studies",
        default=".",
        metavar="DIR",
        help="the FOLDER 'tune --out' (or 'run --out') wrote the default study storage into (default .)",
    )
    e.add_argument("--folder", dest="studies", help=argparse.SUPPRESS)  # the old name of --studies
    e.set_defaults(func=_cmd_export, subparser=e, output_files=("out",))


def _add_run(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``run``: the main job, shipped traces in, tuned export and report out."""
    r = sub.add_parser(
        "run",
        help="the main job: shipped traces in, tuned export and report out",
        description="Load the shipped H200 latency model (or fit it from --traces when it is missing or "
        "--refit is given) and, for every bucket of --workloads and every target (tree_attention, runtime): "
        "run an Optuna study on the family-balanced predicted time (embedded SQLite storage in --out), "
        "polish its best config and find every family's own best config, and choose a portfolio of at most "
        "3 configs (the defaults first) and its selector on the predictions, the design on --heldout. "
        "Writes --out/export.json and a report (report.md, report.json). Rerunning after a kill resumes the "
        "studies; a finished run's --out is replaced only with --overwrite.",
        parents=[*common, _study_options(), _trial_options(trials=RUN_TRIALS), _target_options()],
    )
    r.add_argument(
        "--traces",
        default=RUN_TRACES,
        metavar="DIR",
        help="measurement traces to fit the model from (--refit, or a --model that does not exist; default: "
        "traces/h200 of a source checkout; an installed package holds only the fitted model)",
    )
    r.add_argument("--workloads", default=RUN_WORKLOADS, metavar="DIR", help=f"tuning workloads ({_SHIPPED_WORKLOADS})")
    _heldout_option(r, "run")
    _calibration_option(r)
    r.add_argument(
        "-o",
        "--out",
        default=RUN_OUT,
        metavar="DIR",
        help=f"output FOLDER: studies, {', '.join(RUN_OUTPUTS)} (default {RUN_OUT})",
    )
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the export and report of a finished run in --out (else: refuse; a killed run resumes either way)",
    )
    r.add_argument("--refit", action="store_true", help="fit the model from --traces even if --model exists")
    r.set_defaults(
        func=_cmd_run, subparser=r, output_folder_files=RUN_OUTPUTS, output_folder=True, on_interrupt=_studies_kept
    )


def _add_validate(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``validate``: a tuned export against the defaults, measured on the GPU."""
    v = sub.add_parser(
        "validate",
        help="measure a tuned export against the defaults on the GPU",
        description="On a CUDA GPU: for every tree of WORKLOADS and every target, measure every member of the "
        "export's portfolio for its bucket (CUDA-graph replay, the first tree of each family checked against "
        "the float64 reference); report the measured speedup of the selector's pick over the defaults for every "
        "case, per family and per target, and the selector's regret against the best member; append every "
        "measurement to --traces-out (the next 'fasttree-tune fit' can use them).",
        parents=[*common],
    )
    v.add_argument("--config", required=True, metavar="EXPORT", help="export file ('fasttree-tune run' writes one)")
    v.add_argument(
        "workloads",
        nargs="*",
        default=[RUN_HELDOUT],
        metavar="WORKLOADS",
        help=f"workload traces to measure (default: {_SHIPPED_HELDOUT}, the validation split 'confirm' reads; the "
        f"frozen test, {RUN_TEST}, only for a final check that nothing is chosen from)",
    )
    v.add_argument(
        "--split",
        choices=("all", "heldout"),
        default="all",
        help="all: every step of WORKLOADS (default); heldout: only the steps 'tune' and 'export' hold out of "
        "WORKLOADS when no --heldout is given (the last fifth of each workload): the validation split of your own "
        "workloads, what 'confirm' reads",
    )
    v.add_argument(
        "--targets", type=_targets_arg, default=RUN_TARGETS, metavar="LIST", help="tree_attention, runtime (both)"
    )
    v.add_argument(
        "--traces-out",
        required=True,
        metavar="FILE",
        help="measurement trace FILE to append to; a rerun into the same FILE resumes: a case whose members it "
        "holds, all measured in one earlier run on this GPU model by today's kernels, is read back, not measured "
        "again",
    )
    v.add_argument("--remeasure", action="store_true", help="measure every member again, even those --traces-out holds")
    v.add_argument(
        "--steps",
        type=int_at_least(1),
        metavar="K",
        help="measure K evenly spaced steps of each workload (default: every step)",
    )
    v.add_argument(
        "-o",
        "--out",
        metavar="FILE",
        help="write the results as JSON: the FILE 'fasttree-tune confirm --measured' reads",
    )
    v.add_argument("--json", dest="out", help=argparse.SUPPRESS)  # the old name of --out
    v.add_argument("--markdown", metavar="FILE", help="write the report as markdown")
    v.add_argument("--overwrite", action="store_true", help="replace --out and --markdown if they exist (else: refuse)")
    v.set_defaults(func=_cmd_validate, subparser=v, output_files=("out", "markdown"), append_files=("traces_out",))


def _add_confirm(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """``confirm``: keep only the selector choices that GPU measurement on the validation split supports."""
    from fasttree.toolkit.confirm import ConfirmRules

    rules = ConfirmRules()
    c = sub.add_parser(
        "confirm",
        help="keep only the selector choices that measurements on the validation split confirm",
        description="Read 'fasttree-tune validate --out' results of --config measured on the validation split "
        "(held-out workloads; measurements of the frozen test split are refused) and relabel every selector leaf: "
        f"a leaf leaves the defaults only for a member measured at least {rules.min_gain:.0%} faster in summed time "
        "over at least "
        f"{rules.min_trees} of its trees, none of them below {rules.tree_floor}x of the defaults; other leaves "
        "serve the defaults, and members no leaf names are dropped. Writes the confirmed export and prints one "
        "line per leaf. No GPU, no Optuna.",
        parents=[*common],
    )
    c.add_argument("--config", required=True, metavar="EXPORT", help="the export that was measured")
    c.add_argument("--measured", required=True, nargs="+", metavar="FILE", help="'fasttree-tune validate --out' files")
    c.add_argument("-o", "--out", required=True, metavar="FILE", help="confirmed export FILE to write (.json)")
    c.add_argument("--markdown", metavar="FILE", help="write the leaf decisions as markdown")
    c.add_argument("--overwrite", action="store_true", help="replace --out and --markdown if they exist (else: refuse)")
    c.set_defaults(func=_cmd_confirm, subparser=c, output_files=("out", "markdown"))


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
    f.add_argument("-o", "--out", required=True, metavar="FILE", help="the refined export FILE to write")
    f.add_argument("--overwrite", action="store_true", help="replace --out if it exists (else: refuse)")
    f.add_argument(
        "workloads", nargs="*", default=[RUN_WORKLOADS], metavar="WORKLOADS", help=f"default: {_SHIPPED_WORKLOADS}"
    )
    f.add_argument("--steps", type=int_at_least(1), default=3, metavar="K", help="steps per workload (3)")
    f.add_argument("--passes", type=int_at_least(1), default=2, help="search passes (2)")
    f.add_argument("--min-gain", type=float, default=0.015, help="relative gain a move must bring (0.015)")
    f.add_argument("--fields", default=None, help="comma list of coordinates to search (default: all)")
    f.add_argument("--device", default="cuda", help="the CUDA device to time on (default cuda; e.g. cuda:1)")
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


def _read_workloads(args: argparse.Namespace, paths: list[str], heldout: str):
    """:func:`~.study_settings.read_workloads`; a usage error when they cannot be read or hold more tokens than
    a tuning run takes (:data:`fasttree.traces.MAX_WORKLOAD_TOKENS`, the tuning and held-out steps together)."""
    from fasttree.traces import MAX_WORKLOAD_TOKENS, TraceError

    from .study_settings import read_workloads

    try:
        workloads = read_workloads(paths, heldout, skip_invalid=getattr(args, "skip_invalid", False))
        steps = workloads.tuning + workloads.heldout
        tokens = sum(sum(r["workload"]["tree"]["lengths"]) for r in steps)
        if tokens > MAX_WORKLOAD_TOKENS:
            raise ValueError(
                f"the workload steps hold {tokens} KV tokens in all, more than a tuning run takes "
                f"({MAX_WORKLOAD_TOKENS}, MAX_WORKLOAD_TOKENS); tune fewer files at a time"
            )
    except (TraceError, ValueError, OSError) as exc:
        args.subparser.error(f"WORKLOADS {' '.join(paths)} (held out: {heldout or 'none'}): {exc}")
    return workloads


def _grouped(args: argparse.Namespace, records: list, what: str, *, required: bool = True):
    """Workload steps of ``records`` grouped by bucket; a usage error when there are none (``required``)."""
    from fasttree.tuner import steps_by_bucket

    if not records:
        if required:
            args.subparser.error(f"{what}: no workload lines")
        return {}
    try:
        return steps_by_bucket(records)
    except ValueError as exc:
        args.subparser.error(f"{what}: {exc}")


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


def _tune(args: argparse.Namespace, grouped, model, gpu, folder: Path, *, trials: int, meta: dict[str, Any], settings):
    import optuna

    from fasttree.tuner import balance_families, thin_steps, tune_workload

    if not logging.getLogger("fasttree").isEnabledFor(logging.DEBUG):
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial only with -v
    _warn_outside_training(grouped, meta)
    raw = grouped
    grouped = {b: thin_steps(steps, args.every) for b, steps in grouped.items()}
    grouped = {b: balance_families(steps, model, gpu, b, runtime=args.runtime) for b, steps in grouped.items()}
    try:
        return tune_workload(
            grouped,
            model,
            gpu,
            storage=args.storage,
            folder=folder,
            base_name=_base_name(args.study, "runtime" if args.runtime else "tree_attention"),
            n_trials=trials,
            timeout=getattr(args, "timeout", None),
            seed=getattr(args, "seed", 0),
            worker=getattr(args, "worker", 0),
            worst_step=args.worst_step,
            progress=progress_bar_wanted(getattr(args, "progress", False)),
            polish_passes=getattr(args, "polish_passes", POLISH_PASSES),
            runtime=args.runtime,
            settings=settings,
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
    (``--every``, ``--runtime``), or None when none of them explains it."""
    import optuna

    from fasttree.tuner import LatencyObjective, open_storage, study_name, thin_steps
    from fasttree.tuner.study import _FINGERPRINT_ATTR

    store = open_storage(args.storage, folder=folder)
    for b, steps in grouped.items():
        name = study_name(_base_name(args.study, "runtime" if args.runtime else "tree_attention"), b)
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
        return f"study {name} was tuned on other workload steps (same count, other trees or weights)"
    return None


def _base_name(study: str, target: str) -> str:
    """The study base name of a target: ``NAME`` for tree_attention, ``NAME-rt`` for the runtime (as ``run``)."""
    return f"{study}-rt" if target == "runtime" else study


def _storage_text(args: argparse.Namespace, folder: str) -> str:
    from fasttree.tuner.storage import DEFAULT_DB_NAME

    return args.storage or str(Path(folder) / DEFAULT_DB_NAME)


def _studies_kept(args: argparse.Namespace) -> str:
    """What an interrupted ``tune`` or ``run`` keeps (``main`` prints it on Ctrl-C)."""
    return (
        f"the studies in {_storage_text(args, args.out)} keep every complete trial; rerun the same command to "
        "resume (nothing else was written)"
    )


def _cmd_tune(args: argparse.Namespace) -> int:
    from fasttree.fileio import write_atomic

    from .study_settings import describe_heldout, resolve_heldout, study_settings

    model, gpu, meta = _load_model(args)
    heldout = resolve_heldout(args.heldout, args.workloads)
    workloads = _read_workloads(args, list(args.workloads), heldout)
    grouped = _grouped(args, workloads.tuning, f"WORKLOADS {' '.join(args.workloads)}")
    if heldout:
        logger.info("tuning on %d steps of WORKLOADS; held out for 'export': %d steps of %s",
                    len(workloads.tuning), len(workloads.heldout), describe_heldout(heldout))  # fmt: skip
    settings = {**study_settings(args.model, workloads, args.every),
                "target": "runtime" if args.runtime else "tree_attention"}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = _tune(args, grouped, model, gpu, Path(args.out), trials=args.trials, meta=meta, settings=settings)
    from fasttree.tuner.report import study_table

    print(study_table(results))
    if args.json:
        write_atomic(args.json, json.dumps({b.label: r.to_dict() for b, r in results.items()}, indent=1) + "\n")
    return 0


def _gain_margins(args: argparse.Namespace, model, meta: dict[str, Any], buckets) -> tuple[dict, str | None]:
    """The calibrated margins ``(bucket label, target) -> GainMargin`` of ``--model`` for ``buckets`` on
    ``--calibration`` (:mod:`fasttree.costmodel.calibration`: only their measurements of today's kernel
    launches are read, :func:`fasttree.costmodel.dataset.timed_todays_launches`) and where they came
    from; ``({}, None)`` without held-out traces (a WARNING: every leaf then serves the defaults). A
    usage error for traces that cannot calibrate the model."""
    from fasttree.costmodel.calibration import gain_margins
    from fasttree.costmodel.dataset import load_dataset, timed_todays_launches
    from fasttree.export import bucket_label

    path = args.calibration
    if path == CALIBRATION_NONE:
        logger.warning("--calibration none: no margin for the model's error; every selector leaf serves the defaults")
        return {}, None
    gpu_name = meta["gpu"]["name"]
    default = path is None
    if default:
        path = shipped.heldout_measurement_traces()
        if path is None:
            logger.warning(
                "no held-out measurement traces to calibrate the model's error on (an installed package; pass "
                "--calibration TRACES): every selector leaf serves the defaults until 'validate' and 'confirm' "
                "measure them"
            )
            return {}, None
    if Path(path).resolve() in {Path(t).resolve() for t in meta.get("trace_set", {}).get("paths", [])}:
        args.subparser.error(f"--calibration {path}: the model was fitted on these traces; they are not held out")
    wanted = {(b.group_size, b.head_dim, b.dtype) for b in buckets}

    def keep(r: dict[str, Any]) -> bool:
        bucket = (r["num_q_heads"] // r["num_kv_heads"], r["head_dim"], r["dtype"])
        return bucket in wanted and timed_todays_launches(r)

    try:
        data = load_dataset(path, keep=keep)
    except (ValueError, OSError) as exc:
        if default:
            logger.warning("no margin calibrated on %s (%s): every selector leaf serves the defaults", path, exc)
            return {}, None
        args.subparser.error(
            f"--calibration {path}: no measurements of today's kernel launches in the buckets tuned ({exc})"
        )
    if data.gpu.name != gpu_name:
        if default:
            logger.warning(
                "the model is for %r, the shipped held-out traces for %r: no margin to calibrate, every selector "
                "leaf serves the defaults (pass --calibration with held-out traces of %r)",
                gpu_name, data.gpu.name, gpu_name,
            )  # fmt: skip
            return {}, None
        args.subparser.error(f"--calibration {path}: measured on {data.gpu.name!r}, the model is for {gpu_name!r}")
    margins = gain_margins(model.predict(data.X), data)
    source = f"{path} ({len(data)} measurements, SHA-256 {data.trace_hash[:16]})"
    logger.info("calibrated the margins of %d buckets and targets on %s", len(margins), source)
    return {(bucket_label(g, d, dtype), target): m for (g, d, dtype, target), m in margins.items()}, source


def _portfolios(
    args: argparse.Namespace, folder: Path, model, meta: dict[str, Any], workloads, *, trials: int,
    timeout: float | None, settings: dict[str, Any] | None,
):  # fmt: skip
    """Tune (or, with a study at ``trials`` already, only read) and choose every portfolio of ``workloads``,
    each leaf fenced with the margins of ``--calibration`` (:func:`_gain_margins`)."""
    import optuna

    from fasttree.tuner.pipeline import tune_portfolios

    if not logging.getLogger("fasttree").isEnabledFor(logging.DEBUG):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    grouped = _grouped(args, workloads.tuning, f"WORKLOADS {' '.join(workloads.paths)}")
    heldout = _grouped(args, workloads.heldout, f"--heldout {workloads.heldout_source}", required=False)
    _warn_outside_training(grouped, meta)
    margins, calibration = _gain_margins(args, model, meta, grouped)
    try:
        return tune_portfolios(
            grouped, heldout, args.model, targets=args.targets, folder=folder, storage=args.storage,
            base_name=args.study, n_trials=trials, timeout=timeout, seed=getattr(args, "seed", 0),
            every=args.every, polish_passes=getattr(args, "polish_passes", POLISH_PASSES), jobs=args.jobs,
            force=args.force, settings=settings, margins=margins, calibration=calibration,
        )  # fmt: skip
    except ValueError as exc:
        hint = None
        if "another objective" in str(exc):  # a study of this folder/--storage made with other settings
            try:
                from fasttree.tuner import balance_families, thin_steps

                model, gpu, _ = _load_model(args)
                tuned = {b: balance_families(thin_steps(s, args.every), model, gpu, b) for b, s in grouped.items()}
                hint = _mismatch_hint(args, grouped, tuned, model, gpu, folder)
            except Exception as why:  # only a hint: the refusal stands without it
                logger.debug("no hint for %s: %s", exc, why)
        args.subparser.error(hint or str(exc))


def _exported(results, heldout: str) -> list[str]:
    """One line per exported entry: what it serves, as the held-out predictions say."""
    from fasttree.config import FastTreeConfig

    from .study_settings import describe_heldout

    lines = []
    for r in results:
        p = r.portfolio
        members = p.portfolio.members
        margin = (p.evidence or {}).get("margin")
        if all(m == FastTreeConfig() for m in members):
            what = "serves the defaults only (no tuned config was predicted to pay off)"
        elif not any(p.portfolio.selector.member):
            why = "no margin calibrated" if margin is None else f"no leaf predicted more than {margin:.1%} faster"
            what = (f"serves the defaults ({why}); its {len(members) - 1} tuned members stay as candidates for "
                    "'validate' and 'confirm'")  # fmt: skip
        elif p.valid is None:
            what = f"{len(members)} members, predicted {p.train['objective']:.3f} of the defaults' time on the " \
                   "tuning steps (no held-out steps)"  # fmt: skip
        else:
            picks = p.valid["picks"]
            what = (f"{len(members)} members, switches {sum(picks[1:])} of {sum(picks)} held-out steps from the "
                    f"defaults, predicted {p.valid['objective']:.3f} of their time")  # fmt: skip
        lines.append(f"  {r.target} {r.bucket.label}: {what}")
    return [f"exported {len(results)} entries (held out: {describe_heldout(heldout)}):", *lines]


def _portfolio_export(results, gpu, meta: dict[str, Any], model_path: Path):
    """The format-2 export of ``results`` (:func:`fasttree.tuner.pipeline.tune_portfolios`)."""
    from fasttree import __version__
    from fasttree.export import ConfigExport, ExportEntry, ExportGuard
    from fasttree.traces import utc_now

    model_hash = _sha256_file(model_path)
    entries = []
    for r in results:
        p = r.portfolio
        entries.append(
            ExportEntry(
                gpu=gpu.name,
                group_size=r.bucket.group_size,
                head_dim=r.bucket.head_dim,
                dtype=r.bucket.dtype,
                portfolio=p.portfolio,
                target=r.target,
                guard=ExportGuard.current(model_hash),
                provenance={
                    "study_name": r.tune.study_name,
                    "n_trials": r.tune.n_complete,
                    "candidates": r.n_candidates,
                    "tuning_steps": r.n_steps,
                    "validation_steps": r.n_valid_steps,
                    "rules": {
                        "margin": p.rules.margin,
                        "max_depth": p.rules.max_depth,
                        "min_leaf": p.rules.min_leaf,
                        "family_loss": p.rules.family_loss,
                        "tree_loss": p.rules.tree_loss,
                    },
                    "predicted_train": p.train["objective"],
                    "predicted_valid": None if p.valid is None else p.valid["objective"],
                    "predicted_gain": 1.0 - (p.valid or p.train)["objective"],
                    "evidence": p.evidence,
                },
            )
        )
    return ConfigExport(
        entries=tuple(entries),
        provenance={
            "created_utc": utc_now(),
            "fasttree_version": __version__,
            "trace_set_hash": str(meta.get("trace_set", {}).get("sha256", "")),
            "model_hash": model_hash,
            "model_path": str(model_path),
        },
    )


def _write_export(args: argparse.Namespace, path: str, export, *, overwrite: bool) -> None:
    from fasttree.export import write_export

    try:
        write_export(path, export, overwrite=overwrite)
    except FileExistsError as exc:
        args.subparser.error(f"{exc}; pass --overwrite to replace it")


def _tuned_studies(args: argparse.Namespace, grouped) -> dict[str, dict[str, Any] | None]:
    """The studies ``export`` reads, name -> recorded settings; sets ``args.targets`` when it was left out.

    A usage error, before anything else runs, when a study is missing or has no complete trial: ``export``
    runs no trial."""
    import optuna

    from fasttree.tuner import open_storage, study_name
    from fasttree.tuner.study import SETTINGS_ATTR

    store = open_storage(args.storage, folder=args.studies)
    found: dict[str, dict[str, Any]] = {}
    for target in RUN_TARGETS:
        for b in grouped:
            name = study_name(_base_name(args.study, target), b)
            try:
                study = optuna.load_study(study_name=name, storage=store)
            except KeyError:
                continue
            complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            found[name] = {"target": target, "complete": len(complete), "settings": study.user_attrs.get(SETTINGS_ATTR)}
    where = _storage_text(args, args.studies)
    if args.targets is None:
        args.targets = tuple(t for t in RUN_TARGETS if any(f["target"] == t for f in found.values()))
        if not args.targets:
            names = ", ".join(study_name(args.study, b) for b in grouped)
            args.subparser.error(
                f"{where} holds no study of WORKLOADS' buckets ({names}): 'export' runs no trial; tune them first "
                "('fasttree-tune tune WORKLOADS --out DIR', then 'export --studies DIR')"
            )
    chosen = {}
    for target in args.targets:
        for b in grouped:
            name = study_name(_base_name(args.study, target), b)
            how = "fasttree-tune tune WORKLOADS" + (" --runtime" if target == "runtime" else "")
            if name not in found:
                args.subparser.error(
                    f"{where} holds no study {name} ({target}, bucket {b.label}): 'export' runs no trial; tune it "
                    f"with '{how}' (same --out or --storage), or pass --targets without {target}"
                )
            if not found[name]["complete"]:
                args.subparser.error(f"study {name} in {where} has no complete trial: 'export' runs none; '{how}'")
            chosen[name] = found[name]["settings"]
    return chosen


def _cmd_export(args: argparse.Namespace) -> int:
    from fasttree.tuner.storage import DEFAULT_DB_NAME

    from .study_settings import check_workloads, reconcile, resolve_heldout

    if args.storage is None and not (Path(args.studies) / DEFAULT_DB_NAME).exists():
        args.subparser.error(
            f"no --storage given and no {DEFAULT_DB_NAME} in {args.studies}: nothing was tuned there "
            "(--studies DIR: the folder 'tune --out' wrote)"
        )
    given_heldout = None if args.heldout is None else resolve_heldout(args.heldout, args.workloads)
    everything = _read_workloads(args, list(args.workloads), "")  # all steps: their buckets name the studies
    recorded = _tuned_studies(args, _grouped(args, everything.records, f"WORKLOADS {' '.join(args.workloads)}"))
    try:
        check_workloads(recorded, everything)
        settings = reconcile(recorded, model=args.model, every=args.every, heldout=given_heldout)
    except ValueError as exc:
        args.subparser.error(str(exc))
    args.model = settings["model"] or RUN_MODEL
    args.every = settings["every"] or RUN_EVERY
    heldout = settings["heldout"] if settings["heldout"] is not None else resolve_heldout(None, args.workloads)
    logger.info("exporting %s with --model %s, --every %d, held out: %s", ", ".join(sorted(recorded)), args.model,
                args.every, heldout or "none")  # fmt: skip
    workloads = _read_workloads(args, list(args.workloads), heldout)
    model, gpu, meta = _load_model(args)
    results = _portfolios(args, Path(args.studies), model, meta, workloads, trials=1, timeout=None, settings=None)
    export = _portfolio_export(results, gpu, meta, Path(args.model))
    _write_export(args, args.out, export, overwrite=args.overwrite)
    from fasttree.tuner.report import portfolio_table

    print("\n".join(_exported(results, heldout)))
    print(portfolio_table(results))
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
    from fasttree.traces import utc_now
    from fasttree.tuner.report import portfolio_table, run_report

    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = Path(args.model)
    if args.refit or not model_path.exists():
        if args.refit:
            model_path = out / "latency_model.skops"
            args.model = str(model_path)
        _fit_model(args, model_path)
    model, gpu, meta = _load_model(args)
    from .study_settings import resolve_heldout, study_settings

    heldout = resolve_heldout(args.heldout, [args.workloads])
    workloads = _read_workloads(args, [args.workloads], heldout)
    print(f"model {model_path} ({gpu.name}); targets {', '.join(args.targets)}; {args.jobs} processes")
    settings = study_settings(str(model_path), workloads, args.every)
    results = _portfolios(
        args, out, model, meta, workloads, trials=args.trials, timeout=args.timeout, settings=settings
    )
    export = _portfolio_export(results, gpu, meta, model_path)
    _write_export(args, str(out / "export.json"), export, overwrite=True)
    elapsed = round(time.perf_counter() - t0, 1)
    table = portfolio_table(results)
    summary = {
        "date": utc_now()[:19],
        "gpu": gpu.name,
        "model": str(model_path),
        "model_sha256": export.provenance["model_hash"],
        "elapsed_s": elapsed,
        "jobs": [
            {"target": r.target, "bucket": r.bucket.label, "study": r.tune.to_dict(), "candidates": r.n_candidates,
             "rules": dataclasses.asdict(r.portfolio.rules), "train": r.portfolio.train, "valid": r.portfolio.valid,
             "evidence": r.portfolio.evidence, "designs": r.portfolio.tried, "elapsed_s": r.elapsed_s}
            for r in results
        ],
    }  # fmt: skip
    write_atomic(out / "report.json", json.dumps(summary, indent=1, default=float) + "\n")
    report = out / "report.md"
    write_atomic(report, run_report(results, summary, table))
    print("\n".join(_exported(results, heldout)))
    print(table)
    print(f"export: {out / 'export.json'}; report: {report}; {elapsed:.0f} s")
    return 0


def _nothing_to_validate(export: Any, gpu_name: str) -> str | None:
    """Why validating ``export`` on GPU ``gpu_name`` would only time the defaults against themselves
    (no entry for this GPU, or every entry for it tuned for other kernels or defaults, so served as
    the defaults), or None when some entry would be served."""
    mine = [e for e in export.entries if e.gpu == gpu_name]
    if not mine:
        have = ", ".join(sorted({repr(e.gpu) for e in export.entries})) or "no entries"
        return (
            f"no entry for this GPU ({gpu_name!r}; the export has {have}): every tree would get the defaults, "
            "so there is nothing to validate here; validate on the GPU it was tuned for, or tune for this one "
            "('fasttree-tune profile', 'fit', 'run --model': docs/walkthrough.md)"
        )
    stale = [e.guard.mismatch() for e in mine if e.guard is not None]
    if len(stale) == len(mine) and all(r is not None for r in stale):
        return (
            f"none of its {len(mine)} entries for {gpu_name!r} can be served by the installed package ({stale[0]}): "
            "every tree would get the defaults; re-tune ('fasttree-tune run')"
        )
    return None


def _cmd_validate(args: argparse.Namespace) -> int:
    import torch

    from fasttree.export import read_export
    from fasttree.fileio import write_atomic
    from fasttree.toolkit.validate import earlier_measurements, summarise, validate_portfolios, workload_steps
    from fasttree.traces import TraceError, TraceWriter, read_traces

    if not torch.cuda.is_available():
        args.subparser.error("validate measures on a CUDA GPU and none is visible")
    try:
        export = read_export(args.config)
        records = read_traces(args.workloads, kind="workload").records
        if args.split == "heldout":
            from fasttree.toolkit.workload_split import split_heldout

            records = split_heldout(records)[1]
        if records and args.steps is not None:
            records = [r for rs in workload_steps(records, args.steps).values() for r in rs]
        export_sha256 = _sha256_file(Path(args.config))
    except (TraceError, ValueError, OSError) as exc:
        args.subparser.error(str(exc))
    if not records:
        args.subparser.error(f"no workload lines in {' '.join(args.workloads)}")
    gpu_name = torch.cuda.get_device_name()
    reason = _nothing_to_validate(export, gpu_name)
    if reason is not None:
        args.subparser.error(f"--config {args.config}: {reason}")
    try:
        writer = TraceWriter(args.traces_out)
    except (ValueError, OSError) as exc:
        args.subparser.error(f"--traces-out: {exc}")
    try:
        earlier = {} if args.remeasure else earlier_measurements(args.traces_out, gpu_name)
    except (TraceError, ValueError, OSError) as exc:
        args.subparser.error(f"--traces-out: {exc}")
    with writer:
        results = validate_portfolios(
            export, records, gpu_name=gpu_name, targets=args.targets, writer=writer, earlier=earlier
        )
    summary = summarise(results)
    text = _validation_report(results, summary, gpu_name)
    print(text)
    if args.out:
        doc = {"gpu": gpu_name, "export": str(args.config), "export_sha256": export_sha256, **summary,
               "cases": [dict(vars(v), speedup=v.speedup) for v in results]}  # fmt: skip
        write_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        write_atomic(args.markdown, text + "\n")
    return 0


def _validation_report(results, summary: dict[str, Any], gpu_name: str) -> str:
    """The measured speedups of an export's picks over the defaults: per target, per family, every case."""
    lines = [f"Measured on {gpu_name} (CUDA-graph replay medians): the defaults' time over the picked member's.", ""]
    lines += [
        "| target | cases | geomean | worst | cases below 0.97x | worst family regret | always-defaults regret |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for target, s in summary["targets"].items():
        lines.append(f"| {target} | {s['cases']} | {s['geomean']:.3f}x | {s['worst']:.3f}x | {s['below_0.97']} | "
                     f"{s['worst_family_regret']:.3f} | {s['worst_family_default_regret']:.3f} |")  # fmt: skip
    lines += ["", "| target | bucket | family | cases | switched | geomean | worst | regret | always-defaults regret |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in summary["families"]:
        lines.append(f"| {r['target']} | {r['bucket']} | {r['family']} | {r['cases']} | {r['switched']} | "
                     f"{r['geomean']:.3f}x | {r['worst']:.3f}x | {r['regret']:.3f} | "
                     f"{r['default_regret']:.3f} |")  # fmt: skip
    lines += ["", "| target | case | member picked | members (us) | speedup |", "|---|---|---:|---|---:|"]
    for v in results:
        times = ", ".join(f"{t:.1f}" for t in v.member_us)
        lines.append(f"| {v.target} | {v.case} | {v.picked} | {times} | {v.speedup:.3f}x |")
    return "\n".join(lines)


#: Largest ``validate --json`` file ``confirm`` reads (a full validation of every bucket is ~1 MB).
MAX_MEASURED_BYTES = 64 * 2**20


def _read_measured(path: str, export_sha256: str):
    """The GPU and cases of a ``validate --json`` file of the export whose SHA-256 is ``export_sha256``;
    ValueError otherwise."""
    from fasttree.toolkit.validate import CaseValidation

    p = Path(path)
    if p.stat().st_size > MAX_MEASURED_BYTES:
        raise ValueError(f"--measured {path}: larger than {MAX_MEASURED_BYTES} bytes; not a validate --json file")
    try:
        doc = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"--measured {path}: not a JSON file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list) or not isinstance(doc.get("gpu"), str):
        raise ValueError(f"--measured {path}: not a 'fasttree-tune validate --json' file")
    if "export_sha256" not in doc:
        raise ValueError(f"--measured {path}: no export_sha256 (written by an older validate: measure again)")
    if doc["export_sha256"] != export_sha256:
        raise ValueError(f"--measured {path} measured another export than --config (export_sha256)")
    cases = []
    for i, c in enumerate(doc["cases"]):
        try:
            us = [check_number("member_us", t, above=0) for t in c["member_us"]]
            features = c.get("features")  # None: an older validate (confirm finds the tree by its name)
            if features is not None:
                features = [check_number("features", v) for v in features]
            heads = None if c.get("heads") is None else [int(h) for h in c["heads"]]
            cases.append(CaseValidation(str(c["family"]), str(c["case"]), str(c["bucket"]), str(c["target"]),
                                        int(c["picked"]), us, leaf=int(c["leaf"]), features=features,
                                        heads=heads))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"--measured {path}: case {i} is malformed ({exc!r})") from None
    return doc["gpu"], cases


def _frozen_test_cases(cases) -> list[str]:
    """The cases of ``cases`` (:class:`~fasttree.toolkit.validate.CaseValidation`) that are trees of the frozen
    test split (the shipped test workloads), by the case name ``validate`` records."""
    from fasttree.toolkit.workload_split import case_name
    from fasttree.traces import read_traces

    test = {case_name(r) for r in read_traces(RUN_TEST, kind="workload").records}
    return [c.case for c in cases if c.case in test]


def _cmd_confirm(args: argparse.Namespace) -> int:
    from fasttree.export import read_export
    from fasttree.fileio import write_atomic
    from fasttree.toolkit.confirm import case_trees, confirm_export

    cases = []
    try:
        export = read_export(args.config)
        export_sha256 = _sha256_file(Path(args.config))
        gpus = set()
        for path in args.measured:
            gpu, more = _read_measured(path, export_sha256)
            gpus.add(gpu)
            cases += more
    except (ValueError, OSError) as exc:
        args.subparser.error(str(exc))
    if len(gpus) > 1:
        args.subparser.error(
            f"--measured files come from several GPUs ({', '.join(sorted(gpus))}); confirm one at a time"
        )
    frozen = _frozen_test_cases(cases)
    if frozen:
        args.subparser.error(
            f"--measured holds {len(frozen)} measurements of trees of the frozen test split ({RUN_TEST}; e.g. "
            f"{frozen[0]}): confirm chooses from measurements of the validation split only, and the test stays "
            "unseen; measure held-out workloads ('fasttree-tune validate --config EXPORT --out FILE' measures the "
            "shipped held-out workloads, 'validate --split heldout WORKLOADS' yours)"
        )
    found = case_trees(cases, [RUN_HELDOUT])  # measurements of an older validate: their trees by name
    if found:
        logger.info("%d measured cases record no tree features: took their trees from %s", found, RUN_HELDOUT)
    source = ", ".join(Path(p).name for p in args.measured)
    try:
        confirmed, decisions = confirm_export(export, cases, gpu=gpu, source=source, export_sha256=export_sha256)
    except ValueError as exc:
        args.subparser.error(str(exc))
    lines = [
        f"Selector leaves of {args.config}, confirmed on {len(cases)} measured cases ({gpu}). Ratio: a member's "
        "summed time over the defaults'; worst: its slowest tree's speed relative to the defaults.",
        "",
        "| target | bucket | leaf | trees | model's pick | confirmed | ratio per member | worst per member |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for d in decisions:
        ratios = ", ".join(f"{r:.3f}" for r in d.ratios)
        worst = ", ".join(f"{w:.3f}" for w in d.worst)
        lines.append(f"| {d.target} | {d.bucket} | {d.leaf} | {d.trees} | {d.predicted} | {d.confirmed} | "
                     f"{ratios} | {worst} |")  # fmt: skip
    text = "\n".join(lines)
    _write_export(args, args.out, confirmed, overwrite=args.overwrite)
    if args.markdown:
        write_atomic(args.markdown, text + "\n")
    print(text)
    print(f"export: {args.out}")
    return 0


def _cmd_refine(args: argparse.Namespace) -> int:
    import os

    import torch

    from fasttree.config import FastTreeConfig
    from fasttree.export import ConfigExport, ExportEntry, ExportGuard, bucket_label, read_export, write_export
    from fasttree.portfolio import LeafRegion, Portfolio, Selector, head_layout, tree_features
    from fasttree.toolkit import refine
    from fasttree.toolkit.refine import RuntimeBench, coordinate_search, parse_fields, search_provenance
    from fasttree.toolkit.validate import workload_steps
    from fasttree.traces import TraceError, decode_tree, read_traces
    from fasttree.tuner.objective import runtime_member

    if args.device.split(":")[0] not in ("cuda", "cpu"):
        args.subparser.error(f"--device must be cuda or cpu, got {args.device!r}")
    device = torch.device(args.device)
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
    if not torch.cuda.is_available() and (device.type == "cuda" or getattr(refine.graph_timer, "needs_cuda", False)):
        # the timer replays CUDA graphs whatever --device says (cpu only serves tests with a stand-in timer)
        args.subparser.error(
            "refine times the runtime by CUDA-graph replay and no CUDA GPU is visible "
            "(torch.cuda.is_available() is False): run it on a GPU machine"
        )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    buckets: dict[tuple, dict[str, list]] = {}
    for name, rs in steps.items():
        r = rs[0]
        key = (int(r["num_q_heads"]), int(r["num_kv_heads"]), int(r["head_dim"]), str(r["dtype"]))
        buckets.setdefault(key, {})[name] = [decode_tree(x["workload"]["tree"]) for x in rs]
    entries = {(e.gpu, *e.bucket, e.target): e for e in export.entries if e.write_problem() is None}
    for e in export.entries:
        if e.write_problem() is not None:
            logger.warning("not copied: the entry for %r bucket %s %s: %s", e.gpu, e.bucket, e.target,
                           e.write_problem())  # fmt: skip
    lines = ["| bucket | workload | start (us) | refined (us) | ratio |", "|---|---|---:|---:|---:|"]
    for (hq, hkv, d, dtype), trees in buckets.items():
        portfolio, entry = export.lookup(
            gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, target="runtime"
        )
        start = portfolio.members[-1]  # the runtime entry's last member (the defaults when it has one)
        label = bucket_label(hq // hkv, d, dtype)
        logger.info("bucket %s (%d/%d heads): %d workloads, start from %s", label, hq, hkv, len(trees),
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
        refined = runtime_member(found.config)  # a runtime member keeps the defaults' launch shapes
        if refined != found.config:
            provenance["launch_fields_not_kept"] = found.config.to_dict()
        members = (FastTreeConfig(),) if refined == FastTreeConfig() else (FastTreeConfig(), refined)
        selector = Selector(member=(len(members) - 1,))  # measured on these workloads: every tree like them
        searched = [t for ts in trees.values() for t in ts]
        region = LeafRegion.of_trees(
            [tree_features(t) for t in searched], [head_layout(hq, hkv)] * len(searched), "measured"
        )
        new = ExportEntry(
            gpu, hq // hkv, d, dtype, Portfolio(members, selector, runtime=True, regions=(region,)), provenance,
            target="runtime", guard=ExportGuard.current(),
        )  # fmt: skip
        entries[(gpu, *new.bucket, "runtime")] = new
        for w in sorted(trees):
            a, b = found.start_us[w], found.best_us[w]
            lines.append(f"| {label} | {w} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
        lines.append(f"| {label} | geomean ({found.evaluations} configs, {seconds:.0f} s) | | | "
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
