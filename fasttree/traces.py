"""Versioned trace files: GPU measurements and serving workloads, one JSON object per line.

Two record kinds share one envelope (``schema``, ``schema_version``, ``kind``) and one
tree encoding (:func:`encode_tree` / :func:`decode_tree`):

* ``"measurement"`` -- one timed run of the tree-attention kernels: environment,
  workload tree, heads, dtype, the full :class:`~fasttree.config.FastTreeConfig`, a
  summary of the plan and graph-replay / eager timings (or the error of a failed run),
  identified by a stable :func:`measurement_key`.
* ``"workload"`` -- a tree shape a server saw at one decode step, with a weight and no
  timing: the input the tuner optimises for.

``traces/README.md`` documents every field. Files are ``.jsonl`` (appendable) or
``.jsonl.gz`` (finished sets). :class:`TraceWriter` appends atomically and repairs a torn
last line on open; :func:`read_traces` validates every line and names the file and line
of each problem; :func:`validate` lists the problems of one record.

This module needs only the standard library, numpy and fasttree's tree and config
(no torch), so it can run on the serving side.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from .config import PACKING_FIELDS, FastTreeConfig
from .tree import KVTree
from .validation import check_choice, check_int, check_nonempty_str, check_number, is_int

try:  # POSIX advisory locks keep concurrent writers of one file from interleaving a repair
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Value of every record's ``schema`` field.
SCHEMA = "fasttree-trace"
#: The format version this module reads and writes.
SCHEMA_VERSION = 1
#: Record kinds.
KINDS = ("measurement", "workload")
#: Accepted ``dtype`` values.
DTYPES = ("float16", "bfloat16")
#: Version of the :func:`measurement_key` derivation (part of the hashed payload).
KEY_VERSION = 1

#: Environment fields of a measurement (all required; extra keys are allowed).
ENV_FIELDS = (
    "gpu_name",
    "gpu_sm_count",
    "compute_capability",
    "memory_clock_mhz",
    "driver",
    "torch",
    "triton",
    "fasttree",
    "git_commit",
)

_TREE_FIELDS = ("parents", "lengths", "query_nodes")

# Resource limits of a file's input, each far above what the shipped traces hold and far below
# exhausting memory (the tuner keeps every workload step's tree, 4 bytes per token, and the cost
# model's work arrays allocate per token). The shipped trace files' largest tree holds 1,048,543
# tokens (traces/h200), 2,865 nodes and 2,044 queries (traces/h200_heldout); the largest workload
# tree 278,816 tokens, 1,401 nodes and 1,024 queries (the shipped workloads, paper-suite case 8).
#: Most KV tokens (the sum of ``lengths``) a tree of a trace line may hold: 16x the largest shipped.
MAX_TREE_TOKENS = 2**24
#: Most nodes a tree of a trace line may hold: 366x the largest shipped.
MAX_TREE_NODES = 2**20
#: Most queries a tree of a trace line may hold: 64x the largest shipped.
MAX_TREE_QUERIES = 2**17
#: Most KV tokens the workload steps one tuning run reads may hold together (``fasttree-tune tune`` keeps
#: every step's tree): 4.8x the shipped tuning workloads (55,723,566 tokens in 2,093 steps).
MAX_WORKLOAD_TOKENS = 2**28
#: Longest trace line (bytes, its newline included) :func:`read_traces` reads: a line is read with a
#: bounded ``readline``, so a crafted line (a 3 GiB run in a 3 MB gzip) costs at most this much
#: memory. The longest shipped line is 28,216 bytes (a measurement, traces/h200_heldout); a tree at
#: the limits above encodes in about 18 MB.
MAX_LINE_BYTES = 64 * 2**20
_COMMON_REQUIRED = ("schema", "schema_version", "kind", "workload", "num_q_heads", "num_kv_heads", "head_dim", "dtype")
_REQUIRED = {
    "measurement": (
        *_COMMON_REQUIRED,
        "key",
        "env",
        "config",
        "plan",
        "status",
        "error",
        "timing",
        "correct",
        "max_rel_err",
        "time_utc",
    ),
    "workload": _COMMON_REQUIRED,
}
_OPTIONAL = {"measurement": ("meta", "launch"), "workload": ("weight", "meta")}
#: ``launch.kind`` of a measurement of :class:`fasttree.runtime.TreeAttentionRuntime`'s launches (a record
#: without ``launch`` timed ``fasttree.tree_attention``'s per-plan launches).
RUNTIME_LAUNCH = "runtime"
#: ``launch.kind`` of a measurement of the runtime as a server runs it: its launch variants
#: (``tree_attention``'s own launches over the runtime's buffers). ``RUNTIME_LAUNCH``: its fixed
#: persistent launch (``max_variants=0``), what the profiler's traces and the latency model time.
RUNTIME_VARIANTS_LAUNCH = "runtime_variants"
#: Fields of a measurement's ``launch`` object, and the values each may take.
_LAUNCH_VALUES = {
    "kind": (RUNTIME_LAUNCH, RUNTIME_VARIANTS_LAUNCH),
    "stage1_launches": (1, 2),
    "query_centric": ("auto", "never", "always"),
}
_WORKLOAD_REQUIRED = {
    "measurement": ("family", "seed", "tree"),
    "workload": ("family", "scenario", "step", "seed", "tree"),
}
_GRAPH_TIMING_FIELDS = ("median", "p20", "p80", "replays", "calls_per_graph")
_EAGER_TIMING_FIELDS = ("median",)
_EAGER_TIMING_OPTIONAL = ("p20", "p80")
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_CC_RE = re.compile(r"\d+\.\d+")


class TraceError(ValueError):
    """A trace line or record that breaks the format.

    Parameters
    ----------
    message : str
        What is wrong.
    path : str or None
        File the line came from.
    line : int or None
        1-based line number in ``path``.
    """

    def __init__(self, message: str, path: str | None = None, line: int | None = None) -> None:
        self.path = path
        self.line = line
        self.reason = message
        where = f"{path}:{line}: " if path is not None and line is not None else (f"{path}: " if path else "")
        super().__init__(where + message)


# --------------------------------------------------------------------- trees
def encode_tree(tree: KVTree) -> dict[str, list[int]]:
    """Compact JSON encoding of a tree's shape.

    Parameters
    ----------
    tree : KVTree

    Returns
    -------
    dict
        ``{"parents": [...], "lengths": [...], "query_nodes": [...]}`` as plain int lists.
        Slot ids are not kept: :func:`decode_tree` lays the nodes out in contiguous slots,
        which does not change the plan or the kernels' work.
    """
    if not isinstance(tree, KVTree):
        raise TypeError(f"encode_tree takes a KVTree, got {type(tree).__name__}")
    return {
        "parents": tree.parents.tolist(),
        "lengths": tree.lengths.tolist(),
        "query_nodes": tree.query_nodes.tolist(),
    }


def decode_tree(d: Any) -> KVTree:
    """Rebuild a tree from :func:`encode_tree` output (contiguous slots).

    Parameters
    ----------
    d : dict
        ``{"parents", "lengths", "query_nodes"}``, each a list of ints.

    Returns
    -------
    KVTree

    Raises
    ------
    ValueError
        When ``d`` is not such a dict (missing or unknown keys, non-integer entries),
        holds more than a trace tree may (:data:`MAX_TREE_NODES` nodes,
        :data:`MAX_TREE_QUERIES` queries, :data:`MAX_TREE_TOKENS` tokens: checked before
        anything is allocated per token), or does not describe a valid tree (empty, parent
        out of range, cycle, negative length, query out of range or with an empty context).
    """
    if not isinstance(d, dict):
        raise ValueError(f"a tree encoding must be an object, got {type(d).__name__}")
    missing = [k for k in _TREE_FIELDS if k not in d]
    if missing:
        raise ValueError(f"tree encoding lacks {missing}")
    unknown = sorted(set(d) - set(_TREE_FIELDS))
    if unknown:
        raise ValueError(f"tree encoding has unknown keys {unknown}")
    arrays = []
    for name in _TREE_FIELDS:
        value = d[name]
        if not isinstance(value, (list, tuple, np.ndarray)):
            raise ValueError(f"tree.{name} must be a list of integers, got {type(value).__name__}")
        limit, what = (MAX_TREE_QUERIES, "queries") if name == "query_nodes" else (MAX_TREE_NODES, "nodes")
        if len(value) > limit:
            raise ValueError(f"tree.{name} holds {len(value)} {what}, more than a trace tree may hold ({limit})")
        if isinstance(value, np.ndarray):
            ints = value.size == 0 or value.dtype.kind in "iu"
        else:  # fast path for parsed JSON (plain ints), then the general check (numpy scalars)
            ints = set(map(type, value)) <= {int} or all(is_int(v) for v in value)
        if not ints:
            raise ValueError(f"tree.{name} must hold only integers")
        try:
            arrays.append(np.asarray(value, dtype=np.int64) if len(value) else np.zeros(0, dtype=np.int64))
        except OverflowError:
            raise ValueError(f"tree.{name} holds an integer beyond the int64 range") from None
    parents, lengths, query_nodes = arrays
    largest = int(lengths.max()) if lengths.size else 0  # first: then the sum of the lengths fits int64
    if largest > MAX_TREE_TOKENS:
        raise ValueError(f"a node holds {largest} tokens, more than a trace tree may hold ({MAX_TREE_TOKENS})")
    total = int(lengths.clip(min=0).sum())
    if total > MAX_TREE_TOKENS:
        raise ValueError(f"the tree holds {total} tokens, more than a trace tree may hold ({MAX_TREE_TOKENS})")
    return KVTree.from_lengths(parents, lengths, query_nodes)


# ---------------------------------------------------------------------- keys
def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _config_dict(
    config: FastTreeConfig | dict[str, Any], num_q_heads: Any, num_kv_heads: Any, head_dim: Any
) -> dict[str, Any]:
    """The config as records store and keys hash it: warps and stages derived from the GQA
    ratio and head dim (``num_warps=None``, ``num_stages=None``) written out as the launches
    ran them, so one measurement has one key whatever the defaults are when it is written or read."""
    cfg = config if isinstance(config, FastTreeConfig) else FastTreeConfig.from_dict(config)
    ratio_known = is_int(num_q_heads) and is_int(num_kv_heads) and min(num_q_heads, num_kv_heads) > 0
    if not ratio_known or num_q_heads % num_kv_heads:
        return cfg.to_dict()
    g = int(num_q_heads) // int(num_kv_heads)
    if cfg.num_warps is None:
        cfg = replace(cfg, num_warps=cfg.launch_warps(g))
    if cfg.num_stages is None and is_int(head_dim) and head_dim > 0:
        cfg = replace(cfg, num_stages=cfg.launch_stages(g, int(head_dim)))
    return cfg.to_dict()


def _key_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as a key hashes it: with packing off (``pack_tokens == 0``, where
    ``pack_min_units`` does not matter) it is written as schema version 1, which had
    neither field, so measurements made before packing keep their keys."""
    if config.get("pack_tokens") != 0:
        return config
    out = {k: v for k, v in config.items() if k not in PACKING_FIELDS}
    out["schema_version"] = 1
    return out


