"""GPU timing helpers shared by the benchmarks and the profiler.

* :func:`graph_time_us` -- pure GPU time: ``calls`` invocations captured in one CUDA graph,
  median replay time divided by ``calls`` (the method of the project's H200 anchors).
* :func:`eager_time_us` -- the plain call through ``triton.testing.do_bench`` (median; it
  clears the L2 cache between calls), launch gaps and host work included.
* :func:`graph_cold_time_us` -- one call replayed from a CUDA graph, timed as
  :func:`eager_time_us` times the plain call (L2 cleared before each replay): what the eager
  call costs over it is launching, at the same cache state.
* :func:`eager_loop_time_us` -- ``calls`` plain calls back to back, timed like the graph
  replay (same call count, caches as warm): what launching eagerly costs over the graph
  when one call follows another, as a model's layers do.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton


def graph_time_us(
    fn: Callable[[], object],
    *,
    calls: int = 20,
    replays: int = 30,
    warmup: int = 3,
    budget_s: float = 0.25,
    max_graph_ms: float | None = None,
) -> dict:
    """Median, p20 and p80 of one call's GPU time (us) by CUDA-graph replay.

    At most ``replays`` replays (at least 5), fewer when they would exceed ``budget_s``.
    With ``max_graph_ms``, one call is timed after the warm-up and the graph captures
    fewer than ``calls`` calls (at least one) when they would take longer than that, so
    slow calls are not repeated needlessly.

    ``fn`` must be capturable: no host synchronisation, device buffers it needs already
    allocated or allocated from the graph's pool (torch allocations inside are fine).
    """
    for _ in range(warmup):  # compile kernels, upload plans, settle the allocator
        fn()
    torch.cuda.synchronize()
    if max_graph_ms is not None:
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        calls = int(max(1, min(calls, max_graph_ms // max(a.elapsed_time(b), 1e-6))))
    graph = _captured(fn, calls)
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    graph.replay()
    t1.record()
    torch.cuda.synchronize()
    one = t0.elapsed_time(t1) * 1e-3
    replays = int(max(5, min(replays, budget_s / max(one, 1e-9))))
    times = _per_call_us(graph.replay, replays, calls)
    del graph
    return {**_spread(times), "replays": replays, "calls_per_graph": calls}


def interleaved_graph_times_us(
    fns: dict[str, Callable[[], object]],
    *,
    calls: int = 20,
    rounds: int = 6,
    replays: int = 5,
    warmup: int = 3,
    budget_s: float = 0.5,
    min_rounds: int | None = None,
) -> dict[str, dict]:
    """:func:`graph_time_us` of several calls, their replays interleaved: ``rounds`` rounds, each
    ``replays`` replays of every call's graph in turn, so that a drift of the GPU's clocks or
    temperature during the measurement reaches every call alike (their ratios are what is compared).
    Each round starts one call later in the order (round ``r`` runs call ``r mod n`` first), so no
    call always follows the same other one (a heavy call before it warms the GPU and evicts the L2
    cache it would find warm). Fewer rounds when they would exceed ``budget_s``, never fewer than
    ``min_rounds`` (default: the number of calls, so every call runs in every position) nor 2.
    Same keys as ``fns``; each value as :func:`graph_time_us`'s."""
    graphs = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        graphs[name] = _captured(fn, calls)
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for graph in graphs.values():
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    one_round = t0.elapsed_time(t1) * 1e-3 * replays
    least = len(graphs) if min_rounds is None else min_rounds
    rounds = int(max(2, least, min(rounds, budget_s / max(one_round, 1e-9))))
    order = list(graphs)
    times: dict[str, list[np.ndarray]] = {name: [] for name in graphs}
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            times[name].append(_per_call_us(graphs[name].replay, replays, calls))
    graphs.clear()
    return {
        name: {**_spread(np.concatenate(t)), "replays": rounds * replays, "calls_per_graph": calls}
        for name, t in times.items()
    }


def _captured(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, captured after one call on a side stream (as
    torch advises before a capture: lazy initialisations then happen outside it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _per_call_us(run: Callable[[], object], replays: int, calls: int) -> np.ndarray:
    """One call's time (us) in each of ``replays`` event-timed runs of ``run``, which issues ``calls`` calls."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(start, end, strict=True):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return np.array([s.elapsed_time(e) for s, e in zip(start, end, strict=True)]) * 1e3 / calls


def _spread(times: np.ndarray) -> dict:
    return {
        "median": float(np.median(times)),
        "p20": float(np.percentile(times, 20)),
        "p80": float(np.percentile(times, 80)),
    }


def eager_time_us(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time (us) of the plain call, by ``triton.testing.do_bench``."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3


def graph_cold_time_us(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time (us) of one call replayed from a CUDA graph, by ``triton.testing.do_bench``.

    The counterpart of :func:`eager_time_us` without the host's launches: ``do_bench`` clears
    the L2 cache before each replay as it does before each eager call, whereas
    :func:`graph_time_us` replays many calls back to back, whose data a small call finds in L2.
    ``fn`` must be capturable (see :func:`graph_time_us`).
    """
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = _captured(fn, 1)
    t = float(triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3
    del graph
    return t


def eager_loop_time_us(fn: Callable[[], object], *, calls: int = 20, replays: int = 30, warmup: int = 3) -> dict:
    """Median, p20 and p80 of one call's time (us) over ``calls`` eager calls issued back to back.

    The counterpart of :func:`graph_time_us` without the graph: the same number of calls
    between two events, so the caches are as warm and the difference is what the host's
    launches and per-call work add (launch gaps the GPU waits through). Unlike
    :func:`eager_time_us` it does not clear the L2 cache, and the host's work before a
    call's first launch overlaps the previous call's kernels.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def back_to_back() -> None:
        for _ in range(calls):
            fn()

    return _spread(_per_call_us(back_to_back, replays, calls))
