"""Accuracy and ranking metrics of a latency model (installed as ``fasttree.costmodel.metrics``).

A latency model predicts the GPU latency ``pred`` (microseconds) of one measurement, a (tree, config) pair whose
measured latency is ``meas``. Many configs are measured on the same tree, and the model is used to pick the best config
of each tree, so besides the per-measurement error it is judged by how well it ranks the configs of each tree.

Regression metrics, over all ``n`` measurements (:func:`regression_metrics`):

``ape``
    Absolute percentage error of one measurement, as a fraction (0.05 is 5%): ``|pred - meas| / meas``
    (:func:`absolute_percentage_errors`).
``mape``, ``median_ape``, ``max_ape``
    Mean, median and maximum of ``ape`` over the measurements.
``p90_ape``
    90th percentile of ``ape`` (``numpy.percentile``, linear interpolation between order statistics).
``log_rmse``
    Root mean square of ``ln(pred) - ln(meas)``: ``sqrt(mean((ln pred - ln meas)^2))``. Symmetric in over- and
    under-prediction; a model off by a constant factor ``c`` has ``log_rmse = |ln c|``.

Ranking metrics, per tree (:func:`per_tree_rank_metrics`). Only trees with two or more measurements count; for such a
tree ``t`` with measured latencies ``meas_t`` and predictions ``pred_t``:

``kendall_tau``
    Kendall's tau-b between ``pred_t`` and ``meas_t`` (``scipy.stats.kendalltau``):
    ``(C - D) / sqrt((P - T_pred) * (P - T_meas))`` with ``C`` / ``D`` the concordant / discordant pairs of configs,
    ``P = n (n - 1) / 2`` all pairs and ``T_pred`` / ``T_meas`` the pairs tied in ``pred`` / ``meas``. It is undefined
    (nan) when all of ``pred_t`` or all of ``meas_t`` are equal; such trees are left out of the mean and median and
    counted in ``n_trees_tau_undefined``.
``best``
    ``min(meas_t)``, the latency of the truly fastest config.
``best_of_topk``
    ``min(meas_t[picks])`` where ``picks`` are the ``min(k, n_t)`` configs of lowest ``pred_t`` (the model's top-k
    picks; ties in ``pred_t`` are broken by position in the input, first come first picked).

and over the trees:

``mean_kendall_tau``, ``median_kendall_tau``
    Mean and median of the defined ``kendall_tau`` (nan when no tree has one).
``top{k}_score``
    ``sum_t best / sum_t best_of_topk``, a ratio in (0, 1]; 1 when the model's top-k picks always hold the fastest
    config. Trees of larger latency weigh more (as the top-k score of TenSet).
``a_peak@{k}``
    ``mean_t (best / best_of_topk)``, the same ratio with every tree weighing the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import kendalltau

from fasttree.validation import is_int

__all__ = [
    "RankMetrics",
    "absolute_percentage_errors",
    "evaluation_table",
    "per_tree_rank_metrics",
    "regression_metrics",
]


def _as_1d_float(x: ArrayLike, name: str) -> np.ndarray:
    """``x`` as a 1-D float64 array; ValueError naming ``name`` if it is not numeric, 1-D, or finite."""
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be an array of numbers ({err})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {int(np.sum(~np.isfinite(arr)))} nan or inf values")
    return arr


def _checked_pair(pred_us: ArrayLike, meas_us: ArrayLike, *, pred_nonnegative: bool) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(pred, meas)``: same 1-D shape, non-empty, finite, ``meas > 0`` (and ``pred >= 0`` if asked)."""
    pred = _as_1d_float(pred_us, "pred_us")
    meas = _as_1d_float(meas_us, "meas_us")
    if pred.shape != meas.shape:
        raise ValueError(f"pred_us and meas_us must have the same shape, got {pred.shape} and {meas.shape}")
    if pred.size == 0:
        raise ValueError("pred_us and meas_us are empty")
    if np.any(meas <= 0):
        raise ValueError(f"meas_us must be > 0, got {int(np.sum(meas <= 0))} values <= 0 (min {meas.min():g})")
    if pred_nonnegative and np.any(pred < 0):
        raise ValueError(f"pred_us must be >= 0, got {int(np.sum(pred < 0))} negative values (min {pred.min():g})")
    return pred, meas


