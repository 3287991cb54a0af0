"""Safe, pickle-free JSON files of fitted scikit-learn tree regressors (installed as ``fasttree.costmodel.serialize``).

A pickled scikit-learn model runs arbitrary code when it is loaded. The format here is plain JSON: numbers, strings,
lists and objects, with numpy arrays as base64 of their little-endian bytes. Loading a file from an untrusted source
can therefore never run code, and every number that later drives an array index in scikit-learn's compiled code
(child pointers, feature indices, depth, node count) is checked before any estimator is built, so a tampered file
cannot crash the process either: it raises :class:`ValueError`.

Supported (fitted, single-output) estimators:

- ``sklearn.tree.DecisionTreeRegressor``
- ``sklearn.ensemble.RandomForestRegressor`` (member trees ``DecisionTreeRegressor``)
- ``sklearn.ensemble.ExtraTreesRegressor`` (member trees ``sklearn.tree.ExtraTreeRegressor``)
- ``sklearn.ensemble.GradientBoostingRegressor`` with ``loss`` one of ``"squared_error"``, ``"absolute_error"``,
  ``"huber"`` and ``init`` either ``None`` (the default ``DummyRegressor``) or ``"zero"``.

A loaded estimator predicts bit-identically to the saved one. It is meant for prediction: fit-time-only state
(``train_score_``, out-of-bag scores, the random generators of boosting) is not stored.

Layout of a file (:func:`estimator_to_dict`)::

    {"format": "fasttree-sklearn-trees", "format_version": 1, "type": "GradientBoostingRegressor",
     "sklearn_version": "1.9.1",              # informational
     "params": {...},                         # get_params(deep=False), JSON-able values only
     "n_features_in": 6, "feature_names_in": null or ["a", ...],
     # DecisionTreeRegressor:     "max_features_": int, "tree": TREE
     # Random/ExtraTreesRegressor: "estimators": [MEMBER, ...]
     # GradientBoostingRegressor: "max_features_": int, "learning_rate": float,
     #                            "init": "zero" or {"type": "DummyRegressor", "params": {...}, "constant": ARRAY},
     #                            "estimators": [MEMBER, ...]       (estimators_[:, 0])
    }
    MEMBER = {"type": "DecisionTreeRegressor" | "ExtraTreeRegressor", "params": {...}, "max_features_": int,
              "tree": TREE}
    TREE   = {"node_count": int, "max_depth": int, "value": ARRAY (node_count, 1, 1) float,
              "nodes": {"children_left": ARRAY, "children_right": ARRAY, "feature": ARRAY, "threshold": ARRAY,
                        "impurity": ARRAY, "n_node_samples": ARRAY, "weighted_n_node_samples": ARRAY,
                        "missing_go_to_left": ARRAY}}          # one entry per field of sklearn's node struct
    ARRAY  = {"dtype": "<f8", "shape": [...], "data": "<base64>"}   (encode_array / decode_array)

The node fields are named by the public ``Tree`` attributes. On load they must be exactly the fields of the running
scikit-learn's node struct; a file written under another node layout is refused rather than guessed at.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import sklearn
from sklearn.dummy import DummyRegressor
from sklearn.ensemble import ExtraTreesRegressor, GradientBoostingRegressor, RandomForestRegressor
from sklearn.exceptions import NotFittedError
from sklearn.tree import DecisionTreeRegressor, ExtraTreeRegressor
from sklearn.utils.validation import check_is_fitted

from fasttree.validation import is_int, is_number

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_TEXT_CHARS",
    "MAX_TOTAL_NODES",
    "decode_array",
    "dumps",
    "encode_array",
    "estimator_from_dict",
    "estimator_to_dict",
    "loads",
]

FORMAT_NAME = "fasttree-sklearn-trees"
FORMAT_VERSION = 1

#: Most tree nodes, summed over all trees of a model, that :func:`estimator_from_dict` accepts.
MAX_TOTAL_NODES = 50_000_000
#: Longest JSON text that :func:`loads` parses (about what ``MAX_TOTAL_NODES`` nodes take).
MAX_TEXT_CHARS = 8 * 2**30
#: Most input features a model may declare (bounds the arrays scikit-learn sizes by the feature count).
MAX_FEATURES = 10_000_000
#: Most dimensions of an encoded array.
MAX_NDIM = 8

# Array dtypes an encoded array may declare: little-endian (or byte-order-free) integers and floats, never objects,
# strings, structured or big-endian types. The byte-order-free types are accepted with either prefix.
_ALLOWED_DTYPES = frozenset(
    {"<f4", "<f8", "|i1", "<i1", "<i2", "<i4", "<i8", "|u1", "<u1", "<u2", "<u4", "<u8"},
)

_TREE_LEAF = -1  # sklearn.tree._tree.TREE_LEAF: child pointer of a leaf
_TREE_UNDEFINED = -2  # sklearn.tree._tree.TREE_UNDEFINED: feature (and threshold) of a leaf

# Node struct field -> public attribute of ``Tree`` that holds it (fields not listed share the attribute's name).
_FIELD_TO_ATTR = {"left_child": "children_left", "right_child": "children_right"}
_ATTR_TO_FIELD = {attr: field for field, attr in _FIELD_TO_ATTR.items()}
# Node fields this module knows how to check. A running scikit-learn with any other field is refused.
_KNOWN_FIELDS = frozenset(
    {
        "left_child",
        "right_child",
        "feature",
        "threshold",
        "impurity",
        "n_node_samples",
        "weighted_n_node_samples",
        "missing_go_to_left",
    }
)

_TOP_LEVEL_TYPES: dict[str, type] = {
    "DecisionTreeRegressor": DecisionTreeRegressor,
    "RandomForestRegressor": RandomForestRegressor,
    "ExtraTreesRegressor": ExtraTreesRegressor,
    "GradientBoostingRegressor": GradientBoostingRegressor,
}
# Type of the member trees of each ensemble.
_MEMBER_TYPES: dict[str, type] = {
    "RandomForestRegressor": DecisionTreeRegressor,
    "ExtraTreesRegressor": ExtraTreeRegressor,
    "GradientBoostingRegressor": DecisionTreeRegressor,
}
_GBR_LOSSES = ("squared_error", "absolute_error", "huber")


# ----------------------------------------------------------------------------------------------------------------
# Arrays
# ----------------------------------------------------------------------------------------------------------------


def encode_array(arr: Any) -> dict[str, Any]:
    """Encode a numeric numpy array as a JSON-ready dict.

    Parameters
    ----------
    arr : array_like
        Integer or floating-point array (any byte order, any memory layout).

    Returns
    -------
    dict
        ``{"dtype": str, "shape": list[int], "data": str}``: the little-endian dtype string (``"<f8"``, ``"|u1"``,
        ...), the shape and the base64 of the array's C-order little-endian bytes.

    Raises
    ------
    ValueError
        If the array is not of an allowed numeric dtype (objects, strings, booleans, complex, float16, ...).
    """
    a = np.asarray(arr)
    if a.dtype.kind not in "iuf":
        raise ValueError(f"cannot encode an array of dtype {a.dtype.str!r}: only integer and float arrays")
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    if a.dtype.str not in _ALLOWED_DTYPES:
        raise ValueError(f"cannot encode an array of dtype {a.dtype.str!r}: allowed {sorted(_ALLOWED_DTYPES)}")
    return {
        "dtype": a.dtype.str,
        "shape": [int(s) for s in a.shape],
        "data": base64.b64encode(a.tobytes(order="C")).decode("ascii"),
    }


def decode_array(
    obj: Any,
    *,
    name: str = "array",
    expected_shape: tuple[int, ...] | None = None,
    expected_kinds: str | None = None,
    max_elements: int | None = None,
) -> np.ndarray:
    """Decode and check an array written by :func:`encode_array`.

    Everything is checked before the base64 text is decoded: the dtype against an allow-list of numeric types, the
    shape, the element count and the length of the base64 text against the declared dtype and shape.

    Parameters
    ----------
    obj : object
        The ``{"dtype", "shape", "data"}`` dict.
    name : str, default "array"
        What the array is, for error messages.
    expected_shape : tuple of int, optional
        The shape the array must have.
    expected_kinds : str, optional
        The numpy dtype kinds it may have (``"f"``, ``"iu"``).
    max_elements : int, optional
        Most elements it may have.

    Returns
    -------
    numpy.ndarray
        A new, writable, native-byte-order array.

    Raises
    ------
    ValueError
        On any malformed or mismatching input.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"{name}: an encoded array must be an object, got {type(obj).__name__}")
    if set(obj) != {"dtype", "shape", "data"}:
        raise ValueError(f"{name}: an encoded array needs exactly the keys dtype, shape, data; got {sorted(obj)}")
    dtype_str, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype_str, str) or dtype_str not in _ALLOWED_DTYPES:
        raise ValueError(f"{name}: dtype {dtype_str!r} is not allowed (allowed: {sorted(_ALLOWED_DTYPES)})")
    dtype = np.dtype(dtype_str)
    if expected_kinds is not None and dtype.kind not in expected_kinds:
        raise ValueError(f"{name}: dtype {dtype_str!r} is of the wrong kind (expected kind in {expected_kinds!r})")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(is_int(s) and s >= 0 for s in shape):
        raise ValueError(f"{name}: shape must be a list of at most {MAX_NDIM} non-negative integers, got {shape!r}")
    shape_t = tuple(int(s) for s in shape)
    if expected_shape is not None and shape_t != tuple(expected_shape):
        raise ValueError(f"{name}: shape {list(shape_t)} but expected {list(expected_shape)}")
    n_elements = math.prod(shape_t)
    if max_elements is not None and n_elements > max_elements:
        raise ValueError(f"{name}: {n_elements} elements, more than the limit of {max_elements}")
    if not isinstance(data, str):
        raise ValueError(f"{name}: data must be a base64 string, got {type(data).__name__}")
    n_bytes = n_elements * dtype.itemsize
    expected_chars = 4 * ((n_bytes + 2) // 3)
    if len(data) != expected_chars:
        raise ValueError(
            f"{name}: base64 data has {len(data)} characters but dtype {dtype_str} and shape {list(shape_t)} "
            f"need {expected_chars}"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{name}: invalid base64 data ({exc})") from None
    if len(raw) != n_bytes:
        raise ValueError(f"{name}: base64 data decodes to {len(raw)} bytes but {n_bytes} are needed")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape_t)


# ----------------------------------------------------------------------------------------------------------------
# The private scikit-learn pieces (all of them are here)
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def _node_dtype() -> np.dtype:
    """The structured dtype of the running scikit-learn's tree nodes.

    ``sklearn.tree._tree.NODE_DTYPE`` is not public; the dtype of the ``nodes`` array of a fitted tree's pickle state
    (``Tree.__getstate__``) is, for all practical purposes, the same thing and is read from a tiny fitted tree.
    """
    tiny = DecisionTreeRegressor().fit(np.array([[0.0], [1.0]]), np.array([0.0, 1.0]))
    return tiny.tree_.__getstate__()["nodes"].dtype


def _make_tree(n_features: int, max_depth: int, nodes: np.ndarray, values: np.ndarray) -> Any:
    """Build a single-output regression ``sklearn.tree._tree.Tree`` from checked node and value arrays.

    There is no public constructor of a fitted tree: the private ``Tree`` class and its pickle-state setter
    (``__setstate__``, which copies the arrays into the tree's C buffers) are the only way in. ``nodes`` and
    ``values`` must already have passed :func:`_check_tree`.
    """
    from sklearn.tree._tree import Tree  # private module, see the docstring

    tree = Tree(n_features, np.array([1], dtype=np.intp), 1)
    tree.__setstate__({"max_depth": max_depth, "node_count": nodes.shape[0], "nodes": nodes, "values": values})
    return tree


def _gbr_loss(est: GradientBoostingRegressor) -> Any:
    """The loss object a fitted ``GradientBoostingRegressor`` keeps in ``_loss``.

    ``predict`` reads ``est._loss`` (its link function maps the init estimator's predictions to raw predictions).
    Both the attribute and ``_get_loss``, the method ``fit`` builds it with, are private; ``_get_loss`` is used so
    that the loss is exactly the one ``fit`` would make from the estimator's ``loss`` and ``alpha``.
    """
    return est._get_loss(sample_weight=None)


# ----------------------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------------------


def estimator_to_dict(est: Any) -> dict[str, Any]:
    """Describe a fitted tree regressor as a JSON-ready dict.

    Parameters
    ----------
    est : estimator
        A fitted, single-output ``DecisionTreeRegressor``, ``RandomForestRegressor``, ``ExtraTreesRegressor`` or
        ``GradientBoostingRegressor`` (exactly these classes, not subclasses).

    Returns
    -------
    dict
        Holds only dicts, lists, str, int, float, bool and None (see the module docstring for the layout).

    Raises
    ------
    ValueError
        If the estimator is of another type, not fitted, multi-output, or a boosting model with an unsupported
        ``loss`` or ``init``.
    """
    type_name = type(est).__name__
    if _TOP_LEVEL_TYPES.get(type_name) is not type(est):
        raise ValueError(
            f"unsupported estimator type {type(est).__module__}.{type_name}; supported: {sorted(_TOP_LEVEL_TYPES)}"
        )
    try:
        check_is_fitted(est)
    except NotFittedError:
        raise ValueError(f"the {type_name} is not fitted") from None

    d: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "type": type_name,
        "sklearn_version": sklearn.__version__,
        "params": _jsonable_params(est),
        "n_features_in": int(est.n_features_in_),
        "feature_names_in": _feature_names_to_list(est),
    }
    if isinstance(est, DecisionTreeRegressor):
        d["max_features_"] = int(est.max_features_)
        d["tree"] = _tree_state_to_dict(est, type_name)
    elif isinstance(est, GradientBoostingRegressor):
        d.update(_gbr_to_dict(est))
    else:
        if int(est.n_outputs_) != 1:
            raise ValueError(f"only single-output models are supported; this {type_name} has {est.n_outputs_}")
        member_type = _MEMBER_TYPES[type_name]
        d["estimators"] = [
            _member_to_dict(tree, member_type, f"{type_name}.estimators_[{i}]")
            for i, tree in enumerate(est.estimators_)
        ]
    return d


