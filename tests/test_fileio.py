"""``fasttree.fileio.write_atomic``: file mode without touching the umask, the folder synced after the rename."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

import fasttree.fileio as fileio
from fasttree.fileio import write_atomic

_STATUS = Path("/proc/self/status")


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(old)


def test_new_file_gets_the_usual_mode_under_the_umask(tmp_path, umask_027):
    path = tmp_path / "sub" / "a.txt"
    write_atomic(path, "hello")
    assert path.read_text() == "hello"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask_027
    assert [p.name for p in path.parent.iterdir()] == ["a.txt"]  # no temporary file left


def test_the_umask_is_never_read_or_changed(tmp_path, monkeypatch):
    def no_umask(mask):
        raise AssertionError(f"write_atomic called os.umask({mask:#o})")

    monkeypatch.setattr(fileio.os, "umask", no_umask)
    write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"


@pytest.mark.skipif(not _STATUS.exists(), reason="needs /proc/self/status (Linux) to watch the umask")
def test_other_threads_never_see_a_zero_umask(tmp_path, umask_027):
    """The process umask, as another thread (Optuna's heartbeat, say) sees it, stays 027 while files are written."""
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for line in _STATUS.read_text().splitlines():
                if line.startswith("Umask:"):
                    seen.add(line.split()[1])

    t = threading.Thread(target=watch)
    t.start()
    try:
        for i in range(300):
            write_atomic(tmp_path / f"f{i % 3}.txt", f"{i}")
    finally:
        stop.set()
        t.join()
    assert seen == {"0027"}


def test_the_folder_is_synced_after_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, bool]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", stat.S_ISDIR(os.fstat(fd).st_mode)))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", False))
        return real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    monkeypatch.setattr(fileio.os, "replace", replace)
    write_atomic(tmp_path / "c.txt", "x")
    # the file's data before the rename, the folder's entry after it
    assert events == [("fsync", False), ("replace", False), ("fsync", True)]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "d.txt"
    write_atomic(path, "old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["d.txt"]


def test_a_taken_temporary_name_is_skipped(tmp_path, monkeypatch):
    names = iter(["aaaa", "aaaa", "bbbb"])
    monkeypatch.setattr(fileio.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".e.txt.aaaa.tmp").write_text("someone else's")
    write_atomic(tmp_path / "e.txt", "mine")
    assert (tmp_path / "e.txt").read_text() == "mine"
    assert (tmp_path / ".e.txt.aaaa.tmp").read_text() == "someone else's"
