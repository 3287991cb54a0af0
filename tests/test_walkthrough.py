"""``docs/walkthrough.md``, run: every fenced command of the page, in order, in a fresh folder.

The CPU steps (record, fit, tune, export) run here on tiny inputs: the smoke traces stand in for the
profile's output, and each command gets options appended that only make it smaller (argparse keeps the
last value). The GPU steps (profile, validate, confirm, serve) run with ``pytest -m gpu``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from fasttree import KVTree
from fasttree.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "walkthrough.md"
MODEL = ROOT / "costmodel" / "data" / "h200_latency_model.skops"
#: Subcommands that need the GPU (confirm reads validate's measurements).
GPU_COMMANDS = ("profile", "validate", "confirm")
#: What keeps each command small in a test: appended, so it overrides the page's value.
TINY = {
    "profile": ["-n", "24", "--budget", "120s", "--no-progress"],
    "fit": ["--n-estimators", "20", "--n-seeds", "1", "--workers", "1", "--jobs", "1"],
    "tune": ["--trials", "2", "--polish-passes", "0", "--no-progress"],
    "export": ["--jobs", "1"],
    "validate": ["--steps", "2"],
}


def blocks(kind: str) -> list[str]:
    """The page's fenced blocks of one language, in order."""
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def commands() -> list[list[str]]:
    """Every ``fasttree-tune`` command of the page's bash blocks, split into words."""
    out = []
    for block in blocks("bash"):
        out += [shlex.split(line) for line in block.splitlines() if line.strip()]
    return out


def trees_of_my_server():
    """48 decode steps of a small server: a shared prompt, two requests growing by a token a step."""
    for step in range(48):
        yield KVTree.from_lengths([-1, 0, 0], [200, 20 + step, 30 + step], [1, 2])


def run(argv: list[str]) -> None:
    assert argv[0] == "fasttree-tune", argv
    assert main([*argv[1:], *TINY.get(argv[1], [])]) == 0, argv


def test_the_page_is_what_the_tests_run():
    subcommands = [c[1] for c in commands()]
    assert subcommands == ["profile", "fit", "tune", "tune", "export", "validate", "confirm"]
    assert len(blocks("python")) == 2  # record; serve
    assert "docs/walkthrough.md" in (ROOT / "README.md").read_text()


def test_walkthrough_cpu_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    record, _ = blocks("python")
    exec(record, {"trees_of_my_server": trees_of_my_server})
    assert len(Path("rec/my_server.jsonl").read_text().splitlines()) == 3  # every 16th of 48 steps
    # the profile's output, measured on a GPU: the smoke traces stand in
    shutil.copytree(ROOT / "traces" / "h200_smoke", "traces/my_gpu")
    for argv in commands():
        if argv[1] not in GPU_COMMANDS:
            run(argv)
    text = capsys.readouterr().out
    assert "held out: the last fifth of each workload" in text
    export = json.loads(Path("my_export.json").read_text())
    targets = sorted(e["target"] for e in export["entries"])
    assert targets == ["runtime", "tree_attention"]
    assert {e["gpu"] for e in export["entries"]} == {"NVIDIA H200"}  # the GPU of the traces the model was fitted on


@pytest.mark.gpu
def test_walkthrough_gpu_steps(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    record, serve = blocks("python")
    exec(record, {"trees_of_my_server": trees_of_my_server})
    for argv in commands():
        run(argv)
    assert json.loads(Path("validated.json").read_text())["cases"]
    namespace: dict = {}
    exec(serve, namespace)
    assert namespace["rt"] is not None and torch.cuda.is_available()
    assert os.path.exists("confirmed.json")


def test_the_readme_use_snippet_runs(tmp_path):
    """README's Use block, on the CPU: the interpreter for the GPU, the H200 for the GPU's name."""
    import inspect
    import subprocess
    import sys

    import fasttree as ft

    readme = (ROOT / "README.md").read_text()
    use = readme.split("## Use", 1)[1]
    (snippet,) = re.findall(r"```python\n(.*?)```", use.split("## Serving", 1)[0], flags=re.S)
    for name in re.findall(r"\bft\.(\w+)", use.split("## Serving", 1)[0]):
        assert hasattr(ft, name), name  # every name the section uses exists
    params = inspect.signature(ft.load_portfolio).parameters
    assert {"gpu", "num_q_heads", "num_kv_heads", "head_dim", "dtype", "target"} <= set(params)
    code = snippet.replace('device="cuda"', 'device="cpu"').replace("torch.cuda.get_device_name()", '"NVIDIA H200"')
    code += "\nassert o.shape == (3, 32, 128) and isinstance(portfolio, ft.Portfolio)\nprint('ok')\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
