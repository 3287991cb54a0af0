"""What the benchmarks share: environment metadata, the H200 paper-suite anchors, dtypes and
tolerances, the roofline rates.

Used by :mod:`fasttree.toolkit.kernel_bench` and by the maintained scripts of the repository's
``bench/`` folder (which may import from the package, never the reverse). The anchors file is
package data (``data/anchors_h200_paper_suite.json``), so an installed package finds it."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from .profiler import git_commit

#: The published FastTree kernel's times, SDPA and the roofline floors on the H200 paper suite.
ANCHORS_PATH = Path(__file__).resolve().parent / "data" / "anchors_h200_paper_suite.json"
#: ``--dtype`` choices of the GPU benchmarks.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: Worst relative error against the float64 reference the GPU benchmarks accept, per dtype.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: The anchors' roofline rates (the H200): HBM bytes per second and tensor-core flops per second.
HBM_BYTES_PER_S = 4.8e12
TENSOR_FLOPS = 700e12


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def environment(*, gpu: bool = False) -> dict[str, Any]:
    """Host-name-free description of the machine and software versions (and the GPU), and whether
    the planner's compiled loops loaded (``native_planner``; without them it plans several times
    slower, so a host-time result means little unless this is True)."""
    from fasttree.native import planner_library

    env: dict[str, Any] = {
        "processor": platform.processor() or None,
        "machine": platform.machine() or None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "fasttree": __version__,
        "git_commit": git_commit(),
        "native_planner": planner_library() is not None,
        "timestamp_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if gpu:
        import triton

        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu_name=props.name,
            gpu_sm_count=props.multi_processor_count,
            gpu_compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            torch=torch.__version__,
            cuda=torch.version.cuda,
            triton=triton.__version__,
        )
    return env


def load_anchors() -> dict[str, Any]:
    """The project's copy of the H200 paper-suite anchors (published kernel, SDPA, floors)."""
    return json.loads(ANCHORS_PATH.read_text())


def anchor_rows() -> dict[tuple[int, str], dict[str, Any]]:
    """Anchor rows keyed by (case, heads name)."""
    return {(c["case"], c["heads"]): c for c in load_anchors()["cases"]}


def geomean(x) -> float:
    """Geometric mean of the positive values ``x`` (NaN when there are none)."""
    x = np.asarray(list(x), dtype=np.float64)
    return float(np.exp(np.log(x).mean())) if x.size else float("nan")
