"""The profiler's design: which (tree, heads, dtype, config) points a profiling run measures.

:func:`design` crosses trees with configs. Trees come from a scrambled Sobol' sequence
(``scipy.stats.qmc``) over tree family and seed, GQA ratio and heads, head dim and dtype;
each is measured under :data:`CONFIGS_PER_TREE` configs, the published defaults first,
then configs sampled over every :class:`~fasttree.config.FastTreeConfig` knob (query and
KV tiles, warps and stages per tile class from a per-GQA pool of :data:`KERNEL_POOL`
settings; split sizes, parallelism thresholds, the cost weights alpha/beta/gamma and
packing drawn per point). A design is a prefix of its sequence: ``design(n2, seed)``
starts with ``design(n1, seed)`` for ``n1 < n2``, so a longer run extends a shorter one.

A point's tree (:func:`point_tree`), the key of its measurement (:func:`point_key`) and the
``launch`` its record names (:func:`point_launch`) follow from the point alone. scipy is
imported only when a design is drawn.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import FastTreeConfig
from ..traces import measurement_key, runtime_launch
from ..tree import KVTree
from ..validation import check_choice, check_int
from .workloads import TREE_FAMILIES, sample_tree

logger = logging.getLogger(__name__)

__all__ = [
    "ALPHA_RANGE",
    "BETA_RANGE",
    "CONFIGS_PER_TREE",
    "DEEP_TREES",
    "DEFAULT_SM_COUNT",
    "DTYPE_WEIGHTS",
    "FAMILY_WEIGHTS",
    "GAMMA_RANGE",
    "HEADS_BY_GQA",
    "HEAD_DIM_WEIGHTS",
    "HELDOUT_AXES",
    "HELDOUT_GQA",
    "HELDOUT_HEAD_DIM",
    "KERNEL_POOL",
    "KV_TILES",
    "MAX_TILE_ROWS",
    "NUM_STAGES",
    "NUM_WARPS",
    "PACK_TOKENS",
    "Q_ROWS_LARGE",
    "Q_ROWS_SMALL",
    "SEED_SPACE",
    "SPLITS",
    "SPLITS_LARGE",
    "SPLITS_SMALL",
    "DesignPoint",
    "check_families",
    "check_split",
    "design",
    "point_identity",
    "point_key",
    "point_launch",
    "point_tree",
]

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
        ``"train"`` or ``"heldout"`` (:data:`SPLITS`) for the sampled design, ``"headroom"`` for
        the headroom design (:mod:`fasttree.toolkit.headroom`).
    tree_index : int
        Position of the point's tree in the design (its :data:`CONFIGS_PER_TREE` configs share it).
    runtime : bool
        Time :class:`fasttree.runtime.TreeAttentionRuntime`'s launches (its own plan, persistent
        kernels, ``stage1_launches`` and ``query_centric`` ``"auto"``) instead of
        ``fasttree.tree_attention``'s per-plan launches; the record's ``launch`` says so.
    variants : bool
        With ``runtime``: time the runtime as servers run it, with its launch variants
        (``fasttree.tree_attention``'s own launches over its buffers; ``validate`` does), instead of
        its fixed persistent launch (the profiler's designs: what the latency model's runtime target
        was fitted on). Part of the record's ``launch`` (and so of its key).
    bucket : str or None
        The headroom bucket (:func:`fasttree.toolkit.headroom.bucket_name`) of a point of the
        headroom design; None for the sampled design.
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
    bucket: str | None = None
    variants: bool = False

    @property
    def gqa(self) -> int:
        """GQA ratio ``num_q_heads // num_kv_heads``."""
        return self.num_q_heads // self.num_kv_heads

    def describe(self) -> str:
        """Short human description (for logs)."""
        params = "".join(f" {k}={v}" for k, v in self.params)
        tags = (" defaults" if self.default_config else "") + (" heldout" if self.split == "heldout" else "")
        tags += " runtime" if self.runtime else ""
        tags += f" headroom {self.bucket}" if self.bucket is not None else ""
        return (
            f"#{self.index} {self.family}/{self.seed}{params} Hq={self.num_q_heads} Hkv={self.num_kv_heads} "
            f"D={self.head_dim} {self.dtype}{tags}"
        )


