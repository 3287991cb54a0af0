"""``fasttree-tune``: the command line of the profiler (and, later, of the cost model and tuner).

Subcommands (``fasttree-tune SUBCOMMAND --help`` explains each):

* ``profile`` -- measure a sampled design of (tree, heads, dtype, config) points on the
  visible GPUs and append them to a ``.jsonl`` trace file (:func:`fasttree.toolkit.profiler.profile`).
* ``traces`` -- validate trace files and summarise them: lines per split, family and
  status, profiling rate, spread of repeat measurements (:mod:`fasttree.toolkit.trace_stats`).
* ``headroom`` -- the oracle headroom per bucket and tree family of the lines ``profile --design
  headroom`` wrote: best measured config over the defaults (:mod:`fasttree.toolkit.headroom_stats`).
* ``fit`` -- fit the learned latency model on measurement traces and save it as a skops
  archive (:mod:`fasttree.costmodel`; needs scikit-learn).
* ``evaluate`` -- held-out metrics of a saved model on other traces, or group k-fold by
  tree family on one set, side by side with the simulator and the published cost.
* ``tune`` -- one Optuna study per (GQA ratio, head dim, dtype) bucket of workload traces,
  minimising the latency model's prediction (:mod:`fasttree.tuner`; needs Optuna).
* ``export`` -- the studies' best configs as a JSON export (:mod:`fasttree.export`).
* ``run`` -- the main job: shipped model and workloads in, tuned export and report out.
* ``validate`` -- on a GPU: measured speedup of an export over the defaults on workloads.
* ``confirm`` -- an export whose selectors keep only the choices ``validate``'s measurements on
  the validation split support (:mod:`fasttree.toolkit.confirm`).
* ``refine`` -- on a GPU: a coordinate search from an export's configs, timed on workloads.
* ``bench`` -- on a GPU: the kernel benchmark on the paper suite (:mod:`fasttree.toolkit.kernel_bench`).

Options shared by every subcommand (``-v/--verbose``, ``--log-level``) go before or after
the subcommand. Outputs follow one convention (:data:`_DESCRIPTION`,
:func:`~fasttree.cli.args.refuse_existing_outputs`): ``--out`` is a FILE for the subcommands
that write one file and a FOLDER for those that write several; an existing output is replaced
only with ``--overwrite``; a failed run leaves no empty ``--out`` folder behind. Bad arguments
and a missing GPU exit with status 2 and a message naming the problem; a run stopped by a
lost GPU exits with 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from ..toolkit.headroom import DEFAULT_BUCKETS, DESIGNS, HEADROOM_BUCKETS, HEADROOM_CONFIGS, HEADROOM_TREES
from ..toolkit.headroom_stats import LARGE_HEADROOM
from .args import (
    buckets_arg,
    duration_arg,
    families_arg,
    int_at_least,
    non_negative_int,
    parse_duration,
    positive_int,
    progress_bar_wanted,
    refuse_existing_outputs,
    refuse_unwritable_outputs,
)

__all__ = ["build_parser", "main", "parse_duration"]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: The sampled design's default size (``profile -n``).
DEFAULT_POINTS = 4096


def _common_options(*, suppress: bool) -> argparse.ArgumentParser:
    """``-v/--verbose`` and ``--log-level``; with ``suppress`` they set nothing unless given (subcommand copy)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("logging")
    g.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS if suppress else 0,
        help="more log output: per-point details (DEBUG); the default level is INFO",
    )
    g.add_argument(
        "--log-level",
        type=str.upper,
        choices=_LOG_LEVELS,
        default=argparse.SUPPRESS if suppress else None,
        help="log level of fasttree's messages (overrides -v; default INFO)",
    )
    return p