def _gbr_to_dict(est: GradientBoostingRegressor) -> dict[str, Any]:
    """The boosting-specific part of :func:`estimator_to_dict`."""
    if est.loss not in _GBR_LOSSES:
        raise ValueError(
            f"GradientBoostingRegressor with loss={est.loss!r} is not supported (supported: {_GBR_LOSSES})"
        )
    if est.init is not None and not (isinstance(est.init, str) and est.init == "zero"):
        raise ValueError(f"GradientBoostingRegressor with init={est.init!r} is not supported (None or 'zero' only)")
    if int(est.n_trees_per_iteration_) != 1 or est.estimators_.ndim != 2 or est.estimators_.shape[1] != 1:
        raise ValueError("GradientBoostingRegressor: expected one tree per boosting iteration")
    if isinstance(est.init_, str):
        if est.init_ != "zero":
            raise ValueError(f"GradientBoostingRegressor: unsupported init_ {est.init_!r}")
        init: Any = "zero"
    else:
        if type(est.init_) is not DummyRegressor:
            raise ValueError(f"GradientBoostingRegressor: unsupported init_ of type {type(est.init_).__name__}")
        constant = np.asarray(est.init_.constant_, dtype=np.float64)
        if constant.shape != (1, 1):
            raise ValueError(f"GradientBoostingRegressor: init_.constant_ has shape {constant.shape}, expected (1, 1)")
        init = {"type": "DummyRegressor", "params": _jsonable_params(est.init_), "constant": encode_array(constant)}
    learning_rate = _jsonable_scalar(est.learning_rate)
    if not is_number(learning_rate):
        raise ValueError(f"GradientBoostingRegressor: learning_rate {est.learning_rate!r} is not a finite number")
    return {
        "max_features_": int(est.max_features_),
        "learning_rate": learning_rate,
        "init": init,
        "estimators": [
            _member_to_dict(tree, DecisionTreeRegressor, f"GradientBoostingRegressor.estimators_[{i}, 0]")
            for i, tree in enumerate(est.estimators_[:, 0])
        ],
    }


