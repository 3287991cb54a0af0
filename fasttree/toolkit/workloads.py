"""Tree workloads for profiling and tuning: random tree families and serving simulations.

Two kinds of workload, both CPU-only and deterministic per seed:

* **Tree families** (:data:`TREE_FAMILIES`): functions ``(rng, **size params) -> KVTree``
  that draw one decode batch's KV tree of a given shape -- the paper-suite rule with random
  levels, random recursive trees, few-shot fan-outs, beam search, speculative-decoding
  token trees, multi-document forests and batches without sharing. :func:`sample_tree`
  draws one from a family name and a seed (the pair a trace records). Every parameter left
  at ``None`` is drawn from the range given in the family's docstring; the defaults keep a
  tree within :data:`MAX_QUERIES` queries and :data:`MAX_TOTAL_TOKENS` tokens.
* **Serving scenarios** (:data:`SCENARIOS`): the four end-to-end workloads of the FastTree
  paper, simulated as a server would see them. :func:`iter_serving` yields the KV tree of
  the active requests at every decode step while requests arrive, grow by one token per
  step, fork, finish and leave; :func:`simulate_serving` collects the trees.

All trees are built with :meth:`fasttree.KVTree.from_lengths` (contiguous pool slots, node
``i`` right after node ``i - 1``); every node holds at least one token.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..tree import KVTree
from ..validation import check_int, check_int_pair, check_number
from .suite import PAPER_SUITE, paper_tree

__all__ = [
    "MAX_QUERIES",
    "MAX_TOTAL_TOKENS",
    "PAPER_SUITE_WORKLOAD",
    "SCENARIOS",
    "TREE_FAMILIES",
    "ServingScenario",
    "ServingStep",
    "beam_search",
    "few_shot",
    "iter_serving",
    "multi_document",
    "no_sharing",
    "paper_random",
    "paper_suite_workload",
    "random_recursive",
    "sample_tree",
    "simulate_serving",
    "speculative",
]

#: Upper bound on the queries of a tree drawn with a family's default parameters.
MAX_QUERIES = 4096
#: Upper bound on the tokens of a tree drawn with a family's default parameters.
MAX_TOTAL_TOKENS = 1 << 20


# ------------------------------------------------------------------ helpers
def _check_range(name: str, value, lo: int = 1) -> tuple[int, int]:
    """``value`` as an inclusive integer range ``(a, b)`` with ``lo <= a <= b``."""
    return check_int_pair(name, value, minimum=lo, ordered=True)


def _log_uniform_int(rng: np.random.Generator, lo: int, hi: int, size: int | None = None):
    """Integers in ``[lo, hi]`` (``lo >= 1``) with log-uniformly distributed values."""
    u = rng.uniform(math.log(lo), math.log(hi + 1), size)
    if size is None:
        return min(max(int(math.exp(u)), lo), hi)
    return np.clip(np.floor(np.exp(u)), lo, hi).astype(np.int64)


def _uniform_int(rng: np.random.Generator, bounds: tuple[int, int], size: int | None = None):
    """Integers uniform in the inclusive range ``bounds``."""
    out = rng.integers(bounds[0], bounds[1] + 1, size=size)
    return out.astype(np.int64) if size is not None else int(out)


def _pick(rng: np.random.Generator, name: str, value, default: tuple[int, int], *, lo: int = 1, log: bool) -> int:
    """``value`` validated as an int ``>= lo``, or, when ``None``, drawn from ``default``."""
    if value is None:
        return _log_uniform_int(rng, *default) if log else _uniform_int(rng, default)
    return check_int(name, value, minimum=lo)


def _fit_budget(counts: np.ndarray, tokens: np.ndarray, budget: int) -> np.ndarray:
    """Scale ``tokens`` down (each stays >= 1) until ``counts @ tokens <= budget``."""
    counts = np.asarray(counts, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if int(counts.sum()) > budget:
        raise ValueError(f"max_total_tokens = {budget} is below the {int(counts.sum())} nodes of one token each")
    total = int(counts @ tokens)
    while total > budget:  # every pass lowers each token count above 1, so this ends
        tokens = np.maximum(1, np.floor(tokens * (budget / total))).astype(np.int64)
        total = int(counts @ tokens)
    return tokens


def _prune_and_compress(parents: np.ndarray, lengths: np.ndarray, has_query: np.ndarray) -> KVTree:
    """Radix-tree form of a forest whose parents precede their children (``parents[i] < i``).

    Drops nodes without a query in their subtree, merges every query-less node with a single
    child into that child, and builds the tree with one query per query-holding node.
    """
    n = parents.size
    par = parents.tolist()
    sub = has_query.astype(np.int64).tolist()
    for v in range(n - 1, -1, -1):  # children after parents: one reverse pass accumulates subtrees
        if par[v] >= 0:
            sub[par[v]] += sub[v]
    alive = np.array(sub) > 0
    n_children = np.bincount(parents[alive & (parents >= 0)], minlength=n)
    keep = alive & (has_query | (n_children != 1))
    keep_list = keep.tolist()
    alive_list = alive.tolist()
    up = [-1] * n  # nearest kept ancestor (old id), -1 for none
    acc = lengths.tolist()
    for v in range(n):
        p = par[v]
        if not alive_list[v] or p < 0:
            continue
        if keep_list[p]:
            up[v] = p
        else:  # p has v as its only live child: v absorbs p's tokens
            acc[v] += acc[p]
            up[v] = up[p]
    new_parent = np.array(up, dtype=np.int64)
    new_len = np.array(acc, dtype=np.int64)
    kept = np.flatnonzero(keep)
    index = np.full(n, -1, dtype=np.int64)
    index[kept] = np.arange(kept.size)
    par = new_parent[kept]
    par = np.where(par >= 0, index[np.maximum(par, 0)], -1)
    return KVTree.from_lengths(par, new_len[kept], index[np.flatnonzero(has_query)])


# ------------------------------------------------------------------ families
def paper_random(
    rng: np.random.Generator,
    *,
    levels: int | None = None,
    max_leaves: int = 1024,
    max_node_tokens: int = 4096,
    max_total_tokens: int = MAX_TOTAL_TOKENS,
) -> KVTree:
    """A tree built by the paper-suite rule (:meth:`KVTree.from_levels`) with random levels.

    One root; level widths grow (non-decreasing) from 1 to a leaf count drawn log-uniformly
    in ``[2, max_leaves]``; tokens per node are drawn per level, log-uniformly in
    ``[1, max_node_tokens]``, then scaled down (each >= 1) when the tree would hold more than
    ``max_total_tokens``. One query per last-level node.

    Parameters
    ----------
    rng : numpy.random.Generator
    levels : int, optional
        Number of levels (>= 2); drawn uniformly in ``[2, 9]`` when ``None``.
    max_leaves : int
        Largest last-level width (>= 2).
    max_node_tokens : int
        Largest tokens per node (>= 1).
    max_total_tokens : int
        Token budget of the tree.
    """
    n_levels = _pick(rng, "levels", levels, (2, 9), lo=2, log=False)
    max_leaves = check_int("max_leaves", max_leaves, minimum=2)
    max_node_tokens = check_int("max_node_tokens", max_node_tokens, minimum=1)
    max_total_tokens = check_int("max_total_tokens", max_total_tokens, minimum=1)
    leaves = _log_uniform_int(rng, 2, max_leaves)
    inner = np.sort(_log_uniform_int(rng, 1, leaves, size=n_levels - 2))
    widths = np.array([1, *inner.tolist(), leaves], dtype=np.int64)
    tokens = _fit_budget(widths, _log_uniform_int(rng, 1, max_node_tokens, size=n_levels), max_total_tokens)
    return KVTree.from_levels(widths.tolist(), tokens.tolist())


def random_recursive(
    rng: np.random.Generator,
    *,
    n_nodes: int | None = None,
    max_node_tokens: int = 512,
    internal_query_prob: float = 0.1,
    max_total_tokens: int = MAX_TOTAL_TOKENS,
) -> KVTree:
    """A random recursive tree: node 0 is the root, node ``i``'s parent is uniform in ``[0, i)``.

    Node lengths are log-uniform in ``[1, max_node_tokens]``. Every leaf carries one query;
    each internal node carries one with probability ``internal_query_prob`` (a request that
    ends inside a shared prefix). About half the nodes are leaves.

    Parameters
    ----------
    rng : numpy.random.Generator
    n_nodes : int, optional
        Nodes (>= 1); log-uniform in ``[2, 1024]`` when ``None``.
    max_node_tokens : int
        Largest node length (>= 1).
    internal_query_prob : float
        In ``[0, 1]``.
    max_total_tokens : int
        Token budget of the tree (lengths are scaled down to fit).
    """
    n = _pick(rng, "n_nodes", n_nodes, (2, 1024), log=True)
    max_node_tokens = check_int("max_node_tokens", max_node_tokens, minimum=1)
    max_total_tokens = check_int("max_total_tokens", max_total_tokens, minimum=1)
    internal_query_prob = check_number("internal_query_prob", internal_query_prob, minimum=0, maximum=1)
    parents = np.empty(n, dtype=np.int64)
    parents[0] = -1
    parents[1:] = np.minimum(np.floor(rng.random(n - 1) * np.arange(1, n)), np.arange(n - 1))
    lengths = _fit_budget(np.ones(n), _log_uniform_int(rng, 1, max_node_tokens, size=n), max_total_tokens)
    is_leaf = np.bincount(parents[1:], minlength=n) == 0
    has_query = is_leaf | (rng.random(n) < internal_query_prob)
    return KVTree.from_lengths(parents, lengths, np.flatnonzero(has_query))


def few_shot(
    rng: np.random.Generator,
    *,
    prompt_tokens: int | None = None,
    n_questions: int | None = None,
    question_tokens: tuple[int, int] = (8, 256),
) -> KVTree:
    """One long few-shot prompt (the root) with a wide fan-out of question leaves, one query each.

    Parameters
    ----------
    rng : numpy.random.Generator
    prompt_tokens : int, optional
        Root length; log-uniform in ``[512, 8192]`` when ``None``.
    n_questions : int, optional
        Question leaves; log-uniform in ``[16, 2048]`` when ``None``.
    question_tokens : (int, int)
        Inclusive range of a question's length (uniform).
    """
    prompt = _pick(rng, "prompt_tokens", prompt_tokens, (512, 8192), log=True)
    n_q = _pick(rng, "n_questions", n_questions, (16, 2048), log=True)
    q_range = _check_range("question_tokens", question_tokens)
    parents = np.zeros(n_q + 1, dtype=np.int64)
    parents[0] = -1
    lengths = np.concatenate([[prompt], _uniform_int(rng, q_range, size=n_q)])
    return KVTree.from_lengths(parents, lengths, np.arange(1, n_q + 1))


def beam_search(
    rng: np.random.Generator,
    *,
    width: int | None = None,
    depth: int | None = None,
    n_prompts: int | None = None,
    prompt_tokens: tuple[int, int] = (64, 4096),
    segment_tokens: tuple[int, int] = (1, 32),
) -> KVTree:
    """Beam-search trees: each prompt's beam of ``width`` expanded over ``depth`` rounds with pruning.

    In each round every live beam proposes ``width`` continuations (score = the beam's
    score minus an exponential draw), the best ``width`` of all proposals survive, and each
    survivor extends by a segment of tokens (the same length for the whole round, uniform in
    ``segment_tokens``). Branches without a surviving beam are dropped and single-child
    chains merged (radix form), so every internal node has >= 2 children and each prompt
    root carries exactly ``width`` queries, one per live beam, at the leaves. Several prompts
    form a forest.

    Parameters
    ----------
    rng : numpy.random.Generator
    width : int, optional
        Beam width (>= 2); log-uniform in ``[2, 32]`` when ``None``.
    depth : int, optional
        Branching rounds (>= 1); uniform in ``[1, 16]`` when ``None``.
    n_prompts : int, optional
        Independent beam searches in the batch (>= 1); log-uniform in ``[1, 16]`` when ``None``.
    prompt_tokens : (int, int)
        Inclusive range of a prompt's length (log-uniform).
    segment_tokens : (int, int)
        Inclusive range of the tokens a round appends to each survivor.
    """
    w = _pick(rng, "width", width, (2, 32), lo=2, log=True)
    d = _pick(rng, "depth", depth, (1, 16), log=False)
    n_p = _pick(rng, "n_prompts", n_prompts, (1, 16), log=True)
    p_range = _check_range("prompt_tokens", prompt_tokens)
    s_range = _check_range("segment_tokens", segment_tokens)
    parents: list[int] = []
    lengths: list[int] = []
    queries: list[int] = []
    for _ in range(n_p):
        parents.append(-1)
        lengths.append(_log_uniform_int(rng, *p_range))
        live = np.array([len(parents) - 1], dtype=np.int64)
        scores = np.zeros(1)
        for _ in range(d):
            cand_parent = np.repeat(live, w)
            cand_score = np.repeat(scores, w) - rng.exponential(size=cand_parent.size)
            best = np.argsort(-cand_score, kind="stable")[:w]
            segment = _uniform_int(rng, s_range)
            first = len(parents)
            parents.extend(cand_parent[best].tolist())
            lengths.extend([segment] * w)
            live = np.arange(first, first + w, dtype=np.int64)
            scores = cand_score[best]
        queries.extend(live.tolist())
    has_query = np.zeros(len(parents), dtype=bool)
    has_query[queries] = True
    return _prune_and_compress(np.array(parents, dtype=np.int64), np.array(lengths, dtype=np.int64), has_query)


def speculative(
    rng: np.random.Generator,
    *,
    n_requests: int | None = None,
    n_token_nodes: int | None = None,
    max_depth: int | None = None,
    prompt_tokens: tuple[int, int] = (128, 8192),
) -> KVTree:
    """Speculative-decoding verification: per request, a prompt root and a tree of 1-token draft nodes.

    Draft token ``i`` hangs under the prompt or under a uniformly chosen earlier draft token
    whose depth below the prompt is less than ``max_depth`` (a random recursive tree of
    bounded depth). Every draft token carries one query; the prompt carries none. Requests
    form a forest, one root per request.

    Parameters
    ----------
    rng : numpy.random.Generator
    n_requests : int, optional
        Requests in the batch (>= 1); log-uniform in ``[1, 16]`` when ``None``.
    n_token_nodes : int, optional
        Draft tokens per request (>= 1); drawn per request, log-uniform in ``[4, 256]``, when
        ``None``.
    max_depth : int, optional
        Deepest draft token below the prompt (>= 1); uniform in ``[1, 12]`` when ``None``.
    prompt_tokens : (int, int)
        Inclusive range of a prompt's length (log-uniform).
    """
    n_req = _pick(rng, "n_requests", n_requests, (1, 16), log=True)
    if n_token_nodes is not None:
        check_int("n_token_nodes", n_token_nodes, minimum=1)
    depth_cap = _pick(rng, "max_depth", max_depth, (1, 12), log=False)
    p_range = _check_range("prompt_tokens", prompt_tokens)
    parents: list[int] = []
    lengths: list[int] = []
    queries: list[int] = []
    for _ in range(n_req):
        m = _pick(rng, "n_token_nodes", n_token_nodes, (4, 256), log=True)
        root = len(parents)
        parents.append(-1)
        lengths.append(_log_uniform_int(rng, *p_range))
        eligible = [root]  # nodes that may take a child: the prompt and drafts above max_depth
        depth = {root: 0}
        picks = rng.random(m)
        for i in range(m):
            parent = eligible[int(picks[i] * len(eligible))]
            node = len(parents)
            parents.append(parent)
            lengths.append(1)
            queries.append(node)
            depth[node] = depth[parent] + 1
            if depth[node] < depth_cap:
                eligible.append(node)
    return KVTree.from_lengths(parents, lengths, queries)


def multi_document(
    rng: np.random.Generator,
    *,
    n_documents: int | None = None,
    doc_tokens: tuple[int, int] = (500, 2000),
    questions_per_doc: tuple[int, int] = (2, 16),
    question_tokens: tuple[int, int] = (8, 128),
) -> KVTree:
    """A forest of documents (roots), each with several question leaves, one query per question.

    Parameters
    ----------
    rng : numpy.random.Generator
    n_documents : int, optional
        Roots (>= 1); uniform in ``[2, 32]`` when ``None``.
    doc_tokens : (int, int)
        Inclusive range of a document's length (uniform).
    questions_per_doc : (int, int)
        Inclusive range of a document's question count, drawn per document.
    question_tokens : (int, int)
        Inclusive range of a question's length (uniform).
    """
    n_doc = _pick(rng, "n_documents", n_documents, (2, 32), log=False)
    d_range = _check_range("doc_tokens", doc_tokens)
    q_count = _check_range("questions_per_doc", questions_per_doc)
    q_range = _check_range("question_tokens", question_tokens)
    n_q = _uniform_int(rng, q_count, size=n_doc)
    doc_len = _uniform_int(rng, d_range, size=n_doc)
    # documents first (nodes 0 .. n_doc - 1), then each document's questions in order
    parents = np.concatenate([np.full(n_doc, -1, dtype=np.int64), np.repeat(np.arange(n_doc), n_q)])
    lengths = np.concatenate([doc_len, _uniform_int(rng, q_range, size=int(n_q.sum()))])
    return KVTree.from_lengths(parents, lengths, np.arange(n_doc, parents.size))


def no_sharing(
    rng: np.random.Generator,
    *,
    n_requests: int | None = None,
    context_tokens: tuple[int, int] = (16, 4096),
    max_total_tokens: int = MAX_TOTAL_TOKENS,
) -> KVTree:
    """A batch of independent requests: a forest of single-node roots, one query each.

    Parameters
    ----------
    rng : numpy.random.Generator
    n_requests : int, optional
        Requests (>= 1); log-uniform in ``[1, 1024]`` when ``None``.
    context_tokens : (int, int)
        Inclusive range of a context's length (log-uniform); scaled down (each >= 1) when
        the batch would hold more than ``max_total_tokens``.
    max_total_tokens : int
        Token budget of the batch.
    """
    n = _pick(rng, "n_requests", n_requests, (1, 1024), log=True)
    c_range = _check_range("context_tokens", context_tokens)
    max_total_tokens = check_int("max_total_tokens", max_total_tokens, minimum=1)
    lengths = _fit_budget(np.ones(n), _log_uniform_int(rng, *c_range, size=n), max_total_tokens)
    return KVTree.from_lengths(np.full(n, -1, dtype=np.int64), lengths, np.arange(n))


#: Family name -> generator ``(rng, **params) -> KVTree``.
TREE_FAMILIES: dict[str, Callable[..., KVTree]] = {
    "paper_random": paper_random,
    "random_recursive": random_recursive,
    "few_shot": few_shot,
    "beam_search": beam_search,
    "speculative": speculative,
    "multi_document": multi_document,
    "no_sharing": no_sharing,
}


def sample_tree(family: str, seed: int, **params) -> KVTree:
    """Draw one tree of ``family`` from ``numpy.random.default_rng(seed)``.

    The same ``(family, seed, params)`` always gives the same tree.

    Parameters
    ----------
    family : str
        A key of :data:`TREE_FAMILIES`.
    seed : int
        Non-negative.
    **params
        Keyword parameters of the family's generator.

    Raises
    ------
    ValueError
        On an unknown family, a bad seed, or a bad parameter value.
    """
    if family not in TREE_FAMILIES:
        raise ValueError(f"unknown tree family {family!r}; choose one of {sorted(TREE_FAMILIES)}")
    seed = check_int("seed", seed, minimum=0)
    return TREE_FAMILIES[family](np.random.default_rng(seed), **params)


def paper_suite_workload() -> dict[int, KVTree]:
    """The 15 paper-suite trees, case number (1..15) -> tree (:func:`fasttree.toolkit.suite.paper_tree`)."""
    return {case: paper_tree(case) for case in PAPER_SUITE}


#: Alias of :func:`paper_suite_workload` (a function: each call builds fresh trees).
PAPER_SUITE_WORKLOAD = paper_suite_workload


# ------------------------------------------------------------------ serving
@dataclass(frozen=True)
class ServingScenario:
    """A serving workload: a static tree of shared prompt prefixes and requests that ask under them.

    The shared prefixes form ``len(prefix_levels)`` levels: level 0 has ``prefix_levels[0][0]``
    roots, and each node of level ``l - 1`` has ``prefix_levels[l][0]`` children; a node of
    level ``l`` holds a length drawn uniformly in ``prefix_levels[l][1:]`` (once per
    simulation). Each last-level node (a *prefix*) has ``questions_per_prefix`` question
    templates. A request asks one question: on arrival its private node holds the question's
    tokens under its prefix, and each decode step appends one token. Requests cycle through a
    fresh random order of all templates.

    With ``forks``, a request first decodes a reasoning trunk of ``fork_after`` tokens, then
    its private node becomes shared and it is replaced by ``forks[0]`` fork requests below it
    (each starting with no private token), which fork again by ``forks[1]`` if given, and so
    on; only the last level's forks decode ``output_tokens`` and finish.

    Attributes
    ----------
    name, description : str
    prefix_levels : tuple of (int, int, int)
        Per level: (nodes per parent node, min tokens, max tokens).
    questions_per_prefix : int
    question_tokens : (int, int)
        Inclusive range of a question's length (>= 1).
    output_tokens : (int, int)
        Inclusive range of the tokens a request decodes before it finishes.
    forks : tuple of int
        Fan-out of each fork level (each >= 2); empty: requests never fork.
    fork_after : (int, int)
        Inclusive range of the trunk tokens decoded before a fork.
    max_batch : int
        Default cap on active requests (a forking question reserves ``prod(forks)`` slots).
    arrival_rate : float
        Default mean new questions per decode step (Poisson).
    """

    name: str
    description: str
    prefix_levels: tuple[tuple[int, int, int], ...]
    questions_per_prefix: int
    question_tokens: tuple[int, int]
    output_tokens: tuple[int, int] = (32, 256)
    forks: tuple[int, ...] = ()
    fork_after: tuple[int, int] = (32, 128)
    max_batch: int = 256
    arrival_rate: float = 1.0

    def __post_init__(self) -> None:
        if not self.prefix_levels:
            raise ValueError("prefix_levels must hold at least one level")
        for lvl, spec in enumerate(self.prefix_levels):
            if len(spec) != 3:
                raise ValueError(f"prefix_levels[{lvl}] must be (nodes, min tokens, max tokens), got {spec!r}")
            check_int(f"prefix_levels[{lvl}] nodes", spec[0], minimum=1)
            _check_range(f"prefix_levels[{lvl}] tokens", spec[1:])
        check_int("questions_per_prefix", self.questions_per_prefix, minimum=1)
        _check_range("question_tokens", self.question_tokens)
        _check_range("output_tokens", self.output_tokens)
        for f in self.forks:
            check_int("forks entry", f, minimum=2)
        _check_range("fork_after", self.fork_after)
        check_int("max_batch", self.max_batch, minimum=self.slots_per_question)
        check_number("arrival_rate", self.arrival_rate, minimum=0)

    @property
    def slots_per_question(self) -> int:
        """Most requests one question runs at once (the product of ``forks``)."""
        return math.prod(self.forks)

    @property
    def mean_question_steps(self) -> float:
        """Mean decode steps from a question's admission until its last request finishes."""
        return len(self.forks) * sum(self.fork_after) / 2 + sum(self.output_tokens) / 2


