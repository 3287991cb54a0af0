"""The planner's output before it becomes kernel arrays: context-query groups."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Groups"]


@dataclass(frozen=True)
class Groups:
    """Context-query groups of a plan, in increasing node order.

    Attributes
    ----------
    node : ndarray, int64 [n_groups]
        The tree node that names the group (the bottom of its KV chain).
    kv_start, kv_len : ndarray, int64 [n_groups]
        Group ``i`` reads pool slots ``kv_slots[kv_start[i]:kv_start[i] + kv_len[i]]``
        (``kv_len >= 1``).
    kv_slots : ndarray, int32 [n_kv_entries]
        Backing slot list: the tree's own slot array (single-node groups point into it),
        followed by the concatenated slots of multi-node groups.
    q_indptr : ndarray, int64 [n_groups + 1]
    q_ids : ndarray, int64 [total group queries]
        Group ``i`` serves queries ``q_ids[q_indptr[i]:q_indptr[i + 1]]`` (ascending).
    identity_slots : int
        ``kv_slots[:identity_slots]`` is ``arange(identity_slots)`` (a tree whose slot ``i`` is
        token ``i``), which lets packing skip gathers there; 0 when not known.
    """

    node: np.ndarray
    kv_start: np.ndarray
    kv_len: np.ndarray
    kv_slots: np.ndarray
    q_indptr: np.ndarray
    q_ids: np.ndarray
    identity_slots: int = 0

    @property
    def n_groups(self) -> int:
        return int(self.node.size)

    @property
    def n_queries(self) -> np.ndarray:
        return np.diff(self.q_indptr)
