"""The package's architecture as tests: no import cycles, a serving path that imports nothing of
the offline toolkit, and no product module importing from ``bench/``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Source folder of each installed package (``pyproject.toml``'s package-dir).
PACKAGE_DIRS = {
    "fasttree": ROOT / "fasttree",
    "fasttree.kernels": ROOT / "kernels",
    "fasttree.costmodel": ROOT / "costmodel",
    "fasttree.tuner": ROOT / "tuner",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every module's imports of other modules of the project (at any depth: lazy imports count)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node)
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    deps.add(name)
        graph[module] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    graph = _imports(_modules())
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_product_code_never_imports_bench():
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "bench":
                raise AssertionError(f"{module} imports {node.module}")
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "bench" for a in node.names), module


#: Packages of the offline toolkit and the CLI, which the serving path must not import.
OFFLINE = ("fasttree.toolkit", "fasttree.cli", "fasttree.costmodel", "fasttree.tuner")


def test_serving_modules_import_no_offline_module():
    graph = _imports(_modules())
    serving = [m for m in graph if m.startswith("fasttree") and not m.startswith(OFFLINE) and m != "fasttree.__main__"]
    for m in serving:
        bad = sorted(d for d in graph[m] if d.startswith(OFFLINE))
        assert not bad, f"{m} imports {bad}"


def test_import_fasttree_loads_only_torch_triton_numpy():
    """``import fasttree`` and a runtime load no package beyond what torch, triton and numpy bring,
    and no module of the offline toolkit."""
    code = (
        "import sys, numpy, torch, triton, triton.language; before = set(sys.modules); "
        "import fasttree, fasttree.runtime; "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    ours = [m for m in loaded if m.startswith(OFFLINE)]
    assert not ours, ours
    for banned in ("sklearn", "optuna", "scipy", "matplotlib", "tqdm", "skops", "bench"):
        assert not any(m == banned or m.startswith(banned + ".") for m in loaded), banned