def _member_to_dict(tree_est: Any, member_type: type, where: str) -> dict[str, Any]:
    """A member tree of an ensemble: its type, parameters, ``max_features_`` and tree."""
    if type(tree_est) is not member_type:
        raise ValueError(f"{where}: expected a {member_type.__name__}, got {type(tree_est).__name__}")
    return {
        "type": member_type.__name__,
        "params": _jsonable_params(tree_est),
        "max_features_": int(tree_est.max_features_),
        "tree": _tree_state_to_dict(tree_est, where),
    }


def _tree_state_to_dict(tree_est: Any, where: str) -> dict[str, Any]:
    """The ``tree_`` of a fitted tree estimator, from its public attributes."""
    if int(tree_est.n_outputs_) != 1:
        raise ValueError(f"{where}: only single-output trees are supported, this one has {tree_est.n_outputs_}")
    tree = tree_est.tree_
    node_count = int(tree.node_count)
    value = np.asarray(tree.value)
    if value.shape != (node_count, 1, 1):
        raise ValueError(f"{where}: tree_.value has shape {value.shape}, expected ({node_count}, 1, 1)")
    nodes: dict[str, Any] = {}
    state_nodes = None
    for field in _node_dtype().names:
        attr = _FIELD_TO_ATTR.get(field, field)
        if hasattr(tree, attr):
            arr = np.asarray(getattr(tree, attr))
        else:  # a field without a public attribute: take it from the pickle state
            if state_nodes is None:
                state_nodes = tree.__getstate__()["nodes"]
            arr = state_nodes[field][:node_count]
        nodes[attr] = encode_array(arr)
    return {
        "node_count": node_count,
        "max_depth": int(tree.max_depth),
        "nodes": nodes,
        "value": encode_array(value.astype(np.float64, copy=False)),
    }


