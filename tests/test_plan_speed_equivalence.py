"""Plans and runtime uploads are bit-identical to recorded digests.

The digests in ``tests/data/plan_digests.json`` were recorded with the planner before its
host-time optimisations (re-recorded where a rule changed plans on purpose: the crossover's exponent at
v35, the one-wave crossover's default: 4 of 900 plans); every :class:`fasttree.Plan` array (values,
dtype and shape), every decision of the plan and the runtime's staged plan-buffer words must still hash the same.

Regenerate them (only when a plan change is intended) with::

    TRITON_INTERPRET=1 python tests/test_plan_speed_equivalence.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from trees import random_tree

import fasttree as ft
from fasttree import packing as _packing
from fasttree.packing import pack_units
from fasttree.plan_arrays import DEVICE_ARRAYS
from fasttree.runtime import PLAN_HEADER
from fasttree.toolkit.suite import paper_tree
from fasttree.toolkit.workloads import iter_serving
from fasttree.tree import ragged_arange

DIGESTS = Path(__file__).parent / "data" / "plan_digests.json"
#: The header words of the launch variants (zeroed before hashing the fixed launch's staged words).
_VARIANT_HEADER = slice(PLAN_HEADER.index("class0_first"), PLAN_HEADER.index("words_end") + 1)
#: The runtime's device for the staged-words digest: the CPU only runs it under TRITON_INTERPRET=1 (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SCENARIOS = ("few_shot", "chain_reasoning", "multi_document_qa", "multi_level_system_prompts")
SERVING_STEPS = (3, 10, 25, 50)
HEADS = ((32, 32, 128), (32, 8, 128), (16, 1, 128))
CONFIGS = {
    "default": ft.FastTreeConfig(),
    "no_pack": ft.FastTreeConfig(pack_tokens=0),
    "small_split": ft.FastTreeConfig(kv_split_sizes=(96, 24)),
    "gamma10": ft.FastTreeConfig(gamma=10.0),
    "odd_tiles": ft.FastTreeConfig(q_tile_queries=(12, 3), kv_tile=(32, 16), pack_min_units=64),
}
GROUP_FIELDS = ("node", "kv_start", "kv_len", "kv_slots", "q_indptr", "q_ids")


def _serving_trees(scenario: str) -> list[tuple[str, ft.KVTree]]:
    steps = list(iter_serving(scenario, seed=0, steps=max(SERVING_STEPS) + 1))
    return [(f"serving/{scenario}/{i}", steps[i].tree) for i in SERVING_STEPS]


def _random_trees() -> list[tuple[str, ft.KVTree]]:
    out = []
    for seed in range(34):
        rng = np.random.default_rng(1000 + seed)
        kw = {
            "max_nodes": (40, 120, 300)[seed % 3],
            "roots": (None, 1, 3, None)[seed % 4],
            "scatter_slots": seed % 5 != 0,
        }
        out.append((f"random/{seed}", random_tree(rng, **kw)))
    return out


def corpus() -> list[tuple[str, ft.KVTree]]:
    """Fresh trees (serving steps, random forests, the paper suite), each with a unique name."""
    trees = [t for s in SCENARIOS for t in _serving_trees(s)]
    trees += _random_trees()
    trees += [(f"paper/{c}", paper_tree(c)) for c in (1, 2, 3, 4, 6, 8, 9, 10, 12, 15)]
    return trees


def _update(h, name: str, arr) -> None:
    a = np.ascontiguousarray(arr)
    h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
    h.update(a.tobytes())


def plan_digest(plan: ft.Plan) -> str:
    """sha256 over every array (dtype, shape, bytes) and decision of ``plan``."""
    h = hashlib.sha256()
    for name in DEVICE_ARRAYS:
        _update(h, name, getattr(plan, name))
    ea = plan.edge_assignment
    _update(h, "edge_assignment", np.zeros(0, np.int8) if ea is None else ea)
    for name in GROUP_FIELDS:
        _update(h, f"groups.{name}", getattr(plan.groups, name))
    scalars = (
        plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.n_queries, plan.max_slot,
        plan.class_unit_ptr, plan.tile_classes, plan.n_partial_rows, plan.tile_mode, plan.config,
    )  # fmt: skip
    h.update(repr(scalars).encode())
    return h.hexdigest()


_RULES = ft.PlanRules(wide_units=False, aligned_blocks=False)


def plan_digests() -> dict[str, str]:
    out = {}
    for name, tree in corpus():
        for cname, cfg in CONFIGS.items():
            for hq, hkv, d in HEADS:
                # the digests predate the wide-unit choice and aligned blocks (both tested in test_packing.py)
                p = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rules=_RULES)
                out[f"{name}|{cname}|{hq}-{hkv}-{d}"] = plan_digest(p)
    return out


def staged_digests() -> dict[str, str]:
    """Per runtime config and head shape: a hash chain over every upload of a tree sequence.

    The staged words include stale padding left by earlier plans, so the sequence (and
    the alternation of the two staging buffers) is part of what is hashed.
    """
    from fasttree.runtime import TreeAttentionRuntime

    out = {}
    for cname in ("default", "no_pack"):
        for hq, hkv, d in HEADS:
            trees = corpus()
            pool = max(t.max_slot for _, t in trees) + 2
            rt = TreeAttentionRuntime(
                CONFIGS[cname], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype="float16", device=DEVICE,
                max_queries=1024, max_kv_entries=8 * pool, max_units=1 << 16, max_partial_rows=32 * 1024,
                pool_slots=pool, max_variants=0,
            )  # fmt: skip
            h = hashlib.sha256()
            for name, tree in trees:
                up = rt.plan(tree)
                words = rt._staged[rt._next_staging ^ 1][: up.words].copy()
                words[_VARIANT_HEADER] = 0  # the launch-variant words (class ranges, variant id) came later
                h.update(name.encode())
                _update(h, "words", words)
                h.update(repr((up.query_centric, up.slot_units, up.merge_counts, up.words)).encode())
                h.update(plan_digest(up.plan).encode())
            out[f"{cname}|{hq}-{hkv}-{d}"] = h.hexdigest()
    return out


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(DIGESTS.read_text())


def test_plans_match_recorded_digests(recorded):
    got = plan_digests()
    assert got.keys() == recorded["plans"].keys()
    bad = [k for k, v in got.items() if recorded["plans"][k] != v]
    assert not bad, f"{len(bad)} plans changed, e.g. {bad[:5]}"


def test_runtime_staged_words_match_recorded_digests(recorded):
    got = staged_digests()
    assert got == recorded["staged"]


def test_cached_index_gives_the_same_plan():
    # a tree planned again (its index cached) plans as a fresh one
    for name, tree in corpus()[::7]:
        for hq, hkv, d in HEADS:
            a = plan_digest(ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d))
            b = plan_digest(ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=d))
            assert a == b, name


def test_pack_units_fast_paths_match_the_general_one():
    # pairs_in_order, query_of_rank and identity_slots only save work: same bins, same arrays
    rng = np.random.default_rng(11)
    for _ in range(200):
        n_units = int(rng.integers(1, 40))
        n_queries = int(rng.integers(1, 70))
        q_len = rng.integers(1, 6, n_units)
        pair_query = np.concatenate(
            [np.sort(rng.choice(n_queries, min(int(k), n_queries), replace=False)) for k in q_len]
        )
        q_len = np.array([min(int(k), n_queries) for k in q_len])
        kv_len = rng.integers(1, 60, n_units)
        n_tree = int(rng.integers(80, 400))
        kv_start = np.where(
            rng.random(n_units) < 0.8, rng.integers(0, n_tree - 60, n_units), n_tree + rng.integers(0, 100, n_units)
        )
        kv_slots = np.concatenate([np.arange(n_tree), rng.integers(0, n_tree, 200)]).astype(np.int32)
        rank = rng.permutation(n_queries)
        inverse = np.empty(n_queries, dtype=np.int64)
        inverse[rank] = np.arange(n_queries)
        pair_start = np.concatenate([[0], np.cumsum(q_len)[:-1]])
        kw = dict(
            kv_start=kv_start, kv_len=kv_len, pair_start=pair_start, q_len=q_len, pair_query=pair_query,
            kv_slots=kv_slots, eligible=rng.random(n_units) < 0.8, query_rank=rank,
            capacity=int(rng.choice([1, 2, 4, 16, 32])), budget=int(rng.integers(1, 200)),
        )  # fmt: skip
        ref = pack_units(**kw)
        fast = pack_units(**kw, query_of_rank=inverse, pairs_in_order=True, identity_slots=n_tree)
        assert (ref is None) == (fast is None)
        if ref is None:
            continue
        for name in ("kv_start", "kv_len", "pair_start", "q_len", "pair_query", "pair_present", "kv_slots",
                     "kv_row_mask", "is_bin"):  # fmt: skip
            a, b = getattr(ref, name), getattr(fast, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert (ref.n_packed, ref.n_kept) == (fast.n_packed, fast.n_kept)


@pytest.mark.parametrize("identity", [0, 50, 400])
def test_gather_runs_matches_a_plain_gather(identity):
    rng = np.random.default_rng(identity)
    slots = np.concatenate([np.arange(min(identity, 400)), rng.integers(0, 1000, 300)]).astype(np.int32)
    for n_runs in (1, 3, _packing._SLICE_COPIES + 5, 200):
        start = rng.integers(0, slots.size - 30, n_runs)
        length = rng.integers(0, 30, n_runs)
        out = np.empty(int(length.sum()), dtype=np.int32)
        _packing._gather_runs(slots, start, length, out, identity)
        want = np.concatenate([slots[s : s + n] for s, n in zip(start, length, strict=True)])
        np.testing.assert_array_equal(out, want)


def test_ragged_arange_matches_concatenated_aranges():
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(0, 20))
        start = rng.integers(-5, 1000, n)
        length = rng.integers(0, 12, n)
        want = np.concatenate([np.arange(s, s + k) for s, k in zip(start, length, strict=True)] + [np.zeros(0, int)])
        got = ragged_arange(start, length)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ragged_arange(start, length, int(length.sum())), want)


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        sys.exit("pass --write to (re)record tests/data/plan_digests.json")
    DIGESTS.parent.mkdir(parents=True, exist_ok=True)
    data = {"plans": plan_digests(), "staged": staged_digests()}
    DIGESTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(data['plans'])} plan and {len(data['staged'])} staged digests to {DIGESTS}")
