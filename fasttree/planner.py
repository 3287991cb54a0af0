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
4. Adaptive passes (:func:`plan`): a tile class with few units uses the small split
   size; when one class is nearly empty every group moves to the other class and the
   greedy is re-run with that single tile.

Levels are processed one at a time; within a level, edges are decided either by a
scalar loop (few edges) or by vectorised rounds in which every parent jumps to its
next concatenated child -- both compute exactly the same floating-point costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import FastTreeConfig
from .costs import ALL_LARGE, ALL_SMALL, TWO_CLASSES, PaddingCost
from .plan_arrays import Plan, check_heads, materialize
from .tree import KVTree, ragged_gather

#: Levels with at most this many edges are decided by the scalar loop.
_SCALAR_EDGES = 48


@dataclass(frozen=True)
class Groups:
    """Context-query groups of a plan, in increasing node order.

    Attributes
    ----------
    node : ndarray, int64 [n_groups]
        The tree node that names the group (the bottom of its KV chain).
    kv_indptr : ndarray, int64 [n_groups + 1]
    kv_slots : ndarray, int32 [total group tokens]
        Group ``i`` reads ``kv_slots[kv_indptr[i]:kv_indptr[i + 1]]``.
    q_indptr : ndarray, int64 [n_groups + 1]
    q_ids : ndarray, int64 [total group queries]
        Group ``i`` serves queries ``q_ids[q_indptr[i]:q_indptr[i + 1]]`` (ascending).
    """

    node: np.ndarray
    kv_indptr: np.ndarray
    kv_slots: np.ndarray
    q_indptr: np.ndarray
    q_ids: np.ndarray

    @property
    def n_groups(self) -> int:
        return int(self.node.size)

    @property
    def kv_len(self) -> np.ndarray:
        return np.diff(self.kv_indptr)

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
    # Children are sorted by parent; positions 0..E-1. Each round evaluates every
    # undecided child under its parent's current query count; per parent, children
    # before the first "1" are final zeros, the first "1" is applied, and the parent's
    # later children wait for the next round (the count changed).
    cp = parents[children]
    q = nq[children]
    lv = eff_len[cp]
    c_child = cost.cmm(q, lengths[children])
    c_concat = cost.cmm(q, lengths[children] + lv)
    g_q = cost.gamma * q
    n_state = n_cur.copy()  # indexed by node id, updated for parents as edges land
    decided = np.zeros(children.size, dtype=np.int8)
    rem = np.arange(children.size)
    cut = np.full(n_cur.size, children.size, dtype=np.int64)
    while rem.size:
        p = cp[rem]
        n = n_state[p]
        split_kv = cost.cmm(n, lv[rem]) + c_child[rem] + g_q[rem]
        split_q = cost.cmm(n - q[rem], lv[rem]) + c_concat[rem]
        hit = rem[split_kv > split_q]
        if hit.size == 0:
            break
        hp = cp[hit]
        first = np.ones(hit.size, dtype=bool)
        first[1:] = hp[1:] != hp[:-1]
        sel = hit[first]
        sel_p = cp[sel]
        decided[sel] = 1
        n_state[sel_p] -= q[sel]
        cut[sel_p] = sel
        keep = rem > cut[p]
        cut[sel_p] = children.size
        rem = rem[keep]
    assign[children] = decided
    eff_len[children] = lengths[children] + decided * lv
    touched = np.unique(cp)
    n_cur[touched] = n_state[touched]


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
    order = np.lexsort((pair_q, pair_g))
    pair_q, pair_g = pair_q[order], pair_g[order]
    counts = np.bincount(pair_g, minlength=tree.n_nodes)
    if not np.array_equal(counts, group_queries):
        raise AssertionError("internal error: group membership disagrees with the greedy's query counts")
    kept = group_kv_len[pair_g] > 0
    pair_q, pair_g = pair_q[kept], pair_g[kept]
    node, q_start, q_count = np.unique(pair_g, return_index=True, return_counts=True)
    q_indptr = np.zeros(node.size + 1, dtype=np.int64)
    np.cumsum(q_count, out=q_indptr[1:])
    kv_indptr, kv_slots = _chain_slots(tree, assign, node)
    return Groups(node=node, kv_indptr=kv_indptr, kv_slots=kv_slots, q_indptr=q_indptr, q_ids=pair_q)


