"""Tests of the pickle-free JSON model files (``fasttree.costmodel.serialize``)."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from sklearn.ensemble import (
    ExtraTreesRegressor,
    GradientBoostingRegressor,
    RandomForestClassifier,
    RandomForestRegressor,
)
from sklearn.linear_model import LinearRegression
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

from fasttree.costmodel.serialize import (
    MAX_TOTAL_NODES,
    decode_array,
    dumps,
    encode_array,
    estimator_from_dict,
    estimator_to_dict,
    loads,
)

N_FEATURES = 6


def _data(seed: int, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, N_FEATURES))
    y = X @ rng.standard_normal(N_FEATURES) + np.sin(3 * X[:, 0]) + 0.1 * rng.standard_normal(n)
    return X, y


ESTIMATORS: dict[str, Callable[[], Any]] = {
    "tree": lambda: DecisionTreeRegressor(max_depth=6, random_state=0),
    "forest": lambda: RandomForestRegressor(n_estimators=5, max_depth=5, random_state=0),
    "extra_trees": lambda: ExtraTreesRegressor(n_estimators=5, max_depth=5, random_state=0),
    "gbr": lambda: GradientBoostingRegressor(n_estimators=10, random_state=0),
    "gbr_absolute_error": lambda: GradientBoostingRegressor(n_estimators=10, loss="absolute_error", random_state=0),
    "gbr_huber": lambda: GradientBoostingRegressor(n_estimators=10, loss="huber", alpha=0.8, random_state=0),
    "gbr_init_zero": lambda: GradientBoostingRegressor(n_estimators=10, init="zero", subsample=0.7, random_state=0),
}


@pytest.fixture(scope="module")
def fitted() -> dict[str, Any]:
    X, y = _data(0)
    return {name: make().fit(X, y) for name, make in ESTIMATORS.items()}


@pytest.fixture(scope="module")
def x_new() -> np.ndarray:
    return _data(1, n=300)[0]


@pytest.fixture
def tree_doc(fitted: dict[str, Any]) -> dict[str, Any]:
    """A fresh (mutable) document of the single decision tree."""
    return estimator_to_dict(fitted["tree"])


def _set_nodes(doc_tree: dict[str, Any], **arrays: np.ndarray) -> None:
    """Replace node arrays (by public attribute name) of a ``TREE`` object, keeping each stored dtype."""
    for attr, arr in arrays.items():
        dtype = np.dtype(doc_tree["nodes"][attr]["dtype"])
        doc_tree["nodes"][attr] = encode_array(np.asarray(arr).astype(dtype))


def _nodes(doc_tree: dict[str, Any], attr: str) -> np.ndarray:
    return decode_array(doc_tree["nodes"][attr])


# ----------------------------------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_round_trip_predicts_identically(name: str, fitted: dict[str, Any], x_new: np.ndarray) -> None:
    est = fitted[name]
    loaded = loads(dumps(est))
    assert type(loaded) is type(est)
    assert np.array_equal(est.predict(x_new), loaded.predict(x_new))
    assert loaded.get_params()["random_state"] == est.get_params()["random_state"]
    assert loaded.n_features_in_ == N_FEATURES


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_dict_survives_json(name: str, fitted: dict[str, Any], x_new: np.ndarray) -> None:
    d = estimator_to_dict(fitted[name])
    again = json.loads(json.dumps(d, allow_nan=False))
    assert again == d
    loaded = estimator_from_dict(again)
    assert np.array_equal(fitted[name].predict(x_new), loaded.predict(x_new))
    # a second save of the loaded model writes the same trees
    d2 = estimator_to_dict(loaded)
    if "tree" in d:
        assert d2["tree"] == d["tree"]
    else:
        assert [m["tree"] for m in d2["estimators"]] == [m["tree"] for m in d["estimators"]]


def test_other_fitted_attributes_survive(fitted: dict[str, Any], x_new: np.ndarray) -> None:
    for name in ("tree", "forest", "gbr"):
        est, loaded = fitted[name], loads(dumps(fitted[name]))
        assert np.array_equal(est.feature_importances_, loaded.feature_importances_)
        assert np.array_equal(est.apply(x_new), loaded.apply(x_new))
    tree, loaded = fitted["tree"], loads(dumps(fitted["tree"]))
    assert (tree.decision_path(x_new) != loaded.decision_path(x_new)).nnz == 0
    gbr, loaded = fitted["gbr"], loads(dumps(fitted["gbr"]))
    for a, b in zip(gbr.staged_predict(x_new), loaded.staged_predict(x_new), strict=True):
        assert np.array_equal(a, b)


def test_missing_values_and_infinite_threshold_round_trip() -> None:
    X, y = _data(2)
    X[::4, 0] = np.nan
    y = np.where(np.isnan(X[:, 0]), 100.0, 0.01 * y)  # the first split separates the missing values
    est = DecisionTreeRegressor(max_depth=4, random_state=0).fit(X, y)
    assert np.isinf(est.tree_.threshold).any()  # the "missing values only" split
    x_new, _ = _data(3)
    x_new[::3, 0] = np.nan
    x_new[1::5, 2] = np.nan
    loaded = loads(dumps(est))
    assert np.array_equal(est.predict(x_new), loaded.predict(x_new))
    assert np.array_equal(est.tree_.missing_go_to_left, loaded.tree_.missing_go_to_left)


def test_feature_names(fitted: dict[str, Any], x_new: np.ndarray) -> None:
    d = estimator_to_dict(fitted["forest"])
    assert d["feature_names_in"] is None
    assert not hasattr(estimator_from_dict(d), "feature_names_in_")
    names = [f"f{i}" for i in range(N_FEATURES)]
    d["feature_names_in"] = names
    loaded = estimator_from_dict(d)
    assert list(loaded.feature_names_in_) == names
    d["feature_names_in"] = names[:-1]
    with pytest.raises(ValueError, match="feature_names_in"):
        estimator_from_dict(d)
    d["feature_names_in"] = [*names[:-1], 5]
    with pytest.raises(ValueError, match="feature_names_in"):
        estimator_from_dict(d)


def test_no_pickle_involved(fitted: dict[str, Any], x_new: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pickle used")

    for attr in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, attr, refuse)
    for est in fitted.values():
        assert np.array_equal(est.predict(x_new), loads(dumps(est)).predict(x_new))


def test_dumps_is_plain_sorted_json(fitted: dict[str, Any]) -> None:
    text = dumps(fitted["gbr"])
    d = json.loads(text)
    assert d["format"] == "fasttree-sklearn-trees" and d["format_version"] == 1
    assert d["type"] == "GradientBoostingRegressor"
    assert text == json.dumps(d, sort_keys=True, allow_nan=False, separators=(",", ":"))
    assert d["init"]["type"] == "DummyRegressor"
    assert json.loads(dumps(fitted["gbr_init_zero"]))["init"] == "zero"


# ----------------------------------------------------------------------------------------------------------------
# Arrays
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["<f8", "<f4", "<i8", "<i4", "|u1", ">f8", ">i4", ">u2"])
def test_array_round_trip(dtype: str) -> None:
    arr = np.arange(24).reshape(2, 3, 4).astype(dtype)
    if np.dtype(dtype).kind != "u":
        arr -= 7
    enc = encode_array(arr)
    assert enc["dtype"][0] in "<|"
    back = decode_array(json.loads(json.dumps(enc)))
    assert back.shape == arr.shape and np.array_equal(back, arr) and back.flags.writeable
    assert decode_array(encode_array(np.zeros((0, 3)))).shape == (0, 3)
    assert decode_array(encode_array(np.float64(2.5))).shape == ()


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([object(), 1], dtype=object), np.array([True])])
def test_encode_refuses_non_numeric(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_array(bad)


def test_decode_refuses_bad_arrays() -> None:
    good = encode_array(np.arange(5, dtype=np.float64))
    for dtype in ("|O", "|O8", "<U5", ">f8", "V8", "<c16", 5):
        with pytest.raises(ValueError, match="dtype"):
            decode_array({**good, "dtype": dtype})
    with pytest.raises(ValueError, match="base64"):
        decode_array({**good, "data": good["data"][:-4]})
    with pytest.raises(ValueError, match="base64"):
        decode_array({**good, "data": "!" * len(good["data"])})
    with pytest.raises(ValueError, match="base64"):
        decode_array({**good, "shape": [6]})
    with pytest.raises(ValueError, match="shape"):
        decode_array({**good, "shape": [-5]})
    with pytest.raises(ValueError, match="shape"):
        decode_array({**good, "shape": [10**12, 10**12]})
    with pytest.raises(ValueError, match="elements"):
        decode_array(good, max_elements=4)
    with pytest.raises(ValueError, match="keys"):
        decode_array({**good, "extra": 1})


# ----------------------------------------------------------------------------------------------------------------
# Refused estimators
# ----------------------------------------------------------------------------------------------------------------


def test_unsupported_estimators() -> None:
    X, y = _data(0)
    for est in (
        LinearRegression().fit(X, y),
        DecisionTreeClassifier().fit(X, y > 0),
        RandomForestClassifier(n_estimators=2).fit(X, y > 0),
    ):
        with pytest.raises(ValueError, match=type(est).__name__):
            estimator_to_dict(est)
    with pytest.raises(ValueError, match="single-output"):
        estimator_to_dict(DecisionTreeRegressor(max_depth=2).fit(X, np.c_[y, y]))
    with pytest.raises(ValueError, match="loss='quantile'"):
        estimator_to_dict(GradientBoostingRegressor(n_estimators=2, loss="quantile").fit(X, y))
    with pytest.raises(ValueError, match="init="):
        estimator_to_dict(GradientBoostingRegressor(n_estimators=2, init=LinearRegression()).fit(X, y))

    class MyTree(DecisionTreeRegressor):
        pass

    with pytest.raises(ValueError, match="MyTree"):
        estimator_to_dict(MyTree(max_depth=2).fit(X, y))


@pytest.mark.parametrize("name", ["tree", "forest", "extra_trees", "gbr"])
def test_unfitted_estimator(name: str) -> None:
    with pytest.raises(ValueError, match="not fitted"):
        estimator_to_dict(ESTIMATORS[name]())


# ----------------------------------------------------------------------------------------------------------------
# Tampered files
# ----------------------------------------------------------------------------------------------------------------


def _an_internal_node(doc_tree: dict[str, Any], depth_at_least: int = 0) -> int:
    left = _nodes(doc_tree, "children_left")
    internal = np.flatnonzero(left != -1)
    return int(internal[min(depth_at_least, internal.size - 1)])


def test_child_index_out_of_range(tree_doc: dict[str, Any]) -> None:
    t = tree_doc["tree"]
    n = t["node_count"]
    i = _an_internal_node(t, 2)
    for bad in (n, n + 100, -2, -(2**40)):
        d = copy.deepcopy(tree_doc)
        left = _nodes(t, "children_left")
        left[i] = bad
        _set_nodes(d["tree"], children_left=left)
        with pytest.raises(ValueError, match=rf"children_left\[{i}\] = {bad} is out of range"):
            estimator_from_dict(d)


def test_self_loop_and_one_child(tree_doc: dict[str, Any]) -> None:
    t = tree_doc["tree"]
    i = _an_internal_node(t, 1)
    right = _nodes(t, "children_right")
    right[i] = i
    d = copy.deepcopy(tree_doc)
    _set_nodes(d["tree"], children_right=right)
    with pytest.raises(ValueError, match=f"node {i} is its own child"):
        estimator_from_dict(d)
    right = _nodes(t, "children_right")
    right[i] = -1
    d = copy.deepcopy(tree_doc)
    _set_nodes(d["tree"], children_right=right)
    with pytest.raises(ValueError, match=f"node {i} has exactly one child"):
        estimator_from_dict(d)


def test_cycle_through_root(tree_doc: dict[str, Any]) -> None:
    t = tree_doc["tree"]
    left = _nodes(t, "children_left")
    i = _an_internal_node(t, 3)
    left[i] = 0
    _set_nodes(tree_doc["tree"], children_left=left)
    with pytest.raises(ValueError, match="cycle"):
        estimator_from_dict(tree_doc)


def test_shared_child(tree_doc: dict[str, Any]) -> None:
    t = tree_doc["tree"]
    left, right = _nodes(t, "children_left"), _nodes(t, "children_right")
    i = _an_internal_node(t, 2)
    right[i] = left[i]
    _set_nodes(tree_doc["tree"], children_right=right)
    with pytest.raises(ValueError, match="parents"):
        estimator_from_dict(tree_doc)


def _handmade(tree_doc: dict[str, Any], left: list[int], right: list[int], max_depth: int) -> dict[str, Any]:
    """The tree document with its tree replaced by a handmade one (internal nodes split feature 0 at 0.0)."""
    n = len(left)
    lc, rc = np.array(left), np.array(right)
    leaf = lc == -1
    _set_nodes(
        tree_doc["tree"],
        children_left=lc,
        children_right=rc,
        feature=np.where(leaf, -2, 0),
        threshold=np.where(leaf, -2.0, 0.0),
        impurity=np.zeros(n),
        n_node_samples=np.ones(n),
        weighted_n_node_samples=np.ones(n),
        missing_go_to_left=np.zeros(n),
    )
    tree_doc["tree"]["node_count"] = n
    tree_doc["tree"]["max_depth"] = max_depth
    tree_doc["tree"]["value"] = encode_array(np.arange(n, dtype=np.float64).reshape(n, 1, 1))
    return tree_doc


def test_handmade_tree_loads(tree_doc: dict[str, Any]) -> None:
    est = estimator_from_dict(_handmade(tree_doc, [1, -1, -1], [2, -1, -1], max_depth=1))
    X = np.zeros((2, N_FEATURES))
    X[1, 0] = 1.0
    assert est.predict(X).tolist() == [1.0, 2.0]


def test_cycle_apart_from_root(tree_doc: dict[str, Any]) -> None:
    # 0 -> (1, 2); 3 -> (4, 5); 4 -> (3, 6): every node but the root has one parent, but 3 <-> 4 is a cycle.
    d = _handmade(tree_doc, [1, -1, -1, 4, 3, -1, -1], [2, -1, -1, 5, 6, -1, -1], max_depth=1)
    with pytest.raises(ValueError, match="not reachable from the root"):
        estimator_from_dict(d)


def test_wrong_max_depth(tree_doc: dict[str, Any]) -> None:
    # decision_path sizes its buffer by max_depth: a too small one must be refused
    for bad in (tree_doc["tree"]["max_depth"] - 1, tree_doc["tree"]["max_depth"] + 1):
        d = copy.deepcopy(tree_doc)
        d["tree"]["max_depth"] = bad
        with pytest.raises(ValueError, match="max_depth"):
            estimator_from_dict(d)


def test_feature_index_out_of_range(tree_doc: dict[str, Any]) -> None:
    t = tree_doc["tree"]
    i = _an_internal_node(t, 2)
    for bad in (N_FEATURES, 10**6, -1):
        d = copy.deepcopy(tree_doc)
        feature = _nodes(t, "feature")
        feature[i] = bad
        _set_nodes(d["tree"], feature=feature)
        with pytest.raises(ValueError, match=rf"feature\[{i}\] = {bad} is out of range"):
            estimator_from_dict(d)


def test_nan_threshold_and_value(tree_doc: dict[str, Any]) -> None:
    t = tree_doc["tree"]
    i = _an_internal_node(t, 1)
    for bad in (np.nan, -np.inf):
        d = copy.deepcopy(tree_doc)
        threshold = _nodes(t, "threshold")
        threshold[i] = bad
        _set_nodes(d["tree"], threshold=threshold)
        with pytest.raises(ValueError, match=rf"threshold\[{i}\]"):
            estimator_from_dict(d)
    value = decode_array(t["value"])
    value[3, 0, 0] = np.inf
    tree_doc["tree"]["value"] = encode_array(value)
    with pytest.raises(ValueError, match=r"value\[3\]"):
        estimator_from_dict(tree_doc)


@pytest.mark.parametrize("dtype", ["|O", "<U5", "<c16", ">i8"])
def test_wrong_dtype(tree_doc: dict[str, Any], dtype: str) -> None:
    tree_doc["tree"]["nodes"]["feature"]["dtype"] = dtype
    with pytest.raises(ValueError, match="dtype"):
        estimator_from_dict(tree_doc)


def test_float_where_int_expected(tree_doc: dict[str, Any]) -> None:
    left = _nodes(tree_doc["tree"], "children_left").astype(np.float64)
    tree_doc["tree"]["nodes"]["children_left"] = encode_array(left)
    with pytest.raises(ValueError, match="wrong kind"):
        estimator_from_dict(tree_doc)


def test_base64_length_mismatch(tree_doc: dict[str, Any]) -> None:
    d = copy.deepcopy(tree_doc)
    d["tree"]["nodes"]["threshold"]["data"] = d["tree"]["nodes"]["threshold"]["data"][:-8]
    with pytest.raises(ValueError, match="base64"):
        estimator_from_dict(d)
    d = copy.deepcopy(tree_doc)
    d["tree"]["node_count"] += 1
    with pytest.raises(ValueError, match="shape"):
        estimator_from_dict(d)


def test_node_layout_mismatch(tree_doc: dict[str, Any]) -> None:
    d = copy.deepcopy(tree_doc)
    del d["tree"]["nodes"]["missing_go_to_left"]
    with pytest.raises(ValueError, match="another scikit-learn tree node layout"):
        estimator_from_dict(d)
    d = copy.deepcopy(tree_doc)
    d["tree"]["nodes"]["is_categorical"] = d["tree"]["nodes"]["missing_go_to_left"]
    with pytest.raises(ValueError, match="another scikit-learn tree node layout"):
        estimator_from_dict(d)


def test_bad_missing_go_to_left(tree_doc: dict[str, Any]) -> None:
    mgl = _nodes(tree_doc["tree"], "missing_go_to_left")
    mgl[0] = 7
    _set_nodes(tree_doc["tree"], missing_go_to_left=mgl)
    with pytest.raises(ValueError, match="missing_go_to_left"):
        estimator_from_dict(tree_doc)


def test_header_checks(tree_doc: dict[str, Any]) -> None:
    cases: list[tuple[str, Any, str]] = [
        ("format_version", 2, "format_version"),
        ("format_version", "1", "format_version"),
        ("format_version", True, "format_version"),
        ("format", "pickle", "not a fasttree-sklearn-trees document"),
        ("type", "LinearRegression", "unsupported estimator type 'LinearRegression'"),
        ("type", "os.system", "unsupported estimator type"),
        ("n_features_in", 0, "n_features_in"),
        ("n_features_in", 2.5, "n_features_in"),
        ("params", {"max_depth": 3, "evil": 1}, "unknown parameter 'evil'"),
        ("params", {"max_depth": {"__class__": "x"}}, "unsupported type"),
        ("max_features_", N_FEATURES + 1, "max_features_"),
    ]
    for key, value, message in cases:
        d = copy.deepcopy(tree_doc)
        d[key] = value
        with pytest.raises(ValueError, match=message):
            estimator_from_dict(d)
    d = copy.deepcopy(tree_doc)
    d["unexpected"] = 1
    with pytest.raises(ValueError, match="unexpected keys"):
        estimator_from_dict(d)
    with pytest.raises(ValueError, match="JSON object"):
        estimator_from_dict([tree_doc])  # type: ignore[arg-type]


def test_smaller_feature_count_than_used(tree_doc: dict[str, Any]) -> None:
    used = int(_nodes(tree_doc["tree"], "feature").max())
    tree_doc["n_features_in"] = used
    tree_doc["max_features_"] = used
    with pytest.raises(ValueError, match="out of range"):
        estimator_from_dict(tree_doc)


def test_ensemble_errors_name_the_tree(fitted: dict[str, Any]) -> None:
    d = estimator_to_dict(fitted["gbr"])
    t = d["estimators"][2]["tree"]
    left = _nodes(t, "children_left")
    left[0] = t["node_count"] + 5
    _set_nodes(t, children_left=left)
    with pytest.raises(ValueError, match=r"GradientBoostingRegressor\.estimators\[2\]: children_left\[0\]"):
        estimator_from_dict(d)

    d = estimator_to_dict(fitted["forest"])
    d["estimators"][1]["tree"]["nodes"]["threshold"]["data"] = "AAAA"
    with pytest.raises(ValueError, match=r"RandomForestRegressor\.estimators\[1\]: threshold"):
        estimator_from_dict(d)

    d = estimator_to_dict(fitted["extra_trees"])
    d["estimators"][0]["type"] = "DecisionTreeRegressor"
    with pytest.raises(ValueError, match="ExtraTreeRegressor"):
        estimator_from_dict(d)

    d = estimator_to_dict(fitted["forest"])
    d["estimators"] = []
    with pytest.raises(ValueError, match="non-empty"):
        estimator_from_dict(d)


def test_gbr_specific_checks(fitted: dict[str, Any]) -> None:
    base = estimator_to_dict(fitted["gbr"])
    mutations: list[tuple[Callable[[dict[str, Any]], None], str]] = [
        (lambda d: d["params"].update(loss="quantile"), "loss 'quantile'"),
        (lambda d: d["params"].update(loss="huber", alpha=1.5), "alpha"),
        (lambda d: d.update(learning_rate="0.1"), "learning_rate"),
        (lambda d: d.update(learning_rate=0.5), "differs"),
        (lambda d: d.update(init="one"), "init"),
        (lambda d: d["init"].update(type="LinearRegression"), "DummyRegressor"),
        (lambda d: d["init"].update(constant=encode_array(np.full((1, 1), np.nan))), "not finite"),
        (lambda d: d["init"].update(constant=encode_array(np.ones(3))), "shape"),
        (lambda d: d["params"].update(init="zero"), "params.init"),
    ]
    for mutate, message in mutations:
        d = copy.deepcopy(base)
        mutate(d)
        with pytest.raises(ValueError, match=message):
            estimator_from_dict(d)


def test_size_limit(fitted: dict[str, Any]) -> None:
    d = estimator_to_dict(fitted["forest"])
    total = sum(m["tree"]["node_count"] for m in d["estimators"])
    assert total <= MAX_TOTAL_NODES
    estimator_from_dict(d, max_total_nodes=total)
    with pytest.raises(ValueError, match="tree nodes"):
        estimator_from_dict(d, max_total_nodes=total - 1)
    # a huge declared node count is refused before any array is decoded
    d["estimators"][0]["tree"]["node_count"] = 10**12
    with pytest.raises(ValueError, match="tree nodes"):
        estimator_from_dict(d)
    with pytest.raises(ValueError, match="longer than the limit"):
        loads(dumps(fitted["tree"]), max_chars=100)


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[1, 2", '{"format": NaN}', '{"format": Infinity}', "[" * 100_000 + "]" * 100_000, "null"],
)
def test_loads_refuses_bad_text(text: str) -> None:
    with pytest.raises(ValueError):
        loads(text)


def test_random_tampering_never_crashes(tree_doc: dict[str, Any], x_new: np.ndarray) -> None:
    """Random single-element edits of the node arrays: each is refused or gives a model that works."""
    rng = np.random.default_rng(0)
    t = tree_doc["tree"]
    n = t["node_count"]
    attrs = sorted(t["nodes"])
    n_loaded = 0
    for _ in range(300):
        d = copy.deepcopy(tree_doc)
        attr = attrs[rng.integers(len(attrs))]
        arr = _nodes(t, attr)
        i = int(rng.integers(n))
        if arr.dtype.kind == "f":
            arr[i] = rng.choice([np.nan, np.inf, -np.inf, -2.0, rng.standard_normal()])
        elif arr.dtype.kind == "u":
            arr[i] = rng.integers(0, 256)
        else:
            arr[i] = rng.integers(-3, max(n, N_FEATURES) + 3)
        _set_nodes(d["tree"], **{attr: arr})
        try:
            est = estimator_from_dict(d)
        except ValueError:
            continue
        n_loaded += 1
        est.predict(x_new)
        est.decision_path(x_new)
        _ = est.feature_importances_
    assert 0 < n_loaded < 300
