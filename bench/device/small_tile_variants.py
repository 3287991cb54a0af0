"""Stage-1 body variants on the serving scenarios' decode trees (an A/B on the GPU, not the library).

Llama (32/32) and Mistral (32/8) decode trees of the multi-document and few-shot scenarios
spend most of their attention in the 16-row masked tile class, at about 0.70 of the HBM floor.
This times, by CUDA-graph replay of each plan's stage-1 launches alone (the merge is the
library's and identical for all), the library's kernel against copies of its unit body with
one change each:

* ``i32``: KV addresses from 32-bit offsets (``slot * stride + d``; the pools here are far
  below 2**31 elements) instead of 64-bit ones;
* ``shared``: one offset tile for K and V (the pools share their strides);
* ``evict``: K and V loaded with ``evict_first`` (each entry is read once per launch);
* ``v_early``: V's load issued before the QK product (program order);
* ``all``: the four together.

Every variant's outputs (direct rows, partial rows and LSEs) are compared with the library's
on the same inputs. Also reported per tree: the library's whole call (stage 1 + merge) by
graph replay, the stage-1 / merge split from ``torch.profiler``, and the HBM floor of the
bytes the plan reads::

    python3 bench/device/small_tile_variants.py --out $OUT/small_tile_variants.json
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import triton
import triton.language as tl

import fasttree as ft
from bench.common import write_device_result
from bench.stage1_ab import max_abs_diff, poisoned_outputs, run_launches, stage1_launches
from fasttree.export import read_export
from fasttree.toolkit.timing import graph_time_us
from fasttree.toolkit.workloads import iter_serving

MODELS = {"llama": (32, 32), "mistral": (32, 8)}
SCENARIOS = ("multi_document_qa", "few_shot")
STEPS = (10, 25, 39)
D = 128
HBM = 4.8e12


@triton.jit(do_not_specialize=["unit_offset", "stride_ln"])
def variant_units_kernel(
    Q, K, V, Out, PartO, PartLse, KvIndices, KvRowMask, UnitKvStart, UnitKvLen, UnitQStart, UnitQLen, PairQuery,
    PairOutRow, unit_offset, qk_scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on,
    stride_oh, stride_pn, stride_ph, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST_DOT: tl.constexpr,
    I32: tl.constexpr, SHARED: tl.constexpr, EVICT: tl.constexpr, V_EARLY: tl.constexpr,
):  # fmt: skip
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
    d_valid = d < HEAD_DIM
    q = tl.load(
        Q + qid[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :], other=0.0,
    )  # fmt: skip
    if MASKED:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        row_bit = tl.minimum(row_query, 31)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    for start in range(0, kv_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_len
        if I32:
            slot = tl.load(KvIndices + kv_start + n, mask=n_valid, other=0)
        else:
            slot = tl.load(KvIndices + kv_start + n, mask=n_valid, other=0).to(tl.int64)
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k_off = slot[:, None] * stride_kn + d[None, :]
        if SHARED:
            v_off = k_off
        else:
            v_off = slot[:, None] * stride_vn + d[None, :]
        if EVICT:
            k = tl.load(k_base + k_off, mask=kv_mask, other=0.0, eviction_policy="evict_first")
        else:
            k = tl.load(k_base + k_off, mask=kv_mask, other=0.0)
        if V_EARLY:
            if EVICT:
                v = tl.load(v_base + v_off, mask=kv_mask, other=0.0, eviction_policy="evict_first")
            else:
                v = tl.load(v_base + v_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            bits = tl.load(KvRowMask + kv_start + n, mask=n_valid, other=0)
            s = tl.where(((bits[None, :] >> row_bit[:, None]) & 1) != 0, s, float("-inf"))
        else:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not V_EARLY:
            if EVICT:
                v = tl.load(v_base + v_off, mask=kv_mask, other=0.0, eviction_policy="evict_first")
            else:
                v = tl.load(v_base + v_off, mask=kv_mask, other=0.0)
        p = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    if MASKED:
        l_i = tl.maximum(l_i, 1.0e-30)
    o = acc / l_i[:, None]
    direct = row_valid & (out_row == -1)
    partial = row_valid & (out_row >= 0)
    tl.store(
        Out + qid[:, None] * stride_on + head[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
        mask=direct[:, None] & d_valid[None, :],
    )  # fmt: skip
    prow = tl.maximum(out_row, 0).to(tl.int64)
    tl.store(
        PartO + prow[:, None] * stride_pn + head[:, None] * stride_ph + d[None, :], o,
        mask=partial[:, None] & d_valid[None, :],
    )  # fmt: skip
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(PartLse + prow * stride_ln + head, lse, mask=partial)


VARIANTS = {
    "i32": (True, False, False, False),
    "shared": (False, True, False, False),
    "evict": (False, False, True, False),
    "v_early": (False, False, False, True),
    "all": (True, True, True, True),
}


#: The library's kernel with another (warps, stages, KV tile) for the 16-row class.
OVERRIDES = {
    "w1s4": (1, 4, None),
    "w1s6": (1, 6, None),
    "w2s6": (2, 6, None),
    "w4s4": (4, 4, None),
    "n32s6": (2, 6, 32),
    "n32s8": (2, 8, 32),
    "n128s2": (2, 2, 128),
    "n128s3": (2, 3, 128),
}


def with_override(launches, override):
    warps, stages, block_n = override
    out = []
    for kernel, grid, args, constexprs, w, s, maxnreg in launches:
        if constexprs[3] <= 16:  # the 16-row class
            w, s = warps, stages
            if block_n is not None:
                constexprs = (*constexprs[:4], block_n, *constexprs[5:])
            maxnreg = None
        out.append((kernel, grid, args, constexprs, w, s, maxnreg))
    return out


def run_variant(launches, flags):
    for _, grid, args, constexprs, warps, stages, maxnreg in launches:
        kw = {"num_warps": warps, "num_stages": stages}
        if maxnreg is not None:
            kw["maxnreg"] = maxnreg
        variant_units_kernel[grid](*args, *constexprs[:7], *flags, **kw)


def profile_split(fn):
    """GPU us per call of stage 1 and of the merge, from torch.profiler over 20 eager calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    stage1 = merge = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if "tree_attention_units" in e.key:
            stage1 += t / 20
        elif "merge" in e.key:
            merge += t / 20
    return stage1, merge


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    export = read_export("docs/tune/export_measured.json")
    gpu = torch.cuda.get_device_name(0)
    rows = []
    for model, (hq, hkv) in MODELS.items():
        config, _ = export.lookup(gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float16)
        for scenario in SCENARIOS:
            steps = list(iter_serving(scenario, seed=0, steps=max(STEPS) + 1))
            for i in STEPS:
                tree = steps[i].tree
                plan = ft.plan(tree, config, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
                gen = torch.Generator(device="cuda").manual_seed(i)
                slots = tree.max_slot + 1
                q = torch.randn(tree.n_queries, hq, D, generator=gen, device="cuda", dtype=torch.float16)
                k = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
                v = torch.randn(slots, hkv, D, generator=gen, device="cuda", dtype=torch.float16)
                out = torch.full_like(q, float("nan"))
                full = lambda plan=plan, q=q, k=k, v=v, out=out: ft.tree_attention(q, k, v, plan, out=out)  # noqa: E731
                s = plan.stats()
                uniq = int(tree.lengths[tree.subtree_queries > 0].sum())
                floor_us = (uniq * hkv * D * 2 * 2 + 2 * q.numel() * 2) / HBM * 1e6
                row = {
                    "model": model, "scenario": scenario, "step": i, "queries": tree.n_queries,
                    "units": s["units"], "kv_read_tokens": s["kv_tokens_read"], "unique_tokens": uniq,
                    "floor_us": floor_us, "full_graph_us": graph_time_us(full)["median"],
                }  # fmt: skip
                row["profiled_stage1_us"], row["profiled_merge_us"] = profile_split(full)
                launches = stage1_launches(plan, q, k, v, out)
                ref = poisoned_outputs(lambda launches=launches: run_launches(launches), plan, out)
                base_us = graph_time_us(lambda launches=launches: run_launches(launches))["median"]
                row["stage1_us"] = {"production": base_us}
                row["max_abs_diff"] = {}
                for name, flags in VARIANTS.items():
                    got = poisoned_outputs(lambda launches=launches, f=flags: run_variant(launches, f), plan, out)
                    row["max_abs_diff"][name] = max_abs_diff(ref, got)
                    timed = graph_time_us(lambda launches=launches, f=flags: run_variant(launches, f))
                    row["stage1_us"][name] = timed["median"]
                for name, override in OVERRIDES.items():
                    changed = with_override(launches, override)
                    got = poisoned_outputs(lambda c=changed: run_launches(c), plan, out)
                    row["max_abs_diff"][name] = max_abs_diff(ref, got)
                    row["stage1_us"][name] = graph_time_us(lambda c=changed: run_launches(c))["median"]
                rows.append(row)
                base = row["stage1_us"]["production"]
                print(
                    f"{model} {scenario} {i}: floor {floor_us:.1f} full {row['full_graph_us']:.1f} "
                    f"prof s1 {row['profiled_stage1_us']:.1f} merge {row['profiled_merge_us']:.1f} | stage1 "
                    + " ".join(f"{n}:{t:.1f}({t / base:.3f})" for n, t in row["stage1_us"].items())
                    + " | diff " + " ".join(f"{n}:{e:.1e}" for n, e in row["max_abs_diff"].items()),
                    flush=True,
                )  # fmt: skip
    summary = {}
    for name in ["production", *VARIANTS, *OVERRIDES]:
        ratios = [r["stage1_us"][name] / r["stage1_us"]["production"] for r in rows]
        summary[name] = {"geomean_ratio": float(np.exp(np.mean(np.log(ratios)))), "max_ratio": max(ratios),
                         "min_ratio": min(ratios)}  # fmt: skip
    write_device_result(args.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
