"""``fasttree-tune``: the command line of the offline toolkit (profile, fit, tune, export, validate).

:func:`main` runs it; :func:`build_parser` builds its argument parser. Subcommands live in
:mod:`.main` (profile, traces), :mod:`.costmodel` (fit, evaluate) and :mod:`.tune` (tune, export,
run, validate, refine, bench); :mod:`.args` holds the argument types they share.
"""

from .args import parse_duration
from .main import build_parser, main

__all__ = ["build_parser", "main", "parse_duration"]
