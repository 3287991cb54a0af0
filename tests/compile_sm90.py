"""Compile the kernels for Hopper (sm_90) ahead of time, without a GPU; run by test_compile_sm90.py.

The sm_90 Gluon stage 1 compiles for sm_90a (its wgmma and setmaxnreg), at the tiles
:data:`fasttree.launch_rules.SM90_TILES` launches it with.

Run with ``TRITON_INTERPRET`` unset (the interpreter replaces Triton's compiler). Prints one JSON
object: variant name -> "ok" or the error text. ``--bench-model``: the variants of the decode
benchmark's non-attention kernels (:mod:`bench.model_kernels`) instead of fasttree's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fasttree.kernels import (
    merge_many_partials_kernel,
    merge_partials_kernel,
    merge_partials_persistent_kernel,
    relocate_plan_kernel,
    tree_attention_persistent_kernel,
    tree_attention_units_kernel,
    tree_attention_units_sm90_kernel,
)
from fasttree.launch_rules import sm90_tile

HOPPER = GPUTarget("cuda", 90, 32)
UNITS_POINTERS = ("Q", "K", "V", "Out", "PartO", "PartLse", "KvIndices", "KvRowMask", "UnitKvStart", "UnitKvLen",
                  "UnitQStart", "UnitQLen", "PairQuery", "PairOutRow")  # fmt: skip
UNITS = {
    "units_fp16_d128_g4_m64_n64_masked": ("fp16", 128, 4, 64, 64, True, False, False),
    "units_bf16_d128_g1_m16_n32": ("bf16", 128, 1, 16, 32, False, False, False),
    "units_fp16_d128_g1_m16_n64_masked_offsets32": ("fp16", 128, 1, 16, 64, True, True, False),
    "units_fp16_d96_g4_m64_n64_masked_offsets32_peel": ("fp16", 96, 4, 64, 64, True, True, True),
    "units_bf16_d128_g8_m64_n32_peel": ("bf16", 128, 8, 64, 32, False, False, True),
    "units_fp16_d256_g16_m32_n16_masked": ("fp16", 256, 16, 32, 16, True, False, False),
}
MERGE_VALUES = {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_H": 4, "BLOCK_D": 128, "BLOCK_P": 16, "N_COUNTERS": 8}


def units_signature(kernel, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    """``(signature, attrs)`` of a stage-1 kernel (Triton's or the sm_90 Gluon one: the same runtime
    arguments) over ``dtype`` tensors with ``constexprs``; ``attrs`` mark what a real launch's
    specialisation gives: 16-byte aligned pointers and strides divisible by 16 (not ``unit_offset``
    nor ``stride_ln``, which the kernels do not specialise)."""
    types = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Out": f"*{dtype}", "PartO": "*fp32",
             "PartLse": "*fp32"}  # fmt: skip
    signature = {name: types.get(name, "*i32") for name in UNITS_POINTERS}
    for name in kernel.arg_names[len(UNITS_POINTERS) :]:
        signature[name] = "constexpr" if name in constexprs else ("fp32" if name == "qk_scale" else "i32")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature[name] not in ("constexpr", "fp32") and name not in ("unit_offset", "stride_ln")
    }
    return signature, attrs


def compile_units(dtype, head_dim, group, block_m, block_n, masked, offsets_32=False, peel=False, gdc=False):
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "GROUP": group,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "MASKED": masked, "UPCAST_DOT": False,
                  "OFFSETS_32": offsets_32, "PEEL": peel, "GDC_WAIT": gdc}  # fmt: skip
    signature, _ = units_signature(tree_attention_units_kernel, dtype, constexprs)
    return triton.compile(ASTSource(tree_attention_units_kernel, signature, constexprs), target=HOPPER)


def compile_units_sm90(dtype, head_dim, group, masked, offsets_32=True, gdc=0):
    """The sm_90 Gluon stage 1 at its tile (:func:`fasttree.launch_rules.sm90_tile`), as a real launch
    compiles it (16-byte aligned pointers, strides divisible by 16)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    tile = sm90_tile(head_dim, offsets_32)
    kernel = tree_attention_units_sm90_kernel
    constexprs = {"HEAD_DIM": head_dim, "GROUP": group, "BLOCK_M": 64, "BLOCK_N": tile.block_n, "MASKED": masked,
                  "OFFSETS_32": offsets_32, "HEADS_FASTEST": False, "STAGES": tile.stages,
                  "LOADER_WARPS": tile.loader_warps, "LOADER_REGS": tile.loader_regs, "GDC_WAIT": gdc}  # fmt: skip
    signature, attrs = units_signature(kernel, dtype, constexprs)
    return triton.compile(
        GluonASTSource(kernel, signature, constexprs, attrs), target=HOPPER,
        options={"num_warps": 4, "num_stages": 1, "maxnreg": tile.maxnreg},
    )  # fmt: skip


