"""Per-tree config selection: a small portfolio of configs and a selector that picks one per tree.

A tuned export holds, per GPU and bucket, a :class:`Portfolio`: a few :class:`FastTreeConfig`
members, the first always ``FastTreeConfig()``, and a :class:`Selector`, a shallow decision tree
over cheap features of the tree (:func:`tree_features`) whose leaves name a member. The tuner
fits both together so that the portfolio leaves the defaults only where the latency model
predicts a margin (``fasttree.tuner.portfolio``); serving code calls :meth:`Portfolio.select` once
per tree (a few microseconds, deterministic), or passes the portfolio where a config goes
(:func:`fasttree.plan`, :class:`fasttree.runtime.TreeAttentionRuntime`).

Numpy only: the serving path imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import FastTreeConfig
from .tree import KVTree
from .validation import check_int, is_int, is_number

__all__ = ["LAUNCH_FIELDS", "TREE_FEATURES", "Portfolio", "Selector", "tree_features"]

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
    """

    members: tuple[FastTreeConfig, ...] = (FastTreeConfig(),)
    selector: Selector = field(default_factory=Selector)
    runtime: bool = False

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

    def select(self, tree: KVTree) -> FastTreeConfig:
        """The config to plan ``tree`` with."""
        if len(self.members) == 1:
            return self.members[0]
        return self.members[self.selector.member_of(tree_features(tree))]

    def member_of(self, tree: KVTree) -> int:
        """The index of the member :meth:`select` gives ``tree``."""
        return 0 if len(self.members) == 1 else self.selector.member_of(tree_features(tree))

    @property
    def launch_config(self) -> FastTreeConfig:
        """The member whose launch fields a runtime is built with (member 0)."""
        return self.members[0]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON."""
        return {
            "members": [m.to_dict() for m in self.members],
            "selector": self.selector.to_dict(),
            "runtime": self.runtime,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Portfolio:
        """Build from :meth:`to_dict` (validated in full)."""
        if not isinstance(data, Mapping) or set(data) != {"members", "selector", "runtime"}:
            raise ValueError("a portfolio is a JSON object with the fields members, selector and runtime")
        if not isinstance(data["members"], list):
            raise ValueError("portfolio.members must be a list")
        check_int("portfolio.members count", len(data["members"]), minimum=1, maximum=MAX_MEMBERS)
        if not isinstance(data["runtime"], bool):
            raise ValueError("portfolio.runtime must be a bool")
        members = tuple(FastTreeConfig.from_dict(m) for m in data["members"])
        return cls(members=members, selector=Selector.from_dict(data["selector"]), runtime=data["runtime"])
