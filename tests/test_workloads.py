"""Workload generators: tree families (shape, bounds, determinism) and serving simulations
(trees per decode step, one-token growth, sharing of prefixes, forks, batch cap)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

import fasttree as ft
from fasttree.toolkit.suite import PAPER_SUITE, paper_tree
from fasttree.toolkit.workloads import (
    MAX_QUERIES,
    MAX_TOTAL_TOKENS,
    PAPER_SUITE_WORKLOAD,
    SCENARIOS,
    TREE_FAMILIES,
    ServingScenario,
    iter_serving,
    sample_tree,
    simulate_serving,
)

SEEDS = range(8)
FAMILIES = sorted(TREE_FAMILIES)


# ------------------------------------------------------------------ helpers
def n_children(tree: ft.KVTree) -> np.ndarray:
    return np.bincount(tree.parents[tree.parents >= 0], minlength=tree.n_nodes)


def roots_of(tree: ft.KVTree, nodes: np.ndarray) -> np.ndarray:
    """The root above each node of ``nodes``."""
    cur = np.asarray(nodes, dtype=np.int64).copy()
    while (tree.parents[cur] >= 0).any():
        up = tree.parents[cur] >= 0
        cur[up] = tree.parents[cur[up]]
    return cur


def ancestor_at_depth(tree: ft.KVTree, node: int, depth: int) -> int:
    while tree.depth[node] > depth:
        node = int(tree.parents[node])
    return node


def same_tree(a: ft.KVTree, b: ft.KVTree) -> bool:
    return (
        np.array_equal(a.parents, b.parents)
        and np.array_equal(a.lengths, b.lengths)
        and np.array_equal(a.query_nodes, b.query_nodes)
    )


def contexts(tree: ft.KVTree) -> np.ndarray:
    return tree.path_lengths[tree.query_nodes]


# ------------------------------------------------------------------ families: common properties
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trees_are_valid_bounded_and_contiguous(family):
    for seed in SEEDS:
        tree = sample_tree(family, seed)
        assert isinstance(tree, ft.KVTree)
        assert 1 <= tree.n_queries <= MAX_QUERIES
        assert 1 <= tree.num_tokens <= MAX_TOTAL_TOKENS
        assert tree.lengths.min() >= 1, "every generated node holds tokens"
        assert contexts(tree).min() >= 1
        np.testing.assert_array_equal(tree.slots, np.arange(tree.num_tokens))  # from_lengths: contiguous


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_deterministic_per_seed(family):
    assert same_tree(sample_tree(family, 3), sample_tree(family, 3))
    differ = [not same_tree(sample_tree(family, 0), sample_tree(family, s)) for s in (1, 2, 3)]
    assert any(differ), f"{family}: seeds 0..3 all gave the same tree"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trees_plan(family):
    for seed in (0, 1):
        tree = sample_tree(family, seed)
        plan = ft.plan(tree, num_q_heads=32, num_kv_heads=8, head_dim=128)
        assert plan is not None


def test_defaults_stay_within_bounds_over_many_seeds():
    for family in FAMILIES:
        for seed in range(40, 70):
            tree = sample_tree(family, seed)
            assert tree.n_queries <= MAX_QUERIES and tree.num_tokens <= MAX_TOTAL_TOKENS, (family, seed, tree)


def test_sample_tree_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown tree family"):
        sample_tree("bogus", 0)
    with pytest.raises(ValueError, match="seed"):
        sample_tree("few_shot", -1)
    with pytest.raises(ValueError, match="seed"):
        sample_tree("few_shot", 1.5)
    with pytest.raises(ValueError, match="width"):
        sample_tree("beam_search", 0, width=1)
    with pytest.raises(ValueError, match="levels"):
        sample_tree("paper_random", 0, levels=1)
    with pytest.raises(ValueError, match="question_tokens"):
        sample_tree("few_shot", 0, question_tokens=(10, 5))
    with pytest.raises(ValueError, match="internal_query_prob"):
        sample_tree("random_recursive", 0, internal_query_prob=1.5)
    with pytest.raises(ValueError, match="max_total_tokens"):
        sample_tree("no_sharing", 0, n_requests=10, max_total_tokens=5)
    with pytest.raises(TypeError):
        sample_tree("no_sharing", 0, not_a_param=3)


# ------------------------------------------------------------------ families: shapes
def test_paper_random_follows_the_suite_rule():
    depths = set()
    for seed in range(20):
        tree = sample_tree("paper_random", seed)
        n_levels = len(tree.levels)
        depths.add(n_levels)
        assert 2 <= n_levels <= 9
        widths = [lvl.size for lvl in tree.levels]
        assert widths[0] == 1 and widths == sorted(widths) and widths[-1] <= 1024
        for lvl in tree.levels:
            assert np.unique(tree.lengths[lvl]).size == 1, "one token count per level"
            assert 1 <= tree.lengths[lvl][0] <= 4096
        np.testing.assert_array_equal(np.sort(tree.query_nodes), np.sort(tree.levels[-1]))
        # the same tree as from_levels with the drawn widths and tokens
        again = ft.KVTree.from_levels(widths, [int(tree.lengths[lvl][0]) for lvl in tree.levels])
        assert same_tree(tree, again)
    assert len(depths) >= 4, f"level counts hardly vary: {depths}"


def test_paper_random_respects_token_budget():
    tree = sample_tree("paper_random", 5, levels=3, max_total_tokens=20_000)
    assert tree.num_tokens <= 20_000


def test_random_recursive_shape():
    internal_queries = 0
    for seed in range(12):
        tree = sample_tree("random_recursive", seed)
        n = tree.n_nodes
        assert tree.parents[0] == -1 and (tree.parents[1:] >= 0).all()
        assert (tree.parents[1:] < np.arange(1, n)).all(), "parent of node i lies in [0, i)"
        leaves = np.flatnonzero(n_children(tree) == 0)
        assert np.isin(leaves, tree.query_nodes).all(), "every leaf carries a query"
        assert np.unique(tree.query_nodes).size == tree.n_queries
        internal_queries += int((n_children(tree)[tree.query_nodes] > 0).sum())
    assert internal_queries > 0, "some queries end inside the tree"
    tree = sample_tree("random_recursive", 0, n_nodes=50, internal_query_prob=1.0)
    assert tree.n_nodes == 50 and tree.n_queries == 50


def test_few_shot_is_one_root_with_wide_fan_out():
    for seed in SEEDS:
        tree = sample_tree("few_shot", seed)
        assert tree.parents[0] == -1 and (tree.parents[1:] == 0).all()
        assert tree.n_nodes - 1 >= 16
        np.testing.assert_array_equal(np.sort(tree.query_nodes), np.arange(1, tree.n_nodes))
        assert tree.lengths[0] >= 512
    tree = sample_tree("few_shot", 0, prompt_tokens=3000, n_questions=40, question_tokens=(5, 5))
    assert tree.lengths[0] == 3000 and tree.n_queries == 40 and (tree.lengths[1:] == 5).all()


def test_beam_search_keeps_one_query_per_live_beam():
    for seed in SEEDS:
        tree = sample_tree("beam_search", seed)
        kids = n_children(tree)
        assert (kids[tree.query_nodes] == 0).all(), "queries sit at the live beams (leaves)"
        assert np.unique(tree.query_nodes).size == tree.n_queries
        assert (kids[kids > 0] >= 2).all(), "radix form: no single-child chains"
        assert (np.isin(np.flatnonzero(kids == 0), tree.query_nodes)).all(), "no dead branches"
        per_root = np.bincount(roots_of(tree, tree.query_nodes))
        assert np.unique(per_root[per_root > 0]).size == 1, "every prompt keeps the same beam width"
    tree = sample_tree("beam_search", 1, width=5, depth=6, n_prompts=3)
    assert tree.n_queries == 15 and int((tree.parents < 0).sum()) == 3
    per_root = np.bincount(roots_of(tree, tree.query_nodes), minlength=tree.n_nodes)
    assert (per_root[tree.parents < 0] == 5).all()


def test_speculative_is_one_token_nodes_under_prompts():
    for seed in SEEDS:
        tree = sample_tree("speculative", seed)
        roots = tree.parents < 0
        assert (tree.lengths[~roots] == 1).all(), "draft nodes hold one token"
        np.testing.assert_array_equal(np.sort(tree.query_nodes), np.flatnonzero(~roots))  # one query per draft
    tree = sample_tree("speculative", 2, n_requests=3, n_token_nodes=20, max_depth=4)
    assert int((tree.parents < 0).sum()) == 3 and tree.n_queries == 60
    assert tree.depth.max() <= 4
    chain = sample_tree("speculative", 2, n_requests=1, n_token_nodes=10, max_depth=1)
    assert (chain.parents[1:] == 0).all(), "max_depth 1: every draft hangs under the prompt"


def test_multi_document_is_a_forest_of_documents():
    for seed in SEEDS:
        tree = sample_tree("multi_document", seed)
        roots = np.flatnonzero(tree.parents < 0)
        assert roots.size >= 2
        assert ((tree.lengths[roots] >= 500) & (tree.lengths[roots] <= 2000)).all()
        assert tree.depth.max() == 1
        assert (n_children(tree)[roots] >= 2).all(), "several questions per document"
        np.testing.assert_array_equal(np.sort(tree.query_nodes), np.flatnonzero(tree.parents >= 0))
    tree = sample_tree("multi_document", 0, n_documents=5, questions_per_doc=(3, 3))
    assert int((tree.parents < 0).sum()) == 5 and tree.n_queries == 15


def test_no_sharing_is_one_query_per_root():
    for seed in SEEDS:
        tree = sample_tree("no_sharing", seed)
        assert (tree.parents == -1).all()
        assert tree.n_nodes == tree.n_queries
        np.testing.assert_array_equal(np.bincount(tree.query_nodes, minlength=tree.n_nodes), 1)
    tree = sample_tree("no_sharing", 0, n_requests=1024, context_tokens=(4096, 4096))
    assert tree.n_queries == 1024 and tree.num_tokens <= MAX_TOTAL_TOKENS, "budget scales lengths down"


def test_paper_suite_workload():
    trees = PAPER_SUITE_WORKLOAD()
    assert sorted(trees) == sorted(PAPER_SUITE) and len(trees) == 15
    for case, tree in trees.items():
        assert same_tree(tree, paper_tree(case))


# ------------------------------------------------------------------ serving
STEPS = 120


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return {name: list(iter_serving(name, seed=0, steps=STEPS)) for name in SCENARIOS}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_serving_trees_change_and_contexts_grow_by_one(runs, name):
    run = runs[name]
    assert len(run) == STEPS
    assert [s.step for s in run] == list(range(STEPS)), "no idle steps at the default load"
    kept = grown = 0
    for prev, cur in itertools.pairwise(run):
        assert not same_tree(prev.tree, cur.tree)
        before = dict(zip(prev.request_ids.tolist(), contexts(prev.tree).tolist(), strict=True))
        for rid, ctx in zip(cur.request_ids.tolist(), contexts(cur.tree).tolist(), strict=True):
            if rid in before:
                kept += 1
                grown += ctx == before[rid] + 1
    assert kept > 0 and grown == kept, f"{kept - grown} of {kept} staying requests did not grow by exactly one"
    ids = [set(s.request_ids.tolist()) for s in run]
    assert ids[0] - ids[-1], "requests finish and leave"
    assert ids[-1] - ids[0], "new requests join"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_serving_batches_are_valid_and_capped(runs, name):
    sc = SCENARIOS[name]
    for s in runs[name]:
        tree = s.tree
        assert 1 <= tree.n_queries <= sc.max_batch
        assert contexts(tree).min() >= 1
        assert tree.lengths.min() >= 1, "no empty node reaches the tree"
        assert np.unique(s.request_ids).size == tree.n_queries
        assert (np.diff(s.request_ids) > 0).all(), "queries in admission order"
        # every node is read by some query: shared nodes without a request disappear
        assert tree.subtree_queries.min() >= 1


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_serving_trees_plan(runs, name):
    for s in runs[name][:: STEPS // 4]:
        plan = ft.plan(s.tree, num_q_heads=32, num_kv_heads=8, head_dim=128)
        assert plan is not None


def test_multi_document_qa_shares_documents(runs):
    shared = 0
    for s in runs["multi_document_qa"]:
        tree = s.tree
        roots = roots_of(tree, tree.query_nodes)
        assert int((tree.parents < 0).sum()) <= 16
        assert ((tree.lengths[tree.parents < 0] >= 900) & (tree.lengths[tree.parents < 0] <= 1300)).all()
        # same document <=> same root
        for doc in np.unique(s.prefix_ids):
            assert np.unique(roots[s.prefix_ids == doc]).size == 1
        assert np.unique(roots).size == np.unique(s.prefix_ids).size
        shared += int(tree.n_queries > np.unique(roots).size)
    assert shared == len(runs["multi_document_qa"]), "several questions per document every step"


def test_multi_level_system_prompts_two_level_prefix(runs):
    for s in runs["multi_level_system_prompts"]:
        tree = s.tree
        assert int((tree.parents < 0).sum()) == 1, "one common preamble"
        assert tree.levels[1].size <= 4, "at most 4 system prompts"
        assert (tree.depth[tree.query_nodes] == 2).all(), "each query's private leaf under its system prompt"
        prompt = np.array([ancestor_at_depth(tree, int(q), 1) for q in tree.query_nodes])
        for p in np.unique(s.prefix_ids):
            assert np.unique(prompt[s.prefix_ids == p]).size == 1
        assert np.unique(prompt).size == np.unique(s.prefix_ids).size


def test_few_shot_scenario_branches(runs):
    for s in runs["few_shot"]:
        tree = s.tree
        assert int((tree.parents < 0).sum()) == 1
        branches = tree.levels[1]
        assert branches.size <= 8
        assert ((tree.lengths[branches] >= 800) & (tree.lengths[branches] <= 1600)).all()
        assert tree.subtree_queries[branches].max() <= 16 * 8  # bounded by the batch, shared by many
        assert tree.subtree_queries[branches].max() > 1


def test_chain_reasoning_forks_share_their_trunk():
    run = list(iter_serving("chain_reasoning", seed=1, steps=200))
    fork_groups = shared_trunks = 0
    for prev, cur in itertools.pairwise(run):
        tree = cur.tree
        assert (tree.depth[tree.query_nodes] <= 2).all()
        trunks = tree.levels[1]  # question + reasoning trunk under the system prompt
        assert tree.subtree_queries[trunks].max() <= 4, "a question runs at most 4 forks"
        shared_trunks += int((tree.subtree_queries[trunks] >= 2).sum())
        # New requests at depth 1: a fresh question alone on its node, or 4 fresh forks without a
        # private token yet, querying the trunk they share; the trunk's request just left, one token shorter.
        new = ~np.isin(cur.request_ids, prev.request_ids)
        left = ~np.isin(prev.request_ids, cur.request_ids)
        left_contexts = set(contexts(prev.tree)[left].tolist())
        nodes, counts = np.unique(tree.query_nodes[new & (tree.depth[tree.query_nodes] == 1)], return_counts=True)
        assert set(counts.tolist()) <= {1, 4}
        for node in nodes[counts == 4]:
            assert int(tree.path_lengths[node]) - 1 in left_contexts
            fork_groups += 1
    assert shared_trunks > 0 and fork_groups > 0


def test_serving_is_deterministic_per_seed():
    a = simulate_serving("few_shot", seed=7, steps=30)
    b = simulate_serving("few_shot", seed=7, steps=30)
    c = simulate_serving("few_shot", seed=8, steps=30)
    assert all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    assert not all(same_tree(x, y) for x, y in zip(a, c, strict=True))


def test_drain_mode_submits_once_and_ends():
    run = list(iter_serving("multi_document_qa", seed=0, steps=10_000, arrival_rate=0, initial_requests=20))
    assert 32 <= len(run) <= 256, "ends once the longest answer is done"
    assert run[0].tree.n_queries == 20
    assert set(run[0].request_ids.tolist()) == set(range(20))
    assert all(set(s.request_ids.tolist()) <= set(range(20)) for s in run)
    assert run[-1].tree.n_queries < 20


def test_saturated_batch_stays_full_and_keeps_admitting():
    run = list(iter_serving("multi_document_qa", seed=3, steps=400, max_batch=8, arrival_rate=5.0))
    assert all(s.tree.n_queries == 8 for s in run), "finished requests free their slots for queued ones"
    served = set().union(*(s.request_ids.tolist() for s in run))
    assert len(served) >= 400 * 8 // 256, "a slot serves a request of at most 256 tokens at a time"


def test_custom_scenario_and_overrides():
    sc = dataclasses.replace(SCENARIOS["multi_document_qa"], prefix_levels=((2, 50, 50),), questions_per_prefix=3)
    run = list(iter_serving(sc, seed=0, steps=40, max_batch=4, arrival_rate=3.0))
    assert all(s.tree.n_queries <= 4 for s in run)
    assert max(s.tree.n_queries for s in run) == 4
    assert all(int((s.tree.parents < 0).sum()) <= 2 for s in run)


def test_serving_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown serving scenario"):
        simulate_serving("bogus", seed=0, steps=1)
    with pytest.raises(ValueError, match="steps"):
        simulate_serving("few_shot", seed=0, steps=0)
    with pytest.raises(ValueError, match="arrival_rate"):
        simulate_serving("few_shot", seed=0, steps=1, arrival_rate=-1.0)
    with pytest.raises(ValueError, match="max_batch"):
        simulate_serving("chain_reasoning", seed=0, steps=1, max_batch=3)  # a question needs 4 slots
    with pytest.raises(ValueError, match="forks"):
        ServingScenario("x", "x", ((1, 10, 10),), 1, (1, 1), forks=(1,))
    with pytest.raises(ValueError, match="prefix_levels"):
        ServingScenario("x", "x", (), 1, (1, 1))


def test_serving_node_ids_follow_nodes_across_steps():
    """node_ids name each tree node: unique in a step, and a node seen again has the same parent
    (by id) and at least its tokens."""
    run = list(iter_serving("chain_reasoning", seed=2, steps=60))
    seen: dict[int, tuple[int, int]] = {}
    kept = 0
    for s in run:
        ids = s.node_ids
        assert ids.dtype == np.int64 and ids.size == s.tree.n_nodes and np.unique(ids).size == ids.size
        parent_ids = np.where(s.tree.parents >= 0, ids[np.maximum(s.tree.parents, 0)], -1)
        for nid, pid, length in zip(ids.tolist(), parent_ids.tolist(), s.tree.lengths.tolist(), strict=True):
            if nid in seen:
                assert seen[nid][0] == pid and seen[nid][1] <= length
                kept += 1
            seen[nid] = (pid, length)
    assert kept > 20 * len(run)
