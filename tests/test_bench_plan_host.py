"""bench.plan_host: the radix-cache view of a serving tree builds that tree again, and its build is
timed (CPU)."""

from __future__ import annotations

import numpy as np

from bench import plan_host
from fasttree.adapter import tree_from_radix_nodes


def test_radix_views_rebuild_the_serving_trees_and_are_timed():
    trees = plan_host.serving_trees("chain_reasoning")[:4]
    views = plan_host.radix_views(trees)
    for tree, (parents, nodes, queries) in zip(trees, views, strict=True):
        assert len(nodes) == tree.n_nodes and all(a.dtype == np.int64 for a in nodes)
        built = tree_from_radix_nodes(parents, nodes, queries)
        for name in ("parents", "lengths", "slot_indptr", "slots", "query_nodes"):
            np.testing.assert_array_equal(getattr(built, name), getattr(tree, name))
    assert 0 < plan_host.tree_build_ms(views, repeats=2) < 1e3
