"""Saving and loading a fitted :class:`~fasttree.costmodel.model.LatencyModel` (a skops file, never pickle).

A model file (format 3, conventionally ``*.skops``) is a skops archive (:mod:`skops.io`, the
safe persistence format for scikit-learn models: a zip of a JSON ``schema.json`` describing
the objects and one ``.npy`` member per array, rebuilt without pickle and only from an
allow-list of types). It holds the list of the model's regressors, one per seed, and one more
member, ``fasttree_model.json``: the metadata that decides whether the model may be used (the
GPU it was fitted for, the feature schema, the trace set it was fitted on, the library versions,
the model's parameters) and what it was fitted with (``extra``: fit time, training metrics, the
simulator's calibration).

:func:`load_model` checks a file before it builds anything from it, with limits about four
times the shipped model's (``costmodel/data/h200_latency_model.skops``, package data): the
file size, the number of zip members and their declared inflated sizes (zipfile never
inflates a member past its declared size), the JSON tokens of ``schema.json``, the metadata, every object's type against
:data:`TRUSTED_TYPES` (exactly the types the three model kinds are made of), and every array's
header against its member's size. After skops has rebuilt the regressors,
:func:`fasttree.costmodel.regressors.check_regressor` checks what scikit-learn's prediction
code indexes with. A file that fails any check is a :class:`ModelFileError` naming the
problem. A model for another GPU or feature schema is refused unless ``force`` is given.

JSON model files of older versions (formats 1 and 2, ``*.json``/``*.json.gz``) are not read;
``python -m fasttree.costmodel.persist convert OLD NEW`` converts one without refitting.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import functools
import hashlib
import io
import json
import math
import os
import re
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from sklearn._loss._loss import CyHalfSquaredError

import fasttree
from fasttree.fileio import write_atomic

from .errors import MODEL_FORMAT, ModelFileError
from .features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION
from .gpu import GpuSpec
from .model import KINDS, LatencyModel
from .regressors import MAX_FEATURES, check_regressor

__all__ = [
    "MODEL_FORMAT",
    "MODEL_FORMAT_VERSION",
    "TRUSTED_TYPES",
    "ModelFileError",
    "convert",
    "load_model",
    "save_model",
]

MODEL_FORMAT_VERSION = 3
#: The zip member holding the metadata (the rest of the archive is skops').
META_MEMBER = "fasttree_model.json"
SCHEMA_MEMBER = "schema.json"

# Limits, each about 4x the shipped model's: 7.4 MB on disk, 3,604 zip members that inflate to
# 38 MB, of which schema.json is 21 MB with 750,000 JSON tokens; 2.7 kB of metadata.
#: Largest model file read (bytes on disk).
MAX_FILE_BYTES = 32 * 2**20
#: Largest total of the zip members' inflated sizes (bytes).
MAX_INFLATED_BYTES = 160 * 2**20
#: Most zip members.
MAX_MEMBERS = 16_384
#: Most JSON tokens (separators and brackets) in ``schema.json``: bounds the objects parsing it creates.
MAX_SCHEMA_TOKENS = 3_000_000
#: Deepest nesting of ``schema.json``.
MAX_SCHEMA_DEPTH = 64
#: Largest metadata member (bytes).
MAX_META_BYTES = 2**20

# skops names a type by its __module__, and the Cython loss reports "_loss" in scikit-learn 1.6 to 1.8 (there, that
# module is the same one as sklearn._loss._loss): a file names it either way, by the scikit-learn that wrote it.
_LOSS_TYPES = sorted({"sklearn._loss._loss.CyHalfSquaredError", f"{CyHalfSquaredError.__module__}.CyHalfSquaredError"})

#: Every type a model file may hold, each with the skops loaders that may build it: the types of
#: the regressors of the three model kinds (``GradientBoostingRegressor`` for gbrt and residual,
#: ``RandomForestRegressor`` for forest). ``skops.io.load`` is given exactly these as ``trusted``.
TRUSTED_TYPES: dict[str, frozenset[str]] = {
    "builtins.dict": frozenset({"DictNode"}),
    "builtins.list": frozenset({"ListNode"}),
    "builtins.str": frozenset({"JsonNode", "TypeNode"}),
    "builtins.tuple": frozenset({"TupleNode"}),
    "numpy.float64": frozenset({"NdArrayNode"}),
    "numpy.ndarray": frozenset({"NdArrayNode"}),
    "numpy.random.mtrand.RandomState": frozenset({"RandomStateNode"}),
    **{name: frozenset({"LossNode"}) for name in _LOSS_TYPES},
    "sklearn._loss.link.IdentityLink": frozenset({"ObjectNode"}),
    "sklearn._loss.link.Interval": frozenset({"ObjectNode"}),
    "sklearn._loss.loss.HalfSquaredError": frozenset({"ObjectNode"}),
    "sklearn.dummy.DummyRegressor": frozenset({"ObjectNode"}),
    "sklearn.ensemble._forest.RandomForestRegressor": frozenset({"ObjectNode"}),
    "sklearn.ensemble._gb.GradientBoostingRegressor": frozenset({"ObjectNode"}),
    "sklearn.tree._classes.DecisionTreeRegressor": frozenset({"ObjectNode"}),
    "sklearn.tree._tree.Tree": frozenset({"TreeNode"}),
}

_META_KEYS = (
    "format",
    "format_version",
    "feature_schema_version",
    "feature_names",
    "gpu",
    "trace_set",
    "versions",
    "created_utc",
    "model_params",
    "extra",
)
_PARAM_NAMES = frozenset(LatencyModel().get_params())


def save_model(
    path: str | os.PathLike,
    model: LatencyModel,
    *,
    gpu: GpuSpec,
    trace_hash: str,
    trace_rows: int,
    trace_paths: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write a fitted model and its metadata to ``path`` (a skops file, atomically).

    Parameters
    ----------
    path : str or PathLike
        Destination file (conventionally ``*.skops``; the format is the same whatever the suffix).
    model : LatencyModel
        A fitted model.
    gpu : GpuSpec
        The GPU its traces were measured on.
    trace_hash : str
        :attr:`fasttree.costmodel.dataset.Dataset.trace_hash` of the training set.
    trace_rows : int
        Training rows.
    trace_paths : list of str, optional
        Where the traces came from (informational).
    extra : dict, optional
        More JSON-ready metadata (e.g. evaluation results).
    overwrite : bool
        Replace an existing file (otherwise that is a ``FileExistsError``).

    Returns
    -------
    dict
        The metadata written (everything but the regressors).

    Raises
    ------
    ValueError
        The model is not fitted, or larger than :func:`load_model` accepts.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; choose another path or overwrite it explicitly")
    if not hasattr(model, "estimators_"):
        raise ValueError("the model is not fitted")
    import sklearn

    meta = {
        "format": MODEL_FORMAT,
        "format_version": MODEL_FORMAT_VERSION,
        "feature_schema_version": FEATURE_SCHEMA_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "gpu": gpu.to_dict(),
        "trace_set": {"sha256": trace_hash, "rows": int(trace_rows), "paths": list(trace_paths or [])},
        "versions": {"fasttree": fasttree.__version__, "scikit-learn": sklearn.__version__, "numpy": np.__version__},
        "created_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model_params": model.get_params(),
        "extra": extra or {},
    }
    write_atomic(path, _model_bytes(list(model.estimators_), meta))
    return meta


def _model_bytes(regressors: list[Any], meta: dict[str, Any]) -> bytes:
    """The file of ``regressors`` and ``meta``; refuses one that :func:`load_model` would refuse for its size."""
    import skops.io

    data = skops.io.dumps(regressors, compression=zipfile.ZIP_DEFLATED, compresslevel=6)
    buffer = io.BytesIO(data)
    with zipfile.ZipFile(buffer, "a", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(META_MEMBER, json.dumps(meta, sort_keys=True, allow_nan=False, indent=1) + "\n")
    data = buffer.getvalue()
    where = Path("the model")
    try:
        if len(data) > MAX_FILE_BYTES:
            raise ModelFileError(f"{where}: {len(data)} bytes, more than the {MAX_FILE_BYTES} load_model reads")
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            _check_members(where, zf)
            _check_schema(where, _read_schema(where, zf))
    except ModelFileError as exc:
        raise ValueError(f"cannot save a model that load_model would refuse: {exc}") from None
    return data


def load_model(
    path: str | os.PathLike, *, gpu_name: str | None = None, force: bool = False
) -> tuple[LatencyModel, dict[str, Any]]:
    """Read a model written by :func:`save_model`.

    Parameters
    ----------
    path : str or PathLike
    gpu_name : str, optional
        The GPU the caller will predict for; a model fitted for another GPU is refused.
    force : bool
        Accept a model for another GPU or feature schema (its predictions are then
        extrapolations, or wrong).

    Returns
    -------
    model : LatencyModel
        Fitted, ready to predict.
    meta : dict
        The file's metadata (everything but the regressors).

    Raises
    ------
    ModelFileError
        On a malformed, damaged, oversized or untrusted file, another format, or (without
        ``force``) another GPU or feature schema.
    OSError
        When the file cannot be read (``FileNotFoundError`` when it does not exist).
    """
    path = Path(path)
    data = _read_file(path)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            _check_members(path, zf)
            meta = _read_meta(path, zf)
            params = _check_meta(path, meta)
            _check_compatible(path, meta, gpu_name, force)
            _check_schema(path, _read_schema(path, zf))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise ModelFileError(f"{path}: a damaged zip file ({exc})") from None
    regressors = _build_regressors(path, data)
    model = _assemble(path, params, regressors, force)
    return model, meta


def _read_file(path: Path) -> bytes:
    """The bytes of ``path``; refuses a file larger than any model or that is no zip archive."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ModelFileError(f"{path}: {size} bytes, more than any model file ({MAX_FILE_BYTES} bytes at most)")
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ModelFileError(f"{path}: more than any model file ({MAX_FILE_BYTES} bytes at most)")
    if data.startswith(b"PK\x03\x04"):
        return data
    if data.startswith(b"\x1f\x8b") or data.lstrip()[:1] == b"{":
        raise ModelFileError(
            f"{path}: a gzip or JSON file, not a model file of this version (format {MODEL_FORMAT_VERSION}, a skops "
            f"archive); a JSON model of an older version (format 1 or 2) converts with "
            f"'python -m fasttree.costmodel.persist convert {path} NEW.skops'"
        )
    raise ModelFileError(f"{path}: not a model file (a model file is a skops zip archive)")