#: The four end-to-end scenarios of the FastTree paper (Llama-2-7B / Mistral-7B, up to 256 new tokens).
#: All answers decode 32-256 tokens (uniform). Default load, chosen near 85% of the batch by Little's law:
#: multi_level_system_prompts max_batch 256, 1.5 questions/step; few_shot and multi_document_qa max_batch 128,
#: 0.75/step; chain_reasoning max_batch 128 (32 questions of 4 forks), 0.12/step.
SCENARIOS: dict[str, ServingScenario] = {
    s.name: s
    for s in (
        ServingScenario(
            name="multi_level_system_prompts",
            description=(
                "4 system prompts x 128 questions: a common preamble (768-1280 tokens) above 4 role prompts "
                "(256-768 tokens each), questions of 16-128 tokens"
            ),
            prefix_levels=((1, 768, 1280), (4, 256, 768)),
            questions_per_prefix=128,
            question_tokens=(16, 128),
            max_batch=256,
            arrival_rate=1.5,
        ),
        ServingScenario(
            name="few_shot",
            description=(
                "8 branches x 20 shots x 16 questions: a task instruction (128-256 tokens) above 8 branches of "
                "20 shots each (800-1600 tokens, ~40-80 per shot), questions of 16-64 tokens"
            ),
            prefix_levels=((1, 128, 256), (8, 800, 1600)),
            questions_per_prefix=16,
            question_tokens=(16, 64),
            max_batch=128,
            arrival_rate=0.75,
        ),
        ServingScenario(
            name="chain_reasoning",
            description=(
                "32 questions x 4 forks: under a system prompt (128-384 tokens), each question (32-128 tokens) "
                "decodes a 32-128 token reasoning trunk, then forks into 4 chains that share it"
            ),
            prefix_levels=((1, 128, 384),),
            questions_per_prefix=32,
            question_tokens=(32, 128),
            forks=(4,),
            fork_after=(32, 128),
            max_batch=128,
            arrival_rate=0.12,
        ),
        ServingScenario(
            name="multi_document_qa",
            description="16 documents (roots of 900-1300 tokens, ~1100) x 8 questions of 16-64 tokens",
            prefix_levels=((16, 900, 1300),),
            questions_per_prefix=8,
            question_tokens=(16, 64),
            max_batch=128,
            arrival_rate=0.75,
        ),
    )
}