def _normalise_dtype(dtype: Any) -> str:
    name = str(dtype)
    return name[len("torch.") :] if name.startswith("torch.") else name


def _key_digest(
    tree: dict[str, list[int]],
    family: str,
    seed: int | None,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    config: dict[str, Any],
    gpu_name: str,
    launch: dict[str, Any] | None = None,
) -> str:
    fields = {
        "key_version": KEY_VERSION,
        "tree": tree,
        "family": family,
        "seed": seed,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "config": _key_config(config),
        "gpu_name": gpu_name,
    }
    if launch is not None:  # absent for tree_attention's launches, so their keys stay as they were
        fields["launch"] = launch
    payload = _jsonable(fields)
    return hashlib.sha256(_canonical_json(payload).encode()).hexdigest()


def measurement_key(
    tree: KVTree | dict[str, Any],
    *,
    family: str,
    seed: int | None,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    config: FastTreeConfig | dict[str, Any],
    gpu_name: str,
    launch: dict[str, Any] | None = None,
) -> str:
    """Stable identity of a measurement: SHA-256 hex digest of its canonical JSON.

    The hashed payload holds the tree encoding, family and seed, heads, head dim,
    dtype, the full config (normalised through :class:`FastTreeConfig`, so ``1`` and
    ``1.0`` hash alike), the GPU name and, for a runtime measurement, its ``launch``
    (:func:`runtime_launch`), serialised with sorted keys and no spaces.
    Timings, plan summary, software versions and time are not part of it, so a resumed
    profiler finds the keys it already measured on the same GPU model.

    Parameters
    ----------
    tree : KVTree or dict
        The tree or its :func:`encode_tree` encoding.
    family : str
    seed : int or None
    num_q_heads, num_kv_heads, head_dim : int
    dtype : str
        ``"float16"`` or ``"bfloat16"`` (``torch.float16`` style names are accepted).
    config : FastTreeConfig or dict
    gpu_name : str
    launch : dict, optional
        :func:`runtime_launch` of a measurement of the runtime's launches.

    Returns
    -------
    str
        64 lowercase hex digits.

    Raises
    ------
    ValueError
        On a bad tree encoding or config.
    """
    enc = encode_tree(tree if isinstance(tree, KVTree) else decode_tree(tree))
    return _key_digest(
        enc,
        family,
        seed,
        num_q_heads,
        num_kv_heads,
        head_dim,
        _normalise_dtype(dtype),
        _config_dict(config, num_q_heads, num_kv_heads, head_dim),
        str(gpu_name),
        _checked_launch(launch),
    )


