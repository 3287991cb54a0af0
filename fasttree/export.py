"""The tuned export: per GPU, bucket and target, a portfolio of configs and the selector that picks one per tree.

The tuner writes one JSON file (:func:`write_export`); serving code reads it (:func:`read_export`,
or :func:`load_portfolio`) and looks up the :class:`~fasttree.portfolio.Portfolio` of its GPU,
*bucket* and *target*. A bucket is ``(group_size, head_dim, dtype)`` with ``group_size =
num_q_heads // num_kv_heads`` (the GQA ratio) and ``dtype`` a string such as ``"float16"``; the
target is ``"tree_attention"`` (:func:`fasttree.plan` and :func:`fasttree.tree_attention`) or
``"runtime"`` (:class:`fasttree.runtime.TreeAttentionRuntime`, whose portfolio members share their
launch shapes). A GPU, bucket or target the file does not hold falls back to the defaults.

Every entry carries a guard: the kernel version and the fingerprint of the defaults it was tuned
against (:mod:`fasttree.versions`) and the latency model's hash. An entry whose kernel version or
defaults differ from the installed package's is not served: the lookup logs a WARNING (once per
entry) and falls back to the defaults, since its gains were predicted for other kernels and
measured against another baseline.

Every selector leaf that names a tuned member records the region of its evidence
(:class:`~fasttree.portfolio.LeafRegion`: the feature box and head layouts of the trees on which the
member was measured or predicted with a calibrated margin to beat the defaults); the lookup binds the
portfolio to the head layout it serves (:meth:`~fasttree.portfolio.Portfolio.for_heads`), and a tree
outside its leaf's region gets the defaults. Files of schema version 2 (no regions) still load, as
portfolios whose selector alone decides, with a deprecation WARNING on lookup; files of schema
version 1 (one config per bucket, no guard) load as one-member portfolios, with a deprecation WARNING.

The file is plain JSON, schema-versioned and validated in full on load (unknown fields,
duplicate entries, invalid config values, NaN and duplicate keys are all refused with a
``ValueError``); nothing in it is ever executed or unpickled. The format is described in
``docs/export.md``. This module imports only the standard library, numpy and fasttree's own light
modules, so a serving process needs neither scikit-learn nor Optuna (nor torch, unless it passes a
``torch.dtype``).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .config import CONFIG_SCHEMA_VERSION, FastTreeConfig
from .fileio import write_atomic
from .plan_arrays import check_heads
from .portfolio import Portfolio
from .validation import check_choice, check_int, check_nonempty_str, is_int, is_number
from .versions import KERNEL_VERSION, defaults_fingerprint

__all__ = [
    "EXPORT_SCHEMA",
    "EXPORT_SCHEMA_VERSION",
    "SUPPORTED_DTYPES",
    "TARGETS",
    "ConfigExport",
    "ExportEntry",
    "ExportGuard",
    "bucket_key",
    "load_portfolio",
    "read_export",
    "write_export",
]

logger = logging.getLogger(__name__)

#: The ``schema`` value of every export file.
EXPORT_SCHEMA = "fasttree-export"
#: The ``schema_version`` this library writes; it also reads versions 1 and 2 (deprecated).
EXPORT_SCHEMA_VERSION = 3
#: The older versions it reads.
OLD_SCHEMA_VERSIONS = (1, 2)
#: What an entry's portfolio serves.
TARGETS = ("tree_attention", "runtime")
#: Dtype strings a bucket may name (the kernel's dtypes).
SUPPORTED_DTYPES = ("bfloat16", "float16")
#: Largest export file read (bytes); a real one is a few kilobytes per entry.
MAX_EXPORT_BYTES = 64 * 2**20
#: Deepest nesting of lists and objects accepted in provenance.
_MAX_PROVENANCE_DEPTH = 16

_TOP_FIELDS = ("entries", "provenance", "schema", "schema_version")
_ENTRY_FIELDS = ("dtype", "gpu", "group_size", "guard", "head_dim", "portfolio", "provenance", "target")
_ENTRY_FIELDS_V1 = ("config", "dtype", "gpu", "group_size", "head_dim", "provenance")
_PORTFOLIO_FIELDS = ("members", "regions", "runtime", "selector")
_PORTFOLIO_FIELDS_V2 = ("members", "runtime", "selector")
_GUARD_FIELDS = ("defaults", "kernel_version", "model_sha256")


# --------------------------------------------------------------------- validation helpers
def _check_str(where: str, value: Any) -> None:
    check_nonempty_str(where, value)


def _check_count(where: str, value: Any) -> None:
    check_int(where, value, minimum=0, expected="an integer >= 0")


def _check_positive_number(where: str, value: Any) -> None:
    if not is_number(value, finite=True) or value <= 0:
        raise ValueError(f"{where} must be a finite number > 0, got {value!r}")


def _check_number(where: str, value: Any) -> None:
    if not is_number(value, finite=True):
        raise ValueError(f"{where} must be a finite number, got {value!r}")


#: Provenance keys with a fixed meaning and therefore a checked type; other keys are free.
_TOP_PROVENANCE_TYPES = {
    "created_utc": _check_str,
    "fasttree_version": _check_str,
    "model_hash": _check_str,
    "trace_set_hash": _check_str,
}
_ENTRY_PROVENANCE_TYPES = {
    "study_name": _check_str,
    "n_trials": _check_count,
    "predicted_default_us": _check_positive_number,
    "predicted_tuned_us": _check_positive_number,
    "predicted_gain": _check_number,
}


def _json_value(where: str, value: Any, depth: int = 0) -> Any:
    """A deep copy of ``value`` made of JSON types only; anything else is a ``ValueError``."""
    if depth > _MAX_PROVENANCE_DEPTH:
        raise ValueError(f"{where} is nested deeper than {_MAX_PROVENANCE_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if is_int(value):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}; NaN and infinities are not valid JSON")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(f"{where}[{i}]", v, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has a non-string key {key!r}; JSON object keys are strings")
            out[key] = _json_value(f"{where}.{key}", v, depth + 1)
        return out
    raise ValueError(f"{where} is a {type(value).__name__}, which is not a JSON value")


def _provenance(where: str, value: Any, typed: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__}")
    out = _json_value(where, value)
    for key, check in typed.items():
        if key in out:
            check(f"{where}.{key}", out[key])
    return out


def _dtype_name(dtype: Any) -> str:
    """``"float16"`` for ``"float16"``, ``"torch.float16"``, ``torch.float16`` or ``numpy.dtype("float16")``."""
    name = str(dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {dtype!r}")
    return name


def bucket_key(*, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: Any) -> tuple[int, int, str]:
    """The bucket ``(group_size, head_dim, dtype)`` of an attention shape.

    Parameters
    ----------
    num_q_heads : int
        Query heads; a positive multiple of ``num_kv_heads``.
    num_kv_heads : int
        KV heads.
    head_dim : int
        Head dimension, in [16, 256].
    dtype : str or torch.dtype
        ``"float16"`` or ``"bfloat16"``, or the matching ``torch.dtype``.

    Returns
    -------
    tuple of (int, int, str)
        GQA ratio ``num_q_heads // num_kv_heads``, ``head_dim`` and the dtype string.

    Raises
    ------
    ValueError
        On head counts or a head dim the kernel does not take, or another dtype.
    """
    group_size = check_heads(num_q_heads, num_kv_heads, head_dim)
    return int(group_size), int(head_dim), _dtype_name(dtype)


def bucket_label(group_size: int, head_dim: int, dtype: str) -> str:
    """``g{G}-d{D}-{dtype}``: how study names, validation reports and confirmations name a bucket."""
    return f"g{group_size}-d{head_dim}-{dtype}"


# ---------------------------------------------------------------------------- the format
@dataclass(frozen=True)
class ExportGuard:
    """What an entry was tuned against.

    Parameters
    ----------
    kernel_version : int
        :data:`fasttree.versions.KERNEL_VERSION` of the kernels the model predicted.
    defaults : str
        :func:`fasttree.versions.defaults_fingerprint` of the defaults the gains are relative to.
    model_sha256 : str
        SHA-256 of the latency model file the tuner predicted with (provenance; not checked).
    """

    kernel_version: int
    defaults: str
    model_sha256: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_version", check_int("guard.kernel_version", self.kernel_version, minimum=0))
        _check_str("guard.defaults", self.defaults)
        if not isinstance(self.model_sha256, str):
            raise ValueError(f"guard.model_sha256 must be a string, got {self.model_sha256!r}")

    @classmethod
    def current(cls, model_sha256: str = "") -> ExportGuard:
        """The guard of an entry tuned now, against the installed kernels and defaults."""
        return cls(kernel_version=KERNEL_VERSION, defaults=defaults_fingerprint(), model_sha256=model_sha256)

    def mismatch(self) -> str | None:
        """Why the installed package cannot serve an entry with this guard, or None when it can."""
        if self.kernel_version != KERNEL_VERSION:
            return f"tuned for kernel version {self.kernel_version}, the installed kernels are version {KERNEL_VERSION}"
        if self.defaults != defaults_fingerprint():
            return f"tuned against other defaults ({self.defaults}; today's: {defaults_fingerprint()})"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"defaults": self.defaults, "kernel_version": self.kernel_version, "model_sha256": self.model_sha256}

    @classmethod
    def from_dict(cls, data: Any) -> ExportGuard:
        if not isinstance(data, dict):
            raise ValueError(f"guard must be a JSON object, got {type(data).__name__}")
        _check_fields(data, _GUARD_FIELDS, "guard")
        return cls(**data)


@dataclass(frozen=True)
class ExportEntry:
    """The tuned portfolio of one GPU, bucket and target.

    Parameters
    ----------
    gpu : str
        The GPU's name as ``torch.cuda.get_device_name()`` reports it, e.g. ``"NVIDIA H200"``.
    group_size : int
        GQA ratio ``num_q_heads // num_kv_heads`` (>= 1).
    head_dim : int
        Head dimension, in [16, 256].
    dtype : str
        ``"float16"`` or ``"bfloat16"``.
    portfolio : Portfolio
        The configs, the selector and its leaves' regions of evidence; every member's query tiles
        must fit ``group_size``, and every region's layouts must have this ``group_size``. In an
        entry with a target member 0 is ``FastTreeConfig()``; a runtime entry's members share their
        launch fields. A portfolio without regions (an entry of a version-2 file) is served as its
        selector says, but not written again (:meth:`write_problem`).
    provenance : dict
        JSON values describing where the entry came from. Keys with a checked type:
        ``study_name`` (str), ``n_trials`` (int >= 0), ``predicted_default_us`` and
        ``predicted_tuned_us`` (finite numbers > 0), ``predicted_gain`` (finite number);
        any other key is free. Stored as a deep copy.
    target : str or None
        ``"tree_attention"`` or ``"runtime"``; None for an entry of a version-1 file, which
        served both.
    guard : ExportGuard or None
        What the entry was tuned against; None for an entry of a version-1 file.
    """

    gpu: str
    group_size: int
    head_dim: int
    dtype: str
    portfolio: Portfolio
    provenance: dict[str, Any]
    target: str | None = "tree_attention"
    guard: ExportGuard | None = None

    def __post_init__(self) -> None:
        _check_str("gpu", self.gpu)
        object.__setattr__(self, "group_size", check_int("group_size", self.group_size, minimum=1))
        object.__setattr__(self, "head_dim", check_int("head_dim", self.head_dim, minimum=16, maximum=256))
        if not isinstance(self.dtype, str) or self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.target is not None:
            check_choice("target", self.target, TARGETS)
        if not isinstance(self.portfolio, Portfolio):
            raise ValueError(f"portfolio must be a Portfolio, got {type(self.portfolio).__name__}")
        if self.guard is not None and not isinstance(self.guard, ExportGuard):
            raise ValueError(f"guard must be an ExportGuard, got {type(self.guard).__name__}")
        if self.target is not None and self.guard is None:
            raise ValueError("an entry of this format needs a guard")
        if self.target is not None:
            if self.portfolio.members[0] != FastTreeConfig():
                raise ValueError("portfolio member 0 must be FastTreeConfig(), the defaults")
            if self.portfolio.runtime != (self.target == "runtime"):
                raise ValueError(f"a {self.target} entry's portfolio has runtime={self.portfolio.runtime}")
        for i, member in enumerate(self.portfolio.members):
            try:
                member.query_tiles(self.group_size)
            except ValueError as exc:
                raise ValueError(f"portfolio member {i} does not fit group_size {self.group_size}: {exc}") from None
        for i, region in enumerate(self.portfolio.regions or ()):
            other = [list(p) for p in (region.layouts if region is not None else ()) if p[1] != self.group_size]
            if other:
                raise ValueError(
                    f"portfolio.regions[{i}] lists head layouts {other} ([num_kv_heads, group_size]) of another "
                    f"group size than the entry's {self.group_size}"
                )
        object.__setattr__(self, "provenance", _provenance("provenance", self.provenance, _ENTRY_PROVENANCE_TYPES))

    __hash__ = None  # type: ignore[assignment]  # holds a dict

    @property
    def bucket(self) -> tuple[int, int, str]:
        """``(group_size, head_dim, dtype)``."""
        return self.group_size, self.head_dim, self.dtype

    def serves(self, target: str) -> bool:
        """Whether the entry is for ``target`` (a version-1 entry serves both)."""
        return self.target is None or self.target == target

    def write_problem(self) -> str | None:
        """Why this version cannot write the entry, or None when it can: an entry of a version-1 file,
        or one whose selector sends trees to a tuned member with no region of evidence recorded (an
        entry of a version-2 file)."""
        if self.target is None or self.guard is None:
            return "a version-1 entry is not written again: re-tune it (fasttree-tune run)"
        leaves = self.portfolio.unbounded_leaves
        if leaves:
            return (
                f"selector leaves {list(leaves)} name tuned members with no region of evidence (an entry of export "
                "format 2): confirm it on the GPU again (fasttree-tune validate, then confirm) or re-tune it "
                "(fasttree-tune run)"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict (version 3); ValueError for an entry :meth:`write_problem` names."""
        problem = self.write_problem()
        if problem is not None:
            raise ValueError(f"{self.gpu} {bucket_label(*self.bucket)} {self.target}: {problem}")
        return {
            "dtype": self.dtype,
            "gpu": self.gpu,
            "group_size": self.group_size,
            "guard": self.guard.to_dict(),
            "head_dim": self.head_dim,
            "portfolio": self.portfolio.to_dict(),
            "provenance": _json_value("provenance", self.provenance),
            "target": self.target,
        }

    @classmethod
    def from_dict(cls, data: Any, *, version: int = EXPORT_SCHEMA_VERSION) -> ExportEntry:
        """Build from :meth:`to_dict` output (or a version-1 entry), validating every field.

        Parameters
        ----------
        data : dict
            An entry object. Every field is required and unknown fields are refused. Every
            config must hold its ``schema_version`` and, at the current config schema version,
            every config field, so an entry means the same thing whatever a later release's
            defaults are.
        version : int
            The file's schema version: 1 reads the old one-config entry as a one-member portfolio,
            2 a portfolio without regions.

        Returns
        -------
        ExportEntry

        Raises
        ------
        ValueError
            Naming the field at fault.
        """
        if not isinstance(data, dict):
            raise ValueError(f"must be a JSON object, got {type(data).__name__}")
        if version == 1:
            _check_fields(data, _ENTRY_FIELDS_V1, "entry")
            config = _parse_config("config", data["config"])
            return cls(
                gpu=data["gpu"], group_size=data["group_size"], head_dim=data["head_dim"], dtype=data["dtype"],
                portfolio=Portfolio(members=(config,)), provenance=data["provenance"], target=None, guard=None,
            )  # fmt: skip
        _check_fields(data, _ENTRY_FIELDS, "entry")
        check_choice("target", data["target"], TARGETS)  # null would mean a version-1 entry
        raw = data["portfolio"]
        if not isinstance(raw, dict) or not isinstance(raw.get("members"), list):
            raise ValueError("portfolio must be a JSON object with a members list")
        _check_fields(raw, _PORTFOLIO_FIELDS_V2 if version == 2 else _PORTFOLIO_FIELDS, "portfolio")
        for i, member in enumerate(raw["members"]):
            _parse_config(f"portfolio.members[{i}]", member)
        try:
            portfolio = Portfolio.from_dict({**raw, "regions": None} if version == 2 else raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"portfolio: {exc}") from None
        if version != 2 and portfolio.unbounded_leaves:
            raise ValueError(
                f"portfolio.regions is null but selector leaves {list(portfolio.unbounded_leaves)} name tuned "
                "members: each needs its region of evidence"
            )
        return cls(
            gpu=data["gpu"], group_size=data["group_size"], head_dim=data["head_dim"], dtype=data["dtype"],
            portfolio=portfolio, provenance=data["provenance"], target=data["target"],
            guard=ExportGuard.from_dict(data["guard"]),
        )  # fmt: skip


