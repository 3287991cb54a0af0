"""Measure a tuned export against the defaults on workload trees, on the GPU (``fasttree-tune validate``).

For every workload tree and every target of the export (``tree_attention``: ``fasttree.plan`` and
``fasttree.tree_attention``; ``runtime``: :class:`fasttree.runtime.TreeAttentionRuntime` with its
launch variants, as servers run it, not the fixed launch the profiler's traces time), every
member of the entry's portfolio is measured, by the profiler's own measurement
(:func:`fasttree.toolkit.measure.measure_point`: CUDA-graph replay on random inputs, the first tree of
each family checked against the float64 reference). A case's speedup is the defaults' time (member
0) over the time of the member the selector picks; the selector's regret is the picked members'
summed time over the best member's per tree, per family. A member the selector picks is the
defaults for most trees: its time is then the defaults' own measurement (the same plan and kernels).
Every measurement is appended to a trace file (``meta.split = "validate"``), so the loop closes: the
next fit of the latency model can use the ``tree_attention`` lines (it leaves the runtime's
launch-variant lines out: its runtime target is the fixed launch). A rerun into the same file resumes: a case (tree and
target) whose every member that file already holds measured in one earlier run (same tree, heads,
config and launch on the same GPU model, by today's kernels: :func:`earlier_measurements`) is read
back, not measured again; a case measured in part is measured again whole, so that its ratios come
from one run.

Runs on the GPU machine: imports torch, numpy and fasttree, never Optuna or scikit-learn.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import FastTreeConfig
from ..export import TARGETS, ConfigExport, bucket_label
from ..portfolio import tree_features
from ..traces import TraceWriter, decode_tree, read_traces
from ..validation import check_int
from ..versions import KERNEL_VERSION
from .design import DesignPoint, point_key
from .environment import collect_env
from .measure import measure_point

__all__ = [
    "CaseValidation",
    "earlier_measurements",
    "family_of_record",
    "summarise",
    "validate_portfolios",
    "workload_steps",
]

logger = logging.getLogger(__name__)


@dataclass
class CaseValidation:
    """The measured members of one tree and target.

    Attributes
    ----------
    family : str
        The tree's family (a generator family, ``serving/<scenario>`` or ``paper``).
    case : str
        ``family/scenario/seed/step Hq/Hkv``: which tree.
    bucket : str
        ``g<G>-d<D>-<dtype>``.
    target : str
        ``"tree_attention"`` or ``"runtime"``.
    picked : int
        The member the selector picks.
    member_us : list of float
        Graph-replay median of every member (member 0: the defaults).
    leaf : int
        The selector node the tree reaches (0 for a one-member portfolio), which
        :mod:`fasttree.toolkit.confirm` groups by.
    features : list of float or None
        The tree's selector features (:func:`fasttree.tree_features`): a confirmed leaf's region
        of evidence is their box over its trees. None when unknown (a file of an older validate).
    heads : list of int or None
        ``[num_q_heads, num_kv_heads]`` the tree was measured at (the region's head layouts).
    """

    family: str
    case: str
    bucket: str
    target: str
    picked: int
    member_us: list[float] = field(default_factory=list)
    leaf: int = 0
    features: list[float] | None = None
    heads: list[int] | None = None

    @property
    def speedup(self) -> float:
        """The defaults' time over the picked member's."""
        return self.member_us[0] / self.member_us[self.picked]

    @property
    def best_us(self) -> float:
        """The fastest member's time."""
        return min(self.member_us)


def workload_steps(records: Iterable[Mapping[str, Any]], per_workload: int) -> dict[str, list[Mapping[str, Any]]]:
    """Up to ``per_workload`` evenly spaced records of each workload, by ``family/scenario/seed Hq/Hkv``.

    Raises
    ------
    ValueError
        On ``per_workload < 1`` or no workload records.
    """
    per_workload = check_int("steps per workload", per_workload, minimum=1)
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("kind") != "workload":
            raise ValueError(f"expected workload records, got kind {r.get('kind')!r}")
        w = r["workload"]
        name = f"{w['family']}/{w['scenario']}/seed{w['seed']} {r['num_q_heads']}/{r['num_kv_heads']}"
        groups.setdefault(name, []).append(r)
    if not groups:
        raise ValueError("no workload records")
    out = {}
    for name, rs in groups.items():
        idx = np.unique(np.linspace(0, len(rs) - 1, min(per_workload, len(rs))).round().astype(int))
        out[name] = [rs[i] for i in idx]
    return out


def family_of_record(record: Mapping[str, Any]) -> str:
    """A workload record's family: the generator family, ``serving/<scenario>`` or ``paper``."""
    w = record["workload"]
    return f"serving/{w['scenario']}" if w["family"] == "serving" else str(w["family"])


def earlier_measurements(path: Any, gpu_name: str) -> dict[str, tuple[float, str | None]]:
    """The graph-replay medians (us) of the validate measurements a trace file already holds, and the
    run that measured each (``meta.run``; None for lines of an older validate), by measurement key:
    lines with ``meta.split = "validate"``, status ok, measured on a GPU named ``gpu_name`` by the
    installed kernels (``meta.profiler.kernel_version``). A missing file holds none; invalid lines (a
    torn last line) are skipped; of a key measured twice, the last line counts."""
    if path is None or not Path(path).exists():
        return {}
    out = {}
    for r in read_traces(path, kind="measurement", skip_invalid=True).records:
        meta = r.get("meta") or {}
        if (
            r["status"] == "ok"
            and meta.get("split") == "validate"
            and (r.get("env") or {}).get("gpu_name") == gpu_name
            and (meta.get("profiler") or {}).get("kernel_version") == KERNEL_VERSION
        ):
            out[r["key"]] = (float(r["timing"]["graph_us"]["median"]), meta.get("run"))
    return out


def _read_back(
    points: list[DesignPoint], tree: Any, gpu_name: str, earlier: Mapping[str, tuple[float, str | None]] | None
) -> list[float] | None:
    """The case's member times ``earlier`` holds (:func:`earlier_measurements`), when it holds every
    member's from one run (so that the case's ratios come from one run); else None."""
    if not earlier:
        return None
    done = [earlier.get(point_key(p, gpu_name, tree=tree)) for p in points]
    if any(d is None for d in done) or len({d[1] for d in done}) != 1:
        return None
    return [d[0] for d in done]


def _point(record: Mapping[str, Any], config: FastTreeConfig, index: int, runtime: bool) -> DesignPoint:
    w = record["workload"]
    return DesignPoint(
        index=index,
        family=f"{w['family']}/{w['scenario']}",
        seed=int(w["seed"]) if w.get("seed") is not None else 0,
        num_q_heads=int(record["num_q_heads"]),
        num_kv_heads=int(record["num_kv_heads"]),
        head_dim=int(record["head_dim"]),
        dtype=str(record["dtype"]),
        config=config,
        default_config=config == FastTreeConfig(),
        split="validate",
        tree_index=int(w["step"]),
        runtime=runtime,
        variants=runtime,  # the runtime as servers run it
    )


def validate_portfolios(
    export: ConfigExport,
    records: Iterable[Mapping[str, Any]],
    *,
    gpu_name: str,
    targets: tuple[str, ...] = TARGETS,
    writer: TraceWriter | None = None,
    device: Any = "cuda",
    env: dict[str, Any] | None = None,
    measure: Callable[..., dict[str, Any]] = measure_point,
    earlier: Mapping[str, tuple[float, str | None]] | None = None,
    run: str | None = None,
) -> list[CaseValidation]:
    """Measure every member of the export's portfolio of each record's bucket and target.

    Parameters
    ----------
    export : ConfigExport
    records : iterable of dict
        Workload trace records: the trees to measure.
    gpu_name : str
        The GPU's name as ``torch.cuda.get_device_name()`` reports it (picks the export's entries).
    targets : tuple of str
        ``"tree_attention"`` and/or ``"runtime"``.
    writer : TraceWriter, optional
        Receives every measurement record.
    device : str or torch.device
    env : dict, optional
        :func:`fasttree.toolkit.environment.collect_env` of ``device`` (collected when None).
    measure : callable
        :func:`fasttree.toolkit.measure.measure_point` (replaceable in tests).
    earlier : mapping of str to (float, str or None), optional
        Graph-replay medians already measured and their runs, by measurement key
        (:func:`earlier_measurements`): a case whose every member is there, from one run, is not
        measured (nor written) again.
    run : str, optional
        This run's id, written to every line's ``meta.run`` (a fresh random id by default).

    Returns
    -------
    list of CaseValidation

    Raises
    ------
    RuntimeError
        When a measurement fails (the failed record is still written).
    """
    env = collect_env(device) if env is None else env
    run = uuid.uuid4().hex[:16] if run is None else str(run)
    reused = 0
    results = []
    index = 0
    checked: set[tuple[str, str, int, str, int]] = set()  # (family, bucket, q heads, target, member) checked
    for r in records:
        if r.get("kind") != "workload":
            raise ValueError(f"expected workload records, got kind {r.get('kind')!r}")
        tree = decode_tree(r["workload"]["tree"])
        w = r["workload"]
        case = f"{w['family']}/{w['scenario']}/seed{w['seed']}/step{w['step']} {r['num_q_heads']}/{r['num_kv_heads']}"
        family = family_of_record(r)
        bucket = bucket_label(r["num_q_heads"] // r["num_kv_heads"], r["head_dim"], r["dtype"])
        for target in targets:
            portfolio, _ = export.lookup(
                gpu=gpu_name, num_q_heads=r["num_q_heads"], num_kv_heads=r["num_kv_heads"],
                head_dim=r["head_dim"], dtype=r["dtype"], target=target,
            )  # fmt: skip
            x = tree_features(tree)
            leaf = 0 if len(portfolio.members) == 1 else portfolio.selector.leaf_of(x)
            heads = [int(r["num_q_heads"]), int(r["num_kv_heads"])]
            v = CaseValidation(family, case, bucket, target, portfolio.member_of(tree), leaf=leaf,
                               features=x.tolist(), heads=heads)  # fmt: skip
            runtime = target == "runtime"
            points = [_point(r, config, index + m, runtime) for m, config in enumerate(portfolio.members)]
            index += len(points)
            times = _read_back(points, tree, gpu_name, earlier)
            if times is not None:
                v.member_us = times
                reused += len(times)
            else:
                for m, point in enumerate(points):
                    key = (family, bucket, int(r["num_q_heads"]), target, m)
                    check = key not in checked  # every member of every target on the family's first tree
                    rec = measure(point, device=device, check=check, env=env, tree=tree)
                    checked.add(key)
                    meta = {"split": "validate", "case": case, "target": target, "member": m, "picked": v.picked}
                    rec.setdefault("meta", {}).update({**meta, "leaf": leaf, "run": run})
                    if writer is not None:
                        writer.append(rec)
                    if rec["status"] != "ok":
                        raise RuntimeError(f"{case} {target} member {m}: {rec.get('error')}")
                    v.member_us.append(float(rec["timing"]["graph_us"]["median"]))
            logger.info("%s %s: picks member %d, %.3fx", case, target, v.picked, v.speedup)
            results.append(v)
    if reused:
        logger.info("%d measurements read back from the trace file, not measured again", reused)
    return results


def summarise(results: list[CaseValidation]) -> dict[str, Any]:
    """Per (target, bucket, family) and per target: cases, geomean and worst speedup of the picks, the
    selector's regret (picked time over the best member's, summed per family, minus 1) and, beside it,
    the regret of always picking the defaults (member 0): the trivial baseline."""
    groups: dict[tuple[str, str, str], list[CaseValidation]] = {}
    for v in results:
        groups.setdefault((v.target, v.bucket, v.family), []).append(v)
    rows = []
    for (target, bucket, family), vs in sorted(groups.items()):
        speedups = [v.speedup for v in vs]
        picked = sum(v.member_us[v.picked] for v in vs)
        rows.append({
            "target": target, "bucket": bucket, "family": family, "cases": len(vs),
            "geomean": math.exp(sum(math.log(s) for s in speedups) / len(speedups)), "worst": min(speedups),
            "regret": picked / sum(v.best_us for v in vs) - 1.0,
            "default_regret": sum(v.member_us[0] for v in vs) / sum(v.best_us for v in vs) - 1.0,
            "switched": sum(v.picked != 0 for v in vs),
        })  # fmt: skip
    totals = {}
    for target in sorted({v.target for v in results}):
        speedups = [v.speedup for v in results if v.target == target]
        totals[target] = {
            "cases": len(speedups),
            "geomean": math.exp(sum(math.log(s) for s in speedups) / len(speedups)),
            "worst": min(speedups),
            "below_0.97": sum(s < 0.97 for s in speedups),
            "worst_family_regret": max(r["regret"] for r in rows if r["target"] == target),
            "worst_family_default_regret": max(r["default_regret"] for r in rows if r["target"] == target),
        }
    return {"families": rows, "targets": totals}