def compile_persistent(
    dtype, head_dim, group, block_m, block_n, masked, slots=2, offsets_32=True, peel=True, gdc=False
):
    """The runtime's stage-1 kernel (both slots): plan arrays behind the header of one int32 buffer."""
    types = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Out": f"*{dtype}", "PartO": "*fp32",
             "PartLse": "*fp32", "PlanBuf": "*i32", "Counters": "*i32", "qk_scale": "fp32"}  # fmt: skip
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "GROUP": group, "BLOCK_M0": block_m,
                  "BLOCK_N0": block_n, "BLOCK_M1": 16, "BLOCK_N1": 16, "MASKED": masked,
                  "UPCAST_DOT": False, "SLOTS": slots, "OFFSETS_32": offsets_32, "PEEL0": peel,
                  "PEEL1": not peel, "GDC_WAIT": gdc}  # fmt: skip
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                 for name in tree_attention_persistent_kernel.arg_names}  # fmt: skip
    return triton.compile(ASTSource(tree_attention_persistent_kernel, signature, constexprs), target=HOPPER)


def compile_relocate():
    signature = {"PlanBuf": "*i32", "Fixed": "*i32", "DstOffsets": "*i32", "unit_region": "i32", "sentinel": "i32",
                 "N_ARRAYS": "constexpr", "FIRST_UNIT_ARRAY": "constexpr", "MERGE_ARRAY": "constexpr",
                 "BLOCK": "constexpr"}  # fmt: skip
    constexprs = {"N_ARRAYS": 11, "FIRST_UNIT_ARRAY": 2, "MERGE_ARRAY": 10, "BLOCK": 1024}
    return triton.compile(ASTSource(relocate_plan_kernel, signature, constexprs), target=HOPPER)


def compile_merge(kernel, dtype, gdc=False):
    signature = {"Out": f"*{dtype}", "PartO": "*fp32", "PartLse": "*fp32", "MergeQueries": "*i32",
                 "QueryPartialStart": "*i32", "QueryNumPartials": "*i32", "PlanBuf": "*i32",
                 "Counters": "*i32"}  # fmt: skip
    names = kernel.arg_names
    values = MERGE_VALUES | {"MANY": False}
    constexprs = {n: values[n] for n in names if n.isupper() and n != "GDC_WAIT"} | {"GDC_WAIT": gdc}
    signature = {name: signature.get(name, "constexpr" if name in constexprs else "i32") for name in names}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER)


#: (dtype, hidden, with the residual add) of the RMSNorm kernel.
BENCH_RMS_NORM = {"rms_norm_fp16_h4096_add": ("fp16", 4096, True), "rms_norm_bf16_h4096": ("bf16", 4096, False)}
#: (dtype, Hq, Hkv, D) of the RoPE + K/V write kernel.
BENCH_ROPE = {"rope_kv_fp16_mistral": ("fp16", 32, 8, 128), "rope_kv_bf16_llama": ("bf16", 32, 32, 128)}
#: (dtype, block) of the SiLU-and-mul kernel.
BENCH_SILU = {"silu_mul_fp16": ("fp16", 1024), "silu_mul_bf16": ("bf16", 1024)}


