"""Packing small work units into masked units ("bins").

A unit of the small tile class often holds one query and a 16-32 token node: on a
GPU its program does a few microseconds of fixed work for 8-16 KB of KV, so deep
trees run thousands of latency-bound programs. Packing puts
neighbouring small units into one program: the bin's matrix rows are a block of up to
``capacity`` consecutive queries in DFS order, its KV is the members' KV back to back,
and every KV entry carries a bit mask of the bin rows that attend it. A bin has one
partial result per query instead of one per member, and the rows of an MHA small tile
(16) were padding anyway.

Blocks of consecutive ranks are fixed (``capacity`` ranks each: ``rank // capacity``) or, where
that pays, aligned: at most ``capacity`` ranks each, ending where no short unit's queries
continue, so a unit that fits one block is not cut across two (:func:`_aligned_blocks`,
:func:`_aligned_blocks_pay`).

Vocabulary as in :mod:`fasttree.plan_arrays`; *position* is a query's offset in its
bin's block of ranks, and bit ``p`` of an entry's mask means "the query at position
``p`` attends this entry".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .host_arrays import entry_array, work_array
from .native import address, planner_library
from .tree import arange_view, exclusive_sum, inverse_permutation, ragged_arange, stable_argsort

#: Bits of one KV entry's row mask (int32 on the device).
MAX_PACK_QUERIES = 32

_INT32_MAX = 0x7FFFFFFF

#: ``1 << p`` for every position ``p`` of a bin.
_POSITION_BITS = np.left_shift(np.int64(1), np.arange(MAX_PACK_QUERIES, dtype=np.int64))

#: Runs beyond the identity part of the slots that packing copies one by one (more: a gather).
_SLICE_COPIES = 32


@dataclass(frozen=True)
class PackedUnits:
    """Units after packing; bins come after the units left as they were.

    Attributes
    ----------
    kv_start, kv_len, pair_start, q_len : ndarray, int64 [n_units]
    pair_query : ndarray, int64 [n_pairs]
        Query of each pair; a bin's pairs are the positions ``0 .. q_len - 1`` of its block.
    pair_present : ndarray, bool [n_pairs]
        False for a bin position none of the bin's members serves (the query is there
        only to fill the row; the kernel writes nothing for it).
    kv_slots : ndarray, int32 [n_kv_entries]
        The input slots (or, when the units left alone read less than half of them,
        just their ranges) followed by the bins' concatenated slots.
    kv_row_mask : ndarray, int32 [n_kv_entries]
        -1 (every row) for the input entries, the attending positions for bin entries.
    is_bin : ndarray, bool [n_units]
        False for the ``n_kept`` units left alone, then True for the bins.
    n_packed : int
        Pieces of input units that went into bins.
    n_kept : int
        Input units left as they were (the first ``n_kept`` units).
    """

    kv_start: np.ndarray
    kv_len: np.ndarray
    pair_start: np.ndarray
    q_len: np.ndarray
    pair_query: np.ndarray
    pair_present: np.ndarray
    kv_slots: np.ndarray
    kv_row_mask: np.ndarray
    is_bin: np.ndarray
    n_packed: int
    n_kept: int


class _Pieces(NamedTuple):
    """Eligible units cut at block boundaries, sorted by lowest rank (so by block first)."""

    unit: np.ndarray  # int64: the unit each piece comes from
    lowest: np.ndarray  # int64: the piece's lowest DFS rank (its block: lowest // capacity, or the aligned block's)
    bits: np.ndarray  # int64: bit p = the query at position p of the block is the piece's
    cut: np.ndarray | None  # bool: the piece's unit became two or more pieces (None: no unit did)


class _Candidates(NamedTuple):
    """Every pair of the eligible units, in unit order (each unit's pairs in order)."""

    unit: np.ndarray  # int64: the pair's unit
    rank: np.ndarray  # int64: the DFS rank of the pair's query
    q_len: np.ndarray  # the pairs per eligible unit (``q_len[cand]``)


def _candidates(eligible, cand, q_len, pair_start, pair_query, query_rank, pairs_in_order: bool) -> _Candidates:
    """The eligible units' pairs (``cand``: the eligible units' indices), computed once for the
    fixed and the aligned blocks alike."""
    n_units = q_len.size
    c_len = q_len[cand]
    if pairs_in_order and cand.size == n_units:  # every pair is a candidate's
        c_unit = np.arange(n_units, dtype=np.int64).repeat(q_len)
        c_query = pair_query
    else:
        c_unit = cand.repeat(c_len)
        if pairs_in_order:
            c_query = pair_query[eligible.repeat(q_len)]
        else:
            c_query = pair_query[ragged_arange(pair_start[cand], c_len)]
    return _Candidates(c_unit, query_rank[c_query], c_len)


def _cut_into_pieces(cands: _Candidates, n_queries: int, capacity: int, blocks=None) -> _Pieces:
    c_unit, c_rank = cands.unit, cands.rank
    if blocks is None:
        c_block, c_pos = np.divmod(c_rank, capacity)
        n_blocks = n_queries // capacity + 1
    else:
        block_of_rank, start_of_rank = blocks
        c_block = block_of_rank[c_rank]
        c_pos = c_rank - start_of_rank[c_rank]
        n_blocks = int(block_of_rank[-1]) + 2
    # pieces: (unit, block) keys; the key orders pieces by unit, then block
    key = c_unit * n_blocks
    key += c_block
    if np.count_nonzero(key[1:] < key[:-1]):
        o = key.argsort(kind="stable")
        key, c_rank, c_pos = key[o], c_rank[o], c_pos[o]
    new_piece = np.empty(key.size, dtype=bool)
    new_piece[0] = True
    np.not_equal(key[1:], key[:-1], out=new_piece[1:])
    first = new_piece.nonzero()[0]
    unit = key[first] // n_blocks
    lowest = np.minimum.reduceat(c_rank, first)
    bits = np.bitwise_or.reduceat(np.left_shift(np.int64(1), c_pos), first)
    same = unit[1:] == unit[:-1]
    cut = None
    if np.count_nonzero(same):
        cut = np.zeros(unit.size, dtype=bool)
        cut[1:] = same
        cut[:-1] |= same
    # by lowest rank, ties in (unit, block) order: the same as by (block, lowest rank)
    order = stable_argsort(lowest, n_queries)
    return _Pieces(unit[order], lowest[order], bits[order], None if cut is None else cut[order])


def _aligned_blocks(cands: _Candidates, n_queries: int, capacity: int):
    """Blocks of at most ``capacity`` consecutive ranks that cut as few short units as they can.

    A unit is short when its queries span at most ``capacity`` ranks: a block boundary inside
    that span is avoidable, and would make the unit two pieces (its KV read twice, its queries
    each one partial more). Walking the ranks, each block ends at the farthest rank within
    ``capacity`` where no short unit continues, or after ``capacity`` ranks when there is none.

    Returns
    -------
    (block_of_rank, start_of_rank) : (ndarray, ndarray) or None
        Each rank's block and its block's first rank (int64 [n_queries] each); None when the
        blocks are the fixed ones (``rank // capacity``).
    """
    n = n_queries
    first = exclusive_sum(cands.q_len)
    lo = np.minimum.reduceat(cands.rank, first)
    hi = np.maximum.reduceat(cands.rank, first)
    short = (hi - lo < capacity) & (hi > lo)
    if not np.count_nonzero(short & (lo // capacity != hi // capacity)):
        return None  # the fixed blocks cut no short unit: keep them
    # inside[c]: a boundary before rank c splits some short unit (lo < c <= hi)
    inside = np.bincount(lo[short] + 1, minlength=n + 2) - np.bincount(hi[short] + 1, minlength=n + 2)
    free = (np.cumsum(inside[: n + 1]) == 0).nonzero()[0]  # boundaries that split nothing (0 and n too)
    # farthest free boundary within reach of every start
    reach = np.minimum(np.arange(n + 1) + capacity, n)
    far = free[np.searchsorted(free, reach, side="right") - 1]
    nxt = np.where(far > np.arange(n + 1), far, reach).tolist()
    block_starts = []
    s = 0
    while s < n:
        block_starts.append(s)
        s = nxt[s]
    block_starts = np.asarray(block_starts, dtype=np.int64)
    if block_starts.size == -(-n // capacity) and not np.count_nonzero(block_starts % capacity):
        return None  # increasing starts, at most capacity apart, all multiples of it: the fixed blocks
    block_of_rank = np.zeros(n, dtype=np.int64)
    block_of_rank[block_starts[1:]] = 1
    np.cumsum(block_of_rank, out=block_of_rank)
    return block_of_rank, block_starts[block_of_rank]


def _run_starts(block: np.ndarray, tokens: np.ndarray, budget: int, balanced: bool = False) -> np.ndarray:
    """Whether each piece starts a run (bin): runs never cross a block. Within a block (by the
    exclusive sum of tokens there) a run closes once it holds ``budget`` or more tokens, or with
    ``balanced`` a block of ``T`` tokens is cut into ``max(1, round(T / budget))`` runs of about
    ``T / n`` tokens each (so no short last run)."""
    new_run = np.empty(block.size, dtype=bool)
    new_run[0] = True
    np.not_equal(block[1:], block[:-1], out=new_run[1:])
    excl = np.add.accumulate(tokens)
    excl -= tokens
    # tokens before the piece's block: excl never decreases, so the last block start's excl
    excl -= np.maximum.accumulate(excl * new_run)
    if balanced:
        starts = new_run.nonzero()[0]
        total = np.add.reduceat(tokens, starts)
        n_runs = np.maximum(1, (2 * total + budget) // (2 * budget))  # round half up
        block_of = np.cumsum(new_run) - 1  # every piece's block, 0 .. len(starts) - 1
        excl *= n_runs[block_of]
        excl //= np.maximum(total, 1)[block_of]  # a block of no tokens: excl is 0 there
    else:
        excl //= budget
    new_run[1:] |= excl[1:] != excl[:-1]
    return new_run


class _Bins(NamedTuple):
    """The pieces that go into bins, in bin order (``new_bin`` marks each bin's first)."""

    unit: np.ndarray
    lowest: np.ndarray
    bits: np.ndarray
    new_bin: np.ndarray
    tokens: np.ndarray


def _bin_members(
    cands: _Candidates, n_queries: int, capacity: int, kv_len, budget: int, balanced: bool, blocks,
    native: bool = True,
) -> tuple[_Bins | None, bool]:  # fmt: skip
    """Cut the eligible units into pieces (``blocks``: None for fixed blocks of ``capacity`` ranks,
    else :func:`_aligned_blocks`' arrays) and the pieces into runs; the pieces of runs that become
    bins (None when no bin forms), and whether some unit became two pieces or more. ``native``:
    in the compiled loop (``ft_bin_members``, the same arrays) when it is available."""
    lib = planner_library() if native and cands.unit.size else None
    if lib is not None:
        found = _bin_members_native(lib, cands, n_queries, capacity, kv_len, budget, balanced, blocks)
        if found is not None:
            return found
    unit, lowest, bits, cut = _cut_into_pieces(cands, n_queries, capacity, blocks)
    tokens = kv_len[unit].astype(np.int64, copy=False)
    new_run = _run_starts(lowest // capacity if blocks is None else blocks[0][lowest], tokens, budget, balanced)
    # a piece alone in its run stays a plain unit unless its unit was cut
    lone = np.empty(new_run.size, dtype=bool)
    lone[-1] = True
    lone[:-1] = new_run[1:]
    lone &= new_run
    if cut is not None:
        lone &= ~cut
    n_lone = int(np.count_nonzero(lone))
    if n_lone == lone.size:
        return None, cut is not None
    if n_lone:
        member = ~lone
        unit, lowest, bits = unit[member], lowest[member], bits[member]
        new_run, tokens = new_run[member], tokens[member]
    return _Bins(unit, lowest, bits, new_run, tokens), cut is not None


def _bin_members_native(
    lib, cands: _Candidates, n_queries: int, capacity: int, kv_len, budget: int, balanced: bool, blocks
) -> tuple[_Bins | None, bool] | None:
    """:func:`_bin_members` by ``ft_bin_members``."""
    n = cands.unit.size
    c_unit = np.ascontiguousarray(cands.unit, dtype=np.int64)
    c_rank = np.ascontiguousarray(cands.rank, dtype=np.int64)
    lens = np.ascontiguousarray(kv_len, dtype=np.int64)
    if blocks is None:
        block_ptr = start_ptr = None
    else:
        block_of_rank = np.ascontiguousarray(blocks[0], dtype=np.int64)
        start_of_rank = np.ascontiguousarray(blocks[1], dtype=np.int64)
        block_ptr, start_ptr = address(block_of_rank), address(start_of_rank)
    out = np.empty((4, n), dtype=np.int64)  # unit, lowest, bits, tokens
    new_run = np.empty(n, dtype=np.int8)
    some_cut = np.zeros(1, dtype=np.int64)
    count = lib.ft_bin_members(
        n, address(c_unit), address(c_rank), n_queries, lens.size, capacity, block_ptr, start_ptr,
        address(lens), budget, int(balanced), address(out[0]), address(out[1]), address(out[2]),
        address(new_run), address(out[3]), address(some_cut), address(work_array(_members_scratch(n, lens.size,
        n_queries))),
    )  # fmt: skip
    cut = bool(some_cut[0])
    if count == 0:
        return None, cut
    return _Bins(out[0, :count], out[1, :count], out[2, :count], new_run[:count].view(bool), out[3, :count]), cut


def _members_scratch(n_pairs: int, n_units: int, n_queries: int) -> int:
    """int64 entries of ``ft_bin_members``' scratch (``BIN_MEMBERS_SCRATCH`` of ``planner.c``)."""
    return 9 * n_pairs + 2 * max(n_units, n_queries + 1) + 1


def _reads_and_longest(kv_len: np.ndarray, bins: _Bins | None) -> tuple[int, int]:
    """KV tokens read and the longest unit's tokens once ``bins`` are formed (None: no bins)."""
    if bins is None:
        return int(np.add.reduce(kv_len, dtype=np.int64)), int(kv_len.max())
    kept = np.ones(kv_len.size, dtype=bool)
    kept[bins.unit] = False
    kept_len = kv_len[kept]
    bin_len = np.add.reduceat(bins.tokens, bins.new_bin.nonzero()[0])
    reads = int(np.add.reduce(kept_len, dtype=np.int64)) + int(np.add.reduce(bin_len))
    return reads, max(int(kept_len.max(initial=0)), int(bin_len.max()))


def _aligned_blocks_pay(kv_len: np.ndarray, fixed: _Bins | None, aligned: _Bins | None, max_longer: float) -> bool:
    """Whether the bins of aligned blocks replace those of fixed ones: they read no more KV and
    their longest unit is at most ``max_longer`` times the fixed bins' (a plan that fills one
    wave runs as long as its longest unit)."""
    reads_f, longest_f = _reads_and_longest(kv_len, fixed)
    reads_a, longest_a = _reads_and_longest(kv_len, aligned)
    return reads_a <= reads_f and longest_a <= max_longer * longest_f


def pack_units(
    *,
    kv_start: np.ndarray,
    kv_len: np.ndarray,
    pair_start: np.ndarray,
    q_len: np.ndarray,
    pair_query: np.ndarray,
    kv_slots: np.ndarray,
    eligible: np.ndarray,
    query_rank: np.ndarray,
    capacity: int,
    budget: int,
    query_of_rank: np.ndarray | None = None,
    pairs_in_order: bool = False,
    identity_slots: int = 0,
    balanced: bool = False,
    aligned: bool | None = False,
    max_longer: float = 1.1,
) -> PackedUnits | None:
    """Pack eligible units into bins of at most ``capacity`` queries and about ``budget`` tokens.

    The queries of every eligible unit are cut at the boundaries of blocks of
    ``capacity`` consecutive DFS ranks (a unit across k blocks becomes k pieces, each
    reading the unit's KV). Pieces are sorted by (block, lowest rank) and cut, within a
    block, into runs of about ``budget`` KV tokens (a run closes once it holds
    ``budget`` or more; with ``balanced``, a block of ``T`` tokens becomes
    ``max(1, round(T / budget))`` runs of about equal tokens); a run of two or more
    pieces, or one holding a piece of a cut unit, becomes a bin. Other units are left as they were. A bin's rows are the
    positions from its lowest to its highest served query, so its row count
    (``q_len``) says which tile class can hold it.

    Parameters
    ----------
    kv_start, kv_len, pair_start, q_len : ndarray, int [n_units]
        The units: KV ``kv_slots[kv_start:kv_start + kv_len]``, pairs
        ``pair_start:pair_start + q_len``.
    pair_query : ndarray, int [n_pairs]
    kv_slots : ndarray, int32
    eligible : ndarray, bool [n_units]
        Units that may be packed (short KV).
    query_rank : ndarray, int64 [n_queries]
        DFS rank of every query (a permutation of ``0 .. n_queries - 1``).
    capacity : int
        Queries per bin, 1 .. :data:`MAX_PACK_QUERIES`.
    budget : int
        KV tokens per bin (>= 1).
    query_of_rank : ndarray, int64 [n_queries], optional
        The inverse permutation of ``query_rank`` (the query at each rank), when the
        caller has it; computed otherwise.
    pairs_in_order : bool
        The units' pairs are ``0 .. n_pairs - 1`` in unit order (``pair_start`` is the
        exclusive sum of ``q_len``), which saves gathering them; the result is the same.
    identity_slots : int
        ``kv_slots[:identity_slots]`` is ``arange(identity_slots)``: the bins' KV read there
        is computed instead of gathered; the result is the same.
    balanced : bool
        Cut each block into runs of about equal tokens instead of filling runs up to the
        budget, which can leave a short last run (a lone piece there stays a plain unit).
    aligned : bool or None
        The blocks: False, fixed blocks of ``capacity`` ranks (``rank // capacity``); True,
        blocks of at most ``capacity`` ranks that end where no short unit's queries continue
        (:func:`_aligned_blocks`), so fewer units are cut; None, the aligned blocks where their
        bins read no more KV and leave no unit longer than ``max_longer`` times the fixed
        blocks' longest (:func:`_aligned_blocks_pay`), else the fixed ones.
    max_longer : float
        See ``aligned=None``.

    Returns
    -------
    PackedUnits or None
        None when no bin forms.
    """
    layout = bin_layout(
        kv_len=kv_len, pair_start=pair_start, q_len=q_len, pair_query=pair_query, eligible=eligible,
        query_rank=query_rank, capacity=capacity, budget=budget, pairs_in_order=pairs_in_order,
        balanced=balanced, aligned=aligned, max_longer=max_longer,
    )  # fmt: skip
    if layout is None:
        return None
    return assemble_bins(
        layout, kv_start=kv_start, kv_len=kv_len, pair_start=pair_start, q_len=q_len, pair_query=pair_query,
        kv_slots=kv_slots, query_rank=query_rank, query_of_rank=query_of_rank, pairs_in_order=pairs_in_order,
        identity_slots=identity_slots,
    )  # fmt: skip


class BinLayout(NamedTuple):
    """The bins :func:`bin_layout` chose, before their arrays are built (:func:`assemble_bins`).

    Attributes
    ----------
    bins : _Bins
        The pieces that go into bins, in bin order.
    capacity : int
        Queries per bin.
    start_of_rank : ndarray, int64 [n_queries] or None
        Each rank's block's first rank (aligned blocks), or None for the fixed blocks
        (``rank - rank % capacity``).
    """

    bins: _Bins
    capacity: int
    start_of_rank: np.ndarray | None


def bin_layout(
    *,
    kv_len: np.ndarray,
    pair_start: np.ndarray,
    q_len: np.ndarray,
    pair_query: np.ndarray,
    eligible: np.ndarray,
    query_rank: np.ndarray,
    capacity: int,
    budget: int,
    pairs_in_order: bool = False,
    balanced: bool = False,
    aligned: bool | None = False,
    max_longer: float = 1.1,
    native: bool = True,
) -> BinLayout | None:
    """Which pieces of the eligible units go into which bins, before any per-entry array is built.

    The first step of :func:`pack_units` (which is this and :func:`assemble_bins`): the units are
    cut into pieces at block boundaries and the pieces into runs as that function describes.

    Parameters
    ----------
    kv_len, pair_start, q_len : ndarray, int [n_units]
    pair_query : ndarray, int [n_pairs]
    eligible : ndarray, bool [n_units]
    query_rank : ndarray, int64 [n_queries]
    capacity, budget : int
    pairs_in_order, balanced : bool
    aligned : bool or None
    max_longer : float
        As :func:`pack_units` takes them.
    native : bool
        With ``pairs_in_order``: the whole layout in one compiled call (``ft_bin_layout``) when it
        is available, with the same bins.

    Returns
    -------
    BinLayout or None
        None when no bin forms.
    """
    if not 1 <= capacity <= MAX_PACK_QUERIES:
        raise ValueError(f"capacity must be in [1, {MAX_PACK_QUERIES}], got {capacity}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    lib = planner_library() if native and pairs_in_order else None
    if lib is not None:
        found = _bin_layout_native(
            lib, kv_len, q_len, pair_query, eligible, query_rank, capacity, budget, balanced, aligned, max_longer
        )
        if found is not False:
            return found
    cand = eligible.nonzero()[0]
    if cand.size < 2:
        return None
    cands = _candidates(eligible, cand, q_len, pair_start, pair_query, query_rank, pairs_in_order)
    n_queries = query_rank.size
    blocks = None
    bins, some_cut = _bin_members(cands, n_queries, capacity, kv_len, budget, balanced, blocks)
    # aligned blocks only differ where the fixed ones cut a unit
    if aligned is not False and some_cut:
        shifted = _aligned_blocks(cands, n_queries, capacity)
        if shifted is not None:
            other, _ = _bin_members(cands, n_queries, capacity, kv_len, budget, balanced, shifted)
            if aligned or _aligned_blocks_pay(kv_len, bins, other, max_longer):
                bins, blocks = other, shifted
    if bins is None:
        return None
    return BinLayout(bins, capacity, None if blocks is None else blocks[1])


def _bin_layout_native(
    lib, kv_len, q_len, pair_query, eligible, query_rank, capacity: int, budget: int, balanced: bool, aligned,
    max_longer: float,
) -> BinLayout | bool | None:  # fmt: skip
    """:func:`bin_layout` (pairs in unit order) by ``ft_bin_layout``; False when the compiled call
    could not (out of memory, or input the numpy path handles: then it runs)."""
    i64 = np.int64
    ql, kv, pq, ranks = (np.ascontiguousarray(a, dtype=i64) for a in (q_len, kv_len, pair_query, query_rank))
    elig = np.ascontiguousarray(eligible, dtype=bool).view(np.int8)
    n_units, n_pairs, n_queries = ql.size, pq.size, ranks.size
    if kv.size != n_units or elig.size != n_units or n_queries < 1:
        return False
    # ft_bin_layout's int64 and int8 work arrays, laid out as it documents, in this thread's work
    # memory (the chosen bins are copied out)
    at = 3 * n_pairs + 2 * n_queries + 8 * n_pairs  # res
    n64 = at + 2 + _members_scratch(n_pairs, n_units, n_queries)
    work = work_array(n64 + (2 * n_pairs + n_units + 7) // 8)
    w = address(work)
    mode = 0 if aligned is False else (1 if aligned else 2)
    status = lib.ft_bin_layout(
        n_units, address(ql), address(kv), n_pairs, address(pq), address(elig), n_queries, address(ranks),
        capacity, budget, int(balanced), mode, float(max_longer), w, w + 8 * n64,
    )  # fmt: skip
    if status:
        return False
    count, which = work[at : at + 2].tolist()
    if not count:
        return None
    sor = 3 * n_pairs + n_queries
    o = work[sor + n_queries + 4 * n_pairs * which :][: 4 * n_pairs].reshape(4, n_pairs)[:, :count].copy()
    flags = work[n64:].view(np.int8)[which * n_pairs :][:count].view(bool).copy()
    bins = _Bins(o[0], o[1], o[2], flags, o[3])
    return BinLayout(bins, capacity, work[sor : sor + n_queries].copy() if which else None)


def layout_reads_and_served(
    layout: BinLayout, kv_len: np.ndarray, q_len: np.ndarray, pair_query: np.ndarray, query_of_rank: np.ndarray
) -> tuple[int, np.ndarray]:
    """What the units read and serve once ``layout``'s bins are formed, without building them.

    Parameters
    ----------
    layout : BinLayout
    kv_len, q_len : ndarray, int [n_units]
        The units :func:`bin_layout` was given.
    pair_query : ndarray, int [n_pairs]
        The units' pairs' queries in unit order (``pairs_in_order``).
    query_of_rank : ndarray, int64 [n_queries]

    Returns
    -------
    reads : int
        KV tokens read: the sum of :func:`assemble_bins`' ``kv_len``.
    served : ndarray, int64 [n_present_pairs]
        The query of every pair that serves one: :func:`assemble_bins`' ``pair_query[pair_present]``,
        in another order (the units left alone's pairs, then each bin's served positions).
    """
    bins, capacity = layout.bins, layout.capacity
    keep = np.ones(kv_len.size, dtype=bool)
    keep[bins.unit] = False
    reads = int(np.add.reduce(kv_len[keep], dtype=np.int64)) + int(np.add.reduce(bins.tokens))
    first = bins.new_bin.nonzero()[0]
    b_bits = np.bitwise_or.reduceat(bins.bits, first)  # positions in the bin's block
    b_lowest = bins.lowest[first]
    if layout.start_of_rank is None:
        block_start = b_lowest - b_lowest % capacity
    else:
        block_start = layout.start_of_rank[b_lowest]
    served = np.bitwise_and(b_bits[:, None], _POSITION_BITS[:capacity]) != 0
    b_query = query_of_rank[(block_start[:, None] + arange_view(capacity))[served]]
    return reads, np.concatenate([pair_query[keep.repeat(q_len)], b_query])


def layout_reads_and_rows(
    layout: BinLayout | None,
    kv_len: np.ndarray,
    q_len: np.ndarray,
    pair_query: np.ndarray,
    query_of_rank: np.ndarray,
    native: bool = True,
) -> tuple[int, int]:
    """The KV tokens the units read and the partial rows they write once ``layout``'s bins are
    formed (None: the units as they are): :func:`layout_reads_and_served`'s reads, and the served
    pairs of every query served two times or more. ``native``: in one compiled loop
    (``ft_layout_cost``) when it is available, with the same two numbers."""
    n_queries = query_of_rank.size
    lib = planner_library() if native and layout is not None else None
    if lib is not None:
        bins = layout.bins
        named = (kv_len, q_len, pair_query, bins.unit, bins.lowest, bins.bits, bins.tokens, query_of_rank)
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in named]
        new_bin = np.ascontiguousarray(bins.new_bin, dtype=bool).view(np.int8)
        sor = None if layout.start_of_rank is None else np.ascontiguousarray(layout.start_of_rank, dtype=np.int64)
        if (sor is not None and sor.size != n_queries) or any(a.size != new_bin.size for a in arrays[3:7]):
            raise ValueError("the layout's arrays differ in length")
        kv, ql, pq, unit, lowest, bits, tokens, of_rank = arrays
        keep = np.empty(kv.size, dtype=np.int8)
        n_part = np.empty(n_queries, dtype=np.int64)
        out = np.empty(2, dtype=np.int64)
        if lib.ft_layout_cost(
            kv.size, address(kv), address(ql), pq.size, address(pq), unit.size, address(unit), address(lowest),
            address(bits), address(new_bin), address(tokens), n_queries, address(of_rank), layout.capacity,
            None if sor is None else address(sor), address(keep), address(n_part), address(out),
        ):  # fmt: skip
            raise ValueError("a layout's unit, rank or pair is out of range")
        return int(out[0]), int(out[1])
    if layout is None:
        reads, served = int(np.add.reduce(kv_len, dtype=np.int64)), pair_query
    else:
        reads, served = layout_reads_and_served(layout, kv_len, q_len, pair_query, query_of_rank)
    n_part = np.bincount(served, minlength=n_queries)
    return reads, int(np.add.reduce(n_part[n_part >= 2]))


def _bin_heads(lowest, bits, new_bin, tokens, capacity: int, start_of_rank):
    """Per bin (its pieces in bin order, ``new_bin`` marking each first one): the first piece's
    index, the bin's KV tokens, its first rank, its served positions' bits shifted down to row 0
    (a bin's rows start at its lowest position) and its rows (the highest set bit's index + 1)."""
    first = new_bin.nonzero()[0]
    b_bits = np.bitwise_or.reduceat(bits, first)
    b_tokens = np.add.reduceat(tokens, first)
    b_first_rank = lowest[first]
    b_base = b_first_rank % capacity if start_of_rank is None else b_first_rank - start_of_rank[b_first_rank]
    np.right_shift(b_bits, b_base, out=b_bits)
    b_qlen = np.frexp(b_bits)[1].astype(np.int64)  # b_bits < 2**32
    return first, b_tokens, b_first_rank, b_bits, b_qlen


def bin_rows(layout: BinLayout) -> tuple[np.ndarray, np.ndarray]:
    """Each bin's KV tokens and query rows, as :func:`assemble_bins` builds them from ``layout``
    (int64 [n_bins] each), without building its arrays."""
    _, lowest, bits, new_bin, tokens = layout.bins
    _, b_tokens, _, _, b_qlen = _bin_heads(lowest, bits, new_bin, tokens, layout.capacity, layout.start_of_rank)
    return b_tokens, b_qlen


def assemble_bins(
    layout: BinLayout,
    *,
    kv_start: np.ndarray,
    kv_len: np.ndarray,
    pair_start: np.ndarray,
    q_len: np.ndarray,
    pair_query: np.ndarray,
    kv_slots: np.ndarray,
    query_rank: np.ndarray,
    query_of_rank: np.ndarray | None = None,
    pairs_in_order: bool = False,
    identity_slots: int = 0,
    native: bool = True,
) -> PackedUnits:
    """The packed units of ``layout``: the second step of :func:`pack_units`.

    Parameters
    ----------
    layout : BinLayout
        From :func:`bin_layout` of the same units.
    kv_start, kv_len, pair_start, q_len : ndarray, int [n_units]
    pair_query : ndarray, int [n_pairs]
    kv_slots : ndarray, int32
    query_rank : ndarray, int64 [n_queries]
    query_of_rank : ndarray, int64 [n_queries], optional
    pairs_in_order : bool
    identity_slots : int
        As :func:`pack_units` takes them.
    native : bool
        Built in the compiled loops when they are available (:func:`_assemble`), with the same
        arrays.

    Returns
    -------
    PackedUnits
    """
    unit, lowest, bits, new_run, tokens = layout.bins
    if query_of_rank is None:
        query_of_rank = inverse_permutation(query_rank)
    return _assemble(
        kv_start, kv_len, pair_start, q_len, pair_query, kv_slots, query_of_rank, layout.capacity, pairs_in_order,
        identity_slots, layout.start_of_rank, unit=unit, lowest=lowest, bits=bits, new_bin=new_run, tokens=tokens,
        native=native,
    )  # fmt: skip


def _assemble(
    kv_start,
    kv_len,
    pair_start,
    q_len,
    pair_query,
    kv_slots,
    query_of_rank,
    capacity: int,
    pairs_in_order: bool,
    identity_slots: int,
    start_of_rank,
    *,
    unit,
    lowest,
    bits,
    new_bin,
    tokens,
    native: bool = True,
) -> PackedUnits:
    """The packed units from the bins' member pieces (in bin order; ``new_bin`` marks each
    bin's first piece, the one of its lowest rank). ``native``: built in the compiled loops
    (``ft_assemble_sizes``, ``ft_assemble_fill``) when they are available and the slots are
    int32, with the same arrays."""
    lib = planner_library() if native and kv_slots.dtype == np.int32 else None
    if lib is not None:
        return _assemble_native(
            lib, kv_start, kv_len, pair_start, q_len, pair_query, kv_slots, query_of_rank, capacity, start_of_rank,
            unit, lowest, bits, new_bin, tokens,
        )  # fmt: skip
    first, b_tokens, b_first_rank, b_bits, b_qlen = _bin_heads(lowest, bits, new_bin, tokens, capacity, start_of_rank)
    n_bins = first.size
    # every piece's bin start: the last bin start's lowest rank (ranks never decrease)
    piece_first = np.maximum.accumulate(lowest * new_bin)
    if start_of_rank is None:
        piece_first %= capacity
    else:
        piece_first -= start_of_rank[piece_first]
    bits = np.right_shift(bits, piece_first)
    b_total = int(np.add.reduce(b_tokens))

    # units left alone keep their KV; when they use less than half of the input slots,
    # their ranges are copied out so that the unused rest is not shipped to the device
    n_units = kv_len.size
    keep = np.empty(n_units, dtype=bool)
    keep.fill(True)
    keep[unit] = False
    k_idx = keep.nonzero()[0]
    n_kept = k_idx.size
    k_tokens = kv_len[k_idx].astype(np.int64, copy=False)
    k_total = int(np.add.reduce(k_tokens))
    u_kv_len = np.concatenate([k_tokens, b_tokens])
    if 2 * k_total < kv_slots.size:
        n_old = k_total
        slots = _entry_slots(n_old + b_total, kv_slots.dtype)
        runs = np.concatenate([kv_start[k_idx], kv_start[unit]]) if n_kept else kv_start[unit]
        run_len = np.concatenate([k_tokens, tokens]) if n_kept else tokens
        _gather_runs(kv_slots, runs, run_len, slots, identity_slots)
        u_kv_start = exclusive_sum(u_kv_len)
    else:
        n_old = kv_slots.size
        slots = _entry_slots(n_old + b_total, kv_slots.dtype)
        slots[:n_old] = kv_slots
        _gather_runs(kv_slots, kv_start[unit], tokens, slots[n_old:], identity_slots)
        u_kv_start = np.empty(n_kept + n_bins, dtype=np.int64)
        u_kv_start[:n_kept] = kv_start[k_idx]
        np.add(exclusive_sum(b_tokens), n_old, out=u_kv_start[n_kept:])
    mask = _row_mask(n_old, bits, tokens, b_total)

    # pairs: units left alone keep theirs, compacted; then every bin's positions
    k_len = q_len[k_idx]
    if pairs_in_order:
        k_query = pair_query[keep.repeat(q_len)]
    else:
        k_query = pair_query[ragged_arange(pair_start[k_idx], k_len)]
    pos = arange_view(capacity)
    rows = pos < b_qlen[:, None]  # [bin, position]: the bin's rows
    b_query = query_of_rank[(b_first_rank[:, None] + pos)[rows]]
    b_present = (np.bitwise_and(b_bits[:, None], _POSITION_BITS[:capacity]) != 0)[rows]
    n_k_pairs = k_query.size
    u_q_len = np.concatenate([k_len, b_qlen]).astype(np.int64, copy=False)
    pair_present = np.empty(n_k_pairs + b_query.size, dtype=bool)
    pair_present[:n_k_pairs] = True
    pair_present[n_k_pairs:] = b_present
    is_bin = np.zeros(n_kept + n_bins, dtype=bool)
    is_bin[n_kept:] = True

    return PackedUnits(
        kv_start=u_kv_start,
        kv_len=u_kv_len,
        pair_start=exclusive_sum(u_q_len),
        q_len=u_q_len,
        pair_query=np.concatenate([k_query, b_query]).astype(np.int64, copy=False),
        pair_present=pair_present,
        kv_slots=slots,
        kv_row_mask=mask,
        is_bin=is_bin,
        n_packed=int(unit.size),
        n_kept=int(n_kept),
    )


def _assemble_native(
    lib, kv_start, kv_len, pair_start, q_len, pair_query, kv_slots, query_of_rank, capacity: int, start_of_rank,
    unit, lowest, bits, new_bin, tokens,
) -> PackedUnits:  # fmt: skip
    """:func:`_assemble` by the compiled loops: sizes (every index checked), then the arrays (the
    unit arrays and pair queries views of one int64 buffer, the pair and unit flags of one bool one)."""
    i64, i8 = np.int64, np.int8
    kv_start, kv_len, pair_start, q_len, pair_query, query_of_rank, unit, lowest, bits, tokens = (
        np.ascontiguousarray(a, dtype=i64)
        for a in (kv_start, kv_len, pair_start, q_len, pair_query, query_of_rank, unit, lowest, bits, tokens)
    )  # fmt: skip
    new_bin = np.ascontiguousarray(new_bin, dtype=bool).view(i8)
    slots_in = np.ascontiguousarray(kv_slots)
    n_units, n_pieces, n_queries = kv_len.size, unit.size, query_of_rank.size
    sor = None if start_of_rank is None else np.ascontiguousarray(start_of_rank, dtype=i64)
    if (
        kv_start.size != n_units or pair_start.size != n_units or q_len.size != n_units
        or lowest.size != n_pieces or bits.size != n_pieces or new_bin.size != n_pieces or tokens.size != n_pieces
        or (sor is not None and sor.size != n_queries)
    ):  # fmt: skip
        raise ValueError("the units' or the pieces' arrays differ in length")
    scratch = np.empty(6 + (n_units + 7) // 8, dtype=i64)  # the sizes, then keep (int8 [n_units])
    sizes_at = address(scratch)
    keep_at = sizes_at + 48
    sor_ptr = None if sor is None else address(sor)
    a_start, a_len, a_q_len, a_slots = address(kv_start), address(kv_len), address(q_len), address(slots_in)
    pieces = (address(unit), address(lowest), address(bits), address(new_bin), address(tokens))
    if lib.ft_assemble_sizes(
        n_units, a_start, a_len, a_q_len, slots_in.size, n_queries, capacity, sor_ptr, n_pieces, *pieces, keep_at,
        sizes_at,
    ):  # fmt: skip
        raise ValueError("a packed piece's unit, rank, KV run or row shift is out of range")
    n_bins, n_kept, k_total, b_total, k_pairs, b_pairs = scratch[:6].tolist()
    copy_kept = 2 * k_total < slots_in.size
    n_old = k_total if copy_kept else slots_in.size
    n_out, n_pairs_out = n_kept + n_bins, k_pairs + b_pairs
    out = np.empty(4 * n_out + n_pairs_out, dtype=i64)  # kv_start, kv_len, pair_start, q_len, pair_query
    flags = np.empty(n_pairs_out + n_out, dtype=bool)  # pair_present, is_bin
    o_slots = entry_array(n_old + b_total)
    o_mask = entry_array(n_old + b_total)
    o, f = address(out), address(flags)
    if lib.ft_assemble_fill(
        n_units, a_start, a_len, address(pair_start), a_q_len, pair_query.size, address(pair_query), slots_in.size,
        a_slots, slots_in.size, 0, None, None, n_queries, address(query_of_rank), capacity, sor_ptr, n_pieces, *pieces,
        keep_at, int(copy_kept), n_old, o, o + 8 * n_out, o + 16 * n_out, o + 24 * n_out, o + 32 * n_out, f,
        address(o_slots), address(o_mask), f + n_pairs_out,
    ):  # fmt: skip
        raise ValueError("a kept unit's KV run or pairs, or a bin's ranks, are out of range")
    return PackedUnits(
        kv_start=out[:n_out], kv_len=out[n_out : 2 * n_out], pair_start=out[2 * n_out : 3 * n_out],
        q_len=out[3 * n_out : 4 * n_out], pair_query=out[4 * n_out :], pair_present=flags[:n_pairs_out],
        kv_slots=o_slots, kv_row_mask=o_mask, is_bin=flags[n_pairs_out:], n_packed=n_pieces, n_kept=n_kept,
    )  # fmt: skip


def _entry_slots(n: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised slot array of ``n`` entries: int32 ones from the reused host memory
    (:func:`fasttree.host_arrays.entry_array`)."""
    return entry_array(n) if dtype == np.int32 else np.empty(n, dtype=dtype)


def _row_mask(n_old: int, bits: np.ndarray, tokens: np.ndarray, b_total: int, native: bool = True) -> np.ndarray:
    """The packed units' KV row masks, int32 [n_old + b_total]: -1 for the ``n_old`` entries kept,
    then each piece's ``bits`` (int64, below 2**32) for its ``tokens``; positions >= 31 set the sign
    bit of the int32 mask. ``native``: filled in the compiled loop (``ft_fill_mask``) when it is
    available, else in one numpy repeat (no temporary of the entries' size)."""
    lib = planner_library() if native else None
    if lib is not None:
        b = np.ascontiguousarray(bits, dtype=np.int64)
        t = np.ascontiguousarray(tokens, dtype=np.int64)
        if int(np.add.reduce(t)) != b_total or (t.size and int(t.min()) < 0):
            raise ValueError("piece tokens do not add up to the bins' entries")
        mask = entry_array(n_old + b_total)
        lib.ft_fill_mask(n_old, b.size, address(b), address(t), address(mask))
        return mask
    mask_value = np.empty(bits.size + 1, dtype=np.int32)
    mask_value[0] = -1
    mask_value[1:] = bits.astype(np.uint32).view(np.int32)
    mask_count = np.empty(bits.size + 1, dtype=np.int64)
    mask_count[0] = n_old
    mask_count[1:] = tokens
    return mask_value.repeat(mask_count)


def _gather_runs(
    kv_slots: np.ndarray, start: np.ndarray, length: np.ndarray, out: np.ndarray, identity: int, native: bool = True
) -> None:
    """``out[:] = concatenation of kv_slots[start[i]:start[i] + length[i]]`` (``out`` int32).

    ``native``: copied in the compiled loop (``ft_gather_runs``) when it is available. Else:
    entries below ``identity`` equal their position (``kv_slots[:identity]`` is an arange):
    when at most :data:`_SLICE_COPIES` runs reach beyond it, runs are written as aranges and
    those few copied as slices; otherwise every entry is gathered.
    """
    total = out.size
    lib = planner_library() if native and out.dtype == np.int32 and kv_slots.dtype == np.int32 else None
    if lib is not None and out.flags.c_contiguous:
        src = np.ascontiguousarray(kv_slots)
        st = np.ascontiguousarray(start, dtype=np.int64)
        ln = np.ascontiguousarray(length, dtype=np.int64)
        # the compiled copy checks nothing: the runs must fill out and lie inside kv_slots
        if st.size and (
            int(np.add.reduce(ln)) != total or int(ln.min()) < 0 or int(st.min()) < 0
            or int((st + ln).max()) > src.size
        ):  # fmt: skip
            raise ValueError("slot runs outside the slot array or not filling the output")
        lib.ft_gather_runs(st.size, address(src), address(st), address(ln), address(out))
        return
    # entry k of run i is kv_slots[k + shift[i]], shift = start - (the run's offset in out)
    shift = exclusive_sum(length)
    np.subtract(start, shift, out=shift)
    if identity and kv_slots.size + total <= _INT32_MAX and out.dtype == np.int32:
        outside = (start + length > identity).nonzero()[0]
        if outside.size <= _SLICE_COPIES:
            np.add(arange_view(total, np.int32), shift.astype(np.int32).repeat(length), out=out)
            if outside.size:
                s, n = start[outside], length[outside]
                for a, ln, f in zip(s.tolist(), n.tolist(), (s - shift[outside]).tolist(), strict=True):
                    out[f : f + ln] = kv_slots[a : a + ln]
            return
    idx = shift.repeat(length)
    idx += arange_view(total)  # in place: a second index-sized temporary costs fresh pages
    np.take(kv_slots, idx, out=out, mode="clip")  # idx is in range: "clip" only skips a buffer
