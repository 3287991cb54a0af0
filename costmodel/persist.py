"""Saving and loading a fitted :class:`~fasttree.costmodel.model.LatencyModel` as JSON (never pickle).

The file holds the model's regressors (:mod:`fasttree.costmodel.serialize`, validated
before anything is built; format version 1 held one, under ``estimator``, and is still
read) and the metadata that decides whether the model may be used: the GPU it was fitted
for, the feature schema, the trace set it was fitted on and the library versions. A path
ending in ``.gz`` is written gzip-compressed (the shipped model); reading recognises the
compression by its magic bytes. :func:`load_model` refuses a model for another GPU or
feature schema unless ``force`` is given.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

import fasttree
from fasttree.fileio import write_atomic
from fasttree.validation import check_choice

from .features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION
from .gpu import GpuSpec
from .model import LatencyModel
from .serialize import estimator_from_dict, estimator_to_dict

__all__ = ["MODEL_FORMAT", "MODEL_FORMAT_VERSION", "ModelFileError", "load_model", "save_model"]

MODEL_FORMAT = "fasttree-latency-model"
MODEL_FORMAT_VERSION = 2
#: Format versions :func:`load_model` reads (1: a single regressor under ``estimator``).
READABLE_FORMAT_VERSIONS = (1, 2)
#: Largest model file read (bytes).
MAX_MODEL_BYTES = 2 * 2**30


class ModelFileError(ValueError):
    """A model file that cannot be used here: malformed, or for another GPU or feature schema."""


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
    """Write a fitted model and its metadata to ``path`` (JSON, atomically).

    Parameters
    ----------
    path : str or PathLike
        Destination file (conventionally ``*.json``, or ``*.json.gz`` to compress it).
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
    doc = {**meta, "estimators": [estimator_to_dict(est) for est in model.estimators_]}
    text = (json.dumps(doc, sort_keys=True, allow_nan=False) + "\n").encode()
    write_atomic(path, gzip.compress(text, mtime=0) if path.suffix == ".gz" else text)
    return meta


def _read_document_bytes(path: Path) -> bytes:
    """The JSON bytes of a model file, gunzipped when it is compressed; refuses more than ``MAX_MODEL_BYTES``."""
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise ModelFileError(f"{path}: {size} bytes, larger than any model this library writes")
    raw = path.read_bytes()
    if not raw.startswith(b"\x1f\x8b"):
        return raw
    inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        text = inflate.decompress(raw, MAX_MODEL_BYTES + 1)
    except zlib.error as exc:
        raise ModelFileError(f"{path}: a damaged gzip file ({exc})") from None
    if len(text) > MAX_MODEL_BYTES:
        raise ModelFileError(f"{path}: uncompresses to more than {MAX_MODEL_BYTES} bytes, larger than any model")
    if not inflate.eof:
        raise ModelFileError(f"{path}: a truncated gzip file")
    return text


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
        On a malformed file, another format, or (without ``force``) another GPU or
        feature schema.
    """
    path = Path(path)
    try:
        doc = json.loads(_read_document_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelFileError(f"{path}: not a JSON model file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != MODEL_FORMAT:
        raise ModelFileError(f"{path}: not a {MODEL_FORMAT} file")
    version = doc.get("format_version")
    try:
        check_choice("format_version", version, READABLE_FORMAT_VERSIONS)
    except ValueError:
        raise ModelFileError(
            f"{path}: model format version {version!r}, this library reads {list(READABLE_FORMAT_VERSIONS)}"
        ) from None
    meta = {k: v for k, v in doc.items() if k not in ("estimator", "estimators")}
    problems = []
    if doc.get("feature_schema_version") != FEATURE_SCHEMA_VERSION or doc.get("feature_names") != list(FEATURE_NAMES):
        problems.append(
            f"it uses feature schema {doc.get('feature_schema_version')!r}, this library computes "
            f"{FEATURE_SCHEMA_VERSION} (refit it on the traces)"
        )
    try:
        gpu = GpuSpec.from_dict(doc.get("gpu"))
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: bad gpu entry ({exc})") from None
    if gpu_name is not None and gpu.name != gpu_name:
        problems.append(f"it was fitted on {gpu.name!r} traces, not {gpu_name!r}")
    if problems and not force:
        raise ModelFileError(f"{path}: " + "; ".join(problems) + " (force=True / --force uses it anyway)")
    params = doc.get("model_params")
    if not isinstance(params, dict):
        raise ModelFileError(f"{path}: model_params must be an object")
    if version == 1:  # one regressor, written before LatencyModel had n_seeds
        params, stored = {**params, "n_seeds": 1}, [doc.get("estimator")]
    else:
        stored = doc.get("estimators")
        if not isinstance(stored, list) or not stored:
            raise ModelFileError(f"{path}: estimators must be a non-empty list")
    try:
        model = LatencyModel(**params)
        expected = type(model._make_estimator())
        estimators = [estimator_from_dict(d) for d in stored]
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    if len(estimators) != model.n_seeds:
        raise ModelFileError(f"{path}: n_seeds is {model.n_seeds!r} but the file holds {len(estimators)} regressors")
    for i, estimator in enumerate(estimators):
        if type(estimator) is not expected:
            kind, held = params.get("kind"), type(estimator).__name__
            raise ModelFileError(f"{path}: a {kind!r} model holds a {held} (regressor {i})")
        if estimator.n_features_in_ != estimators[0].n_features_in_:
            raise ModelFileError(f"{path}: its regressors take different numbers of features")
    if estimators[0].n_features_in_ != len(FEATURE_NAMES) and not force:
        raise ModelFileError(f"{path}: the regressors take {estimators[0].n_features_in_} features")
    model.estimators_ = estimators
    model.n_features_in_ = estimators[0].n_features_in_
    return model, meta
