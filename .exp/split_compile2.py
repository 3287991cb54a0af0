import sys; sys.path.insert(0, "/work/main/.exp")
from split_compile import comp, units_split_kernel, tree_attention_units_kernel
cases = [("split2 n64 w4 s3", dict(bm=16, bn=64, masked=True, warps=4, stages=3, split=2)),
         ("split4 n64 w4 s2", dict(bm=16, bn=64, masked=True, warps=4, stages=2, split=4)),
         ("split4 n64 w4 s4", dict(bm=16, bn=64, masked=True, warps=4, stages=4, split=4)),
         ("split4 n64 w4 s5", dict(bm=16, bn=64, masked=True, warps=4, stages=5, split=4)),
         ("split2 n32 w2 s5", dict(bm=16, bn=32, masked=True, warps=2, stages=5, split=2)),
         ("split2 n64 w2 s2", dict(bm=16, bn=64, masked=True, warps=2, stages=2, split=2)),
         ("split4 n64 w4 s3 nomask", dict(bm=16, bn=64, masked=False, warps=4, stages=3, split=4)),
         ("split4 n64 w4 s3 peel", dict(bm=16, bn=64, masked=True, warps=4, stages=3, split=4, peel=True)),
         ("split8 n128 w8 s3", dict(bm=16, bn=128, masked=True, warps=8, stages=3, split=8)),
         ]
for name, kw in cases:
    r = comp(units_split_kernel, **kw)
    print(name, {k: v for k, v in r.items() if k not in ("ttgir", "ptx")}, flush=True)
