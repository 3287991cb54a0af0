"""Paper suite A/B on the GPU: pipeline stages per tile class, and a stage-1 body with a peeled tail.

Two questions, one run, every one of the 45 paper cases (head dim 128, fp16):

1. Configs: the default ``FastTreeConfig`` (stages 3 and 3) against stages (3, 5), (5, 3) and
   (5, 5). Triton 3.6 on sm_90 gives a tile's gathered K/V a second shared-memory buffer only
   from 5 stages on (64-row tiles: 82 -> 115 KB; 16-row: 39 -> 73 KB). Whole calls
   (``tree_attention``) by CUDA-graph replay, each checked against the float64 reference.
2. Kernel body: the default plan's stage-1 launches with the library's kernel against a copy
   whose KV loop runs the unit's full ``BLOCK_N`` tiles without masks (index, K, V and
   row-mask loads unpredicated, no ``where`` on the scores of a non-masked class) and one
   masked tail tile. Outputs compared with the library's on the same inputs.

Also the peeled body on the serving decode trees of ``small_tile_variants.py`` (step 25).

    python3 bench/device/paper_ab.py --out $OUT/paper_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import torch
import triton
import triton.language as tl

import fasttree as ft
from bench.common import environment, random_case
from bench.device.small_tile_variants import diff, run_production, snapshot, stage1_launches
from fasttree import attention as att
from fasttree.export import read_export
from fasttree.suite import PAPER_HEADS, paper_tree
from fasttree.timing import graph_time_us
from fasttree.workloads import iter_serving

D = 128
STAGES = {"s33": (3, 3), "s35": (3, 5), "s53": (5, 3), "s55": (5, 5)}


@triton.jit
def _tile(
    start, kv_start, kv_len, q, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn, stride_vn, qk_scale,
    row_bit, d, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    n = start + tl.arange(0, BLOCK_N)
    if TAIL:
        n_valid = n < kv_len
        slot = tl.load(KvIndices + kv_start + n, mask=n_valid, other=0)
        k = tl.load(k_base + slot[:, None] * stride_kn + d[None, :], mask=n_valid[:, None], other=0.0)
    else:
        slot = tl.load(KvIndices + kv_start + n)
        k = tl.load(k_base + slot[:, None] * stride_kn + d[None, :])
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        if TAIL:
            bits = tl.load(KvRowMask + kv_start + n, mask=n_valid, other=0)
        else:
            bits = tl.load(KvRowMask + kv_start + n)
        s = tl.where(((bits[None, :] >> row_bit[:, None]) & 1) != 0, s, float("-inf"))
    elif TAIL:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if TAIL:
        v = tl.load(v_base + slot[:, None] * stride_vn + d[None, :], mask=n_valid[:, None], other=0.0)
    else:
        v = tl.load(v_base + slot[:, None] * stride_vn + d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["unit_offset", "stride_ln"])
def peeled_units_kernel(
    Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask, UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery,
    PairOutRow, unit_offset, qk_scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on,
    stride_oh, stride_pn, stride_ph, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST_DOT: tl.constexpr, OFFSETS_32: tl.constexpr,
):  # fmt: skip
    # HEAD_DIM == BLOCK_D and OFFSETS_32 assumed (the cases here)
    unit = tl.program_id(0) + unit_offset
    kv_head = tl.program_id(1)
    kv_start = tl.load(UnitKvStart + unit)
    kv_len = tl.load(UnitKvLen + unit)
    q_start = tl.load(UnitQStart + unit)
    q_len = tl.load(UnitQLen + unit)
    rows = tl.arange(0, BLOCK_M)
    row_query = rows // GROUP
    row_valid = row_query < q_len
    head = kv_head * GROUP + rows % GROUP
    qid = tl.load(PairQuery + q_start + row_query, mask=row_valid, other=0).to(tl.int64)
    out_row = tl.load(PairOutRow + q_start + row_query, mask=row_valid, other=-2)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + qid[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=row_valid[:, None], other=0.0
    )
    if MASKED:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_bit = tl.minimum(row_query, 31)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    full = kv_len - kv_len % BLOCK_N
    for start in range(0, full, BLOCK_N):
        m_i, l_i, acc = _tile(
            start, kv_start, kv_len, q, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn, stride_vn,
            qk_scale, row_bit, d, BLOCK_N, MASKED, False,
        )  # fmt: skip
    if full < kv_len:
        m_i, l_i, acc = _tile(
            full, kv_start, kv_len, q, m_i, l_i, acc, KvIndices, KvRowMask, k_base, v_base, stride_kn, stride_vn,
            qk_scale, row_bit, d, BLOCK_N, MASKED, True,
        )  # fmt: skip
    if MASKED:
        l_i = tl.maximum(l_i, 1.0e-30)
    o = acc / l_i[:, None]
    direct = row_valid & (out_row == -1)
    partial = row_valid & (out_row >= 0)
    tl.store(
        Out + qid[:, None] * stride_on + head[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
        mask=direct[:, None],
    )  # fmt: skip
    prow = tl.maximum(out_row, 0).to(tl.int64)
    tl.store(PartO + prow[:, None] * stride_pn + head[:, None] * stride_ph + d[None, :], o, mask=partial[:, None])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(PartLse + prow * stride_ln + head, lse, mask=partial)


def run_peeled(launches):
    for _, grid, args, constexprs, warps, stages, maxnreg in launches:
        kw = {"num_warps": warps, "num_stages": stages}
        if maxnreg is not None:
            kw["maxnreg"] = maxnreg
        peeled_units_kernel[grid](*args, *constexprs[:8], **kw)


def body_ab(plan, q, k, v) -> dict:
    """Stage-1 time (us) of the library's body and the peeled one on ``plan``, and their max difference."""
    out = torch.full_like(q, float("nan"))
    launches = stage1_launches(plan, q, k, v, out)
    assert all(c[-1] for _, _, _, c, *_ in launches), "the pools here give int32 offsets"
    part_o, part_lse = att._workspace(plan, q.device)
    rows = plan.n_partial_rows
    results = {}
    snaps = {}
    for name, run in (("production", run_production), ("peeled", run_peeled)):
        for buf in (out, part_o, part_lse):
            buf.fill_(float("nan"))
        run(launches)
        torch.cuda.synchronize()
        snaps[name] = snapshot(out, part_o, part_lse, rows)
        results[name] = graph_time_us(lambda run=run: run(launches))["median"]
    results["max_abs_diff"] = diff(snaps["production"], snaps["peeled"])
    return results