def runtime_launch(*, stage1_launches: int, query_centric: str = "auto", variants: bool = False) -> dict[str, Any]:
    """The ``launch`` object of a measurement of :class:`fasttree.runtime.TreeAttentionRuntime`.

    Parameters
    ----------
    stage1_launches : {1, 2}
        The runtime's resolved stage-1 launches.
    query_centric : {"auto", "never", "always"}
    variants : bool
        Timed with its launch variants (kind :data:`RUNTIME_VARIANTS_LAUNCH`), else its fixed
        persistent launch (kind :data:`RUNTIME_LAUNCH`).

    Raises
    ------
    ValueError
        On a value outside those.
    """
    kind = RUNTIME_VARIANTS_LAUNCH if variants else RUNTIME_LAUNCH
    return _checked_launch({"kind": kind, "stage1_launches": stage1_launches, "query_centric": query_centric})


def _launch_problems(launch: Any) -> list[str]:
    if not isinstance(launch, dict):
        return [f"launch must be an object, got {type(launch).__name__}"]
    p = [f"launch.{k} is missing" for k in _LAUNCH_VALUES if k not in launch]
    p += [f"launch has an unknown field {k!r}" for k in launch if k not in _LAUNCH_VALUES]
    for k, allowed in _LAUNCH_VALUES.items():
        v = launch.get(k)
        if k in launch:
            _collect(p, check_choice, f"launch.{k}", v, allowed)
    return p


def _checked_launch(launch: dict[str, Any] | None) -> dict[str, Any] | None:
    if launch is None:
        return None
    problems = _launch_problems(launch)
    if problems:
        raise ValueError("; ".join(problems))
    return dict(launch)


def record_launch(record: dict[str, Any]) -> dict[str, Any] | None:
    """The ``launch`` of a measurement record: :func:`runtime_launch`'s object, or None when the
    record timed ``fasttree.tree_attention``'s per-plan launches."""
    return record.get("launch")


