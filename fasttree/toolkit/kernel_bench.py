"""Kernel benchmark of tree attention on the FastTree paper suite (needs a CUDA GPU).

For every case (15 trees x heads 32/32, 32/8, 16/1 by default; head_dim 128, fp16),
measured in one run on random N(0, 1) inputs:

* host planning time (median) and plan upload time;
* each variant's GPU time by CUDA-graph replay (20 calls per graph, median / 20; the variants'
  replays interleaved in rounds, so a drift of the clocks reaches them alike; with
  ``--instances N`` each of our variants is timed as N independent instances, each with its own
  allocations, and its time is the median of theirs) and its
  eager time (``do_bench`` median; for ``fasttree`` also 20 eager calls back to back, timed
  like the replay): ``fasttree`` (default config), the ablations
  ``no_greedy`` (gamma = -10), ``query_centric`` (gamma = 10, split 81920) and
  ``no_split`` (no long-context split), ``query_separated`` (FlashDecoding-style split-KV
  per query), ``sdpa`` (torch SDPA over per-query duplicated KV; skipped when the
  duplicated KV would not fit), ``tuned`` (the member of the ``--export`` entry's portfolio
  for this GPU and head shape that its selector picks for the case's tree; skipped when the
  export has no entry, or one tuned for other kernels or defaults) and ``runtime`` (the serving path:
  :class:`fasttree.runtime.TreeAttentionRuntime` with the default config, the case's tree
  planned and uploaded, its fixed launches replayed); on request (``--variants``; not run by
  default) the peers ``flashinfer_decode`` (FlashInfer's batch decode over each query's whole
  path, page size 1) and ``flashinfer_cascade`` (its multi-level cascade, one level per depth),
  see :mod:`.flashinfer_baseline`: skipped with the reason when FlashInfer cannot be imported,
  each call first run in a child process so that a crash of theirs is recorded per case (one the
  probe missed, in the timed process, fails that peer on that case and the run goes on from the
  case in a fresh process); and with ``--candidate FIELD=VALUE;...`` the variant ``candidate``:
  ``FastTreeConfig()`` and ``PlanRules.defaults()`` with those fields changed, planned and launched
  as ``fasttree`` is (the A/B of a change to the defaults; the summary gives ``candidate_vs_fasttree`` and
  ``candidate_vs_query_separated``);
* every variant's worst per-query relative error against the float64 reference on a
  sample of queries (outputs poisoned with NaN first);
* the roofline floor ``max(min_bytes / 4.8 TB/s, flops / 700 TFLOP/s)`` as the anchors
  file defines it, and the published FastTree kernel's times from that file.

Writes ``kernel_<label>.json`` (with environment metadata), ``kernel_<label>.md`` and
``kernel_<label>.png`` under ``--out`` (default ``docs/results``, ``kernel_h200.*``). The
``tuned`` variant reads ``--export`` (default ``docs/tune/export.json`` in the working folder, as a
source checkout has it; without that file the variant is skipped). Run as
``fasttree-tune bench -- ARGS``, or from the repository root::

    python -m bench.kernel --suite paper [--heads mha,gqa4,gqa16] [--cases 1-15] [--out docs/results]

``--suite heldout --seed S --trees N [--shapes 8x1/d256/bf16,...] [--families random_recursive,...]
[--family-params JSON]`` draws ``N`` fresh trees of every family, or of those named with the size ranges
the JSON narrows (:func:`.family_suite.heldout_cases`), instead of a fixed suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fasttree as ft

from ..export import ConfigExport, read_export
from ..fileio import write_atomic
from ..launch_rules import GpuTarget, stage1_launches
from ..runtime import TreeAttentionRuntime
from .bench_cases import case_inputs, case_key, probe_item
from .bench_common import DTYPES, HBM_BYTES_PER_S, TENSOR_FLOPS, TOL, anchor_rows, environment, geomean
from .family_suite import HELDOUT_SHAPES, SUITES, FamilyCase, family_tree, format_shape, heldout_cases, parse_shape
from .suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from .timing import eager_loop_time_us, eager_time_us, graph_cold_time_us, interleaved_graph_times_us

log = logging.getLogger("fasttree.toolkit.kernel_bench")

#: The tuner's export the ``tuned`` variant reads by default, relative to the working folder.
DEFAULT_EXPORT = "docs/tune/export.json"

SDPA_MAX_BYTES = 40e9
#: FlashInfer's kernels (:mod:`.flashinfer_baseline`, imported only when one of them is asked for).
PEER_VARIANTS = ("flashinfer_decode", "flashinfer_cascade")
#: The variants run when ``--variants`` is not given: ours and the torch baselines.
DEFAULT_VARIANTS = ("fasttree", "no_greedy", "query_centric", "no_split", "query_separated", "sdpa", "tuned", "runtime")
#: The variant of ``--candidate``: the defaults with some fields changed (run only when given).
CANDIDATE = "candidate"
#: Every variant ``--variants`` accepts.
VARIANTS = DEFAULT_VARIANTS + PEER_VARIANTS + (CANDIDATE,)


def roofline_floor_us(tree: ft.KVTree, hq: int, hkv: int, d: int, elem_bytes: int = 2) -> dict[str, float]:
    """The anchors' floor: unique KV read once, q read and o written once; 4 flops per
    (query, context token, q head, dim)."""
    min_bytes = tree.num_tokens * hkv * d * 2 * elem_bytes + tree.n_queries * hq * d * elem_bytes * 2
    flops = 4 * float(tree.path_lengths[tree.query_nodes].sum()) * hq * d
    bw = min_bytes / HBM_BYTES_PER_S * 1e6
    tc = flops / TENSOR_FLOPS * 1e6
    return {"floor_us": max(bw, tc), "floor_bandwidth_us": bw, "floor_tensor_core_us": tc, "min_bytes": min_bytes}


def variant_configs(base: ft.FastTreeConfig) -> dict[str, ft.FastTreeConfig]:
    huge = 1 << 30
    return {
        "fasttree": base,
        "no_greedy": base.with_(gamma=-10.0),
        "query_centric": base.with_(gamma=10.0, kv_split_sizes=(81920, 81920)),
        "no_split": base.with_(kv_split_sizes=(huge, huge)),
    }


def sdpa_runner(q, k, v, tree: ft.KVTree) -> Callable[[], torch.Tensor] | None:
    """SDPA over each query's context gathered into its own KV (padded and masked when ragged)."""
    indptr, slots = tree.query_slots()
    lens = np.diff(indptr)
    nq, hq, d = q.shape
    hkv = k.shape[1]
    lmax = int(lens.max())
    if 2 * nq * lmax * hkv * d * q.element_size() > SDPA_MAX_BYTES:
        return None
    idx = np.zeros((nq, lmax), dtype=np.int64)
    valid = np.arange(lmax)[None, :] < lens[:, None]
    idx[valid] = slots
    idx_t = torch.from_numpy(idx).to(q.device)
    kd = k[idx_t].permute(0, 2, 1, 3).contiguous()  # [nq, Hkv, Lmax, D]
    vd = v[idx_t].permute(0, 2, 1, 3).contiguous()
    qd = q.unsqueeze(2)  # [nq, Hq, 1, D]
    mask = None if bool(valid.all()) else torch.from_numpy(valid).to(q.device)[:, None, None, :]
    gqa = hq != hkv

    def call() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=gqa).squeeze(2)

    return call


