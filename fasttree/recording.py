"""Record the trees a server sees at decode steps as a workload trace for the tuner.

:class:`WorkloadRecorder` samples every ``every``-th decode step's :class:`~fasttree.tree.KVTree`
and appends it as a ``kind: "workload"`` line (:func:`fasttree.traces.workload_record`)
through :class:`fasttree.traces.TraceWriter`, which validates each record and writes it
as one whole line (a killed server leaves only complete lines; a torn one is repaired on
the next open). Overhead and size are bounded: a call that is not sampled costs an
integer check, and recording stops for good after ``max_records`` records, when the
recorded trees' tokens would pass ``max_tokens`` or when the lines written would pass
``max_bytes``.

Feed the file to ``fasttree-tune tune`` / ``run`` like the shipped workloads (``fasttree/toolkit/data/workloads``)::

    rec = WorkloadRecorder("traces/recorded/server.jsonl", num_q_heads=32, num_kv_heads=8,
                           head_dim=128, dtype="float16")
    for step in range(...):
        tree = tree_from_req_to_token(req_to_token, req_pool_indices, seq_lens)
        rec.record(step, tree)
    rec.close()

This module needs only the standard library, numpy and fasttree's tree and trace
modules (no torch).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .plan_arrays import check_heads
from .traces import DTYPES, TraceWriter, workload_record
from .tree import KVTree
from .validation import check_choice, check_int, check_nonempty_str

__all__ = ["WorkloadRecorder"]

logger = logging.getLogger(__name__)


class WorkloadRecorder:
    """Sample decode-step trees into a ``.jsonl`` workload trace, with bounded overhead and size.

    Calls to :meth:`record` are counted from 0; calls ``0, every, 2 * every, ...`` are
    sampled (deterministic, whatever the ``step`` values). A sampled tree is written as
    one ``"workload"`` record with the model's head shape and dtype, ``workload.step``
    the caller's ``step``. Recording stops for good (logged once at INFO) at the first
    sampled tree that would exceed a limit: ``max_records`` records, ``max_tokens``
    tokens (the sum of :attr:`KVTree.num_tokens` of the recorded trees) or ``max_bytes``
    bytes of lines written. The limits count this recorder's records only: re-opening an
    existing file appends to it.

    Not thread-safe: call :meth:`record` from one thread (the scheduler's).

    Parameters
    ----------
    path : str or PathLike
        A ``.jsonl`` file, created (with its folders) when missing, appended to otherwise.
    num_q_heads, num_kv_heads, head_dim : int
        The model's attention shape (``num_q_heads`` a multiple of ``num_kv_heads``;
        ``head_dim`` in [16, 256]).
    dtype : str or torch.dtype
        ``"float16"`` or ``"bfloat16"`` (``torch.float16`` style accepted).
    every : int
        Sampling period in calls (>= 1).
    max_records : int
        Records to write at most (>= 1).
    max_tokens : int
        Tokens of the recorded trees at most (>= 1); the default, 2**32, is about 2048
        trees of two million tokens.
    max_bytes : int
        Bytes of trace lines to write at most (>= 1); the default is 64 MiB. Line size
        grows with a tree's nodes and queries, not its tokens.
    family : str
        ``workload.family`` of every record.
    scenario : str
        ``workload.scenario`` of every record.
    seed : int or None
        ``workload.seed`` of every record (>= 0 or None).
    fsync : bool
        ``os.fsync`` after each record (survives power loss). Off by default: the lines
        still survive a killed process, and a sampled step does not wait for the disk.

    Raises
    ------
    ValueError
        On a bad argument (named in the message), or a ``.gz`` path; nothing is created
        then.

    Examples
    --------
    >>> with WorkloadRecorder("run.jsonl", num_q_heads=32, num_kv_heads=8, head_dim=128,
    ...                       dtype="float16", every=16) as rec:  # doctest: +SKIP
    ...     rec.record(step, tree)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        every: int = 64,
        max_records: int = 2048,
        max_tokens: int = 1 << 32,
        max_bytes: int = 64 << 20,
        family: str = "recorded",
        scenario: str = "server",
        seed: int | None = None,
        fsync: bool = False,
    ) -> None:
        check_heads(num_q_heads, num_kv_heads, head_dim)
        dtype_name = check_choice("dtype", str(dtype).removeprefix("torch."), DTYPES)
        self._every = check_int("every", every, minimum=1)
        self._max_records = check_int("max_records", max_records, minimum=1)
        self._max_tokens = check_int("max_tokens", max_tokens, minimum=1)
        self._max_bytes = check_int("max_bytes", max_bytes, minimum=1)
        if seed is not None:
            seed = check_int("seed", seed, minimum=0)
        self._fixed = {
            "family": check_nonempty_str("family", family),
            "scenario": check_nonempty_str("scenario", scenario),
            "seed": seed,
            "num_q_heads": int(num_q_heads),
            "num_kv_heads": int(num_kv_heads),
            "head_dim": int(head_dim),
            "dtype": dtype_name,
        }
        self._writer: TraceWriter | None = TraceWriter(path, fsync=fsync)  # ValueError for .gz
        self.path = self._writer.path
        self._calls = 0
        self._n_recorded = 0
        self._tokens = 0
        self._bytes = 0
        #: Why recording stopped (a limit, an I/O error, ``"closed"``), or None while it runs.
        self.stop_reason: str | None = None

    # ------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, int, int, str]:
        """``(num_q_heads, num_kv_heads, head_dim, dtype)`` the records carry."""
        f = self._fixed
        return f["num_q_heads"], f["num_kv_heads"], f["head_dim"], f["dtype"]

    @property
    def n_recorded(self) -> int:
        """Records written by this recorder."""
        return self._n_recorded

    @property
    def n_calls(self) -> int:
        """Calls to :meth:`record` so far."""
        return self._calls

    @property
    def recorded_tokens(self) -> int:
        """Tokens of the recorded trees (what ``max_tokens`` bounds)."""
        return self._tokens

    @property
    def recorded_bytes(self) -> int:
        """Bytes of the lines written (what ``max_bytes`` bounds)."""
        return self._bytes

    @property
    def active(self) -> bool:
        """Whether later calls may still record (no limit reached, not closed)."""
        return self.stop_reason is None

    # ---------------------------------------------------------------- record
    def record(self, step: int, tree: KVTree) -> bool:
        """Count one decode step and record its tree when the step is sampled.

        Parameters
        ----------
        step : int
            The server's decode step index (>= 0), stored as ``workload.step``; it does
            not decide the sampling (the call count does).
        tree : KVTree
            The step's tree; only its shape is stored (:func:`fasttree.traces.encode_tree`).

        Returns
        -------
        bool
            Whether a record was written.

        Raises
        ------
        ValueError
            On a sampled call with ``step`` not an integer >= 0 or ``tree`` not a KVTree.
            Calls that are not sampled check nothing.

        Notes
        -----
        An ``OSError`` while writing (disk full, say) is logged and stops recording
        instead of failing the server's step; the file keeps only whole lines.
        """
        call = self._calls
        self._calls = call + 1
        if call % self._every or self.stop_reason is not None:
            return False
        return self._record(step, tree)

    def _record(self, step: int, tree: KVTree) -> bool:
        check_int("step", step, minimum=0)
        if not isinstance(tree, KVTree):
            raise ValueError(f"tree must be a KVTree, got {type(tree).__name__}")
        if self._tokens + tree.num_tokens > self._max_tokens:
            return self._stop(
                f"max_tokens ({self._max_tokens}) reached: {self._tokens} tokens recorded, "
                f"the next tree has {tree.num_tokens}"
            )
        record = workload_record(step=int(step), tree=tree, **self._fixed)
        # the line TraceWriter writes: canonical JSON plus its newline
        size = len(json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()) + 1
        if self._bytes + size > self._max_bytes:
            return self._stop(
                f"max_bytes ({self._max_bytes}) reached: {self._bytes} bytes written, the next line has {size}"
            )
        try:
            self._writer.append(record)
        except OSError as exc:
            logger.error("%s: workload recording stopped: write failed: %s", self.path, exc)
            self._halt(f"write failed: {exc}")
            return False
        self._n_recorded += 1
        self._tokens += tree.num_tokens
        self._bytes += size
        if self._n_recorded == self._max_records:  # stop now: close the file without waiting for a sample
            self._stop(f"max_records ({self._max_records}) records written")
        return True

    def _stop(self, reason: str) -> bool:
        logger.info("%s: workload recording stopped after %d record(s): %s", self.path, self._n_recorded, reason)
        self._halt(reason)
        return False

    def _halt(self, reason: str) -> None:
        self.stop_reason = reason
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Close the file (idempotent); later calls to :meth:`record` return False."""
        if self.stop_reason is None:
            self._halt("closed")

    def __enter__(self) -> WorkloadRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "recording" if self.stop_reason is None else f"stopped: {self.stop_reason}"
        return (
            f"WorkloadRecorder({str(self.path)!r}, every={self._every}, n_recorded={self._n_recorded}, "
            f"n_calls={self._calls}, {state})"
        )
