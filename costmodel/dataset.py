"""Training and evaluation data of the latency model: measurement traces -> feature matrix.

Every ``status: "ok"`` measurement is re-planned with the library's planner (its tree,
heads and config), turned into a feature row (:mod:`fasttree.costmodel.features`), and
labelled with its graph-replay median time. Rows carry the tree family (the group of
group k-fold), a tree id (the same tree, heads, head dim and dtype measured under
several configs share one: the unit of the per-tree rank metrics) and the split.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fasttree.config import FastTreeConfig
from fasttree.costs import ALL_LARGE
from fasttree.launch_rules import sm90_tile_class
from fasttree.plan_arrays import tile_rows
from fasttree.plan_rules import PlanRules
from fasttree.runtime_planning import plan_as_launched, resolve_stage1_launches
from fasttree.traces import decode_tree, read_traces, record_launch, timed_launch_variants
from fasttree.validation import is_int
from fasttree.versions import KERNEL_VERSION

from .features import (
    FEATURE_NAMES,
    KERNEL_VERSION_COLUMN,
    STAGE1_OVERLAP,
    features_of_plan,
    features_of_plans,
    mark_runtime,
    published_cost,
)
from .gpu import GpuSpec, gpu_spec

logger = logging.getLogger(__name__)

__all__ = [
    "Dataset",
    "load_dataset",
    "measured_kernel_version",
    "record_features",
    "record_plan",
    "timed_todays_launches",
    "tree_id",
]


@dataclass(frozen=True)
class Dataset:
    """Feature rows of measured plans.

    Attributes
    ----------
    X : ndarray, float64 [n, len(FEATURE_NAMES)]
    y_us : ndarray, float64 [n]
        Measured GPU time (graph-replay median, microseconds).
    family : ndarray, str [n]
        Tree family of each row.
    tree : ndarray, str [n]
        Tree id (:func:`tree_id`).
    split : ndarray, str [n]
        ``meta.split`` of the line (``"unmarked"`` when absent).
    default_config : ndarray, bool [n]
        Whether the row measured the published defaults.
    dtype : ndarray, str [n]
        The attention dtype of each row (``"float16"``, ``"bfloat16"``): with the ``gqa`` and
        ``head_dim`` features, the row's bucket.
    published_cost : ndarray, float64 [n]
        The published planner's cost of the plan (:func:`~fasttree.costmodel.features.published_cost`).
    keys : ndarray, str [n]
        Measurement keys.
    gpu : GpuSpec
        The one GPU of the set.
    trace_hash : str
        SHA-256 over the sorted measurement keys (identifies the trace set).
    """

    X: np.ndarray
    y_us: np.ndarray
    family: np.ndarray
    tree: np.ndarray
    split: np.ndarray
    default_config: np.ndarray
    dtype: np.ndarray
    published_cost: np.ndarray
    keys: np.ndarray
    gpu: GpuSpec
    trace_hash: str

    def __len__(self) -> int:
        return int(self.y_us.size)

    def domain(self) -> dict[str, list[int]]:
        """The GQA ratios and head dims the rows hold: a model fitted on them records this as
        ``extra["training_domain"]``, and the tuner warns about buckets outside it."""
        column = {name: self.X[:, FEATURE_NAMES.index(name)] for name in ("gqa", "head_dim")}
        return {
            "group_sizes": sorted({int(v) for v in np.unique(column["gqa"])}),
            "head_dims": sorted({int(v) for v in np.unique(column["head_dim"])}),
        }

    def subset(self, mask: np.ndarray) -> Dataset:
        """Rows where ``mask`` (bool [n] or indices) selects."""
        return Dataset(
            X=self.X[mask],
            y_us=self.y_us[mask],
            family=self.family[mask],
            tree=self.tree[mask],
            split=self.split[mask],
            default_config=self.default_config[mask],
            dtype=self.dtype[mask],
            published_cost=self.published_cost[mask],
            keys=self.keys[mask],
            gpu=self.gpu,
            trace_hash=self.trace_hash,
        )


def tree_id(record: dict[str, Any]) -> str:
    """Id shared by the measurements of one tree with one heads/head-dim/dtype setting and launch path
    (the runtime's measurements of a tree are ranked apart from ``tree_attention``'s)."""
    w = record["workload"]
    ident = [w["family"], w.get("seed"), w.get("params"), w["tree"], record["num_q_heads"], record["num_kv_heads"]]
    ident += [record["head_dim"], record["dtype"]]
    launch = record_launch(record)
    if launch is not None:
        ident.append(launch)
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


#: The planner's rules newer than the first traces, oldest first (fields of
#: :class:`fasttree.PlanRules` that switch one off).
_RULES = (
    "aligned_blocks", "wide_units", "whole_groups", "balanced_bins", "solo_units", "solo_split_max_kv_heads",
    "solo_min_share", "solo_recut", "crossover_margin",
)  # fmt: skip
#: The value that switches a rule off where it is not ``False``.
_RULE_OFF: dict[str, Any] = {"solo_split_max_kv_heads": 0, "solo_min_share": 2.0, "crossover_margin": 0.0}


def _switched_off(rules: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """Every non-empty combination of ``rules`` switched off (field -> off value), all of them
    first, then more rules on before fewer."""
    return tuple(
        {name: _RULE_OFF.get(name, False) for name in off}
        for n in range(len(rules), 0, -1)
        for off in itertools.combinations(rules, n)
    )


#: Rules newer than every shipped trace, switched off in each legacy rule set: the config's own
#: small split at every head dim, no-sharing plans' groups uncapped by the summed context and no
#: one-wave crossover (nor its merge-free decode).
_NEWER_THAN_TRACES: dict[str, Any] = {
    "wide_head_small_split": 0, "no_sharing_split_by_context": False, "crossover_wave_programs": 0,
    "crossover_merge_free_decode": False,
}  # fmt: skip
#: Rule sets to re-plan a record with, as it was measured: today's rules less
#: :data:`_NEWER_THAN_TRACES`, then also with all-small trees on the large tiles
#: (``all_large_without_large``), as every trace before they changed, then also every combination
#: of the older rules switched off, all of them first (how most shipped traces were planned), then
#: more rules on before fewer.
_LEGACY_RULES: tuple[PlanRules, ...] = (
    PlanRules(**_NEWER_THAN_TRACES),
    *(PlanRules(all_large_without_large=True, **_NEWER_THAN_TRACES, **off) for off in ({}, *_switched_off(_RULES))),
)
#: The rules newer than the first runtime traces, switched off the same way, to re-plan a runtime
#: record as it was measured (over the runtime's rules); :data:`_NEWER_THAN_TRACES` off in each.
_RUNTIME_LEGACY: tuple[dict[str, Any], ...] = tuple(
    {**off, **_NEWER_THAN_TRACES} for off in ({}, *_switched_off(_RULES[_RULES.index("solo_split_max_kv_heads") :]))
)
#: The first kernel version whose launches cap the KV tile of wide-head launches
#: (:attr:`fasttree.PlanRules.wide_head_kv_tile`); a runtime record measured before it is launched
#: without the cap. The cap leaves the plan as it is, so the plan summary cannot tell.
WIDE_HEAD_CAP_KERNEL = 32
#: The first kernel version whose all-large plans run tile class 1 (the large tiles) at the large
#: class's warps; before it, class 1 kept the small class's.
ALL_LARGE_WARPS_KERNEL = 33
#: The first kernel version whose ``tree_attention`` launches run a 64-row class's stage 1 with the
#: sm_90 Gluon kernel on sm_90 GPUs at its head dims (:attr:`fasttree.PlanRules.sm90_stage1`,
#: :data:`fasttree.launch_rules.SM90_TILES`); the runtime's fixed launch keeps the Triton kernel.
SM90_STAGE1_KERNEL = 35


def record_plan(record: dict[str, Any]):
    """Re-plan one measurement record with the library's planner (its tree, heads and config).

    The plan must be the one that was measured. When the record's plan summary (units per
    tile class, KV tokens read, partial rows) differs from the re-planned one, the record
    is planned again with the planner's newer rules switched off (:data:`_LEGACY_RULES`: all-small
    plans, aligned blocks, wide units, whole groups, balanced bins, the solo rules, the crossover)
    and the first plan that matches is kept;
    otherwise the re-planned one is returned (logged at DEBUG).

    A measurement of the runtime's launches (``launch`` set) is planned as the runtime plans
    and returned as the runtime launches it (:func:`fasttree.runtime_planning.plan_as_launched`),
    without the wide-head KV-tile cap when measured before :data:`WIDE_HEAD_CAP_KERNEL`; one of
    ``tree_attention`` with the warps its classes ran at the record's kernel version.
    """
    import fasttree as ft

    args = (decode_tree(record["workload"]["tree"]), FastTreeConfig.from_dict(record["config"]))
    heads = {k: record[k] for k in ("num_q_heads", "num_kv_heads", "head_dim")}
    launch = record_launch(record)
    if launch is not None:
        how = {"stage1_launches": launch["stage1_launches"], "query_centric": launch["query_centric"]}
        group_size = heads["num_q_heads"] // heads["num_kv_heads"]
        launches = resolve_stage1_launches(launch["stage1_launches"], group_size, heads["head_dim"])
        runtime = PlanRules.runtime(launches)
        if measured_kernel_version(record) < WIDE_HEAD_CAP_KERNEL:
            runtime = runtime.with_(wide_head_kv_tile=0)
        plan = plan_as_launched(*args, **heads, **how, rules=runtime)
        if record.get("plan") is not None and not _same_plan(plan, record["plan"]):
            # measured before the newest rules: the runtime's rules with some of them off
            for off in _RUNTIME_LEGACY:
                before = plan_as_launched(*args, **heads, **how, rules=runtime.with_(**off))
                if _same_plan(before, record["plan"]):
                    return before
            logger.debug("record %s: the runtime's plan differs from its measured one", record.get("key"))
        return plan
    plan = ft.plan(*args, **heads)
    measured = record.get("plan")
    if measured is not None and not _same_plan(plan, measured):
        for rules in _LEGACY_RULES:
            legacy = ft.plan(*args, **heads, rules=rules)
            if _same_plan(legacy, measured):
                plan = legacy
                break
        else:
            logger.debug("record %s: no planner rule set reproduces its measured plan", record.get("key"))
    return _launched_as_measured(plan, measured_kernel_version(record))


def _launched_as_measured(plan, kernel_version: int):
    """``plan`` with the warps its tile classes were launched with at ``kernel_version``: before
    :data:`ALL_LARGE_WARPS_KERNEL`, an all-large plan's class 1 ran the small class's."""
    if kernel_version >= ALL_LARGE_WARPS_KERNEL or plan.tile_mode != ALL_LARGE:
        return plan
    large, small = plan.tile_classes
    small = replace(small, num_warps=plan.config.launch_warps(plan.group_size)[1])
    return replace(plan, tile_classes=(large, small), _device_cache={})


def _same_plan(plan, summary: dict[str, Any]) -> bool:
    """``plan`` has the recorded summary's (``Plan.stats()`` as the profiler stored it) units per
    class, tile mode, KV tokens read and partial rows."""
    stats = plan.stats()
    return (
        list(stats["units"]) == list(summary.get("units", stats["units"]))
        and stats["tile_mode"] == summary.get("tile_mode", stats["tile_mode"])
        and stats["kv_tokens_read"] == summary.get("kv_tokens_read")
        and stats["partial_rows"] == summary.get("partial_rows")
    )


def record_features(record: dict[str, Any], gpu: GpuSpec | None = None) -> np.ndarray:
    """Feature row (float64 [len(FEATURE_NAMES)]) of one measurement record (re-planned).

    Parameters
    ----------
    record : dict
        A valid measurement record.
    gpu : GpuSpec, optional
        Default: :func:`gpu_spec` of the record's ``env``.
    """
    row = features_of_plan(record_plan(record), gpu_spec(record["env"]) if gpu is None else gpu)
    row[STAGE1_OVERLAP] *= measured_with_overlap(record)
    row[KERNEL_VERSION_COLUMN] = measured_kernel_version(record)
    launch = record_launch(record)
    if launch is not None:
        mark_runtime(row[None, :], launch["stage1_launches"])
    return row


#: Records re-planned and turned into feature rows together (their plans are held at once).
_FEATURE_BATCH = 256


def _features_chunk(records: list[dict[str, Any]], gpu: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    spec = GpuSpec.from_dict(gpu)
    X = np.empty((len(records), len(FEATURE_NAMES)))
    cost = np.empty(len(records))
    for lo in range(0, len(records), _FEATURE_BATCH):
        plans = [record_plan(r) for r in records[lo : lo + _FEATURE_BATCH]]
        X[lo : lo + len(plans)] = features_of_plans(plans, spec)  # = features_of_plan of each, batched
        cost[lo : lo + len(plans)] = [published_cost(p) for p in plans]
    X[:, STAGE1_OVERLAP] *= [measured_with_overlap(r) for r in records]
    X[:, KERNEL_VERSION_COLUMN] = [measured_kernel_version(r) for r in records]
    launched = [record_launch(r) for r in records]
    runtime = np.array([launch is not None for launch in launched], dtype=bool)
    if runtime.any():
        X[runtime] = mark_runtime(X[runtime], [launch["stage1_launches"] for launch in launched if launch])
    return X, cost


#: Commits (7-character prefixes) of the shipped traces measured before ``tree_attention`` ran a
#: plan's two stage-1 launches side by side (7ada9e2); later traces say so in
#: ``meta.profiler.stage1_overlap``.
PRE_OVERLAP_COMMITS = frozenset({"c072d8c", "d3140ff", "51c6972", "0b92d40", "c9aa805", "6ad7bd2"})


def _profiler_info(record: dict[str, Any]) -> Any:
    """The record's ``meta.profiler`` annotations (an empty dict when absent)."""
    return (record.get("meta") or {}).get("profiler") or {}