def _parse_config(where: str, config: Any) -> FastTreeConfig:
    """A config of an entry: a complete, schema-versioned config dict."""
    if not isinstance(config, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(config).__name__}")
    if "schema_version" not in config:
        raise ValueError(f"{where}.schema_version is missing")
    if config["schema_version"] == CONFIG_SCHEMA_VERSION and type(config["schema_version"]) is int:
        missing = sorted({f.name for f in fields(FastTreeConfig)} - set(config))
        if missing:
            raise ValueError(f"{where} is missing fields {missing} (an entry lists every field)")
    try:
        return FastTreeConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


#: Entries whose guard failed or whose version-1 format was deprecated, warned about once each.
_WARNED: set[tuple] = set()


def _warn_once(key: tuple, message: str, *args: Any) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message, *args)


@dataclass(frozen=True)
class ConfigExport:
    """A whole export file: tuned entries and where they came from.

    Parameters
    ----------
    entries : tuple of ExportEntry
        At most one per (gpu, bucket, target); stored sorted by (gpu, dtype, group_size,
        head_dim, target) so equal exports compare and serialise equal.
    provenance : dict
        JSON values describing the run that made the file. Keys with a checked type
        (strings): ``created_utc``, ``fasttree_version``, ``trace_set_hash``,
        ``model_hash``; any other key is free. Stored as a deep copy.
    """

    entries: tuple[ExportEntry, ...]
    provenance: dict[str, Any]

    def __post_init__(self) -> None:
        try:
            entries = tuple(self.entries)
        except TypeError:
            raise ValueError(f"entries must be a sequence of ExportEntry, got {self.entries!r}") from None
        seen: dict[tuple, int] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, ExportEntry):
                raise ValueError(f"entries[{i}] must be an ExportEntry, got {type(entry).__name__}")
            key = (entry.gpu, *entry.bucket, entry.target or "")
            if key in seen:
                raise ValueError(
                    f"entries[{i}] duplicates entries[{seen[key]}]: gpu {entry.gpu!r}, group_size "
                    f"{entry.group_size}, head_dim {entry.head_dim}, dtype {entry.dtype!r}, target {entry.target!r}"
                )
            seen[key] = i
        entries = tuple(sorted(entries, key=lambda e: (e.gpu, e.dtype, e.group_size, e.head_dim, e.target or "")))
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "provenance", _provenance("provenance", self.provenance, _TOP_PROVENANCE_TYPES))

    __hash__ = None  # type: ignore[assignment]  # holds a dict

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict with the schema name and version."""
        return {
            "entries": [e.to_dict() for e in self.entries],
            "provenance": _json_value("provenance", self.provenance),
            "schema": EXPORT_SCHEMA,
            "schema_version": EXPORT_SCHEMA_VERSION,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ConfigExport:
        """Build from :meth:`to_dict` output (or a version-1 file), validating everything.

        Parameters
        ----------
        data : dict
            The parsed file. ``schema`` must be :data:`EXPORT_SCHEMA` and ``schema_version``
            one of :data:`OLD_SCHEMA_VERSIONS` or :data:`EXPORT_SCHEMA_VERSION`; every field is
            required and unknown fields are refused, at the top level and in each entry.

        Returns
        -------
        ConfigExport

        Raises
        ------
        ValueError
            Naming the problem; an entry's problem names its index and field, e.g.
            ``entries[2]: portfolio.members[1]: FastTreeConfig.kv_tile ...``.
        """
        if not isinstance(data, dict):
            raise ValueError(f"an export must be a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != EXPORT_SCHEMA:
            raise ValueError(f"not a {EXPORT_SCHEMA} file (schema is {schema!r})")
        version = data.get("schema_version")
        if type(version) is not int or version not in (*OLD_SCHEMA_VERSIONS, EXPORT_SCHEMA_VERSION):
            raise ValueError(
                f"export schema_version {version!r} is not supported; this fasttree reads versions "
                f"{', '.join(map(str, OLD_SCHEMA_VERSIONS))} and {EXPORT_SCHEMA_VERSION}"
            )
        _check_fields(data, _TOP_FIELDS, "export")
        raw_entries = data["entries"]
        if not isinstance(raw_entries, list):
            raise ValueError(f"entries must be a JSON array, got {type(raw_entries).__name__}")
        entries = []
        for i, raw in enumerate(raw_entries):
            try:
                entries.append(ExportEntry.from_dict(raw, version=version))
            except ValueError as exc:
                raise ValueError(f"entries[{i}]: {exc}") from None
        return cls(entries=tuple(entries), provenance=data["provenance"])

    def lookup(
        self,
        *,
        gpu: str,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        target: str = "tree_attention",
    ) -> tuple[Portfolio, ExportEntry | None]:
        """The portfolio to serve an attention shape with on a GPU.

        Parameters
        ----------
        gpu : str
            The GPU's name as ``torch.cuda.get_device_name()`` reports it; matched exactly.
        num_q_heads : int
            Query heads; a positive multiple of ``num_kv_heads``.
        num_kv_heads : int
            KV heads.
        head_dim : int
            Head dimension, in [16, 256].
        dtype : str or torch.dtype
            ``"float16"`` or ``"bfloat16"``, or the matching ``torch.dtype``.
        target : {"tree_attention", "runtime"}
            What will serve the portfolio.

        Returns
        -------
        portfolio : Portfolio
            The matching entry's portfolio bound to this head layout (:meth:`Portfolio.for_heads`:
            a tree gets a tuned member only inside its selector leaf's region of evidence, at a
            layout the region lists), or the defaults' (``FastTreeConfig()`` alone) when the
            file has none for this GPU (logged at WARNING, once per GPU, naming the GPUs it has and
            how to tune for this one), none for this bucket and target (logged at INFO) or when the
            entry was tuned for other kernels or defaults (logged at WARNING, once per entry). An
            entry without regions (a version-2 file) is served as its selector says, with a
            deprecation WARNING once per entry.
        entry : ExportEntry or None
            The entry served (for its provenance), or ``None`` on the fallback.

        Raises
        ------
        ValueError
            On invalid head counts, head dim, dtype or target (checked before anything else).
        """
        key = bucket_key(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        _check_str("gpu", gpu)
        check_choice("target", target, TARGETS)
        defaults = Portfolio(runtime=target == "runtime")
        on_gpu = [e for e in self.entries if e.gpu == gpu and e.serves(target)]
        for entry in on_gpu:
            if entry.bucket != key:
                continue
            if entry.guard is None:
                _warn_once(
                    (gpu, key, target, "format 1"),
                    "the export entry for %r bucket %s is of export format 1 (deprecated: no guard, one config "
                    "for every tree); re-tune with fasttree-tune run",
                    gpu,
                    key,
                )
                return _v1_portfolio(entry, target), entry
            reason = entry.guard.mismatch()
            if reason is not None:
                _warn_once(
                    (gpu, key, target, reason),
                    "not serving the export entry for %r bucket %s %s: %s; using the defaults",
                    gpu, key, target, reason,
                )  # fmt: skip
                return defaults, None
            if entry.portfolio.unbounded_leaves:
                _warn_once(
                    (gpu, key, target, "format 2"),
                    "the export entry for %r bucket %s %s is of export format 2 (deprecated): its selector records "
                    "no region of evidence, so it may send trees unlike any it was measured on to a tuned member; "
                    "confirm it again (fasttree-tune validate, then confirm) or re-tune (fasttree-tune run)",
                    gpu, key, target,
                )  # fmt: skip
            logger.debug("tuned FastTree portfolio for %r, bucket %s, %s", gpu, key, target)
            return entry.portfolio.for_heads(num_q_heads, num_kv_heads), entry
        if not any(e.gpu == gpu for e in self.entries):
            _warn_once(
                (gpu, "no gpu"),
                "the export has no entry for GPU %r (it has %s): serving the defaults; to tune for this GPU, "
                "profile it and fit its latency model, then tune against that model ('fasttree-tune profile', "
                "'fit', 'run --model': docs/walkthrough.md)",
                gpu, ", ".join(repr(g) for g in sorted({e.gpu for e in self.entries})) or "no entries",
            )  # fmt: skip
            return defaults, None
        logger.info(
            "the export has no %s entry for %r bucket %s (it has %s); using the defaults",
            target,
            gpu,
            key,
            sorted({(e.gpu, *e.bucket, e.target) for e in self.entries}, key=str),
        )
        return defaults, None


def _v1_portfolio(entry: ExportEntry, target: str) -> Portfolio:
    """A version-1 entry's one config as a portfolio for ``target``."""
    return Portfolio(members=entry.portfolio.members, runtime=target == "runtime")


