"""Build a :class:`~fasttree.tree.KVTree` from a serving engine's view of its batch.

A serving engine knows, for each decoding request, the KV-pool slots of its context in
order (SGLang's ``req_to_token[req_pool_idx, :seq_len]``); requests that share a prefix
(a system prompt, few-shot examples, a document, the beams of one prompt) share the
slots of that prefix. These functions recover the shared structure from the slot ids
alone, without reading any KV data:

* :func:`tree_from_token_slots` -- one slot sequence per request: the compressed trie
  (radix tree) of the sequences, each node a maximal run of slots shared by exactly the
  same requests.
* :func:`tree_from_req_to_token` -- SGLang's ``req_to_token`` table, ``req_pool_indices``
  and ``seq_lens`` (CPU or CUDA tensors, or numpy arrays): gathers the batch's rows on
  the host with one device-to-host copy and builds the trie of them.
* :func:`tree_from_radix_nodes` -- the radix cache's own nodes (parent ids, slots per
  node, the node where each request's context ends), validated and wrapped.

Only numpy and the standard library are needed; torch is used only when given tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .host_arrays import entry_array
from .tree import KVTree, exclusive_sum, ragged_arange
from .validation import check_int_array

__all__ = ["tree_from_radix_nodes", "tree_from_req_to_token", "tree_from_token_slots"]

logger = logging.getLogger(__name__)

_INT32_MAX = int(np.iinfo(np.int32).max)
#: Mean compared length (tokens per adjacent pair) from which the LCPs are found pair by pair.
_LOOP_MIN_TOKENS = 128


# ------------------------------------------------------------------ inputs
def _is_tensor(value: Any) -> bool:
    """A torch tensor, recognised without importing torch."""
    return hasattr(value, "detach") and hasattr(value, "device") and hasattr(value, "numpy")


def _host_array(
    name: str, value: Any, ndim: int, *, allow_device: bool = False, keep_dtype: bool = False
) -> np.ndarray:
    """``value`` (array-like, or a torch tensor) as a host integer numpy array of ``ndim`` dims,
    int64 unless ``keep_dtype`` (then any integer dtype but uint64, which becomes int64).

    A CUDA tensor is copied to the host when ``allow_device``, else refused (a per-request
    copy would synchronise the device once per request).
    """
    if _is_tensor(value):
        if value.device.type != "cpu":
            if not allow_device:
                raise ValueError(
                    f"{name} is a tensor on {value.device}: move the batch to the host once "
                    "(or use tree_from_req_to_token, which copies the rows it needs in one transfer)"
                )
            value = value.detach().cpu()
        value = value.detach().numpy()
    return check_int_array(name, value, ndim=ndim, keep_dtype=keep_dtype)


def _check_slot_range(flat: np.ndarray, indptr: np.ndarray, where: Callable[[int, int], str]) -> None:
    """``ValueError`` naming the first slot of ``flat`` that is negative or beyond int32.

    Request ``j``'s slots are ``flat[indptr[j]:indptr[j + 1]]``; ``where(j, k)`` names the
    input entry of its ``k``-th slot.
    """
    if not flat.size:
        return
    lo, hi = int(flat.min()), int(flat.max())
    if lo >= 0 and hi <= _INT32_MAX:
        return
    at = int(np.flatnonzero((flat < 0) | (flat > _INT32_MAX))[0])
    j = int(np.searchsorted(indptr, at, side="right")) - 1
    what = "a negative slot id" if flat[at] < 0 else "beyond the int32 slot range of the kernels"
    raise ValueError(f"{where(j, at - int(indptr[j]))} = {int(flat[at])} is {what}")


# -------------------------------------------------------------------- trie
def _sorted_order(data: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Requests in lexicographic order of their slot sequences (a prefix before its extensions).

    Request ``j``'s sequence is ``data[start[j]:start[j] + length[j]]``. Slots are in
    ``[0, 2**31)``, so their big-endian 4-byte images compare like the numbers and
    byte-string order is lexicographic order; Python's sort of ``n`` byte strings is stable
    (identical sequences keep request order) and compares with memcmp.
    """
    n = start.size
    # the big-endian images in reused host memory (entries outside the sequences are converted
    # but never compared): a fresh block of the batch's size per call took fresh pages, 4-5x the
    # time of the rest on a 256-request batch
    image = entry_array(data.size).view(">u4")
    np.copyto(image, data, casting="unsafe")
    b = start.tolist()
    e = (start + length).tolist()
    keys = [image[b[j] : e[j]].tobytes() for j in range(n)]
    return np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)


