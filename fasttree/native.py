"""Native cores of the host planner: C compiled on first use, called through ctypes.

``fasttree/csrc/planner.c`` holds C versions of the planner's hottest loops (the greedy edge
assignment and the groups it keeps, the groups' query lists, KV starts and chained slots, the
units' cuts, the packing's bin layouts (candidates, aligned blocks, pieces and runs), the wide
units' cost of a bin layout, the packed units' arrays (alone, or with the plan's unit arrays in
one call), slot-run gathers and row masks, a laid-out plan's reads by tile class, the plan's tile
classes, unit order, int32 arrays and partial rows, a tree's levels and queries' DFS positions,
and a plan extension's old-slot check, anchors and entry insertion),
each the same arithmetic in the same order as the numpy/Python path it replaces, so plans are
bit-identical either way (``tests/test_native.py``).
:func:`planner_library` compiles it once per source version with the machine's C compiler (``$CC``,
else ``cc``: the compiler Triton itself needs to build its launchers on a GPU host), caches the
shared library under ``$FASTTREE_CACHE_DIR`` (default ``~/.cache/fasttree``) and loads it; where no
compiler works it returns None, logs why once, and the planner runs its numpy path. Each call costs
about a microsecond per array it is passed (:func:`address`), so only loops that replace several
numpy calls pay, and their wrappers pass one buffer for several outputs.

Standard library only (no torch, no numpy): the serving path may import it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["address", "c_int32", "c_int64", "cache_dir", "planner_library"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "planner.c"
#: Compiler flags: -O3 planned 4-9% faster than -O2 on paper and family trees (2 cores, gcc 12,
#: four alternated runs), plans bit for bit the same.
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99")
#: ``(path, library)`` once loaded; ``(None, None)`` after a failure (not retried in this process).
_LOADED: tuple[Path | None, ctypes.CDLL | None] | None = None

_I64P = ctypes.c_void_p  # pointers are passed as addresses (:func:`address`): the cheapest call
_SIGNATURES = {
    "ft_greedy_groups": (
        ctypes.c_int64,
        [ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, ctypes.c_double, ctypes.c_double, ctypes.c_double,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P,
         _I64P, _I64P, _I64P, _I64P, _I64P],
    ),
    "ft_chain_lengths": (None, [ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P]),
    "ft_chain_layout": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P,
         _I64P],
    ),
    "ft_chain_fill": (None, [ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P]),
    "ft_chain_runs": (None, [ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P]),
    "ft_gather_runs": (None, [ctypes.c_int64, _I64P, _I64P, _I64P, _I64P]),
    "ft_group_queries": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, ctypes.c_int64,
         _I64P, _I64P],
    ),
    "ft_fill_mask": (None, [ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P]),
    "ft_layout_class_reads": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P,
         ctypes.c_int64, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P],
    ),
    "ft_assemble_sizes": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, ctypes.c_int64,
         _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P],
    ),
    "ft_assemble_fill": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64,
         ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P,
         _I64P, _I64P, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P,
         _I64P, _I64P],
    ),
    "ft_layout_cost": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P,
         ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P],
    ),
    "ft_bin_layout": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, _I64P, _I64P],
    ),
    "ft_bin_members": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P,
         ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P],
    ),
    "ft_cut_units": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P,
         _I64P, _I64P, _I64P, _I64P, _I64P],
    ),
    "ft_query_positions": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P,
         _I64P, _I64P, _I64P],
    ),
    "ft_tree_levels": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P,
         _I64P],
    ),
    "ft_prefixes_equal": (
        ctypes.c_int64, [ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P]
    ),
    "ft_extend_entries": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, ctypes.c_int64, _I64P,
         ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P],
    ),
    "ft_find_anchors": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P,
         ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P],
    ),
    "ft_unit_arrays": (
        ctypes.c_int64,
        [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, ctypes.c_int64,
         _I64P, _I64P, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P,
         _I64P],
    ),
    "ft_packed_plan": (
        ctypes.c_int64,
        [ctypes.c_int64, _I64P, _I64P, _I64P, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64,
         ctypes.c_int64, _I64P, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P,
         _I64P, _I64P, _I64P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P, _I64P, _I64P],
    ),
}  # fmt: skip


#: Offset of an ndarray's data pointer in the array object (numpy's ``PyArrayObject``: the object
#: header, then ``data``), read where the object's address is its ``id`` (CPython).
_DATA_OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)
_pointer_at = ctypes.c_void_p.from_address
#: The array type whose data pointer :func:`address` reads from the object (set once its first
#: array's pointer there matched ``ndarray.ctypes.data``); None before that or off CPython.
_FIELD_TYPE: type | None = None


def address(array) -> int:
    """The address of a C-contiguous array's first byte, for the compiled loops. On CPython the
    ndarray's data pointer is read from the array object (about 0.15 us; checked against
    ``ndarray.ctypes.data`` on the first array), else through the buffer protocol
    (``ctypes.c_char.from_buffer``) for a writable, non-empty array, else ``array.ctypes.data``.
    The caller keeps the array alive while the address is used."""
    if type(array) is _FIELD_TYPE:
        return _pointer_at(id(array) + _DATA_OFFSET).value or 0
    return _checked_address(array)


def _checked_address(array) -> int:
    """:func:`address` without the data pointer's field (the first array of a type, or off CPython);
    on CPython it enables reading the field for the array's type when the two agree."""
    global _FIELD_TYPE
    if array.size:
        try:
            at = ctypes.addressof(ctypes.c_char.from_buffer(array))
        except (TypeError, ValueError, BufferError):
            at = array.ctypes.data
    else:
        at = array.ctypes.data
    if (
        _FIELD_TYPE is None
        and sys.implementation.name == "cpython"
        and type(array).__name__ == "ndarray"
        and at == (_pointer_at(id(array) + _DATA_OFFSET).value or 0) == array.ctypes.data
    ):
        _FIELD_TYPE = type(array)
    return at


