"""The headroom summary: per bucket and tree family, how much the best measured config beats the defaults.

Reads the lines of the headroom design (``meta.design == "headroom"``, written by ``fasttree-tune
profile --design headroom``; :mod:`fasttree.toolkit.headroom`) and computes, per target
(``tree_attention``, or ``runtime`` for lines with a ``launch``) and bucket
(:func:`~fasttree.toolkit.headroom.bucket_name`):

* per tree, the **oracle**: the defaults' graph-replay median over the fastest ``ok`` config's of
  that tree (>= 1, the defaults included), and the defaults' **rank** among the tree's ``ok``
  configs (1: nothing was faster);
* per group (bucket, bucket and family, family over the buckets, all): the trees, the oracle's
  geometric mean, median and maximum, the share of trees at or above :data:`LARGE_HEADROOM`, the
  median rank of the defaults; beside them the **always-defaults** baseline (1.000x on every tree
  by definition) and the **best single config** of the bucket *in-sample*: the one config, among
  those measured ``ok`` on every used tree of the bucket, with the highest geometric mean of the
  defaults' time over its time. It is chosen on the very trees it is scored on, so it is an upper
  bound of what one fixed config could reach on these trees, not an estimate for others.

Each key counts once (its first line; later lines are the profiler's repeats). Failed lines
(compile errors, out of memory, wrong results) are counted per bucket and left out; a tree whose
defaults line failed or is missing is listed and left out; a tree measured under fewer configs
than the fullest tree of its bucket (a run stopped by its budget) is counted as incomplete and
kept. Lines of other designs are counted and ignored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..config import FastTreeConfig
from ..traces import _config_dict
from .headroom import HEADROOM_BUCKETS, HEADROOM_DESIGN, bucket_name
from .workloads import TREE_FAMILIES

logger = logging.getLogger(__name__)

__all__ = [
    "LARGE_HEADROOM",
    "SUMMARY_SCHEMA",
    "BestSingle",
    "GroupStats",
    "HeadroomSummary",
    "TreeResult",
    "headroom_summary",
]

#: An oracle at or above this counts as a large headroom (tuning may pay there).
LARGE_HEADROOM = 1.15
#: Other configs the in-sample portfolio line adds to the defaults, at most.
PORTFOLIO_OTHERS = 3
#: ``schema`` of the summary's JSON.
SUMMARY_SCHEMA = "fasttree-headroom-summary"
_ALL = "all"


@dataclass(frozen=True)
class TreeResult:
    """One tree of one bucket and target.

    Attributes
    ----------
    target : str
        ``"tree_attention"`` or ``"runtime"``.
    bucket : str
        :func:`~fasttree.toolkit.headroom.bucket_name` of the shape.
    family : str
    seed : int
    defaults_us : float
        The defaults' graph-replay median.
    best_us : float
        The fastest ``ok`` config's graph-replay median (the defaults included).
    best_config : dict
        That config (``FastTreeConfig.to_dict()``).
    configs_ok, configs_failed : int
        Configs measured ``ok`` and failed on the tree.
    defaults_rank : int
        1 + the ``ok`` configs measured faster than the defaults.
    """

    target: str
    bucket: str
    family: str
    seed: int
    defaults_us: float
    best_us: float
    best_config: dict[str, Any]
    configs_ok: int
    configs_failed: int
    defaults_rank: int

    @property
    def oracle(self) -> float:
        """The defaults' time over the best measured config's (>= 1)."""
        return self.defaults_us / self.best_us


@dataclass(frozen=True)
class GroupStats:
    """The oracle over a group of trees, with the baselines beside it.

    Attributes
    ----------
    trees : int
    oracle_geomean, oracle_median, oracle_max : float
        Of the per-tree oracles.
    large_share : float
        Share of trees whose oracle is at least :data:`LARGE_HEADROOM`.
    defaults : float
        The always-defaults baseline: 1.0 (the defaults against themselves).
    defaults_rank_median : float
        Median rank of the defaults among each tree's ``ok`` configs.
    configs_median : float
        Median number of ``ok`` configs per tree (what the rank is out of).
    best_single_geomean : float or None
        Geometric mean over the group's trees of the defaults' time over the time of the best
        single config of each tree's bucket (in-sample; None when a bucket has none).
    """

    trees: int
    oracle_geomean: float
    oracle_median: float
    oracle_max: float
    large_share: float
    defaults: float
    defaults_rank_median: float
    configs_median: float
    best_single_geomean: float | None


@dataclass(frozen=True)
class BestSingle:
    """The best single config of a bucket, chosen and scored on the same trees (in-sample).

    Attributes
    ----------
    config : dict
        ``FastTreeConfig.to_dict()``; the defaults when no other config beats them.
    geomean : float
        Geometric mean over the bucket's used trees of the defaults' time over the config's.
    is_defaults : bool
    eligible : int
        Configs measured ``ok`` on every used tree (the defaults included).
    not_eligible : int
        Configs that failed or were not measured on some used tree.
    changes : dict
        The fields of ``config`` that differ from the defaults as the bucket launches them.
    """

    config: dict[str, Any]
    geomean: float
    is_defaults: bool
    eligible: int
    not_eligible: int
    changes: dict[str, Any] = field(default_factory=dict)


@dataclass
class BucketReport:
    """One bucket of one target: its trees, groups, best single config and what was left out.

    ``portfolio_in_sample[k - 1]``: the geomean over the bucket's used trees of the defaults' time
    over the best of the defaults and ``k`` other configs per tree, the others added greedily (each
    the one that raises that geomean most), for ``k`` up to :data:`PORTFOLIO_OTHERS`: chosen and
    scored on the same trees (in-sample), what a perfect per-tree selector among so few configs
    could reach here."""

    stats: GroupStats | None
    families: dict[str, GroupStats] = field(default_factory=dict)
    best_single: BestSingle | None = None
    lines: int = 0
    failed_lines: int = 0
    excluded_trees: list[str] = field(default_factory=list)
    incomplete_trees: int = 0
    configs_max: int = 0
    portfolio_in_sample: list[float] = field(default_factory=list)


@dataclass
class HeadroomSummary:
    """What :func:`headroom_summary` found.

    Attributes
    ----------
    buckets : dict
        ``target -> bucket -> BucketReport``.
    families : dict
        ``target -> family -> GroupStats`` over every bucket.
    overall : dict
        ``target -> GroupStats`` over every bucket and family.
    trees : list of TreeResult
        Every used tree.
    gpu : str or None
    kernel_versions : list of int
    git_commits : list of str
    ignored_lines : int
        Measurement lines of other designs.
    repeat_lines : int
        Later lines of a key already read (not used).
    """

    buckets: dict[str, dict[str, BucketReport]] = field(default_factory=dict)
    families: dict[str, dict[str, GroupStats]] = field(default_factory=dict)
    overall: dict[str, GroupStats] = field(default_factory=dict)
    trees: list[TreeResult] = field(default_factory=list)
    gpu: str | None = None
    kernel_versions: list[int] = field(default_factory=list)
    git_commits: list[str] = field(default_factory=list)
    ignored_lines: int = 0
    repeat_lines: int = 0

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """A plain-JSON dict of the summary (``schema`` :data:`SUMMARY_SCHEMA`)."""
        return {
            "schema": SUMMARY_SCHEMA,
            "schema_version": 1,
            "large_headroom": LARGE_HEADROOM,
            "gpu": self.gpu,
            "kernel_versions": self.kernel_versions,
            "git_commits": self.git_commits,
            "ignored_lines": self.ignored_lines,
            "repeat_lines": self.repeat_lines,
            "targets": {
                target: {
                    "overall": _json_stats(self.overall.get(target)),
                    "families": {f: _json_stats(s) for f, s in self.families.get(target, {}).items()},
                    "buckets": {
                        name: {
                            **_json_stats(b.stats, "stats"),
                            "families": {f: _json_stats(s) for f, s in b.families.items()},
                            "best_single_in_sample": asdict(b.best_single) if b.best_single else None,
                            "lines": b.lines,
                            "failed_lines": b.failed_lines,
                            "excluded_trees": b.excluded_trees,
                            "incomplete_trees": b.incomplete_trees,
                            "configs_max": b.configs_max,
                            "portfolio_in_sample": [_round(x) for x in b.portfolio_in_sample],
                        }
                        for name, b in buckets.items()
                    },
                }
                for target, buckets in self.buckets.items()
            },
            "trees": [{**asdict(t), "oracle": _round(t.oracle)} for t in self.trees],
        }

    # ------------------------------------------------------------------ markdown
    def markdown(self) -> str:
        """The tables: per bucket (and all), per bucket and family, per family over the buckets."""
        out = [
            f"Oracle: per tree, the defaults' time over the fastest measured config's (graph-replay medians; "
            f"{self.gpu or 'no GPU'}; kernel version {', '.join(map(str, self.kernel_versions)) or '-'}; "
            f"commit {', '.join(self.git_commits) or '-'}). Always defaults: 1.000x on every tree by definition "
            f"(no tree >= {LARGE_HEADROOM:.2f}x). Defaults' rank: median over the trees of its place among the "
            "tree's measured configs (1 = fastest), out of the median number of configs measured per tree. "
            "Best single config: the one config of each bucket with the highest geomean over that bucket's "
            "trees, chosen on the same trees it is scored on (**in-sample**: an upper bound of what one fixed "
            "config reaches here).",
            "",
        ]
        for target, buckets in self.buckets.items():
            out += [f"### {target}", "", _HEADER_BUCKET, _rule(_HEADER_BUCKET)]
            for name, b in buckets.items():
                out.append(_row(name, b.stats, extra=f"{b.failed_lines} / {b.lines}"))
            overall = self.overall.get(target)
            failed = sum(b.failed_lines for b in buckets.values())
            lines = sum(b.lines for b in buckets.values())
            out.append(_row(f"**{_ALL}**", overall, extra=f"{failed} / {lines}"))
            out += ["", f"Per bucket and family ({target}):", "", _HEADER_FAMILY, _rule(_HEADER_FAMILY)]
            for name, b in buckets.items():
                for family, s in b.families.items():
                    out.append(_row(f"{name} | {family}", s))
            out += [
                "",
                f"Per family over the buckets ({target}):",
                "",
                _HEADER_BUCKET_NOFAIL,
                _rule(_HEADER_BUCKET_NOFAIL),
            ]
            for family, s in self.families.get(target, {}).items():
                out.append(_row(family, s))
            out += ["", f"Best single config per bucket, in-sample ({target}):", ""]
            for name, b in buckets.items():
                bs = b.best_single
                if bs is None:
                    out.append(f"- {name}: no tree")
                    continue
                changed = json.dumps(bs.changes, separators=(",", ":"))
                what = "the defaults" if bs.is_defaults else f"the defaults with `{changed}`"
                out.append(
                    f"- {name}: {what}, {bs.geomean:.3f}x geomean over the bucket's trees (chosen among "
                    f"{bs.eligible} configs measured ok on every tree; {bs.not_eligible} others failed or were "
                    "not measured on some tree)"
                )
            out += [
                "",
                f"The defaults and the best 1 to {PORTFOLIO_OTHERS} other configs, picked per tree, "
                f"in-sample ({target}):",
                "",
            ]
            for name, b in buckets.items():
                steps = " / ".join(f"{x:.3f}x" for x in b.portfolio_in_sample) or "no other config"
                out.append(f"- {name}: {steps}")
            left_out = [(name, b) for name, b in buckets.items() if b.excluded_trees or b.incomplete_trees]
            if left_out:
                out += ["", f"Trees left out or incomplete ({target}):", ""]
                for name, b in left_out:
                    if b.excluded_trees:
                        out.append(f"- {name}: left out (no ok defaults line): {', '.join(b.excluded_trees)}")
                    if b.incomplete_trees:
                        out.append(
                            f"- {name}: {b.incomplete_trees} tree(s) measured under fewer configs than the "
                            f"bucket's fullest ({b.configs_max}); kept"
                        )
            out.append("")
        if self.ignored_lines or self.repeat_lines:
            out.append(
                f"Not used: {self.ignored_lines} measurement line(s) of other designs, {self.repeat_lines} repeat "
                "line(s) (a key measured again; its first line is used)."
            )
        return "\n".join(out).rstrip() + "\n"


_HEADER_BUCKET = (
    "| bucket | trees | oracle geomean | median | max | trees >= 1.15x | always defaults | defaults' rank "
    "(of configs) | best single config, in-sample | failed / lines |"
)
_HEADER_BUCKET_NOFAIL = _HEADER_BUCKET.replace("bucket |", "family |", 1).rsplit(" failed / lines |", 1)[0]
_HEADER_FAMILY = _HEADER_BUCKET.replace("| bucket |", "| bucket | family |", 1).rsplit(" failed / lines |", 1)[0]


def _greedy_portfolio(
    times: Mapping[tuple[str, int], Mapping[str, float]], defaults_key: str, candidates: set[str]
) -> list[float]:
    """:attr:`BucketReport.portfolio_in_sample` of ``times`` (tree -> config key -> us), the others
    drawn from ``candidates`` (configs measured ok on every tree); ties go to the smaller key."""
    trees = list(times)
    best = {t: times[t][defaults_key] for t in trees}
    others = sorted(candidates - {defaults_key})
    out: list[float] = []
    for _ in range(min(PORTFOLIO_OTHERS, len(others))):
        pick = max(others, key=lambda k: _geomean(times[t][defaults_key] / min(best[t], times[t][k]) for t in trees))
        others.remove(pick)
        best = {t: min(best[t], times[t][pick]) for t in trees}
        out.append(_geomean(times[t][defaults_key] / best[t] for t in trees))
    return out


def _rule(header: str) -> str:
    return "|" + "---|" * (header.count("|") - 1)


def _row(name: str, s: GroupStats | None, *, extra: str | None = None) -> str:
    tail = f" {extra} |" if extra is not None else ""
    if s is None:
        return f"| {name} | 0 | - | - | - | - | 1.000x | - | - |{tail}"
    single = "-" if s.best_single_geomean is None else f"{s.best_single_geomean:.3f}x"
    return (
        f"| {name} | {s.trees} | {s.oracle_geomean:.3f}x | {s.oracle_median:.3f}x | {s.oracle_max:.3f}x | "
        f"{round(s.large_share * s.trees)} ({100 * s.large_share:.0f}%) | {s.defaults:.3f}x | "
        f"{s.defaults_rank_median:g} (of {s.configs_median:g}) | {single} |{tail}"
    )


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


def _json_stats(s: GroupStats | None, key: str | None = None) -> dict[str, Any]:
    body = None if s is None else {k: (_round(v) if isinstance(v, float) else v) for k, v in asdict(s).items()}
    return {key: body} if key else (body or {})


def _geomean(values: Iterable[float]) -> float:
    v = np.asarray(list(values), dtype=np.float64)
    return float(np.exp(np.mean(np.log(v))))


def _group(trees: list[TreeResult], single: Mapping[tuple[str, str, str, int], float]) -> GroupStats | None:
    """Stats of ``trees``; ``single`` maps a tree's identity to its bucket's best single config's ratio."""
    if not trees:
        return None
    oracle = np.array([t.oracle for t in trees])
    ratios = [single.get(_tree_id(t)) for t in trees]
    return GroupStats(
        trees=len(trees),
        oracle_geomean=_geomean(oracle),
        oracle_median=float(np.median(oracle)),
        oracle_max=float(oracle.max()),
        large_share=float(np.mean(oracle >= LARGE_HEADROOM)),
        defaults=1.0,
        defaults_rank_median=float(np.median([t.defaults_rank for t in trees])),
        configs_median=float(np.median([t.configs_ok for t in trees])),
        best_single_geomean=None if any(r is None for r in ratios) else _geomean(ratios),
    )


