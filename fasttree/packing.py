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

import numpy as np

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


def _ragged_arange(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start[i], start[i] + length[i])`` (lengths >= 0)."""
    total = int(length.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    keep = length > 0
    s, ln = start[keep].astype(np.int64), length[keep].astype(np.int64)
    first = np.zeros(s.size, dtype=np.int64)
    np.add.accumulate(ln[:-1], out=first[1:])
    out = np.ones(total, dtype=np.int64)
    out[first] = s
    out[first[1:]] -= s[:-1] + ln[:-1] - 1
    np.add.accumulate(out, out=out)
    return out


def _bit_index(x: np.ndarray) -> np.ndarray:
    """Index of the highest set bit of each positive ``x`` (< 2**52)."""
    return np.frexp(x.astype(np.float64))[1].astype(np.int64) - 1


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
    unit, becomes a bin. Other units are left as they were.

    Parameters
    ----------
    kv_start, kv_len, pair_start, q_len : ndarray, int [n_units]
        The units: KV ``kv_slots[kv_start:kv_start + kv_len]``, pairs
        ``pair_start:pair_start + q_len``.
    pair_query : ndarray, int [n_pairs]
    kv_slots : ndarray, int32
    eligible : ndarray, bool [n_units]
        Units that may be packed (one tile class, short KV).
    query_rank : ndarray, int64 [n_queries]
        DFS rank of every query (a permutation of ``0 .. n_queries - 1``).
    capacity : int
        Queries per bin, 1 .. :data:`MAX_PACK_QUERIES`.
    budget : int
        KV tokens per bin (>= 1).

    A bin's rows are the positions from its lowest to its highest served query, so
    its row count (``q_len``) says which tile class can hold it.

    Returns
    -------
    PackedUnits or None
        None when no bin of two or more units forms.
    """
    if not 1 <= capacity <= MAX_PACK_QUERIES:
        raise ValueError(f"capacity must be in [1, {MAX_PACK_QUERIES}], got {capacity}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    cand = eligible.nonzero()[0]
    if cand.size < 2:
        return None
    c_len = q_len[cand].astype(np.int64)
    c_pairs = _ragged_arange(pair_start[cand], c_len)
    c_rank = query_rank[pair_query[c_pairs]]
    # pieces: a unit's queries in one block (a unit across blocks is cut, its KV read once per piece)
    c_block = c_rank // capacity
    c_unit = np.repeat(np.arange(cand.size, dtype=np.int64), c_len)
    n_blocks = int(c_block.max()) + 1
    piece_key = c_unit * n_blocks + c_block
    if np.count_nonzero(piece_key[1:] < piece_key[:-1]):
        o = piece_key.argsort(kind="stable")
        piece_key, c_rank, c_block = piece_key[o], c_rank[o], c_block[o]
    new_piece = np.ones(piece_key.size, dtype=bool)
    np.not_equal(piece_key[1:], piece_key[:-1], out=new_piece[1:])
    p_first = new_piece.nonzero()[0]
    unit = cand[piece_key[p_first] // n_blocks]
    block = c_block[p_first]
    rmin = np.minimum.reduceat(c_rank, p_first)
    # piece bits: OR over its queries of 1 << position in the block
    bits = np.bitwise_or.reduceat(np.left_shift(np.int64(1), c_rank - c_block * capacity), p_first)
    cut = np.zeros(kv_len.size, dtype=bool)
    cut[unit[1:][unit[1:] == unit[:-1]]] = True

    order = np.lexsort((rmin, block))
    unit, block, bits = unit[order], block[order], bits[order]
    tokens = kv_len[unit].astype(np.int64)
    new_block = np.ones(unit.size, dtype=bool)
    np.not_equal(block[1:], block[:-1], out=new_block[1:])
    csum = np.add.accumulate(tokens)
    excl = csum - tokens
    block_first = new_block.nonzero()[0]
    excl -= excl[block_first][np.add.accumulate(new_block) - 1]
    # a run closes once it holds >= budget tokens: runs by the exclusive sum
    run = excl // budget
    new_bin = new_block.copy()
    np.not_equal(run[1:], run[:-1], out=new_bin[1:])
    new_bin[1:] |= new_block[1:]
    bin_of = np.add.accumulate(new_bin) - 1
    n_bins = int(bin_of[-1]) + 1
    # a run becomes a bin when it has two or more pieces or holds a piece of a cut unit
    grouped = np.bincount(bin_of, minlength=n_bins) >= 2
    grouped |= np.bincount(bin_of, weights=cut[unit], minlength=n_bins) > 0
    packed = grouped[bin_of]
    if not packed.any():
        return None

    # bins of two or more members
    m_unit = unit[packed]
    m_bits = bits[packed]
    m_bin = bin_of[packed]
    m_tokens = tokens[packed]
    m_new = np.ones(m_unit.size, dtype=bool)
    np.not_equal(m_bin[1:], m_bin[:-1], out=m_new[1:])
    m_first = m_new.nonzero()[0]
    b_bits = np.bitwise_or.reduceat(m_bits, m_first)
    b_tokens = np.add.reduceat(m_tokens, m_first)
    # a bin's rows start at its lowest position: shift its bits down to row 0
    b_base = _bit_index(b_bits & -b_bits)
    b_first_rank = block[packed][m_first] * capacity + b_base
    m_bits = np.right_shift(m_bits, np.repeat(b_base, np.diff(np.append(m_first, m_bits.size))))
    b_bits = np.right_shift(b_bits, b_base)
    b_qlen = _bit_index(b_bits) + 1

    entries = _ragged_arange(kv_start[m_unit], m_tokens)
    new_slots = kv_slots[entries]
    new_mask = np.repeat(m_bits, m_tokens)
    # positions >= 31 set the sign bit of the int32 mask
    new_mask = new_mask.astype(np.uint32).view(np.int32)

    # units left alone keep their KV; when they use less than half of the input slots,
    # their ranges are copied out so that the unused rest is not shipped to the device
    keep = np.ones(kv_len.size, dtype=bool)
    keep[m_unit] = False
    k_idx = keep.nonzero()[0]
    k_tokens = kv_len[k_idx].astype(np.int64)
    k_kv_start = kv_start[k_idx].astype(np.int64)
    old_slots = kv_slots
    if 2 * int(k_tokens.sum()) < kv_slots.size:
        old_slots = kv_slots[_ragged_arange(k_kv_start, k_tokens)]
        k_kv_start = np.zeros(k_idx.size, dtype=np.int64)
        np.add.accumulate(k_tokens[:-1], out=k_kv_start[1:])
    n_old = int(old_slots.size)
    b_kv_start = np.zeros(b_tokens.size, dtype=np.int64)
    np.add.accumulate(b_tokens[:-1], out=b_kv_start[1:])
    b_kv_start += n_old

    # pairs: units left alone keep theirs, compacted; then every bin's positions
    k_len = q_len[k_idx].astype(np.int64)
    k_pairs = _ragged_arange(pair_start[k_idx], k_len)
    k_pair_start = np.zeros(k_idx.size, dtype=np.int64)
    np.add.accumulate(k_len[:-1], out=k_pair_start[1:])
    n_kept_pairs = int(k_pairs.size)
    b_pair_start = np.zeros(b_qlen.size, dtype=np.int64)
    np.add.accumulate(b_qlen[:-1], out=b_pair_start[1:])
    b_pos = _ragged_arange(np.zeros(b_qlen.size, dtype=np.int64), b_qlen)
    b_of_pair = np.repeat(np.arange(b_qlen.size), b_qlen)
    rank_to_query = np.empty(query_rank.size, dtype=np.int64)
    rank_to_query[query_rank] = np.arange(query_rank.size, dtype=np.int64)
    b_query = rank_to_query[b_first_rank[b_of_pair] + b_pos]
    b_present = (np.right_shift(b_bits[b_of_pair], b_pos) & 1).astype(bool)

    return PackedUnits(
        kv_start=np.concatenate([k_kv_start, b_kv_start]),
        kv_len=np.concatenate([k_tokens, b_tokens]),
        pair_start=np.concatenate([k_pair_start, b_pair_start + n_kept_pairs]),
        q_len=np.concatenate([k_len, b_qlen]),
        pair_query=np.concatenate([pair_query[k_pairs].astype(np.int64), b_query]),
        pair_present=np.concatenate([np.ones(n_kept_pairs, dtype=bool), b_present]),
        kv_slots=np.concatenate([old_slots, new_slots.astype(kv_slots.dtype, copy=False)]),
        kv_row_mask=np.concatenate([np.full(n_old, -1, dtype=np.int32), new_mask]),
        is_bin=np.concatenate([np.zeros(k_idx.size, dtype=bool), np.ones(b_qlen.size, dtype=bool)]),
        n_packed=int(m_unit.size),
    )
