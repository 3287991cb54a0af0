"""The tuner's search space: the :class:`~fasttree.config.FastTreeConfig` a trial proposes for one bucket.

The space is the profiling design's (:mod:`fasttree.toolkit.design`), never wider, because the
latency model was trained only there: query-tile rows per tile class from
:data:`~fasttree.toolkit.design.Q_ROWS_LARGE` / :data:`~fasttree.toolkit.design.Q_ROWS_SMALL` (turned
into queries per tile with the bucket's GQA ratio, as the profiler does), KV tiles, split
sizes, both parallelism-threshold pairs in ``[0, 4 * sm_count]``, alpha/beta/gamma in their
ranges, warps and stages per tile class, and packing (``pack_min_units`` only when packing
is on). Powers of two are suggested as integer exponents (``log2_*``), so TPE sees their
order.

Invalid combinations never reach the objective:

* tile rows x GQA ratio over the kernel's 256 rows cannot be drawn: the large rows are at
  least the small ones and the queries per tile are ``max(1, rows // g)``; a bucket whose
  ratio alone exceeds the limit is refused when the :class:`Bucket` is built;
* configs whose units kernel needs more shared memory than one block of the GPU may use
  (:func:`config_smem_bytes`, head dim 256 with large tiles) are *pruned*
  (:class:`optuna.TrialPruned`, reason in the ``invalid`` user attribute) before
  anything is planned: not scored, and TPE ranks pruned trials below every completed one.

:func:`default_params` gives the published defaults as trial parameters (the study
enqueues them as its first trial); :func:`config_from_params` turns any trial's
parameters back into a config, so ``config_from_params(default_params(gpu, g, d), g, d) ==
FastTreeConfig()``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from fasttree.config import DEFAULT_NUM_STAGES_DEEP, DEFAULT_Q_TILE_ROWS, FastTreeConfig
from fasttree.costmodel.gpu import GpuSpec
from fasttree.costmodel.predict import elem_bytes_of
from fasttree.export import bucket_key, bucket_label
from fasttree.toolkit.design import (
    ALPHA_RANGE,
    BETA_RANGE,
    GAMMA_RANGE,
    KV_TILES,
    MAX_TILE_ROWS,
    NUM_STAGES,
    NUM_WARPS,
    PACK_TOKENS,
    Q_ROWS_LARGE,
    Q_ROWS_SMALL,
    SPLITS_LARGE,
    SPLITS_SMALL,
)
from fasttree.validation import check_int, is_int, is_number

#: Pipeline stages the tuner searches: the profiler's and the defaults' 5 for the large class
#: (:data:`fasttree.config.DEFAULT_NUM_STAGES_DEEP`). The traces behind the shipped latency
#: model hold no 5-stage launches, so its predictions there extrapolate.
TUNER_NUM_STAGES = tuple(sorted(set(NUM_STAGES) | set(DEFAULT_NUM_STAGES_DEEP)))

__all__ = [
    "CLASSES",
    "PARAM_NAMES",
    "PIPELINE_BUFFERS",
    "SMEM_RESERVE_BYTES",
    "Bucket",
    "canonical_config",
    "check_params",
    "config_from_params",
    "config_smem_bytes",
    "default_params",
    "invalid_reason",
    "plan_smem_bytes",
    "search_space",
    "suggest_config",
    "suggest_params",
    "threshold_high",
    "units_kernel_smem_bytes",
]

logger = logging.getLogger(__name__)

#: Tile-class suffixes of the per-class parameters (index 0 and 1 of the config's pairs).
CLASSES = ("large", "small")

# ------------------------------------------------------------------ shared memory
#: Bytes the units kernel holds besides its tiles: the compiler's reports in
#: ``traces/h200_heldout`` (Triton 3.6, H200) are the tiles plus 512 or 1024 bytes.
SMEM_RESERVE_BYTES = 1024
#: Most K (and V) tile buffers of the pipelined loop: the H200 reports show two for
#: ``num_stages`` 2, 3 and 4 alike.
PIPELINE_BUFFERS = 2
#: Stages past which every two more add a K/V buffer (both paths; the tuner's space stops at 4,
#: the measured refinement of :mod:`fasttree.toolkit.refine` goes to 8).
EXTRA_BUFFER_STAGES = 3
#: Triton pipelines the KV loop through shared memory on the Hopper (wgmma) path only,
#: which needs a warp group (4 warps) and 64 matrix rows; with fewer, one buffer.
_PIPELINED_MIN_WARPS = 4
_PIPELINED_MIN_ROWS = 64
#: The kernel's smallest tile rows (``tl.dot`` needs 16), as :mod:`fasttree.plan_arrays` pads.
_MIN_BLOCK_M = 16


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


def units_kernel_smem_bytes(
    *, block_m: int, block_n: int, head_dim: int, num_warps: int, num_stages: int, elem_bytes: int = 2
) -> int:
    """Estimated shared memory (bytes) of one program of the units kernel (``kernels/tree_attention.py``).

    The Q tile (``block_m`` rows) plus the K and V tiles (``block_n`` tokens each) times the
    pipeline's buffers, at ``next_pow2(head_dim)`` columns, plus :data:`SMEM_RESERVE_BYTES`.
    Buffers: ``min(num_stages, PIPELINE_BUFFERS)`` when Triton pipelines the loop (at least
    4 warps and 64 rows, ``num_stages >= 2``), else one; plus one more for every two stages
    past 4 (:data:`EXTRA_BUFFER_STAGES`: Triton 3.6 on sm_90 reports the same bytes for 2-4
    stages, then a buffer more at 5 and at 7, on both paths; ``tests/test_compile_sm90.py``).

    Against the H200 measurements (``traces/h200`` and ``traces/h200_heldout``, 31,208
    records, 27 of them failed for shared memory), the limit of 227 KiB applied to every
    launched tile class of the re-planned records rejects all 27 failed records and none
    of the 31,181 ok ones; it reproduces the compiler's reported bytes within 1 KiB.
    Applied to whole configs (:func:`config_smem_bytes`, what the tuner prunes with), it
    rejects all 27 failed and 49 ok records: head-dim-256 configs whose largest tile the
    record's own tree happened not to launch at full size (``tests/test_tuner.py``).

    Parameters
    ----------
    block_m : int
        Matrix rows of a program (query tile x GQA ratio, padded to a power of two >= 16).
    block_n : int
        KV tokens per inner-loop tile.
    head_dim : int
        Head dimension (the kernel pads it to a power of two).
    num_warps, num_stages : int
        Triton launch settings.
    elem_bytes : int
        Bytes per Q/K/V element.

    Returns
    -------
    int
    """
    block_d = _next_pow2(head_dim)
    pipelined = num_stages >= 2 and num_warps >= _PIPELINED_MIN_WARPS and block_m >= _PIPELINED_MIN_ROWS
    buffers = (min(num_stages, PIPELINE_BUFFERS) if pipelined else 1) + max(0, num_stages - EXTRA_BUFFER_STAGES) // 2
    return elem_bytes * block_d * (block_m + 2 * buffers * block_n) + SMEM_RESERVE_BYTES


def config_smem_bytes(config: FastTreeConfig, group_size: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Most shared memory any launch of ``config`` can need, over every tree.

    A launch of tile class ``s`` uses the class's warps and stages with the query and KV
    tiles of either class (the planner's all-large / all-small modes run one class with
    the other's tiles), so every pairing counts; the KV tile only ever shrinks below the
    config's. Raises ``ValueError`` when the query tiles exceed the kernel's rows.
    """
    queries = config.query_tiles(group_size)
    warps = config.launch_warps(group_size)
    stages = config.launch_stages(group_size, head_dim)
    block_m = [max(_MIN_BLOCK_M, _next_pow2(q * group_size)) for q in queries]
    return max(
        units_kernel_smem_bytes(
            block_m=block_m[tiles],
            block_n=config.kv_tile[tiles],
            head_dim=head_dim,
            num_warps=warps[launch],
            num_stages=stages[launch],
            elem_bytes=elem_bytes,
        )
        for tiles in (0, 1)
        for launch in (0, 1)
    )


