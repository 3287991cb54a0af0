"""Plans not made by the planner are checked before their first upload: every array the kernels
index must keep them inside their buffers (``fasttree.plan_arrays.check_plan_arrays``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_attention import check_against_reference, make_inputs
from test_plan_extend import CONFIGS
from trees import random_tree

import fasttree as ft
from fasttree.plan_arrays import check_plan_arrays
from fasttree.runtime_planning import plan_for_runtime
from fasttree.toolkit.suite import PAPER_SUITE, paper_tree


def test_every_plan_the_planner_makes_passes_the_check():
    """Paper trees at three head layouts (tree, fixed-launch and query-separated plans) and random
    forests under several configs: no planner plan is refused."""
    for case in list(PAPER_SUITE)[::3]:
        tree = paper_tree(case)
        for hq, hkv in ((32, 32), (32, 8), (16, 1)):
            heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": 128}
            check_plan_arrays(ft.plan(tree, **heads))
            check_plan_arrays(ft.plan_query_separated(tree, **heads))
            check_plan_arrays(plan_for_runtime(tree, ft.FastTreeConfig(), **heads, stage1_launches=2)[0])
    rng = np.random.default_rng(11)
    for i in range(60):
        tree = random_tree(rng, max_nodes=int(rng.choice([5, 40, 200])), max_len=int(rng.choice([4, 80, 600])))
        hq, hkv = [(32, 32), (32, 8), (8, 1), (28, 4)][i % 4]
        check_plan_arrays(ft.plan(tree, CONFIGS[i % len(CONFIGS)], num_q_heads=hq, num_kv_heads=hkv, head_dim=64))


def _tampered(plan: ft.Plan) -> dict[str, dict]:
    """One broken copy of ``plan`` per invariant (the fields ``dataclasses.replace`` changes)."""
    kv, pairs = plan.kv_indices, plan.pair_query
    last = plan.n_units - 1
    longer = plan.unit_kv_len.copy()
    longer[last] = kv.size  # the last unit's KV range runs past kv_indices
    far = plan.unit_q_start.copy()
    far[last] = pairs.size  # its pairs start past pair_query
    return {
        "slot past max_slot": {"kv_indices": np.where(np.arange(kv.size) == 0, plan.max_slot + 1, kv).astype(np.int32)},
        "negative slot": {"kv_indices": np.where(np.arange(kv.size) == kv.size - 1, -1, kv).astype(np.int32)},
        "KV range": {"unit_kv_len": longer},
        "pair range": {"unit_q_start": far},
        "unit arrays' lengths": {"unit_q_len": plan.unit_q_len[:-1].copy()},
        "class pointer": {"class_unit_ptr": (0, plan.n_units, plan.n_units + 1)},
        "query past n_queries": {"pair_query": np.full_like(pairs, plan.n_queries)},
        "partial row": {"pair_out_row": np.full_like(plan.pair_out_row, plan.n_partial_rows)},
        "masks": {"kv_row_mask": np.zeros(1, dtype=np.int32)},
        "merged query": {"merge_queries": np.array([plan.n_queries], dtype=np.int32)},
        "float slots": {"kv_indices": kv.astype(np.float64)},
    }


@pytest.mark.parametrize("broken", list(_tampered(ft.plan(paper_tree(2), num_q_heads=8, num_kv_heads=2, head_dim=64))))
def test_a_hand_replaced_plan_that_would_leave_its_buffers_raises_before_any_launch(broken):
    tree = paper_tree(2)
    plan = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=64)
    assert plan.kv_row_mask.size and plan.merge_queries.size  # every invariant has something to break
    bad = dataclasses.replace(plan, **_tampered(plan)[broken])
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_inputs(tree, 8, 2, 64, torch.float16, "cpu", gen)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError):
        ft.tree_attention(q, k, v, bad, out=out)
    assert torch.isnan(out).all()  # nothing ran


def test_a_consistent_hand_replaced_plan_is_checked_once_and_runs(monkeypatch):
    """``dataclasses.replace`` drops the planner's mark (the check runs on the copy's first upload,
    and only then); a copy with the same arrays passes it and computes the same attention."""
    tree = random_tree(np.random.default_rng(5), max_nodes=30, max_len=40)
    plan = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=64)
    copy = dataclasses.replace(plan, kv_indices=plan.kv_indices.copy())
    assert plan._planned and not copy._planned
    calls = []
    import fasttree.plan_arrays as plan_arrays

    checked = plan_arrays.check_plan_arrays
    monkeypatch.setattr(plan_arrays, "check_plan_arrays", lambda p: calls.append(p) or checked(p))
    gen = torch.Generator().manual_seed(1)
    q, k, v = make_inputs(tree, 8, 2, 64, torch.float16, "cpu", gen)
    for _ in range(2):
        out = ft.tree_attention(q, k, v, copy, out=torch.full_like(q, float("nan")))
        check_against_reference(out, q, k, v, tree)
    ft.tree_attention(q, k, v, plan)
    assert calls == [copy]
