"""Where a measurement runs: the GPU, driver, library versions and commit of a trace's ``env``.

:func:`collect_env` answers for one CUDA device (cached per device for the process);
:func:`device_sm_count`, :func:`cuda_device`, :func:`generic_cuda` and
:func:`visible_gpu_ids` answer the profiler's other questions about the devices it may use.
torch is imported inside the functions.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from .design import DEFAULT_SM_COUNT

__all__ = ["collect_env", "cuda_device", "device_sm_count", "generic_cuda", "git_commit", "visible_gpu_ids"]


def git_commit() -> str | None:
    """``$FASTTREE_GIT_COMMIT``, else ``git rev-parse HEAD`` of this package's checkout, else None."""
    env = os.environ.get("FASTTREE_GIT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _nvidia_smi(gpu_id: str) -> dict[str, Any]:
    """Max memory clock (MHz) and driver version from ``nvidia-smi``, Nones when it is unavailable."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=clocks.max.memory,driver_version",
                "--format=csv,noheader,nounits",
                "-i",
                gpu_id,
            ],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        )
        clock, driver = (s.strip() for s in out.stdout.strip().splitlines()[0].split(",")[:2])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"memory_clock_mhz": None, "driver": None}
    return {"memory_clock_mhz": int(clock) if clock.isdigit() and int(clock) > 0 else None, "driver": driver or None}


def _driver_from_proc() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def _physical_gpu_id(props: Any, index: int) -> str:
    """An ``nvidia-smi -i`` id for the device: its UUID when torch knows it, else the visible index mapped
    through ``CUDA_VISIBLE_DEVICES``."""
    uid = getattr(props, "uuid", None)
    if uid is not None:
        text = str(uid)
        return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


_ENV_CACHE: dict[str, dict[str, Any]] = {}


def collect_env(device: Any = None) -> dict[str, Any]:
    """Where a measurement runs: the trace format's ``env`` (plus a few extra keys).

    GPU name, SM count and compute capability from ``torch.cuda``; memory clock and
    driver from ``nvidia-smi`` (None when it is missing; the driver then from
    ``/proc/driver/nvidia/version``); torch, triton and fasttree versions; the git commit
    (:func:`git_commit`). Extra keys: ``cuda``, ``python``, ``gpu_memory_gib``. Cached per
    device for the process.

    Parameters
    ----------
    device : str or torch.device, optional
        A CUDA device (default: the current one).

    Returns
    -------
    dict

    Raises
    ------
    ValueError
        When no CUDA GPU is visible or ``device`` is not a CUDA device.
    """
    import torch
    import triton

    import fasttree

    if not torch.cuda.is_available():
        raise ValueError("no CUDA GPU is visible (torch.cuda.is_available() is False); the profiler measures on a GPU")
    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda":
        raise ValueError(f"the profiler measures on a CUDA device, got {dev}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    cache_key = f"cuda:{index}"
    if cache_key in _ENV_CACHE:
        return dict(_ENV_CACHE[cache_key])
    props = torch.cuda.get_device_properties(index)
    smi = _nvidia_smi(_physical_gpu_id(props, index))
    clock = smi["memory_clock_mhz"]
    if clock is None:
        khz = getattr(props, "memory_clock_rate", None)
        clock = int(khz) // 1000 if isinstance(khz, int) and khz >= 1000 else None
    env = {
        "gpu_name": props.name,
        "gpu_sm_count": int(props.multi_processor_count),
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_clock_mhz": clock,
        "driver": smi["driver"] or _driver_from_proc(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fasttree": fasttree.__version__,
        "git_commit": git_commit(),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
    }
    _ENV_CACHE[cache_key] = env
    return dict(env)


def device_sm_count(device: Any = None) -> int:
    """SM count of a CUDA device, or :data:`DEFAULT_SM_COUNT` when none is visible."""
    try:
        import torch

        if not torch.cuda.is_available():
            return DEFAULT_SM_COUNT
        dev = torch.device("cuda" if device is None else device)
        index = torch.cuda.current_device() if dev.index is None else dev.index
        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    except Exception:  # any trouble asking the device: the documented default
        return DEFAULT_SM_COUNT


def cuda_device(device: Any) -> bool:
    """Whether ``device`` names a CUDA device and one is visible."""
    try:
        import torch

        return torch.device(device).type == "cuda" and torch.cuda.is_available()
    except Exception:
        return False


def generic_cuda(device: Any) -> bool:
    """Whether ``device`` is the generic ``"cuda"`` (no index): every visible GPU may be used."""
    try:
        import torch

        dev = torch.device(device)
    except Exception:
        return False
    return dev.type == "cuda" and dev.index is None


def visible_gpu_ids() -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entry a child process needs to see each visible GPU alone."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[:count] if visible else [str(i) for i in range(count)]