def plan_smem_bytes(plan: Any, elem_bytes: int = 2, *, every_class: bool = False) -> int:
    """Estimated shared memory of the units-kernel launches a :class:`fasttree.Plan` makes (0 if none).

    With ``every_class``, tile classes without units count too: the runtime compiles and launches
    both of its launch slots every step (pass its :func:`fasttree.runtime_planning.launch_view`).
    """
    ptr = plan.class_unit_ptr
    sizes = [
        units_kernel_smem_bytes(
            block_m=tc.block_m,
            block_n=tc.block_n,
            head_dim=plan.head_dim,
            num_warps=tc.num_warps,
            num_stages=tc.num_stages,
            elem_bytes=elem_bytes,
        )
        for c, tc in enumerate(plan.tile_classes)
        if every_class or ptr[c + 1] > ptr[c]
    ]
    return max(sizes, default=0)


# ------------------------------------------------------------------------ buckets
@dataclass(frozen=True, order=True)
class Bucket:
    """What a tuned config is specific to: GQA ratio, head dim and dtype.

    Attributes
    ----------
    group_size : int
        ``num_q_heads // num_kv_heads``, at most the kernel's 256 rows.
    head_dim : int
        In [16, 256].
    dtype : str
        ``"float16"`` or ``"bfloat16"``.
    """

    group_size: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        g = self.group_size
        g = check_int("a bucket's GQA ratio", g, minimum=1, maximum=MAX_TILE_ROWS)
        _, d, dtype = bucket_key(num_q_heads=g, num_kv_heads=1, head_dim=self.head_dim, dtype=self.dtype)
        object.__setattr__(self, "group_size", g)
        object.__setattr__(self, "head_dim", d)
        object.__setattr__(self, "dtype", dtype)

    @classmethod
    def of(cls, *, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: Any) -> Bucket:
        """The bucket of an attention shape (``ValueError`` on shapes the kernel does not take)."""
        g, d, name = bucket_key(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        return cls(g, d, name)

    @property
    def elem_bytes(self) -> int:
        """Bytes per Q/K/V element."""
        return elem_bytes_of(self.dtype)

    @property
    def label(self) -> str:
        """``g{G}-d{D}-{dtype}``, the suffix of the bucket's study name."""
        return bucket_label(self.group_size, self.head_dim, self.dtype)


# ------------------------------------------------------------------------- space
def _log2_bounds(name: str, values: tuple[int, ...]) -> tuple[int, int]:
    """Exponent range of consecutive powers of two (the profiler's tuples)."""
    exps = [v.bit_length() - 1 for v in values]
    if any(v != 1 << e for v, e in zip(values, exps, strict=True)) or exps != list(range(exps[0], exps[-1] + 1)):
        raise ValueError(f"{name} must be consecutive powers of two, got {values}")
    return exps[0], exps[-1]


_LOG2 = {
    "q_rows_large": _log2_bounds("Q_ROWS_LARGE", Q_ROWS_LARGE),
    "q_rows_small": _log2_bounds("Q_ROWS_SMALL", Q_ROWS_SMALL),
    "kv_tile": _log2_bounds("KV_TILES", KV_TILES),
    "kv_split_large": _log2_bounds("SPLITS_LARGE", SPLITS_LARGE),
    "kv_split_small": _log2_bounds("SPLITS_SMALL", SPLITS_SMALL),
    "num_warps": _log2_bounds("NUM_WARPS", NUM_WARPS),
}
if Q_ROWS_LARGE[0] < Q_ROWS_SMALL[-1]:  # would let the large tile be smaller than the small one
    raise ValueError("the profiler's large query-tile rows must not be below its small ones")

#: Every parameter a trial may suggest, in order (``pack_min_units`` only when ``pack_tokens > 0``).
PARAM_NAMES: tuple[str, ...] = (
    "log2_q_rows_large",
    "log2_q_rows_small",
    *(f"log2_kv_tile_{c}" for c in CLASSES),
    *(f"log2_kv_split_{c}" for c in CLASSES),
    *(f"para_thresh1_{c}" for c in CLASSES),
    *(f"para_thresh2_{c}" for c in CLASSES),
    "alpha",
    "beta",
    "gamma",
    *(f"log2_num_warps_{c}" for c in CLASSES),
    *(f"num_stages_{c}" for c in CLASSES),
    "pack_tokens",
    "pack_min_units",
)


def threshold_high(gpu: GpuSpec) -> int:
    """Upper end of the thresholds and ``pack_min_units``: ``4 * sm_count`` (the profiler's),
    raised to the defaults' values on a GPU with fewer SMs so the defaults stay in the space."""
    d = FastTreeConfig()
    return max(4 * int(gpu.sm_count), *d.para_threshs1, *d.para_threshs2, d.pack_min_units)


def search_space(gpu: GpuSpec) -> dict[str, BaseDistribution]:
    """Every parameter's Optuna distribution, keyed and ordered as :data:`PARAM_NAMES`.

    Parameters
    ----------
    gpu : GpuSpec
        Sets the range of the thresholds and of ``pack_min_units`` (:func:`threshold_high`).

    Returns
    -------
    dict of str to optuna.distributions.BaseDistribution
    """
    hi = threshold_high(gpu)
    space: dict[str, BaseDistribution] = {
        "log2_q_rows_large": IntDistribution(*_LOG2["q_rows_large"]),
        "log2_q_rows_small": IntDistribution(*_LOG2["q_rows_small"]),
    }
    for c in CLASSES:
        space[f"log2_kv_tile_{c}"] = IntDistribution(*_LOG2["kv_tile"])
    for c in CLASSES:
        space[f"log2_kv_split_{c}"] = IntDistribution(*_LOG2[f"kv_split_{c}"])
    for k in (1, 2):
        for c in CLASSES:
            space[f"para_thresh{k}_{c}"] = IntDistribution(0, hi)
    for name, bounds in (("alpha", ALPHA_RANGE), ("beta", BETA_RANGE), ("gamma", GAMMA_RANGE)):
        space[name] = FloatDistribution(*bounds)
    for c in CLASSES:
        space[f"log2_num_warps_{c}"] = IntDistribution(*_LOG2["num_warps"])
    for c in CLASSES:
        space[f"num_stages_{c}"] = IntDistribution(min(TUNER_NUM_STAGES), max(TUNER_NUM_STAGES))
    space["pack_tokens"] = CategoricalDistribution(PACK_TOKENS)
    space["pack_min_units"] = IntDistribution(0, hi)
    return space


def _active(name: str, params: Mapping[str, Any]) -> bool:
    """Whether ``name`` is suggested given the parameters before it (the conditional one)."""
    return name != "pack_min_units" or params.get("pack_tokens", 0) > 0


def _suggest(trial: optuna.trial.BaseTrial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high)
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high)
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    raise TypeError(f"no suggest for {type(dist).__name__}")  # pragma: no cover - search_space's kinds only


