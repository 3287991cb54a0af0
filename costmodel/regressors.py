"""What a loaded regressor must satisfy before it may predict (installed as ``fasttree.costmodel.regressors``).

A model file rebuilds scikit-learn objects from stored state. Their types are checked by the
loader (an allow-list), but scikit-learn's compiled prediction code also trusts their contents:
it follows child pointers and feature indices without bounds checks and writes one output
column per boosting column. :func:`check_regressor` checks, on the built objects and before any
prediction, everything those loops index with, so a tampered file is refused with a
:class:`ValueError` instead of reading or writing out of bounds or looping forever.

Checked: a ``GradientBoostingRegressor`` (squared error, ``init`` the default
``DummyRegressor`` or ``"zero"``) or a ``RandomForestRegressor`` whose member trees are
``DecisionTreeRegressor``; single output, unnamed features; and for every tree: the node
count within the allocated nodes, child indices in range with one parent per node and every
node reachable from the root (no cycles), the stored depth, feature indices below the feature
count, thresholds, finite values.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sklearn._loss.link import IdentityLink
from sklearn._loss.loss import HalfSquaredError
from sklearn.dummy import DummyRegressor
from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
from sklearn.tree import DecisionTreeRegressor
from sklearn.tree._tree import Tree

__all__ = ["MAX_FEATURES", "check_regressor", "check_tree"]

#: Most input features a regressor may declare.
MAX_FEATURES = 10_000
#: Most worker threads a forest may ask for when it predicts.
MAX_FOREST_JOBS = 256

_TREE_LEAF = -1  # sklearn.tree._tree.TREE_LEAF: child pointer of a leaf
_TREE_UNDEFINED = -2  # sklearn.tree._tree.TREE_UNDEFINED: feature of a leaf


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _n_features_of(est: Any, where: str) -> int:
    n = getattr(est, "n_features_in_", None)
    if not _is_int(n) or not 1 <= n <= MAX_FEATURES:
        raise ValueError(f"{where}: n_features_in_ must be an integer in [1, {MAX_FEATURES}], got {n!r}")
    if hasattr(est, "feature_names_in_"):
        raise ValueError(f"{where}: has feature names (the latency model's regressors take unnamed columns)")
    return int(n)


def check_regressor(est: Any, where: str = "regressor") -> None:
    """Refuse a regressor whose state would make scikit-learn's prediction code misbehave.

    Parameters
    ----------
    est : object
        A built ``GradientBoostingRegressor`` or ``RandomForestRegressor``.
    where : str
        How messages name it.

    Raises
    ------
    ValueError
        Naming the regressor, the tree and what is wrong.
    """
    if type(est) is GradientBoostingRegressor:
        _check_gbr(est, where)
    elif type(est) is RandomForestRegressor:
        _check_forest(est, where)
    else:
        raise ValueError(f"{where}: a {type(est).__name__}, not a GradientBoostingRegressor or RandomForestRegressor")


def _check_gbr(est: GradientBoostingRegressor, where: str) -> None:
    n_features = _n_features_of(est, where)
    stages = getattr(est, "estimators_", None)
    if not isinstance(stages, np.ndarray) or stages.dtype != object or stages.ndim != 2 or stages.shape[1] != 1:
        raise ValueError(f"{where}: estimators_ must be an object array of shape (n_stages, 1)")
    if stages.shape[0] < 1 or getattr(est, "n_estimators_", None) != stages.shape[0]:
        raise ValueError(f"{where}: n_estimators_ must be the number of stages, {stages.shape[0]} (at least 1)")
    if getattr(est, "n_trees_per_iteration_", None) != 1:
        raise ValueError(f"{where}: n_trees_per_iteration_ must be 1 (a regressor)")
    lr = getattr(est, "learning_rate", None)
    if not isinstance(lr, (float, int, np.floating)) or isinstance(lr, bool) or not math.isfinite(float(lr)):
        raise ValueError(f"{where}: learning_rate must be a finite number, got {lr!r}")
    loss = getattr(est, "_loss", None)
    if type(loss) is not HalfSquaredError or type(getattr(loss, "link", None)) is not IdentityLink:
        raise ValueError(f"{where}: only the squared-error loss is supported")
    init = getattr(est, "init_", None)
    if not (isinstance(init, str) and init == "zero"):
        if type(init) is not DummyRegressor:
            raise ValueError(f"{where}: init_ must be a DummyRegressor or 'zero', got {type(init).__name__}")
        constant = getattr(init, "constant_", None)
        if (
            not isinstance(constant, np.ndarray)
            or constant.dtype != np.float64
            or constant.shape != (1, 1)
            or not np.isfinite(constant).all()
        ):
            raise ValueError(f"{where}: init_.constant_ must be a finite float64 array of shape (1, 1)")
        if getattr(init, "n_outputs_", None) != 1:
            raise ValueError(f"{where}: init_.n_outputs_ must be 1")
    for i in range(stages.shape[0]):
        _check_tree_estimator(stages[i, 0], n_features, f"{where}.estimators_[{i}, 0]")


def _check_forest(est: RandomForestRegressor, where: str) -> None:
    n_features = _n_features_of(est, where)
    trees = getattr(est, "estimators_", None)
    if not isinstance(trees, list) or not trees:
        raise ValueError(f"{where}: estimators_ must be a non-empty list")
    if getattr(est, "n_outputs_", None) != 1:
        raise ValueError(f"{where}: n_outputs_ must be 1")
    if not _is_int(est.n_estimators) or est.n_estimators != len(trees):
        raise ValueError(f"{where}: n_estimators must be the number of trees, {len(trees)}")
    n_jobs = est.n_jobs
    if n_jobs is not None and (not _is_int(n_jobs) or n_jobs == 0 or not -1 <= n_jobs <= MAX_FOREST_JOBS):
        raise ValueError(f"{where}: n_jobs must be None, -1 or in [1, {MAX_FOREST_JOBS}], got {n_jobs!r}")
    for i, tree in enumerate(trees):
        _check_tree_estimator(tree, n_features, f"{where}.estimators_[{i}]")


def _check_tree_estimator(est: Any, n_features: int, where: str) -> None:
    if type(est) is not DecisionTreeRegressor:
        raise ValueError(f"{where}: a {type(est).__name__}, expected a DecisionTreeRegressor")
    if _n_features_of(est, where) != n_features:
        raise ValueError(f"{where}: takes {est.n_features_in_} features, the ensemble {n_features}")
    if getattr(est, "n_outputs_", None) != 1:
        raise ValueError(f"{where}: n_outputs_ must be 1")
    tree = getattr(est, "tree_", None)
    if type(tree) is not Tree:
        raise ValueError(f"{where}: tree_ must be a Tree, got {type(tree).__name__}")
    check_tree(tree, n_features, where)


def check_tree(tree: Tree, n_features: int, where: str = "tree") -> None:
    """The structural checks of one fitted ``Tree`` (see the module docstring).

    Raises
    ------
    ValueError
        Naming the first bad node.
    """
    if tree.n_features != n_features or tree.n_outputs != 1 or tree.max_n_classes != 1:
        raise ValueError(
            f"{where}: a tree of {tree.n_features} features, {tree.n_outputs} outputs and "
            f"{tree.max_n_classes} classes, expected {n_features}, 1 and 1"
        )
    n = tree.node_count
    # node_count is stored apart from the node array; every array view below is node_count long
    if not 1 <= n <= tree.capacity:
        raise ValueError(f"{where}: node_count {n} is not in [1, {tree.capacity}] (the stored nodes)")
    left, right = tree.children_left.astype(np.int64), tree.children_right.astype(np.int64)
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
    internal = ~leaf

    # Every node but the root has exactly one parent; the root has none.
    n_parents = np.bincount(np.concatenate([left[internal], right[internal]]), minlength=n)
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
    if depth != tree.max_depth:
        # scikit-learn sizes buffers by max_depth (decision_path), so it must be the true depth
        raise ValueError(f"{where}: max_depth is {tree.max_depth} but the tree is {depth} deep")

    feature = tree.feature
    bad = internal & ((feature < 0) | (feature >= n_features))
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: feature[{i}] = {int(feature[i])} is out of range [0, {n_features})")
    threshold = tree.threshold
    # +inf is a legitimate split threshold: scikit-learn uses it for "non-missing left, missing right".
    bad = internal & (np.isnan(threshold) | np.isneginf(threshold))
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: threshold[{i}] = {threshold[i]} is not a valid threshold")
    value = tree.value
    if value.shape != (n, 1, 1):
        raise ValueError(f"{where}: value has shape {value.shape}, expected ({n}, 1, 1)")
    bad = ~np.isfinite(value.reshape(n))
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: value[{i}] = {value.reshape(n)[i]} is not finite")
