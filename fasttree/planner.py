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
scalar loop (few edges) or by vectorised rounds in which every parent jumps to its
next concatenated child -- both compute exactly the same floating-point costs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .config import FastTreeConfig
from .costs import ALL_LARGE, ALL_SMALL, TWO_CLASSES, PaddingCost, mode_tiles
from .plan_arrays import Plan, check_heads, materialize
from .tree import KVTree

_DEFAULT_CONFIG = FastTreeConfig()

#: Levels with at most this many edges are decided by the scalar loop.
_SCALAR_EDGES = 64


@dataclass(frozen=True)
class Groups:
    """Context-query groups of a plan, in increasing node order.

    Attributes
    ----------
    node : ndarray, int64 [n_groups]
        The tree node that names the group (the bottom of its KV chain).
    kv_start, kv_len : ndarray, int64 [n_groups]
        Group ``i`` reads pool slots ``kv_slots[kv_start[i]:kv_start[i] + kv_len[i]]``
        (``kv_len >= 1``).
    kv_slots : ndarray, int32 [n_kv_entries]
        Backing slot list: the tree's own slot array (single-node groups point into it),
        followed by the concatenated slots of multi-node groups.
    q_indptr : ndarray, int64 [n_groups + 1]
    q_ids : ndarray, int64 [total group queries]
        Group ``i`` serves queries ``q_ids[q_indptr[i]:q_indptr[i + 1]]`` (ascending).
    """

    node: np.ndarray
    kv_start: np.ndarray
    kv_len: np.ndarray
    kv_slots: np.ndarray
    q_indptr: np.ndarray
    q_ids: np.ndarray

    @property
    def n_groups(self) -> int:
        return int(self.node.size)

    @property
    def n_queries(self) -> np.ndarray:
        return np.diff(self.q_indptr)


# ---------------------------------------------------------------- tree index
class _TreeIndex:
    """Structure of one tree that every plan of it shares; built once, cached on the tree.

    Non-root nodes are kept in *edge order*: by depth, then parent, then id. A level
    ``d >= 1`` is the slice ``bounds[d - 1]`` of every per-edge array, and the children of
    one parent (a *segment*) are contiguous, in id order.
    """

    def __init__(self, tree: KVTree) -> None:
        n = tree.n_nodes
        parents, sq = tree.parents, tree.subtree_queries
        lp = tree.level_ptr.tolist()
        ch = tree.level_order[lp[1] :] if len(lp) > 2 else tree.level_order[:0]
        cp = parents[ch]
        if ch.size > 1:
            key = tree.depth[ch] * n + cp
            if (key[1:] < key[:-1]).any():
                o = np.argsort(key, kind="stable")
                ch, cp = ch[o], cp[o]
        e = ch.size
        self.children = ch
        self.cp = cp
        self.bounds = [(lo - lp[1], hi - lp[1]) for lo, hi in itertools.pairwise(lp[1:])]
        q = sq[ch]
        self.q = q
        self.ln = tree.lengths[ch]
        new_seg = np.ones(e, dtype=bool)
        np.not_equal(cp[1:], cp[:-1], out=new_seg[1:])
        starts = np.flatnonzero(new_seg)
        seg = np.cumsum(new_seg) - 1
        self.sstart = starts[seg]  # segment start of every edge
        incl = np.cumsum(q)
        excl = incl - q
        excl_seg = excl - excl[self.sstart]  # queries of earlier siblings
        n_par = sq[cp]
        ends = np.empty_like(starts)
        ends[:-1] = starts[1:] - 1
        ends[-1:] = e - 1
        seg_total = (incl[ends] - excl[starts])[seg]
        self.n_par = n_par
        self.n_par_after = n_par - seg_total  # parent count when every child is concatenated
        self.excl_seg = excl_seg
        # Query counts at which the vectorised greedy evaluates Cmm: a run of 1s before
        # the edge (n1) or only 0s (n_par), each before and after taking the child, and q.
        a = np.empty((5, e), dtype=np.int64)
        np.subtract(n_par, excl_seg, out=a[0])
        a[1] = n_par
        np.subtract(a[0], q, out=a[2])
        np.subtract(n_par, q, out=a[3])
        a[4] = q
        self.a = a
        self._lists: dict[int, tuple[list, list, list, list, list]] = {}
        self._groups: _GroupIndex | None = None

    def lists(self, lo: int, hi: int) -> tuple[list, list, list, list, list]:
        """Python lists (children, parents, q, lengths, parent counts) of one level."""
        got = self._lists.get(lo)
        if got is None:
            sl = slice(lo, hi)
            got = (
                self.children[sl].tolist(),
                self.cp[sl].tolist(),
                self.q[sl].tolist(),
                self.ln[sl].tolist(),
                self.n_par[sl].tolist(),
            )
            self._lists[lo] = got
        return got

    def groups(self, tree: KVTree) -> _GroupIndex:
        if self._groups is None:
            self._groups = _GroupIndex(tree, self)
        return self._groups


