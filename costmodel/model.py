"""The learned latency model: a scikit-learn estimator on plan features, fitted on log latency.

:class:`LatencyModel` follows scikit-learn's estimator contract: a keyword-only
constructor that stores its parameters unchanged, fitted state in attributes ending in
``_``, ``fit`` returning ``self``, ``predict`` checking the model is fitted. Its input
is the feature matrix of :mod:`fasttree.costmodel.features` (columns
:data:`~fasttree.costmodel.features.FEATURE_NAMES`), its target the measured GPU time in
microseconds; internally it regresses ``log(time)`` (or, for ``kind="residual"``, the log
ratio of the measured time to the simulator's, the column ``sim_total_us``).

It fits ``n_seeds`` regressors that differ only in their random seed and predicts the
geometric mean of theirs: with row and feature subsampling one fit's held-out top-1 score
moved by up to 0.03 with the seed alone (``docs/history.md``, the latency model).
"""

from __future__ import annotations

import numpy as np
from joblib import Parallel, delayed
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
from sklearn.utils.validation import check_is_fitted, validate_data

from fasttree.validation import check_choice, check_int

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
    n_seeds : int
        Regressors fitted, with seeds ``random_state``, ``random_state + 1``, ...; the
        prediction is the geometric mean of theirs.
    random_state : int
        Seed of the first regressor.
    n_jobs : int or None
        Processes that fit the regressors side by side (joblib's convention: None is one
        unless a ``joblib.parallel_config`` says otherwise, -1 every core).

    Attributes
    ----------
    estimators_ : list of GradientBoostingRegressor or RandomForestRegressor
        The fitted regressors, ``n_seeds`` of them, in seed order.
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
        n_seeds: int = 3,
        random_state: int = 0,
        n_jobs: int | None = None,
    ) -> None:
        self.kind = kind
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.max_depth = max_depth
        self.min_samples_leaf = min_samples_leaf
        self.subsample = subsample
        self.max_features = max_features
        self.n_seeds = n_seeds
        self.random_state = random_state
        self.n_jobs = n_jobs

    def _make_estimator(self, seed: int | None = None):
        """An unfitted regressor of this kind (``seed``: its random state, default ``random_state``)."""
        check_choice("kind", self.kind, KINDS)
        seed = self.random_state if seed is None else seed
        if self.kind == "forest":
            return RandomForestRegressor(
                n_estimators=self.n_estimators,
                max_depth=self.max_depth,
                min_samples_leaf=self.min_samples_leaf,
                random_state=seed,
                n_jobs=-1,
            )
        return GradientBoostingRegressor(
            n_estimators=self.n_estimators,
            learning_rate=self.learning_rate,
            max_depth=self.max_depth,
            min_samples_leaf=self.min_samples_leaf,
            subsample=self.subsample,
            max_features=self.max_features,
            random_state=seed,
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
        check_int("n_seeds", self.n_seeds, minimum=1, expected="a positive integer")
        target = np.log(y) - self._baseline(X)
        unfitted = [self._make_estimator(self.random_state + i) for i in range(self.n_seeds)]
        self.estimators_ = Parallel(n_jobs=self.n_jobs)(delayed(_fitted)(est, X, target) for est in unfitted)
        return self

    def predict(self, X) -> np.ndarray:
        """Predicted GPU time (us, float [n]) of feature rows ``X`` (float [n, n_features])."""
        log_times, base = self._member_log_times(X)
        return np.exp(log_times.mean(axis=0) + base)

    def predict_members(self, X) -> np.ndarray:
        """Each regressor's own predicted GPU time (us, float [n_seeds, n]) of rows ``X`` (float [n, n_features]).

        :meth:`predict` is the geometric mean over the first axis; the spread across it shows
        how much the seed alone moves a prediction.
        """
        log_times, base = self._member_log_times(X)
        return np.exp(log_times + base)

    def _member_log_times(self, X) -> tuple[np.ndarray, np.ndarray]:
        """Each regressor's log-time output (float [n_seeds, n]) and the baseline it is relative to (float [n])."""
        check_is_fitted(self, "estimators_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return np.stack([est.predict(X) for est in self.estimators_]), self._baseline(X)


def _fitted(estimator, X: np.ndarray, target: np.ndarray):
    """``estimator`` fitted on ``X`` and ``target`` (a module-level function, so worker processes can run it)."""
    return estimator.fit(X, target)