def timed_launch_variants(record: dict[str, Any]) -> bool:
    """Whether a measurement record timed the runtime's launch variants (as servers run it)."""
    launch = record.get("launch")
    return launch is not None and launch.get("kind") == RUNTIME_VARIANTS_LAUNCH


# ------------------------------------------------------------------- records
def utc_now() -> str:
    """Current UTC time as ISO 8601 with a ``Z`` suffix (the ``time_utc`` format)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _jsonable(obj: Any) -> Any:
    """Plain-JSON copy: tuples and arrays become lists, numpy scalars Python numbers."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def plan_summary(plan: Any) -> dict[str, Any]:
    """JSON-ready summary of a :class:`~fasttree.plan_arrays.Plan` (its ``stats()``).

    Parameters
    ----------
    plan : Plan
        Anything with a ``stats()`` method returning a dict.

    Returns
    -------
    dict
        ``units`` per tile class, ``groups``, ``pairs``, ``partial_rows``,
        ``merged_queries``, ``kv_tokens_read``, ``kv_bytes_read``, ``flops``,
        ``tile_mode``, ``splits``, ``q_tiles`` (tuples as lists).
    """
    return _jsonable(plan.stats())


def measurement_record(
    *,
    env: dict[str, Any],
    family: str,
    seed: int | None,
    tree: KVTree | dict[str, Any],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    config: FastTreeConfig | dict[str, Any],
    plan: Any = None,
    status: str = "ok",
    timing: dict[str, Any] | None = None,
    error: str | None = None,
    correct: bool | None = None,
    max_rel_err: float | None = None,
    params: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    time_utc: str | None = None,
    launch: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a ``"measurement"`` record with its key (not validated: the writer does that).

    Parameters
    ----------
    env : dict
        :data:`ENV_FIELDS` (``gpu_name`` enters the key).
    family, seed, tree
        Workload identity; ``tree`` a KVTree or its encoding.
    num_q_heads, num_kv_heads, head_dim : int
    dtype : str
    config : FastTreeConfig or dict
    plan : Plan, dict or None
        A Plan is summarised with :func:`plan_summary`; None when planning failed.
    status : {"ok", "failed"}
    timing : dict or None
        ``{"graph_us": {median, p20, p80, replays, calls_per_graph}, "eager_us": {median}}``.
    error : str or None
        Required when ``status == "failed"``.
    correct : bool or None
    max_rel_err : float or None
    params : dict or None
        Free-form generator parameters stored as ``workload.params``.
    meta : dict or None
        Free-form record annotations (e.g. ``{"split": "heldout"}``).
    time_utc : str or None
        Defaults to :func:`utc_now`.
    launch : dict or None
        :func:`runtime_launch` when the runtime's launches were timed (None:
        ``fasttree.tree_attention``'s).

    Returns
    -------
    dict
    """
    enc = encode_tree(tree if isinstance(tree, KVTree) else decode_tree(tree))
    cfg = _config_dict(config, num_q_heads, num_kv_heads, head_dim)
    launch = _checked_launch(launch)
    dtype = _normalise_dtype(dtype)
    workload: dict[str, Any] = {"family": family, "seed": seed, "tree": enc}
    if params is not None:
        workload["params"] = _jsonable(params)
    if plan is not None and not isinstance(plan, dict):
        plan = plan_summary(plan)
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "kind": "measurement",
        "key": _key_digest(
            enc,
            family,
            seed,
            num_q_heads,
            num_kv_heads,
            head_dim,
            dtype,
            cfg,
            str(env.get("gpu_name")),
            launch,
        ),
        "env": _jsonable(env),
        "workload": workload,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "config": cfg,
        "plan": _jsonable(plan),
        "status": status,
        "error": error,
        "timing": _jsonable(timing),
        "correct": correct,
        "max_rel_err": max_rel_err,
        "time_utc": time_utc if time_utc is not None else utc_now(),
    }
    if launch is not None:
        record["launch"] = launch
    if meta is not None:
        record["meta"] = _jsonable(meta)
    return record


def workload_record(
    *,
    family: str,
    scenario: str,
    step: int,
    seed: int | None,
    tree: KVTree | dict[str, Any],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    weight: float = 1.0,
    params: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a ``"workload"`` record: one decode-step tree shape, no timing.

    Parameters
    ----------
    family : str
        Generator family (e.g. ``"paper"``, ``"few_shot"``).
    scenario : str
        Serving scenario the step belongs to.
    step : int
        Decode step index (>= 0) within the scenario.
    seed : int or None
    tree : KVTree or dict
    num_q_heads, num_kv_heads, head_dim : int
    dtype : str
    weight : float
        Relative importance (> 0) of this tree in the tuner's objective.
    params, meta : dict or None
        Free-form, as in :func:`measurement_record`.

    Returns
    -------
    dict
    """
    enc = encode_tree(tree if isinstance(tree, KVTree) else decode_tree(tree))
    workload: dict[str, Any] = {"family": family, "scenario": scenario, "step": step, "seed": seed, "tree": enc}
    if params is not None:
        workload["params"] = _jsonable(params)
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "kind": "workload",
        "workload": workload,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": _normalise_dtype(dtype),
        "weight": weight,
    }
    if meta is not None:
        record["meta"] = _jsonable(meta)
    return record


