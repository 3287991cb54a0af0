"""Reading the JSON model files of older versions (formats 1 and 2), for conversion only.

Installed as ``fasttree.costmodel.legacy``; only
:func:`fasttree.costmodel.persist.convert` (``python -m fasttree.costmodel.persist convert OLD
NEW``) uses it. Such a file is one JSON document, gzip-compressed when its name ends in ``.gz``::

    {"format": "fasttree-latency-model", "format_version": 2, ...metadata...,
     "estimators": [REGRESSOR, ...]}          # format 1: one REGRESSOR under "estimator"
    REGRESSOR = {"format": "fasttree-sklearn-trees", "format_version": 1,
                 "type": "GradientBoostingRegressor" | "RandomForestRegressor",
                 "params": {...}, "n_features_in": int, "feature_names_in": null,
                 "estimators": [MEMBER, ...],
                 # GradientBoostingRegressor also: "max_features_", "learning_rate",
                 #   "init": "zero" or {"type": "DummyRegressor", "params": {...}, "constant": ARRAY}
                }
    MEMBER = {"type": "DecisionTreeRegressor", "params": {...}, "max_features_": int,
              "tree": {"node_count": int, "max_depth": int, "value": ARRAY,
                       "nodes": {"children_left": ARRAY, ..., one per field of scikit-learn's node}}}
    ARRAY  = {"dtype": "<f8", "shape": [...], "data": "<base64 of the little-endian bytes>"}

The regressors are built from the arrays (type names from an allow-list, arrays of numeric
dtypes whose byte count matches their shape) and then checked by
:func:`fasttree.costmodel.regressors.check_regressor`, as a loaded model file is.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.dummy import DummyRegressor
from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
from sklearn.tree import DecisionTreeRegressor
from sklearn.tree._tree import Tree

from .errors import MODEL_FORMAT, ModelFileError
from .model import LatencyModel
from .regressors import check_regressor

__all__ = ["MAX_JSON_BYTES", "read_json_model"]

#: Largest JSON text read (bytes, after gunzip): about 4x the last shipped JSON model's 21 MB.
MAX_JSON_BYTES = 96 * 2**20

_REGRESSOR_FORMAT = ("fasttree-sklearn-trees", 1)
_ALLOWED_DTYPES = frozenset({"<f4", "<f8", "|i1", "<i1", "<i2", "<i4", "<i8", "|u1", "<u1", "<u2", "<u4", "<u8"})
# node struct field -> the key the file names it by (the others share the field's name)
_FIELD_TO_KEY = {"left_child": "children_left", "right_child": "children_right"}


def read_json_model(path: str | Path) -> tuple[dict[str, Any], list[Any]]:
    """The metadata and the regressors of an old JSON model file.

    Returns
    -------
    meta : dict
        Everything but the regressors; ``model_params`` completed with the defaults of
        parameters the file predates (format 1 had one regressor and no ``n_seeds``).
    regressors : list
        Built and checked, ``n_seeds`` of them.

    Raises
    ------
    ModelFileError
        Naming what is wrong with the file.
    """
    path = Path(path)
    doc = _read_document(path)
    if not isinstance(doc, dict) or doc.get("format") != MODEL_FORMAT:
        raise ModelFileError(f"{path}: not a {MODEL_FORMAT} file")
    version = doc.get("format_version")
    if version not in (1, 2) or isinstance(version, bool):
        raise ModelFileError(f"{path}: JSON model format version {version!r}; the JSON formats were 1 and 2")
    params = doc.get("model_params")
    if not isinstance(params, dict):
        raise ModelFileError(f"{path}: model_params must be an object")
    if version == 1:  # one regressor, written before LatencyModel had n_seeds
        params, stored = {**params, "n_seeds": 1}, [doc.get("estimator")]
    else:
        stored = doc.get("estimators")
        if not isinstance(stored, list) or not stored:
            raise ModelFileError(f"{path}: estimators must be a non-empty list")
    if "kind" not in params:
        raise ModelFileError(f"{path}: model_params lacks kind")
    meta = {k: v for k, v in doc.items() if k not in ("estimator", "estimators")}
    meta["model_params"] = {**LatencyModel().get_params(), **params}
    regressors = []
    for i, d in enumerate(stored):
        try:
            est = _regressor(d)
            check_regressor(est, f"regressor {i}")
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ModelFileError(f"{path}: regressor {i}: {type(exc).__name__}: {exc}") from None
        regressors.append(est)
    return meta, regressors


def _read_document(path: Path) -> Any:
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ModelFileError(f"{path}: {size} bytes, more than any JSON model ({MAX_JSON_BYTES} bytes at most)")
    with open(path, "rb") as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if raw.startswith(b"\x1f\x8b"):
        inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            raw = inflate.decompress(raw, MAX_JSON_BYTES + 1)
        except zlib.error as exc:
            raise ModelFileError(f"{path}: a damaged gzip file ({exc})") from None
        if len(raw) > MAX_JSON_BYTES:
            raise ModelFileError(f"{path}: uncompresses to more than any JSON model ({MAX_JSON_BYTES} bytes)")
        if not inflate.eof:
            raise ModelFileError(f"{path}: a truncated gzip file")
    if len(raw) > MAX_JSON_BYTES:
        raise ModelFileError(f"{path}: more than any JSON model ({MAX_JSON_BYTES} bytes)")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ModelFileError(f"{path}: not a JSON model file ({exc})") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _array(obj: Any, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Decode one ARRAY: a numeric dtype, a shape (``shape`` when given) and exactly the bytes they need."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise ValueError(f"{name}: an array must be an object with dtype, shape and data")
    if obj["dtype"] not in _ALLOWED_DTYPES:
        raise ValueError(f"{name}: dtype {obj['dtype']!r} is not allowed")
    dims = obj["shape"]
    if not isinstance(dims, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in dims):
        raise ValueError(f"{name}: shape must be a list of non-negative integers")
    if shape is not None and tuple(dims) != shape:
        raise ValueError(f"{name}: shape {dims}, expected {list(shape)}")
    dtype = np.dtype(obj["dtype"])
    if not isinstance(obj["data"], str) or len(obj["data"]) != 4 * ((math.prod(dims) * dtype.itemsize + 2) // 3):
        raise ValueError(f"{name}: data is not the base64 of {dims} {obj['dtype']} values")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{name}: invalid base64 data ({exc})") from None
    if len(raw) != math.prod(dims) * dtype.itemsize:
        raise ValueError(f"{name}: data is not the base64 of {dims} {obj['dtype']} values")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(dims)


def _int(d: dict[str, Any], key: str, name: str) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{name}: {key} must be an integer")
    return v


def _params(d: dict[str, Any], name: str) -> dict[str, Any]:
    params = d["params"]
    if not isinstance(params, dict):
        raise ValueError(f"{name}: params must be an object")
    return params


def _regressor(d: Any) -> Any:
    if not isinstance(d, dict) or (d.get("format"), d.get("format_version")) != _REGRESSOR_FORMAT:
        raise ValueError("not a fasttree-sklearn-trees (version 1) regressor")
    if d.get("feature_names_in") is not None:
        raise ValueError("has feature names (the latency model's regressors take unnamed columns)")
    kind = d.get("type")
    n_features = _int(d, "n_features_in", kind)
    members = d["estimators"]
    if not isinstance(members, list) or not members:
        raise ValueError(f"{kind}: estimators must be a non-empty list")
    trees = [_tree_regressor(m, n_features, f"{kind}.estimators[{i}]") for i, m in enumerate(members)]
    if kind == "RandomForestRegressor":
        est = RandomForestRegressor(**_params(d, kind))
        est.n_outputs_ = 1
        est.estimator_ = DecisionTreeRegressor()
        est.estimators_ = trees
    elif kind == "GradientBoostingRegressor":
        est = GradientBoostingRegressor(**_params(d, kind))
        est.learning_rate = d["learning_rate"]
        est.max_features_ = _int(d, "max_features_", kind)
        est.n_trees_per_iteration_ = 1
        if d["init"] == "zero":
            est.init_ = "zero"
        else:
            init = d["init"]
            if not isinstance(init, dict) or init.get("type") != "DummyRegressor":
                raise ValueError(f"{kind}: init must be 'zero' or a DummyRegressor")
            est.init_ = DummyRegressor(**_params(init, f"{kind}.init"))
            est.init_.n_features_in_ = n_features
            est.init_.n_outputs_ = 1
            est.init_.constant_ = _array(init["constant"], f"{kind}.init.constant", (1, 1)).astype(np.float64)
        est.estimators_ = np.empty((len(trees), 1), dtype=object)
        for i, tree in enumerate(trees):
            est.estimators_[i, 0] = tree
        est.n_estimators_ = len(trees)
        est._loss = est._get_loss(sample_weight=None)  # what fit makes from loss and alpha (private, as _loss is)
    else:
        raise ValueError(f"regressor type {kind!r} is not one a latency model is made of")
    est.n_features_in_ = n_features
    return est


def _tree_regressor(m: Any, n_features: int, name: str) -> DecisionTreeRegressor:
    if not isinstance(m, dict) or m.get("type") != "DecisionTreeRegressor" or not isinstance(m.get("tree"), dict):
        raise ValueError(f"{name}: expected a DecisionTreeRegressor with a tree")
    est = DecisionTreeRegressor(**_params(m, name))
    est.n_features_in_ = n_features
    est.n_outputs_ = 1
    est.max_features_ = _int(m, "max_features_", name)
    t = m["tree"]
    n = _int(t, "node_count", name)
    stored = t["nodes"]
    if n < 1 or not isinstance(stored, dict):
        raise ValueError(f"{name}: a tree needs nodes")
    nodes = np.zeros(n, dtype=_node_dtype())
    for field in nodes.dtype.names:
        key = _FIELD_TO_KEY.get(field, field)
        if key not in stored:
            raise ValueError(f"{name}: the file's tree nodes lack {key} (another scikit-learn's node layout)")
        nodes[field] = _array(stored[key], f"{name}.{key}", (n,))
    values = _array(t["value"], f"{name}.value", (n, 1, 1)).astype(np.float64)
    tree = Tree(n_features, np.array([1], dtype=np.intp), 1)
    tree.__setstate__({"max_depth": _int(t, "max_depth", name), "node_count": n, "nodes": nodes, "values": values})
    est.tree_ = tree
    return est


@functools.cache
def _node_dtype() -> np.dtype:
    """The running scikit-learn's node struct, as its pickle state (``Tree.__getstate__``) has it."""
    tiny = DecisionTreeRegressor().fit(np.array([[0.0], [1.0]]), np.array([0.0, 1.0]))
    return tiny.tree_.__getstate__()["nodes"].dtype