def _feature_names_to_list(est: Any) -> list[str] | None:
    names = getattr(est, "feature_names_in_", None)
    if names is None:
        return None
    return [str(n) for n in names]


def _jsonable_scalar(v: Any) -> Any:
    """``v`` as a JSON scalar, or the sentinel ``_DROP`` when it is not one (objects, NaN, infinities)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else _DROP
    return _DROP


_DROP = object()


def _jsonable_params(est: Any) -> dict[str, Any]:
    """``est.get_params(deep=False)`` less the values JSON cannot hold exactly (estimators, random generators,
    non-finite floats); flat lists and 1-d arrays of scalars become lists."""
    out: dict[str, Any] = {}
    for key, value in est.get_params(deep=False).items():
        if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1):
            items = [_jsonable_scalar(v) for v in value]
            if all(item is not _DROP for item in items):
                out[key] = items
            continue
        converted = _jsonable_scalar(value)
        if converted is not _DROP:
            out[key] = converted
    return out


def dumps(est: Any) -> str:
    """Serialize a fitted tree regressor to JSON text (see :func:`estimator_to_dict`).

    Parameters
    ----------
    est : estimator
        A supported fitted estimator.

    Returns
    -------
    str
        Compact JSON with sorted keys and no NaN or infinity literals.
    """
    return json.dumps(estimator_to_dict(est), sort_keys=True, allow_nan=False, separators=(",", ":"))


# ----------------------------------------------------------------------------------------------------------------
# Loading: checking (nothing is built until the whole document has passed)
# ----------------------------------------------------------------------------------------------------------------


def _check_keys(obj: Any, where: str, required: set[str], optional: frozenset[str] | set[str] = frozenset()) -> None:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    keys = set(obj)
    if not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{where}: keys must be strings")
    missing = required - keys
    if missing:
        raise ValueError(f"{where}: missing keys {sorted(missing)}")
    extra = keys - required - set(optional)
    if extra:
        raise ValueError(f"{where}: unexpected keys {sorted(extra)}")


def _get_int(obj: Mapping[str, Any], key: str, where: str, lo: int, hi: int | None = None) -> int:
    v = obj[key]
    if not is_int(v):
        raise ValueError(f"{where}: {key} must be an integer, got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{where}: {key} = {v} is outside [{lo}, {hi if hi is not None else 'inf'}]")
    return v


def _is_json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, str)) or is_number(v, finite=True)


@functools.cache
def _param_names(cls: type) -> frozenset[str]:
    return frozenset(cls().get_params(deep=False))


def _check_params(raw: Any, cls: type, where: str) -> dict[str, Any]:
    """Constructor parameters: known names of ``cls``, JSON scalars or flat lists of them."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: params must be an object, got {type(raw).__name__}")
    allowed = _param_names(cls)
    params: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or key not in allowed:
            raise ValueError(f"{where}: unknown parameter {key!r} for {cls.__name__}")
        if isinstance(value, list):
            if not all(_is_json_scalar(v) for v in value):
                raise ValueError(f"{where}: parameter {key!r} must be a list of plain scalars")
            params[key] = list(value)
        elif _is_json_scalar(value):
            params[key] = value
        else:
            raise ValueError(f"{where}: parameter {key!r} has a value of unsupported type {type(value).__name__}")
    return params


