"""The workloads a tuning command reads and the settings its studies record, for ``tune``, ``export`` and ``run``.

:func:`read_workloads` reads WORKLOADS and the held-out workloads (a path, the split of WORKLOADS that
:mod:`fasttree.toolkit.workload_split` defines, or none) and warns when the held-out steps are tuning steps.
:func:`study_settings` is what ``tune`` and ``run`` store in each study (model, workloads' hash, ``--every``,
held-out source; the tuner adds the target), and :func:`reconcile` is how ``export`` reuses them: an option
left out takes the recorded value, an option given with another value is a ``ValueError`` naming it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..toolkit import shipped
from ..toolkit.workload_split import records_sha256, shared_steps, split_heldout

__all__ = ["HELDOUT_SPLIT", "Workloads", "read_workloads", "reconcile", "resolve_heldout", "study_settings"]

logger = logging.getLogger("fasttree.cli")

#: ``--heldout split``: the last fifth of each workload of WORKLOADS, left out of tuning.
HELDOUT_SPLIT = "split"


def _same_path(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def resolve_heldout(spec: str | None, workload_paths: Sequence[str]) -> str:
    """The held-out source: a path, :data:`HELDOUT_SPLIT` or ``""`` (none).

    ``None`` (no ``--heldout``) is the shipped held-out workloads when ``workload_paths`` is the shipped
    tuning folder, else the split of the user's own workloads; ``"none"`` and ``""`` mean none.
    """
    if spec is None:
        shipped_tuning = shipped.workloads_path("tuning")
        if len(workload_paths) == 1 and _same_path(workload_paths[0], shipped_tuning):
            return str(shipped.workloads_path("heldout"))
        return HELDOUT_SPLIT
    if spec.strip().lower() in ("", "none"):
        return ""
    return HELDOUT_SPLIT if spec == HELDOUT_SPLIT else spec


def describe_heldout(source: str) -> str:
    """How log lines name a held-out source."""
    if source == HELDOUT_SPLIT:
        return "the last fifth of each workload (--heldout split)"
    return source or "none (--heldout none)"


@dataclass(frozen=True)
class Workloads:
    """What a tuning command reads: all records of WORKLOADS, the ones it tunes on and the held-out ones."""

    paths: tuple[str, ...]
    records: list
    tuning: list
    heldout: list
    heldout_source: str
    sha256: str


def read_workloads(paths: Sequence[str], heldout: str, *, skip_invalid: bool = False) -> Workloads:
    """Read WORKLOADS and the held-out workloads of ``heldout`` (:func:`resolve_heldout`'s value).

    A WARNING when held-out steps have the trees of tuning steps: the design would be chosen on the
    tuning data.

    Raises
    ------
    ValueError, fasttree.traces.TraceError, OSError
        On unreadable traces, or a ``--heldout split`` that leaves nothing to tune on.
    """
    from ..traces import read_traces

    def read(where: Sequence[str]) -> list:
        ts = read_traces(list(where), kind="workload", skip_invalid=skip_invalid)
        for name, line, reason in ts.invalid[:20]:  # read_traces logs how many, and the first
            logger.info("skipped %s:%d: %s", name, line, reason)
        return ts.records

    records = read(paths)
    if heldout == HELDOUT_SPLIT:
        tuning, held = split_heldout(records)
        if records and not tuning:
            raise ValueError("--heldout split leaves no step to tune on")
    else:
        tuning, held = records, (read([heldout]) if heldout else [])
        shared = shared_steps(tuning, held)
        if shared:
            logger.warning(
                "%d of the %d held-out steps of %s are tuning steps of %s: each portfolio's design would be chosen "
                "on its own tuning data; pass other held-out workloads, or leave --heldout out to hold out the last "
                "fifth of each workload",
                shared, len(held), heldout, " ".join(paths),
            )  # fmt: skip
    return Workloads(tuple(str(p) for p in paths), records, tuning, held, heldout, records_sha256(records))


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def study_settings(model: str, workloads: Workloads, every: int) -> dict[str, Any]:
    """What ``tune`` and ``run`` record in each study (JSON values; the tuner adds ``target``)."""
    return {
        "model": str(model),
        "model_sha256": sha256_file(model),
        "workloads": list(workloads.paths),
        "workloads_sha256": workloads.sha256,
        "every": int(every),
        "heldout": workloads.heldout_source,
    }


def reconcile(
    recorded: Mapping[str, Mapping[str, Any] | None], *, model: str | None, every: int | None, heldout: str | None
) -> dict[str, Any]:
    """``export``'s model, ``--every`` and held-out source from the studies' recorded settings.

    Parameters
    ----------
    recorded : mapping of str to dict or None
        Study name -> its recorded settings (None: a study that records none).
    model, every, heldout
        The options given (None: left out; ``heldout`` already resolved when given).

    Returns
    -------
    dict
        ``model``, ``every`` and ``heldout`` (None where neither the options nor the studies say).

    Raises
    ------
    ValueError
        Naming the study and the setting when a given option differs from what a study recorded, when
        the studies recorded different values, or when the recorded model file changed since.
    """
    have = {name: s for name, s in recorded.items() if s}
    out: dict[str, Any] = {"model": model, "every": every, "heldout": heldout}
    for key, option in (("every", "--every"), ("heldout", "--heldout"), ("model_sha256", "--model")):
        values = {repr(s.get(key)) for s in have.values()}
        if len(values) > 1:
            raise ValueError(
                f"the studies were tuned with different {option} settings ({', '.join(sorted(have))}): "
                "export one target at a time (--targets)"
            )
    if not have:
        return out
    name, first = sorted(have.items())[0]
    if every is not None and every != first.get("every"):
        raise ValueError(
            f"study {name} was tuned with --every {first.get('every')}, this command passes --every {every}: "
            "leave --every out to reuse the study's"
        )
    if heldout is not None and heldout != first.get("heldout"):
        raise ValueError(
            f"study {name} was tuned with held-out workloads {describe_heldout(first.get('heldout', ''))}, this "
            f"command passes {describe_heldout(heldout)}: leave --heldout out to reuse the study's"
        )
    if model is not None:
        if Path(model).is_file() and sha256_file(model) != first.get("model_sha256"):
            raise ValueError(
                f"study {name} was tuned with --model {first.get('model')} (sha256 "
                f"{str(first.get('model_sha256'))[:12]}...), this command passes --model {model} (another file): "
                "leave --model out to reuse the study's"
            )
    else:
        model = str(first.get("model"))
        if not Path(model).is_file():
            model = _shipped_copy(model, first.get("model_sha256"), name)  # its bytes checked there
        elif sha256_file(model) != first.get("model_sha256"):
            raise ValueError(
                f"study {name} was tuned with --model {model}, which has changed since: pass --model with the "
                "model it was tuned with"
            )
    out.update(model=model, every=first.get("every") if every is None else every)
    out["heldout"] = first.get("heldout") if heldout is None else heldout
    return out


def _shipped_copy(model: str, sha256: Any, study: str) -> str:
    """The shipped model in place of a study's recorded ``model`` that no longer exists, when its bytes are the
    ones the study recorded (the package reinstalled or moved since: the shipped model's path is absolute);
    else a ``ValueError`` asking for ``--model``."""
    here = shipped.model_path()
    if here.is_file() and sha256_file(here) == sha256:
        logger.info("study %s was tuned with --model %s, which no longer exists: the shipped model %s has its bytes",
                    study, model, here)  # fmt: skip
        return str(here)
    raise ValueError(f"study {study} was tuned with --model {model}, which no longer exists: pass --model")


def check_workloads(recorded: Mapping[str, Mapping[str, Any] | None], workloads: Workloads) -> None:
    """A ``ValueError`` naming the first study that recorded other workloads than ``workloads``."""
    for name, s in sorted(recorded.items()):
        if s and s.get("workloads_sha256") not in (None, workloads.sha256):
            raise ValueError(
                f"study {name} was tuned on other workloads ({' '.join(s.get('workloads', []))}) than "
                f"{' '.join(workloads.paths)} reads now: pass the workloads it was tuned on (or another --study)"
            )
