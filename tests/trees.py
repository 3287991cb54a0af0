"""Seeded random KV trees for tests: forests, internal-node queries, 1-token and long nodes."""

from __future__ import annotations

import numpy as np

import fasttree as ft


def random_tree(
    rng: np.random.Generator,
    *,
    max_nodes: int = 40,
    max_len: int = 300,
    roots: int | None = None,
    scatter_slots: bool = True,
) -> ft.KVTree:
    """A random forest with queries at random nodes (internal ones included).

    Node lengths mix 1-token nodes, tile-boundary lengths and long nodes; some
    non-root nodes are empty. Slots are a random permutation of a pool larger than
    the tree when ``scatter_slots`` (non-contiguous, any order), else contiguous.
    """
    n = int(rng.integers(1, max_nodes + 1))
    n_roots = int(rng.integers(1, min(n, 4) + 1)) if roots is None else min(roots, n)
    shape = rng.integers(3)
    parents = np.full(n, -1, dtype=np.int64)
    for i in range(n_roots, n):
        if shape == 0:  # random recursive tree
            parents[i] = rng.integers(0, i)
        elif shape == 1:  # deep, chain-like
            parents[i] = rng.integers(max(0, i - 2), i)
        else:  # wide, shallow
            parents[i] = rng.integers(0, min(i, n_roots + 3))
    # shuffle node ids so that parents need not precede children
    perm = rng.permutation(n)
    inv = np.empty(n, dtype=np.int64)
    inv[perm] = np.arange(n)
    parents = np.where(parents[perm] >= 0, inv[np.maximum(parents[perm], 0)], -1)
    choices = np.array([0, 1, 1, 2, 7, 15, 16, 17, 31, 32, 33, 64, 100, 128, 129, max_len])
    lengths = rng.choice(choices, size=n)
    lengths[parents < 0] = np.maximum(lengths[parents < 0], 1)
    n_queries = int(rng.integers(1, 2 * n + 2))
    query_nodes = rng.integers(0, n, size=n_queries)
    total = int(lengths.sum())
    pool = rng.permutation(total + int(rng.integers(0, 50)))[:total] if scatter_slots else np.arange(total)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    node_slots = [pool[bounds[i] : bounds[i + 1]] for i in range(n)]
    return ft.KVTree(parents, node_slots, query_nodes)