# ---------------------------------------------------------------- validation
def _collect(p: list[str], check: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Run one of :mod:`fasttree.validation`'s checks; its ``ValueError`` becomes a problem in ``p``."""
    try:
        check(*args, **kwargs)
    except ValueError as exc:
        p.append(str(exc))
        return False
    return True


def _check_int(p: list[str], name: str, v: Any, lo: int, *, nullable: bool = False) -> bool:
    if v is None and nullable:
        return True
    expected = f"an integer >= {lo}{' or null' if nullable else ''}"
    return _collect(p, check_int, name, v, minimum=lo, expected=expected)


def _check_str(p: list[str], name: str, v: Any, *, nullable: bool = False) -> bool:
    if v is None and nullable:
        return True
    return _collect(p, check_nonempty_str, name, v, expected="a non-empty string or null" if nullable else None)


def _check_positive(p: list[str], name: str, v: Any) -> bool:
    return _collect(p, check_number, name, v, above=0, expected="a finite number > 0")


def _check_free_form(p: list[str], name: str, v: Any) -> None:
    """A free-form object: any JSON, but no non-finite numbers."""
    if not isinstance(v, dict):
        p.append(f"{name} must be an object, got {type(v).__name__}")
        return
    stack: list[tuple[str, Any]] = [(name, v)]
    while stack:
        where, obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend((f"{where}.{k}", x) for k, x in obj.items())
        elif isinstance(obj, (list, tuple)):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(obj))
        elif isinstance(obj, float) and not math.isfinite(obj):
            p.append(f"{where} is {obj!r}: numbers must be finite")


def _check_fields(p: list[str], name: str, obj: dict, required: Iterable[str], optional: Iterable[str] = ()) -> None:
    required = tuple(required)
    missing = [k for k in required if k not in obj]
    if missing:
        p.append(f"{name} lacks required field(s) {missing}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        p.append(f"{name} has unknown field(s) {unknown}")


def _check_timing(p: list[str], timing: Any) -> None:
    if not isinstance(timing, dict):
        p.append(f"timing must be an object for status 'ok', got {type(timing).__name__}")
        return
    _check_fields(p, "timing", timing, ("graph_us", "eager_us"))
    graph = timing.get("graph_us")
    if "graph_us" in timing:
        if not isinstance(graph, dict):
            p.append(f"timing.graph_us must be an object, got {type(graph).__name__}")
        else:
            _check_fields(p, "timing.graph_us", graph, _GRAPH_TIMING_FIELDS)
            ok = all(
                _check_positive(p, f"timing.graph_us.{k}", graph[k]) for k in ("median", "p20", "p80") if k in graph
            )
            for k in ("replays", "calls_per_graph"):
                if k in graph:
                    _check_int(p, f"timing.graph_us.{k}", graph[k], 1)
            has_all = ok and all(k in graph for k in ("median", "p20", "p80"))
            if has_all and not graph["p20"] <= graph["median"] <= graph["p80"]:
                p.append(
                    f"timing.graph_us must have p20 <= median <= p80, got "
                    f"{graph['p20']!r}, {graph['median']!r}, {graph['p80']!r}"
                )
    eager = timing.get("eager_us")
    if "eager_us" in timing:
        if not isinstance(eager, dict):
            p.append(f"timing.eager_us must be an object, got {type(eager).__name__}")
        else:
            _check_fields(p, "timing.eager_us", eager, _EAGER_TIMING_FIELDS, _EAGER_TIMING_OPTIONAL)
            for k in (*_EAGER_TIMING_FIELDS, *_EAGER_TIMING_OPTIONAL):
                if k in eager:
                    _check_positive(p, f"timing.eager_us.{k}", eager[k])


def _check_env(p: list[str], env: Any) -> None:
    if not isinstance(env, dict):
        p.append(f"env must be an object, got {type(env).__name__}")
        return
    missing = [k for k in ENV_FIELDS if k not in env]
    if missing:
        p.append(f"env lacks required field(s) {missing}")
    if "gpu_name" in env:
        _check_str(p, "env.gpu_name", env["gpu_name"])
    if "gpu_sm_count" in env:
        _check_int(p, "env.gpu_sm_count", env["gpu_sm_count"], 1)
    if "compute_capability" in env:
        cc = env["compute_capability"]
        if not isinstance(cc, str) or not _CC_RE.fullmatch(cc):
            p.append(f"env.compute_capability must be a 'major.minor' string such as '9.0', got {cc!r}")
    if "memory_clock_mhz" in env:
        _check_int(p, "env.memory_clock_mhz", env["memory_clock_mhz"], 1, nullable=True)
    for k in ("driver", "torch", "triton", "fasttree", "git_commit"):
        if k in env:
            _check_str(p, f"env.{k}", env[k], nullable=True)
    extra = {k: v for k, v in env.items() if k not in ENV_FIELDS}
    if extra:
        _check_free_form(p, "env", extra)


def parse_time_utc(text: str) -> datetime:
    """A ``time_utc`` string (ISO 8601, ``Z`` or an offset) as an aware datetime; ``ValueError`` if not ISO 8601."""
    return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)


def _check_time(p: list[str], v: Any) -> None:
    if not isinstance(v, str):
        p.append(f"time_utc must be an ISO 8601 UTC string, got {v!r}")
        return
    try:
        t = parse_time_utc(v)
    except ValueError:
        p.append(f"time_utc {v!r} is not ISO 8601")
        return
    if t.utcoffset() is None or t.utcoffset().total_seconds() != 0:
        p.append(f"time_utc {v!r} must be in UTC (suffix 'Z' or '+00:00')")


