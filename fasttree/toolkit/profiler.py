"""The profiler: GPU measurements of sampled (tree, heads, dtype, config) points as traces.

Three layers, each usable on its own:

* **Design** -- :func:`design` crosses trees with configs. Trees come from a scrambled
  Sobol' sequence (``scipy.stats.qmc``) over tree family and seed, GQA ratio and heads,
  head dim and dtype; each is measured under :data:`CONFIGS_PER_TREE` configs, the
  published defaults first, then configs sampled over every
  :class:`~fasttree.config.FastTreeConfig` knob (query and KV tiles, warps and stages per
  tile class from a per-GQA pool of :data:`KERNEL_POOL` settings; split sizes,
  parallelism thresholds, the cost weights alpha/beta/gamma and packing drawn per
  point). A design is a prefix of its sequence: ``design(n2, seed)`` starts with
  ``design(n1, seed)`` for ``n1 < n2``, so a longer run extends a shorter one.
* **Measurement** -- :func:`measure_point` builds the tree, plans it, times the kernels by
  CUDA-graph replay and eagerly, optionally checks the output against the float64
  reference, and returns a trace record (:func:`fasttree.traces.measurement_record`). Any
  failure (planning, compilation, out of memory, a wrong result) becomes a
  ``status: "failed"`` record.
* **Driver** -- :func:`profile` appends records to a ``.jsonl`` trace file with
  :class:`~fasttree.traces.TraceWriter`, skips points whose key the file already holds
  (resume), compiles the Triton kernels a batch of points needs in parallel worker
  processes while the batch before it is measured, stops starting points when a time
  budget is spent, shows a progress bar, and runs one worker process per visible GPU
  when there are several.

The command line is ``fasttree-tune profile`` (:mod:`fasttree.cli`). scipy and tqdm (the
``profile`` extra) are imported inside the functions that need them, never by
``import fasttree``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import os
import platform
import queue as queue_module
import re
import subprocess
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import FastTreeConfig
from ..traces import TraceError, TraceWriter, existing_keys, measurement_key, measurement_record, runtime_launch
from ..tree import KVTree
from ..validation import check_choice, check_int, check_number
from .workloads import TREE_FAMILIES, sample_tree

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SM_COUNT",
    "DTYPE_WEIGHTS",
    "FAMILY_WEIGHTS",
    "HEADS_BY_GQA",
    "HEAD_DIM_WEIGHTS",
    "DesignPoint",
    "DeviceLostError",
    "ProfileSummary",
    "collect_env",
    "design",
    "failed_record",
    "measure_point",
    "point_key",
    "point_tree",
    "profile",
]

# ------------------------------------------------------------------ search space
#: SM count assumed for the parallelism thresholds when no GPU can be asked (an H100 / H200).
DEFAULT_SM_COUNT = 132
#: Sampling weight of each tree family (the two most general generators a bit heavier).
FAMILY_WEIGHTS: dict[str, float] = {
    name: (1.5 if name in ("paper_random", "random_recursive") else 1.0) for name in TREE_FAMILIES
}
#: (num_q_heads, num_kv_heads) per GQA ratio; each ratio is drawn with equal weight, then a pair within it.
HEADS_BY_GQA: dict[int, tuple[tuple[int, int], ...]] = {
    1: ((32, 32), (16, 16), (8, 8)),
    4: ((32, 8), (16, 4), (64, 16)),
    8: ((32, 4), (64, 8), (16, 2)),
    16: ((16, 1), (32, 2), (64, 4)),
}
#: Share of each head dim.
HEAD_DIM_WEIGHTS: dict[int, float] = {64: 0.15, 128: 0.70, 256: 0.15}
#: The held-out split: what the training design never samples. Each held-out point takes
#: one axis: GQA 8 heads, head dim 256, or a tree deeper than any training tree (the
#: family knob and its held-out range; training uses the family's default range below it).
HELDOUT_GQA = 8
HELDOUT_HEAD_DIM = 256
DEEP_TREES: dict[str, tuple[str, int, int]] = {
    "paper_random": ("levels", 10, 14),  # training: 2..9 levels
    "beam_search": ("depth", 17, 32),  # training: 1..16 rounds
    "speculative": ("max_depth", 13, 24),  # training: 1..12 tokens below the prompt
}
HELDOUT_AXES = ("gqa8", "head_dim_256", "deep")
#: Design splits.
SPLITS = ("train", "heldout")
#: Share of each dtype.
DTYPE_WEIGHTS: dict[str, float] = {"float16": 0.5, "bfloat16": 0.5}
#: Query-tile matrix rows (queries x GQA ratio) of the large and the small tile class.
Q_ROWS_LARGE = (32, 64, 128)
Q_ROWS_SMALL = (8, 16, 32)
#: KV tokens per inner-loop tile, per class.
KV_TILES = (16, 32, 64, 128)
#: KV split sizes (tokens per unit): default (large) and small.
SPLITS_LARGE = (256, 512, 1024, 2048, 4096)
SPLITS_SMALL = (32, 64, 128, 256)
#: Ranges of the planner's cost weights.
ALPHA_RANGE = (0.1, 2.0)
BETA_RANGE = (0.05, 1.0)
GAMMA_RANGE = (-1.0, 2.0)
#: Triton launch settings per class.
NUM_WARPS = (2, 4, 8)
NUM_STAGES = (1, 2, 3, 4)
#: Token budgets of packed units (0: no packing).
PACK_TOKENS = (0, 256, 512, 1024, 2048)
#: Largest matrix rows of one program (query tile x GQA ratio), the kernel's limit.
MAX_TILE_ROWS = 256
#: Heads, head dim and dtype of the defaults point of each family.
DEFAULT_POINT_HEADS = (32, 8)
DEFAULT_POINT_HEAD_DIM = 128
DEFAULT_POINT_DTYPE = "float16"
#: Largest family seed (exclusive).
SEED_SPACE = 1 << 30

#: Configs measured per tree: the published defaults, then ``CONFIGS_PER_TREE - 1`` sampled ones.
CONFIGS_PER_TREE = 8
#: Kernel settings (query-tile rows, KV tiles, warps and stages per class) sampled per GQA
#: ratio and design seed: the design draws each point's kernel settings from this pool.
KERNEL_POOL = 32

# Sobol' dimensions, in order (a new dimension goes last, so existing columns keep their meaning).
#: Per tree: the workload.
_TREE_DIMS = ("family", "family_seed", "heads", "head_dim", "dtype", "heldout_axis", "depth")
#: Per kernel-pool entry: the settings that make a kernel specialisation.
_KERNEL_DIMS = (
    "q_rows_large",
    "q_rows_small",
    "kv_tile_large",
    "kv_tile_small",
    "warps_large",
    "warps_small",
    "stages_large",
    "stages_small",
)
#: Per sampled config: the pool entry and the planner's knobs.
_CONFIG_DIMS = (
    "kernel",
    "split_large",
    "split_small",
    "thresh1_large",
    "thresh1_small",
    "thresh2_large",
    "thresh2_small",
    "alpha",
    "beta",
    "gamma",
    "pack_tokens",
    "pack_min_units",
)
#: Scrambling salts of the three sequences (and of the held-out split's tree sequence).
_SALT_TREES, _SALT_HELDOUT, _SALT_KERNELS, _SALT_CONFIGS = 0x7EE5, 0x4E1D, 0x4E7, 0xC0F
#: Draws after which a sequence that produced nothing valid is given up.
_MAX_FRUITLESS_DRAWS = 1 << 16


@dataclass(frozen=True)
class DesignPoint:
    """One point of a profiling design: a workload tree, heads, dtype and a config.

    Attributes
    ----------
    index : int
        Position in the design (0-based).
    family : str
        Tree family, a key of :data:`fasttree.toolkit.workloads.TREE_FAMILIES`.
    seed : int
        Family seed: :func:`fasttree.toolkit.workloads.sample_tree` ``(family, seed)`` is the tree.
    num_q_heads, num_kv_heads, head_dim : int
    dtype : str
        ``"float16"`` or ``"bfloat16"``.
    config : FastTreeConfig
    design_seed : int
        Seed of the design the point belongs to.
    default_config : bool
        True for the published-defaults point of a family.
    params : tuple of (str, int)
        Keyword parameters of the family's generator (held-out deep trees), else empty.
    split : str
        ``"train"`` or ``"heldout"`` (:data:`SPLITS`).
    tree_index : int
        Position of the point's tree in the design (its :data:`CONFIGS_PER_TREE` configs share it).
    runtime : bool
        Time :class:`fasttree.runtime.TreeAttentionRuntime`'s launches (its own plan, persistent
        kernels, ``stage1_launches`` and ``query_centric`` ``"auto"``) instead of
        ``fasttree.tree_attention``'s per-plan launches; the record's ``launch`` says so.
    """

    index: int
    family: str
    seed: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    config: FastTreeConfig
    design_seed: int = 0
    default_config: bool = False
    params: tuple[tuple[str, int], ...] = ()
    split: str = "train"
    tree_index: int = 0
    runtime: bool = False

    @property
    def gqa(self) -> int:
        """GQA ratio ``num_q_heads // num_kv_heads``."""
        return self.num_q_heads // self.num_kv_heads

    def describe(self) -> str:
        """Short human description (for logs)."""
        params = "".join(f" {k}={v}" for k, v in self.params)
        tags = (" defaults" if self.default_config else "") + (" heldout" if self.split == "heldout" else "")
        tags += " runtime" if self.runtime else ""
        return (
            f"#{self.index} {self.family}/{self.seed}{params} Hq={self.num_q_heads} Hkv={self.num_kv_heads} "
            f"D={self.head_dim} {self.dtype}{tags}"
        )


