"""Extending a plan to the next decode step's tree instead of planning it again.

Between two decode steps a serving batch usually changes in one way only: every running
request appends its new token to its *private* node (a node whose tokens one query alone
reads), while the shared prefixes, the requests and their order stay as they were. The plan
of the previous step then needs only those tokens added: a private token is read by its query
alone, through exactly one KV entry of the plan, so inserting the new slots next to that entry
(in the same work unit, with the same row mask) gives a plan that reads every query's context
exactly once, as a fresh plan does. Only the cost decisions (groups, splits, packing) were
made for slightly shorter nodes, which is why :class:`PlanExtender` extends a plan for a
bounded number of steps before the caller plans afresh.

Vocabulary as in :mod:`fasttree.plan_arrays`; the *anchor* of a private node is the plan's
KV entry of its last token.
"""

from __future__ import annotations

import copy

import numpy as np

from .native import address, c_int32, planner_library
from .plan_arrays import Plan
from .tree import KVTree, kept_mask, ragged_arange, splice
from .validation import check_int

_INT32_MAX = 0x7FFFFFFF


class _TreeCopy:
    """The arrays of a :class:`KVTree` that decide whether a later tree extends it (copies,
    so a caller reusing its arrays cannot change what the plan was made for)."""

    __slots__ = ("lengths", "parents", "private", "query_nodes", "read", "slot_indptr", "slots")

    def __init__(self, tree: KVTree, same_shape: _TreeCopy | None = None) -> None:
        # same_shape: a copy of a tree with the same parents and queries, whose arrays are shared
        if same_shape is None:
            self.parents = tree.parents.copy()
            self.query_nodes = tree.query_nodes.copy()
            sq = tree.subtree_queries
            self.private = sq == 1  # read by one query
            self.read = sq > 0  # read by some query
        else:
            self.parents, self.query_nodes = same_shape.parents, same_shape.query_nodes
            self.private, self.read = same_shape.private, same_shape.read
        self.lengths = tree.lengths.copy()
        self.slot_indptr = tree.slot_indptr.copy()
        self.slots = tree.slots.copy()


def _prefixes_equal_native(lib, tree: KVTree, old: _TreeCopy) -> bool:
    """Whether every node of ``tree`` starts with the slots it had in ``old`` (``ft_prefixes_equal``;
    the nodes' lengths have not shrunk: checked before)."""
    indptr, old_indptr, lengths = (
        np.ascontiguousarray(a, dtype=np.int64) for a in (tree.slot_indptr, old.slot_indptr, old.lengths)
    )  # no copies of the trees' own int64 arrays
    rc = lib.ft_prefixes_equal(
        lengths.size, address(tree.slots), tree.slots.size, address(indptr), address(old.slots), old.slots.size,
        address(old_indptr), address(lengths),
    )  # fmt: skip
    if rc < 0:
        raise RuntimeError("internal error: a node's slots outside the tree's slot array")
    return rc == 1


def _with_entries(
    plan: Plan, tree: KVTree, kv_indices: np.ndarray, kv_row_mask: np.ndarray, unit_kv_start: np.ndarray,
    unit_kv_len: np.ndarray,
) -> Plan:  # fmt: skip
    """``plan`` with the KV entries and unit ranges of its extension to ``tree`` (int32 arrays): a
    shallow copy (``dataclasses.replace`` would re-run the plan's checks), its device copies dropped."""
    extended = copy.copy(plan)
    extended.__dict__.update(
        max_slot=tree.max_slot,
        kv_indices=kv_indices,
        kv_row_mask=kv_row_mask,
        unit_kv_start=unit_kv_start,
        unit_kv_len=unit_kv_len,
        _device_cache={},
    )
    return extended


def _consistent(plan: Plan) -> bool:
    """Whether ``plan``'s unit arrays have one entry per unit and its row masks (if any) one per
    KV entry: what the compiled loops index without a check of their own (a plan built by hand
    otherwise goes the numpy way, which raises on a mismatch)."""
    n = plan.unit_kv_len.size
    masks = plan.kv_row_mask.size
    return plan.unit_kv_start.size == n and plan.unit_q_len.size == n and (masks == 0 or masks == plan.kv_indices.size)