def _bench_kernels():
    """bench.model_kernels (the repository root is put on the path when run as a script)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import model_kernels

    return model_kernels


def _compile_bench(kernel, types: dict[str, str], constexprs: dict, num_warps: int):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER, options={"num_warps": num_warps})


def compile_rms_norm(dtype, hidden, add):
    k = _bench_kernels().rms_norm_kernel
    types = {"X": f"*{dtype}", "Delta": f"*{dtype}", "Weight": f"*{dtype}", "Y": f"*{dtype}", "eps": "fp32"}
    block = triton.next_power_of_2(hidden)
    return _compile_bench(k, types, {"HAS_DELTA": add, "BLOCK": block}, max(1, min(16, block // 512)))


def compile_rope(dtype, hq, hkv, head_dim):
    k = _bench_kernels().rope_kv_write_kernel
    types = {"QKV": f"*{dtype}", "Q": f"*{dtype}", "KPool": f"*{dtype}", "VPool": f"*{dtype}",
             "WriteSlots": "*i64", "Cos": "*fp32", "Sin": "*fp32"}  # fmt: skip
    block_half = triton.next_power_of_2(head_dim // 2)
    constexprs = {"NUM_Q_HEADS": hq, "NUM_KV_HEADS": hkv, "HEAD_DIM": head_dim, "BLOCK_HALF": block_half}
    return _compile_bench(k, types, constexprs, 1 if block_half <= 64 else 2)


def compile_silu(dtype, block):
    k = _bench_kernels().silu_mul_kernel
    return _compile_bench(k, {"GateUp": f"*{dtype}", "Out": f"*{dtype}"}, {"BLOCK": block}, 4 if block >= 512 else 1)


def bench_jobs() -> dict:
    """The variants of ``--bench-model``."""
    jobs = {name: (compile_rms_norm, args) for name, args in BENCH_RMS_NORM.items()}
    jobs |= {name: (compile_rope, args) for name, args in BENCH_ROPE.items()}
    jobs |= {name: (compile_silu, args) for name, args in BENCH_SILU.items()}
    return jobs


def fasttree_jobs() -> dict:
    """The tree-attention and merge variants (the default)."""
    jobs = {name: (compile_units, args) for name, args in UNITS.items()}
    jobs |= {f"merge_{d}": (compile_merge, (merge_partials_kernel, d)) for d in ("fp16", "bf16")}
    jobs |= {f"merge_many_{d}": (compile_merge, (merge_many_partials_kernel, d)) for d in ("fp16", "bf16")}
    jobs["persistent_fp16_d128_g4_m64_n64_masked"] = (compile_persistent, ("fp16", 128, 4, 64, 64, True))
    jobs["persistent_bf16_d256_g1_m16_n32"] = (compile_persistent, ("bf16", 256, 1, 16, 32, False))
    jobs["persistent_slot0_fp16_d128_g1_m64_n64"] = (
        compile_persistent, ("fp16", 128, 1, 64, 64, False, 0, False, False)
    )  # fmt: skip
    jobs["persistent_slot1_fp16_d128_g4_m16_n16_masked"] = (compile_persistent, ("fp16", 128, 4, 16, 16, True, 1))
    jobs |= {f"merge_persistent_{d}": (compile_merge, (merge_partials_persistent_kernel, d)) for d in ("fp16", "bf16")}
    jobs["relocate_plan"] = (compile_relocate, ())
    if tree_attention_units_sm90_kernel is not None:  # the sm_90 Gluon stage 1
        jobs["units_sm90_fp16_d128_g4_masked"] = (compile_units_sm90, ("fp16", 128, 4, True))
        jobs["units_sm90_bf16_d128_g16"] = (compile_units_sm90, ("bf16", 128, 16, False))
        jobs["units_sm90_fp16_d128_g8_masked_offsets64"] = (compile_units_sm90, ("fp16", 128, 8, True, False))
        jobs["gdc_units_sm90_bf16_d128_g8"] = (compile_units_sm90, ("bf16", 128, 8, False, True, 1))
        jobs["gdc_early_units_sm90_fp16_d128_g4_masked"] = (compile_units_sm90, ("fp16", 128, 4, True, True, 2))
    # programmatic dependent launch (GDC_WAIT): the PTX must hold the wait (checked in main)
    jobs["gdc_units_fp16_d128_g4_m64_n64_masked"] = (compile_units, ("fp16", 128, 4, 64, 64, True, True, True, True))
    jobs["gdc_persistent_fp16_d128_g1_m16_n32"] = (
        compile_persistent, ("fp16", 128, 1, 16, 32, False, 2, True, True, True)
    )  # fmt: skip
    jobs["gdc_merge_fp16"] = (compile_merge, (merge_partials_kernel, "fp16", True))
    jobs["gdc_merge_many_bf16"] = (compile_merge, (merge_many_partials_kernel, "bf16", True))
    jobs["gdc_merge_persistent_fp16"] = (compile_merge, (merge_partials_persistent_kernel, "fp16", True))
    # GDC_WAIT 2 ("early"): the PTX must also let the next grid launch
    jobs["gdc_early_units_bf16_d128_g1_m16_n64_masked"] = (
        compile_units, ("bf16", 128, 1, 16, 64, True, True, False, 2)
    )  # fmt: skip
    jobs["gdc_early_persistent_fp16_d128_g4_m64_n64_masked"] = (
        compile_persistent, ("fp16", 128, 4, 64, 64, True, 2, True, True, 2)
    )  # fmt: skip
    jobs["gdc_early_merge_fp16"] = (compile_merge, (merge_partials_kernel, "fp16", 2))
    jobs["gdc_early_merge_many_fp16"] = (compile_merge, (merge_many_partials_kernel, "fp16", 2))
    jobs["gdc_early_merge_persistent_bf16"] = (compile_merge, (merge_partials_persistent_kernel, "bf16", 2))
    return jobs


def check(name: str, kernel) -> str:
    """Return "ok" or what is wrong with a compiled variant: no sm_90 cubin, or a ``gdc_`` variant
    whose PTX lacks ``griddepcontrol.wait`` (or another variant whose PTX has it), or a ``gdc_early_``
    variant (``GDC_WAIT`` 2) whose PTX lacks ``griddepcontrol.launch_dependents`` (or another that has it)."""
    ptx = kernel.asm.get("ptx", "")
    if not kernel.asm.get("cubin") or ".target sm_90" not in ptx:
        return "no sm_90 cubin"
    if ("griddepcontrol.wait" in ptx) != name.startswith("gdc_"):
        return "griddepcontrol.wait " + ("missing" if name.startswith("gdc_") else "present without GDC_WAIT")
    if ("griddepcontrol.launch_dependents" in ptx) != name.startswith("gdc_early_"):
        return "griddepcontrol.launch_dependents " + ("missing" if name.startswith("gdc_early_") else "present")
    if "_sm90_" in name and not ("setmaxnreg" in ptx and "wgmma" in ptx):
        return "the warp-specialized kernel's PTX lacks setmaxnreg or wgmma"
    if "_sm90_" in name and kernel.metadata.shared > 227 * 1024:
        return f"{kernel.metadata.shared} bytes of shared memory: more than an sm_90 program gets"
    return "ok"


#: (block_m, block_n, head_dim, num_warps) x stages of ``--smem``: the units kernel's shared memory
#: as a real launch compiles it (16-byte aligned pointers, strides divisible by 16).
SMEM_TILES = ((16, 64, 128, 2), (16, 32, 256, 4), (64, 64, 128, 4), (64, 32, 128, 8), (64, 128, 64, 4))
SMEM_STAGES = (2, 3, 4, 5, 6, 7, 8)


def units_shared_bytes(block_m, block_n, head_dim, num_warps, num_stages) -> int:
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "GROUP": 1, "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "MASKED": True, "UPCAST_DOT": False, "OFFSETS_32": True, "PEEL": False}  # fmt: skip
    signature, attrs = units_signature(tree_attention_units_kernel, "fp16", constexprs)
    k = triton.compile(
        ASTSource(tree_attention_units_kernel, signature, constexprs, attrs), target=HOPPER,
        options={"num_warps": num_warps, "num_stages": num_stages},
    )  # fmt: skip
    return int(k.metadata.shared)


def main() -> int:
    results = {}
    if "--smem" in sys.argv[1:]:
        for tile in SMEM_TILES:
            for stages in SMEM_STAGES:
                results[",".join(map(str, (*tile, stages)))] = units_shared_bytes(*tile, stages)
        json.dump(results, sys.stdout)
        return 0
    if "--bench-model" in sys.argv[1:]:
        jobs = bench_jobs()
    else:
        jobs = fasttree_jobs()
    for name, (fn, args) in jobs.items():
        try:
            results[name] = check(name, fn(*args))
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"[:2000]
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