def absolute_percentage_errors(pred_us: ArrayLike, meas_us: ArrayLike) -> np.ndarray:
    """Absolute percentage error of every measurement, as a fraction.

    Parameters
    ----------
    pred_us : array_like of float, shape (n,)
        Predicted latencies in microseconds, finite and >= 0.
    meas_us : array_like of float, shape (n,)
        Measured latencies in microseconds, finite and > 0.

    Returns
    -------
    ape : ndarray of float64, shape (n,)
        ``|pred_us - meas_us| / meas_us`` (0.05 is 5%).

    Raises
    ------
    ValueError
        If the arrays are not 1-D of the same non-zero length, hold nan or inf, ``meas_us <= 0`` or ``pred_us < 0``.
    """
    pred, meas = _checked_pair(pred_us, meas_us, pred_nonnegative=True)
    return np.abs(pred - meas) / meas


def regression_metrics(pred_us: ArrayLike, meas_us: ArrayLike) -> dict[str, float]:
    """Per-measurement accuracy of predicted latencies (see the module docstring for definitions).

    Parameters
    ----------
    pred_us : array_like of float, shape (n,)
        Predicted latencies in microseconds, finite and > 0 (``log_rmse`` needs their logarithm).
    meas_us : array_like of float, shape (n,)
        Measured latencies in microseconds, finite and > 0.

    Returns
    -------
    metrics : dict of str to float
        ``n`` (int, the number of measurements), ``mape``, ``median_ape``, ``p90_ape``, ``max_ape`` (fractions, not
        percentages) and ``log_rmse``.

    Raises
    ------
    ValueError
        As :func:`absolute_percentage_errors`, and if any ``pred_us`` is 0.
    """
    pred, meas = _checked_pair(pred_us, meas_us, pred_nonnegative=True)
    if np.any(pred == 0):
        raise ValueError(f"pred_us must be > 0 for log_rmse, got {int(np.sum(pred == 0))} zeros")
    ape = np.abs(pred - meas) / meas
    log_err = np.log(pred) - np.log(meas)
    return {
        "n": int(ape.size),
        "mape": float(np.mean(ape)),
        "median_ape": float(np.median(ape)),
        "p90_ape": float(np.percentile(ape, 90)),
        "max_ape": float(np.max(ape)),
        "log_rmse": float(np.sqrt(np.mean(log_err**2))),
    }


@dataclass(frozen=True)
class RankMetrics:
    """How well a latency model ranks the configs of each tree (see the module docstring for definitions).

    Attributes
    ----------
    n_trees : int
        Trees with two or more measurements (the only ones counted).
    n_trees_tau_undefined : int
        Of those, trees whose Kendall tau is undefined (all predicted or all measured latencies equal).
    mean_kendall_tau, median_kendall_tau : float
        Over the trees with a defined tau; nan if there are none.
    top_k_score : dict of int to float
        ``k -> sum_t best / sum_t best_of_topk``.
    a_peak_at_k : dict of int to float
        ``k -> mean_t (best / best_of_topk)``.
    per_tree : list of dict
        One dict per counted tree, in the order of ``np.unique`` of the ids: ``tree`` (the id as given), ``n``
        (measurements), ``kendall_tau`` (nan if undefined), ``best_us`` and ``best_of_top{k}_us`` for each ``k``.
    """

    n_trees: int
    n_trees_tau_undefined: int
    mean_kendall_tau: float
    median_kendall_tau: float
    top_k_score: dict[int, float] = field(default_factory=dict)
    a_peak_at_k: dict[int, float] = field(default_factory=dict)
    per_tree: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, float]:
        """The aggregate metrics as a flat dict.

        Returns
        -------
        metrics : dict of str to float
            ``n_trees``, ``n_trees_tau_undefined`` (ints), ``mean_kendall_tau``, ``median_kendall_tau``, then
            ``top{k}_score`` and ``a_peak@{k}`` for each ``k`` in the order given.
        """
        out: dict[str, float] = {
            "n_trees": self.n_trees,
            "n_trees_tau_undefined": self.n_trees_tau_undefined,
            "mean_kendall_tau": self.mean_kendall_tau,
            "median_kendall_tau": self.median_kendall_tau,
        }
        out.update({f"top{k}_score": v for k, v in self.top_k_score.items()})
        out.update({f"a_peak@{k}": v for k, v in self.a_peak_at_k.items()})
        return out