class _GroupIndex:
    """Query ranges of the tree in DFS order (own queries first, then children in id order).

    ``qlo[v]:qlo[v] + subtree_queries[v]`` are the DFS positions of the queries at or below
    ``v``; ``perm[pos]`` is the query at a position (``None`` when that is the identity).
    """

    def __init__(self, tree: KVTree, ix: _TreeIndex) -> None:
        n = tree.n_nodes
        parents, sq = tree.parents, tree.subtree_queries
        # non-root nodes sorted by (parent, id)
        if ix.cp.size > 1 and (ix.cp[1:] < ix.cp[:-1]).any():
            cs = np.argsort(parents, kind="stable")
            self.child_sorted = cs[n - ix.children.size :]
        else:
            self.child_sorted = ix.children
        own = np.bincount(tree.query_nodes, minlength=n)
        qlo = np.zeros(n, dtype=np.int64)
        roots = tree.level_order[: tree.level_ptr[1]]
        r_sq = sq[roots]
        qlo[roots] = np.cumsum(r_sq) - r_sq
        for lo, hi in ix.bounds:
            ch, cp = ix.children[lo:hi], ix.cp[lo:hi]
            qlo[ch] = qlo[cp] + own[cp] + ix.excl_seg[lo:hi]
        self.qlo = qlo
        self.qhi = qlo + sq
        key = qlo[tree.query_nodes]
        if key.size > 1 and (key[1:] < key[:-1]).any():
            self.perm: np.ndarray | None = np.argsort(key, kind="stable")
        else:
            self.perm = None


def _tree_index(tree: KVTree) -> _TreeIndex:
    ix = getattr(tree, "_planner_index", None)
    if ix is None:
        ix = _TreeIndex(tree)
        tree._planner_index = ix
    return ix


# --------------------------------------------------------------------- greedy
class _EdgeCosts:
    """Per-cost constants of the greedy over a tree's edges (see :class:`_TreeIndex`).

    ``c_child`` and ``g_q`` are ``Cmm(q, len_child)`` and ``gamma * q`` per edge; ``pad_q``
    and ``ts_k`` are the query padding and KV tile of the counts in ``_TreeIndex.a``.
    """

    def __init__(self, ix: _TreeIndex, cost: PaddingCost, vector: bool) -> None:
        (tq0, tq1), (tk0, tk1) = cost.q_tiles, cost.kv_tiles
        self.ag = cost.alpha * cost.group_size
        self.bg = cost.beta * cost.group_size
        self.gamma = cost.gamma
        self.tiles = (tq0, tq1, tk0, tk1)
        a = ix.a if vector else ix.a[4:]
        pow2 = _pow2(tq0) and _pow2(tq1)
        if tq0 == tq1:
            pad_q = (-a) & (tq0 - 1) if pow2 else (-a) % tq0
        else:
            large = a > tq1
            tsq = np.where(large, tq0, tq1)
            pad_q = (-a) & (tsq - 1) if pow2 else (-a) % tsq
        if tk0 == tk1:
            ts_k = np.full(a.shape, tk0, dtype=np.int64)
        else:
            ts_k = np.where(a > tq1, tk0, tk1)
        self.pad_q = pad_q
        self.ts_k = ts_k
        q, ln = ix.q, ix.ln
        pk = ts_k[-1] - ln
        np.maximum(pk, 0, out=pk)
        pk *= q
        c_child = self.ag * (pad_q[-1] * ln)
        c_child += self.bg * pk
        self.c_child = c_child
        self.g_q = self.gamma * q


def _pow2(x: int) -> bool:
    return x & (x - 1) == 0


