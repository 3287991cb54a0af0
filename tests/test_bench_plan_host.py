"""bench.plan_host: the radix-cache view of a serving tree builds that tree again, and its build is
timed (CPU)."""

from __future__ import annotations

import numpy as np

from bench import plan_host
from fasttree.adapter import tree_from_radix_nodes


def test_radix_views_rebuild_the_serving_trees_and_are_timed():
    trees = plan_host.serving_trees("chain_reasoning")[:4]
    views = plan_host.radix_views(trees)
    for tree, (parents, nodes, queries) in zip(trees, views, strict=True):
        assert len(nodes) == tree.n_nodes and all(a.dtype == np.int64 for a in nodes)
        built = tree_from_radix_nodes(parents, nodes, queries)
        for name in ("parents", "lengths", "slot_indptr", "slots", "query_nodes"):
            np.testing.assert_array_equal(getattr(built, name), getattr(tree, name))
    assert 0 < plan_host.tree_build_ms(views, repeats=2) < 1e3


def test_runtime_plan_column_times_the_plan_the_runtime_uploads():
    """``runtime_plan_ms`` times :func:`plan_for_runtime` with the default config and rules: the
    plan the benchmark's runtime uploads (so ``runtime_ms - runtime_plan_ms`` is the upload)."""
    import fasttree
    from fasttree.runtime_planning import plan_for_runtime

    trees = plan_host.serving_trees("chain_reasoning")[:2]
    rt = plan_host.make_runtime(trees, 32, 8, 128, "cpu")
    heads = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    for tree in trees:
        uploaded = rt.plan(tree).plan
        planned, _ = plan_for_runtime(tree, fasttree.FastTreeConfig(), **heads, rules=fasttree.PlanRules.defaults())
        for name in ("kv_indices", "unit_kv_start", "unit_kv_len", "pair_query", "query_num_partials"):
            np.testing.assert_array_equal(getattr(planned, name), getattr(uploaded, name))


def test_a_cpu_run_without_the_interpreter_is_refused_with_a_usage_error(monkeypatch, capsys):
    """On a machine without a GPU the runtime needs ``TRITON_INTERPRET=1``: without it the script
    stops with a usage error naming the variable, not a traceback from the runtime's constructor."""
    import pytest

    monkeypatch.setattr(plan_host, "interpreting", lambda: False)
    with pytest.raises(SystemExit) as stop:
        plan_host.main(["--device", "cpu", "--repeats", "1"])
    assert stop.value.code == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
