"""Building KV trees from a serving engine's slot lists, req_to_token table and radix nodes (CPU only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trees import random_tree

import fasttree as ft
from fasttree.adapter import tree_from_radix_nodes, tree_from_req_to_token, tree_from_token_slots


# ------------------------------------------------------------------ helpers
def context_slots(tree: ft.KVTree) -> list[list[int]]:
    """Each query's context slots, root first."""
    indptr, slots = tree.query_slots()
    return [slots[indptr[j] : indptr[j + 1]].tolist() for j in range(tree.n_queries)]


def node_paths(tree: ft.KVTree) -> list[tuple[int, ...]]:
    """Each node's root-path slots (the node's identity in a trie)."""
    out: list[tuple[int, ...] | None] = [None] * tree.n_nodes
    for i in tree.level_order.tolist():
        p = int(tree.parents[i])
        out[i] = (out[p] if p >= 0 else ()) + tuple(tree.node_slots(i).tolist())
    return out


def reference_trie(seqs: list[list[int]]) -> tuple[set[tuple[int, ...]], list[tuple[int, ...]]]:
    """Brute force: the compressed trie's nodes (as root-path slot tuples) and each query's node.

    A token-by-token trie; a prefix is a node boundary when it ends a sequence or is
    followed by two different slots, i.e. where the set of sequences through it changes.
    """
    prefixes: dict[tuple[int, ...], set[int]] = {}  # prefix -> next slots seen
    ends = {tuple(s) for s in seqs}
    for s in seqs:
        for k in range(1, len(s) + 1):
            nxt = prefixes.setdefault(tuple(s[:k]), set())
            if k < len(s):
                nxt.add(s[k])
    nodes = {p for p, nxt in prefixes.items() if p in ends or len(nxt) >= 2}
    return nodes, [tuple(s) for s in seqs]


def check_compressed_trie(tree: ft.KVTree, seqs: list[list[int]]) -> None:
    """The tree gives back every sequence and is the (unique, minimal) compressed trie."""
    assert tree.n_queries == len(seqs)
    assert context_slots(tree) == [list(map(int, s)) for s in seqs]
    # every node holds tokens and is read by some query
    assert tree.lengths.min() >= 1
    assert tree.subtree_queries.min() >= 1
    # a node without a query branches (else it would merge with its only child)
    n_children = np.bincount(tree.parents[tree.parents >= 0], minlength=tree.n_nodes)
    has_query = np.bincount(tree.query_nodes, minlength=tree.n_nodes) > 0
    assert np.all(has_query | (n_children >= 2))
    # siblings (roots included) start with different slots (else they would share a node)
    first = tree.slots[tree.slot_indptr[:-1]]
    pairs = set(zip(tree.parents.tolist(), first.tolist(), strict=True))
    assert len(pairs) == tree.n_nodes
    # node ids in DFS preorder: a parent first, each subtree a contiguous id range
    assert np.all(tree.parents < np.arange(tree.n_nodes))
    size = np.ones(tree.n_nodes, dtype=np.int64)
    for i in range(tree.n_nodes - 1, -1, -1):
        if tree.parents[i] >= 0:
            size[tree.parents[i]] += size[i]
    for i in range(tree.n_nodes):
        sub = np.arange(i + 1, i + size[i])
        if sub.size:
            anc = sub.copy()
            while np.any(anc > i):
                anc = np.where(anc > i, tree.parents[anc], anc)
            assert np.all(anc == i)
    # the same nodes as the brute-force trie
    paths = node_paths(tree)
    nodes, query_paths = reference_trie([list(map(int, s)) for s in seqs])
    assert set(paths) == nodes
    assert len(paths) == len(nodes)
    assert [paths[q] for q in tree.query_nodes.tolist()] == query_paths


# --------------------------------------------------------------- hand-built
def test_shared_system_prompt_and_distinct_questions():
    prompt = list(range(100))
    seqs = [prompt + list(range(100 + 10 * j, 105 + 10 * j)) for j in range(3)]
    tree = tree_from_token_slots(seqs)
    assert tree.parents.tolist() == [-1, 0, 0, 0]
    assert tree.lengths.tolist() == [100, 5, 5, 5]
    assert tree.query_nodes.tolist() == [1, 2, 3]
    assert tree.node_slots(0).tolist() == prompt
    check_compressed_trie(tree, seqs)


