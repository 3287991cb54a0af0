"""Host-side cost of one ``tree_attention`` call (needs a CUDA GPU).

Enqueues many calls of a tiny case back to back and reports microseconds per call for:
input checks alone, the whole call, the cached direct launchers alone and the slow path's
launch list.
The GPU work per call is far below these times, so they measure the host::

    python -m bench.host_overhead
"""

from __future__ import annotations

import time

import torch

import fasttree as ft
from fasttree import attention
from fasttree.toolkit.suite import paper_tree


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

    # the pieces of a cached call: the direct launchers alone, and the JIT path they replace
    entries = [v for key, v in plan._device_cache.items() if isinstance(key, tuple) and key[0] == "direct"]
    if not entries:
        print("the direct launch path was not taken (launch hooks active?)")
        return 1
    _, launchers = entries[0]  # (fork mode, launchers): timed without the fork's events
    stream = torch.cuda.current_stream(0).cuda_stream
    scale = 1.0 / 128**0.5 * 1.4426950408889634

    ptrs = attention.launch_pointers(q, k, v, out)

    def direct() -> None:
        for launch in launchers:
            launch(stream, *ptrs, scale)

    print(f"launches per call: {len(launchers)}")
    print(f"direct launchers only: {per_call_us(direct):.1f} us/call")
    print(f"current stream: {per_call_us(lambda: torch.cuda.current_stream(0).cuda_stream):.1f} us/call")
    dev = attention._device_plan(plan, q.device)
    slow = per_call_us(lambda: attention._launches(plan, dev, q, k, v, out, scale))
    print(f"launch list (slow path, no launch): {slow:.1f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
