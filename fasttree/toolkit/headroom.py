"""The headroom design: every config of a fixed sample, measured on every tree of a fixed sample, per bucket.

Before tuning a bucket (head layout, head dim, dtype) it pays to know how much any config could
gain there. :func:`headroom_design` fixes, before anything is measured, per bucket of
:data:`HEADROOM_BUCKETS`:

* a sample of trees (:func:`headroom_trees`): the same ``trees`` trees in every bucket, the tree
  families of :data:`fasttree.toolkit.workloads.TREE_FAMILIES` in turn (several families, each
  about equally often), each with a seed drawn from :data:`HEADROOM_TREE_SEEDS`, a range no
  workload trace uses (the tuning and validation workloads draw seeds 0-15 and 1000-1007, the
  frozen test trees come from other generators), with each family's default (training) size
  ranges;
* a sample of configs (:func:`headroom_configs`): the published defaults, then ``configs - 1``
  configs drawn like the profiler's sampled configs (:func:`fasttree.toolkit.design.design`:
  every :class:`~fasttree.config.FastTreeConfig` knob from a scrambled Sobol' sequence, the kernel
  settings from the profiler's bounded pool per GQA ratio and seed, so the kernels a run compiles
  stay bounded), from a sequence of the bucket's own.

Every tree of a bucket is measured under every config of the bucket (a full cross), so the
summary (:mod:`fasttree.toolkit.headroom_stats`) can give each tree's oracle (its best measured
config against the defaults) and the best single config of the bucket. The points are ordinary
:class:`~fasttree.toolkit.design.DesignPoint` objects (``split`` ``"headroom"``, ``bucket`` set):
``fasttree-tune profile --design headroom`` measures them with the profiler's loop (resumable,
compiling ahead, ``--budget``), and :func:`fasttree.toolkit.profile_loop.annotate_record` writes
``meta.design = "headroom"`` and ``meta.bucket`` into their lines.

scipy is imported only when a design is drawn.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from ..config import FastTreeConfig
from ..portfolio import LAUNCH_FIELDS
from ..traces import _config_dict
from ..validation import check_int
from .design import (
    _CONFIG_DIMS,
    DEFAULT_SM_COUNT,
    KERNEL_POOL,
    MAX_TILE_ROWS,
    SEED_SPACE,
    DesignPoint,
    _kernel_pool,
    _sampled_configs,
    _Stream,
    check_families,
    choose_names,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "DESIGNS",
    "HEADROOM_BUCKETS",
    "HEADROOM_CONFIGS",
    "HEADROOM_DESIGN",
    "HEADROOM_SPLIT",
    "HEADROOM_TREES",
    "HEADROOM_TREE_SEEDS",
    "PLANNER_ONLY_EVERY",
    "HeadroomBucket",
    "bucket_name",
    "check_buckets",
    "headroom_configs",
    "headroom_design",
    "headroom_trees",
]

#: The designs the profiler measures (:func:`fasttree.toolkit.profiler.profile`'s ``design_name``):
#: the sampled one (:func:`fasttree.toolkit.design.design`) and this one.
DESIGNS = ("sampled", "headroom")
#: ``meta.design`` of a headroom line, and ``meta.split`` (it is neither training nor held-out data).
HEADROOM_DESIGN = "headroom"
HEADROOM_SPLIT = "headroom"
#: Trees per bucket and configs per tree (the defaults included) of the default design.
HEADROOM_TREES = 20
HEADROOM_CONFIGS = 50
#: Every this-many-th sampled config keeps the defaults' kernel settings (planner knobs only).
PLANNER_ONLY_EVERY = 4
#: Seeds of the headroom trees: ``[2**20, 2**30)``, far above the seeds the workload traces draw
#: (``fasttree.toolkit.workload_traces``: tuning 0-15, validation 1000-1007).
HEADROOM_TREE_SEEDS = (1 << 20, SEED_SPACE)
#: Scrambling salts of the tree draw and of the config sequences (other than the profiler's).
_SALT_TREES, _SALT_CONFIGS = 0x4EAD, 0xC0F1
_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class HeadroomBucket:
    """A head layout, head dim and dtype the headroom design measures.

    Attributes
    ----------
    num_q_heads, num_kv_heads : int
        Query and KV heads (``num_q_heads`` a multiple of ``num_kv_heads``).
    head_dim : int
    dtype : str
        ``"float16"`` or ``"bfloat16"``.
    why : str
        What the bucket stands for (documentation and ``--help``).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    why: str = ""

    @property
    def gqa(self) -> int:
        """GQA ratio ``num_q_heads // num_kv_heads``."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def name(self) -> str:
        """``{Hq}x{Hkv}-d{D}-{fp16|bf16}`` (:func:`bucket_name`)."""
        return bucket_name(self.num_q_heads, self.num_kv_heads, self.head_dim, self.dtype)


def bucket_name(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: str) -> str:
    """The headroom bucket name of a shape, ``{Hq}x{Hkv}-d{D}-{fp16|bf16}`` (e.g. ``32x8-d128-fp16``).

    The heads are named, not only their ratio: 8 query heads over one KV head and 32 over 4 are
    both GQA 8 (one export bucket) but give the GPU different numbers of programs.
    """
    return f"{num_q_heads}x{num_kv_heads}-d{head_dim}-{_DTYPE_SHORT.get(dtype, dtype)}"


_BUCKETS = (
    HeadroomBucket(32, 32, 128, "float16", "MHA (GQA 1), Llama-2-7B-shaped; hand-tuned defaults"),
    HeadroomBucket(32, 8, 128, "float16", "GQA 4, Mistral-7B-shaped; hand-tuned defaults"),
    HeadroomBucket(32, 2, 128, "float16", "GQA 16; hand-tuned defaults"),
    HeadroomBucket(32, 8, 64, "bfloat16", "head dim 64, bf16"),
    HeadroomBucket(32, 8, 256, "bfloat16", "head dim 256, bf16"),
    HeadroomBucket(8, 1, 128, "bfloat16", "GQA 8 over one KV head (tensor-parallel shard), bf16"),
    HeadroomBucket(32, 4, 128, "float16", "GQA 8 over 4 KV heads"),
    HeadroomBucket(16, 1, 128, "float16", "GQA 16 over one KV head"),
    HeadroomBucket(32, 8, 128, "bfloat16", "GQA 4 in bf16"),
)
#: Every bucket the headroom design knows, by name.
HEADROOM_BUCKETS: dict[str, HeadroomBucket] = {b.name: b for b in _BUCKETS}
#: The buckets measured by default (6 x 20 trees x 50 configs = 6,000 points).
DEFAULT_BUCKETS: tuple[str, ...] = tuple(b.name for b in _BUCKETS[:6])


def check_buckets(buckets: Iterable[str] | str | None) -> list[HeadroomBucket]:
    """The named buckets in :data:`HEADROOM_BUCKETS` order; ``None`` means :data:`DEFAULT_BUCKETS`.

    Raises
    ------
    ValueError
        On an unknown name or an empty selection.
    """
    chosen = choose_names(DEFAULT_BUCKETS if buckets is None else buckets, HEADROOM_BUCKETS, "headroom buckets",
                          "buckets must name at least one headroom bucket (or be None for the defaults)")  # fmt: skip
    return [HEADROOM_BUCKETS[name] for name in chosen]


def headroom_trees(trees: int, seed: int = 0, *, families: Iterable[str] | None = None) -> list[tuple[str, int]]:
    """The ``(family, seed)`` of each tree of the headroom sample (the same in every bucket).

    Tree ``i`` is of family ``families[i % len(families)]``; its seed is drawn from
    ``numpy.random.default_rng([seed, salt])`` in :data:`HEADROOM_TREE_SEEDS`, distinct across the
    sample; :func:`fasttree.toolkit.workloads.sample_tree` ``(family, tree_seed)`` is the tree.

    Parameters
    ----------
    trees : int
        Trees (>= 1).
    seed : int
        Design seed (>= 0).
    families : iterable of str, optional
        Tree families, in :data:`~fasttree.toolkit.workloads.TREE_FAMILIES` order (default all).

    Returns
    -------
    list of (str, int)
    """
    trees = check_int("trees", trees, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    fams = check_families(families)
    rng = np.random.default_rng([seed, _SALT_TREES])
    out: list[tuple[str, int]] = []
    used: set[int] = set()
    for i in range(trees):
        tree_seed = int(rng.integers(*HEADROOM_TREE_SEEDS))
        while tree_seed in used:
            tree_seed = int(rng.integers(*HEADROOM_TREE_SEEDS))
        used.add(tree_seed)
        out.append((fams[i % len(fams)], tree_seed))
    return out


def headroom_configs(
    bucket: HeadroomBucket,
    configs: int = HEADROOM_CONFIGS,
    seed: int = 0,
    *,
    sm_count: int = DEFAULT_SM_COUNT,
    kernel_pool: int = KERNEL_POOL,
) -> list[FastTreeConfig]:
    """The configs of ``bucket``: the defaults, then ``configs - 1`` distinct sampled ones.

    Sampled as the profiler samples (:func:`fasttree.toolkit.design.design`): planner knobs from a
    scrambled Sobol' sequence, kernel settings from the profiler's pool of ``kernel_pool`` settings
    for the bucket's GQA ratio and ``seed``; rows that map to an invalid config are skipped. Every
    :data:`PLANNER_ONLY_EVERY`-th sampled config keeps the defaults' kernel settings (the launch
    fields, :data:`fasttree.portfolio.LAUNCH_FIELDS`, which the pool never holds), so the sweep
    also measures what the planner's knobs alone are worth. The
    sequence is seeded by ``seed`` and the bucket's shape, so a bucket's configs do not depend on
    which other buckets a run measures.

    Parameters
    ----------
    bucket : HeadroomBucket
    configs : int
        Configs (>= 2), the defaults included.
    seed : int
        Design seed (>= 0).
    sm_count : int
        The GPU's SM count; the thresholds range over ``[0, 4 * sm_count]``.
    kernel_pool : int
        Kernel settings per GQA ratio (>= 1).

    Returns
    -------
    list of FastTreeConfig
        ``FastTreeConfig()`` first.
    """
    configs = check_int("configs", configs, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    sm_count = check_int("sm_count", sm_count, minimum=1)
    kernel_pool = check_int("kernel_pool", kernel_pool, minimum=1)
    g = bucket.gqa
    if g > MAX_TILE_ROWS:
        raise ValueError(f"bucket {bucket.name}: GQA ratio {g} is over the kernel's {MAX_TILE_ROWS} rows")
    dtype_index = list(_DTYPE_SHORT).index(bucket.dtype)
    stream = _Stream(
        _CONFIG_DIMS,
        [seed, _SALT_CONFIGS, bucket.num_q_heads, bucket.num_kv_heads, bucket.head_dim, dtype_index],
    )
    pool = _kernel_pool(g, seed, kernel_pool)
    defaults = FastTreeConfig()
    out = [defaults]
    launched = {_launched(out[0], bucket)}  # distinct as launched: derived warps and stages written out
    for i, config in enumerate(_sampled_configs(stream, pool, sys.maxsize, g=g, sm_count=sm_count)):
        if i % PLANNER_ONLY_EVERY == 0:  # the defaults' kernels (the pool holds none of them), other planning
            config = replace(config, **{f: getattr(defaults, f) for f in LAUNCH_FIELDS})
        if _launched(config, bucket) not in launched:
            launched.add(_launched(config, bucket))
            out.append(config)
        if len(out) == configs:
            break
    return out


def _launched(config: FastTreeConfig, bucket: HeadroomBucket) -> str:
    """The config as the bucket's launches run it and trace records store it (and keys hash it)."""
    resolved = _config_dict(config, bucket.num_q_heads, bucket.num_kv_heads, bucket.head_dim)
    return json.dumps(resolved, sort_keys=True)


