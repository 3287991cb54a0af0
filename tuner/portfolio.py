"""Choose a bucket's portfolio and fit its selector together, on the latency model's predictions.

The input is a :class:`SelectionProblem`: for every tuning tree, its features
(:func:`fasttree.tree_features`), its family, and the predicted latency of every candidate config
relative to the defaults' (column 0 is the defaults, all ones). The output is a
:class:`fasttree.Portfolio`: member 0 the defaults, at most a few more, and a shallow decision
tree (:class:`fasttree.Selector`) that names a member per tree.

The objective is the mean over families of each family's weighted mean ratio (every family counts
the same, whatever its number of trees), so the defaults score exactly 1. A leaf of the selector
leaves the defaults only when its trees are predicted at least ``margin`` faster with the chosen
member, no family present in the leaf is predicted slower than the defaults (``family_loss``), and
no single tree is predicted more than ``tree_loss`` slower: the latency model's errors are a few
percent, so a predicted gain smaller than that is no reason to switch (:class:`SelectionRules`).

The tree is grown greedily: a node splits on the feature and threshold (at quantiles of the
node's trees) that most lower the summed cost of its two leaves, while both keep ``min_leaf``
trees and the depth stays within ``max_depth``. Members are added greedily too: each round fits
the selector with every remaining candidate added and keeps the one that lowers the objective
most, until ``max_members`` or no candidate gains ``min_gain``. (scikit-learn's trees fit a
label or a value per leaf, not a choice among columns of costs under these constraints, hence
this small fit of our own.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fasttree.config import FastTreeConfig
from fasttree.portfolio import TREE_FEATURES, Portfolio, Selector, tree_features
from fasttree.validation import check_int, check_number

from .objective import family_of

__all__ = [
    "DESIGNS",
    "PortfolioChoice",
    "PortfolioResult",
    "SelectionProblem",
    "SelectionRules",
    "build_portfolio",
    "choose_portfolio",
    "fit_selector",
    "score",
    "selection_problem",
]

#: Thresholds tried per feature and node (quantiles of the node's distinct values).
_THRESHOLDS = 32


@dataclass(frozen=True)
class SelectionProblem:
    """Predicted latencies of candidate configs on a bucket's tuning trees.

    Attributes
    ----------
    features : ndarray, float64 [n_trees, len(TREE_FEATURES)]
    ratio : ndarray, float64 [n_trees, n_candidates]
        Predicted latency over the defaults' (column 0: the defaults, ones).
    family : ndarray, int64 [n_trees]
        Index of each tree's family in ``family_names``.
    family_names : tuple of str
    weight : ndarray, float64 [n_trees]
        Derived: each family's trees share ``1 / n_families`` equally.
    """

    features: np.ndarray
    ratio: np.ndarray
    family: np.ndarray
    family_names: tuple[str, ...]
    weight: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        features = np.asarray(self.features, dtype=np.float64)
        ratio = np.asarray(self.ratio, dtype=np.float64)
        family = np.asarray(self.family, dtype=np.int64)
        n = ratio.shape[0]
        if ratio.ndim != 2 or ratio.shape[1] < 1 or n < 1:
            raise ValueError(f"ratio must be [n_trees >= 1, n_candidates >= 1], got shape {ratio.shape}")
        if features.shape != (n, len(TREE_FEATURES)):
            raise ValueError(f"features must be [{n}, {len(TREE_FEATURES)}], got {features.shape}")
        if family.shape != (n,) or family.min() < 0 or family.max() >= len(self.family_names):
            raise ValueError("family must index family_names, one entry per tree")
        if not np.all(np.isfinite(ratio)) or not np.all(ratio > 0) or not np.allclose(ratio[:, 0], 1.0):
            raise ValueError("ratio must be finite and positive, its column 0 (the defaults) ones")
        counts = np.bincount(family, minlength=len(self.family_names)).astype(np.float64)
        present = np.count_nonzero(counts)
        weight = 1.0 / (present * counts[family])
        for name, value in (("features", features), ("ratio", ratio), ("family", family), ("weight", weight)):
            object.__setattr__(self, name, value)

    @property
    def n_candidates(self) -> int:
        return int(self.ratio.shape[1])


@dataclass(frozen=True)
class SelectionRules:
    """When a leaf may leave the defaults, and how large the selector may grow.

    Parameters
    ----------
    margin : float
        Least predicted gain (share of the leaf's weighted time) to pick another member.
    family_loss : float
        Largest predicted loss of any family present in the leaf (0: none may lose).
    tree_loss : float
        Largest predicted loss of any single tree in the leaf.
    max_depth : int
        Deepest split.
    min_leaf : int
        Fewest trees in a leaf.
    """

    margin: float = 0.05
    family_loss: float = 0.0
    tree_loss: float = 0.0
    max_depth: int = 2
    min_leaf: int = 8

    def __post_init__(self) -> None:
        for name in ("margin", "family_loss", "tree_loss"):
            object.__setattr__(self, name, check_number(name, getattr(self, name), minimum=0.0, maximum=1.0))
        object.__setattr__(self, "max_depth", check_int("max_depth", self.max_depth, minimum=0, maximum=8))
        object.__setattr__(self, "min_leaf", check_int("min_leaf", self.min_leaf, minimum=1))


def _leaf(
    problem: SelectionProblem, idx: np.ndarray, members: Sequence[int], rules: SelectionRules
) -> tuple[int, float]:
    """``(position in members, cost)`` of a leaf holding trees ``idx``: the cheapest member that
    passes the rules, else the defaults (position 0)."""
    w = problem.weight[idx]
    r = problem.ratio[np.ix_(idx, members)]
    totals = w @ r
    base = float(totals[0])
    for pos in np.argsort(totals, kind="stable"):
        if pos == 0 or totals[pos] > (1.0 - rules.margin) * base:
            break
        col = r[:, pos]
        if col.max() > 1.0 + rules.tree_loss:
            continue
        fam = problem.family[idx]
        fam_w = np.bincount(fam, weights=w)
        fam_t = np.bincount(fam, weights=w * col)
        present = fam_w > 0
        if np.any(fam_t[present] > (1.0 + rules.family_loss) * fam_w[present]):
            continue
        return int(pos), float(totals[pos])
    return 0, base


@dataclass
class _Node:
    feature: int = -1
    threshold: float = 0.0
    left: _Node | None = None
    right: _Node | None = None
    member: int = 0


def _grow(problem: SelectionProblem, idx: np.ndarray, members: Sequence[int], rules: SelectionRules, depth: int):
    """The subtree over trees ``idx`` and its cost."""
    member, cost = _leaf(problem, idx, members, rules)
    node = _Node(member=member)
    if depth >= rules.max_depth or idx.size < 2 * rules.min_leaf:
        return node, cost
    best = None
    x = problem.features[idx]
    for f in range(x.shape[1]):
        values = np.unique(x[:, f])
        if values.size < 2:
            continue
        mids = (values[:-1] + values[1:]) / 2
        if mids.size > _THRESHOLDS:
            mids = np.unique(np.quantile(mids, np.linspace(0, 1, _THRESHOLDS)))
        for t in mids:
            go_left = x[:, f] <= t
            n_left = int(np.count_nonzero(go_left))
            if n_left < rules.min_leaf or idx.size - n_left < rules.min_leaf:
                continue
            left_cost = _leaf(problem, idx[go_left], members, rules)[1]
            split_cost = left_cost + _leaf(problem, idx[~go_left], members, rules)[1]
            if best is None or split_cost < best[0] - 1e-12:
                best = (split_cost, f, float(t), go_left)
    if best is None or best[0] >= cost - 1e-9:
        return node, cost
    _, f, t, go_left = best
    left, left_cost = _grow(problem, idx[go_left], members, rules, depth + 1)
    right, right_cost = _grow(problem, idx[~go_left], members, rules, depth + 1)
    if left_cost + right_cost >= cost - 1e-9:
        return node, cost
    return _Node(feature=f, threshold=t, left=left, right=right), left_cost + right_cost


def _flatten(root: _Node) -> Selector:
    """The node arrays of a grown tree, root first, children after their parent."""
    order = [root]
    arrays: dict[str, list] = {"feature": [], "threshold": [], "left": [], "right": [], "member": []}
    i = 0
    while i < len(order):
        node = order[i]
        arrays["feature"].append(node.feature)
        arrays["threshold"].append(node.threshold)
        arrays["member"].append(node.member)
        if node.feature >= 0:
            arrays["left"].append(len(order))
            order.append(node.left)
            arrays["right"].append(len(order))
            order.append(node.right)
        else:
            arrays["left"].append(-1)
            arrays["right"].append(-1)
        i += 1
    return Selector(**{k: tuple(v) for k, v in arrays.items()})


def fit_selector(
    problem: SelectionProblem, members: Sequence[int], rules: SelectionRules = SelectionRules()
) -> tuple[Selector, float]:
    """The selector over ``members`` (candidate columns, the defaults first) and its objective.

    Returns
    -------
    selector : Selector
        Its leaves name positions in ``members``.
    objective : float
        Mean over families of the picked members' weighted mean ratio (the defaults: 1).
    """
    if not members or members[0] != 0:
        raise ValueError("members must start with the defaults (candidate 0)")
    root, cost = _grow(problem, np.arange(problem.ratio.shape[0]), list(members), rules, 0)
    return _flatten(root), cost


def score(problem: SelectionProblem, members: Sequence[int], selector: Selector) -> dict[str, object]:
    """What ``selector`` over ``members`` picks on ``problem``'s trees, and the predicted ratios.

    Returns
    -------
    dict
        ``objective`` (mean of the family ratios), ``families`` (name -> weighted mean ratio of its
        trees), ``worst_tree`` (largest picked ratio), ``picks`` (trees per member position) and
        ``regret`` (objective of the picks over that of the best member per tree, minus 1).
    """
    pos = np.array([selector.member_of(x) for x in problem.features], dtype=np.int64)
    cols = np.asarray(members, dtype=np.int64)[pos]
    picked = problem.ratio[np.arange(cols.size), cols]
    best = problem.ratio[:, list(members)].min(axis=1)
    fam_w = np.bincount(problem.family, weights=problem.weight, minlength=len(problem.family_names))
    fam_t = np.bincount(problem.family, weights=problem.weight * picked, minlength=len(problem.family_names))
    families = {n: float(fam_t[i] / fam_w[i]) for i, n in enumerate(problem.family_names) if fam_w[i] > 0}
    objective = float(problem.weight @ picked)
    return {
        "objective": objective,
        "families": families,
        "worst_tree": float(picked.max()),
        "picks": np.bincount(pos, minlength=len(members)).tolist(),
        "regret": objective / float(problem.weight @ best) - 1.0,
    }


@dataclass(frozen=True)
class PortfolioChoice:
    """A chosen portfolio: candidate columns (the defaults first), the selector, its objective."""

    members: tuple[int, ...]
    selector: Selector
    objective: float


def choose_portfolio(
    problem: SelectionProblem,
    rules: SelectionRules = SelectionRules(),
    *,
    max_members: int = 4,
    min_gain: float = 0.002,
) -> PortfolioChoice:
    """Add candidates to the defaults greedily, each round keeping the one whose fitted selector
    lowers the objective most, while it gains at least ``min_gain`` and the portfolio has fewer
    than ``max_members`` members."""
    max_members = check_int("max_members", max_members, minimum=1)
    members = [0]
    selector, objective = fit_selector(problem, members, rules)
    while len(members) < max_members:
        best = None
        for c in range(1, problem.n_candidates):
            if c in members:
                continue
            sel, obj = fit_selector(problem, [*members, c], rules)
            if best is None or obj < best[2] - 1e-12:
                best = (c, sel, obj)
        if best is None or best[2] > objective - min_gain:
            break
        members.append(best[0])
        selector, objective = best[1], best[2]
    used = sorted({selector.member[i] for i, f in enumerate(selector.feature) if f < 0} | {0})
    if used != list(range(len(members))):  # drop members no leaf names, renumbering the leaves
        keep = [members[p] for p in used]
        selector, objective = fit_selector(problem, keep, rules)
        members = keep
    return PortfolioChoice(members=tuple(members), selector=selector, objective=objective)


def selection_problem(objective, configs: Sequence[FastTreeConfig]) -> SelectionProblem:
    """The :class:`SelectionProblem` of ``configs`` (the defaults first) on ``objective``'s steps:
    every config planned and predicted on every step (:meth:`LatencyObjective.evaluate`)."""
    if not configs or configs[0] != FastTreeConfig():
        raise ValueError("the candidate configs must start with FastTreeConfig()")
    base = objective.defaults.step_us
    ratio = np.column_stack([np.ones_like(base)] + [objective.evaluate(c).step_us / base for c in configs[1:]])
    features = np.stack([tree_features(s.tree) for s in objective.steps])
    families = [family_of(s) for s in objective.steps]
    names = tuple(sorted(set(families)))
    index = {name: i for i, name in enumerate(names)}
    return SelectionProblem(features, ratio, np.array([index[f] for f in families]), names)


#: Selection rules tried (:func:`build_portfolio`): margin, members at most, selector depth, fewest
#: trees per leaf. On the H200 model's predictions for GQA 4, a leaf that let any training tree be
#: predicted slower (a 3% tolerance) left 2-5% of the validation trees 5-84% slower; with none
#: allowed, no validation tree was predicted slower and the gain on validation was about the same.
DESIGNS = tuple((m, k, d, n) for m in (0.05, 0.10) for k in (2, 3) for d in (2, 3) for n in (8, 16))
#: A validation tree may be predicted at most this much slower than with the defaults.
VALID_TREE_LOSS = 0.02


@dataclass(frozen=True)
class PortfolioResult:
    """A bucket's tuned portfolio and how it scored.

    Attributes
    ----------
    portfolio : Portfolio
    rules : SelectionRules
        The rules it was fitted with (chosen on the validation steps).
    train, valid : dict
        :func:`score` of the portfolio on the tuning and the validation steps (``valid``: None
        without validation steps).
    tried : list of dict
        Per design tried: margin, members at most, depth, the members chosen and both scores.
    """

    portfolio: Portfolio
    rules: SelectionRules
    train: dict
    valid: dict | None
    tried: list = field(default_factory=list)


def build_portfolio(
    configs: Sequence[FastTreeConfig],
    train: SelectionProblem,
    valid: SelectionProblem | None = None,
    *,
    runtime: bool = False,
    designs: Sequence[tuple[float, int, int, int]] = DESIGNS,
    base_rules: SelectionRules = SelectionRules(),
) -> PortfolioResult:
    """Choose the portfolio and fit its selector on ``train`` under every design (margin, members at
    most, depth, fewest trees per leaf), and keep the design whose portfolio scores best on
    ``valid`` among those that leave no validation family predicted slower than the defaults and no
    validation tree more than :data:`VALID_TREE_LOSS` slower; ties go to the simpler design. None
    passes: the defaults alone. Without ``valid``: the most cautious design (largest margin, fewest
    members, shallowest, largest leaves)."""
    tried = []
    best = None
    for margin, members, depth, min_leaf in designs:
        rules = replace(base_rules, margin=margin, max_depth=depth, min_leaf=min_leaf)
        choice = choose_portfolio(train, rules, max_members=members)
        train_score = score(train, choice.members, choice.selector)
        valid_score = None if valid is None else score(valid, choice.members, choice.selector)
        tried.append(
            {"margin": margin, "max_members": members, "max_depth": depth, "min_leaf": min_leaf,
             "members": len(choice.members), "train": train_score, "valid": valid_score}
        )  # fmt: skip
        if valid_score is not None:
            ok = all(r <= 1.0 + rules.family_loss for r in valid_score["families"].values())
            ok = ok and valid_score["worst_tree"] <= 1.0 + VALID_TREE_LOSS
            key = (round(valid_score["objective"], 6), members, depth, -min_leaf, -margin)
        else:
            ok, key = True, (-margin, members, depth, -min_leaf)
        if ok and (best is None or key < best[0]):
            best = (key, rules, choice, train_score, valid_score)
    if best is None:
        rules = replace(base_rules, margin=max(d[0] for d in designs))
        choice = PortfolioChoice(members=(0,), selector=Selector(), objective=1.0)
        defaults_valid = None if valid is None else score(valid, (0,), choice.selector)
        best = (None, rules, choice, score(train, (0,), choice.selector), defaults_valid)
    _, rules, choice, train_score, valid_score = best
    members = tuple(configs[c] for c in choice.members)
    portfolio = Portfolio(members=members, selector=choice.selector, runtime=runtime)
    return PortfolioResult(portfolio=portfolio, rules=rules, train=train_score, valid=valid_score, tried=tried)
