"""Every planner and kernel knob of FastTree in one validated, JSON-serialisable object.

Vocabulary used across the package:

* ``g`` -- the GQA group size, ``num_q_heads // num_kv_heads``.
* *tile class* -- 0 is the large query tile, 1 the small one. Pairs such as
  ``kv_tile`` or ``num_warps`` are indexed by tile class.
* *query tile* -- how many decode queries one work unit handles; the kernel packs
  the ``g`` query heads of one KV head of each of them into ``queries * g`` matrix rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .fileio import write_atomic
from .validation import check_int, check_int_pair, check_number

CONFIG_SCHEMA_VERSION = 2
#: Fields added in schema version 2 (packing).
PACKING_FIELDS = ("pack_tokens", "pack_min_units")
#: What a schema-version-1 dict means by the keys it leaves out, where that differs from
#: today's defaults: no packing (added in version 2) and the published KV tiles.
_V1_DEFAULTS = {"pack_tokens": 0, "kv_tile": (32, 32)}

#: Published query tiles in matrix rows (queries x g): (64, 16) for MHA, GQA 4 and GQA 16 alike.
DEFAULT_Q_TILE_ROWS = (64, 16)
#: Warps per tile class of ``num_warps=None``: Triton's default 4 (the published kernel's),
#: except MHA's 16-row tiles, which run at 2. On the H200 paper suite 2 warps took 0.86-0.985x
#: the time on all 15 MHA cases (geomean 0.912) and 1.00-1.10x on GQA 4; GQA 16 ran up to 1.35x
#: slower at 2 (``docs/history.md``).
DEFAULT_NUM_WARPS = (4, 4)
DEFAULT_NUM_WARPS_MHA = (4, 2)
#: Pipeline stages per tile class of ``num_stages=None``: Triton's default 3, except the large
#: class at 5 (Triton 3.6 on sm_90 then gives its gathered K/V a second shared-memory buffer:
#: 82 -> 115 KB for 64-row tiles at head dim 128) for GQA ratios up to
#: :data:`_DEEP_STAGES_MAX_GROUP` and head dims up to :data:`_DEEP_STAGES_MAX_HEAD_DIM`. On the H200
#: paper suite 5 stages took 0.917-0.929x the time on GQA 2, 4 and 8 (geomean per ratio; every
#: case 0.86-1.02x), 0.993x on MHA and 1.003x on GQA 16, in whole calls and in the runtime
#: (``docs/history.md``). A GPU with less shared memory per block
#: compiles the launch with fewer stages (:func:`fasttree.launcher.launch`).
DEFAULT_NUM_STAGES = (3, 3)
DEFAULT_NUM_STAGES_DEEP = (5, 3)
_DEEP_STAGES_MAX_GROUP = 8
_DEEP_STAGES_MAX_HEAD_DIM = 128
_MAX_Q_TILE_ROWS = 256  # == fasttree.plan_arrays.MAX_BLOCK_M
#: Ranges of the cost weights: far wider than any tuned value (the planner multiplies them with
#: token counts, so an extreme weight would only overflow its costs). gamma -10 and 10 are the
#: paper's "never concatenate" and query-centric ablations.
_WEIGHT_RANGES = {"alpha": (0.0, 1e4), "beta": (0.0, 1e4), "gamma": (-1e4, 1e4)}
#: Largest tile, split size or threshold (the kernels index with int32).
_MAX_COUNT = 2**31 - 1
#: Largest pack_tokens and pack_min_units (2**24: far past any tree a plan can hold in one launch).
_MAX_PACK = 1 << 24
_PAIR_FIELDS = (
    "q_tile_queries",
    "kv_tile",
    "kv_split_sizes",
    "para_threshs1",
    "para_threshs2",
    "num_warps",
    "num_stages",
)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class FastTreeConfig:
    """Planner cost weights, tile sizes, split sizes, thresholds and launch settings.

    Defaults are the values the FastTree authors tuned on an H100, except two choices
    measured on the H200 for this kernel (``docs/history.md``):
    KV tiles of 64 tokens (published: 32) and packing of short units (new here).

    Parameters
    ----------
    alpha : float
        Weight of query-dimension padding (wasted matrix rows) in the planner's cost.
    beta : float
        Weight of KV-dimension padding (wasted KV columns) in the planner's cost.
    gamma : float
        Price per query of an extra partial result (merge work). ``-10`` never
        concatenates a context into its children (cascade-like), ``10`` always does
        (query-centric).
    q_tile_queries : tuple of int or None
        Queries per tile for (large, small) tile class. ``None`` derives the published
        values from the GQA ratio: 64 and 16 matrix rows, i.e. (64, 16) queries for MHA,
        (16, 4) for GQA 4, (4, 1) for GQA 16.
    kv_tile : tuple of int
        KV tokens per inner-loop tile (a power of two >= 16) for each tile class.
    kv_split_sizes : tuple of int
        (default, small) number of KV tokens per work unit; a tile class with too few
        units switches to the small one. Groups longer than the default size are cut at
        it only where their class would, uncut, have fewer units x KV heads than
        ``para_threshs1`` (twice it for the small class; see
        :data:`fasttree.planner._WHOLE_GROUPS_MIN_ITEMS`).
    para_threshs1 : tuple of int
        Per tile class, the work units x KV heads under which that class uses the small
        split size (and, scaled as above, under which it cuts long groups at all).
    para_threshs2 : tuple of int
        (large, small): when both classes have work and the large one has fewer units x
        KV heads than the first value, every group uses the small tile; else, when the
        small one has fewer than the second, every group uses the large tile.
    num_warps : tuple of int or None
        Triton warps per tile class. ``None`` derives them from the GQA ratio
        (:meth:`launch_warps`): ``DEFAULT_NUM_WARPS_MHA`` (4, 2) for MHA, else
        ``DEFAULT_NUM_WARPS`` (4, 4), Triton's default, which the published kernel used.
    num_stages : tuple of int or None
        Triton software-pipelining stages per tile class. ``None`` derives them from the GQA
        ratio and head dim (:meth:`launch_stages`): ``DEFAULT_NUM_STAGES_DEEP`` (5, 3) for
        ratios up to 8 at head dims up to 128, else ``DEFAULT_NUM_STAGES`` (3, 3), Triton's
        default.
    pack_tokens : int
        Work units shorter than this many KV tokens are packed, in DFS order, into masked
        units of about this many tokens that fill a tile's rows (one program, one partial
        per query; see :mod:`fasttree.packing`). 0 turns packing off (the published
        behaviour).
    pack_min_units : int
        Packing aims at no fewer than about this many packed units x KV heads (the token
        budget shrinks for small trees), so the GPU stays busy.
    """

    alpha: float = 0.66
    beta: float = 0.33
    gamma: float = 0.1
    q_tile_queries: tuple[int, int] | None = None
    kv_tile: tuple[int, int] = (64, 64)
    kv_split_sizes: tuple[int, int] = (1024, 128)
    para_threshs1: tuple[int, int] = (132, 528)
    para_threshs2: tuple[int, int] = (132, 132)
    num_warps: tuple[int, int] | None = None
    num_stages: tuple[int, int] | None = None
    pack_tokens: int = 1024
    pack_min_units: int = 264

    def __post_init__(self) -> None:
        for name, (lo, hi) in _WEIGHT_RANGES.items():
            value = check_number(f"FastTreeConfig.{name}", getattr(self, name), minimum=lo, maximum=hi)
            object.__setattr__(self, name, value)
        for name in _PAIR_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("q_tile_queries", "num_warps", "num_stages"):
                continue
            try:
                pair = check_int_pair(f"FastTreeConfig.{name}", value)
            except ValueError:
                raise ValueError(f"FastTreeConfig.{name} must be a pair of integers, got {value!r}") from None
            if max(pair) > _MAX_COUNT:
                raise ValueError(f"FastTreeConfig.{name} must be at most {_MAX_COUNT}, got {pair}")
            object.__setattr__(self, name, pair)
        if self.q_tile_queries is not None:
            large, small = self.q_tile_queries
            if small < 1 or large < small:
                raise ValueError(
                    f"FastTreeConfig.q_tile_queries must be (large, small) with large >= small >= 1, "
                    f"got {self.q_tile_queries}"
                )
        for t in self.kv_tile:
            if not _is_pow2(t) or not 16 <= t <= 512:
                raise ValueError(
                    f"FastTreeConfig.kv_tile entries must be powers of two in [16, 512], got {self.kv_tile}"
                )
        if min(self.kv_split_sizes) < 1:
            raise ValueError(f"FastTreeConfig.kv_split_sizes must be >= 1, got {self.kv_split_sizes}")
        for name in ("para_threshs1", "para_threshs2"):
            if min(getattr(self, name)) < 0:
                raise ValueError(f"FastTreeConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_warps is not None and any(not _is_pow2(w) or w > 16 for w in self.num_warps):
            raise ValueError(f"FastTreeConfig.num_warps must be powers of two <= 16, got {self.num_warps}")
        if self.num_stages is not None and (min(self.num_stages) < 1 or max(self.num_stages) > 8):
            raise ValueError(f"FastTreeConfig.num_stages must be in [1, 8], got {self.num_stages}")
        for name in ("pack_tokens", "pack_min_units"):
            value = getattr(self, name)
            check_int(f"FastTreeConfig.{name}", value, minimum=0, expected="an integer >= 0")
            value = check_int(f"FastTreeConfig.{name}", value, maximum=_MAX_PACK)
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ tiles
    def query_tiles(self, group_size: int) -> tuple[int, int]:
        """Queries per tile (large, small) for a GQA group size ``g``.

        Raises ``ValueError`` when a tile would need more than 256 matrix rows.
        """
        if group_size < 1:
            raise ValueError(f"GQA group size must be >= 1, got {group_size}")
        if self.q_tile_queries is None:
            tiles = tuple(max(1, rows // group_size) for rows in DEFAULT_Q_TILE_ROWS)
        else:
            tiles = self.q_tile_queries
        for t in tiles:
            if t * group_size > _MAX_Q_TILE_ROWS:
                raise ValueError(
                    f"a query tile of {t} queries x GQA group size {group_size} = {t * group_size} rows "
                    f"exceeds the kernel limit of {_MAX_Q_TILE_ROWS} rows; lower q_tile_queries"
                )
        return tiles[0], tiles[1]

    def launch_warps(self, group_size: int) -> tuple[int, int]:
        """Warps per tile class (large, small) for a GQA group size ``g``: ``num_warps``, or
        when it is None ``DEFAULT_NUM_WARPS_MHA`` for ``g == 1`` and ``DEFAULT_NUM_WARPS`` else."""
        if group_size < 1:
            raise ValueError(f"GQA group size must be >= 1, got {group_size}")
        if self.num_warps is not None:
            return self.num_warps
        return DEFAULT_NUM_WARPS_MHA if group_size == 1 else DEFAULT_NUM_WARPS

    def launch_stages(self, group_size: int, head_dim: int) -> tuple[int, int]:
        """Pipeline stages per tile class (large, small) for a GQA group size ``g`` and head
        dim: ``num_stages``, or when it is None ``DEFAULT_NUM_STAGES_DEEP`` for ``g <= 8`` at
        head dims up to 128 and ``DEFAULT_NUM_STAGES`` else."""
        if group_size < 1:
            raise ValueError(f"GQA group size must be >= 1, got {group_size}")
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        if self.num_stages is not None:
            return self.num_stages
        if group_size <= _DEEP_STAGES_MAX_GROUP and head_dim <= _DEEP_STAGES_MAX_HEAD_DIM:
            return DEFAULT_NUM_STAGES_DEEP
        return DEFAULT_NUM_STAGES

    def with_(self, **changes: Any) -> FastTreeConfig:
        """Return a validated copy with some fields changed."""
        return replace(self, **changes)

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict (tuples become lists) with a schema version."""
        out: dict[str, Any] = {"schema_version": CONFIG_SCHEMA_VERSION}
        for key, value in asdict(self).items():
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FastTreeConfig:
        """Build from :meth:`to_dict` output; unknown keys or an unknown schema version raise ``ValueError``.

        A version-1 dict (before packing existed) gets ``pack_tokens=0`` and, when it
        omits them, the published KV tiles (32, 32), so it plans as it did.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a FastTreeConfig must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.pop("schema_version", CONFIG_SCHEMA_VERSION)
        if type(version) is int and version == 1:
            for key, value in _V1_DEFAULTS.items():
                data.setdefault(key, value)
        elif type(version) is not int or version != CONFIG_SCHEMA_VERSION:
            raise ValueError(
                f"FastTreeConfig schema_version {version!r} is not supported (expected 1 or {CONFIG_SCHEMA_VERSION})"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown FastTreeConfig keys: {unknown}")
        return cls(**data)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Serialise to a JSON string; when ``path`` is given, also write it atomically."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            write_atomic(path, text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> FastTreeConfig:
        """Load from JSON text (a ``str``) or from a file (a ``pathlib.Path`` or other path-like)."""
        if isinstance(text_or_path, os.PathLike):
            text = Path(text_or_path).read_text()
        elif isinstance(text_or_path, str):
            text = text_or_path
        else:
            raise ValueError(f"from_json takes JSON text or a path, got {type(text_or_path).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"FastTreeConfig JSON is malformed: {exc}") from None
        return cls.from_dict(data)
