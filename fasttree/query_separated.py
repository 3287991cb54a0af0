"""Plain split-KV decode plans (FlashDecoding-style): every query alone over its whole context.

The baseline tree attention is measured against, the runtime's bounded fallback, and the plan
:func:`fasttree.plan` returns where the tree plan would cost more (its crossover rule).
"""

from __future__ import annotations

import numpy as np

from .config import FastTreeConfig
from .costs import QUERY_SEPARATED
from .groups import Groups
from .plan_arrays import Plan, check_heads, chunked_split, materialize
from .tree import KVTree
from .validation import check_int

__all__ = ["plan_query_separated", "query_separated_split"]


def plan_query_separated(
    tree: KVTree,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_split_size: int | None = None,
    num_sms: int = 132,
    kv_tile: int = 64,
) -> Plan:
    """Plan FlashDecoding-style attention: every query alone over its whole context.

    Each query's root-path KV is cut into chunks of ``kv_split_size`` tokens (by default
    sized so that about four waves of ``num_sms`` programs run); one program handles the
    ``g`` heads of one KV head of one query over one chunk, and chunks are merged.
    """
    check_heads(num_q_heads, num_kv_heads, head_dim)
    if kv_split_size is not None:
        kv_split_size = check_int("kv_split_size", kv_split_size, minimum=1)
    kv_indptr, kv_slots = tree.query_slots()
    nq = tree.n_queries
    lens = np.diff(kv_indptr)
    if kv_split_size is None:
        kv_split_size = query_separated_split(int(lens.max()), nq, num_kv_heads, num_sms, kv_tile)
    groups = Groups(
        node=tree.query_nodes.copy(),
        kv_start=kv_indptr[:-1],
        kv_len=lens,
        kv_slots=kv_slots,
        q_indptr=np.arange(nq + 1, dtype=np.int64),
        q_ids=np.arange(nq, dtype=np.int64),
    )
    config = FastTreeConfig(
        q_tile_queries=(1, 1),
        kv_tile=(kv_tile, kv_tile),
        kv_split_sizes=(kv_split_size, kv_split_size),
        pack_tokens=0,
    )
    return materialize(
        groups,
        q_tiles=(1, 1),
        kv_tiles=(kv_tile, kv_tile),
        group_split=np.full(nq, kv_split_size, dtype=np.int64),
        splits=(kv_split_size, kv_split_size),
        config=config,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        n_queries=nq,
        max_slot=tree.max_slot,
        tile_mode=QUERY_SEPARATED,
    )


def query_separated_split(longest: int, n_queries: int, num_kv_heads: int, num_sms: int, kv_tile: int) -> int:
    """The default chunk size of :func:`plan_query_separated`: a multiple of ``kv_tile`` that cuts
    the ``longest`` context into enough chunks for about four waves of ``num_sms`` programs over
    ``n_queries`` queries x ``num_kv_heads`` KV heads."""
    return chunked_split(longest, 4 * num_sms, n_queries * num_kv_heads, kv_tile)
