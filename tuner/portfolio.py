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

Last, :func:`fence_portfolio` keeps a leaf's member only where the predictions are evidence enough:
on the validation trees that reach the leaf (the tuning trees without validation steps), at least
:data:`EVIDENCE_MIN_TREES` of them, none predicted slower than with the defaults, and their
predicted gain larger than the margin calibrated from the model's held-out errors for the bucket
(:mod:`fasttree.costmodel.calibration`); the kept leaf records the region of those trees (feature
box and head layouts), so the export serves its member only to trees like them. Other leaves serve
the defaults; the members stay in the portfolio as candidates ``fasttree-tune confirm`` may switch
on from GPU measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fasttree.config import FastTreeConfig
from fasttree.portfolio import TREE_FEATURES, LeafRegion, Portfolio, Selector, head_layout, tree_features
from fasttree.validation import check_int, check_number

from .objective import family_of

__all__ = [
    "DESIGNS",
    "EVIDENCE_MIN_TREES",
    "PortfolioChoice",
    "PortfolioResult",
    "SelectionProblem",
    "SelectionRules",
    "build_portfolio",
    "choose_portfolio",
    "fence_portfolio",
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
    layouts : ndarray, int64 [n_trees, 2], optional
        Each tree's head layout ``(num_kv_heads, group_size)`` (:func:`fasttree.portfolio.head_layout`):
        what a fenced leaf's region lists. None when unknown.
    weight : ndarray, float64 [n_trees]
        Derived: each family's trees share ``1 / n_families`` equally.
    """

    features: np.ndarray
    ratio: np.ndarray
    family: np.ndarray
    family_names: tuple[str, ...]
    layouts: np.ndarray | None = None
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
        if self.layouts is not None:
            layouts = np.asarray(self.layouts, dtype=np.int64)
            if layouts.shape != (n, 2) or layouts.min() < 1:
                raise ValueError(f"layouts must be [{n}, 2] ints >= 1 (num_kv_heads, group_size), got {layouts.shape}")
            object.__setattr__(self, "layouts", layouts)
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


def score(
    problem: SelectionProblem, members: Sequence[int], selector: Selector, *, portfolio: Portfolio | None = None
) -> dict[str, object]:
    """What ``selector`` over ``members`` picks on ``problem``'s trees, and the predicted ratios.

    With ``portfolio`` (whose selector is ``selector``), the picks are what it serves each tree at
    the tree's layout (:meth:`fasttree.Portfolio.member_at`: the defaults outside a leaf's region);
    ``problem`` then needs ``layouts``.

    Returns
    -------
    dict
        ``objective`` (mean of the family ratios), ``families`` (name -> weighted mean ratio of its
        trees), ``worst_tree`` (largest picked ratio), ``picks`` (trees per member position) and
        ``regret`` (objective of the picks over that of the best member per tree, minus 1).
    """
    if portfolio is None:
        pos = np.array([selector.member_of(x) for x in problem.features], dtype=np.int64)
    else:
        if problem.layouts is None:
            raise ValueError("scoring a portfolio's picks needs the trees' layouts")
        layouts = [tuple(lay) for lay in problem.layouts.tolist()]
        pos = np.array([portfolio.member_at(x, lay) for x, lay in zip(problem.features, layouts, strict=True)])
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
    layouts = np.array([head_layout(s.num_q_heads, s.num_kv_heads) for s in objective.steps], dtype=np.int64)
    return SelectionProblem(features, ratio, np.array([index[f] for f in families]), names, layouts)


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
    columns : tuple of int
        The candidate column (of the selection problems) of every member.
    evidence : dict or None
        What :func:`fence_portfolio` decided (None before it ran): the margin, the trees it judged
        on and, per leaf, the model's pick, the member served and the predicted gain.
    """

    portfolio: Portfolio
    rules: SelectionRules
    train: dict
    valid: dict | None
    tried: list = field(default_factory=list)
    columns: tuple[int, ...] = ()
    evidence: dict | None = None


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
    return PortfolioResult(
        portfolio=portfolio, rules=rules, train=train_score, valid=valid_score, tried=tried,
        columns=tuple(choice.members),
    )  # fmt: skip