def headroom_design(
    seed: int = 0,
    *,
    buckets: Iterable[str] | str | None = None,
    trees: int = HEADROOM_TREES,
    configs: int = HEADROOM_CONFIGS,
    families: Iterable[str] | None = None,
    sm_count: int = DEFAULT_SM_COUNT,
    runtime: bool = False,
) -> list[DesignPoint]:
    """The headroom design: per bucket, every sampled tree under every config of the bucket.

    Points run bucket by bucket (in :data:`HEADROOM_BUCKETS` order), tree by tree, the defaults
    first; ``tree_index`` numbers the (bucket, tree) pairs, so a multi-GPU run gives each GPU whole
    trees. ``split`` is :data:`HEADROOM_SPLIT` and ``bucket`` the bucket's name.

    Parameters
    ----------
    seed : int
        Design seed (>= 0): the trees, the config sequences and the kernel pools.
    buckets : iterable of str, optional
        Names from :data:`HEADROOM_BUCKETS` (default :data:`DEFAULT_BUCKETS`).
    trees : int
        Trees per bucket (>= 1; the same trees in every bucket).
    configs : int
        Configs per tree (>= 2), the defaults included.
    families : iterable of str, optional
        Tree families to draw from in turn (default all).
    sm_count : int
        The GPU's SM count (the thresholds' range).
    runtime : bool
        Points time the runtime's launches (:attr:`DesignPoint.runtime`).

    Returns
    -------
    list of DesignPoint
        ``len(buckets) * trees * configs`` points.

    Raises
    ------
    ValueError
        On a bad seed, bucket name, family, ``trees``, ``configs`` or ``sm_count``, all checked
        before anything is drawn.
    """
    seed = check_int("seed", seed, minimum=0)
    chosen = check_buckets(buckets)
    trees = check_int("trees", trees, minimum=1)
    configs = check_int("configs", configs, minimum=2)
    sm_count = check_int("sm_count", sm_count, minimum=1)
    fams = check_families(families)
    sample = headroom_trees(trees, seed, families=fams)
    points: list[DesignPoint] = []
    tree_index = 0
    for bucket in chosen:
        bucket_configs = headroom_configs(bucket, configs, seed, sm_count=sm_count)
        for family, tree_seed in sample:
            for c, config in enumerate(bucket_configs):
                points.append(
                    DesignPoint(
                        index=len(points),
                        family=family,
                        seed=tree_seed,
                        num_q_heads=bucket.num_q_heads,
                        num_kv_heads=bucket.num_kv_heads,
                        head_dim=bucket.head_dim,
                        dtype=bucket.dtype,
                        config=config,
                        design_seed=seed,
                        default_config=c == 0,
                        split=HEADROOM_SPLIT,
                        tree_index=tree_index,
                        runtime=bool(runtime),
                        bucket=bucket.name,
                    )
                )
            tree_index += 1
    return points
