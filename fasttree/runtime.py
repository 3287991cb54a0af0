"""The production decode runtime: plan once per step on the host, run every layer from fixed buffers.

:class:`TreeAttentionRuntime` preallocates every buffer a step needs (one int32 plan buffer
on the device, two pinned staging copies of it, the fp32 partial-result workspace) once.
:meth:`~TreeAttentionRuntime.plan` plans a step's tree on the host and ships the whole plan
with one pinned, non-blocking copy. Each plan gets a *launch variant* (:mod:`fasttree.launch_variants`):
``tree_attention``'s own launch decisions with grids rounded up to buckets, run by
:meth:`~TreeAttentionRuntime.forward` over the plan arrays at fixed addresses, so a CUDA graph of
a whole decode step, all layers, captured for one variant replays every later plan of it
(:class:`StepGraphs` keeps one graph per variant met). With ``max_variants`` variants live, a
plan of a new one runs the smallest live variant whose launches cover it (the same launches with
larger grids), else gets a new id in place of the least recently used variant. With
``max_variants=0`` every plan runs the fixed launch: a persistent stage 1 over both tile classes'
units and a persistent merge, whose grids depend on the GPU only.

Shapes use the package's vocabulary (:mod:`fasttree.plan_arrays`): ``n_queries``, ``Hq``,
``Hkv``, ``D``, ``g = Hq // Hkv``; ``B`` is the row count of the ``q`` / ``out`` buffers the
caller passes (at least the planned queries; rows past them are neither read nor written).

Typical use (one runtime per attention shape, shared by all layers)::

    rt = TreeAttentionRuntime("export.json", num_q_heads=32, num_kv_heads=8, head_dim=128,
                              dtype=torch.float16, device="cuda", max_queries=256,
                              max_kv_entries=1 << 20)
    graphs = StepGraphs(step, [rt])      # step(): every layer calls rt.forward(q, k_cache[l], v_cache[l], out=o)
    for tree in trees:                   # each decode step: a new tree, the same buffers
        rt.plan(tree)
        graphs.replay()                  # the graph of this plan's variant (captured when first met)

Safety under replay: :meth:`plan` refuses (``ValueError``) any tree whose plan would not fit
the capacities, or would read ``q`` rows or pool slots beyond the smallest ``q`` and KV pool
that :meth:`forward` has been called with (so beyond any captured buffer). ``plan`` and the
replays must run on the same CUDA stream (the upload is ordered before the next replay), and one
runtime's :meth:`forward` calls must not run concurrently on different streams: they share the
partial-result buffers and stage 1's item counters (one runtime per stream otherwise).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .attention import (
    LOG2E,
    direct_launchers,
    kernel_launches,
    launch_through_triton,
    output_like,
    run_direct,
)
from .config import FastTreeConfig
from .costs import ALL_LARGE
from .export import ConfigExport, _dtype_name
from .kernels import (
    merge_partials_persistent_kernel,
    relocate_plan_kernel,
    tree_attention_persistent_kernel,
)
from .launch_rules import (
    MANY_PARTIALS,
    SMALL_TILE_CAPPED_PROGRAMS,
    GpuTarget,
    capped_registers,
    few_partials_merge_heads,
    kv_offsets_fit_int32,
    next_pow2,
    pdl_wait,
    peel_tiles,
)
from .launch_variants import FIXED_VARIANT, LaunchVariant, VariantTable, grid_bucket, launch_variant
from .launcher import (
    current_stream,
    direct_launcher,
    fixed_launcher,
    interpreting,
    launch,
    launch_hooks_active,
    launch_pointers,
    on_device,
    tensor_layout,
)
from .plan_arrays import DEVICE_ARRAYS, MAX_BLOCK_M, Plan, check_heads
from .plan_extend import PlanExtender
from .plan_rules import PlanRules
from .portfolio import LAUNCH_FIELDS, Portfolio
from .query_separated import plan_query_separated, query_separated_split
from .recording import WorkloadRecorder
from .runtime_planning import QUERY_CENTRIC_CHOICES, launch_slots, plan_for_runtime, resolve_stage1_launches
from .step_graphs import StepGraphs
from .tree import KVTree
from .validation import check_choice, check_int, check_number

__all__ = ["PLAN_HEADER", "CapacityError", "RuntimePlan", "StepGraphs", "TreeAttentionRuntime"]

logger = logging.getLogger(__name__)

#: The plan buffer's header, in int32 words: the offset of each plan array (in
#: :data:`~fasttree.plan_arrays.DEVICE_ARRAYS` order), the unit range of launch slot 0 and 1,
#: and the merged-query counts of the few- and many-partials merges (kernels' ``HDR_*``).
PLAN_HEADER = (
    *DEVICE_ARRAYS, "slot0_first", "slot0_end", "slot1_first", "slot1_end", "merge_few", "merge_many",
    "class0_first", "class0_end", "class1_first", "class1_end", "lead0", "lead1", "merge_fill_end",
    "words_end",
)  # fmt: skip
_HEADER_WORDS = 32  # PLAN_HEADER padded to an aligned start for the arrays
_ALIGN_WORDS = 32  # every array starts at a multiple of 128 bytes
#: Partial rows the many-partials merge reads per step (merged queries with at least
#: ``fasttree.launch_rules.MANY_PARTIALS`` partials go to it, as in ``tree_attention``).
_MERGE_BLOCK_P = 16
#: Programs per SM of the persistent merge (a light kernel: many fit an SM).
_MERGE_PROGRAMS_PER_SM = 8
#: int32 words of each stage-1 launch's item counters (slot 0, slot 1, padding).
_COUNTER_WORDS = 4


@dataclass(frozen=True)
class RuntimePlan:
    """What :meth:`TreeAttentionRuntime.plan` uploaded.

    Attributes
    ----------
    plan : Plan
        The host plan (for inspection; the device holds its arrays).
    query_centric : bool
        The plan ignores sharing (planned with ``gamma = 10``), chosen by ``query_centric``.
    slot_units : tuple of (int, int)
        The ``[first, end)`` unit range of each launch slot.
    merge_counts : tuple of int
        Merged queries of the few- and of the many-partials merge.
    words : int
        int32 words copied to the device.
    extended : bool
        The plan is the previous step's, extended to this tree's new tokens
        (``extend_steps``), not planned afresh. It keeps that plan's launch variant: its units,
        tile classes and partial rows are that plan's, only their KV lengths grew.
    variant_id : int
        The launch variant :meth:`TreeAttentionRuntime.forward` runs the plan with: 1, 2, ...
        (the plan's own launches, grids bucketed) or 0 (the fixed persistent launch). A server
        replays the CUDA graph it captured for this id (:class:`StepGraphs` does it).
    variant : LaunchVariant or None
        The launches of ``variant_id`` (None for the fixed launch).
    bounded : bool
        The tree's plan was over a capacity: this is :meth:`TreeAttentionRuntime.bounded_plan`
        (every query alone over its context).
    """

    plan: Plan
    query_centric: bool
    slot_units: tuple[tuple[int, int], tuple[int, int]]
    merge_counts: tuple[int, int]
    words: int
    extended: bool = False
    variant_id: int = FIXED_VARIANT
    variant: LaunchVariant | None = None
    bounded: bool = False

    @property
    def n_queries(self) -> int:
        return self.plan.n_queries


class CapacityError(ValueError):
    """A plan over one of the runtime's capacities (the message names it); :meth:`TreeAttentionRuntime.plan`
    then uploads the bounded fallback plan."""


def _positive_int(name: str, value: Any) -> int:
    return check_int(name, value, minimum=1, expected="a positive integer")


def _runtime_device(device: torch.device | str) -> torch.device:
    """``device`` as a CUDA device with its index (the CPU only under the interpreter)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif not interpreting():
        raise ValueError(f"device must be a CUDA device (or the CPU under TRITON_INTERPRET=1), got {device}")
    return device


def _aligned(words: int) -> int:
    return -(-words // _ALIGN_WORDS) * _ALIGN_WORDS


#: Arguments of ``merge_partials_persistent_kernel`` before its constexprs.
_MERGE_ARGS = 11
#: Position of ``qk_scale`` among ``tree_attention_persistent_kernel``'s arguments.
_STAGE1_QK_ARG = 9
#: Factors of the KV split sizes a plan over a capacity is tried again with, smallest first, before
#: the bounded plan: the first that fits keeps the most of the planner's own chunks (a tree a few
#: partial rows over ``max_partial_rows`` loses a third of its units at 1.5x, three quarters at 4x).
_SPLIT_SCALES = (1.5, 2, 4, 32)

#: The plan's KV index (and row-mask) arrays hold this many times ``max_kv_entries``.
KV_CAPACITY_FACTOR = 2
#: KV tile of the bounded fallback plan (and its chunk sizes' multiple).
_BOUNDED_KV_TILE = 64
#: Words one program of the plan relocation copies per step.
_RELOCATE_BLOCK = 1024
#: Most programs of the plan relocation per array.
_RELOCATE_PROGRAMS = 64
#: Context entries per partial row of the default ``max_partial_rows`` (a plan's partial rows grow
#: with its context entries over its KV split sizes, 1024 and 128 by default).
_CONTEXT_PER_PARTIAL_ROW = 256
#: Partial rows the default ``max_partial_rows`` adds for small batches: a batch of few queries is cut
#: into chunks until about ``para_threshs1[1]`` (528) programs run (plain decode's four waves, or the
#: 128-token small split), so its partial rows do not shrink with the batch. Without it, 10 of 1,212
#: held-out trees (sized at their own queries and context entries) went over the two terms above,
#: by up to 104 rows, and their retried plans ran 0.88-0.98x on an H100.
_SMALL_BATCH_PARTIAL_ROWS = 1024
#: Fewest work units of the default ``max_units``.
_MIN_UNITS = 16384
#: Launch variants a runtime hands out by default before further new ones run the fixed launch.
DEFAULT_MAX_VARIANTS = 32


class TreeAttentionRuntime:
    """Tree attention for one attention shape with preallocated, CUDA-graph-safe buffers.

    Parameters
    ----------
    config : FastTreeConfig, Portfolio, ConfigExport, str, PathLike or None
        The config; a portfolio (its selector picks a member per tree; with launch variants its
        members may differ in launch fields, as ``tree_attention``'s do: a plan that no variant id
        serves is planned with member 0, whose launch fields the fixed launch is compiled for; with
        ``max_variants=0`` they must share them); or a tuner export (object or path) whose runtime
        entry for this GPU and bucket is used (the defaults when it has none, or when it was tuned
        for other kernels or defaults). ``None``: ``FastTreeConfig()``.
    num_q_heads, num_kv_heads, head_dim : int
        ``Hq``, ``Hkv`` (``Hq`` a multiple of it) and ``D`` in [16, 256].
    dtype : torch.dtype or str
        float16 or bfloat16: the dtype of ``q``, the KV pools and ``out``.
    device : torch.device or str
        A CUDA device (the CPU only under ``TRITON_INTERPRET=1``, for tests).
    max_queries : int
        Most decode queries of one step.
    max_kv_entries : int
        Most context entries of one step: its queries' summed context lengths (what
        query-separated decode reads). The plan's KV index arrays hold
        ``KV_CAPACITY_FACTOR * max_kv_entries`` entries (:attr:`kv_capacity`), room for what a
        plan adds to its context entries (the tree's own slots ahead of its groups' entries,
        packed units' tokens again; at most 1.14x the context entries on the paper and
        families suites). **Capacity guarantee**: a tree within ``max_queries`` whose context
        entries fit ``max_kv_entries`` always plans: when its plan is over any capacity,
        :meth:`bounded_plan` (which provably fits) is uploaded instead. A tree over the limits
        still plans when its plan fits the buffers. :meth:`capacities` sizes it for a batch and
        a context length.
    max_units : int, optional
        Most work units of one plan; ``max(16384, max_partial_rows)`` by default (at least
        ``max_queries``).
    max_partial_rows : int, optional
        Most fp32 partial rows (queries with several partials hold one per partial);
        ``16 * max_queries + max_kv_entries / 256 + 1024`` by default. Sizes the
        ``[max_partial_rows, Hq, D]`` workspace. A plan over a capacity is tried again with
        larger KV splits (fewer partial rows), then replaced by the bounded plan.
    max_pairs : int, optional
        Most (unit, query) pairs; ``2 * (max_queries + max_partial_rows)`` by default (at
        least ``max_queries``).
    pool_slots : int, optional
        Rows of the KV pools; when given, :meth:`plan` refuses trees reading beyond them
        and :meth:`forward` pools of another size. Only then can stage 1 form K/V addresses
        from int32 offsets (when every slot's offsets fit): 1-4% faster on the H200.
    query_centric : {"auto", "never", "always"}
        ``"auto"`` plans a step query-centric (every query alone over its path, no
        merges between nodes) when grouping would save less than 10% of the KV reads.
    programs_per_sm : int, optional
        Persistent programs per SM of the stage-1 launch; by default the kernel's
        occupancy (from its registers and shared memory), read after its compilation.
    waves : int
        Persistent stage-1 programs are ``waves`` times the SMs x programs per SM (more
        waves: finer load balance through the GPU's block scheduler, more programs).
    stage1_launches : {"auto", 1, 2}
        1: one persistent stage-1 launch runs both tile classes (compiled for both tiles,
        with the large class's warps and stages); 2: one persistent launch per tile class,
        each compiled for its own tile, warps and stages, the second ordered after the
        first, and a small-tile launch capped at the registers that let
        ``fasttree.launch_rules.SMALL_TILE_CAPPED_PROGRAMS`` (4) programs share an SM (MHA on the
        H200 suite: 1.06x of tree_attention's time vs 1.16x with 3 per SM). ``"auto"``: 2 for MHA
        (``Hq == Hkv``) at ``D <= 128``, whose small units are memory-bound and gain from
        the extra programs per SM; 1 otherwise, where the second launch costs more than it
        gains (``docs/runtime.md``, "Measured on the H200").
    recorder : WorkloadRecorder, optional
        Receives every tree :meth:`plan` uploads (it samples and bounds what it writes), so
        a server's own decode steps become a workload trace for ``fasttree-tune``. Its head
        shape and dtype must be the runtime's.
    extend_steps : int
        When a step's tree only appends tokens to nodes that one query reads (same nodes,
        queries and older slots as the last uploaded tree: a decode step without arrivals
        or finishes), :meth:`plan` inserts the new slots into the last plan instead of
        planning afresh (:class:`fasttree.plan_extend.PlanExtender`: the same tokens read
        exactly once, in O(KV entries) numpy work), for at most ``extend_steps`` steps in a
        row; the cost decisions are redone at the next fresh plan. 0: plan every tree.
    max_variants : int
        Launch variants handed out (:mod:`fasttree.launch_variants`): each plan runs with the
        launches :func:`fasttree.tree_attention` would give it, grids rounded up to a bucket,
        under the variant id :meth:`plan` returns; a server captures one CUDA graph per id it
        meets (:class:`StepGraphs`). At most ``max_variants`` variants are live: then a plan of
        a new variant runs under the id of the smallest live variant that covers it (the same
        launches, grids at least its own: :meth:`fasttree.launch_variants.LaunchVariant.covers`),
        else under a new id that replaces the least recently used variant (ids are never
        reused: a graph of a replaced id is just never replayed again; ``StepGraphs`` drops the
        least recently replayed past its ``max_graphs``). 0: every plan runs the fixed
        persistent launch (id 0: one graph for every step, planned with
        :meth:`fasttree.PlanRules.runtime`; slower than the variants).

    Raises
    ------
    ValueError
        On invalid shapes, dtype, device, capacities or config, before any allocation.
    """

    def __init__(
        self,
        config: FastTreeConfig | Portfolio | ConfigExport | str | os.PathLike | None = None,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        device: torch.device | str,
        max_queries: int,
        max_kv_entries: int,
        max_units: int | None = None,
        max_partial_rows: int | None = None,
        max_pairs: int | None = None,
        pool_slots: int | None = None,
        query_centric: str = "auto",
        programs_per_sm: int | None = None,
        waves: int = 1,
        stage1_launches: int | str = "auto",
        recorder: WorkloadRecorder | None = None,
        extend_steps: int = 8,
        max_variants: int = DEFAULT_MAX_VARIANTS,
    ) -> None:
        self.group_size = check_heads(num_q_heads, num_kv_heads, head_dim)
        self.num_q_heads, self.num_kv_heads, self.head_dim = int(num_q_heads), int(num_kv_heads), int(head_dim)
        self.dtype = getattr(torch, _dtype_name(dtype))
        self.device = _runtime_device(device)
        self._set_capacities(max_queries, max_kv_entries, max_units, max_partial_rows, max_pairs, pool_slots)
        self.query_centric = check_choice("query_centric", query_centric, QUERY_CENTRIC_CHOICES)
        self.programs_per_sm = None if programs_per_sm is None else _positive_int("programs_per_sm", programs_per_sm)
        self.waves = _positive_int("waves", waves)
        self.stage1_launches = resolve_stage1_launches(stage1_launches, self.group_size, self.head_dim)
        self.recorder = self._checked_recorder(recorder)
        self.extend_steps = check_int("extend_steps", extend_steps, minimum=0, expected="a non-negative integer")
        self._extender = PlanExtender(max_steps=self.extend_steps) if self.extend_steps else None
        self._steps = 0
        self.variants = VariantTable(
            check_int("max_variants", max_variants, minimum=0, expected="a non-negative integer")
        )
        self._target = GpuTarget.of(self.device, interpreting())
        # the plans' rules: tree_attention's with launch variants, else the fixed launch's
        self._rules = PlanRules.runtime(self.stage1_launches, variants=bool(self.variants.max_variants))
        self.portfolio = self._resolve_portfolio(config)
        self.config = self.portfolio.launch_config  # member 0: the fixed launch's launch fields

        # launch slots: (block_m, block_n, num_warps, num_stages) of the large and the small tile class; both
        # run in one persistent launch, with the large class's warps and stages (the config's small-class
        # warps and stages apply to tree_attention's per-plan launches only)
        self.slots = launch_slots(self.config, self.group_size, self.head_dim, self._rules.wide_head_kv_tile)
        if max(s[0] for s in self.slots) > MAX_BLOCK_M:
            q_tiles = self.config.query_tiles(self.group_size)
            raise ValueError(f"query tiles {q_tiles} x GQA {self.group_size} exceed {MAX_BLOCK_M} rows")
        self.masked = any(m.pack_tokens > 0 for m in self.portfolio.members)  # row masks if any member packs
        self._capacity = {
            "kv_indices": self.kv_capacity,
            "kv_row_mask": self.kv_capacity if self.masked else 1,
            "unit_kv_start": self.max_units,
            "unit_kv_len": self.max_units,
            "unit_q_start": self.max_units,
            "unit_q_len": self.max_units,
            "pair_query": self.max_pairs,
            "pair_out_row": self.max_pairs,
            "query_partial_start": self.max_queries,
            "query_num_partials": self.max_queries,
            "merge_queries": self.max_queries,
        }
        self.plan_words = _HEADER_WORDS + sum(_aligned(n) for n in self._capacity.values())
        # launch variants read the arrays at fixed offsets of a second buffer: a unit array holds tile
        # class 0's units from 0 and class 1's from unit_region (room for the largest grid bucket of
        # either), the merge list room for its largest bucket, the per-query arrays one more entry
        # (the merge list's filler query, of no partial)
        self.unit_region = grid_bucket(self.max_units)
        fixed = dict(self._capacity)
        fixed.update({n: 2 * self.unit_region for n in fixed if n.startswith("unit_")})
        fixed.update(query_partial_start=self.max_queries + 1, query_num_partials=self.max_queries + 1,
                     merge_queries=grid_bucket(self.max_queries))  # fmt: skip
        self._fixed_offsets = np.cumsum([0] + [_aligned(c) for c in fixed.values()])[:-1].tolist()
        self.fixed_words = sum(_aligned(c) for c in fixed.values()) if self.variants.max_variants else 0
        if self.plan_words > 0x7FFFFFFF:
            raise ValueError(f"the capacities need {self.plan_words} int32 words of plan buffer, more than 2**31 - 1")
        self._allocate_buffers()

    def _set_capacities(self, max_queries, max_kv_entries, max_units, max_partial_rows, max_pairs, pool_slots) -> None:
        """Validate the capacities (positive integers; partial rows and pairs derived when None)."""
        self.max_queries = _positive_int("max_queries", max_queries)
        self.max_kv_entries = _positive_int("max_kv_entries", max_kv_entries)
        self.kv_capacity = KV_CAPACITY_FACTOR * self.max_kv_entries
        self.max_partial_rows = _positive_int(
            "max_partial_rows",
            16 * self.max_queries + -(-self.max_kv_entries // _CONTEXT_PER_PARTIAL_ROW) + _SMALL_BATCH_PARTIAL_ROWS
            if max_partial_rows is None
            else max_partial_rows,
        )
        self.max_units = _positive_int(
            "max_units", max(_MIN_UNITS, self.max_partial_rows) if max_units is None else max_units
        )
        self.max_pairs = _positive_int(
            "max_pairs", 2 * (self.max_queries + self.max_partial_rows) if max_pairs is None else max_pairs
        )
        for name in ("max_units", "max_pairs"):
            if getattr(self, name) < self.max_queries:
                raise ValueError(
                    f"{name}={getattr(self, name)} is below max_queries={self.max_queries}: the bounded plan "
                    "of a full batch needs one unit and one pair per query"
                )
        self.pool_slots = None if pool_slots is None else _positive_int("pool_slots", pool_slots)

    def _checked_recorder(self, recorder: WorkloadRecorder | None) -> WorkloadRecorder | None:
        """``recorder``, checked to record the runtime's head shape and dtype."""
        if recorder is None:
            return None
        if not isinstance(recorder, WorkloadRecorder):
            raise ValueError(f"recorder must be a WorkloadRecorder, got {type(recorder).__name__}")
        shape = (self.num_q_heads, self.num_kv_heads, self.head_dim, _dtype_name(self.dtype))
        if recorder.shape != shape:
            raise ValueError(f"the recorder records heads/head dim/dtype {recorder.shape}, the runtime has {shape}")
        return recorder

    def _allocate_buffers(self) -> None:
        """Allocate the plan buffer, its pinned staging copies, the partial-result workspace and the
        item counters, after checking that they fit the device's memory."""
        if self.device.type == "cuda":  # say which capacity is too large before torch fails to allocate it
            total = torch.cuda.get_device_properties(self.device).total_memory
            if self.device_bytes > total:
                raise ValueError(
                    f"the runtime's buffers need {self.device_bytes / 2**30:.1f} GiB of device memory "
                    f"(max_partial_rows={self.max_partial_rows} x {self.num_q_heads} heads x {self.head_dim} fp32 "
                    f"partials, {self.plan_words} plan words), more than the device's {total / 2**30:.1f} GiB"
                )
        pin = self.device.type == "cuda"
        self._plan_buf = torch.zeros(self.plan_words, dtype=torch.int32, device=self.device)
        self._fixed = torch.zeros(max(1, self.fixed_words), dtype=torch.int32, device=self.device)
        self._fixed_dst = torch.tensor(self._fixed_offsets, dtype=torch.int32, device=self.device)
        self._relocators: dict = {}  # programs -> fixed_launcher of relocate_plan_kernel on those buffers
        sizes = (
            np.diff([*self._fixed_offsets, self.fixed_words]).tolist()
            if self.fixed_words
            else [1] * len(self._fixed_offsets)
        )
        self._fixed_arrays = {
            name: self._fixed[o : o + n] if self.fixed_words else self._fixed
            for name, o, n in zip(DEVICE_ARRAYS, self._fixed_offsets, sizes, strict=True)
        }
        # the merge list's filler (query max_queries, of no partial) everywhere no plan's list reached;
        # unit arrays: empty units (zeros)
        if self.fixed_words:
            self._fixed_arrays["merge_queries"].fill_(self.max_queries)
        self._merge_fill_end = 0  # where the last relocated plan's merge list ended
        self._staging = [torch.zeros(self.plan_words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._staged = [s.numpy() for s in self._staging]
        self._copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._next_staging = 0
        self._part_o = torch.empty(
            (self.max_partial_rows, self.num_q_heads, self.head_dim), dtype=torch.float32, device=self.device
        )
        self._part_lse = torch.empty((self.max_partial_rows, self.num_q_heads), dtype=torch.float32, device=self.device)
        # per stage-1 launch: the items of slot 0 and 1 its programs claimed past their first (the merge
        # launch zeroes them for the next call)
        self._counters = torch.zeros((2, _COUNTER_WORDS), dtype=torch.int32, device=self.device)
        self._launch_counters = tuple(self._counters.unbind(0))  # each launch's row, viewed once
        self._current: RuntimePlan | None = None
        self._own_variant: LaunchVariant | None = None  # launch_variant() of the plan _current extends or is
        self._min_rows = self.max_queries  # smallest q / out seen by forward
        self._min_pool = self.pool_slots  # smallest KV pool seen by forward
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self._sm_count = int(props.multi_processor_count)
            self._props = props
        else:
            self._sm_count, self._props = 4, None
        self._programs = [0, 0]  # persistent stage-1 programs per launch (sized after the kernel's compilation)
        self._launchers: dict[tuple, tuple] = {}  # direct launchers by the tensors' layout (see _layout_key)
        self._variant_launchers: dict[tuple, tuple] = {}  # a launch variant's, by (variant id, layout)
        self._maxnreg = self._register_caps()

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory the runtime's buffers take: the plan buffer, its fixed-offset copy
        for the launch variants, the fp32 partial outputs and LSEs (``max_partial_rows`` rows of every
        query head) and the item counters."""
        partial_rows = self.max_partial_rows * self.num_q_heads
        fixed = max(1, self.fixed_words) + len(self._fixed_offsets)  # the fixed-offset arrays and their offsets
        return 4 * (self.plan_words + fixed + partial_rows * (self.head_dim + 1) + 2 * _COUNTER_WORDS)

    def _register_caps(self) -> list[int | None]:
        """Register cap per stage-1 launch (None: the compiler's choice).

        A small-tile (16-row) class in a launch of its own at 4 warps, as measured, gets the
        registers that let ``SMALL_TILE_CAPPED_PROGRAMS`` programs share an SM (128 on an
        H100/H200); other warp counts keep the compiler's (8 warps would get 64: spills).
        """
        caps: list[int | None] = [None, None]
        if self.stage1_launches == 2 and self._props is not None:
            regs_per_sm = int(getattr(self._props, "regs_per_multiprocessor", 65536))
            for i, (block_m, _, warps, _) in enumerate(self.slots):
                if block_m <= 16 and warps == 4:
                    caps[i] = capped_registers(warps, regs_per_sm, SMALL_TILE_CAPPED_PROGRAMS)
        return caps

    # ------------------------------------------------------------------ config
    def _resolve_portfolio(self, config) -> Portfolio:
        """The portfolio the runtime plans with: a config alone, a runtime portfolio, or the runtime
        entry of an export (object or path) for this GPU and bucket."""
        if config is None:
            return Portfolio(runtime=True)
        if isinstance(config, FastTreeConfig):
            return Portfolio(members=(config,), runtime=True)
        if isinstance(config, Portfolio):
            if not self.variants.max_variants and len({tuple(getattr(m, f) for f in LAUNCH_FIELDS)
                                                       for m in config.members}) > 1:  # fmt: skip
                raise ValueError(
                    "the portfolio's members differ in launch fields (tiles, warps, stages), which the fixed "
                    "launch alone (max_variants=0) cannot switch between trees; give max_variants > 0 (launch "
                    "variants) or the export's runtime entry"
                )
            return config.for_heads(self.num_q_heads, self.num_kv_heads)  # regions apply at our layout
        if isinstance(config, (str, os.PathLike)):
            from .export import read_export

            config = read_export(config)
        if isinstance(config, ConfigExport):
            gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            portfolio, entry = config.lookup(
                gpu=gpu, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, dtype=self.dtype, target="runtime",
            )  # fmt: skip
            logger.info("runtime config for %s: %s", gpu, "tuned export entry" if entry else "defaults")
            return portfolio
        raise ValueError(
            "config must be a FastTreeConfig, a Portfolio, a ConfigExport or an export path, "
            f"got {type(config).__name__}"
        )

    @staticmethod
    def capacities(*, max_queries: int, max_context_tokens: int) -> dict[str, int]:
        """Capacities under which every decode step of at most ``max_queries`` requests, each
        with a context of at most ``max_context_tokens`` tokens (shared prefixes counted in
        every context that holds them), plans without an exception: ``max_queries`` and
        ``max_kv_entries = max_queries * max_context_tokens`` (the other capacities keep their
        defaults, derived from these). Pass them on: ``TreeAttentionRuntime(config,
        **TreeAttentionRuntime.capacities(...), ...)``; :attr:`device_bytes` then gives the
        device memory they take (an int32 word per KV entry in the plan buffers, plus the fp32
        partials).
        """
        q = _positive_int("max_queries", max_queries)
        return {"max_queries": q, "max_kv_entries": q * _positive_int("max_context_tokens", max_context_tokens)}

    # -------------------------------------------------------------------- plan
    def plan(self, tree: KVTree, *, rows: int | None = None) -> RuntimePlan:
        """Plan ``tree`` on the host and upload it into the runtime's buffers (one copy).

        Call once per decode step, before the step's :meth:`forward` calls (or graph replay)
        on the same stream. Returns what was uploaded. A tree that only appends tokens to
        nodes one query reads is served by extending the last plan (``extend_steps``).

        Parameters
        ----------
        tree : KVTree
            The step's decode batch (query ``j`` is row ``j`` of ``q``).
        rows : int, optional
            The rows ``B`` of the ``q`` / ``out`` buffers this step will run with: a server
            that captured one graph per batch-size bucket passes the bucket it will replay
            (checked: ``n_queries <= rows <= max_queries``). Without it, the tree must fit the
            smallest ``q`` :meth:`forward` has ever been called with, which is safe for any
            captured graph.

        Raises
        ------
        ValueError
            When the tree has more queries than ``rows``, ``max_queries`` or (without
            ``rows``) the smallest ``q`` passed to :meth:`forward`, reads a slot beyond
            ``pool_slots`` or the smallest KV pool passed to :meth:`forward`, or its plan
            exceeds a capacity while its context entries exceed ``max_kv_entries`` (both named
            in the message; within them the bounded plan is uploaded instead). Nothing is
            uploaded then: the previous plan stays in place.
        """
        if not isinstance(tree, KVTree):
            raise ValueError(f"plan() needs a KVTree, got {type(tree).__name__}")
        if rows is not None:
            rows = _positive_int("rows", rows)
            if rows > self.max_queries:
                raise ValueError(f"rows={rows} exceeds max_queries={self.max_queries}")
            if tree.n_queries > rows:
                raise ValueError(f"the tree has {tree.n_queries} queries, more than rows={rows}")
        elif tree.n_queries > self._min_rows:
            which = "max_queries" if self._min_rows == self.max_queries else "the smallest q forward() was called with"
            raise ValueError(
                f"the tree has {tree.n_queries} queries, more than {self._min_rows} ({which}); "
                "pass rows= to plan for a larger q buffer"
            )
        if self._min_pool is not None and tree.max_slot >= self._min_pool:
            raise ValueError(f"the tree reads pool slot {tree.max_slot} but the KV pool has {self._min_pool} slots")
        extender = self._extender
        plan = None if extender is None else extender.extend(tree)
        uploaded = None
        if plan is not None:  # the extender only holds uploaded plans: _current is the one extended
            try:
                uploaded = self._upload(plan, self._current.query_centric, extended=True)
            except CapacityError:  # checked before anything is written: plan afresh
                uploaded = None
        if uploaded is None:
            uploaded = self._upload_fresh(tree, self.portfolio.select(tree))
        if extender is not None:
            extender.remember(tree, uploaded.plan)
        if self.recorder is not None:
            self.recorder.record(self._steps, tree)
        self._steps += 1
        return uploaded

    def _upload_fresh(self, tree: KVTree, config: FastTreeConfig) -> RuntimePlan:
        """Plan ``tree`` afresh with ``config`` and upload it; over a capacity, what
        :meth:`_upload_within_capacity` uploads."""
        try:
            return self._upload(*self._plan_afresh(tree, config))
        except CapacityError as err:
            return self._upload_within_capacity(tree, config, err)

    def _plan_afresh(
        self, tree: KVTree, config: FastTreeConfig, split_scale: float = 1, *, crossover: bool = True
    ) -> tuple[Plan, bool]:
        """Plan ``tree`` with ``config`` (a portfolio member; its KV split sizes times
        ``split_scale``, rounded up); whether the plan is query-centric. ``crossover=False``: never plain
        decode's plan (``PlanRules.crossover_margin`` and ``crossover_wave_programs`` 0), which may
        need more KV entries than a tree plan."""
        if split_scale != 1:
            config = config.with_(kv_split_sizes=tuple(math.ceil(split_scale * s) for s in config.kv_split_sizes))
        rules = self._rules if crossover else self._rules.with_(crossover_margin=0.0, crossover_wave_programs=0)
        return plan_for_runtime(
            tree, config, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, stage1_launches=self.stage1_launches, query_centric=self.query_centric,
            rules=rules,
        )  # fmt: skip

    def _upload_within_capacity(self, tree: KVTree, config: FastTreeConfig, err: CapacityError) -> RuntimePlan:
        """Upload a plan of ``tree`` that fits after its plan with ``config`` was over a capacity
        (``err``): the tree plan (not plain decode's, which the crossover rule may pick and which
        reads every query's context), then with the KV split sizes :data:`_SPLIT_SCALES` times
        larger (fewer chunks, partial rows and units; the grouping kept), else the bounded plan
        (:meth:`bounded_plan`); raises ValueError naming ``max_kv_entries`` when the tree's context
        entries exceed it and none fits."""
        for scale in (1, *_SPLIT_SCALES):
            try:
                return self._upload(*self._plan_afresh(tree, config, scale, crossover=False))
            except CapacityError:
                continue
        context = int(np.add.reduce(tree.path_lengths[tree.query_nodes], dtype=np.int64))
        if context > self.max_kv_entries:
            raise ValueError(
                f"{err}; the tree's queries read {context} context entries in all, more than "
                f"max_kv_entries={self.max_kv_entries}, so no plan is guaranteed to fit: size max_kv_entries for "
                "the batch's summed context lengths (TreeAttentionRuntime.capacities)"
            ) from err
        logger.info("%s: serving this step with the bounded query-separated plan", err)
        return self._upload(self.bounded_plan(tree), True, bounded=True)

    def bounded_plan(self, tree: KVTree) -> Plan:
        """The plan that fits the capacities whenever ``tree`` fits ``max_queries`` and its context
        entries (the sum of its queries' context lengths) fit ``max_kv_entries``.

        Every query alone over its context (:func:`fasttree.plan_query_separated`), cut into
        chunks of ``s`` tokens, a multiple of 64: query-separated decode's own chunk size (about
        four waves of programs), or larger where the capacities need it, ``s >= C / (m - n)``
        for ``C`` context entries, ``n`` queries and ``m = min(max_units, max_partial_rows,
        max_pairs)``, or no cut when ``m <= n``. Bound: a query of ``c`` entries has
        ``ceil(c / s) <= c / s + 1`` chunks, one unit, one pair and (with two or more) one
        partial row each, so units = pairs <= ``C / s + n <= m`` and partial rows <= units;
        its KV entries are ``C``. The constructor checks ``max_units, max_pairs >=
        max_queries``, so the uncut plan fits too.
        """
        lens = tree.path_lengths[tree.query_nodes]
        n = tree.n_queries
        context = int(np.add.reduce(lens, dtype=np.int64))
        longest = max(1, int(lens.max()) if lens.size else 1)
        room = min(self.max_units, self.max_partial_rows, self.max_pairs) - n
        split = longest if room <= 0 else max(1, -(-context // room))
        split = max(split, query_separated_split(longest, n, self.num_kv_heads, self._sm_count, _BOUNDED_KV_TILE))
        split = -(-split // _BOUNDED_KV_TILE) * _BOUNDED_KV_TILE
        return plan_query_separated(
            tree, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            kv_split_size=split, num_sms=self._sm_count, kv_tile=_BOUNDED_KV_TILE,
        )  # fmt: skip

    def _upload(self, plan: Plan, query_centric: bool, *, extended: bool = False, bounded: bool = False) -> RuntimePlan:
        if plan.n_partial_rows > self.max_partial_rows:
            raise CapacityError(
                f"the plan needs {plan.n_partial_rows} partial rows, more than max_partial_rows={self.max_partial_rows}"
            )
        n_units = plan.n_units
        if n_units > self.max_units:
            raise CapacityError(f"the plan has {n_units} work units, more than max_units={self.max_units}")
        if plan.pair_query.size > self.max_pairs:
            raise CapacityError(
                f"the plan has {plan.pair_query.size} (unit, query) pairs, more than max_pairs={self.max_pairs}"
            )
        if plan.kv_indices.size > self.kv_capacity:
            raise CapacityError(
                f"the plan has {plan.kv_indices.size} KV entries, more than the {self.kv_capacity} its arrays hold "
                f"({KV_CAPACITY_FACTOR} x max_kv_entries={self.max_kv_entries})"
            )
        n0 = plan.class_unit_ptr[1]
        if plan.tile_mode == ALL_LARGE:  # every unit in class 1 has large tiles: slot 0 runs them
            slot_units = ((0, n_units), (n_units, n_units))
        else:
            slot_units = ((0, n0), (n0, n_units))
        merge = plan.merge_queries
        many = plan.query_num_partials[merge] >= MANY_PARTIALS
        n_many = int(np.count_nonzero(many))
        if n_many and n_many < merge.size:
            merge = np.concatenate([merge[~many], merge[many]])
        merge_counts = (int(merge.size) - n_many, n_many)

        if not self.variants.max_variants:
            own = None
        elif extended:  # the extended plan's units, classes and partials are its fresh plan's: its launches too
            own = self._own_variant
        else:
            own = launch_variant(plan, self._target)
        variant_id = FIXED_VARIANT if own is None else self.variants.id_of(own)
        variant = self.variants.variant(variant_id)  # maybe a covering one; None: the fixed launch (max_variants 0)
        while self.variants.evicted:  # variants that left the table: their launchers go too
            gone = self.variants.evicted.pop()
            for k in [k for k in self._variant_launchers if k[0] == gone]:
                del self._variant_launchers[k]

        i = self._next_staging
        self._next_staging ^= 1
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # the copy out of this staging buffer (two plans ago) is done
        buf = self._staged[i]
        n_kv = plan.kv_indices.size
        # the fixed launch reads row masks whenever a member packs, a variant for its masked classes:
        # a plan with no packed unit gets all-ones masks (every query attends every entry) when its
        # launches read them (the fixed launch, or a covering variant with a masked class)
        reads_masks = self.masked if variant is None else any(s.masked for s in variant.stage1)
        no_mask = reads_masks and plan.kv_row_mask.size == 0
        offsets = []
        off = _HEADER_WORDS
        # every array's padding up to its aligned end is zeroed: the relocation copies aligned lengths,
        # so a per-query array's padding lands on queries past the plan's, the merge list's filler
        # (query max_queries) among them, which must read as no partials (else stale words from an
        # earlier plan in this staging buffer send a merge program to write an output row past them)
        for name in DEVICE_ARRAYS:
            offsets.append(off)
            if name == "kv_row_mask" and no_mask:
                n, end = n_kv, off + _aligned(n_kv)
                buf[off : off + n] = -1
            else:
                arr = merge if name == "merge_queries" else getattr(plan, name)
                n, end = arr.size, off + _aligned(max(1, arr.size))
                buf[off : off + n] = arr
            buf[off + n : end] = 0
            off = end
        ptr = plan.class_unit_ptr
        leads = [0, 0]  # a variant's idle programs of each class run first (relocate_plan_kernel)
        if variant is not None:
            for s in variant.stage1:
                leads[s.tile_class] = s.n_units - int(ptr[s.tile_class + 1] - ptr[s.tile_class])
            if min(leads) < 0:  # a variant's grids cover its plans' units (VariantTable)
                raise AssertionError(f"internal error: variant {variant_id}'s grids miss units of the plan")
        buf[: len(PLAN_HEADER)] = (
            *offsets, *slot_units[0], *slot_units[1], *merge_counts, ptr[0], ptr[1], ptr[1], ptr[2], *leads,
            self._merge_fill_end, off,
        )  # fmt: skip
        if off > self.plan_words:  # cannot happen when every capacity holds (checked above)
            raise ValueError(f"the plan needs {off} int32 words of plan buffer, more than {self.plan_words}")
        self._plan_buf[:off].copy_(self._staging[i][:off], non_blocking=True)
        if variant is not None:
            self._relocate(max(n_kv, plan.pair_query.size, plan.n_units, self.max_queries, self._merge_fill_end))
            # past its end, the merge list holds the filler query up to the region's end
            self._merge_fill_end = int(merge.size)
        if self._copied[i] is not None:
            self._copied[i].record(torch.cuda.current_stream(self.device))
        self._current = RuntimePlan(
            plan=plan, query_centric=query_centric, slot_units=slot_units, merge_counts=merge_counts,
            words=off, extended=extended, variant_id=variant_id, variant=variant, bounded=bounded,
        )  # fmt: skip
        self._own_variant = own
        return self._current

    def _relocate(self, longest: int) -> None:
        """Copy the uploaded plan's arrays to their fixed offsets (one launch, on the current stream
        after the upload), where the launch variants' kernels read them; ``longest``: the most
        words of one array."""
        programs = max(1, min(_RELOCATE_PROGRAMS, -(-longest // _RELOCATE_BLOCK)))
        with on_device(self.device):
            fixed = self._relocators.get(programs)
            if fixed is not None and not launch_hooks_active():  # compiled before: its bound launcher
                fixed(current_stream(self.device))
                return
            grid = (len(DEVICE_ARRAYS), programs)
            args = (self._plan_buf, self._fixed, self._fixed_dst, self.unit_region, self.max_queries)
            constexprs = (
                len(DEVICE_ARRAYS), DEVICE_ARRAYS.index("unit_kv_start"), DEVICE_ARRAYS.index("merge_queries"),
                _RELOCATE_BLOCK,
            )  # fmt: skip
            compiled = launch(relocate_plan_kernel, grid, args, constexprs, 4, 1)
            if compiled is not None:  # None: the interpreter, or launch hooks recording launches
                self._relocators[programs] = fixed_launcher(compiled, grid, args, constexprs)

    @property
    def stage1_programs(self) -> tuple[int, ...]:
        """Persistent programs of each stage-1 launch (0 until the first :meth:`forward` has
        compiled the kernel and sized its grid from the kernel's occupancy)."""
        return tuple(int(n) for n in self._programs[: self.stage1_launches])

    @property
    def current_plan(self) -> RuntimePlan | None:
        """The last plan :meth:`plan` uploaded (None before the first)."""
        return self._current

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        sm_scale: float | None = None,
    ) -> torch.Tensor:
        """Tree attention of the uploaded plan: its launch variant's launches (or the fixed launch),
        capturable in a CUDA graph that replays every later plan of the same variant.

        Parameters
        ----------
        q : Tensor, dtype [B, Hq, D], the runtime's device
            Row ``j`` is query ``j`` of the planned tree; ``B`` >= its queries. Rows past
            them are not read.
        k_cache, v_cache : Tensor, dtype [pool_slots, Hkv, D], the runtime's device
            The token pools the tree's slot ids index.
        out : Tensor, dtype [B, Hq, D], optional
            Written in place (rows past the planned queries are left untouched) and returned; its
            last dim contiguous, no two elements sharing memory.
        sm_scale : float, optional
            ``1 / sqrt(D)`` by default.

        Returns
        -------
        Tensor, dtype [B, Hq, D]

        Raises
        ------
        ValueError
            Before any launch: no plan uploaded yet, or tensors whose shape, dtype, device
            or layout do not match the runtime and the plan.
        """
        cur = self._current
        if cur is None:
            raise ValueError("forward() before plan(): upload a step's tree first")
        self._check(q, k_cache, v_cache, cur)
        out = output_like(q, out)
        scale = 1.0 / math.sqrt(self.head_dim) if sm_scale is None else sm_scale
        check_number("sm_scale", scale, above=0.0, expected="a positive finite number")
        self._min_rows = min(self._min_rows, q.shape[0])
        pool = k_cache.shape[0]
        self._min_pool = pool if self._min_pool is None else min(self._min_pool, pool)
        with on_device(q.device):
            self._launch_all(q, k_cache, v_cache, out, float(scale) * LOG2E)
        return out

    __call__ = forward

    def _check(self, q, k_cache, v_cache, cur: RuntimePlan) -> None:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name} must be a 3-D torch.Tensor")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} has dtype {t.dtype}, the runtime {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the runtime on {self.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
        b, hq, d = q.shape
        if (hq, d) != (self.num_q_heads, self.head_dim):
            raise ValueError(f"q has shape {tuple(q.shape)}, expected [B, Hq={self.num_q_heads}, D={self.head_dim}]")
        if b < cur.n_queries:
            raise ValueError(f"q has {b} rows but the uploaded plan has {cur.n_queries} queries")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} shapes differ")
        pool, hkv, dk = k_cache.shape
        if (hkv, dk) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"k_cache has shape {tuple(k_cache.shape)}, "
                f"expected [pool_slots, Hkv={self.num_kv_heads}, D={self.head_dim}]"
            )
        if self.pool_slots is not None and pool != self.pool_slots:
            raise ValueError(f"the KV pools have {pool} slots, the runtime was built for pool_slots={self.pool_slots}")
        if cur.plan.max_slot >= pool:
            raise ValueError(f"the uploaded plan reads pool slot {cur.plan.max_slot} but the KV pool has {pool} slots")

    # ---------------------------------------------------------------- launches
    def _layout_key(self, q, k_cache, v_cache, out) -> tuple | None:
        """What the launches' compiled kernels and fixed arguments depend on besides the tensors'
        addresses and ``qk_scale`` (dtype, 16-byte alignment, strides), or None when the call must
        go through Triton (the interpreter, launch hooks)."""
        if interpreting() or q.device.type != "cuda" or launch_hooks_active():
            return None
        return tensor_layout(q, k_cache, v_cache, out)

    def _launch_all(self, q, k_cache, v_cache, out, qk_scale: float) -> None:
        cur = self._current
        if cur.variant_id != FIXED_VARIANT:
            self._launch_variant(cur.variant_id, cur.variant, q, k_cache, v_cache, out, qk_scale)
            return
        key = self._layout_key(q, k_cache, v_cache, out)
        cached = self._launchers.get(key) if key is not None else None
        if cached is not None:  # every kernel compiled for this layout: call the launchers directly
            stream = current_stream(q.device)
            ptrs = launch_pointers(q, k_cache, v_cache, out)
            for launch in cached:
                launch(stream, *ptrs, qk_scale)
            return
        launched = self._launch_through_triton(q, k_cache, v_cache, out, qk_scale)
        # cache once the stage-1 grids are final (the first call sizes them after compiling)
        if (
            key is not None
            and all(c is not None for c, *_ in launched)
            and all(self._programs[i] == grid for i, (_, grid, *_) in enumerate(launched[:-1]))
        ):
            self._launchers[key] = tuple(
                direct_launcher(c, (grid, 1), args, constexprs, None if len(args) == _MERGE_ARGS else _STAGE1_QK_ARG)
                for c, grid, args, constexprs in launched
            )

    def _offsets_32(self, k_cache, v_cache) -> bool:
        """Whether stage 1 may form K/V addresses from int32 offsets: only when every slot a later
        plan may read is known to fit (``pool_slots`` fixed), since the launches, and graphs
        captured from them, serve every later plan."""
        return self.pool_slots is not None and kv_offsets_fit_int32(self.pool_slots - 1, k_cache, v_cache)

    def _launch_variant(self, vid: int, variant: LaunchVariant, q, k_cache, v_cache, out, qk_scale: float) -> None:
        """Launch variant ``vid``: its stage-1 launches (two side by side on two streams) and merge."""
        key = self._layout_key(q, k_cache, v_cache, out)
        cached = self._variant_launchers.get((vid, key)) if key is not None else None
        if cached is not None:  # compiled for this layout: call the launchers directly
            run_direct((variant.forked, cached), launch_pointers(q, k_cache, v_cache, out), q.device, qk_scale)
            return
        launches = self._variant_launches(variant, q, k_cache, v_cache, out, qk_scale)
        compiled = launch_through_triton(launches, q.device, variant.forked and self._target.cuda)
        if key is not None and all(c is not None for c in compiled):
            self._variant_launchers[(vid, key)] = direct_launchers(compiled, launches)

    def _variant_launches(self, variant: LaunchVariant, q, k_cache, v_cache, out, qk_scale: float) -> list:
        """``(kernel, grid, args, constexprs, num_warps, num_stages, maxnreg, shrink_stages)`` of each
        launch of ``variant``: tree_attention's kernels (:func:`fasttree.attention.kernel_launches`)
        over the arrays at fixed addresses, grids the variant's buckets (the stage-1 programs beyond
        the plan's units come first and find the relocation's empty units, which attend nothing;
        merge programs past its merge list find the filler query, which has no partial)."""
        unit_offsets = tuple(0 if s.tile_class == 0 else self.unit_region for s in variant.stage1)
        launches = kernel_launches(
            variant.stage1, variant.merge, self._fixed_arrays, self._part_o, self._part_lse, q, k_cache, v_cache,
            out, qk_scale, self._target, offsets_32=self._offsets_32(k_cache, v_cache), unit_offsets=unit_offsets,
        )  # fmt: skip
        shrink = [s.shrink_stages for s in variant.stage1] + [False] * (len(launches) - len(variant.stage1))
        return [(*spec, sh) for spec, sh in zip(launches, shrink, strict=True)]

    def _launch_through_triton(self, q, k_cache, v_cache, out, qk_scale: float) -> list[tuple]:
        """Launch through :func:`fasttree.launcher.launch`; returns ``(compiled, grid, args, constexprs)``
        of each launch, stage 1 first, the merge last."""
        launched = []
        d, hq = self.head_dim, self.num_q_heads
        block_d = next_pow2(d)
        upcast = interpreting() and q.dtype == torch.bfloat16
        offsets_32 = self._offsets_32(k_cache, v_cache)
        part_o, part_lse = self._part_o, self._part_lse
        (m0, n0, warps0, stages0), (m1, n1, warps1, stages1) = self.slots
        strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                   out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_lse.stride(0))  # fmt: skip
        if self.stage1_launches == 1:  # both slots, compiled for both tiles, the large class's warps and stages
            launches = [((m0, n0, m1, n1, 2), warps0, stages0)]
        else:  # one launch per slot, each compiled for its own tile alone
            launches = [((m0, n0, m0, n0, 0), warps0, stages0), ((m1, n1, m1, n1, 1), warps1, stages1)]
        target = GpuTarget.of(q.device, interpreting())
        gdc_stage1, gdc_merge = pdl_wait("persistent_stage1", target), pdl_wait("persistent_merge", target)
        for i, ((bm0, bn0, bm1, bn1, which), warps, stages) in enumerate(launches):
            constexprs = (d, block_d, self.group_size, bm0, bn0, bm1, bn1, self.masked, upcast, which, offsets_32,
                          peel_tiles(bm0), peel_tiles(bm1), True, gdc_stage1)  # fmt: skip
            args = (q, k_cache, v_cache, out, part_o, part_lse, self._plan_buf, self._launch_counters[i],
                    self.num_kv_heads, qk_scale, *strides)  # fmt: skip
            grid = self._programs[i] or self._sm_count
            compiled = launch(
                tree_attention_persistent_kernel, (grid, 1), args, constexprs, warps, stages, self._maxnreg[i],
                shrink_stages=self.config.num_stages is None,
            )  # fmt: skip
            launched.append((compiled, grid, args, constexprs))
            if not self._programs[i]:
                self._programs[i] = self._sm_count * self._occupancy(compiled, warps) * self.waves
        args = (out, part_o, part_lse, self._plan_buf, self._counters, hq, out.stride(0), out.stride(1),
                part_o.stride(0), part_o.stride(1), part_lse.stride(0))  # fmt: skip
        block_h = few_partials_merge_heads(hq)
        constexprs = (hq, d, block_h, _MERGE_BLOCK_P, block_d, self._counters.numel(), gdc_merge)
        grid = _MERGE_PROGRAMS_PER_SM * self._sm_count
        compiled = launch(merge_partials_persistent_kernel, (grid, 1), args, constexprs, 4, 1)
        launched.append((compiled, grid, args, constexprs))
        return launched

    def _occupancy(self, compiled, num_warps: int) -> int:
        """Programs of ``compiled`` one SM holds at once (``programs_per_sm`` when given)."""
        if self.programs_per_sm is not None:
            return self.programs_per_sm
        props = self._props
        if compiled is None or props is None:
            return 1
        by_threads = int(getattr(props, "max_threads_per_multi_processor", 2048)) // (32 * num_warps)
        regs = int(getattr(compiled, "n_regs", 0) or 0)
        regs_per_sm = int(getattr(props, "regs_per_multiprocessor", 65536))
        by_regs = regs_per_sm // (regs * 32 * num_warps) if regs > 0 else by_threads
        shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        smem = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
        by_smem = smem // shared if shared and smem else by_threads
        return max(1, min(by_threads, by_regs, by_smem, 32))
