"""``KVTree``'s slot contract (issue 38, D13): disjoint slots, documented and checked on request.

Construction does not refuse overlapping slots (the check costs more than planning the tree, see
``KVTree``'s notes); :meth:`KVTree.check_disjoint_slots` names the slot and the nodes.
"""

from __future__ import annotations

import numpy as np
import pytest

import fasttree as ft
from fasttree.adapter import tree_from_token_slots
from fasttree.toolkit.suite import paper_tree


@pytest.mark.parametrize(
    "make",
    [
        lambda: ft.KVTree.from_lengths([-1, 0, 0], [5, 3, 2], [1, 2]),
        lambda: paper_tree(8),
        lambda: ft.KVTree([-1, 0, 0], [[9, 4, 70], [3], [100, 2]], [1, 2]),
        lambda: ft.KVTree.from_flat([-1, 0], [2, 2], [7, 1, 0, 5], [1]),
        lambda: ft.KVTree([-1, 0], [[1, 2], []], [1]),
        lambda: tree_from_token_slots([[1, 2, 3], [1, 2, 4]]),  # a shared prefix is one node
    ],
)
def test_disjoint_trees_pass(make):
    make().check_disjoint_slots()


def test_a_slot_twice_in_one_node():
    tree = ft.KVTree([-1, 0], [[4, 5, 4], [6]], [1])  # accepted: the contract is not checked on construction
    with pytest.raises(ValueError, match=r"node 0 holds pool slot 4 twice: its queries read that token twice"):
        tree.check_disjoint_slots()


def test_a_slot_in_a_node_and_its_descendant_is_read_twice():
    tree = ft.KVTree([-1, 0, 1], [[1, 2], [3], [2, 9]], [2])
    with pytest.raises(ValueError, match=r"nodes 0 and 2 both hold pool slot 2: the queries below node 2 read"):
        tree.check_disjoint_slots()


def test_a_slot_in_two_branches():
    tree = tree_from_token_slots([[1, 2, 3], [4, 2]])  # the adapter keeps what the slot lists repeat
    with pytest.raises(ValueError, match=r"nodes 0 and 1 both hold pool slot 2: two tokens would share"):
        tree.check_disjoint_slots()


def test_append_tokens_with_a_slot_already_held_is_caught():
    tree = ft.KVTree([-1, 0, 0], [[0, 1], [2], [3]], [1, 2])
    grown = tree.append_tokens([4, 5])
    grown.check_disjoint_slots()
    with pytest.raises(ValueError, match=r"pool slot 0"):
        grown.append_tokens([6, 0]).check_disjoint_slots()


def test_the_check_is_exact_on_a_large_scattered_tree():
    rng = np.random.default_rng(0)
    base = paper_tree(8)
    slots = rng.permutation(2**22)[: base.num_tokens]
    tree = ft.KVTree.from_flat(base.parents, base.lengths, slots, base.query_nodes)
    tree.check_disjoint_slots()
    slots[-1] = slots[0]  # the first token of the root and the last token of the last leaf
    with pytest.raises(ValueError, match=f"pool slot {slots[0]}: the queries below node {base.n_nodes - 1}"):
        ft.KVTree.from_flat(base.parents, base.lengths, slots, base.query_nodes).check_disjoint_slots()


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.uint64])
def test_from_flat_copies_the_slots_into_its_own_int32_array(dtype):
    """Slots of any integer dtype become the tree's own int32 array (never the caller's, so a
    server may reuse its buffer), with the range checked in the given dtype."""
    slots = np.array([7, 1, 0, 5], dtype=dtype)
    tree = ft.KVTree.from_flat([-1, 0], [2, 2], slots, [1])
    assert tree.slots.dtype == np.int32 and np.array_equal(tree.slots, [7, 1, 0, 5])
    assert not np.shares_memory(tree.slots, slots)
    slots[:] = 3  # the caller reuses its buffer
    assert np.array_equal(tree.slots, [7, 1, 0, 5])
    if dtype in (np.int32, np.int64):
        with pytest.raises(ValueError, match="negative slot id"):
            ft.KVTree.from_flat([-1, 0], [2, 2], np.array([7, -1, 0, 5], dtype=dtype), [1])
    if dtype in (np.int64, np.uint64):
        with pytest.raises(ValueError, match="beyond the int32 range"):
            ft.KVTree.from_flat([-1, 0], [2, 2], np.array([7, 1 << 31, 0, 5], dtype=dtype), [1])