def _tree_groups(tree_ids: ArrayLike | Iterable[Any], n: int) -> tuple[list[Any], np.ndarray]:
    """Group ids: ``(unique ids as given, code of every measurement)``, ``codes[i]`` indexing the unique ids.

    Ids that ``np.unique`` cannot sort together (e.g. ints and strings) are grouped by ``str(id)``.
    """
    if isinstance(tree_ids, np.ndarray) and tree_ids.dtype != object:
        if tree_ids.ndim != 1:
            raise ValueError(f"tree_ids must be 1-D, got shape {tree_ids.shape}")
        items: list[Any] = tree_ids.tolist()  # Python ints / strs, not numpy scalars
    else:
        if isinstance(tree_ids, (str, bytes)):
            raise ValueError("tree_ids must be a sequence of ids, got a single string")
        try:
            items = list(tree_ids)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(f"tree_ids must be a sequence of ids, got {type(tree_ids).__name__}") from None
    if len(items) != n:
        raise ValueError(f"tree_ids must have the same length as meas_us, got {len(items)} and {n}")
    for t in items:
        try:
            hash(t)
        except TypeError:
            raise ValueError(f"tree_ids must be hashable, got {t!r}") from None
    arr = np.empty(n, dtype=object)
    for i, t in enumerate(items):  # element-wise: tuples stay single ids instead of becoming rows
        arr[i] = t
    try:
        _, first, codes = np.unique(arr, return_index=True, return_inverse=True)
    except TypeError:  # mixed types that do not compare: group by their string form
        _, first, codes = np.unique(np.array([str(t) for t in items]), return_index=True, return_inverse=True)
        if len(first) != len(set(items)):
            raise ValueError("tree_ids holds distinct ids with the same string form (e.g. 1 and '1')") from None
    return [items[i] for i in first], np.asarray(codes).reshape(-1)


def _validated_ks(ks: Sequence[int]) -> tuple[int, ...]:
    out = []
    for k in ks:
        if not is_int(k) or k < 1:
            raise ValueError(f"ks must hold integers >= 1, got {k!r}")
        out.append(int(k))
    if not out:
        raise ValueError("ks is empty")
    return tuple(dict.fromkeys(out))  # drop repeats, keep the order