def _commit(record: dict[str, Any]) -> str:
    """The 7-character prefix of the record's ``env.git_commit`` ("" when unknown)."""
    return str(record.get("env", {}).get("git_commit") or "")[:7]


def measured_with_overlap(record: dict[str, Any]) -> bool:
    """Whether the record's two-class plan ran its stage-1 launches side by side.

    ``meta.profiler.stage1_overlap`` when the profiler wrote it, else whether the record's
    commit is not one of :data:`PRE_OVERLAP_COMMITS`. A measurement of the runtime's launches ran
    both classes' units side by side when one persistent stage-1 launch ran them all.
    """
    launch = record_launch(record)
    if launch is not None:
        return launch["stage1_launches"] == 1
    info = _profiler_info(record)
    if isinstance(info.get("stage1_overlap"), bool):
        return info["stage1_overlap"]
    return _commit(record) not in PRE_OVERLAP_COMMITS


#: Kernel version (:data:`fasttree.versions.KERNEL_VERSION`: a row of ``docs/history.md``'s
#: table) of the commits (7-character prefixes) of the shipped traces that predate
#: ``meta.profiler.kernel_version``: the newest row that moved GPU time and whose commit is an
#: ancestor of the trace's. Rows that change only the host path (v10) or the planner (v18, v31)
#: do not count, so 0b92d40 times v9's kernels, 85069fd v17's and 99e70e8 v30's. (Failed lines written
#: before the profiler annotated every line carry no ``meta.profiler.kernel_version``, and are looked up here
#: too: 9a6a950's runtime traces.)
KERNEL_VERSION_OF_COMMIT = {
    "1fd251a": 3,
    "c072d8c": 9,
    "d3140ff": 9,
    "51c6972": 9,
    "0b92d40": 9,
    "c9aa805": 11,
    "6ad7bd2": 14,
    "cfea378": 17,
    "1f5a7ad": 17,
    "85069fd": 17,
    "99e70e8": 30,
    "9a6a950": 30,
}