def greedy_edge_assignment(tree: KVTree, cost: PaddingCost) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy binary edge assignment of FastTree, correct for forests and internal queries.

    Parameters
    ----------
    tree : KVTree
    cost : PaddingCost

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
    assign = np.zeros(tree.n_nodes, dtype=np.int8)
    n_cur = tree.subtree_queries.copy()
    eff_len = tree.lengths.copy()
    threshold = _SCALAR_EDGES
    vector = any(hi - lo > threshold for lo, hi in ix.bounds)
    ec = _EdgeCosts(ix, cost, vector)
    for lo, hi in ix.bounds:
        if hi - lo <= threshold:
            _decide_level_scalar(ix, lo, hi, ec, n_cur, eff_len, assign)
        else:
            _decide_level_vector(ix, lo, hi, ec, cost, n_cur, eff_len, assign)
    return assign, n_cur, eff_len


def _decide_level_scalar(ix: _TreeIndex, lo: int, hi: int, ec: _EdgeCosts, n_cur, eff_len, assign) -> None:
    # The plain sequential greedy; Cmm(n, lv) of the parent's current count is carried
    # from one child to the next. Same arithmetic as PaddingCost.cmm_scalar.
    ag, bg = ec.ag, ec.bg
    tq0, tq1, tk0, tk1 = ec.tiles
    children, pars, qs, lns, n_pars = ix.lists(lo, hi)
    lvs = eff_len[ix.cp[lo:hi]].tolist()
    ccs = ec.c_child[lo:hi].tolist()
    gqs = ec.g_q[lo:hi].tolist()
    ones = []
    effs = []
    seg_p = []
    seg_n = []
    prev = -1
    n = cn = 0
    for c, p, q, ln, n_p, lv, cc, gq in zip(children, pars, qs, lns, n_pars, lvs, ccs, gqs, strict=True):
        if p != prev:
            if prev >= 0:
                seg_p.append(prev)
                seg_n.append(n)
            prev = p
            n = n_p
            if n > tq1:
                cn = ag * (((-n) % tq0) * lv) + bg * ((tk0 - lv if lv < tk0 else 0) * n)
            else:
                cn = ag * (((-n) % tq1) * lv) + bg * ((tk1 - lv if lv < tk1 else 0) * n)
        m = n - q
        if m > tq1:
            cm = ag * (((-m) % tq0) * lv) + bg * ((tk0 - lv if lv < tk0 else 0) * m)
        else:
            cm = ag * (((-m) % tq1) * lv) + bg * ((tk1 - lv if lv < tk1 else 0) * m)
        t = ln + lv
        if q > tq1:
            ccat = ag * (((-q) % tq0) * t) + bg * ((tk0 - t if t < tk0 else 0) * q)
        else:
            ccat = ag * (((-q) % tq1) * t) + bg * ((tk1 - t if t < tk1 else 0) * q)
        if cn + cc + gq > cm + ccat:
            ones.append(c)
            effs.append(t)
            n = m
            cn = cm
        else:
            effs.append(ln)
    seg_p.append(prev)
    seg_n.append(n)
    if ones:
        assign[ones] = 1
    eff_len[ix.children[lo:hi]] = effs
    n_cur[seg_p] = seg_n


def _decide_level_vector(ix: _TreeIndex, lo: int, hi: int, ec: _EdgeCosts, cost: PaddingCost, n_cur, eff_len, assign):
    # Every edge is evaluated under two hypotheses about its earlier siblings: all
    # concatenated (count n1) or none (count n_par). A parent whose first child is
    # concatenated follows the first, otherwise the second; the decisions stand up to
    # and including the first edge that breaks its hypothesis. When no edge breaks, the
    # level is done; else the remaining edges go through the rounds of
    # _decide_rest_vector. Costs use exactly the expressions of PaddingCost.cmm.
    sl = slice(lo, hi)
    children, cp, ln = ix.children[sl], ix.cp[sl], ix.ln[sl]
    lv = eff_len[cp]
    kv = np.empty((5, hi - lo), dtype=np.int64)
    kv[:4] = lv
    np.add(ln, lv, out=kv[4])
    c = ec.pad_q[:, sl] * kv
    c = ec.ag * c
    pad_k = ec.ts_k[:, sl] - kv
    np.maximum(pad_k, 0, out=pad_k)
    pad_k *= ix.a[:, sl]
    c += ec.bg * pad_k
    # split_kv = Cmm(n, lv) + Cmm(q, len) + gamma q ; split_q = Cmm(n - q, lv) + Cmm(q, len + lv)
    split_kv = c[:2] + ec.c_child[sl]
    split_kv += ec.g_q[sl]
    split_q = c[2:4] + c[4]
    ones = split_kv > split_q  # [2, E]: under n1, under n_par
    first = ones[0][ix.sstart[sl] - lo]  # the first child's decision, per edge
    use = np.where(first, ones[0], ones[1])
    brk = use != first
    if not brk.any():
        assign[children] = first
        eff_len[children] = np.where(first, kv[4], ln)
        n_cur[cp] = np.where(first, ix.n_par_after[sl], ix.n_par[sl])
        return
    _decide_rest_vector(ix, lo, hi, ec, cost, n_cur, eff_len, assign, lv, c[4], use, brk)


