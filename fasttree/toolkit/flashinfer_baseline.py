"""FlashInfer as a peer in the kernel benchmark (optional: needs ``flashinfer-python``).

Two variants of :mod:`fasttree.toolkit.kernel_bench` run FlashInfer's kernels on the benchmark's
trees and data, with the pool slots as the page indices of a paged KV cache of page size 1
(layout ``NHD``: ``k[slot]`` is page ``slot``):

* ``flashinfer_decode`` -- ``BatchDecodeWithPagedKVCacheWrapper``: each query reads its whole
  root-to-node path, shared prefixes read once per query (what a serving engine's plain decode
  does; SGLang's FlashInfer backend runs it with page size 1). Tensor cores (the prefill kernel
  FlashInfer decodes with) are on when a KV head serves 4 or more query heads, SGLang's rule for
  16-bit caches (:func:`use_tensor_cores`).
* ``flashinfer_cascade`` -- ``MultiLevelCascadeAttentionWrapper``: one level per tree depth, each
  level's queries grouped by their node at that depth (a group's queries read the node's KV once,
  as one prefill segment), the levels' partial results merged by their log-sum-exp. FlashInfer's
  model needs every query in every level; :func:`cascade_levels` says how trees whose queries sit
  at different depths are fitted.

Both wrappers are built with ``use_cuda_graph=True`` and fixed index buffers, planned once per
tree outside timing, and their ``run`` is what the benchmark times and captures in its CUDA graphs.

A kernel that touches memory out of bounds leaves the CUDA context unusable for the rest of the
process, so the benchmark first runs every FlashInfer call it will time in a child process
(:func:`probe`: an eager call, then one captured and replayed), restarting the child past a case
that killed it, and times only the calls that passed there. The index building here is pure
NumPy (:func:`decode_page_table`, :func:`cascade_levels`) and runs without a GPU or FlashInfer.

Run ``python -m fasttree.toolkit.flashinfer_baseline --warmup`` on the GPU machine once before
the benchmark: FlashInfer compiles its kernels with ``nvcc`` on first use (about a minute or more
per kernel family; cached on disk for later processes).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..tree import KVTree

log = logging.getLogger("fasttree.toolkit.flashinfer_baseline")

#: The kernel benchmark's FlashInfer variants.
FLASHINFER_VARIANTS = ("flashinfer_decode", "flashinfer_cascade")
#: The version the benchmark was written against (another one runs, and is recorded).
TESTED_VERSION = "0.5.3"
#: Bytes of the float workspace all FlashInfer wrappers of a device share (they run one after another
#: on one stream); SGLang's default size.
WORKSPACE_BYTES = 384 << 20
#: Segments a cascade level may hold: FlashInfer's prefill wrapper keeps the segments' KV lengths in
#: a buffer of 32768 entries.
MAX_LEVEL_SEGMENTS = 32768
#: Seconds one child process of :func:`probe` may run before it is stopped (its first call compiles).
PROBE_TIMEOUT_S = 480.0


# ----------------------------------------------------------------------------- index building
@dataclass(frozen=True)
class PageTable:
    """A paged KV cache's index arrays for page size 1 (host arrays, int32).

    Attributes
    ----------
    indptr : ndarray, int32 [n_rows + 1]
        Row ``i``'s pages are ``indices[indptr[i]:indptr[i + 1]]``.
    indices : ndarray, int32 [indptr[-1]]
        Page ids (the pool slots).
    last_page_len : ndarray, int32 [n_rows]
        Tokens in each row's last page: 1 for every row (every row holds a token).
    """

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray


def _page_table(indptr: np.ndarray, slots: np.ndarray) -> PageTable:
    lens = np.diff(indptr)
    if lens.size and int(lens.min()) <= 0:
        raise ValueError("every row of a page table needs at least one token")
    return PageTable(
        indptr=np.ascontiguousarray(indptr, dtype=np.int32),
        indices=np.ascontiguousarray(slots, dtype=np.int32),
        last_page_len=np.ones(lens.size, dtype=np.int32),
    )


def decode_page_table(tree: KVTree) -> PageTable:
    """Each query's whole context as a page-size-1 page table: one row per query, in query order,
    its pages the slots of its root-to-node path, root first.

    Parameters
    ----------
    tree : KVTree

    Returns
    -------
    PageTable
        ``n_rows = tree.n_queries``; ``indptr[-1]`` is the sum of the queries' context lengths.
    """
    indptr, slots = tree.query_slots()
    return _page_table(indptr, slots)


@dataclass(frozen=True)
class CascadeLevels:
    """The inputs of FlashInfer's multi-level cascade for a tree (host arrays).

    Attributes
    ----------
    order : ndarray, int64 [n_queries]
        The queries in the cascade's row order: row ``r`` is query ``order[r]`` (every level's
        segments are runs of consecutive rows).
    qo_indptr : list of ndarray, int32 [n_segments_l + 1]
        Per level, segment ``s`` holds rows ``qo_indptr[l][s]:qo_indptr[l][s + 1]``.
    kv : list of PageTable
        Per level, the segments' KV (one page-table row per segment).
    """

    order: np.ndarray
    qo_indptr: list[np.ndarray]
    kv: list[PageTable]

    @property
    def num_levels(self) -> int:
        return len(self.kv)

    @property
    def identity_order(self) -> bool:
        """Whether the rows are the queries in their own order (no permutation around the call)."""
        return bool(np.array_equal(self.order, np.arange(self.order.size)))

    def segments(self) -> list[int]:
        """Segments per level."""
        return [int(p.size - 1) for p in self.qo_indptr]


def cascade_levels(tree: KVTree) -> CascadeLevels:
    """One cascade level per tree depth, for FlashInfer's ``MultiLevelCascadeAttentionWrapper``.

    Empty nodes are left out of the paths (a node's level counts the non-empty nodes above it).
    With ``L`` the fewest non-empty nodes on any query's path, level ``l < L - 1`` holds each
    query's ``l``-th non-empty node, queries with the same node forming one segment that reads
    it once; level ``L - 1`` holds the rest of each query's path (its nodes from that depth
    down, concatenated root first), one segment per run of queries at the same deepest node.
    So on trees whose queries all sit at one depth (the paper suite) every level is one depth;
    where queries sit at different depths, the depths below the shallowest query are read per
    query, as plain decode reads them: FlashInfer's cascade has every query in every level and
    a level of no KV is not in its model. The rows are the queries sorted by their root path,
    so every level's segments are runs of consecutive rows.

    Parameters
    ----------
    tree : KVTree

    Returns
    -------
    CascadeLevels

    Raises
    ------
    ValueError
        When a level would hold more segments than :data:`MAX_LEVEL_SEGMENTS`.
    """
    path_ptr, path_nodes = tree.query_paths()
    nonempty = tree.lengths[path_nodes] > 0
    counts = np.add.reduceat(nonempty.astype(np.int64), path_ptr[:-1]) if path_nodes.size else np.zeros(0)
    nq = tree.n_queries
    # the queries' non-empty path nodes, root first, padded with -1 (so an ancestor's query sorts first)
    width = int(counts.max())
    table = np.full((nq, width), -1, dtype=np.int64)
    rows = np.repeat(np.arange(nq), np.diff(path_ptr))[nonempty]
    kept_ptr = np.zeros(nq + 1, dtype=np.int64)
    np.cumsum(counts, out=kept_ptr[1:])
    cols = np.arange(rows.size) - kept_ptr[rows]
    table[rows, cols] = path_nodes[nonempty]
    order = np.lexsort(table.T[::-1]) if width else np.arange(nq)
    table = table[order]
    counts = counts[order]
    n_levels = int(counts.min())
    deepest = table[np.arange(nq), counts - 1]
    qo_indptr: list[np.ndarray] = []
    kv: list[PageTable] = []
    for lvl in range(n_levels):
        key = table[:, lvl] if lvl < n_levels - 1 else deepest
        starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
        if starts.size > MAX_LEVEL_SEGMENTS:
            raise ValueError(
                f"cascade level {lvl} holds {starts.size} segments, over FlashInfer's {MAX_LEVEL_SEGMENTS}"
            )
        first = table[starts]
        # a segment's nodes: its one node at this depth, or at the last level the rest of its path
        nodes = first[:, lvl : lvl + 1] if lvl < n_levels - 1 else first[:, lvl:]
        valid = nodes >= 0
        node_list = nodes[valid]
        seg_of = np.repeat(np.arange(starts.size), valid.sum(axis=1))
        lens = tree.lengths[node_list]
        seg_len = np.bincount(seg_of, weights=lens, minlength=starts.size).astype(np.int64)
        kv_ptr = np.zeros(starts.size + 1, dtype=np.int64)
        np.cumsum(seg_len, out=kv_ptr[1:])
        slots = (
            np.concatenate([tree.node_slots(int(n)) for n in node_list]) if node_list.size else np.zeros(0, np.int32)
        )
        qo = np.concatenate([starts, [nq]]).astype(np.int32)
        qo_indptr.append(qo)
        kv.append(_page_table(kv_ptr, slots))
    return CascadeLevels(order=order.astype(np.int64), qo_indptr=qo_indptr, kv=kv)


def use_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """SGLang's rule for FlashInfer's decode on 16-bit caches: tensor cores (the prefill kernel)
    when a KV head serves 4 or more query heads."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads >= 4


