"""Per-tree config selection: a small portfolio of configs and a selector that picks one per tree.

A tuned export holds, per GPU and bucket, a :class:`Portfolio`: a few :class:`FastTreeConfig`
members, the first always ``FastTreeConfig()``, and a :class:`Selector`, a shallow decision tree
over cheap features of the tree (:func:`tree_features`) whose leaves name a member. The tuner
fits both together so that the portfolio leaves the defaults only where the latency model
predicts a margin (``fasttree.tuner.portfolio``); serving code calls :meth:`Portfolio.select` once
per tree (a few microseconds, deterministic), or passes the portfolio where a config goes
(:func:`fasttree.plan`, :class:`fasttree.runtime.TreeAttentionRuntime`).

A leaf that names another member than the defaults carries the region of its evidence
(:class:`LeafRegion`): the box of the features of the trees on which that member was measured
(``fasttree-tune confirm``, ``refine``) or predicted with a calibrated margin (``fasttree-tune
run``) to beat the defaults, and the head layouts (KV heads, GQA ratio) those trees ran at. The
portfolio serves the leaf's member only to a tree inside that box, at one of those layouts; every
other tree gets member 0 (:meth:`Portfolio.member_at` decides, for :meth:`Portfolio.select` and
:meth:`Portfolio.member_of`). The layout a portfolio serves is bound once
(:meth:`Portfolio.for_heads`; :meth:`fasttree.export.ConfigExport.lookup` does it).

Numpy only: the serving path imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .config import FastTreeConfig
from .tree import KVTree
from .validation import check_int, is_int, is_number

__all__ = [
    "EVIDENCE_KINDS",
    "LAUNCH_FIELDS",
    "TREE_FEATURES",
    "LeafRegion",
    "Portfolio",
    "Selector",
    "head_layout",
    "tree_features",
]

#: Features of a tree a selector may split on, in the order of :func:`tree_features`.
TREE_FEATURES = (
    "log2_queries",  # decode queries
    "log2_nodes",  # KV nodes
    "depth",  # deepest query node (roots: 0)
    "log2_tokens",  # KV tokens in the tree
    "reads_per_token",  # tokens every query reads, over the tree's tokens (1: nothing shared)
    "log2_mean_context",  # mean tokens a query reads
    "log2_max_context",  # most tokens a query reads
    "private_share",  # share of the tokens only one query reads
)
#: Config fields that fix a runtime's launch shapes (its CUDA graphs): the members of a portfolio
#: served by the runtime must agree on them.
LAUNCH_FIELDS = ("q_tile_queries", "kv_tile", "num_warps", "num_stages")
#: Deepest selector the format accepts (a selector deeper than a few levels fits noise).
MAX_SELECTOR_DEPTH = 8
#: Most members of a portfolio.
MAX_MEMBERS = 16
#: How a leaf's evidence was gathered: GPU measurements of every member on the trees
#: (``fasttree-tune confirm``, ``refine``), or the latency model's predictions, whose gain had to
#: exceed the model's calibrated error (``fasttree-tune run`` and ``export``).
EVIDENCE_KINDS = ("measured", "predicted")
#: Most head layouts a region lists.
MAX_LAYOUTS = 64


def tree_features(tree: KVTree) -> np.ndarray:
    """The selector's features of ``tree`` (:data:`TREE_FEATURES`).

    Parameters
    ----------
    tree : KVTree

    Returns
    -------
    ndarray, float64 [len(TREE_FEATURES)]
    """
    n_q = tree.n_queries
    tokens = max(1, tree.num_tokens)
    context = tree.path_lengths[tree.query_nodes]
    reads = int(np.add.reduce(context))
    private = int(np.add.reduce(tree.lengths[tree.subtree_queries == 1]))
    return np.array(
        (
            math.log2(n_q),
            math.log2(tree.n_nodes),
            float(tree.depth[tree.query_nodes].max()),
            math.log2(tokens),
            reads / tokens,
            math.log2(max(1.0, reads / n_q)),
            math.log2(max(1, int(context.max()))),
            private / tokens,
        ),
        dtype=np.float64,
    )


@dataclass(frozen=True)
class Selector:
    """A binary decision tree over :data:`TREE_FEATURES` whose leaves name a portfolio member.

    Node ``i`` is a leaf when ``feature[i] < 0`` and then picks member ``member[i]``; otherwise a
    tree goes to ``left[i]`` when its feature ``feature[i]`` is ``<= threshold[i]``, else to
    ``right[i]``. Node 0 is the root; children come after their parent.

    Attributes
    ----------
    feature : tuple of int
    threshold : tuple of float
    left, right : tuple of int
    member : tuple of int
    """

    feature: tuple[int, ...] = (-1,)
    threshold: tuple[float, ...] = (0.0,)
    left: tuple[int, ...] = (-1,)
    right: tuple[int, ...] = (-1,)
    member: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        arrays = {name: tuple(getattr(self, name)) for name in ("feature", "threshold", "left", "right", "member")}
        n = len(arrays["feature"])
        if n < 1 or any(len(a) != n for a in arrays.values()):
            raise ValueError(f"a selector needs equally long, non-empty node arrays, got lengths {arrays}")
        for name in ("feature", "left", "right", "member"):
            if not all(is_int(v) for v in arrays[name]):
                raise ValueError(f"selector.{name} must hold integers")
            arrays[name] = tuple(int(v) for v in arrays[name])
        if min(arrays["member"]) < 0:
            raise ValueError(f"selector.member must hold member indices >= 0, got {arrays['member']}")
        if not all(is_number(v, finite=True) for v in arrays["threshold"]):
            raise ValueError("selector.threshold must hold finite numbers")
        arrays["threshold"] = tuple(float(v) for v in arrays["threshold"])
        depth = [0] * n
        for i in range(n):
            f = arrays["feature"][i]
            if f < 0:
                continue
            if f >= len(TREE_FEATURES):
                raise ValueError(f"selector node {i} splits on feature {f}; there are {len(TREE_FEATURES)}")
            for child in (arrays["left"][i], arrays["right"][i]):
                if not i < child < n:  # children after their parent: no cycle, every node reached once
                    raise ValueError(f"selector node {i} has child {child} (children come after their parent)")
                depth[child] = depth[i] + 1
        if max(depth) > MAX_SELECTOR_DEPTH:
            raise ValueError(f"the selector is {max(depth)} levels deep, more than {MAX_SELECTOR_DEPTH}")
        for name, value in arrays.items():
            object.__setattr__(self, name, value)

    def leaf_of(self, x: Sequence[float]) -> int:
        """The leaf node a tree with features ``x`` reaches."""
        i = 0
        feature, threshold, left, right = self.feature, self.threshold, self.left, self.right
        while feature[i] >= 0:
            i = left[i] if x[feature[i]] <= threshold[i] else right[i]
        return i

    def member_of(self, x: Sequence[float]) -> int:
        """The member a tree with features ``x`` gets."""
        return self.member[self.leaf_of(x)]

    @property
    def n_members(self) -> int:
        """One more than the largest member a leaf names."""
        return 1 + max(m for f, m in zip(self.feature, self.member, strict=True) if f < 0)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (lists), with the feature names it was fitted for."""
        return {
            "features": list(TREE_FEATURES),
            "feature": list(self.feature),
            "threshold": list(self.threshold),
            "left": list(self.left),
            "right": list(self.right),
            "member": list(self.member),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Selector:
        """Build from :meth:`to_dict`; a selector fitted on other features is refused."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a selector must be a JSON object, got {type(data).__name__}")
        expected = {"features", "feature", "threshold", "left", "right", "member"}
        if set(data) != expected:
            raise ValueError(f"a selector has the fields {sorted(expected)}, got {sorted(data)}")
        if list(data["features"]) != list(TREE_FEATURES):
            raise ValueError(
                f"the selector was fitted on features {data['features']}, this version has {TREE_FEATURES}"
            )
        for name in expected - {"features"}:
            if not isinstance(data[name], list):
                raise ValueError(f"selector.{name} must be a list")
        return cls(**{k: tuple(v) for k, v in data.items() if k != "features"})


@dataclass(frozen=True)
class LeafRegion:
    """Where a selector leaf's member was shown to beat the defaults.

    Attributes
    ----------
    lo, hi : tuple of float
        Per feature of :data:`TREE_FEATURES`, the least and greatest value over the evidence trees
        that reach the leaf (``lo <= hi``): the box a tree's features must lie in.
    layouts : tuple of (int, int)
        The head layouts of those trees, ``(num_kv_heads, group_size)`` pairs (sorted, distinct):
        the number of KV heads fixes the kernels' grid width, so a tree at another layout is outside.
    trees : int
        Evidence trees (>= 1).
    evidence : str
        One of :data:`EVIDENCE_KINDS`.
    """

    lo: tuple[float, ...]
    hi: tuple[float, ...]
    layouts: tuple[tuple[int, int], ...]
    trees: int
    evidence: str

    def __post_init__(self) -> None:
        n = len(TREE_FEATURES)
        bounds = []
        for name in ("lo", "hi"):
            values = tuple(getattr(self, name))
            if len(values) != n or not all(is_number(v, finite=True) for v in values):
                raise ValueError(f"region.{name} must hold {n} finite numbers (one per selector feature)")
            bounds.append(tuple(float(v) for v in values))
        lo, hi = bounds
        if any(a > b for a, b in zip(lo, hi, strict=True)):
            raise ValueError("region.lo must not exceed region.hi")
        layouts = tuple(sorted({_layout_pair("region.layouts", pair) for pair in self.layouts}))
        if not 1 <= len(layouts) <= MAX_LAYOUTS:
            raise ValueError(f"region.layouts must list 1 to {MAX_LAYOUTS} head layouts, got {len(layouts)}")
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", hi)
        object.__setattr__(self, "layouts", layouts)
        object.__setattr__(self, "trees", check_int("region.trees", self.trees, minimum=1))
        if self.evidence not in EVIDENCE_KINDS:
            raise ValueError(f"region.evidence must be one of {list(EVIDENCE_KINDS)}, got {self.evidence!r}")

    def contains(self, x: Sequence[float]) -> bool:
        """Whether features ``x`` (:func:`tree_features`) lie in the box (bounds included)."""
        return all(a <= v <= b for a, v, b in zip(self.lo, x, self.hi, strict=True))

    @classmethod
    def of_trees(cls, features: Any, layouts: Sequence[tuple[int, int]], evidence: str) -> LeafRegion:
        """The region of evidence trees: the box of their features, the set of their layouts.

        Parameters
        ----------
        features : array-like, float [n_trees, len(TREE_FEATURES)]
        layouts : sequence of (int, int)
            Each tree's ``(num_kv_heads, group_size)``.
        evidence : str
            One of :data:`EVIDENCE_KINDS`.
        """
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] < 1 or x.shape[0] != len(layouts):
            raise ValueError(f"a region needs one layout per tree and at least one tree, got {x.shape} features")
        return cls(
            lo=tuple(x.min(axis=0).tolist()), hi=tuple(x.max(axis=0).tolist()),
            layouts=tuple(tuple(p) for p in layouts), trees=x.shape[0], evidence=evidence,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (lists)."""
        return {
            "evidence": self.evidence,
            "hi": list(self.hi),
            "layouts": [list(p) for p in self.layouts],
            "lo": list(self.lo),
            "trees": self.trees,
        }

    @classmethod
    def from_dict(cls, data: Any) -> LeafRegion:
        """Build from :meth:`to_dict` (validated in full)."""
        expected = {"evidence", "hi", "layouts", "lo", "trees"}
        if not isinstance(data, Mapping) or set(data) != expected:
            raise ValueError(f"a region is a JSON object with the fields {sorted(expected)}")
        for name in ("lo", "hi", "layouts"):
            if not isinstance(data[name], list):
                raise ValueError(f"region.{name} must be a list")
        return cls(lo=tuple(data["lo"]), hi=tuple(data["hi"]), layouts=tuple(data["layouts"]),
                   trees=data["trees"], evidence=data["evidence"])  # fmt: skip


def _layout_pair(where: str, pair: Any) -> tuple[int, int]:
    """A ``(num_kv_heads, group_size)`` pair of ints >= 1; ValueError naming ``where`` otherwise."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(is_int(v) and v >= 1 for v in pair):
        raise ValueError(f"{where} must hold (num_kv_heads, group_size) pairs of ints >= 1, got {pair!r}")
    return int(pair[0]), int(pair[1])


def head_layout(num_q_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """``(num_kv_heads, group_size)`` of a head count: the layout a :class:`LeafRegion` lists.

    Raises
    ------
    ValueError
        Unless both are ints >= 1 and ``num_q_heads`` is a multiple of ``num_kv_heads``.
    """
    hq = check_int("num_q_heads", num_q_heads, minimum=1)
    hkv = check_int("num_kv_heads", num_kv_heads, minimum=1)
    if hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    return hkv, hq // hkv


@dataclass(frozen=True)
class Portfolio:
    """Configs to serve one bucket with and the selector that picks one per tree.

    Parameters
    ----------
    members : sequence of FastTreeConfig
        Member 0 is ``FastTreeConfig()`` (a portfolio leaves the defaults only where it chose to);
        a one-member portfolio of another config is what an old (version 1) export holds.
    selector : Selector
        Names a member for every tree; the constant selector picks member 0.
    runtime : bool
        The portfolio serves :class:`fasttree.runtime.TreeAttentionRuntime`: its members then
        share the launch fields (:data:`LAUNCH_FIELDS`), which fix the runtime's CUDA graphs.
    regions : sequence of LeafRegion or None, optional
        Per selector node, the region of the evidence for the member its leaf names: a
        :class:`LeafRegion` for every leaf naming another member than 0, None for every other
        node. A tree then gets the leaf's member only inside the region, at one of its layouts,
        and member 0 elsewhere. None (the default; what an export of format 2 holds): no region
        recorded, the selector alone decides. A tuple of Nones becomes None (the same selection).
    layout : (int, int), optional
        The head layout ``(num_kv_heads, group_size)`` the portfolio serves (:meth:`for_heads`).
        With regions and no layout, every tree gets member 0 (no layout is known to be covered).

    Raises
    ------
    ValueError
        On invalid members, selector, regions or layout.
    """

    members: tuple[FastTreeConfig, ...] = (FastTreeConfig(),)
    selector: Selector = field(default_factory=Selector)
    runtime: bool = False
    regions: tuple[LeafRegion | None, ...] | None = None
    layout: tuple[int, int] | None = None
    #: Per node, the member a tree reaching it gets inside its region at :attr:`layout` (derived).
    _served: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        members = tuple(self.members)
        if not 1 <= len(members) <= MAX_MEMBERS:
            raise ValueError(f"a portfolio holds 1 to {MAX_MEMBERS} configs, got {len(members)}")
        if not all(isinstance(m, FastTreeConfig) for m in members):
            raise ValueError("portfolio members must be FastTreeConfig objects")
        if not isinstance(self.selector, Selector):
            raise ValueError(f"selector must be a Selector, got {type(self.selector).__name__}")
        if self.selector.n_members > len(members):
            raise ValueError(
                f"the selector names member {self.selector.n_members - 1}, the portfolio has {len(members)}"
            )
        if self.runtime:
            for i, m in enumerate(members[1:], 1):
                differ = [f for f in LAUNCH_FIELDS if getattr(m, f) != getattr(members[0], f)]
                if differ:
                    raise ValueError(f"runtime portfolio member {i} differs from member 0 in launch fields {differ}")
        object.__setattr__(self, "members", members)
        regions = self._checked_regions()
        object.__setattr__(self, "regions", regions)
        layout = None if self.layout is None else _layout_pair("layout", self.layout)
        object.__setattr__(self, "layout", layout)
        sel = self.selector
        if len(members) == 1:
            served = (0,) * len(sel.member)
        elif regions is None:
            served = sel.member
        else:
            served = tuple(
                m if r is not None and layout is not None and layout in r.layouts else 0
                for m, r in zip(sel.member, regions, strict=True)
            )
        object.__setattr__(self, "_served", served)

    def _checked_regions(self) -> tuple[LeafRegion | None, ...] | None:
        if self.regions is None:
            return None
        try:
            regions = tuple(self.regions)
        except TypeError:
            raise ValueError(f"regions must be a sequence, got {type(self.regions).__name__}") from None
        sel = self.selector
        if len(regions) != len(sel.feature):
            raise ValueError(f"regions must hold one item per selector node ({len(sel.feature)}), got {len(regions)}")
        for i, (f, m, r) in enumerate(zip(sel.feature, sel.member, regions, strict=True)):
            if r is not None and not isinstance(r, LeafRegion):
                raise ValueError(f"regions[{i}] must be a LeafRegion or None, got {type(r).__name__}")
            serves = f < 0 and m != 0 and len(self.members) > 1
            if serves and r is None:
                raise ValueError(f"selector leaf {i} names member {m} but has no region of evidence")
            if not serves and r is not None:
                raise ValueError(f"selector node {i} serves no member but the defaults: its region must be None")
        return None if all(r is None for r in regions) else regions

    def for_heads(self, num_q_heads: int, num_kv_heads: int) -> Portfolio:
        """The portfolio serving ``num_q_heads`` query heads over ``num_kv_heads`` KV heads.

        A leaf's member then goes only to trees at a layout its region lists. A portfolio without
        regions is returned as it is (the layout changes nothing there).

        Raises
        ------
        ValueError
            On head counts that are not ints >= 1 with ``num_q_heads`` a multiple of ``num_kv_heads``.
        """
        layout = head_layout(num_q_heads, num_kv_heads)
        if self.regions is None or layout == self.layout:
            return self
        return replace(self, layout=layout)

    def member_at(self, x: Sequence[float], layout: tuple[int, int] | None = None) -> int:
        """The member a tree with features ``x`` (:func:`tree_features`) gets: its selector leaf's
        member when the leaf's region covers ``x`` and the layout, else 0.

        Parameters
        ----------
        x : sequence of float
        layout : (int, int), optional
            ``(num_kv_heads, group_size)``; default: the bound :attr:`layout`.
        """
        if len(self.members) == 1:
            return 0
        leaf = self.selector.leaf_of(x)
        if self.regions is None:
            return self.selector.member[leaf]
        region = self.regions[leaf]
        if layout is None:
            member = self._served[leaf]
        else:
            member = self.selector.member[leaf] if region is not None and tuple(layout) in region.layouts else 0
        if member and not region.contains(x.tolist() if isinstance(x, np.ndarray) else x):
            return 0
        return member

    def select(self, tree: KVTree, layout: tuple[int, int] | None = None) -> FastTreeConfig:
        """The config to plan ``tree`` with (:meth:`member_at` of its features; ``layout``: the
        ``(num_kv_heads, group_size)`` it runs at, default the bound :attr:`layout`)."""
        if len(self.members) == 1:
            return self.members[0]
        return self.members[self.member_at(tree_features(tree), layout)]

    def member_of(self, tree: KVTree) -> int:
        """The index of the member :meth:`select` gives ``tree``."""
        return 0 if len(self.members) == 1 else self.member_at(tree_features(tree))

    @property
    def launch_config(self) -> FastTreeConfig:
        """The member whose launch fields a runtime is built with (member 0)."""
        return self.members[0]

    @property
    def unbounded_leaves(self) -> tuple[int, ...]:
        """Leaves that name a member other than 0 with no region recorded (a portfolio without
        regions, e.g. of an export of format 2): the selector alone sends trees to them."""
        if self.regions is not None or len(self.members) == 1:
            return ()
        return tuple(i for i, (f, m) in enumerate(zip(self.selector.feature, self.selector.member, strict=True))
                     if f < 0 and m != 0)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (the bound :attr:`layout` is not part of it)."""
        return {
            "members": [m.to_dict() for m in self.members],
            "regions": None if self.regions is None else [None if r is None else r.to_dict() for r in self.regions],
            "runtime": self.runtime,
            "selector": self.selector.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Portfolio:
        """Build from :meth:`to_dict` (validated in full)."""
        if not isinstance(data, Mapping) or set(data) != {"members", "regions", "selector", "runtime"}:
            raise ValueError("a portfolio is a JSON object with the fields members, regions, selector and runtime")
        if not isinstance(data["members"], list):
            raise ValueError("portfolio.members must be a list")
        check_int("portfolio.members count", len(data["members"]), minimum=1, maximum=MAX_MEMBERS)
        if not isinstance(data["runtime"], bool):
            raise ValueError("portfolio.runtime must be a bool")
        raw = data["regions"]
        if raw is not None and not isinstance(raw, list):
            raise ValueError("portfolio.regions must be a list or null")
        regions = None
        if raw is not None:
            items = []
            for i, r in enumerate(raw):
                try:
                    items.append(None if r is None else LeafRegion.from_dict(r))
                except ValueError as exc:
                    raise ValueError(f"portfolio.regions[{i}]: {exc}") from None
            regions = tuple(items)
        members = tuple(FastTreeConfig.from_dict(m) for m in data["members"])
        return cls(members=members, selector=Selector.from_dict(data["selector"]), runtime=data["runtime"],
                   regions=regions)  # fmt: skip
