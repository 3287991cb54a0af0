"""Registers and spills of every stage-1 kernel variant on Hopper, from the compiler, without a GPU (CPU).

    python -m bench.kernel_resources        # writes costmodel/data/kernel_resources_sm90.json
    python -m bench.kernel_resources --keep-existing   # compiles only the variants the file lacks

Each variant (head dim, query-tile rows, KV tile, masked, warps, stages) is lowered by Triton's
ahead-of-time path for sm_90 and assembled by the ptxas Triton ships, with ``-v``; its report
gives the registers per thread and the spill stores and loads. The latency model reads the table
(:mod:`fasttree.costmodel.resources`): register spilling is the largest error of a simulator
that guesses registers from tile sizes. Run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HEAD_DIMS = (64, 128, 256)
BLOCK_M = (16, 32, 64, 128, 256)
BLOCK_N = (16, 32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4, 5)  # 5: the 64-row class's default up to GQA 8 (FastTreeConfig.launch_stages)
GROUP = 4
OUT = Path("costmodel/data/kernel_resources_sm90.json")

#: Integer arguments tree_attention_units_kernel does not specialise on (``do_not_specialize``).
_NOT_SPECIALISED = ("unit_offset", "stride_ln")
_KEY = ("head_dim", "block_m", "block_n", "masked", "num_warps", "num_stages")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def measure(variant: tuple) -> tuple[tuple, dict | str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fasttree.kernels import tree_attention_units_kernel as kernel

    d, bm, bn, masked, warps, stages = variant
    pointers = ("Q", "K", "V", "Out", "PartO", "PartLse", "KvIndices", "KvRowMask", "UnitKvStart", "UnitKvLen",
                "UnitQStart", "UnitQLen", "PairQuery", "PairOutRow")  # fmt: skip
    types = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "Out": "*fp16", "PartO": "*fp32", "PartLse": "*fp32"}
    signature = {n: types.get(n, "*i32") for n in pointers}
    # int64 K/V offsets (OFFSETS_32 off): the kernel the committed traces ran
    constexprs = {"HEAD_DIM": d, "BLOCK_D": d, "GROUP": GROUP, "BLOCK_M": bm, "BLOCK_N": bn, "MASKED": masked,
                  "UPCAST_DOT": False, "OFFSETS_32": False, "PEEL": False}  # fmt: skip
    for n in kernel.arg_names[len(pointers) :]:
        signature[n] = "constexpr" if n in constexprs else ("fp32" if n == "qk_scale" else "i32")
    # what the JIT assumes at a real launch: pointers 16-byte aligned and integer arguments
    # (strides) multiples of 16, except those the kernel does not specialise on; without it
    # the loads are not vectorised and the register counts are far from the launched kernel's
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(kernel.arg_names)
        if signature[n] not in ("constexpr", "fp32") and n not in _NOT_SPECIALISED
    }
    try:
        k = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": stages},
        )
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(k.asm["ptx"])
            arch = "sm_90a" if ".target sm_90a" in k.asm["ptx"] else "sm_90"
            rep = subprocess.run(
                [_ptxas(), f"-arch={arch}", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        text = rep.stdout + rep.stderr
        used, spill = _USED.search(text), _SPILL.search(text)
        if used is None or spill is None:
            return variant, f"no ptxas report: {text[-300:]}"
        return variant, {
            "regs": int(used.group(1)),
            "spill_stores": int(spill.group(1)),
            "spill_loads": int(spill.group(2)),
            "shared": int(k.metadata.shared),
        }
    except Exception as exc:  # e.g. shared memory beyond the GPU's: recorded, not fatal
        return variant, f"{type(exc).__name__}: {str(exc)[:300]}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--keep-existing", action="store_true",
        help="keep the variants already in --out and compile only the others (when the kernel's code "
        "behind the kept ones has not changed)",
    )  # fmt: skip
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    variants = [v for v in itertools.product(HEAD_DIMS, BLOCK_M, BLOCK_N, (False, True), WARPS, STAGES)
                if v[1] * v[0] <= 256 * 256]  # fmt: skip
    kept = {}
    if args.keep_existing and args.out.exists():
        for row in json.loads(args.out.read_text()).get("variants", []):
            kept[tuple(row[k] for k in _KEY)] = row
    todo = [v for v in variants if v not in kept]
    done = dict(kept)
    with ProcessPoolExecutor(args.workers) as pool:
        for i, (variant, result) in enumerate(pool.map(measure, todo, chunksize=4)):
            row = dict(zip(_KEY, variant, strict=True))
            row.update(result if isinstance(result, dict) else {"error": result})
            done[variant] = row
            if i % 50 == 0:
                print(f"{i + 1}/{len(todo)}", flush=True)
    rows = [done[v] for v in variants]
    import triton

    doc = {
        "what": "registers per thread and spill bytes of tree_attention_units_kernel variants, from ptxas -v, "
        "compiled with the JIT's launch-time specialisation (16-byte aligned pointers, strides divisible by 16)",
        "target": "sm_90", "group": GROUP, "dtype": "float16", "triton": triton.__version__,
        "command": "python -m bench.kernel_resources", "variants": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from fasttree.fileio import write_atomic

    write_atomic(args.out, json.dumps(doc, indent=0) + "\n")
    ok = sum("regs" in r for r in rows)
    print(f"{args.out}: {ok} of {len(rows)} variants compiled; {sum(r.get('spill_stores', 0) > 0 for r in rows)} spill")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