def geomean(xs) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    for case in range(1, 16):
        tree = paper_tree(case)
        for heads, (hq, hkv) in PAPER_HEADS.items():
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=case, samples=16)
            sample_t = torch.as_tensor(sample, device="cuda")
            row = {"case": case, "heads": heads, "configs": {}}
            for label, stages in STAGES.items():
                config = dataclasses.replace(ft.FastTreeConfig(), num_stages=stages)
                plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
                out = torch.full_like(q, float("nan"))
                call = lambda plan=plan, out=out, q=q, k=k, v=v: ft.tree_attention(q, k, v, plan, out=out)  # noqa: E731
                try:
                    call()
                    torch.cuda.synchronize()
                    err = ft.max_relative_error(out[sample_t], ref)
                    row["configs"][label] = {"graph_us": graph_time_us(call)["median"], "err": err}
                except Exception as exc:  # a config the GPU cannot launch: recorded
                    row["configs"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
            row["body"] = body_ab(plan, q, k, v)
            rows.append(row)
            base = row["configs"]["s33"]["graph_us"]
            print(
                f"{case}/{heads}: "
                + " ".join(f"{n}:{c.get('graph_us', math.nan) / base:.3f}" for n, c in row["configs"].items())
                + f" | body peeled/production {row['body']['peeled'] / row['body']['production']:.3f}"
                f" diff {row['body']['max_abs_diff']:.1e}",
                flush=True,
            )
    decode = []
    export = read_export("docs/tune/export_measured.json")
    for model, (hq, hkv) in {"llama": (32, 32), "mistral": (32, 8)}.items():
        config, _ = export.lookup(
            gpu=torch.cuda.get_device_name(0), num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16
        )
        for scenario in ("multi_document_qa", "few_shot"):
            tree = list(iter_serving(scenario, seed=0, steps=26))[25].tree
            gen = torch.Generator(device="cuda").manual_seed(25)
            slots = tree.max_slot + 1
            q = torch.randn(tree.n_queries, hq, D, generator=gen, device="cuda", dtype=torch.float16)
            k = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
            v = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
            plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
            res = {"model": model, "scenario": scenario, **body_ab(plan, q, k, v)}
            decode.append(res)
            print(f"{model} {scenario}: body peeled/production {res['peeled'] / res['production']:.3f}", flush=True)
    summary = {
        label: geomean(
            [
                r["configs"]["s33"]["graph_us"] / r["configs"][label]["graph_us"]
                for r in rows
                if "graph_us" in r["configs"].get(label, {})
            ]
        )
        for label in STAGES
    }
    summary["peeled_body_time_ratio"] = geomean([r["body"]["peeled"] / r["body"]["production"] for r in rows])
    summary["peeled_body_time_ratio_decode"] = geomean([r["peeled"] / r["production"] for r in decode])
    summary["max_err"] = {
        label: max(r["configs"][label].get("err", math.inf) for r in rows) for label in STAGES
    }  # fmt: skip
    summary["peeled_max_abs_diff"] = max(r["body"]["max_abs_diff"] for r in rows + [{"body": d} for d in decode])
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"env": environment(gpu=True), "rows": rows, "decode": decode, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
