"""Host-side cost of one ``tree_attention`` call (needs a CUDA GPU).

Enqueues many calls of a tiny case back to back and reports microseconds per call for:
input checks alone, the whole call, and the bare Triton launch of the same kernel.
The GPU work per call is far below these times, so they measure the host::

    python -m bench.host_overhead
"""

from __future__ import annotations

import time

import torch

import fasttree as ft
from fasttree import attention
from fasttree.suite import paper_tree


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    tree = paper_tree(1)
    plan = ft.plan(tree, num_q_heads=16, num_kv_heads=1, head_dim=128)
    q = torch.randn(tree.n_queries, 16, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(tree.max_slot + 1, 1, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    ft.tree_attention(q, k, v, plan, out=out)
    print(f"units per class {plan.units_per_class()}")
    print(f"checks only: {per_call_us(lambda: attention._check_inputs(q, k, v, plan)):.1f} us/call")
    print(f"tree_attention(out=...): {per_call_us(lambda: ft.tree_attention(q, k, v, plan, out=out)):.1f} us/call")
    print(f"tree_attention(): {per_call_us(lambda: ft.tree_attention(q, k, v, plan)):.1f} us/call")
    print(f"torch.empty_like: {per_call_us(lambda: torch.empty_like(q)):.1f} us/call")

    # the pieces of one launch, with the arguments tree_attention would pass
    calls = []
    real_launch = attention._launch

    def spy(kernel, grid, args, constexprs, num_warps, num_stages):
        calls.append((kernel, grid, args, constexprs, num_warps, num_stages))
        real_launch(kernel, grid, args, constexprs, num_warps, num_stages)

    attention._launch = spy
    ft.tree_attention(q, k, v, plan, out=out)
    attention._launch = real_launch
    kernel, grid, args, constexprs, warps, stages = calls[0]
    key = (kernel, 0, constexprs, warps, stages, tuple(attention._arg_spec(x) for x in args))
    compiled = attention._COMPILED.get(key)
    if compiled is None:
        print("the cached launch path was not taken (launch hooks active?)")
        return 1
    stream = torch.cuda.current_stream(0).cuda_stream
    print(f"launches per call: {len(calls)}; stage-1 arguments: {len(args)}")
    print(f"_launch (cached path): {per_call_us(lambda: real_launch(*calls[0])):.1f} us/call")
    print(f"arg spec key: {per_call_us(lambda: tuple(attention._arg_spec(x) for x in args)):.1f} us/call")
    print(f"current stream: {per_call_us(lambda: torch.cuda.current_stream(0).cuda_stream):.1f} us/call")
    run = compiled.run
    fn, meta = compiled.function, compiled.packed_metadata

    def direct() -> None:
        run(grid[0], grid[1], 1, stream, fn, meta, None, None, None, *args, *constexprs)

    def jit() -> None:
        kernel[grid](*args, *constexprs, num_warps=warps, num_stages=stages)

    print(f"compiled.run only: {per_call_us(direct):.1f} us/call")
    print(f"kernel[grid](...) JIT path: {per_call_us(jit):.1f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
