"""Plans under the default and the runtime's rules are bit-identical to recorded ones.

``tests/test_plan_speed_equivalence.py`` pins plans made without the wide-unit and aligned-block
rules; this module pins the plans ``ft.plan`` makes today (``PlanRules.defaults()``, and
``PlanRules.runtime(1)`` / ``(2)`` as the runtime plans): every array of the plan (values, dtype,
shape), its decisions and its groups, on the 15 paper-suite trees, seeded random forests (internal
queries, scattered slots, empty nodes), the large trees of ``bench.plan_time``'s other families,
serving-simulation steps and extended trees (``KVTree.append_tokens``). The digests in
``tests/data/plan_digests_default_rules.json`` were recorded from the planner before its per-token
host work was vectorised further (re-recorded where a rule changed plans on purpose: the
crossover's exponent at v35, the one-wave crossover's default at 132 programs, its merge-free
decode); a host-time optimisation must leave every plan as it was.

Regenerate them (only when a plan change is intended) with::

    PYTHONPATH=. python tests/test_plan_baseline.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_plan_speed_equivalence import plan_digest
from trees import random_tree

import fasttree as ft
from bench.plan_time import family_trees
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree
from fasttree.toolkit.workloads import iter_serving

DIGESTS = Path(__file__).parent / "data" / "plan_digests_default_rules.json"

CONFIGS = {
    "default": ft.FastTreeConfig(),
    "small_split": ft.FastTreeConfig(kv_split_sizes=(96, 24)),
    "odd_tiles": ft.FastTreeConfig(q_tile_queries=(12, 3), kv_tile=(32, 16), pack_min_units=64),
    "big_pack": ft.FastTreeConfig(pack_tokens=512, pack_min_units=32),
}
RULES = {
    "defaults": ft.PlanRules.defaults(),
    "runtime1": ft.PlanRules.runtime(1),
    "runtime2": ft.PlanRules.runtime(2),
}


def _random_forests() -> list[tuple[str, ft.KVTree]]:
    out = []
    for seed in range(40):
        rng = np.random.default_rng(4300 + seed)
        kw = {
            "max_nodes": (40, 150, 400, 1200)[seed % 4],
            "roots": (None, 1, 5)[seed % 3],
            "scatter_slots": seed % 4 != 0,
        }
        out.append((f"random/{seed}", random_tree(rng, **kw)))
    return out


def _extended(name: str, tree: ft.KVTree, steps: int) -> list[tuple[str, ft.KVTree]]:
    """``tree`` grown by ``steps`` decode steps where every query sits on a private node."""
    if np.count_nonzero(tree.subtree_queries[tree.query_nodes] != 1):
        return []
    out = []
    nxt = tree.max_slot + 1
    for s in range(1, steps + 1):
        tree = tree.append_tokens(np.arange(nxt, nxt + tree.n_queries)[::-1])
        nxt += tree.n_queries
        out.append((f"{name}+{s}", tree))
    return out


def corpus() -> list[tuple[str, ft.KVTree, tuple[str, ...], tuple[str, ...]]]:
    """(name, tree, config names, rules names): every tree with the configs and rules it is planned with."""
    every_config, every_rules = tuple(CONFIGS), tuple(RULES)
    out = [(f"paper/{c}", paper_tree(c), every_config, every_rules) for c in sorted(PAPER_SUITE)]
    out += [(n, t, every_config, every_rules) for n, t in _random_forests()]
    out += [(f"family/{n}", t, ("default",), every_rules) for n, t in family_trees().items()]
    for scenario in ("few_shot", "multi_document_qa", "multi_level_system_prompts"):
        steps = list(iter_serving(scenario, seed=1, steps=41))
        for i in (5, 40):
            name = f"serving/{scenario}/{i}"
            out.append((name, steps[i].tree, ("default",), every_rules))
            out += [(n, t, ("default",), ("defaults",)) for n, t in _extended(name, steps[i].tree, 2)]
    out += [(n, t, ("default",), every_rules) for n, t in _extended("paper/9", paper_tree(9), 3)]
    return out


def plan_digests() -> dict[str, str]:
    out = {}
    for name, tree, config_names, rules_names in corpus():
        for cname in config_names:
            for rname in rules_names:
                for heads, (hq, hkv) in PAPER_HEADS.items():
                    cfg, rules = CONFIGS[cname], RULES[rname]
                    p = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, rules=rules)
                    out[f"{name}|{cname}|{rname}|{heads}"] = plan_digest(p)
    return out


@pytest.fixture(scope="module")
def recorded() -> dict[str, str]:
    return json.loads(DIGESTS.read_text())["plans"]


def test_plans_match_recorded_digests(recorded):
    got = plan_digests()
    assert got.keys() == recorded.keys()
    bad = [k for k, v in got.items() if recorded[k] != v]
    assert not bad, f"{len(bad)} of {len(got)} plans changed, e.g. {bad[:5]}"


def test_digest_sees_a_changed_array():
    # the digest is not blind: flipping one row-mask bit or one slot changes it
    tree = paper_tree(8)
    p = ft.plan(tree, num_q_heads=32, num_kv_heads=8, head_dim=128)
    before = plan_digest(p)
    assert p.kv_row_mask.size
    p.kv_row_mask[-1] ^= 1
    assert plan_digest(p) != before
    p.kv_row_mask[-1] ^= 1
    p.kv_indices[0] += 1
    assert plan_digest(p) != before


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        sys.exit("pass --write to (re)record tests/data/plan_digests_default_rules.json")
    data = {"plans": plan_digests()}
    DIGESTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(data['plans'])} plan digests to {DIGESTS}")
