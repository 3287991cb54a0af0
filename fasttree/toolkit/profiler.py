"""The profiler: GPU measurements of sampled (tree, heads, dtype, config) points as traces.

:func:`profile` is the driver; each of its jobs lives in a module of its own:

* **Design** (:mod:`fasttree.toolkit.design`) -- :func:`design` crosses trees with configs
  drawn from scrambled Sobol' sequences; a design is a prefix of its sequence, so a longer
  run extends a shorter one.
* **Environment** (:mod:`fasttree.toolkit.environment`) -- :func:`collect_env`: the GPU,
  driver, versions and commit of a trace's ``env``.
* **Measurement** (:mod:`fasttree.toolkit.measure`) -- :func:`measure_point` plans one
  point, checks it against the float64 reference, times it by CUDA-graph replay and
  eagerly, and returns its trace record; any failure becomes a ``status: "failed"`` record.
* **Compiling ahead** (:mod:`fasttree.toolkit.precompile`) -- the Triton kernels a batch
  of points needs, compiled in worker processes while the batch before it is measured.
* **The resumable loop** (:mod:`fasttree.toolkit.profile_loop`) -- measure the points on one
  device, skip the keys the trace file already holds, annotate and append each record.

:func:`profile` checks its arguments, draws the design, shows a progress bar, and runs the
loop in this process or in one worker process per visible GPU. The command line is
``fasttree-tune profile`` (:mod:`fasttree.cli`). scipy and tqdm (the ``profile`` extra) are
imported inside the functions that need them, never by ``import fasttree``. The names of
the modules above that callers use are importable from here too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue as queue_module
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..validation import check_choice, check_int, check_number
from .design import (
    ALPHA_RANGE,
    BETA_RANGE,
    CONFIGS_PER_TREE,
    DEEP_TREES,
    DEFAULT_SM_COUNT,
    DTYPE_WEIGHTS,
    FAMILY_WEIGHTS,
    GAMMA_RANGE,
    HEAD_DIM_WEIGHTS,
    HEADS_BY_GQA,
    HELDOUT_AXES,
    HELDOUT_GQA,
    HELDOUT_HEAD_DIM,
    KERNEL_POOL,
    KV_TILES,
    MAX_TILE_ROWS,
    NUM_STAGES,
    NUM_WARPS,
    PACK_TOKENS,
    Q_ROWS_LARGE,
    Q_ROWS_SMALL,
    SEED_SPACE,
    SPLITS,
    SPLITS_LARGE,
    SPLITS_SMALL,
    DesignPoint,
    check_families,
    check_split,
    design,
    point_key,
    point_launch,
    point_tree,
)
from .environment import collect_env, device_sm_count, generic_cuda, git_commit, visible_gpu_ids
from .headroom import DESIGNS, HEADROOM_CONFIGS, HEADROOM_TREES, check_buckets, headroom_design
from .measure import TOLERANCE, DeviceLostError, error_text, failed_record, measure_point
from .precompile import default_compile_workers, kernel_specialisations
from .profile_loop import ProfileSummary, run_points

logger = logging.getLogger(__name__)

__all__ = [
    "ALPHA_RANGE",
    "BETA_RANGE",
    "CONFIGS_PER_TREE",
    "DEEP_TREES",
    "DEFAULT_SM_COUNT",
    "DESIGNS",
    "DTYPE_WEIGHTS",
    "FAMILY_WEIGHTS",
    "GAMMA_RANGE",
    "HEADS_BY_GQA",
    "HEAD_DIM_WEIGHTS",
    "HELDOUT_AXES",
    "HELDOUT_GQA",
    "HELDOUT_HEAD_DIM",
    "KERNEL_POOL",
    "KV_TILES",
    "MAX_TILE_ROWS",
    "NUM_STAGES",
    "NUM_WARPS",
    "PACK_TOKENS",
    "Q_ROWS_LARGE",
    "Q_ROWS_SMALL",
    "SEED_SPACE",
    "SPLITS",
    "SPLITS_LARGE",
    "SPLITS_SMALL",
    "TOLERANCE",
    "DesignPoint",
    "DeviceLostError",
    "ProfileSummary",
    "collect_env",
    "default_compile_workers",
    "design",
    "device_sm_count",
    "failed_record",
    "git_commit",
    "kernel_specialisations",
    "measure_point",
    "point_key",
    "point_launch",
    "point_tree",
    "profile",
]


# ------------------------------------------------------------------ progress
class _Progress:
    """A tqdm bar (when tqdm is installed and ``enabled``), else periodic log lines."""

    def __init__(self, total: int, *, enabled: bool, deadline: float | None, desc: str = "profile") -> None:
        self.total = total
        self.deadline = deadline
        self.done = self.ok = self.failed = 0
        self.t0 = time.monotonic()
        self._last_log = self.t0
        self._log_every = 30.0 if enabled else 60.0
        self.bar = None
        self._redirect = contextlib.nullcontext()
        if enabled:
            try:
                from tqdm import tqdm
                from tqdm.contrib.logging import logging_redirect_tqdm
            except ImportError:
                logger.info("tqdm is not installed: progress goes to the log every %.0f s", self._log_every)
            else:
                self.bar = tqdm(total=total, unit="pt", desc=desc, dynamic_ncols=True, smoothing=0.05)
                self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()

    def update(self, status: str) -> None:
        self.done += 1
        if status == "ok":
            self.ok += 1
        else:
            self.failed += 1
        now = time.monotonic()
        if self.bar is not None:
            postfix = {"ok": self.ok, "failed": self.failed}
            if self.deadline is not None:
                postfix["budget_left"] = f"{max(0.0, self.deadline - now):.0f}s"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif now - self._last_log >= self._log_every or self.done == self.total:
            self._last_log = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else math.inf
            if self.deadline is not None:
                eta = min(eta, max(0.0, self.deadline - now))
            logger.info(
                "%d/%d points (%d failed), %.1f points/min, ETA %s",
                self.done,
                self.total,
                self.failed,
                rate * 60,
                _fmt_seconds(eta),
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._redirect.__exit__(None, None, None)


def _fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "unknown"
    s = round(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


_ProgressFactory = Callable[[int], _Progress]


# ------------------------------------------------------------------ one worker process per GPU
def _shard_main(
    shard: int,
    out: str,
    points: list[DesignPoint],
    options: dict[str, Any],
    events: Any,
) -> None:
    """Entry point of one GPU worker process (spawned with ``CUDA_VISIBLE_DEVICES`` set to its GPU)."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s gpu{shard} %(name)s: %(message)s")
    logging.getLogger("fasttree").setLevel(options.pop("log_level"))

    def report(event: str, value: Any) -> None:
        events.put((shard, event, value))

    try:
        wall_deadline = options.pop("wall_deadline")
        options["deadline"] = None if wall_deadline is None else time.monotonic() + (wall_deadline - time.time())
        env = options.pop("env")
        if env is None:
            env = collect_env(options["device"])
        summary = run_points(Path(out), points, env=env, report=report, shard=shard, **options)
        events.put((shard, "summary", asdict(summary)))
    except BaseException as exc:
        events.put((shard, "error", error_text(exc)))
        raise