def _decide_rest_vector(ix, lo, hi, ec, cost: PaddingCost, n_cur, eff_len, assign, lv, c_concat, use, brk) -> None:
    # Children are sorted by parent. A round resolves, for every parent with undecided
    # children, a run of 1s (evaluated with the count dropping by each child taken),
    # the 0 that ends it, the 0s that follow under the now-fixed count, and the next 1;
    # the parent's later children wait for the next round. Each decision is evaluated
    # under exactly the count the sequential greedy would see.
    sl = slice(lo, hi)
    children, cp, q, ln = ix.children[sl], ix.cp[sl], ix.q[sl], ix.ln[sl]
    c_child, g_q = ec.c_child[sl], ec.g_q[sl]
    sstart = ix.sstart[sl] - lo
    # decisions of the first pass stand up to and including each parent's first break
    before = np.cumsum(brk) - brk
    resolved = before == before[sstart]
    decided = (use & resolved).astype(np.int8)
    n_state = n_cur.copy()  # indexed by node id
    taken = np.where(decided == 1, q, 0)
    seg_starts = np.flatnonzero(sstart == np.arange(hi - lo))
    n_state[cp[seg_starts]] = ix.n_par[sl][seg_starts] - np.add.reduceat(taken, seg_starts)

    def concat(rem: np.ndarray, n: np.ndarray) -> np.ndarray:
        split_kv = cost.cmm(n, lv[rem]) + c_child[rem] + g_q[rem]
        split_q = cost.cmm(n - q[rem], lv[rem]) + c_concat[rem]
        return split_kv > split_q

    big = np.iinfo(np.int64).max
    rem = np.flatnonzero(~resolved)
    while rem.size:
        p = cp[rem]
        qr = q[rem]
        seg_first = np.ones(rem.size, dtype=bool)
        seg_first[1:] = p[1:] != p[:-1]
        starts = np.flatnonzero(seg_first)
        seg = np.cumsum(seg_first) - 1
        incl = np.cumsum(qr)
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
    assign[children] = decided
    eff_len[children] = ln + decided * lv
    n_cur[cp] = n_state[cp]


# --------------------------------------------------------------------- groups
def build_groups(tree: KVTree, assign: np.ndarray, group_queries: np.ndarray, group_kv_len: np.ndarray) -> Groups:
    """Materialise the context-query groups of an edge assignment.

    Parameters
    ----------
    tree : KVTree
    assign : ndarray, int8 [n_nodes]
        Edge assignment from :func:`greedy_edge_assignment`.
    group_queries, group_kv_len : ndarray, int64 [n_nodes]
        Query counts and KV lengths per group from the same call; the counts are
        checked against the memberships found here, groups without tokens are dropped.
    """
    # A query belongs to the group of its own node and to the parent of every 0-edge on
    # its path: node v's group holds the queries below v except those below a child of
    # v whose edge is not 0. In DFS order those are v's query range minus the ranges of
    # such children ("holes"), so every group's list is a few runs of DFS positions.
    n = tree.n_nodes
    gx = _tree_index(tree).groups(tree)
    sq = tree.subtree_queries
    cs = gx.child_sorted
    holes = cs[assign[cs] != 0]
    hole_par = tree.parents[holes]
    counts = sq - np.bincount(hole_par, weights=sq[holes], minlength=n).astype(np.int64)
    if not np.array_equal(counts, group_queries):
        raise AssertionError("internal error: group membership disagrees with the greedy's query counts")
    keep = (counts > 0) & (group_kv_len > 0)
    node = np.flatnonzero(keep)
    g_count = counts[node]
    q_indptr = np.zeros(node.size + 1, dtype=np.int64)
    np.cumsum(g_count, out=q_indptr[1:])
    inner = keep[hole_par]
    holes, hole_par = holes[inner], hole_par[inner]
    if holes.size == 0:
        run_start, run_len = gx.qlo[node], g_count
    else:
        # runs of group g: qlo[g] .. first hole, between holes, last hole .. qhi[g]
        hg = np.searchsorted(node, hole_par)
        k = np.arange(holes.size)
        n_holes = np.bincount(hg, minlength=node.size)
        g_first = np.zeros(node.size, dtype=np.int64)
        np.cumsum(n_holes[:-1], out=g_first[1:])
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
    q_pos = _ragged_arange(run_start, run_len, int(q_indptr[-1]))
    if gx.perm is None:
        q_ids = q_pos
    else:
        # DFS order differs from id order: sort each group's queries by id
        gid = np.repeat(np.arange(node.size, dtype=np.int64) * tree.n_queries, g_count)
        key = gx.perm[q_pos] + gid
        key.sort()
        q_ids = key - gid
    kv_start, kv_slots = _chain_slots(tree, assign, node)
    return Groups(
        node=node, kv_start=kv_start, kv_len=group_kv_len[node], kv_slots=kv_slots, q_indptr=q_indptr, q_ids=q_ids
    )


