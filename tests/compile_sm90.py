"""Compile the kernels for Hopper (sm_90) ahead of time, without a GPU; run by test_compile_sm90.py.

Run with ``TRITON_INTERPRET`` unset (the interpreter replaces Triton's compiler). Prints one JSON
object: variant name -> "ok" or the error text.
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fasttree.kernels import (
    merge_many_partials_kernel,
    merge_partials_kernel,
    merge_partials_persistent_kernel,
    tree_attention_persistent_kernel,
    tree_attention_units_kernel,
)

HOPPER = GPUTarget("cuda", 90, 32)
UNITS_POINTERS = ("Q", "K", "V", "Out", "PartO", "PartLse", "KvIndices", "KvRowMask", "UnitKvStart", "UnitKvLen",
                  "UnitQStart", "UnitQLen", "PairQuery", "PairOutRow")  # fmt: skip
UNITS = {
    "units_fp16_d128_g4_m64_n64_masked": ("fp16", 128, 4, 64, 64, True),
    "units_bf16_d128_g1_m16_n32": ("bf16", 128, 1, 16, 32, False),
    "units_fp16_d256_g16_m32_n16_masked": ("fp16", 256, 16, 32, 16, True),
}
MERGE_VALUES = {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_H": 4, "BLOCK_D": 128, "BLOCK_P": 16}


def compile_units(dtype, head_dim, group, block_m, block_n, masked):
    types = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Out": f"*{dtype}", "PartO": "*fp32",
             "PartLse": "*fp32"}  # fmt: skip
    signature = {name: types.get(name, "*i32") for name in UNITS_POINTERS}
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "GROUP": group, "BLOCK_M": block_m,
                  "BLOCK_N": block_n, "MASKED": masked, "UPCAST_DOT": False}  # fmt: skip
    for name in tree_attention_units_kernel.arg_names[len(UNITS_POINTERS) :]:
        signature[name] = "constexpr" if name in constexprs else ("fp32" if name == "qk_scale" else "i32")
    return triton.compile(ASTSource(tree_attention_units_kernel, signature, constexprs), target=HOPPER)


def compile_persistent(dtype, head_dim, group, block_m, block_n, masked, slots=2):
    """The runtime's stage-1 kernel (both slots): plan arrays behind the header of one int32 buffer."""
    types = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Out": f"*{dtype}", "PartO": "*fp32",
             "PartLse": "*fp32", "PlanBuf": "*i32", "qk_scale": "fp32"}  # fmt: skip
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "GROUP": group, "BLOCK_M0": block_m,
                  "BLOCK_N0": block_n, "BLOCK_M1": 16, "BLOCK_N1": 16, "MASKED": masked,
                  "UPCAST_DOT": False, "SLOTS": slots}  # fmt: skip
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                 for name in tree_attention_persistent_kernel.arg_names}  # fmt: skip
    return triton.compile(ASTSource(tree_attention_persistent_kernel, signature, constexprs), target=HOPPER)


def compile_merge(kernel, dtype):
    signature = {"Out": f"*{dtype}", "PartO": "*fp32", "PartLse": "*fp32", "MergeQueries": "*i32",
                 "QueryPartialStart": "*i32", "QueryNumPartials": "*i32", "PlanBuf": "*i32"}  # fmt: skip
    names = kernel.arg_names
    constexprs = {n: MERGE_VALUES[n] for n in names if n.isupper()}
    signature = {name: signature.get(name, "constexpr" if name in constexprs else "i32") for name in names}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER)


def main() -> int:
    results = {}
    jobs = {name: (compile_units, args) for name, args in UNITS.items()}
    jobs |= {f"merge_{d}": (compile_merge, (merge_partials_kernel, d)) for d in ("fp16", "bf16")}
    jobs |= {f"merge_many_{d}": (compile_merge, (merge_many_partials_kernel, d)) for d in ("fp16", "bf16")}
    jobs["persistent_fp16_d128_g4_m64_n64_masked"] = (compile_persistent, ("fp16", 128, 4, 64, 64, True))
    jobs["persistent_bf16_d256_g1_m16_n32"] = (compile_persistent, ("bf16", 256, 1, 16, 32, False))
    jobs["persistent_slot0_fp16_d128_g1_m64_n64"] = (compile_persistent, ("fp16", 128, 1, 64, 64, False, 0))
    jobs["persistent_slot1_fp16_d128_g4_m16_n16_masked"] = (compile_persistent, ("fp16", 128, 4, 16, 16, True, 1))
    jobs |= {f"merge_persistent_{d}": (compile_merge, (merge_partials_persistent_kernel, d)) for d in ("fp16", "bf16")}
    for name, (fn, args) in jobs.items():
        try:
            k = fn(*args)
            results[name] = "ok" if k.asm.get("cubin") and ".target sm_90" in k.asm["ptx"] else "no sm_90 cubin"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"[:2000]
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