def test_two_level_sharing_and_sibling_order_by_first_slot():
    # request order differs from slot order: node ids follow slots, queries follow requests
    seqs = [[0, 1, 2, 50, 51, 9], [0, 1, 2, 40, 41], [0, 1, 2, 50, 51, 7], [0, 1, 2, 40, 42]]
    tree = tree_from_token_slots(seqs)
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0, 4, 4]
    assert [tree.node_slots(i).tolist() for i in range(7)] == [[0, 1, 2], [40], [41], [42], [50, 51], [7], [9]]
    assert tree.query_nodes.tolist() == [6, 2, 5, 3]
    check_compressed_trie(tree, seqs)


def test_forest_of_two_prompts():
    a, b = list(range(10, 40)), list(range(500, 520))
    seqs = [[*a, 40], [*b, 600], [*a, 41], [*b, 601, 602]]
    tree = tree_from_token_slots(seqs)
    assert (tree.parents < 0).sum() == 2
    assert tree.parents.tolist() == [-1, 0, 0, -1, 3, 3]
    assert tree.lengths.tolist() == [30, 1, 1, 20, 1, 2]
    assert tree.query_nodes.tolist() == [1, 4, 2, 5]
    check_compressed_trie(tree, seqs)


def test_prefix_request_sits_at_an_internal_node():
    seqs = [[5, 6, 7, 8, 9], [5, 6, 7], [5, 6, 7, 8, 10, 11]]
    tree = tree_from_token_slots(seqs)
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    assert [tree.node_slots(i).tolist() for i in range(4)] == [[5, 6, 7], [8], [9], [10, 11]]
    assert tree.query_nodes.tolist() == [2, 0, 3]
    assert tree.subtree_queries[0] == 3
    check_compressed_trie(tree, seqs)


def test_chain_of_prefixes():
    seqs = [[1, 2, 3, 4], [1, 2], [1], [1, 2, 3]]
    tree = tree_from_token_slots(seqs)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.lengths.tolist() == [1, 1, 1, 1]
    assert tree.query_nodes.tolist() == [3, 1, 0, 2]
    check_compressed_trie(tree, seqs)


def test_identical_requests_share_one_node():
    seqs = [[3, 4, 5], [3, 4, 5], [3, 4, 6], [3, 4, 5]]
    tree = tree_from_token_slots(seqs)
    assert tree.parents.tolist() == [-1, 0, 0]
    assert tree.query_nodes.tolist() == [1, 1, 2, 1]
    check_compressed_trie(tree, seqs)
    # all identical: one node, every query on it
    tree = tree_from_token_slots([[8, 9]] * 3)
    assert tree.n_nodes == 1 and tree.query_nodes.tolist() == [0, 0, 0]


def test_single_request_and_single_token():
    tree = tree_from_token_slots([np.arange(7, 1000)])
    assert tree.n_nodes == 1 and tree.lengths.tolist() == [993] and tree.query_nodes.tolist() == [0]
    tree = tree_from_token_slots([[0]])
    assert tree.n_nodes == 1 and tree.slots.tolist() == [0]


def test_input_types_and_non_contiguous_slots():
    seqs = [[900, 3, 77, 12], [900, 3, 5]]
    expected = tree_from_token_slots(seqs)
    for conv in (
        lambda s: np.asarray(s, dtype=np.int32),
        lambda s: np.asarray(s, dtype=np.uint16),
        lambda s: np.asarray(s, dtype=np.uint64),
        lambda s: torch.tensor(s, dtype=torch.int32),
        lambda s: torch.tensor(s, dtype=torch.int64),
        tuple,
    ):
        tree = tree_from_token_slots([conv(s) for s in seqs])
        assert context_slots(tree) == seqs
        assert tree.parents.tolist() == expected.parents.tolist()
    check_compressed_trie(expected, seqs)
    # repeated slots within and across requests are only slot ids to the trie
    seqs = [[1, 1, 1, 2], [1, 1, 2], [2, 1, 1]]
    check_compressed_trie(tree_from_token_slots(seqs), seqs)