def _run_sharded(
    out: Path,
    points: list[DesignPoint],
    *,
    gpu_ids: list[str],
    env: dict[str, Any] | None,
    progress: _ProgressFactory,
    **options: Any,
) -> ProfileSummary:
    """:func:`~fasttree.toolkit.profile_loop.run_points` in one spawned worker process per GPU of
    ``gpu_ids``, each measuring every k-th tree (all its configs); one progress bar counts them all."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    k = len(gpu_ids)
    deadline = options.pop("deadline")
    wall_deadline = None if deadline is None else time.time() + (deadline - time.monotonic())
    options = dict(
        options,
        device="cuda",
        env=env,
        wall_deadline=wall_deadline,
        log_level=logging.getLogger("fasttree").getEffectiveLevel(),
    )
    options["compile_workers"] = max(1, options["compile_workers"] // k)
    procs = _start_workers(ctx, out, points, gpu_ids, options, events)
    logger.info("profiling on %d GPUs (%s), one worker process each, every %d-th tree", k, ",".join(gpu_ids), k)
    try:
        return _collect_events(events, procs, progress)
    finally:
        for p in procs:
            p.join()


def _start_workers(
    ctx: Any, out: Path, points: list[DesignPoint], gpu_ids: list[str], options: dict[str, Any], events: Any
) -> list[Any]:
    """Start one worker process per GPU, each seeing only its GPU (``CUDA_VISIBLE_DEVICES``)."""
    k = len(gpu_ids)
    procs = []
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for i, gpu in enumerate(gpu_ids):
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # inherited by the spawned child at start
            mine = [p for p in points if p.tree_index % k == i]  # whole trees: a tree's configs share a GPU
            p = ctx.Process(
                target=_shard_main, args=(i, str(out), mine, dict(options), events), name=f"fasttree-gpu{i}"
            )
            p.start()
            procs.append(p)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return procs


def _collect_events(events: Any, procs: list[Any], progress: _ProgressFactory) -> ProfileSummary:
    """Follow the workers' events until every worker has finished: start the bar once every worker
    has counted its points, advance it per record, and merge the workers' summaries."""
    k = len(procs)
    total = totals_seen = 0
    bar: _Progress | None = None
    summary = ProfileSummary(gpus=k)
    finished: set[int] = set()
    errors: list[str] = []
    early_events: list[str] = []
    try:
        while len(finished) < k:
            try:
                shard, event, value = events.get(timeout=1.0)
            except queue_module.Empty:
                for i, p in enumerate(procs):
                    if i not in finished and not p.is_alive():
                        finished.add(i)
                        if p.exitcode != 0:
                            errors.append(f"GPU worker {i} exited with code {p.exitcode}")
                continue
            if event == "total":
                total += int(value)
                totals_seen += 1
                if totals_seen == k:  # every worker has counted its points: the bar can start
                    bar = progress(total)
                    for early in early_events:
                        bar.update(early)
            elif event in ("ok", "failed"):
                if bar is not None:
                    bar.update(event)
                else:
                    early_events.append(event)
            elif event == "summary":
                summary.merge(ProfileSummary(**value))
                finished.add(shard)
            elif event == "error":
                errors.append(f"GPU worker {shard}: {value}")
                finished.add(shard)
    finally:
        if bar is not None:
            bar.close()
    if errors:
        summary.aborted = "; ".join(errors)
    return summary