def _check_max_features(obj: Mapping[str, Any], where: str, n_features: int) -> int:
    return _get_int(obj, "max_features_", where, 1, n_features)


def _check_node_layout(stored_attrs: Any, where: str) -> dict[str, str]:
    """Map the stored node attribute names to the running node fields; refuse any other layout."""
    node_dtype = _node_dtype()
    running = set(node_dtype.names)
    unknown_running = running - _KNOWN_FIELDS
    if unknown_running:
        raise ValueError(
            f"the running scikit-learn {sklearn.__version__} has tree node fields this loader cannot check: "
            f"{sorted(unknown_running)}"
        )
    if not isinstance(stored_attrs, Mapping):
        raise ValueError(f"{where}: nodes must be an object, got {type(stored_attrs).__name__}")
    stored = {_ATTR_TO_FIELD.get(a, a) if isinstance(a, str) else a for a in stored_attrs}
    if stored != running:
        missing = sorted(running - stored)
        extra = sorted(str(f) for f in stored - running)
        raise ValueError(
            f"{where}: the model was saved with another scikit-learn tree node layout than the running "
            f"scikit-learn {sklearn.__version__} (missing fields {missing}, extra fields {extra})"
        )
    return {_FIELD_TO_ATTR.get(f, f): f for f in running}


def _decode_tree(obj: Any, where: str, n_features: int) -> dict[str, Any]:
    """Decode and check one ``TREE`` object; returns the node structured array and values ready for ``Tree``."""
    _check_keys(obj, where, {"node_count", "max_depth", "nodes", "value"})
    n = _get_int(obj, "node_count", where, 1)
    max_depth = _get_int(obj, "max_depth", where, 0, n - 1)
    attr_to_field = _check_node_layout(obj["nodes"], where)
    node_dtype = _node_dtype()

    fields: dict[str, np.ndarray] = {}
    for attr, field in attr_to_field.items():
        target = node_dtype.fields[field][0]
        kinds = "f" if target.kind == "f" else "iu"
        arr = decode_array(obj["nodes"][attr], name=f"{where}: {attr}", expected_shape=(n,), expected_kinds=kinds)
        if kinds == "iu" and arr.size:
            info = np.iinfo(target)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"{where}: {attr} has values outside the range of {target}")
        fields[field] = arr
    value = decode_array(obj["value"], name=f"{where}: value", expected_shape=(n, 1, 1), expected_kinds="f")

    _check_tree(fields, value, n, max_depth, n_features, where)

    nodes = np.zeros(n, dtype=node_dtype)
    for field, arr in fields.items():
        nodes[field] = arr.astype(node_dtype.fields[field][0])
    values = np.ascontiguousarray(value, dtype=np.float64)
    return {"max_depth": max_depth, "nodes": nodes, "values": values}


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_tree(
    fields: dict[str, np.ndarray], value: np.ndarray, n: int, max_depth: int, n_features: int, where: str
) -> None:
    """The structural checks of one tree (see the module docstring); raises ValueError naming the first bad node."""
    left, right = fields["left_child"].astype(np.int64), fields["right_child"].astype(np.int64)
    leaf = _check_child_links(left, right, n, where)
    _check_one_rooted_tree(left, right, leaf, n, max_depth, where)
    _check_splits(fields, leaf, n_features, where)
    _check_node_statistics(fields, value, n, where)


