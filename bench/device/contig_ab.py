"""Experiment: stage-1 K/V loads of units whose slots are one contiguous run, on the paper suite.

For every paper case and head ratio whose default plan has a tile class in which every work
unit's slots form one run (``kv_indices[unit start + i] == kv_indices[unit start] + i``), times
the whole ``tree_attention`` call by CUDA-graph replay with those classes' stage-1 launches
compiled three ways (``CONTIG`` of :func:`fasttree.kernels.tree_attention.tree_attention_units_kernel`):

* ``gather``: the default (per-token slot ids loaded, rows gathered);
* ``run``: no slot-id loads, row addresses from the unit's first slot;
* ``tma``: K and V tiles loaded by TMA through host tensor descriptors of the pools viewed
  ``[pool_slots, Hkv * D]``.

Every variant goes through Triton's JIT launch path (no cached direct launchers), the same for
all three. Outputs are checked against the float64 reference on sampled queries. ::

    python3 bench/device/contig_ab.py --out $OUT/contig_ab.json [--rounds 3] [--cases 5,9]
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import fasttree as ft
import fasttree.attention as attn
from bench.common import checked_graph_time, geomean, random_case, timed_in_turn, write_device_result
from fasttree.kernels.tree_attention import tree_attention_units_kernel
from fasttree.suite import PAPER_HEADS, paper_tree

D = 128
#: name -> (CONTIG, pipeline stages added to the launch's). A gathered tile's slot ids are loaded one
#: stage ahead of its rows, so at equal stages a run (no slot ids) buffers one tile more: the
#: ``_eq`` variants run one stage less, i.e. as many K/V buffers as the gather.
VARIANTS = {"gather": (0, 0), "run": (1, 0), "tma": (2, 0), "run_eq": (1, -1), "tma_eq": (2, -1), "gather_deep": (0, 1)}


def contiguous_classes(plan: ft.Plan) -> list[bool]:
    """Per tile class: whether every unit's slots are one run (False for an empty class)."""
    out = []
    ptr = plan.class_unit_ptr
    for c in range(len(plan.tile_classes)):
        lo, hi = int(ptr[c]), int(ptr[c + 1])
        if hi == lo:
            out.append(False)
            continue
        st = plan.unit_kv_start[lo:hi].astype(np.int64)
        ln = plan.unit_kv_len[lo:hi].astype(np.int64)
        unit = np.repeat(np.arange(hi - lo), ln)
        entry = st[unit] + (np.arange(ln.sum()) - np.repeat(np.cumsum(ln) - ln, ln))
        first = plan.kv_indices[st].astype(np.int64)[unit]
        out.append(bool(np.all(plan.kv_indices[entry] == first + (entry - st[unit]))))
    return out


class _Contig:
    """Stands in for the stage-1 kernel in a launch tuple: launches it with ``CONTIG`` set."""

    def __init__(self, mode: int, stages: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.mode, self.stages, self.k, self.v = mode, stages, k, v

    def __getitem__(self, grid):
        def launch(*args, **options):
            constexprs = args[-11:]
            block_n = constexprs[4]
            if constexprs[-1]:
                options["launch_pdl"] = True
            options["num_stages"] = max(1, options["num_stages"] + self.stages)
            extra = {"CONTIG": self.mode}
            if self.mode == 2:
                slots, hkv, d = self.k.shape
                extra["KDesc"] = TensorDescriptor.from_tensor(self.k.view(slots, hkv * d), block_shape=[block_n, d])
                extra["VDesc"] = TensorDescriptor.from_tensor(self.v.view(slots, hkv * d), block_shape=[block_n, d])
            return tree_attention_units_kernel[grid](*args, **extra, **options)

        return launch


_real_launches = attn._launches
_real_stage1_launches = attn._stage1_launches
_STATE: dict = {"mode": (0, 0), "classes": []}


def _patched_launches(host, dev, q, k_cache, v_cache, out, qk_scale):
    launches = _real_launches(host, dev, q, k_cache, v_cache, out, qk_scale)
    contig = [c for c, ok in enumerate(_STATE["classes"]) if ok and host.units_per_class()[c]]
    present = [c for c in range(len(host.tile_classes)) if host.units_per_class()[c]]
    result = []
    for i, launch in enumerate(launches):
        kernel, *rest = launch
        if kernel is tree_attention_units_kernel:
            mode, stages = _STATE["mode"] if present[i] in contig else (0, 0)
            kernel = _Contig(mode, stages, k_cache, v_cache)
        result.append((kernel, *rest))
    return result


def _stage1_count(launches):
    return sum(1 for kernel, *_ in launches if kernel is tree_attention_units_kernel or isinstance(kernel, _Contig))


def timed(mode: tuple[int, int], classes: list[bool], plan, q, k, v, sample, ref) -> dict:
    _STATE["mode"], _STATE["classes"] = mode, classes
    return checked_graph_time(plan, q, k, v, sample, ref)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(str(c) for c in range(1, 16)))
    p.add_argument("--heads", default="mha,gqa4,gqa16")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    attn._launches = _patched_launches
    attn._stage1_launches = _stage1_count
    attn._launch_hooks_active = lambda: True  # every launch through the JIT (the wrapper's keywords)
    rows = []
    for case in [int(x) for x in a.cases.split(",")]:
        tree = paper_tree(case)
        for heads in a.heads.split(","):
            hq, hkv = PAPER_HEADS[heads]
            plan = ft.plan(tree, None, num_q_heads=hq, num_kv_heads=hkv, head_dim=D)
            classes = contiguous_classes(plan)
            if not any(classes):
                continue
            q, k, v, sample, ref = random_case(tree, hq, hkv, D, seed=case, samples=16)
            calls = {name: partial(timed, mode, classes, plan, q, k, v, sample, ref) for name, mode in VARIANTS.items()}
            res = timed_in_turn(calls, a.rounds, keep_errors=True)
            row = {"case": case, "heads": heads, "contiguous_classes": classes,
                   "units": [int(u) for u in plan.units_per_class()], **res}  # fmt: skip
            rows.append(row)
            base = res["gather"].get("graph_us")
            msg = " ".join(
                f"{n}:{res[n]['graph_us'] / base:.3f}" if "graph_us" in res[n] else f"{n}:ERR" for n in VARIANTS
            )
            print(f"{case}/{heads} classes {classes} gather {base:.1f} us {msg}", flush=True)
    summary = {}
    for n in list(VARIANTS)[1:]:
        r = [row[n]["graph_us"] / row["gather"]["graph_us"] for row in rows if "graph_us" in row[n]]
        summary[n] = {"geomean_ratio": geomean(r), "cases": len(r)}
    summary["max_err"] = max(max(row[n].get("err", 0.0) for n in VARIANTS) for row in rows) if rows else None
    write_device_result(a.out, summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