def _ragged_arange(start: np.ndarray, length: np.ndarray, total: int) -> np.ndarray:
    """Concatenation of ``arange(start[i], start[i] + length[i])`` (int64, ``total`` entries)."""
    out = np.ones(total, dtype=np.int64)
    if total == 0:
        return out
    nonempty = length > 0
    s, ln = start[nonempty], length[nonempty]
    first = np.zeros(s.size, dtype=np.int64)
    np.cumsum(ln[:-1], out=first[1:])
    jumps = np.empty_like(s)
    jumps[0] = s[0]
    jumps[1:] = s[1:] - (s[:-1] + ln[:-1] - 1)
    out[first] = jumps
    np.cumsum(out, out=out)
    return out


def _chain_slots(tree: KVTree, assign: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KV of each group node's 1-chain (top of the chain first).

    Returns ``(kv_start, kv_slots)``: a group that is a single node reads its run of the
    tree's own slot array; longer chains are concatenated after it.
    """
    parents = tree.parents
    kv_start = tree.slot_indptr[nodes]
    chained = np.flatnonzero(assign[nodes] == 1)
    if chained.size == 0:
        return kv_start, tree.slots
    # walk every chain up from its group node; step s holds the s-th node above it
    cur = nodes[chained]
    ids = np.arange(chained.size)
    steps, step_ids = [cur], [ids]
    while cur.size:
        up = parents[cur]
        if up.min() < 0:  # a root marked 1: its chain ends there
            ok = up >= 0
            up, ids = up[ok], ids[ok]
        steps.append(up)
        step_ids.append(ids)
        more = assign[up] == 1
        cur, ids = up[more], ids[more]
    chain_len = np.bincount(np.concatenate(step_ids), minlength=chained.size)
    chain_ptr = np.zeros(chained.size + 1, dtype=np.int64)
    np.cumsum(chain_len, out=chain_ptr[1:])
    chain_nodes = np.empty(int(chain_ptr[-1]), dtype=np.int64)
    top_pos = chain_ptr[1:] - 1  # the group node is last; the s-th node above it s places before
    for s, (nd, gi) in enumerate(zip(steps, step_ids, strict=True)):
        chain_nodes[top_pos[gi] - s] = nd
    starts = tree.slot_indptr[chain_nodes]
    lens = tree.slot_indptr[chain_nodes + 1] - starts
    node_ptr = np.zeros(chain_nodes.size + 1, dtype=np.int64)
    np.cumsum(lens, out=node_ptr[1:])
    n_slots = tree.slots.size
    kv_start[chained] = n_slots + node_ptr[chain_ptr[:-1]]
    total = int(node_ptr[-1])
    out = np.empty(n_slots + total, dtype=np.int32)
    out[:n_slots] = tree.slots
    if total:
        nonempty = lens > 0
        s, ln = starts[nonempty], lens[nonempty]
        jumps = np.empty_like(s)
        jumps[0] = s[0]
        jumps[1:] = s[1:] - (s[:-1] + ln[:-1] - 1)
        first = node_ptr[:-1][nonempty]
        if getattr(tree, "_slots_are_arange", False):
            # slot i of the tree is i: the gather indices are the slots themselves
            tail = out[n_slots:]
            tail.fill(1)
            tail[first] = jumps
            np.cumsum(tail, dtype=np.int32, out=tail)
        else:
            idx = np.ones(total, dtype=np.int64)
            idx[first] = jumps
            np.cumsum(idx, out=idx)
            np.take(tree.slots, idx, out=out[n_slots:])
    return kv_start, out


# ----------------------------------------------------------------------- plan
def plan(
    tree: KVTree,
    config: FastTreeConfig | None = None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Plan:
    """Plan tree attention for one tree on the host.

    The adaptive passes follow the published planner: after the greedy, a phase whose
    units x KV heads are fewer than ``para_threshs1`` (and more than zero) switches to
    the small split size; only if a split changed, the units are recounted, and when the
    large phase has fewer than ``para_threshs2[0]`` (or else the small one fewer than
    ``para_threshs2[1]``) every group moves to the small (large) tiles and the greedy
    runs again with them.

    Parameters
    ----------
    tree : KVTree
    config : FastTreeConfig, optional
        Defaults to ``FastTreeConfig()`` (the published H100 values).
    num_q_heads, num_kv_heads : int
        ``Hq`` and ``Hkv``; ``Hq`` must be a multiple of ``Hkv``.
    head_dim : int
        ``D``, in [16, 256].

    Returns
    -------
    Plan
        Flat int32 arrays for the kernels plus the decisions that produced them.
    """
    if not isinstance(tree, KVTree):
        raise ValueError(f"plan() needs a KVTree, got {type(tree).__name__}")
    config = _DEFAULT_CONFIG if config is None else config
    if not isinstance(config, FastTreeConfig):
        raise ValueError(f"config must be a FastTreeConfig, got {type(config).__name__}")
    g = check_heads(num_q_heads, num_kv_heads, head_dim)
    q_tiles = config.query_tiles(g)

    def run_greedy(mode: str):
        tq, tk = mode_tiles(mode, q_tiles, config.kv_tile)
        cost = PaddingCost(config.alpha, config.beta, config.gamma, g, tq, tk)
        assign, group_q, group_kv = greedy_edge_assignment(tree, cost)
        return cost, assign, build_groups(tree, assign, group_q, group_kv)

    mode = TWO_CLASSES
    cost, assign, groups = run_greedy(mode)
    big, small = config.kv_split_sizes
    splits = [big, big]
    units = _units_per_phase(groups, cost, splits, num_kv_heads)
    changed = False
    for c in (0, 1):
        if 0 < units[c] < config.para_threshs1[c]:
            splits[c] = small
            changed = True
    if changed:
        units = _units_per_phase(groups, cost, splits, num_kv_heads)
        if 0 < units[0] < config.para_threshs2[0]:
            mode = ALL_SMALL
        elif 0 < units[1] < config.para_threshs2[1]:
            mode = ALL_LARGE
        if mode != TWO_CLASSES:
            cost, assign, groups = run_greedy(mode)
    return materialize(
        groups,
        q_tiles=cost.q_tiles,
        kv_tiles=cost.kv_tiles,
        group_split=np.where(groups.q_indptr[1:] - groups.q_indptr[:-1] <= cost.q_tiles[1], splits[1], splits[0]),
        splits=(splits[0], splits[1]),
        config=config,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        n_queries=tree.n_queries,
        max_slot=tree.max_slot,
        tile_mode=mode,
        edge_assignment=assign,
    )


def _units_per_phase(groups: Groups, cost: PaddingCost, splits, num_kv_heads: int) -> list[int]:
    """Work units x KV heads per group phase, for the given split sizes."""
    # Every group has >= 1 query and q_tiles[1] <= q_tiles[0], so a phase-1 group (at most
    # q_tiles[1] queries) is one query tile under either tile size.
    nq = groups.q_indptr[1:] - groups.q_indptr[:-1]
    small = nq <= cost.q_tiles[1]
    split = splits[0] if splits[0] == splits[1] else np.where(small, splits[1], splits[0])
    units = -(-groups.kv_len // split)
    units *= -(-nq // cost.q_tiles[0])
    total = int(units.sum())
    in_small = int(units[small].sum())
    return [(total - in_small) * num_kv_heads, in_small * num_kv_heads]
