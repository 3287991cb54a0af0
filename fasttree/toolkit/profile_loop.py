"""The resumable profile loop on one device: measure design points and append their records.

:func:`run_points` skips the points whose key the trace file already holds (a rerun resumes
a killed run), measures the others in batches (compiling each batch's kernels ahead while
the one before it is measured, :mod:`fasttree.toolkit.precompile`), writes every record
with :class:`~fasttree.traces.TraceWriter` (an invalid one as a failed record), stops
starting points when the time budget is spent or the device is lost, and optionally
measures earlier points again. :func:`annotate_record` writes the run's facts into each
record's ``meta``. :class:`ProfileSummary` counts what a run did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..traces import TraceError, TraceWriter, existing_keys
from .design import DesignPoint, point_key
from .environment import cuda_device
from .headroom import HEADROOM_DESIGN
from .measure import DeviceLostError, error_text, failed_record
from .precompile import CompilePool, kernel_specialisations

logger = logging.getLogger(__name__)

__all__ = ["ProfileSummary", "annotate_record", "run_points"]


@dataclass
class ProfileSummary:
    """What a :func:`profile` run did.

    Attributes
    ----------
    points : int
        Design points considered.
    skipped : int
        Points whose key the trace file already held (measured by an earlier run).
    measured : int
        Records written with ``status: "ok"``.
    failed : int
        Records written with ``status: "failed"``.
    not_started : int
        Points left when the budget ran out or the run stopped.
    elapsed_s : float
        Wall time of the run.
    stopped_by_budget : bool
    precompiled, precompile_failed : int
        Kernel specialisations compiled ahead, and those that failed to.
    precompile_s : float
        Wall time spent compiling ahead.
    aborted : str or None
        Why the run stopped early other than the budget (a lost device), else None.
    repeats : int
        Repeat measurements written (lines of keys measured earlier in the run).
    """

    points: int = 0
    skipped: int = 0
    measured: int = 0
    failed: int = 0
    not_started: int = 0
    elapsed_s: float = 0.0
    stopped_by_budget: bool = False
    precompiled: int = 0
    precompile_failed: int = 0
    precompile_s: float = 0.0
    aborted: str | None = None
    repeats: int = 0
    gpus: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def written(self) -> int:
        """Records written (ok and failed)."""
        return self.measured + self.failed

    @property
    def points_per_minute(self) -> float:
        """Records written per minute of wall time."""
        return self.written / (self.elapsed_s / 60) if self.elapsed_s > 0 else 0.0

    def merge(self, other: ProfileSummary) -> None:
        """Add another shard's counts (multi-GPU runs)."""
        for name in (
            "points",
            "skipped",
            "measured",
            "failed",
            "not_started",
            "precompiled",
            "precompile_failed",
            "repeats",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.precompile_s = max(self.precompile_s, other.precompile_s)
        self.stopped_by_budget = self.stopped_by_budget or other.stopped_by_budget
        self.aborted = self.aborted or other.aborted

    def line(self) -> str:
        """One-line summary for the log."""
        text = (
            f"{self.measured} measured, {self.failed} failed, {self.skipped} skipped (already in the file), "
            f"{self.not_started} not started, of {self.points} points"
            + (f", {self.repeats} repeat measurements" if self.repeats else "")
            + f" in {self.elapsed_s:.1f} s "
            f"({self.points_per_minute:.1f} points/minute"
            + (f", {self.gpus} GPUs" if self.gpus > 1 else "")
            + (
                f"; {self.precompiled} kernel variants compiled ahead in {self.precompile_s:.1f} s"
                if self.precompiled
                else ""
            )
            + ")"
        )
        if self.stopped_by_budget:
            text += "; stopped by the time budget"
        if self.aborted:
            text += f"; aborted: {self.aborted}"
        return text


def annotate_record(record: dict[str, Any], point: DesignPoint, run_id: str, check: bool, shard: int | None) -> None:
    """Write the run's facts into the record's ``meta``: ``meta.profiler`` gets the run id, the
    point's design seed and index, whether it is a defaults point, whether it was checked, the
    kernel version (failed lines too: which kernels failed) and the GPU worker; ``meta.split``
    the point's split (``traces/README.md``: held-out lines say so at the top of ``meta``); a point of
    the headroom design also gets ``meta.design = "headroom"`` and ``meta.bucket``."""
    from ..versions import KERNEL_VERSION

    meta = record.get("meta")
    if not isinstance(meta, dict):
        meta = record["meta"] = {}
    info = meta.get("profiler")
    if not isinstance(info, dict):
        info = meta["profiler"] = {}
    info.update(
        run_id=run_id,
        design_seed=point.design_seed,
        design_index=point.index,
        default_config=point.default_config,
        checked=check,
    )
    info.setdefault("kernel_version", KERNEL_VERSION)
    meta["split"] = point.split
    if point.bucket is not None:
        meta["design"] = HEADROOM_DESIGN
        meta["bucket"] = point.bucket
    if shard is not None:
        info["gpu_worker"] = shard


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _points_to_measure(
    out: Path, points: Sequence[DesignPoint], gpu_name: str, summary: ProfileSummary
) -> list[DesignPoint]:
    """The points whose key ``out`` does not hold yet (each key once), counting the others as skipped."""
    done = existing_keys(out)
    todo: list[DesignPoint] = []
    for p in points:
        key = point_key(p, gpu_name)
        if key in done:
            summary.skipped += 1
        else:
            done.add(key)  # also drops repeats within the design
            todo.append(p)
    if summary.skipped:
        logger.info("%s: %d of %d points already measured, skipped", out, summary.skipped, len(points))
    return todo


@dataclass
class _DeviceRun:
    """The state one device's run shares between its batches and points (``writer`` is set once the
    trace file is open)."""

    measure: Callable[..., dict[str, Any]]
    device: Any
    env: dict[str, Any]
    run_id: str
    shard: int | None
    summary: ProfileSummary
    report: Callable[[str, Any], None]
    deadline: float | None
    check_every: int
    repeat_every: int
    compiler: CompilePool | None = None
    writer: TraceWriter | None = None
    queued: dict[Any, str] = field(default_factory=dict)
    first: bool = True
    measured_ok: list[DesignPoint] = field(default_factory=list)

    def budget_spent(self) -> bool:
        """Whether the deadline has passed (then the summary says the budget stopped the run)."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.summary.stopped_by_budget = True
        return self.summary.stopped_by_budget

    def compile_ahead(self, batches: Sequence[Sequence[DesignPoint]], i: int) -> None:
        """Wait for batch ``i``'s kernels, then queue batch ``i + 1``'s (compiled while batch ``i`` is
        measured); on any failure close the pool and let the measuring process compile."""
        if self.compiler is None:
            return
        try:
            if i == 0:
                self.queued = self.compiler.submit(kernel_specialisations(batches[0], self.device))
            self.compiler.wait(self.queued, self.deadline)
            self.queued = {}
            if i + 1 < len(batches):
                self.queued = self.compiler.submit(kernel_specialisations(batches[i + 1], self.device))
        except Exception as exc:  # e.g. a worker died and broke the pool: measure on without it
            logger.warning("compiling ahead failed (%s); the measuring process compiles from now on", exc)
            self.close_compiler()

    def close_compiler(self) -> None:
        """Add the pool's counts to the summary and shut its workers down."""
        compiler, self.compiler = self.compiler, None
        if compiler is None:
            return
        self.summary.precompiled += compiler.compiled
        self.summary.precompile_failed += compiler.failed
        self.summary.precompile_s += compiler.seconds
        try:
            compiler.close()
        except Exception as exc:
            logger.warning("closing the compile workers: %s", exc)

    def measure_batch(self, batch: Sequence[DesignPoint]) -> bool:
        """Measure and write the batch's points; True when the run must stop (budget, lost device)."""
        summary = self.summary
        for p in batch:
            if self.budget_spent():
                break
            check = self.check_every > 0 and (self.first or p.index % self.check_every == 0)
            self.first = False
            record = self.write(p, self.measured(p, check), check)
            if record["status"] == "ok":
                summary.measured += 1
            else:
                summary.failed += 1
                logger.debug("%s failed: %s", p.describe(), record["error"])
            self.report(record["status"], None)
            if record["status"] == "ok":
                self.measured_ok.append(p)
            if summary.aborted:
                logger.error("%s; stopping (rerun to resume after point %d)", summary.aborted, p.index)
                break
            again = self.point_to_repeat()
            if again is not None and self.repeat(again):
                break
        return bool(summary.stopped_by_budget or summary.aborted)

    def point_to_repeat(self) -> DesignPoint | None:
        """After every ``repeat_every``-th record, the ``ok`` point measured about ``repeat_every / 2``
        points earlier (None when no repeat is due)."""
        k = self.repeat_every
        if k and self.summary.written % k == 0 and len(self.measured_ok) > k // 2:
            return self.measured_ok[-1 - k // 2]
        return None

    def measured(self, point: DesignPoint, check: bool) -> dict[str, Any]:
        """The point's annotated record from ``measure``: an exception becomes a failed record, a lost
        device aborts the run (its record is kept); the key must be the point's."""
        try:
            record = self.measure(point, device=self.device, check=check, env=self.env)
        except DeviceLostError as exc:
            record = exc.record
            self.summary.aborted = str(exc)
        except Exception as exc:
            logger.debug("measuring %s raised", point.describe(), exc_info=True)
            record = failed_record(point, self.env, error_text(exc))
        annotate_record(record, point, self.run_id, check, self.shard)
        gpu_name = str(self.env.get("gpu_name"))
        expected = point_key(point, gpu_name)
        if record.get("key") != expected:
            raise ValueError(
                f"measure returned a record with key {record.get('key')!r} for {point.describe()}, "
                f"expected {expected} (is its env['gpu_name'] {gpu_name!r}?)"
            )
        return record

    def write(self, point: DesignPoint, record: dict[str, Any], check: bool) -> dict[str, Any]:
        """Append the record; an invalid one (a timing that is not finite, say) is written as failed."""
        try:
            self.writer.append(record)
        except TraceError as exc:
            logger.warning("%s: invalid record (%s); written as failed", point.describe(), exc)
            record = failed_record(point, self.env, "InvalidRecord: " + error_text(exc))
            annotate_record(record, point, self.run_id, check, self.shard)
            self.writer.append(record)
        return record

    def repeat(self, point: DesignPoint) -> bool:
        """Measure ``point`` again and append the record as a repeat line; True when the device was lost."""
        lost = False
        try:
            record = self.measure(point, device=self.device, check=False, env=self.env)
        except DeviceLostError as exc:
            record, lost = exc.record, True
            self.summary.aborted = str(exc)
        except Exception as exc:
            record = failed_record(point, self.env, error_text(exc))
        annotate_record(record, point, self.run_id, False, self.shard)
        record["meta"]["profiler"]["repeat"] = True
        try:
            self.writer.append(record)
        except TraceError as exc:
            logger.warning("%s: invalid repeat record (%s); not written", point.describe(), exc)
            return lost
        self.summary.repeats += 1
        return lost


def run_points(
    out: Path,
    points: Sequence[DesignPoint],
    *,
    device: Any,
    env: dict[str, Any],
    deadline: float | None,
    precompile: bool,
    compile_workers: int,
    measure: Callable[..., dict[str, Any]],
    check_every: int,
    batch_size: int,
    run_id: str,
    report: Callable[[str, Any], None],
    shard: int | None = None,
    repeat_every: int = 0,
) -> ProfileSummary:
    """Measure ``points`` on one device, appending to ``out``: the body of
    :func:`fasttree.toolkit.profiler.profile` (and of each of its GPU workers).

    ``report(event, value)`` gets ``("total", n_to_measure)`` once, then ``("ok" | "failed", None)`` per record.
    With ``repeat_every`` K > 0, after every K-th point an ``ok`` point measured about K/2
    points earlier is measured again and written as another line of its key
    (``meta.profiler.repeat``), for the spread of repeat measurements.
    """
    t0 = time.monotonic()
    summary = ProfileSummary(points=len(points))
    todo = _points_to_measure(out, points, str(env.get("gpu_name")), summary)
    report("total", len(todo))
    run = _DeviceRun(
        measure=measure,
        device=device,
        env=env,
        run_id=run_id,
        shard=shard,
        summary=summary,
        report=report,
        deadline=deadline,
        check_every=check_every,
        repeat_every=repeat_every,
    )
    if precompile and todo:
        if cuda_device(device):
            run.compiler = CompilePool(compile_workers)
        else:
            logger.info("no CUDA device: not compiling kernels ahead")
    try:
        with TraceWriter(out) as writer:
            run.writer = writer
            batches = list(_batches(todo, batch_size))
            for i, batch in enumerate(batches):
                if run.budget_spent():
                    break
                run.compile_ahead(batches, i)
                if run.measure_batch(batch):
                    break
    finally:
        summary.not_started = len(todo) - summary.written
        run.close_compiler()
    summary.elapsed_s = time.monotonic() - t0
    return summary