_DESCRIPTION = """\
FastTree's offline toolkit: measure the kernels, fit a latency model on the measurements,
tune configs against it, and check the tuned configs on the GPU.

  measure     profile (GPU) writes versioned trace files; traces validates and summarises them;
              headroom summarises a headroom sweep (profile --design headroom): per bucket and
              family, the best measured config of each tree over the defaults
  model       fit trains the learned latency model on measurement traces; evaluate scores it
  tune        tune runs one Optuna study per bucket of workload traces; export writes the
              studies' best configs; run is the main job (shipped model and workloads in,
              tuned export and report out)
  check (GPU) validate measures an export against the defaults; refine searches from an
              export's configs by timing them; bench runs the kernel benchmark; confirm (CPU)
              keeps the selector choices validate's measurements support

Outputs: --out (-o) is a FILE for the subcommands that write one file (fit, export, confirm, refine,
evaluate, validate and headroom: their JSON; profile appends to its trace file, so a rerun resumes) and a
FOLDER for those that write several (tune: its study storage; run: studies, export and report;
bench: its reports). An output that exists (--out, --json, --markdown; a finished run in run's
--out; bench's reports) is replaced only with --overwrite, else the subcommand refuses before
doing any work; so does an output that cannot be written (a folder given for a FILE, a read-only
place). Ctrl-C ends a subcommand with one line saying what was kept (exit status 130).
"""