# ----------------------------------------------------------------------------- FlashInfer calls
_IMPORTED: tuple[ModuleType | None, str | None] | None = None


def import_flashinfer() -> tuple[ModuleType | None, str | None]:
    """FlashInfer's module, or None and why it cannot be used (imported once per process).

    Returns
    -------
    module : ModuleType or None
    reason : str or None
        Why the variants are skipped: FlashInfer missing or failing to import.
    """
    global _IMPORTED
    if _IMPORTED is None:
        try:
            fi = importlib.import_module("flashinfer")
        except Exception as exc:  # ImportError, or a broken install failing in its own imports
            _IMPORTED = (None, f"flashinfer cannot be imported ({type(exc).__name__}: {exc})")
        else:
            _IMPORTED = (fi, None)
    return _IMPORTED


def flashinfer_version() -> str | None:
    """The imported FlashInfer's version, or None."""
    fi, _ = import_flashinfer()
    return None if fi is None else str(getattr(fi, "__version__", "unknown"))


_WORKSPACES: dict[str, Any] = {}


def shared_workspace(device):
    """The float workspace the device's wrappers share (they run one after another on one stream):
    uint8 ``[WORKSPACE_BYTES]`` on ``device``, zeroed (FlashInfer asks for zeros at first use)."""
    import torch

    key = str(device)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]