def _check_members(path: Path, zf: zipfile.ZipFile) -> None:
    """Limits on the members, from the zip directory alone, then every array header against its member's size."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise ModelFileError(f"{path}: {len(infos)} zip members, more than any model ({MAX_MEMBERS})")
    names = {info.filename for info in infos}
    for needed in (META_MEMBER, SCHEMA_MEMBER):
        if needed not in names:
            raise ModelFileError(f"{path}: not a {MODEL_FORMAT} file (no {needed} in the archive)")
    total = 0
    for info in infos:
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ModelFileError(f"{path}: member {info.filename!r} uses an unsupported compression")
        if info.filename not in (META_MEMBER, SCHEMA_MEMBER) and not info.filename.endswith(".npy"):
            raise ModelFileError(f"{path}: unexpected member {info.filename!r}")
        total += info.file_size
    if total > MAX_INFLATED_BYTES:
        raise ModelFileError(
            f"{path}: its members inflate to {total} bytes, more than any model ({MAX_INFLATED_BYTES} bytes at most)"
        )
    for info in infos:
        if info.filename.endswith(".npy"):
            _check_array_header(path, zf, info)


def _check_array_header(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """An array member holds exactly the bytes its header declares (numpy allocates by the header), no objects.

    The header is read as numpy writes it (``{'descr': ..., 'fortran_order': ..., 'shape': (...), }``);
    any other is refused.
    """
    with zf.open(info) as f:
        magic = f.read(8)
        sizes = {b"\x93NUMPY\x01\x00": 2, b"\x93NUMPY\x02\x00": 4}
        if magic not in sizes:
            raise ModelFileError(f"{path}: member {info.filename!r} is not a numpy array")
        length = f.read(sizes[magic])
        header = f.read(int.from_bytes(length, "little")) if len(length) == sizes[magic] else b""
        start = 8 + len(length) + len(header)
    match = _NPY_HEADER.fullmatch(header.decode("latin-1"))
    if match is None or len(header) != int.from_bytes(length, "little"):
        raise ModelFileError(f"{path}: member {info.filename!r} has a malformed numpy header")
    try:
        dtype = _npy_dtype(match["descr"])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ModelFileError(f"{path}: member {info.filename!r} has a malformed numpy dtype ({exc})") from None
    if dtype.hasobject:
        raise ModelFileError(f"{path}: member {info.filename!r} holds Python objects")
    shape = [int(d) for d in match["shape"].split(",") if d.strip()]
    if start + math.prod(shape) * dtype.itemsize != info.file_size:
        raise ModelFileError(f"{path}: member {info.filename!r} has {info.file_size} bytes, not its array's")


_NPY_HEADER = re.compile(
    r"\{'descr': (?P<descr>.{1,2000}), 'fortran_order': (?:True|False), "
    r"'shape': \((?P<shape>(?:[0-9]{1,19}, ?)*[0-9]{0,19})\), \} *\n"
)


@functools.lru_cache(maxsize=256)
def _npy_dtype(descr: str) -> np.dtype:
    return np.lib.format.descr_to_dtype(ast.literal_eval(descr))


def _read_member(path: Path, zf: zipfile.ZipFile, name: str, limit: int) -> bytes:
    """A member's bytes, read in chunks (zipfile sizes its inflate buffer by the read) and at most ``limit``."""
    chunks, total = [], 0
    with zf.open(name) as f:
        while chunk := f.read(2**20):
            total += len(chunk)
            if total > limit:
                raise ModelFileError(f"{path}: {name} is larger than any model's ({limit} bytes at most)")
            chunks.append(chunk)
    return b"".join(chunks)


