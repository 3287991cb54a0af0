"""``fasttree-tune fit`` and ``fasttree-tune evaluate``: the latency model's subcommands.

scikit-learn is imported only when one of them runs (``pip install -e '.[costmodel]'``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

from .args import int_at_least

__all__ = ["add_costmodel_commands", "fit_and_save"]

logger = logging.getLogger("fasttree.cli")

_KEYS = ("n", "mape", "p90_ape", "mean_kendall_tau", "top1_score", "top5_score", "a_peak@1", "n_trees")


def _trace_inputs() -> argparse.ArgumentParser:
    """Options shared by the subcommands that read measurement traces."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("traces")
    g.add_argument("paths", nargs="+", metavar="TRACES", help="measurement trace files or folders")
    g.add_argument("--skip-invalid", action="store_true", help="skip bad lines (logged) instead of stopping")
    g.add_argument(
        "--workers",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="processes that re-plan the traces (default: cpus, <= 8)",
    )
    return p


def _model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model")
    g.add_argument("--kind", choices=("gbrt", "forest", "residual"), default="gbrt", help="regressor (default gbrt)")
    g.add_argument("--n-estimators", type=int_at_least(1), default=400, metavar="N", help="trees (default 400)")
    g.add_argument("--max-depth", type=int_at_least(1), default=7, metavar="D", help="tree depth (default 7)")
    g.add_argument(
        "--n-seeds",
        type=int_at_least(1),
        default=3,
        metavar="N",
        help="regressors fitted with seeds SEED, SEED+1, ...; predictions are their geometric mean (default 3)",
    )
    g.add_argument("--seed", type=int_at_least(0), default=0, help="random seed of the first regressor (default 0)")
    g.add_argument(
        "--jobs",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="processes fitting the regressors side by side (default: every core)",
    )
    return p