def _c_ints(arrays, itemsize: int) -> bool:
    for a in arrays:
        dt = a.dtype
        if dt.kind != "i" or dt.itemsize != itemsize or not dt.isnative or not a.flags.c_contiguous:
            return False
    return True


def c_int64(*arrays) -> bool:
    """Whether every array is C-contiguous, native-endian int64: what the compiled loops read at
    an :func:`address` (read from the arrays' attributes: this module imports no numpy)."""
    return _c_ints(arrays, 8)


def c_int32(*arrays) -> bool:
    """:func:`c_int64` for int32 arrays (a plan's entry and unit arrays, a tree's slots)."""
    return _c_ints(arrays, 4)


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$FASTTREE_CACHE_DIR``, else ``~/.cache/fasttree``."""
    env = os.environ.get("FASTTREE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fasttree"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _library_path(source: bytes, cc: str) -> Path:
    key = hashlib.sha256(
        b"\0".join([source, cc.encode(), " ".join(_FLAGS).encode(), platform.machine().encode(),
                    sys.platform.encode()])
    ).hexdigest()[:16]  # fmt: skip
    return cache_dir() / "native" / f"planner-{key}.so"


def _compile(source_path: Path, target: Path, cc: str) -> None:
    """Compile into a temporary file beside ``target``, then rename it into place (atomic: a
    concurrent process sees the old state or the whole library)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, "-o", tmp, str(source_path)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{cc} exited with {proc.returncode}: {proc.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def planner_library() -> ctypes.CDLL | None:
    """The compiled planner cores (compiled and cached on first use), or None where they cannot
    be built or loaded (then the planner's numpy path runs; the reason is logged once)."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED[1]
    try:
        source = _SOURCE.read_bytes()
        cc = _compiler()
        if cc is None:
            raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'} not found)")
        path = _library_path(source, cc)
        if not path.exists():
            _compile(_SOURCE, path, cc)
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("native planner cores unavailable, planning with numpy: %s", exc)
        _LOADED = (None, None)
        return None
    _LOADED = (path, lib)
    return lib