def _read_json(path: Path, data: bytes, name: str) -> Any:
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelFileError(f"{path}: {name} is not valid JSON ({exc})") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _read_meta(path: Path, zf: zipfile.ZipFile) -> dict[str, Any]:
    meta = _read_json(path, _read_member(path, zf, META_MEMBER, MAX_META_BYTES), META_MEMBER)
    if not isinstance(meta, dict) or meta.get("format") != MODEL_FORMAT:
        raise ModelFileError(f"{path}: not a {MODEL_FORMAT} file")
    version = meta.get("format_version")
    if version != MODEL_FORMAT_VERSION or isinstance(version, bool):
        raise ModelFileError(f"{path}: model format version {version!r}, this library reads {MODEL_FORMAT_VERSION}")
    return meta


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_meta(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Every metadata field the library reads, with its type; returns the model parameters."""
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ModelFileError(f"{path}: the metadata lacks {', '.join(missing)}")
    trace_set = meta["trace_set"]
    if not (
        isinstance(trace_set, dict)
        and isinstance(trace_set.get("sha256"), str)
        and _is_int(trace_set.get("rows"))
        and isinstance(trace_set.get("paths"), list)
        and all(isinstance(p, str) for p in trace_set["paths"])
    ):
        raise ModelFileError(f"{path}: trace_set must be an object with sha256 (a string), rows and paths")
    versions = meta["versions"]
    if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
        raise ModelFileError(f"{path}: versions must be an object of strings")
    if not isinstance(meta["created_utc"], str):
        raise ModelFileError(f"{path}: created_utc must be a string")
    if not isinstance(meta["extra"], dict):
        raise ModelFileError(f"{path}: extra must be an object")
    try:
        gpu = GpuSpec.from_dict(meta["gpu"])
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: bad gpu entry ({exc})") from None
    if not isinstance(gpu.name, str):
        raise ModelFileError(f"{path}: bad gpu entry (the name must be a string)")
    params = meta["model_params"]
    if not isinstance(params, dict):
        raise ModelFileError(f"{path}: model_params must be an object")
    missing = sorted(_PARAM_NAMES - set(params))
    if missing:
        raise ModelFileError(f"{path}: model_params lacks {', '.join(missing)}")
    unknown = sorted(set(params) - _PARAM_NAMES)
    if unknown:
        raise ModelFileError(f"{path}: model_params has unknown parameters {', '.join(unknown)}")
    if params["kind"] not in KINDS:
        raise ModelFileError(f"{path}: model_params kind must be one of {list(KINDS)}, got {params['kind']!r}")
    for name in ("n_seeds", "n_estimators"):
        if not _is_int(params[name]) or params[name] < 1:
            raise ModelFileError(f"{path}: model_params {name} must be a positive integer, got {params[name]!r}")
    if not _is_int(params["random_state"]):
        raise ModelFileError(f"{path}: model_params random_state must be an integer")
    return params


def _check_compatible(path: Path, meta: dict[str, Any], gpu_name: str | None, force: bool) -> None:
    problems = []
    if meta["feature_schema_version"] != FEATURE_SCHEMA_VERSION or meta["feature_names"] != list(FEATURE_NAMES):
        problems.append(
            f"it uses feature schema {meta['feature_schema_version']!r}, this library computes "
            f"{FEATURE_SCHEMA_VERSION} (refit it on the traces)"
        )
    name = meta["gpu"]["name"]
    if gpu_name is not None and name != gpu_name:
        problems.append(f"it was fitted on {name!r} traces, not {gpu_name!r}")
    if problems and not force:
        raise ModelFileError(f"{path}: " + "; ".join(problems) + " (force=True / --force uses it anyway)")


def _read_schema(path: Path, zf: zipfile.ZipFile) -> Any:
    """skops' object description, parsed only when its token count is within :data:`MAX_SCHEMA_TOKENS`."""
    data = _read_member(path, zf, SCHEMA_MEMBER, MAX_INFLATED_BYTES)
    tokens = sum(data.count(c) for c in (b",", b":", b"{", b"["))
    if tokens > MAX_SCHEMA_TOKENS:
        raise ModelFileError(f"{path}: {SCHEMA_MEMBER} has {tokens} JSON tokens, more than any model's")
    return _read_json(path, data, SCHEMA_MEMBER)


def _check_schema(path: Path, schema: Any) -> None:
    """Every object's type and loader against :data:`TRUSTED_TYPES`, the nesting depth and each tree's shape."""
    if not isinstance(schema, dict):
        raise ModelFileError(f"{path}: {SCHEMA_MEMBER} must be an object")
    untrusted: set[str] = set()
    stack = [(schema, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ModelFileError(f"{path}: {SCHEMA_MEMBER} is nested more than {MAX_SCHEMA_DEPTH} deep")
        if isinstance(obj, dict):
            if "__class__" in obj or "__loader__" in obj:
                name = f"{obj.get('__module__')}.{obj.get('__class__')}"
                if obj.get("__loader__") not in TRUSTED_TYPES.get(name, ()):
                    untrusted.add(f"{name} ({obj.get('__loader__')})")
                elif name == "sklearn.tree._tree.Tree":
                    _check_tree_args(path, obj)
            stack.extend((v, depth + 1) for v in obj.values() if isinstance(v, (dict, list)))
        elif isinstance(obj, list):
            stack.extend((v, depth + 1) for v in obj if isinstance(v, (dict, list)))
    if untrusted:
        shown = sorted(untrusted)
        more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
        raise ModelFileError(f"{path}: holds types a latency model is not made of: {', '.join(shown[:5])}{more}")


def _check_tree_args(path: Path, node: dict[str, Any]) -> None:
    """A tree is built as ``Tree(n_features, n_classes, n_outputs)`` before its state is set: one output only."""
    try:
        args = node["__reduce__"]["args"]
        items = args["content"]
        assert args["__loader__"] == "TupleNode" and len(items) == 3
        n_features, n_outputs = (json.loads(items[i]["content"]) for i in (0, 2))
        assert items[0]["__loader__"] == items[2]["__loader__"] == "JsonNode"
        assert _is_int(n_features) and 1 <= n_features <= MAX_FEATURES and _is_int(n_outputs) and n_outputs == 1
    except (AssertionError, KeyError, TypeError, ValueError, IndexError):
        raise ModelFileError(f"{path}: a tree is not a single-output regression tree") from None


def _build_regressors(path: Path, data: bytes) -> list[Any]:
    """skops rebuilds the regressors, trusting exactly :data:`TRUSTED_TYPES`."""
    import skops.io

    try:
        regressors = skops.io.loads(data, trusted=sorted(TRUSTED_TYPES))
    except Exception as exc:  # skops raises what its node classes meet; all of it means the same here
        raise ModelFileError(f"{path}: its regressors cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    if not isinstance(regressors, list) or not regressors:
        raise ModelFileError(f"{path}: the archive must hold a non-empty list of regressors")
    return regressors


def _assemble(path: Path, params: dict[str, Any], regressors: list[Any], force: bool) -> LatencyModel:
    """The model of ``params`` with ``regressors``, each checked (:func:`check_regressor`)."""
    model = LatencyModel(**params)
    if len(regressors) != model.n_seeds:
        raise ModelFileError(f"{path}: n_seeds is {model.n_seeds!r} but the file holds {len(regressors)} regressors")
    expected = type(model._make_estimator())
    for i, est in enumerate(regressors):
        if type(est) is not expected:
            raise ModelFileError(f"{path}: a {model.kind!r} model holds a {type(est).__name__} (regressor {i})")
        try:
            check_regressor(est, f"regressor {i}")
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}") from None
        if est.n_features_in_ != regressors[0].n_features_in_:
            raise ModelFileError(f"{path}: its regressors take different numbers of features")
    if regressors[0].n_features_in_ != len(FEATURE_NAMES) and not force:
        raise ModelFileError(f"{path}: the regressors take {regressors[0].n_features_in_} features")
    model.estimators_ = regressors
    model.n_features_in_ = regressors[0].n_features_in_
    return model


# ------------------------------------------------------------------ converting older files
def convert(old: str | os.PathLike, new: str | os.PathLike, *, overwrite: bool = False) -> dict[str, Any]:
    """Convert a JSON model file of an older version (format 1 or 2) to this format, without refitting.

    The regressors are rebuilt from the old file (:mod:`fasttree.costmodel.legacy`), checked as
    :func:`load_model` checks them and saved with the old file's metadata, plus
    ``converted_from`` (the old file's name, format version and SHA-256).

    Returns
    -------
    dict
        The metadata written.
    """
    from .legacy import read_json_model

    old, new = Path(old), Path(new)
    if new.exists() and not overwrite:
        raise FileExistsError(f"{new} exists; choose another path or overwrite it explicitly")
    meta, regressors = read_json_model(old)
    version = meta["format_version"]
    meta = {**meta, "format_version": MODEL_FORMAT_VERSION}
    meta["converted_from"] = {
        "file": old.name,
        "format_version": version,
        "sha256": hashlib.sha256(old.read_bytes()).hexdigest(),
    }
    params = _check_meta(old, meta)
    _assemble(old, params, regressors, force=True)
    write_atomic(new, _model_bytes(regressors, meta))
    return meta


def main(argv: list[str] | None = None) -> int:
    """``python -m fasttree.costmodel.persist convert OLD NEW``: exit 0, or 2 with one line naming the problem."""
    p = argparse.ArgumentParser(
        prog="python -m fasttree.costmodel.persist",
        description="Convert a JSON latency model of an older fasttree (format 1 or 2, *.json / *.json.gz) to "
        f"the current model file (format {MODEL_FORMAT_VERSION}, a skops archive), without refitting.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert an old JSON model file")
    c.add_argument("old", metavar="OLD", help="the old model file")
    c.add_argument("new", metavar="NEW", help="the model file to write (conventionally *.skops)")
    c.add_argument("--overwrite", action="store_true", help="replace NEW if it exists")
    args = p.parse_args(argv)
    try:
        meta = convert(args.old, args.new, overwrite=args.overwrite)
        load_model(args.new, force=True)
    except (ModelFileError, FileExistsError, OSError) as exc:
        c.error(str(exc))
    kind, seeds, old = meta["model_params"]["kind"], meta["model_params"]["n_seeds"], meta["converted_from"]
    print(f"{args.new}: {kind} model, {seeds} regressors, converted from format {old['format_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
