"""How far the latency model's predicted gains are off, measured on held-out traces: the margin a
predicted gain must clear before a model-only export acts on it.

The tuner asks the model how much faster a config is than the defaults on a tree: a ratio of two
predictions. For every held-out tree measured under the defaults and under other configs (one tree
at one head shape, dtype and launch path: :func:`~fasttree.costmodel.dataset.tree_id`), each other
config gives one pair, and its error

    ``error = log(measured ratio to the defaults) - log(predicted ratio to the defaults)``

is positive where the model promised more gain than the GPU gave. Per bucket (GQA ratio, head dim,
dtype) and target (``tree_attention`` launches or the runtime's), :func:`gain_margins` takes the
``quantile`` of the errors, ``q``, and returns ``margin = 1 - exp(-max(q, 0))``: a member predicted to
save more than ``margin`` of the defaults' time still saves time on the GPU unless the model errs on
it by more than on ``1 - quantile`` of the held-out pairs. A bucket and target with fewer than
``min_pairs`` pairs gets no margin (a model-only export then serves the defaults there).

The caller passes measurements of today's kernel launches only
(:func:`~fasttree.costmodel.dataset.timed_todays_launches`: older versions' errors say little about
today's kernels where a change reached them); a pair never mixes two kernel versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fasttree.validation import check_int, check_number

from .dataset import Dataset
from .features import FEATURE_NAMES

__all__ = ["MARGIN_QUANTILE", "MIN_PAIRS", "GainMargin", "gain_errors", "gain_margins"]

#: The quantile of the held-out gain errors a predicted gain must exceed (one pair in five errs more).
MARGIN_QUANTILE = 0.8
#: Fewest held-out pairs of a bucket and target to calibrate its margin on.
MIN_PAIRS = 20

_COLUMN = {name: FEATURE_NAMES.index(name) for name in ("gqa", "head_dim", "runtime_launch", "kernel_version")}


@dataclass(frozen=True)
class GainMargin:
    """The calibrated margin of one bucket and target.

    Attributes
    ----------
    margin : float
        Least predicted gain (a share of the defaults' time, in [0, 1)) a member must show.
    pairs : int
        Held-out (config, defaults) pairs it was calibrated on.
    quantile : float
        The quantile of their errors it is.
    """

    margin: float
    pairs: int
    quantile: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (what an export's provenance records)."""
        return {"margin": self.margin, "pairs": self.pairs, "quantile": self.quantile}


def gain_errors(pred_us: np.ndarray, data: Dataset) -> dict[tuple[int, int, str, str], np.ndarray]:
    """The held-out errors of predicted gains, per bucket and target.

    Parameters
    ----------
    pred_us : ndarray, float [len(data)]
        The model's predictions of ``data``'s rows.
    data : Dataset
        Held-out measurements; trees measured under the defaults (``default_config``) and other
        configs with the same kernel version give the pairs.

    Returns
    -------
    dict
        ``(group_size, head_dim, dtype, target) -> errors`` (float64 [pairs], ``log(measured ratio) -
        log(predicted ratio)``), ``target`` ``"tree_attention"`` or ``"runtime"``.
    """
    pred = np.asarray(pred_us, dtype=np.float64)
    if pred.shape != data.y_us.shape:
        raise ValueError(f"pred_us must hold one prediction per row ({data.y_us.size}), got shape {pred.shape}")
    rows_of: dict[tuple[str, float], list[int]] = {}
    for i in range(len(data)):
        rows_of.setdefault((str(data.tree[i]), float(data.X[i, _COLUMN["kernel_version"]])), []).append(i)
    errors: dict[tuple[int, int, str, str], list[float]] = {}
    for rows in rows_of.values():
        defaults = [i for i in rows if data.default_config[i]]
        if not defaults:
            continue
        ref = defaults[0]
        x = data.X[ref]
        key = (
            int(x[_COLUMN["gqa"]]),
            int(x[_COLUMN["head_dim"]]),
            str(data.dtype[ref]),
            "runtime" if x[_COLUMN["runtime_launch"]] else "tree_attention",
        )
        for i in rows:
            if i == ref or data.default_config[i]:
                continue
            measured = math.log(data.y_us[i] / data.y_us[ref])
            predicted = math.log(pred[i] / pred[ref])
            errors.setdefault(key, []).append(measured - predicted)
    return {k: np.asarray(v, dtype=np.float64) for k, v in sorted(errors.items())}


def gain_margins(
    pred_us: np.ndarray,
    data: Dataset,
    *,
    quantile: float = MARGIN_QUANTILE,
    min_pairs: int = MIN_PAIRS,
) -> dict[tuple[int, int, str, str], GainMargin]:
    """The margin of every bucket and target with at least ``min_pairs`` held-out pairs (see the module
    docstring).

    Parameters
    ----------
    pred_us : ndarray, float [len(data)]
        The model's predictions of ``data``'s rows.
    data : Dataset
        Held-out measurements (traces the model was not fitted on).
    quantile : float
        In (0, 1).
    min_pairs : int
        Fewest pairs to calibrate on (>= 1).

    Returns
    -------
    dict
        ``(group_size, head_dim, dtype, target) -> GainMargin``.
    """
    quantile = float(check_number("quantile", quantile, above=0, below=1))
    min_pairs = check_int("min_pairs", min_pairs, minimum=1)
    out = {}
    for key, err in gain_errors(pred_us, data).items():
        if err.size >= min_pairs:
            q = max(0.0, float(np.quantile(err, quantile)))
            out[key] = GainMargin(margin=1.0 - math.exp(-q), pairs=int(err.size), quantile=quantile)
    return out