@dataclass(frozen=True)
class ServingStep:
    """The decode batch of one server step.

    Attributes
    ----------
    step : int
        Decode step (idle steps without an active request yield nothing, so steps may jump).
    tree : KVTree
        Query ``j`` is request ``request_ids[j]``; requests in admission order.
    request_ids : ndarray, int64 [n_queries]
        Identity of each query's request; a fork is a new request.
    prefix_ids : ndarray, int64 [n_queries]
        Index of each request's static prefix (last-level shared node, 0-based in level order).
    node_ids : ndarray, int64 [n_nodes]
        The simulator's identity of each tree node: the same for a node in every step it
        appears in, so a caller can keep its KV at fixed pool slots across steps (the trees
        themselves number slots contiguously, step by step).
    """

    step: int
    tree: KVTree
    request_ids: np.ndarray
    prefix_ids: np.ndarray
    node_ids: np.ndarray


class _Request:
    __slots__ = ("group", "level", "node", "parent", "prefix", "remaining", "rid")

    def __init__(self, rid: int, group: int, prefix: int, parent: int, node: int, remaining: int, level: int) -> None:
        self.rid = rid
        self.group = group  # the question it serves (forks share it)
        self.prefix = prefix
        self.parent = parent  # shared node above the private one
        self.node = node  # private node
        self.remaining = remaining  # tokens left to decode in this phase (trunk or answer)
        self.level = level  # fork levels already taken