def check_families(families: Iterable[str] | None) -> list[str]:
    """Families in :data:`TREE_FAMILIES` order; ``None`` means all."""
    if families is None:
        return list(TREE_FAMILIES)
    return choose_names(families, TREE_FAMILIES, "tree families", "families must name at least one tree family "
                        "(or be None for all)")  # fmt: skip


def choose_names(names: Iterable[str] | str, known: Iterable[str], what: str, empty: str) -> list[str]:
    """``names`` (one name or several; repeats dropped) in the order of ``known``.

    Raises
    ------
    ValueError
        On a name not in ``known`` (the message names them as ``what``), or with ``empty`` when
        ``names`` is empty.
    """
    known = list(known)
    chosen = list(dict.fromkeys([names] if isinstance(names, str) else names))
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; choose from {known}")
    if not chosen:
        raise ValueError(empty)
    return [n for n in known if n in chosen]


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


def check_split(split: str) -> str:
    """``split`` when it is one of :data:`SPLITS`, else ``ValueError``."""
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
    fams = check_families(families)
    split = check_split(split)
    trees = _Stream(_TREE_DIMS, [seed, _SALT_TREES] if split == "train" else [seed, _SALT_HELDOUT])
    configs = _Stream(_CONFIG_DIMS, [seed, _SALT_CONFIGS])
    pools: dict[int, list[dict[str, Any]]] = {}
    points: list[DesignPoint] = []
    tree_index = 0
    while len(points) < n:
        common = _tree_fields(trees.next(), fams, split, design_seed=seed, tree_index=tree_index, runtime=runtime)
        points.append(DesignPoint(index=len(points), config=FastTreeConfig(), default_config=True, **common))
        g = common["num_q_heads"] // common["num_kv_heads"]
        if g not in pools:
            pools[g] = _kernel_pool(g, seed, kernel_pool)
        wanted = min(configs_per_tree - 1, n - len(points))
        for config in _sampled_configs(configs, pools[g], wanted, g=g, sm_count=sm_count):
            points.append(DesignPoint(index=len(points), config=config, **common))
        tree_index += 1
    return points


def _tree_fields(
    x: dict[str, float], families: list[str], split: str, *, design_seed: int, tree_index: int, runtime: bool
) -> dict[str, Any]:
    """The :class:`DesignPoint` fields of one row of the tree sequence (all but the config)."""
    family, params, (hq, hkv), head_dim = _workload_axes(x, families, split)
    return dict(
        family=family,
        seed=min(int(x["family_seed"] * SEED_SPACE), SEED_SPACE - 1),
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        dtype=_categorical(x["dtype"], list(DTYPE_WEIGHTS), list(DTYPE_WEIGHTS.values())),
        design_seed=design_seed,
        params=params,
        split=split,
        tree_index=tree_index,
        runtime=bool(runtime),
    )


def _sampled_configs(
    configs: _Stream, pool: list[dict[str, Any]], count: int, *, g: int, sm_count: int
) -> Iterator[FastTreeConfig]:
    """The next ``count`` valid configs other than the defaults from the config sequence, each
    with kernel settings of ``pool``; rows that map to no valid config are skipped."""
    made, start = 0, configs.drawn
    while made < count:
        if configs.drawn - start >= _MAX_FRUITLESS_DRAWS:
            raise ValueError(f"no valid point among {configs.drawn - start} draws of the design's configs")
        u = configs.next()
        config = _config_from_unit(u, _categorical(u["kernel"], pool), g=g, sm_count=sm_count)
        if config is None or config == FastTreeConfig():
            continue
        yield config
        made, start = made + 1, configs.drawn


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
    return measurement_key(point_tree(point) if tree is None else tree, **point_identity(point), gpu_name=gpu_name)


def point_launch(point: DesignPoint) -> dict[str, Any] | None:
    """The ``launch`` of the point's record: :func:`fasttree.traces.runtime_launch` of a runtime
    point (``stage1_launches`` resolved for its heads), None for ``tree_attention``'s launches."""
    if not point.runtime:
        return None
    from ..runtime_planning import resolve_stage1_launches

    return runtime_launch(
        stage1_launches=resolve_stage1_launches("auto", point.gqa, point.head_dim),
        query_centric="auto",
        variants=point.variants,
    )


def point_identity(point: DesignPoint) -> dict[str, Any]:
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
