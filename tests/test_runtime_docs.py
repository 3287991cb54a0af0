"""The example of docs/runtime.md runs as written (CPU interpreter here; CUDA graphs on a GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "runtime.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks, "docs/runtime.md has no python example"
    return blocks[0]


def test_the_runtime_page_example_runs():
    exec(compile(_example(), str(PAGE), "exec"), {"__name__": "runtime_docs_example"})


@pytest.mark.gpu
def test_the_runtime_page_example_runs_with_graphs():
    import torch

    assert torch.cuda.is_available()
    exec(compile(_example(), str(PAGE), "exec"), {"__name__": "runtime_docs_example"})
