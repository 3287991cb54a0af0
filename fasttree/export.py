"""The tuned-config export: per GPU and bucket, the :class:`~fasttree.FastTreeConfig` to serve with.

The tuner writes one JSON file (:func:`write_export`); serving code reads it
(:func:`read_export`, or :func:`config_from_export`) and looks up the
entry of its GPU and *bucket*. A bucket is ``(group_size, head_dim, dtype)`` with
``group_size = num_q_heads // num_kv_heads`` (the GQA ratio) and ``dtype`` a string such
as ``"float16"``. A GPU or bucket the file does not hold falls back to the defaults,
``FastTreeConfig()``.

The file is plain JSON, schema-versioned and validated in full on load (unknown fields,
duplicate buckets, invalid config values, NaN and duplicate keys are all refused with a
``ValueError``); nothing in it is ever executed or unpickled. The format is described in
``docs/export.md``.

This module imports only the standard library and fasttree's own light modules, so a
serving process needs neither scikit-learn nor Optuna (nor torch, unless it passes a
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

__all__ = [
    "EXPORT_SCHEMA",
    "EXPORT_SCHEMA_VERSION",
    "SUPPORTED_DTYPES",
    "ConfigExport",
    "ExportEntry",
    "bucket_key",
    "read_export",
    "write_export",
]

logger = logging.getLogger(__name__)

#: The ``schema`` value of every export file.
EXPORT_SCHEMA = "fasttree-export"
#: The only ``schema_version`` this library reads and writes.
EXPORT_SCHEMA_VERSION = 1
#: Dtype strings a bucket may name (the kernel's dtypes).
SUPPORTED_DTYPES = ("bfloat16", "float16")
#: Largest export file read (bytes); a real one is a few kilobytes per entry.
MAX_EXPORT_BYTES = 64 * 2**20
#: Deepest nesting of lists and objects accepted in provenance.
_MAX_PROVENANCE_DEPTH = 16

_TOP_FIELDS = ("entries", "provenance", "schema", "schema_version")
_ENTRY_FIELDS = ("config", "dtype", "gpu", "group_size", "head_dim", "provenance")


# --------------------------------------------------------------------- validation helpers
def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def _is_finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _check_str(where: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")


def _check_count(where: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, got {value!r}")


def _check_positive_number(where: str, value: Any) -> None:
    if not _is_finite_number(value) or value <= 0:
        raise ValueError(f"{where} must be a finite number > 0, got {value!r}")


def _check_number(where: str, value: Any) -> None:
    if not _is_finite_number(value):
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
    if _is_int(value):
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


# ---------------------------------------------------------------------------- the format
@dataclass(frozen=True)
class ExportEntry:
    """The tuned config of one GPU and bucket.

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
    config : FastTreeConfig
        The tuned config; its query tiles must fit ``group_size``.
    provenance : dict
        JSON values describing where the config came from. Keys with a checked type:
        ``study_name`` (str), ``n_trials`` (int >= 0), ``predicted_default_us`` and
        ``predicted_tuned_us`` (finite numbers > 0), ``predicted_gain`` (finite number);
        any other key is free. Stored as a deep copy.
    """

    gpu: str
    group_size: int
    head_dim: int
    dtype: str
    config: FastTreeConfig
    provenance: dict[str, Any]

    def __post_init__(self) -> None:
        _check_str("gpu", self.gpu)
        if not _is_int(self.group_size) or self.group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {self.group_size!r}")
        if not _is_int(self.head_dim) or not 16 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be an integer in [16, 256], got {self.head_dim!r}")
        if not isinstance(self.dtype, str) or self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.config, FastTreeConfig):
            raise ValueError(f"config must be a FastTreeConfig, got {type(self.config).__name__}")
        try:
            self.config.query_tiles(self.group_size)
        except ValueError as exc:
            raise ValueError(f"config does not fit group_size {self.group_size}: {exc}") from None
        object.__setattr__(self, "group_size", int(self.group_size))
        object.__setattr__(self, "head_dim", int(self.head_dim))
        object.__setattr__(self, "provenance", _provenance("provenance", self.provenance, _ENTRY_PROVENANCE_TYPES))

    __hash__ = None  # type: ignore[assignment]  # holds a dict

    @property
    def bucket(self) -> tuple[int, int, str]:
        """``(group_size, head_dim, dtype)``."""
        return self.group_size, self.head_dim, self.dtype

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict; the config is :meth:`FastTreeConfig.to_dict` output."""
        return {
            "config": self.config.to_dict(),
            "dtype": self.dtype,
            "gpu": self.gpu,
            "group_size": self.group_size,
            "head_dim": self.head_dim,
            "provenance": _json_value("provenance", self.provenance),
        }

    @classmethod
    def from_dict(cls, data: Any) -> ExportEntry:
        """Build from :meth:`to_dict` output, validating every field.

        Parameters
        ----------
        data : dict
            An entry object. Every field is required and unknown fields are refused.
            ``config`` must hold its ``schema_version`` and, at the current config schema
            version, every config field, so an entry means the same thing whatever a
            later release's defaults are.

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
        _check_fields(data, _ENTRY_FIELDS, "entry")
        config = data["config"]
        if not isinstance(config, dict):
            raise ValueError(f"config must be a JSON object, got {type(config).__name__}")
        if "schema_version" not in config:
            raise ValueError("config.schema_version is missing")
        if config["schema_version"] == CONFIG_SCHEMA_VERSION and type(config["schema_version"]) is int:
            missing = sorted({f.name for f in fields(FastTreeConfig)} - set(config))
            if missing:
                raise ValueError(f"config is missing fields {missing} (an entry lists every field)")
        try:
            parsed = FastTreeConfig.from_dict(config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config: {exc}") from None
        return cls(
            gpu=data["gpu"],
            group_size=data["group_size"],
            head_dim=data["head_dim"],
            dtype=data["dtype"],
            config=parsed,
            provenance=data["provenance"],
        )


@dataclass(frozen=True)
class ConfigExport:
    """A whole export file: tuned entries and where they came from.

    Parameters
    ----------
    entries : tuple of ExportEntry
        At most one per (gpu, bucket); stored sorted by (gpu, dtype, group_size,
        head_dim) so equal exports compare and serialise equal.
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
        seen: dict[tuple[str, int, int, str], int] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, ExportEntry):
                raise ValueError(f"entries[{i}] must be an ExportEntry, got {type(entry).__name__}")
            key = (entry.gpu, *entry.bucket)
            if key in seen:
                raise ValueError(
                    f"entries[{i}] duplicates entries[{seen[key]}]: gpu {entry.gpu!r}, group_size "
                    f"{entry.group_size}, head_dim {entry.head_dim}, dtype {entry.dtype!r}"
                )
            seen[key] = i
        entries = tuple(sorted(entries, key=lambda e: (e.gpu, e.dtype, e.group_size, e.head_dim)))
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
        """Build from :meth:`to_dict` output, validating everything.

        Parameters
        ----------
        data : dict
            The parsed file. ``schema`` must be :data:`EXPORT_SCHEMA` and
            ``schema_version`` :data:`EXPORT_SCHEMA_VERSION`; every field is required
            and unknown fields are refused, at the top level and in each entry.

        Returns
        -------
        ConfigExport

        Raises
        ------
        ValueError
            Naming the problem; an entry's problem names its index and field, e.g.
            ``entries[2]: config: FastTreeConfig.kv_tile ...``.
        """
        if not isinstance(data, dict):
            raise ValueError(f"an export must be a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != EXPORT_SCHEMA:
            raise ValueError(f"not a {EXPORT_SCHEMA} file (schema is {schema!r})")
        version = data.get("schema_version")
        if type(version) is not int or version != EXPORT_SCHEMA_VERSION:
            raise ValueError(
                f"export schema_version {version!r} is not supported; this fasttree reads version "
                f"{EXPORT_SCHEMA_VERSION}"
            )
        _check_fields(data, _TOP_FIELDS, "export")
        raw_entries = data["entries"]
        if not isinstance(raw_entries, list):
            raise ValueError(f"entries must be a JSON array, got {type(raw_entries).__name__}")
        entries = []
        for i, raw in enumerate(raw_entries):
            try:
                entries.append(ExportEntry.from_dict(raw))
            except ValueError as exc:
                raise ValueError(f"entries[{i}]: {exc}") from None
        return cls(entries=tuple(entries), provenance=data["provenance"])

    def lookup(
        self, *, gpu: str, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: Any
    ) -> tuple[FastTreeConfig, ExportEntry | None]:
        """The config to serve an attention shape with on a GPU.

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

        Returns
        -------
        config : FastTreeConfig
            The tuned config of the matching entry, or ``FastTreeConfig()`` when the file
            has none for this GPU and bucket (logged at INFO).
        entry : ExportEntry or None
            The matching entry (for its provenance), or ``None`` on the fallback.

        Raises
        ------
        ValueError
            On invalid head counts, head dim or dtype (checked before anything else).
        """
        key = bucket_key(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        _check_str("gpu", gpu)
        on_gpu = [e for e in self.entries if e.gpu == gpu]
        for entry in on_gpu:
            if entry.bucket == key:
                logger.debug("tuned FastTree config for %r, bucket %s", gpu, key)
                return entry.config, entry
        bucket = f"(group_size={key[0]}, head_dim={key[1]}, dtype={key[2]})"
        if on_gpu:
            logger.info(
                "the export has no tuned FastTree config for %r bucket %s (it has %s); using the defaults",
                gpu,
                bucket,
                sorted(e.bucket for e in on_gpu),
            )
        else:
            logger.info(
                "the export has no tuned FastTree config for GPU %r (it has %s); using the defaults",
                gpu,
                sorted({e.gpu for e in self.entries}),
            )
        return FastTreeConfig(), None


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
    logger.info("wrote %d tuned FastTree configs to %s", len(export.entries), path)
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


def config_from_export(
    path: str | os.PathLike,
    *,
    gpu: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
) -> FastTreeConfig:
    """Load the tuned config of a GPU and attention shape from a tuner export.

    Reads and validates the whole file (:func:`fasttree.export.read_export`), then
    looks up the entry of ``gpu`` and the bucket ``(num_q_heads // num_kv_heads,
    head_dim, dtype)``. A GPU or bucket the file does not hold gives the defaults,
    ``FastTreeConfig()`` (logged at INFO). See ``docs/export.md``.

    Parameters
    ----------
    path : str or PathLike
        The export file (JSON written by :func:`fasttree.export.write_export`).
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

    Returns
    -------
    FastTreeConfig
        The tuned config, or the defaults when the file has no entry for this GPU
        and bucket.

    Raises
    ------
    ValueError
        On invalid head counts, head dim or dtype, or a malformed or invalid file.
    FileNotFoundError
        When ``path`` does not exist.
    """
    bucket_key(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    config, _ = read_export(path).lookup(
        gpu=gpu, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    return config
