"""The held-out split of a user's own workloads, and what identifies a set of workload steps.

When ``fasttree-tune tune``, ``export`` or ``run`` get workloads of their own and no held-out workloads,
the portfolio designs are chosen on a split of those workloads: the last fifth of the steps of each
workload (``family/scenario/seed``, head shape and dtype), in recorded order, is held out of tuning
(:func:`split_heldout`). Holding out the latest steps rather than every fifth keeps the two sets
apart: consecutive decode steps differ by a token. ``validate --split heldout`` measures the same
steps, so ``confirm`` reads measurements of trees nothing was tuned on.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "HELDOUT_FRACTION",
    "case_name",
    "records_sha256",
    "shared_steps",
    "split_heldout",
    "workload_name",
]

#: Fraction of each workload's steps held out (rounded down, at least one step of a workload of two or more).
HELDOUT_FRACTION = 0.2


def workload_name(record: Mapping[str, Any]) -> str:
    """``family/scenario/seed<S> Hq/Hkv d<D> <dtype>``: the workload (and bucket) a workload record belongs to."""
    w = record["workload"]
    return (
        f"{w['family']}/{w.get('scenario')}/seed{w.get('seed')} {record['num_q_heads']}/{record['num_kv_heads']} "
        f"d{record['head_dim']} {record['dtype']}"
    )


def case_name(record: Mapping[str, Any]) -> str:
    """``family/scenario/seed<S>/step<K> Hq/Hkv``: how ``validate`` names the case of a workload record."""
    w = record["workload"]
    return (
        f"{w['family']}/{w.get('scenario')}/seed{w.get('seed')}/step{w.get('step')} "
        f"{record['num_q_heads']}/{record['num_kv_heads']}"
    )


def split_heldout(
    records: Sequence[Mapping[str, Any]], fraction: float = HELDOUT_FRACTION
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """Tuning and held-out records of ``records``: the last ``fraction`` of each workload's steps held out.

    Parameters
    ----------
    records : sequence of dict
        Workload trace records (``read_traces(..., kind="workload").records``), in recorded order.
    fraction : float
        In (0, 1). A workload of ``n >= 2`` steps holds out its last ``max(1, floor(n * fraction))``;
        a workload of one step is only tuned on.

    Returns
    -------
    tuning, heldout : list of dict
        Both in the order of ``records``.

    Raises
    ------
    ValueError
        On a ``fraction`` outside (0, 1).
    """
    if not 0 < fraction < 1:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {fraction!r}")
    counts: dict[str, int] = {}
    for r in records:
        counts[workload_name(r)] = counts.get(workload_name(r), 0) + 1
    seen: dict[str, int] = {}
    tuning, heldout = [], []
    for r in records:
        name = workload_name(r)
        n, i = counts[name], seen.get(name, 0)
        seen[name] = i + 1
        held = 0 if n < 2 else max(1, int(n * fraction))
        (heldout if i >= n - held else tuning).append(r)
    return tuning, heldout


def _step_key(record: Mapping[str, Any]) -> str:
    tree = record["workload"]["tree"]
    return json.dumps(
        [record["num_q_heads"], record["num_kv_heads"], record["head_dim"], record["dtype"], tree], sort_keys=True
    )


def shared_steps(a: Iterable[Mapping[str, Any]], b: Iterable[Mapping[str, Any]]) -> int:
    """How many records of ``b`` have a tree (and head shape and dtype) that some record of ``a`` has."""
    keys = {_step_key(r) for r in a}
    return sum(_step_key(r) in keys for r in b)


def records_sha256(records: Iterable[Mapping[str, Any]]) -> str:
    """SHA-256 of workload records as canonical JSON, in order: which steps a study was tuned on."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps(r, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()