#: Fewest evidence trees a leaf needs to leave the defaults in a model-only export (as ``fasttree-tune
#: confirm`` asks of measured trees).
EVIDENCE_MIN_TREES = 4


def fence_portfolio(
    result: PortfolioResult,
    train: SelectionProblem,
    valid: SelectionProblem | None,
    margin: float | None,
    *,
    min_trees: int = EVIDENCE_MIN_TREES,
) -> PortfolioResult:
    """Keep a leaf's member only where the predictions are evidence enough, fenced by their region.

    The evidence trees are ``valid``'s (``train``'s without it). A leaf naming member ``m != 0``
    keeps it when at least ``min_trees`` evidence trees reach it, none is predicted slower with
    ``m`` than with the defaults, and their predicted gain (one minus their weighted mean ratio)
    exceeds ``margin``; it then records the region of those trees (feature box, head layouts,
    evidence ``"predicted"``). Every other leaf serves the defaults. No margin (None: the model's
    error is unknown for this bucket) keeps no leaf. The members stay (candidates ``fasttree-tune
    confirm`` may switch on); the scores are recomputed with the fenced picks.

    Parameters
    ----------
    result : PortfolioResult
        :func:`build_portfolio`'s result on ``train`` and ``valid``.
    train, valid : SelectionProblem
        With ``layouts``.
    margin : float or None
        Least predicted gain, in [0, 1).
    min_trees : int

    Returns
    -------
    PortfolioResult
        With the fenced portfolio, its scores and ``evidence``.

    Raises
    ------
    ValueError
        On a margin outside [0, 1), or problems without layouts.
    """
    if margin is not None:
        margin = float(check_number("margin", margin, minimum=0, below=1))
    min_trees = check_int("min_trees", min_trees, minimum=1)
    evidence = valid if valid is not None else train
    if evidence.layouts is None or (valid is not None and train.layouts is None):
        raise ValueError("fencing a portfolio needs the trees' layouts (selection_problem records them)")
    portfolio = result.portfolio
    sel = portfolio.selector
    reached = np.array([sel.leaf_of(x) for x in evidence.features], dtype=np.int64)
    labels = list(sel.member)
    regions: list[LeafRegion | None] = [None] * len(labels)
    leaves = []
    for node, (f, m) in enumerate(zip(sel.feature, sel.member, strict=True)):
        if f >= 0:
            continue
        idx = np.flatnonzero(reached == node)
        gain = worst = None
        if m != 0 and len(portfolio.members) > 1:
            if idx.size:
                w = evidence.weight[idx]
                r = evidence.ratio[idx, result.columns[m]]
                gain = 1.0 - float(w @ r) / float(w.sum())
                worst = float(r.max())
            keep = margin is not None and idx.size >= min_trees and gain > margin and worst <= 1.0
            if keep:
                layouts = [tuple(p) for p in evidence.layouts[idx].tolist()]
                regions[node] = LeafRegion.of_trees(evidence.features[idx], layouts, "predicted")
            else:
                labels[node] = 0
        leaves.append({"leaf": node, "trees": int(idx.size), "model_pick": m, "served": labels[node],
                       "predicted_gain": gain, "worst_ratio": worst})  # fmt: skip
    selector = Selector(sel.feature, sel.threshold, sel.left, sel.right, tuple(labels))
    fenced = Portfolio(members=portfolio.members, selector=selector, runtime=portfolio.runtime, regions=tuple(regions))
    columns = result.columns
    return replace(
        result,
        portfolio=fenced,
        train=score(train, columns, selector, portfolio=fenced),
        valid=None if valid is None else score(valid, columns, selector, portfolio=fenced),
        evidence={"margin": margin, "split": "validation" if valid is not None else "tuning",
                  "min_trees": min_trees, "leaves": leaves},
    )  # fmt: skip