def _run_here(
    out: Path,
    points: list[DesignPoint],
    *,
    device: Any,
    env: dict[str, Any],
    progress: _ProgressFactory,
    **options: Any,
) -> ProfileSummary:
    """:func:`~fasttree.toolkit.profile_loop.run_points` in this process, with a progress bar."""
    bar: list[_Progress] = []

    def report(event: str, value: Any) -> None:
        if event == "total":
            bar.append(progress(int(value)))
        elif bar:
            bar[0].update(event)

    try:
        return run_points(out, points, device=device, env=env, report=report, **options)
    finally:
        if bar:
            bar[0].close()


# ------------------------------------------------------------------ the driver
def profile(
    out: str | os.PathLike,
    *,
    n: int | None = None,
    seed: int = 0,
    budget_s: float | None = None,
    device: Any = "cuda",
    families: Iterable[str] | None = None,
    split: str = "train",
    precompile: bool = True,
    progress: bool = True,
    measure: Callable[..., dict[str, Any]] = measure_point,
    check_every: int = 10,
    env: dict[str, Any] | None = None,
    sm_count: int | None = None,
    gpus: int | None = None,
    compile_workers: int | None = None,
    batch_size: int = 32,
    repeat_every: int = 0,
    runtime: bool = False,
    design_name: str = "sampled",
    buckets: Iterable[str] | None = None,
    trees: int | None = None,
    configs: int | None = None,
) -> ProfileSummary:
    """Profile a design into the trace file ``out`` (appending, resumable): ``n`` points of the
    sampled design, or the headroom design (``design_name="headroom"``).

    Points whose key ``out`` already holds (ok or failed) are skipped, so rerunning the
    same command resumes a killed run, and a larger ``n`` adds only the new points. Points
    are measured in batches; before each batch the Triton kernel specialisations it needs
    are compiled in parallel worker processes (``precompile``; spawned, ``min(16, cpu
    count)`` of them) so that the measuring process finds them in Triton's disk cache. No
    new point starts once ``budget_s`` is spent. A failing point is written as a failed
    record and the run goes on. With several visible GPUs (and ``device`` the generic
    ``"cuda"``), one spawned worker process per GPU measures every k-th tree (all its configs), all
    appending to ``out``.

    Parameters
    ----------
    out : str or PathLike
        A ``.jsonl`` trace file (created when missing).
    n : int, optional
        Points of the sampled design (see :func:`design`); required for it, refused for the
        headroom design (its size is buckets x ``trees`` x ``configs``).
    seed : int
        Design seed.
    budget_s : float, optional
        Wall-clock budget in seconds (None: until every point is done).
    device : str or torch.device
        ``"cuda"`` (every visible GPU) or one device such as ``"cuda:1"``.
    families : iterable of str, optional
        Restrict the design to these tree families.
    split : str
        ``"train"`` or ``"heldout"`` (see :func:`design`); recorded in every line's
        ``meta.split``. Write the splits to separate folders (``traces/h200_heldout/``).
    precompile : bool
        Compile kernels ahead in worker processes (skipped without a CUDA device).
    progress : bool
        Show a tqdm progress bar (log lines when tqdm is missing).
    measure : callable
        ``measure(point, *, device, check, env) -> record``; :func:`measure_point` by
        default (tests inject a fake). Must return a record whose key is
        :func:`point_key` for ``env["gpu_name"]``; an exception it raises is written as
        a failed record. In a multi-GPU run it must be picklable (a module-level function).
    check_every : int
        Check correctness of every point whose design index is a multiple of this (and
        of the first point measured); 0 never checks.
    env : dict, optional
        The ``env`` of the records (default: :func:`collect_env` of the device; tests
        pass a fake one).
    sm_count : int, optional
        SM count for the design's thresholds (default: the device's, else 132).
    gpus : int, optional
        GPU worker processes (default: every visible GPU when ``device`` is ``"cuda"``,
        else 1); more than one forces the multi-process path.
    compile_workers : int, optional
        Compile worker processes (default ``min(16, cpu count)``; split among GPUs).
    batch_size : int
        Points per compile-then-measure batch.
    repeat_every : int
        After every this many points, measure an earlier ``ok`` point again and write it
        as another line of its key (``meta.profiler.repeat``; 0: never), the data of the
        repeat spread that ``fasttree-tune traces`` reports.
    runtime : bool
        Time :class:`fasttree.runtime.TreeAttentionRuntime`'s launches instead of
        ``tree_attention``'s (:attr:`DesignPoint.runtime`; other keys, so both can share a file).
    design_name : str
        ``"sampled"`` (:func:`design`, the latency model's training and held-out data) or
        ``"headroom"`` (:func:`fasttree.toolkit.headroom.headroom_design`: per bucket, a fixed
        sample of trees each under a fixed sample of configs; lines carry ``meta.design`` and
        ``meta.bucket``, ``meta.split`` is ``"headroom"``). One of :data:`DESIGNS`.
    buckets : iterable of str, optional
        Headroom design only: bucket names (default
        :data:`fasttree.toolkit.headroom.DEFAULT_BUCKETS`).
    trees : int, optional
        Headroom design only: trees per bucket (default
        :data:`~fasttree.toolkit.headroom.HEADROOM_TREES`).
    configs : int, optional
        Headroom design only: configs per tree, the defaults included (default
        :data:`~fasttree.toolkit.headroom.HEADROOM_CONFIGS`).

    Returns
    -------
    ProfileSummary

    Raises
    ------
    ValueError
        On bad arguments (an option of the other design included), a ``.gz`` output path, or no
        CUDA GPU when ``env`` is not given; all before anything is measured.
    """
    t0 = time.monotonic()
    out = Path(out)
    if out.name.endswith(".gz"):
        raise ValueError(f"{out}: the profiler appends to a .jsonl file; gzip it once the set is finished")
    seed = check_int("seed", seed, minimum=0)
    draw = _design_drawer(
        design_name,
        n=n,
        seed=seed,
        families=families,
        split=split,
        runtime=runtime,
        buckets=buckets,
        trees=trees,
        configs=configs,
    )
    options = _loop_options(
        precompile=precompile,
        measure=measure,
        check_every=check_every,
        batch_size=batch_size,
        repeat_every=repeat_every,
        compile_workers=compile_workers,
    )
    budget_s = _checked_budget(budget_s)
    fams = check_families(families)
    options["deadline"] = deadline = None if budget_s is None else t0 + budget_s
    env_given = env is not None
    if env is None:
        env = collect_env(device)
    if sm_count is None:
        sm_count = int(env.get("gpu_sm_count") or 0) or device_sm_count(device)
    points = draw(sm_count)
    options["run_id"] = run_id = uuid.uuid4().hex[:12]
    logger.info(
        "profile run %s: %d %s design points (seed %d, families %s) -> %s%s",
        run_id,
        len(points),
        split if design_name == "sampled" else design_name,
        seed,
        ",".join(fams),
        out,
        f", budget {budget_s:.0f} s" if budget_s is not None else "",
    )

    def make_progress(total: int) -> _Progress:
        return _Progress(total, enabled=progress, deadline=deadline)

    gpu_ids = _gpu_ids(gpus, device)
    if len(gpu_ids) > 1:  # each GPU worker collects its own env unless the caller fixed one
        shard_env = env if env_given else None
        summary = _run_sharded(out, points, gpu_ids=gpu_ids, env=shard_env, progress=make_progress, **options)
    else:
        summary = _run_here(out, points, device=device, env=env, progress=make_progress, **options)
    summary.points = len(points)
    summary.elapsed_s = time.monotonic() - t0
    logger.info("profile run %s done: %s", run_id, summary.line())
    return summary


