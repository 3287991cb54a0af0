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
    return ft.KVTree(parents, _split(pool, lengths), query_nodes)


def _split(pool: np.ndarray, lengths) -> list[np.ndarray]:
    """``pool``'s first ``sum(lengths)`` slots, node by node: node ``i`` takes the next ``lengths[i]``."""
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [pool[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]


def tiny_server_trees(steps: int = 26) -> list[ft.KVTree]:
    """A small serving scenario's trees (two prefix levels, forks, arrivals and departures, short
    answers, at most 12 requests: not a multiple of the runtime's 32-word array alignment) with
    stable pool slots, as a server's allocator keeps them."""
    from bench.decode import stable_slot_trees
    from fasttree.toolkit.workloads import ServingScenario, iter_serving

    scenario = ServingScenario(
        name="tiny_forking", description="test", prefix_levels=((1, 40, 60), (2, 10, 30)), questions_per_prefix=4,
        question_tokens=(2, 9), output_tokens=(3, 9), forks=(2,), fork_after=(2, 4), max_batch=12, arrival_rate=0.7,
    )  # fmt: skip
    return stable_slot_trees(list(iter_serving(scenario, seed=5, steps=steps)))


def shared_forest(rng: np.random.Generator, *, fanout: int = 40) -> ft.KVTree:
    """A forest of 1-3 documents (64-1,499 tokens), each with 1-3 branches (1-399 tokens, half of
    them queried) read by 4 to ``fanout - 1`` queried leaves (1-300 tokens, tile-boundary lengths
    among them): wide sharing, so that plans have large query tiles. Slots scattered over a pool
    larger than the tree."""
    parents: list[int] = []
    lengths: list[int] = []
    queries: list[int] = []
    for _ in range(int(rng.integers(1, 4))):
        root = len(parents)
        parents.append(-1)
        lengths.append(int(rng.integers(64, 1500)))
        for _ in range(int(rng.integers(1, 4))):
            node = len(parents)
            parents.append(root)
            lengths.append(int(rng.integers(1, 400)))
            if rng.random() < 0.5:
                queries.append(node)
            for _ in range(int(rng.integers(4, fanout))):
                queries.append(len(parents))
                parents.append(node)
                lengths.append(int(rng.choice([1, 7, 33, 64, 129, 300])))
    return ft.KVTree(parents, _split(rng.permutation(sum(lengths) + 64), lengths), queries)
