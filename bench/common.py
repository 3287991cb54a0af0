"""Helpers shared by the benchmark scripts: environment metadata, atomic writes, anchors."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fasttree
from fasttree.fileio import write_atomic
from fasttree.toolkit.profiler import git_commit
from fasttree.toolkit.timing import graph_time_us

ANCHORS_PATH = Path(__file__).with_name("anchors_h200_paper_suite.json")
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
    """Host-name-free description of the machine and software versions (and the GPU)."""
    env: dict[str, Any] = {
        "processor": platform.processor() or None,
        "machine": platform.machine() or None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "fasttree": fasttree.__version__,
        "git_commit": git_commit(),
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


def write_device_result(path: str | os.PathLike, summary: dict[str, Any], **data: Any) -> None:
    """Print a device A/B's ``summary`` and write ``{"env", **data, "summary"}`` to ``path`` as JSON
    (atomically; ``env`` is :func:`environment` with the GPU)."""
    print(json.dumps(summary, indent=1))
    write_atomic(path, json.dumps({"env": environment(gpu=True), **data, "summary": summary}, indent=1))


def geomean(x) -> float:
    """Geometric mean of the positive values ``x`` (NaN when there are none)."""
    x = np.asarray(list(x), dtype=np.float64)
    return float(np.exp(np.log(x).mean())) if x.size else float("nan")


def checked_graph_time(
    plan: fasttree.Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sample: np.ndarray, ref: torch.Tensor
) -> dict[str, float]:
    """``{"graph_us", "err"}`` of ``fasttree.tree_attention`` on ``plan``: one call's median GPU
    time by CUDA-graph replay, and the worst relative error of the query rows ``sample`` against
    their float64 reference ``ref`` (as :func:`random_case` gives them), the output poisoned
    with NaN before the first call."""
    out = torch.full_like(q, float("nan"))

    def call() -> torch.Tensor:
        return fasttree.tree_attention(q, k, v, plan, out=out)

    call()
    torch.cuda.synchronize()
    err = fasttree.max_relative_error(out[torch.as_tensor(sample, device=out.device)], ref)
    return {"graph_us": graph_time_us(call)["median"], "err": err}


def serving_inputs(
    trees: list[fasttree.KVTree], num_q_heads: int, num_kv_heads: int, head_dim: int, seed: int = 7
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v, out)`` on the GPU for timing every tree of ``trees`` through one runtime: fp16
    N(0, 1) ``q`` [rows, Hq, D] (rows: the most queries of a tree), pools ``k``/``v`` [slots, Hkv, D]
    holding every tree's slots (one generator seeded ``seed``, drawn in that order), ``out`` like q."""
    slots = max(t.max_slot for t in trees) + 1
    rows = max(t.n_queries for t in trees)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, num_q_heads, head_dim, generator=gen, device="cuda", dtype=torch.float16)
    k = torch.randn(slots, num_kv_heads, head_dim, generator=gen, device="cuda", dtype=torch.float16)
    v = torch.randn(slots, num_kv_heads, head_dim, generator=gen, device="cuda", dtype=torch.float16)
    return q, k, v, torch.empty_like(q)