def per_tree_rank_metrics(
    pred_us: ArrayLike,
    meas_us: ArrayLike,
    tree_ids: ArrayLike | Iterable[Any],
    ks: Sequence[int] = (1, 5),
) -> RankMetrics:
    """Ranking quality of predicted latencies within each tree (see the module docstring for definitions).

    Parameters
    ----------
    pred_us : array_like of float, shape (n,)
        Predicted latencies in microseconds, finite (only their order within a tree matters, so any sign is allowed).
    meas_us : array_like of float, shape (n,)
        Measured latencies in microseconds, finite and > 0.
    tree_ids : array_like of hashable, shape (n,)
        Tree of every measurement: ints, strings or other hashable ids. Ids of types that do not sort together
        (e.g. ints and strings) are grouped by ``str(id)``.
    ks : sequence of int, default (1, 5)
        The ``k`` of the top-k metrics, each >= 1 (a ``k`` above a tree's size takes the whole tree).

    Returns
    -------
    RankMetrics
        Aggregates over the trees with two or more measurements, and one record per such tree.

    Raises
    ------
    ValueError
        If the arrays are not 1-D of the same non-zero length, ``pred_us`` or ``meas_us`` is not finite,
        ``meas_us <= 0``, ``ks`` is empty or holds a ``k < 1``, or no tree has two or more measurements.
    """
    pred, meas = _checked_pair(pred_us, meas_us, pred_nonnegative=False)
    kk = _validated_ks(ks)
    ids, codes = _tree_groups(tree_ids, meas.size)

    order = np.argsort(codes, kind="stable")  # measurements grouped by tree, input order kept within a tree
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    per_tree: list[dict[str, Any]] = []
    taus: list[float] = []
    best_sum = 0.0
    best_of_topk_sum = dict.fromkeys(kk, 0.0)
    ratio_sum = dict.fromkeys(kk, 0.0)
    for idx in np.split(order, bounds):
        if idx.size < 2:
            continue
        p, m = pred[idx], meas[idx]
        if np.all(p == p[0]) or np.all(m == m[0]):
            tau = float("nan")  # tau-b divides by zero; decided here so scipy has nothing to warn about
        else:
            tau = float(kendalltau(p, m).statistic)
        if not np.isnan(tau):
            taus.append(tau)
        best = float(m.min())
        best_sum += best
        record: dict[str, Any] = {"tree": ids[codes[idx[0]]], "n": int(idx.size), "kendall_tau": tau, "best_us": best}
        by_pred = np.argsort(p, kind="stable")
        for k in kk:
            best_of_topk = float(m[by_pred[:k]].min())
            best_of_topk_sum[k] += best_of_topk
            ratio_sum[k] += best / best_of_topk
            record[f"best_of_top{k}_us"] = best_of_topk
        per_tree.append(record)

    if not per_tree:
        raise ValueError("no tree has two or more measurements (tree_ids are all distinct)")
    nt = len(per_tree)
    return RankMetrics(
        n_trees=nt,
        n_trees_tau_undefined=nt - len(taus),
        mean_kendall_tau=float(np.mean(taus)) if taus else float("nan"),
        median_kendall_tau=float(np.median(taus)) if taus else float("nan"),
        top_k_score={k: best_sum / best_of_topk_sum[k] for k in kk},
        a_peak_at_k={k: ratio_sum[k] / nt for k in kk},
        per_tree=per_tree,
    )


def _cell(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.4g}"
    return str(value).replace("|", "\\|")


def evaluation_table(rows: list[tuple[str, dict[str, float]]], keys: list[str], *, name_header: str = "model") -> str:
    """A markdown table of metrics, one row per evaluated model (or split), for CLI and docs output.

    Parameters
    ----------
    rows : list of (str, dict of str to float)
        ``(row name, metrics)``, e.g. ``("xgb heldout", regression_metrics(...))``.
    keys : list of str
        The metrics to show, one column each, in this order. A key missing from a row's dict shows as ``-``.
    name_header : str, default "model"
        Header of the first column (the row names).

    Returns
    -------
    table : str
        Header line, alignment line, then one line per row; no trailing newline. Floats have 4 significant digits
        (``format(x, ".4g")``); ints are written in full; fractions are not converted to percentages.

    Raises
    ------
    ValueError
        If ``keys`` is empty or a row is not a ``(name, dict)`` pair.
    """
    if not keys:
        raise ValueError("keys is empty: the table needs at least one metric column")
    lines = [
        "| " + " | ".join([_cell(name_header), *(_cell(k) for k in keys)]) + " |",
        "|" + "|".join([" --- ", *(" ---: " for _ in keys)]) + "|",
    ]
    for row in rows:
        if not (isinstance(row, tuple) and len(row) == 2 and isinstance(row[1], dict)):
            raise ValueError(f"rows must hold (name, dict) pairs, got {row!r}")
        name, metrics = row
        cells = [_cell(name), *(_cell(metrics[k]) if k in metrics else "-" for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
