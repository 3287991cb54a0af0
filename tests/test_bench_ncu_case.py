"""bench.ncu_case: the case lookup, the plan description and the refusals (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import ncu_case
from fasttree.launch_rules import GpuTarget


@pytest.mark.parametrize(
    ("suite", "name", "heads", "dtype"),
    [
        ("paper", "9/gqa16", (16, 1, 128), torch.float16),
        ("crossover", "ns32x4k/8x1/d256/bf16", (8, 1, 256), torch.bfloat16),
        ("families", "forest_internal/16x1/d128/fp16", (16, 1, 128), torch.float16),
        ("decode", "mistral:chain_reasoning:2", (32, 8, 128), torch.float16),
    ],
)
def test_a_case_resolves_to_its_tree_and_heads(suite, name, heads, dtype):
    case = ncu_case.resolve_case(suite, name)
    assert (case.num_q_heads, case.num_kv_heads, case.head_dim) == heads and case.dtype == dtype
    assert case.tree.n_queries > 0 and case.name == name
    plan = ncu_case.plan_case(case, "fasttree")
    qs = ncu_case.plan_case(case, "query_separated")
    assert qs.tile_mode == "query_separated"
    # plain decode reads every query's whole context: at least as many entries as the tree plan
    assert qs.kv_indices.size >= plan.kv_indices.size
    lines = ncu_case.describe(case, plan, GpuTarget(cuda=True, major=9, sms=132))
    assert lines[0].startswith(name) and f"{plan.kv_indices.size} KV entries" in lines[0]
    launches = [line for line in lines[1:] if "stage 1 class" in line]
    assert len(launches) == int(np.count_nonzero(np.diff(plan.class_unit_ptr)))


def test_a_decode_step_is_the_workloads_tree():
    from bench.decode import make_workload

    case = ncu_case.resolve_case("decode", "llama:few_shot:3")
    tree = make_workload("few_shot", seed=0, warmup=0, steps=4, max_batch=None, vocab=32000).trees[3]
    np.testing.assert_array_equal(case.tree.slots, tree.slots)
    np.testing.assert_array_equal(case.tree.parents, tree.parents)


@pytest.mark.parametrize(
    ("suite", "name", "match"),
    [
        ("paper", "16/gqa4", "CASE/HEADS"),
        ("paper", "9", "CASE/HEADS"),
        ("crossover", "nope", "no case 'nope'"),
        ("decode", "llama:few_shot", "MODEL:SCENARIO:STEP"),
        ("decode", "gpt:few_shot:3", "MODEL:SCENARIO:STEP"),
        ("heldout", "x", "--suite"),
    ],
)
def test_a_bad_case_is_a_value_error_naming_the_form(suite, name, match):
    with pytest.raises(ValueError, match=match):
        ncu_case.resolve_case(suite, name)


def test_without_a_gpu_it_refuses_before_planning(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ncu_case.main(["--suite", "paper", "--case", "9/gqa16"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