def time_serving_trees(config, trees: list[fasttree.KVTree], q, k, v, out) -> dict[str, float]:
    """Summed graph-replay medians (us) over ``trees`` of ``TreeAttentionRuntime.forward`` (one
    runtime sized for them, each tree planned into it) and of ``tree_attention`` on each tree's
    ``fasttree.plan`` with ``config``, and the worst relative error of either against the float64
    reference (outputs poisoned first). Inputs as :func:`serving_inputs` makes them."""
    from fasttree.runtime import TreeAttentionRuntime

    rows, hq, d = q.shape
    slots, hkv = k.shape[0], k.shape[1]
    rt = TreeAttentionRuntime(
        config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=q.dtype, device=q.device,
        max_queries=rows, max_kv_entries=8 * slots, max_units=1 << 16, max_partial_rows=64 * rows,
        pool_slots=slots, extend_steps=0,
    )  # fmt: skip
    runtime_us = per_plan_us = 0.0
    errs = []
    for tree in trees:
        n = tree.n_queries
        plan = fasttree.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        rt.plan(tree)
        runtime_us += graph_time_us(lambda: rt.forward(q, k, v, out=out))["median"]
        ref = fasttree.reference_attention(q[:n], k, v, tree)
        out.fill_(float("nan"))
        rt.forward(q, k, v, out=out)
        errs.append(fasttree.max_relative_error(out[:n], ref))
        qn = q[:n].contiguous()
        o2 = torch.full_like(qn, float("nan"))
        per_plan_us += graph_time_us(lambda plan=plan, qn=qn, o2=o2: fasttree.tree_attention(qn, k, v, plan, out=o2))[
            "median"
        ]
        errs.append(fasttree.max_relative_error(o2, ref))
    return {"runtime_us": runtime_us, "tree_attention_us": per_plan_us, "max_err": max(errs)}


def seed_range(text: str) -> range:
    """An argparse type: ``FIRST:END`` as ``range(FIRST, END)`` with ``0 <= FIRST < END``."""
    first, _, end = text.partition(":")
    try:
        seeds = range(int(first), int(end))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:END seeds, got {text!r}") from None
    if seeds.start < 0 or not seeds:
        raise argparse.ArgumentTypeError(f"expected 0 <= FIRST < END, got {text!r}")
    return seeds


@contextmanager
def switched(module, attr: str, value) -> Iterator[None]:
    """Set ``module.attr`` (an A/B switch) to ``value`` for the ``with`` block, then restore it."""
    old = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, old)


def timed_in_turn(
    calls: Mapping[str, Callable[[], dict[str, float]]], rounds: int, *, keep_errors: bool = False
) -> dict[str, dict[str, Any]]:
    """Time each of ``calls`` (name -> a call returning ``{"graph_us", "err"}``, as
    :func:`checked_graph_time`) ``rounds`` times in turn (A, B, A, B, ...: the GPU's drift falls on
    every call alike). Per name: the median ``graph_us``, the worst ``err`` and, when ``rounds > 1``,
    every round's time (``graph_us_rounds``). With ``keep_errors`` a call that raises (a variant that
    does not compile) is recorded as ``{"error": ...}`` and not called again."""
    timings: dict[str, list[dict[str, float]]] = {name: [] for name in calls}
    failed: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for name, call in calls.items():
            if name in failed:
                continue
            try:
                timings[name].append(call())
            except Exception as e:
                if not keep_errors:
                    raise
                failed[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    out: dict[str, dict[str, Any]] = {}
    for name in calls:
        if name in failed:
            out[name] = failed[name]
            continue
        times = [t["graph_us"] for t in timings[name]]
        out[name] = {"graph_us": float(np.median(times)), "err": max(t["err"] for t in timings[name])}
        if rounds > 1:
            out[name]["graph_us_rounds"] = times
    return out


def random_case(
    tree: fasttree.KVTree, num_q_heads: int, num_kv_heads: int, head_dim: int, seed: int, samples: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, torch.Tensor]:
    """``(q, k, v, sample, ref)`` of one device benchmark case: fp16 N(0, 1) inputs on the GPU
    (one generator seeded ``seed``, drawn in that order), up to ``samples`` sorted query rows
    drawn with numpy's ``seed``, and their float64 reference outputs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tree.n_queries, num_q_heads, head_dim, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(tree.max_slot + 1, num_kv_heads, head_dim, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(k.shape, device="cuda", dtype=torch.float16, generator=gen)
    n = min(samples, tree.n_queries)
    sample = np.sort(np.random.default_rng(seed).choice(tree.n_queries, n, replace=False))
    return q, k, v, sample, fasttree.reference_attention(q, k, v, tree, queries=sample)
