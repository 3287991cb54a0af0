"""Packing small work units into masked units ("bins").

A unit of the small tile class often holds one query and a 16-32 token node: on a
GPU its program does a few microseconds of fixed work for 8-16 KB of KV, so deep
trees run thousands of latency-bound programs (docs/bench/NOTES.md). Packing puts
neighbouring small units into one program: the bin's matrix rows are a block of up to
``capacity`` consecutive queries in DFS order, its KV is the members' KV back to back,
and every KV entry carries a bit mask of the bin rows that attend it. A bin has one
partial result per query instead of one per member, and the rows of an MHA small tile
(16) were padding anyway.

Vocabulary as in :mod:`fasttree.plan_arrays`; *position* is a query's offset in its
bin's block of ranks, and bit ``p`` of an entry's mask means "the query at position
``p`` attends this entry".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .tree import exclusive_sum, ragged_arange

#: Bits of one KV entry's row mask (int32 on the device).
MAX_PACK_QUERIES = 32


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
    n_packed : int
        Pieces of input units that went into bins.
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


def _bit_index(x: np.ndarray) -> np.ndarray:
    """Index of the highest set bit of each positive ``x`` (< 2**52)."""
    return np.frexp(x.astype(np.float64))[1].astype(np.int64) - 1


class _Pieces(NamedTuple):
    """Eligible units cut at block boundaries, sorted by (block, lowest rank)."""

    unit: np.ndarray  # int64: the unit each piece comes from
    block: np.ndarray  # int64: block of ``capacity`` DFS ranks
    bits: np.ndarray  # int64: bit p = the query at position p of the block is the piece's
    cut: np.ndarray  # bool [n_units]: the unit became two or more pieces


def _cut_into_pieces(cand, q_len, pair_start, pair_query, query_rank, capacity: int, n_units: int) -> _Pieces:
    c_len = q_len[cand].astype(np.int64)
    c_rank = query_rank[pair_query[ragged_arange(pair_start[cand], c_len)]]
    c_block = c_rank // capacity
    n_blocks = int(c_block.max()) + 1
    piece_key = np.repeat(np.arange(cand.size, dtype=np.int64), c_len) * n_blocks + c_block
    if np.count_nonzero(piece_key[1:] < piece_key[:-1]):
        o = piece_key.argsort(kind="stable")
        piece_key, c_rank, c_block = piece_key[o], c_rank[o], c_block[o]
    new_piece = np.ones(piece_key.size, dtype=bool)
    np.not_equal(piece_key[1:], piece_key[:-1], out=new_piece[1:])
    first = new_piece.nonzero()[0]
    unit = cand[piece_key[first] // n_blocks]
    block = c_block[first]
    lowest = np.minimum.reduceat(c_rank, first)
    bits = np.bitwise_or.reduceat(np.left_shift(np.int64(1), c_rank - c_block * capacity), first)
    cut = np.zeros(n_units, dtype=bool)
    cut[unit[1:][unit[1:] == unit[:-1]]] = True
    order = np.lexsort((lowest, block))
    return _Pieces(unit[order], block[order], bits[order], cut)


def _runs(block: np.ndarray, tokens: np.ndarray, budget: int) -> np.ndarray:
    """Run (bin) index of every piece: runs never cross a block and close once they
    hold ``budget`` or more tokens (by the exclusive sum of tokens within the block)."""
    new_block = np.ones(block.size, dtype=bool)
    np.not_equal(block[1:], block[:-1], out=new_block[1:])
    excl = np.add.accumulate(tokens) - tokens
    block_first = new_block.nonzero()[0]
    excl -= excl[block_first][np.add.accumulate(new_block) - 1]
    run = excl // budget
    new_run = new_block
    new_run[1:] |= run[1:] != run[:-1]
    return np.add.accumulate(new_run) - 1


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
) -> PackedUnits | None:
    """Pack eligible units into bins of at most ``capacity`` queries and about ``budget`` tokens.

    The queries of every eligible unit are cut at the boundaries of blocks of
    ``capacity`` consecutive DFS ranks (a unit across k blocks becomes k pieces, each
    reading the unit's KV). Pieces are sorted by (block, lowest rank) and cut, within a
    block, into runs of about ``budget`` KV tokens (a run closes once it holds
    ``budget`` or more); a run of two or more pieces, or one holding a piece of a cut
    unit, becomes a bin. Other units are left as they were. A bin's rows are the
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

    Returns
    -------
    PackedUnits or None
        None when no bin forms.
    """
    if not 1 <= capacity <= MAX_PACK_QUERIES:
        raise ValueError(f"capacity must be in [1, {MAX_PACK_QUERIES}], got {capacity}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    cand = eligible.nonzero()[0]
    if cand.size < 2:
        return None
    pieces = _cut_into_pieces(cand, q_len, pair_start, pair_query, query_rank, capacity, kv_len.size)
    tokens = kv_len[pieces.unit].astype(np.int64)
    run = _runs(pieces.block, tokens, budget)
    n_runs = int(run[-1]) + 1
    is_bin = np.bincount(run, minlength=n_runs) >= 2
    is_bin |= np.bincount(run, weights=pieces.cut[pieces.unit], minlength=n_runs) > 0
    member = is_bin[run]
    if not member.any():
        return None
    return _assemble(
        kv_start, kv_len, pair_start, q_len, pair_query, kv_slots, query_rank, capacity,
        unit=pieces.unit[member], block=pieces.block[member], bits=pieces.bits[member],
        run=run[member], tokens=tokens[member],
    )  # fmt: skip


def _assemble(
    kv_start,
    kv_len,
    pair_start,
    q_len,
    pair_query,
    kv_slots,
    query_rank,
    capacity: int,
    *,
    unit,
    block,
    bits,
    run,
    tokens,
) -> PackedUnits:
    """The packed units from the bins' member pieces (in bin order)."""
    new_bin = np.ones(unit.size, dtype=bool)
    np.not_equal(run[1:], run[:-1], out=new_bin[1:])
    first = new_bin.nonzero()[0]
    b_bits = np.bitwise_or.reduceat(bits, first)
    b_tokens = np.add.reduceat(tokens, first)
    # a bin's rows start at its lowest position: shift its bits down to row 0
    b_base = _bit_index(b_bits & -b_bits)
    b_first_rank = block[first] * capacity + b_base
    bits = np.right_shift(bits, np.repeat(b_base, np.diff(np.append(first, unit.size))))
    b_bits = np.right_shift(b_bits, b_base)
    b_qlen = _bit_index(b_bits) + 1
    b_total = int(b_tokens.sum())

    # units left alone keep their KV; when they use less than half of the input slots,
    # their ranges are copied out so that the unused rest is not shipped to the device
    keep = np.ones(kv_len.size, dtype=bool)
    keep[unit] = False
    k_idx = keep.nonzero()[0]
    k_tokens = kv_len[k_idx].astype(np.int64)
    k_kv_start = kv_start[k_idx].astype(np.int64)
    old_slots = kv_slots
    if 2 * int(k_tokens.sum()) < kv_slots.size:
        old_slots = kv_slots[ragged_arange(k_kv_start, k_tokens)]
        k_kv_start = exclusive_sum(k_tokens)
    n_old = int(old_slots.size)
    b_kv_start = exclusive_sum(b_tokens) + n_old
    slots = np.empty(n_old + b_total, dtype=kv_slots.dtype)
    slots[:n_old] = old_slots
    np.take(kv_slots, ragged_arange(kv_start[unit], tokens, b_total), out=slots[n_old:])
    mask = np.empty(n_old + b_total, dtype=np.int32)
    mask[:n_old] = -1
    # positions >= 31 set the sign bit of the int32 mask
    mask[n_old:] = np.repeat(bits.astype(np.uint32).view(np.int32), tokens)

    # pairs: units left alone keep theirs, compacted; then every bin's positions
    k_len = q_len[k_idx].astype(np.int64)
    k_pairs = ragged_arange(pair_start[k_idx], k_len)
    b_pos = ragged_arange(np.zeros(b_qlen.size, dtype=np.int64), b_qlen)
    b_of_pair = np.repeat(np.arange(b_qlen.size), b_qlen)
    rank_to_query = np.empty(query_rank.size, dtype=np.int64)
    rank_to_query[query_rank] = np.arange(query_rank.size, dtype=np.int64)
    b_query = rank_to_query[b_first_rank[b_of_pair] + b_pos]
    b_present = (np.right_shift(b_bits[b_of_pair], b_pos) & 1).astype(bool)

    return PackedUnits(
        kv_start=np.concatenate([k_kv_start, b_kv_start]),
        kv_len=np.concatenate([k_tokens, b_tokens]),
        pair_start=np.concatenate([exclusive_sum(k_len), exclusive_sum(b_qlen) + k_pairs.size]),
        q_len=np.concatenate([k_len, b_qlen]),
        pair_query=np.concatenate([pair_query[k_pairs].astype(np.int64), b_query]),
        pair_present=np.concatenate([np.ones(k_pairs.size, dtype=bool), b_present]),
        kv_slots=slots,
        kv_row_mask=mask,
        is_bin=np.concatenate([np.zeros(k_idx.size, dtype=bool), np.ones(b_qlen.size, dtype=bool)]),
        n_packed=int(unit.size),
    )
