"""The FastTree paper's kernel benchmark suite (project copy of the anchors file's definition).

15 trees given as nodes per level and tokens per node per level (see
:meth:`fasttree.KVTree.from_levels` for the rule), crossed with three head settings.
"""

from __future__ import annotations

from ..tree import KVTree
from ..validation import check_choice

#: case -> (nodes_per_level, tokens_per_node_per_level)
PAPER_SUITE: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {
    1: ((1, 2, 64), (8, 256, 32)),
    2: ((1, 4, 256), (8, 256, 32)),
    3: ((1, 4, 8, 256), (8, 256, 256, 32)),
    4: ((1, 256), (256, 32)),
    5: ((1, 1024), (2048, 32)),
    6: ((1, 16, 64), (1024, 256, 32)),
    7: ((1, 4, 16, 512), (1024, 256, 128, 32)),
    8: ((1, 4, 16, 64, 256, 1024), (256, 8, 256, 64, 32, 256)),
    9: ((1, 10), (4000, 400)),
    10: ((1, 2, 4, 8, 16, 32, 64, 128, 1024), (16,) * 9),
    11: ((1, 2, 4, 8, 16, 32, 64, 128, 1024), (256, 128, 64, 16, 16, 16, 16, 16, 16)),
    12: ((1, 8, 16, 32, 64, 128, 1024), (256, 128, 64, 16, 16, 16, 16)),
    13: ((1, 8, 16, 32, 64, 256, 1024), (256, 128, 64, 16, 16, 16, 16)),
    14: ((1, 16, 32, 64, 128, 1024), (256, 128, 64, 16, 16, 16)),
    15: ((1, 16, 32, 64, 256, 1024), (256, 128, 64, 16, 16, 16)),
}

#: head setting -> (num_q_heads, num_kv_heads)
PAPER_HEADS: dict[str, tuple[int, int]] = {"mha": (32, 32), "gqa4": (32, 8), "gqa16": (16, 1)}


def paper_tree(case: int) -> KVTree:
    """The paper-suite tree of ``case`` (1..15)."""
    check_choice("paper-suite case", case, PAPER_SUITE, expected=f"one of 1..{len(PAPER_SUITE)}")
    nodes, tokens = PAPER_SUITE[case]
    return KVTree.from_levels(nodes, tokens)
