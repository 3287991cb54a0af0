"""Argument types the ``fasttree-tune`` subcommands share: durations, bounded integers, tree families.

Each raises ``argparse.ArgumentTypeError`` naming what it expected, which argparse turns into a
usage error (exit status 2).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from ..validation import check_int

__all__ = [
    "buckets_arg",
    "duration_arg",
    "families_arg",
    "int_at_least",
    "non_negative_int",
    "parse_duration",
    "positive_int",
    "progress_bar_wanted",
    "refuse_existing_outputs",
    "refuse_unwritable_outputs",
    "unwritable_reason",
]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"60s"``, ``"10m"``, ``"1.5h"`` or ``"90"`` (seconds).

    Parameters
    ----------
    text : str
        A positive number with an optional unit ``s``, ``m`` or ``h``.

    Returns
    -------
    float
        Seconds, > 0.

    Raises
    ------
    ValueError
        When ``text`` is not such a duration or is not positive.
    """
    if not isinstance(text, str):
        raise ValueError(f"a duration must be a string such as '60s', '10m' or '1h', got {text!r}")
    m = _DURATION_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"invalid duration {text!r}: use seconds ('90', '60s'), minutes ('10m') or hours ('1h')")
    seconds = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"invalid duration {text!r}: it must be positive")
    return seconds


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_at_least(minimum: int, what: str | None = None):
    """An argparse ``type`` accepting integers >= ``minimum``.

    ``what`` names them in errors (default ``"an integer >= {minimum}"``): ``expected
    {what}, got {value}``.
    """
    what = f"an integer >= {minimum}" if what is None else what

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            return check_int("value", value, minimum=minimum)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}") from None

    return parse


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "an integer >= 0")


def _names_arg(text: str, known: Iterable[str], one: str, many: str) -> list[str]:
    """A comma-separated list of names from ``known`` (``one`` / ``many``: what one and several are)."""
    known = list(known)
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {many}")
    unknown = [s for s in names if s not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {one if len(unknown) == 1 else many} {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return names


def families_arg(text: str) -> list[str]:
    from ..toolkit.workloads import TREE_FAMILIES

    return _names_arg(text, TREE_FAMILIES, "tree family", "tree families")


def buckets_arg(text: str) -> list[str]:
    from ..toolkit.headroom import HEADROOM_BUCKETS

    return _names_arg(text, HEADROOM_BUCKETS, "headroom bucket", "headroom buckets")


def progress_bar_wanted(requested: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw a progress bar: asked for (no ``--no-progress``) and ``stream`` (default
    ``sys.stderr``, where tqdm draws) is a terminal. A bar redraws itself with ``\\r``, which a log file
    or a pipe keeps as one garbled line per redraw."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(requested) and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def refuse_existing_outputs(args: argparse.Namespace) -> None:
    """The output rule of every subcommand: an output that exists is replaced only with ``--overwrite``.

    A subcommand names its outputs in its parser's defaults: ``output_files``, the attributes holding
    FILE paths (``--out``, ``--json``, ``--export``, ...), and ``output_folder_files``, the files it
    writes into its ``--out`` FOLDER. Checked before the subcommand starts, so a refused run does no
    work. A usage error (exit status 2) names the first output that exists.
    """
    if getattr(args, "overwrite", False):
        return
    for attr in getattr(args, "output_files", ()):
        value = getattr(args, attr, None)
        if value and Path(value).exists() and not Path(value).is_dir():  # a folder: refuse_unwritable_outputs
            args.subparser.error(f"--{attr.replace('_', '-')} {value} exists; pass --overwrite to replace it")
    for name in getattr(args, "output_folder_files", ()):
        path = Path(args.out) / name
        if path.exists():
            args.subparser.error(
                f"{path} exists (--out {args.out} holds a finished run); pass --overwrite to replace it, or "
                "choose another --out"
            )


def unwritable_reason(path: str | os.PathLike, *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written (a FILE, or with ``folder`` a FOLDER to create or fill), or None.

    Checked by trying: a temporary file is created and removed in ``path`` (a folder that exists) or
    in the nearest folder above it that exists, since permission bits do not tell the whole story
    (``/proc``, read-only mounts, running as root).

    Parameters
    ----------
    path : str or PathLike
    folder : bool
        Whether ``path`` is a folder (else a file).

    Returns
    -------
    str or None
        A short reason (``"is a folder"``, ``"... is not writable (Permission denied)"``), or None.
    """
    p = Path(path)
    if p.exists():
        if folder and not p.is_dir():
            return "is a file, not a folder"
        if not folder and p.is_dir():
            return "is a folder; give a FILE"
    probe = p if folder and p.is_dir() else p.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".fasttree-probe-"):
            pass
    except OSError as exc:
        return f"{probe} is not writable ({exc.strerror or exc})"
    return None


def refuse_unwritable_outputs(args: argparse.Namespace) -> None:
    """A usage error (exit status 2) naming the first output of the subcommand that cannot be written.

    The outputs are those :func:`refuse_existing_outputs` reads, plus ``append_files`` (files a
    subcommand appends to) and the ``--out`` FOLDER of a subcommand that sets ``output_folder``.
    Checked before the subcommand starts, so nothing is computed for an output that would fail.
    """
    files = [*getattr(args, "output_files", ()), *getattr(args, "append_files", ())]
    for attr in files:
        value = getattr(args, attr, None)
        reason = unwritable_reason(value) if value else None
        if reason:
            args.subparser.error(f"--{attr.replace('_', '-')} {value}: {reason}")
    if getattr(args, "output_folder", False) or getattr(args, "output_folder_files", ()):
        reason = unwritable_reason(args.out, folder=True)
        if reason:
            args.subparser.error(f"--out {args.out}: {reason}")
