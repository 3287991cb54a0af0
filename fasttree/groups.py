"""The planner's output before it becomes kernel arrays: context-query groups."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .host_arrays import entry_array

__all__ = ["ChainedSlots", "Groups"]


class ChainedSlots:
    """A slot list held in two parts, not yet copied into one array: ``concatenate([head, tail])``.

    The planner's groups read the tree's own slot array (single-node groups, ``head``) and the
    chained groups' concatenated slots after it (``tail``), which are runs of the head: a packed
    plan gathers its entries from the head through those runs (:attr:`runs`), so neither the list
    nor its tail is built unless something reads them, and then the tail is written in place
    (``fill_tail``), not copied.

    Parameters
    ----------
    head : ndarray, int32 [n_head]
        Entries ``0 .. n_head - 1`` (the tree's slot array, not a copy).
    n_tail : int
        Entries after the head.
    fill_tail : callable
        ``fill_tail(out)`` writes the tail, entries ``n_head .. n_head + n_tail - 1``, into an
        int32 C-contiguous array ``out`` [n_tail].
    tail_runs : callable, optional
        Returns the tail as runs of the head, int64 [2 * n_runs + 1]: ``src`` [n_runs] then
        ``off`` [n_runs + 1], where tail entry ``t`` with ``off[j] <= t < off[j + 1]`` is
        ``head[src[j] + t - off[j]]`` (``off[0] = 0``, ``off[n_runs] = n_tail``).
    """

    __slots__ = ("_fill_tail", "_runs", "_tail", "_tail_runs", "head", "n_tail")

    def __init__(
        self,
        head: np.ndarray,
        n_tail: int,
        fill_tail: Callable[[np.ndarray], None],
        tail_runs: Callable[[], np.ndarray] | None = None,
    ) -> None:
        self.head = head
        self.n_tail = int(n_tail)
        self._fill_tail = fill_tail
        self._tail_runs = tail_runs
        self._tail: np.ndarray | None = None
        self._runs: np.ndarray | None = None

    @property
    def runs(self) -> np.ndarray | None:
        """``tail_runs()``, int64 [2 * n_runs + 1] (computed at the first read, then kept), or None
        where the tail is not known as runs of the head."""
        if self._runs is None and self._tail_runs is not None:
            self._runs = self._tail_runs()
        return self._runs

    @classmethod
    def of(cls, head: np.ndarray, tail: np.ndarray) -> ChainedSlots:
        """The two parts as arrays (``head``: int32 [n_head], ``tail``: int32 [n_tail])."""
        out = cls(head, tail.size, lambda dst: np.copyto(dst, tail))
        out._tail = tail
        return out

    def __reduce__(self) -> tuple[Callable[..., ChainedSlots], tuple[np.ndarray, np.ndarray]]:
        return ChainedSlots.of, (self.head, self.tail)

    @property
    def size(self) -> int:
        """Entries of the whole list."""
        return int(self.head.size) + self.n_tail

    @property
    def tail(self) -> np.ndarray:
        """The tail, int32 [n_tail]: written at the first read into the reused host memory
        (:func:`fasttree.host_arrays.entry_array`), then kept."""
        if self._tail is None:
            tail = entry_array(self.n_tail)
            self._fill_tail(tail)
            self._tail = tail
        return self._tail

    def array(self) -> np.ndarray:
        """The list as one int32 array [size], in memory of its own from the reused host memory
        (:func:`fasttree.host_arrays.entry_array`: a slab no other live array uses)."""
        n_head = self.head.size
        out = entry_array(n_head + self.n_tail)
        out[:n_head] = self.head
        if self._tail is None:
            self._fill_tail(out[n_head:])
        else:
            out[n_head:] = self._tail
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self.array()
        return out if dtype is None else out.astype(dtype, copy=False)


class _SlotsField:
    """The ``kv_slots`` field of :class:`Groups`: set to an array or a :class:`ChainedSlots`, read
    as an array (a ``ChainedSlots`` is joined at the first read, which the groups then keep)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Groups | None, owner: type | None = None) -> np.ndarray:
        if obj is None:
            raise AttributeError(self._name)  # the dataclass field has no default
        value = obj.__dict__[self._name]
        if isinstance(value, ChainedSlots):
            value = value.array()
            obj.__dict__[self._name] = value
        return value

    def __set__(self, obj: Groups, value: np.ndarray | ChainedSlots) -> None:
        obj.__dict__[self._name] = value  # only the dataclass's __init__ sets it (frozen)


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
        followed by the concatenated slots of multi-node groups. The planner passes a
        :class:`ChainedSlots` (the two parts, not copied into one array): the field reads as
        the joined array, built at its first read from the tree's slots as they are then
        (:attr:`kv_slot_source` reads the parts without joining them).
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
    kv_slots: np.ndarray = _SlotsField()  # type: ignore[assignment]
    q_indptr: np.ndarray
    q_ids: np.ndarray
    identity_slots: int = 0

    @property
    def n_groups(self) -> int:
        return int(self.node.size)

    @property
    def n_queries(self) -> np.ndarray:
        return np.diff(self.q_indptr)

    @property
    def kv_slot_source(self) -> np.ndarray | ChainedSlots:
        """``kv_slots`` as the groups hold it: the array, or the :class:`ChainedSlots` not yet
        joined (a packed plan reads its head and runs)."""
        return self.__dict__["kv_slots"]