def _tree_id(t: TreeResult) -> tuple[str, str, str, int]:
    return (t.target, t.bucket, t.family, t.seed)


def _config_key(config: FastTreeConfig | Mapping[str, Any], record: Mapping[str, Any]) -> str:
    """A canonical text of a config as the record's shape ran it (derived warps and stages written
    out, as trace records store them): equal launches, equal text."""
    if not isinstance(config, FastTreeConfig):
        config = dict(config)
    resolved = _config_dict(config, record["num_q_heads"], record["num_kv_heads"], record["head_dim"])
    return json.dumps(resolved, sort_keys=True)


def _headroom_lines(records: Iterable[Mapping[str, Any]], summary: HeadroomSummary) -> list[Mapping[str, Any]]:
    """The lines of the headroom design (checked to come from one GPU and kernel version), the first
    of each key; counts the others."""
    lines = []
    for r in records:
        if r.get("kind") != "measurement":
            continue
        meta = r.get("meta") if isinstance(r.get("meta"), dict) else {}
        if meta.get("design") != HEADROOM_DESIGN:
            summary.ignored_lines += 1
            continue
        lines.append(r)
    _check_one_run_setting(lines, summary)
    seen: set[str] = set()
    out = []
    for r in lines:
        if r["key"] in seen:
            summary.repeat_lines += 1
            continue
        seen.add(r["key"])
        out.append(r)
    return out


