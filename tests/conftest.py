"""Test set-up: CPU runs use the Triton interpreter; ``gpu`` tests need CUDA.

``TRITON_INTERPRET`` must be set before ``fasttree.kernels`` is imported, so it is
decided here, before any test module imports fasttree.
"""

import importlib.util
import os

import torch

HAS_CUDA = torch.cuda.is_available()
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


@pytest.fixture
def device() -> torch.device:
    """The device kernels run on: CUDA when present, else the CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