def _validate(record: Any) -> tuple[list[str], KVTree | None, FastTreeConfig | None]:
    if not isinstance(record, dict):
        return [f"a trace line must be a JSON object, got {type(record).__name__}"], None, None
    if record.get("schema") != SCHEMA:
        return [f"schema must be {SCHEMA!r}, got {record.get('schema')!r}"], None, None
    version = record.get("schema_version")
    if not is_int(version) or version != SCHEMA_VERSION:
        return [f"schema_version {version!r} is not supported (this reader knows {SCHEMA_VERSION})"], None, None
    kind = record.get("kind")
    p: list[str] = []
    if not _collect(p, check_choice, "kind", kind, KINDS):
        return p, None, None

    _check_fields(p, "record", record, _REQUIRED[kind], _OPTIONAL[kind])

    tree: KVTree | None = None
    wl = record.get("workload")
    if "workload" in record:
        if not isinstance(wl, dict):
            p.append(f"workload must be an object, got {type(wl).__name__}")
        else:
            _check_fields(p, "workload", wl, _WORKLOAD_REQUIRED[kind], ("params",))
            if "family" in wl:
                _check_str(p, "workload.family", wl["family"])
            if "seed" in wl:
                _check_int(p, "workload.seed", wl["seed"], 0, nullable=True)
            if "scenario" in wl:
                _check_str(p, "workload.scenario", wl["scenario"])
            if "step" in wl:
                _check_int(p, "workload.step", wl["step"], 0)
            if "params" in wl:
                _check_free_form(p, "workload.params", wl["params"])
            if "tree" in wl:
                try:
                    tree = decode_tree(wl["tree"])
                except ValueError as exc:
                    p.append(f"workload.tree is not a valid tree: {exc}")

    heads_ok = _check_int(p, "num_q_heads", record.get("num_q_heads"), 1) if "num_q_heads" in record else False
    heads_ok &= _check_int(p, "num_kv_heads", record.get("num_kv_heads"), 1) if "num_kv_heads" in record else False
    if heads_ok and record["num_q_heads"] % record["num_kv_heads"]:
        p.append(f"num_q_heads ({record['num_q_heads']}) must be a multiple of num_kv_heads ({record['num_kv_heads']})")
    if "head_dim" in record:
        _check_int(p, "head_dim", record["head_dim"], 1)
    if "dtype" in record:
        _collect(p, check_choice, "dtype", record["dtype"], DTYPES)
    if "meta" in record:
        _check_free_form(p, "meta", record["meta"])

    config: FastTreeConfig | None = None
    if kind == "workload":
        if "weight" in record:
            _check_positive(p, "weight", record["weight"])
        return p, tree, config

    if "env" in record:
        _check_env(p, record["env"])
    if "launch" in record:
        p += _launch_problems(record["launch"])
    if "config" in record:
        try:
            config = FastTreeConfig.from_dict(record["config"])
        except (ValueError, TypeError) as exc:
            p.append(f"config does not load as a FastTreeConfig: {exc}")
    status = record.get("status")
    if "status" in record and status not in ("ok", "failed"):
        p.append(f"status must be 'ok' or 'failed', got {status!r}")
    if "plan" in record:
        plan = record["plan"]
        if plan is None:
            if status == "ok":
                p.append("plan must be an object for status 'ok', got null")
        else:
            _check_free_form(p, "plan", plan)
    if "error" in record:
        err = record["error"]
        if status == "failed":
            _check_str(p, "error", err)
        elif status == "ok" and err is not None:
            p.append(f"error must be null for status 'ok', got {err!r}")
    if "timing" in record:
        if status == "ok":
            _check_timing(p, record["timing"])
        elif status == "failed" and record["timing"] is not None:
            p.append("timing must be null for status 'failed'")
    if "correct" in record and record["correct"] is not None and not isinstance(record["correct"], bool):
        p.append(f"correct must be true, false or null, got {record['correct']!r}")
    if "max_rel_err" in record:
        err = record["max_rel_err"]
        if err is not None:
            _collect(p, check_number, "max_rel_err", err, minimum=0, expected="a finite number >= 0 or null")
    if "time_utc" in record:
        _check_time(p, record["time_utc"])
    key = record.get("key")
    if "key" in record and (not isinstance(key, str) or not _KEY_RE.fullmatch(key)):
        p.append(f"key must be 64 lowercase hex digits, got {key!r}")
    elif not p:  # everything the key covers is valid: check the digest
        wl = record["workload"]
        expected = _key_digest(
            encode_tree(tree),
            wl["family"],
            wl["seed"],
            record["num_q_heads"],
            record["num_kv_heads"],
            record["head_dim"],
            record["dtype"],
            _config_dict(config, record["num_q_heads"], record["num_kv_heads"], record["head_dim"]),
            record["env"]["gpu_name"],
            record.get("launch"),
        )
        if key != expected:
            p.append(f"key {key} does not match the record's identity (expected {expected}; see measurement_key)")
    return p, tree, config


