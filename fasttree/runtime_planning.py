"""How :class:`fasttree.runtime.TreeAttentionRuntime` plans a step and launches it, on the host only.

The runtime plans a tree with its own rules (:meth:`fasttree.PlanRules.runtime`: no wide units,
fixed packing blocks, solo units when each tile class has a launch of its own) and a query-centric
plan when grouping saves little, and launches both tile classes' units from fixed shapes: the config's query and KV
tiles, in one persistent launch with the large class's warps and stages, or in two. This
module holds those decisions as functions, so that the runtime, the profiler (timing the
runtime's launches) and the latency model (re-planning such a measurement) make the same
plan. It needs numpy only.

Dimension names: ``Hq``/``Hkv`` query/KV heads, ``g = Hq / Hkv``, ``D`` head dim.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np

from .config import FastTreeConfig
from .costs import ALL_LARGE
from .plan_arrays import Plan, _tile_class, check_heads, tile_rows
from .plan_rules import PlanRules, wide_head_tile
from .planner import plan as plan_tree
from .tree import KVTree
from .validation import check_choice

__all__ = [
    "MIN_SHARING_GAIN",
    "QUERY_CENTRIC_CHOICES",
    "QUERY_CENTRIC_GAMMA",
    "launch_slots",
    "launch_view",
    "plan_as_launched",
    "plan_for_runtime",
    "resolve_stage1_launches",
]

#: A grouped plan must save this share of the KV a query-centric plan reads, or ``"auto"`` plans query-centric.
MIN_SHARING_GAIN = 0.10
#: ``gamma`` of a query-centric plan (every edge concatenated: each query alone over its path).
QUERY_CENTRIC_GAMMA = 10.0
#: Values of the runtime's ``query_centric``.
QUERY_CENTRIC_CHOICES = ("auto", "never", "always")


def resolve_stage1_launches(stage1_launches: int | str, group_size: int, head_dim: int) -> int:
    """Stage-1 launches of a runtime: 1 or 2, ``"auto"`` resolved.

    ``"auto"`` is 2 for MHA (``g == 1``) at ``D <= 128``, whose small units are memory-bound
    and gain from a small-tile launch of their own, and 1 otherwise (``docs/runtime.md``).

    Raises
    ------
    ValueError
        When ``stage1_launches`` is not ``"auto"``, 1 or 2.
    """
    if stage1_launches == "auto":
        return 2 if group_size == 1 and head_dim <= 128 else 1
    if isinstance(stage1_launches, bool) or stage1_launches not in (1, 2):
        raise ValueError(f"stage1_launches must be 'auto', 1 or 2, got {stage1_launches!r}")
    return int(stage1_launches)


def launch_slots(
    config: FastTreeConfig, group_size: int, head_dim: int, wide_head_cap: int
) -> tuple[tuple[int, int, int, int], ...]:
    """``(block_m, block_n, num_warps, num_stages)`` of the runtime's launch slot 0 (the large tile
    class) and slot 1 (the small one): the config's tiles, whatever a plan's units need.

    ``block_m`` is the tile's queries times ``g`` rounded up to a power of two (at least 16), as
    :func:`fasttree.plan` sizes it; ``block_n`` the config's KV tile, capped as the plans' rules cap
    it (``wide_head_cap``: :attr:`fasttree.PlanRules.wide_head_kv_tile`, :func:`wide_head_tile`).
    """
    q_tiles = config.query_tiles(group_size)
    warps = config.launch_warps(group_size)
    stages = config.launch_stages(group_size, head_dim)
    slots = []
    for c, t in enumerate(q_tiles):
        block_m = tile_rows(t, group_size)
        block_n = wide_head_tile(head_dim, block_m, int(config.kv_tile[c]), wide_head_cap)
        slots.append((block_m, block_n, int(warps[c]), int(stages[c])))
    return tuple(slots)


def _shares_tokens(tree: KVTree) -> bool:
    """Whether some token is in the context of two or more queries."""
    return bool(np.count_nonzero((tree.subtree_queries >= 2) & (tree.lengths > 0)))


def plan_for_runtime(
    tree: KVTree,
    config: FastTreeConfig,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    stage1_launches: int | str = "auto",
    query_centric: str = "auto",
    rules: PlanRules | None = None,
) -> tuple[Plan, bool]:
    """Plan ``tree`` as :meth:`fasttree.runtime.TreeAttentionRuntime.plan` does when it plans afresh.

    Parameters
    ----------
    tree : KVTree
    config : FastTreeConfig
    num_q_heads, num_kv_heads, head_dim : int
        ``Hq``, ``Hkv`` and ``D``.
    stage1_launches : {"auto", 1, 2}
        The runtime's stage-1 launches (:func:`resolve_stage1_launches`); with 2, small units
        are planned solo.
    query_centric : {"auto", "never", "always"}
        ``"auto"``: plan query-centric when grouping would save less than
        :data:`MIN_SHARING_GAIN` of the KV reads.
    rules : PlanRules, optional
        The planning rules; by default those of the fixed persistent launch
        (:meth:`PlanRules.runtime` of the resolved ``stage1_launches``). A runtime with launch
        variants plans with :meth:`PlanRules.defaults`, as :func:`fasttree.tree_attention`'s plans are made.

    Returns
    -------
    plan : Plan
    query_centric : bool
        Whether the plan is the query-centric one.

    Raises
    ------
    ValueError
        On bad heads, ``stage1_launches`` or ``query_centric`` (and whatever
        :func:`fasttree.plan` refuses).
    """
    group_size = check_heads(num_q_heads, num_kv_heads, head_dim)
    launches = resolve_stage1_launches(stage1_launches, group_size, head_dim)
    check_choice("query_centric", query_centric, QUERY_CENTRIC_CHOICES)
    heads = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
             "rules": PlanRules.runtime(launches) if rules is None else rules}  # fmt: skip
    if query_centric == "always":
        return plan_tree(tree, _query_centric_config(config), **heads), True
    plan = plan_tree(tree, config, **heads)
    # grouping must save MIN_SHARING_GAIN of a query-centric plan's KV reads (tested first:
    # it is cheaper than _shares_tokens and usually decides)
    if (
        query_centric == "auto"
        and plan.merge_queries.size
        and int(np.add.reduce(plan.unit_kv_len, dtype=np.int64))
        > (1 - MIN_SHARING_GAIN) * int(np.add.reduce(tree.path_lengths[tree.query_nodes]))
        and _shares_tokens(tree)
    ):
        return plan_tree(tree, _query_centric_config(config), **heads), True
    return plan, False


@functools.lru_cache(maxsize=64)
def _query_centric_config(config: FastTreeConfig) -> FastTreeConfig:
    """``config`` with the query-centric gamma (cached: a validated copy costs about as much as
    a tenth of a small tree's plan, and a runtime plans with a few configs)."""
    return replace(config, gamma=QUERY_CENTRIC_GAMMA)


def launch_view(plan: Plan, config: FastTreeConfig, *, stage1_launches: int | str = "auto") -> Plan:
    """``plan`` with the tile classes the runtime launches its units with.

    The runtime runs each class's units from its launch slot's fixed shape
    (:func:`launch_slots`; an all-large plan's units all from slot 0), and with one stage-1
    launch both slots at the large class's warps and stages, and row masks whenever the config
    packs tokens. The arrays are shared with
    ``plan``; only ``tile_classes`` differ. For the latency model's features of a runtime
    measurement.

    Raises
    ------
    ValueError
        On a bad ``stage1_launches``.
    """
    g, d = plan.group_size, plan.head_dim
    launches = resolve_stage1_launches(stage1_launches, g, d)
    slots = launch_slots(config, g, d, plan.rules.wide_head_kv_tile)
    masked = config.pack_tokens > 0  # the runtime compiles row masks in whenever the config packs
    classes = []
    for c, tc in enumerate(plan.tile_classes):
        block_m, block_n, warps, stages = slots[0 if plan.tile_mode == ALL_LARGE else c]
        if launches == 1:
            warps, stages = slots[0][2], slots[0][3]
        classes.append(_tile_class(tc.queries, block_m, block_n, tc.split, warps, stages, masked))
    view = replace(plan, tile_classes=tuple(classes), _device_cache={})
    view._planned = plan._planned  # the same arrays
    return view


def plan_as_launched(
    tree: KVTree,
    config: FastTreeConfig,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    stage1_launches: int | str = "auto",
    query_centric: str = "auto",
    rules: PlanRules | None = None,
) -> Plan:
    """The runtime's plan of ``tree`` (:func:`plan_for_runtime`) with the tile classes its launches
    run (:func:`launch_view`): what the latency model is asked about for a runtime step.

    Parameters and errors as :func:`plan_for_runtime`.
    """
    heads = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    plan, _ = plan_for_runtime(
        tree, config, **heads, stage1_launches=stage1_launches, query_centric=query_centric, rules=rules
    )
    return launch_view(plan, config, stage1_launches=stage1_launches)
