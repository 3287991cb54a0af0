"""The planning rules that are not tuned: one frozen value, passed to :func:`fasttree.plan`.

:class:`fasttree.FastTreeConfig` holds what the tuner searches (cost weights, tiles, splits,
thresholds, packing). :class:`PlanRules` holds the rest of what decides a plan: rules that were
measured once on the H200 and kept (``docs/history.md`` has the measurements), with the
constants they use. Two sets are in use: :meth:`PlanRules.defaults` for :func:`fasttree.plan` and
:func:`fasttree.tree_attention`, and :meth:`PlanRules.runtime` for the serving runtime, whose
persistent launches gain nothing from three of the rules. A plan records its rules
(:attr:`fasttree.Plan.rules`), so two plans of one tree differ only where their config or rules do.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from .validation import check_int, check_int_pair, check_number

__all__ = ["ADDED_AS", "PlanRules", "capped_small_split", "deciding_fields", "decode_programs_per_sm", "wide_head_tile"]

#: Field metadata key of a rule added switched off: the value it was added with, at which it
#: changed no plan of the defaults (:func:`deciding_fields` leaves it out there).
ADDED_AS = "added_as"


#: The integer rules that take 0 (the others are positive).
_NON_NEGATIVE_INTS = (
    "solo_split_max_kv_heads",
    "wide_head_small_split",
    "crossover_wave_programs",
)


@dataclass(frozen=True)
class PlanRules:
    """Planning rules beyond the tuned config, with the constants they use.

    Parameters
    ----------
    solo_units : bool
        Keep work units of at least ``solo_min_tokens`` KV tokens whose rows fit the small tile
        out of packed bins that fill the large tile, when together they would waste at least
        ``solo_min_waste_flops`` of matrix work there (a bin costs every KV entry its full
        tile of rows). False: such units are packed like any other short unit.
    solo_min_tokens : int
        KV tokens from which a unit may stay out of large-tile bins.
    solo_min_waste_flops : float
        Matrix work (flops, all KV heads) the bins must waste on such units before they stay out.
    solo_min_share : float
        ... or the share of the units' KV tokens the solo ones hold, from which they stay out
        whatever the waste: with one KV head a batch of independent requests wastes little
        matrix work, yet bins of four requests ran it at 0.78-0.88x of query-separated decode on
        the H200, and keeping them out 1.02-1.18x faster; at 0.5 the share also took random
        paper-like trees at GQA 8 and 16 to 0.84x. Above 1: never.
    solo_split_max_kv_heads : int
        With at most this many KV heads, the groups the solo rule keeps out are cut as plain
        split-KV decode cuts them (by the longest; :func:`fasttree.plan_arrays._solo_group_split`),
        not at the small split size: on the H200 their 128-token units made batches of
        independent requests at 16/1, 32/2 and 64/4 heads 0.73-0.85x of query-separated decode,
        and cutting them into their share of the programs instead measured 0.93-0.96x of this
        at 1 and 2 KV heads. 0: never.
    solo_recut : bool
        With more KV heads, the solo groups cut at the small split size are cut into their share
        of ``para_threshs1[1]`` programs instead (H200: 1.26x on 32 x 4k-token requests at 64/4
        heads, 1.03x on 16 x 2k at 64/4). False: they keep their split.
    solo_recut_programs : float
        ... and so are solo groups at any split where their cut makes more than this many times
        ``para_threshs1[1]`` programs (H200: 1.02-1.04x on three batches at 32/8 and 28/4 heads,
        0.99x on a fourth; a cut of 1.9 times, re-cut, measured 0.93x).
    crossover_margin : float
        At 16 or more query heads per KV head, :func:`fasttree.plan` returns plain split-KV
        decode's plan (:func:`fasttree.plan_query_separated`) where the tree plan costs more than
        this many times as much by the crossover test
        (:func:`fasttree.planner._decode_weighted_reads`: KV tokens read, each weighted by
        ``(block_m / 16) ** crossover_row_exponent`` for its tile's rows). 0: never.
    crossover_row_exponent : float
        That weight's exponent. 0.63 (a 64-row tile's token costs 2.4 times a 16-row tile's): on an
        H100 the trees at GQA 16 that the test kept at 0.5, timed against query-separated decode,
        put a 64-row tile's token at 2.3-2.9 times a 16-row tile's with the Triton kernel and
        2.1-2.4 times with the sm_90 Gluon stage 1 at head dim 128 (trees scored 0.94-1.00 ran
        0.76-0.86x of decode). On a fresh draw (480 trees at GQA 16, D 64/128/256) 0.63 changed 21,
        1.17x geomean against 0.5, every one within 0.983x of decode (13 of them below 0.97x at
        0.5); two whose tree plans had beaten decode (1.24x, 1.12x) lost that (``docs/history.md``).
        The weight alone predicts small trees loosely: their implied 64-row weight ranged 0.9-4.5.
    crossover_wave_programs : int
        A second crossover test, at every GQA ratio: where the tree plan and decode's plan each
        have at most this many programs (units x KV heads: about one wave, where a step lasts
        about as long as its longest program) and decode's longest program reads fewer KV tiles
        than the tree plan's (two or more), :func:`fasttree.plan` returns decode's plan, unless
        decode merges partial results and the tree plan does not; 0: off
        (:func:`fasttree.planner.decode_shorter_in_one_wave`). 132 by default: every tree plan it
        sends to decode on the committed held-out A/B rows (H100 and H200) ran 0.71-0.95x of
        decode's time, and on two fresh H100 draws the 60 trees it changes ran 1.23x geomean, each
        1.07x or faster (``docs/history.md``). Off in :meth:`runtime`'s fixed launch slots, where
        it was not timed.
    crossover_merge_free_decode : bool
        In that one-wave test, also decode's plan where decode merges no partial results and the
        tree plan does, whatever their KV tiles. Within one wave decode merges nothing only when
        every query's context fits one KV tile (its chunks split any longer context), so the tree
        plan's sharing saves at most a tile per query while its merge launch costs a launch's
        latency: on an H100, two such trees (2 queries of up to 35 tokens at 28/4 D 128, 6 of up to 55
        at 32/8 D 256) ran 0.67x and 0.70x of decode's time. True by default: on two fresh draws of
        small random forests (H100, 3 instances) 1.42x and 1.49x on the 42 and 30 trees it changed,
        each 1.13x or faster, at decode's time; no suite case changes (``docs/history.md``). False:
        the test as before.
    unpacked_max_reads : float
        Packing splits a unit with more queries than a bin holds into one piece per bin, each
        reading the unit's KV again. Where the plan's units without bins would read at most this
        many times the KV tokens of the packed plan, the plan packs nothing (0: never). Added off
        for a GPU A/B: on the H200 headroom sweep (kernel version 30) the three trees where this held
        at 0.9 and a config without packing was timed ran 1.17-1.28x faster without
        (``docs/history.md``).
    wide_units : bool
        Units with more queries than a packed bin holds (MHA's large-tile units) are either
        packed (cut into one piece per block of queries, each reading the unit's KV) or kept
        whole in the large tile (read once, one partial row more per query): True picks the
        plan that costs less in KV tokens read plus ``wide_row_tokens`` per partial row;
        False always packs them.
    wide_row_tokens : float
        KV tokens (per KV head) whose reads cost as much as one partial row, in that choice.
    aligned_blocks : bool
        Packing cuts its blocks of consecutive queries where no short unit's queries continue,
        instead of every ``capacity`` queries, where the bins then read no more KV and leave
        the longest unit at most ``aligned_max_longer`` times as long. False: fixed blocks.
    aligned_max_longer : float
        The longest unit the aligned blocks may leave, relative to the fixed blocks'.
    balanced_bins : bool
        Where packed bins fill a large tile bigger than the small one (GQA with two tile
        classes), a block of queries is cut into bins of about equal tokens, so that no lone
        piece is left for a second tile class and a merge (H200: the paper's GQA-16 deep trees
        0.79-0.85x). False fills every bin up to the token budget, as plans were made before
        the rule: the latency model re-plans older traces with it.
    whole_groups : bool
        Cut long groups at the big split size only where their tile class needs the parallelism
        (the next two fields); False always cuts them, as the published planner and plans before
        the rule did (older traces).
    whole_groups_min_items : tuple of (int, int)
        Groups longer than the big split size are cut at it only in a tile class that would,
        uncut, have fewer than these factors (large, small class) times ``para_threshs1``
        units x KV heads ...
    whole_groups_max_tail : float
        ... or whose longest group would hold more than this many times the class's KV x heads
        over ``para_threshs1`` (uncut, it would be the launch's tail).
    all_large_without_large : bool
        Whether a plan whose groups are all small (no unit in the large phase) still moves every
        group to the large tiles when the small phase has fewer than ``para_threshs2[1]`` units
        (the all-large tile mode, the published planner's choice); False plans it all-small
        (16-row tiles for its groups and for the bins packed from them). One launch runs such a
        plan either way, so the large tiles only add idle rows. False for ``ft.plan``: on an H100,
        1.17-1.20x geomean on the held-out trees it changed in three draws (122 trees of 1-16
        queries; the third draw, not used for any choice, 52 trees, worst 1.002x), two trees
        below 0.97x (0.955x, 0.970x: 6.5 and 5.4 us). True for the runtime, where it was not
        timed (:meth:`runtime`).
    wide_head_kv_tile : int
        At head dims above 128, the KV tile (tokens) a launch of 32 or more rows runs at most
        (:func:`fasttree.launch_rules.launch_kv_tile`): a power of two in [16, 512], or 0 for the
        plan's own tile. On sm_90 the 64-row tile at head dim 256 with 64-token tiles takes 164 KB
        of shared memory at 3 stages (one program per SM), with 32-token tiles 98 KB (two). 32 by
        default: on an H100, 1.00-1.56x on 36 of the 39 held-out D 256 trees it changed (two
        seeds); slower on three: 0.94x, 0.73x (a launch bound by one 6,747-token unit) and an
        all-large MHA tree whose 64-row tiles then ran at 2 warps (``docs/history.md``).
    decode_split_by_context : bool
        How query-separated decode (:func:`fasttree.plan_query_separated`, also the plan the
        crossover test picks) sizes its default chunks for about four waves of programs: False
        cuts the longest context into ``ceil(4 x SMs / (queries x KV heads))`` chunks, which is one
        chunk per query once the queries x KV heads alone reach ``4 x SMs`` (each query's context
        whole: the longest is the launch's tail); True there caps the chunk at ``ceil(context x KV
        heads / (4 x SMs))`` tokens for the summed context, rounded up to the KV tile, where that
        is at most four fifths of the longest context
        (:func:`fasttree.query_separated.query_separated_split`; smaller batches keep the
        default's chunks: capped, small forests lost up to 0.93x). Plain decode's plans only: a
        tree plan's solo units keep the longest context's chunks (capped too, they measured
        0.91-0.97x on no-sharing batches). On random forests at GQA 16 that the crossover sends to
        plain decode (H100, two fresh draws) 1.28-1.32x on the trees it changed, none below 0.97x
        (``docs/history.md``).
    equal_lengths_one_wave : bool
        How plain decode (:func:`fasttree.plan_query_separated`) and a tree plan whose groups are all
        solo units (a batch without sharing) chunk a batch whose contexts are equal to within one
        KV tile: False as above; True, the smallest multiple of the KV tile whose chunks of every
        context x KV heads fit one wave of the launch at :func:`decode_programs_per_sm` programs
        per SM (head dims above 64 up to 128), as FlashInfer's batch decode sizes its own. On
        mixed lengths one wave waits for the longest chunk (0.993x, 14 of 47 below 0.97x on a fresh
        draw of no-sharing batches). True by default: on fresh draws of equal-length batches (H100,
        1k-4k tokens) it ran 1.01-1.19x on every changed batch at head dim 128 and lost up to 0.89x
        at head dim 256, where it no longer applies; a further draw at head dims up to 128, not
        used for that choice, confirmed it (1.036-1.090x on 45 changed batches, worst 0.985x;
        ``docs/history.md``). Not in :meth:`runtime`'s fixed launch slots, where it was not timed.
    no_sharing_split_by_context : bool
        In a tree plan without sharing (every group one query's) whose groups x KV heads alone fill
        ``para_threshs1[1]`` programs, every group's split at most plain decode's chunk by the
        summed context (:func:`fasttree.plan_arrays.context_capped_split`, as
        ``decode_split_by_context`` cuts plain decode), where that chunk is at most four fifths of
        the longest context. Plain decode's own plan keeps its chunks. Otherwise such a batch keeps
        its longest requests whole (the phase's whole groups, the solo rule's one chunk each), a
        launch whose tail is the longest request: on the H200, batches of 390-700 requests of
        16-4k tokens ran 0.71-0.84x of plain decode, whose chunks were 1-2k. True by default: on
        two fresh draws of no-sharing batches (H100, 3 instances) it ran 1.013x and 1.068x on the
        10 and 11 trees it changed, none below 0.998x, up to 1.32x (``docs/history.md``); no tree
        with sharing changes. Not in :meth:`runtime`'s fixed launch slots, where it was not timed.
    sm90_stage1 : bool
        Whether the 64-row tile class's stage 1 runs the warp-specialized Gluon kernel
        (:mod:`fasttree.kernels.tree_attention_sm90`) on sm_90 GPUs at head dim 128
        (:func:`fasttree.launch_rules.warp_specialized_stage1`); other classes, head dims and GPUs,
        and the CPU interpreter, keep the Triton kernel. True by default: through
        ``tree_attention`` on an H100 it ran 1.07x as fast as the Triton kernel on the 83 D 128
        trees (fp16 and bf16) it changed in the suites and two fresh draws, none below 0.99x, and
        1.10x on the 52 of a third draw, not used for the choice (worst 0.996x); at D 256 it lost
        (0.91x) and at D 64 it gained 1.03x with a loss, so it runs at D 128 only
        (``docs/history.md``). False: the Triton kernel everywhere.
    wide_head_small_split : int
        At head dims above 128, the small split size (``FastTreeConfig.kv_split_sizes[1]``: KV
        tokens per unit of a phase with too few units) at most this (:func:`capped_small_split`), or 0
        for the config's own ...
    wide_head_small_split_programs : int
        ... in plans whose units x KV heads at the config's split sizes are at most this many (a
        launch that leaves most SMs idle) and which merge partial results there already (a cap
        that cuts a plan with no merge adds the merge launch). 64 and 24 by default: on an H100,
        on the held-out D 256 trees it changes (2-15 queries, up to 3k tokens; seeds 44000-46000
        chose the merge condition, 47000-48000 checked it), 1.18x geomean on 133 trees, 130 of
        them 1.00-1.32x (to decode's time), three 0.91-0.95x (``docs/history.md``). In every plan
        it lost (1.037x, 11 of 75 trees below 0.97x). Not in :meth:`runtime`'s fixed launch slots,
        where it was not timed.
    """

    solo_units: bool = True
    solo_min_tokens: int = 128
    solo_min_waste_flops: float = 4e9
    solo_min_share: float = 0.9
    solo_split_max_kv_heads: int = 2
    solo_recut: bool = True
    solo_recut_programs: float = 2.0
    crossover_margin: float = 1.03
    wide_units: bool = True
    wide_row_tokens: float = 8.5
    aligned_blocks: bool = True
    aligned_max_longer: float = 1.1
    balanced_bins: bool = True
    whole_groups: bool = True
    whole_groups_min_items: tuple[int, int] = (1, 2)
    whole_groups_max_tail: float = 2.0
    all_large_without_large: bool = False
    wide_head_kv_tile: int = 32
    # rules added switched off: ADDED_AS holds the value each was added with (it changed no default
    # plan); a default away from it is a rule adopted since
    wide_head_small_split: int = field(default=64, metadata={ADDED_AS: 0})
    wide_head_small_split_programs: int = field(default=24, metadata={ADDED_AS: 24})
    decode_split_by_context: bool = field(default=True, metadata={ADDED_AS: False})
    equal_lengths_one_wave: bool = field(default=True, metadata={ADDED_AS: False})
    no_sharing_split_by_context: bool = field(default=True, metadata={ADDED_AS: False})
    sm90_stage1: bool = field(default=True, metadata={ADDED_AS: False})
    crossover_row_exponent: float = field(default=0.63, metadata={ADDED_AS: 0.5})
    crossover_wave_programs: int = field(default=132, metadata={ADDED_AS: 0})
    crossover_merge_free_decode: bool = field(default=True, metadata={ADDED_AS: False})
    unpacked_max_reads: float = field(default=0.0, metadata={ADDED_AS: 0.0})

    def __post_init__(self) -> None:
        for f in fields(self):
            name, value = f"PlanRules.{f.name}", getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be a bool, got {value!r}")
            elif f.name == "whole_groups_min_items":
                value = check_int_pair(name, value, minimum=0)
            elif f.name in _NON_NEGATIVE_INTS:
                value = check_int(name, value, minimum=0, expected="a non-negative integer")
            elif f.name == "wide_head_kv_tile":
                value = check_int(name, value, minimum=0, expected="0 or a power of two in [16, 512]")
                if value and (value & (value - 1) or not 16 <= value <= 512):
                    raise ValueError(f"{name} must be 0 or a power of two in [16, 512], got {value}")
            elif f.type == "int":
                value = check_int(name, value, minimum=1, expected="a positive integer")
            else:
                value = check_number(name, value, minimum=0.0)
            object.__setattr__(self, f.name, value)

    @classmethod
    def defaults(cls) -> PlanRules:
        """The rules of :func:`fasttree.plan` and :func:`fasttree.tree_attention`."""
        return _DEFAULTS

    @classmethod
    def runtime(cls, stage1_launches: int, *, variants: bool = False) -> PlanRules:
        """The rules of :class:`fasttree.runtime.TreeAttentionRuntime` for its resolved number of
        stage-1 launches (1 or 2): with launch ``variants`` (its default, ``max_variants`` > 0) it
        runs ``tree_attention``'s own launches and plans with its rules (:meth:`defaults`); the
        fixed persistent launch (``max_variants=0``) plans with the rules below.

        Wide units are packed: kept whole they ran the runtime's decode trees no faster, and the
        choice packs MHA plans twice on every fresh step. Blocks are fixed: aligned ones changed
        none of the decode benchmark's tuned plans and cost up to 0.17 ms more host time per
        fresh step. Solo units only with two launches: with one launch, a unit kept out of the
        bins would run with the large tile's registers. All-small trees go to the large tiles
        (``all_large_without_large``), as before the rule changed for ``ft.plan``: the runtime's
        fixed launch slots were not timed with all-small plans of such trees, nor with the wide-head
        small split (``wide_head_small_split`` 0), nor with one-wave chunks of equal-length batches
        (``equal_lengths_one_wave`` False), no-sharing chunks by the summed context
        (``no_sharing_split_by_context`` False) or the one-wave crossover
        (``crossover_wave_programs`` 0).
        """
        if variants:
            return _DEFAULTS
        return replace(
            _DEFAULTS, solo_units=stage1_launches == 2, wide_units=False, aligned_blocks=False,
            all_large_without_large=True, wide_head_small_split=0, equal_lengths_one_wave=False,
            no_sharing_split_by_context=False, crossover_wave_programs=0,
        )  # fmt: skip

    def with_(self, **changes: Any) -> PlanRules:
        """A validated copy with some fields changed."""
        return replace(self, **changes)


_DEFAULTS = PlanRules()


def wide_head_tile(head_dim: int, block_m: int, block_n: int, cap: int) -> int:
    """``block_n``, or ``cap`` (:attr:`PlanRules.wide_head_kv_tile`; 0: off) where it is smaller, for
    a launch of 32 or more rows above head dim 128: the one place of that rule, for the per-plan
    launches (:func:`fasttree.launch_rules.launch_kv_tile`) and the runtime's fixed launch slots
    (:func:`fasttree.runtime_planning.launch_slots`)."""
    if cap and head_dim > 128 and block_m >= 32 and block_n > cap:
        return cap
    return block_n


def decode_programs_per_sm(head_dim: int) -> int | None:
    """Programs per SM of plain decode's stage-1 launch (16 rows, 64-token KV tiles, 4 warps, 3
    stages) on sm_90, which :attr:`PlanRules.equal_lengths_one_wave` fits its chunks to: 4 above
    head dim 64 up to 128 (114 registers and 39 KB of shared memory at 128, as Nsight Compute
    reported them on an H100, ``docs/history.md``). None elsewhere, where the rule leaves plans
    alone: at head dims up to 64 (not measured), and above 128, where the launch runs 3 per SM
    (160 registers, 76 KB at 256) and one-wave chunks lost on fresh draws of equal-length batches
    (up to 0.89x at 16/2 D 256 bf16)."""
    return 4 if 64 < head_dim <= 128 else None


def capped_small_split(head_dim: int, split: int, rules: PlanRules) -> int:
    """The small split size ``split`` (``FastTreeConfig.kv_split_sizes[1]``), or the cap
    :attr:`PlanRules.wide_head_small_split` (0: off) where it is smaller, above head dim 128: the one
    place of where the cap applies (:func:`fasttree.planner._adaptive_splits` applies it, the solo
    re-cut reads the result)."""
    cap = rules.wide_head_small_split
    if not cap or split <= cap or head_dim <= 128:
        return split
    return cap


def deciding_fields(rules: PlanRules) -> dict[str, Any]:
    """``rules`` as a dict of its fields, less the rules at the value they were added with
    (:data:`ADDED_AS`): what the defaults' fingerprint (:func:`fasttree.versions.defaults_fingerprint`)
    hashes, so that adding a rule switched off leaves tuned exports valid, while adopting it (a
    new default value) does not."""
    return {
        f.name: getattr(rules, f.name)
        for f in fields(rules)
        if not (ADDED_AS in f.metadata and getattr(rules, f.name) == f.metadata[ADDED_AS])
    }
