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

from dataclasses import dataclass

import numpy as np

from .config import FastTreeConfig
from .costs import ALL_LARGE, ALL_SMALL, TWO_CLASSES, PaddingCost, mode_tiles
from .plan_arrays import Plan, check_heads, materialize
from .tree import KVTree, ragged_gather

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


# --------------------------------------------------------------------- greedy
def _children_by_parent(tree: KVTree) -> list[np.ndarray]:
    """Per level ``d >= 1``, its nodes sorted by (parent, id); cached on the tree."""
    cached = getattr(tree, "_children_by_parent", None)
    if cached is None:
        cached = [lvl[np.argsort(tree.parents[lvl], kind="stable")] for lvl in tree.levels[1:]]
        tree._children_by_parent = cached
    return cached


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
    n = tree.n_nodes
    assign = np.zeros(n, dtype=np.int8)
    n_cur = tree.subtree_queries.copy()
    eff_len = tree.lengths.copy()
    parents, lengths, nq = tree.parents, tree.lengths, tree.subtree_queries
    for children in _children_by_parent(tree):
        if children.size <= _SCALAR_EDGES:
            _decide_level_scalar(children, parents, lengths, nq, n_cur, eff_len, assign, cost)
        else:
            _decide_level_vector(children, parents, lengths, nq, n_cur, eff_len, assign, cost)
    return assign, n_cur, eff_len


def _decide_level_scalar(children, parents, lengths, nq, n_cur, eff_len, assign, cost: PaddingCost) -> None:
    cmm = cost.cmm_scalar
    gamma = cost.gamma
    state: dict[int, int] = {}
    child_list = children.tolist()
    par_list = parents[children].tolist()
    q_list = nq[children].tolist()
    len_list = lengths[children].tolist()
    plen = dict(zip(par_list, eff_len[parents[children]].tolist(), strict=True))
    for c, p, q, ln in zip(child_list, par_list, q_list, len_list, strict=True):
        n = state.get(p)
        if n is None:
            n = int(n_cur[p])
        lv = plen[p]
        split_kv = cmm(n, lv) + cmm(q, ln) + gamma * q
        split_q = cmm(n - q, lv) + cmm(q, ln + lv)
        if split_kv > split_q:
            assign[c] = 1
            eff_len[c] = ln + lv
            n -= q
        state[p] = n
    for p, n in state.items():
        n_cur[p] = n


def _decide_level_vector(children, parents, lengths, nq, n_cur, eff_len, assign, cost: PaddingCost) -> None:
    # Children are sorted by parent. A round resolves, for every parent with undecided
    # children, a run of 1s (evaluated with the count dropping by each child taken),
    # the 0 that ends it, the 0s that follow under the now-fixed count, and the next 1;
    # the parent's later children wait for the next round. Each decision is evaluated
    # under exactly the count the sequential greedy would see.
    cp = parents[children]
    q = nq[children]
    lv = eff_len[cp]
    c_child = cost.cmm(q, lengths[children])
    c_concat = cost.cmm(q, lengths[children] + lv)
    g_q = cost.gamma * q
    n_state = n_cur.copy()  # indexed by node id
    decided = np.zeros(children.size, dtype=np.int8)

    def concat(rem: np.ndarray, n: np.ndarray) -> np.ndarray:
        split_kv = cost.cmm(n, lv[rem]) + c_child[rem] + g_q[rem]
        split_q = cost.cmm(n - q[rem], lv[rem]) + c_concat[rem]
        return split_kv > split_q

    big = np.iinfo(np.int64).max
    rem = np.arange(children.size)
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
    eff_len[children] = lengths[children] + decided * lv
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
    parents = tree.parents
    nqry = tree.n_queries
    # Each query belongs to the group of its own node and to the parent of every
    # 0-edge on its path; walk all queries upwards together.
    q_ids = [np.arange(nqry)]
    g_nodes = [tree.query_nodes]
    cur = tree.query_nodes
    qi = q_ids[0]
    while True:
        par = parents[cur]
        up = par >= 0
        if not up.any():
            break
        cur, qi, par, was = cur[up], qi[up], par[up], assign[cur[up]]
        zero = was == 0
        q_ids.append(qi[zero])
        g_nodes.append(par[zero])
        cur = par
    pair_q = np.concatenate(q_ids)
    pair_g = np.concatenate(g_nodes)
    order = np.argsort(pair_g * nqry + pair_q)
    pair_q, pair_g = pair_q[order], pair_g[order]
    counts = np.bincount(pair_g, minlength=tree.n_nodes)
    if not np.array_equal(counts, group_queries):
        raise AssertionError("internal error: group membership disagrees with the greedy's query counts")
    kept = group_kv_len[pair_g] > 0
    pair_q, pair_g = pair_q[kept], pair_g[kept]
    new_group = np.ones(pair_g.size, dtype=bool)
    new_group[1:] = pair_g[1:] != pair_g[:-1]
    q_indptr = np.append(np.flatnonzero(new_group), pair_g.size)
    node = pair_g[new_group]
    kv_start, kv_slots = _chain_slots(tree, assign, node)
    return Groups(
        node=node, kv_start=kv_start, kv_len=group_kv_len[node], kv_slots=kv_slots, q_indptr=q_indptr, q_ids=pair_q
    )


def _chain_slots(tree: KVTree, assign: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KV of each group node's 1-chain (top of the chain first).

    Returns ``(kv_start, kv_slots)``: a group that is a single node reads its run of the
    tree's own slot array; longer chains are concatenated after it.
    """
    parents = tree.parents
    kv_start = tree.slot_indptr[nodes].copy()
    chained = np.flatnonzero(assign[nodes] == 1)
    if chained.size == 0:
        return kv_start, tree.slots
    cur = nodes[chained]
    cols = [cur]
    alive = np.ones(cur.size, dtype=bool)
    while alive.any():
        nxt = np.where(alive, parents[np.where(alive, cur, 0)], -1)
        cols.append(nxt)
        cur = nxt
        alive = (cur >= 0) & (assign[np.maximum(cur, 0)] == 1)
    table = np.stack(cols[::-1], axis=1)  # [n_chained, chain_len], top of chain first, -1 padded on the left
    chain_nodes = table[table >= 0]
    chain_len = (table >= 0).sum(axis=1)
    node_ptr, slots = ragged_gather(tree.slot_indptr, tree.slots, chain_nodes)
    chain_ptr = np.zeros(chained.size + 1, dtype=np.int64)
    np.cumsum(chain_len, out=chain_ptr[1:])
    kv_start[chained] = tree.slots.size + node_ptr[chain_ptr[:-1]]
    return kv_start, np.concatenate([tree.slots, slots])


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
        group_split=np.where(cost.phase(groups.n_queries) == 0, splits[0], splits[1]),
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
    phase = cost.phase(groups.n_queries)
    split = np.where(phase == 0, splits[0], splits[1])
    tile = np.where(phase == 0, cost.q_tiles[0], cost.q_tiles[1])
    units = -(-groups.kv_len // split) * -(-groups.n_queries // tile)
    per_phase = np.bincount(phase, weights=units, minlength=2)
    return [int(per_phase[0]) * num_kv_heads, int(per_phase[1]) * num_kv_heads]
