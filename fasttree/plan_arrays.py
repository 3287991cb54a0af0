"""The :class:`Plan`: flat int32 arrays that drive the kernels, built from groups.

Vocabulary (dimension names used in every docstring of the package):

* ``n_queries`` -- decode queries (one new token each), row ``j`` of ``q``.
* ``Hq``, ``Hkv``, ``D``, ``g = Hq // Hkv`` -- query heads, KV heads, head dim, GQA ratio.
* *unit* -- one program's work per KV head: a chunk of a group's KV (at most the split
  size) times a tile of the group's queries.
* *pair* -- one (unit, query) combination; it produces one partial result per head.
* *partial row* -- a row of the fp32 partial buffers; a query with one partial writes
  its output directly and owns no partial row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .config import FastTreeConfig
from .costs import ALL_LARGE, QUERY_SEPARATED
from .groups import ChainedSlots
from .host_arrays import entry_array, work_array
from .native import address, c_int32, c_int64, planner_library
from .packing import MAX_PACK_QUERIES, BinLayout, assemble_bins, bin_layout, bin_rows, layout_reads_and_rows
from .plan_rules import PlanRules, decode_programs_per_sm
from .tree import arange_view, exclusive_sum, inverse_permutation, stable_argsort
from .validation import check_int, check_int_array

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .groups import Groups

_DEFAULT_RULES = PlanRules.defaults()

#: int32 arrays shipped to the device, in packing order.
DEVICE_ARRAYS = (
    "kv_indices",
    "kv_row_mask",
    "unit_kv_start",
    "unit_kv_len",
    "unit_q_start",
    "unit_q_len",
    "pair_query",
    "pair_out_row",
    "query_partial_start",
    "query_num_partials",
    "merge_queries",
)

_MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
_MIN_BLOCK_N = 16  # and at least 16 KV tokens
MAX_BLOCK_M = 256  # rows of one program (query tile x GQA ratio)
ABSENT_ROW = -2  # pair_out_row of a packed unit's row that serves no query


def check_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Validate head counts and head dim; return the GQA ratio ``g``."""
    if (
        not (type(num_q_heads) is int and type(num_kv_heads) is int and type(head_dim) is int)
        or min(num_q_heads, num_kv_heads, head_dim) < 1
    ):  # plain positive ints pass without the general check
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(name, v, minimum=1, expected="a positive integer")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in [16, 256], got {head_dim}")
    return num_q_heads // num_kv_heads


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


def tile_rows(queries: int, group_size: int) -> int:
    """Rows (``block_m``) of a tile of ``queries`` queries at ``group_size`` query heads per KV
    head: the power of two covering ``queries x group_size``, at least 16 (``tl.dot``'s least)."""
    return max(_MIN_BLOCK_M, _next_pow2(queries * group_size))


def tenth_longest(kv_len: np.ndarray, *, descending: bool = False) -> int:
    """The KV length that one unit in ten (or more) of a tile class reaches: the ``size // 10``-th
    of the units' lengths ``kv_len`` (non-empty) in decreasing order. ``descending``: ``kv_len`` is
    sorted so already (a class as planned); else any order (an extended plan's)."""
    k = kv_len.size // 10
    if descending:
        return int(kv_len[k])
    i = kv_len.size - 1 - k
    return int(np.partition(kv_len, i)[i])


def _class_kv_tile(kv_tile: int, kv_len_desc: np.ndarray) -> int:
    """The KV tile of a tile class: ``kv_tile``, shrunk (to a power of two >= 16) when
    nine in ten of the class's units are shorter, so short units do not compute on
    masked tokens. ``kv_len_desc`` is sorted in decreasing order."""
    if not kv_len_desc.size:
        return kv_tile
    p90 = tenth_longest(kv_len_desc, descending=True)
    return min(kv_tile, max(_MIN_BLOCK_N, _next_pow2(p90)))


