"""The KV tree (a forest, in general) of a batch of decode queries.

A *node* is a run of KV tokens stored in a token pool (an SGLang-style
``[pool_slots, Hkv, D]`` KV cache with page size 1); a query's context is the
concatenation of the nodes on its root-to-node path. Nodes are numbered
``0 .. n_nodes - 1``; siblings are visited in increasing node id everywhere.

Construction validates everything the planner and kernels rely on and derives,
with vectorised numpy, the arrays they need (depths, levels, children,
subtree query counts, path lengths).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .native import address, c_int64, planner_library
from .validation import check_int_array

_INT32_MAX = np.iinfo(np.int32).max


def _as_int_array(name: str, value, ndim: int = 1, keep_dtype: bool = False) -> np.ndarray:
    """``value`` (array-like, or a CPU tensor) as an int64 array of ``ndim`` dims, or with
    ``keep_dtype`` in its own integer dtype (:func:`check_int_array`)."""
    arr = value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else value
    return check_int_array(name, arr, ndim=ndim, keep_dtype=keep_dtype)


def _parents_and_lengths(parents, lengths) -> tuple[np.ndarray, np.ndarray]:
    """``parents`` and per-node token ``lengths`` as int64 arrays of one size, lengths >= 0."""
    lengths_arr = _as_int_array("lengths", lengths)
    parents_arr = _as_int_array("parents", parents)
    if lengths_arr.size != parents_arr.size:
        raise ValueError(f"lengths has {lengths_arr.size} entries but parents has {parents_arr.size} nodes")
    if lengths_arr.size and lengths_arr.min() < 0:
        bad = int(np.flatnonzero(lengths_arr < 0)[0])
        raise ValueError(f"lengths[{bad}] = {lengths_arr[bad]} is negative")
    return parents_arr, lengths_arr


def kept_mask(total: int, at: np.ndarray) -> np.ndarray:
    """bool [total]: False at the indices ``at``, True at every other index."""
    keep = np.ones(total, dtype=bool)
    keep[at] = False
    return keep


def splice(old: np.ndarray, at: np.ndarray, new, keep: np.ndarray | None = None) -> np.ndarray:
    """``old`` with entries inserted: ``new[k]`` lands at index ``at[k]`` of the result (``at``
    increasing), ``old``'s entries fill the other indices in order; dtype of ``old``.

    ``keep`` is ``kept_mask(old.size + at.size, at)`` when the caller already has it.
    """
    total = old.size + at.size
    if keep is None:
        keep = kept_mask(total, at)
    out = np.empty(total, dtype=old.dtype)
    out[keep] = old
    out[at] = new
    return out


def exclusive_sum(x: np.ndarray) -> np.ndarray:
    """``[0, x[0], x[0] + x[1], ...]``: the int64 start of each run of lengths ``x``."""
    out = np.zeros(x.size, dtype=np.int64)
    np.add.accumulate(x[:-1], out=out[1:])
    return out


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """The int64 inverse of the permutation ``perm`` of ``0 .. n - 1``: ``out[perm[i]] = i``."""
    out = np.empty(perm.size, dtype=np.int64)
    out[perm] = np.arange(perm.size, dtype=np.int64)
    return out


#: Longest cached arange behind :func:`arange_view` (longer ones are made on each call).
_ARANGE_CACHE_MAX = 1 << 20
_aranges: dict = {}


def arange_view(n: int, dtype=np.int64) -> np.ndarray:
    """A read-only ``arange(n)`` of ``dtype`` (``np.int32`` or ``np.int64``).

    A view of a cached arange (up to :data:`_ARANGE_CACHE_MAX` entries): an operand that
    saves filling a new arange when only arithmetic on it is needed.
    """
    cached = _aranges.get(dtype)
    if cached is None or cached.size < n:
        if n > _ARANGE_CACHE_MAX:
            return np.arange(n, dtype=dtype)
        size = min(_ARANGE_CACHE_MAX, max(n, 4096, 2 * (0 if cached is None else cached.size)))
        cached = np.arange(size, dtype=dtype)
        cached.flags.writeable = False
        _aranges[dtype] = cached
    return cached[:n]


def stable_argsort(key: np.ndarray, bound: int) -> np.ndarray:
    """``key.argsort(kind="stable")`` for non-negative keys below ``bound`` (a radix sort
    on 16-bit keys when they fit)."""
    return key.astype(np.uint16).argsort(kind="stable") if bound <= 1 << 16 else key.argsort(kind="stable")


def ragged_arange(start: np.ndarray, length: np.ndarray, total: int | None = None) -> np.ndarray:
    """Concatenation of ``arange(start[i], start[i] + length[i])`` (int64; lengths >= 0).

    ``total`` is ``length.sum()`` when the caller already knows it.
    """
    n = length.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # entry k of run i is k + (start[i] - first[i]), first[i] the run's offset in the output
    shift = np.empty(n, dtype=np.int64)
    shift[0] = 0
    np.add.accumulate(length[:-1], out=shift[1:])
    if total is None:
        total = int(shift[-1] + length[-1])
    np.subtract(start, shift, out=shift)
    out = shift.repeat(length)
    out += arange_view(total)  # in place: no second temporary of the output's size
    return out


def ragged_gather(indptr: np.ndarray, data: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ``data[indptr[r]:indptr[r + 1]]`` for each ``r`` in ``rows``.

    Returns ``(out_indptr, out_data)`` with ``len(rows) + 1`` and ``sum of row lengths`` entries.
    """
    starts = indptr[rows]
    lens = indptr[rows + 1] - starts
    out_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=out_indptr[1:])
    return out_indptr, data[ragged_arange(starts, lens, int(out_indptr[-1]))]