def _contains(dist: BaseDistribution, value: Any) -> bool:
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if not is_number(value):
        return False
    if isinstance(dist, IntDistribution) and not is_int(value):
        return False
    return dist.low <= value <= dist.high


def suggest_params(trial: optuna.trial.BaseTrial, gpu: GpuSpec) -> dict[str, Any]:
    """Suggest every active parameter of :func:`search_space` from ``trial``.

    Parameters
    ----------
    trial : optuna.trial.BaseTrial
    gpu : GpuSpec

    Returns
    -------
    dict
        Parameter name -> value (the trial's ``params``).
    """
    params: dict[str, Any] = {}
    for name, dist in search_space(gpu).items():
        if _active(name, params):
            params[name] = _suggest(trial, name, dist)
    return params


def check_params(params: Mapping[str, Any], gpu: GpuSpec) -> None:
    """Raise ``ValueError`` unless ``params`` are exactly the active parameters of the space, each in range."""
    space = search_space(gpu)
    unknown = sorted(set(params) - set(space))
    if unknown:
        raise ValueError(f"unknown trial parameters {unknown}")
    for name, dist in space.items():
        if not _active(name, params):
            if name in params:
                raise ValueError(f"trial parameter {name!r} is set but inactive")
            continue
        if name not in params:
            raise ValueError(f"trial parameters lack {name!r}")
        if not _contains(dist, params[name]):
            raise ValueError(f"trial parameter {name}={params[name]!r} is outside {dist}")


