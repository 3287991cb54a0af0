"""Tree families that no tuning or validation step uses: the frozen test of tuned exports.

The tuner tunes on :data:`fasttree.toolkit.workloads.TREE_FAMILIES`, the serving scenarios and the
paper suite, and makes its design choices on held-out seeds of those. A tuned export is then
measured on the GPU against the defaults on these families (and the paper suite), shaped as a
new user's batches would be: wide few-shot trees, forests of beam searches, multi-tenant forests
with queries at internal nodes, long documents, speculative token trees, deep chat histories and
batches of independent 2k-token requests. Each is a function ``(rng) -> KVTree``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..tree import KVTree
from .workloads import beam_search

__all__ = ["UNSEEN_FAMILIES", "sample_unseen_tree"]


def _ints(rng: np.random.Generator, lo: int, hi: int, size: int | None = None):
    return rng.integers(lo, hi + 1, size=size)


def wide_few_shot(rng: np.random.Generator) -> KVTree:
    """An instruction over 40-60 example branches, each read by 2-8 questions."""
    parents, lengths, queries = [-1], [int(_ints(rng, 128, 384))], []
    for _ in range(int(_ints(rng, 40, 60))):
        branch = len(parents)
        parents.append(0)
        lengths.append(int(_ints(rng, 200, 900)))
        for _ in range(int(_ints(rng, 2, 8))):
            queries.append(len(parents))
            parents.append(branch)
            lengths.append(int(_ints(rng, 8, 64)))
    return KVTree.from_lengths(parents, lengths, queries)


def beam_forest(rng: np.random.Generator) -> KVTree:
    """4-8 independent beam searches side by side (a forest: one root each)."""
    parents: list[int] = []
    lengths: list[int] = []
    queries: list[int] = []
    for _ in range(int(_ints(rng, 4, 8))):
        tree = beam_search(rng, n_prompts=1)
        offset = len(parents)
        parents += [p + offset if p >= 0 else -1 for p in tree.parents.tolist()]
        lengths += tree.lengths.tolist()
        queries += [q + offset for q in tree.query_nodes.tolist()]
    return KVTree.from_lengths(parents, lengths, queries)


def multi_tenant(rng: np.random.Generator) -> KVTree:
    """3-6 tenants (system prompts of 500-3000 tokens), each with 3-12 conversations whose history
    node is itself a query (an internal node) and has 0-3 follow-up turns below it."""
    parents: list[int] = []
    lengths: list[int] = []
    queries: list[int] = []
    for _ in range(int(_ints(rng, 3, 6))):
        tenant = len(parents)
        parents.append(-1)
        lengths.append(int(_ints(rng, 500, 3000)))
        for _ in range(int(_ints(rng, 3, 12))):
            history = len(parents)
            parents.append(tenant)
            lengths.append(int(_ints(rng, 50, 1500)))
            queries.append(history)
            for _ in range(int(_ints(rng, 0, 3))):
                queries.append(len(parents))
                parents.append(history)
                lengths.append(int(_ints(rng, 8, 96)))
    return KVTree.from_lengths(parents, lengths, queries)


def long_documents(rng: np.random.Generator) -> KVTree:
    """Two documents of 20k-32k tokens with 8 questions each."""
    parents, lengths, queries = [], [], []
    for _ in range(2):
        doc = len(parents)
        parents.append(-1)
        lengths.append(int(_ints(rng, 20000, 32000)))
        for _ in range(8):
            queries.append(len(parents))
            parents.append(doc)
            lengths.append(int(_ints(rng, 16, 128)))
    return KVTree.from_lengths(parents, lengths, queries)


def token_tree(rng: np.random.Generator) -> KVTree:
    """2-6 requests (prompts of 512-4096 tokens), each verifying a speculative token tree of 32-96
    one-token nodes; every node of a token tree is a query."""
    parents: list[int] = []
    lengths: list[int] = []
    queries: list[int] = []
    for _ in range(int(_ints(rng, 2, 6))):
        prompt = len(parents)
        parents.append(-1)
        lengths.append(int(_ints(rng, 512, 4096)))
        nodes = [prompt]
        for _ in range(int(_ints(rng, 32, 96))):
            parent = nodes[int(rng.integers(0, len(nodes)))] if len(nodes) > 1 and rng.random() < 0.8 else prompt
            queries.append(len(parents))
            nodes.append(len(parents))
            parents.append(parent)
            lengths.append(1)
    return KVTree.from_lengths(parents, lengths, queries)


def deep_chat(rng: np.random.Generator) -> KVTree:
    """A system prompt over 8-24 chats, each a chain of 6-30 turns (32-256 tokens) with a
    regenerated turn now and then (a branch); the chain's last turn and every branch are queries."""
    parents, lengths, queries = [-1], [int(_ints(rng, 200, 1200))], []
    for _ in range(int(_ints(rng, 8, 24))):
        node = 0
        for _ in range(int(_ints(rng, 6, 30))):
            if rng.random() < 0.15:  # a regenerated answer: a sibling branch that is read
                queries.append(len(parents))
                parents.append(node)
                lengths.append(int(_ints(rng, 32, 256)))
            parents.append(node)
            lengths.append(int(_ints(rng, 32, 256)))
            node = len(parents) - 1
        queries.append(node)
    return KVTree.from_lengths(parents, lengths, queries)


def independent_2k(rng: np.random.Generator) -> KVTree:
    """64-256 independent requests of 1.5k-2.5k tokens: nothing shared."""
    n = int(_ints(rng, 64, 256))
    return KVTree.from_lengths([-1] * n, _ints(rng, 1500, 2500, size=n).tolist(), list(range(n)))


#: Family name -> generator ``(rng) -> KVTree``.
UNSEEN_FAMILIES: dict[str, Callable[[np.random.Generator], KVTree]] = {
    "wide_few_shot": wide_few_shot,
    "beam_forest": beam_forest,
    "multi_tenant": multi_tenant,
    "long_documents": long_documents,
    "token_tree": token_tree,
    "deep_chat": deep_chat,
    "independent_2k": independent_2k,
}


def sample_unseen_tree(family: str, seed: int) -> KVTree:
    """Draw one tree of an unseen ``family`` from ``numpy.random.default_rng(seed)``."""
    if family not in UNSEEN_FAMILIES:
        raise ValueError(f"unknown unseen family {family!r}; choose one of {sorted(UNSEEN_FAMILIES)}")
    return UNSEEN_FAMILIES[family](np.random.default_rng(seed))
