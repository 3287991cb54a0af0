"""Run a module (``python -m`` style) with a planner or launch switch set, for whole-run A/Bs.

``switch_ab.py`` times single calls; a whole benchmark (the end-to-end decode, say) under one
value of a switch needs the switch set before the benchmark imports and plans anything::

    python3 bench/device/with_switch.py fasttree.packing:_ALIGNED_BLOCKS true \\
        bench.decode --models llama --out /tmp/res --label decode_blocks_on

The value is parsed as ``switch_ab.py`` parses ``--values`` (JSON when it parses, else the string).
The switch is restored when the module returns.
"""

from __future__ import annotations

import importlib
import logging
import runpy
import sys

from switch_ab import parse_value  # a sibling script: run as a script, bench/device is on sys.path

from bench.common import switched

log = logging.getLogger("with_switch")


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: with_switch.py module:ATTRIBUTE VALUE MODULE [ARGS...]")
    target, text, module, *rest = argv
    mod_name, sep, attr = target.partition(":")
    if not sep or not attr:
        raise SystemExit(f"the switch must be module:ATTRIBUTE, got {target!r}")
    mod = importlib.import_module(mod_name)
    if not hasattr(mod, attr):
        raise SystemExit(f"{mod_name} has no attribute {attr}")
    value = parse_value(text)
    sys.argv = [module, *rest]
    with switched(mod, attr, value):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        log.info("%s = %r", target, value)
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