def _device_table(table: PageTable, device) -> tuple[Any, Any, Any]:
    import torch

    return tuple(torch.from_numpy(a).to(device) for a in (table.indptr, table.indices, table.last_page_len))


def host_table(table: PageTable) -> tuple[Any, Any, Any]:
    """``table``'s arrays as CPU int32 tensors (indptr, indices, last_page_len), as a wrapper's ``plan``
    takes them."""
    import torch

    return tuple(torch.from_numpy(a) for a in (table.indptr, table.indices, table.last_page_len))


@dataclass
class Runner:
    """A planned FlashInfer call.

    Attributes
    ----------
    call : callable
        ``call()`` returns the attention output, q's dtype on its device, ``[n_queries, Hq, D]``, in
        the queries' order.
    info : dict
        The plan's description for the report.
    out : Tensor or None
        The fixed buffer ``call()`` writes and returns, or None when each call allocates its output.
    """

    call: Callable[[], Any]
    info: dict[str, Any]
    out: Any = None


def decode_runner(fi: ModuleType, q, k, v, tree: KVTree) -> Runner:
    """FlashInfer's batch decode over each query's whole path (page size 1), planned for CUDA graphs.

    Parameters
    ----------
    fi : module
        FlashInfer.
    q : Tensor, fp16/bf16, CUDA, [n_queries, Hq, D]
    k, v : Tensor, q's dtype and device, [pool_slots, Hkv, D]
        The KV pool; slot ``s`` is page ``s``.
    tree : KVTree
        Its slots index ``k`` and ``v``.

    Returns
    -------
    Runner
        Writes into a fixed output buffer, which ``call()`` returns.
    """
    import torch

    _, hq, d = q.shape
    hkv = k.shape[1]
    tc = use_tensor_cores(hq, hkv)
    table = decode_page_table(tree)
    indptr, indices, last = _device_table(table, q.device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        shared_workspace(q.device), "NHD", use_cuda_graph=True, use_tensor_cores=tc,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
    )  # fmt: skip
    wrapper.plan(*host_table(table), hq, hkv, d, 1, q_data_type=q.dtype, kv_data_type=k.dtype)
    torch.cuda.synchronize(q.device)
    cache = (k.unsqueeze(1), v.unsqueeze(1))  # [pages, page_size 1, Hkv, D]
    out = torch.empty_like(q)

    def call():
        return wrapper.run(q, cache, out=out)

    return Runner(call, {"tensor_cores": tc, "page_size": 1, "kv_entries": int(table.indices.size)}, out)