def tuned_config(
    export: ConfigExport | None, tree: ft.KVTree, *, gpu: str, hq: int, hkv: int, d: int, dtype: torch.dtype
) -> tuple[ft.FastTreeConfig, int] | None:
    """The ``tuned`` variant's config for ``tree``: the member of the export's ``tree_attention``
    portfolio for this GPU and head shape that its selector picks, and the member's index; None
    when the export has no entry for the shape (or one tuned for other kernels or defaults)."""
    if export is None:
        return None
    portfolio, entry = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    if entry is None:
        return None
    return portfolio.select(tree), portfolio.member_of(tree)


def worst_rel_error(out: torch.Tensor, ref: torch.Tensor, rows: np.ndarray) -> float:
    """Worst per-query relative error of ``out[rows]`` against the float64 ``ref``."""
    return ft.max_relative_error(out[torch.as_tensor(rows, device=out.device)], ref)


def bench_case(case: int, heads: str, args: argparse.Namespace, anchors: dict) -> dict[str, Any]:
    """One paper-suite case (tree ``case`` at head setting ``heads``) at ``args``' head dim and dtype."""
    hq, hkv = PAPER_HEADS[heads]
    return bench_tree(
        paper_tree(case), case, heads, hq, hkv, args.head_dim, args.dtype, args, anchors.get((case, heads)), case
    )


def bench_family_case(fc: FamilyCase, args: argparse.Namespace) -> dict[str, Any]:
    """One case of the families suite (:mod:`.family_suite`)."""
    hq, hkv = fc.heads
    return bench_tree(family_tree(fc), fc.name, f"{hq}/{hkv}", hq, hkv, fc.head_dim, fc.dtype, args, None, fc.seed)