# ---------------------------------------------------------------- randomised
@pytest.mark.parametrize("seed", range(12))
def test_random_trees_round_trip_as_minimal_tries(seed):
    """Sequences read off random KV trees (forests, internal queries, empty and 1-token
    nodes, scattered slots) come back as the compressed trie of those sequences."""
    rng = np.random.default_rng(seed)
    for _ in range(5):
        src = random_tree(rng, max_nodes=30, max_len=40)
        seqs = context_slots(src)
        tree = tree_from_token_slots([np.asarray(s) for s in seqs])
        check_compressed_trie(tree, seqs)
        # the source tree is a valid but maybe non-minimal representation: never smaller
        assert tree.n_nodes <= int((src.lengths > 0).sum())
        assert tree.num_tokens <= src.num_tokens


@pytest.mark.parametrize("seed", range(8))
def test_random_sequences_over_a_small_alphabet(seed):
    """Adversarial slots: few distinct ids, so branches collide, repeat and nest."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 40))
    base = rng.integers(0, 3, size=int(rng.integers(1, 12))).tolist()
    seqs = []
    for _ in range(n):
        cut = int(rng.integers(0, len(base) + 1))
        tail = rng.integers(0, 3, size=int(rng.integers(0 if cut else 1, 6))).tolist()
        seqs.append(base[:cut] + tail)
    if n > 2:  # duplicates and exact prefixes of other requests
        seqs.append(list(seqs[0]))
        if len(seqs[1]) > 1:
            seqs.append(seqs[1][: len(seqs[1]) // 2])
    check_compressed_trie(tree_from_token_slots(seqs), seqs)


@pytest.mark.parametrize("seed", range(3))
def test_long_contexts_compare_pair_by_pair(seed):
    """Contexts long enough for the pair-by-pair LCP path: the same trie as the reference."""
    rng = np.random.default_rng(seed)
    prompt = rng.permutation(5000)[:600].tolist()
    docs = [list(range(10_000 + 300 * d, 10_300 + 300 * d)) for d in range(3)]
    seqs = []
    for j in range(20):
        s = prompt + docs[j % 3][: int(rng.integers(1, 300))] + list(range(20_000 + 50 * j, 20_000 + 50 * j + j % 4))
        seqs.append(s)
    seqs.append(prompt[:250])
    check_compressed_trie(tree_from_token_slots(seqs), seqs)


def test_serving_size_batch():
    """256 requests x 4k tokens: a shared system prompt, 8 documents, private tails."""
    prompt = np.arange(2048)
    docs = [np.arange(10_000 + 1024 * d, 10_000 + 1024 * (d + 1)) for d in range(8)]
    seqs = [np.concatenate([prompt, docs[j % 8], 100_000 + 1024 * j + np.arange(1024)]) for j in range(256)]
    tree = tree_from_token_slots(seqs)
    assert tree.n_nodes == 1 + 8 + 256 and tree.n_queries == 256
    assert tree.num_tokens == 2048 + 8 * 1024 + 256 * 1024
    _, slots = tree.query_slots()
    np.testing.assert_array_equal(slots, np.concatenate(seqs))


# ------------------------------------------------------------- req_to_token
def synthetic_table(rng: np.random.Generator):
    """A req_to_token table with shared prefixes; entries past each length are junk (-1 or stale)."""
    max_requests, width = 16, 64
    table = rng.integers(-1, 5000, size=(max_requests, width))
    prompt = rng.permutation(1000)[:20]
    rows = rng.permutation(max_requests)[:10]
    lens = rng.integers(1, width + 1, size=rows.size)
    for k, r in enumerate(rows):
        cut = int(rng.integers(0, prompt.size + 1))
        body = np.concatenate([prompt[:cut], 2000 + 100 * k + np.arange(width)])
        table[r, : lens[k]] = body[: lens[k]]
    return table, rows, lens


@pytest.mark.parametrize("seed", range(4))
def test_req_to_token_matches_slot_lists(seed):
    rng = np.random.default_rng(seed)
    table, rows, lens = synthetic_table(rng)
    gathered = [table[r, :n] for r, n in zip(rows, lens, strict=True)]
    expected = tree_from_token_slots(gathered)
    for args in (
        (table, rows, lens),
        (torch.from_numpy(table).to(torch.int32), torch.from_numpy(rows), torch.from_numpy(lens).to(torch.int32)),
        (table.tolist(), rows.tolist(), lens.tolist()),
    ):
        tree = tree_from_req_to_token(*args)
        for name in ("parents", "lengths", "slots", "query_nodes"):
            np.testing.assert_array_equal(getattr(tree, name), getattr(expected, name))
    check_compressed_trie(expected, [g.tolist() for g in gathered])


def test_req_to_token_repeated_row_gives_identical_requests():
    table = np.array([[4, 5, 6, -1], [4, 5, 9, 9]])
    tree = tree_from_req_to_token(table, [1, 0, 1], [4, 3, 3])
    assert context_slots(tree) == [[4, 5, 9, 9], [4, 5, 6], [4, 5, 9]]
    assert tree.query_nodes[2] != tree.query_nodes[0]


@pytest.mark.gpu
def test_req_to_token_on_cuda():
    rng = np.random.default_rng(7)
    table, rows, lens = synthetic_table(rng)
    expected = tree_from_req_to_token(table, rows, lens)
    dev = torch.device("cuda")
    tree = tree_from_req_to_token(torch.from_numpy(table).to(dev), torch.from_numpy(rows).to(dev), lens)
    np.testing.assert_array_equal(tree.slots, expected.slots)
    np.testing.assert_array_equal(tree.parents, expected.parents)
    np.testing.assert_array_equal(tree.query_nodes, expected.query_nodes)


# -------------------------------------------------------------- radix nodes
def test_radix_nodes_wrap_and_prune():
    # SGLang-style: an empty root, cached nodes, one node no request of the batch reads
    parents = [-1, 0, 1, 1, 0, 2]
    node_slots = [[], [0, 1, 2], [3, 4], [5], [50, 51], [6]]
    tree = tree_from_radix_nodes(parents, node_slots, [5, 3, 2])
    assert tree.n_nodes == 6 and tree.query_nodes.tolist() == [5, 3, 2]
    assert context_slots(tree) == [[0, 1, 2, 3, 4, 6], [0, 1, 2, 5], [0, 1, 2, 3, 4]]
    pruned = tree_from_radix_nodes(parents, node_slots, [5, 3, 2], prune=True)
    assert pruned.parents.tolist() == [-1, 0, 1, 1, 2]
    assert pruned.query_nodes.tolist() == [4, 3, 2]
    assert context_slots(pruned) == context_slots(tree)
    # tensors are accepted
    t = tree_from_radix_nodes(torch.tensor(parents), [torch.tensor(s, dtype=torch.int64) for s in node_slots], [5])
    assert context_slots(t) == [[0, 1, 2, 3, 4, 6]]


@pytest.mark.parametrize("seed", range(4))
def test_radix_nodes_random_prune_keeps_contexts(seed):
    rng = np.random.default_rng(seed)
    src = random_tree(rng, max_nodes=40, max_len=20)
    node_slots = [src.node_slots(i) for i in range(src.n_nodes)]
    queries = src.query_nodes[: max(1, src.n_queries // 2)]
    full = tree_from_radix_nodes(src.parents, node_slots, queries)
    pruned = tree_from_radix_nodes(src.parents, node_slots, queries, prune=True)
    assert context_slots(pruned) == context_slots(full)
    assert pruned.subtree_queries.min() >= 1
    assert pruned.n_nodes == int((full.subtree_queries > 0).sum())


def test_radix_nodes_pruned_read_only_the_requests_nodes():
    """With ``prune`` the slots of nodes no request reads are neither read nor checked (the cost
    follows the batch, not the cache), while the parents are still checked whole."""
    parents = [-1, 0, 0, 1, 2]
    node_slots = [np.array([0, 1]), np.array([2]), np.array([-9]), np.array([3, 4]), np.array([[7]])]
    tree = tree_from_radix_nodes(parents, node_slots, [3, 1], prune=True)
    assert tree.parents.tolist() == [-1, 0, 1] and context_slots(tree) == [[0, 1, 2, 3, 4], [0, 1, 2]]
    with pytest.raises(ValueError, match=r"node_slots\[4\] must be a 1-D integer array"):
        tree_from_radix_nodes(parents, node_slots, [3, 1])  # unpruned, every node is read
    with pytest.raises(ValueError, match=r"node_slots hold a negative slot id"):
        tree_from_radix_nodes(parents, node_slots, [2], prune=True)  # a request reads node 2
    with pytest.raises(ValueError, match=r"node_slots\[4\] must be a 1-D integer array"):
        tree_from_radix_nodes(parents, [*node_slots[:4], [[7]]], [4], prune=True)  # named by its cache id
    with pytest.raises(ValueError, match="cycle"):  # a cycle among unread nodes is still refused
        tree_from_radix_nodes([-1, 0, 3, 2], [[1], [2], [3], [4]], [1], prune=True)


@pytest.mark.parametrize("seed", range(4))
def test_radix_nodes_of_numpy_arrays_build_the_tree_of_lists(seed):
    """Per-node numpy arrays of any integer dtype (the fast path: one concatenation, no per-node
    check) give the tree the per-node checks give to the same slots as lists, empty nodes,
    uint16 and int8 entries included, and so do CPU tensors; an entry the fast path does not take
    (a float, 2-D or uint64 array, a list among arrays) is checked and named as before."""
    rng = np.random.default_rng(seed)
    src = random_tree(rng, max_nodes=40, max_len=20)
    dtypes = (np.int64, np.int32, np.uint32, np.int16, np.uint16)
    arrays = [src.node_slots(i).astype(dtypes[i % len(dtypes)]) for i in range(src.n_nodes)]
    lists = [a.tolist() for a in arrays]
    fast = tree_from_radix_nodes(src.parents, arrays, src.query_nodes)
    slow = tree_from_radix_nodes(src.parents, lists, src.query_nodes)
    for name in ("parents", "lengths", "slot_indptr", "slots", "query_nodes"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name))
    assert fast.slots.dtype == slow.slots.dtype
    assert context_slots(fast) == context_slots(src)
    mixed = [*arrays[:-1], lists[-1]]  # a list among arrays: the checked path, the same tree
    np.testing.assert_array_equal(tree_from_radix_nodes(src.parents, mixed, src.query_nodes).slots, fast.slots)
    parents, good = [-1, 0], [np.array([1, 2], dtype=np.int32), np.array([3], dtype=np.int8)]
    for bad, match in (
        (np.array([3.0]), r"node_slots\[1\] must hold integers"),
        (np.array([[3]], dtype=np.int32), r"node_slots\[1\] must be a 1-D integer array"),
        (np.array([2**63], dtype=np.uint64), r"node_slots\[1\] holds 9223372036854775808, beyond the int64"),
        (np.array([-3], dtype=np.int16), r"negative slot id"),
        (np.array([2**31], dtype=np.int64), r"beyond the int32 range"),
    ):
        with pytest.raises(ValueError, match=match):
            tree_from_radix_nodes(parents, [good[0], bad], [1])
    assert context_slots(tree_from_radix_nodes(parents, good, [1])) == [[1, 2, 3]]
    # CPU tensors, one per node (one torch.cat): the same tree; an irregular one is checked and named
    tdtypes = (torch.int64, torch.int32, torch.uint8, torch.int16)
    tensors = [torch.from_numpy(src.node_slots(i).astype(np.int64)) for i in range(src.n_nodes)]
    tensors = [t.to(tdtypes[i % len(tdtypes)]) if t.numel() == 0 or t.max() < 256 else t for i, t in enumerate(tensors)]
    from_tensors = tree_from_radix_nodes(torch.from_numpy(src.parents), tensors, src.query_nodes)
    np.testing.assert_array_equal(from_tensors.slots, fast.slots)
    np.testing.assert_array_equal(from_tensors.slot_indptr, fast.slot_indptr)
    t_good = [torch.tensor([1, 2]), torch.tensor([3], dtype=torch.int32)]
    assert context_slots(tree_from_radix_nodes(parents, t_good, [1])) == [[1, 2, 3]]
    for bad, match in (
        (torch.tensor([3.0]), r"node_slots\[1\] must hold integers"),
        (torch.tensor([[3]]), r"node_slots\[1\] must be a 1-D integer array"),
        (torch.tensor([-3]), r"negative slot id"),
    ):
        with pytest.raises(ValueError, match=match):
            tree_from_radix_nodes(parents, [t_good[0], bad], [1])


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("slot_lists", "match"),
    [
        ([], r"slot_lists is empty"),
        ([[1, 2], []], r"slot_lists\[1\] is empty"),
        ([[1, 2], [3, -4]], r"^slot_lists\[1\]\[1\] = -4 is a negative slot id$"),
        ([[1, 2], [2**31]], r"slot_lists\[1\]\[0\] = 2147483648 is beyond the int32"),
        ([[1, 2], [[3]]], r"slot_lists\[1\] must be a 1-D integer array, got shape \(1, 1\)"),
        ([[1.5, 2.0]], r"slot_lists\[0\] must hold integers, got dtype float64"),
        ([np.array([True, False])], r"slot_lists\[0\] must hold integers, got dtype bool"),
        ([5], r"slot_lists\[0\] must be a 1-D integer array, got shape \(\)"),
        ("abc", r"slot_lists must be a sequence"),
        ([np.array([2**63 + 5], dtype=np.uint64)], r"slot_lists\[0\] holds 9223372036854775813, beyond the int64"),
        # numpy arrays and CPU tensors (one concatenation): the same checks, the same names
        ([np.array([1, 2]), np.array([], dtype=np.int32)], r"slot_lists\[1\] is empty"),
        ([np.array([1, 2]), np.array([3, -4], dtype=np.int16)], r"^slot_lists\[1\]\[1\] = -4 is a negative slot id$"),
        ([np.array([1, 2]), np.array([2**31])], r"slot_lists\[1\]\[0\] = 2147483648 is beyond the int32"),
        ([torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64)], r"slot_lists\[1\] is empty"),
        ([torch.tensor([1, 2]), torch.tensor([3, -4])], r"^slot_lists\[1\]\[1\] = -4 is a negative slot id$"),
        ([torch.tensor([1, 2]), torch.tensor([3.0])], r"slot_lists\[1\] must hold integers"),
    ],
)
def test_token_slots_errors(slot_lists, match):
    with pytest.raises(ValueError, match=match):
        tree_from_token_slots(slot_lists)


def test_token_slots_refuses_device_tensors():
    class FakeCuda:  # a tensor on a GPU, as far as the adapter can tell
        device = torch.device("cuda", 0)

        def detach(self):
            return self

        def numpy(self):  # pragma: no cover - must not be reached
            raise AssertionError

    with pytest.raises(ValueError, match=r"slot_lists\[0\] is a tensor on cuda:0"):
        tree_from_token_slots([FakeCuda()])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.zeros((4, 8), int), [], []), r"req_pool_indices is empty"),
        ((np.zeros((4, 8), int), [0, 1], [3]), r"seq_lens has 1 entries but req_pool_indices has 2"),
        ((np.zeros((4, 8), int), [0, 4], [3, 3]), r"req_pool_indices\[1\] = 4 is out of range \[0, 4\)"),
        ((np.zeros((4, 8), int), [-1], [3]), r"req_pool_indices\[0\] = -1 is out of range"),
        ((np.zeros((4, 8), int), [0, 1], [3, 0]), r"seq_lens\[1\] = 0 is out of range \[1, 8\]"),
        ((np.zeros((4, 8), int), [0, 1], [9, 3]), r"seq_lens\[0\] = 9 is out of range \[1, 8\]"),
        ((np.zeros(8, int), [0], [3]), r"req_to_token must be a 2-D integer table"),
        ((np.zeros((4, 8)), [0], [3]), r"req_to_token must hold integers, got dtype float64"),
        ((torch.zeros(4, 8), [0], [3]), r"req_to_token must hold integers, got dtype torch.float32"),
        ((np.zeros((4, 8), int), [[0]], [3]), r"req_pool_indices must be a 1-D integer array"),
        ((np.zeros((4, 8), int), [0], [3.0]), r"seq_lens must hold integers"),
        (
            (np.array([[1, 2, -3, 4], [5, 6, 7, 8]]), [1, 0], [2, 3]),
            r"req_to_token\[0, 2\] \(request 1's context\) = -3 is a negative slot id",
        ),
        # 4-byte tables: the trie is built first and KVTree's check fails, then the entry is named
        (
            (np.array([[1, 2, -3, 4], [5, 6, 7, 8]], dtype=np.int32), [1, 0], [2, 3]),
            r"req_to_token\[0, 2\] \(request 1's context\) = -3 is a negative slot id",
        ),
        (
            (np.array([[9, -5, 3], [9, -5, 4], [9, 1, 1]], dtype=np.int32), [2, 0, 1], [3, 3, 3]),
            r"req_to_token\[0, 1\] \(request 1's context\) = -5 is a negative slot id",
        ),
        (
            (torch.tensor([[1, 2, 3], [1, 2, -7]], dtype=torch.int32), [0, 1], [3, 3]),
            r"req_to_token\[1, 2\] \(request 1's context\) = -7 is a negative slot id",
        ),
    ],
)
def test_req_to_token_errors(args, match):
    with pytest.raises(ValueError, match=match):
        tree_from_req_to_token(*args)


def test_req_to_token_ignores_junk_past_lengths():
    table = np.array([[1, 2, -7, -7], [1, 3, -1, 2**40]])
    tree = tree_from_req_to_token(table, [0, 1], [2, 2])
    assert context_slots(tree) == [[1, 2], [1, 3]]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([], [], [0]), r"parents is empty"),
        (([-1, 0], [[1]], [0]), r"node_slots has 1 entries but parents has 2 nodes"),
        (([-1, 0], [[1], [2]], []), r"request_nodes is empty"),
        (([-1, 0], [[1], [2]], [2]), r"request_nodes\[0\] = 2 is out of range \[0, 2\)"),
        (([-1, 0], [[1], [2]], [1, -1]), r"request_nodes\[1\] = -1 is out of range"),
        (([-1, 5], [[1], [2]], [1]), r"parents\[1\] = 5 is out of range"),
        (([1, 0], [[1], [2]], [1]), r"cycle"),
        (([-1, 0], [[1], [-2]], [1]), r"negative slot id"),
        (([-1, 0], [[1], [[2]]], [1]), r"node_slots\[1\] must be a 1-D integer array"),
        (([-1, 0], [[], [2]], [0]), r"query 0 \(at node 0\) has an empty context"),
        (([-1.0, 0.0], [[1], [2]], [1]), r"parents must hold integers"),
    ],
)
def test_radix_nodes_errors(args, match):
    with pytest.raises(ValueError, match=match):
        tree_from_radix_nodes(*args)


def test_req_to_token_keeps_small_integer_tables_and_checks_uint32():
    table16 = np.array([[1, 2, 3, -1], [1, 2, 4, 5]], dtype=np.int16)
    tree = tree_from_req_to_token(table16, [0, 1], [3, 4])
    assert context_slots(tree) == [[1, 2, 3], [1, 2, 4, 5]]
    big = np.array([[1, 2**31], [1, 2]], dtype=np.uint32)
    with pytest.raises(ValueError, match=r"req_to_token\[0, 1\] \(request 0's context\) = 2147483648 is beyond"):
        tree_from_req_to_token(big, [0, 1], [2, 2])
    assert context_slots(tree_from_req_to_token(big, [0, 1], [1, 2])) == [[1], [1, 2]]
