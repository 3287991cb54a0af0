"""One CUDA graph per launch variant of a decode step: :class:`StepGraphs`.

A :class:`fasttree.runtime.TreeAttentionRuntime` runs each plan with the launches of its launch
variant (:attr:`fasttree.runtime.RuntimePlan.variant_id`). A graph captured while one variant's
plan was uploaded replays every later plan of that variant, and only those. ``StepGraphs`` keeps
the graphs of a server's decode step keyed by the variants of its runtimes' current plans,
captures a graph the first time its key is met (after one eager run of the step, which compiles
that variant's kernels) and replays it, the way serving engines keep one graph per batch-size
bucket. At most ``max_graphs`` are kept (the least recently replayed goes first); all share one
memory pool.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .validation import check_int

__all__ = ["StepGraphs"]

logger = logging.getLogger(__name__)


class StepGraphs:
    """CUDA graphs of one decode step, one per combination of the runtimes' launch variants.

    Parameters
    ----------
    step : callable
        Runs the whole decode step on the current stream from fixed buffers (every layer's
        ``rt.forward(q, k_cache[l], v_cache[l], out=o)`` and whatever else the step does). It is
        run eagerly once before each capture, so it must be safe to run twice for one step (a
        decode step's KV writes and attention are).
    runtimes : sequence of TreeAttentionRuntime
        The runtimes ``step`` calls; each has uploaded the step's plan (``rt.plan(tree)``)
        before :meth:`replay`.
    max_graphs : int
        Graphs kept at most, the least recently replayed dropped first (a runtime keeps at most
        ``max_variants`` variants live; the graph of one that left is never met again).
    pool : optional
        A memory pool handle (``torch.cuda.graph_pool_handle()``) the graphs share; one is made
        when None. The graphs may reuse each other's intermediate memory: read a step's outputs
        before the next replay.

    Examples
    --------
    >>> graphs = StepGraphs(decode_step, [rt])  # doctest: +SKIP
    >>> for tree in trees:  # doctest: +SKIP
    ...     rt.plan(tree)
    ...     graphs.replay()
    """

    def __init__(
        self,
        step: Callable[[], Any],
        runtimes: Sequence[Any],
        *,
        max_graphs: int = 64,
        pool: Any = None,
    ) -> None:
        if not callable(step):
            raise ValueError("step must be callable")
        self.runtimes = tuple(runtimes)
        if not self.runtimes:
            raise ValueError("StepGraphs needs at least one runtime")
        self.step = step
        self.max_graphs = check_int("max_graphs", max_graphs, minimum=1, expected="a positive integer")
        self._pool = pool
        self._graphs: OrderedDict[tuple[int, ...], torch.cuda.CUDAGraph] = OrderedDict()
        self.captures = 0

    def key(self) -> tuple[int, ...]:
        """The variant ids of the runtimes' current plans: which graph :meth:`replay` runs."""
        key = []
        for rt in self.runtimes:
            cur = rt.current_plan
            if cur is None:
                raise ValueError("replay() before every runtime has a plan: call rt.plan(tree) first")
            key.append(cur.variant_id)
        return tuple(key)

    def replay(self) -> None:
        """Replay the graph of the current plans' variants on the current stream, capturing it first
        (one eager run of ``step``, then the capture) when it is new."""
        key = self.key()
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key)
        else:
            self._graphs.move_to_end(key)
        graph.replay()

    def _capture(self, key: tuple[int, ...]) -> torch.cuda.CUDAGraph:
        if len(self._graphs) >= self.max_graphs:
            old, _ = self._graphs.popitem(last=False)
            logger.info("dropped the CUDA graph of launch variants %s (max_graphs=%d)", old, self.max_graphs)
        self.step()  # compiles this variant's kernels (launches are not captured while compiling)
        torch.cuda.current_stream().synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.step()
        self._graphs[key] = graph
        self.captures += 1
        return graph

    def __len__(self) -> int:
        return len(self._graphs)
