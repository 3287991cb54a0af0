"""Launch policy: how a plan's tile classes and merges are launched on a given GPU.

Pure functions of a plan's shapes and a :class:`GpuTarget` (the facts of the GPU a launch runs
on), so that :func:`fasttree.tree_attention`, the runtime, the profiler and the latency model
ask the same questions and tests can ask them for any GPU. Each rule was measured on the H200
(``docs/history.md``); where a rule assumes the H100/H200's occupancy it applies on sm_90 only.

Dimension names: ``g`` GQA ratio, ``D`` head dim; a tile class's *items* are its units times
the KV heads (one program each in a per-plan launch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .kernels import tree_attention_units_sm90_kernel
from .plan_arrays import Plan, TileClass, tenth_longest
from .plan_rules import wide_head_tile

__all__ = [
    "MANY_PARTIALS",
    "MAX_GRID_Y",
    "MERGE_HEADS",
    "MERGE_PARTIALS_PER_STEP",
    "SM90_TILES",
    "SMALL_TILE_CAPPED_PROGRAMS",
    "GpuTarget",
    "MergeLaunch",
    "Sm90Tile",
    "Stage1Launch",
    "capped_registers",
    "few_partials_merge_heads",
    "kv_offsets_fit_int32",
    "launch_kv_tile",
    "launch_num_stages",
    "merge_heads_per_program",
    "merge_launch",
    "merge_max_partials",
    "next_pow2",
    "pdl_wait",
    "peel_tiles",
    "sm90_tile",
    "small_tile_maxnreg",
    "stage1_launches",
    "units_grid",
    "warp_specialized_stage1",
]

#: The largest second grid dimension a CUDA launch takes.
MAX_GRID_Y = 65535
#: Query heads merged by one program of the few-partials merge.
MERGE_HEADS = 4
#: Merged queries with this many partials or more go to the many-partials merge (H200, paper suite:
#: 3-28% faster on plans with 7-27 partials per query, up to 6-12% slower on those with 2-5).
MANY_PARTIALS = 7
#: Partial rows the many-partials merge reads in one step (a query with more takes several).
MERGE_PARTIALS_PER_STEP = 32
#: Programs per SM of the 16-row stage-1 kernel at 4 warps and head dim <= 128 as compiled (159
#: registers on sm_90), and with its registers capped by :func:`capped_registers`.
_SMALL_TILE_PROGRAMS, SMALL_TILE_CAPPED_PROGRAMS = 3, 4
#: Beyond this many waves the tail a register cap saves is small and the cap cost 1-4% (H200, 26 waves).
_SMALL_TILE_MAX_WAVES = 8
#: Fewest KV tiles per unit, on average over a launch's units, for peeling the tail tile: outside
#: the pipelined loop it costs about what the unmasked tiles save on units of 1.75-1.9 tiles (H200:
#: +4-5%), while units of 2.75 and more gained 1-12%.
_PEEL_MIN_TILES = 2.5
#: The KV tile of a one-wave 16-row GQA class (:func:`launch_kv_tile`): 16 x 128-token tiles keep 3
#: programs per SM on sm_90 at head dim 128 (168 registers, 75 KB of shared memory, one K/V buffer).
_WIDE_KV_TILE_TOKENS = 128
#: Stages of a one-wave 16-row MHA class (:func:`launch_num_stages`): two gathered K/V buffers
#: (73 KB at head dim 128: 3 programs per SM instead of 5).
_DEEP_ONE_WAVE_STAGES = 5
#: Compute capability (major) whose occupancy the one-wave rules assume: 3 programs per SM of
#: 16-row tiles at 75 KB of shared memory each, as on the H100/H200 (227 KB per program, 64K
#: registers per SM). GPUs with less shared memory per SM (sm_80: 163 KB, sm_86/89: 99 KB) would
#: fit fewer, so the rules would add waves there: they keep the plan's launch settings.
_ONE_WAVE_MAJOR = 9
_INT32_MAX = 2**31 - 1
#: Kinds of launch whose programmatic-dependent-launch wait :func:`pdl_wait` gives.
PDL_KINDS = ("stage1", "stage1_forked", "merge", "persistent_stage1", "persistent_merge")


@dataclass(frozen=True)
class GpuTarget:
    """The facts of the device a launch runs on that the launch rules read.

    Attributes
    ----------
    cuda : bool
        A compiled CUDA launch (False: Triton's CPU interpreter, which has no programmatic
        dependent launch and no register caps).
    major : int
        Compute capability major (0 under the interpreter).
    sms : int
        Streaming multiprocessors (0 under the interpreter).
    regs_per_sm : int
        32-bit registers per SM.
    """

    cuda: bool
    major: int = 0
    sms: int = 0
    regs_per_sm: int = 65536

    @property
    def one_wave_sms(self) -> int:
        """SMs the one-wave rules count (:func:`launch_kv_tile`, :func:`launch_num_stages`), or 0
        where they do not apply (GPUs of another compute capability; the interpreter's target
        has none, a test may give it an H200's to run those launches on the CPU)."""
        return self.sms if self.major == _ONE_WAVE_MAJOR else 0

    @property
    def pdl(self) -> bool:
        """Whether launches may use programmatic dependent launch (sm_90 and newer)."""
        return self.cuda and self.major >= 9

    @staticmethod
    def of(device: torch.device, interpreting: bool) -> GpuTarget:
        """The target of launches on ``device`` (cached per CUDA device); the interpreter's when
        ``interpreting`` or ``device`` is not a CUDA device."""
        if interpreting or device.type != "cuda":
            return _INTERPRETER
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_target(index)


_INTERPRETER = GpuTarget(cuda=False)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``): ``triton.next_power_of_2`` without its
    constexpr-function call overhead (a few microseconds per host call)."""
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def _cuda_target(index: int) -> GpuTarget:
    props = torch.cuda.get_device_properties(index)
    return GpuTarget(
        cuda=True,
        major=int(props.major),
        sms=int(props.multi_processor_count),
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536)),
    )


def units_grid(n_units: int, num_kv_heads: int) -> tuple[tuple[int, int], bool]:
    """The per-plan stage-1 grid of ``n_units`` units and ``num_kv_heads`` KV heads, and its
    ``HEADS_FASTEST``.

    ``(heads, units)`` with the KV heads fastest (programs launch with the first dimension
    fastest) when the units fit the grid's second dimension: a unit's heads then run together
    and read each gathered slot's K and V rows of every head, which are contiguous in the pools,
    at about the same time (H200: 0.95x the runtime's time on Llama decode trees, 0.98x on
    Mistral's, 0.997x on the paper suite). Else ``(units, heads)``.
    """
    if n_units <= MAX_GRID_Y:
        return (num_kv_heads, n_units), True
    return (n_units, num_kv_heads), False


def peel_tiles(block_m: int, mean_tiles: float | None = None) -> bool:
    """Whether a stage-1 launch of ``block_m``-row tiles runs its units' whole KV tiles unmasked,
    then one masked tail tile (the kernels' ``PEEL``).

    Tiles of more than 16 rows whose units average at least :data:`_PEEL_MIN_TILES` KV tiles
    (``mean_tiles``; None, as for the runtime's launches, which serve every later plan: not
    checked). On the H200 paper suite peeling the 64-row launches took 0.977x the time on
    geomean (GQA 4 down to 0.89x) and left the runtime's decode trees unchanged (0.998x);
    peeling 16-row launches cost up to 9%.
    """
    return block_m > 16 and (mean_tiles is None or mean_tiles >= _PEEL_MIN_TILES)


def kv_offsets_fit_int32(max_slot: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the stage-1 kernels may form K/V addresses from int32 offsets (``OFFSETS_32``).

    True when, in both pools, the element offset of every (slot, KV head, dim) with slot <=
    ``max_slot`` (``slot * stride(0) + head * stride(1) + dim``) is at most ``2**31 - 1``.
    The answer depends only on ``max_slot``, the pools' strides and their head and dim sizes,
    so launchers cached by plan and tensor layout stay valid.
    """
    _, hkv, d = k_cache.shape
    for t in (k_cache, v_cache):
        s0, s1 = t.stride(0), t.stride(1)
        if max_slot * s0 + (hkv - 1) * s1 + d - 1 > _INT32_MAX:
            return False
    return True


def capped_registers(num_warps: int, regs_per_sm: int = 65536, programs: int = SMALL_TILE_CAPPED_PROGRAMS) -> int:
    """Registers per thread (a multiple of 8) that let ``programs`` programs of ``num_warps``
    warps share an SM of ``regs_per_sm`` registers (128 for 4 programs of 4 warps on an H100/H200)."""
    return regs_per_sm // (programs * 32 * num_warps) // 8 * 8


def small_tile_maxnreg(
    group_size: int, head_dim: int, block_m: int, num_warps: int, items: int, sms: int
) -> int | None:
    """Register cap of a 16-row MHA tile class's launch, or None (the compiler's choice).

    An MHA class of 16-row tiles (one query per row: memory-bound programs) gets
    :func:`capped_registers` (128 per thread), 4 programs per SM instead of 3, when that puts its
    ``items``, at most :data:`_SMALL_TILE_MAX_WAVES` waves of the GPU's ``sms`` SMs, into fewer
    waves. On the H200 paper suite a cap on every such launch was 16-23% faster on the MHA cases
    whose items fill 1-2 waves, 2-6% faster on those with 2-6 waves, 1-4% slower on one with 26
    waves and up to 15% slower where the items already fit one wave. GQA tiles gained nothing,
    nor did 96 registers.
    """
    if group_size != 1 or head_dim > 128 or block_m > 16 or num_warps != 4 or sms <= 0:
        return None
    waves = -(-items // (_SMALL_TILE_PROGRAMS * sms))
    if waves <= _SMALL_TILE_MAX_WAVES and -(-items // (SMALL_TILE_CAPPED_PROGRAMS * sms)) < waves:
        return capped_registers(num_warps)
    return None


def _one_wave_of_small_tiles(head_dim: int, tc: TileClass, items: int, sms: int) -> bool:
    """The condition both one-wave rules share: a 16-row class at head dim <= 128 with one gathered
    K/V buffer (up to 4 stages) whose ``items`` fit one wave of ``sms`` SMs at 3 programs per SM."""
    return head_dim <= 128 and tc.block_m == 16 and tc.num_stages <= 4 and items <= _SMALL_TILE_PROGRAMS * sms


def launch_kv_tile(
    group_size: int, head_dim: int, tc: TileClass, lengths: np.ndarray, items: int, sms: int, wide_head_cap: int
) -> int:
    """KV tokens per inner-loop tile of one stage-1 launch of tile class ``tc``.

    ``tc.block_n`` (the plan's), at most ``wide_head_cap`` (``PlanRules.wide_head_kv_tile``; 0: no
    cap) for a class of 32 or more rows above head dim 128; and a 16-row GQA class (several heads per query, 4 or
    more warps, at most 4 stages, head dim <= 128) with a 64-token tile runs 128-token tiles
    when its ``items`` fit one wave of the GPU's ``sms`` SMs at 3 programs per SM and one unit in
    ten or more (``lengths``: the class's unit KV lengths) is longer than 64 tokens. Such a
    launch is bound by each program's chain of dependent KV tiles, not by the GPU's throughput,
    so halving the tiles shortens it (H200 paper suite: 0.89-0.91x on the four cases it changes;
    the same tile on 2.6 waves cost 5%, and MHA's 2-warp 16-row tiles lost 10-40% with it).
    ``sms`` is :attr:`GpuTarget.one_wave_sms` (0: the rule does not apply).
    """
    capped = wide_head_tile(head_dim, tc.block_m, tc.block_n, wide_head_cap)
    if capped != tc.block_n:
        return capped
    if (
        group_size == 1
        or not _one_wave_of_small_tiles(head_dim, tc, items, sms)
        or tc.block_n != 64
        or tc.num_warps < 4
        or lengths.size == 0
    ):
        return tc.block_n
    return _WIDE_KV_TILE_TOKENS if tenth_longest(lengths) > tc.block_n else tc.block_n


def launch_num_stages(group_size: int, head_dim: int, tc: TileClass, items: int, sms: int) -> int:
    """Pipeline stages of one stage-1 launch of tile class ``tc`` whose config leaves the stages
    to their defaults (a config that sets ``num_stages`` keeps them: the caller does not ask).

    ``tc.num_stages``, except that a 16-row MHA class (one query per row, up to 4 stages: one
    gathered K/V buffer, head dim <= 128) runs 5 stages, a second buffer, when its ``items`` fit
    one wave of the GPU's ``sms`` SMs at the 3 programs per SM that leaves room for: the wave
    count does not change, and each program's chain of KV tiles has one more tile in flight.
    Where the deeper buffers would add a wave they cost 14-18% on the H200. ``sms`` is
    :attr:`GpuTarget.one_wave_sms` (0: the rule does not apply).
    """
    if group_size != 1 or not _one_wave_of_small_tiles(head_dim, tc, items, sms):
        return tc.num_stages
    return _DEEP_ONE_WAVE_STAGES


def pdl_wait(kind: str, target: GpuTarget) -> int:
    """``GDC_WAIT`` of a ``kind`` launch (:data:`PDL_KINDS`): 0 (no programmatic dependent launch),
    1 (the grid waits for the previous one first) or 2 (early: it reads the plan's arrays for its
    first item, then waits).

    Per-plan stage-1 launches and merges wait first (H200, graph replay of back-to-back calls:
    paper suite 0.98x of no PDL); one of two stage-1 launches that run side by side on two
    streams does not use it (forked plans lost 1.23-1.31x with it); the runtime's persistent
    launches wait early (its decode trees 0.973x of waiting first; the per-plan kernels lost
    1.02x with early waits, hence early for the runtime only). None before sm_90.
    """
    if kind not in PDL_KINDS:
        raise ValueError(f"launch kind must be one of {PDL_KINDS}, got {kind!r}")
    if not target.pdl or kind == "stage1_forked":
        return 0
    return 2 if kind.startswith("persistent") else 1


def merge_max_partials(plan: Plan) -> int:
    """Most partial rows of one merged query of ``plan`` (0 when nothing is merged)."""
    if plan.merge_queries.size == 0:
        return 0
    return int(plan.query_num_partials[plan.merge_queries].max())


def few_partials_merge_heads(num_q_heads: int) -> int:
    """Query heads one program of a few-partials merge handles (the runtime's persistent merge too)."""
    return min(next_pow2(num_q_heads), MERGE_HEADS)


def merge_heads_per_program(plan: Plan) -> int:
    """Query heads one program of ``plan``'s merge launch handles (1 for the many-partials merge)."""
    if merge_max_partials(plan) >= MANY_PARTIALS:
        return 1
    return few_partials_merge_heads(plan.num_q_heads)


@dataclass(frozen=True)
class Stage1Launch:
    """The launch of one tile class's stage 1, as :func:`stage1_launches` decides it for a plan.

    Attributes
    ----------
    tile_class : int
        The class (0 large tiles, 1 small tiles).
    first_unit, n_units : int
        The class's units: ``first_unit ... first_unit + n_units - 1``.
    block_m, block_n : int
        Matrix rows of a program and KV tokens per inner-loop tile.
    num_warps, num_stages : int
        Warps per program and pipeline stages.
    maxnreg : int or None
        Register cap per thread (None: the compiler's choice).
    masked : bool
        The class holds packed units (row masks apply).
    peel : bool
        Whole KV tiles unmasked, then one masked tail tile.
    shrink_stages : bool
        The stages are the config's defaults: fewer may be compiled where shared memory ends.
    warp_specialized : bool
        The class runs the sm_90 Gluon kernel (:func:`warp_specialized_stage1`) at its own tile
        (:func:`sm90_tile`), not the Triton kernel at ``block_n``, ``num_warps``, ``num_stages``.
    """

    tile_class: int
    first_unit: int
    n_units: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None
    masked: bool
    peel: bool
    shrink_stages: bool
    warp_specialized: bool = False


@dataclass(frozen=True)
class Sm90Tile:
    """The launch shape of the sm_90 Gluon stage 1 (:mod:`fasttree.kernels.tree_attention_sm90`)
    at one head dim; its results do not depend on it.

    Attributes
    ----------
    block_n : int
        KV entries per tile.
    stages : int
        Depth of the shared-memory ring of K and V tiles.
    maxnreg : int
        Registers per thread of the whole program (the consumer warpgroup and the loader's warps),
        which the two partitions share through ``setmaxnreg``.
    loader_regs : int
        Registers per thread of the loader partition.
    loader_warps : int
        Warps of the loader partition.
    """

    block_n: int
    stages: int
    maxnreg: int
    loader_regs: int
    loader_warps: int = 4


#: The Gluon stage 1's tile, with 32-bit K/V offsets (``OFFSETS_32``) and with 64-bit ones (pools
#: past 2**31 elements: the loader's addresses take more registers, at 40 it spills). Head dim 128
#: only: through ``tree_attention`` on an H100 it ran 1.07x as fast as the Triton kernel on the 83
#: trees it changed at D 128 (fresh draws and the suites; none below 0.99x), but 0.91x at D 256 (one
#: program per SM against the Triton kernel's two) and 1.03x at D 64 with a loss of 0.958x
#: (``docs/history.md``). Compiled for
#: sm_90a with Triton 3.6: 2 programs per SM (82 KB of shared memory, 8 warps x 128 registers), no
#: spill.
SM90_TILES: dict[tuple[int, bool], Sm90Tile] = {
    (128, True): Sm90Tile(block_n=64, stages=2, maxnreg=128, loader_regs=40),
    (128, False): Sm90Tile(block_n=64, stages=2, maxnreg=128, loader_regs=56),
}
#: The tile class the Gluon stage 1 runs: one consumer warpgroup of 64 rows.
_SM90_BLOCK_M = 64


def sm90_tile(head_dim: int, offsets_32: bool) -> Sm90Tile:
    """The Gluon stage 1's tile at ``head_dim`` (a head dim of :data:`SM90_TILES`) with 32-bit or
    64-bit K/V offsets."""
    return SM90_TILES[(head_dim, offsets_32)]


def sm90_tile_class(block_m: int, head_dim: int) -> bool:
    """Whether the Gluon stage 1 has a tile for a class of ``block_m`` rows at ``head_dim``: 64 rows
    at a head dim of :data:`SM90_TILES` (128)."""
    return block_m == _SM90_BLOCK_M and (head_dim, True) in SM90_TILES


def warp_specialized_stage1(on: bool, target: GpuTarget, block_m: int, head_dim: int) -> bool:
    """Whether a tile class of ``block_m`` rows at ``head_dim`` runs the sm_90 Gluon stage 1: where
    ``on`` (:attr:`fasttree.PlanRules.sm90_stage1`), on a compiled sm_90 target, for a class of
    :func:`sm90_tile_class`, and where the installed Triton has Gluon's Hopper ops."""
    return (
        on
        and target.cuda
        and target.major == 9
        and sm90_tile_class(block_m, head_dim)
        and tree_attention_units_sm90_kernel is not None
    )


@dataclass(frozen=True)
class MergeLaunch:
    """The merge launch of a plan, as :func:`merge_launch` decides it.

    Attributes
    ----------
    many : bool
        The many-partials merge (one program per merged query and head, ``block_p`` partial
        rows at a time); else the few-partials one (``block_h`` heads per program).
    n_merge : int
        Merged queries.
    block_h, block_p : int
        Heads per program (few-partials) and partial rows per step (many-partials; 0 otherwise).
    num_warps, num_stages : int
    """

    many: bool
    n_merge: int
    block_h: int
    block_p: int
    num_warps: int
    num_stages: int


def stage1_launches(
    plan: Plan, target: GpuTarget, grid: Callable[[int], int] | None = None
) -> tuple[Stage1Launch, ...]:
    """The stage-1 launch of each non-empty tile class of ``plan`` on ``target``; with ``grid``,
    each launch starts at unit 0 and runs ``grid(n)`` units for a class of ``n`` (a launch
    variant's grid bucket, :func:`fasttree.launch_variants.launch_variant`).

    One place for the per-plan choices :func:`fasttree.tree_attention` and the runtime's launch
    variants make alike: the KV tile (:func:`launch_kv_tile`, with the plan's
    ``rules.wide_head_kv_tile``), the stages
    (:func:`launch_num_stages`, only where the config leaves them to their defaults), peeling
    (:func:`peel_tiles`), MHA's register cap (:func:`small_tile_maxnreg`) and the sm_90 Gluon
    kernel (:func:`warp_specialized_stage1`, with the plan's ``rules.sm90_stage1``).
    """
    ptr = plan.class_unit_ptr
    d, g = plan.head_dim, plan.group_size
    sms = target.one_wave_sms
    default_stages = plan.config.num_stages is None
    out = []
    for c, tc in enumerate(plan.tile_classes):
        n_units = int(ptr[c + 1] - ptr[c])
        if n_units == 0:
            continue
        lengths = plan.unit_kv_len[ptr[c] : ptr[c + 1]]
        items = n_units * plan.num_kv_heads
        block_n = launch_kv_tile(g, d, tc, lengths, items, sms, plan.rules.wide_head_kv_tile)
        num_stages = launch_num_stages(g, d, tc, items, sms) if default_stages else tc.num_stages
        mean_tiles = float(np.add.reduce(-(-lengths // block_n), dtype=np.int64)) / n_units
        maxnreg = None
        if g == 1 and tc.block_m <= 16 and target.cuda:
            maxnreg = small_tile_maxnreg(g, d, tc.block_m, tc.num_warps, items, target.sms)
        out.append(
            Stage1Launch(
                tile_class=c, first_unit=0 if grid else int(ptr[c]), n_units=grid(n_units) if grid else n_units,
                block_m=tc.block_m, block_n=block_n,
                num_warps=tc.num_warps, num_stages=num_stages, maxnreg=maxnreg, masked=tc.masked,
                peel=peel_tiles(tc.block_m, mean_tiles), shrink_stages=default_stages,
                warp_specialized=warp_specialized_stage1(plan.rules.sm90_stage1, target, tc.block_m, d),
            )
        )  # fmt: skip
    return tuple(out)


def merge_launch(plan: Plan, block_d: int, grid: Callable[[int], int] | None = None) -> MergeLaunch | None:
    """The merge launch of ``plan`` (None when no query has several partials); ``block_d`` is
    the head dim rounded up to a power of two; with ``grid``, it runs ``grid(n)`` programs for
    ``n`` merged queries (a launch variant's grid bucket).

    Every merged query goes to the many-partials merge when one has :data:`MANY_PARTIALS` or
    more partial rows, else to the few-partials merge.
    """
    n_merge = int(plan.merge_queries.size)
    if n_merge == 0:
        return None
    most = merge_max_partials(plan)
    if most >= MANY_PARTIALS:
        block_p = min(MERGE_PARTIALS_PER_STEP, next_pow2(most))
        warps = 1 if block_p * block_d <= 512 else 2 if block_p * block_d <= 2048 else 4
        return MergeLaunch(
            many=True, n_merge=grid(n_merge) if grid else n_merge, block_h=1, block_p=block_p, num_warps=warps,
            num_stages=1,
        )  # fmt: skip
    block_h = few_partials_merge_heads(plan.num_q_heads)
    return MergeLaunch(
        many=False, n_merge=grid(n_merge) if grid else n_merge, block_h=block_h, block_p=0, num_warps=4, num_stages=3
    )
