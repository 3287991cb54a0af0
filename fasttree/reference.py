"""Float64 reference of tree decode attention (torch, any device, slow but exact)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .tree import KVTree


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: KVTree,
    sm_scale: float | None = None,
    *,
    queries: np.ndarray | None = None,
) -> torch.Tensor:
    """Exact attention of each query over its root-path context, in float64.

    Parameters
    ----------
    q : Tensor [n_queries, Hq, D]
    k_cache, v_cache : Tensor [pool_slots, Hkv, D]
    tree : KVTree
    sm_scale : float, optional
        ``1 / sqrt(D)`` by default.
    queries : ndarray of int, optional
        Only these query rows (e.g. a sample, for big trees); all by default.

    Returns
    -------
    Tensor, float64 [len(queries), Hq, D], on q's device
    """
    nq, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    indptr, slots = tree.query_slots()
    rows = np.arange(nq) if queries is None else np.asarray(queries)
    out = torch.empty((rows.size, hq, d), dtype=torch.float64, device=q.device)
    slots_t = torch.from_numpy(slots.astype(np.int64)).to(q.device)
    for i, j in enumerate(rows.tolist()):
        idx = slots_t[indptr[j] : indptr[j + 1]]
        k = k_cache[idx].double().repeat_interleave(g, dim=1)  # [L, Hq, D]
        v = v_cache[idx].double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[j].double(), k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out


def max_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst per-query relative error ``||out_j - ref_j|| / ||ref_j||`` over the rows.

    Parameters
    ----------
    out : Tensor [n, Hq, D], any float dtype
    ref : Tensor, float64 [n, Hq, D], same device
        The reference rows (:func:`reference_attention`) for the same queries.
    """
    num = (out.double() - ref).flatten(1).norm(dim=1)
    den = ref.flatten(1).norm(dim=1).clamp_min(1e-30)
    return float((num / den).max())
