"""Compile the Triton kernels a batch of design points needs ahead, in worker processes.

:func:`kernel_specialisations` finds the kernel specialisations the points' first calls
would compile, without compiling or launching them (Triton's ``jit_cache_hook``);
:class:`CompilePool` compiles them in spawned worker processes into Triton's disk cache,
so that the measuring process finds them there. The profiler queues the next batch's
kernels while the current batch is measured.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from .design import DesignPoint, point_tree
from .measure import error_text, point_plan, runtime_for

logger = logging.getLogger(__name__)

__all__ = ["CompilePool", "default_compile_workers", "kernel_specialisations"]


def _compile_worker(module: str, name: str, specialization: str) -> tuple[str | None, float]:
    """Compile one kernel specialisation in a worker process (Triton's ``preload``); fills the disk cache."""
    t0 = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(module), name)
        fn.preload(specialization)
    except Exception as exc:
        return error_text(exc), time.perf_counter() - t0
    return None, time.perf_counter() - t0


@contextlib.contextmanager
def _record_compiles(found: dict[str, tuple[str, str]]) -> Iterator[None]:
    """While active, Triton records each kernel specialisation it would compile in ``found``
    (specialisation JSON -> (module, name)) and skips compiling and launching it."""
    import triton

    knobs = triton.knobs.runtime
    previous = knobs.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # Triton's keyword names
        found.setdefault(compile["specialization_data"], (str(fn.module), str(fn.name)))
        return True

    knobs.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.jit_cache_hook = previous


def kernel_specialisations(points: Iterable[DesignPoint], device: Any) -> dict[str, tuple[str, str]]:
    """The Triton specialisations the points' first ``tree_attention`` (or runtime) calls would compile.

    Each point is planned and run once on uninitialised tensors of its real shapes with
    Triton's ``jit_cache_hook`` set to record and skip every compilation (so a kernel
    that is not compiled yet is neither compiled nor launched; ones already loaded in
    this process run on the garbage inputs, harmlessly). Points that fail to plan or
    allocate are left out (their measurement records the failure).

    Parameters
    ----------
    points : iterable of DesignPoint
    device : str or torch.device
        A CUDA device.

    Returns
    -------
    dict
        Triton's ``specialization_data`` JSON -> (kernel module, kernel name).
    """
    import torch

    import fasttree as ft

    found: dict[str, tuple[str, str]] = {}
    with _record_compiles(found):
        for point in points:
            try:
                tree = point_tree(point)
                plan = point_plan(point, tree)
                dtype = getattr(torch, point.dtype)
                pool = tree.max_slot + 1
                q = torch.empty(tree.n_queries, point.num_q_heads, point.head_dim, device=device, dtype=dtype)
                k = torch.empty(pool, point.num_kv_heads, point.head_dim, device=device, dtype=dtype)
                v = torch.empty_like(k)
                if point.runtime:
                    runtime_for(point, tree, plan, device).forward(q, k, v, out=torch.empty_like(q))
                else:
                    ft.tree_attention(q, k, v, plan, out=torch.empty_like(q))
            except Exception as exc:
                logger.debug("compile discovery of %s: %s", point.describe(), error_text(exc))
            finally:
                q = k = v = plan = None
    return found


class CompilePool:
    """A pool of spawned worker processes that compile kernel specialisations into Triton's disk cache.

    :meth:`submit` queues specialisations and returns at once (so the next batch compiles
    while the current one is measured); :meth:`wait` blocks until a submission is done.
    A specialisation is submitted once per compiler. ``seconds`` is the time spent
    waiting, i.e. the compile time that measurement did not hide.
    """

    def __init__(self, workers: int) -> None:
        self.workers = max(1, int(workers))
        self._pool = None
        self._submitted: set[str] = set()
        self.compiled = 0
        self.failed = 0
        self.seconds = 0.0

    def _executor(self):
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def submit(self, specs: dict[str, tuple[str, str]]) -> dict[Any, str]:
        """Queue the specialisations not submitted before; returns their futures (future -> kernel name)."""
        new = {data: where for data, where in specs.items() if data not in self._submitted}
        if not new:
            return {}
        self._submitted.update(new)
        pool = self._executor()
        return {pool.submit(_compile_worker, mod, name, data): name for data, (mod, name) in new.items()}

    def wait(self, futures: dict[Any, str], deadline: float | None) -> None:
        """Block until ``futures`` (from :meth:`submit`) are done, or until ``deadline`` (``time.monotonic``)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        if not futures:
            return
        t0 = time.monotonic()
        pending = set(futures)
        errors: list[str] = []
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    error, _ = f.result()
                except Exception as exc:  # a worker died (BrokenProcessPool) or similar
                    error = error_text(exc)
                if error is None:
                    self.compiled += 1
                else:
                    self.failed += 1
                    errors.append(f"{futures[f]}: {error}")
            if pending and deadline is not None and time.monotonic() >= deadline:
                for f in pending:
                    f.cancel()
                logger.info("time budget reached while compiling: %d kernel variant(s) left", len(pending))
                break
        spent = time.monotonic() - t0
        self.seconds += spent
        if errors:
            logger.warning("%d kernel variant(s) failed to compile ahead; first: %s", len(errors), errors[0])
        logger.debug(
            "%d kernel variant(s) compiled ahead; waited %.1f s for them (%d worker process(es))",
            len(futures) - len(pending) - len(errors),
            spent,
            self.workers,
        )

    def compile(self, specs: dict[str, tuple[str, str]], deadline: float | None) -> None:
        """Compile ``specs`` and wait for them (:meth:`submit` then :meth:`wait`)."""
        self.wait(self.submit(specs), deadline)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def default_compile_workers() -> int:
    """``min(16, os.cpu_count())``."""
    return max(1, min(16, os.cpu_count() or 1))
