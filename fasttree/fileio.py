"""Atomic file writes: a file the library writes is either the old one or the whole new one."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

__all__ = ["write_atomic"]

#: Mode of a new file before the process umask applies (the usual ``open()`` mode: 0644 under umask 022).
FILE_MODE = 0o666
#: Attempts at a fresh temporary name before giving up (each name is 64 random bits).
_NAME_ATTEMPTS = 100


def _create_temporary(folder: Path, name: str) -> tuple[int, str]:
    """A new, empty file next to the destination, opened for writing: ``(fd, path)``.

    Created with :data:`FILE_MODE`, which the kernel masks with the process umask, as ``open()``
    does: the umask is never read or changed (it is per process, and other threads, e.g.
    Optuna's heartbeat, may create files meanwhile).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(_NAME_ATTEMPTS):
        tmp = str(folder / f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, FILE_MODE), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary file name in {folder}")


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX: fsync the directory; a no-op where folders cannot be opened)."""
    directory = getattr(os, "O_DIRECTORY", None)
    if directory is None:  # pragma: no cover - Windows: the rename is durable with the file
        return
    fd = os.open(folder, os.O_RDONLY | directory)
    try:
        os.fsync(fd)
    except OSError as exc:  # a file system that cannot sync folders (EINVAL) has nothing more to do
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``.

    A crash leaves either the previous file or the complete new one, never a half-written
    one (the temporary file is removed on error). The file is synced before the rename and
    its folder after it, so the new contents and the new name survive a power loss. A new
    file gets mode ``0o666`` less the process umask, as ``open()`` gives; the umask is not
    touched (safe with other threads running).

    Parameters
    ----------
    path : str or PathLike
        Destination; its folder is created when missing.
    data : str or bytes
        Contents (``str`` is written as UTF-8).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(path.parent)