def _check_fields(data: dict[str, Any], expected: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(data) - set(expected))
    if unknown:
        raise ValueError(f"unknown {what} fields {unknown}")
    missing = sorted(set(expected) - set(data))
    if missing:
        raise ValueError(f"missing {what} fields {missing}")


# ----------------------------------------------------------------------------- file I/O
def write_export(path: str | os.PathLike, export: ConfigExport, *, overwrite: bool = False) -> Path:
    """Write an export as sorted, indented JSON, atomically.

    Parameters
    ----------
    path : str or PathLike
        Destination file (conventionally ``*.json``); its folder is created when missing.
    export : ConfigExport
        What to write.
    overwrite : bool
        Replace an existing file; otherwise an existing ``path`` is a ``FileExistsError``.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    FileExistsError
        When ``path`` exists and ``overwrite`` is false.
    """
    path = Path(path)
    if not isinstance(export, ConfigExport):
        raise ValueError(f"export must be a ConfigExport, got {type(export).__name__}")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; choose another path or pass overwrite=True to replace it")
    text = json.dumps(export.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_atomic(path, text)
    tuned = sum(
        any(m != 0 and f < 0 for f, m in zip(e.portfolio.selector.feature, e.portfolio.selector.member, strict=True))
        and len(e.portfolio.members) > 1
        for e in export.entries
    )
    logger.info(
        "wrote %s: %d entries, %d serving tuned configs, %d serving the defaults only",
        path, len(export.entries), tuned, len(export.entries) - tuned,
    )  # fmt: skip
    return path


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in a JSON object")
        out[key] = value
    return out


def read_export(path: str | os.PathLike) -> ConfigExport:
    """Read and validate an export written by :func:`write_export`.

    Only JSON is parsed: nothing is evaluated or unpickled. ``NaN``/``Infinity`` and
    duplicate object keys are refused, as is anything :meth:`ConfigExport.from_dict`
    refuses.

    Parameters
    ----------
    path : str or PathLike
        The export file.

    Returns
    -------
    ConfigExport

    Raises
    ------
    ValueError
        Naming the file and the problem (malformed JSON, a truncated file, another
        schema or version, an invalid entry).
    FileNotFoundError
        When ``path`` does not exist.
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_EXPORT_BYTES:
        raise ValueError(f"{path}: {size} bytes, larger than any export ({MAX_EXPORT_BYTES} bytes at most)")
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed or truncated JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None
    try:
        return ConfigExport.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_portfolio(
    path: str | os.PathLike,
    *,
    gpu: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    target: str = "tree_attention",
) -> Portfolio:
    """Load the tuned portfolio of a GPU, attention shape and target from a tuner export.

    Reads and validates the whole file (:func:`read_export`), then looks up the entry of ``gpu``,
    the bucket ``(num_q_heads // num_kv_heads, head_dim, dtype)`` and ``target``
    (:meth:`ConfigExport.lookup`: the defaults when the file lacks it or when the entry was
    tuned for other kernels or defaults). Pass the portfolio where a config goes:
    ``ft.plan(tree, portfolio, ...)`` plans each tree with the member its selector picks.

    Parameters
    ----------
    path : str or PathLike
        The export file (JSON written by :func:`write_export`).
    gpu : str
        The GPU's name as ``torch.cuda.get_device_name()`` reports it; matched exactly.
    num_q_heads, num_kv_heads : int
        Query and KV heads.
    head_dim : int
        Head dimension, in [16, 256].
    dtype : str or torch.dtype
        ``"float16"`` or ``"bfloat16"``, or the matching ``torch.dtype``.
    target : {"tree_attention", "runtime"}

    Returns
    -------
    Portfolio

    Raises
    ------
    ValueError
        On invalid head counts, head dim, dtype or target, or a malformed or invalid file.
    FileNotFoundError
        When ``path`` does not exist.
    """
    bucket_key(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    _check_str("gpu", gpu)
    check_choice("target", target, TARGETS)
    portfolio, _ = read_export(path).lookup(
        gpu=gpu, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, target=target
    )
    return portfolio
