"""Packing in two steps: the bins' layout (``bin_layout``) and their arrays (``assemble_bins``).

The wide-unit choice compares two layouts by what they would read and serve
(``layout_reads_and_served``) before building either; these tests check that those terms are the
ones the assembled units have, and that the two steps make what ``pack_units`` makes.
"""

from __future__ import annotations

import numpy as np
import pytest

from fasttree.packing import assemble_bins, bin_layout, layout_reads_and_served, pack_units


def _random_units(rng: np.random.Generator, n_queries: int) -> dict:
    """Units over DFS-ranked queries: runs of consecutive queries (as groups' tiles are), in unit
    order with their pairs back to back, each with a KV range of a slot array."""
    n_units = int(rng.integers(2, 40))
    q_len = rng.integers(1, 12, n_units)
    first = rng.integers(0, n_queries, n_units)
    pair_query = np.concatenate([(f + np.arange(k)) % n_queries for f, k in zip(first, q_len, strict=True)])
    kv_len = rng.integers(1, 200, n_units)
    n_slots = int(kv_len.sum()) + 50
    kv_start = rng.integers(0, n_slots - kv_len + 1)
    pair_start = np.concatenate([[0], np.cumsum(q_len)[:-1]])
    return dict(
        kv_start=kv_start.astype(np.int64),
        kv_len=kv_len.astype(np.int64),
        pair_start=pair_start.astype(np.int64),
        q_len=q_len.astype(np.int64),
        pair_query=pair_query.astype(np.int64),
        kv_slots=rng.permutation(n_slots).astype(np.int32),
    )


@pytest.mark.parametrize("aligned", [False, True, None])
def test_layout_terms_match_the_assembled_units(aligned):
    rng = np.random.default_rng(43)
    seen = 0
    for _ in range(300):
        n_queries = int(rng.integers(2, 80))
        u = _random_units(rng, n_queries)
        rank = rng.permutation(n_queries)
        of_rank = np.argsort(rank)
        kw = dict(
            eligible=rng.random(u["q_len"].size) < 0.8,
            query_rank=rank,
            capacity=int(rng.integers(1, 33)),
            budget=int(rng.integers(16, 600)),
            pairs_in_order=True,
            balanced=bool(rng.integers(2)),
            aligned=aligned,
        )
        layout_args = {k: u[k] for k in ("kv_len", "pair_start", "q_len", "pair_query")}
        layout = bin_layout(**layout_args, **kw)
        ref = pack_units(**u, **kw)
        if layout is None:
            assert ref is None
            continue
        seen += 1
        packed = assemble_bins(layout, **u, query_rank=rank, query_of_rank=of_rank, pairs_in_order=True)
        for name in ("kv_start", "kv_len", "pair_start", "q_len", "pair_query", "pair_present", "kv_slots"):
            np.testing.assert_array_equal(getattr(packed, name), getattr(ref, name), err_msg=name)
        reads, served = layout_reads_and_served(layout, u["kv_len"], u["q_len"], u["pair_query"], of_rank)
        assert reads == int(packed.kv_len.sum())
        np.testing.assert_array_equal(np.sort(served), np.sort(packed.pair_query[packed.pair_present]))
    assert seen > 100
