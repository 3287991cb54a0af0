"""Test set-up: CPU runs use the Triton interpreter; ``gpu`` tests need CUDA.

``TRITON_INTERPRET`` must be set before ``fasttree.kernels`` is imported, so it is
decided here, before any test module imports fasttree.

Under pytest-xdist the workers share one GPU: every ``gpu`` test holds a shared lock on one file
while it runs, and a ``gpu_timing`` test (one that compares times) holds it exclusively, so no
other worker's kernels run beside its timings. They also share the CPU's cores: each worker's torch
runs its share of them (the float64 references run on the CPU; 8 workers of 16 threads each on 16
cores took minutes over references that take 35 s in one process).
"""

import fcntl
import importlib.util
import os
import tempfile
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

#: The device image has no Optuna, and the tuner's test modules hold no GPU test: a CUDA
#: machine without Optuna does not collect them (a CPU machine without it fails loudly).
collect_ignore = ["test_tuner.py", "test_cli_tune.py"] if HAS_CUDA and not importlib.util.find_spec("optuna") else []


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


#: The lock file of :func:`_gpu_share` (one per user and machine, so concurrent workers find it).
_GPU_LOCK = Path(tempfile.gettempdir()) / f"fasttree-gpu-tests-{os.getuid()}.lock"


@pytest.fixture(autouse=True)
def _gpu_share(request):
    """A ``gpu`` test runs under a shared lock, a ``gpu_timing`` one under an exclusive lock (it
    waits until no other worker runs a GPU test, and none starts until it ends)."""
    if not HAS_CUDA or "gpu" not in request.keywords:
        yield
        return
    exclusive = "gpu_timing" in request.keywords
    with open(_GPU_LOCK, "a+") as handle:  # closing the file releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


@pytest.fixture
def device() -> torch.device:
    """The device kernels run on: CUDA when present, else the CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
