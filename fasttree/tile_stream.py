"""The tile stream: a plan's units cut into KV tiles and dealt to a fixed number of programs.

:func:`build_tile_stream` turns the units of each tile class into a list of
``BLOCK_N``-token tiles (a unit's tiles adjacent, classes back to back) and cuts each
class's list into contiguous per-program ranges of about equal work, at unit
boundaries. The stream kernel (:mod:`fasttree.kernels.tree_attention_stream`) runs one
launch per class with ``programs x Hkv`` programs, so its grid depends on the GPU, not
on the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan_arrays import Plan

#: Bit layout of ``tile_meta`` (must match the kernel's constants).
META_TOKENS_BITS = 10
META_LAST_SHIFT = 20
META_FIRST_SHIFT = 21
#: Work of one unit's output write, in tiles, for balancing the program ranges.
UNIT_OVERHEAD_TILES = 0.5

STREAM_ARRAYS = ("tile_info", "prog_tiles")


@dataclass(frozen=True)
class TileStream:
    """Per-tile metadata and per-program tile ranges of one plan.

    Attributes
    ----------
    tile_info : ndarray, int32 [n_tiles, 4]
        Per tile: first ``kv_indices`` entry; first pair of its unit; valid tokens (bits
        0-9) | the unit's queries (bits 10-19) | last tile of its unit (bit 20) | first
        tile (bit 21); 0.
    prog_tiles : ndarray, int32 [sum over classes of (programs + 1)]
        Class ``c``'s program ``p`` handles tiles ``prog_tiles[o + p]:prog_tiles[o + p + 1]``
        with ``o = prog_offset[c]``.
    prog_offset : tuple of int
        First ``prog_tiles`` entry of each class.
    programs : tuple of int
        Programs per KV head of each class (0: the class has no units).
    """

    tile_info: np.ndarray
    prog_tiles: np.ndarray
    prog_offset: tuple[int, int]
    programs: tuple[int, int]


def build_tile_stream(plan: Plan, *, num_sms: int, programs_per_sm: tuple[int, int]) -> TileStream:
    """Cut a plan's units into tiles and deal them to ``programs`` per class and KV head.

    Parameters
    ----------
    plan : Plan
    num_sms : int
        Streaming multiprocessors of the GPU.
    programs_per_sm : tuple of int
        Resident programs wanted per SM for each tile class; a class gets
        ``ceil(num_sms * programs_per_sm / Hkv)`` programs per KV head, at most one per unit.

    Returns
    -------
    TileStream
    """
    if num_sms < 1 or min(programs_per_sm) < 1:
        raise ValueError(f"num_sms and programs_per_sm must be >= 1, got {num_sms}, {programs_per_sm}")
    ptr = plan.class_unit_ptr
    kv_parts, q_parts, meta_parts, prog_parts = [], [], [], []
    programs = []
    prog_offset = []
    tile_base = 0
    prog_base = 0
    for c in (0, 1):
        u0, u1 = ptr[c], ptr[c + 1]
        bn = plan.tile_classes[c].block_n
        kv_len = plan.unit_kv_len[u0:u1].astype(np.int64)
        n_units = kv_len.size
        nt = -(-kv_len // bn)
        unit_first_tile = np.zeros(n_units + 1, dtype=np.int64)
        np.cumsum(nt, out=unit_first_tile[1:])
        n_tiles = int(unit_first_tile[-1])
        unit = np.repeat(np.arange(n_units), nt)
        j = np.arange(n_tiles, dtype=np.int64) - unit_first_tile[unit]
        j *= bn
        kv_parts.append(plan.unit_kv_start[u0:u1].astype(np.int64)[unit] + j)
        q_parts.append(plan.unit_q_start[u0:u1][unit])
        n_valid = np.minimum(bn, kv_len[unit] - j)
        last = (j + bn >= kv_len[unit]).astype(np.int64)
        first = (j == 0).astype(np.int64)
        q_len = plan.unit_q_len[u0:u1].astype(np.int64)[unit]
        meta_parts.append(
            n_valid | (q_len << META_TOKENS_BITS) | (last << META_LAST_SHIFT) | (first << META_FIRST_SHIFT)
        )

        want = -(-num_sms * int(programs_per_sm[c]) // plan.num_kv_heads)
        p = min(n_units, want)
        prog_offset.append(prog_base)
        programs.append(p)
        if p:
            work = np.zeros(n_units + 1)
            np.cumsum(nt + UNIT_OVERHEAD_TILES, out=work[1:])
            cut = np.searchsorted(work, np.arange(p + 1) * (work[-1] / p), side="left")
            cut[0], cut[-1] = 0, n_units
            np.maximum.accumulate(cut, out=cut)
            prog_parts.append(unit_first_tile[cut] + tile_base)
        else:
            prog_parts.append(np.full(1, tile_base, dtype=np.int64))
        prog_base += prog_parts[-1].size
        tile_base += n_tiles
    if tile_base > 0x7FFFFFFF:
        raise ValueError("the plan needs more than 2**31 KV tiles; split the batch")
    i32 = np.int32
    info = np.zeros((tile_base, 4), dtype=i32)
    info[:, 0] = np.concatenate(kv_parts)
    info[:, 1] = np.concatenate(q_parts)
    info[:, 2] = np.concatenate(meta_parts)
    return TileStream(
        tile_info=info,
        prog_tiles=np.concatenate(prog_parts).astype(i32),
        prog_offset=(prog_offset[0], prog_offset[1]),
        programs=(programs[0], programs[1]),
    )