def _check_families(families: Iterable[str] | None) -> list[str]:
    """Families in :data:`TREE_FAMILIES` order; ``None`` means all."""
    if families is None:
        return list(TREE_FAMILIES)
    if isinstance(families, str):
        families = [families]
    chosen = list(dict.fromkeys(families))
    unknown = [f for f in chosen if f not in TREE_FAMILIES]
    if unknown:
        raise ValueError(f"unknown tree families {unknown}; choose from {list(TREE_FAMILIES)}")
    if not chosen:
        raise ValueError("families must name at least one tree family (or be None for all)")
    return [f for f in TREE_FAMILIES if f in chosen]


def _categorical(u: float, options: Sequence[Any], weights: Sequence[float] | None = None) -> Any:
    """The option whose slice of ``[0, 1)`` (sized by ``weights``) holds ``u``."""
    if weights is None:
        return options[min(int(u * len(options)), len(options) - 1)]
    cdf = np.cumsum(np.asarray(weights, dtype=np.float64))
    i = int(np.searchsorted(cdf / cdf[-1], u, side="right"))
    return options[min(i, len(options) - 1)]


def _heads_options(ratios: Iterable[int]) -> tuple[list[tuple[int, int]], list[float]]:
    """Head pairs of the given GQA ratios, each ratio with equal weight."""
    ratios = list(ratios)
    options: list[tuple[int, int]] = []
    weights: list[float] = []
    for g in ratios:
        pairs = HEADS_BY_GQA[g]
        for pair in pairs:
            options.append(pair)
            weights.append(1.0 / (len(ratios) * len(pairs)))
    return options, weights


def _check_split(split: str) -> str:
    return check_choice("split", split, SPLITS)


def _workload_axes(x: dict[str, float], families: list[str], split: str):
    """(family, params, heads, head_dim) of a Sobol' point in ``split``.

    Training draws from everything but the held-out values; a held-out point takes
    one held-out axis (:data:`HELDOUT_AXES`; ``deep`` only when ``families`` has a
    family of :data:`DEEP_TREES`) and training values on the others.
    """
    heads, heads_w = _heads_options(g for g in HEADS_BY_GQA if g != HELDOUT_GQA)
    dims = {d: w for d, w in HEAD_DIM_WEIGHTS.items() if d != HELDOUT_HEAD_DIM}
    family = _categorical(x["family"], families, [FAMILY_WEIGHTS[f] for f in families])
    params: tuple[tuple[str, int], ...] = ()
    head_dim = _categorical(x["head_dim"], list(dims), list(dims.values()))
    if split == "heldout":
        deep = [f for f in families if f in DEEP_TREES]
        axes = [a for a in HELDOUT_AXES if a != "deep" or deep]
        axis = _categorical(x["heldout_axis"], axes)
        if axis == "gqa8":
            heads, heads_w = _heads_options([HELDOUT_GQA])
        elif axis == "head_dim_256":
            head_dim = HELDOUT_HEAD_DIM
        else:
            family = _categorical(x["family"], deep, [FAMILY_WEIGHTS[f] for f in deep])
            knob, lo, hi = DEEP_TREES[family]
            params = ((knob, _int_in(x["depth"], lo, hi)),)
    return family, params, _categorical(x["heads"], heads, heads_w), head_dim


def _uniform(u: float, lo: float, hi: float, digits: int = 4) -> float:
    return round(lo + u * (hi - lo), digits)


def _int_in(u: float, lo: int, hi: int) -> int:
    """Integer uniform in ``[lo, hi]``."""
    return min(lo + int(u * (hi - lo + 1)), hi)


def _sobol(d: int, seed: int | list[int]):
    from scipy.stats import qmc

    try:
        return qmc.Sobol(d=d, scramble=True, rng=seed)
    except TypeError:  # scipy < 1.15 names it ``seed``
        return qmc.Sobol(d=d, scramble=True, seed=seed)


class _Stream:
    """Rows of one scrambled Sobol' sequence, one at a time, named by ``dims``.

    Rows are drawn in blocks whose total stays a power of two (Sobol' balance); the
    sequence continues across blocks, so how it is cut does not change the rows.
    """

    def __init__(self, dims: tuple[str, ...], seed: int | list[int]) -> None:
        self.dims = dims
        self._sampler = _sobol(len(dims), seed)
        self._rows: list[list[float]] = []
        self._next = 0
        self.drawn = 0

    def next(self) -> dict[str, float]:
        if self._next == len(self._rows):
            count = max(64, int(self._sampler.num_generated))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # balance warnings of scipy
                self._rows = self._sampler.random(count).tolist()
            self._next = 0
        row = self._rows[self._next]
        self._next += 1
        self.drawn += 1
        return dict(zip(self.dims, row, strict=True))