def _resolve(scenario: str | ServingScenario) -> ServingScenario:
    if isinstance(scenario, ServingScenario):
        return scenario
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown serving scenario {scenario!r}; choose one of {sorted(SCENARIOS)}")
    return SCENARIOS[scenario]


def iter_serving(
    scenario: str | ServingScenario,
    *,
    seed: int,
    steps: int,
    max_batch: int | None = None,
    arrival_rate: float | None = None,
    initial_requests: int | None = None,
) -> Iterator[ServingStep]:
    """Simulate a server on ``scenario`` and yield the KV tree of every decode step.

    At each step: new questions arrive (``initial_requests`` at step 0, then a Poisson
    number with mean ``arrival_rate``) and wait in a FIFO queue; queued questions are
    admitted while the reserved batch slots stay within ``max_batch``; the tree of the
    active requests is yielded; then every active request decodes one token into its private
    node. A request whose phase ends either forks (see :class:`ServingScenario`) or finishes
    and leaves; shared nodes no active request reads no longer appear in the trees. A
    request without private tokens yet (a fresh fork) queries its shared node.

    Parameters
    ----------
    scenario : str or ServingScenario
        A key of :data:`SCENARIOS`, or a custom scenario.
    seed : int
        Non-negative; the same arguments always give the same trees.
    steps : int
        Trees to yield (>= 1). Fewer come when ``arrival_rate`` is 0 and every request has
        finished.
    max_batch : int, optional
        Cap on active requests; the scenario's default when ``None``.
    arrival_rate : float, optional
        Mean new questions per step; the scenario's default when ``None``.
    initial_requests : int, optional
        Questions arriving at step 0. When ``None``: the steady-state load
        ``arrival_rate * scenario.mean_question_steps`` capped at a full batch, or a full batch
        when ``arrival_rate`` is 0. ``arrival_rate=0`` with ``initial_requests=n`` submits
        ``n`` questions at once and drains them (the paper's end-to-end set-up).

    Yields
    ------
    ServingStep
    """
    sc = _resolve(scenario)
    seed = check_int("seed", seed, minimum=0)
    steps = check_int("steps", steps, minimum=1)
    slots = sc.slots_per_question
    batch = sc.max_batch if max_batch is None else check_int("max_batch", max_batch, minimum=slots)
    rate = sc.arrival_rate if arrival_rate is None else check_number("arrival_rate", arrival_rate, minimum=0)
    if initial_requests is not None:
        initial = check_int("initial_requests", initial_requests, minimum=0)
    elif rate == 0:
        initial = batch // slots
    else:  # about the steady-state number of questions in the system (Little's law), at most a full batch
        initial = min(batch // slots, round(rate * sc.mean_question_steps))
    sim = _Simulation(sc, np.random.default_rng(seed), batch)
    sim.arrive(initial)
    emitted = t = 0
    while emitted < steps:
        if t > 0 and rate > 0:
            sim.arrive(int(sim.rng.poisson(rate)))
        sim.admit()
        if not sim.active:
            if rate == 0:
                return
            t += 1
            continue
        yield _emit(t, sim.active, sim.node_parent, sim.node_len)
        emitted += 1
        sim.decode_one_token()
        t += 1


class _Simulation:
    """One serving simulation's state: the node forest (static prefixes first, parents before
    children), the active requests, the question queue and the reserved batch slots.

    Every random draw comes from ``rng`` in a fixed order, so a seed fixes the trees.
    """

    def __init__(self, sc: ServingScenario, rng: np.random.Generator, batch: int) -> None:
        self.sc = sc
        self.rng = rng
        self.batch = batch
        self.slots = sc.slots_per_question
        self.node_parent: list[int] = []
        self.node_len: list[int] = []
        self.prefixes = self._static_prefixes()
        # the question templates: each prefix's questions, with their lengths
        self.template_prefix = np.repeat(np.arange(len(self.prefixes)), sc.questions_per_prefix)
        self.template_len = _uniform_int(rng, sc.question_tokens, size=self.template_prefix.size)
        self.order: deque[int] = deque()  # templates not drawn yet in the current permutation
        self.pending: deque[int] = deque()  # questions waiting for admission
        self.active: dict[int, _Request] = {}
        self.group_live: dict[int, int] = {}  # live requests per question
        self.reserved = 0
        self.next_rid = self.next_group = 0

    def _static_prefixes(self) -> list[int]:
        """Add the shared prefix nodes level by level; returns the last level's nodes."""
        level_nodes: list[int] = [-1]
        for lvl, (fan_out, lo, hi) in enumerate(self.sc.prefix_levels):
            nodes: list[int] = []
            for parent in level_nodes:
                for _ in range(fan_out):
                    nodes.append(self._new_node(parent if lvl else -1, _uniform_int(self.rng, (lo, hi))))
            level_nodes = nodes
        return level_nodes

    def _new_node(self, parent: int, length: int) -> int:
        self.node_parent.append(parent)
        self.node_len.append(length)
        return len(self.node_parent) - 1

    def _phase_tokens(self, level: int) -> int:
        """Tokens of a request's next phase: a trunk before a fork level, else the answer."""
        sc = self.sc
        return _uniform_int(self.rng, sc.fork_after if level < len(sc.forks) else sc.output_tokens)

    def arrive(self, count: int) -> None:
        """Queue ``count`` new questions, drawn from the templates by successive random permutations."""
        for _ in range(count):
            if not self.order:
                self.order.extend(self.rng.permutation(self.template_prefix.size).tolist())
            self.pending.append(self.order.popleft())

    def admit(self) -> None:
        """Admit queued questions while their reserved batch slots fit in ``batch``."""
        while self.pending and self.reserved + self.slots <= self.batch:
            tpl = self.pending.popleft()
            prefix = int(self.template_prefix[tpl])
            anchor = self.prefixes[prefix]
            node = self._new_node(anchor, int(self.template_len[tpl]))
            rid, group = self.next_rid, self.next_group
            self.active[rid] = _Request(rid, group, prefix, anchor, node, self._phase_tokens(0), 0)
            self.group_live[group] = 1
            self.reserved += self.slots
            self.next_rid += 1
            self.next_group += 1

    def decode_one_token(self) -> None:
        """Every active request decodes one token; a request whose phase ends forks or finishes."""
        for rid in list(self.active):
            req = self.active[rid]
            self.node_len[req.node] += 1
            req.remaining -= 1
            if req.remaining:
                continue
            del self.active[rid]
            if req.level < len(self.sc.forks):
                self._fork(req)
            else:
                self._finish(req)

    def _fork(self, req: _Request) -> None:
        """The trunk becomes shared; the forks start empty below it."""
        n_forks = self.sc.forks[req.level]
        for _ in range(n_forks):
            child = self._new_node(req.node, 0)
            level = req.level + 1
            self.active[self.next_rid] = _Request(
                self.next_rid, req.group, req.prefix, req.node, child, self._phase_tokens(level), level
            )
            self.next_rid += 1
        self.group_live[req.group] += n_forks - 1

    def _finish(self, req: _Request) -> None:
        """The request leaves; its question's slots are freed once its last request has."""
        self.group_live[req.group] -= 1
        if self.group_live[req.group] == 0:
            del self.group_live[req.group]
            self.reserved -= self.slots


def _emit(step: int, active: dict[int, _Request], node_parent: list[int], node_len: list[int]) -> ServingStep:
    """The KV tree of the active requests: the nodes on their paths, in creation order."""
    query_old: list[int] = []
    used: set[int] = set()
    for req in active.values():
        q = req.node if node_len[req.node] > 0 else req.parent
        query_old.append(q)
        while q >= 0 and q not in used:
            used.add(q)
            q = node_parent[q]
    nodes = sorted(used)
    index = {v: i for i, v in enumerate(nodes)}
    parents = [index[node_parent[v]] if node_parent[v] >= 0 else -1 for v in nodes]
    lengths = [node_len[v] for v in nodes]
    tree = KVTree.from_lengths(parents, lengths, [index[q] for q in query_old])
    request_ids = np.fromiter(active, dtype=np.int64, count=len(active))
    prefix_ids = np.fromiter((r.prefix for r in active.values()), dtype=np.int64, count=len(active))
    return ServingStep(step, tree, request_ids, prefix_ids, np.array(nodes, dtype=np.int64))


def simulate_serving(
    scenario: str | ServingScenario,
    *,
    seed: int,
    steps: int,
    max_batch: int | None = None,
    arrival_rate: float | None = None,
    initial_requests: int | None = None,
) -> list[KVTree]:
    """The decode-step trees of :func:`iter_serving`, as a list (same parameters)."""
    return [
        s.tree
        for s in iter_serving(
            scenario,
            seed=seed,
            steps=steps,
            max_batch=max_batch,
            arrival_rate=arrival_rate,
            initial_requests=initial_requests,
        )
    ]