def bench_tree(
    tree: ft.KVTree, case: int | str, heads: str, hq: int, hkv: int, d: int, dtype_name: str,
    args: argparse.Namespace, anchor: dict | None, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Every variant of ``args`` on ``tree`` at ``Hq = hq``, ``Hkv = hkv``, head dim ``d`` and dtype
    ``dtype_name``, on random N(0, 1) inputs seeded by ``seed``; ``anchor``: the published
    kernel's row of the anchors file, if any."""
    dtype = DTYPES[dtype_name]
    pool = tree.max_slot + 1
    q, k, v = case_inputs(tree, hq, hkv, d, dtype, seed)
    rows = np.sort(np.random.default_rng(seed).choice(tree.n_queries, min(tree.n_queries, 64), replace=False))
    ref = ft.reference_attention(q, k, v, tree, queries=rows)
    row: dict[str, Any] = {
        "case": case,
        "heads": heads,
        "num_q_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": d,
        "dtype": dtype_name,
        "n_queries": tree.n_queries,
        "unique_kv_tokens": tree.num_tokens,
        **roofline_floor_us(tree, hq, hkv, d, q.element_size()),
    }
    if anchor and d == 128 and dtype == torch.float16:
        row["published_graph_us"] = anchor["published_fasttree_graph_us"]
        row["published_eager_us"] = anchor["published_fasttree_eager_us"]
        row["published_plan_ms"] = anchor["published_fasttree_plan_ms"]
        row["anchor_sdpa_us"] = anchor["sdpa_duplicated_kv_us"]

    # planning and upload of the default plan
    base = ft.FastTreeConfig()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        plan = ft.plan(tree, base, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        times.append(time.perf_counter() - t0)
    row["plan_ms"] = float(np.median(times)) * 1e3
    up = []
    for _ in range(10):  # the one host-to-device copy plan.to makes on a plan's first upload
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ft.DevicePlan.upload(plan, "cuda")
        torch.cuda.synchronize()
        up.append(time.perf_counter() - t0)
    row["upload_us"] = float(np.median(up)) * 1e6
    row["plan"] = plan.stats()

    runners: dict[str, Callable[[], torch.Tensor] | None] = {}
    outs: dict[str, torch.Tensor] = {}
    skipped: dict[str, str] = {}  # variant -> why it did not run
    failed: dict[str, str] = {}  # variant -> the error it raised (a peer's failure, recorded per case)
    # each of our variants as a maker of independent instances (own plan arrays, workspace and output)
    makers: dict[str, Callable[[], tuple[Callable[[], object], torch.Tensor]]] = {}

    def plan_instance(p: ft.Plan) -> tuple[Callable[[], object], torch.Tensor]:
        o = torch.empty_like(q)
        return (lambda: ft.tree_attention(q, k, v, p, out=o)), o

    def add_planned(name: str, p: ft.Plan, make_plan: Callable[[], ft.Plan]) -> None:
        """Variant ``name``: plan ``p`` is its first instance, ``make_plan()`` plans each further one."""
        runners[name], outs[name] = plan_instance(p)
        makers[name] = lambda: plan_instance(make_plan())

    for name, cfg in variant_configs(base).items():
        if name not in args.variants:
            continue
        make_plan = functools.partial(ft.plan, tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        p = plan if name == "fasttree" else make_plan()
        add_planned(name, p, make_plan)
        row.setdefault("variant_plans", {})[name] = {"tile_mode": p.tile_mode, "units": p.units_per_class()}
    candidate = getattr(args, "candidate", None)
    if CANDIDATE in args.variants and candidate is not None:
        candidate_plan = functools.partial(
            ft.plan, tree, candidate[0], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rules=candidate[1]
        )
        p = candidate_plan()
        add_planned(CANDIDATE, p, candidate_plan)
        target = GpuTarget.of(q.device, interpreting=False)
        row.setdefault("variant_plans", {})[CANDIDATE] = {
            "tile_mode": p.tile_mode, "units": p.units_per_class(), **_compared_with_defaults(plan, p, target),
        }  # fmt: skip
    if "query_separated" in args.variants:
        sms = torch.cuda.get_device_properties(0).multi_processor_count

        qs_plan = functools.partial(
            ft.plan_query_separated, tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, num_sms=sms
        )
        add_planned("query_separated", qs_plan(), qs_plan)
    if "sdpa" in args.variants:
        runners["sdpa"] = sdpa_runner(q, k, v, tree)
        if runners["sdpa"] is None:
            skipped["sdpa"] = "duplicated KV would not fit"
    if "tuned" in args.variants:
        picked = tuned_config(args.export, tree, gpu=torch.cuda.get_device_name(0), hq=hq, hkv=hkv, d=d, dtype=dtype)
        if picked is None:
            runners["tuned"] = None
            skipped["tuned"] = "no export entry"
        else:
            tuned, member = picked
            tuned_plan = functools.partial(ft.plan, tree, tuned, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
            p = tuned_plan()
            add_planned("tuned", p, tuned_plan)
            row.setdefault("variant_plans", {})["tuned"] = {
                "tile_mode": p.tile_mode, "units": p.units_per_class(), "member": member,
            }  # fmt: skip
    if "runtime" in args.variants:

        def new_runtime() -> TreeAttentionRuntime:
            rt = TreeAttentionRuntime(
                base, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda",
                max_queries=tree.n_queries, max_kv_entries=int(tree.path_lengths[tree.query_nodes].sum()),
                pool_slots=pool,
            )  # fmt: skip
            rt.plan(tree)
            return rt

        def runtime_instance(rt: TreeAttentionRuntime) -> tuple[Callable[[], object], torch.Tensor]:
            o = torch.empty_like(q)
            return (lambda: rt.forward(q, k, v, out=o)), o

        rt = new_runtime()
        runners["runtime"], outs["runtime"] = runtime_instance(rt)
        makers["runtime"] = lambda: runtime_instance(new_runtime())
        uploaded = rt.current_plan
        row.setdefault("variant_plans", {})["runtime"] = {
            "variant_id": uploaded.variant_id, "units": uploaded.plan.units_per_class(), "bounded": uploaded.bounded,
            "same_plan_as_fasttree": bool(np.array_equal(uploaded.plan.kv_indices, plan.kv_indices)),
        }  # fmt: skip
    for name in (n for n in PEER_VARIANTS if n in args.variants):
        peer = _peer_runner(name, q, k, v, tree, getattr(args, "peer_status", {}).get((case_key(case, heads), name)))
        if isinstance(peer, str):
            (failed if peer.startswith("error: ") else skipped)[name] = peer.removeprefix("error: ")
            runners[name] = None
            continue
        runners[name] = peer.call
        if peer.out is not None:  # poisoned before the correctness call, as ours are
            outs[name] = peer.out
        row.setdefault("variant_plans", {})[name] = peer.info

    results: dict[str, Any] = {}
    # more instances of each of our variants (--instances): each times its own allocations
    instances: dict[str, list[tuple[Callable[[], object], torch.Tensor]]] = {}
    for name, make in makers.items():
        if runners.get(name) is not None:
            instances[name] = [(runners[name], outs[name])] + [make() for _ in range(getattr(args, "instances", 1) - 1)]
    timed = {name: fn for name, fn in runners.items() if fn is not None}
    for name, inst in instances.items():
        timed.update({f"{name}@{i}": fn for i, (fn, _) in enumerate(inst) if i})
    # graph times of the variants, replays interleaved (their ratios are the benchmark's findings)
    graph_times = interleaved_graph_times_us(timed, min_rounds=sum(fn is not None for fn in runners.values()))
    for name, fn in runners.items():
        if fn is None:
            results[name] = {"error": failed[name], "correct": False} if name in failed else {"skipped": skipped[name]}
            continue
        errs = []
        for run, out in instances.get(name, [(fn, outs.get(name))]):
            if out is not None:
                out.fill_(float("nan"))
                run()
            else:
                out = run()
            torch.cuda.synchronize()
            errs.append(worst_rel_error(out, ref, rows) if bool(torch.isfinite(out).all()) else float("nan"))
        err = float("nan") if any(math.isnan(x) for x in errs) else max(errs)
        times = [graph_times[name]] + [graph_times[f"{name}@{i}"] for i in range(1, len(instances.get(name, ())))]
        e = eager_time_us(fn, rep_ms=50)
        results[name] = {
            "graph_us": float(np.median([g["median"] for g in times])),
            "graph_p20_us": float(np.median([g["p20"] for g in times])),
            "graph_p80_us": float(np.median([g["p80"] for g in times])),
            "eager_us": e,
            "max_rel_err": err,
            "correct": not math.isnan(err) and err <= TOL[dtype],
        }
        if len(times) > 1:
            results[name]["graph_instances_us"] = [g["median"] for g in times]
        if name == "fasttree":  # our default call: also eagerly back to back, as the graph runs it, and
            # one graph replay at a time with L2 cleared, as do_bench times the eager call
            results[name]["eager_loop_us"] = eager_loop_time_us(fn)["median"]
            results[name]["graph_cold_us"] = graph_cold_time_us(fn, rep_ms=50)
    row["variants"] = results
    ours = results.get("fasttree", {})
    if "graph_us" in ours:
        row["floor_over_ours"] = row["floor_us"] / ours["graph_us"]
        if "published_graph_us" in row:
            row["speedup_vs_published"] = row["published_graph_us"] / ours["graph_us"]
    for name in ("tuned", "runtime"):
        t = results.get(name, {}).get("graph_us")
        if t is not None and "published_graph_us" in row:
            row[f"speedup_vs_published_{name}"] = row["published_graph_us"] / t
    runners.clear()
    outs.clear()
    torch.cuda.empty_cache()
    return row


class CudaContextLostError(RuntimeError):
    """A CUDA error that left the process's context unusable (an illegal memory access).

    ``variant`` names the FlashInfer peer whose call broke it (None: not a peer's). A peer's is
    recorded as that peer's failure on the case, and the rest of the run continues in a fresh
    process (:func:`main`); any other stops the run with the cases done so far."""

    def __init__(self, message: str, variant: str | None = None) -> None:
        super().__init__(message)
        self.variant = variant


def cuda_context_broken() -> bool:
    """Whether the current CUDA context is unusable (a device synchronisation raises)."""
    try:
        torch.cuda.synchronize()
    except Exception:  # the sticky error of an illegal access, whatever torch's class for it
        return True
    return False


def _peer_runner(name: str, q, k, v, tree: ft.KVTree, status: str | None):
    """Peer variant ``name`` planned on this case, or why not: ``"error: ..."`` when it failed (in the
    probe, ``status``, or here: planning or its first eager call raised), else a skip reason."""
    if status is not None:
        return status
    from . import flashinfer_baseline as fib

    fi, reason = fib.import_flashinfer()
    if fi is None:
        return reason
    try:
        runner = fib.make_runner(name, q, k, v, tree)
        runner.call()  # its first call eagerly, before any capture (an error here is this case's alone)
        torch.cuda.synchronize()
    except Exception as exc:  # a peer's failure is a finding of the run, recorded on its row
        if cuda_context_broken():  # ... unless it took the process's CUDA context with it
            raise CudaContextLostError(
                f"{name} broke the CUDA context ({type(exc).__name__}: {exc})"[:600], variant=name
            ) from exc
        log.warning("%s failed: %s", name, exc)
        return f"error: {type(exc).__name__}: {exc}"[:600]
    return runner


def peer_status(items: list[dict[str, Any]], variants: list[str]) -> dict[tuple[str, str], str]:
    """Before the run: ``(case key, variant) -> status`` of the peer variants in ``variants`` that must
    not run in this process: their skip reason when FlashInfer cannot be imported (every case), or
    ``"error: ..."`` for each call that failed in the child-process probe
    (:func:`.flashinfer_baseline.probe`). Empty when no peer variant is asked for."""
    peers = [n for n in PEER_VARIANTS if n in variants]
    if not peers:
        return {}
    from . import flashinfer_baseline as fib

    fi, reason = fib.import_flashinfer()
    if fi is None:
        log.warning("%s: %s skipped", reason, ", ".join(peers))
        return {(item["key"], name): reason for item in items for name in peers}
    log.info("flashinfer %s: probing %d calls in child processes", fib.flashinfer_version(), len(items) * len(peers))
    t0 = time.perf_counter()
    failures = fib.probe(items, peers)
    log.info("probe done in %.0f s, %d failed", time.perf_counter() - t0, len(failures))
    return {key: f"error: {err}" for key, err in failures.items()}


def _eager_gaps(rows: list[dict[str, Any]], key: str) -> list[float]:
    """Our default call's eager time ``key`` minus its graph time, over the rows that have both (us)."""
    out = []
    for r in rows:
        ours = r["variants"].get("fasttree", {})
        if key in ours and "graph_us" in ours:
            out.append(ours[key] - ours["graph_us"])
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    s: dict[str, Any] = {"n_cases": len(rows)}
    sp = [r["speedup_vs_published"] for r in rows if "speedup_vs_published" in r]
    if sp:
        worst = min(rows, key=lambda r: r.get("speedup_vs_published", math.inf))
        s["geomean_speedup_vs_published"] = geomean(sp)
        s["min_speedup_vs_published"] = min(sp)
        s["min_speedup_case"] = f"{worst['case']}/{worst['heads']}"
        s["cases_slower_than_published"] = sum(x < 1 for x in sp)
    for name in ("tuned", "runtime"):
        sp_v = [r[f"speedup_vs_published_{name}"] for r in rows if f"speedup_vs_published_{name}" in r]
        if sp_v:
            s[f"geomean_speedup_vs_published_{name}"] = geomean(sp_v)
            s[f"min_speedup_vs_published_{name}"] = min(sp_v)
            s[f"n_cases_{name}"] = len(sp_v)
    spreads = [
        (max(v["graph_instances_us"]) / min(v["graph_instances_us"]), f"{r['case']}/{r['heads']}/{name}")
        for r in rows
        for name, v in r["variants"].items()
        if v.get("graph_instances_us")
    ]
    if spreads:  # slowest over fastest instance of one variant on one case
        s["instance_spread"] = {
            "median": float(np.median([x for x, _ in spreads])),
            "worst": max(spreads)[0],
            "worst_case": max(spreads)[1],
            "n": len(spreads),
        }
    big = [r["floor_over_ours"] for r in rows if r["floor_us"] >= 20 and "floor_over_ours" in r]
    s["n_floor_ge_20us"] = len(big)
    s["geomean_floor_over_ours_floor_ge_20us"] = geomean(big) if big else None
    gaps = _eager_gaps(rows, "eager_us")
    s["max_eager_minus_graph_us"] = max(gaps) if gaps else None
    cold = [
        ours["eager_us"] - ours["graph_cold_us"]
        for ours in (r["variants"].get("fasttree", {}) for r in rows)
        if "eager_us" in ours and "graph_cold_us" in ours
    ]
    if cold:
        s["max_eager_minus_graph_cold_us"] = max(cold)
        s["median_eager_minus_graph_cold_us"] = float(np.median(cold))
    loop_gaps = _eager_gaps(rows, "eager_loop_us")
    if loop_gaps:
        s["max_eager_loop_minus_graph_us"] = max(loop_gaps)
        s["median_eager_loop_minus_graph_us"] = float(np.median(loop_gaps))
    # ours and the torch baselines (the exit status); a peer's wrong result or failure is a finding, listed below
    s["all_correct"] = all(
        v.get("correct", True) for r in rows for name, v in r["variants"].items() if name not in PEER_VARIANTS
    )
    losses = []
    for r in rows:
        ours = r["variants"].get("fasttree", {}).get("graph_us")
        for other in ("query_separated", "sdpa", *PEER_VARIANTS):
            t = r["variants"].get(other, {}).get("graph_us")
            if ours is not None and t is not None and t < ours:
                losses.append(f"{r['case']}/{r['heads']} vs {other}: {ours:.1f} > {t:.1f} us")
    s["losses_to_baselines"] = losses
    s.update(_ratio_summary(rows))
    s.update(_peer_summary(rows))
    same = [r for r in rows if r.get("variant_plans", {}).get("runtime", {}).get("same_plan_as_fasttree")]
    if same:  # the runtime's launches alone: the rows it planned as tree_attention did (no capacity retry)
        s["runtime_vs_fasttree_same_plan"] = _ratio_summary(same).get("runtime_vs_fasttree")
    changed = [r for r in rows if _candidate_changes(r)]
    if any(CANDIDATE in r["variants"] for r in rows):  # the candidate where it changes the plan or a launch
        s["candidate_changed_cases"] = len(changed)
        s["candidate_vs_fasttree_where_changed"] = _ratio_summary(changed).get("candidate_vs_fasttree")
    return s


def _candidate_changes(row: dict[str, Any]) -> bool:
    """Whether the candidate's plan or stage-1 launches differ from the defaults' on ``row``: False
    without a candidate, True where its record lacks either comparison."""
    info = row.get("variant_plans", {}).get(CANDIDATE)
    if info is None:
        return False
    return not (info.get("same_plan_as_fasttree", False) and info.get("same_launches_as_fasttree", False))


#: Ratios the summary reports, as (key, faster variant's time in the numerator, slower's in the denominator):
#: ``runtime_vs_fasttree`` is tree_attention's time over the runtime's (>= 1: the runtime as fast).
_RATIOS = (
    ("runtime_vs_fasttree", "fasttree", "runtime"),
    ("fasttree_vs_query_separated", "query_separated", "fasttree"),
    ("runtime_vs_query_separated", "query_separated", "runtime"),
    ("candidate_vs_fasttree", "fasttree", CANDIDATE),
    ("candidate_vs_query_separated", "query_separated", CANDIDATE),
)


def _ratio(row: dict[str, Any], num: str, den: str) -> float | None:
    """``num``'s graph time over ``den``'s in ``row`` (None when either is missing)."""
    a = row["variants"].get(num, {}).get("graph_us")
    b = row["variants"].get(den, {}).get("graph_us")
    return None if a is None or b is None else a / b


def _ratio_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geomean, worst case and count below 0.97 of each of :data:`_RATIOS` over the rows with both times."""
    out: dict[str, Any] = {}
    for key, num, den in _RATIOS:
        pairs = [(_ratio(r, num, den), f"{r['case']}/{r['heads']}") for r in rows]
        pairs = [(p, name) for p, name in pairs if p is not None]
        if not pairs:
            continue
        worst = min(pairs)
        out[key] = {
            "geomean": geomean([p for p, _ in pairs]), "worst": worst[0], "worst_case": worst[1],
            "below_0.97": sum(p < 0.97 for p, _ in pairs), "n": len(pairs),
        }  # fmt: skip
    return out


def _peer_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per peer variant that appears in ``rows`` (``fasttree_vs_<peer>``): its graph time over ours
    (> 1: ours faster) as geomean, worst case and the cases where ours is slower, the same of the
    eager times, and the cases where the peer failed, was wrong or was skipped (with why)."""
    out: dict[str, Any] = {}
    for peer in PEER_VARIANTS:
        entries = [(case_key(r["case"], r["heads"]), r["variants"][peer], r["variants"].get("fasttree", {}))
                   for r in rows if peer in r["variants"]]  # fmt: skip
        if not entries:
            continue
        s: dict[str, Any] = {"n_cases": len(entries)}
        for kind in ("graph_us", "eager_us"):
            pairs = [(v[kind] / ours[kind], key) for key, v, ours in entries if kind in v and kind in ours]
            if not pairs:
                continue
            worst = min(pairs)
            prefix = kind.removesuffix("_us")
            s[f"{prefix}_n"] = len(pairs)
            s[f"{prefix}_geomean"] = geomean([p for p, _ in pairs])
            s[f"{prefix}_worst"] = worst[0]
            s[f"{prefix}_worst_case"] = worst[1]
            s[f"{prefix}_ours_slower"] = [f"{key} ({p:.3f})" for p, key in pairs if p < 1]
        s["failed"] = [f"{key}: {v['error']}" for key, v, _ in entries if "error" in v]
        s["wrong"] = [f"{key}: max_rel_err {v['max_rel_err']:.2e}" for key, v, _ in entries
                      if "max_rel_err" in v and not v.get("correct", True)]  # fmt: skip
        skips = sorted({v["skipped"] for _, v, _ in entries if "skipped" in v})
        s["skipped"] = {why: sum(v.get("skipped") == why for _, v, _ in entries) for why in skips}
        out[f"fasttree_vs_{peer}"] = s
    return out


def _f(x, fmt=".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(rows, summary, env, label, instances: int = 1) -> str:
    names = [n for n in VARIANTS if any(n in r["variants"] for r in rows)]
    head = (
        "| case | heads | floor us | published us | "
        + " | ".join(names)
        + " | eager | graph cold | eager loop | speedup | floor/ours | runtime/ours |"
    )
    lines = [
        f"# Tree-attention kernel benchmark ({label})",
        "",
        f"{env.get('gpu_name')} ({env.get('gpu_sm_count')} SMs), torch {env.get('torch')}, triton {env.get('triton')}, "
        f"commit {(env.get('git_commit') or 'unknown')[:12]}, {env['timestamp_utc']}. "
        "GPU time in us by CUDA-graph replay (20 calls per graph, median / 20); eager = do_bench median "
        "of our default call (one call at a time, L2 cleared before each); graph cold = the same call replayed "
        "from a CUDA graph, timed as eager is (one at a time, L2 cleared); eager loop = 20 of our default calls "
        "issued back to back without a graph, timed like the replay (median / 20); runtime/ours = our default "
        "call's time over the runtime's (>= 1: the runtime as fast). `x` marks a wrong result, `fail` a call "
        "that raised or crashed (the error is in the JSON and the summary), `skip` one not run (why: the JSON)."
        + (
            f" Each of our variants timed as {instances} independent instances (own plan arrays, workspace and "
            "output), replays interleaved: its time is the median of theirs (`graph_instances_us` in the JSON)."
            if instances > 1
            else ""
        ),
        "",
        head,
        "|" + "---:|" * (len(names) + 10),
    ]
    if summary.get("stopped"):
        lines[2:2] = [f"**Incomplete run**: {summary['stopped']}", ""]
    for r in rows:
        cells = []
        for n in names:
            v = r["variants"].get(n, {})
            if "skipped" in v or "error" in v:
                cells.append("skip" if "skipped" in v else "fail")
                continue
            cells.append(_f(v.get("graph_us")) + ("" if v.get("correct", True) else " x"))
        ours = r["variants"].get("fasttree", {})
        lines.append(
            f"| {r['case']} | {r['heads']} | {_f(r['floor_us'])} | {_f(r.get('published_graph_us'))} | "
            + " | ".join(cells)
            + f" | {_f(ours.get('eager_us'))} | {_f(ours.get('graph_cold_us'))} | {_f(ours.get('eager_loop_us'))}"
            + f" | {_f(r.get('speedup_vs_published'), '.2f')}"
            + f" | {_f(r.get('floor_over_ours'), '.2f')}"
            + f" | {_f(_ratio(r, 'fasttree', 'runtime'), '.3f')} |"
        )
    lines += ["", "Summary:", ""]
    lines += [f"- {k}: {v}" for k, v in summary.items()]
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plot")
        return False
    names = [n for n in VARIANTS if any("graph_us" in r["variants"].get(n, {}) for r in rows)]
    labels = [f"{r['case']}/{r['heads']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.35), 5))
    series = {"published": [r.get("published_graph_us", np.nan) / r["floor_us"] for r in rows]}
    for n in names:
        series[n] = [r["variants"].get(n, {}).get("graph_us", np.nan) / r["floor_us"] for r in rows]
    for n, y in series.items():
        ax.plot(x, y, marker="o", ms=3, lw=1, label=n)
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, labels, rotation=90, fontsize=7)
    ax.set_ylabel("GPU time / roofline floor")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def candidate_changes(fc: FamilyCase, config: ft.FastTreeConfig, rules: ft.PlanRules, target: GpuTarget) -> bool:
    """Whether the candidate (``config``, ``rules``) plans the tree of ``fc`` differently from the
    defaults (its KV entries) or launches its stage 1 differently on ``target``."""
    tree, (hq, hkv) = family_tree(fc), fc.heads
    heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": fc.head_dim}
    default, candidate = ft.plan(tree, **heads), ft.plan(tree, config, **heads, rules=rules)
    return not all(_compared_with_defaults(default, candidate, target).values())


def _compared_with_defaults(default: ft.Plan, candidate: ft.Plan, target: GpuTarget) -> dict[str, bool]:
    """Whether ``candidate`` has the defaults' plan (its KV entries) and stage-1 launches on
    ``target``: a candidate row's ``same_plan_as_fasttree`` and ``same_launches_as_fasttree``."""
    return {
        "same_plan_as_fasttree": bool(np.array_equal(candidate.kv_indices, default.kv_indices)),
        "same_launches_as_fasttree": stage1_launches(candidate, target) == stage1_launches(default, target),
    }


def parse_candidate(text: str) -> tuple[ft.FastTreeConfig, ft.PlanRules]:
    """``FastTreeConfig()`` and ``PlanRules.defaults()`` with the fields of ``text`` changed:
    ``FIELD=VALUE`` pairs separated by ``;``, a pair field's two values by a comma, a bool as
    ``true``/``false`` (``kv_tile=32,32;gamma=0.2``, ``wide_head_kv_tile=32``). ``ValueError`` on an
    unknown field, a bad value, or no change at all."""
    config_fields = {f.name for f in dataclasses.fields(ft.FastTreeConfig)}
    rule_fields = {f.name for f in dataclasses.fields(ft.PlanRules)}
    changes: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq or name not in config_fields | rule_fields:
            raise ValueError(
                f"--candidate {part!r}: expected FIELD=VALUE with FIELD a FastTreeConfig field "
                f"({', '.join(sorted(config_fields))}) or a PlanRules field ({', '.join(sorted(rule_fields))})"
            )
        if value.lower() in ("true", "false"):
            parsed: Any = value.lower() == "true"
        else:
            try:
                numbers = [float(x) if "." in x or "e" in x.lower() else int(x) for x in value.split(",")]
            except ValueError:
                raise ValueError(f"--candidate {part!r}: {value!r} is not a number or a pair of numbers") from None
            parsed = tuple(numbers) if len(numbers) > 1 else numbers[0]
        changes[0 if name in config_fields else 1][name] = parsed
    if not changes[0] and not changes[1]:
        raise ValueError("--candidate names no field")
    config, rules = ft.FastTreeConfig().with_(**changes[0]), ft.PlanRules.defaults().with_(**changes[1])
    if config == ft.FastTreeConfig() and rules == ft.PlanRules.defaults():
        raise ValueError(f"--candidate {text!r} is the defaults")
    return config, rules


def _heldout_draw(args: argparse.Namespace) -> dict[str, Any]:
    """What regenerates a heldout run's trees (:func:`.family_suite.heldout_cases`): seed, count,
    head layouts (``HQxHKV/dD/DTYPE``), families (None: every family) and their parameters."""
    return {
        "seed": args.seed,
        "trees": args.trees,
        "shapes": [format_shape(*shape) for shape in args.shapes],
        "families": [f for f in args.families.split(",") if f] if args.families else None,
        "family_params": _family_params(args.family_params),
    }


def _candidate_dict(config: ft.FastTreeConfig, rules: ft.PlanRules) -> dict[str, Any]:
    """The report's record of a candidate: its config and the rules it changes."""
    defaults = dataclasses.asdict(ft.PlanRules.defaults())
    changed = {k: v for k, v in dataclasses.asdict(rules).items() if v != defaults[k]}
    return {"config": config.to_dict(), "rules": changed}


def _family_params(text: str | None) -> dict[str, Any] | None:
    """``--family-params`` as a dict (JSON lists become tuples, as the generators' ranges are);
    ValueError when it is not a JSON object."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--family-params is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--family-params must be a JSON object, got {text!r}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}


def parse_args(argv=None, *, prog: str = "python -m fasttree.toolkit.kernel_bench") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--suite",
        choices=["paper", *SUITES, "heldout"],
        default="paper",
        help="benchmark suite: the paper's 15 trees at --heads, --head-dim and --dtype; 'families': "
        "other tree families at fixed head shapes, head dims and dtypes; 'crossover': batches with no or "
        "little sharing at tensor-parallel head layouts, where query-separated decode is the bar; "
        "'heldout': --trees fresh trees of every family drawn from --seed at --shapes "
        "(fasttree.toolkit.family_suite; for these --cases, --heads, --head-dim and --dtype do not apply) "
        "(default: paper)",
    )
    p.add_argument("--seed", type=int, default=9000, help="heldout suite: the first tree's seed (default: 9000)")
    p.add_argument("--trees", type=int, default=56, help="heldout suite: number of trees (default: 56)")
    p.add_argument(
        "--shapes",
        default=None,
        help="heldout suite: head layouts HQxHKV/dD/DTYPE, comma separated, used in turn (default: "
        + ",".join(f"{h[0]}x{h[1]}/d{d}/{'bf16' if t == 'bfloat16' else 'fp16'}" for h, d, t in HELDOUT_SHAPES)
        + ")",
    )
    p.add_argument(
        "--families",
        default=None,
        help="heldout suite: tree families, comma separated, used in turn (default: every family)",
    )
    p.add_argument(
        "--family-params",
        default=None,
        metavar="JSON",
        help="heldout suite: keyword parameters every --families generator takes, as a JSON object "
        "(e.g. '{\"context_tokens\": [1024, 4096]}' for no_sharing; default: their own ranges)",
    )
    p.add_argument(
        "--candidate",
        default=None,
        metavar="FIELD=VALUE;...",
        help="time the variant 'candidate': FastTreeConfig() and PlanRules.defaults() with these fields "
        "changed (as 'kv_tile=32,32;num_stages=3,3' or 'wide_head_kv_tile=32'), against the defaults and "
        "query-separated decode",
    )
    p.add_argument(
        "--changed-only",
        action="store_true",
        help="with --candidate, on a family or heldout suite: time only the trees whose candidate plan or "
        "stage-1 launches differ from the defaults' (decided on the host before any timing)",
    )
    p.add_argument("--heads", default=",".join(PAPER_HEADS), help="head settings, comma separated")
    p.add_argument("--cases", default="1-15", help="case numbers: '1-15', '1,5,8'")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"variants to run, comma separated, of {', '.join(VARIANTS)} (default: all but the FlashInfer peers "
        f"{', '.join(PEER_VARIANTS)}, which need flashinfer-python importable and are skipped with the reason "
        "otherwise)",
    )
    p.add_argument("--out", type=Path, default=Path("docs/results"), help="output FOLDER (default: docs/results)")
    p.add_argument("--label", default="h200", help="names the outputs kernel_<label>.* (default: h200)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace kernel_<label>.{json,md,png} in --out if they exist"
    )
    p.add_argument(
        "--export",
        default=None,
        help=f"tuner export for the 'tuned' variant ('none': skip the variant; default: {DEFAULT_EXPORT} when "
        "the working folder has it, else none)",
    )
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="time each of our variants as this many independent instances (own plan arrays, workspace and "
        "output; the runtime its own buffers), all replays interleaved; its time is the median of theirs "
        "(identical instances of a small plan differ by up to 5%% on an H100). Peers run once (default: 1)",
    )
    p.add_argument("--resume", type=Path, default=None, help=argparse.SUPPRESS)  # the child of _run_rest_in_child
    args = p.parse_args(argv)
    cases: list[int] = []
    for part in args.cases.split(","):
        lo, _, hi = part.partition("-")
        cases += list(range(int(lo), int(hi or lo) + 1))
    args.cases = [c for c in cases if c in PAPER_SUITE]
    try:
        args.shapes = tuple(parse_shape(x) for x in args.shapes.split(",") if x) if args.shapes else HELDOUT_SHAPES
        families = tuple(f for f in args.families.split(",") if f) if args.families else None
        params = _family_params(args.family_params)
        heldout = args.suite == "heldout"
        args.heldout = heldout_cases(args.seed, args.trees, args.shapes, families, params) if heldout else ()
        args.candidate = parse_candidate(args.candidate) if args.candidate is not None else None
    except ValueError as exc:
        p.error(str(exc))
    if args.instances < 1:
        p.error("--instances must be at least 1")
    args.heads = [h for h in args.heads.split(",") if h]
    args.variants = [v for v in args.variants.split(",") if v]
    if args.candidate is not None and CANDIDATE not in args.variants:
        args.variants.append(CANDIDATE)
    if args.candidate is None and CANDIDATE in args.variants:
        p.error("the variant 'candidate' needs --candidate FIELD=VALUE;...")
    if args.changed_only and (args.candidate is None or args.suite == "paper"):
        p.error("--changed-only needs --candidate and a family or heldout suite")
    bad = [h for h in args.heads if h not in PAPER_HEADS] + [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown heads/variants: {bad}")
    args.export_missing = args.export is None and not Path(DEFAULT_EXPORT).is_file()
    if args.export is None:
        args.export = "none" if args.export_missing else DEFAULT_EXPORT
    args.export_path = None if args.export == "none" else str(args.export)
    if args.export_path is None:
        args.export = None
        args.variants = [v for v in args.variants if v != "tuned"]
    else:
        try:
            args.export = read_export(args.export)
        except (OSError, ValueError) as exc:
            p.error(f"--export {args.export}: {exc} (run from the repository root, or pass --export none)")
    return args


#: Fresh processes one run may start after FlashInfer peers broke the CUDA context (one per break).
MAX_RESTARTS = 16


def _stopped_at(items: list[dict[str, Any]], index: int, why: str) -> str:
    """The summary's ``stopped``: the case the run ended at, why, and the cases not run."""
    left = ", ".join(item["key"] for item in items[index:])
    return f"stopped at {items[index]['key']}: {why}"[:800] + f" (not run: {left})"


def _run_items(runs: list[Callable[[], dict[str, Any]]], items: list[dict[str, Any]], start: int):
    """Run ``runs[start:]`` in this process: ``(rows, lost, stopped)``. ``lost`` is ``(index, variant,
    message)`` when a FlashInfer peer broke the CUDA context at case ``index`` (this process can run
    nothing more); ``stopped`` says where the run ended when anything else broke it (None: it ran to
    the end). Errors that leave the context usable propagate."""
    rows: list[dict[str, Any]] = []
    for i in range(start, len(runs)):
        try:
            row = runs[i]()
        except RuntimeError as exc:  # CudaContextLostError, or a CUDA error that broke the context elsewhere
            if not isinstance(exc, CudaContextLostError) and not cuda_context_broken():
                raise
            if isinstance(exc, CudaContextLostError) and exc.variant in PEER_VARIANTS:
                return rows, (i, exc.variant, str(exc)), None
            stopped = _stopped_at(items, i, str(exc))
            log.error("%s", stopped)
            return rows, None, stopped
        rows.append(row)
        v = row["variants"].get("fasttree", {})
        log.info(
            "case %s %-5s ours %.1f us (eager %.1f), runtime %.1f us, published %s, floor %.1f, err %.1e",
            row["case"],
            row["heads"],
            v.get("graph_us", float("nan")),
            v.get("eager_us", float("nan")),
            row["variants"].get("runtime", {}).get("graph_us", float("nan")),
            row.get("published_graph_us"),
            row["floor_us"],
            v.get("max_rel_err", float("nan")),
        )
    return rows, None, None


def _encode_status(status: dict[tuple[str, str], str]) -> list[list[str]]:
    return [[key, name, text] for (key, name), text in status.items()]


def _run_rest_in_child(argv: list[str], start: int, status: dict[tuple[str, str], str]) -> dict[str, Any]:
    """Run cases ``start:`` of this benchmark in a fresh Python process (the same arguments plus
    ``--resume``, with the peer statuses known so far, so it probes nothing again): its rows, and
    its ``lost`` and ``stopped`` as :func:`_run_items` returns them."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kernel-bench-") as tmp:
        state = Path(tmp) / "resume.json"
        state.write_text(json.dumps({"start": start, "peer_status": _encode_status(status), "out": None}))
        cmd = [sys.executable, "-m", "fasttree.toolkit.kernel_bench", *argv, "--resume", str(state)]
        log.info("continuing at case %d in a fresh process", start)
        proc = subprocess.run(cmd, check=False)
        result = json.loads(state.read_text())
    if "rows" not in result:  # it died before writing (a crash of the interpreter): its cases are not run
        return {"rows": [], "lost": None, "stopped": f"the fresh process exited with {proc.returncode}, no rows"}
    return result


def main(argv=None, *, prog: str = "python -m fasttree.toolkit.kernel_bench") -> int:
    """Run the benchmark (``argv``: its command-line arguments, ``prog``: the command named in its
    usage), write the reports; 0 when every variant of ours and the torch baselines was correct, 1 when one
    was not (a FlashInfer peer's wrong result or failure is listed in the summary, not in the status), 2
    without a GPU, 3 when a CUDA error of ours broke the process's context: the reports then hold the
    cases done before it and the summary's ``stopped`` says where and which were not run. A FlashInfer
    peer that breaks the context (an illegal access its child-process probe did not show) fails on that
    case, and the run goes on from that case in a fresh process (at most :data:`MAX_RESTARTS` times)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, prog=prog)
    resume = json.loads(args.resume.read_text()) if args.resume is not None else None
    existing = [args.out / f"kernel_{args.label}.{ext}" for ext in ("json", "md", "png")]
    existing = [str(path) for path in existing if path.exists()]
    if existing and not args.overwrite and resume is None:  # the outputs rule of fasttree-tune: refused before any work
        print(
            f"{prog}: error: {', '.join(existing)} exist; pass --overwrite to replace the reports (or another "
            "--out or --label)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        log.error("the kernel benchmark needs a CUDA GPU")
        return 2
    if args.export_missing:
        log.info("no %s in the working folder: the 'tuned' variant is skipped", DEFAULT_EXPORT)
    env = environment(gpu=True)
    anchors = anchor_rows()
    if args.suite == "paper":
        runs = [lambda c=case, h=heads: bench_case(c, h, args, anchors) for case in args.cases for heads in args.heads]
        items = [probe_item(args, case=case, heads=heads) for case in args.cases for heads in args.heads]
    else:
        cases = args.heldout if args.suite == "heldout" else SUITES[args.suite]
        if args.changed_only:
            target = GpuTarget.of(torch.device("cuda"), interpreting=False)
            cases = [fc for fc in cases if candidate_changes(fc, *args.candidate, target)]
            log.info("--changed-only: the candidate changes %d trees", len(cases))
        runs = [lambda fc=fc: bench_family_case(fc, args) for fc in cases]
        items = [probe_item(args, family=fc) for fc in cases]
    if resume is not None:  # a child of _run_rest_in_child: its cases, its rows to the state file
        args.peer_status = {(key, name): text for key, name, text in resume["peer_status"]}
        rows, lost, stopped = _run_items(runs, items, int(resume["start"]))
        args.resume.write_text(json.dumps({"rows": rows, "lost": lost, "stopped": stopped}))
        return 0
    args.peer_status = peer_status(items, args.variants)
    if any(n in args.variants for n in PEER_VARIANTS):
        from .flashinfer_baseline import flashinfer_version

        env["flashinfer"] = flashinfer_version()
    rows, lost, stopped = _run_items(runs, items, 0)
    restarts = []
    while lost is not None:
        index, variant, message = lost
        key = items[index]["key"]
        log.error("%s at %s; the run continues in a fresh process", message, key)
        args.peer_status[(key, variant)] = f"error: broke the CUDA context in the timed process: {message}"[:600]
        restarts.append(f"{key} {variant}")
        if len(restarts) > MAX_RESTARTS:
            stopped = _stopped_at(items, index, f"more than {MAX_RESTARTS} fresh processes")
            break
        child = _run_rest_in_child(argv, index, args.peer_status)
        rows += child["rows"]
        lost, stopped = child["lost"], child["stopped"]
        if stopped is not None and not child["rows"] and lost is None and not stopped.startswith("stopped at"):
            stopped = _stopped_at(items, index, stopped)
    summary = summarize(rows)
    summary["stopped"] = stopped
    summary["peer_context_losses"] = restarts
    report = {
        "benchmark": f"tree attention kernel, {args.suite} suite",
        "label": args.label,
        "export": args.export_path,
        "candidate": None if args.candidate is None else _candidate_dict(*args.candidate),
        "heldout": _heldout_draw(args) if args.suite == "heldout" else None,
        "changed_only": args.changed_only,
        "instances": args.instances,
        "env": env,
        "summary": summary,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"kernel_{args.label}.json", json.dumps(report, indent=1) + "\n")
    md = markdown(rows, summary, env, args.label, args.instances)
    write_atomic(args.out / f"kernel_{args.label}.md", md)
    plot(rows, args.out / f"kernel_{args.label}.png")
    sys.stdout.write(md)
    if stopped is not None:
        return 3
    return 0 if summary["all_correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
