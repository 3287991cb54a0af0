"""bench.stage1_ab (the device A/B scripts' stage-1 helpers) on the CPU under the interpreter."""

from __future__ import annotations

import numpy as np
import torch
from trees import random_tree

import fasttree as ft
from bench.stage1_ab import max_abs_diff, poisoned_outputs, run_launches, stage1_launches


def test_stage1_launches_run_as_tree_attention_and_diffs_see_changes():
    tree = random_tree(np.random.default_rng(5), max_nodes=10, max_len=80)
    plan = ft.plan(tree, num_q_heads=4, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(tree.n_queries, 4, 16, generator=gen, dtype=torch.float16)
    k = torch.randn(tree.max_slot + 1, 2, 16, generator=gen, dtype=torch.float16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    launches = stage1_launches(plan, q, k, v, out)
    assert launches and all(len(e) == 7 for e in launches)
    got = poisoned_outputs(lambda: run_launches(launches), plan, out)
    assert got[0].shape == q.shape and got[1].shape[0] == plan.n_partial_rows
    again = poisoned_outputs(lambda: run_launches(launches), plan, out)
    assert max_abs_diff(got, again) == 0.0
    assert plan.merge_queries.size == 0  # this tree: stage 1 writes every output row
    assert ft.max_relative_error(got[0], ft.reference_attention(q, k, v, tree)) < 2e-3
    changed = (got[0] + 1.0, got[1], got[2])
    assert max_abs_diff(got, changed) >= 1.0
    nan = got[0].clone()
    nan.view(-1)[0] = float("nan") if torch.isfinite(got[0].view(-1)[0]) else 0.0
    assert max_abs_diff(got, (nan, got[1], got[2])) == float("inf")