class KVTree:
    """A forest of KV-cache nodes and the decode queries that read it.

    Parameters
    ----------
    parents : array-like of int, shape [n_nodes]
        ``parents[i]`` is the parent node of node ``i``, or ``-1`` for a root
        (several roots make a forest).
    node_slots : sequence of n_nodes array-likes of int
        ``node_slots[i]`` is the 1-D array of KV-pool slot ids of node ``i``'s tokens,
        in any order and not necessarily contiguous. A node may be empty. The nodes' slots
        must be disjoint (the contract below).
    query_nodes : array-like of int, shape [n_queries]
        ``query_nodes[j]`` is the node whose root path is query ``j``'s context;
        any node, internal ones included.

    Raises
    ------
    ValueError
        On an empty tree, parent ids out of range, self-parents or cycles, negative
        slots (or slots >= 2**31), query nodes out of range, or a query whose
        context holds no token.

    Notes
    -----
    Contract: every token of the tree has a pool slot of its own, i.e. the slots of all
    nodes are pairwise disjoint and no node lists a slot twice (as in any KV cache: a token
    is stored once). Construction does not check it: the check sorts every slot, which on
    the paper suite's largest tree (case 8: 278,816 tokens) takes about 1.2 ms against
    0.8 to 7 ms for ``fasttree.plan`` of that tree (15% to 150%, far over the serving path's
    budget). A tree that breaks it still plans and runs, but a query whose root path holds
    one slot twice attends to that token twice (its weight counts double in the softmax).
    Call :meth:`check_disjoint_slots` on trees built from slots you do not control (the
    adapter, ``fasttree.adapter``, builds a trie of the requests' slot lists and inherits
    any slot they repeat). Trees of :meth:`from_lengths`, :meth:`from_levels` and the trace
    reader (contiguous slots) hold by construction.

    Attributes
    ----------
    parents : ndarray, int64 [n_nodes]
    lengths : ndarray, int64 [n_nodes]
        Tokens per node.
    slot_indptr : ndarray, int64 [n_nodes + 1]
        Node ``i``'s slots are ``slots[slot_indptr[i]:slot_indptr[i + 1]]``.
    slots : ndarray, int32 [total_tokens]
    query_nodes : ndarray, int64 [n_queries]
    depth : ndarray, int64 [n_nodes]
        0 for roots.
    level_order : ndarray, int64 [n_nodes]
        Nodes sorted by (depth, id); level ``d`` is
        ``level_order[level_ptr[d]:level_ptr[d + 1]]``.
    level_ptr : ndarray, int64 [max_depth + 2]
    subtree_queries : ndarray, int64 [n_nodes]
        Queries whose context contains node ``i`` (queries at ``i`` or below it).
    path_lengths : ndarray, int64 [n_nodes]
        Tokens on the path from the root to node ``i`` inclusive.
    """

    def __init__(self, parents, node_slots: Sequence, query_nodes) -> None:
        parents_arr = _as_int_array("parents", parents)
        n = parents_arr.size
        if n == 0:
            raise ValueError("a KVTree needs at least one node (parents is empty)")
        try:
            count = len(node_slots)
        except TypeError:
            raise ValueError(
                f"node_slots must be a sequence of per-node slot arrays, got {type(node_slots).__name__}"
            ) from None
        if count != n:
            raise ValueError(f"node_slots has {count} entries but parents has {n} nodes")
        arrays = [_as_int_array(f"node_slots[{i}]", s) for i, s in enumerate(node_slots)]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=n)
        slots = np.concatenate(arrays) if lengths.sum() else np.zeros(0, dtype=np.int64)
        self._init(parents_arr, lengths, slots, _as_int_array("query_nodes", query_nodes))

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_lengths(cls, parents, lengths, query_nodes) -> KVTree:
        """Tree whose nodes occupy contiguous slots, node ``i`` right after node ``i - 1``.

        Parameters
        ----------
        parents : array-like of int, shape [n_nodes]
        lengths : array-like of int, shape [n_nodes]
            Tokens per node (>= 0).
        query_nodes : array-like of int, shape [n_queries]
        """
        return cls._from_lengths(parents, lengths, query_nodes)

    @classmethod
    def _from_lengths(cls, parents, lengths, query_nodes, depth: np.ndarray | None = None) -> KVTree:
        parents_arr, lengths_arr = _parents_and_lengths(parents, lengths)
        total = int(lengths_arr.sum())
        if total > _INT32_MAX + 1:
            raise ValueError(f"the tree holds {total} tokens, more than a 2**31 slot pool")
        obj = cls.__new__(cls)
        obj._init(
            parents_arr,
            lengths_arr,
            np.arange(total, dtype=np.int32),  # slot i of the pool is token i of the tree
            _as_int_array("query_nodes", query_nodes),
            depth=depth,
            slots_are_arange=True,
        )
        obj._slots_are_arange = True
        return obj

    @classmethod
    def from_flat(cls, parents, lengths, slots, query_nodes) -> KVTree:
        """Tree whose node slots are given back to back: node ``i``'s are
        ``slots[sum(lengths[:i]):sum(lengths[:i + 1])]`` (no per-node arrays to build).

        Parameters
        ----------
        parents : array-like of int, shape [n_nodes]
        lengths : array-like of int, shape [n_nodes]
            Tokens per node (>= 0).
        slots : array-like of int, shape [sum(lengths)]
            KV-pool slot ids, node after node.
        query_nodes : array-like of int, shape [n_queries]

        Raises
        ------
        ValueError
            As the constructor, and when ``lengths`` and ``parents`` differ in size, a length
            is negative, or ``slots`` does not hold ``sum(lengths)`` entries.
        """
        parents_arr, lengths_arr = _parents_and_lengths(parents, lengths)
        # checked in their own dtype and converted to int32 once (int32 ones copied: the tree
        # never shares the caller's array)
        slots_arr = _as_int_array("slots", slots, keep_dtype=True)
        total = int(lengths_arr.sum())
        if slots_arr.size != total:
            raise ValueError(f"slots has {slots_arr.size} entries but the lengths add up to {total}")
        if slots_arr.dtype == np.int32:
            slots_arr = slots_arr.copy()
        obj = cls.__new__(cls)
        obj._init(parents_arr, lengths_arr, slots_arr, _as_int_array("query_nodes", query_nodes))
        return obj

    @classmethod
    def from_levels(cls, nodes_per_level: Sequence[int], tokens_per_level: Sequence[int]) -> KVTree:
        """The paper-suite tree: level 0 nodes are roots, child ``j`` of a level of ``n_l``
        nodes hangs under node ``j * n_prev // n_l`` of the previous level, every node of
        level ``l`` holds ``tokens_per_level[l]`` tokens (contiguous slots, level by level),
        and each node of the last level carries one query, in node order.
        """
        if len(nodes_per_level) == 0 or len(nodes_per_level) != len(tokens_per_level):
            raise ValueError("nodes_per_level and tokens_per_level must be non-empty and of equal length")
        if min(nodes_per_level) < 1:
            raise ValueError(f"every level needs at least one node, got {list(nodes_per_level)}")
        parents: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        prev_first, prev_n, first = -1, 0, 0
        for n_l, tokens in zip(nodes_per_level, tokens_per_level, strict=True):
            if prev_n == 0:
                parents.append(np.full(n_l, -1, dtype=np.int64))
            else:
                parents.append(prev_first + np.arange(n_l, dtype=np.int64) * prev_n // n_l)
            lengths.append(np.full(n_l, tokens, dtype=np.int64))
            prev_first, prev_n, first = first, n_l, first + n_l
        queries = np.arange(prev_first, first, dtype=np.int64)
        depth = np.arange(len(nodes_per_level), dtype=np.int64).repeat(nodes_per_level)  # nodes are level by level
        return cls._from_lengths(np.concatenate(parents), np.concatenate(lengths), queries, depth)

    # ------------------------------------------------------------- internals
    def _init(
        self,
        parents: np.ndarray,
        lengths: np.ndarray,
        slots: np.ndarray,
        query_nodes: np.ndarray,
        *,
        depth: np.ndarray | None = None,
        slots_are_arange: bool = False,
    ) -> None:
        # depth: the nodes' depths when the caller knows them (an acyclic forest);
        # slots_are_arange: slots is arange(n_tokens) as int32, already in range.
        n = parents.size
        if n == 0:
            raise ValueError("a KVTree needs at least one node (parents is empty)")
        bad = np.flatnonzero((parents < -1) | (parents >= n))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"parents[{i}] = {parents[i]} is out of range: parent ids must be -1 or in [0, {n})")
        self_loops = np.flatnonzero(parents == np.arange(n))
        if self_loops.size:
            i = int(self_loops[0])
            raise ValueError(f"node {i} is its own parent (a cycle)")
        hi = slots.size - 1 if slots_are_arange else -1
        if slots.size and not slots_are_arange:
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0:
                raise ValueError(f"node_slots hold a negative slot id ({lo})")
            if hi > _INT32_MAX:
                raise ValueError(f"node_slots hold slot id {hi}, beyond the int32 range of the kernels")
        if query_nodes.size == 0:
            raise ValueError("a KVTree needs at least one query (query_nodes is empty)")
        bad = np.flatnonzero((query_nodes < 0) | (query_nodes >= n))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"query_nodes[{j}] = {query_nodes[j]} is out of range [0, {n})")

        got = _levels_native(parents, lengths, query_nodes, depth)
        if got is not None:
            depth, level_order, level_ptr, path_lengths, subtree_queries = got
        else:
            if depth is None:
                depth = _depths(parents)  # raises on cycles
            level_order = depth.argsort(kind="stable")
            level_ptr = np.searchsorted(depth[level_order], np.arange(int(depth.max()) + 2))
        bounds = level_ptr.tolist()
        levels = [level_order[bounds[d] : bounds[d + 1]] for d in range(len(bounds) - 1)]
        if got is None:
            # Top-down path lengths, bottom-up subtree query counts, one level at a time.
            path_lengths = lengths.copy()
            subtree_queries = np.bincount(query_nodes, minlength=n).astype(np.int64)
            for lvl in levels[1:]:
                path_lengths[lvl] += path_lengths[parents[lvl]]
            for lvl in reversed(levels[1:]):
                np.add.at(subtree_queries, parents[lvl], subtree_queries[lvl])

        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])

        empty = np.flatnonzero(path_lengths[query_nodes] == 0)
        if empty.size:
            j = int(empty[0])
            raise ValueError(f"query {j} (at node {query_nodes[j]}) has an empty context: no token on its root path")

        self.parents = parents
        self.lengths = lengths
        self.slot_indptr = indptr
        # an int32 array here is always a fresh one (append_tokens); int64 ones are converted (a copy)
        self.slots = slots if slots_are_arange else slots.astype(np.int32, copy=False)
        self.query_nodes = query_nodes
        self.depth = depth
        self.level_order = level_order
        self.level_ptr = level_ptr
        self.levels = levels
        self.subtree_queries = subtree_queries
        self.path_lengths = path_lengths
        self._max_slot = hi

    def append_tokens(self, slots) -> KVTree:
        """The next decode step's tree: every query's node gains one token, at ``slots[j]``.

        For a batch whose requests stay the same: each request appended the token it just
        decoded to its own node. The new tree has the same nodes, parents and queries (so a
        :class:`~fasttree.plan_extend.PlanExtender` can extend the plan of this one), built
        in O(tokens) numpy work, without rebuilding the trie from the requests' contexts.

        Parameters
        ----------
        slots : array-like of int, shape [n_queries]
            Pool slot of query ``j``'s new token, in ``[0, 2**31)``.

        Raises
        ------
        ValueError
            When ``slots`` has another length than the queries, holds a slot out of range,
            or a query's node is read by other queries too (a request sitting on a shared
            node, e.g. a fresh fork: its new token starts a node of its own, so the tree
            must be rebuilt).
        """
        new = _as_int_array("slots", slots)
        qn = self.query_nodes
        if new.size != qn.size:
            raise ValueError(f"slots has {new.size} entries but the tree has {qn.size} queries: one new token each")
        if new.size and (new.min() < 0 or new.max() > _INT32_MAX):
            j = int(np.flatnonzero((new < 0) | (new > _INT32_MAX))[0])
            raise ValueError(f"slots[{j}] = {new[j]} is outside the pool slot range [0, 2**31)")
        shared = np.flatnonzero(self.subtree_queries[qn] != 1)
        if shared.size:
            j = int(shared[0])
            raise ValueError(
                f"query {j} sits at node {qn[j]}, which other queries read too: its new token needs a node "
                "of its own, so build the tree afresh"
            )
        # query j's token goes at the end of its node: before the first slot of the node after it
        order = np.argsort(qn, kind="stable")
        at = self.slot_indptr[qn[order] + 1] + np.arange(qn.size)
        out = splice(self.slots, at, new[order])
        lengths = self.lengths.copy()
        lengths[qn] += 1
        obj = KVTree.__new__(KVTree)
        obj._init(self.parents, lengths, out, qn, depth=self.depth)
        return obj

    def check_disjoint_slots(self) -> None:
        """Check the contract that every token has a pool slot of its own (see the class notes).

        O(tokens log tokens): a sort of every slot; free for trees with contiguous slots
        (:meth:`from_lengths`, :meth:`from_levels`).

        Raises
        ------
        ValueError
            Naming a slot held twice and the nodes holding it (one node twice, two nodes,
            and whether a query reads it twice: when one of the nodes is on the other's root path).
        """
        if getattr(self, "_slots_are_arange", False) or self.slots.size < 2:
            return
        ordered = np.sort(self.slots)
        dup = np.flatnonzero(ordered[1:] == ordered[:-1])
        if dup.size == 0:
            return
        slot = int(ordered[dup[0]])
        first, second = (int(x) for x in np.flatnonzero(self.slots == slot)[:2])
        a, b = (int(n) for n in np.searchsorted(self.slot_indptr, [first, second], side="right") - 1)
        if a == b:
            raise ValueError(f"node {a} holds pool slot {slot} twice: its queries read that token twice")
        if self._is_ancestor(a, b) or self._is_ancestor(b, a):
            reads = f"the queries below node {max(a, b, key=lambda n: self.depth[n])} read that token twice"
        else:
            reads = "two tokens would share one stored K/V row"
        raise ValueError(f"nodes {a} and {b} both hold pool slot {slot}: {reads}")

    def _is_ancestor(self, a: int, b: int) -> bool:
        """Whether node ``a`` is on node ``b``'s root path (``b`` included)."""
        while b >= 0:
            if b == a:
                return True
            b = int(self.parents[b])
        return False

    # ------------------------------------------------------------ properties
    @property
    def n_nodes(self) -> int:
        return int(self.parents.size)

    @property
    def n_queries(self) -> int:
        return int(self.query_nodes.size)

    @property
    def num_tokens(self) -> int:
        """Unique KV tokens held by the tree's nodes."""
        return int(self.slots.size)

    @property
    def max_slot(self) -> int:
        """Largest pool slot id used, or -1 for a tree without tokens."""
        return self._max_slot

    def node_slots(self, i: int) -> np.ndarray:
        """Slots of node ``i``, int32 [lengths[i]]."""
        return self.slots[self.slot_indptr[i] : self.slot_indptr[i + 1]]

    def query_paths(self) -> tuple[np.ndarray, np.ndarray]:
        """Root-first node paths of every query.

        Returns
        -------
        indptr : ndarray, int64 [n_queries + 1]
        nodes : ndarray, int64 [sum of path node counts]
            Query ``j``'s path is ``nodes[indptr[j]:indptr[j + 1]]``, root first.
        """
        qn = self.query_nodes
        width = int(self.depth[qn].max()) + 1
        table = np.full((qn.size, width), -1, dtype=np.int64)
        rows = np.arange(qn.size)
        cur = qn.copy()
        alive = np.ones(qn.size, dtype=bool)
        while alive.any():
            table[rows[alive], self.depth[cur[alive]]] = cur[alive]
            cur[alive] = self.parents[cur[alive]]
            alive &= cur >= 0
        counts = self.depth[qn] + 1
        indptr = np.zeros(qn.size + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return indptr, table[table >= 0]

    def query_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Each query's context as pool slots, root first (an SGLang ``req_to_token`` in CSR form).

        Returns
        -------
        indptr : ndarray, int64 [n_queries + 1]
        slots : ndarray, int32 [sum of context lengths]
        """
        path_indptr, path_nodes = self.query_paths()
        node_ptr, slots = ragged_gather(self.slot_indptr, self.slots, path_nodes)
        return node_ptr[path_indptr], slots

    def __repr__(self) -> str:
        roots = int((self.parents < 0).sum())
        return (
            f"KVTree(n_nodes={self.n_nodes}, roots={roots}, depth={int(self.depth.max()) + 1}, "
            f"tokens={self.num_tokens}, n_queries={self.n_queries})"
        )


def _levels_native(
    parents: np.ndarray, lengths: np.ndarray, query_nodes: np.ndarray, depth: np.ndarray | None, native: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(depth, level_order, level_ptr, path_lengths, subtree_queries)`` of :meth:`KVTree._init`
    (int64 each, the numpy path's values) by the compiled ``ft_tree_levels`` when it is available
    and the arrays are int64; None otherwise or on a cycle (the numpy path then names it).
    ``parents`` are in ``[-1, n)`` without self loops and ``query_nodes`` in ``[0, n)`` (checked)."""
    lib = planner_library() if native else None
    if lib is None:
        return None
    n, i64 = parents.size, np.int64
    if not c_int64(parents, lengths, query_nodes) or (depth is not None and not c_int64(depth)):
        return None
    if lengths.size != n or (depth is not None and depth.size != n):
        return None
    out = np.empty(5 * n + 2, dtype=i64)  # depth, level_order, path_lengths, subtree_queries, level_ptr
    state = np.empty(n, dtype=np.int8)
    o = address(out)
    if depth is not None:
        out[:n] = depth
    max_depth = lib.ft_tree_levels(
        n, address(parents), address(lengths), query_nodes.size, address(query_nodes), int(depth is not None), o,
        o + 8 * n, o + 32 * n, o + 16 * n, o + 24 * n, address(state),
    )  # fmt: skip
    if max_depth < 0:
        return None
    return out[:n], out[n : 2 * n], out[4 * n : 4 * n + max_depth + 2], out[2 * n : 3 * n], out[3 * n : 4 * n]


def _depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node by pointer jumping; raises ``ValueError`` on a cycle."""
    n = parents.size
    depth = (parents >= 0).astype(np.int64)
    anc = parents.copy()
    for _ in range(max(1, int(n).bit_length()) + 1):
        live = np.flatnonzero(anc >= 0)
        if live.size == 0:
            return depth
        up = anc[live]
        depth[live] += depth[up]
        anc[live] = anc[up]
    cyc = int(np.flatnonzero(anc >= 0)[0])
    raise ValueError(f"the parent links contain a cycle (node {cyc} never reaches a root)")
