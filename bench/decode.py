"""End-to-end decode benchmark: a 7B-shaped decoder serving the FastTree paper's scenarios.

A Llama-2-7B-shaped decoder (hidden 4096, 32 query and 32 KV heads of 128, SwiGLU MLP
11008, RMSNorm, vocab 32000) and a Mistral-7B-shaped GQA-4 one (8 KV heads, MLP 14336),
with random fp16 weights (``N(0, 1) / sqrt(fan_in)``, so activations stay finite) and
RoPE, decode the batches of :func:`fasttree.toolkit.workloads.iter_serving`: every step's KV tree
is one decode batch (its queries are the active requests, one new token each). One step:
embed the tokens; per layer RMSNorm, fused QKV projection, RoPE, write the new token's K
and V into the layer's pools ``[pool_slots + 1, Hkv, D]`` at each request's write slot
(the last slot of its context; the extra last slot of the pools takes the padding rows'
writes), attention over the
tree, O projection, residual, RMSNorm, MLP, residual; final RMSNorm, LM head, greedy
argmax. Input tokens are a hash of (request id, step): their values do not matter.
The pools start as random N(0, 1) values, never zeros.

Pool slots (``--slots``): ``stable`` (default) keeps every node's tokens at the slots they
were given, as a server's token allocator does: a node keeps its slots while it is in the
trees, a new token takes a free slot (the lowest freed one first, else a new one), and a
node that leaves the trees frees its slots. ``contiguous`` lays each step's tree out anew in
slots ``0..tokens-1`` (the layout of the serving simulator's trees).

The GEMMs are ``torch.nn.functional.linear``; the ops between them run, by default, as a
serving engine runs them, in three fused Triton kernels (:mod:`bench.model_ops`): residual
add + RMSNorm, RoPE of q and k + the K/V pool writes, SiLU-and-mul (the MLP's output is
added to the residual stream by the next RMSNorm). ``--unfused`` runs the same math as
separate torch ops instead (:func:`rms_norm`, :func:`apply_rope`, ``index_copy_``, ...:
the reference of the fused path).

Every tensor a step reads or writes has ``max_rows`` rows (the largest batch of the
scenario): rows past the step's queries are padding, so the whole step can be replayed
from CUDA graphs. Attention backends, all on the same model code (an
``attention(layer, q, out)`` hook):

* ``fasttree``: one :class:`fasttree.runtime.TreeAttentionRuntime` shared by all layers;
  per step ``plan(tree)`` on the host, then the whole step (all layers and the LM head)
  replayed from CUDA graphs, one per launch variant of the runtime's plans (captured in the
  compile pass).
* ``fasttree_overlap``: ``fasttree`` with the host planning of step ``i + 1`` (and its
  upload, stream-ordered after step ``i``) done while the GPU runs step ``i``, as a server
  with an overlapping scheduler would; a step's time is then the time between two
  consecutive device synchronisations.
* ``fasttree_piecewise``: the same runtime run eagerly between CUDA graphs of the
  non-attention segments (what the full graph adds).
* ``fasttree_fresh``: ``fasttree`` with every step planned afresh (``extend_steps=0``: no
  step's plan is the previous one extended to the new tokens).
* ``query_separated``: FlashDecoding-style split-KV per query
  (:func:`fasttree.plan_query_separated`, planned and uploaded once per step), eager
  between the segment graphs.
* ``query_separated_overlap``: ``query_separated`` with step ``i + 1`` planned and its plan
  uploaded (pinned, non-blocking) while the GPU runs step ``i``, as ``fasttree_overlap``
  does: the baseline of the overlapped ``fasttree`` row (``vs query_separated`` stays the
  ratio to the sequential baseline).
* ``sdpa``: each query's root-path K/V gathered into a padded ``[n, Hkv, Lmax, D]`` tensor
  (gather index built on the host and uploaded once per step, shared by the layers) and
  ``torch.nn.functional.scaled_dot_product_attention`` with an additive key-padding mask;
  GQA by viewing the ``g`` query heads of a KV head as ``g`` query rows (no KV copy per
  query head). Skipped for a scenario whose padded KV of one layer exceeds
  ``--sdpa-max-gib``.
* ``flashinfer_decode`` (only when named in ``--backends``): FlashInfer's
  ``BatchDecodeWithPagedKVCacheWrapper`` over each query's whole root path, page size 1 with
  the pools' slots as the pages (layout ``NHD``), tensor cores from GQA 4 on, planned once per
  step for all layers as SGLang's FlashInfer backend does, run eagerly between the segment
  graphs (:mod:`fasttree.toolkit.flashinfer_baseline`). Skipped, with the reason, when
  ``flashinfer`` cannot be imported or on the CPU.

Piecewise graphs: segment 0 is the embedding and layer 0 up to attention, segment ``l``
layer ``l - 1`` after attention and layer ``l`` up to it, the last one layer ``L - 1``
after attention and the head. On the CPU (``--device cpu``, needs ``TRITON_INTERPRET=1``
set before the run, for tests) the same code runs eagerly, without graphs.

Per (model, scenario, backend): ``--warmup`` untimed steps, then ``--steps`` timed ones,
each ended by a device synchronisation. Reported: tokens/s (decoded tokens / summed step
wall times), mean / p50 / p90 step latency, the host time of planning and upload and its
share of the step, the share of the step the GPU sat idle (:class:`StepClock`: what of the
host's work, planning included, is on the critical path; with ``*_overlap`` planning is
not), and the attention share (``1 - t_noattn / t``, ``t_noattn`` from the
same steps rerun with attention replaced by a copy and no planning, through the same
graphs: the share includes planning). The timed steps plan each tree as a new object
(:func:`as_new_tree`), without the index the planner cached on it in earlier passes, as a
server plans the new tree of every step. Correctness, on the first timed step: layer 0's
attention (outputs poisoned with NaN first, run eagerly) and the last layer's attention as
the timed step computed it (through the graphs) against the float64 reference on up to 32
sampled queries; and the last layer's attention of the last timed step the same way (after
every plan, extension and launch variant of the run).

Writes ``<label>.json`` (environment, with the host's planning speed on a reference tree
(:func:`host_reference_ms`): the plan share moves with it; args, workload summaries, rows) and
``<label>.md`` under ``--out``. Run from the repository root on the GPU::

    python -m bench.decode [--models llama,mistral] [--scenarios ...] [--backends ...]
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional

import fasttree as ft
from bench import model_ops
from fasttree.config import FastTreeConfig
from fasttree.fileio import write_atomic
from fasttree.planner import unprepared
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.bench_common import DTYPES, HBM_BYTES_PER_S, TOL, environment
from fasttree.toolkit.suite import paper_tree
from fasttree.toolkit.workloads import SCENARIOS, iter_serving

log = logging.getLogger("bench.decode")

BACKENDS = (
    "fasttree", "fasttree_overlap", "fasttree_piecewise", "fasttree_fresh", "query_separated",
    "query_separated_overlap", "sdpa",
)  # fmt: skip
#: Peers' backends: accepted by ``--backends``, not run by default (they need ``flashinfer`` importable).
PEER_BACKENDS = ("flashinfer_decode",)
#: Pool-slot layouts of the workloads' trees (``--slots``).
SLOT_LAYOUTS = ("stable", "contiguous")
CHECK_QUERIES = 32
#: How the non-attention ops ran, by ``fused`` (the report's ``non_attention_ops``).
NON_ATTENTION_OPS = {True: "fused RMSNorm/RoPE/SiLU Triton kernels", False: "torch ops"}
#: Per-layer attention callback: ``attention(layer, q [B, Hq, D], out [B, Hq, D])`` writes ``out``.
Attention = Callable[[int, torch.Tensor, torch.Tensor], None]


# ----------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    Attributes
    ----------
    name : str
    hidden : int
        Model width.
    num_q_heads, num_kv_heads, head_dim : int
        Attention heads (``num_q_heads * head_dim`` need not equal ``hidden``).
    intermediate : int
        SwiGLU MLP width.
    vocab : int
    layers : int
        Default layer count.
    rms_eps : float
    rope_theta : float
    """

    name: str
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0


MODELS: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama-2-7b", 4096, 32, 32, 128, 11008, 32000, 32),
    "mistral": ModelSpec("mistral-7b", 4096, 32, 8, 128, 14336, 32000, 32, rope_theta=1e6),
    # for tests and smoke runs
    "tiny": ModelSpec("tiny", 64, 4, 2, 16, 128, 100, 2),
}


@dataclass
class LayerWeights:
    """One decoder layer's weights (``torch.nn.functional.linear`` layout ``[out, in]``)."""

    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    wo: torch.Tensor  # [hidden, Hq D]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]


