"""The user's own loop through ``fasttree-tune``'s real entry point: fast start, one output convention, outputs
checked before any work, clean interrupts and errors, held-out workloads of the user's own workloads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_version_imports_neither_torch_nor_triton():
    code = (
        "import sys\n"
        "from fasttree.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'optuna', 'sklearn') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    seconds = time.perf_counter() - t0
    assert "fasttree-tune 0.1.0" in done.stdout
    assert "heavy: []" in done.stdout, done.stdout
    assert seconds < 5  # 0.3 s alone; generous for a loaded 2-core machine (the import check is the real test)
