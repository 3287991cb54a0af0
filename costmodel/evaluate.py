"""Held-out evaluation of latency predictors: group k-fold by tree family and a separate held-out set.

Three predictors are compared on the same rows:

* the **simulator** alone (:class:`SimulatorBaseline`: ``log t = a + b log sim``, the two
  numbers fitted on the training rows),
* the **learned model** (:class:`~fasttree.costmodel.model.LatencyModel`, each kind),
* the **published planner's cost** (:func:`~fasttree.costmodel.features.published_cost`;
  arbitrary units, so rank metrics only).

Rows of one tree never sit on both sides of a split: k-fold groups by family, and the
held-out set's trees were generated apart (``fasttree-tune profile --split heldout``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.model_selection import GroupKFold
from sklearn.utils.validation import check_is_fitted, validate_data

from .dataset import Dataset
from .features import FEATURE_NAMES, SIM_TOTAL
from .metrics import per_tree_rank_metrics, regression_metrics

logger = logging.getLogger(__name__)

__all__ = ["SimulatorBaseline", "cross_validated_predictions", "prediction_metrics", "rank_only_metrics"]


class SimulatorBaseline(RegressorMixin, BaseEstimator):
    """The simulator's time, calibrated by a line in log-log space: ``log t = a + b log sim``.

    Attributes
    ----------
    coef_ : ndarray, float64 [2]
        ``(a, b)``.
    """

    def __init__(self) -> None:
        pass

    def fit(self, X, y) -> SimulatorBaseline:
        """Fit ``(a, b)`` on feature rows ``X`` (float [n, n_features]) and times ``y`` (us, float [n])."""
        X, y = validate_data(self, X, y, dtype=np.float64, y_numeric=True)
        sim = np.log(np.maximum(X[:, SIM_TOTAL], 1e-6))
        A = np.column_stack([np.ones_like(sim), sim])
        self.coef_ = np.linalg.lstsq(A, np.log(y), rcond=None)[0]
        return self

    @classmethod
    def from_coef(cls, coef) -> SimulatorBaseline:
        """A fitted baseline with the stored ``(a, b)`` (e.g. from a model file's metadata)."""
        coef = np.asarray(coef, dtype=np.float64)
        if coef.shape != (2,) or not np.all(np.isfinite(coef)):
            raise ValueError(f"the simulator calibration must be two finite numbers (a, b), got {coef.tolist()}")
        base = cls()
        base.coef_ = coef
        base.n_features_in_ = len(FEATURE_NAMES)
        return base

    def predict(self, X) -> np.ndarray:
        """Calibrated simulator time (us, float [n])."""
        check_is_fitted(self, "coef_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return np.exp(self.coef_[0] + self.coef_[1] * np.log(np.maximum(X[:, SIM_TOTAL], 1e-6)))


def prediction_metrics(pred_us: np.ndarray, data: Dataset) -> dict[str, float]:
    """Error and rank metrics of predicted times (us, float [n]) against ``data``'s measurements."""
    out: dict[str, float] = dict(regression_metrics(pred_us, data.y_us))
    out.update(per_tree_rank_metrics(pred_us, data.y_us, data.tree).as_dict())
    return out


def rank_only_metrics(scores: np.ndarray, data: Dataset) -> dict[str, float]:
    """Rank metrics of scores in any unit (float [n]; lower = predicted faster)."""
    return per_tree_rank_metrics(np.asarray(scores, dtype=np.float64), data.y_us, data.tree).as_dict()


def cross_validated_predictions(
    make_model: Callable[[], Any], data: Dataset, *, n_splits: int = 5, on_fold: Callable[[int], None] | None = None
) -> np.ndarray:
    """Out-of-fold predictions (us, float [n]) with :class:`~sklearn.model_selection.GroupKFold` by tree family.

    Parameters
    ----------
    make_model : callable
        Returns a fresh unfitted regressor (``fit(X, y_us)``, ``predict(X) -> us``).
    data : Dataset
    n_splits : int
        Folds (at most the number of families).
    on_fold : callable, optional
        Called with the fold index after each fold (progress).

    Raises
    ------
    ValueError
        With fewer than two families.
    """
    families = np.unique(data.family)
    if families.size < 2:
        raise ValueError(f"group k-fold by family needs two families or more, the data has {families.tolist()}")
    k = min(n_splits, families.size)
    pred = np.empty_like(data.y_us)
    for i, (train, test) in enumerate(GroupKFold(n_splits=k).split(data.X, data.y_us, groups=data.family)):
        model = make_model().fit(data.X[train], data.y_us[train])
        pred[test] = model.predict(data.X[test])
        logger.debug("fold %d: held out %s", i, sorted(set(data.family[test])))
        if on_fold is not None:
            on_fold(i)
    return pred
