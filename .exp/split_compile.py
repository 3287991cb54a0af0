import sys, re, subprocess, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main/.exp"); sys.path.insert(0, "/work/main")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fasttree.kernels import tree_attention_units_kernel
from split_unit import units_split_kernel
PTRS = ("Q","K","V","Out","PartO","PartLse","KvIndices","KvRowMask","UnitKvStart","UnitKvLen","UnitQStart","UnitQLen","PairQuery","PairOutRow")
NOSPEC = {"unit_offset", "stride_ln"}
def comp(kernel, bm, bn, masked, warps, stages, peel=False, split=None, g=1, d=128):
    types = {"Q":"*fp16","K":"*fp16","V":"*fp16","Out":"*fp16","PartO":"*fp32","PartLse":"*fp32"}
    sig = {n: types.get(n, "*i32") for n in PTRS}
    cx = {"HEAD_DIM": d, "BLOCK_D": d, "GROUP": g, "BLOCK_M": bm, "BLOCK_N": bn, "MASKED": masked, "UPCAST_DOT": False, "OFFSETS_32": True, "PEEL": peel}
    if "KV_SPLIT" in kernel.arg_names: cx["KV_SPLIT"] = split or 1
    elif split: cx["SPLIT"] = split
    for n in kernel.arg_names[len(PTRS):]:
        sig[n] = "constexpr" if n in cx else ("fp32" if n == "qk_scale" else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n] not in ("constexpr","fp32") and n not in NOSPEC}
    k = triton.compile(ASTSource(kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as t:
        p = Path(t)/"k.ptx"; p.write_text(ptx)
        arch = "sm_90a" if ".target sm_90a" in ptx else "sm_90"
        r = subprocess.run([str(Path(triton.__file__).parent/"backends"/"nvidia"/"bin"/"ptxas"), f"-arch={arch}", "-v", str(p), "-o", str(Path(t)/"k.cubin")], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stdout + r.stderr).group(1)
    spill = re.search(r"(\d+) bytes spill stores", r.stdout + r.stderr).group(1)
    mma = re.findall(r"#ttg.nvidia_mma<\{[^}]*\}>", k.asm["ttgir"])
    return dict(regs=regs, spill=spill, smem=k.metadata.shared, bar=ptx.count("bar.sync") + ptx.count("barrier.sync"), mma_sync=ptx.count("mma.sync"), wgmma=ptx.count("wgmma.mma_async"), cp_async=ptx.count("cp.async.ca") + ptx.count("cp.async.cg"), layouts=sorted(set(mma)), ttgir=k.asm["ttgir"], ptx=ptx)

if __name__ == "__main__":
    cases = [("prod m16 n64 w2 s5", tree_attention_units_kernel, dict(bm=16, bn=64, masked=True, warps=2, stages=5)),
             ("prod m16 n64 w4 s3", tree_attention_units_kernel, dict(bm=16, bn=64, masked=True, warps=4, stages=3)),
             ("split2 m16 n64 w2 s5", units_split_kernel, dict(bm=16, bn=64, masked=True, warps=2, stages=5, split=2)),
             ("split2 m16 n64 w2 s3", units_split_kernel, dict(bm=16, bn=64, masked=True, warps=2, stages=3, split=2)),
             ("split4 m16 n64 w4 s3", units_split_kernel, dict(bm=16, bn=64, masked=True, warps=4, stages=3, split=4)),
             ("split4 m16 n128 w4 s3", units_split_kernel, dict(bm=16, bn=128, masked=True, warps=4, stages=3, split=4)),
             ("split2 m16 n128 w2 s3", units_split_kernel, dict(bm=16, bn=128, masked=True, warps=2, stages=3, split=2)),
             ]
    for name, kern, kw in cases:
        r = comp(kern, **kw)
        Path(f"/work/main/.exp/{name.replace(' ','_')}.ttgir").write_text(r["ttgir"])
        Path(f"/work/main/.exp/{name.replace(' ','_')}.ptx").write_text(r["ptx"])
        print(name, {k: v for k, v in r.items() if k not in ("ttgir", "ptx")}, flush=True)