def cascade_runner(fi: ModuleType, q, k, v, tree: KVTree) -> Runner:
    """FlashInfer's multi-level cascade, one level per depth (:func:`cascade_levels`), planned for
    CUDA graphs. Arguments as :func:`decode_runner`'s; ``call()`` returns a new tensor each call
    (the wrapper allocates its output), permuting q and the output when the cascade's row order is
    not the queries' own."""
    import torch

    nq, hq, d = q.shape
    hkv = k.shape[1]
    levels = cascade_levels(tree)
    dev = q.device
    qo_dev = [torch.from_numpy(p).to(dev) for p in levels.qo_indptr]
    kv_dev = [_device_table(t, dev) for t in levels.kv]
    wrapper = fi.MultiLevelCascadeAttentionWrapper(
        levels.num_levels, shared_workspace(dev), "NHD", use_cuda_graph=True,
        qo_indptr_buf_arr=qo_dev, paged_kv_indptr_buf_arr=[t[0] for t in kv_dev],
        paged_kv_indices_buf_arr=[t[1] for t in kv_dev], paged_kv_last_page_len_buf_arr=[t[2] for t in kv_dev],
    )  # fmt: skip
    host = [host_table(t) for t in levels.kv]
    wrapper.plan(
        [torch.from_numpy(p) for p in levels.qo_indptr], [t[0] for t in host], [t[1] for t in host],
        [t[2] for t in host], hq, hkv, d, 1, q_data_type=q.dtype, kv_data_type=k.dtype,
    )  # fmt: skip
    torch.cuda.synchronize(dev)
    cache = (k.unsqueeze(1), v.unsqueeze(1))
    info = {
        "levels": levels.num_levels, "segments": levels.segments(), "page_size": 1,
        "kv_entries": int(sum(t.indices.size for t in levels.kv)), "permuted": not levels.identity_order,
    }  # fmt: skip
    if levels.identity_order:
        return Runner(lambda: wrapper.run(q, cache), info)
    perm = torch.from_numpy(levels.order).to(dev)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(nq, device=dev)

    def call():
        return wrapper.run(q.index_select(0, perm), cache).index_select(0, inv)

    return Runner(call, info)


_BUILDERS = {"flashinfer_decode": decode_runner, "flashinfer_cascade": cascade_runner}


