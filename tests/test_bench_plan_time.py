"""bench.plan_time: a case's row carries its timing and the page faults per plan, and the tables
show them (CPU)."""

from __future__ import annotations

import numpy as np

from bench import plan_time


def test_a_cases_row_times_the_plan_and_counts_its_page_faults():
    row = plan_time.bench_case(9, "gqa4", repeats=5, warmup=2)
    assert row["repeats"] == 5 and 0 < row["plan_min_ms"] <= row["plan_ms"] <= row["plan_p90_ms"]
    faults = row["page_faults_per_plan"]
    assert faults is None or (faults >= 0 and np.isfinite(faults))
    summary = plan_time.summarize([row])
    env = plan_time.environment()
    text = plan_time.markdown([row], summary, env, "t")
    assert "| faults |" in text and f"| {row['n_nodes']} | {row['n_queries']} |" in text
    # the environment says whether the compiled planner loops ran (a host time means little without)
    from fasttree.native import planner_library

    assert env["native_planner"] is (planner_library() is not None)
    assert ("compiled planner loops loaded" in text) is env["native_planner"]
    assert "compiled planner loops unknown" in plan_time.markdown([row], summary, {**env, "native_planner": None}, "t")


def test_reused_host_memory_leaves_a_big_tree_without_page_faults():
    """Planning one 100k+-token tree repeatedly (as a server plans similar trees) takes no fresh
    pages once the planner's host memory is reused."""
    row = plan_time.bench_case("multi_document", "mha", repeats=12, warmup=4)
    if row["page_faults_per_plan"] is None:
        return  # the platform does not count page faults
    assert row["n_tokens"] > 100_000 and row["page_faults_per_plan"] < 60  # 242 without the host pool


def test_the_fresh_column_plans_a_new_unindexed_tree_every_call(monkeypatch):
    """``fresh_plan_ms`` times plans of new tree objects (the planner's per-tree index not cached,
    as for a server's new tree each step), not the warm tree the plan_ms column reuses."""
    import fasttree
    from fasttree import planner

    seen = []
    real = fasttree.plan

    def recording(tree, *a, **k):
        seen.append((id(tree), getattr(tree, planner._INDEX_ATTR, None) is None))
        return real(tree, *a, **k)

    monkeypatch.setattr(plan_time.fasttree, "plan", recording)
    row = plan_time.bench_case(9, "gqa16", repeats=4, warmup=1)
    warm, fresh = seen[:5], seen[5:]
    assert len({i for i, _ in warm}) == 1 and not any(unindexed for _, unindexed in warm[1:])
    assert len(fresh) == 4 and all(unindexed for _, unindexed in fresh)
    assert row["fresh_plan_ms"] > 0
    summary = plan_time.summarize([row])
    text = plan_time.markdown([row], summary, plan_time.environment(), "t")
    assert "| fresh_ms |" in text and f"fresh trees: median {row['fresh_plan_ms']:.3f} ms" in text
