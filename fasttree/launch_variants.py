"""Launch variants of the decode runtime: per-plan launches that a CUDA graph can replay.

:func:`fasttree.tree_attention` sizes each launch for its plan: a grid of exactly the plan's
(unit, KV head) items per tile class, and per-plan tiles, stages, register caps and peeling
(:func:`fasttree.launch_rules.stage1_launches`, :func:`fasttree.launch_rules.merge_launch`). A
graph cannot replay such a launch for another plan. A :class:`LaunchVariant` is those same
launch decisions with each grid rounded up to a *grid bucket* (:func:`grid_bucket`; stage-1 grids
also stop at whole waves of the GPU): every plan of a variant runs from one set of launches (the
kernels read the plan's arrays and unit ranges from the runtime's plan buffer; a grid's programs
beyond a plan's units find empty ones), so a server captures one graph per variant it meets and
replays the one of each step's plan, as serving engines keep one graph per batch-size bucket.
:class:`VariantTable` numbers the variants a runtime hands out and bounds the live ones; past the
bound a plan runs the smallest live variant whose launches cover it (the same launches, larger
grids), else a new id replaces the least recently used one.

Numpy only (no device work).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, fields

from .host_arrays import eighth_step_ceil
from .launch_rules import GpuTarget, MergeLaunch, Stage1Launch, merge_launch, next_pow2, stage1_launches
from .plan_arrays import Plan

__all__ = ["FIXED_VARIANT", "LaunchVariant", "VariantTable", "grid_bucket", "launch_variant", "unit_wave"]

#: Variant id of the runtime's fixed persistent launch (serves any plan within the capacities).
FIXED_VARIANT = 0


def grid_bucket(n: int, wave: int = 0) -> int:
    """The grid size (>= ``n``) a launch variant gives a launch of ``n`` programs along its
    unit (or merged-query) dimension.

    ``n`` itself up to 16; above that the smaller of ``n`` rounded up to ``m * 2**e`` with
    ``8 <= m < 16`` (at most one program in eight exits idle, at most eight buckets per doubling
    of a server's plans' sizes) and, with ``wave`` > 0, ``n`` rounded up to a multiple of
    ``wave``. The planner sizes its splits to fill whole waves of the GPU (a multiple of the SM
    count in programs), so a plan's unit count often sits on a wave; its bucket then adds no idle
    program that would start a partial wave of its own (:func:`unit_wave`).
    """
    n = max(int(n), 0)
    lattice = eighth_step_ceil(n)  # n itself up to 16, where no multiple of a wave is smaller
    if wave > 0:
        return min(lattice, -(-n // wave) * wave)
    return lattice


def unit_wave(target: GpuTarget, num_kv_heads: int) -> int:
    """Units of one wave of stage-1 programs on ``target``: the fewest units whose programs
    (units x ``num_kv_heads``) are a whole multiple of the SM count; 0 (no wave) under the
    interpreter, where ``target.sms`` is 0."""
    if target.sms <= 0:
        return 0
    return target.sms // math.gcd(target.sms, int(num_kv_heads))


@dataclass(frozen=True)
class LaunchVariant:
    """The launches of one step: the stage-1 launch of each non-empty tile class (two run side by
    side on two streams, as :func:`fasttree.tree_attention` runs them) and the merge, if any.

    Hashable: a server keys its CUDA graphs by it (with :class:`fasttree.runtime.StepGraphs`,
    or by :attr:`fasttree.runtime.RuntimePlan.variant_id`).
    """

    stage1: tuple[Stage1Launch, ...]  # first_unit 0, n_units the class's grid bucket
    merge: MergeLaunch | None  # n_merge the merge list's grid bucket

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:  # once per variant: a server's table hashes every step's
        return hash((self.stage1, self.merge))

    @functools.cached_property
    def shape(self) -> tuple:
        """Everything of its launches but the grids and the stage-1 masks: variants of one shape
        differ only in grid sizes and masked classes (:meth:`covers`)."""
        return (
            tuple(tuple(getattr(s, f) for f in _STAGE1_SHAPE) for s in self.stage1),
            None if self.merge is None else tuple(getattr(self.merge, f) for f in _MERGE_SHAPE),
        )

    @functools.cached_property
    def _grids(self) -> tuple[tuple[int, bool], ...]:
        """Each stage-1 launch's units and mask, then the merged queries (with False)."""
        merge = () if self.merge is None else ((self.merge.n_merge, False),)
        return (*((s.n_units, s.masked) for s in self.stage1), *merge)

    @property
    def forked(self) -> bool:
        """Two stage-1 launches, run side by side."""
        return len(self.stage1) == 2

    @property
    def programs(self) -> int:
        """Grid rows of its launches: the stage-1 launches' units and the merged queries."""
        return sum(s.n_units for s in self.stage1) + (0 if self.merge is None else self.merge.n_merge)

    def covers(self, other: LaunchVariant) -> bool:
        """Whether this variant's launches serve every plan of ``other``: the same launches (tile
        classes, tiles, warps, stages, register caps, peeling; the same merge kernel) with grids at
        least ``other``'s, a masked tile class serving an unmasked one too. The runtime keeps its
        fixed arrays empty past each plan (empty units, the merge list's filler query), so the extra
        programs find nothing to do, and uploads all-ones row masks for a plan without any."""
        if self.shape != other.shape:
            return False
        return all(
            n >= on and (masked or not other_masked)
            for (n, masked), (on, other_masked) in zip(self._grids, other._grids, strict=True)
        )