def _int_param(params: Mapping[str, Any], name: str) -> int:
    if name not in params:
        raise ValueError(f"trial parameters lack {name!r}")
    return check_int(f"trial parameter {name!r}", params[name])


def _pair(params: Mapping[str, Any], fmt: str, *, log2: bool = False) -> tuple[int, int]:
    values = tuple(_int_param(params, fmt.format(c)) for c in CLASSES)
    return (1 << values[0], 1 << values[1]) if log2 else (values[0], values[1])


def config_from_params(params: Mapping[str, Any], group_size: int, head_dim: int) -> FastTreeConfig:
    """The config of a trial's parameters for GQA ratio ``group_size`` and ``head_dim``.

    Query-tile rows equal to the published ``(64, 16)`` give ``q_tile_queries=None`` (the
    published tiles), and warps and stages equal to the bucket's defaults ``num_warps=None``
    and ``num_stages=None``, so the defaults' parameters give exactly ``FastTreeConfig()``.
    Without packing, ``pack_min_units`` (not suggested) keeps its default.

    Raises
    ------
    ValueError
        On missing or ill-typed parameters, or values :class:`FastTreeConfig` rejects.
    """
    unknown = sorted(set(params) - set(PARAM_NAMES))
    if unknown:
        raise ValueError(f"unknown trial parameters {unknown}")
    rows = (1 << _int_param(params, "log2_q_rows_large"), 1 << _int_param(params, "log2_q_rows_small"))
    if rows == DEFAULT_Q_TILE_ROWS:
        queries = None
    else:
        queries = (max(1, rows[0] // group_size), max(1, rows[1] // group_size))
    warps = _pair(params, "log2_num_warps_{}", log2=True)
    stages = _pair(params, "num_stages_{}")
    pack_tokens = _int_param(params, "pack_tokens")
    for name in ("alpha", "beta", "gamma"):
        if name not in params:
            raise ValueError(f"trial parameters lack {name!r}")
    return FastTreeConfig(
        alpha=params["alpha"],
        beta=params["beta"],
        gamma=params["gamma"],
        q_tile_queries=queries,
        kv_tile=_pair(params, "log2_kv_tile_{}", log2=True),
        kv_split_sizes=_pair(params, "log2_kv_split_{}", log2=True),
        para_threshs1=_pair(params, "para_thresh1_{}"),
        para_threshs2=_pair(params, "para_thresh2_{}"),
        num_warps=None if warps == FastTreeConfig().launch_warps(group_size) else warps,
        num_stages=None if stages == FastTreeConfig().launch_stages(group_size, head_dim) else stages,
        pack_tokens=pack_tokens,
        pack_min_units=_int_param(params, "pack_min_units") if pack_tokens > 0 else FastTreeConfig.pack_min_units,
    )


def default_params(gpu: GpuSpec, group_size: int, head_dim: int) -> dict[str, Any]:
    """The defaults (``FastTreeConfig()``) for GQA ratio ``group_size`` and ``head_dim`` as trial
    parameters, for ``enqueue_trial`` (only the warps and stages depend on the bucket:
    :meth:`FastTreeConfig.launch_warps`, :meth:`FastTreeConfig.launch_stages`).

    Raises ``ValueError`` if the defaults left the space (a profiler range changed).
    """
    d = FastTreeConfig()
    warps = d.launch_warps(group_size)
    stages = d.launch_stages(group_size, head_dim)
    p: dict[str, Any] = {
        "log2_q_rows_large": DEFAULT_Q_TILE_ROWS[0].bit_length() - 1,
        "log2_q_rows_small": DEFAULT_Q_TILE_ROWS[1].bit_length() - 1,
    }
    for i, c in enumerate(CLASSES):
        p[f"log2_kv_tile_{c}"] = d.kv_tile[i].bit_length() - 1
    for i, c in enumerate(CLASSES):
        p[f"log2_kv_split_{c}"] = d.kv_split_sizes[i].bit_length() - 1
    for i, c in enumerate(CLASSES):
        p[f"para_thresh1_{c}"] = d.para_threshs1[i]
    for i, c in enumerate(CLASSES):
        p[f"para_thresh2_{c}"] = d.para_threshs2[i]
    p.update(alpha=d.alpha, beta=d.beta, gamma=d.gamma)
    for i, c in enumerate(CLASSES):
        p[f"log2_num_warps_{c}"] = warps[i].bit_length() - 1
    for i, c in enumerate(CLASSES):
        p[f"num_stages_{c}"] = stages[i]
    p["pack_tokens"] = d.pack_tokens
    if d.pack_tokens > 0:
        p["pack_min_units"] = d.pack_min_units
    check_params(p, gpu)
    if config_from_params(p, group_size, head_dim) != d:
        raise ValueError("the published defaults do not map back to FastTreeConfig()")  # pragma: no cover
    return p


def neighbour_params(gpu: GpuSpec, group_size: int, head_dim: int) -> list[dict[str, Any]]:
    """The defaults with one knob changed, enqueued after them so TPE starts from each basin.

    Packing off and at other budgets (``pack_tokens`` splits the space into regions with
    different plans; a random start-up may never try them), the small tile class at the
    other of 2 and 4 warps (its default is 2 for MHA, 4 for GQA; on the H200 each ratio has
    cases where the other count wins), and the large class at the other of 3 and 5 stages
    (its default is 5 up to GQA 8 at head dims up to 128, else 3).
    """
    base = default_params(gpu, group_size, head_dim)
    out = []
    for tokens in (0, 512, 2048):
        p = {k: v for k, v in base.items() if k != "pack_min_units"}
        p["pack_tokens"] = tokens
        if tokens > 0:
            p["pack_min_units"] = base.get("pack_min_units", FastTreeConfig().pack_min_units)
        out.append(p)
    small_warps = f"log2_num_warps_{CLASSES[1]}"
    out.append({**base, small_warps: 2 if base[small_warps] == 1 else 1})
    large_stages = f"num_stages_{CLASSES[0]}"
    out.append({**base, large_stages: 3 if base[large_stages] == 5 else 5})
    for p in out:
        check_params(p, gpu)
    return out


def canonical_config(config: FastTreeConfig, group_size: int, head_dim: int) -> FastTreeConfig:
    """``config`` with ``num_warps`` and ``num_stages`` set back to None where they equal what None
    derives for the bucket: the launch rules that apply only to derived settings (deeper one-wave
    pipelines, fewer stages where shared memory ends) then keep working."""
    defaults = FastTreeConfig()
    changes = {}
    if config.num_warps is not None and config.num_warps == defaults.launch_warps(group_size):
        changes["num_warps"] = None
    if config.num_stages is not None and config.num_stages == defaults.launch_stages(group_size, head_dim):
        changes["num_stages"] = None
    return replace(config, **changes) if changes else config


def invalid_reason(config: FastTreeConfig, bucket: Bucket, gpu: GpuSpec) -> str | None:
    """Why ``config`` cannot run in ``bucket`` on ``gpu`` (tile rows, shared memory), or cannot be
    predicted there (pipeline stages no trace measured: the profiling design's, or the defaults'
    own for the bucket), or None."""
    stages = config.launch_stages(bucket.group_size, bucket.head_dim)
    default_stages = FastTreeConfig().launch_stages(bucket.group_size, bucket.head_dim)
    for c, (s, d) in enumerate(zip(stages, default_stages, strict=True)):
        if s not in NUM_STAGES and s != d:
            return f"{s} pipeline stages for tile class {c} were never profiled at {bucket.label}"
    try:
        need = config_smem_bytes(config, bucket.group_size, bucket.head_dim, bucket.elem_bytes)
    except ValueError as exc:
        return str(exc)
    if need > gpu.smem_per_sm:
        return f"the units kernel needs ~{need} bytes of shared memory, more than the {gpu.smem_per_sm} of {gpu.name}"
    return None


def suggest_config(trial: optuna.trial.BaseTrial, bucket: Bucket, gpu: GpuSpec) -> FastTreeConfig:
    """Suggest a valid config for ``bucket`` on ``gpu`` from ``trial``.

    Raises
    ------
    optuna.TrialPruned
        When the suggested combination is invalid (:func:`invalid_reason`); the reason is
        stored in the trial's ``invalid`` user attribute. Never scored.
    """
    params = suggest_params(trial, gpu)
    try:
        config = config_from_params(params, bucket.group_size, bucket.head_dim)
        reason = invalid_reason(config, bucket, gpu)
    except ValueError as exc:
        reason = str(exc)
    if reason is not None:
        trial.set_user_attr("invalid", reason)
        logger.debug("trial pruned before evaluation: %s", reason)
        raise optuna.TrialPruned(reason)
    return config
