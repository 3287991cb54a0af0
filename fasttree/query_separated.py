"""Plain split-KV decode plans (FlashDecoding-style): every query alone over its whole context.

The baseline tree attention is measured against, the runtime's bounded fallback, and the plan
:func:`fasttree.plan` returns where the tree plan would cost more (its crossover rule).
"""

from __future__ import annotations

import functools

import numpy as np

from .config import FastTreeConfig
from .costs import QUERY_SEPARATED
from .groups import Groups
from .native import address, planner_library
from .plan_arrays import (
    Plan,
    check_heads,
    chunked_split,
    context_capped_split,
    materialize,
    one_wave_programs_per_sm,
    one_wave_split,
)
from .plan_rules import PlanRules
from .tree import KVTree
from .validation import check_int

__all__ = ["PLANNED_SMS", "plan_query_separated", "query_contexts", "query_separated_split"]

#: The SM count plans are made for where a rule counts waves (an H100's and an H200's 132): decode's
#: default chunking and the one-wave crossover (:func:`fasttree.planner.decode_shorter_in_one_wave`),
#: so that a tree's plan does not depend on the device it runs on.
PLANNED_SMS = 132


def query_contexts(tree: KVTree) -> tuple[np.ndarray, np.ndarray]:
    """Each query's context as pool slots, root first: :meth:`KVTree.query_slots`, by the compiled
    chain loops (``ft_chain_lengths``, ``ft_chain_fill``) when they are available.

    Every node counts as chained to its parent, so a query's chain runs from its node to its root.
    The compiled walk copies each context once (5-17x faster than the numpy gather on 2-17M
    entries on 2 CPU cores); without a compiler, the numpy one.

    Returns
    -------
    indptr : ndarray, int64 [n_queries + 1]
    slots : ndarray, int32 [sum of context lengths]
    """
    lib = planner_library()
    if lib is None:
        return tree.query_slots()
    nodes = np.ascontiguousarray(tree.query_nodes, dtype=np.int64)
    parents = np.ascontiguousarray(tree.parents, dtype=np.int64)
    lengths = np.ascontiguousarray(tree.lengths, dtype=np.int64)
    node_ptr = np.ascontiguousarray(tree.slot_indptr, dtype=np.int64)
    slots = np.ascontiguousarray(tree.slots, dtype=np.int32)
    chained = np.ones(parents.size, dtype=np.int8)
    n = nodes.size
    total = np.empty(n, dtype=np.int64)
    lib.ft_chain_lengths(n, address(nodes), address(parents), address(chained), address(lengths), address(total))
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(total, out=indptr[1:])
    out = np.empty(int(indptr[-1]), dtype=np.int32)
    scratch = np.empty(int(tree.depth.max()) + 2 if n else 1, dtype=np.int64)  # the deepest chain's nodes
    lib.ft_chain_fill(
        n, address(nodes), address(parents), address(chained), address(node_ptr), address(lengths),
        address(slots), address(indptr), address(scratch), address(out),
    )  # fmt: skip
    return indptr, out


def plan_query_separated(
    tree: KVTree,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_split_size: int | None = None,
    num_sms: int = PLANNED_SMS,
    kv_tile: int = 64,
    rules: PlanRules | None = None,
) -> Plan:
    """Plan FlashDecoding-style attention: every query alone over its whole context.

    Each query's root-path KV is cut into chunks of ``kv_split_size`` tokens (by default
    sized so that about four waves of ``num_sms`` programs run); one program handles the
    ``g`` heads of one KV head of one query over one chunk, and chunks are merged. ``rules``
    (default :meth:`PlanRules.defaults`) is recorded in the plan: its launch rules (the
    wide-head KV-tile cap) apply to the plan's launches and its chunking rules
    (``decode_split_by_context``, ``equal_lengths_one_wave``) to the chunk size, so this is the
    plan :func:`fasttree.plan`'s crossover returns where decode wins (also the benchmarks'
    query-separated baseline).
    """
    check_heads(num_q_heads, num_kv_heads, head_dim)
    if rules is None:
        rules = PlanRules.defaults()
    elif not isinstance(rules, PlanRules):
        raise ValueError(f"rules must be a PlanRules, got {type(rules).__name__}")
    if kv_split_size is not None:
        kv_split_size = check_int("kv_split_size", kv_split_size, minimum=1)
    kv_indptr, kv_slots = query_contexts(tree)
    nq = tree.n_queries
    lens = np.diff(kv_indptr)
    if kv_split_size is None:
        per_sm = one_wave_programs_per_sm(rules, lens, kv_tile, head_dim)
        if per_sm is not None:
            kv_split_size = one_wave_split(lens, num_kv_heads, per_sm * num_sms, kv_tile)
        else:
            context = int(np.add.reduce(lens, dtype=np.int64)) if rules.decode_split_by_context else None
            kv_split_size = query_separated_split(int(lens.max()), nq, num_kv_heads, num_sms, kv_tile, context=context)
    groups = Groups(
        node=tree.query_nodes.copy(),
        kv_start=kv_indptr[:-1],
        kv_len=lens,
        kv_slots=kv_slots,
        q_indptr=np.arange(nq + 1, dtype=np.int64),
        q_ids=np.arange(nq, dtype=np.int64),
    )
    config = _decode_config(kv_tile, kv_split_size)
    return materialize(
        groups,
        q_tiles=(1, 1),
        kv_tiles=(kv_tile, kv_tile),
        group_split=kv_split_size,
        splits=(kv_split_size, kv_split_size),
        config=config,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        n_queries=nq,
        max_slot=tree.max_slot,
        tile_mode=QUERY_SEPARATED,
        rules=rules,
    )


@functools.lru_cache(maxsize=256)
def _decode_config(kv_tile: int, kv_split_size: int) -> FastTreeConfig:
    """The config a query-separated plan records (immutable, shared by the plans with the same
    one: building and validating one costs about as much as planning a small tree)."""
    return FastTreeConfig(
        q_tile_queries=(1, 1), kv_tile=(kv_tile, kv_tile), kv_split_sizes=(kv_split_size, kv_split_size), pack_tokens=0
    )


def query_separated_split(
    longest: int, n_queries: int, num_kv_heads: int, num_sms: int, kv_tile: int, *, context: int | None = None
) -> int:
    """The default chunk size of :func:`plan_query_separated`: a multiple of ``kv_tile`` that cuts
    the ``longest`` context into enough chunks for about four waves of ``num_sms`` programs over
    ``n_queries`` queries x ``num_kv_heads`` KV heads. With ``context`` (the queries' summed
    context entries, ``PlanRules.decode_split_by_context``), where those items alone fill the
    four waves (one chunk per query: the longest context whole), the chunk that cuts the summed
    context x ``num_kv_heads`` into about that many programs when it is at most four fifths of
    that (:func:`fasttree.plan_arrays.context_capped_split`)."""
    items, programs = n_queries * num_kv_heads, 4 * num_sms
    capped = (
        None if context is None else context_capped_split(longest, programs, items, kv_tile, context * num_kv_heads)
    )
    return chunked_split(longest, programs, items, kv_tile) if capped is None else capped
