"""Reused host memory for a plan's per-KV-entry arrays and the compiled loops' work memory.

A plan of a large tree holds three int32 arrays with one entry per KV entry it reads (the
groups' chained slots, the packed units' slots and their row masks): megabytes per plan. A
server plans the next step while the last plan is still alive, and the C allocator then hands
each new plan fresh pages (it returns freed top-of-heap memory to the OS), whose first touch
costs about as much as the planner's own work on such trees. :class:`EntryArrayPool` keeps the
memory: it owns a bounded set of slabs and hands out views of a slab no live array uses.

Whether a slab is in use is read from its reference count: every view of a slab, and every
view of those views, holds a reference to the slab (numpy points a view's ``base`` at the array
that owns the memory), so a slab referenced only by the pool is free. That count is exact on
CPython with the GIL; elsewhere (other interpreters, free-threaded builds) the pool allocates
every array afresh.

:func:`work_array` keeps one int64 array per thread for the compiled loops' work memory (what a
call reads and writes only while it runs): a fresh block of that size per call would be fresh
pages as well.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["EntryArrayPool", "entry_array", "work_array"]


def _refs(slabs: list[np.ndarray], i: int) -> int:
    """``sys.getrefcount`` of ``slabs[i]``, read the one way the pool reads it."""
    return sys.getrefcount(slabs[i])


def _free_refs() -> int:
    """What :func:`_refs` reports for an array only a list holds (the interpreter's own count
    of the call's temporaries included)."""
    probe = [np.empty(1, dtype=np.int32)]
    return _refs(probe, 0)


def _refcounts_exact() -> bool:
    """Whether reference counts say when a slab is free (CPython with the GIL)."""
    if sys.implementation.name != "cpython":
        return False
    gil = getattr(sys, "_is_gil_enabled", None)
    return gil is None or bool(gil())


def eighth_step_ceil(n: int) -> int:
    """``n`` (>= 0) rounded up to a step of one eighth of its power of two: ``n`` itself up to 16,
    above that ``m * 2**e`` with ``8 <= m < 16``, so at most one entry in eight is spare and sizes
    within one such step share one value (slab sizes here, launch grids in
    :func:`fasttree.launch_variants.grid_bucket`)."""
    n = max(int(n), 0)
    shift = max(n.bit_length() - 4, 0)
    return -(-n >> shift) << shift


class EntryArrayPool:
    """Bounded slabs of int32 host memory, handed out as views of a free slab.

    Parameters
    ----------
    max_slabs : int
        Slabs the pool keeps at most (in use or free). Past that, a request no free slab
        serves replaces the smallest free slab, or, when every slab is in use, gets memory of
        its own (not pooled).
    max_bytes : int
        Bytes the pool's slabs hold at most; a request that would exceed it gets memory of its
        own.
    min_entries : int
        Requests smaller than this get memory of their own (the allocator reuses small blocks
        well).
    """

    def __init__(self, max_slabs: int = 12, max_bytes: int = 1 << 28, min_entries: int = 1 << 12) -> None:
        self.max_slabs = int(max_slabs)
        self.max_bytes = int(max_bytes)
        self.min_entries = int(min_entries)
        self._slabs: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._exact = _refcounts_exact()
        self._free = _free_refs()

    def empty(self, n: int) -> np.ndarray:
        """An uninitialised int32 array of ``n`` entries (C-contiguous, on the host)."""
        n = int(n)
        if n < self.min_entries or not self._exact:
            return np.empty(n, dtype=np.int32)
        with self._lock:
            slabs, free = self._slabs, self._free
            fit = spare = -1  # the smallest free slab that fits, the smallest free one
            for i in range(len(slabs)):
                if _refs(slabs, i) != free:
                    continue
                size = slabs[i].size
                if size >= n and (fit < 0 or size < slabs[fit].size):
                    fit = i
                if spare < 0 or size < slabs[spare].size:
                    spare = i
            if fit >= 0:
                return slabs[fit][:n]
            size = eighth_step_ceil(n)  # plans of similar sizes reuse one slab
            if len(slabs) >= self.max_slabs:
                if spare < 0:
                    return np.empty(n, dtype=np.int32)
                slabs.pop(spare)
            if sum(s.nbytes for s in slabs) + 4 * size > self.max_bytes:
                return np.empty(n, dtype=np.int32)
            slab = np.empty(size, dtype=np.int32)
            slabs.append(slab)
            return slab[:n]

    def held_bytes(self) -> int:
        """Bytes of the pool's slabs, in use or free."""
        with self._lock:
            return sum(s.nbytes for s in self._slabs)


_POOL = EntryArrayPool()


def entry_array(n: int) -> np.ndarray:
    """An uninitialised int32 array of ``n`` entries from the process's :class:`EntryArrayPool`."""
    return _POOL.empty(n)


#: Entries of the largest per-thread work array kept (larger requests get memory of their own).
_MAX_WORK_ENTRIES = 1 << 23
_WORK = threading.local()


def work_array(n: int) -> np.ndarray:
    """Uninitialised int64 work memory of ``n`` entries, reused by this thread's next call.

    For a compiled loop's work arrays that no result refers to: the caller copies out what it
    keeps before it (or anything it calls) asks for work memory again.

    Returns
    -------
    ndarray, int64 [n]
        A view of this thread's work array (grown to :func:`eighth_step_ceil` of ``n``
        when it is smaller), or an array of its own above ``2**23`` entries.
    """
    n = int(n)
    if n > _MAX_WORK_ENTRIES:
        return np.empty(n, dtype=np.int64)
    buf = getattr(_WORK, "buf", None)
    if buf is None or buf.size < n:
        buf = _WORK.buf = np.empty(eighth_step_ceil(n), dtype=np.int64)
    return buf[:n]