def _check_child_links(left: np.ndarray, right: np.ndarray, n: int, where: str) -> np.ndarray:
    """Children in range, none its own parent's, both or none per node; returns the leaf mask."""
    idx = np.arange(n, dtype=np.int64)

    for attr, child in (("children_left", left), ("children_right", right)):
        bad = (child < _TREE_LEAF) | (child >= n)
        if bad.any():
            i = _first(bad)
            raise ValueError(f"{where}: {attr}[{i}] = {int(child[i])} is out of range [-1, {n})")
        bad = child == idx
        if bad.any():
            raise ValueError(f"{where}: node {_first(bad)} is its own child")
    leaf = left == _TREE_LEAF
    bad = leaf != (right == _TREE_LEAF)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: node {i} has exactly one child (children {int(left[i])}, {int(right[i])})")
    return leaf


def _check_one_rooted_tree(
    left: np.ndarray, right: np.ndarray, leaf: np.ndarray, n: int, max_depth: int, where: str
) -> None:
    """One parent per node but the root, every node reachable from the root, and ``max_depth`` the true depth."""
    internal = ~leaf
    # Every node but the root has exactly one parent; the root has none.
    children = np.concatenate([left[internal], right[internal]])
    n_parents = np.bincount(children, minlength=n)
    if n_parents[0] != 0:
        raise ValueError(f"{where}: the root node 0 is the child of another node (a cycle)")
    bad = n_parents[1:] != 1
    if bad.any():
        i = _first(bad) + 1
        raise ValueError(f"{where}: node {i} has {int(n_parents[i])} parents, expected exactly 1")
    # Breadth-first from the root. With one parent per node no node is reached twice, so this ends after at most n
    # nodes; reaching fewer than n means the rest form cycles apart from the root.
    frontier = np.zeros(1, dtype=np.int64)
    reached, depth = 1, 0
    while True:
        frontier = frontier[internal[frontier]]
        if frontier.size == 0:
            break
        frontier = np.concatenate([left[frontier], right[frontier]])
        reached += frontier.size
        depth += 1
    if reached != n:
        raise ValueError(f"{where}: {n - reached} of {n} nodes are not reachable from the root (a cycle)")
    if depth != max_depth:
        # scikit-learn sizes buffers by max_depth (decision_path), so it must be the true depth
        raise ValueError(f"{where}: max_depth is {max_depth} but the tree is {depth} deep")


def _check_splits(fields: dict[str, np.ndarray], leaf: np.ndarray, n_features: int, where: str) -> None:
    """Split features in range on internal nodes (undefined on leaves) and valid thresholds."""
    internal = ~leaf
    feature = fields["feature"]
    bad = internal & ((feature < 0) | (feature >= n_features))
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: feature[{i}] = {int(feature[i])} is out of range [0, {n_features})")
    bad = leaf & (feature != _TREE_UNDEFINED)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: leaf node {i} has feature {int(feature[i])}, expected {_TREE_UNDEFINED}")

    threshold = fields["threshold"].astype(np.float64)
    # +inf is a legitimate split threshold: scikit-learn uses it for "non-missing left, missing right".
    bad = np.isnan(threshold) | np.isneginf(threshold) | (leaf & np.isinf(threshold))
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: threshold[{i}] = {threshold[i]} is not a valid threshold")


def _check_node_statistics(fields: dict[str, np.ndarray], value: np.ndarray, n: int, where: str) -> None:
    """Missing-value routing 0 or 1, sample counts non-negative, weights, impurities and values finite."""
    if "missing_go_to_left" in fields:
        mgl = fields["missing_go_to_left"]
        bad = (mgl != 0) & (mgl != 1)
        if bad.any():
            i = _first(bad)
            raise ValueError(f"{where}: missing_go_to_left[{i}] = {int(mgl[i])} is not 0 or 1")
    bad = fields["n_node_samples"] < 0
    if bad.any():
        raise ValueError(f"{where}: n_node_samples[{_first(bad)}] is negative")
    # Not read by predict, but by feature_importances_ and partial dependence.
    weights = fields["weighted_n_node_samples"]
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: weighted_n_node_samples[{i}] = {weights[i]} is not a finite non-negative number")
    bad = ~np.isfinite(fields["impurity"])
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: impurity[{i}] = {fields['impurity'][i]} is not finite")

    bad = ~np.isfinite(value.reshape(n))
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: value[{i}] = {value.reshape(n)[i]} is not finite")


def _decode_member(obj: Any, member_type: type, where: str, n_features: int) -> dict[str, Any]:
    """Decode and check one ``MEMBER`` object of an ensemble."""
    _check_keys(obj, where, {"type", "params", "max_features_", "tree"})
    if obj["type"] != member_type.__name__:
        raise ValueError(f"{where}: member type {obj['type']!r}, expected {member_type.__name__!r}")
    return {
        "cls": member_type,
        "params": _check_params(obj["params"], member_type, where),
        "max_features_": _check_max_features(obj, where, n_features),
        "tree": _decode_tree(obj["tree"], where, n_features),
    }


def _node_count_of(tree_obj: Any, where: str) -> int:
    """``node_count`` of a ``TREE`` object, read before anything is decoded (for the size limit)."""
    if not isinstance(tree_obj, Mapping) or "node_count" not in tree_obj:
        raise ValueError(f"{where}: tree must be an object with a node_count")
    return _get_int(tree_obj, "node_count", where, 1)


