"""Registers and spills of the stage-1 kernel variants, from the compiler (no GPU needed).

``data/kernel_resources_sm90.json`` is written by ``python -m bench.kernel_resources``: for
every (head dim, query-tile rows, KV tile, masked, warps, stages) of the search space, the
registers per thread and the spill stores and loads that ptxas reports for sm_90. The
simulator and the features look variants up here; a variant the table lacks (another head
dim, a Triton that compiles differently) gets ``None`` and the simulator falls back to its
estimate from tile sizes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMPILED_FIELDS", "KernelResources", "compiled_features", "kernel_resources"]

_TABLE = Path(__file__).with_name("data") / "kernel_resources_sm90.json"


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one variant.

    Attributes
    ----------
    regs : int
        Registers per thread.
    spill_bytes : int
        Spill stores plus spill loads per thread (bytes).
    shared : int
        Shared memory per program (bytes).
    """

    regs: int
    spill_bytes: int
    shared: int


@functools.cache
def _table() -> dict[tuple, KernelResources]:
    if not _TABLE.exists():
        return {}
    doc = json.loads(_TABLE.read_text())
    out = {}
    for v in doc.get("variants", []):
        if "regs" not in v:
            continue
        key = (v["head_dim"], v["block_m"], v["block_n"], bool(v["masked"]), v["num_warps"], v["num_stages"])
        out[key] = KernelResources(
            regs=int(v["regs"]), spill_bytes=int(v["spill_stores"]) + int(v["spill_loads"]), shared=int(v["shared"])
        )
    return out


@functools.cache
def _head_dims() -> tuple[int, ...]:
    """The table's head dims, ascending."""
    return tuple(sorted({k[0] for k in _table()}))


def kernel_resources(
    head_dim: int, block_m: int, block_n: int, masked: bool, num_warps: int, num_stages: int
) -> KernelResources | None:
    """The table's entry for a stage-1 variant (the next head dim up when its own is missing), or None."""
    table = _table()
    for d in [head_dim] + [x for x in _head_dims() if x > head_dim]:
        hit = table.get((d, block_m, block_n, bool(masked), num_warps, num_stages))
        if hit is not None:
            return hit
    return None


#: Per tile class, the features :func:`compiled_features` gives (``c0_<name>``, ``c1_<name>``).
COMPILED_FIELDS = ("ptx_regs", "ptx_spill_bytes", "ptx_shared_bytes", "spill_traffic")


def compiled_features(
    head_dim: int, block_m: int, block_n: int, masked: bool, num_warps: int, num_stages: int, *, programs: float,
    iterations: float,
) -> tuple[float, float, float, float]:  # fmt: skip
    """One tile class's compiler facts, as features (:data:`COMPILED_FIELDS`).

    Registers per thread, spill bytes per thread, shared memory per program and spill
    traffic (spill bytes x the class's KV-tile iterations); zeros for a class without
    programs, -1 for a variant the table lacks.
    """
    if programs <= 0:
        return (0.0, 0.0, 0.0, 0.0)
    res = kernel_resources(int(head_dim), int(block_m), int(block_n), bool(masked), int(num_warps), int(num_stages))
    if res is None:
        return (-1.0, -1.0, -1.0, -1.0)
    return (float(res.regs), float(res.spill_bytes), float(res.shared), float(res.spill_bytes) * float(iterations))
