"""The learned latency model: a scikit-learn estimator on plan features, fitted on log latency.

:class:`LatencyModel` follows scikit-learn's estimator contract: a keyword-only
constructor that stores its parameters unchanged, fitted state in attributes ending in
``_``, ``fit`` returning ``self``, ``predict`` checking the model is fitted. Its input
is the feature matrix of :mod:`fasttree.costmodel.features` (columns
:data:`~fasttree.costmodel.features.FEATURE_NAMES`), its target the measured GPU time in
microseconds; internally it regresses ``log(time)`` (or, for ``kind="residual"``, the log
ratio of the measured time to the simulator's, the column ``sim_total_us``).
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
from sklearn.utils.validation import check_is_fitted, validate_data

from .features import FEATURE_NAMES, SIM_TOTAL

__all__ = ["KINDS", "LatencyModel"]

#: ``gbrt``: gradient-boosted trees on log latency; ``forest``: a random forest on log
#: latency; ``residual``: gradient-boosted trees on log(measured / simulated).
KINDS = ("gbrt", "forest", "residual")


class LatencyModel(RegressorMixin, BaseEstimator):
    """Predicts the GPU time (us) of one tree-attention call from its plan's features.

    Parameters
    ----------
    kind : {"gbrt", "forest", "residual"}
        The regressor (see :data:`KINDS`).
    n_estimators : int
        Trees.
    learning_rate : float
        Shrinkage of the boosted kinds.
    max_depth : int or None
        Depth of each tree (None: unlimited, forests only).
    min_samples_leaf : int
        Smallest leaf.
    subsample : float
        Row fraction per boosting stage.
    max_features : float or None
        Feature fraction tried per split of the boosted kinds (None: all).
    random_state : int
        Seed.

    Attributes
    ----------
    estimator_ : GradientBoostingRegressor or RandomForestRegressor
        The fitted regressor.
    n_features_in_ : int
        ``len(FEATURE_NAMES)``.
    """

    def __init__(
        self,
        *,
        kind: str = "gbrt",
        n_estimators: int = 400,
        learning_rate: float = 0.08,
        max_depth: int | None = 7,
        min_samples_leaf: int = 3,
        subsample: float = 0.5,
        max_features: float | None = 0.5,
        random_state: int = 0,
    ) -> None:
        self.kind = kind
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.max_depth = max_depth
        self.min_samples_leaf = min_samples_leaf
        self.subsample = subsample
        self.max_features = max_features
        self.random_state = random_state

    def _make_estimator(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind == "forest":
            return RandomForestRegressor(
                n_estimators=self.n_estimators,
                max_depth=self.max_depth,
                min_samples_leaf=self.min_samples_leaf,
                random_state=self.random_state,
                n_jobs=-1,
            )
        return GradientBoostingRegressor(
            n_estimators=self.n_estimators,
            learning_rate=self.learning_rate,
            max_depth=self.max_depth,
            min_samples_leaf=self.min_samples_leaf,
            subsample=self.subsample,
            max_features=self.max_features,
            random_state=self.random_state,
        )

    def _baseline(self, X: np.ndarray) -> np.ndarray:
        if self.kind != "residual":
            return np.zeros(X.shape[0])
        sim = X[:, SIM_TOTAL]
        if not np.all(sim > 0):
            raise ValueError("the residual model needs a positive sim_total_us in every row")
        return np.log(sim)

    def fit(self, X, y) -> LatencyModel:
        """Fit on feature rows ``X`` (float [n, n_features]) and measured times ``y`` (us, float [n], > 0).

        Returns
        -------
        LatencyModel
            ``self``.
        """
        X, y = validate_data(self, X, y, dtype=np.float64, y_numeric=True)
        if X.shape[1] != len(FEATURE_NAMES):
            raise ValueError(f"X has {X.shape[1]} feature columns, expected {len(FEATURE_NAMES)} (FEATURE_NAMES)")
        if not np.all(y > 0):
            raise ValueError("y must hold positive times (us)")
        est = self._make_estimator()
        est.fit(X, np.log(y) - self._baseline(X))
        self.estimator_ = est
        return self

    def predict(self, X) -> np.ndarray:
        """Predicted GPU time (us, float [n]) of feature rows ``X`` (float [n, n_features])."""
        check_is_fitted(self, "estimator_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return np.exp(self.estimator_.predict(X) + self._baseline(X))