def _check_one_run_setting(lines: list[Mapping[str, Any]], summary: HeadroomSummary) -> None:
    """Refuse lines of several GPUs or kernel versions (their times do not compare); note the commits."""
    gpus = sorted({str(r["env"]["gpu_name"]) for r in lines})
    if len(gpus) > 1:
        raise ValueError(f"the headroom lines come from several GPUs ({', '.join(gpus)}); summarise one GPU at a time")
    summary.gpu = gpus[0] if gpus else None
    versions = set()
    for r in lines:
        prof = r.get("meta", {}).get("profiler")
        if isinstance(prof, dict) and isinstance(prof.get("kernel_version"), int):
            versions.add(prof["kernel_version"])
    if len(versions) > 1:
        raise ValueError(
            f"the headroom lines time several kernel versions ({sorted(versions)}); summarise one version at a time"
        )
    summary.kernel_versions = sorted(versions)
    summary.git_commits = sorted({str(r["env"]["git_commit"]) for r in lines if r["env"].get("git_commit")})


def headroom_summary(records: Iterable[Mapping[str, Any]]) -> HeadroomSummary:
    """Summarise the headroom design's measurement lines (see the module docstring).

    Parameters
    ----------
    records : iterable of dict
        Trace records (``read_traces(...).records``); lines of other kinds and designs are counted
        and ignored.

    Returns
    -------
    HeadroomSummary

    Raises
    ------
    ValueError
        When no line is of the headroom design, or the lines mix GPUs or kernel versions.
    """
    summary = HeadroomSummary()
    lines = _headroom_lines(records, summary)
    if not lines:
        raise ValueError(
            f"no measurement line of the headroom design (meta.design {HEADROOM_DESIGN!r}; "
            f"{summary.ignored_lines} of other designs): write them with 'fasttree-tune profile --design headroom'"
        )
    # target -> bucket -> (family, seed) -> config key -> record
    grouped: dict[str, dict[str, dict[tuple[str, int], dict[str, Mapping[str, Any]]]]] = {}
    for r in lines:
        target = "runtime" if r.get("launch") else "tree_attention"
        bucket = bucket_name(r["num_q_heads"], r["num_kv_heads"], r["head_dim"], r["dtype"])
        tree = (r["workload"]["family"], int(r["workload"]["seed"]))
        configs = grouped.setdefault(target, {}).setdefault(bucket, {}).setdefault(tree, {})
        configs[_config_key(r["config"], r)] = r
    for target in sorted(grouped):
        buckets = grouped[target]
        summary.buckets[target] = {}
        target_trees: list[TreeResult] = []
        single: dict[tuple[str, str, str, int], float] = {}
        for bucket in sorted(buckets, key=_bucket_order):
            report, used, ratios = _bucket(target, bucket, buckets[bucket])
            summary.buckets[target][bucket] = report
            target_trees += used
            single.update(ratios)
        for bucket, report in summary.buckets[target].items():
            mine = [t for t in target_trees if t.bucket == bucket]
            report.stats = _group(mine, single)
            for family in sorted({t.family for t in mine}, key=_family_order):
                report.families[family] = _group([t for t in mine if t.family == family], single)
        summary.families[target] = {
            family: _group([t for t in target_trees if t.family == family], single)
            for family in sorted({t.family for t in target_trees}, key=_family_order)
        }
        overall = _group(target_trees, single)
        if overall is not None:
            summary.overall[target] = overall
        summary.trees += target_trees
    return summary