def add_costmodel_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``fit`` and ``evaluate`` to the ``fasttree-tune`` subparsers ``sub``."""
    f = sub.add_parser(
        "fit",
        help="fit the learned latency model on measurement traces",
        description="Re-plan every ok measurement of TRACES (one GPU), compute its plan features and the "
        "simulator's estimate, fit the latency model on log time, and save it with its metadata (GPU, "
        "feature schema, trace-set hash, library versions) as a skops archive (no pickle).",
        parents=[*common, _trace_inputs(), _model_options()],
    )
    f.add_argument("-o", "--out", required=True, metavar="FILE", help="model FILE to write (a skops archive, *.skops)")
    f.add_argument("--overwrite", action="store_true", help="replace --out if it exists (else: refuse)")
    f.set_defaults(func=_cmd_fit, subparser=f, output_files=("out",))

    e = sub.add_parser(
        "evaluate",
        help="held-out metrics of the latency model, the simulator and the published cost",
        description="With --model: predict TRACES (a held-out set) with a saved model and compare it with the "
        "simulator (calibrated on the model's training traces) and the published planner's cost (ranks "
        "only). Without --model: group k-fold by tree family on TRACES, fitting a model per fold. Prints "
        "MAPE, p90 error, mean per-tree Kendall tau and top-k scores.",
        parents=[*common, _trace_inputs(), _model_options()],
    )
    e.add_argument("--model", metavar="MODEL", help="a model written by 'fasttree-tune fit'")
    e.add_argument("--folds", type=int_at_least(2), default=5, metavar="K", help="folds without --model (default 5)")
    e.add_argument("--force", action="store_true", help="use a model fitted for another GPU or feature schema")
    e.add_argument("-o", "--out", metavar="FILE", help="also write the metrics as a JSON FILE")
    e.add_argument("--json", dest="out", help=argparse.SUPPRESS)  # the old name of --out
    e.add_argument("--overwrite", action="store_true", help="replace --out if it exists (else: refuse)")
    e.set_defaults(func=_cmd_evaluate, subparser=e, output_files=("out",))


def _load(args: argparse.Namespace):
    from fasttree.costmodel.dataset import load_dataset
    from fasttree.traces import TraceError

    t0 = time.perf_counter()
    try:
        data = load_dataset(args.paths, skip_invalid=args.skip_invalid, workers=args.workers)
    except (TraceError, ValueError, OSError) as exc:
        args.subparser.error(str(exc))
    logger.info("%d measurements of %s re-planned in %.1f s", len(data), data.gpu.name, time.perf_counter() - t0)
    return data


def _make_model(args: argparse.Namespace):
    from fasttree.costmodel.model import LatencyModel

    return LatencyModel(
        kind=args.kind,
        n_estimators=args.n_estimators,
        max_depth=args.max_depth,
        n_seeds=args.n_seeds,
        random_state=args.seed,
        n_jobs=-1 if args.jobs is None else args.jobs,
    )


def fit_and_save(model, data, path, *, trace_paths: list[str], overwrite: bool) -> tuple[float, dict[str, float]]:
    """Fit ``model`` on ``data``, calibrate the simulator baseline, save both to ``path``.

    Returns
    -------
    fit_s : float
        Seconds the fit took.
    train : dict
        The fitted model's metrics on its own training rows (not a held-out score); the rank
        metrics only when some tree was measured under several configs.
    """
    from fasttree.costmodel.evaluate import SimulatorBaseline, prediction_metrics
    from fasttree.costmodel.metrics import regression_metrics
    from fasttree.costmodel.persist import save_model

    t0 = time.perf_counter()
    model.fit(data.X, data.y_us)
    fit_s = time.perf_counter() - t0
    sim = SimulatorBaseline().fit(data.X, data.y_us)
    pred = model.predict(data.X)
    ranked = len(set(data.tree.tolist())) < len(data)
    train = prediction_metrics(pred, data) if ranked else dict(regression_metrics(pred, data.y_us))
    extra = {
        "fit_seconds": round(fit_s, 2),
        "training_metrics": {k: train[k] for k in _KEYS if k in train},
        "simulator_baseline": {"coef": [float(c) for c in sim.coef_]},
        "training_domain": data.domain(),
    }
    save_model(
        path,
        model,
        gpu=data.gpu,
        trace_hash=data.trace_hash,
        trace_rows=len(data),
        trace_paths=trace_paths,
        extra=extra,
        overwrite=overwrite,
    )
    return fit_s, train


def _cmd_fit(args: argparse.Namespace) -> int:
    data = _load(args)
    fit_s, train = fit_and_save(
        _make_model(args), data, args.out, trace_paths=[str(p) for p in args.paths], overwrite=args.overwrite
    )
    print(f"{args.out}: {args.kind} model of {len(data)} measurements ({data.gpu.name}), fitted in {fit_s:.1f} s")
    tau = f", tau {train['mean_kendall_tau']:.3f}" if "mean_kendall_tau" in train else ""
    print(f"training fit (not a held-out score): MAPE {train['mape']:.3f}{tau}")
    return 0


def _ranked(data) -> bool:
    """Whether some tree of ``data`` was measured two or more times (the rank metrics need one); a WARNING
    when none was."""
    if len(set(data.tree.tolist())) < len(data):
        return True
    logger.warning(
        "no tree of TRACES was measured under two or more configs: the rank metrics (Kendall tau, top-k) and "
        "the published cost's row are skipped"
    )
    return False


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from fasttree.costmodel.evaluate import (
        SimulatorBaseline,
        cross_validated_predictions,
        prediction_metrics,
        rank_only_metrics,
    )
    from fasttree.costmodel.metrics import evaluation_table, regression_metrics
    from fasttree.costmodel.persist import ModelFileError, load_model
    from fasttree.fileio import write_atomic

    rows: list[tuple[str, dict[str, float]]] = []
    if args.model:
        try:
            model, meta = load_model(args.model, force=args.force)
        except FileNotFoundError:
            args.subparser.error(f"--model {args.model} does not exist (fit one with 'fasttree-tune fit')")
        except OSError as exc:
            args.subparser.error(f"--model {args.model}: {exc.strerror or exc}")
        except ModelFileError as exc:
            args.subparser.error(str(exc))
        data = _load(args)
        if data.gpu.name != meta["gpu"]["name"] and not args.force:
            args.subparser.error(f"the model is for {meta['gpu']['name']!r}, the traces are {data.gpu.name!r}")
        if meta.get("trace_set", {}).get("sha256") == data.trace_hash:
            logger.warning("these are the model's own training traces: the numbers are not held-out scores")
        try:
            sim = SimulatorBaseline.from_coef(meta["extra"]["simulator_baseline"]["coef"])
        except (KeyError, TypeError, ValueError) as exc:
            args.subparser.error(f"{args.model}: no usable simulator calibration ({exc})")
        ranked = _ranked(data)
        metrics = prediction_metrics if ranked else (lambda pred, d: dict(regression_metrics(pred, d.y_us)))
        rows.append(("simulator", metrics(sim.predict(data.X), data)))
        rows.append((f"learned ({meta['model_params']['kind']})", metrics(model.predict(data.X), data)))
    else:
        data = _load(args)
        ranked = _ranked(data)  # before the folds: they take minutes
        metrics = prediction_metrics if ranked else (lambda pred, d: dict(regression_metrics(pred, d.y_us)))
        done = []

        def progress(i: int) -> None:
            done.append(i)
            logger.info("fold %d/%d done", len(done), args.folds)

        try:
            sim_pred = cross_validated_predictions(SimulatorBaseline, data, n_splits=args.folds)
            pred = cross_validated_predictions(lambda: _make_model(args), data, n_splits=args.folds, on_fold=progress)
        except ValueError as exc:
            args.subparser.error(str(exc))
        rows.append(("simulator", metrics(sim_pred, data)))
        rows.append((f"learned ({args.kind})", metrics(pred, data)))
    if ranked:
        rows.append(("published cost (ranks)", rank_only_metrics(data.published_cost, data)))
    keys = list(_KEYS) if ranked else [k for k in _KEYS if k in rows[0][1]]
    print(evaluation_table(rows, keys))
    if args.out:
        write_atomic(args.out, json.dumps({name: m for name, m in rows}, indent=1, default=float) + "\n")
    return 0