class PlanExtender:
    """Extends the last plan it was given to later trees that only grew private nodes.

    A tree *extends* the remembered one when it has the same nodes, parents and queries
    (same ids, same order), every node's slots start with the slots it had, and only nodes
    that one query reads (or none) grew. Then :meth:`extend` inserts the new tokens' slots
    into the remembered plan (O(KV entries) numpy work, no planning) and returns the
    extended plan; otherwise it returns None and the caller plans the tree afresh.

    Parameters
    ----------
    max_steps : int
        Consecutive extensions of one fresh plan; afterwards :meth:`extend` returns None,
        so the cost decisions are redone at least every ``max_steps + 1`` steps.
    native : bool
        Check the old slots and insert the new entries in compiled loops
        (:func:`fasttree.native.planner_library`) when they are available: the same plans as
        the numpy path, bit for bit (``tests/test_native.py``).

    Examples
    --------
    >>> ext = PlanExtender(max_steps=8)
    >>> plan = ext.extend(tree)                                # doctest: +SKIP
    >>> if plan is None:
    ...     plan = ft.plan(tree, config, **heads)              # doctest: +SKIP
    >>> ext.remember(tree, plan)                               # doctest: +SKIP
    """

    def __init__(self, *, max_steps: int = 8, native: bool = True) -> None:
        self.max_steps = check_int("max_steps", max_steps, minimum=1, expected="a positive integer")
        self.native = bool(native)
        self.reset()

    def reset(self) -> None:
        """Forget the remembered plan (the next :meth:`extend` returns None)."""
        self._tree: _TreeCopy | None = None
        self._plan: Plan | None = None
        self._steps = 0
        self._anchor: np.ndarray | None = None  # int64 [n_nodes]: entry of the node's last token, -1: none
        self._anchor_unit: np.ndarray | None = None  # int64 [n_nodes]: the unit holding that entry
        self._pending: tuple | None = None  # (plan, tree copy, anchors, anchor units) of the last extend
        self._table = np.zeros(0, dtype=np.int32)  # slot -> candidate lookup, all -1 between uses

    @property
    def steps(self) -> int:
        """Extensions since the remembered fresh plan."""
        return self._steps

    def remember(self, tree: KVTree, plan: Plan) -> None:
        """Base later extensions on ``plan``, the plan now in use for ``tree``.

        Pass the plan :meth:`extend` returned for ``tree`` (the extension is then adopted)
        or a fresh plan of ``tree`` (extensions restart from it).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is plan:
            self._plan, self._tree, self._anchor, self._anchor_unit = pending
            self._steps += 1
            return
        self._plan, self._tree = plan, _TreeCopy(tree)
        self._anchor = self._anchor_unit = None  # found on the first extension
        self._steps = 0

    def extend(self, tree: KVTree) -> Plan | None:
        """The remembered plan extended to ``tree``, or None when ``tree`` does not extend
        the remembered tree (or ``max_steps`` extensions were made).

        The returned plan is not adopted until :meth:`remember` is called with it. It has the
        fresh plan's units, pairs, partial rows and tile classes, and its ``groups`` and
        ``edge_assignment`` (the decisions made for the shorter nodes); only ``kv_indices``,
        ``kv_row_mask``, ``unit_kv_start``, ``unit_kv_len`` and ``max_slot`` change, so units
        within a class need no longer be in decreasing KV length.
        """
        self._pending = None
        old, plan = self._tree, self._plan
        if old is None or plan is None or self._steps >= self.max_steps:
            return None
        n = old.parents.size
        if tree.parents.size != n or tree.query_nodes.size != old.query_nodes.size:
            return None
        if np.any(tree.parents != old.parents) or np.any(tree.query_nodes != old.query_nodes):
            return None
        grow = tree.lengths - old.lengths
        grown = np.flatnonzero(grow)
        if grown.size == 0:
            if not np.array_equal(tree.slots, old.slots):
                return None
            self._pending = (plan, old, self._anchor, self._anchor_unit)
            return plan
        d = grow[grown]
        if np.minimum.reduce(d) < 0:
            return None
        one = int(np.maximum.reduce(d)) == 1  # one new token per grown node: the decode step's case
        read = old.read[grown]
        all_read = bool(np.all(read))
        if not all_read:
            grown_read = grown[read]
        if not np.all(old.private[grown if all_read else grown_read]):
            return None  # a node several queries read grew
        # the old tokens keep their slots: the new array without the appended runs is the old one
        first_new = tree.slot_indptr[grown] + old.lengths[grown]
        lib = planner_library() if self.native else None
        if lib is not None and c_int32(tree.slots, old.slots):
            same = _prefixes_equal_native(lib, tree, old)
        else:
            new_pos = first_new if one else ragged_arange(first_new, d)
            same = np.array_equal(tree.slots[kept_mask(tree.slots.size, new_pos)], old.slots)
        if not same:
            return None
        if all_read:
            nodes = grown
        else:
            nodes, d, first_new = grown_read, d[read], first_new[read]
        if self._anchor is None:
            self._anchor, self._anchor_unit = self._find_anchors(plan, old)
        anchor = self._anchor[nodes]
        if nodes.size and np.minimum.reduce(anchor) < 0:
            return None  # an empty private node grew, or its last token was not found once
        n_new = nodes.size if one else int(np.add.reduce(d))
        new_entries = plan.kv_indices.size + n_new
        if new_entries > _INT32_MAX:
            return None
        order = anchor.argsort()
        nodes, d, anchor, first_new = nodes[order], d[order], anchor[order], first_new[order]
        entry_arrays = (plan.kv_indices, plan.kv_row_mask, plan.unit_kv_start, plan.unit_kv_len, tree.slots)
        if lib is not None and c_int32(*entry_arrays) and _consistent(plan):  # what the compiled insertion reads
            extended, new_anchor = self._insert_native(lib, plan, tree, nodes, d, anchor, first_new, new_entries)
            self._pending = (extended, _TreeCopy(tree, old), new_anchor, self._anchor_unit)
            return extended
        # each node's new slots go right after its last token's entry: new positions, in order
        if one:
            at = anchor + np.arange(1, n_new + 1)
            slots = tree.slots[first_new]
        else:
            at = np.repeat(anchor + 1, d)
            at += np.arange(n_new)
            slots = tree.slots[ragged_arange(first_new, d)]
        keep = kept_mask(new_entries, at)  # shared by the two entry arrays
        kv_indices = splice(plan.kv_indices, at, slots, keep)
        kv_row_mask = plan.kv_row_mask
        if kv_row_mask.size:
            new_masks = kv_row_mask[anchor] if one else np.repeat(kv_row_mask[anchor], d)
            kv_row_mask = splice(kv_row_mask, at, new_masks, keep)
        # entries inserted before position x: those of the anchors below x (one per anchor when one)
        if one:
            before = None
        else:
            before = np.zeros(nodes.size + 1, dtype=np.int64)
            np.cumsum(d, out=before[1:])

        def shift(x: np.ndarray) -> np.ndarray:
            below = np.searchsorted(anchor, x, side="left")
            return below if before is None else before[below]

        unit_kv_start = plan.unit_kv_start + shift(plan.unit_kv_start)
        unit_kv_len = plan.unit_kv_len.astype(np.int64)
        np.add.at(unit_kv_len, self._anchor_unit[nodes], d)
        new_anchor = self._anchor.copy()
        has = new_anchor >= 0
        new_anchor[has] += shift(new_anchor[has])
        new_anchor[nodes] += d  # the node's last token is now its last new slot
        extended = _with_entries(
            plan, tree, kv_indices, kv_row_mask, unit_kv_start.astype(np.int32), unit_kv_len.astype(np.int32)
        )
        self._pending = (extended, _TreeCopy(tree, old), new_anchor, self._anchor_unit)
        return extended

    def _insert_native(
        self, lib, plan: Plan, tree: KVTree, nodes: np.ndarray, d: np.ndarray, anchor: np.ndarray,
        first_new: np.ndarray, new_entries: int,
    ) -> tuple[Plan, np.ndarray]:  # fmt: skip
        """:meth:`extend`'s insertion of the new entries in one compiled call (``ft_extend_entries``):
        the same arrays as its numpy path. ``nodes, d, anchor, first_new``: the grown nodes in
        anchor order, their new tokens, anchors and first new slot positions."""
        n_old, n_units, n_nodes = plan.kv_indices.size, plan.n_units, self._anchor.size
        masked = plan.kv_row_mask.size > 0
        out = np.empty(new_entries * (2 if masked else 1) + 2 * n_units, dtype=np.int32)
        kv = out[:new_entries]
        mask = out[new_entries : 2 * new_entries] if masked else plan.kv_row_mask
        units = out[out.size - 2 * n_units :]
        longs = np.empty(n_nodes + nodes.size + 1, dtype=np.int64)
        new_anchor, before = longs[:n_nodes], longs[n_nodes:]
        unit_of = np.ascontiguousarray(self._anchor_unit[nodes], dtype=np.int64)
        nodes, d, anchor, first_new = (np.ascontiguousarray(a, dtype=np.int64) for a in (nodes, d, anchor, first_new))
        rc = lib.ft_extend_entries(
            n_old, address(plan.kv_indices), address(plan.kv_row_mask) if masked else None, nodes.size,
            address(anchor), address(d), address(first_new), address(nodes), address(unit_of), tree.slots.size,
            address(tree.slots), n_units, address(plan.unit_kv_start), address(plan.unit_kv_len), n_nodes,
            address(self._anchor), address(kv), address(mask) if masked else None, address(units),
            address(units[n_units:]), address(new_anchor), address(before),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError("internal error: an extended plan's entry outside its arrays")
        return _with_entries(plan, tree, kv, mask, units[:n_units], units[n_units:]), new_anchor

    def _find_anchors(self, plan: Plan, old: _TreeCopy) -> tuple[np.ndarray, np.ndarray]:
        """Entry (and unit) of every private node's last token, -1 where there is no token, where
        another private node ends in the same slot, or where that slot is not read by exactly one
        entry of the plan's units or that entry serves more than one row (in the compiled loop,
        ``ft_find_anchors``, when it is available and the plan's arrays are int32: the same
        anchors)."""
        n = old.parents.size
        anchor = np.full(n, -1, dtype=np.int64)
        anchor_unit = np.full(n, -1, dtype=np.int64)
        cand = np.flatnonzero(old.private & (old.lengths > 0))
        kv = plan.kv_indices
        if cand.size == 0 or kv.size == 0:
            return anchor, anchor_unit
        last = old.slots[old.slot_indptr[cand + 1] - 1].astype(np.int64)
        lib = planner_library() if self.native else None
        mask = plan.kv_row_mask
        arrays = (kv, plan.unit_kv_start, plan.unit_kv_len, plan.unit_q_len, *((mask,) if mask.size else ()))
        if lib is not None and c_int32(*arrays) and _consistent(plan):
            self._grow_table(int(np.maximum.reduce(last)) + 1)
            scratch = np.empty(4 * cand.size, dtype=np.int64)
            rc = lib.ft_find_anchors(
                cand.size, address(cand), address(last), kv.size, address(kv), address(mask) if mask.size else None,
                plan.n_units, address(plan.unit_kv_start), address(plan.unit_kv_len), address(plan.unit_q_len),
                self._table.size, address(self._table), n, address(scratch), address(anchor), address(anchor_unit),
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError("internal error: a plan's unit range or a node outside its arrays")
            return anchor, anchor_unit
        self._grow_table(max(int(np.maximum.reduce(last)), int(np.maximum.reduce(kv))) + 1)
        table = self._table
        table[last] = np.arange(cand.size, dtype=np.int32)
        try:
            winner = table[last].astype(np.int64)  # of the candidates ending in one slot, one wins it
            hit = table.take(kv)  # every entry, read by a unit or not (packing leaves copied runs behind)
        finally:
            table[last] = -1
        # a candidate alone in its slot (two private nodes ending in one slot: neither)
        unique = np.bincount(winner, minlength=cand.size) == 1
        found = np.flatnonzero(hit >= 0)
        # the unit whose KV range holds each found entry (non-empty ranges are disjoint), if any
        units = np.flatnonzero(plan.unit_kv_len > 0)
        start = plan.unit_kv_start[units].astype(np.int64)
        by_start = start.argsort()
        k = np.searchsorted(start[by_start], found, side="right") - 1
        unit = units[by_start[np.maximum(k, 0)]]
        inside = (k >= 0) & (found < plan.unit_kv_start[unit].astype(np.int64) + plan.unit_kv_len[unit])
        found, unit = found[inside], unit[inside]
        which = hit[found].astype(np.int64)
        ok = unique & (np.bincount(which, minlength=cand.size) == 1)
        keep = ok[which]
        found, which, unit = found[keep], which[keep], unit[keep]
        # the entry must serve one row: a one-query unit, or a bin entry with one mask bit
        if mask.size:
            m = mask[found].astype(np.int64) & 0xFFFFFFFF
            single = (m != 0) & ((m & (m - 1)) == 0)
            single |= (m == 0xFFFFFFFF) & (plan.unit_q_len[unit] == 1)
        else:
            single = plan.unit_q_len[unit] == 1
        found, which, unit = found[single], which[single], unit[single]
        anchor[cand[which]] = found
        anchor_unit[cand[which]] = unit
        return anchor, anchor_unit

    def _grow_table(self, size: int) -> None:
        """Make the slot lookup table (all -1 between uses) at least ``size`` long."""
        if self._table.size < size:
            self._table = np.full(max(size, 2 * self._table.size), -1, dtype=np.int32)
