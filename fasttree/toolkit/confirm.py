"""Keep only the selector choices that GPU measurement confirms (``fasttree-tune confirm``).

The tuner fits each portfolio's selector on the latency model's predictions; the model is a few
percent off on single trees, so a leaf that the model sends to another member can be measured
slower than the defaults. This step takes the measurements ``fasttree-tune validate`` made of every
member on the *validation* split (never the frozen test), groups the trees by the selector leaf
they reach, and relabels every leaf with the member the measurements support:

- a leaf keeps or gets member ``m != 0`` only when at least :attr:`ConfirmRules.min_trees` measured
  trees reach it, their summed time under ``m`` is at least :attr:`ConfirmRules.min_gain` below the
  defaults' summed time, and no single tree is measured slower than :attr:`ConfirmRules.tree_floor`
  times the defaults' speed; among the members that pass, the fastest in summed time wins;
- every other leaf, including one no measured tree reaches, serves the defaults (member 0).

A leaf that leaves the defaults records its region of evidence (:class:`fasttree.LeafRegion`): the
box of the selector features of its measured trees and the head layouts they ran at. The served
portfolio gives the leaf's member only to trees inside that region and the defaults to every
other tree, so a tree unlike any measured one is never sent to a member on the strength of trees
it does not resemble. Members no leaf names any more are dropped. The leaf structure (the model's
split of the feature space) is kept: only the labels change, so the measurements choose among a
handful of options per leaf rather than fitting a new tree to few points.

GPU-free: plain Python over :class:`fasttree.toolkit.validate.CaseValidation` (numpy for the boxes).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..export import ConfigExport, bucket_label
from ..portfolio import LeafRegion, Portfolio, Selector, head_layout, tree_features
from ..validation import check_int, check_number

if TYPE_CHECKING:  # annotations only: the CLI imports this module to build its help
    from .validate import CaseValidation

__all__ = ["ConfirmRules", "LeafDecision", "case_trees", "confirm_export", "confirm_portfolio"]


@dataclass(frozen=True)
class ConfirmRules:
    """When a measured leaf may leave the defaults.

    Attributes
    ----------
    min_trees : int
        Fewest measured trees a leaf needs before it may leave the defaults.
    min_gain : float
        The member's summed time must be at most ``1 - min_gain`` of the defaults' over the leaf's trees.
    tree_floor : float
        No tree of the leaf may run below ``tree_floor`` times the defaults' speed under the member.
    """

    min_trees: int = 4
    min_gain: float = 0.03
    tree_floor: float = 0.97

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_trees", check_int("min_trees", self.min_trees, minimum=1))
        object.__setattr__(self, "min_gain", float(check_number("min_gain", self.min_gain, minimum=0, below=1)))
        object.__setattr__(self, "tree_floor", float(check_number("tree_floor", self.tree_floor, above=0, maximum=1)))


@dataclass(frozen=True)
class LeafDecision:
    """What the measurements said about one selector leaf.

    Attributes
    ----------
    target, bucket : str
    leaf : int
        The selector node.
    trees : int
        Measured trees that reach the leaf.
    predicted : int
        The member the model-fitted selector named.
    confirmed : int
        The member the leaf serves after confirmation (an index into the original portfolio).
    ratios : tuple of float
        Per member, its summed measured time over the defaults' (1.0 for member 0; NaN without trees).
    worst : tuple of float
        Per member, the lowest per-tree speed relative to the defaults (NaN without trees).
    """

    target: str
    bucket: str
    leaf: int
    trees: int
    predicted: int
    confirmed: int
    ratios: tuple[float, ...]
    worst: tuple[float, ...]


def _leaf_choice(cases: list[CaseValidation], n_members: int, rules: ConfirmRules) -> tuple[int, list, list]:
    if not cases:
        return 0, [math.nan] * n_members, [math.nan] * n_members
    default_sum = sum(c.member_us[0] for c in cases)
    ratios = [sum(c.member_us[m] for c in cases) / default_sum for m in range(n_members)]
    worst = [min(c.member_us[0] / c.member_us[m] for c in cases) for m in range(n_members)]
    passing = [
        m
        for m in range(1, n_members)
        if len(cases) >= rules.min_trees and ratios[m] <= 1.0 - rules.min_gain and worst[m] >= rules.tree_floor
    ]
    return (min(passing, key=lambda m: ratios[m]) if passing else 0), ratios, worst


def _measured_region(cases: list[CaseValidation]) -> LeafRegion:
    """The region of evidence of a confirmed leaf: the box and head layouts of its measured trees."""
    missing = [c.case for c in cases if c.features is None or c.heads is None]
    if missing:
        raise ValueError(
            f"{missing[0]}: the measurement records no tree features or heads (an older validate) and is not a "
            "tree of the shipped held-out workloads: measure it again with this fasttree-tune validate"
        )
    return LeafRegion.of_trees([c.features for c in cases], [head_layout(*c.heads) for c in cases], "measured")


def confirm_portfolio(
    portfolio: Portfolio,
    cases: Iterable[CaseValidation],
    rules: ConfirmRules = ConfirmRules(),
    *,
    target: str = "",
    bucket: str = "",
) -> tuple[Portfolio, list[LeafDecision]]:
    """Relabel ``portfolio``'s selector leaves from measured cases; drop members no leaf names.

    Parameters
    ----------
    portfolio : Portfolio
    cases : iterable of CaseValidation
        Measurements of this portfolio (every member of every case, ``leaf`` set).
    rules : ConfirmRules
    target, bucket : str
        Copied into the decisions.

    Returns
    -------
    Portfolio
        The confirmed portfolio (the defaults alone when no leaf leaves them); every leaf that
        leaves the defaults records the region of its measured trees.
    list of LeafDecision
        One per leaf, in node order.

    Raises
    ------
    ValueError
        When a case holds another number of members than the portfolio, or a leaf that is not one,
        or a case of a leaf that leaves the defaults records no features or heads.
    """
    cases = list(cases)
    n_members = len(portfolio.members)
    selector = portfolio.selector
    leaves = [i for i, f in enumerate(selector.feature) if f < 0] if n_members > 1 else [0]
    by_leaf: dict[int, list[CaseValidation]] = {leaf: [] for leaf in leaves}
    for c in cases:
        if len(c.member_us) != n_members:
            raise ValueError(f"{c.case}: {len(c.member_us)} members measured, the portfolio has {n_members}")
        if c.leaf not in by_leaf:
            raise ValueError(f"{c.case}: leaf {c.leaf} is not a leaf of the selector")
        by_leaf[c.leaf].append(c)
    decisions = []
    labels = list(selector.member)
    for leaf in leaves:
        chosen, ratios, worst = _leaf_choice(by_leaf[leaf], n_members, rules)
        predicted = selector.member[leaf] if n_members > 1 else 0
        decisions.append(
            LeafDecision(target, bucket, leaf, len(by_leaf[leaf]), predicted, chosen, tuple(ratios), tuple(worst))
        )
        labels[leaf] = chosen
    used = sorted({0} | {labels[i] for i in leaves})
    if len(used) == 1:
        defaults = dataclasses.replace(portfolio, members=portfolio.members[:1], selector=Selector(), regions=None)
        return defaults, decisions
    renumber = {old: new for new, old in enumerate(used)}
    member = tuple(renumber[m] if selector.feature[i] < 0 else 0 for i, m in enumerate(labels))
    regions = tuple(
        _measured_region(by_leaf[i]) if selector.feature[i] < 0 and member[i] else None for i in range(len(member))
    )
    confirmed = Selector(selector.feature, selector.threshold, selector.left, selector.right, member)
    members = tuple(portfolio.members[m] for m in used)
    return dataclasses.replace(portfolio, members=members, selector=confirmed, regions=regions), decisions


def confirm_export(
    export: ConfigExport,
    cases: Iterable[CaseValidation],
    *,
    gpu: str,
    rules: ConfirmRules = ConfirmRules(),
    source: str = "",
    export_sha256: str = "",
) -> tuple[ConfigExport, list[LeafDecision]]:
    """Confirm every multi-member portfolio of ``gpu``'s entries from measured cases.

    Parameters
    ----------
    export : ConfigExport
        The export the cases measured.
    cases : iterable of CaseValidation
        ``fasttree-tune validate``'s cases on the validation split.
    gpu : str
        The GPU the cases ran on; only its entries change.
    rules : ConfirmRules
    source : str
        Names the measurements in each confirmed entry's provenance.
    export_sha256 : str
        SHA-256 of the export file the cases measured (recorded in the provenance).

    Returns
    -------
    ConfigExport
        The confirmed export (provenance ``confirmed``: rules, trees, source, the measured export's
        SHA-256, leaves changed).
    list of LeafDecision
    """
    groups: dict[tuple[str, str], list[CaseValidation]] = {}
    for c in cases:
        groups.setdefault((c.target, c.bucket), []).append(c)
    entries = []
    decisions: list[LeafDecision] = []
    for entry in export.entries:
        if entry.gpu != gpu or entry.target is None or len(entry.portfolio.members) == 1:
            entries.append(entry)
            continue
        bucket = bucket_label(*entry.bucket)
        measured = groups.get((entry.target, bucket), [])
        portfolio, leaf_decisions = confirm_portfolio(
            entry.portfolio, measured, rules, target=entry.target, bucket=bucket
        )
        decisions += leaf_decisions
        provenance: dict[str, Any] = dict(entry.provenance)
        provenance["confirmed"] = {
            "source": source,
            "export_sha256": export_sha256,
            "trees": len(measured),
            "rules": dataclasses.asdict(rules),
            "leaves_changed": sum(d.confirmed != d.predicted for d in leaf_decisions),
            "members_before": len(entry.portfolio.members),
        }
        entries.append(dataclasses.replace(entry, portfolio=portfolio, provenance=provenance))
    return dataclasses.replace(export, entries=tuple(entries)), decisions


def case_trees(cases: Sequence[CaseValidation], workloads: Sequence[str | os.PathLike]) -> int:
    """Fill in the features and heads of cases that lack them (measured by an older ``validate``)
    from the workload traces they were measured on, matched by case name. A case no tree of
    ``workloads`` matches is left as it is (:func:`confirm_portfolio` refuses it only where a
    confirmed leaf needs it).

    Parameters
    ----------
    cases : sequence of CaseValidation
        Changed in place.
    workloads : sequence of path
        Workload trace files or folders (e.g. the shipped held-out workloads).

    Returns
    -------
    int
        Cases filled in.
    """
    from ..traces import decode_tree, read_traces
    from .workload_split import case_name

    todo = [c for c in cases if c.features is None or c.heads is None]
    if not todo:
        return 0
    records = {case_name(r): r for r in read_traces(list(workloads), kind="workload").records}
    filled = 0
    for c in todo:
        r = records.get(c.case)
        if r is not None:
            c.features = tree_features(decode_tree(r["workload"]["tree"])).tolist()
            c.heads = [int(r["num_q_heads"]), int(r["num_kv_heads"])]
            filled += 1
    return filled