#: The fields of a stage-1 launch and of a merge launch that make a variant's :attr:`LaunchVariant.shape`
#: (all but the grid sizes and the stage-1 mask).
_STAGE1_SHAPE = tuple(f.name for f in fields(Stage1Launch) if f.name not in ("n_units", "masked"))
_MERGE_SHAPE = tuple(f.name for f in fields(MergeLaunch) if f.name != "n_merge")


def launch_variant(plan: Plan, target: GpuTarget) -> LaunchVariant:
    """The launch variant of ``plan`` on ``target``: ``plan``'s own launch decisions, grids bucketed."""
    wave = unit_wave(target, plan.num_kv_heads)
    stage1 = stage1_launches(plan, target, lambda n: grid_bucket(n, wave))
    return LaunchVariant(stage1=stage1, merge=merge_launch(plan, next_pow2(plan.head_dim), grid_bucket))


class VariantTable:
    """Numbers the launch variants a runtime hands out and keeps at most ``max_variants`` live.

    Parameters
    ----------
    max_variants : int
        Live variants at most. Ids count up from 1 in the order variants are met and are never
        reused, so a graph captured for an id always replays that id's launches. Once
        ``max_variants`` are live, a plan whose variant is new runs under the live variant with the
        fewest programs among those that cover it (:meth:`LaunchVariant.covers`: the same
        launches with larger grids), else it gets a new id and the least recently used variant
        leaves the table (:attr:`evicted` lists the ids that left; a server's graph of one is
        never replayed again). 0: every plan runs :data:`FIXED_VARIANT` (the fixed persistent
        launch: one graph serves every step).

    Over 400 steps of each serving scenario at 32/32 and 32/8 heads, 32 live ids served every
    step with a variant for 0-11 ids more than the 32 first met (``python -m bench.variant_ids``),
    where handing out no id past 32 had run the fixed launch on up to 20% of the steps.
    """

    def __init__(self, max_variants: int) -> None:
        self.max_variants = int(max_variants)
        self._ids: OrderedDict[LaunchVariant, int] = OrderedDict()  # least recently used first
        self._by_id: dict[int, LaunchVariant] = {}
        self._by_shape: dict[tuple, dict[int, LaunchVariant]] = {}  # live variants of each shape, by id
        self._last_id = 0
        self.evicted: list[int] = []

    def id_of(self, variant: LaunchVariant) -> int:
        """The id that serves ``variant``'s plans (and marks it used): its own when it is live or
        there is room, else the covering live variant's with the fewest programs, else a new id
        in place of the least recently used variant (0 when ``max_variants`` is 0)."""
        vid = self._ids.get(variant)
        if vid is not None:
            self._ids.move_to_end(variant)
            return vid
        if not self.max_variants:
            return FIXED_VARIANT
        if len(self._ids) >= self.max_variants:
            same = self._by_shape.get(variant.shape, {})
            covering = [(v.programs, i, v) for i, v in same.items() if v.covers(variant)]
            if covering:
                _, vid, cover = min(covering, key=lambda c: c[:2])
                self._ids.move_to_end(cover)
                return vid
            gone, old = self._ids.popitem(last=False)
            del self._by_id[old]
            shape = self._by_shape[gone.shape]
            del shape[old]
            if not shape:
                del self._by_shape[gone.shape]
            self.evicted.append(old)
        self._last_id += 1
        self._ids[variant] = self._last_id
        self._by_id[self._last_id] = variant
        self._by_shape.setdefault(variant.shape, {})[self._last_id] = variant
        return self._last_id

    def variant(self, variant_id: int) -> LaunchVariant | None:
        """The live variant numbered ``variant_id`` (None for :data:`FIXED_VARIANT` or an id that left)."""
        return self._by_id.get(variant_id)

    @property
    def handed_out(self) -> int:
        """Ids handed out so far (live or evicted)."""
        return self._last_id

    def __len__(self) -> int:
        """Live variants."""
        return len(self._ids)