def _bucket_order(name: str) -> tuple[int, str]:
    names = list(HEADROOM_BUCKETS)
    return (names.index(name), "") if name in names else (len(names), name)


def _family_order(name: str) -> tuple[int, str]:
    names = list(TREE_FAMILIES)
    return (names.index(name), "") if name in names else (len(names), name)


def _bucket(
    target: str, bucket: str, trees: Mapping[tuple[str, int], Mapping[str, Mapping[str, Any]]]
) -> tuple[BucketReport, list[TreeResult], dict[tuple[str, str, str, int], float]]:
    """One bucket: its used trees, its report (stats filled in by the caller) and each used tree's
    ratio under the bucket's best single config."""
    report = BucketReport(stats=None)
    report.configs_max = max(len(configs) for configs in trees.values())
    some_line = next(iter(next(iter(trees.values())).values()))
    defaults_key = _config_key(FastTreeConfig(), some_line)
    used: list[TreeResult] = []
    times: dict[tuple[str, int], dict[str, float]] = {}
    for (family, seed), configs in sorted(trees.items(), key=lambda kv: (_family_order(kv[0][0]), kv[0][1])):
        report.lines += len(configs)
        failed = sum(1 for r in configs.values() if r["status"] != "ok")
        report.failed_lines += failed
        if len(configs) < report.configs_max:
            report.incomplete_trees += 1
        name = f"{family}/{seed}"
        defaults = configs.get(defaults_key)
        if defaults is None or defaults["status"] != "ok":
            why = "no defaults line" if defaults is None else f"defaults failed: {defaults.get('error')}"
            report.excluded_trees.append(f"{name} ({why})")
            logger.warning("%s %s: tree %s left out (%s)", target, bucket, name, why)
            continue
        ok = {k: float(r["timing"]["graph_us"]["median"]) for k, r in configs.items() if r["status"] == "ok"}
        best_key = min(ok, key=lambda k: (ok[k], k != defaults_key))
        t_def = ok[defaults_key]
        used.append(
            TreeResult(
                target=target,
                bucket=bucket,
                family=family,
                seed=seed,
                defaults_us=t_def,
                best_us=ok[best_key],
                best_config=json.loads(best_key),
                configs_ok=len(ok),
                configs_failed=failed,
                defaults_rank=1 + sum(1 for t in ok.values() if t < t_def),
            )
        )
        times[(family, seed)] = ok
    ratios: dict[tuple[str, str, str, int], float] = {}
    if used:
        candidates = set.intersection(*(set(ok) for ok in times.values()))
        every = set().union(*(set(c) for c in trees.values()))
        scores = {
            k: _geomean(times[t][defaults_key] / times[t][k] for t in times)
            for k in sorted(candidates, key=lambda k: (k != defaults_key, k))
        }
        best = max(scores, key=lambda k: (scores[k], k == defaults_key))
        config, defaults = json.loads(best), json.loads(defaults_key)
        report.best_single = BestSingle(
            config=config,
            geomean=scores[best],
            is_defaults=best == defaults_key,
            eligible=len(candidates),
            not_eligible=len(every) - len(candidates),
            changes={k: v for k, v in config.items() if defaults.get(k) != v},
        )
        for family, seed in times:
            ratios[(target, bucket, family, seed)] = times[(family, seed)][defaults_key] / times[(family, seed)][best]
        report.portfolio_in_sample = _greedy_portfolio(times, defaults_key, candidates)
    if report.failed_lines:
        logger.info("%s %s: %d of %d lines failed (left out)", target, bucket, report.failed_lines, report.lines)
    return report, used, ratios