def _kernel_pool(g: int, design_seed: int, size: int) -> list[dict[str, Any]]:
    """``size`` valid kernel settings for GQA ratio ``g`` (query tiles, KV tiles, warps, stages per class)."""
    stream = _Stream(_KERNEL_DIMS, [design_seed, g, _SALT_KERNELS])
    pool: list[dict[str, Any]] = []
    while len(pool) < size:
        if stream.drawn >= _MAX_FRUITLESS_DRAWS and not pool:
            raise ValueError(f"no valid point: no valid kernel setting for GQA {g} among {stream.drawn} draws")
        x = stream.next()
        rows = (_categorical(x["q_rows_large"], Q_ROWS_LARGE), _categorical(x["q_rows_small"], Q_ROWS_SMALL))
        if rows[0] < rows[1]:
            continue
        queries = tuple(max(1, r // g) for r in rows)
        if max(queries) * g > MAX_TILE_ROWS:
            continue
        pool.append(
            {
                "q_tile_queries": queries,
                "kv_tile": (_categorical(x["kv_tile_large"], KV_TILES), _categorical(x["kv_tile_small"], KV_TILES)),
                "num_warps": (_categorical(x["warps_large"], NUM_WARPS), _categorical(x["warps_small"], NUM_WARPS)),
                "num_stages": (
                    _categorical(x["stages_large"], NUM_STAGES),
                    _categorical(x["stages_small"], NUM_STAGES),
                ),
            }
        )
    return pool


def _config_from_unit(x: dict[str, float], kernel: dict[str, Any], *, g: int, sm_count: int) -> FastTreeConfig | None:
    """The config of one configuration row with the pool's ``kernel`` settings, or ``None`` when invalid."""
    hi = 4 * sm_count
    try:
        config = FastTreeConfig(
            alpha=_uniform(x["alpha"], *ALPHA_RANGE),
            beta=_uniform(x["beta"], *BETA_RANGE),
            gamma=_uniform(x["gamma"], *GAMMA_RANGE),
            kv_split_sizes=(
                _categorical(x["split_large"], SPLITS_LARGE),
                _categorical(x["split_small"], SPLITS_SMALL),
            ),
            para_threshs1=(_int_in(x["thresh1_large"], 0, hi), _int_in(x["thresh1_small"], 0, hi)),
            para_threshs2=(_int_in(x["thresh2_large"], 0, hi), _int_in(x["thresh2_small"], 0, hi)),
            pack_tokens=_categorical(x["pack_tokens"], PACK_TOKENS),
            pack_min_units=_int_in(x["pack_min_units"], 0, hi),
            **kernel,
        )
        config.query_tiles(g)
    except ValueError as exc:
        logger.debug("design config skipped: %s", exc)
        return None
    return config


def design(
    n: int,
    seed: int = 0,
    *,
    sm_count: int = DEFAULT_SM_COUNT,
    families: Iterable[str] | None = None,
    split: str = "train",
    configs_per_tree: int = CONFIGS_PER_TREE,
    kernel_pool: int = KERNEL_POOL,
    runtime: bool = False,
) -> list[DesignPoint]:
    """A deterministic sampled design of ``n`` points: trees crossed with configs.

    Trees come from a scrambled Sobol' sequence (``scipy.stats.qmc.Sobol``, seeded by
    ``seed`` and the split) over family (weights :data:`FAMILY_WEIGHTS`), family seed,
    heads (:data:`HEADS_BY_GQA`, each GQA ratio alike), head dim
    (:data:`HEAD_DIM_WEIGHTS`) and dtype. Each tree is measured under
    ``configs_per_tree`` configs in a row: first the published defaults
    (:class:`FastTreeConfig` ``()``), then configs from a second sequence over the
    planner's knobs (split sizes, the two threshold pairs as integers in
    ``[0, 4 * sm_count]``, alpha, beta, gamma, pack tokens and units) combined with
    kernel settings (query-tile rows per class from :data:`Q_ROWS_LARGE` /
    :data:`Q_ROWS_SMALL`, converted to queries per tile ``max(1, rows // g)``, KV tiles,
    warps and stages per class) drawn from a pool of ``kernel_pool`` settings per GQA
    ratio and design seed. Crossing gives every tree a ranking of configs (what the
    cost model's per-tree rank metrics need), and the pool bounds the kernel variants
    a run compiles; another design seed draws another pool. A configuration row that
    maps to an invalid config (a :class:`FastTreeConfig` validation error) is skipped
    and its sequence continues, so the design is a prefix of one sequence:
    ``design(m, seed)[:n] == design(n, seed)`` for ``m >= n`` (with the same other
    arguments and scipy version).

    Parameters
    ----------
    n : int
        Points (>= 0).
    seed : int
        Design seed (>= 0).
    sm_count : int
        The GPU's SM count; the thresholds range over ``[0, 4 * sm_count]``.
    families : iterable of str, optional
        Restrict to these tree families (default: all of :data:`TREE_FAMILIES`).
    split : str
        ``"train"`` (default) never samples GQA 8, head dim 256 or the deep-tree ranges
        of :data:`DEEP_TREES`; ``"heldout"`` samples only trees with exactly one of them
        (:data:`HELDOUT_AXES`). The splits draw their trees from differently scrambled
        sequences.
    configs_per_tree : int
        Configs per tree (>= 1), the defaults included.
    kernel_pool : int
        Kernel settings per GQA ratio (>= 1).
    runtime : bool
        Points time the runtime's launches (:attr:`DesignPoint.runtime`); the same trees and
        configs as ``runtime=False``, with other keys.

    Returns
    -------
    list of DesignPoint
        ``index`` runs from 0 to ``n - 1``; ``tree_index`` numbers the trees.

    Raises
    ------
    ValueError
        On a bad ``n``, ``seed``, ``sm_count``, family name, ``configs_per_tree`` or
        ``kernel_pool``, or a search space without a valid config.
    """
    n = check_int("n", n, minimum=0)
    seed = check_int("seed", seed, minimum=0)
    sm_count = check_int("sm_count", sm_count, minimum=1)
    configs_per_tree = check_int("configs_per_tree", configs_per_tree, minimum=1)
    kernel_pool = check_int("kernel_pool", kernel_pool, minimum=1)
    fams = _check_families(families)
    split = _check_split(split)
    trees = _Stream(_TREE_DIMS, [seed, _SALT_TREES] if split == "train" else [seed, _SALT_HELDOUT])
    configs = _Stream(_CONFIG_DIMS, [seed, _SALT_CONFIGS])
    pools: dict[int, list[dict[str, Any]]] = {}
    points: list[DesignPoint] = []
    tree_index = 0
    while len(points) < n:
        x = trees.next()
        family, params, (hq, hkv), head_dim = _workload_axes(x, fams, split)
        g = hq // hkv
        common = dict(
            family=family,
            seed=min(int(x["family_seed"] * SEED_SPACE), SEED_SPACE - 1),
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=head_dim,
            dtype=_categorical(x["dtype"], list(DTYPE_WEIGHTS), list(DTYPE_WEIGHTS.values())),
            design_seed=seed,
            params=params,
            split=split,
            tree_index=tree_index,
            runtime=bool(runtime),
        )
        points.append(DesignPoint(index=len(points), config=FastTreeConfig(), default_config=True, **common))
        pool = pools.get(g)
        if pool is None:
            pool = pools[g] = _kernel_pool(g, seed, kernel_pool)
        made, start = 1, configs.drawn
        while made < configs_per_tree and len(points) < n:
            if configs.drawn - start >= _MAX_FRUITLESS_DRAWS:
                raise ValueError(f"no valid point among {configs.drawn - start} draws of the design's configs")
            u = configs.next()
            config = _config_from_unit(u, _categorical(u["kernel"], pool), g=g, sm_count=sm_count)
            if config is None or config == FastTreeConfig():
                continue
            points.append(DesignPoint(index=len(points), config=config, **common))
            made, start = made + 1, configs.drawn
        tree_index += 1
    return points


def point_tree(point: DesignPoint) -> KVTree:
    """The point's tree: ``sample_tree(point.family, point.seed, **dict(point.params))``.

    The last few trees are cached (a design measures each tree under several configs in a
    row); treat the returned tree as read-only.
    """
    return _sample_tree_cached(point.family, point.seed, point.params)


@functools.lru_cache(maxsize=32)
def _sample_tree_cached(family: str, seed: int, params: tuple[tuple[str, int], ...]) -> KVTree:
    return sample_tree(family, seed, **dict(params))


def point_key(point: DesignPoint, gpu_name: str, *, tree: KVTree | None = None) -> str:
    """Key of the measurement record of ``point`` on a GPU named ``gpu_name``.

    Equal to the ``key`` of the record :func:`measure_point` returns there
    (:func:`fasttree.traces.measurement_key`).

    Parameters
    ----------
    point : DesignPoint
    gpu_name : str
        ``env["gpu_name"]`` of the measuring device.
    tree : KVTree, optional
        The point's tree when already built (else :func:`point_tree`).
    """
    return measurement_key(point_tree(point) if tree is None else tree, **_identity(point), gpu_name=gpu_name)


def point_launch(point: DesignPoint) -> dict[str, Any] | None:
    """The ``launch`` of the point's record: :func:`fasttree.traces.runtime_launch` of a runtime
    point (``stage1_launches`` resolved for its heads), None for ``tree_attention``'s launches."""
    if not point.runtime:
        return None
    from ..runtime_planning import resolve_stage1_launches

    return runtime_launch(
        stage1_launches=resolve_stage1_launches("auto", point.gqa, point.head_dim), query_centric="auto"
    )


def _identity(point: DesignPoint) -> dict[str, Any]:
    """The fields besides the tree that identify a point's measurement (its key's inputs)."""
    return {
        "family": point.family,
        "seed": point.seed,
        "num_q_heads": point.num_q_heads,
        "num_kv_heads": point.num_kv_heads,
        "head_dim": point.head_dim,
        "dtype": point.dtype,
        "config": point.config,
        "launch": point_launch(point),
    }


# ------------------------------------------------------------------ environment
def git_commit() -> str | None:
    """``$FASTTREE_GIT_COMMIT``, else ``git rev-parse HEAD`` of this package's checkout, else None."""
    env = os.environ.get("FASTTREE_GIT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _nvidia_smi(gpu_id: str) -> dict[str, Any]:
    """Max memory clock (MHz) and driver version from ``nvidia-smi``, Nones when it is unavailable."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=clocks.max.memory,driver_version",
                "--format=csv,noheader,nounits",
                "-i",
                gpu_id,
            ],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        )
        clock, driver = (s.strip() for s in out.stdout.strip().splitlines()[0].split(",")[:2])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"memory_clock_mhz": None, "driver": None}
    return {"memory_clock_mhz": int(clock) if clock.isdigit() and int(clock) > 0 else None, "driver": driver or None}


def _driver_from_proc() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def _physical_gpu_id(props: Any, index: int) -> str:
    """An ``nvidia-smi -i`` id for the device: its UUID when torch knows it, else the visible index mapped
    through ``CUDA_VISIBLE_DEVICES``."""
    uid = getattr(props, "uuid", None)
    if uid is not None:
        text = str(uid)
        return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


_ENV_CACHE: dict[str, dict[str, Any]] = {}


def collect_env(device: Any = None) -> dict[str, Any]:
    """Where a measurement runs: the trace format's ``env`` (plus a few extra keys).

    GPU name, SM count and compute capability from ``torch.cuda``; memory clock and
    driver from ``nvidia-smi`` (None when it is missing; the driver then from
    ``/proc/driver/nvidia/version``); torch, triton and fasttree versions; the git commit
    (:func:`git_commit`). Extra keys: ``cuda``, ``python``, ``gpu_memory_gib``. Cached per
    device for the process.

    Parameters
    ----------
    device : str or torch.device, optional
        A CUDA device (default: the current one).

    Returns
    -------
    dict

    Raises
    ------
    ValueError
        When no CUDA GPU is visible or ``device`` is not a CUDA device.
    """
    import torch
    import triton

    import fasttree

    if not torch.cuda.is_available():
        raise ValueError("no CUDA GPU is visible (torch.cuda.is_available() is False); the profiler measures on a GPU")
    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda":
        raise ValueError(f"the profiler measures on a CUDA device, got {dev}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    cache_key = f"cuda:{index}"
    if cache_key in _ENV_CACHE:
        return dict(_ENV_CACHE[cache_key])
    props = torch.cuda.get_device_properties(index)
    smi = _nvidia_smi(_physical_gpu_id(props, index))
    clock = smi["memory_clock_mhz"]
    if clock is None:
        khz = getattr(props, "memory_clock_rate", None)
        clock = int(khz) // 1000 if isinstance(khz, int) and khz >= 1000 else None
    env = {
        "gpu_name": props.name,
        "gpu_sm_count": int(props.multi_processor_count),
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_clock_mhz": clock,
        "driver": smi["driver"] or _driver_from_proc(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fasttree": fasttree.__version__,
        "git_commit": git_commit(),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
    }
    _ENV_CACHE[cache_key] = env
    return dict(env)


def device_sm_count(device: Any = None) -> int:
    """SM count of a CUDA device, or :data:`DEFAULT_SM_COUNT` when none is visible."""
    try:
        import torch

        if not torch.cuda.is_available():
            return DEFAULT_SM_COUNT
        dev = torch.device("cuda" if device is None else device)
        index = torch.cuda.current_device() if dev.index is None else dev.index
        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    except Exception:  # any trouble asking the device: the documented default
        return DEFAULT_SM_COUNT


# ------------------------------------------------------------------ measurement
#: Largest per-query relative error accepted against the float64 reference.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
#: Timing of one point: calls per CUDA graph (fewer when they would pass GRAPH_MAX_MS),
#: replays and replay budget; the eager ``do_bench`` warm-up and repetition (ms).
GRAPH_CALLS, GRAPH_REPLAYS, GRAPH_BUDGET_S, GRAPH_MAX_MS = 10, 20, 0.1, 2.0
EAGER_WARMUP_MS, EAGER_REP_MS = 2.0, 10.0
#: Queries checked against the reference (a sample when the tree has more).
CHECK_QUERIES = 16


class DeviceLostError(RuntimeError):
    """The GPU is unusable after a failure (a sticky CUDA error): the process cannot measure on.

    Attributes
    ----------
    record : dict
        The failed record of the point that broke the device (the driver writes it).
    """

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    text = " ".join(text.split())  # one line
    return text[:2000]


def failed_record(
    point: DesignPoint,
    env: dict[str, Any],
    error: str,
    *,
    tree: KVTree | None = None,
    plan: Any = None,
    correct: bool | None = None,
    max_rel_err: float | None = None,
) -> dict[str, Any]:
    """A ``status: "failed"`` measurement record of ``point``.

    Parameters
    ----------
    point : DesignPoint
    env : dict
        :func:`collect_env` output.
    error : str
        What went wrong (exception type and message), non-empty.
    tree : KVTree, optional
        The point's tree when already built.
    plan : Plan or dict, optional
        The plan when planning succeeded.
    correct, max_rel_err
        The correctness check's outcome when a wrong result is the failure.
    """
    if not error:
        raise ValueError("a failed record needs a non-empty error")
    return measurement_record(
        env=env,
        tree=point_tree(point) if tree is None else tree,
        **_identity(point),
        params=dict(point.params) or None,
        plan=plan,
        status="failed",
        error=error,
        correct=correct,
        max_rel_err=max_rel_err,
    )


def _synchronize(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _device_healthy(device: Any) -> bool:
    import torch

    try:
        _synchronize(device)
        return float(torch.ones(1, device=device).add_(1).item()) == 2.0
    except Exception:
        return False


def _inputs(point: DesignPoint, tree: KVTree, device: Any):
    import torch

    dtype = getattr(torch, point.dtype)
    gen = torch.Generator(device=device).manual_seed(point.seed)
    pool = tree.max_slot + 1
    q = torch.randn(tree.n_queries, point.num_q_heads, point.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(pool, point.num_kv_heads, point.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(pool, point.num_kv_heads, point.head_dim, device=device, dtype=dtype, generator=gen)
    return q, k, v


def _point_plan(point: DesignPoint, tree: KVTree):
    """The plan the point's launches run: ``fasttree.plan``'s, or the runtime's own for a runtime point."""
    heads = {"num_q_heads": point.num_q_heads, "num_kv_heads": point.num_kv_heads, "head_dim": point.head_dim}
    if point.runtime:
        from ..runtime_planning import plan_for_runtime

        launch = point_launch(point)
        stage1, centric = launch["stage1_launches"], launch["query_centric"]
        return plan_for_runtime(tree, point.config, **heads, stage1_launches=stage1, query_centric=centric)[0]
    import fasttree as ft

    return ft.plan(tree, point.config, **heads)


def _runtime_for(point: DesignPoint, tree: KVTree, plan, device: Any):
    """A :class:`fasttree.runtime.TreeAttentionRuntime` for the point, its capacities those of
    ``plan`` (the runtime's own plan of ``tree``), with ``tree`` planned and uploaded."""
    import torch

    from ..runtime import TreeAttentionRuntime

    launch = point_launch(point)
    rt = TreeAttentionRuntime(
        point.config, num_q_heads=point.num_q_heads, num_kv_heads=point.num_kv_heads, head_dim=point.head_dim,
        dtype=getattr(torch, point.dtype), device=device, max_queries=tree.n_queries,
        max_kv_entries=max(1, int(plan.kv_indices.size)), max_units=max(1, plan.n_units),
        max_partial_rows=max(1, int(plan.n_partial_rows)), max_pairs=max(1, int(plan.pair_query.size)),
        pool_slots=tree.max_slot + 1, query_centric=launch["query_centric"],
        stage1_launches=launch["stage1_launches"], extend_steps=0,
    )  # fmt: skip
    rt.plan(tree)
    return rt


def measure_point(
    point: DesignPoint,
    *,
    device: Any = "cuda",
    check: bool = True,
    env: dict[str, Any] | None = None,
    graph_budget_s: float = GRAPH_BUDGET_S,
    eager_rep_ms: float = EAGER_REP_MS,
    tree: KVTree | None = None,
) -> dict[str, Any]:
    """Measure one design point on the GPU and return its trace record.

    Builds the tree (:func:`point_tree`), draws N(0, 1) ``q``/``k``/``v`` in the point's
    dtype, plans it with the point's config, times ``tree_attention`` (or, for a runtime
    point, :meth:`fasttree.runtime.TreeAttentionRuntime.forward` of a runtime sized to the
    plan) by CUDA-graph replay
    (:func:`fasttree.toolkit.timing.graph_time_us`) and eagerly
    (:func:`fasttree.toolkit.timing.eager_time_us`, a short repetition), and stores
    :func:`fasttree.traces.plan_summary` of the plan. With ``check``, first compares the
    output of up to :data:`CHECK_QUERIES` sampled queries with
    :func:`fasttree.reference_attention` (worst per-query relative error against
    :data:`TOLERANCE`).

    Every failure is returned as a ``status: "failed"`` record naming the exception:
    planning errors, kernel compilation or launch errors, out of memory, non-finite or
    wrong output (then ``correct`` is false and no timing is taken).

    Parameters
    ----------
    point : DesignPoint
    device : str or torch.device
        A CUDA device.
    check : bool
        Check the output against the float64 reference.
    env : dict, optional
        :func:`collect_env` output (collected when None); its ``gpu_name`` enters the key.
    graph_budget_s : float
        Replay budget of the graph timing.
    eager_rep_ms : float
        Repetition time of the eager timing.
    tree : KVTree, optional
        The tree to measure instead of the point's sampled one (e.g. a workload step's,
        with the point's ``family`` and ``seed`` naming where it came from).

    Returns
    -------
    dict
        A measurement record (not yet validated; :class:`~fasttree.traces.TraceWriter` does that).

    Raises
    ------
    DeviceLostError
        When a failure left the GPU unusable (a sticky CUDA error); its ``record`` is
        the point's failed record.
    """
    import torch

    import fasttree as ft

    from ..traces import plan_summary
    from .timing import eager_time_us, graph_time_us

    env = collect_env(device) if env is None else env
    t0 = time.perf_counter()
    tree = point_tree(point) if tree is None else tree
    try:
        plan = _point_plan(point, tree)
    except Exception as exc:
        return failed_record(point, env, "PlanError: " + _error_text(exc), tree=tree)
    summary = plan_summary(plan)
    q = k = v = out = rt = None
    correct: bool | None = None
    err: float | None = None
    try:
        q, k, v = _inputs(point, tree, device)
        out = torch.empty_like(q)
        if point.runtime:
            rt = _runtime_for(point, tree, plan, device)

            def call() -> torch.Tensor:
                return rt.forward(q, k, v, out=out)

        else:

            def call() -> torch.Tensor:
                return ft.tree_attention(q, k, v, plan, out=out)

        if check:
            out.fill_(float("nan"))
            call()
            _synchronize(device)
            rng = np.random.default_rng(point.seed)
            rows = np.sort(rng.choice(tree.n_queries, min(tree.n_queries, CHECK_QUERIES), replace=False))
            ref = ft.reference_attention(q, k, v, tree, queries=rows)
            finite = bool(torch.isfinite(out).all())
            err = ft.max_relative_error(out[torch.as_tensor(rows, device=out.device)], ref) if finite else None
            correct = finite and err is not None and err <= TOLERANCE[point.dtype]
            del ref
            if not correct:
                what = "non-finite output" if not finite else f"max relative error {err:.3g} > {TOLERANCE[point.dtype]}"
                return failed_record(
                    point, env, f"WrongResult: {what}", tree=tree, plan=summary, correct=False, max_rel_err=err
                )
        graph = graph_time_us(
            call, calls=GRAPH_CALLS, replays=GRAPH_REPLAYS, budget_s=graph_budget_s, max_graph_ms=GRAPH_MAX_MS
        )
        eager = eager_time_us(call, warmup_ms=EAGER_WARMUP_MS, rep_ms=eager_rep_ms)
        record = measurement_record(
            env=env,
            tree=tree,
            **_identity(point),
            params=dict(point.params) or None,
            plan=summary,
            status="ok",
            timing={"graph_us": graph, "eager_us": {"median": eager}},
            correct=correct,
            max_rel_err=err,
        )
        # the two stage-1 launches of a two-class plan ran side by side (the latency model's stage1_overlap),
        # and which kernels ran (its kernel_version)
        info = {
            "wall_s": round(time.perf_counter() - t0, 4),
            "stage1_overlap": bool(ft.attention._FORK_STAGE1) if rt is None else rt.stage1_launches == 1,
            "kernel_version": ft.attention.KERNEL_VERSION,
        }
        if rt is not None:  # the persistent stage-1 programs of each launch, as sized from the compiled kernels
            info["runtime_programs"] = [int(n) for n in rt._programs[: rt.stage1_launches]]
        record["meta"] = {"profiler": info}
        return record
    except Exception as exc:
        record = failed_record(point, env, _error_text(exc), tree=tree, plan=summary, correct=correct, max_rel_err=err)
        q = k = v = out = rt = None
        plan = None
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        if not _device_healthy(device):
            raise DeviceLostError(f"the GPU is unusable after point {point.index}: {record['error']}", record) from exc
        return record


# ------------------------------------------------------------------ compile ahead
def _compile_worker(module: str, name: str, specialization: str) -> tuple[str | None, float]:
    """Compile one kernel specialisation in a worker process (Triton's ``preload``); fills the disk cache."""
    t0 = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(module), name)
        fn.preload(specialization)
    except Exception as exc:
        return _error_text(exc), time.perf_counter() - t0
    return None, time.perf_counter() - t0


@contextlib.contextmanager
def _record_compiles(found: dict[str, tuple[str, str]]) -> Iterator[None]:
    """While active, Triton records each kernel specialisation it would compile in ``found``
    (specialisation JSON -> (module, name)) and skips compiling and launching it."""
    import triton

    knobs = triton.knobs.runtime
    previous = knobs.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # Triton's keyword names
        found.setdefault(compile["specialization_data"], (str(fn.module), str(fn.name)))
        return True

    knobs.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.jit_cache_hook = previous


def kernel_specialisations(points: Iterable[DesignPoint], device: Any) -> dict[str, tuple[str, str]]:
    """The Triton specialisations the points' first ``tree_attention`` (or runtime) calls would compile.

    Each point is planned and run once on uninitialised tensors of its real shapes with
    Triton's ``jit_cache_hook`` set to record and skip every compilation (so a kernel
    that is not compiled yet is neither compiled nor launched; ones already loaded in
    this process run on the garbage inputs, harmlessly). Points that fail to plan or
    allocate are left out (their measurement records the failure).

    Parameters
    ----------
    points : iterable of DesignPoint
    device : str or torch.device
        A CUDA device.

    Returns
    -------
    dict
        Triton's ``specialization_data`` JSON -> (kernel module, kernel name).
    """
    import torch

    import fasttree as ft

    found: dict[str, tuple[str, str]] = {}
    with _record_compiles(found):
        for point in points:
            try:
                tree = point_tree(point)
                plan = _point_plan(point, tree)
                dtype = getattr(torch, point.dtype)
                pool = tree.max_slot + 1
                q = torch.empty(tree.n_queries, point.num_q_heads, point.head_dim, device=device, dtype=dtype)
                k = torch.empty(pool, point.num_kv_heads, point.head_dim, device=device, dtype=dtype)
                v = torch.empty_like(k)
                if point.runtime:
                    _runtime_for(point, tree, plan, device).forward(q, k, v, out=torch.empty_like(q))
                else:
                    ft.tree_attention(q, k, v, plan, out=torch.empty_like(q))
            except Exception as exc:
                logger.debug("compile discovery of %s: %s", point.describe(), _error_text(exc))
            finally:
                q = k = v = plan = None
    return found


class _Compiler:
    """A pool of spawned worker processes that compile kernel specialisations into Triton's disk cache.

    :meth:`submit` queues specialisations and returns at once (so the next batch compiles
    while the current one is measured); :meth:`wait` blocks until a submission is done.
    A specialisation is submitted once per compiler. ``seconds`` is the time spent
    waiting, i.e. the compile time that measurement did not hide.
    """

    def __init__(self, workers: int) -> None:
        self.workers = max(1, int(workers))
        self._pool = None
        self._submitted: set[str] = set()
        self.compiled = 0
        self.failed = 0
        self.seconds = 0.0

    def _executor(self):
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def submit(self, specs: dict[str, tuple[str, str]]) -> dict[Any, str]:
        """Queue the specialisations not submitted before; returns their futures (future -> kernel name)."""
        new = {data: where for data, where in specs.items() if data not in self._submitted}
        if not new:
            return {}
        self._submitted.update(new)
        pool = self._executor()
        return {pool.submit(_compile_worker, mod, name, data): name for data, (mod, name) in new.items()}

    def wait(self, futures: dict[Any, str], deadline: float | None) -> None:
        """Block until ``futures`` (from :meth:`submit`) are done, or until ``deadline`` (``time.monotonic``)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        if not futures:
            return
        t0 = time.monotonic()
        pending = set(futures)
        errors: list[str] = []
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    error, _ = f.result()
                except Exception as exc:  # a worker died (BrokenProcessPool) or similar
                    error = _error_text(exc)
                if error is None:
                    self.compiled += 1
                else:
                    self.failed += 1
                    errors.append(f"{futures[f]}: {error}")
            if pending and deadline is not None and time.monotonic() >= deadline:
                for f in pending:
                    f.cancel()
                logger.info("time budget reached while compiling: %d kernel variant(s) left", len(pending))
                break
        spent = time.monotonic() - t0
        self.seconds += spent
        if errors:
            logger.warning("%d kernel variant(s) failed to compile ahead; first: %s", len(errors), errors[0])
        logger.debug(
            "%d kernel variant(s) compiled ahead; waited %.1f s for them (%d worker process(es))",
            len(futures) - len(pending) - len(errors),
            spent,
            self.workers,
        )

    def compile(self, specs: dict[str, tuple[str, str]], deadline: float | None) -> None:
        """Compile ``specs`` and wait for them (:meth:`submit` then :meth:`wait`)."""
        self.wait(self.submit(specs), deadline)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def default_compile_workers() -> int:
    """``min(16, os.cpu_count())``."""
    return max(1, min(16, os.cpu_count() or 1))


# ------------------------------------------------------------------ driver
@dataclass
class ProfileSummary:
    """What a :func:`profile` run did.

    Attributes
    ----------
    points : int
        Design points considered.
    skipped : int
        Points whose key the trace file already held (measured by an earlier run).
    measured : int
        Records written with ``status: "ok"``.
    failed : int
        Records written with ``status: "failed"``.
    not_started : int
        Points left when the budget ran out or the run stopped.
    elapsed_s : float
        Wall time of the run.
    stopped_by_budget : bool
    precompiled, precompile_failed : int
        Kernel specialisations compiled ahead, and those that failed to.
    precompile_s : float
        Wall time spent compiling ahead.
    aborted : str or None
        Why the run stopped early other than the budget (a lost device), else None.
    repeats : int
        Repeat measurements written (lines of keys measured earlier in the run).
    """

    points: int = 0
    skipped: int = 0
    measured: int = 0
    failed: int = 0
    not_started: int = 0
    elapsed_s: float = 0.0
    stopped_by_budget: bool = False
    precompiled: int = 0
    precompile_failed: int = 0
    precompile_s: float = 0.0
    aborted: str | None = None
    repeats: int = 0
    gpus: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def written(self) -> int:
        """Records written (ok and failed)."""
        return self.measured + self.failed

    @property
    def points_per_minute(self) -> float:
        """Records written per minute of wall time."""
        return self.written / (self.elapsed_s / 60) if self.elapsed_s > 0 else 0.0

    def merge(self, other: ProfileSummary) -> None:
        """Add another shard's counts (multi-GPU runs)."""
        for name in (
            "points",
            "skipped",
            "measured",
            "failed",
            "not_started",
            "precompiled",
            "precompile_failed",
            "repeats",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.precompile_s = max(self.precompile_s, other.precompile_s)
        self.stopped_by_budget = self.stopped_by_budget or other.stopped_by_budget
        self.aborted = self.aborted or other.aborted

    def line(self) -> str:
        """One-line summary for the log."""
        text = (
            f"{self.measured} measured, {self.failed} failed, {self.skipped} skipped (already in the file), "
            f"{self.not_started} not started, of {self.points} points"
            + (f", {self.repeats} repeat measurements" if self.repeats else "")
            + f" in {self.elapsed_s:.1f} s "
            f"({self.points_per_minute:.1f} points/minute"
            + (f", {self.gpus} GPUs" if self.gpus > 1 else "")
            + (
                f"; {self.precompiled} kernel variants compiled ahead in {self.precompile_s:.1f} s"
                if self.precompiled
                else ""
            )
            + ")"
        )
        if self.stopped_by_budget:
            text += "; stopped by the time budget"
        if self.aborted:
            text += f"; aborted: {self.aborted}"
        return text


class _Progress:
    """A tqdm bar (when tqdm is installed and ``enabled``), else periodic log lines."""

    def __init__(self, total: int, *, enabled: bool, deadline: float | None, desc: str = "profile") -> None:
        self.total = total
        self.deadline = deadline
        self.done = self.ok = self.failed = 0
        self.t0 = time.monotonic()
        self._last_log = self.t0
        self._log_every = 30.0 if enabled else 60.0
        self.bar = None
        self._redirect = contextlib.nullcontext()
        if enabled:
            try:
                from tqdm import tqdm
                from tqdm.contrib.logging import logging_redirect_tqdm
            except ImportError:
                logger.info("tqdm is not installed: progress goes to the log every %.0f s", self._log_every)
            else:
                self.bar = tqdm(total=total, unit="pt", desc=desc, dynamic_ncols=True, smoothing=0.05)
                self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()

    def update(self, status: str) -> None:
        self.done += 1
        if status == "ok":
            self.ok += 1
        else:
            self.failed += 1
        now = time.monotonic()
        if self.bar is not None:
            postfix = {"ok": self.ok, "failed": self.failed}
            if self.deadline is not None:
                postfix["budget_left"] = f"{max(0.0, self.deadline - now):.0f}s"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif now - self._last_log >= self._log_every or self.done == self.total:
            self._last_log = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else math.inf
            if self.deadline is not None:
                eta = min(eta, max(0.0, self.deadline - now))
            logger.info(
                "%d/%d points (%d failed), %.1f points/min, ETA %s",
                self.done,
                self.total,
                self.failed,
                rate * 60,
                _fmt_seconds(eta),
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._redirect.__exit__(None, None, None)


def _fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "unknown"
    s = round(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _annotate(record: dict[str, Any], point: DesignPoint, run_id: str, check: bool, shard: int | None) -> None:
    from ..attention import KERNEL_VERSION

    meta = record.get("meta")
    if not isinstance(meta, dict):
        meta = record["meta"] = {}
    info = meta.get("profiler")
    if not isinstance(info, dict):
        info = meta["profiler"] = {}
    info.update(
        run_id=run_id,
        design_seed=point.design_seed,
        design_index=point.index,
        default_config=point.default_config,
        checked=check,
    )
    info.setdefault("kernel_version", KERNEL_VERSION)  # failed lines too: which kernels failed
    meta["split"] = point.split  # traces/README.md: held-out lines say so at the top of meta
    if shard is not None:
        info["gpu_worker"] = shard


def _run_points(
    out: Path,
    points: Sequence[DesignPoint],
    *,
    device: Any,
    env: dict[str, Any],
    deadline: float | None,
    precompile: bool,
    compile_workers: int,
    measure: Callable[..., dict[str, Any]],
    check_every: int,
    batch_size: int,
    run_id: str,
    report: Callable[[str, Any], None],
    shard: int | None = None,
    repeat_every: int = 0,
) -> ProfileSummary:
    """Measure ``points`` on one device, appending to ``out``; the body of :func:`profile` (and of each GPU worker).

    ``report(event, value)`` gets ``("total", n_to_measure)`` once, then ``("ok" | "failed", None)`` per record.
    With ``repeat_every`` K > 0, after every K-th point an ``ok`` point measured about K/2
    points earlier is measured again and written as another line of its key
    (``meta.profiler.repeat``), for the spread of repeat measurements.
    """
    t0 = time.monotonic()
    summary = ProfileSummary(points=len(points))
    gpu_name = str(env.get("gpu_name"))
    done = existing_keys(out)
    todo: list[DesignPoint] = []
    for p in points:
        key = point_key(p, gpu_name)
        if key in done:
            summary.skipped += 1
        else:
            done.add(key)  # also drops repeats within the design
            todo.append(p)
    del done
    report("total", len(todo))
    if summary.skipped:
        logger.info("%s: %d of %d points already measured, skipped", out, summary.skipped, len(points))
    compiler = None
    if precompile and todo:
        if _cuda_device(device):
            compiler = _Compiler(compile_workers)
        else:
            logger.info("no CUDA device: not compiling kernels ahead")
    first = True
    measured_ok: list[DesignPoint] = []
    try:
        with TraceWriter(out) as writer:
            batches = list(_batches(todo, batch_size))
            queued: dict[Any, str] = {}
            for i, batch in enumerate(batches):
                if deadline is not None and time.monotonic() >= deadline:
                    summary.stopped_by_budget = True
                    break
                if compiler is not None:
                    # wait for this batch's kernels, then queue the next batch's (compiled while this one is measured)
                    try:
                        if i == 0:
                            queued = compiler.submit(kernel_specialisations(batch, device))
                        compiler.wait(queued, deadline)
                        queued = {}
                        if i + 1 < len(batches):
                            queued = compiler.submit(kernel_specialisations(batches[i + 1], device))
                    except Exception as exc:  # e.g. a worker died and broke the pool: measure on without it
                        logger.warning("compiling ahead failed (%s); the measuring process compiles from now on", exc)
                        _close_compiler(compiler, summary)
                        compiler = None
                for p in batch:
                    if deadline is not None and time.monotonic() >= deadline:
                        summary.stopped_by_budget = True
                        break
                    check = check_every > 0 and (first or p.index % check_every == 0)
                    first = False
                    try:
                        record = measure(p, device=device, check=check, env=env)
                    except DeviceLostError as exc:
                        record = exc.record
                        summary.aborted = str(exc)
                    except Exception as exc:
                        logger.debug("measuring %s raised", p.describe(), exc_info=True)
                        record = failed_record(p, env, _error_text(exc))
                    _annotate(record, p, run_id, check, shard)
                    expected = point_key(p, gpu_name)
                    if record.get("key") != expected:
                        raise ValueError(
                            f"measure returned a record with key {record.get('key')!r} for {p.describe()}, "
                            f"expected {expected} (is its env['gpu_name'] {gpu_name!r}?)"
                        )
                    try:
                        writer.append(record)
                    except TraceError as exc:  # e.g. a timing that is not finite: keep the point, as failed
                        logger.warning("%s: invalid record (%s); written as failed", p.describe(), exc)
                        record = failed_record(p, env, "InvalidRecord: " + _error_text(exc))
                        _annotate(record, p, run_id, check, shard)
                        writer.append(record)
                    if record["status"] == "ok":
                        summary.measured += 1
                    else:
                        summary.failed += 1
                        logger.debug("%s failed: %s", p.describe(), record["error"])
                    report(record["status"], None)
                    if record["status"] == "ok":
                        measured_ok.append(p)
                    if summary.aborted:
                        logger.error("%s; stopping (rerun to resume after point %d)", summary.aborted, p.index)
                        break
                    if repeat_every and summary.written % repeat_every == 0 and len(measured_ok) > repeat_every // 2:
                        again = measured_ok[-1 - repeat_every // 2]
                        if _repeat(again, writer, measure, device, env, run_id, shard, summary):
                            break
                if summary.stopped_by_budget or summary.aborted:
                    break
    finally:
        summary.not_started = len(todo) - summary.written
        if compiler is not None:
            _close_compiler(compiler, summary)
    summary.elapsed_s = time.monotonic() - t0
    return summary


def _repeat(
    point: DesignPoint,
    writer: TraceWriter,
    measure: Callable[..., dict[str, Any]],
    device: Any,
    env: dict[str, Any],
    run_id: str,
    shard: int | None,
    summary: ProfileSummary,
) -> bool:
    """Measure ``point`` again and append the record as a repeat line; True when the device was lost."""
    lost = False
    try:
        record = measure(point, device=device, check=False, env=env)
    except DeviceLostError as exc:
        record, lost = exc.record, True
        summary.aborted = str(exc)
    except Exception as exc:
        record = failed_record(point, env, _error_text(exc))
    _annotate(record, point, run_id, False, shard)
    record["meta"]["profiler"]["repeat"] = True
    try:
        writer.append(record)
    except TraceError as exc:
        logger.warning("%s: invalid repeat record (%s); not written", point.describe(), exc)
        return lost
    summary.repeats += 1
    return lost


def _close_compiler(compiler: _Compiler, summary: ProfileSummary) -> None:
    summary.precompiled += compiler.compiled
    summary.precompile_failed += compiler.failed
    summary.precompile_s += compiler.seconds
    try:
        compiler.close()
    except Exception as exc:
        logger.warning("closing the compile workers: %s", exc)


def _cuda_device(device: Any) -> bool:
    try:
        import torch

        return torch.device(device).type == "cuda" and torch.cuda.is_available()
    except Exception:
        return False


def _visible_gpu_ids() -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entry a child needs to see each visible GPU alone."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[:count] if visible else [str(i) for i in range(count)]


def _shard_main(
    shard: int,
    out: str,
    points: list[DesignPoint],
    options: dict[str, Any],
    events: Any,
) -> None:
    """Entry point of one GPU worker process (spawned with ``CUDA_VISIBLE_DEVICES`` set to its GPU)."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s gpu{shard} %(name)s: %(message)s")
    logging.getLogger("fasttree").setLevel(options.pop("log_level"))

    def report(event: str, value: Any) -> None:
        events.put((shard, event, value))

    try:
        wall_deadline = options.pop("wall_deadline")
        options["deadline"] = None if wall_deadline is None else time.monotonic() + (wall_deadline - time.time())
        env = options.pop("env")
        if env is None:
            env = collect_env(options["device"])
        summary = _run_points(Path(out), points, env=env, report=report, shard=shard, **options)
        events.put((shard, "summary", asdict(summary)))
    except BaseException as exc:
        events.put((shard, "error", _error_text(exc)))
        raise


def _run_sharded(
    out: Path,
    points: list[DesignPoint],
    *,
    gpu_ids: list[str],
    env: dict[str, Any] | None,
    progress: _ProgressFactory,
    **options: Any,
) -> ProfileSummary:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    k = len(gpu_ids)
    procs = []
    deadline = options.pop("deadline")
    wall_deadline = None if deadline is None else time.time() + (deadline - time.monotonic())
    options = dict(
        options,
        device="cuda",
        env=env,
        wall_deadline=wall_deadline,
        log_level=logging.getLogger("fasttree").getEffectiveLevel(),
    )
    options["compile_workers"] = max(1, options["compile_workers"] // k)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for i, gpu in enumerate(gpu_ids):
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # inherited by the spawned child at start
            mine = [p for p in points if p.tree_index % k == i]  # whole trees: a tree's configs share a GPU
            p = ctx.Process(
                target=_shard_main, args=(i, str(out), mine, dict(options), events), name=f"fasttree-gpu{i}"
            )
            p.start()
            procs.append(p)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    logger.info("profiling on %d GPUs (%s), one worker process each, every %d-th tree", k, ",".join(gpu_ids), k)
    total = 0
    totals_seen = 0
    bar: _Progress | None = None
    summary = ProfileSummary(gpus=k)
    finished: set[int] = set()
    errors: list[str] = []
    early_events: list[str] = []
    try:
        while len(finished) < k:
            try:
                shard, event, value = events.get(timeout=1.0)
            except queue_module.Empty:
                for i, p in enumerate(procs):
                    if i not in finished and not p.is_alive():
                        finished.add(i)
                        if p.exitcode != 0:
                            errors.append(f"GPU worker {i} exited with code {p.exitcode}")
                continue
            if event == "total":
                total += int(value)
                totals_seen += 1
                if totals_seen == k:  # every worker has counted its points: the bar can start
                    bar = progress(total)
                    for early in early_events:
                        bar.update(early)
            elif event in ("ok", "failed"):
                if bar is not None:
                    bar.update(event)
                else:
                    early_events.append(event)
            elif event == "summary":
                summary.merge(ProfileSummary(**value))
                finished.add(shard)
            elif event == "error":
                errors.append(f"GPU worker {shard}: {value}")
                finished.add(shard)
    finally:
        if bar is not None:
            bar.close()
        for p in procs:
            p.join()
    if errors:
        summary.aborted = "; ".join(errors)
    return summary


_ProgressFactory = Callable[[int], _Progress]


def profile(
    out: str | os.PathLike,
    *,
    n: int,
    seed: int = 0,
    budget_s: float | None = None,
    device: Any = "cuda",
    families: Iterable[str] | None = None,
    split: str = "train",
    precompile: bool = True,
    progress: bool = True,
    measure: Callable[..., dict[str, Any]] = measure_point,
    check_every: int = 10,
    env: dict[str, Any] | None = None,
    sm_count: int | None = None,
    gpus: int | None = None,
    compile_workers: int | None = None,
    batch_size: int = 32,
    repeat_every: int = 0,
    runtime: bool = False,
) -> ProfileSummary:
    """Profile a design of ``n`` points into the trace file ``out`` (appending, resumable).

    Points whose key ``out`` already holds (ok or failed) are skipped, so rerunning the
    same command resumes a killed run, and a larger ``n`` adds only the new points. Points
    are measured in batches; before each batch the Triton kernel specialisations it needs
    are compiled in parallel worker processes (``precompile``; spawned, ``min(16, cpu
    count)`` of them) so that the measuring process finds them in Triton's disk cache. No
    new point starts once ``budget_s`` is spent. A failing point is written as a failed
    record and the run goes on. With several visible GPUs (and ``device`` the generic
    ``"cuda"``), one spawned worker process per GPU measures every k-th tree (all its configs), all
    appending to ``out``.

    Parameters
    ----------
    out : str or PathLike
        A ``.jsonl`` trace file (created when missing).
    n : int
        Design points (see :func:`design`).
    seed : int
        Design seed.
    budget_s : float, optional
        Wall-clock budget in seconds (None: until every point is done).
    device : str or torch.device
        ``"cuda"`` (every visible GPU) or one device such as ``"cuda:1"``.
    families : iterable of str, optional
        Restrict the design to these tree families.
    split : str
        ``"train"`` or ``"heldout"`` (see :func:`design`); recorded in every line's
        ``meta.split``. Write the splits to separate folders (``traces/h200_heldout/``).
    precompile : bool
        Compile kernels ahead in worker processes (skipped without a CUDA device).
    progress : bool
        Show a tqdm progress bar (log lines when tqdm is missing).
    measure : callable
        ``measure(point, *, device, check, env) -> record``; :func:`measure_point` by
        default (tests inject a fake). Must return a record whose key is
        :func:`point_key` for ``env["gpu_name"]``; an exception it raises is written as
        a failed record. In a multi-GPU run it must be picklable (a module-level function).
    check_every : int
        Check correctness of every point whose design index is a multiple of this (and
        of the first point measured); 0 never checks.
    env : dict, optional
        The ``env`` of the records (default: :func:`collect_env` of the device; tests
        pass a fake one).
    sm_count : int, optional
        SM count for the design's thresholds (default: the device's, else 132).
    gpus : int, optional
        GPU worker processes (default: every visible GPU when ``device`` is ``"cuda"``,
        else 1); more than one forces the multi-process path.
    compile_workers : int, optional
        Compile worker processes (default ``min(16, cpu count)``; split among GPUs).
    batch_size : int
        Points per compile-then-measure batch.
    repeat_every : int
        After every this many points, measure an earlier ``ok`` point again and write it
        as another line of its key (``meta.profiler.repeat``; 0: never), the data of the
        repeat spread that ``fasttree-tune traces`` reports.
    runtime : bool
        Time :class:`fasttree.runtime.TreeAttentionRuntime`'s launches instead of
        ``tree_attention``'s (:attr:`DesignPoint.runtime`; other keys, so both can share a file).

    Returns
    -------
    ProfileSummary

    Raises
    ------
    ValueError
        On bad arguments, a ``.gz`` output path, or no CUDA GPU when ``env`` is not given.
    """
    t0 = time.monotonic()
    out = Path(out)
    if out.name.endswith(".gz"):
        raise ValueError(f"{out}: the profiler appends to a .jsonl file; gzip it once the set is finished")
    n = check_int("n", n, minimum=0)
    seed = check_int("seed", seed, minimum=0)
    check_every = check_int("check_every", check_every, minimum=0)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    repeat_every = check_int("repeat_every", repeat_every, minimum=0)
    if budget_s is not None:
        budget_s = check_number(
            "budget_s", budget_s, above=0, finite=False, expected="a positive number of seconds or None"
        )
        budget_s = budget_s if math.isfinite(budget_s) else None
    fams = _check_families(families)
    deadline = None if budget_s is None else t0 + float(budget_s)
    env_given = env is not None
    if env is None:
        env = collect_env(device)
    if sm_count is None:
        sm_count = int(env.get("gpu_sm_count") or 0) or device_sm_count(device)
    if compile_workers is None:
        compile_workers = default_compile_workers()
    compile_workers = check_int("compile_workers", compile_workers, minimum=1)
    points = design(n, seed, sm_count=sm_count, families=fams, split=_check_split(split), runtime=runtime)
    run_id = uuid.uuid4().hex[:12]
    logger.info(
        "profile run %s: %d %s design points (seed %d, families %s) -> %s%s",
        run_id,
        n,
        split,
        seed,
        ",".join(fams),
        out,
        f", budget {budget_s:.0f} s" if budget_s is not None else "",
    )

    def make_progress(total: int) -> _Progress:
        return _Progress(total, enabled=progress, deadline=deadline)

    options = dict(
        deadline=deadline,
        precompile=precompile,
        compile_workers=compile_workers,
        measure=measure,
        check_every=check_every,
        batch_size=batch_size,
        run_id=run_id,
        repeat_every=repeat_every,
    )
    if gpus is None:
        gpu_ids = _visible_gpu_ids() if _generic_cuda(device) else []
    else:
        gpus = check_int("gpus", gpus, minimum=1)
        visible = _visible_gpu_ids()
        gpu_ids = visible[:gpus] if len(visible) >= gpus else [str(i) for i in range(gpus)]
    if len(gpu_ids) > 1:
        # each GPU worker collects its own env unless the caller fixed one
        shard_env = env if env_given else None
        summary = _run_sharded(out, points, gpu_ids=gpu_ids, env=shard_env, progress=make_progress, **options)
    else:
        bar: list[_Progress] = []

        def report(event: str, value: Any) -> None:
            if event == "total":
                bar.append(make_progress(int(value)))
            elif bar:
                bar[0].update(event)

        try:
            summary = _run_points(out, points, device=device, env=env, report=report, **options)
        finally:
            if bar:
                bar[0].close()
    summary.points = len(points)
    summary.elapsed_s = time.monotonic() - t0
    logger.info("profile run %s done: %s", run_id, summary.line())
    return summary


def _generic_cuda(device: Any) -> bool:
    try:
        import torch

        dev = torch.device(device)
    except Exception:
        return False
    return dev.type == "cuda" and dev.index is None