_COMMON_KEYS = {"format", "format_version", "type", "params", "n_features_in", "feature_names_in"}
_EXTRA_KEYS = {
    "DecisionTreeRegressor": {"max_features_", "tree"},
    "RandomForestRegressor": {"estimators"},
    "ExtraTreesRegressor": {"estimators"},
    "GradientBoostingRegressor": {"max_features_", "learning_rate", "init", "estimators"},
}


def _check_document(d: Any, max_total_nodes: int) -> dict[str, Any]:
    """Check a whole document and decode its arrays; returns a plain description for :func:`_build`."""
    if not isinstance(d, Mapping):
        raise ValueError(f"a model document must be a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT_NAME:
        raise ValueError(f"not a {FORMAT_NAME} document (format = {d.get('format')!r})")
    version = d.get("format_version")
    if not is_int(version) or version != FORMAT_VERSION:
        raise ValueError(f"unsupported format_version {version!r} (this loader reads version {FORMAT_VERSION})")
    type_name = d.get("type")
    if not isinstance(type_name, str) or type_name not in _TOP_LEVEL_TYPES:
        raise ValueError(f"unsupported estimator type {type_name!r}; supported: {sorted(_TOP_LEVEL_TYPES)}")
    cls = _TOP_LEVEL_TYPES[type_name]
    _check_keys(d, type_name, _COMMON_KEYS | _EXTRA_KEYS[type_name], {"sklearn_version"})
    if not isinstance(d.get("sklearn_version", ""), str):
        raise ValueError(f"{type_name}: sklearn_version must be a string")

    n_features = _get_int(d, "n_features_in", type_name, 1, MAX_FEATURES)
    names = d["feature_names_in"]
    if names is not None and (
        not isinstance(names, list) or len(names) != n_features or not all(isinstance(s, str) for s in names)
    ):
        raise ValueError(f"{type_name}: feature_names_in must be null or a list of {n_features} strings")
    spec: dict[str, Any] = {
        "cls": cls,
        "params": _check_params(d["params"], cls, f"{type_name}.params"),
        "n_features": n_features,
        "feature_names": None if names is None else list(names),
    }

    # Size limit first, from the node counts alone.
    if type_name == "DecisionTreeRegressor":
        tree_objs = [(type_name, d["tree"])]
    else:
        members = d["estimators"]
        if not isinstance(members, list) or not members:
            raise ValueError(f"{type_name}: estimators must be a non-empty list")
        tree_objs = []
        for i, member in enumerate(members):
            where = f"{type_name}.estimators[{i}]"
            if not isinstance(member, Mapping) or "tree" not in member:
                raise ValueError(f"{where}: expected an object with a tree")
            tree_objs.append((where, member["tree"]))
    total = 0
    for where, tree_obj in tree_objs:
        total += _node_count_of(tree_obj, where)
        if total > max_total_nodes:
            raise ValueError(f"{type_name}: more than {max_total_nodes} tree nodes in all; refusing to load")

    if type_name == "DecisionTreeRegressor":
        spec["max_features_"] = _check_max_features(d, type_name, n_features)
        spec["tree"] = _decode_tree(d["tree"], type_name, n_features)
        return spec

    member_type = _MEMBER_TYPES[type_name]
    spec["members"] = [
        _decode_member(member, member_type, f"{type_name}.estimators[{i}]", n_features)
        for i, member in enumerate(d["estimators"])
    ]
    if type_name == "GradientBoostingRegressor":
        spec.update(_check_gbr(d, spec["params"], n_features))
    return spec


def _check_gbr(d: Mapping[str, Any], params: dict[str, Any], n_features: int) -> dict[str, Any]:
    """The boosting-specific checks of :func:`_check_document`."""
    where = "GradientBoostingRegressor"
    loss = params.get("loss", "squared_error")
    if loss not in _GBR_LOSSES:
        raise ValueError(f"{where}: loss {loss!r} is not supported (supported: {_GBR_LOSSES})")
    if loss == "huber":
        alpha = params.get("alpha", 0.9)
        if not is_number(alpha) or not 0.0 < alpha < 1.0:
            raise ValueError(f"{where}: alpha {alpha!r} must be a number in (0, 1)")
    learning_rate = d["learning_rate"]
    if not is_number(learning_rate, finite=True):
        raise ValueError(f"{where}: learning_rate {learning_rate!r} must be a finite number")
    if "learning_rate" in params and params["learning_rate"] != learning_rate:
        raise ValueError(f"{where}: learning_rate {learning_rate!r} differs from params {params['learning_rate']!r}")

    init_param = params.get("init")
    init = d["init"]
    if init == "zero":
        if init_param != "zero":
            raise ValueError(f"{where}: init_ is 'zero' but params.init is {init_param!r}")
        init_spec: Any = "zero"
    else:
        if init_param is not None:
            raise ValueError(f"{where}: params.init must be null or 'zero', got {init_param!r}")
        iwhere = f"{where}.init"
        _check_keys(init, iwhere, {"type", "params", "constant"})
        if init["type"] != "DummyRegressor":
            raise ValueError(f"{iwhere}: init type {init['type']!r}, expected 'DummyRegressor'")
        constant = decode_array(init["constant"], name=f"{iwhere}.constant", expected_shape=(1, 1), expected_kinds="f")
        if not np.isfinite(constant).all():
            raise ValueError(f"{iwhere}: constant is not finite")
        init_spec = {
            "params": _check_params(init["params"], DummyRegressor, iwhere),
            "constant": constant.astype(np.float64),
        }
    return {
        "max_features_": _check_max_features(d, where, n_features),
        "learning_rate": learning_rate,
        "init": init_spec,
    }


# ----------------------------------------------------------------------------------------------------------------
# Loading: building (only from a checked description)
# ----------------------------------------------------------------------------------------------------------------


def _build_tree_estimator(cls: type, params: dict[str, Any], max_features: int, tree: dict, n_features: int) -> Any:
    est = cls(**params)
    est.n_features_in_ = n_features
    est.n_outputs_ = 1
    est.max_features_ = max_features
    est.tree_ = _make_tree(n_features, tree["max_depth"], tree["nodes"], tree["values"])
    return est


def _build(spec: dict[str, Any]) -> Any:
    cls, n_features = spec["cls"], spec["n_features"]
    est = cls(**spec["params"])
    est.n_features_in_ = n_features
    if spec["feature_names"] is not None:
        est.feature_names_in_ = np.asarray(spec["feature_names"], dtype=object)
    if cls is DecisionTreeRegressor:
        est.n_outputs_ = 1
        est.max_features_ = spec["max_features_"]
        est.tree_ = _make_tree(n_features, spec["tree"]["max_depth"], spec["tree"]["nodes"], spec["tree"]["values"])
        return est

    trees = [
        _build_tree_estimator(m["cls"], m["params"], m["max_features_"], m["tree"], n_features) for m in spec["members"]
    ]
    if cls is GradientBoostingRegressor:
        est.learning_rate = spec["learning_rate"]
        est.n_trees_per_iteration_ = 1
        est.max_features_ = spec["max_features_"]
        if spec["init"] == "zero":
            est.init_ = "zero"
        else:
            init = DummyRegressor(**spec["init"]["params"])
            init.n_features_in_ = n_features
            init.n_outputs_ = 1
            init.constant_ = spec["init"]["constant"]
            est.init_ = init
        estimators = np.empty((len(trees), 1), dtype=object)
        for i, tree in enumerate(trees):
            estimators[i, 0] = tree
        est.estimators_ = estimators
        est.n_estimators_ = len(trees)
        est._loss = _gbr_loss(est)
    else:
        est.n_outputs_ = 1
        est.estimator_ = _MEMBER_TYPES[cls.__name__]()
        est.estimators_ = trees
    return est


def estimator_from_dict(d: Mapping[str, Any], *, max_total_nodes: int = MAX_TOTAL_NODES) -> Any:
    """Rebuild a fitted estimator from :func:`estimator_to_dict` output, checking everything first.

    The whole document is checked (format, version, type allow-list, parameter names and types, every array's dtype,
    shape and length, and the structure of every tree: child indices, a single tree reachable from the root without
    cycles, the stored depth, feature indices, thresholds and values) before any estimator or tree is built.

    Parameters
    ----------
    d : Mapping
        The document, e.g. from ``json.loads``.
    max_total_nodes : int, default MAX_TOTAL_NODES
        Most tree nodes, over all trees, to accept.

    Returns
    -------
    estimator
        A fitted estimator of the stored type whose ``predict`` is bit-identical to the saved one's.

    Raises
    ------
    ValueError
        If anything in the document is malformed, out of range or of another scikit-learn tree layout; the message
        names the tree (``GradientBoostingRegressor.estimators[3]``) and what is wrong.
    """
    return _build(_check_document(d, max_total_nodes))


def loads(text: str | bytes, *, max_total_nodes: int = MAX_TOTAL_NODES, max_chars: int = MAX_TEXT_CHARS) -> Any:
    """Rebuild a fitted estimator from JSON text written by :func:`dumps`.

    Parameters
    ----------
    text : str or bytes
        The JSON text.
    max_total_nodes : int, default MAX_TOTAL_NODES
        Most tree nodes, over all trees, to accept.
    max_chars : int, default MAX_TEXT_CHARS
        Longest text to parse.

    Returns
    -------
    estimator
        See :func:`estimator_from_dict`.

    Raises
    ------
    ValueError
        If the text is too long, not JSON (NaN and infinity literals included), or not a valid model document.
    """
    if not isinstance(text, (str, bytes, bytearray)):
        raise ValueError(f"expected JSON text, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ValueError(f"model text of {len(text)} characters is longer than the limit of {max_chars}")
    try:
        d = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("model text is nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"model text is not valid JSON: {exc}") from None
    return estimator_from_dict(d, max_total_nodes=max_total_nodes)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a model file")
