"""Eager host cost of the direct launchers: addresses as ints, and Triton's C launch called directly.

``fasttree.attention._INT_POINTERS`` makes the cached direct launchers of ``tree_attention``
and of the runtime's eager ``forward`` pass every tensor argument to Triton's launcher as its
address: the launcher then neither calls ``data_ptr()`` nor asks the driver to check the address
(``cuPointerGetAttribute``) per pointer argument and launch. ``_C_LAUNCH`` makes them call the
C launch function of Triton's ``CudaLauncher`` without its Python ``__call__``. For paper-suite
cases whose eager calls are host-bound, three settings in one run, alternated per case
(``int_c``: both; ``int``: ints through ``__call__``; ``tensor``: neither):

* ``host_us``: per-call host time of 2,000 calls back to back (GPU work per call is below it);
* ``launchers_us``: the cached launchers alone, per call;
* ``graph_us`` / ``eager_us`` / ``eager_loop_us``: ``fasttree.toolkit.timing``'s CUDA-graph replay,
  ``do_bench`` median and 20 calls back to back, as ``bench.kernel`` reports them;
* ``runtime_host_us``: per-call host time of ``TreeAttentionRuntime.forward`` (eager);
* every output checked against the float64 reference on sampled queries.

Usage (repository root, after ``pip install -e .``)::

    python3 bench/device/int_pointers_ab.py --out $OUT/int_pointers_ab.json
"""

from __future__ import annotations

import argparse
import json

import torch

import fasttree as ft
from bench.common import environment, random_case
from bench.host_overhead import per_call_us
from fasttree import attention
from fasttree.runtime import TreeAttentionRuntime
from fasttree.toolkit.suite import PAPER_HEADS, paper_tree
from fasttree.toolkit.timing import eager_loop_time_us, eager_time_us, graph_time_us

CASES = ("1/gqa16", "6/gqa4", "9/gqa4", "11/gqa16", "13/gqa16", "1/mha", "12/gqa16")


def _clear_direct(plan, rt) -> None:
    for key in [k for k in plan._device_cache if isinstance(k, tuple) and k[0] == "direct"]:
        del plan._device_cache[key]
    rt._launchers.clear()


def _max_rel_err(out, ref, rows) -> float:
    return ft.max_relative_error(out[torch.as_tensor(rows, device=out.device)], ref)


def run_case(name: str, seed: int) -> dict:
    case, heads = name.split("/")
    tree = paper_tree(int(case))
    hq, hkv = PAPER_HEADS[heads]
    d = 128
    q, k, v, rows, ref = random_case(tree, hq, hkv, d, seed=seed, samples=16)
    plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    rt = TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float16, device="cuda",
        max_queries=tree.n_queries, max_kv_entries=2 * plan.kv_indices.size + 4096, max_units=2 * plan.n_units + 64,
        max_partial_rows=2 * plan.n_partial_rows + 64, max_pairs=2 * plan.pair_query.size + 64,
        pool_slots=k.shape[0], extend_steps=0,
    )  # fmt: skip
    rt.plan(tree)
    out = torch.empty_like(q)
    out_rt = torch.empty_like(q)
    row = {"case": name, "n_launches": None}
    call = lambda: ft.tree_attention(q, k, v, plan, out=out)  # noqa: E731
    call_rt = lambda: rt.forward(q, k, v, out=out_rt)  # noqa: E731
    modes = {"int_c": (True, True), "int": (True, False), "tensor": (False, False)}
    for mode in (*modes, *modes):  # alternated: host drift hits every setting
        attention._INT_POINTERS, attention._C_LAUNCH = modes[mode]
        _clear_direct(plan, rt)
        out.fill_(float("nan"))
        out_rt.fill_(float("nan"))
        call()
        call()  # the second call builds nothing new: the direct launchers run
        call_rt()
        call_rt()
        torch.cuda.synchronize()
        entries = [e for key, e in plan._device_cache.items() if isinstance(key, tuple) and key[0] == "direct"]
        launchers = entries[0][1]
        row["n_launches"] = len(launchers)
        stream = torch.cuda.current_stream().cuda_stream
        ptrs = attention.launch_pointers(q, k, v, out)
        scale = 1.0 / d**0.5 * 1.4426950408889634

        def direct(launchers=launchers, ptrs=ptrs, stream=stream, scale=scale) -> None:
            for launch in launchers:
                launch(stream, *ptrs, scale)

        res = {
            "err": _max_rel_err(out, ref, rows),
            "err_runtime": _max_rel_err(out_rt, ref, rows),
            "host_us": per_call_us(call),
            "launchers_us": per_call_us(direct),
            "runtime_host_us": per_call_us(call_rt),
            "graph_us": graph_time_us(call)["median"],
            "eager_us": eager_time_us(call, rep_ms=50),
            "eager_loop_us": eager_loop_time_us(call)["median"],
            "runtime_eager_loop_us": eager_loop_time_us(call_rt)["median"],
        }
        if mode == "int_c":  # the pieces of a call besides the launchers
            dev = plan._device_cache[q.device]
            res["checks_us"] = per_call_us(lambda: attention._check_inputs(q, k, v, plan))
            res["fast_path_us"] = per_call_us(lambda dev=dev: attention._fast_path(plan, dev, q, k, v, out))
            res["stream_us"] = per_call_us(lambda: attention._current_stream(q.device))
        for key, val in res.items():
            row.setdefault(f"{mode}_{key}", []).append(val)
    attention._INT_POINTERS = attention._C_LAUNCH = True
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    rows = []
    for i, name in enumerate(args.cases.split(",")):
        row = run_case(name, seed=i)
        rows.append(row)
        brief = {k: [round(x, 1) if x > 1e-2 else x for x in v] for k, v in row.items() if isinstance(v, list)}
        print(name, row["n_launches"], json.dumps(brief), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