def _pack_capacity(block_m: tuple[int, int], g: int) -> int:
    """Queries per packed unit: a full large tile when its rows hold at most
    :data:`~fasttree.packing.MAX_PACK_QUERIES` queries (GQA), else a full small tile
    (MHA: a 64-row tile of 32 queries would leave half its rows empty, which measured
    slower on the H200 than 16-query bins)."""
    large = block_m[0] // g
    return large if large <= MAX_PACK_QUERIES else min(block_m[1] // g, MAX_PACK_QUERIES)


def _bins_fill_a_larger_tile(block_m: tuple[int, int], g: int) -> bool:
    """Whether bins fill the large tile (:func:`_pack_capacity`) and it has more rows than the
    small one, so a unit left out of the bins runs in a smaller tile (the solo and balanced-bin
    rules act only then)."""
    return block_m[0] // g <= MAX_PACK_QUERIES and block_m[0] > block_m[1]


def _solo_units(
    kv_len: np.ndarray,
    q_len: np.ndarray,
    block_m: tuple[int, int],
    g: int,
    num_kv_heads: int,
    head_dim: int,
    rules: PlanRules,
) -> np.ndarray | None:
    """Units kept out of packing (None: none) by ``rules.solo_units``: at least
    ``rules.solo_min_tokens`` long, rows that fit the small tile, bins that fill the large tile
    (:func:`_pack_capacity`), and together worth ``rules.solo_min_waste_flops`` of wasted
    matrix work or ``rules.solo_min_share`` of the units' KV tokens (:func:`_solo_pays`)."""
    if not rules.solo_units or not _bins_fill_a_larger_tile(block_m, g):
        return None
    solo = (kv_len >= rules.solo_min_tokens) & (q_len * g <= block_m[1])
    if not _solo_pays(kv_len[solo], kv_len, block_m, num_kv_heads, head_dim, rules):
        return None
    return solo


def _solo_pays(
    solo_kv_len: np.ndarray,
    all_kv_len: np.ndarray,
    block_m: tuple[int, int],
    num_kv_heads: int,
    head_dim: int,
    rules: PlanRules,
) -> bool:
    """The solo rule's test: whether large-tile bins would waste at least
    ``rules.solo_min_waste_flops`` of matrix work on solo units (or groups) of these KV lengths,
    or the solo ones hold at least ``rules.solo_min_share`` of all units' (groups') KV tokens.

    On the H200 the waste alone kept them out on paper case 8 at GQA 4 (51.5 GFLOP wasted: 42 us
    saved) and GQA 16 (6.4 GFLOP: 11 us), but cost 5-7 us on plans wasting 0.5-2.9 GFLOP, where
    solo units were a small part of trees with sharing; with one KV head a batch of independent
    requests wastes little matrix work, yet 64-row bins of four requests ran it at 0.78-0.88x of
    query-separated decode: the share catches those."""
    tokens = int(np.add.reduce(solo_kv_len, dtype=np.int64))
    if 4.0 * tokens * (block_m[0] - block_m[1]) * num_kv_heads * head_dim >= rules.solo_min_waste_flops:
        return True
    return tokens > 0 and tokens >= rules.solo_min_share * int(np.add.reduce(all_kv_len, dtype=np.int64))


def chunked_split(longest: int, programs: int, items: int, kv_tile: int, work: int | None = None) -> int:
    """The split size of plain split-KV decode: the multiple of ``kv_tile`` (at least one tile)
    that cuts the ``longest`` context into ``ceil(programs / items)`` chunks (at least one), so
    that ``items`` (queries or groups x KV heads) fill about ``programs`` programs. With ``work``
    (their summed context x KV heads: ``PlanRules.decode_split_by_context``, plain decode) at most the chunk
    that cuts ``work`` into about ``programs`` programs: finer where the contexts' lengths
    differ (cut by the longest, the shorter ones make fewer programs), about the same where they
    are equal."""
    chunks = max(1, -(-programs // items))
    split = max(kv_tile, -(-longest // chunks))
    if work is not None:
        split = min(split, max(kv_tile, -(-max(1, work) // programs)))
    return -(-split // kv_tile) * kv_tile


def context_capped_split(longest: int, programs: int, items: int, kv_tile: int, work: int) -> int | None:
    """The chunk that cuts ``work`` (a batch's summed context x KV heads) into about ``programs``
    programs (:func:`chunked_split`), where the ``items`` alone fill them (the longest context would
    be read whole, the launch's tail) and that chunk is at most four fifths of the uncut one: a cap
    just below the longest context cuts a few contexts in two and adds partials and a merge launch
    for little (0.95-0.98x on the H100). None otherwise, and for no programs (a config's
    ``para_threshs1`` of 0). Plain decode's (``PlanRules.decode_split_by_context``) and a no-sharing
    tree plan's (``PlanRules.no_sharing_split_by_context``) rule."""
    if programs < 1 or items < programs:
        return None
    split = chunked_split(longest, programs, items, kv_tile)
    capped = chunked_split(longest, programs, items, kv_tile, work)
    return capped if 5 * capped <= 4 * split else None


def one_wave_programs_per_sm(rules: PlanRules | None, lens: np.ndarray, kv_tile: int, head_dim: int) -> int | None:
    """The programs per SM :func:`one_wave_split` fits a batch's chunks to under
    :attr:`PlanRules.equal_lengths_one_wave` (:func:`fasttree.plan_rules.decode_programs_per_sm`),
    or None where the rule is off, the head dim unmeasured, or the contexts of lengths ``lens``
    (int64, not empty) not equal to within one KV tile."""
    if rules is None or not rules.equal_lengths_one_wave:
        return None
    if int(np.maximum.reduce(lens)) - int(np.minimum.reduce(lens)) >= kv_tile:
        return None
    return decode_programs_per_sm(head_dim)


def one_wave_split(lens: np.ndarray, num_kv_heads: int, programs: int, kv_tile: int) -> int:
    """The smallest multiple of ``kv_tile`` that cuts the contexts of lengths ``lens`` (int64
    [n_queries], not empty) into at most ``programs`` chunks x ``num_kv_heads``
    (:attr:`PlanRules.equal_lengths_one_wave`), or the longest context rounded up to the tile (one
    chunk per query) when no chunk size does: a binary search over the tiles, the chunk count
    falling as the chunk grows."""
    tiles_hi = max(1, -(-int(np.maximum.reduce(lens)) // kv_tile))

    def fits(tiles: int) -> bool:
        return int(np.add.reduce(-(-lens // (tiles * kv_tile)), dtype=np.int64)) * num_kv_heads <= programs

    if not fits(tiles_hi):
        return tiles_hi * kv_tile
    lo, hi = 1, tiles_hi
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo * kv_tile


def _solo_group_split(
    groups: Groups,
    group_split: np.ndarray | int,
    block_m: tuple[int, int],
    g: int,
    num_kv_heads: int,
    head_dim: int,
    small_split: int,
    config: FastTreeConfig,
    rules: PlanRules,
) -> np.ndarray | int:
    """``group_split`` with the groups the solo rule will keep out of packing cut no finer than
    a plain split-KV decode of them would be.

    A solo group (its queries' rows fit the small tile, at least ``rules.solo_min_tokens`` long,
    in a plan where the solo test of :func:`_solo_pays` holds) runs as its own units, so its
    phase's split size alone would decide their number: at the small split that is a launch of
    short programs, each with a partial row to merge (on the H200, 1,024 units of 128 tokens for
    64 independent 2k-token requests at 32 query over 2 KV heads, 0.84x of query-separated
    decode). With ``P = para_threshs1[1]`` programs as the target:

    - at most ``rules.solo_split_max_kv_heads`` KV heads, their split is raised to the smallest
      multiple of the small KV tile that cuts the longest solo group into
      ``ceil(P / (solo groups x KV heads))`` chunks, the chunking of
      :func:`fasttree.plan_query_separated`;
    - with more KV heads (``rules.solo_recut``), a solo group of ``L`` tokens cut at the small
      split size, or any solo group where their cut makes more than
      ``rules.solo_recut_programs * P`` programs, in a plan whose groups hold ``T`` tokens, is
      cut into ``ceil(L * P / (T x KV heads))`` chunks of about equal length (rounded up to the
      small KV tile): its share of ``P`` programs. There, cutting every group by the longest one
      left a long group whole as the launch's tail on mixed lengths, and re-cutting groups
      already cut at the big split size into about ``P`` programs lost waves (0.93x on 32 x
      4k-token requests at 32/8 heads, whose cut made 1.9 P programs);
    - with ``rules.equal_lengths_one_wave``, every group solo (a batch without sharing) and their
      lengths equal to within the small KV tile, either way the chunk of :func:`one_wave_split` for
      one wave of ``P x p / 4`` programs, ``p`` the launch's programs per SM
      (:func:`fasttree.plan_rules.decode_programs_per_sm`).

    A longer split is kept.

    Returns
    -------
    ndarray, int64 [n_groups], or int
        ``group_split`` itself when no group changes.
    """
    few_heads = num_kv_heads <= rules.solo_split_max_kv_heads
    if not rules.solo_units or not (few_heads or rules.solo_recut) or not _bins_fill_a_larger_tile(block_m, g):
        return group_split
    kv_len = groups.kv_len
    nq = groups.q_indptr[1:] - groups.q_indptr[:-1]
    solo = (nq * g <= block_m[1]) & (kv_len >= rules.solo_min_tokens)
    n_solo = int(np.count_nonzero(solo))
    if not n_solo or not _solo_pays(kv_len[solo], kv_len, block_m, num_kv_heads, head_dim, rules):
        return group_split
    programs, tile = config.para_threshs1[1], config.kv_tile[1]
    current = np.full(kv_len.size, group_split, dtype=np.int64) if np.ndim(group_split) == 0 else group_split
    per_sm = one_wave_programs_per_sm(rules, kv_len, tile, head_dim) if n_solo == kv_len.size else None
    one_wave = per_sm is not None
    if one_wave:  # every group solo, equal lengths: one wave of plain decode's launch, scaled from P at 4 per SM
        split = one_wave_split(kv_len, num_kv_heads, programs * per_sm // 4, tile)
    elif few_heads:
        split = chunked_split(int(np.maximum.reduce(kv_len[solo])), programs, n_solo * num_kv_heads, tile)
    else:
        cut = int(np.add.reduce(-(-kv_len[solo] // current[solo]), dtype=np.int64)) * num_kv_heads
        if cut <= rules.solo_recut_programs * programs:  # only the groups at the small split
            solo &= current <= small_split
        total = int(np.add.reduce(kv_len, dtype=np.int64)) * num_kv_heads
        chunks = np.maximum(1, -(-(kv_len * programs) // total))
        even = -(-kv_len // chunks)  # tokens per chunk, rounded up to the tile below
        split = np.maximum(tile, -(-even // tile) * tile)
    raised = solo & (current < split)
    if not np.count_nonzero(raised):
        return group_split
    out = np.array(current, dtype=np.int64)
    out[raised] = split if few_heads or one_wave else split[raised]
    return out


def _no_sharing_split_cap(
    groups: Groups, group_split: np.ndarray | int, num_kv_heads: int, config: FastTreeConfig, rules: PlanRules
) -> np.ndarray | int:
    """``group_split`` capped at plain decode's chunk by the summed context in a tree plan without
    sharing (:attr:`PlanRules.no_sharing_split_by_context`; not plain decode's plan, whose chunks
    :func:`fasttree.plan_query_separated` sizes, a caller's too): every group one query's, their
    groups x KV heads at least ``P = para_threshs1[1]`` programs, at the chunk of
    :func:`context_capped_split` for ``P`` programs and the small KV tile; ``group_split`` itself
    where that gives none.

    Returns
    -------
    ndarray, int64 [n_groups], or int
    """
    if not rules.no_sharing_split_by_context:
        return group_split
    nq = groups.n_queries
    kv_len = groups.kv_len
    if not nq.size or int(np.maximum.reduce(nq)) != 1:
        return group_split
    work = int(np.add.reduce(kv_len, dtype=np.int64)) * num_kv_heads
    cap = context_capped_split(
        int(np.maximum.reduce(kv_len)), config.para_threshs1[1], kv_len.size * num_kv_heads, config.kv_tile[1], work
    )
    if cap is None:
        return group_split
    current = np.broadcast_to(np.asarray(group_split, dtype=np.int64), kv_len.shape)
    over = current > cap
    if not np.count_nonzero(over):
        return group_split
    out = current.copy()
    out[over] = cap
    return out


def _pack_budget(
    kv_len: np.ndarray, config: FastTreeConfig, num_kv_heads: int, kept_out: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """Units that may be packed (shorter than ``pack_tokens``, not in ``kept_out``: the solo
    units and, in a plan that keeps them whole, the wide ones) and the
    tokens per packed unit: ``pack_tokens``, lowered (to >= 16) so that about
    ``pack_min_units`` packed programs (units x KV heads) share the eligible tokens."""
    eligible = kv_len < config.pack_tokens
    if kept_out is not None:
        eligible &= ~kept_out
    want_units = -(-config.pack_min_units // num_kv_heads)
    share = int(np.add.reduce(kv_len[eligible])) // max(1, want_units)
    return eligible, min(config.pack_tokens, max(_MIN_BLOCK_N, share))


@dataclass(frozen=True)
class TileClass:
    """Launch shape of one tile class.

    Attributes
    ----------
    queries : int
        Queries per tile.
    block_m : int
        Matrix rows of a program (``queries * g`` rounded up to a power of two >= 16).
    block_n : int
        KV tokens per inner-loop tile: the config's ``kv_tile`` of the class, or a smaller
        power of two (>= 16) when 90% of the class's units are that short.
    split : int
        KV tokens per unit.
    num_warps, num_stages : int
    masked : bool
        Whether the class holds packed units (bins): KV entries then carry row masks
        (``Plan.kv_row_mask``) and the kernel applies them.
    """

    queries: int
    block_m: int
    block_n: int
    split: int
    num_warps: int
    num_stages: int
    masked: bool = False


@dataclass(eq=False)
class Plan:
    """A tree-attention plan: host arrays (int32) plus the decisions behind them.

    Attributes
    ----------
    num_q_heads, num_kv_heads, head_dim, n_queries : int
    max_slot : int
        Largest KV-pool slot read; the pool must have more slots.
    kv_indices : ndarray, int32 [n_kv_entries]
        Pool slots the units' KV ranges index (see :class:`fasttree.groups.Groups`),
        followed by the packed units' slots.
    kv_row_mask : ndarray, int32 [n_kv_entries] or [0]
        Bit ``p`` of entry ``e``: the unit's query at pair position ``p`` attends entry
        ``e`` (-1: all of them). Empty when no tile class is masked.
    unit_kv_start, unit_kv_len : ndarray, int32 [n_units]
        The unit's KV is ``kv_indices[start:start + len]`` (len >= 1).
    unit_q_start, unit_q_len : ndarray, int32 [n_units]
        The unit's pairs are ``start:start + len`` of the pair arrays.
    pair_query : ndarray, int32 [n_pairs]
        Query row of each pair.
    pair_out_row : ndarray, int32 [n_pairs]
        Partial row the pair writes, -1 when its query has a single partial and the
        pair writes the output directly, or -2 (:data:`ABSENT_ROW`) for a row of a
        packed unit that serves no query (nothing is written).
    query_partial_start, query_num_partials : ndarray, int32 [n_queries]
        Query ``j``'s partial rows are ``start:start + num`` (num == 1 means direct).
    merge_queries : ndarray, int32 [n_merge]
        Queries with two or more partials, merged by stage 2.
    class_unit_ptr : tuple of int
        Units of tile class ``c`` are ``class_unit_ptr[c]:class_unit_ptr[c + 1]``; within
        a class, units are sorted by decreasing KV length.
    tile_classes : tuple of TileClass
        Launch shape per tile class (0: units with more than ``tile_classes[1].queries``
        queries, 1: the others).
    n_partial_rows : int
    tile_mode : str
        ``two_classes``, ``all_large`` or ``all_small`` (the adaptive tile pass).
    config : FastTreeConfig
    edge_assignment : ndarray, int8 [n_nodes] or None
        The greedy's decision per node (1: edge from its parent concatenated).
    groups : Groups
        The context-query groups the units were cut from.
    rules : PlanRules
        The planning rules the plan was made with.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    n_queries: int
    max_slot: int
    kv_indices: np.ndarray
    kv_row_mask: np.ndarray
    unit_kv_start: np.ndarray
    unit_kv_len: np.ndarray
    unit_q_start: np.ndarray
    unit_q_len: np.ndarray
    pair_query: np.ndarray
    pair_out_row: np.ndarray
    query_partial_start: np.ndarray
    query_num_partials: np.ndarray
    merge_queries: np.ndarray
    class_unit_ptr: tuple[int, int, int]
    tile_classes: tuple[TileClass, TileClass]
    n_partial_rows: int
    tile_mode: str
    config: FastTreeConfig
    groups: Groups
    edge_assignment: np.ndarray | None = None
    rules: PlanRules = _DEFAULT_RULES
    _device_cache: dict = field(default_factory=dict, repr=False)
    # made by the planner (its arrays consistent by construction): a plan built or replaced by hand
    # is checked once, before its first upload (:func:`check_plan_arrays`)
    _planned: bool = field(default=False, init=False, repr=False)

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def n_units(self) -> int:
        return int(self.unit_kv_len.size)

    def units_per_class(self) -> tuple[int, int]:
        p = self.class_unit_ptr
        return p[1] - p[0], p[2] - p[1]

    # ------------------------------------------------------------- device
    def to(self, device: Any, *, non_blocking: bool = False) -> DevicePlan:
        """Upload the plan's arrays with one host-to-device copy; cached per device.

        Parameters
        ----------
        device : torch.device or str
        non_blocking : bool
            For a CUDA device: copy from pinned host memory on the current stream and return
            without waiting for the copy, so the host can go on (e.g. plan the next step) while
            the GPU runs earlier work. Kernels launched later on that stream see the arrays;
            another stream must wait for the current one first. False: the copy is done when
            this returns. Only the first upload to a device copies (later calls return the
            cached arrays).

        Raises
        ------
        ValueError
            For a plan not made by the planner (built or replaced by hand) whose arrays would
            send a kernel outside them (:func:`check_plan_arrays`), before anything is uploaded.
        """
        import torch

        device = torch.device(device)
        cached = self._device_cache.get(device)
        if cached is None:
            if not self._planned:
                check_plan_arrays(self)
            cached = DevicePlan.upload(self, device, non_blocking=non_blocking)
            self._device_cache[device] = cached
        return cached

    # ------------------------------------------------------------ summary
    def __repr__(self) -> str:
        """Shapes and counts only (``summary()`` says more; the arrays are attributes)."""
        units = self.units_per_class()
        return (
            f"Plan(n_queries={self.n_queries}, heads={self.num_q_heads}/{self.num_kv_heads}, "
            f"head_dim={self.head_dim}, groups={self.groups.n_groups}, units={units}, pairs={self.pair_query.size}, "
            f"kv_indices={self.kv_indices.size}, partial_rows={self.n_partial_rows}, tile_mode={self.tile_mode!r})"
        )

    def stats(self) -> dict[str, Any]:
        """Work counts of the plan (per launch, all KV heads)."""
        elem = 2  # fp16 / bf16 bytes
        d = self.head_dim
        kv_tokens = int(self.unit_kv_len.astype(np.int64).sum())
        pair_tokens = int((self.unit_kv_len.astype(np.int64) * self.unit_q_len).sum())
        return {
            "units": self.units_per_class(),
            "groups": self.groups.n_groups,
            "pairs": int(self.pair_query.size),
            "partial_rows": self.n_partial_rows,
            "merged_queries": int(self.merge_queries.size),
            "kv_tokens_read": kv_tokens,
            "kv_bytes_read": kv_tokens * self.num_kv_heads * d * 2 * elem,
            "flops": 4 * pair_tokens * self.num_q_heads * d,
            "tile_mode": self.tile_mode,
            "splits": tuple(tc.split for tc in self.tile_classes),
            "q_tiles": tuple(tc.queries for tc in self.tile_classes),
        }

    def summary(self) -> str:
        """One-paragraph human summary."""
        s = self.stats()
        return (
            f"Plan: {self.n_queries} queries, Hq={self.num_q_heads} Hkv={self.num_kv_heads} D={self.head_dim}; "
            f"{s['groups']} groups -> units (large, small) = {s['units']} x {self.num_kv_heads} KV heads, "
            f"query tiles {s['q_tiles']}, splits {s['splits']}, mode {s['tile_mode']}; "
            f"{s['partial_rows']} partial rows, {s['merged_queries']} queries merged; "
            f"KV read {s['kv_tokens_read']} tokens ({s['kv_bytes_read'] / 1e6:.2f} MB)"
        )


@dataclass(frozen=True)
class DevicePlan:
    """The plan's arrays on one device: views into a single int32 tensor."""

    plan: Plan
    device: Any
    buffer: torch.Tensor
    arrays: dict[str, torch.Tensor]

    @classmethod
    def upload(cls, plan: Plan, device: Any, *, non_blocking: bool = False) -> DevicePlan:
        """The plan's arrays copied to ``device`` in one int32 tensor (see :meth:`Plan.to`)."""
        import torch

        parts = [np.ascontiguousarray(getattr(plan, name), dtype=np.int32) for name in DEVICE_ARRAYS]
        sizes = [max(1, p.size) for p in parts]  # keep every view non-empty (valid pointer)
        host = np.zeros(sum(sizes), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        for p, off in zip(parts, offsets[:-1], strict=True):
            host[off : off + p.size] = p
        staged = torch.from_numpy(host)
        device = torch.device(device)
        if non_blocking and device.type == "cuda":
            # pinned: the copy runs on the stream without the host waiting; torch keeps the pinned
            # block from reuse until the copy is done
            buf = staged.pin_memory().to(device, non_blocking=True)
        else:
            buf = staged.to(device)
        arrays = {name: buf[offsets[i] : offsets[i] + sizes[i]] for i, name in enumerate(DEVICE_ARRAYS)}
        return cls(plan=plan, device=buf.device, buffer=buf, arrays=arrays)


def check_plan_arrays(plan: Plan) -> None:
    """Raise ValueError naming the first of ``plan``'s arrays that would send the kernels outside
    their buffers: what a plan not made by the planner must satisfy before it is uploaded.

    Every unit array has one entry per unit and the tile classes' unit ranges lie within them;
    each unit's KV range lies within ``kv_indices`` and its pairs within ``pair_query``, and its
    queries fit its class's tile rows; slots lie in ``[0, max_slot]``; row masks, when present or
    read by a masked class, one per KV entry; pairs name queries below ``n_queries`` and write the
    output (-1), nothing (-2) or a partial row below ``n_partial_rows``; merged queries lie below
    ``n_queries`` and their partial rows below ``n_partial_rows``. O(KV entries).

    Parameters
    ----------
    plan : Plan
    """

    def ints(name: str) -> np.ndarray:
        a = check_int_array(f"the plan's {name}", getattr(plan, name))
        if a.size and (int(a.min()) < -(2**31) or int(a.max()) >= 2**31):
            raise ValueError(f"the plan's {name} holds values outside int32")
        return a

    def fail(what: str) -> None:
        raise ValueError(f"inconsistent plan (not made by fasttree.plan?): {what}")

    n_queries, max_slot, rows = int(plan.n_queries), int(plan.max_slot), int(plan.n_partial_rows)
    if n_queries < 0 or rows < 0:
        fail(f"n_queries={n_queries}, n_partial_rows={rows}")
    kv, mask = ints("kv_indices"), ints("kv_row_mask")
    kv_start, kv_len, q_start, q_len = (ints(n) for n in ("unit_kv_start", "unit_kv_len", "unit_q_start", "unit_q_len"))
    pairs, out_row = ints("pair_query"), ints("pair_out_row")
    part_start, n_part, merge = ints("query_partial_start"), ints("query_num_partials"), ints("merge_queries")
    n_units = kv_len.size
    if not kv_start.size == q_start.size == q_len.size == n_units:
        fail("the unit arrays differ in length")
    ptr = [int(p) for p in plan.class_unit_ptr]
    if len(ptr) != 3 or not 0 <= ptr[0] <= ptr[1] <= ptr[2] <= n_units:
        fail(f"class_unit_ptr {tuple(plan.class_unit_ptr)} for {n_units} units")
    if n_units and (kv_start.min() < 0 or kv_len.min() < 0 or (kv_start + kv_len).max() > kv.size):
        fail("a unit's KV range lies outside kv_indices")
    if kv.size and (kv.min() < 0 or kv.max() > max_slot):
        fail(f"kv_indices outside [0, max_slot={max_slot}]")
    masked = any(tc.masked and ptr[c + 1] > ptr[c] for c, tc in enumerate(plan.tile_classes))
    if mask.size not in (0, kv.size) or (masked and mask.size != kv.size):
        fail(f"{mask.size} row masks for {kv.size} KV entries")
    if out_row.size != pairs.size:
        fail("pair_query and pair_out_row differ in length")
    if n_units and (q_start.min() < 0 or q_len.min() < 0 or (q_start + q_len).max() > pairs.size):
        fail("a unit's pairs lie outside pair_query")
    g = max(1, int(plan.num_q_heads) // max(1, int(plan.num_kv_heads)))
    for c, tc in enumerate(plan.tile_classes):
        if ptr[c + 1] > ptr[c] and q_len[ptr[c] : ptr[c + 1]].max() > max(1, tc.block_m // g):
            fail(f"a unit of tile class {c} has more queries than its {tc.block_m}-row tiles hold")
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n_queries):
        fail(f"pair_query outside [0, n_queries={n_queries})")
    if out_row.size and (out_row.min() < -2 or out_row.max() >= rows):
        fail(f"pair_out_row outside [-2, n_partial_rows={rows})")
    if part_start.size < n_queries or n_part.size < n_queries:
        fail("query_partial_start and query_num_partials need one entry per query")
    if merge.size and (merge.min() < 0 or merge.max() >= n_queries):
        fail(f"merge_queries outside [0, n_queries={n_queries})")
    if merge.size:  # the merge reads each merged query's partial rows
        start, count = part_start[merge], n_part[merge]
        if start.min() < 0 or count.min() < 0 or (start + count).max() > rows:
            fail(f"a merged query's partial rows lie outside [0, n_partial_rows={rows})")


def materialize(
    groups: Groups,
    *,
    q_tiles: tuple[int, int],
    kv_tiles: tuple[int, int],
    group_split: np.ndarray | int,
    splits: tuple[int, int],
    config: FastTreeConfig,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    n_queries: int,
    max_slot: int,
    tile_mode: str,
    edge_assignment: np.ndarray | None = None,
    query_rank: np.ndarray | None = None,
    query_of_rank: np.ndarray | None = None,
    rules: PlanRules | None = None,
    max_weighted_reads: float | None = None,
    fill_slots: Callable[[], np.ndarray] | None = None,
    small_split: int | None = None,
) -> Plan | None:
    """Cut groups into units, assign partial rows, and pack the int32 arrays of a :class:`Plan`.

    Every group's queries are cut into tiles of ``q_tiles[0]`` queries and its KV into
    chunks of its ``group_split`` tokens; a unit with more than ``q_tiles[1]`` queries runs
    in tile class 0, the others (small groups and remainder tiles) in class 1.

    Parameters
    ----------
    groups : Groups
        Groups with >= 1 token and >= 1 query each.
    q_tiles, kv_tiles : tuple of int
        Queries and KV tokens per tile of tile class 0 and 1.
    group_split : ndarray, int [n_groups], or int
        KV tokens per unit of each group (an int: the same for every group).
    splits : tuple of int
        The split sizes of the two phases (recorded in the plan).
    query_rank : ndarray, int64 [n_queries], optional
        DFS rank of every query; when given and ``config.pack_tokens > 0``, units
        shorter than ``pack_tokens`` are packed into masked units that fill a large
        tile's rows, or a small tile's when a large one holds more than 32 queries
        (:func:`fasttree.packing.pack_units`), with a token budget lowered
        until there are about ``config.pack_min_units`` packed programs; a packed unit
        whose rows fit the small tile runs in the small class.
    query_of_rank : ndarray, int64 [n_queries], optional
        The inverse permutation of ``query_rank``, when the caller has it (packing
        computes it otherwise).
    rules : PlanRules, optional
        How units are packed: solo, wide and aligned-block rules (:class:`fasttree.PlanRules`);
        :meth:`PlanRules.defaults` when None.
    max_weighted_reads : float, optional
        Abandon the plan (return None) when the KV tokens its units read, each weighted by
        ``(block_m / 16) ** rules.crossover_row_exponent`` for its tile class
        (:func:`_laid_out_weighted_reads`), exceed this: decided once the units and bins are laid
        out, before their arrays are built.
    fill_slots : callable, optional
        Returns the groups' ``kv_slots`` (int32, or a :class:`fasttree.groups.ChainedSlots`) where
        ``groups`` were built without them: called once, after that test, and the plan's groups
        carry them.
    small_split : int, optional
        The small split size the planner cut phases with too few units at (the solo rule re-cuts
        the groups at it); ``config.kv_split_sizes[1]`` when None.
    """
    g = num_q_heads // num_kv_heads
    for t in q_tiles:
        if t * g > MAX_BLOCK_M:
            raise ValueError(
                f"a tile of {t} queries x GQA ratio {g} needs {t * g} rows, more than the kernel's {MAX_BLOCK_M}"
            )
    rules = PlanRules.defaults() if rules is None else rules
    # tile class of every unit: large (0) above q_tiles[1] queries; packing (when on)
    # builds bins of up to a large tile's rows, which join the class their rows fit
    block_m = (tile_rows(q_tiles[0], g), tile_rows(q_tiles[1], g))
    packing = query_rank is not None and config.pack_tokens > 0
    if packing:
        small = config.kv_split_sizes[1] if small_split is None else small_split
        group_split = _solo_group_split(groups, group_split, block_m, g, num_kv_heads, head_dim, small, config, rules)
    if tile_mode != QUERY_SEPARATED:  # a tree plan's rule: plain decode's chunks are its own
        group_split = _no_sharing_split_cap(groups, group_split, num_kv_heads, config, rules)
    units = _cut_units(groups, int(q_tiles[0]), group_split)
    layout = None
    if packing:
        layout, query_of_rank = _pack_layout(
            units, block_m, g, config, rules, num_kv_heads, head_dim, query_rank, query_of_rank
        )
    small_queries = int(q_tiles[1])
    if max_weighted_reads is not None and (
        _laid_out_weighted_reads(units, layout, block_m, g, small_queries, n_queries, rules.crossover_row_exponent)
        > max_weighted_reads
    ):
        return None
    if fill_slots is not None:
        groups = replace(groups, kv_slots=fill_slots())
    # units left alone are small by their query count, bins (the last ones) by their rows (q_len * g)
    small = (small_queries, block_m[1] // g)
    if layout is None:
        kv_slots, kv_row_mask = groups.kv_slots, np.zeros(0, dtype=np.int32)
        _check_int32_counts(kv_slots.size, units.pair_query.size)
        arrays = _unit_arrays(units, units.kv_len.size, small, None, n_queries)
        n_bins = 0
    else:
        if query_of_rank is None:
            query_of_rank = inverse_permutation(query_rank)
        packed = _packed_arrays(
            units, layout, groups.kv_slot_source, query_rank, query_of_rank, small, n_queries, groups.identity_slots
        )
        arrays, kv_slots, kv_row_mask, n_bins = packed
    ptr = arrays.class_ptr
    masked = (arrays.small_bins < n_bins, arrays.small_bins > 0)
    unit_kv_len = arrays.kv_len
    warps = config.launch_warps(g)
    stages = config.launch_stages(g, head_dim)
    if tile_mode == ALL_LARGE:  # class 1 runs the large tiles: with the large class's warps
        warps = (warps[0], warps[0])
    classes = tuple(
        _tile_class(
            int(q_tiles[c]),
            block_m[c],
            _class_kv_tile(int(kv_tiles[c]), unit_kv_len[ptr[c] : ptr[c + 1]]),
            int(splits[c]),
            int(warps[c]),
            int(stages[c]),
            masked[c],
        )
        for c in (0, 1)
    )
    plan = Plan(
        num_q_heads=int(num_q_heads),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        n_queries=int(n_queries),
        max_slot=int(max_slot),
        kv_indices=kv_slots.astype(np.int32, copy=False),
        kv_row_mask=kv_row_mask,
        unit_kv_start=arrays.kv_start,
        unit_kv_len=arrays.kv_len,
        unit_q_start=arrays.q_start,
        unit_q_len=arrays.q_len,
        pair_query=arrays.pair_query,
        pair_out_row=arrays.out_row,
        query_partial_start=arrays.part_start,
        query_num_partials=arrays.n_part,
        merge_queries=arrays.merge,
        class_unit_ptr=ptr,
        tile_classes=classes,  # type: ignore[arg-type]
        n_partial_rows=arrays.n_rows,
        tile_mode=tile_mode,
        config=config,
        groups=groups,
        edge_assignment=edge_assignment,
        rules=rules,
    )
    plan._planned = True
    return plan


class _Units(NamedTuple):
    """Work units before packing and ordering: unit ``u`` reads ``kv_len[u]`` KV entries from
    ``kv_start[u]`` and serves pairs ``pair_start[u]:pair_start[u] + q_len[u]``, whose queries are
    ``pair_query``."""

    kv_start: np.ndarray
    kv_len: np.ndarray
    pair_start: np.ndarray
    q_len: np.ndarray
    pair_query: np.ndarray


def _cut_units(groups: Groups, tile_q: int, group_split: np.ndarray | int, native: bool = True) -> _Units:
    """Cut every group's queries into tiles of ``tile_q`` queries and its KV into chunks of its
    ``group_split`` tokens; the units in group order, a group's KV chunks outermost. Where some
    group is cut, ``native``: in the compiled loop (``ft_cut_units``) when it is available and
    the groups' arrays are the int64 ones it reads, with the same units."""
    kv_len = groups.kv_len
    q_indptr = groups.q_indptr
    nq = q_indptr[1:] - q_indptr[:-1]
    n_groups = kv_len.size
    if isinstance(group_split, (int, np.integer)):
        split_g = int(group_split)
        one_chunk = not n_groups or (int(np.maximum.reduce(kv_len)) <= split_g and int(np.minimum.reduce(kv_len)) >= 1)
    else:
        split_g = np.asarray(group_split, dtype=np.int64)
        one_chunk = not np.count_nonzero((kv_len > split_g) | (kv_len < 1))
    one_tile = not n_groups or (int(np.maximum.reduce(nq)) <= tile_q and int(np.minimum.reduce(nq)) >= 1)
    if native and not (one_chunk and one_tile):
        got = _cut_units_native(groups, tile_q, split_g)
        if got is not None:
            return got
    tiles = 1 if one_tile else -(-nq // tile_q)

    if one_chunk:
        # one KV chunk per group: a group's units are its query tiles, and the pairs are
        # the groups' query lists back to back
        if one_tile:
            kv_start, u_kv_len, q_first, u_q_len = groups.kv_start, kv_len, q_indptr[:-1], nq
        else:
            u_group = np.arange(n_groups).repeat(tiles)
            first = exclusive_sum(tiles)
            w = np.arange(u_group.size, dtype=np.int64) - first[u_group]
            w *= tile_q
            kv_start = groups.kv_start[u_group]
            u_kv_len = kv_len[u_group]
            q_first = q_indptr[u_group] + w
            u_q_len = nq[u_group] - w
            np.minimum(u_q_len, tile_q, out=u_q_len)
        q0 = int(q_indptr[0]) if q_indptr.size else 0
        unit_pair_start = q_first - q0
        pair_query = groups.q_ids[q0 : q0 + int(np.add.reduce(u_q_len))]
        return _Units(kv_start, u_kv_len, unit_pair_start, u_q_len, pair_query)
    chunks = -(-kv_len // split_g)
    per_group = chunks if one_tile else chunks * tiles
    u_group = np.arange(n_groups).repeat(per_group)
    first = exclusive_sum(per_group)
    w = np.arange(u_group.size, dtype=np.int64) - first[u_group]
    if one_tile:  # a group's units are its KV chunks, each with all its queries
        chunk = w
        q_first = q_indptr[u_group]
        u_q_len = nq[u_group]
    else:
        u_tiles = tiles[u_group]
        chunk = w // u_tiles
        tile = w - chunk * u_tiles
        q_first = q_indptr[u_group] + tile * tile_q
        u_q_len = np.minimum(tile_q, nq[u_group] - tile * tile_q)
    u_split = split_g if isinstance(split_g, int) else split_g[u_group]
    kv_start = groups.kv_start[u_group] + chunk * u_split
    u_kv_len = np.minimum(u_split, kv_len[u_group] - chunk * u_split)
    # pairs, in unit order: unit u's are q_ids[q_first[u]:q_first[u] + u_q_len[u]]
    unit_pair_start = exclusive_sum(u_q_len)
    n_pairs = int(unit_pair_start[-1] + u_q_len[-1]) if u_q_len.size else 0
    pair_pos = (q_first - unit_pair_start).repeat(u_q_len)
    pair_pos += arange_view(n_pairs)
    pair_query = groups.q_ids[pair_pos]
    return _Units(kv_start, u_kv_len, unit_pair_start, u_q_len, pair_query)


def _cut_units_native(groups: Groups, tile_q: int, split_g: np.ndarray | int) -> _Units | None:
    """:func:`_cut_units` by ``ft_cut_units`` (a count, then the units in one int64 buffer), or None
    where it is not available, an array is not the int64 C-contiguous one it reads, or a group is
    empty (numpy's path then runs)."""
    lib = planner_library()
    if lib is None:
        return None
    i64 = np.int64
    kv_start, kv_len, q_indptr, q_ids = groups.kv_start, groups.kv_len, groups.q_indptr, groups.q_ids
    n_groups = kv_len.size
    split, per_group = (split_g, None) if isinstance(split_g, int) else (0, split_g)
    if not c_int64(kv_start, kv_len, q_indptr, q_ids) or (per_group is not None and not c_int64(per_group)):
        return None
    if kv_start.size != n_groups or q_indptr.size != n_groups + 1:
        return None
    if per_group is not None and per_group.size != n_groups:
        return None
    counts = np.empty(2, dtype=i64)
    at = (address(kv_start), address(kv_len), address(q_indptr), address(q_ids))
    split_at = None if per_group is None else address(per_group)
    if lib.ft_cut_units(n_groups, *at, q_ids.size, tile_q, split, split_at, address(counts), *[None] * 5):
        return None
    n_units, n_pairs = counts.tolist()
    out = np.empty(4 * n_units + n_pairs, dtype=i64)  # kv_start, kv_len, pair_start, q_len, pair_query
    o = address(out)
    ptrs = [o + 8 * n_units * k for k in range(5)]
    if lib.ft_cut_units(n_groups, *at, q_ids.size, tile_q, split, split_at, address(counts), *ptrs):
        return None
    return _Units(
        out[:n_units], out[n_units : 2 * n_units], out[2 * n_units : 3 * n_units], out[3 * n_units : 4 * n_units],
        out[4 * n_units :],
    )  # fmt: skip


def _pack_layout(
    units: _Units,
    block_m: tuple[int, int],
    g: int,
    config: FastTreeConfig,
    rules: PlanRules,
    num_kv_heads: int,
    head_dim: int,
    query_rank: np.ndarray,
    query_of_rank: np.ndarray | None,
) -> tuple[BinLayout | None, np.ndarray | None]:
    """The bins the short units are packed into (:func:`fasttree.packing.pack_units`) under
    ``rules``: solo units kept out, balanced runs where bins fill a large tile bigger than the small
    one, wide units packed or whole, whichever costs less (None: nothing is packed), and
    ``query_of_rank`` (computed when the wide-unit choice needed it). The two choices are compared
    as bin layouts (:func:`fasttree.packing.bin_layout`); the caller builds the chosen one's arrays
    (:func:`fasttree.packing.assemble_bins`)."""
    kept_out = _solo_units(units.kv_len, units.q_len, block_m, g, num_kv_heads, head_dim, rules)
    capacity = _pack_capacity(block_m, g)
    balanced = rules.balanced_bins and _bins_fill_a_larger_tile(block_m, g)  # a lone piece: the smaller tile

    def layout(out: np.ndarray | None) -> tuple[np.ndarray, BinLayout | None]:
        eligible, budget = _pack_budget(units.kv_len, config, num_kv_heads, out)
        return eligible, bin_layout(
            kv_len=units.kv_len, pair_start=units.pair_start, q_len=units.q_len, pair_query=units.pair_query,
            eligible=eligible, query_rank=query_rank, capacity=capacity, budget=budget, pairs_in_order=True,
            balanced=balanced, aligned=None if rules.aligned_blocks else False, max_longer=rules.aligned_max_longer,
        )  # fmt: skip

    eligible, chosen = layout(kept_out)
    if rules.wide_units:  # the wide units packed, or whole: the plan that costs less
        wide = units.q_len > capacity
        if np.count_nonzero(wide & eligible):
            _, whole = layout(wide if kept_out is None else kept_out | wide)
            if query_of_rank is None:
                query_of_rank = inverse_permutation(query_rank)
            if _wide_units_whole_pay(chosen, whole, units, query_of_rank, rules.wide_row_tokens):
                chosen = whole
    if rules.unpacked_max_reads and chosen is not None:  # the bins re-read split units' KV: none at all
        if query_of_rank is None:
            query_of_rank = inverse_permutation(query_rank)
        packed_reads, _ = layout_reads_and_rows(chosen, units.kv_len, units.q_len, units.pair_query, query_of_rank)
        if int(np.add.reduce(units.kv_len, dtype=np.int64)) <= rules.unpacked_max_reads * packed_reads:
            chosen = None
    return chosen, query_of_rank


def tile_read_weight(block_m: int, exponent: float) -> float:
    """The crossover test's weight of a KV token read by a tile of ``block_m`` rows:
    ``(block_m / 16) ** exponent`` (:attr:`fasttree.PlanRules.crossover_row_exponent`)."""
    return (block_m / _MIN_BLOCK_M) ** exponent


def _laid_out_weighted_reads(
    units: _Units,
    layout: BinLayout | None,
    block_m: tuple[int, int],
    g: int,
    small_queries: int,
    n_queries: int,
    exponent: float,
    native: bool = True,
) -> float:
    """The KV tokens read by the plan :func:`materialize` builds from ``units`` and ``layout`` (None:
    no bins), each weighted by :func:`tile_read_weight` (with ``exponent``) for its tile class, before
    the plan's arrays:
    units left alone in the small class when they have at most ``small_queries`` queries, bins when
    their rows fit the small tile (:func:`fasttree.packing.bin_rows`). The class-0 sum, then the
    class-1 sum, as the assembled plan's classes give them. ``native``: the two token counts in one
    compiled loop (``ft_layout_class_reads``) when it is available, with the same numbers."""
    sums = _layout_class_reads_native(units, layout, block_m[1] // g, small_queries, n_queries) if native else None
    if sums is not None:
        total, small = sums
    else:
        kv_len, q_len = units.kv_len, units.q_len
        if layout is not None:
            keep = np.ones(kv_len.size, dtype=bool)
            keep[layout.bins.unit] = False
            kv_len, q_len = kv_len[keep], q_len[keep]
        total = int(np.add.reduce(kv_len, dtype=np.int64))
        small = int(np.add.reduce(kv_len[q_len <= small_queries], dtype=np.int64))
        if layout is not None:
            b_tokens, b_rows = bin_rows(layout)
            total += int(np.add.reduce(b_tokens, dtype=np.int64))
            small += int(np.add.reduce(b_tokens[b_rows <= block_m[1] // g], dtype=np.int64))
    w_large, w_small = (tile_read_weight(b, exponent) for b in block_m)
    return 0.0 + (total - small) * w_large + small * w_small


def _layout_class_reads_native(
    units: _Units, layout: BinLayout | None, small_rows: int, small_queries: int, n_queries: int
) -> tuple[int, int] | None:
    """``ft_layout_class_reads``' (all, small-class) token counts, or None where the compiled loop
    is not available or the arrays are not the int64 / bool ones it reads."""
    lib = planner_library()
    if lib is None:
        return None
    i64 = np.int64
    kv_len, q_len = units.kv_len, units.q_len
    arrays = [kv_len, q_len]
    if layout is not None:
        bins = layout.bins
        arrays += [bins.unit, bins.lowest, bins.bits, bins.tokens]
        if bins.new_bin.dtype != np.bool_ or not bins.new_bin.flags.c_contiguous:
            return None
    if not c_int64(*arrays):
        return None
    keep = np.empty(kv_len.size, dtype=np.int8)
    out = np.empty(2, dtype=i64)
    if layout is None:
        n_pieces, pieces, capacity, sor = 0, [None] * 5, 1, None
    else:
        n_pieces = bins.unit.size
        pieces = [address(bins.unit), address(bins.lowest), address(bins.bits), address(bins.new_bin.view(np.int8)),
                  address(bins.tokens)]  # fmt: skip
        sor = layout.start_of_rank
        if sor is not None and (not c_int64(sor) or sor.size != n_queries):
            return None
        capacity = layout.capacity
    got = lib.ft_layout_class_reads(
        kv_len.size, address(kv_len), address(q_len), small_queries, n_pieces, *pieces, n_queries, capacity,
        None if sor is None else address(sor), small_rows, address(keep), address(out),
    )  # fmt: skip
    return None if got else (int(out[0]), int(out[1]))


class _UnitArrays(NamedTuple):
    """A plan's int32 unit arrays (units in class order), pair queries and partial rows
    (:class:`Plan`'s fields of the same meaning), its number of partial rows, its class boundaries
    ``(0, n_large, n_units)`` and the bins in the small class."""

    kv_start: np.ndarray
    kv_len: np.ndarray
    q_start: np.ndarray
    q_len: np.ndarray
    pair_query: np.ndarray
    out_row: np.ndarray
    part_start: np.ndarray
    n_part: np.ndarray
    merge: np.ndarray
    n_rows: int
    class_ptr: tuple[int, int, int]
    small_bins: int


def _unit_arrays(
    units: _Units,
    n_kept: int,
    small_queries: tuple[int, int],
    pair_present: np.ndarray | None,
    n_queries: int,
    native: bool = True,
) -> _UnitArrays:
    """The plan's int32 arrays of ``units`` in class order (:func:`_class_order`), their pairs
    (``pair_present``: which serve a query, None: every one) and partial rows
    (:func:`_partial_rows`), for at most ``2**31 - 1`` pairs. A unit is in the small class when its
    queries are at most ``small_queries[0]`` (the first ``n_kept`` units: left alone) or
    ``small_queries[1]`` (the others: bins). ``native``: in one compiled loop (``ft_unit_arrays``)
    when it is available and the arrays are the int64 / bool ones it reads, with the same arrays."""
    got = _unit_arrays_native(units, n_kept, small_queries, pair_present, n_queries) if native else None
    if got is not None:
        return got
    q_len = units.q_len
    u_small = np.empty(q_len.size, dtype=bool)
    np.less_equal(q_len[:n_kept], small_queries[0], out=u_small[:n_kept])
    np.less_equal(q_len[n_kept:], small_queries[1], out=u_small[n_kept:])
    uorder, ptr = _class_order(u_small, units.kv_len)
    rows = _partial_rows(units.pair_query, pair_present, n_queries)
    i32 = np.int32
    return _UnitArrays(
        kv_start=units.kv_start[uorder].astype(i32),
        kv_len=units.kv_len[uorder].astype(i32),
        q_start=units.pair_start[uorder].astype(i32),
        q_len=q_len[uorder].astype(i32),
        pair_query=units.pair_query.astype(i32),
        out_row=rows.out_row,
        part_start=rows.part_start.astype(i32),
        n_part=rows.n_part.astype(i32),
        merge=rows.multi.nonzero()[0].astype(i32),
        n_rows=rows.n_rows,
        class_ptr=ptr,
        small_bins=int(np.count_nonzero(u_small[n_kept:])),
    )


def _unit_arrays_native(
    units: _Units,
    n_kept: int,
    small_queries: tuple[int, int],
    pair_present: np.ndarray | None,
    n_queries: int,
) -> _UnitArrays | None:
    """:func:`_unit_arrays` by ``ft_unit_arrays``, or None where it is not available, an array is
    not the int64 (``pair_present``: bool) C-contiguous one it reads, or a length or index is out
    of range. The outputs are views of one int32 buffer (one address for the call)."""
    lib = planner_library()
    if lib is None:
        return None
    i64 = np.int64
    kv_start, kv_len, pair_start, q_len, pair_query = units
    n_units, n_pairs = kv_len.size, pair_query.size
    if not c_int64(kv_start, kv_len, pair_start, q_len, pair_query):
        return None
    if kv_start.size != n_units or pair_start.size != n_units or q_len.size != n_units or not 0 <= n_kept <= n_units:
        return None
    present = None
    if pair_present is not None:
        if pair_present.dtype != np.bool_ or not pair_present.flags.c_contiguous or pair_present.size != n_pairs:
            return None
        present = address(pair_present.view(np.int8))
    u2, p2 = 4 * n_units, 4 * n_units + 2 * n_pairs
    out = np.empty(p2 + 3 * n_queries, dtype=np.int32)
    scratch = np.empty(n_queries + 3 * n_units + 4, dtype=i64)  # per query, the sort's work, the counts
    base, s = address(out), address(scratch)
    got = lib.ft_unit_arrays(
        n_units, n_kept, small_queries[0], small_queries[1], address(kv_start), address(kv_len), address(pair_start),
        address(q_len), n_pairs, address(pair_query), present, n_queries, base, base + 4 * n_units,
        base + 8 * n_units, base + 12 * n_units, base + 4 * u2, base + 4 * (u2 + n_pairs), base + 4 * p2,
        base + 4 * (p2 + n_queries), base + 4 * (p2 + 2 * n_queries), s, s + 8 * n_queries,
        s + 8 * (n_queries + 3 * n_units),
    )  # fmt: skip
    if got == -2:
        raise AssertionError("internal error: a query has no work unit")
    if got:
        return None
    n_rows, n_merge, n_large, small_bins = scratch[-4:].tolist()
    q0 = p2 + n_queries
    return _UnitArrays(
        out[:n_units], out[n_units : 2 * n_units], out[2 * n_units : 3 * n_units], out[3 * n_units : u2],
        out[u2 : u2 + n_pairs], out[u2 + n_pairs : p2], out[p2:q0], out[q0 : q0 + n_queries],
        out[q0 + n_queries : q0 + n_queries + n_merge], n_rows, (0, n_large, n_units), small_bins,
    )  # fmt: skip


def _check_int32_counts(n_entries: int, n_pairs: int) -> None:
    """Raise ValueError where a plan's KV entries or pairs (so its partial rows, at most the pairs)
    do not fit the int32 arrays."""
    if max(n_entries, n_pairs) > 0x7FFFFFFF:
        raise ValueError("the plan needs more than 2**31 KV entries, pairs or partial rows; split the batch")


class _Packed(NamedTuple):
    """A packed plan's unit arrays (:func:`_unit_arrays`), KV entries (int32 [n_entries]), their row
    masks (int32 [n_entries]) and its number of bins."""

    arrays: _UnitArrays
    kv_slots: np.ndarray
    kv_row_mask: np.ndarray
    n_bins: int


def _packed_arrays(
    units: _Units,
    layout: BinLayout,
    kv_slots: np.ndarray | ChainedSlots,
    query_rank: np.ndarray,
    query_of_rank: np.ndarray,
    small_queries: tuple[int, int],
    n_queries: int,
    identity_slots: int = 0,
    native: bool = True,
) -> _Packed:
    """The plan's arrays with ``layout``'s bins: the packed units
    (:func:`fasttree.packing.assemble_bins`, pairs in unit order) and their :func:`_unit_arrays`.
    ``native``: in one compiled call (``ft_packed_plan``) when it is available and the arrays are
    the ones it reads, with the same arrays; else (or where it refuses the input) step by step.

    Parameters
    ----------
    units : _Units
        The cut units (int64 arrays, pairs in unit order).
    layout : BinLayout
        From :func:`fasttree.packing.bin_layout` of ``units``.
    kv_slots : ndarray, int32 [n_slots], or ChainedSlots
        The groups' KV slots (the compiled call reads a :class:`fasttree.groups.ChainedSlots`' two
        parts as they are; the steps join them).
    query_rank, query_of_rank : ndarray, int64 [n_queries]
        Each query's DFS rank and the query at each rank.
    small_queries : tuple of int
        The small class's limits, as :func:`_unit_arrays` takes them.
    n_queries, identity_slots : int

    Returns
    -------
    _Packed
    """
    got = _packed_arrays_native(units, layout, kv_slots, query_of_rank, small_queries, n_queries) if native else None
    if got is not None:
        return got
    packed = assemble_bins(
        layout, kv_start=units.kv_start, kv_len=units.kv_len, pair_start=units.pair_start, q_len=units.q_len,
        pair_query=units.pair_query, kv_slots=np.asarray(kv_slots), query_rank=query_rank,
        query_of_rank=query_of_rank, pairs_in_order=True, identity_slots=identity_slots, native=native,
    )  # fmt: skip
    _check_int32_counts(packed.kv_slots.size, packed.pair_query.size)
    units = _Units(packed.kv_start, packed.kv_len, packed.pair_start, packed.q_len, packed.pair_query)
    arrays = _unit_arrays(units, packed.n_kept, small_queries, packed.pair_present, n_queries, native=native)
    return _Packed(arrays, packed.kv_slots, packed.kv_row_mask, packed.kv_len.size - packed.n_kept)


def _packed_plan_sizes(n_units: int, n_pairs: int, n_pieces: int, capacity: int, n_queries: int) -> tuple[int, int]:
    """Entries of ``ft_packed_plan``'s int64 work memory and int32 output (``PACKED_PLAN_WORK`` and
    ``PACKED_PLAN_OUT`` of ``planner.c``): at most ``n_units + n_pieces`` packed units (the kept
    ones, then the bins) of at most ``n_pairs + capacity * n_pieces`` pairs."""
    max_units, max_pairs = n_units + n_pieces, n_pairs + capacity * n_pieces
    work = 10 + 7 * max_units + max_pairs + n_queries + (n_units + max_pairs + max_units + 7) // 8
    return work, 4 * max_units + 2 * max_pairs + 3 * n_queries


def _packed_arrays_native(
    units: _Units,
    layout: BinLayout,
    kv_slots: np.ndarray | ChainedSlots,
    query_of_rank: np.ndarray,
    small_queries: tuple[int, int],
    n_queries: int,
) -> _Packed | None:
    """:func:`_packed_arrays` by ``ft_packed_plan``, or None where it is not available, an array is
    not the int64 (the slots: int32; ``new_bin``: bool) C-contiguous one it reads, the lengths
    differ, or the call refuses the input (then the steps run and say what is wrong). The unit
    arrays are views of one int32 buffer; the entries and masks come from the reused host memory
    (:func:`fasttree.host_arrays.entry_array`). A :class:`fasttree.groups.ChainedSlots` is read as
    its head and the tail's runs of it (:func:`_slot_runs`), not joined."""
    lib = planner_library()
    if lib is None:
        return None
    bins, capacity, sor = layout
    kv_start, kv_len, pair_start, q_len, pair_query = units
    unit, lowest, bits, new_bin, tokens = bins
    head, n_slots, runs = _slot_runs(kv_slots)
    n_units, n_pairs, n_pieces = kv_len.size, pair_query.size, unit.size
    if not (
        c_int64(kv_start, kv_len, pair_start, q_len, pair_query, query_of_rank, unit, lowest, bits, tokens, runs)
        and c_int32(head) and new_bin.dtype == np.bool_ and new_bin.flags.c_contiguous
        and kv_start.size == n_units and pair_start.size == n_units and q_len.size == n_units
        and lowest.size == n_pieces and bits.size == n_pieces and new_bin.size == n_pieces
        and tokens.size == n_pieces and query_of_rank.size == n_queries
        and (sor is None or (c_int64(sor) and sor.size == n_queries))
    ):  # fmt: skip
        return None
    b_total = int(np.add.reduce(tokens))
    n_head, n_runs = head.size, runs.size // 2
    n_work, n_out = _packed_plan_sizes(n_units, n_pairs, n_pieces, capacity, n_queries)
    slots, mask = entry_array(n_slots + b_total), entry_array(n_slots + b_total)
    out = np.empty(n_out, dtype=np.int32)
    work = work_array(n_work)
    got = lib.ft_packed_plan(
        n_units, address(kv_start), address(kv_len), address(pair_start), address(q_len), n_pairs,
        address(pair_query), n_slots, address(head), n_head, n_runs, address(runs), address(runs) + 8 * n_runs,
        n_queries, address(query_of_rank), capacity, None if sor is None else address(sor), n_pieces, address(unit),
        address(lowest), address(bits), address(new_bin.view(np.int8)), address(tokens), b_total, small_queries[0],
        small_queries[1], address(slots), address(mask), address(out), address(work),
    )  # fmt: skip
    if got:
        return None
    n_bins, n_kept, k_total, _, k_pairs, b_pairs, n_rows, n_merge, n_large, small_bins = work[:10].tolist()
    n_entries = (k_total if 2 * k_total < n_slots else n_slots) + b_total
    nu, np_ = n_kept + n_bins, k_pairs + b_pairs
    _check_int32_counts(n_entries, np_)
    u4, q0 = 4 * nu, 4 * nu + 2 * np_
    arrays = _UnitArrays(
        out[:nu], out[nu : 2 * nu], out[2 * nu : 3 * nu], out[3 * nu : u4], out[u4 : u4 + np_], out[u4 + np_ : q0],
        out[q0 : q0 + n_queries], out[q0 + n_queries : q0 + 2 * n_queries],
        out[q0 + 2 * n_queries : q0 + 2 * n_queries + n_merge], n_rows, (0, n_large, nu), small_bins,
    )  # fmt: skip
    return _Packed(arrays, slots[:n_entries], mask[:n_entries], n_bins)


#: The runs of a slot list without a tail (:func:`_slot_runs`): no run, one offset (0).
_NO_RUNS = np.zeros(1, dtype=np.int64)
_NO_RUNS.flags.writeable = False


def _slot_runs(kv_slots: np.ndarray | ChainedSlots) -> tuple[np.ndarray, int, np.ndarray]:
    """A slot list as ``ft_packed_plan`` reads it: ``(head, n_slots, runs)``, the list's entries
    being ``head`` (int32 [n_head]) and then the runs of it that :attr:`fasttree.groups.ChainedSlots.runs`
    describes (int64 [2 * n_runs + 1]); an array, or a ``ChainedSlots`` without runs (joined), is
    all head."""
    if isinstance(kv_slots, ChainedSlots):
        runs = kv_slots.runs
        if runs is not None:
            return kv_slots.head, kv_slots.size, runs
        kv_slots = kv_slots.array()
    return kv_slots, kv_slots.size, _NO_RUNS


class _Rows(NamedTuple):
    """Partial rows of a plan (see :class:`Plan`): each pair's ``out_row``, and per query its first
    row, its number of partials and whether it has several (``multi``)."""

    out_row: np.ndarray
    part_start: np.ndarray
    n_part: np.ndarray
    multi: np.ndarray
    n_rows: int


def _partial_rows(pair_query: np.ndarray, pair_present: np.ndarray | None, n_queries: int) -> _Rows:
    """Partial rows, contiguous per query, in pair order within a query; ``pair_present`` (None:
    every pair) marks the pairs that serve a query."""
    n_pairs = pair_query.size
    present = pair_query if pair_present is None or np.count_nonzero(pair_present) == n_pairs else None
    n_present = pair_query[pair_present] if present is None else present
    n_part = np.bincount(n_present, minlength=n_queries)
    if n_part.size != n_queries or np.minimum.reduce(n_part) < 1:
        raise AssertionError("internal error: a query has no work unit")
    multi = n_part >= 2
    rows_per_query = n_part * multi
    part_start = exclusive_sum(rows_per_query)
    n_rows = int(part_start[-1] + rows_per_query[-1])
    n_present_pairs = n_present.size
    if n_present_pairs == n_pairs:
        out_row = np.empty(n_pairs, dtype=np.int32)
        rows_out = out_row
    else:
        out_row = np.full(n_pairs, ABSENT_ROW, dtype=np.int32)
        rows_out = np.empty(n_present_pairs, dtype=np.int32)
    if not n_rows:
        rows_out.fill(-1)
    else:
        # a stable sort of the pairs by query (radix sort on 16-bit keys when they fit)
        order = stable_argsort(n_present, n_queries)
        q_sorted = n_present[order]
        # row of the k-th pair in sorted order: part_start[q] + k - seg_start[q]
        row = (part_start - exclusive_sum(n_part))[q_sorted]
        row += arange_view(n_present_pairs)
        rows_out[order] = row if n_rows == n_present_pairs else np.where(multi[q_sorted], row, -1)
    if rows_out is not out_row:
        out_row[pair_present] = rows_out
    return _Rows(out_row, part_start, n_part, multi, n_rows)


def _class_order(u_small: np.ndarray, u_kv_len: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The units' order (tile class 0 first, within a class longest KV first, stable) and the
    class boundaries ``(0, n_large, n_units)``."""
    n_units = u_small.size
    n_large = int(n_units - np.count_nonzero(u_small))
    if n_units and int(np.maximum.reduce(u_kv_len)) < 1 << 15 and int(np.minimum.reduce(u_kv_len)) >= 0:
        # 16-bit keys (radix sort): the class bit, then 0x7FFF - kv_len
        key = np.where(u_small, 0xFFFF, 0x7FFF) - u_kv_len
        uorder = key.astype(np.uint16).argsort(kind="stable")
    else:
        uorder = np.lexsort((-u_kv_len, u_small))
    return uorder, (0, n_large, n_units)


def _wide_units_whole_pay(
    packed: BinLayout | None,
    whole: BinLayout | None,
    units: _Units,
    query_of_rank: np.ndarray,
    row_tokens: float,
) -> bool:
    """Whether the plan with the wide units whole (``whole``) costs less than the one with them
    packed (the KV tokens read plus ``row_tokens`` per partial row: one per work unit of each query
    with two or more, :func:`fasttree.packing.layout_reads_and_rows`), both from the bins' layouts
    before their arrays are built. None:
    nothing was packed, the plan has ``units`` as they are. On the H200 paper suite, keeping them
    whole lost where it saved at most 7.5 KV tokens per partial row it added and won from 9.0 up; on
    held-out MHA trees the choice ran at 0.95x the packed plans' time (the best of the two per tree:
    0.94x)."""

    def cost(layout: BinLayout | None) -> float:
        reads, rows = layout_reads_and_rows(layout, units.kv_len, units.q_len, units.pair_query, query_of_rank)
        return reads + row_tokens * rows

    return cost(whole) < cost(packed)


@functools.lru_cache(maxsize=512)
def _tile_class(
    queries: int, block_m: int, block_n: int, split: int, num_warps: int, num_stages: int, masked: bool
) -> TileClass:
    """A :class:`TileClass` (immutable), shared by the plans that have the same one."""
    return TileClass(
        queries=queries, block_m=block_m, masked=masked, block_n=block_n, split=split,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
