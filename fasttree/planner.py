"""The FastTree planner: greedy edge assignment, groups, long-context split, adaptive passes.

Pipeline (all on the host, numpy only):

1. :func:`greedy_edge_assignment` -- BFS over the tree; for every edge parent ``v`` ->
   child ``l`` (siblings in id order) decide 1 (concatenate ``v``'s context into
   ``l``'s group) when ``SplitKVCost > SplitQCost`` (see :mod:`fasttree.costs`).
2. :func:`build_groups` -- every node is a context-query group: its KV is its own tokens
   plus its ancestors' up its chain of 1-edges, its queries are those below it not
   absorbed by a 1-edge child. Empty groups are dropped.
3. :func:`fasttree.plan_arrays.materialize` -- groups cut into work units (KV chunks x
   query tiles), partial rows assigned; see :class:`fasttree.plan_arrays.Plan`.
4. Adaptive passes (:func:`plan`): a tile phase with few units uses the small split
   size; when one phase is nearly empty every group moves to the other phase's tiles and
   the greedy is re-run with them.

Levels are processed one at a time; within a level, edges are decided either by a
scalar loop (few edges) or vectorised: every edge is evaluated under "all earlier
siblings concatenated" and "none concatenated", which settles the level unless a parent's
children switch more than once (then the scalar loop finishes the remaining edges when
they are few, else rounds in which every parent jumps to its next concatenated child).
Every path computes exactly the floating-point costs of
:meth:`fasttree.costs.PaddingCost.cmm` (exact integer products times the float weights).

What depends only on the tree (edges grouped by level and parent, the query counts the
greedy evaluates, DFS query ranges) is built on first use and cached on the tree. The
adaptive passes count units from the greedy's group sizes alone; the groups' query lists
and slots are built once, for the final tile mode.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable

import numpy as np

from .config import FastTreeConfig
from .costs import ALL_LARGE, ALL_SMALL, TWO_CLASSES, PaddingCost, mode_tiles
from .groups import ChainedSlots, Groups
from .host_arrays import entry_array
from .launch_rules import launch_kv_tile
from .native import address, c_int32, c_int64, planner_library
from .plan_arrays import _MIN_BLOCK_M, Plan, check_heads, materialize, tile_read_weight, tile_rows
from .plan_rules import PlanRules, capped_small_split
from .portfolio import Portfolio, head_layout
from .query_separated import PLANNED_SMS, plan_query_separated
from .tree import KVTree, arange_view, exclusive_sum, inverse_permutation, ragged_arange, stable_argsort

_DEFAULT_CONFIG = FastTreeConfig()

_INT32_MAX = 0x7FFFFFFF

#: Levels with at most this many edges are decided by the scalar loop (a speed threshold: both
#: loops decide alike).
SCALAR_EDGES = 16

#: A vectorised level whose first pass leaves at most ``_SCALAR_REST_FACTOR * SCALAR_EDGES``
#: edges undecided finishes them with the scalar loop (else with rounds of vector passes).
_SCALAR_REST_FACTOR = 8

#: Chained groups' slots are filled by strided copies only when a copy averages this many tokens
#: (a speed threshold: every fill gives the same slots).
STRIDED_FILL_TOKENS = 8192


# ---------------------------------------------------------------- tree index
class _Level:
    """The edges into one depth of the tree: slice ``lo:hi`` of the edge order."""

    __slots__ = ("hi", "ix", "lists", "lnf", "lo", "lv0", "prel", "prev", "size", "sstart")

    def __init__(self, ix: _TreeIndex, lo: int, hi: int, lv0: np.ndarray | None, prel: np.ndarray | None) -> None:
        self.ix = ix
        self.lo, self.hi, self.size = lo, hi, hi - lo
        self.lv0 = lv0  # parents' group lengths of the first level (roots: their own)
        self.prel = prel  # parent's index in the level above (None for the first level)
        self.sstart = ix.sstart[lo:hi] - lo if lo else ix.sstart[:hi]  # first sibling's index in this level
        self.lnf = ix.lnf[lo:hi]
        self.lists: tuple[list, list, list, list] | None = None
        # the parents' group lengths of the first level (lv0), else their indices in the level
        # above (prel), as a list: what the all-scalar greedy reads (built on first use)
        self.prev: list | None = None

    @property
    def not_last(self) -> np.ndarray:
        """bool [size]: the edge is not its parent's last child (the numpy greedy's)."""
        return self.ix.not_last[self.lo : self.hi]

    @property
    def a(self) -> np.ndarray:
        """float64 [5, size]: this level's slice of the index's query counts (the numpy greedy's)."""
        return self.ix.af[:, self.lo : self.hi]


#: Trees with more edges keep the greedy's integer query counts as int32 (less memory traffic).
_INT32_COUNTS_EDGES = 4096


class _TreeIndex:
    """Structure of one tree that every plan of it shares; built once, cached on the tree.

    Non-root nodes are kept in *edge order*: by depth, then parent, then id. A level (the
    edges into one depth) is a slice of every per-edge array, and the children of one
    parent (a *segment*) are contiguous, in id order.
    """

    def __init__(self, tree: KVTree) -> None:
        n = tree.n_nodes
        parents, sq = tree.parents, tree.subtree_queries
        lp = tree.level_ptr.tolist()
        r = lp[1]
        ch = tree.level_order[r:]
        cp = parents[ch]
        e = ch.size
        # level_order is by (depth, id): edge order needs no sort when parents already ascend
        self.child_sorted = None  # non-root nodes by (parent, id), when computed here
        if e > 1 and np.count_nonzero(cp[1:] < cp[:-1]):
            # nodes by (parent, id) are in edge order when their depths ascend (parents
            # numbered level by level); else sort by (depth, parent, id)
            cs = stable_argsort(parents + 1, n + 1)[r:]  # the r roots (parent -1) come first
            self.child_sorted = cs
            d = tree.depth[cs]
            if np.count_nonzero(d[1:] < d[:-1]):
                key = tree.depth[ch] * n + cp
                o = stable_argsort(key, (len(lp) - 1) * n)
                ch, cp = ch[o], cp[o]
            else:
                ch, cp = cs, parents[cs]
        self.children = ch
        self.cp = cp
        self._int32_counts = e > _INT32_COUNTS_EDGES and tree.n_queries < 1 << 31
        # children in edge order are the nodes n_roots .. n - 1 (trees numbered level by level)
        contiguous = e == 0 or (int(ch[0]) == r and int(ch[-1]) == n - 1 and not np.count_nonzero(ch[1:] < ch[:-1]))
        self.child_index = slice(r, n) if contiguous else ch
        self.roots = tree.level_order[:r]
        # the edges into each depth 1, 2, ...: slice lo:hi of the edge order
        self.level_bounds = [(lp[i + 1] - r, lp[i + 2] - r) for i in range(len(lp) - 2)]
        self.max_level = max((hi - lo for lo, hi in self.level_bounds), default=0)
        self.n_nodes = n
        self.lengths = tree.lengths
        self._sq = sq
        self._groups: _GroupIndex | None = None
        # the per-edge parents, query counts, lengths and parents' counts as lists (built on first use)
        self.scalar_lists: tuple[list, list, list, list] | None = None
        # the edges' children and parents, subtree queries and lengths of the compiled greedy's
        # groups and their addresses (built on first use)
        self.native_groups: tuple[tuple[np.ndarray, ...], tuple[int, ...]] | None = None
        # the tree's parents, lengths, slot offsets and slots, and its longest chain, for the
        # compiled chain loops (built on first use)
        self.native_tree: tuple | None = None

    # The per-edge counts and lengths and the sibling segments: what the numpy paths read (the
    # compiled greedy derives its own), built on first use.
    @functools.cached_property
    def q(self) -> np.ndarray:
        """int64 [n_edges]: the child's subtree queries."""
        return self._sq[self.children]

    @functools.cached_property
    def n_par(self) -> np.ndarray:
        """int64 [n_edges]: the parent's subtree queries."""
        return self._sq[self.cp]

    @functools.cached_property
    def lnf(self) -> np.ndarray:
        """float64 [n_edges]: the child's tokens."""
        return self.lengths[self.children].astype(np.float64)

    @functools.cached_property
    def _new_seg(self) -> np.ndarray:
        """bool [n_edges]: the edge is its parent's first child (starts a segment)."""
        cp = self.cp
        new_seg = np.empty(cp.size, dtype=bool)
        new_seg[:1] = True
        np.not_equal(cp[1:], cp[:-1], out=new_seg[1:])
        return new_seg

    @functools.cached_property
    def seg_starts(self) -> np.ndarray:
        """int64 [n_segments]: each segment's first edge."""
        return self._new_seg.nonzero()[0]

    @functools.cached_property
    def seg_par(self) -> np.ndarray:
        """int64 [n_segments]: each segment's parent."""
        return self.cp[self.seg_starts]

    @functools.cached_property
    def sstart(self) -> np.ndarray:
        """int64 [n_edges]: every edge's first sibling."""
        starts = self.seg_starts
        seg_size = np.empty(starts.size, dtype=np.int64)
        np.subtract(starts[1:], starts[:-1], out=seg_size[:-1])
        seg_size[-1:] = self.cp.size - starts[-1:]
        return starts.repeat(seg_size)

    @functools.cached_property
    def excl_seg(self) -> np.ndarray:
        """int64 [n_edges]: the queries of every edge's earlier siblings."""
        excl = np.add.accumulate(self.q)
        excl -= self.q
        return excl - excl[self.sstart]

    def groups(self, tree: KVTree) -> _GroupIndex:
        if self._groups is None:
            self._groups = _GroupIndex(tree, self)
        return self._groups

    @functools.cached_property
    def edge_of(self) -> np.ndarray:
        """int64 [n_nodes]: every node's edge (its index in edge order), -1 for a root."""
        pos = np.full(self.n_nodes, -1, dtype=np.int64)
        pos[self.children] = np.arange(self.children.size, dtype=np.int64)
        return pos

    # What only the numpy greedy reads (the compiled one does not): built on its first use.
    @functools.cached_property
    def levels(self) -> list[_Level]:
        """The edges into each depth (:class:`_Level`), the first level with its roots' lengths,
        the others with their parents' indices in the level above."""
        out = []
        for i, (lo, hi) in enumerate(self.level_bounds):
            if i == 0:
                out.append(_Level(self, lo, hi, self.lengths[self.cp[lo:hi]].astype(np.float64), None))
            else:
                prel = self.edge_of[self.cp[lo:hi]]
                prel -= self.level_bounds[i - 1][0]
                out.append(_Level(self, lo, hi, None, prel))
        return out

    @functools.cached_property
    def af(self) -> np.ndarray:
        """float64 [5, n_edges]: the query counts at which the vectorised greedy evaluates Cmm:
        a run of 1s before the edge (n1) or only 0s (n_par), each before and after taking the
        child, and q."""
        a = np.empty((5, self.q.size), dtype=np.int64)
        a[4] = self.q
        a[1] = self.n_par
        np.subtract(self.n_par, self.excl_seg, out=a[0])
        np.subtract(a[0], self.q, out=a[2])
        np.subtract(self.n_par, self.q, out=a[3])
        self._counts = a.astype(np.int32) if self._int32_counts else a
        return a.astype(np.float64)

    @property
    def qf(self) -> np.ndarray:
        """float64 [n_edges]: ``q`` as floats (row 4 of :attr:`af`)."""
        return self.af[4]

    @property
    def a(self) -> np.ndarray:
        """int64 (int32 on large trees) [5, n_edges]: :attr:`af`'s counts as integers."""
        self.af  # noqa: B018 (builds _counts)
        return self._counts

    @functools.cached_property
    def neg_a(self) -> np.ndarray:
        return np.negative(self.a)

    @functools.cached_property
    def not_last(self) -> np.ndarray:
        """bool [n_edges]: the edge is not its parent's last child."""
        e = self.q.size
        not_last = np.empty(e, dtype=bool)
        np.logical_not(self._new_seg[1:], out=not_last[:-1])
        not_last[-1:] = False
        return not_last


class _GroupIndex:
    """Query ranges of the tree in DFS order (own queries first, then children in id order).

    ``qlo[v]:qlo[v] + subtree_queries[v]`` are the DFS positions of the queries at or below
    ``v``; ``perm[pos]`` is the query at a position (``None`` when that is the identity),
    ``rank`` its inverse (every query's position) and ``query_of_rank`` is ``perm`` or, for
    the identity, ``rank``.
    """

    def __init__(self, tree: KVTree, ix: _TreeIndex) -> None:
        n = tree.n_nodes
        parents, sq = tree.parents, tree.subtree_queries
        # non-root nodes sorted by (parent, id)
        if ix.child_sorted is not None:
            self.child_sorted = ix.child_sorted
        elif ix.cp.size > 1 and np.count_nonzero(ix.cp[1:] < ix.cp[:-1]):
            self.child_sorted = stable_argsort(parents + 1, n + 1)[n - ix.children.size :]
        else:
            self.child_sorted = ix.children
        positions = _query_positions_native(tree, ix)
        if positions is not None:
            self.qlo, self.rank, self.perm = positions
        else:
            own = np.bincount(tree.query_nodes, minlength=n)
            qlo = np.empty(n, dtype=np.int64)
            r_sq = sq[ix.roots]
            qlo[ix.roots] = np.add.accumulate(r_sq) - r_sq
            for lo, hi in ix.level_bounds:
                ch, cp = ix.children[lo:hi], ix.cp[lo:hi]
                x = qlo[cp]
                x += own[cp]
                x += ix.excl_seg[lo:hi]
                qlo[ch] = x
            self.qlo = qlo
            key = qlo[tree.query_nodes]
            if key.size > 1 and np.count_nonzero(key[1:] < key[:-1]):
                self.perm: np.ndarray | None = stable_argsort(key, key.size)
                self.rank = inverse_permutation(self.perm)
            else:
                self.perm = None
                self.rank = np.arange(key.size, dtype=np.int64)
        self.qhi = self.qlo + sq
        # rank: the DFS rank of every query (queries of one node in id order);
        # query_of_rank: the query at each DFS rank (the inverse permutation)
        self.query_of_rank = self.rank if self.perm is None else self.perm
        # the arrays of the compiled group query lists and their addresses (built on first use)
        self.native: tuple | None = None


def _query_positions_native(
    tree: KVTree, ix: _TreeIndex, native: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """:class:`_GroupIndex`'s ``qlo``, ``rank`` and ``perm`` (None: the identity) by the compiled
    ``ft_query_positions``, the numpy path's values; None where it is not available or an array
    is not the int64 one it reads."""
    lib = planner_library() if native else None
    if lib is None:
        return None
    if not c_int64(tree.subtree_queries, tree.query_nodes, ix.roots, ix.children, ix.cp):
        return None
    n, nq = tree.n_nodes, tree.n_queries
    out = np.empty(n + 2 * nq, dtype=np.int64)  # qlo, rank, perm
    own = np.empty(n, dtype=np.int64)
    o = address(out)
    identity = lib.ft_query_positions(
        n, address(tree.subtree_queries), nq, address(tree.query_nodes), ix.roots.size, address(ix.roots),
        ix.children.size, address(ix.children), address(ix.cp), o, o + 8 * n, o + 8 * (n + nq), address(own),
    )  # fmt: skip
    if identity < 0:
        return None
    return out[:n], out[n : n + nq], None if identity else out[n + nq :]


#: Attribute of a planned tree that holds its cached :class:`_TreeIndex`.
_INDEX_ATTR = "_planner_index"


def _tree_index(tree: KVTree) -> _TreeIndex:
    ix = getattr(tree, _INDEX_ATTR, None)
    if ix is None:
        ix = _TreeIndex(tree)
        setattr(tree, _INDEX_ATTR, ix)
    return ix


def prepare(tree: KVTree) -> KVTree:
    """Build the index of ``tree`` that :func:`plan` caches on it, ahead of the first plan.

    :func:`plan` builds it on first use (edges by level and parent, DFS query ranges);
    building it here moves that cost out of the first plan, e.g. before trees are
    handed to worker processes, which then inherit it. Plans do not change.

    Returns
    -------
    KVTree
        ``tree``.
    """
    if not isinstance(tree, KVTree):
        raise ValueError(f"prepare() needs a KVTree, got {type(tree).__name__}")
    _tree_index(tree).groups(tree)
    return tree


def unprepared(tree: KVTree) -> KVTree:
    """A new tree object with ``tree``'s arrays and without the index :func:`plan` caches on
    a tree it planned: what a caller gets that builds a new tree every decode step (e.g. to
    time planning as a server pays it). Plans do not change.
    """
    if not isinstance(tree, KVTree):
        raise ValueError(f"unprepared() needs a KVTree, got {type(tree).__name__}")
    new = copy.copy(tree)
    new.__dict__.pop(_INDEX_ATTR, None)
    return new


# --------------------------------------------------------------------- greedy
class _EdgeCosts:
    """Per-cost constants of the greedy over a tree's edges (see :class:`_TreeIndex`).

    ``c_child`` and ``g_q`` are ``Cmm(q, len_child)`` and ``gamma * q`` per edge; ``pad_q``
    and ``ts_k`` are the query padding and KV tile of the counts in ``_TreeIndex.a``.
    Costs are float64 arrays of exact integers multiplied by the float weights, which is
    what PaddingCost.cmm computes.
    """

    def __init__(self, ix: _TreeIndex, cost: PaddingCost, vector: bool) -> None:
        (tq0, tq1), (tk0, tk1) = cost.q_tiles, cost.kv_tiles
        self.ag = cost.alpha * cost.group_size
        self.bg = cost.beta * cost.group_size
        self.tiles = (tq0, tq1, tk0, tk1)
        a, neg_a = (ix.a, ix.neg_a) if vector else (ix.a[4:], ix.neg_a[4:])
        pow2 = _pow2(tq0) and _pow2(tq1)
        it = a.dtype.type
        if tq0 == tq1:
            pad_q = neg_a & it(tq0 - 1) if pow2 else neg_a % it(tq0)
        elif pow2 and tq0 % tq1 == 0:
            # (-n) mod tq0, then mod tq1 (a divisor of tq0) where the small tile applies
            pad_q = neg_a & it(tq0 - 1)
            np.bitwise_and(pad_q, it(tq1 - 1), out=pad_q, where=a <= tq1)
        elif pow2:
            pad_q = neg_a & np.where(a > tq1, it(tq0 - 1), it(tq1 - 1))
        else:
            pad_q = neg_a % np.where(a > tq1, it(tq0), it(tq1))
        self.pad_q = pad_q.astype(np.float64)
        self.ts_k = float(tk0) if tk0 == tk1 else np.where(a > tq1, float(tk0), float(tk1))
        tk_q = self.ts_k if tk0 == tk1 else self.ts_k[-1]
        c_child = self.pad_q[-1] * ix.lnf
        c_child *= self.ag
        pad_k = tk_q - ix.lnf
        np.maximum(pad_k, 0.0, out=pad_k)
        pad_k *= ix.qf
        pad_k *= self.bg
        c_child += pad_k
        self.c_child = c_child
        self.g_q = cost.gamma * ix.qf


def _pow2(x: int) -> bool:
    return x & (x - 1) == 0


def greedy_edge_assignment(
    tree: KVTree, cost: PaddingCost, *, scalar_edges: int = SCALAR_EDGES, native: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy binary edge assignment of FastTree, correct for forests and internal queries.

    Parameters
    ----------
    tree : KVTree
    cost : PaddingCost
    scalar_edges : int
        Without the native core, levels with at most this many edges are decided by a scalar
        loop, the others by vectorised passes (a speed trade-off: the assignment is the same).
    native : bool
        Decide every edge in the compiled loop (:func:`fasttree.native.planner_library`) when it
        is available (the same assignment, bit for bit); False: the numpy paths.

    Returns
    -------
    assign : ndarray, int8 [n_nodes]
        1 when the edge from ``parents[i]`` into node ``i`` is concatenated; 0 for roots.
    group_queries : ndarray, int64 [n_nodes]
        Queries left in node ``i``'s group after its children took theirs.
    group_kv_len : ndarray, int64 [n_nodes]
        Tokens of node ``i``'s group: its own plus its ancestors' up the 1-chain.
    """
    ix = _tree_index(tree)
    n = tree.n_nodes
    assign = np.zeros(n, dtype=np.int8)
    n_cur = tree.subtree_queries.copy()
    eff_len = tree.lengths.copy()
    if not ix.level_bounds:
        return assign, n_cur, eff_len
    lib = planner_library() if native else None
    if lib is not None:
        assign, n_cur, eff_len, _ = _greedy_native(lib, tree, ix, cost)
        return assign, n_cur, eff_len
    threshold = scalar_edges
    if ix.max_level <= threshold:
        dec, group_len = _greedy_all_scalar(ix, cost)
    else:
        ec = _EdgeCosts(ix, cost, True)
        decided, group_lens = [], []
        eff = None  # group lengths of the level above, in its edge order
        for lvl in ix.levels:
            lv = lvl.lv0 if lvl.prel is None else eff[lvl.prel]
            if lvl.size <= threshold:
                dec, eff = _decide_level_scalar(ix, lvl, ec, lv)
            else:
                dec, eff = _decide_level_vector(ix, lvl, ec, cost, lv, scalar_edges)
            decided.append(dec)
            group_lens.append(eff)
        dec = np.concatenate(decided) if len(decided) > 1 else decided[0]
        group_len = np.concatenate(group_lens) if len(group_lens) > 1 else group_lens[0]
    assign[ix.child_index] = dec
    eff_len[ix.child_index] = group_len
    n_cur[ix.seg_par] -= np.add.reduceat(ix.q * dec, ix.seg_starts)
    return assign, n_cur, eff_len


def _greedy_groups(tree: KVTree, cost: PaddingCost) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Kept]:
    """:func:`greedy_edge_assignment` and the groups it keeps (:class:`_Kept`): in one compiled call
    (:func:`_greedy_native`) when it is available, the same arrays bit for bit."""
    lib = planner_library()
    ix = _tree_index(tree)
    if lib is None or not ix.level_bounds:
        assign, group_q, group_kv = greedy_edge_assignment(tree, cost)
        return assign, group_q, group_kv, _Kept.of(group_q, group_kv)
    return _greedy_native(lib, tree, ix, cost)


def _greedy_native(
    lib, tree: KVTree, ix: _TreeIndex, cost: PaddingCost
) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Kept]:
    """The greedy and its kept groups by ``ft_greedy_groups`` (which derives the per-edge inputs
    from the edges' children and parents): :func:`greedy_edge_assignment`'s arrays, as
    :func:`_greedy_all_scalar` decides the edges, and :class:`_Kept` of them. ``ix`` has edges."""
    if ix.native_groups is None:  # the edges' children and parents, subtree queries and lengths, once per tree
        arrays = tuple(
            np.ascontiguousarray(a, dtype=np.int64) for a in (ix.children, ix.cp, tree.subtree_queries, ix.lengths)
        )
        ix.native_groups = (arrays, tuple(address(a) for a in arrays))
    n, e = ix.n_nodes, ix.cp.size
    out = np.empty(5 * n + 1 + n + 3 * e, dtype=np.int64)  # group_q, group_kv, node, count, kv_len, kept; work
    fwork = np.empty(3 * e, dtype=np.float64)
    flags = np.empty(2 * n + e, dtype=np.int8)  # assign, keep, dec
    o, f = address(out), address(flags)
    (tq0, tq1), (tk0, tk1) = cost.q_tiles, cost.kv_tiles
    if lib.ft_greedy_groups(
        n, e, *ix.native_groups[1], cost.alpha * cost.group_size, cost.beta * cost.group_size, cost.gamma, tq0, tq1,
        tk0, tk1, o + 8 * (5 * n + 1), address(fwork), f + 2 * n, f, o, o + 8 * n, f + n, o + 16 * n, o + 24 * n,
        o + 32 * n, o + 40 * n,
    ):  # fmt: skip
        raise AssertionError("internal error: the tree index's edges are out of range")
    k = int(out[5 * n])
    kept = _Kept(flags[n : 2 * n].view(bool), out[2 * n : 2 * n + k], out[3 * n : 3 * n + k], out[4 * n : 4 * n + k])
    return flags[:n], out[:n], out[n : 2 * n], kept


class _ScalarCosts:
    """What :func:`_greedy_scalar` reads of :class:`_EdgeCosts` (the weights and tiles), for
    :func:`_greedy_all_scalar`, which computes the per-edge costs itself."""

    __slots__ = ("ag", "bg", "tiles")

    def __init__(self, cost: PaddingCost) -> None:
        self.ag = cost.alpha * cost.group_size
        self.bg = cost.beta * cost.group_size
        (tq0, tq1), (tk0, tk1) = cost.q_tiles, cost.kv_tiles
        self.tiles = (tq0, tq1, tk0, tk1)


def _greedy_all_scalar(ix: _TreeIndex, cost: PaddingCost) -> tuple[np.ndarray, np.ndarray]:
    """The greedy of a tree whose levels all go through the scalar loop, in lists from the first
    level to the last: the decisions (bool) and group lengths (float64) in edge order.

    ``Cmm(q, len_child)`` and ``gamma * q`` of every edge are computed here with the operations
    :class:`_EdgeCosts` applies to its arrays, in the same order on the same float64 values, so
    the costs and decisions are those of the other paths.
    """
    if ix.scalar_lists is None:
        ix.scalar_lists = (ix.cp.tolist(), ix.q.tolist(), ix.lnf.tolist(), ix.n_par.tolist())
    pars, qs, lns, n_pars = ix.scalar_lists
    ec = _ScalarCosts(cost)
    ag, bg = ec.ag, ec.bg
    tq0, tq1, tk0, tk1 = ec.tiles
    gamma = cost.gamma
    c_child, g_q = [], []
    for q, ln in zip(qs, lns, strict=True):
        big = q > tq1
        pad_k = (tk0 if big else tk1) - ln  # a float, as the float KV tile minus the length
        c = ((-q) % (tq0 if big else tq1)) * ln * ag
        c += (pad_k if pad_k > 0.0 else 0.0) * q * bg
        c_child.append(c)
        g_q.append(gamma * q)
    decided, group_len = [], []
    eff: list = []
    for lvl in ix.levels:
        if lvl.prev is None:
            lvl.prev = (lvl.lv0 if lvl.prel is None else lvl.prel).tolist()
        lv = lvl.prev if lvl.prel is None else [eff[i] for i in lvl.prev]
        sl = slice(lvl.lo, lvl.hi)
        dec, eff = _greedy_scalar(ec, pars[sl], qs[sl], lns[sl], n_pars[sl], lv, c_child[sl], g_q[sl])
        decided += dec
        group_len += eff
    return np.array(decided, dtype=bool), np.array(group_len, dtype=np.float64)


def _decide_level_scalar(ix: _TreeIndex, lvl: _Level, ec: _EdgeCosts, lv: np.ndarray):
    # The plain sequential greedy over the whole level.
    lo, hi = lvl.lo, lvl.hi
    if lvl.lists is None:
        sl = slice(lo, hi)
        lvl.lists = (ix.cp[sl].tolist(), ix.q[sl].tolist(), ix.lnf[sl].tolist(), ix.n_par[sl].tolist())
    pars, qs, lns, n_pars = lvl.lists
    dec, effs = _greedy_scalar(
        ec, pars, qs, lns, n_pars, lv.tolist(), ec.c_child[lo:hi].tolist(), ec.g_q[lo:hi].tolist()
    )
    return np.array(dec, dtype=bool), np.array(effs, dtype=np.float64)


def _greedy_scalar(ec: _EdgeCosts, pars, qs, lns, n_starts, lvs, ccs, gqs, ccats=None) -> tuple[list, list]:
    """The sequential greedy over edges given as lists, the edges of one parent consecutive.

    ``pars`` names each edge's parent, ``n_starts`` the parent's query count when its first
    listed edge is decided; ``qs``, ``lns``, ``lvs``, ``ccs``, ``gqs`` are the child's queries
    and length, the parent's group length, ``Cmm(q, len)`` and ``gamma * q`` per edge, and
    ``ccats`` (optional) ``Cmm(q, len + lv)``. Cmm(n, lv) of the parent's current count is
    carried from one child to the next; the arithmetic is that of PaddingCost.cmm_scalar.
    Returns the decisions and group lengths (the latter only without ``ccats``).
    """
    ag, bg = ec.ag, ec.bg
    tq0, tq1, tk0, tk1 = ec.tiles
    dec = []
    effs = []
    prev = None
    n = 0
    cn = 0.0
    pk0 = pk1 = 0
    # two copies of the loop on purpose: this is the planner's hottest Python, and a branch
    # per edge on ``ccats`` costs more than the repetition (keep their arithmetic identical)
    if ccats is not None:
        for p, q, n_p, lv_, cc, gq, ccat in zip(pars, qs, n_starts, lvs, ccs, gqs, ccats, strict=True):
            if p != prev:
                prev = p
                n = n_p
                pk0 = tk0 - lv_ if lv_ < tk0 else 0  # KV padding of the parent's group per tile
                pk1 = tk1 - lv_ if lv_ < tk1 else 0
                if n > tq1:
                    cn = ag * (((-n) % tq0) * lv_) + bg * (pk0 * n)
                else:
                    cn = ag * (((-n) % tq1) * lv_) + bg * (pk1 * n)
            m = n - q
            if m > tq1:
                cm = ag * (((-m) % tq0) * lv_) + bg * (pk0 * m)
            else:
                cm = ag * (((-m) % tq1) * lv_) + bg * (pk1 * m)
            if cn + cc + gq > cm + ccat:
                dec.append(True)
                n = m
                cn = cm
            else:
                dec.append(False)
        return dec, effs
    for p, q, ln, n_p, lv_, cc, gq in zip(pars, qs, lns, n_starts, lvs, ccs, gqs, strict=True):
        if p != prev:
            prev = p
            n = n_p
            pk0 = tk0 - lv_ if lv_ < tk0 else 0
            pk1 = tk1 - lv_ if lv_ < tk1 else 0
            if n > tq1:
                cn = ag * (((-n) % tq0) * lv_) + bg * (pk0 * n)
            else:
                cn = ag * (((-n) % tq1) * lv_) + bg * (pk1 * n)
        m = n - q
        if m > tq1:
            cm = ag * (((-m) % tq0) * lv_) + bg * (pk0 * m)
        else:
            cm = ag * (((-m) % tq1) * lv_) + bg * (pk1 * m)
        t = ln + lv_
        if q > tq1:
            ccat = ag * (((-q) % tq0) * t) + bg * ((tk0 - t if t < tk0 else 0) * q)
        else:
            ccat = ag * (((-q) % tq1) * t) + bg * ((tk1 - t if t < tk1 else 0) * q)
        if cn + cc + gq > cm + ccat:
            dec.append(True)
            effs.append(t)
            n = m
            cn = cm
        else:
            dec.append(False)
            effs.append(ln)
    return dec, effs


def _decide_level_vector(
    ix: _TreeIndex, lvl: _Level, ec: _EdgeCosts, cost: PaddingCost, lv: np.ndarray, scalar_edges: int
):
    # Every edge is evaluated under two hypotheses about its earlier siblings: all
    # concatenated (count n1) or none (count n_par). A parent whose first child is
    # concatenated follows the first, otherwise the second; the decisions stand up to
    # and including the first edge that breaks its hypothesis. When that covers every
    # edge the level is done; else the remaining edges go through the rounds of
    # _decide_rest_vector. Costs use exactly the expressions of PaddingCost.cmm.
    lo, hi = lvl.lo, lvl.hi
    kv = np.empty((5, lvl.size))
    kv[:4] = lv
    np.add(lvl.lnf, lv, out=kv[4])
    c = ec.pad_q[:, lo:hi] * kv
    c *= ec.ag
    pad_k = (ec.ts_k if isinstance(ec.ts_k, float) else ec.ts_k[:, lo:hi]) - kv
    np.maximum(pad_k, 0.0, out=pad_k)
    pad_k *= lvl.a
    pad_k *= ec.bg
    c += pad_k
    # split_kv = Cmm(n, lv) + Cmm(q, len) + gamma q ; split_q = Cmm(n - q, lv) + Cmm(q, len + lv)
    split_kv = c[:2] + ec.c_child[lo:hi]
    split_kv += ec.g_q[lo:hi]
    split_q = c[2:4] + c[4]
    ones = split_kv > split_q  # [2, E]: under n1, under n_par
    first = ones[0][lvl.sstart]  # the first child's decision, per edge
    use = np.where(first, ones[0], ones[1])
    brk = use != first
    brk &= lvl.not_last  # a break at a parent's last child decides nothing after it
    if not np.count_nonzero(brk):
        return use, np.where(use, kv[4], lvl.lnf)
    # decisions of the first pass stand up to and including each parent's first break
    before = np.add.accumulate(brk, dtype=np.int64)
    before -= brk
    resolved = before == before[lvl.sstart]
    n_rest = lvl.size - int(np.count_nonzero(resolved))
    if n_rest > scalar_edges * _SCALAR_REST_FACTOR:
        return _decide_rest_vector(ix, lvl, ec, cost, lv, c[4], use, resolved)
    # few edges left: the sequential greedy finishes every parent from its count there
    sl = slice(lo, hi)
    q = ix.q[sl]
    decided = use & resolved
    n_state = ix.n_par[sl].copy()  # indexed by the parent's first child
    seg_starts = (lvl.sstart == np.arange(lvl.size)).nonzero()[0]
    n_state[seg_starts] -= np.add.reduceat(q * decided, seg_starts)
    rem = (~resolved).nonzero()[0]
    p = lvl.sstart[rem]
    rem_lo = rem + lo
    dec, _ = _greedy_scalar(
        ec, p.tolist(), q[rem].tolist(), None, n_state[p].tolist(), lv[rem].tolist(),
        ec.c_child[rem_lo].tolist(), ec.g_q[rem_lo].tolist(), c[4][rem].tolist(),
    )  # fmt: skip
    decided[rem] = dec
    return decided, np.where(decided, kv[4], lvl.lnf)


def _decide_rest_vector(ix: _TreeIndex, lvl: _Level, ec: _EdgeCosts, cost: PaddingCost, lv, c_concat, use, resolved):
    # Children are sorted by parent. A round resolves, for every parent with undecided
    # children, a run of 1s (evaluated with the count dropping by each child taken),
    # the 0 that ends it, the 0s that follow under the now-fixed count, and the next 1;
    # the parent's later children wait for the next round. Each decision is evaluated
    # under exactly the count the sequential greedy would see.
    sl = slice(lvl.lo, lvl.hi)
    q = ix.q[sl]
    c_child, g_q = ec.c_child[sl], ec.g_q[sl]
    sstart = lvl.sstart
    decided = (use & resolved).astype(np.int8)  # resolved: the first pass's decisions that stand
    n_state = ix.n_par[sl].copy()  # indexed by the parent's first child
    seg_starts = (sstart == np.arange(lvl.size)).nonzero()[0]
    n_state[seg_starts] -= np.add.reduceat(np.where(decided == 1, q, 0), seg_starts)
    lv_int = lv.astype(np.int64)

    def concat(rem: np.ndarray, n: np.ndarray) -> np.ndarray:
        split_kv = cost.cmm(n, lv_int[rem]) + c_child[rem] + g_q[rem]
        split_q = cost.cmm(n - q[rem], lv_int[rem]) + c_concat[rem]
        return split_kv > split_q

    big = np.iinfo(np.int64).max
    rem = (~resolved).nonzero()[0]
    while rem.size:
        p = sstart[rem]
        qr = q[rem]
        seg_first = np.ones(rem.size, dtype=bool)
        seg_first[1:] = p[1:] != p[:-1]
        starts = seg_first.nonzero()[0]
        seg = np.add.accumulate(seg_first, dtype=np.int64) - 1
        incl = np.add.accumulate(qr)
        taken_before = incl - qr - (incl - qr)[starts][seg]
        n_if_ones = n_state[p] - taken_before
        ones = concat(rem, n_if_ones)
        pos = np.arange(rem.size)
        k0 = np.minimum.reduceat(np.where(ones, big, pos), starts)[seg]  # first 0 of the run of 1s
        decided[rem[pos < k0]] = 1
        seg_p = p[starts]
        all_ones = k0[starts] == big
        seg_end = np.append(starts[1:], rem.size) - 1
        n_state[seg_p[all_ones]] -= (incl[seg_end] - (incl - qr)[starts])[all_ones]
        # children after the 0 at k0 see the count fixed at its value there
        has_zero = k0 < big
        n_fixed = n_if_ones[np.minimum(k0, rem.size - 1)]
        after = has_zero & (pos > k0)
        later_ones = np.zeros(rem.size, dtype=bool)
        later_ones[after] = concat(rem[after], n_fixed[after])
        k1 = np.minimum.reduceat(np.where(later_ones, pos, big), starts)[seg]  # next 1
        hit = later_ones & (pos == k1)
        decided[rem[hit]] = 1
        stop_p = seg_p[~all_ones]
        n_state[stop_p] = n_fixed[starts][~all_ones]
        n_state[p[hit]] -= qr[hit]
        rem = rem[has_zero & (pos > k1) & (k1 < big)]
    return decided, lvl.lnf + decided * lv


# --------------------------------------------------------------------- groups
def build_groups(
    tree: KVTree,
    assign: np.ndarray,
    group_queries: np.ndarray,
    group_kv_len: np.ndarray,
    *,
    strided_fill_tokens: int = STRIDED_FILL_TOKENS,
) -> Groups:
    """Materialise the context-query groups of an edge assignment.

    Parameters
    ----------
    tree : KVTree
    assign : ndarray, int8 [n_nodes]
        Edge assignment from :func:`greedy_edge_assignment`.
    group_queries, group_kv_len : ndarray, int64 [n_nodes]
        Query counts and KV lengths per group from the same call; the counts are
        checked against the memberships found here, groups without tokens are dropped.
    strided_fill_tokens : int
        Chained groups' slots are filled by strided copies only where a copy averages this many
        tokens (a speed trade-off: the slots are the same).
    """
    return _build_groups(tree, assign, group_queries, group_kv_len, check=True, fill_tokens=strided_fill_tokens)


class _Kept:
    """The groups an edge assignment keeps (>= 1 query and >= 1 token), before their query
    lists and slots are built: enough to count their work units."""

    __slots__ = ("count", "keep", "kv_len", "node")

    def __init__(self, keep: np.ndarray, node: np.ndarray, count: np.ndarray, kv_len: np.ndarray) -> None:
        self.keep = keep  # bool [n_nodes]
        self.node = node  # the kept groups' nodes, ascending
        self.count = count  # queries per kept group
        self.kv_len = kv_len

    @classmethod
    def of(cls, group_queries: np.ndarray, group_kv_len: np.ndarray) -> _Kept:
        """The groups kept of the greedy's per-node query counts and KV lengths."""
        keep = (group_queries > 0) & (group_kv_len > 0)
        node = keep.nonzero()[0]
        return cls(keep, node, group_queries[node], group_kv_len[node])


#: The ``kv_slots`` of groups whose slots are built later (``_build_groups(defer_slots=True)``).
_NO_SLOTS = np.zeros(0, dtype=np.int32)
_NO_SLOTS.flags.writeable = False


def _build_groups(
    tree: KVTree,
    assign,
    group_queries,
    group_kv_len,
    *,
    check: bool,
    kept: _Kept | None = None,
    fill_tokens: int = STRIDED_FILL_TOKENS,
    native: bool = True,
    defer_slots: bool = False,
) -> Groups | tuple[Groups, Callable[[], np.ndarray | ChainedSlots]]:
    # ``defer_slots``: return the groups with an empty ``kv_slots`` and the function that builds
    # it (the multi-node chains' slot copies), for a caller that may not need them. Either way the
    # native path's slots are a ChainedSlots (the tree's slot array is not copied).
    # A query belongs to the group of its own node and to the parent of every 0-edge on
    # its path: node v's group holds the queries below v except those below a child of
    # v whose edge is not 0. In DFS order those are v's query range minus the ranges of
    # such children ("holes"), so every group's list is a few runs of DFS positions.
    # check=False trusts group_queries and assign (the greedy's own, as in plan()), and then
    # ``kept`` may hold what _Kept computes from them.
    gx = _tree_index(tree).groups(tree)
    cs = gx.child_sorted
    counts = group_queries
    if check:
        holes = cs[assign[cs] != 0]
        sq = tree.subtree_queries
        counts = sq - np.bincount(tree.parents[holes], weights=sq[holes], minlength=tree.n_nodes).astype(np.int64)
        if counts.shape != np.shape(group_queries) or np.count_nonzero(counts != group_queries):
            raise AssertionError("internal error: group membership disagrees with the greedy's query counts")
    if kept is None or check:
        kept = _Kept.of(counts, group_kv_len)
    keep, node, g_count = kept.keep, kept.node, kept.count
    lib = planner_library() if native else None
    if lib is not None:
        q_indptr, q_ids = _group_queries_native(lib, tree, gx, assign, node, g_count)
    else:
        q_indptr, q_ids = _group_queries_numpy(tree, gx, assign, keep, node, g_count)
    kv_start, fill = _chain_layout(
        tree, assign, node, roots_unmarked=not check, fill_tokens=fill_tokens, native=native, parts=True
    )
    identity = tree.slots.size if getattr(tree, "_slots_are_arange", False) else 0
    groups = Groups(
        node=node, kv_start=kv_start, kv_len=kept.kv_len, kv_slots=_NO_SLOTS if defer_slots else fill(),
        q_indptr=q_indptr, q_ids=q_ids, identity_slots=identity,
    )  # fmt: skip
    return (groups, fill) if defer_slots else groups


def _group_queries_numpy(
    tree: KVTree, gx: _GroupIndex, assign: np.ndarray, keep: np.ndarray, node: np.ndarray, g_count: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_build_groups`' ``q_indptr`` and query lists by numpy: each group's list is its DFS
    range minus its hole children's, as runs of positions."""
    cs = gx.child_sorted
    holes = cs[assign[cs] != 0]
    hole_par = tree.parents[holes]
    q_indptr = np.zeros(node.size + 1, dtype=np.int64)
    np.add.accumulate(g_count, out=q_indptr[1:])
    inner = keep[hole_par]
    holes, hole_par = holes[inner], hole_par[inner]
    if holes.size == 0:
        run_start, run_len = gx.qlo[node], g_count
    else:
        # runs of group g: qlo[g] .. first hole, between holes, last hole .. qhi[g]
        hg = node.searchsorted(hole_par)
        k = np.arange(holes.size)
        n_holes = np.bincount(hg, minlength=node.size)
        g_first = exclusive_sum(n_holes)
        g_first += np.arange(node.size)
        n_runs = node.size + holes.size
        run_start = np.empty(n_runs, dtype=np.int64)
        run_end = np.empty(n_runs, dtype=np.int64)
        run_start[g_first] = gx.qlo[node]
        run_end[g_first + n_holes] = gx.qhi[node]
        hk = hg + k
        run_end[hk] = gx.qlo[holes]
        run_start[hk + 1] = gx.qhi[holes]
        run_len = run_end - run_start
    q_pos = ragged_arange(run_start, run_len, int(q_indptr[-1]))
    if gx.perm is None:
        return q_indptr, q_pos
    # DFS order differs from id order: sort each group's queries by id
    gid = (np.arange(node.size, dtype=np.int64) * tree.n_queries).repeat(g_count)
    key = gx.perm[q_pos] + gid
    key.sort()
    return q_indptr, key - gid


def _group_queries_native(
    lib, tree: KVTree, gx: _GroupIndex, assign: np.ndarray, node: np.ndarray, g_count: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_build_groups`' ``q_indptr`` and query lists by ``ft_group_queries`` (which finds the
    hole children itself): int64 [n_groups + 1] and [sum of g_count]."""
    if gx.native is None:  # the tree's arrays the compiled loop reads, once per tree
        arrays = tuple(np.ascontiguousarray(a, dtype=np.int64) for a in (gx.child_sorted, tree.parents, gx.qlo, gx.qhi))
        perm = None if gx.perm is None else np.ascontiguousarray(gx.perm, dtype=np.int64)
        gx.native = (arrays, perm, (*(address(a) for a in arrays), None if perm is None else address(perm)))
    cs_at, parents_at, qlo_at, qhi_at, perm_at = gx.native[2]
    node = np.ascontiguousarray(node, dtype=np.int64)
    g_count = np.ascontiguousarray(g_count, dtype=np.int64)
    assign8 = np.ascontiguousarray(assign, dtype=np.int8)
    n_groups, n_ids = node.size, int(np.add.reduce(g_count))
    if g_count.size != n_groups or assign8.size != tree.n_nodes:
        raise AssertionError("internal error: group membership disagrees with the greedy's query counts")
    out = np.empty(n_groups + 1 + n_ids, dtype=np.int64)  # q_indptr, q_ids
    o = address(out)
    status = lib.ft_group_queries(
        n_groups, address(node), address(g_count), gx.native[0][0].size, cs_at, address(assign8), parents_at, qlo_at,
        qhi_at, perm_at, n_ids, o, o + 8 * (n_groups + 1),
    )  # fmt: skip
    if status == -2:
        raise MemoryError("no memory to sort the groups' query lists")
    if status:
        raise AssertionError("internal error: group membership disagrees with the greedy's query counts")
    return out[: n_groups + 1], out[n_groups + 1 :]


def _chain_layout(
    tree: KVTree,
    assign: np.ndarray,
    nodes: np.ndarray,
    *,
    roots_unmarked: bool = False,
    fill_tokens: int = STRIDED_FILL_TOKENS,
    native: bool = True,
    parts: bool = False,
) -> tuple[np.ndarray, Callable[[], np.ndarray | ChainedSlots]]:
    """KV of each group node's 1-chain (top of the chain first), in two steps.

    Returns ``(kv_start, fill)``: ``fill()`` returns ``kv_slots``, where a group that is a single
    node reads its run of the tree's own slot array and longer chains are concatenated after it.
    ``roots_unmarked`` promises that ``assign`` is 0 at every root (as the greedy's is), which
    skips a check. ``native``: the chains walked in the compiled loops when they are available
    (the same arrays), their slots copied only when ``fill`` is called; False: numpy, both at once.
    ``parts``: where the compiled loops copy chains, ``fill()`` returns them as a
    :class:`fasttree.groups.ChainedSlots` (the tree's slot array and the chains' slots, not
    joined) instead of one array.
    """
    lib = planner_library() if native else None
    if lib is not None:
        kv_start, fill = _chain_layout_native(lib, tree, assign, nodes)
        return kv_start, fill if parts else (lambda: np.asarray(fill()))
    parents = tree.parents
    kv_start = tree.slot_indptr[nodes]
    chained = (assign[nodes] == 1).nonzero()[0]
    n_chained = chained.size
    if n_chained == 0:
        slots = tree.slots
        return kv_start, lambda: slots
    # Walk every chain up from its group node: step s holds the s-th node above it (and
    # which chains it belongs to, None for all); a chain ends at its first node not
    # marked 1, or at a root.
    # (the greedy never marks a root: roots_unmarked says the assignment is its)
    roots_marked = not roots_unmarked and np.count_nonzero(assign[_tree_index(tree).roots] == 1)
    cur, ids = nodes[chained], None
    steps = [(cur, ids)]
    while True:
        up = parents[cur]
        if roots_marked:
            ok = up >= 0
            if np.count_nonzero(ok) < up.size:
                up, ids = up[ok], (np.arange(n_chained) if ids is None else ids)[ok]
        if up.size == 0:
            break
        steps.append((up, ids))
        more = assign[up] == 1
        n_more = np.count_nonzero(more)
        if n_more == 0:
            break
        if n_more < up.size:
            up, ids = up[more], (np.arange(n_chained) if ids is None else ids)[more]
        cur = up
    # [chain, position] tables of the chain nodes' slot runs, top of the chain first;
    # shorter chains are padded on the left with empty runs
    k = len(steps)
    run_start = np.zeros((n_chained, k), dtype=np.int64)
    run_len = np.zeros((n_chained, k), dtype=np.int64)
    for s, (nd, ids) in enumerate(steps):
        col = k - 1 - s
        if ids is None:
            run_start[:, col] = tree.slot_indptr[nd]
            run_len[:, col] = tree.lengths[nd]
        else:
            run_start[ids, col] = tree.slot_indptr[nd]
            run_len[ids, col] = tree.lengths[nd]
    chain_total = np.add.reduce(run_len, axis=1)
    chain_first = exclusive_sum(chain_total)
    n_slots = tree.slots.size
    kv_start[chained] = n_slots + chain_first
    total = int(chain_first[-1] + chain_total[-1])
    out = entry_array(n_slots + total)
    out[:n_slots] = tree.slots
    if total == 0:
        return kv_start, lambda: out
    tail = out[n_slots:]
    if _fill_strided(tail, tree.slots, run_start, run_len, chain_first, fill_tokens):
        return kv_start, lambda: out
    # every run as an arange of positions in the tree's slot array: position i of the tail
    # reads slot array entry i + (start - first) of its run
    flat_len = run_len.ravel()
    shift = exclusive_sum(flat_len)
    np.subtract(run_start.ravel(), shift, out=shift)
    if getattr(tree, "_slots_are_arange", False) and n_slots + total <= _INT32_MAX:
        # slot i of the tree is i: the positions are the slots themselves
        np.add(arange_view(total, np.int32), shift.astype(np.int32).repeat(flat_len), out=tail)
    else:
        idx = shift.repeat(flat_len)
        idx += arange_view(total)  # in place: a second index-sized temporary costs fresh pages
        np.take(tree.slots, idx, out=tail, mode="clip")  # idx is in range: "clip" only skips a buffer
    return kv_start, lambda: out


def _chain_layout_native(
    lib, tree: KVTree, assign: np.ndarray, nodes: np.ndarray
) -> tuple[np.ndarray, Callable[[], np.ndarray | ChainedSlots]]:
    """:func:`_chain_layout` by the compiled ``ft_chain_layout`` (the groups' KV starts and chains),
    and the function that copies the chains' slots by ``ft_chain_fill`` into a tail of their own
    (a :class:`fasttree.groups.ChainedSlots` with the tree's slot array; the array alone where
    no group chains nodes)."""
    ix = _tree_index(tree)
    if ix.native_tree is None:  # the tree's arrays as the compiled loops read them, once per tree
        arrays = (
            np.ascontiguousarray(tree.parents, dtype=np.int64), np.ascontiguousarray(tree.lengths, dtype=np.int64),
            np.ascontiguousarray(tree.slot_indptr, dtype=np.int64), np.ascontiguousarray(tree.slots, dtype=np.int32),
        )  # fmt: skip
        longest = int(tree.depth.max()) + 2  # nodes of the longest chain, at most
        ix.native_tree = (arrays, tuple(address(a) for a in arrays), longest)
    native_tree = ix.native_tree  # fill_tail holds it: the addresses it passes stay valid
    (parents, _, _, slots), (parents_at, lengths_at, indptr_at, _), longest = native_tree
    nodes = np.ascontiguousarray(nodes, dtype=np.int64)
    assign8 = np.ascontiguousarray(assign, dtype=np.int8)
    n, n_slots = nodes.size, slots.size
    if assign8.size != parents.size:
        raise AssertionError("internal error: the assignment is not the tree's")
    out = np.empty(3 * n + 3, dtype=np.int64)  # kv_start, heads, first, the three counts
    o, a8 = address(out), address(assign8)
    if lib.ft_chain_layout(
        n, address(nodes), parents.size, a8, parents_at, lengths_at, indptr_at, n_slots, o, o + 8 * n, o + 16 * n,
        o + 24 * n,
    ):  # fmt: skip
        raise AssertionError("internal error: a group's node is out of the tree")
    n_chains, n_chained, n_runs = out[-3:].tolist()
    kv_start = out[:n]
    if n_chains == 0:
        return kv_start, lambda: slots

    def fill_tail(tail: np.ndarray) -> None:
        if tail.size != n_chained or not c_int32(tail):
            raise ValueError(f"the chains' slots need an int32 C-contiguous array of {n_chained} entries")
        # called at the groups' first need of the chains' slots, maybe after the tree's index is gone:
        # fill_tail and tail_runs keep the tree's arrays (native_tree), assign8 and the heads and
        # their offsets (out) alive
        _, (parents_at, lengths_at, indptr_at, slots_at), _ = native_tree
        scratch = np.empty(longest, dtype=np.int64)  # per call: the loops run without the GIL
        at = address(out)
        lib.ft_chain_fill(
            n_chains, at + 8 * n, parents_at, address(assign8), indptr_at, lengths_at, slots_at, at + 16 * n,
            address(scratch), address(tail),
        )  # fmt: skip

    def tail_runs() -> np.ndarray:
        _, (parents_at, lengths_at, indptr_at, _), _ = native_tree
        runs = np.empty(2 * n_runs + 1 + longest, dtype=np.int64)  # src, off, then scratch
        at, r = address(out), address(runs)
        lib.ft_chain_runs(
            n_chains, at + 8 * n, parents_at, address(assign8), indptr_at, lengths_at, r + 8 * (2 * n_runs + 1), r,
            r + 8 * n_runs,
        )  # fmt: skip
        return runs[: 2 * n_runs + 1]

    return kv_start, lambda: ChainedSlots(slots, n_chained, fill_tail, tail_runs)


def _fill_strided(tail, slots, run_start, run_len, chain_first, fill_tokens: int) -> bool:
    """Copy the chains' slot runs into ``tail`` as strided views of ``slots``, if they are regular.

    Consecutive chains with the same run lengths form a [chains, tokens] block; one
    position of the chain (a column range of the block) is one strided copy when its run
    starts repeat in equal groups whose values step by a constant ``d >= 0`` (chains that
    share an ancestor, siblings laid out evenly). Returns False, writing nothing, when
    the runs are irregular or the copies would be too short to pay.
    """
    n_chains, k = run_len.shape
    row_changes = None if n_chains == 1 else run_len[1:] != run_len[:-1]
    if row_changes is None or not np.count_nonzero(row_changes):
        bounds = [0, n_chains]
    elif 2 * k * fill_tokens > tail.size:
        return False  # two blocks or more: already too many copies for the tokens
    else:
        bounds = [0, *(row_changes.any(axis=1).nonzero()[0] + 1).tolist(), n_chains]
    if (len(bounds) - 1) * k * fill_tokens > tail.size:
        return False
    copies = []
    for b0, b1 in itertools.pairwise(bounds):
        nb = b1 - b0
        lens = run_len[b0].tolist()
        width = sum(lens)
        first = int(chain_first[b0])
        block = tail[first : first + nb * width].reshape(nb, width)
        off = 0
        for col, ln in enumerate(lens):
            if not ln:
                continue
            st = run_start[b0:b1, col]
            rep, step = nb, 0
            if nb > 1:
                # starts s0 + (i // rep) * step: the differences are step at every rep-th place, else 0
                dif = st[1:] - st[:-1]
                moves = dif.nonzero()[0]
                if moves.size:
                    rep, step = int(moves[0]) + 1, int(dif[moves[0]])
                    if nb % rep or step < 0 or moves.size != nb // rep - 1:
                        return False
                    if np.count_nonzero(dif[rep - 1 :: rep] != step):
                        return False
            copies.append((block, nb // rep, rep, off, ln, int(st[0]), step))
            off += ln
    item = slots.itemsize
    for block, groups, r, off, ln, s, d in copies:
        src = np.ndarray((groups, 1, ln), slots.dtype, buffer=slots, offset=s * item, strides=(d * item, 0, item))
        block.reshape(groups, r, block.shape[1])[:, :, off : off + ln] = src
    return True


# ----------------------------------------------------------------------- plan
def plan(
    tree: KVTree,
    config: FastTreeConfig | Portfolio | None = None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rules: PlanRules | None = None,
) -> Plan:
    """Plan tree attention for one tree on the host.

    The adaptive passes follow the published planner, with one change: groups longer than
    the big split size ``kv_split_sizes[0]`` are cut at it only in a phase that would,
    uncut, have too few units x KV heads to fill the GPU (``rules.whole_groups_min_items``).
    Then a phase whose units x KV heads are fewer than ``para_threshs1`` (and more than
    zero) switches to the small split size; only if a split changed, the units are
    recounted, and when the large phase has fewer than ``para_threshs2[0]`` (or else the
    small one fewer than ``para_threshs2[1]``) every group moves to the small (large) tiles
    and the greedy runs again with them.

    Parameters
    ----------
    tree : KVTree
    config : FastTreeConfig or Portfolio, optional
        Defaults to ``FastTreeConfig()``; a tuned portfolio (:func:`fasttree.load_portfolio`) plans
        the tree with the member its selector picks for it at these head counts.
    num_q_heads, num_kv_heads : int
        ``Hq`` and ``Hkv``; ``Hq`` must be a multiple of ``Hkv``.
    head_dim : int
        ``D``, in [16, 256].
    rules : PlanRules, optional
        The planning rules beyond the config; :meth:`PlanRules.defaults` when None (the
        runtime plans with :meth:`PlanRules.runtime`).

    Returns
    -------
    Plan
        Flat int32 arrays for the kernels plus the decisions that produced them.
    """
    if not isinstance(tree, KVTree):
        raise ValueError(f"plan() needs a KVTree, got {type(tree).__name__}")
    config = _DEFAULT_CONFIG if config is None else config
    if isinstance(config, Portfolio):  # a leaf's member only at this plan's head layout, inside its region
        config = config.select(tree, head_layout(num_q_heads, num_kv_heads))
    if not isinstance(config, FastTreeConfig):
        raise ValueError(f"config must be a FastTreeConfig or a Portfolio, got {type(config).__name__}")
    rules = PlanRules.defaults() if rules is None else rules
    if not isinstance(rules, PlanRules):
        raise ValueError(f"rules must be a PlanRules, got {type(rules).__name__}")
    g = check_heads(num_q_heads, num_kv_heads, head_dim)
    q_tiles = config.query_tiles(g)
    heads = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    margin, exponent = rules.crossover_margin, rules.crossover_row_exponent
    limit = margin * _decode_weighted_reads(tree, g, exponent) if margin and g >= _MIN_BLOCK_M else None
    planned = _tree_plan(tree, config, rules, g, q_tiles, max_weighted_reads=limit, **heads)
    if planned is None:  # the crossover test: the tree plan costs more than margin x decode's
        return plan_query_separated(tree, **heads, rules=rules)
    if rules.crossover_wave_programs:
        decode = decode_shorter_in_one_wave(tree, planned, rules.crossover_wave_programs)
        if decode is not None:
            return decode
    return planned


def longest_program_tiles(plan: Plan) -> int:
    """KV tiles of ``plan``'s longest program: its longest unit over the KV tile its tile class's
    launch runs (:func:`fasttree.launch_rules.launch_kv_tile`, on the planner's GPU of
    :data:`fasttree.query_separated.PLANNED_SMS` SMs, so that plans do not depend on the device)."""
    ptr, g, most = plan.class_unit_ptr, plan.group_size, 0
    for c, tc in enumerate(plan.tile_classes):
        lengths = plan.unit_kv_len[ptr[c] : ptr[c + 1]]
        if lengths.size:
            items = lengths.size * plan.num_kv_heads
            tile = launch_kv_tile(g, plan.head_dim, tc, lengths, items, PLANNED_SMS, plan.rules.wide_head_kv_tile)
            most = max(most, -(-int(lengths.max()) // tile))
    return most


def decode_shorter_in_one_wave(tree: KVTree, planned: Plan, programs: int) -> Plan | None:
    """Decode's plan of ``tree`` where ``planned`` (its tree plan) and decode's plan each have at
    most ``programs`` programs (units x KV heads) and decode's longest program reads fewer KV tiles
    than the tree plan's, which reads two or more (:func:`longest_program_tiles`), unless decode
    merges partial results and the tree plan does not (a one-unit tree plan: decode's merge launch
    costs more than its shorter programs save); and (:attr:`PlanRules.crossover_merge_free_decode`)
    wherever decode merges nothing and the tree plan merges; else None.

    Within about one wave a step lasts about as long as its longest program: a small tree plan
    whose few programs each chain two or three KV tiles (and merge partial results) runs slower
    than decode's one-tile chunks, though it reads fewer tokens (:attr:`PlanRules.crossover_wave_programs`).
    """
    kv_heads = planned.num_kv_heads
    if planned.n_units * kv_heads > programs:
        return None
    tiles = longest_program_tiles(planned)
    spare_merge = planned.rules.crossover_merge_free_decode and planned.n_partial_rows > 0
    if tiles < 2 and not spare_merge:
        return None
    decode = plan_query_separated(
        tree, num_q_heads=planned.num_q_heads, num_kv_heads=kv_heads, head_dim=planned.head_dim, rules=planned.rules
    )
    if decode.n_units * kv_heads > programs:
        return None
    if spare_merge and not decode.n_partial_rows:  # decode spares the tree plan's merge launch
        return decode
    if tiles < 2 or longest_program_tiles(decode) >= tiles:
        return None
    if decode.n_partial_rows and not planned.n_partial_rows:  # decode would add the merge launch
        return None
    return decode


def _tree_plan(
    tree: KVTree,
    config: FastTreeConfig,
    rules: PlanRules,
    g: int,
    q_tiles: tuple[int, int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_weighted_reads: float | None = None,
) -> Plan | None:
    """The tree plan of :func:`plan` with queries per tile ``q_tiles`` (large, small class):
    the greedy, the adaptive passes, the groups and the plan's arrays; None where its weighted KV
    reads exceed ``max_weighted_reads`` (:func:`fasttree.plan_arrays.materialize`)."""

    def run_greedy(mode: str):
        tq, tk = mode_tiles(mode, q_tiles, config.kv_tile)
        cost = PaddingCost(config.alpha, config.beta, config.gamma, g, tq, tk)
        return (cost, *_greedy_groups(tree, cost))

    # the groups' query lists and slots are built once the tile mode is settled: the
    # adaptive passes only count units
    cost, assign, group_q, group_kv, kept = run_greedy(TWO_CLASSES)
    units_for = _PhaseUnits(kept.count, kept.kv_len, cost.q_tiles, num_kv_heads)
    splits, mode, small_split = _adaptive_splits(units_for, config, rules, head_dim, tree.n_queries)
    if mode != TWO_CLASSES:
        cost, assign, group_q, group_kv, kept = run_greedy(mode)
        units_for = None
    # with a crossover test, the chains' slots are copied once the plan is kept (materialize may
    # send it to decode first)
    fill_slots = None
    if max_weighted_reads is None:
        groups = _build_groups(tree, assign, group_q, group_kv, check=False, kept=kept)
    else:
        groups, fill_slots = _build_groups(tree, assign, group_q, group_kv, check=False, kept=kept, defer_slots=True)
    if splits[0] == splits[1]:
        group_split = splits[0]
    else:  # phase 1: groups of at most q_tiles[1] queries
        small_groups = units_for.small if units_for is not None else kept.count <= cost.q_tiles[1]
        group_split = np.where(small_groups, splits[1], splits[0])
    gx = _tree_index(tree).groups(tree)
    return materialize(
        groups,
        q_tiles=cost.q_tiles,
        kv_tiles=cost.kv_tiles,
        group_split=group_split,
        splits=(splits[0], splits[1]),
        config=config,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        n_queries=tree.n_queries,
        max_slot=tree.max_slot,
        tile_mode=mode,
        edge_assignment=assign,
        query_rank=gx.rank,
        query_of_rank=gx.query_of_rank,
        rules=rules,
        max_weighted_reads=max_weighted_reads,
        fill_slots=fill_slots,
        small_split=small_split,
    )


def _decode_weighted_reads(tree: KVTree, g: int, exponent: float) -> float:
    """The crossover test's cost of plain split-KV decode of ``tree``
    (:func:`fasttree.plan_query_separated`): :func:`plan` returns decode's plan where the tree
    plan's cost exceeds ``PlanRules.crossover_margin`` times this.

    A plan's cost is the KV tokens its units read, each weighted by ``(block_m / 16) ** exponent``
    for its tile's rows (:func:`fasttree.plan_arrays.tile_read_weight`,
    :attr:`PlanRules.crossover_row_exponent`). Decode reads every query's context (the sum over
    nodes of tokens x queries below) in tiles of ``max(16, g)`` rows. :func:`plan` applies the
    test only from ``g = 16``, where decode's tile has no idle rows, and decides it once the tree
    plan's units and bins are laid out, before its arrays are built.

    Measured on the H200 at exponent 0.5 (``docs/history.md``, crossover): on the crossover,
    families and paper suites every paper tree and batch without sharing costs at most 1.01 times decode's, and the
    forests with internal queries at GQA 16 that lost to decode (0.84-0.97x) cost 1.05-1.26
    times; on 46 held-out trees, of the 27 at GQA 16 the test sent to decode 24 ran 1.01-1.44x
    faster there and 3 lost 1-2.5%; at GQA 7 it would have lost on all 5 it picked (0.80-0.94x).
    """
    decode_rows = tile_rows(1, g)  # the rows of decode's one-query tile
    return float(np.dot(tree.lengths, tree.subtree_queries)) * tile_read_weight(decode_rows, exponent)


def _adaptive_splits(
    units_for: _PhaseUnits, config: FastTreeConfig, rules: PlanRules, head_dim: int, n_queries: int
) -> tuple[list[int], str, int]:
    """The split size of each phase, the tile mode and the small split size (what a phase with
    too few units takes), from the two-class greedy's groups.

    Groups longer than the big split size are cut at it only where their phase needs the
    parallelism: enough units x KV heads uncut (``rules.whole_groups_min_items`` times
    ``para_threshs1``), and no group much longer than the phase's work spread over
    ``para_threshs1`` programs (one long group would be the launch's tail). Then a phase with
    fewer units x KV heads than ``para_threshs1`` takes the small split size (above head dim
    128 at most ``rules.wide_head_small_split``, :func:`fasttree.plan_rules.capped_small_split`, where
    the plan's units x KV heads at the config's splits are at most
    ``rules.wide_head_small_split_programs`` and the plan merges partial results there already: a
    query of ``n_queries`` reads two groups, or a group is cut; a cap that cuts a plan with no
    merge adds the merge launch, about 2 us of a 7 us plan on an H100); only if a split
    changed, the units are recounted and too few in the large (small) phase move every group to
    the small (large) tiles; to the large ones only where the large phase has units, unless
    ``rules.all_large_without_large`` (else all-small).
    """
    big, small = config.kv_split_sizes
    capped = capped_small_split(head_dim, small, rules)
    splits = [big, big]
    if rules.whole_groups and units_for.longest > big:
        whole = units_for.longest
        uncut = units_for([whole, whole])
        for c, (tokens, longest) in enumerate(units_for.uncut_work()):
            thresh = config.para_threshs1[c]
            if (
                uncut[c] >= thresh * rules.whole_groups_min_items[c]
                and longest * thresh <= rules.whole_groups_max_tail * tokens
            ):
                splits[c] = whole
    units = units_for(splits)
    changed = [c for c in (0, 1) if 0 < units[c] < config.para_threshs1[c]]
    for c in changed:
        splits[c] = small
    if changed and capped != small:
        if sum(units_for(splits)) > rules.wide_head_small_split_programs or not units_for.merges(splits, n_queries):
            capped = small  # enough programs at the config's split, or no merge there: it keeps the split
        for c in changed:
            splits[c] = capped
    mode = TWO_CLASSES
    if changed:
        units = units_for(splits)
        if 0 < units[0] < config.para_threshs2[0]:
            mode = ALL_SMALL
        elif 0 < units[1] < config.para_threshs2[1]:
            mode = ALL_LARGE if units[0] or rules.all_large_without_large else ALL_SMALL
    return splits, mode, capped


class _PhaseUnits:
    """Work units x KV heads per group phase, as a function of the split sizes.

    Built from the groups' query counts and KV lengths; calling it with ``splits`` (KV
    tokens per unit of phase 0 and 1) returns ``[units of phase 0, units of phase 1]``, each
    times ``num_kv_heads``. ``small`` holds whether each group is in phase 1 (at most
    ``q_tiles[1]`` queries).
    """

    def __init__(self, nq: np.ndarray, kv_len: np.ndarray, q_tiles: tuple[int, int], num_kv_heads: int) -> None:
        # Every group has >= 1 query and q_tiles[1] <= q_tiles[0], so a phase-1 group (at most
        # q_tiles[1] queries) is one query tile under either tile size.
        self.nq = nq
        self.small = nq <= q_tiles[1]
        self.n_small = int(np.count_nonzero(self.small))
        self.kv_len = kv_len
        self.longest = int(np.maximum.reduce(kv_len))
        tq = q_tiles[0]
        self.q_tiles = None if int(np.maximum.reduce(nq)) <= tq else (nq + (tq - 1)) // tq  # nq >= 1
        self.n_groups = nq.size
        self.num_kv_heads = num_kv_heads
        # the phase that holds every group (0 or 1), None when both hold some
        self.one_phase = 1 if self.n_small == self.n_groups else 0 if not self.n_small else None

    def _group_split(self, splits) -> int | np.ndarray:
        """The split size of every group at ``splits``: one int where every group takes the same
        (equal splits, or one phase holding every group), else per group."""
        if splits[0] == splits[1]:
            return splits[0]
        if self.one_phase is not None:
            return splits[self.one_phase]
        return np.where(self.small, splits[1], splits[0])

    def __call__(self, splits) -> list[int]:
        kv_len, small, one = self.kv_len, self.small, self.one_phase
        split = self._group_split(splits)
        if isinstance(split, int):
            chunks = 1 if self.longest <= split else -(-kv_len // split)
        else:
            chunks = -(-kv_len // split)
        units = chunks if self.q_tiles is None else chunks * self.q_tiles
        if isinstance(units, int):
            total, in_small = self.n_groups, self.n_small
        else:
            total = int(np.add.reduce(units))
            in_small = total if one == 1 else 0 if one == 0 else int(np.add.reduce(units[small]))
        h = self.num_kv_heads
        return [(total - in_small) * h, in_small * h]

    def merges(self, splits, n_queries: int) -> bool:
        """Whether a plan at ``splits`` merges partial results: one of the tree's ``n_queries``
        queries is in two groups (the groups hold more queries than the tree), or a group is
        longer than its phase's split (cut into chunks)."""
        if int(np.add.reduce(self.nq)) > n_queries:
            return True
        split = self._group_split(splits)
        if isinstance(split, int):
            return self.longest > split
        return bool(np.any(self.kv_len > split))

    def uncut_work(self) -> list[tuple[int, int]]:
        """Per phase, uncut: ``(KV tokens over all units x KV heads, the longest group's KV)``."""
        tokens = self.kv_len if self.q_tiles is None else self.kv_len * self.q_tiles
        if self.one_phase is not None:  # the other phase is empty
            work = (int(np.add.reduce(tokens, dtype=np.int64)) * self.num_kv_heads, self.longest)
            return [(0, 0), work] if self.one_phase else [work, (0, 0)]
        out = []
        for in_phase in (~self.small, self.small):
            total = int(np.add.reduce(tokens[in_phase], dtype=np.int64)) * self.num_kv_heads
            out.append((total, int(np.maximum.reduce(self.kv_len[in_phase]))))
        return out