def measured_kernel_version(record: dict[str, Any]) -> int:
    """The kernel version a measurement record timed.

    ``meta.profiler.kernel_version`` when the profiler wrote it, else the record's commit in
    :data:`KERNEL_VERSION_OF_COMMIT`, else the running kernels' (:data:`fasttree.versions.KERNEL_VERSION`:
    a trace of an unknown commit is taken for a trace of these kernels).
    """
    info = _profiler_info(record)
    version = info.get("kernel_version") if isinstance(info, dict) else None
    if is_int(version) and version >= 0:
        return int(version)
    return KERNEL_VERSION_OF_COMMIT.get(_commit(record), KERNEL_VERSION)


#: The oldest kernel version whose records can have timed today's launches: the kernel changes
#: after it (:data:`WIDE_HEAD_CAP_KERNEL`, :data:`ALL_LARGE_WARPS_KERNEL`,
#: :data:`SM90_STAGE1_KERNEL`) reach only some plans.
_COMPARABLE_SINCE = 30


def timed_todays_launches(record: dict[str, Any]) -> bool:
    """Whether a measurement record timed the launches today's kernels make of its plan: it was
    measured with :data:`fasttree.versions.KERNEL_VERSION`, or with a version from
    :data:`_COMPARABLE_SINCE` on that no later change reaches. The wide-head KV-tile cap reaches
    every record above head dim 128 (counted whether or not its tile was capped); the all-large
    warps a ``tree_attention`` record of an all-large plan whose config gives its two classes
    different warps (and one without a plan summary); the sm_90 Gluon stage 1 a ``tree_attention``
    record on an sm_90 GPU at a head dim it runs whose plan has a 64-row class with units (and one
    without a plan summary). For the held-out traces that calibrate the tuner's margins: a kernel
    change leaves the measurements it does not reach usable."""
    version = measured_kernel_version(record)
    if version >= KERNEL_VERSION:
        return True
    if version < _COMPARABLE_SINCE or (version < WIDE_HEAD_CAP_KERNEL and record["head_dim"] > 128):
        return False
    if version < SM90_STAGE1_KERNEL and _reached_by_sm90_stage1(record):
        return False
    if version < ALL_LARGE_WARPS_KERNEL and record_launch(record) is None:
        mode = (record.get("plan") or {}).get("tile_mode")
        warps = FastTreeConfig.from_dict(record["config"]).launch_warps(record["num_q_heads"] // record["num_kv_heads"])
        return mode is not None and (mode != ALL_LARGE or warps[0] == warps[1])
    return True


def _reached_by_sm90_stage1(record: dict[str, Any]) -> bool:
    """Whether the sm_90 Gluon stage 1 (:data:`SM90_STAGE1_KERNEL`) runs a launch of the record's
    plan today: a ``tree_attention`` record measured on an sm_90 GPU (``env.compute_capability``
    9.x) whose plan summary has units in a tile class the Gluon kernel runs
    (:func:`fasttree.launch_rules.sm90_tile_class` of its rows, :func:`fasttree.plan_arrays.tile_rows`);
    a record without that summary, at a head dim the kernel runs, counts as reached."""
    env = record.get("env") or {}
    if record_launch(record) is not None or not str(env.get("compute_capability", "")).startswith("9."):
        return False
    d, g = record["head_dim"], record["num_q_heads"] // record["num_kv_heads"]
    summary = record.get("plan") or {}
    q_tiles, units = summary.get("q_tiles"), summary.get("units")
    if not q_tiles or not units:
        return sm90_tile_class(64, d)  # the kernel's one class: 64 rows
    return any(n > 0 and sm90_tile_class(tile_rows(q, g), d) for q, n in zip(q_tiles, units, strict=True))


def _is_default(record: dict[str, Any]) -> bool:
    info = _profiler_info(record)
    return bool(info.get("default_config")) if isinstance(info, dict) else False


def _default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def load_dataset(
    paths: str | os.PathLike | list[str | os.PathLike],
    *,
    skip_invalid: bool = False,
    workers: int | None = None,
    min_rows: int = 1,
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> Dataset:
    """Read measurement traces and build their :class:`Dataset`.

    Parameters
    ----------
    paths : path or list of paths
        Trace files or folders (``*.jsonl``, ``*.jsonl.gz`` below them).
    skip_invalid : bool
        Skip (and log) invalid lines instead of raising.
    workers : int, optional
        Processes that re-plan the records (default ``min(8, cpu count)``; 1: in this process).
    min_rows : int
        Fewest ``ok`` measurements the set must hold (after ``keep``).
    keep : callable, optional
        Keeps only the measurement records for which it returns true (before the costly re-planning).
        Measurements of the runtime's launch variants (``fasttree-tune validate``'s) are always left
        out: the model's runtime target is the runtime's fixed launch.

    Returns
    -------
    Dataset

    Raises
    ------
    ValueError
        On an invalid line (unless ``skip_invalid``), fewer than ``min_rows`` ok
        measurements, measurements of several GPUs, or a GPU without facts.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("no trace paths given")
    ts = read_traces([Path(p) for p in paths], kind="measurement", skip_invalid=skip_invalid)
    for file, line, reason in ts.invalid:
        logger.warning("%s:%s: skipped: %s", file, line, reason)
    # one measurement per key (a key measured again, e.g. to gauge the spread, counts once: the first)
    records = list({r["key"]: r for r in reversed(ts.records) if r["status"] == "ok"}.values())[::-1]
    variants = sum(timed_launch_variants(r) for r in records)
    if variants:  # the model's runtime target is the fixed launch; these timed the launch variants
        logger.info("%d measurements of the runtime's launch variants left out (validate's)", variants)
        records = [r for r in records if not timed_launch_variants(r)]
    if keep is not None:
        records = [r for r in records if keep(r)]
    if len(records) < min_rows:
        raise ValueError(f"{', '.join(map(str, paths))}: {len(records)} ok measurements, need at least {min_rows}")
    gpus = sorted({r["env"]["gpu_name"] for r in records})
    if len(gpus) != 1:
        raise ValueError(f"the traces mix GPUs {gpus}: fit or evaluate one GPU at a time")
    gpu = gpu_spec(records[0]["env"])
    workers = _default_workers() if workers is None else max(1, int(workers))
    if workers == 1 or len(records) < 256:
        X, cost = _features_chunk(records, gpu.to_dict())
    else:
        chunks = [records[i::workers] for i in range(workers)]
        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(_features_chunk, chunks, [gpu.to_dict()] * workers))
        X = np.empty((len(records), len(FEATURE_NAMES)))
        cost = np.empty(len(records))
        for i, (part, part_cost) in enumerate(parts):
            X[i::workers] = part
            cost[i::workers] = part_cost
    keys = np.array([r["key"] for r in records])
    return Dataset(
        X=X,
        y_us=np.array([float(r["timing"]["graph_us"]["median"]) for r in records]),
        family=np.array([r["workload"]["family"] for r in records]),
        tree=np.array([tree_id(r) for r in records]),
        split=np.array([str((r.get("meta") or {}).get("split", "unmarked")) for r in records]),
        default_config=np.array([_is_default(r) for r in records]),
        dtype=np.array([str(r["dtype"]) for r in records]),
        published_cost=cost,
        keys=keys,
        gpu=gpu,
        trace_hash=hashlib.sha256("\n".join(sorted(keys.tolist())).encode()).hexdigest(),
    )
