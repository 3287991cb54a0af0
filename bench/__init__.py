"""Benchmark scripts for fasttree (run as ``python -m bench.<name>`` from the repo root)."""
