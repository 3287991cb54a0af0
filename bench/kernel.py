"""Kernel benchmark of tree attention on the FastTree paper suite (needs a CUDA GPU).

The benchmark lives in the package (:mod:`fasttree.toolkit.kernel_bench`, also run by
``fasttree-tune bench``); this module is its entry point from a source checkout. Run from the
repository root::

    python -m bench.kernel --suite paper [--heads mha,gqa4,gqa16] [--cases 1-15] [--out docs/results]
"""

from __future__ import annotations

from fasttree.toolkit.kernel_bench import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m bench.kernel"))