def _chain_slots(tree: KVTree, assign: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slots of each node's 1-chain (top of the chain first) for the given group nodes."""
    parents = tree.parents
    cols = [nodes]
    cur = nodes
    alive = assign[cur] == 1
    while alive.any():
        nxt = np.where(alive, parents[np.where(alive, cur, 0)], -1)
        cols.append(nxt)
        cur = nxt
        alive = (cur >= 0) & (assign[np.maximum(cur, 0)] == 1)
    table = np.stack(cols[::-1], axis=1)  # [n_groups, chain_len], top of chain first, -1 padded on the left
    chain_nodes = table[table >= 0]
    chain_len = (table >= 0).sum(axis=1)
    node_ptr, slots = ragged_gather(tree.slot_indptr, tree.slots, chain_nodes)
    chain_ptr = np.zeros(nodes.size + 1, dtype=np.int64)
    np.cumsum(chain_len, out=chain_ptr[1:])
    return node_ptr[chain_ptr], slots


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
    config = FastTreeConfig() if config is None else config
    if not isinstance(config, FastTreeConfig):
        raise ValueError(f"config must be a FastTreeConfig, got {type(config).__name__}")
    g = check_heads(num_q_heads, num_kv_heads, head_dim)
    q_tiles = config.query_tiles(g)

    def run_greedy(mode: str):
        cost = PaddingCost(config.alpha, config.beta, config.gamma, g, q_tiles, config.kv_tile, mode)
        assign, group_q, group_kv = greedy_edge_assignment(tree, cost)
        groups = build_groups(tree, assign, group_q, group_kv)
        return cost, assign, groups

    mode = TWO_CLASSES
    cost, assign, groups = run_greedy(mode)
    splits, units = _choose_splits(groups, cost, config, q_tiles, num_kv_heads)
    if units[0] > 0 and units[1] > 0:
        if units[0] * num_kv_heads < config.para_threshs2[0]:
            mode = ALL_SMALL
        elif units[1] * num_kv_heads < config.para_threshs2[1]:
            mode = ALL_LARGE
    if mode != TWO_CLASSES:
        cost, assign, groups = run_greedy(mode)
        splits, units = _choose_splits(groups, cost, config, q_tiles, num_kv_heads)
    return materialize(
        groups,
        tile_class=cost.tile_class(groups.n_queries),
        q_tiles=q_tiles,
        split_sizes=splits,
        config=config,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        n_queries=tree.n_queries,
        max_slot=tree.max_slot,
        tile_mode=mode,
        edge_assignment=assign,
    )


def _units_per_class(groups: Groups, tile_class: np.ndarray, q_tiles, splits) -> list[int]:
    kv_len = groups.kv_len
    nq = groups.n_queries
    out = []
    for c in (0, 1):
        m = tile_class == c
        chunks = -(-kv_len[m] // splits[c])
        tiles = -(-nq[m] // q_tiles[c])
        out.append(int((chunks * tiles).sum()))
    return out


def _choose_splits(groups: Groups, cost: PaddingCost, config: FastTreeConfig, q_tiles, num_kv_heads: int):
    """First adaptive pass: a tile class with too few units x KV heads uses the small split."""
    tile_class = cost.tile_class(groups.n_queries)
    big, small = config.kv_split_sizes
    units = _units_per_class(groups, tile_class, q_tiles, (big, big))
    splits = tuple(small if units[c] * num_kv_heads < config.para_threshs1[c] else big for c in (0, 1))
    return splits, _units_per_class(groups, tile_class, q_tiles, splits)
