"""The FastTree planner's padding cost ``Cmm`` and the edge costs built on it.

With ``TSQ`` query rows per tile (counted in queries), ``TSK`` KV tokens per tile and
``g`` the GQA group size::

    PadQ(TS, n) = TS - ((n - 1) % TS + 1)       # == (-n) mod TS, 0 for n == 0
    PadK(TS, n) = max(0, TS - n)
    Cmm(nQ, nK) = alpha * PadQ(TSQ, nQ) * g * nK + beta * PadK(TSK, nK) * nQ * g

The tile class (and so ``TSQ``, ``TSK``) is chosen by ``nQ``: more than the small
query tile uses the large tile, unless the plan is forced to one tile class.
``Cmm(0, nK) == 0``: an empty group costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Tile modes of a plan: two tile classes, or every group on one of them.
TWO_CLASSES, ALL_LARGE, ALL_SMALL = "two_classes", "all_large", "all_small"

_FIXED_CLASS = {ALL_LARGE: 0, ALL_SMALL: 1}


@dataclass(frozen=True)
class PaddingCost:
    """Vectorised ``Cmm`` for one (config, GQA ratio, tile mode).

    Parameters
    ----------
    alpha, beta, gamma : float
        Cost weights of the config.
    group_size : int
        GQA ratio ``g``.
    q_tiles : tuple of int
        Queries per tile (large, small).
    kv_tiles : tuple of int
        KV tokens per tile (large, small).
    mode : str
        ``TWO_CLASSES``, ``ALL_LARGE`` or ``ALL_SMALL``.
    """

    alpha: float
    beta: float
    gamma: float
    group_size: int
    q_tiles: tuple[int, int]
    kv_tiles: tuple[int, int]
    mode: str = TWO_CLASSES

    def tile_class(self, n_queries: np.ndarray) -> np.ndarray:
        """0 (large) or 1 (small) per group of ``n_queries`` queries, int64 like the input."""
        n_queries = np.asarray(n_queries)
        if self.mode == ALL_LARGE:
            return np.zeros_like(n_queries)
        if self.mode == ALL_SMALL:
            return np.ones_like(n_queries)
        return (n_queries <= self.q_tiles[1]).astype(n_queries.dtype)

    def cmm(self, n_queries: np.ndarray, n_kv: np.ndarray) -> np.ndarray:
        """Padding cost of a group of ``n_queries`` queries over ``n_kv`` tokens (broadcasting)."""
        n_queries = np.asarray(n_queries, dtype=np.int64)
        n_kv = np.asarray(n_kv, dtype=np.int64)
        if self.mode == TWO_CLASSES:
            large = n_queries > self.q_tiles[1]
            tsq = np.where(large, self.q_tiles[0], self.q_tiles[1])
            tsk = np.where(large, self.kv_tiles[0], self.kv_tiles[1])
        else:
            c = 0 if self.mode == ALL_LARGE else 1
            tsq, tsk = self.q_tiles[c], self.kv_tiles[c]
        if self.q_tiles[0] & (self.q_tiles[0] - 1) == 0 and self.q_tiles[1] & (self.q_tiles[1] - 1) == 0:
            pad_q = (-n_queries) & (tsq - 1)  # same as % for power-of-two tiles, and faster
        else:
            pad_q = (-n_queries) % tsq
        pad_k = np.maximum(tsk - n_kv, 0)
        g = self.group_size
        return self.alpha * g * (pad_q * n_kv) + self.beta * g * (pad_k * n_queries)

    def cmm_scalar(self, nq: int, nk: int) -> float:
        """``cmm`` for Python ints (no numpy overhead), same arithmetic."""
        c = _FIXED_CLASS.get(self.mode, 0 if nq > self.q_tiles[1] else 1)
        tsk = self.kv_tiles[c]
        pad_k = tsk - nk if nk < tsk else 0
        g = self.group_size
        return self.alpha * g * (((-nq) % self.q_tiles[c]) * nk) + self.beta * g * (pad_k * nq)

    def split_kv_minus_split_q(self, n_cur, n_child, len_child, len_parent, *, scalar: bool = False):
        """``SplitKVCost - SplitQCost`` of an edge; the edge is concatenated (1) when it is > 0.

        ``SplitQCost  = Cmm(n_cur - n_child, len_parent) + Cmm(n_child, len_child + len_parent)``
        ``SplitKVCost = Cmm(n_cur, len_parent) + Cmm(n_child, len_child) + gamma * n_child``
        """
        cmm = self.cmm_scalar if scalar else self.cmm
        split_kv = cmm(n_cur, len_parent) + cmm(n_child, len_child) + self.gamma * n_child
        split_q = cmm(n_cur - n_child, len_parent) + cmm(n_child, len_child + len_parent)
        return split_kv - split_q
