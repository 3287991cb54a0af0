"""The FastTree planner's padding cost ``Cmm`` and the edge costs built on it.

With ``TSQ`` queries per tile, ``TSK`` KV tokens per tile and ``g`` the GQA group size::

    PadQ(TS, n) = TS - ((n - 1) % TS + 1)       # == (-n) mod TS, 0 for n == 0
    PadK(TS, n) = max(0, TS - n)
    Cmm(nQ, nK) = alpha * PadQ(TSQ, nQ) * g * nK + beta * PadK(TSK, nK) * nQ * g

The tile *phase* is chosen by ``nQ``: more queries than the phase-1 tile use the phase-0
tile pair. In the default two-class mode the pairs are (large, small); the adaptive tile
pass can force both phases onto the small or onto the large tiles (see
:func:`mode_tiles`). ``Cmm(0, nK) == 0``: an empty group costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Tile modes of a plan: two tile classes, or every group on one of them.
TWO_CLASSES, ALL_LARGE, ALL_SMALL = "two_classes", "all_large", "all_small"
#: The tile mode of plain split-KV decode's plans (:func:`fasttree.plan_query_separated`): one
#: query per tile in both classes, as :data:`TWO_CLASSES` with one-query tiles.
QUERY_SEPARATED = "query_separated"


def mode_tiles(mode: str, q_tiles: tuple[int, int], kv_tiles: tuple[int, int]):
    """Per-phase (query tiles, KV tiles) of a tile mode."""
    if mode in (TWO_CLASSES, QUERY_SEPARATED):
        return tuple(q_tiles), tuple(kv_tiles)
    if mode == ALL_LARGE:
        return (q_tiles[0], q_tiles[0]), (kv_tiles[0], kv_tiles[0])
    if mode == ALL_SMALL:
        return (q_tiles[1], q_tiles[1]), (kv_tiles[1], kv_tiles[1])
    raise ValueError(f"unknown tile mode {mode!r}")


def _pow2(x: int) -> bool:
    return x & (x - 1) == 0


@dataclass(frozen=True)
class PaddingCost:
    """Vectorised ``Cmm`` for one (config, GQA ratio, per-phase tiles).

    Parameters
    ----------
    alpha, beta, gamma : float
        Cost weights of the config.
    group_size : int
        GQA ratio ``g``.
    q_tiles : tuple of int
        Queries per tile of phase 0 and phase 1.
    kv_tiles : tuple of int
        KV tokens per tile of phase 0 and phase 1.
    """

    alpha: float
    beta: float
    gamma: float
    group_size: int
    q_tiles: tuple[int, int]
    kv_tiles: tuple[int, int]

    def phase(self, n_queries: np.ndarray) -> np.ndarray:
        """0 or 1 per group of ``n_queries`` queries (int64)."""
        return (np.asarray(n_queries) <= self.q_tiles[1]).astype(np.int64)

    def cmm(self, n_queries: np.ndarray, n_kv: np.ndarray) -> np.ndarray:
        """Padding cost of a group of ``n_queries`` queries over ``n_kv`` tokens (broadcasting)."""
        n_queries = np.asarray(n_queries, dtype=np.int64)
        n_kv = np.asarray(n_kv, dtype=np.int64)
        (tq0, tq1), (tk0, tk1) = self.q_tiles, self.kv_tiles
        large = n_queries > tq1
        tsq = np.where(large, tq0, tq1)
        tsk = np.where(large, tk0, tk1)
        if _pow2(tq0) and _pow2(tq1):
            pad_q = (-n_queries) & (tsq - 1)  # same as % for power-of-two tiles, and faster
        else:
            pad_q = (-n_queries) % tsq
        pad_k = np.maximum(tsk - n_kv, 0)
        g = self.group_size
        return self.alpha * g * (pad_q * n_kv) + self.beta * g * (pad_k * n_queries)

    def cmm_scalar(self, nq: int, nk: int) -> float:
        """``cmm`` for Python ints (no numpy overhead), same arithmetic."""
        c = 0 if nq > self.q_tiles[1] else 1
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