def validate(record: Any) -> list[str]:
    """Problems of one record, or an empty list when it is a valid trace record.

    Parameters
    ----------
    record : Any
        A parsed trace line.

    Returns
    -------
    list of str
        One message per problem. A wrong ``schema``, ``schema_version`` or ``kind``
        stops the check there (the rest would be meaningless).
    """
    return _validate(record)[0]


# -------------------------------------------------------------------- writer
def _serialise(record: Any) -> bytes:
    """One line: canonical JSON (sorted keys, no spaces) plus ``\\n``; validated as parsed back."""
    try:
        text = json.dumps(_jsonable(record), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"record not written: not JSON-serialisable ({exc})") from None
    problems = validate(json.loads(text))
    if problems:
        raise TraceError("record not written: " + "; ".join(problems))
    return text.encode("utf-8") + b"\n"


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _is_gzip_path(path: Path) -> bool:
    return path.suffix == ".gz"


class TraceWriter:
    """Append-only, crash-safe writer of a ``.jsonl`` trace file.

    Each :meth:`append` validates the record, serialises it to one line and writes it
    with a single ``os.write`` on an ``O_APPEND`` descriptor (under an advisory
    ``flock``, so writers in several processes never interleave), then ``os.fsync``\\ s
    when ``fsync`` is true. A process killed between appends leaves only whole lines.

    On open, a last line without its trailing newline (a write torn by a crash or power
    loss) is repaired: if it is a complete valid record it only gets its newline; else
    the fragment is appended to ``<path>.torn`` (one fragment per line, never deleted)
    and the file is truncated to its last complete line.

    Parameters
    ----------
    path : str or PathLike
        A ``.jsonl`` file; created (with its parent folders) when missing.
    fsync : bool
        ``os.fsync`` after every append (durable across power loss; default). Without it
        lines still survive a killed process, as the kernel holds them.

    Raises
    ------
    ValueError
        For a ``.gz`` path: gzip members cannot be appended atomically.

    Examples
    --------
    >>> with TraceWriter("traces/h200/run1.jsonl") as w:  # doctest: +SKIP
    ...     w.append(measurement_record(...))
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True) -> None:
        self.path = Path(path)
        if _is_gzip_path(self.path):
            raise ValueError(
                f"{self.path}: cannot append to a gzip file (a killed run would leave a corrupt stream); "
                "write a .jsonl file and gzip it once the set is finished"
            )
        self.fsync = fsync
        self.n_written = 0
        #: Bytes of a torn last line moved to ``<path>.torn`` on open (0 when none).
        self.torn_bytes = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            with _locked(self._fd):
                self._repair()
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    @property
    def torn_path(self) -> Path:
        """Where torn fragments go: ``<path>.torn``."""
        return self.path.with_name(self.path.name + ".torn")

    def _repair(self) -> None:
        fd = self._fd
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return
        # Find the last newline, reading backwards in chunks.
        end, chunk, cut = size, 1 << 16, 0
        while end > 0:
            start = max(0, end - chunk)
            pos = os.pread(fd, end - start, start).rfind(b"\n")
            if pos >= 0:
                cut = start + pos + 1
                break
            end = start
        fragment = os.pread(fd, size - cut, cut)
        try:
            complete = not validate(json.loads(fragment.decode("utf-8")))
        except (UnicodeDecodeError, ValueError):
            complete = False
        if complete:
            logger.warning("%s: last line lacked its newline (a short write); added it", self.path)
            self._write_all(b"\n")
        else:
            tfd = os.open(self.torn_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(tfd, fragment + b"\n")
                os.fsync(tfd)
            finally:
                os.close(tfd)
            os.ftruncate(fd, cut)
            self.torn_bytes = len(fragment)
            logger.warning(
                "%s: moved a torn last line (%d bytes, from a crashed write) to %s",
                self.path,
                len(fragment),
                self.torn_path,
            )
        os.fsync(fd)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # one write in practice; a short write (disk full, signal) finishes here
            n = os.write(self._fd, view)
            view = view[n:]

    def append(self, record: dict[str, Any]) -> None:
        """Validate ``record`` and append it as one line.

        Parameters
        ----------
        record : dict
            A measurement or workload record (see :func:`measurement_record`).

        Raises
        ------
        TraceError
            When the record is invalid or not JSON-serialisable; nothing is written.
        ValueError
            When the writer is closed.
        """
        if self._fd is None:
            raise ValueError(f"{self.path}: the TraceWriter is closed")
        line = _serialise(record)
        with _locked(self._fd):
            self._write_all(line)
            if self.fsync:
                os.fsync(self._fd)
        self.n_written += 1

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# -------------------------------------------------------------------- reader
@dataclass
class TraceSet:
    """Validated records read by :func:`read_traces`.

    Attributes
    ----------
    records : list of dict
        Valid records in file and line order (workload records get ``weight`` 1.0
        when the line omits it).
    invalid : list of (str, int, str)
        ``(file, 1-based line, reason)`` of each skipped line (``skip_invalid=True``).
    files : list of str
        Files read.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[tuple[str, int, str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def n_invalid(self) -> int:
        """Number of skipped lines."""
        return len(self.invalid)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Records of one kind."""
        return [r for r in self.records if r["kind"] == kind]

    def gpus(self) -> list[str]:
        """Distinct ``env.gpu_name`` of the measurement records, sorted."""
        return sorted({r["env"]["gpu_name"] for r in self.records if r["kind"] == "measurement"})

    def require_single_gpu(self) -> str:
        """The one GPU all measurements ran on.

        Returns
        -------
        str

        Raises
        ------
        TraceError
            When the set holds no measurement or measurements from several GPUs.
        """
        gpus = self.gpus()
        if len(gpus) != 1:
            what = "no measurement records" if not gpus else f"measurements from {len(gpus)} GPUs: {gpus}"
            raise TraceError(f"expected measurements from a single GPU, got {what} (files: {self.files})")
        return gpus[0]

    def keys(self) -> set[str]:
        """Keys of the measurement records."""
        return {r["key"] for r in self.records if r["kind"] == "measurement"}

    def by_key(self) -> dict[str, list[dict[str, Any]]]:
        """Measurement records grouped by key (repeat measurements share one)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for r in self.records:
            if r["kind"] == "measurement":
                out.setdefault(r["key"], []).append(r)
        return out


def _expand(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith((".jsonl", ".jsonl.gz"))))
        elif p.exists():
            out.append(p)
        else:
            raise TraceError("no such trace file or folder", str(p))
    return out


def _lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, bytes)`` of each line of ``path``, each read with a bounded ``readline``; a line
    longer than :data:`MAX_LINE_BYTES` comes as ``(line number, None)``, and only when the caller asks
    for the next line is the rest of it read through (in bounded chunks) and dropped."""
    opener = gzip.open if _is_gzip_path(path) else open
    with opener(path, "rb") as f:
        lineno = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if len(raw) <= MAX_LINE_BYTES:
                yield lineno, raw
                continue
            yield lineno, None
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(MAX_LINE_BYTES)


def _too_long() -> str:
    return (
        f"a line longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES; the longest shipped trace line is 28 kB): "
        "not a trace line"
    )


def read_traces(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    kind: str | None = None,
    skip_invalid: bool = False,
    on_file: Callable[[int, int, str, int], None] | None = None,
) -> TraceSet:
    """Read and validate trace files.

    Parameters
    ----------
    paths : path or iterable of paths
        ``.jsonl`` files, ``.jsonl.gz`` files (by the ``.gz`` suffix) or folders (every
        ``*.jsonl`` and ``*.jsonl.gz`` below them, sorted).
    kind : {"measurement", "workload"} or None
        Keep only records of this kind (lines of other kinds are still validated).
    skip_invalid : bool
        Skip bad lines and list them in ``TraceSet.invalid`` instead of raising.
    on_file : callable, optional
        Called after each file as ``on_file(index, n_files, name, n_lines)`` (progress of long reads;
        ``index`` counts from 1, ``n_lines`` the file's lines).

    Returns
    -------
    TraceSet

    Raises
    ------
    TraceError
        On a missing path; on the first bad line (``file:line: reason``; a line longer than
        :data:`MAX_LINE_BYTES` is one, found without reading more of it) unless
        ``skip_invalid``. A file that cannot be read on (a gzip stream cut short, say)
        raises too, or, with ``skip_invalid``, counts as one invalid line and ends that file.
    """
    if kind is not None:
        check_choice("kind", kind, KINDS, expected=f"one of {list(KINDS)} or None")
    out = TraceSet()
    files = _expand(paths)
    for index, path in enumerate(files, 1):
        name = str(path)
        out.files.append(name)
        lineno = 0
        try:
            for lineno, raw in _lines(path):
                if raw is None:
                    reason, record = _too_long(), None
                else:
                    reason, record = _parse_line(raw)
                if reason is not None:
                    if not skip_invalid:
                        raise TraceError(reason, name, lineno)
                    out.invalid.append((name, lineno, reason))
                    continue
                if kind is None or record["kind"] == kind:
                    out.records.append(record)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            reason = f"unreadable after line {lineno}: {exc}"
            if not skip_invalid:
                raise TraceError(reason, name, lineno + 1) from None
            out.invalid.append((name, lineno + 1, reason))
        if on_file is not None:
            on_file(index, len(files), name, lineno)
    if out.invalid:
        logger.warning("skipped %d invalid trace line(s); first: %s:%d: %s", out.n_invalid, *out.invalid[0])
    return out


def _parse_line(raw: bytes) -> tuple[str | None, dict[str, Any] | None]:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if not raw.strip():
        return "empty line", None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8: {exc}", None
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return f"malformed JSON: {exc}", None
    problems = validate(record)
    if problems:
        return "; ".join(problems), None
    if record["kind"] == "workload":
        record.setdefault("weight", 1.0)
    return None, record


def existing_keys(paths: str | os.PathLike | Iterable[str | os.PathLike], *, status: str | None = None) -> set[str]:
    """Keys of the valid measurement lines of trace files, for resuming a profiler run.

    Missing files count as empty; invalid lines (a torn last line, say) are skipped.

    Parameters
    ----------
    paths : path or iterable of paths
    status : {"ok", "failed"} or None
        Only keys of records with this status (None: both, so failed configs are not
        retried).

    Returns
    -------
    set of str
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    present = [p for p in items if Path(p).exists()]
    if not present:
        return set()
    ts = read_traces(present, kind="measurement", skip_invalid=True)
    return {r["key"] for r in ts.records if status is None or r["status"] == status}