def _adjacent_lcp(flat: np.ndarray, start: np.ndarray, length: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Longest common prefix of each request with its successor in ``order`` (sequences as
    in :func:`_sorted_order`).

    Returns
    -------
    ndarray, int64 [n - 1]
        Entry ``k`` is the LCP length of requests ``order[k]`` and ``order[k + 1]``.
    """
    start = start[order]
    length = length[order]
    m = np.minimum(length[:-1], length[1:])  # >= 1: every sequence is non-empty
    if int(m.sum()) < _LOOP_MIN_TOKENS * m.size:
        # short contexts: compare every pair position by position, all pairs at once
        seg = exclusive_sum(m)
        total = int(m.sum())
        diff = np.flatnonzero(flat[ragged_arange(start[:-1], m, total)] != flat[ragged_arange(start[1:], m, total)])
        lcp = m.copy()
        if diff.size:
            pair = np.searchsorted(seg, diff, side="right") - 1
            first = np.ones(diff.size, dtype=bool)
            first[1:] = pair[1:] != pair[:-1]
            lcp[pair[first]] = diff[first] - seg[pair[first]]
        return lcp
    # long contexts: one contiguous comparison per pair beats gathering every position
    lcp = np.empty(m.size, dtype=np.int64)
    s, mm = start.tolist(), m.tolist()
    for k, mk in enumerate(mm):
        ne = flat[s[k] : s[k] + mk] != flat[s[k + 1] : s[k + 1] + mk]
        i = int(ne.argmax())
        lcp[k] = i if ne[i] else mk
    return lcp


def _trie(data: np.ndarray, start: np.ndarray, lengths: np.ndarray) -> KVTree:
    """The compressed trie of the sequences ``data[start[j]:start[j] + lengths[j]]`` (each
    non-empty, slots in ``[0, 2**31)``; int64 ``start`` and ``lengths``), one query per
    sequence in sequence order."""
    n = start.size
    order = _sorted_order(data, start, lengths) if n > 1 else np.zeros(1, dtype=np.int64)
    lcp = [0, *_adjacent_lcp(data, start, lengths, order).tolist()] if n > 1 else [0]
    seq_len = lengths[order].tolist()

    # One pass over the sorted requests (not over tokens) with the rightmost root path on
    # a stack: the LCP with the predecessor says where the new sequence branches off. A
    # node is (end depth, parent, a request through it, first sorted request below it).
    depth: list[int] = []
    parent: list[int] = []
    rep: list[int] = []
    first: list[int] = []
    query_sorted = [0] * n
    stack, stack_depth = [-1], [0]  # -1: the virtual root above the forest's roots
    for k in range(n):
        lk = lcp[k]
        while stack_depth[-1] > lk:
            last = stack.pop()
            stack_depth.pop()
            if stack_depth[-1] < lk:  # branch point inside an edge: split it with a new node
                new = len(depth)
                depth.append(lk)
                parent.append(stack[-1])
                rep.append(k)
                first.append(first[last])
                parent[last] = new
                stack.append(new)
                stack_depth.append(lk)
        if seq_len[k] == lk:  # identical to its predecessor: its query sits at the same node
            query_sorted[k] = stack[-1]
            continue
        new = len(depth)
        depth.append(seq_len[k])
        parent.append(stack[-1])
        rep.append(k)
        first.append(k)
        stack.append(new)
        stack_depth.append(seq_len[k])
        query_sorted[k] = new

    depth_a = np.array(depth, dtype=np.int64)
    parent_a = np.array(parent, dtype=np.int64)
    start_depth = np.where(parent_a >= 0, depth_a[np.maximum(parent_a, 0)], 0)
    # Node ids in DFS preorder of the lexicographic order: by (first sorted request below
    # the node, depth); a parent precedes its children, siblings go by their first slot.
    perm = np.lexsort((depth_a, np.array(first, dtype=np.int64)))
    new_id = np.empty(perm.size, dtype=np.int64)
    new_id[perm] = np.arange(perm.size)
    parents = parent_a[perm]
    parents = np.where(parents >= 0, new_id[np.maximum(parents, 0)], -1)
    node_len = depth_a[perm] - start_depth[perm]
    node_start = start[order[np.array(rep, dtype=np.int64)[perm]]] + start_depth[perm]
    slots = data[ragged_arange(node_start, node_len)]
    query_nodes = np.empty(n, dtype=np.int64)
    query_nodes[order] = new_id[np.array(query_sorted, dtype=np.int64)]
    return KVTree.from_flat(parents, node_len, slots, query_nodes)


# ---------------------------------------------------------------- public API
def tree_from_token_slots(slot_lists: Sequence) -> KVTree:
    """The KV tree of a batch, from each request's context slots: shared prefixes become shared nodes.

    Builds the compressed trie (radix tree) of the requests' slot sequences: each node is
    a maximal run of slots shared by exactly the same set of requests. Requests whose
    sequences start with different slots are in different trees (a forest). Query ``j``
    (request ``j``) sits at the node where its sequence ends: a leaf, or an internal node
    when another request's sequence extends it; identical sequences give several queries
    at one node. No KV data is read, only slot ids.

    Node ids are in depth-first preorder, children in increasing order of their first slot
    (so a parent precedes its children). Every node holds at least one slot, and every
    node either carries a query or has at least two children whose first slots differ:
    no smaller tree represents the batch.

    Parameters
    ----------
    slot_lists : sequence of n_requests 1-D int arrays, lists or CPU tensors
        ``slot_lists[j]``, int [context_len_j] with ``context_len_j >= 1``: request ``j``'s
        KV-pool slot ids in context order, its whole context including the token being
        decoded (SGLang's ``req_to_token[req_pool_indices[j], :seq_lens[j]]``). Slots are
        in ``[0, 2**31)``.

    Returns
    -------
    KVTree
        ``n_queries == n_requests``, query ``j`` for request ``j``; ``tree.query_slots()``
        gives back ``slot_lists`` exactly.

    Raises
    ------
    ValueError
        When ``slot_lists`` is empty, an entry is not a 1-D integer array, is empty, is a
        tensor on a GPU, or holds a negative slot or one beyond the int32 range.

    Notes
    -----
    Cost: one sort of the requests' byte images, a vectorised comparison of each request
    with its predecessor in sorted order (O(total tokens)) and a pass over the requests;
    no Python loop runs per token.
    """
    if isinstance(slot_lists, (str, bytes)) or not hasattr(slot_lists, "__len__"):
        raise ValueError(f"slot_lists must be a sequence of 1-D slot arrays, got {type(slot_lists).__name__}")
    n = len(slot_lists)
    if n == 0:
        raise ValueError("slot_lists is empty: a batch needs at least one request")
    flat, lengths = _flat_entries(slot_lists, "slot_lists", range(n), empty_ok=False)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    _check_slot_range(flat, indptr, lambda j, k: f"slot_lists[{j}][{k}]")
    return _trie(flat, indptr[:-1], lengths)


def tree_from_req_to_token(req_to_token: Any, req_pool_indices: Any, seq_lens: Any) -> KVTree:
    """The KV tree of a batch from SGLang's request-to-token table.

    Request ``j``'s context is ``req_to_token[req_pool_indices[j], :seq_lens[j]]``; the
    result is :func:`tree_from_token_slots` of those rows. Entries past a row's length
    are not read (they may hold anything).

    The small ``req_pool_indices`` and ``seq_lens`` are copied to the host and validated
    first (so a bad index never reaches a device gather); then the batch's rows, cut to
    the longest context, are gathered where ``req_to_token`` lives and copied to the host
    in one transfer, never the whole table.

    Parameters
    ----------
    req_to_token : numpy array or torch tensor (CPU or CUDA), int [max_requests, max_context_len]
        Each request-pool row's KV-pool slot ids in context order.
    req_pool_indices : array-like or tensor, int [batch]
        The table row of each request of the batch, in ``[0, max_requests)``.
    seq_lens : array-like or tensor, int [batch]
        Context length of each request, the token being decoded included, in
        ``[1, max_context_len]``.

    Returns
    -------
    KVTree
        Query ``j`` for request ``j`` of the batch.

    Raises
    ------
    ValueError
        Naming the argument: an empty batch, ``req_pool_indices`` and ``seq_lens`` of
        different lengths, non-integer dtypes or wrong dimensions, an index outside the
        table, a length outside ``[1, max_context_len]``, or a negative slot (or one
        beyond int32) within a request's context.
    """
    idx = _host_array("req_pool_indices", req_pool_indices, 1, allow_device=True)
    lens = _host_array("seq_lens", seq_lens, 1, allow_device=True)
    if idx.size == 0:
        raise ValueError("req_pool_indices is empty: a batch needs at least one request")
    if lens.size != idx.size:
        raise ValueError(
            f"seq_lens has {lens.size} entries but req_pool_indices has {idx.size}: one of each per request"
        )
    shape = tuple(req_to_token.shape) if hasattr(req_to_token, "shape") else np.shape(req_to_token)
    if len(shape) != 2:
        raise ValueError(f"req_to_token must be a 2-D integer table [max_requests, max_context_len], got shape {shape}")
    max_requests, max_context = int(shape[0]), int(shape[1])
    bad = np.flatnonzero((idx < 0) | (idx >= max_requests))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"req_pool_indices[{j}] = {int(idx[j])} is out of range [0, {max_requests}) of req_to_token")
    bad = np.flatnonzero((lens < 1) | (lens > max_context))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"seq_lens[{j}] = {int(lens[j])} is out of range [1, {max_context}] (req_to_token's width)")
    width = int(lens.max())
    if _is_tensor(req_to_token):
        import torch  # a tensor was given, so torch is installed

        if req_to_token.dtype.is_floating_point or req_to_token.dtype.is_complex or req_to_token.dtype == torch.bool:
            raise ValueError(f"req_to_token must hold integers, got dtype {req_to_token.dtype}")
        rows_t = req_to_token[torch.as_tensor(idx, device=req_to_token.device), :width]
        rows = _host_array("req_to_token", rows_t, 2, allow_device=True, keep_dtype=True)
    else:
        table = np.asarray(req_to_token)
        rows = _host_array("req_to_token", table[idx, :width], 2, keep_dtype=True)
    # the trie reads each row's context in place (no compacted copy): row j starts at j * width
    starts = np.arange(idx.size, dtype=np.int64) * width
    if rows.dtype.itemsize <= 4:
        # 4-byte images tell every two slots apart, so the trie holds each context entry in a
        # node and KVTree checks their range; only a failed check pays the masked pass over the
        # rows below, which names the entry
        try:
            return _trie(rows.reshape(-1), starts, lens)
        except ValueError:
            pass
    _check_req_to_token_range(rows, lens, idx)
    return _trie(rows.reshape(-1), starts, lens)


def _check_req_to_token_range(rows: np.ndarray, lens: np.ndarray, idx: np.ndarray) -> None:
    """``ValueError`` naming the first entry of a request's context (``rows[j, :lens[j]]``) that is
    a negative slot or one beyond int32, in ``req_to_token``'s own row (``idx[j]``) and column."""
    mask = np.arange(rows.shape[1]) < lens[:, None]
    info = np.iinfo(rows.dtype)
    lo = int(np.min(rows, where=mask, initial=info.max)) if rows.size else 0
    hi = int(np.max(rows, where=mask, initial=info.min)) if rows.size else 0
    if lo < 0 or hi > _INT32_MAX:
        flat = rows[mask].astype(np.int64)  # only to name the bad entry
        indptr = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(lens, out=indptr[1:])
        _check_slot_range(flat, indptr, lambda j, k: f"req_to_token[{int(idx[j])}, {k}] (request {j}'s context)")


def _integer_arrays(entries: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
    """``(slots, lengths)`` of ``entries`` when every entry is a 1-D numpy array of a signed,
    or narrower than 64-bit unsigned, integer dtype (or a CPU tensor,
    :func:`_integer_tensors`): the slots back to back (one concatenation, an integer dtype
    that holds every entry's values) and each entry's length (int64 [n_entries]); None for any
    other entry, which the per-entry checks then name. The fast path of
    :func:`tree_from_radix_nodes` and :func:`tree_from_token_slots`: a server hands over one array
    per node or request every step, and checking each through
    :func:`fasttree.validation.check_int_array` cost about as much as planning the tree."""
    if _is_tensor(entries[0]):
        return _integer_tensors(entries)
    lengths = np.empty(len(entries), dtype=np.int64)
    for i, a in enumerate(entries):
        if type(a) is not np.ndarray or a.ndim != 1:
            return None
        kind = a.dtype.kind
        if kind != "i" and (kind != "u" or a.dtype.itemsize == 8):
            return None
        lengths[i] = a.size
    return np.concatenate(entries), lengths


def _integer_tensors(entries: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_integer_arrays` for CPU torch tensors of one type, each 1-D of a signed integer
    dtype or uint8 (one ``torch.cat``, on the host; an engine's radix cache may keep a tensor per
    node); None for any other entry."""
    import torch  # the caller holds torch tensors: torch is imported already

    kind = type(entries[0])
    if not issubclass(kind, torch.Tensor):  # tensor-like, not a tensor: the per-entry checks
        return None
    integer = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    lengths = np.empty(len(entries), dtype=np.int64)
    for i, a in enumerate(entries):
        if type(a) is not kind or a.device.type != "cpu" or a.dim() != 1 or a.dtype not in integer:
            return None
        lengths[i] = a.numel()
    return torch.cat(list(entries)).detach().numpy(), lengths


def tree_from_radix_nodes(parents: Any, node_slots: Sequence, request_nodes: Any, *, prune: bool = False) -> KVTree:
    """The KV tree of a batch from a radix cache's own nodes.

    A thin, validating wrapper around ``KVTree(parents, node_slots, request_nodes)`` for
    engines that keep their prefix cache as a radix tree: request ``j``'s context is the
    concatenation of the slots of the nodes on the root path of ``request_nodes[j]``.
    Tokens a request holds outside the cache (a decode tail not yet inserted) must be
    given as nodes of their own (a child of the node where its cached prefix ends).

    Parameters
    ----------
    parents : array-like or CPU tensor, int [n_nodes]
        Parent node id of each node, ``-1`` for a root (several roots make a forest). The
        cache's empty root node may be passed as an empty root.
    node_slots : sequence of n_nodes 1-D int arrays, lists or CPU tensors
        ``node_slots[i]``, int [len_i]: node ``i``'s KV-pool slot ids in context order
        (``len_i >= 0``; slots in ``[0, 2**31)``).
    request_nodes : array-like or CPU tensor, int [n_requests]
        The node where each request's context ends, in ``[0, n_nodes)``; any node,
        internal ones included; several requests may end at one node.
    prune : bool
        Drop the nodes no request reads (the rest of the cache), renumbering the kept
        nodes in increasing order of their ids; only the kept nodes' slots are read and
        checked, so the cost follows the batch's tokens, not the cache's. Off by default:
        node ids stay the cache's.

    Returns
    -------
    KVTree
        Query ``j`` for request ``j``.

    Raises
    ------
    ValueError
        Naming the argument: empty ``parents`` or ``request_nodes``, ``node_slots`` of
        another length than ``parents``, non-integer or non-1-D entries, tensors on a GPU,
        ``request_nodes`` out of range, parent ids out of range or cycles, negative slots,
        or a request whose context holds no token.
    """
    par = _host_array("parents", parents, 1)
    n = par.size
    if n == 0:
        raise ValueError("parents is empty: the radix tree needs at least one node")
    if isinstance(node_slots, (str, bytes)) or not hasattr(node_slots, "__len__"):
        raise ValueError(f"node_slots must be a sequence of 1-D slot arrays, got {type(node_slots).__name__}")
    if len(node_slots) != n:
        raise ValueError(f"node_slots has {len(node_slots)} entries but parents has {n} nodes")
    req = _host_array("request_nodes", request_nodes, 1)
    if req.size == 0:
        raise ValueError("request_nodes is empty: a batch needs at least one request")
    bad = np.flatnonzero((req < 0) | (req >= n))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"request_nodes[{j}] = {int(req[j])} is out of range [0, {n}) of the radix nodes")
    if not prune:
        flat, lengths = _flat_entries(node_slots, "node_slots", range(n))
        return KVTree.from_flat(par, lengths, flat, req)  # checks parents (range, cycles), slots, contexts
    # only the requests' root paths are read: the structure alone first (one token a node; it checks
    # the parents' range and cycles), then the kept nodes' slots, so a step costs the batch's
    # tokens, not the cache's
    shape = KVTree._from_lengths(par, np.ones(n, dtype=np.int64), req)
    keep = shape.subtree_queries > 0
    kept = np.flatnonzero(keep)
    new_id = np.cumsum(keep) - 1  # a kept node's parent is kept: it is on the same requests' paths
    kept_parents = par[kept]
    flat, lengths = _flat_entries([node_slots[i] for i in kept.tolist()], "node_slots", kept.tolist())
    if kept.size < n:
        logger.debug("radix tree pruned from %d to %d nodes", n, kept.size)
    return KVTree.from_flat(
        np.where(kept_parents >= 0, new_id[np.maximum(kept_parents, 0)], -1), lengths, flat, new_id[req]
    )


def _flat_entries(
    entries: Sequence, name: str, ids: Sequence[int], *, empty_ok: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, lengths)`` of the 1-D slot arrays ``entries`` back to back: one concatenation
    where :func:`_integer_arrays` takes them, else each entry checked in order and named
    ``{name}[{id}]`` by its id in ``ids`` (and, unless ``empty_ok``, refused when empty: a
    request's context)."""
    flat_lengths = _integer_arrays(entries)
    if flat_lengths is not None and (empty_ok or flat_lengths[1].all()):
        return flat_lengths
    arrays = []
    for i, s in zip(ids, entries, strict=True):
        arr = _host_array(f"{name}[{i}]", s, 1)
        if not empty_ok and arr.size == 0:
            raise ValueError(f"{name}[{i}] is empty: a request's context holds at least the token being decoded")
        arrays.append(arr)
    return np.concatenate(arrays), np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
