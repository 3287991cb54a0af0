"""What a trace set holds: counts per split and family, profiling rate, and the spread of
repeat measurements (the numbers the traces issue's closing note reports).

Split: ``meta.split`` of a line (``"train"`` / ``"heldout"``, written by the profiler),
``"unmarked"`` when absent. Counts take each key once (its first line); later lines of a
key (the profiler's repeat measurements) are counted apart. Rate: measurement lines per minute of each profiler run
(``meta.profiler.run_id``) of 10 or more lines, timed from its first to its last line's
``time_utc``. Spread:
for every key measured ``ok`` two or more times, the median over its measurements of
``|t - median| / median`` of the graph-replay median ``t``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from ..traces import TraceSet, parse_time_utc

__all__ = ["TraceStats", "trace_stats"]


@dataclass
class TraceStats:
    """Summary of the measurement lines of a :class:`~fasttree.traces.TraceSet`.

    Attributes
    ----------
    counts : dict
        ``(split, family, status) -> lines``.
    gpus : list of str
    runs : dict
        ``run_id -> (lines, minutes from first to last line)``.
    repeat_lines : int
        Lines whose key an earlier line already had (not in ``counts``).
    repeated_keys : int
        Keys with two or more ``ok`` measurements.
    spread_median, spread_p90 : float or None
        Median and 90th percentile over those keys of the per-key median relative deviation.
    """

    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)
    gpus: list[str] = field(default_factory=list)
    runs: dict[str, tuple[int, float]] = field(default_factory=dict)
    repeat_lines: int = 0
    repeated_keys: int = 0
    spread_median: float | None = None
    spread_p90: float | None = None

    @property
    def lines(self) -> int:
        return sum(self.counts.values())

    def per_minute(self) -> float | None:
        """Lines per minute over the runs with 10 or more lines (None without such runs)."""
        timed = [(n, m) for n, m in self.runs.values() if n >= 10 and m > 0]
        if not timed:
            return None
        return sum(n for n, _ in timed) / sum(m for _, m in timed)

    def table(self) -> str:
        """A plain-text report: one row per (split, family), then rate and spread."""
        rows: dict[tuple[str, str], Counter] = {}
        for (split, family, status), n in sorted(self.counts.items()):
            rows.setdefault((split, family), Counter())[status] += n
        lines = [f"{'split':<10} {'family':<18} {'ok':>7} {'failed':>7}"]
        for (split, family), c in rows.items():
            lines.append(f"{split:<10} {family:<18} {c['ok']:>7} {c['failed']:>7}")
        total = Counter()
        for c in rows.values():
            total.update(c)
        lines.append(f"{'all':<10} {'':<18} {total['ok']:>7} {total['failed']:>7}")
        lines.append(f"GPUs: {', '.join(self.gpus) or '-'}")
        rate = self.per_minute()
        lines.append(
            f"profiler runs: {len(self.runs)}; lines per minute: "
            + (f"{rate:.1f}" if rate is not None else "- (no run of 10 lines or more)")
        )
        if self.repeat_lines:
            lines.append(f"repeat lines (a key measured again; not counted above): {self.repeat_lines}")
        if self.repeated_keys:
            lines.append(
                f"repeat measurements: {self.repeated_keys} keys; median relative deviation "
                f"{100 * self.spread_median:.2f}% (p90 {100 * self.spread_p90:.2f}%)"
            )
        else:
            lines.append("repeat measurements: none (no key measured ok twice)")
        return "\n".join(lines)


def trace_stats(ts: TraceSet) -> TraceStats:
    """Summarise the measurement lines of ``ts`` (see the module docstring).

    Parameters
    ----------
    ts : TraceSet
        From :func:`fasttree.traces.read_traces`.

    Returns
    -------
    TraceStats
    """
    out = TraceStats(gpus=ts.gpus())
    counts: Counter = Counter()
    run_times: dict[str, list[datetime]] = {}
    seen: set[str] = set()
    for r in ts.of_kind("measurement"):
        meta: dict[str, Any] = r.get("meta") if isinstance(r.get("meta"), dict) else {}
        split = meta.get("split") if isinstance(meta.get("split"), str) else "unmarked"
        if r["key"] in seen:
            out.repeat_lines += 1
        else:
            seen.add(r["key"])
            counts[(split, r["workload"]["family"], r["status"])] += 1
        prof = meta.get("profiler")
        if isinstance(prof, dict) and isinstance(prof.get("run_id"), str):
            run_times.setdefault(prof["run_id"], []).append(parse_time_utc(r["time_utc"]))
    out.counts = dict(counts)
    for run_id, times in run_times.items():
        span = (max(times) - min(times)).total_seconds() / 60.0
        out.runs[run_id] = (len(times), span)
    deviations = []
    for recs in ts.by_key().values():
        t = np.array([r["timing"]["graph_us"]["median"] for r in recs if r["status"] == "ok"])
        if t.size >= 2:
            med = float(np.median(t))
            deviations.append(float(np.median(np.abs(t - med) / med)))
    if deviations:
        out.repeated_keys = len(deviations)
        out.spread_median = float(np.median(deviations))
        out.spread_p90 = float(np.percentile(deviations, 90))
    return out