def _design_drawer(
    design_name: str,
    *,
    n: int | None,
    seed: int,
    families: Iterable[str] | None,
    split: str,
    runtime: bool,
    buckets: Iterable[str] | None,
    trees: int | None,
    configs: int | None,
) -> Callable[[int], list[DesignPoint]]:
    """Check the design's arguments (before any work) and return ``draw(sm_count) -> points``."""
    design_name = check_choice("design_name", design_name, DESIGNS)
    fams = check_families(families)
    split = check_split(split)
    if design_name == "sampled":
        given = [name for name, v in (("buckets", buckets), ("trees", trees), ("configs", configs)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: options of the headroom design, not of the sampled one")
        if n is None:
            raise ValueError("n (the number of design points) is required for the sampled design")
        n = check_int("n", n, minimum=0)
        return lambda sm_count: design(n, seed, sm_count=sm_count, families=fams, split=split, runtime=runtime)
    if n is not None:
        raise ValueError(
            "n: the headroom design's size is buckets x trees x configs; choose those instead of a number of points"
        )
    if split != "train":
        raise ValueError(f"split {split!r}: the headroom design has no splits (its lines say meta.split 'headroom')")
    chosen = [b.name for b in check_buckets(buckets)]
    trees = HEADROOM_TREES if trees is None else check_int("trees", trees, minimum=1)
    configs = HEADROOM_CONFIGS if configs is None else check_int("configs", configs, minimum=2)
    return lambda sm_count: headroom_design(
        seed, buckets=chosen, trees=trees, configs=configs, families=fams, sm_count=sm_count, runtime=runtime
    )


def _loop_options(
    *,
    precompile: bool,
    measure: Callable[..., dict[str, Any]],
    check_every: Any,
    batch_size: Any,
    repeat_every: Any,
    compile_workers: Any,
) -> dict[str, Any]:
    """The checked options of the loop each device runs (:func:`~fasttree.toolkit.profile_loop.run_points`)."""
    workers = default_compile_workers() if compile_workers is None else compile_workers
    return dict(
        precompile=precompile,
        measure=measure,
        check_every=check_int("check_every", check_every, minimum=0),
        batch_size=check_int("batch_size", batch_size, minimum=1),
        repeat_every=check_int("repeat_every", repeat_every, minimum=0),
        compile_workers=check_int("compile_workers", workers, minimum=1),
    )


def _checked_budget(budget_s: Any) -> float | None:
    """``budget_s`` in seconds, None for no budget (an infinite budget is none)."""
    if budget_s is None:
        return None
    budget_s = check_number(
        "budget_s", budget_s, above=0, finite=False, expected="a positive number of seconds or None"
    )
    return budget_s if math.isfinite(budget_s) else None


def _gpu_ids(gpus: int | None, device: Any) -> list[str]:
    """The GPUs to run on, one worker process each: ``gpus`` of them (the first visible ones), or by
    default every visible GPU when ``device`` is the generic ``"cuda"``, else none (this process only)."""
    if gpus is None:
        return visible_gpu_ids() if generic_cuda(device) else []
    gpus = check_int("gpus", gpus, minimum=1)
    visible = visible_gpu_ids()
    return visible[:gpus] if len(visible) >= gpus else [str(i) for i in range(gpus)]
