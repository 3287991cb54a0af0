"""Checks of a plan's semantics shared by the planner and plan-extension tests: every query
reads its context exactly once (row masks applied), and partial rows are consistent."""

from __future__ import annotations

import numpy as np

import fasttree as ft
from fasttree.plan_arrays import ABSENT_ROW

#: Today's rules less the one-wave crossover (``PlanRules.crossover_wave_programs``), which sends
#: many of the tests' small tree plans to decode: for tests of what tree plans do.
TREE_PLANS = ft.PlanRules().with_(crossover_wave_programs=0)


def unit_class(plan: ft.Plan, u: int) -> int:
    return 0 if u < plan.class_unit_ptr[1] else 1


def read_tokens(plan: ft.Plan) -> tuple[np.ndarray, np.ndarray]:
    """(query, slot) of every KV token that every pair of the plan reads (row masks applied)."""
    queries, slots = [], []
    kv = plan.kv_indices
    for u in range(plan.n_units):
        ks, kn = int(plan.unit_kv_start[u]), int(plan.unit_kv_len[u])
        qs, qn = int(plan.unit_q_start[u]), int(plan.unit_q_len[u])
        masked = plan.tile_classes[unit_class(plan, u)].masked
        for p, j in enumerate(plan.pair_query[qs : qs + qn].tolist()):
            take = np.ones(kn, dtype=bool)
            if masked:
                take = ((plan.kv_row_mask[ks : ks + kn].astype(np.int64) >> p) & 1).astype(bool)
                # a row that reads nothing must be marked absent, and only then
                assert take.any() == (plan.pair_out_row[qs + p] != ABSENT_ROW)
            queries.append(np.full(int(take.sum()), j, dtype=np.int64))
            slots.append(kv[ks : ks + kn][take].astype(np.int64))
    return np.concatenate(queries), np.concatenate(slots)


def assert_covers_contexts_once(tree: ft.KVTree, plan: ft.Plan) -> None:
    q, s = read_tokens(plan)
    base = max(int(s.max()), tree.max_slot) + 1
    got = np.sort(q * base + s)
    indptr, slots = tree.query_slots()
    rq = np.repeat(np.arange(tree.n_queries), np.diff(indptr))
    want = np.sort(rq * base + slots.astype(np.int64))
    assert got.size == want.size, "a query reads a different number of tokens than its context holds"
    np.testing.assert_array_equal(got, want)


def assert_partials_consistent(plan: ft.Plan) -> None:
    nq = plan.n_queries
    present = plan.pair_out_row != ABSENT_ROW
    assert np.all(plan.pair_out_row >= ABSENT_ROW)
    counts = np.bincount(plan.pair_query[present], minlength=nq)
    np.testing.assert_array_equal(counts, plan.query_num_partials)
    direct = plan.pair_out_row == -1
    # a pair writes directly exactly when its query has one partial
    np.testing.assert_array_equal(direct[present], plan.query_num_partials[plan.pair_query[present]] == 1)
    partial = plan.pair_out_row >= 0
    rows = plan.pair_out_row[partial]
    assert rows.size == plan.n_partial_rows
    np.testing.assert_array_equal(np.sort(rows), np.arange(plan.n_partial_rows))
    owner = plan.pair_query[partial]
    start = plan.query_partial_start[owner]
    assert np.all((rows >= start) & (rows < start + plan.query_num_partials[owner]))
    np.testing.assert_array_equal(plan.merge_queries, np.flatnonzero(plan.query_num_partials >= 2))