def make_runner(name: str, q, k, v, tree: KVTree) -> Runner:
    """The planned call of FlashInfer variant ``name`` (one of :data:`FLASHINFER_VARIANTS`).

    Raises
    ------
    ValueError
        On an unknown ``name``.
    RuntimeError
        When FlashInfer cannot be imported.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown FlashInfer variant {name!r}: expected one of {FLASHINFER_VARIANTS}")
    fi, reason = import_flashinfer()
    if fi is None:
        raise RuntimeError(reason)
    return _BUILDERS[name](fi, q, k, v, tree)


# ----------------------------------------------------------------------------- crash-isolated probe
def probe(
    items: Sequence[dict[str, Any]],
    variants: Sequence[str],
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
    max_restarts: int = 20,
    command: Sequence[str] | None = None,
) -> dict[tuple[str, str], str]:
    """Run every FlashInfer call the benchmark will time in child processes first.

    Each child (``python -m fasttree.toolkit.flashinfer_baseline --probe``) builds each item's
    tree and inputs as the benchmark does, plans each variant, calls it once eagerly and once
    from a captured CUDA graph, synchronising after each. A child that dies (an out-of-bounds
    access poisons its CUDA context) or outlasts ``timeout_s`` is restarted past the call it was
    making, which is recorded as failed.

    Parameters
    ----------
    items : sequence of dict
        JSON-able case descriptions, as :func:`fasttree.toolkit.bench_cases.probe_item` makes them;
        each has a ``"key"`` string.
    variants : sequence of str
        FlashInfer variants to probe.
    timeout_s : float
        Wall time a child may take.
    max_restarts : int
        Children started after the first, at most; calls left when they are spent are recorded
        as not probed.
    command : sequence of str, optional
        The child's command line (default: this module's ``--probe`` under the running Python).

    Returns
    -------
    dict
        ``(item key, variant) -> error`` for every call that failed (raised, crashed the child or
        timed out); the calls not in it passed.
    """
    jobs = [(dict(item), name) for item in items for name in variants]
    failures: dict[tuple[str, str], str] = {}
    start = 0
    for attempt in range(max_restarts + 1):
        if start >= len(jobs):
            break
        payload = json.dumps([{"item": item, "variant": name} for item, name in jobs[start:]])
        with tempfile.TemporaryFile(mode="w+") as err:
            proc = subprocess.Popen(
                list(command or [sys.executable, "-m", "fasttree.toolkit.flashinfer_baseline", "--probe"]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
            timed_out = False
            try:
                stdout, _ = proc.communicate(payload, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, _ = proc.communicate()
                timed_out = True
            err.seek(0)
            err_tail = err.read()[-2000:]
        done = start
        started = None
        for line in (stdout or "").splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict) or "event" not in msg:  # anything else the child printed
                continue
            idx = start + int(msg["job"])
            if msg["event"] == "start":
                started = idx
            elif msg["event"] == "done":
                if msg.get("error"):
                    failures[(jobs[idx][0]["key"], jobs[idx][1])] = msg["error"]
                started = None
                done = idx + 1
        if proc.returncode == 0 and not timed_out and done >= len(jobs):
            return failures
        if started is not None:  # the call in flight when the child died or was stopped
            why = f"timed out after {timeout_s:.0f} s" if timed_out else f"the process died (exit {proc.returncode})"
            failures[(jobs[started][0]["key"], jobs[started][1])] = f"{why}: {err_tail.strip()[-600:]}"
            log.warning("FlashInfer probe: %s %s %s", jobs[started][0]["key"], jobs[started][1], why)
            done = started + 1
        elif done == start:  # died before its first call (import, CUDA start): nothing more to learn
            for item, name in jobs[start:]:
                failures[(item["key"], name)] = f"probe process failed (exit {proc.returncode}): {err_tail[-600:]}"
            return failures
        start = done
        log.info("FlashInfer probe: restarting past call %d of %d (restart %d)", start, len(jobs), attempt + 1)
    for item, name in jobs[start:]:
        failures.setdefault((item["key"], name), "not probed (restarts spent)")
    return failures


def _probe_child(jobs: list[dict[str, Any]]) -> int:
    """The child of :func:`probe`: one JSON line per event on stdout."""
    import torch

    from .bench_cases import probe_inputs
    from .timing import _captured

    def emit(**msg: Any) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    for j, job in enumerate(jobs):
        emit(event="start", job=j)
        error = None
        try:
            tree, q, k, v = probe_inputs(job["item"])
            runner = make_runner(job["variant"], q, k, v, tree)
            runner.call()
            torch.cuda.synchronize()
            graph = _captured(runner.call, 1)
            graph.replay()
            torch.cuda.synchronize()
            del graph, runner, q, k, v
        except Exception as exc:  # recorded; the parent restarts us past it if the context is gone
            error = f"{type(exc).__name__}: {exc}"[:600]
        emit(event="done", job=j, error=error)
        if error is not None:
            try:
                torch.cuda.synchronize()
            except Exception:
                return 3  # the CUDA context is broken: a fresh process takes the next call
    return 0


def warmup(head_dim: int = 128, dtype_name: str = "float16") -> dict[str, float]:
    """Compile FlashInfer's kernels for the benchmark's calls at ``head_dim`` and ``dtype_name``
    (decode with and without tensor cores, cascade) on a small tree; seconds per call."""
    import torch

    from .bench_common import DTYPES

    fi, reason = import_flashinfer()
    if fi is None:
        raise RuntimeError(reason)
    dtype = DTYPES[dtype_name]
    tree = KVTree.from_levels((1, 2, 4), (16, 8, 4))
    times: dict[str, float] = {}
    for hq, hkv in ((32, 32), (32, 8)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(tree.n_queries, hq, head_dim, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(tree.max_slot + 1, hkv, head_dim, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn_like(k)
        for name in FLASHINFER_VARIANTS:
            t0 = time.perf_counter()
            make_runner(name, q, k, v, tree).call()
            torch.cuda.synchronize()
            times[f"{name} {hq}/{hkv}"] = time.perf_counter() - t0
    return times


def main(argv: Sequence[str] | None = None) -> int:
    """``--warmup``: compile the kernels (see :func:`warmup`); ``--probe``: the child of :func:`probe`
    (jobs as JSON on stdin)."""
    p = argparse.ArgumentParser(
        prog="python -m fasttree.toolkit.flashinfer_baseline", description=__doc__.split("\n\n")[0]
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--warmup", action="store_true", help="compile FlashInfer's kernels for the benchmark")
    mode.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--head-dims", default="128", help="head dims to compile for, comma separated (default 128)")
    p.add_argument("--dtypes", default="float16", help="dtypes to compile for, comma separated (default float16)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.probe:
        return _probe_child(json.loads(sys.stdin.read()))
    fi, reason = import_flashinfer()
    if fi is None:
        log.error("%s", reason)
        return 2
    log.info("flashinfer %s from %s", flashinfer_version(), os.path.dirname(fi.__file__))
    for d in (int(x) for x in args.head_dims.split(",") if x):
        for dt in (x for x in args.dtypes.split(",") if x):
            t0 = time.perf_counter()
            times = warmup(d, dt)
            log.info("D %d %s: %.1f s (%s)", d, dt, time.perf_counter() - t0,
                     ", ".join(f"{k} {s:.1f} s" for k, s in times.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
