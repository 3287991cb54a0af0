"""The data shipped in the package: the H200 latency model and the workload traces ``fasttree-tune run`` tunes on.

Both are package data (``pyproject.toml``'s ``package-data``), found through :mod:`importlib.resources`,
so the defaults of ``fasttree-tune run``, ``tune``, ``validate`` and ``refine`` work from any folder of
any install, editable or not:

* the model: ``fasttree/costmodel/data/h200_latency_model.skops`` (7.4 MB; source:
  ``costmodel/data/``), fitted on the H200 measurements of ``traces/h200``;
* the tuning, held-out and test workloads: ``fasttree/toolkit/data/workloads/``,
  ``fasttree/toolkit/data/workloads_heldout/`` and ``fasttree/toolkit/data/workloads_test/`` (written by
  :mod:`fasttree.toolkit.workload_traces`; format: ``traces/README.md``).

The measurement traces (``traces/h200``, 21 MB) are needed only to fit the model again
(``fasttree-tune run --refit``) and are not package data: :func:`measurement_traces` finds them in
a source checkout only, as :func:`heldout_measurement_traces` finds the model's held-out
measurements (``traces/h200_heldout``), on which ``run`` and ``export`` calibrate the margin a
predicted gain must exceed.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = [
    "MODEL_FILE",
    "WORKLOAD_SPLITS",
    "heldout_measurement_traces",
    "measurement_traces",
    "model_path",
    "workloads_path",
]

#: File name of the shipped model (in ``fasttree.costmodel``'s ``data`` folder).
MODEL_FILE = "h200_latency_model.skops"


def _resource(package: str, *parts: str) -> Path:
    """The file system path of package data (the package is installed as files, not in a zip)."""
    ref = files(package).joinpath(*parts)
    if not isinstance(ref, Path):  # pragma: no cover - a zip import has no file system path to hand out
        raise FileNotFoundError(f"{package}: package data {'/'.join(parts)} is not on the file system ({ref})")
    return ref


def model_path() -> Path:
    """The shipped H200 latency model (a skops file: :func:`fasttree.costmodel.persist.load_model`)."""
    return _resource("fasttree.costmodel", "data", MODEL_FILE)


#: The shipped workload splits and their folders (``docs/tune/protocol.md``): ``tuning`` for the studies,
#: ``heldout`` for every design choice, ``test`` (families nothing else uses) for the final GPU validation only.
WORKLOAD_SPLITS = {"tuning": "workloads", "heldout": "workloads_heldout", "test": "workloads_test"}


def workloads_path(split: str = "tuning") -> Path:
    """The folder of the shipped workload traces of ``split`` (a key of :data:`WORKLOAD_SPLITS`)."""
    if split not in WORKLOAD_SPLITS:
        raise ValueError(f"split must be one of {', '.join(WORKLOAD_SPLITS)}, got {split!r}")
    return _resource("fasttree.toolkit", "data", WORKLOAD_SPLITS[split])


def _checkout_traces(name: str) -> Path | None:
    root = Path(__file__).resolve().parents[2]
    traces = root / "traces" / name
    return traces if traces.is_dir() and (root / "pyproject.toml").is_file() else None


def measurement_traces() -> Path | None:
    """``traces/h200`` of the source checkout this package runs from, or None (an installed package)."""
    return _checkout_traces("h200")


def heldout_measurement_traces() -> Path | None:
    """``traces/h200_heldout`` (the shipped model's held-out measurements) of the source checkout this
    package runs from, or None (an installed package)."""
    return _checkout_traces("h200_heldout")