_PROFILE_HELP = "measure sampled (tree, heads, dtype, config) points on the GPU into a trace file"
_PROFILE_DESCRIPTION = """\
Measure a sampled design over the tuner's search space on the GPU and append one trace
record per point to OUT (a .jsonl file; format: traces/README.md).

The design crosses trees with configs: trees from a scrambled Sobol' sequence (seeded by
--seed) over tree family and seed, heads (GQA 1/4/16; 8 only in the held-out split), head
dim (64/128; 256 held out) and dtype (fp16/bf16), each measured under 8 configs: the
published defaults, then 7 sampled over every FastTreeConfig knob (kernel tiles, warps
and stages from a per-GQA pool of 32 settings, so a run compiles a bounded set of
kernels). Each point is planned, timed by CUDA-graph replay and eagerly, and every
--check-every-th point is checked against the float64 reference. A failing point (plan
error, compile error, out of memory, wrong result) is written as a failed record and the
run goes on.

--design headroom measures instead, for each bucket (head layout, head dim, dtype) of
--buckets, the same --trees trees (default 20, the tree families in turn, seeds no workload
trace uses) each under the same --configs configs (default 50: the defaults and 49 sampled
as above, from the bucket's own sequence): 6,000 points for the 6 default buckets. Its lines
carry meta.design 'headroom' and meta.bucket; 'fasttree-tune headroom' summarises them.

Resumable: points whose key OUT already holds are skipped, so rerunning the same command
continues a killed or budget-limited run, and a larger -n adds only new points. Kernels a
batch needs are compiled ahead in min(16, cpu count) worker processes while the batch
before it is measured. With several visible GPUs, one worker process per GPU measures
every k-th tree (choose GPUs with CUDA_VISIBLE_DEVICES).
"""
_PROFILE_EPILOG = """\
examples:
  fasttree-tune profile --out traces/h200/run1.jsonl --budget 1h
  fasttree-tune profile --out /tmp/t.jsonl --budget 60s -n 200 --families beam_search,speculative
  fasttree-tune profile --design headroom --out traces/h200_headroom/headroom.jsonl --budget 9m
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``fasttree-tune`` argument parser (one subparser per subcommand)."""
    parser = argparse.ArgumentParser(
        prog="fasttree-tune",
        description=_DESCRIPTION,
        parents=[_common_options(suppress=False)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'fasttree-tune SUBCOMMAND --help' for what a subcommand does and its options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # Each subcommand adds a parser here and sets ``func``; new ones (fit, evaluate, tune, ...) go alongside.
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", title="subcommands")
    sub.required = True
    _add_profile_command(sub)
    _add_traces_command(sub)
    _add_headroom_command(sub)

    from .costmodel import add_costmodel_commands

    add_costmodel_commands(sub, [_common_options(suppress=True)])

    from .tune import add_tune_commands

    add_tune_commands(sub, [_common_options(suppress=True)])
    return parser


def _add_profile_command(sub: Any) -> None:
    """``profile``: measure a design of points on the GPU into a trace file."""
    p = sub.add_parser(
        "profile",
        help=_PROFILE_HELP,
        description=_PROFILE_DESCRIPTION,
        epilog=_PROFILE_EPILOG,
        parents=[_common_options(suppress=True)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="FILE",
        help="trace FILE to append to (.jsonl; created if missing; never replaced: a rerun resumes it)",
    )
    p.add_argument(
        "--budget",
        type=duration_arg,
        default=None,
        metavar="DURATION",
        help="stop starting new points after this wall time: seconds ('90', '60s'), minutes ('10m') "
        "or hours ('1h'); default: no limit",
    )
    _add_design_options(p)
    _add_measurement_options(p)
    p.set_defaults(func=_cmd_profile, subparser=p, append_files=("out",))


def _add_design_options(p: argparse.ArgumentParser) -> None:
    """``profile``'s design: points, seed, tree families and split."""
    p.add_argument(
        "--design",
        choices=DESIGNS,
        default="sampled",
        help="which design (default sampled): 'sampled' draws -n points for the latency model; 'headroom' "
        "measures --trees trees under --configs configs in each of --buckets",
    )
    p.add_argument(
        "-n",
        "--points",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"sampled design: points (default {DEFAULT_POINTS}); the design is a prefix of one sequence, so a "
        "larger N extends a run",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="design seed (default 0)")
    p.add_argument(
        "--families",
        type=families_arg,
        default=None,
        metavar="LIST",
        help="comma-separated tree families to sample (default: all of paper_random, random_recursive, "
        "few_shot, beam_search, speculative, multi_document, no_sharing)",
    )
    p.add_argument(
        "--split",
        choices=("train", "heldout"),
        default="train",
        help="design split (default train): 'heldout' samples only what training never does -- GQA 8, "
        "head dim 256, or trees deeper than the training ranges -- for the cost model's held-out "
        "evaluation; lines carry meta.split; write them to their own folder (traces/h200_heldout/)",
    )
    p.add_argument(
        "--buckets",
        type=buckets_arg,
        default=None,
        metavar="LIST",
        help=f"headroom design: comma-separated buckets (default {','.join(DEFAULT_BUCKETS)}; also "
        f"{','.join(b for b in HEADROOM_BUCKETS if b not in DEFAULT_BUCKETS)})",
    )
    p.add_argument(
        "--trees",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"headroom design: trees per bucket, the same in every bucket (default {HEADROOM_TREES})",
    )
    p.add_argument(
        "--configs",
        type=int_at_least(2, "an integer >= 2"),
        default=None,
        metavar="N",
        help=f"headroom design: configs per tree, the defaults included (default {HEADROOM_CONFIGS})",
    )


def _add_measurement_options(p: argparse.ArgumentParser) -> None:
    """``profile``'s measurement: checks, repeats, the launches timed, compiling ahead and progress."""
    p.add_argument(
        "--check-every",
        type=non_negative_int,
        default=10,
        metavar="K",
        help="check the output against the float64 reference on every K-th design point and the first "
        "(default 10; 0: never)",
    )
    p.add_argument(
        "--repeat-every",
        type=non_negative_int,
        default=20,
        metavar="K",
        help="after every K-th point, measure an earlier point again as another line of its key, for the "
        "spread of repeat measurements that 'fasttree-tune traces' reports (default 20; 0: never)",
    )
    p.add_argument(
        "--runtime",
        action="store_true",
        help="time the production runtime's launches (TreeAttentionRuntime: its own plans, persistent kernels) "
        "instead of tree_attention's per-plan launches; lines carry 'launch' and other keys",
    )
    p.add_argument(
        "--no-precompile",
        dest="precompile",
        action="store_false",
        help="do not compile kernels ahead in worker processes (the measuring process compiles them)",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar: progress goes to the log once a minute (so it does when stderr is not a terminal)",
    )


def _add_traces_command(sub: Any) -> None:
    """``traces``: validate trace files and summarise them."""
    t = sub.add_parser(
        "traces",
        help="validate trace files and summarise what they hold",
        description="Validate trace files (.jsonl, .jsonl.gz or folders of them) and print, for the "
        "measurement lines, the count per split (meta.split), tree family and status, the GPUs, the "
        "profiling rate (lines per minute of each profiler run) and the spread of repeat measurements "
        "of one key (median relative deviation of the graph-replay median).",
        parents=[_common_options(suppress=True)],
    )
    t.add_argument("paths", nargs="+", metavar="PATH", help="trace files or folders")
    t.add_argument(
        "--skip-invalid", action="store_true", help="skip bad lines (counted and listed) instead of stopping"
    )
    t.set_defaults(func=_cmd_traces, subparser=t)


def _add_headroom_command(sub: Any) -> None:
    """``headroom``: summarise the headroom design's lines."""
    h = sub.add_parser(
        "headroom",
        help="the oracle headroom per bucket and tree family of a headroom sweep (profile --design headroom)",
        description="Read the lines of the headroom design (meta.design 'headroom') from trace files or "
        "folders and report, per target, bucket and tree family and over all: the trees, the per-tree "
        "oracle (the defaults' graph-replay median over the fastest measured config's: geomean, median, "
        f"max, share of trees >= {LARGE_HEADROOM:.2f}x), beside the always-defaults baseline (1.000x), the "
        "defaults' median rank among each tree's configs, and the best single config of each bucket "
        "chosen and scored on the same trees (in-sample). Failed lines are counted and left out; a tree "
        "without an ok defaults line is listed and left out. Prints the tables; -o writes them as JSON, "
        "--markdown as a Markdown page.",
        parents=[_common_options(suppress=True)],
    )
    h.add_argument("paths", nargs="+", metavar="TRACES", help="trace files or folders")
    h.add_argument("-o", "--out", metavar="FILE", default=None, help="write the summary as JSON to FILE")
    h.add_argument("--markdown", metavar="FILE", default=None, help="write the tables as Markdown to FILE")
    h.add_argument("--overwrite", action="store_true", help="replace --out and --markdown if they exist (else: refuse)")
    h.add_argument(
        "--skip-invalid", action="store_true", help="skip bad lines (counted and listed) instead of stopping"
    )
    h.set_defaults(func=_cmd_headroom, subparser=h, output_files=("out", "markdown"))


def _cmd_headroom(args: argparse.Namespace) -> int:
    import json

    from ..fileio import write_atomic
    from ..toolkit.headroom_stats import headroom_summary
    from ..traces import TraceError, read_traces

    try:
        ts = read_traces(args.paths, skip_invalid=args.skip_invalid)
    except TraceError as exc:
        args.subparser.error(str(exc))
    paths = " ".join(args.paths)
    if not ts.files:
        args.subparser.error(f"{paths}: no trace files (*.jsonl, *.jsonl.gz)")
    for name, line, reason in ts.invalid[:20]:
        print(f"skipped {name}:{line}: {reason}")
    try:
        summary = headroom_summary(ts.records)
    except ValueError as exc:
        args.subparser.error(f"{paths}: {exc}")
    text = summary.markdown()
    print(text, end="")
    if args.out:
        write_atomic(args.out, json.dumps(summary.to_json(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    if args.markdown:
        write_atomic(args.markdown, text)
        print(f"wrote {args.markdown}")
    return 0


def _setup_logging(args: argparse.Namespace) -> None:
    """fasttree's loggers at the chosen level; other libraries' at WARNING."""
    level = args.log_level or ("DEBUG" if args.verbose >= 1 else "INFO")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("fasttree").setLevel(getattr(logging, level))


def _cmd_traces(args: argparse.Namespace) -> int:
    import time

    from ..toolkit.trace_stats import trace_stats
    from ..traces import TraceError, read_traces

    log = logging.getLogger("fasttree.cli")
    t0 = time.perf_counter()

    def progress(index: int, n: int, name: str, lines: int) -> None:
        log.info("read %d/%d %s: %d lines (%.0f s)", index, n, name, lines, time.perf_counter() - t0)

    try:
        ts = read_traces(args.paths, skip_invalid=args.skip_invalid, on_file=progress)
    except TraceError as exc:
        args.subparser.error(str(exc))
    paths = " ".join(args.paths)
    if not ts.files:
        args.subparser.error(f"{paths}: no trace files (*.jsonl, *.jsonl.gz)")
    n_measured = len(ts.of_kind("measurement"))
    if not n_measured:
        workload = len(ts.of_kind("workload"))
        what = (
            f"{workload} workload lines and no measurement lines: 'traces' summarises measurements; workload "
            "traces are read by 'tune', 'export', 'run' and 'validate'"
            if workload
            else "no valid measurement lines"
        )
        args.subparser.error(f"{paths}: {what}")
    print(f"{len(ts.files)} file(s), {len(ts)} valid line(s), {ts.n_invalid} invalid")
    for name, line, reason in ts.invalid[:20]:
        print(f"  {name}:{line}: {reason}")
    print(trace_stats(ts).table())
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    sub: argparse.ArgumentParser = args.subparser
    if args.out.endswith(".gz"):
        sub.error(f"--out {args.out}: write a .jsonl file (appendable); gzip it once the set is finished")
    if not torch.cuda.is_available():
        sub.error(
            "no CUDA GPU found (torch.cuda.is_available() is False"
            + (f", torch {torch.__version__} has no CUDA" if torch.version.cuda is None else "")
            + "): the profiler measures the kernels on a GPU; run it on a GPU machine"
        )
    from ..toolkit.profiler import profile

    if args.design == "headroom":
        design = dict(design_name="headroom", buckets=args.buckets, trees=args.trees, configs=args.configs)
        if args.points is not None:
            sub.error("-n/--points: the headroom design's size is --buckets x --trees x --configs")
        if args.split != "train":
            sub.error(f"--split {args.split}: the headroom design has no splits")
    else:
        headroom_only = [f"--{k}" for k in ("buckets", "trees", "configs") if getattr(args, k) is not None]
        if headroom_only:
            sub.error(f"{', '.join(headroom_only)}: options of --design headroom")
        design = dict(n=DEFAULT_POINTS if args.points is None else args.points, split=args.split)
    try:
        summary = profile(
            args.out,
            seed=args.seed,
            budget_s=args.budget,
            families=args.families,
            precompile=args.precompile,
            progress=progress_bar_wanted(args.progress),
            check_every=args.check_every,
            repeat_every=args.repeat_every,
            runtime=args.runtime,
            **design,
        )
    except KeyboardInterrupt:
        logging.getLogger("fasttree.cli").warning("interrupted; rerun the same command to resume")
        return 130
    except ValueError as exc:
        sub.error(str(exc))
    except OSError as exc:
        logging.getLogger("fasttree.cli").error("profile stopped: %s", exc)
        return 1
    print(f"{args.out}: {summary.line()}")
    return 1 if summary.aborted else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fasttree-tune``; returns the exit status.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success, 1 when a run stopped early on an error, 2 on bad arguments or no
        GPU (``argparse`` exits with it), 130 when interrupted.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage names the subcommand and its options
        args.subparser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args)
    refuse_existing_outputs(args)
    refuse_unwritable_outputs(args)
    created = _missing_output_folders(args)
    status = 1
    try:
        status = args.func(args)
        return status
    except KeyboardInterrupt:
        kept = getattr(args, "on_interrupt", None)
        print(f"fasttree-tune {args.command}: interrupted; {kept(args) if kept else 'nothing was written'}",
              file=sys.stderr)  # fmt: skip
        status = 130
        return status
    finally:
        if status != 0:  # failed (an exception, a usage error or a non-zero status): no empty --out left behind
            for folder in created:
                try:
                    folder.rmdir()  # only while empty
                except OSError:
                    break


def _missing_output_folders(args: argparse.Namespace) -> list[Path]:
    """The folders an ``--out`` FOLDER (of a subcommand that sets ``output_folder``) needs that do not
    exist yet, deepest first: what a failed run removes again while they are empty."""
    if not getattr(args, "output_folder", False):
        return []
    created = []
    path = Path(args.out).absolute()
    while not path.exists() and path.parent != path:
        created.append(path)
        path = path.parent
    return created


if __name__ == "__main__":
    sys.exit(main())