@dataclass
class Model:
    """Random weights of a decoder of :class:`ModelSpec` shape with ``len(layers)`` layers."""

    spec: ModelSpec
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    dtype: torch.dtype
    device: torch.device

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def _random(shape: tuple[int, ...], scale: float, gen: torch.Generator, dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(scale)


def build_model(spec: ModelSpec, *, layers: int, dtype: torch.dtype, device: torch.device, seed: int) -> Model:
    """Random weights: projections ``N(0, 1) / sqrt(fan_in)``, embedding ``N(0, 1)``, norms 1.

    Parameters
    ----------
    spec : ModelSpec
    layers : int
        Decoder layers (>= 1).
    dtype : torch.dtype
    device : torch.device
    seed : int

    Returns
    -------
    Model
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hq, hkv, d, inter = spec.hidden, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate

    def rand(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        return _random(shape, fan_in**-0.5, gen, dtype, device)

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=dtype, device=device)

    weights = [
        LayerWeights(
            attn_norm=ones(),
            wqkv=rand(((hq + 2 * hkv) * d, h), h),
            wo=rand((h, hq * d), hq * d),
            mlp_norm=ones(),
            w_gate_up=rand((2 * inter, h), h),
            w_down=rand((h, inter), inter),
        )
        for _ in range(layers)
    ]
    return Model(
        spec=spec,
        embed=_random((spec.vocab, h), 1.0, gen, dtype, device),
        layers=weights,
        final_norm=ones(),
        lm_head=rand((spec.vocab, h), h),
        dtype=dtype,
        device=device,
    )


# -------------------------------------------------------------------------- workload
@dataclass
class Workload:
    """The decode steps of one serving scenario and the host inputs of each.

    Attributes
    ----------
    scenario : str
    trees : list of KVTree
        Warm-up steps first, then the timed ones.
    inputs : list of ndarray, int64 [3, max_rows]
        Per step: input tokens, K/V write slots, RoPE positions; rows past the step's
        queries are padding (token 0, the sink slot, position 0).
    warmup : int
        Leading untimed steps.
    max_rows : int
        Most queries of a step: the row count of every batch buffer.
    pool_slots : int
        Most ``tree.max_slot + 1`` of a step; the pools have one more (sink) slot.
    max_position : int
        Longest context of a query (RoPE table length).
    """

    scenario: str
    trees: list[ft.KVTree]
    inputs: list[np.ndarray]
    warmup: int
    max_rows: int
    pool_slots: int
    max_position: int

    @property
    def pool_rows(self) -> int:
        """Rows of each KV pool: the tree slots and the sink slot of the padding rows."""
        return self.pool_slots + 1

    @property
    def timed(self) -> range:
        """Indices of the timed steps."""
        return range(self.warmup, len(self.trees))

    def summary(self) -> dict[str, Any]:
        """Sizes of the timed steps' trees."""
        trees = [self.trees[i] for i in self.timed]
        ctx = [float(t.path_lengths[t.query_nodes].mean()) for t in trees]
        return {
            "scenario": self.scenario,
            "steps": len(trees),
            "queries_mean": float(np.mean([t.n_queries for t in trees])),
            "queries_max": int(max(t.n_queries for t in trees)),
            "max_rows": self.max_rows,
            "tree_tokens_mean": float(np.mean([t.num_tokens for t in trees])),
            "context_mean": float(np.mean(ctx)),
            "pool_slots": self.pool_slots,
            "max_position": self.max_position,
        }


def last_context_slots(tree: ft.KVTree) -> np.ndarray:
    """Pool slot of the last token of every query's context, int64 [n_queries]."""
    node = tree.query_nodes.copy()
    empty = tree.lengths[node] == 0
    while empty.any():  # a query at an empty node reads its nearest non-empty ancestor last
        node[empty] = tree.parents[node[empty]]
        empty = tree.lengths[node] == 0
    return tree.slots[tree.slot_indptr[node + 1] - 1].astype(np.int64)


def as_new_tree(tree: ft.KVTree) -> ft.KVTree:
    """``tree`` as a new object, without the index the planner caches on a tree it planned
    (:func:`fasttree.planner.unprepared`).

    The benchmark plans each step's tree several times (compile pass, warm-up, check, timed
    steps); a server builds a new tree every step, so the timed steps plan new objects and pay
    for that index as a server would.
    """
    return unprepared(tree)


def stable_slot_trees(served: list) -> list[ft.KVTree]:
    """The trees of ``served`` (:class:`fasttree.toolkit.workloads.ServingStep`) with every node's tokens
    kept at fixed pool slots across steps, as a server's token allocator keeps them.

    A node (by ``node_ids``) keeps the slots it was given while it appears in the trees; its new
    tokens take free slots, the lowest freed one first, else the next unused one; a node
    that no longer appears frees its slots (a node that comes back gets new ones).
    """
    slots_of: dict[int, np.ndarray] = {}
    free: list[int] = []  # a min-heap of freed slots
    fresh = 0
    trees = []
    for s in served:
        live = set(s.node_ids.tolist())
        for nid in [n for n in slots_of if n not in live]:
            for slot in slots_of.pop(nid).tolist():
                heapq.heappush(free, slot)
        node_slots = []
        for nid, length in zip(s.node_ids.tolist(), s.tree.lengths.tolist(), strict=True):
            have = slots_of.get(nid, np.zeros(0, dtype=np.int64))
            need = length - have.size
            if need < 0:
                raise AssertionError(f"node {nid} shrank from {have.size} to {length} tokens")
            if need:
                reuse = [heapq.heappop(free) for _ in range(min(need, len(free)))]
                new = np.arange(fresh, fresh + need - len(reuse), dtype=np.int64)
                fresh += new.size
                have = np.concatenate([have, np.asarray(reuse, dtype=np.int64), new])
                slots_of[nid] = have
            node_slots.append(have)
        trees.append(ft.KVTree(s.tree.parents, node_slots, s.tree.query_nodes))
    return trees


def make_workload(
    scenario: str, *, seed: int, warmup: int, steps: int, max_batch: int | None, vocab: int, slots: str = "stable"
) -> Workload:
    """Simulate ``warmup + steps`` decode steps of ``scenario`` and build each step's inputs.

    Parameters
    ----------
    scenario : str
        A key of :data:`fasttree.toolkit.workloads.SCENARIOS`.
    seed : int
    warmup, steps : int
    max_batch : int, optional
        Cap on active requests (the scenario's default when None).
    vocab : int
        Input tokens are drawn below it.
    slots : {"stable", "contiguous"}
        Pool-slot layout (:data:`SLOT_LAYOUTS`; module docstring).

    Returns
    -------
    Workload
    """
    if slots not in SLOT_LAYOUTS:
        raise ValueError(f"slots must be one of {SLOT_LAYOUTS}, got {slots!r}")
    served = list(iter_serving(scenario, seed=seed, steps=warmup + steps, max_batch=max_batch))
    if len(served) < warmup + steps:
        raise ValueError(f"scenario {scenario} yielded {len(served)} steps, fewer than {warmup + steps}")
    trees = stable_slot_trees(served) if slots == "stable" else [s.tree for s in served]
    max_rows = max(t.n_queries for t in trees)
    pool_slots = max(t.max_slot + 1 for t in trees)
    inputs = []
    for s, t in zip(served, trees, strict=True):
        n = t.n_queries
        arr = np.zeros((3, max_rows), dtype=np.int64)
        arr[0, :n] = (s.request_ids * 1_000_003 + s.step * 7919) % vocab
        arr[1, :n] = last_context_slots(t)
        arr[1, n:] = pool_slots  # the sink slot
        arr[2, :n] = t.path_lengths[t.query_nodes] - 1
        inputs.append(arr)
    max_position = max(int(t.path_lengths[t.query_nodes].max()) for t in trees)
    return Workload(scenario, trees, inputs, warmup, max_rows, pool_slots, max_position)


# ------------------------------------------------------------------------ buffers
@dataclass
class StepBuffers:
    """Static device buffers of one decode step (fixed addresses, so graphs can replay them).

    Attributes
    ----------
    inputs : Tensor, int64 [3, max_rows]
        Rows ``tokens``, ``write_slots``, ``positions`` (views below).
    staging : Tensor, int64 [3, max_rows]
        Host copy of ``inputs`` (pinned on a GPU), uploaded with one copy per step.
    uploaded : torch.cuda.Event or None
        Recorded after the last upload (None on the CPU).
    hidden : Tensor [max_rows, hidden]
        The residual stream.
    q, attn_out : Tensor [max_rows, Hq, D]
        The attention's input and output of the current layer.
    normed : Tensor [max_rows, hidden]
        The fused path's RMSNorm output (the input of the QKV, gate/up and LM-head GEMMs).
    mlp_act : Tensor [max_rows, intermediate]
        The fused path's SwiGLU activation (the input of the down projection).
    k_pools, v_pools : Tensor [layers, pool_rows, Hkv, D]
    rope_cos, rope_sin : Tensor, float32 [max_position, D / 2]
        RoPE tables; ``cos``, ``sin`` [max_rows, 1, D / 2] are the step's rows of them.
    logits : Tensor [max_rows, vocab]
    next_tokens : Tensor, int64 [max_rows]
    """

    inputs: torch.Tensor
    staging: torch.Tensor
    hidden: torch.Tensor
    q: torch.Tensor
    attn_out: torch.Tensor
    normed: torch.Tensor
    mlp_act: torch.Tensor
    k_pools: torch.Tensor
    v_pools: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    logits: torch.Tensor
    next_tokens: torch.Tensor
    uploaded: Any = None

    @property
    def tokens(self) -> torch.Tensor:
        return self.inputs[0]

    @property
    def write_slots(self) -> torch.Tensor:
        return self.inputs[1]

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs[2]


def allocate_buffers(model: Model, workload: Workload) -> StepBuffers:
    """Allocate the static buffers and pools of ``model`` for ``workload`` (pools not yet filled)."""
    spec, dev, dt = model.spec, model.device, model.dtype
    rows, hq, hkv, d = workload.max_rows, spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    pin = dev.type == "cuda"
    inv_freq = spec.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(workload.max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    pools = (model.n_layers, workload.pool_rows, hkv, d)
    return StepBuffers(
        inputs=torch.zeros((3, rows), dtype=torch.int64, device=dev),
        staging=torch.zeros((3, rows), dtype=torch.int64, pin_memory=pin),
        hidden=torch.zeros((rows, spec.hidden), dtype=dt, device=dev),
        q=torch.zeros((rows, hq, d), dtype=dt, device=dev),
        attn_out=torch.zeros((rows, hq, d), dtype=dt, device=dev),
        normed=torch.zeros((rows, spec.hidden), dtype=dt, device=dev),
        mlp_act=torch.zeros((rows, spec.intermediate), dtype=dt, device=dev),
        k_pools=torch.empty(pools, dtype=dt, device=dev),
        v_pools=torch.empty(pools, dtype=dt, device=dev),
        rope_cos=angles.cos().float().to(dev),
        rope_sin=angles.sin().float().to(dev),
        cos=torch.zeros((rows, 1, d // 2), dtype=torch.float32, device=dev),
        sin=torch.zeros((rows, 1, d // 2), dtype=torch.float32, device=dev),
        logits=torch.zeros((rows, spec.vocab), dtype=dt, device=dev),
        next_tokens=torch.zeros(rows, dtype=torch.int64, device=dev),
    )


def fill_pools(buf: StepBuffers, seed: int) -> None:
    """Refill every K/V pool with N(0, 1) values (the same for a given seed)."""
    gen = torch.Generator(device=buf.k_pools.device).manual_seed(seed)
    buf.k_pools.normal_(generator=gen)
    buf.v_pools.normal_(generator=gen)


def upload_inputs(buf: StepBuffers, workload: Workload, step: int) -> None:
    """Copy step ``step``'s tokens, write slots and positions into the static input buffer."""
    if buf.uploaded is not None:
        buf.uploaded.synchronize()  # the previous copy out of the staging buffer is done
    buf.staging.copy_(torch.from_numpy(workload.inputs[step]))
    buf.inputs.copy_(buf.staging, non_blocking=True)
    if buf.inputs.is_cuda:
        if buf.uploaded is None:
            buf.uploaded = torch.cuda.Event()
        buf.uploaded.record()


class StepClock:
    """The device time of each timed step: CUDA events recorded on the current stream right before
    the step's first launch and right after its last (no events on the CPU, where :meth:`seconds`
    is None). The events are made before the timed loop and read after it."""

    def __init__(self, device: torch.device, steps: int) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(steps)]  # fmt: skip

    def start(self, j: int) -> None:
        if self.events is not None:
            self.events[j][0].record()

    def stop(self, j: int) -> None:
        if self.events is not None:
            self.events[j][1].record()

    def seconds(self) -> list[float] | None:
        """Per timed step, the seconds between its two events (call after the last synchronisation)."""
        if self.events is None:
            return None
        return [a.elapsed_time(b) / 1e3 for a, b in self.events]


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -------------------------------------------------------------------------- step
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in ``x``'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim of ``x`` [B, H, D] by the angles of ``cos``/``sin`` [B, 1, D/2]."""
    x32 = x.float()
    a, b = x32.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


def embed(model: Model, buf: StepBuffers) -> None:
    """Token embeddings into the residual stream; the step's RoPE rows."""
    buf.hidden.copy_(functional.embedding(buf.tokens, model.embed))
    buf.cos.copy_(buf.rope_cos[buf.positions].unsqueeze(1))
    buf.sin.copy_(buf.rope_sin[buf.positions].unsqueeze(1))


def pre_attention(model: Model, buf: StepBuffers, layer: int) -> None:
    """Layer ``layer`` up to attention: norm, QKV, RoPE, K/V written to the pools, ``buf.q``."""
    spec, w = model.spec, model.layers[layer]
    hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    rows = buf.hidden.shape[0]
    qkv = functional.linear(rms_norm(buf.hidden, w.attn_norm, spec.rms_eps), w.wqkv)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=1)
    buf.q.copy_(apply_rope(q.view(rows, hq, d), buf.cos, buf.sin))
    buf.k_pools[layer].index_copy_(0, buf.write_slots, apply_rope(k.view(rows, hkv, d), buf.cos, buf.sin))
    buf.v_pools[layer].index_copy_(0, buf.write_slots, v.view(rows, hkv, d))


def post_attention(model: Model, buf: StepBuffers, layer: int) -> None:
    """Layer ``layer`` after attention: O projection, residual, norm, SwiGLU MLP, residual."""
    spec, w = model.spec, model.layers[layer]
    rows = buf.hidden.shape[0]
    buf.hidden.add_(functional.linear(buf.attn_out.view(rows, -1), w.wo))
    gate, up = functional.linear(rms_norm(buf.hidden, w.mlp_norm, spec.rms_eps), w.w_gate_up).chunk(2, dim=1)
    buf.hidden.add_(functional.linear(functional.silu(gate) * up, w.w_down))


def lm_head(model: Model, buf: StepBuffers) -> None:
    """Final norm, LM head and greedy argmax into ``buf.logits`` / ``buf.next_tokens``."""
    x = rms_norm(buf.hidden, model.final_norm, model.spec.rms_eps)
    buf.logits.copy_(functional.linear(x, model.lm_head))
    buf.next_tokens.copy_(buf.logits.argmax(dim=1))


def fused_pre_attention(model: Model, buf: StepBuffers, layer: int, delta: torch.Tensor | None) -> None:
    """:func:`pre_attention` with the Triton kernels of :mod:`bench.model_ops`.

    ``delta`` (the previous layer's MLP output, None for layer 0) is added to the residual
    stream by the RMSNorm kernel; then the QKV GEMM and one RoPE + K/V write launch.
    """
    spec, w = model.spec, model.layers[layer]
    model_ops.rms_norm(buf.hidden, w.attn_norm, spec.rms_eps, delta=delta, out=buf.normed)
    qkv = functional.linear(buf.normed, w.wqkv)
    model_ops.rope_kv_write(qkv, buf.cos, buf.sin, buf.write_slots, buf.k_pools[layer], buf.v_pools[layer], out=buf.q)


def fused_post_attention(model: Model, buf: StepBuffers, layer: int) -> torch.Tensor:
    """:func:`post_attention` with the Triton kernels of :mod:`bench.model_ops`.

    The O projection's output is added to the residual stream by the MLP's RMSNorm kernel;
    the MLP's output is returned, not added: the next RMSNorm (the next layer's, or the
    final one) adds it, as a serving engine's fused add-RMSNorm does.
    """
    spec, w = model.spec, model.layers[layer]
    rows = buf.hidden.shape[0]
    attn = functional.linear(buf.attn_out.view(rows, -1), w.wo)
    model_ops.rms_norm(buf.hidden, w.mlp_norm, spec.rms_eps, delta=attn, out=buf.normed)
    model_ops.silu_mul(functional.linear(buf.normed, w.w_gate_up), out=buf.mlp_act)
    return functional.linear(buf.mlp_act, w.w_down)


def fused_lm_head(model: Model, buf: StepBuffers, delta: torch.Tensor) -> None:
    """:func:`lm_head` after adding ``delta`` (the last MLP's output) in the fused final RMSNorm."""
    model_ops.rms_norm(buf.hidden, model.final_norm, model.spec.rms_eps, delta=delta, out=buf.normed)
    buf.logits.copy_(functional.linear(buf.normed, model.lm_head))
    buf.next_tokens.copy_(buf.logits.argmax(dim=1))


def run_segment(model: Model, buf: StepBuffers, i: int, *, fused: bool = True) -> None:
    """Non-attention segment ``i`` of a step, ``0 <= i <= layers``: what runs between two attentions.

    ``fused``: the Triton kernels of :mod:`bench.model_ops` around the GEMMs (the MLP
    output of layer ``i - 1`` is added to the residual stream by the next RMSNorm, in the
    same segment); else the reference torch ops.
    """
    if not fused:
        if i == 0:
            embed(model, buf)
        else:
            post_attention(model, buf, i - 1)
        if i < model.n_layers:
            pre_attention(model, buf, i)
        else:
            lm_head(model, buf)
        return
    if i == 0:
        embed(model, buf)
        delta = None
    else:
        delta = fused_post_attention(model, buf, i - 1)
    if i < model.n_layers:
        fused_pre_attention(model, buf, i, delta)
    else:
        fused_lm_head(model, buf, delta)


def copy_attention(layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
    """The no-attention stand-in: ``out = q``."""
    out.copy_(q)


class StepRunner:
    """Runs decode steps eagerly, from piecewise CUDA graphs, or from one full-step graph.

    Parameters
    ----------
    model : Model
    buf : StepBuffers
    graphs : {"none", "piecewise", "full"}
        ``"piecewise"``: one graph per non-attention segment, attention eager between them;
        ``"full"``: one graph per attention callback (``key``), holding the whole step.
        Until :meth:`capture` has run, steps run eagerly.
    fused : bool
        Run the non-attention ops with the fused Triton kernels (default), else with the
        reference torch ops (see :func:`run_segment`).
    """

    def __init__(self, model: Model, buf: StepBuffers, graphs: str, *, fused: bool = True) -> None:
        if graphs not in ("none", "piecewise", "full"):
            raise ValueError(f"graphs must be 'none', 'piecewise' or 'full', got {graphs!r}")
        self.model, self.buf, self.graphs, self.fused = model, buf, graphs, fused
        self._pool = torch.cuda.graph_pool_handle() if graphs != "none" else None
        self._full: dict[str, torch.cuda.CUDAGraph] = {}
        self._segments: list[torch.cuda.CUDAGraph] | None = None
        self.late_captures = 0

    def eager(self, attention: Attention) -> None:
        """One step, every op launched from Python."""
        m, b = self.model, self.buf
        for layer in range(m.n_layers):
            run_segment(m, b, layer, fused=self.fused)
            attention(layer, b.q, b.attn_out)
        run_segment(m, b, m.n_layers, fused=self.fused)

    def _side_stream_step(self, attention: Attention) -> None:
        """Rerun the current step eagerly on a side stream (what CUDA-graph capture should follow)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.eager(attention)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture(self, attention: Attention, key: str | Callable[[], str]) -> None:
        """Capture the graphs; a no-op without graphs or when done.

        Call after an eager step whose inputs and plan are still in place: it is rerun on a
        side stream first, then the capture records without running anything. ``key`` names
        the full graph, or gives its name for the current step (the runtime's launch variant:
        one full graph per variant).
        """
        key = key() if callable(key) else key
        if self.graphs == "none" or (self.graphs == "full" and key in self._full) or self._segments is not None:
            return
        self._side_stream_step(attention)
        if self.graphs == "full":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.eager(attention)
            self._full[key] = graph
        else:
            segments = []
            for i in range(self.model.n_layers + 1):  # replayed in capture order: the pool may be shared
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    run_segment(self.model, self.buf, i, fused=self.fused)
                segments.append(graph)
            self._segments = segments

    def run(self, attention: Attention, key: str | Callable[[], str]) -> None:
        """One step with ``attention`` (its full graph is the one captured under ``key``, or under
        ``key()``; a full graph not captured yet is captured after an eager step, counted in
        :attr:`late_captures`)."""
        per_variant = callable(key)
        key = key() if per_variant else key
        if self.graphs == "full" and per_variant and key not in self._full:
            self.eager(attention)
            self.capture(attention, key)
            self.late_captures += 1
        elif self.graphs == "full" and key in self._full:
            self._full[key].replay()
        elif self.graphs == "piecewise" and self._segments is not None:
            b = self.buf
            for layer, graph in enumerate(self._segments[:-1]):
                graph.replay()
                attention(layer, b.q, b.attn_out)
            self._segments[-1].replay()
        else:
            self.eager(attention)

    @property
    def mode(self) -> str:
        """What ran: ``full_graph``, ``piecewise_graphs`` or ``eager``."""
        return {"full": "full_graph", "piecewise": "piecewise_graphs", "none": "eager"}[self.graphs]


# ------------------------------------------------------------------------ backends
class FastTreeBackend:
    """Tree attention through one :class:`TreeAttentionRuntime` shared by every layer.

    Parameters
    ----------
    model : Model
    buf : StepBuffers
    workload : Workload
    config : FastTreeConfig, export path or None
    full_graph : bool
        ``fasttree`` (True: the whole step is one graph) or ``fasttree_piecewise``.
    """

    def __init__(
        self, model: Model, buf: StepBuffers, workload: Workload, config, *, full_graph: bool, extend_steps: int = 8
    ) -> None:
        spec = model.spec
        self.name = "fasttree" if full_graph else "fasttree_piecewise"
        self.overlap = False
        self.graphs = "full" if full_graph else "piecewise"
        self.buf = buf
        rows = workload.max_rows
        self.rt = TreeAttentionRuntime(
            config,
            num_q_heads=spec.num_q_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=model.dtype,
            device=model.device,
            max_queries=rows,
            max_kv_entries=max(
                4 * workload.pool_rows, *(int(t.path_lengths[t.query_nodes].sum()) for t in workload.trees)
            ),
            max_units=1 << 16,
            max_partial_rows=32 * rows,
            pool_slots=workload.pool_rows,
            extend_steps=extend_steps,
        )
        self.plans = self.query_centric_plans = self.extended_plans = 0
        self.plan_s: dict[bool, list[float]] = {False: [], True: []}  # host time of each plan, by extended

    def graph_key(self) -> str:
        """The full-step graph of the current plan: one per launch variant of the runtime."""
        return f"attention/{self.rt.current_plan.variant_id}"

    def prepare_step(self, tree: ft.KVTree) -> None:
        """Plan ``tree`` on the host and upload the plan into the runtime's buffer."""
        t0 = time.perf_counter()
        uploaded = self.rt.plan(tree)
        self.plan_s[uploaded.extended].append(time.perf_counter() - t0)
        self.query_centric_plans += int(uploaded.query_centric)
        self.extended_plans += int(uploaded.extended)
        self.plans += 1

    def attention(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        self.rt.forward(q, self.buf.k_pools[layer], self.buf.v_pools[layer], out=out)

    def info(self) -> dict[str, Any]:
        return {
            "plans": self.plans,
            "query_centric_plans": self.query_centric_plans,
            "extended_plans": self.extended_plans,
            "extend_steps": self.rt.extend_steps,
            # median host time of runtime.plan over every call (compile pass, warm-up and timed
            # steps), fresh plans and extended ones apart: what extension saves per step
            "plan_ms_median_fresh": _median_ms(self.plan_s[False]),
            "plan_ms_median_extended": _median_ms(self.plan_s[True]),
            "config": self.rt.config.to_dict(),
        }


def _median_ms(seconds: list[float]) -> float | None:
    """The median of ``seconds`` in milliseconds (None when empty)."""
    return float(np.median(seconds)) * 1e3 if seconds else None


class QuerySeparatedBackend:
    """FlashDecoding-style split-KV attention per query, planned and uploaded once per step."""

    graphs = "piecewise"

    def __init__(self, model: Model, buf: StepBuffers, workload: Workload, *, overlap: bool = False) -> None:
        self.name = "query_separated_overlap" if overlap else "query_separated"
        self.overlap = overlap
        spec = model.spec
        self.buf = buf
        self.heads = {"num_q_heads": spec.num_q_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim}
        dev = model.device
        self.device = dev
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        self.plan: ft.DevicePlan | None = None
        self.n = 0

    def prepare_step(self, tree: ft.KVTree) -> None:
        """Plan the split-KV launch of ``tree`` on the host and upload it (without waiting, overlapped)."""
        plan = ft.plan_query_separated(tree, num_sms=self.num_sms, **self.heads)
        self.plan = plan.to(self.device, non_blocking=self.overlap)
        self.n = tree.n_queries

    def attention(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        n = self.n
        ft.tree_attention(q[:n], self.buf.k_pools[layer], self.buf.v_pools[layer], self.plan, out=out[:n])

    def info(self) -> dict[str, Any]:
        return {"num_sms": self.num_sms}


def sdpa_padded_length(tree: ft.KVTree) -> int:
    """Longest context of ``tree``'s queries, rounded up to a multiple of 16."""
    return -(-int(tree.path_lengths[tree.query_nodes].max()) // 16) * 16


def sdpa_kv_bytes(workload: Workload, spec: ModelSpec, elem_bytes: int) -> int:
    """Most bytes of one layer's gathered, padded K and V over the workload's steps."""
    return max(
        2 * t.n_queries * sdpa_padded_length(t) * spec.num_kv_heads * spec.head_dim * elem_bytes for t in workload.trees
    )


class SdpaBackend:
    """PyTorch SDPA over each query's gathered root-path K/V with a key-padding mask."""

    name = "sdpa"
    graphs = "piecewise"

    def __init__(self, model: Model, buf: StepBuffers, workload: Workload) -> None:
        spec = model.spec
        self.buf = buf
        self.device, self.dtype = model.device, model.dtype
        self.hkv, self.g, self.d = spec.num_kv_heads, spec.num_q_heads // spec.num_kv_heads, spec.head_dim
        self.n = self.length = 0
        self.index: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def prepare_step(self, tree: ft.KVTree) -> None:
        """Build the padded gather index on the host, upload it once, and build the mask on the device."""
        indptr, slots = tree.query_slots()
        lens = np.diff(indptr)
        n, length = tree.n_queries, sdpa_padded_length(tree)
        host = np.zeros(n * length + n, dtype=np.int64)
        index = host[: n * length].reshape(n, length)
        index[np.arange(length)[None, :] < lens[:, None]] = slots
        host[n * length :] = lens
        dev = torch.from_numpy(host).to(self.device)  # the one upload of the step
        self.index, lens_t = dev[: n * length], dev[n * length :]
        valid = torch.arange(length, device=self.device)[None, :] < lens_t[:, None]
        mask = torch.zeros((n, length), dtype=self.dtype, device=self.device)
        self.mask = mask.masked_fill_(~valid, float("-inf")).view(n, 1, 1, length)
        self.n, self.length = n, length

    def attention(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        n, length, hkv, g, d = self.n, self.length, self.hkv, self.g, self.d
        k = self.buf.k_pools[layer].index_select(0, self.index).view(n, length, hkv, d).transpose(1, 2)
        v = self.buf.v_pools[layer].index_select(0, self.index).view(n, length, hkv, d).transpose(1, 2)
        # the g query heads of one KV head attend the same keys: g query rows of one SDPA head
        o = functional.scaled_dot_product_attention(q[:n].view(n, hkv, g, d), k, v, attn_mask=self.mask)
        out[:n].copy_(o.reshape(n, hkv * g, d))

    def info(self) -> dict[str, Any]:
        return {}


class FlashInferDecodeBackend:
    """FlashInfer's batch decode over each query's whole path (page size 1, the pools' slots as the
    pages), planned once per step for all layers."""

    name = "flashinfer_decode"
    graphs = "piecewise"

    def __init__(self, model: Model, buf: StepBuffers, workload: Workload) -> None:
        from fasttree.toolkit import flashinfer_baseline as fib

        fi, reason = fib.import_flashinfer()
        if fi is None:
            raise RuntimeError(reason)
        spec = model.spec
        self.fib = fib
        self.buf = buf
        self.dtype = model.dtype
        self.heads = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim)
        self.tensor_cores = fib.use_tensor_cores(spec.num_q_heads, spec.num_kv_heads)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            fib.shared_workspace(model.device), "NHD", use_tensor_cores=self.tensor_cores
        )
        self.n = 0

    def prepare_step(self, tree: ft.KVTree) -> None:
        """Build the step's page table on the host and plan the wrapper (it uploads the table)."""
        table = self.fib.decode_page_table(tree)
        hq, hkv, d = self.heads
        self.wrapper.plan(*self.fib.host_table(table), hq, hkv, d, 1, q_data_type=self.dtype, kv_data_type=self.dtype)
        self.n = tree.n_queries

    def attention(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        n = self.n
        cache = (self.buf.k_pools[layer].unsqueeze(1), self.buf.v_pools[layer].unsqueeze(1))  # [pages, 1, Hkv, D]
        self.wrapper.run(q[:n], cache, out=out[:n])

    def info(self) -> dict[str, Any]:
        return {"tensor_cores": self.tensor_cores, "page_size": 1, "flashinfer": self.fib.flashinfer_version()}


def peer_skip_reason(name: str, device: torch.device) -> str | None:
    """Why the peer backend ``name`` cannot run here (None: it can)."""
    if device.type != "cuda":
        return f"{name} needs a CUDA device"
    from fasttree.toolkit.flashinfer_baseline import import_flashinfer

    return import_flashinfer()[1]


def make_backend(name: str, model: Model, buf: StepBuffers, workload: Workload, config):
    """The backend ``name`` of :data:`BACKENDS` or :data:`PEER_BACKENDS` for ``model`` on ``workload``."""
    if name in ("fasttree", "fasttree_overlap", "fasttree_piecewise", "fasttree_fresh"):
        backend = FastTreeBackend(
            model, buf, workload, config, full_graph=name != "fasttree_piecewise",
            extend_steps=0 if name == "fasttree_fresh" else 8,
        )  # fmt: skip
        backend.name, backend.overlap = name, name == "fasttree_overlap"
        return backend
    if name in ("query_separated", "query_separated_overlap"):
        return QuerySeparatedBackend(model, buf, workload, overlap=name == "query_separated_overlap")
    if name == "sdpa":
        return SdpaBackend(model, buf, workload)
    if name == "flashinfer_decode":
        return FlashInferDecodeBackend(model, buf, workload)
    raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS + PEER_BACKENDS}")


# ---------------------------------------------------------------------- measurement
def sample_queries(n: int, seed: int) -> np.ndarray:
    """Up to :data:`CHECK_QUERIES` sorted query rows of ``n``."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(n, CHECK_QUERIES), replace=False))


def attention_error(buf: StepBuffers, layer: int, tree: ft.KVTree, seed: int) -> float:
    """Worst relative error of ``buf.attn_out`` against the float64 reference of ``buf.q`` over
    ``layer``'s pools, on sampled queries (NaN when an output is not finite)."""
    n = tree.n_queries
    rows = sample_queries(n, seed)
    out = buf.attn_out[torch.as_tensor(rows, device=buf.attn_out.device)]
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    ref = ft.reference_attention(buf.q[:n], buf.k_pools[layer], buf.v_pools[layer], tree, queries=rows)
    return ft.max_relative_error(out, ref)


def check_layer0(
    model: Model, buf: StepBuffers, workload: Workload, backend, step: int, seed: int, *, fused: bool = True
) -> float:
    """Layer 0's attention of step ``step``, run eagerly on NaN-poisoned outputs, vs the reference.

    Leaves the pools as the step itself leaves them (segment 0 writes the same K/V again).
    ``fused`` picks the non-attention path of segment 0 (see :func:`run_segment`).
    """
    tree = workload.trees[step]
    upload_inputs(buf, workload, step)
    backend.prepare_step(tree)
    run_segment(model, buf, 0, fused=fused)
    buf.attn_out[: tree.n_queries].fill_(float("nan"))
    backend.attention(0, buf.q, buf.attn_out)
    sync(model.device)
    return attention_error(buf, 0, tree, seed)


def time_steps(
    runner: StepRunner,
    workload: Workload,
    attention: Attention,
    key: str,
    prepare: Callable[[ft.KVTree], None] | None,
    *,
    on_first_timed: Callable[[], None] | None = None,
    after_first_timed: Callable[[], None] | None = None,
    keep_logits: list | None = None,
    overlap: bool = False,
) -> dict[str, np.ndarray]:
    """Warm up (the first step eager, then the graphs captured), then time every timed step.

    Before the warm-up, every step's tree is prepared and run through layer 0's attention
    once, untimed, so that no kernel compiles inside the timed steps (the baselines' launch
    parameters depend on the tree).

    Parameters
    ----------
    runner : StepRunner
    workload : Workload
    attention : callable
        The per-layer attention.
    key : str
        Names the full graph of ``attention``.
    prepare : callable, optional
        Per-step host planning and upload (timed separately, inside the step).
    on_first_timed, after_first_timed : callable, optional
        Called (untimed) before and after the first timed step.
    keep_logits : list, optional
        Receives each timed step's ``(logits, next_tokens)`` rows of its queries, on the CPU.
    overlap : bool
        Prepare step ``i + 1`` on the host while the device runs step ``i`` (the step's
        time is then measured between consecutive synchronisations).

    Returns
    -------
    dict
        ``step_s`` and ``plan_s`` (float64 [steps]), ``queries`` (int64 [steps]) and ``device_s``
        (float64 [steps]: :class:`StepClock`'s device time of each step; None on the CPU).
    """
    buf, dev = runner.buf, runner.model.device
    if prepare is not None:  # compile pass (and, for per-variant keys, one full graph per launch variant)
        for tree in workload.trees:
            prepare(tree)
            attention(0, buf.q, buf.attn_out)
            if callable(key) and runner.graphs == "full":
                runner.capture(attention, key)
        sync(dev)
    for i in range(workload.warmup):
        upload_inputs(buf, workload, i)
        if prepare is not None:
            prepare(workload.trees[i])
        runner.run(attention, key)
        sync(dev)
        if i == 0:
            runner.capture(attention, key)
    step_s, plan_s, queries = [], [], []
    clock = StepClock(dev, len(workload.timed))
    if overlap and prepare is not None:
        return _time_overlapped(runner, workload, attention, key, prepare, on_first_timed, after_first_timed,
                                keep_logits, clock)  # fmt: skip
    for j, i in enumerate(workload.timed):
        tree = as_new_tree(workload.trees[i])
        if i == workload.warmup and on_first_timed is not None:
            on_first_timed()
        sync(dev)
        t0 = time.perf_counter()
        upload_inputs(buf, workload, i)
        p0 = time.perf_counter()
        if prepare is not None:
            prepare(tree)
        p1 = time.perf_counter()
        clock.start(j)
        runner.run(attention, key)
        clock.stop(j)
        sync(dev)
        t1 = time.perf_counter()
        step_s.append(t1 - t0)
        plan_s.append(p1 - p0)
        queries.append(tree.n_queries)
        if i == workload.warmup and after_first_timed is not None:
            after_first_timed()
        if keep_logits is not None:
            keep_logits.append(_step_logits(buf, tree.n_queries))
    return _timings(step_s, plan_s, queries, clock.seconds())


def _step_logits(buf: StepBuffers, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last step's logits and next tokens of its ``n`` queries, on the CPU."""
    return buf.logits[:n].float().cpu(), buf.next_tokens[:n].cpu()


def _timings(
    step_s: list[float], plan_s: list[float], queries: list[int], device_s: list[float] | None
) -> dict[str, np.ndarray | None]:
    return {
        "step_s": np.array(step_s), "plan_s": np.array(plan_s), "queries": np.array(queries, dtype=np.int64),
        "device_s": None if device_s is None else np.array(device_s),
    }  # fmt: skip


def _time_overlapped(
    runner, workload, attention, key, prepare, on_first_timed, after_first_timed, keep_logits, clock: StepClock
):  # fmt: skip
    """The timed steps of :func:`time_steps` with step ``i + 1`` prepared while step ``i`` runs."""
    buf, dev = runner.buf, runner.model.device
    timed = list(workload.timed)
    if on_first_timed is not None:
        on_first_timed()
    upload_inputs(buf, workload, timed[0])
    prepare(as_new_tree(workload.trees[timed[0]]))
    sync(dev)
    step_s, plan_s, queries = [], [], []
    t_prev = time.perf_counter()
    for j, i in enumerate(timed):
        clock.start(j)
        runner.run(attention, key)  # enqueued; the host goes on while the device runs it
        clock.stop(j)
        p0 = p1 = time.perf_counter()
        if j + 1 < len(timed):  # stream-ordered after this step: safe to overwrite its inputs and plan
            upload_inputs(buf, workload, timed[j + 1])
            tree = as_new_tree(workload.trees[timed[j + 1]])
            p0 = time.perf_counter()  # the plan time, as in the sequential loop: planning and its upload only
            prepare(tree)
            p1 = time.perf_counter()
        sync(dev)
        t = time.perf_counter()
        step_s.append(t - t_prev)
        plan_s.append(p1 - p0)
        queries.append(workload.trees[i].n_queries)
        t_prev = t
        if keep_logits is not None:
            keep_logits.append(_step_logits(buf, workload.trees[i].n_queries))
        if j == 0 and after_first_timed is not None:
            after_first_timed()
        if keep_logits is not None or j == 0:
            t_prev = time.perf_counter()
    return _timings(step_s, plan_s, queries, clock.seconds())


def run_backend(
    name: str,
    model: Model,
    buf: StepBuffers,
    workload: Workload,
    args: argparse.Namespace,
    *,
    graphs: bool,
    keep_logits: list | None = None,
) -> dict[str, Any]:
    """Measure one backend on one workload (pools refilled first) and return its result row.

    Parameters
    ----------
    name : str
        A backend of :data:`BACKENDS`.
    model : Model
    buf : StepBuffers
    workload : Workload
    args : argparse.Namespace
        ``seed``, ``export`` and ``unfused`` are read.
    graphs : bool
        Use CUDA graphs (False: every step eager, the CPU path).
    keep_logits : list, optional
        See :func:`time_steps`.

    Returns
    -------
    dict
        The row's measurements (see :func:`summarize_times`).
    """
    fill_pools(buf, args.seed + 1)
    export = None if args.export in (None, "none") else args.export
    backend = make_backend(name, model, buf, workload, export)
    fused = not getattr(args, "unfused", False)
    runner = StepRunner(model, buf, backend.graphs if graphs else "none", fused=fused)
    errors: dict[str, float] = {}
    seed = args.seed

    def check_first() -> None:
        errors["layer0"] = check_layer0(model, buf, workload, backend, workload.warmup, seed, fused=fused)

    def check_last() -> None:
        tree = workload.trees[workload.warmup]
        errors["last_layer"] = attention_error(buf, model.n_layers - 1, tree, seed)

    with_attn = time_steps(
        runner,
        workload,
        backend.attention,
        getattr(backend, "graph_key", "attention"),
        backend.prepare_step,
        on_first_timed=check_first,
        after_first_timed=check_last,
        keep_logits=keep_logits,
        overlap=getattr(backend, "overlap", False),
    )
    # the last timed step's last layer, as it left q and the attention output (before the rerun below)
    errors["last_step"] = attention_error(buf, model.n_layers - 1, workload.trees[workload.timed[-1]], seed)
    without = time_steps(runner, workload, copy_attention, "copy", None)
    row = summarize_times(with_attn, without)
    tol = TOL[model.dtype]
    err = max(errors.values())
    row.update(
        mode=runner.mode,
        fused=fused,
        max_rel_err=err,
        max_rel_err_layer0=errors["layer0"],
        max_rel_err_last_layer=errors["last_layer"],
        max_rel_err_last_step=errors["last_step"],
        correct=bool(math.isfinite(err) and err <= tol),
        backend_info={**backend.info(), "full_graphs": len(runner._full), "late_captures": runner.late_captures},
    )
    return row


def device_idle_share(times: dict[str, np.ndarray | None]) -> float | None:
    """The share of the timed steps' wall time outside their own device work (``1 - device time /
    step time``, :class:`StepClock`): what the device waited for the host (planning and uploads not
    overlapped with the previous step, launches, the synchronisation); None without device times."""
    device = times.get("device_s")
    if device is None:
        return None
    return 1.0 - float(device.sum()) / float(times["step_s"].sum())


def summarize_times(
    with_attn: dict[str, np.ndarray | None], without: dict[str, np.ndarray | None]
) -> dict[str, Any]:  # fmt: skip
    """Throughput, latency percentiles, plan share, device idle share and attention share of the timed steps."""
    step, plan = with_attn["step_s"], with_attn["plan_s"]
    total = float(step.sum())
    tokens = int(with_attn["queries"].sum())
    noattn = float(without["step_s"].sum())
    plan_share = float(plan.sum()) / total
    attention_share = 1.0 - noattn / total
    return {
        "device_idle_share": device_idle_share(with_attn),
        "noattn_device_idle_share": device_idle_share(without),
        "steps": int(step.size),
        "tokens": tokens,
        "tokens_per_s": tokens / total,
        "step_ms_mean": float(step.mean()) * 1e3,
        "step_ms_p50": float(np.percentile(step, 50)) * 1e3,
        "step_ms_p90": float(np.percentile(step, 90)) * 1e3,
        "plan_ms_mean": float(plan.mean()) * 1e3,
        "plan_share": plan_share,
        "noattn_step_ms_mean": float(without["step_s"].mean()) * 1e3,
        "attention_share": attention_share,
        "attention_kernel_share": attention_share - plan_share,
    }


def bench_scenario(
    model: Model,
    model_key: str,
    scenario: str,
    args: argparse.Namespace,
    *,
    graphs: bool,
    logits: dict | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every requested backend of ``args.backends`` on one scenario.

    Returns
    -------
    summary : dict
        The workload's sizes.
    rows : list of dict
        One per backend; a skipped backend has ``skipped`` (the reason), a failed one ``error``.
    """
    workload = make_workload(
        scenario, seed=args.seed, warmup=args.warmup, steps=args.steps, max_batch=args.max_batch,
        vocab=model.spec.vocab, slots=args.slots,
    )  # fmt: skip
    summary = {"model": model_key, "slots": args.slots, **workload.summary()}
    elem = torch.tensor([], dtype=model.dtype).element_size()
    sdpa_bytes = sdpa_kv_bytes(workload, model.spec, elem)
    summary["sdpa_padded_kv_gib"] = sdpa_bytes / 2**30
    log.info("%s / %s: %s", model_key, scenario, summary)
    buf = allocate_buffers(model, workload)
    rows = []
    for name in args.backends:
        row: dict[str, Any] = {"model": model_key, "scenario": scenario, "backend": name}
        if name == "sdpa" and sdpa_bytes > args.sdpa_max_gib * 2**30:
            row["skipped"] = (
                f"padded KV of one layer {sdpa_bytes / 2**30:.1f} GiB > --sdpa-max-gib {args.sdpa_max_gib:g}"
            )
        elif name in PEER_BACKENDS and (why := peer_skip_reason(name, model.device)) is not None:
            row["skipped"] = why
        if "skipped" in row:
            log.info("%s / %s / %s skipped: %s", model_key, scenario, name, row["skipped"])
            rows.append(row)
            continue
        kept: list | None = [] if logits is not None else None
        try:
            row.update(run_backend(name, model, buf, workload, args, graphs=graphs, keep_logits=kept))
        except Exception as exc:  # recorded, and the run goes on with the next backend
            log.exception("%s / %s / %s failed", model_key, scenario, name)
            row["error"] = f"{type(exc).__name__}: {exc}"
        if model.device.type == "cuda":
            torch.cuda.empty_cache()  # the backend's graphs and buffers are gone
        if logits is not None:
            logits[(model_key, scenario, name)] = kept
        rows.append(row)
        if "tokens_per_s" in row:
            log.info(
                "%s / %s / %-18s %9.1f tok/s  p50 %.2f ms  plan %.1f%%  attention %.1f%%  err %.1e",
                model_key, scenario, name, row["tokens_per_s"], row["step_ms_p50"], 100 * row["plan_share"],
                100 * row["attention_share"], row["max_rel_err"],
            )  # fmt: skip
    del buf
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return summary, rows


def attention_floor_s(report: dict[str, Any], model: str, scenario: str) -> float:
    """Seconds one timed step's attention takes at least, all layers: every KV entry of the
    step's tree read once per layer at ``HBM_BYTES_PER_S`` (the H200's 4.8 TB/s; the mean tree
    of the timed steps), queries and outputs not counted."""
    spec = next(m for m in report["models"] if m["key"] == model)
    work = next(w for w in report["workloads"] if (w["model"], w["scenario"]) == (model, scenario))
    elem = DTYPES[report["args"]["dtype"]].itemsize
    kv_bytes = work["tree_tokens_mean"] * spec["num_kv_heads"] * spec["head_dim"] * 2 * elem
    return spec["layers"] * kv_bytes / HBM_BYTES_PER_S


def attach_speedups(report: dict[str, Any]) -> None:
    """Set each timed row's ratios to its scenario's ``query_separated`` row (in place).

    ``speedup_vs_query_separated``: the ratio of tokens/s. The two ratios no attention kernel
    or planner can exceed on this decoder, from the row's attention-free step times
    (``noattn_step_ms_mean``: the same steps with attention replaced by a copy and no planning,
    through the same graphs) against the baseline's tokens/s:
    ``speedup_bound_vs_query_separated`` with attention and planning free, and
    ``speedup_floor_bound_vs_query_separated`` with planning free and attention at its HBM
    floor (:func:`attention_floor_s`). None is set for a scenario without a timed
    ``query_separated`` row.
    """
    scenarios: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in report["rows"]:
        scenarios.setdefault((r["model"], r["scenario"]), []).append(r)
    for (model, scenario), group in scenarios.items():
        base = next((r for r in group if r["backend"] == "query_separated" and "tokens_per_s" in r), None)
        if base is None:
            continue
        floor_s = attention_floor_s(report, model, scenario)
        for r in group:
            if "tokens_per_s" not in r:
                continue
            r["speedup_vs_query_separated"] = r["tokens_per_s"] / base["tokens_per_s"]
            noattn_s = r["noattn_step_ms_mean"] * r["steps"] / 1e3
            r["speedup_bound_vs_query_separated"] = r["tokens"] / noattn_s / base["tokens_per_s"]
            floored_s = noattn_s + r["steps"] * floor_s
            r["speedup_floor_bound_vs_query_separated"] = r["tokens"] / floored_s / base["tokens_per_s"]


# -------------------------------------------------------------------------- report
def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def results_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the result rows."""
    lines = [
        "| model | scenario | backend | tokens/s | vs query_separated | bound | floor bound | p50 step ms "
        "| plan+upload | GPU idle | attention | max err |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['scenario']} | {r['backend']} |"
        if "skipped" in r or "error" in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            lines.append(f"{head} {what.replace('|', '/')} | | | | | | | | |")
            continue
        err = _f(r["max_rel_err"], ".1e") + ("" if r["correct"] else " x")
        lines.append(
            f"{head} {r['tokens_per_s']:.0f} | {_f(r.get('speedup_vs_query_separated'), '.2f')} | "
            f"{_f(r.get('speedup_bound_vs_query_separated'), '.2f')} | "
            f"{_f(r.get('speedup_floor_bound_vs_query_separated'), '.2f')} | {r['step_ms_p50']:.2f} | "
            f"{100 * r['plan_share']:.1f}% | {_pct(r.get('device_idle_share'))} | {100 * r['attention_share']:.1f}% | "
            f"{err} |"
        )
    return "\n".join(lines) + "\n"


def _config_source(report: dict[str, Any]) -> str:
    """Where the fasttree backends' config came from, per model (the export's entry or the defaults)."""
    export = report["args"].get("export")
    default = FastTreeConfig().to_dict()
    seen = {}
    for r in report["rows"]:
        config = (r.get("backend_info") or {}).get("config")
        if r["backend"].startswith("fasttree") and config is not None:
            seen[r["model"]] = "defaults" if config == default else "tuned entry"
    if not export or export == "none":
        return "FastTreeConfig() defaults"
    return f"export `{export}` (" + ", ".join(f"{m}: {v}" for m, v in seen.items()) + ")"


#: The host-speed reference: ``ft.plan`` of this paper-suite tree at 32 query / 8 KV heads, D 128.
HOST_REFERENCE_CASE = 5


def host_reference_ms(repeats: int = 30) -> float:
    """Median milliseconds of ``ft.plan`` of paper case :data:`HOST_REFERENCE_CASE` (1,025 nodes,
    1,024 queries) at 32/8 heads, D 128, warm: the host's planning speed, recorded with each run
    so that plan shares measured on hosts of different speeds can be compared."""
    tree = paper_tree(HOST_REFERENCE_CASE)
    heads = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    ft.plan(tree, **heads)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ft.plan(tree, **heads)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def markdown(report: dict[str, Any]) -> str:
    """The markdown report: set-up, results table, workload table."""
    env, a = report["env"], report["args"]
    non_attention = report.get("non_attention_ops") or NON_ATTENTION_OPS[not a.get("unfused", False)]
    layers = ", ".join(f"{m['key']} ({m['name']}, {m['layers']} layers)" for m in report["models"])
    lines = [
        f"# End-to-end decode benchmark ({report['label']})",
        "",
        f"{env.get('gpu_name') or env.get('cpu_model')}, torch {env.get('torch', torch.__version__)}, "
        f"triton {env.get('triton', '-')}, commit {(env.get('git_commit') or 'unknown')[:12]}, "
        f"{env['timestamp_utc']}"
        + (", planner WITHOUT its compiled loops (numpy path)" if env.get("native_planner") is False else "")
        + (
            f"; host planning speed: `ft.plan` of paper case {HOST_REFERENCE_CASE} at 32/8 in "
            f"{env['host_plan_reference_ms']:.3f} ms (warm median)"
            if env.get("host_plan_reference_ms") is not None
            else ""
        )
        + ".",
        "",
        f"Random-weight {a['dtype']} decoders: {layers}; RoPE on; non-attention ops: {non_attention} "
        "(GEMMs: torch `linear`). Each step decodes one token for every "
        f"active request of `iter_serving(scenario, seed={a['seed']})`"
        + (f" (max_batch {a['max_batch']})" if a["max_batch"] else "")
        + f"; {a['warmup']} warm-up steps, then {a['steps']} timed steps, each ended by a device synchronisation. "
        "tokens/s = decoded tokens / summed step wall times; vs query_separated = tokens/s ratio; "
        "bound = that ratio with this row's attention and planning free (its decoded tokens over its "
        "attention-free step times, against the baseline's tokens/s: what no attention kernel or planner "
        "can exceed on this decoder); floor bound = the same with attention at its HBM floor (each KV "
        f"entry of the step's tree read once per layer at {HBM_BYTES_PER_S / 1e12:g} TB/s); "
        "plan+upload = host planning and upload time / step time; GPU idle = 1 - (device time of the step's "
        "launches, CUDA events before the first and after the last) / step time: the host work the GPU waited "
        "for (planning and uploads not overlapped with the previous step, launches, the synchronisation; "
        "`-` without a GPU); attention = 1 - (step time with attention "
        "replaced by a copy and no planning, same graphs) / step time (planning included); max err = worst "
        f"relative error of layer 0's and the last layer's attention on <= {CHECK_QUERIES} sampled queries of "
        "the first timed step, and of the last layer's of the last timed step, vs the float64 reference (`x`: "
        "above tolerance). "
        "`fasttree`: the whole step in one CUDA graph, a step's plan extended from the previous one when only "
        "private nodes grew (at most 8 steps in a row); `fasttree_fresh`: the same with every step planned "
        "afresh; `fasttree_overlap`: `fasttree` with step i + 1 planned while the GPU runs step i; "
        "`query_separated_overlap`: the baseline planned (and its plan uploaded) the same way, the fair "
        "baseline of `fasttree_overlap`; the others: attention eager between graphs of the non-attention segments. "
        f"Pool slots: {a.get('slots', 'contiguous')}. fasttree config: {_config_source(report)}.",
        "",
        results_table(report["rows"]),
        "Workloads (timed steps):",
        "",
        "| model | scenario | steps | queries mean | max rows | tree tokens mean | context mean | pool slots "
        "| sdpa KV GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in report["workloads"]:
        lines.append(
            f"| {w['model']} | {w['scenario']} | {w['steps']} | {w['queries_mean']:.1f} | {w['max_rows']} | "
            f"{w['tree_tokens_mean']:.0f} | {w['context_mean']:.0f} | {w['pool_slots']} | "
            f"{w['sdpa_padded_kv_gib']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path, label: str) -> tuple[Path, Path]:
    """Write ``<label>.json`` and ``<label>.md`` under ``out`` atomically; returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{label}.json", out / f"{label}.md"
    write_atomic(js, json.dumps(report, indent=1, default=str) + "\n")
    write_atomic(md, markdown(report))
    return js, md


# ---------------------------------------------------------------------------- main
def _csv(value: str, choices, what: str) -> list[str]:
    items = [x for x in value.split(",") if x]
    bad = [x for x in items if x not in choices]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad}; choose from {sorted(choices)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default="llama,mistral",
        type=lambda s: _csv(s, MODELS, "models"),
        help="comma list of llama, mistral, tiny (default: llama,mistral)",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        type=lambda s: _csv(s, SCENARIOS, "scenarios"),
        help="comma list of serving scenarios (default: all four)",
    )
    p.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        type=lambda s: _csv(s, BACKENDS + PEER_BACKENDS, "backends"),
        help=f"comma list of {', '.join(BACKENDS + PEER_BACKENDS)} (default: all but the FlashInfer peer "
        f"{', '.join(PEER_BACKENDS)}, which needs flashinfer-python importable and is skipped otherwise)",
    )
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's, 32 for 7B)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps (>= 1; the first is eager)")
    p.add_argument("--steps", type=int, default=48, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=None, help="cap on active requests (default: the scenario's)")
    p.add_argument(
        "--slots", choices=SLOT_LAYOUTS, default="stable",
        help="pool slots: stable per node across steps, as a server allocates them (default), or each "
        "step's tree laid out anew in contiguous slots",
    )  # fmt: skip
    p.add_argument(
        "--export",
        default="docs/tune/export.json",
        help="tuned export for the fasttree backends (its runtime entry for this GPU and bucket, else the "
        "defaults; default: the committed export of fasttree-tune run); 'none': FastTreeConfig()",
    )
    p.add_argument("--sdpa-max-gib", type=float, default=40.0, help="skip sdpa above this padded KV per layer")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu (TRITON_INTERPRET=1)")
    p.add_argument("--no-graphs", action="store_true", help="run every step eagerly (always so on the CPU)")
    p.add_argument(
        "--unfused",
        action="store_true",
        help="run RMSNorm, RoPE, the K/V writes, SiLU-and-mul and the residual adds as separate torch ops "
        "(default: the fused Triton kernels of bench.model_ops)",
    )
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    p.add_argument("--label", default="decode_h200")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="measure nothing: rewrite the markdown report beside an earlier run's <label>.json with this "
        "version's table (its ratios recomputed from the rows)",
    )
    args = p.parse_args(argv)  # fmt: skip
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    return args


def run_benchmark(args: argparse.Namespace, *, keep_logits: bool = False) -> tuple[dict[str, Any], dict]:
    """Run every (model, scenario, backend) of ``args`` and write the report.

    Parameters
    ----------
    args : argparse.Namespace
        From :func:`parse_args`.
    keep_logits : bool
        Collect every timed step's logits and next tokens (for tests).

    Returns
    -------
    report : dict
        What ``<label>.json`` holds.
    logits : dict
        ``(model, scenario, backend) -> [(logits, next_tokens), ...]`` when ``keep_logits``.
    """
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:  # plans cache their uploads per indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    graphs = device.type == "cuda" and not args.no_graphs
    dtype = DTYPES[args.dtype]
    env = environment(gpu=device.type == "cuda")
    env["host_plan_reference_ms"] = host_reference_ms()
    logits: dict = {}
    rows: list[dict[str, Any]] = []
    workloads: list[dict[str, Any]] = []
    models = []
    with torch.no_grad():
        for key in args.models:
            spec = MODELS[key]
            layers = args.layers or spec.layers
            log.info("building %s (%d layers, %s) on %s", spec.name, layers, args.dtype, device)
            model = build_model(spec, layers=layers, dtype=dtype, device=device, seed=args.seed)
            models.append({**vars(spec), "key": key, "layers": layers})
            for scenario in args.scenarios:
                summary, scenario_rows = bench_scenario(
                    model, key, scenario, args, graphs=graphs, logits=logits if keep_logits else None
                )
                workloads.append(summary)
                rows.extend(scenario_rows)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report = {
        "benchmark": "end-to-end decode, FastTree paper serving scenarios",
        "label": args.label,
        "env": env,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": str(device),
        "graphs": graphs,
        "fused": not args.unfused,
        "non_attention_ops": NON_ATTENTION_OPS[not args.unfused],
        "models": models,
        "workloads": workloads,
        "rows": rows,
        "all_correct": all(r.get("correct", True) and "error" not in r for r in rows),
    }
    attach_speedups(report)
    write_report(report, args.out, args.label)
    return report, logits


def render(path: Path) -> dict[str, Any]:
    """Rewrite ``<label>.md`` beside the report ``path`` (``<label>.json``) with this version's
    table, the ratios recomputed from its rows (:func:`attach_speedups`); returns the report.

    Raises
    ------
    ValueError
        When ``path`` is not a JSON report of this benchmark.
    """
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the report {path}: {exc}") from exc
    if not isinstance(report, dict) or not {"rows", "env", "args", "models", "workloads"} <= report.keys():
        raise ValueError(f"{path} is not a bench.decode report (rows, env, args, models and workloads expected)")
    attach_speedups(report)
    write_atomic(path.with_suffix(".md"), markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the report, print the results table; 1 when a check failed."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.render is not None:
        try:
            report = render(args.render)
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        sys.stdout.write(results_table(report["rows"]))
        return 0
    try:
        report, _ = run_benchmark(args)
    except ValueError as exc:  # a set-up problem, before any measurement
        log.error("%s", exc)
        return 2
    sys.stdout.write(results_table(report["rows"]))
    return 0 if report["all_correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
