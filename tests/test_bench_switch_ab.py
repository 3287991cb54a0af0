"""bench/device/switch_ab.py's CPU parts: values, the switch's scope and which plans a value changes."""

from __future__ import annotations

import pytest

from bench.device.switch_ab import differ, parse_value, plans, summarize, switched
from fasttree import plan_arrays, planner
from fasttree.toolkit.suite import paper_tree


def test_values_parse_as_json_else_strings():
    got = [parse_value(x) for x in ("0", "2.5", "true", "null", "fill", "[1,2]")]
    assert got == [0, 2.5, True, None, "fill", [1, 2]]


def test_switch_is_restored_even_after_an_error():
    old = planner._WHOLE_GROUPS_MIN_ITEMS
    with pytest.raises(RuntimeError), switched(planner, "_WHOLE_GROUPS_MIN_ITEMS", None):
        assert planner._WHOLE_GROUPS_MIN_ITEMS is None
        raise RuntimeError
    assert planner._WHOLE_GROUPS_MIN_ITEMS is old


def test_plans_under_each_value_and_what_they_change():
    # balanced bins change 11/gqa16's plan, not 1/mha's (MHA keeps filled bins)
    ps = plans(plan_arrays, "_BALANCED_RUNS", [False, None], paper_tree(11), None, 16, 1)
    assert differ(ps) and ps[0].n_partial_rows == 512 and ps[1].n_partial_rows == 0
    assert not differ(plans(plan_arrays, "_BALANCED_RUNS", [False, None], paper_tree(1), None, 32, 32))


def test_summary_ratios_against_the_first_value():
    paper = [{"a": {"graph_us": 10.0, "err": 1e-4}, "b": {"graph_us": 8.0, "err": 2e-4}}]
    decode = [{"a": {"runtime_us": 100.0, "tree_attention_us": 50.0, "max_err": 1e-4},
               "b": {"runtime_us": 90.0, "tree_attention_us": 55.0, "max_err": 3e-4}}]  # fmt: skip
    s = summarize(paper, decode, ["a", "b"])["b"]
    assert s["paper_changed"] == 1 and s["paper_geomean_over_changed"] == pytest.approx(0.8)
    assert s["paper_geomean_over_45"] == pytest.approx(0.8 ** (1 / 45))
    assert s["decode_runtime"] == pytest.approx(0.9) and s["decode_tree_attention"] == pytest.approx(1.1)
    assert s["paper_max_err"] == 2e-4 and s["decode_max_err"] == 3e-4


def test_a_launch_switch_times_every_case_with_its_value_set(monkeypatch):
    """``--launch``: no case is skipped for an unchanged plan, and each value's timing runs with the
    switch set to it (the GPU parts faked)."""
    from bench.device import switch_ab
    from fasttree import attention

    seen = []

    def fake_time(plan, *args):
        seen.append(attention._PDL)
        return {"graph_us": 1.0, "err": 0.0}

    monkeypatch.setattr(switch_ab, "random_case", lambda *a, **k: (None, None, None, None, None))
    monkeypatch.setattr(switch_ab, "checked_graph_time", fake_time)
    monkeypatch.setattr(switch_ab, "paper_tree", lambda case: paper_tree(1))  # small: 45 plans x 2 values
    values = ["none", "early"]
    rows = switch_ab.tree_rows(attention, "_PDL", values, values, switch_ab.paper_items(), launch=True)
    assert len(rows) == 45 and seen == ["none", "early"] * 45
    seen.clear()
    assert switch_ab.tree_rows(attention, "_PDL", values, values, switch_ab.paper_items()) == []  # plans unchanged
    assert seen == []


def test_rounds_time_the_values_in_turn_and_keep_the_median(monkeypatch):
    """``--rounds``: each value is timed once per round, A, B, A, B, ...; its row keeps the median
    and every round's time; ``--cases`` limits the cases (the GPU parts faked)."""
    from bench.device import switch_ab
    from fasttree import attention

    seen, times = [], iter([5.0, 1.0, 3.0, 2.0, 4.0, 9.0])

    def fake_time(plan, *args):
        seen.append(attention._PDL)
        return {"graph_us": next(times), "err": 1e-4}

    monkeypatch.setattr(switch_ab, "random_case", lambda *a, **k: (None, None, None, None, None))
    monkeypatch.setattr(switch_ab, "checked_graph_time", fake_time)
    monkeypatch.setattr(switch_ab, "PAPER_HEADS", {"mha": (4, 4)})
    values = ["none", "early"]
    rows = switch_ab.tree_rows(attention, "_PDL", values, values, switch_ab.paper_items([1]), True, rounds=3)
    assert seen == ["none", "early"] * 3
    assert [(r["case"], r["heads"]) for r in rows] == [(1, "mha")]
    assert rows[0]["none"]["graph_us_rounds"] == [5.0, 3.0, 4.0] and rows[0]["none"]["graph_us"] == 4.0
    assert rows[0]["early"]["graph_us_rounds"] == [1.0, 2.0, 9.0] and rows[0]["early"]["graph_us"] == 2.0


def test_heldout_items_cover_every_family_seed_and_head_ratio(monkeypatch):
    from bench.device import switch_ab

    drawn = []
    monkeypatch.setattr(switch_ab, "sample_tree", lambda family, seed: drawn.append((family, seed)) or paper_tree(1))
    items = list(switch_ab.heldout_items(range(5, 7)))
    families = sorted(switch_ab.TREE_FAMILIES)
    assert drawn == [(f, s) for f in families for s in (5, 6)]  # each tree drawn once for its head ratios
    assert [(i["family"], i["seed"], i["heads"]) for i, _, _, _ in items] == [
        (f, s, h) for f in families for s in (5, 6) for h in switch_ab.PAPER_HEADS
    ]
    assert all(heads == i["heads"] and seed == i["seed"] for i, _, heads, seed in items)


def test_summary_of_heldout_rows():
    paper = []
    held = [{"a": {"graph_us": 10.0, "err": 1e-4}, "b": {"graph_us": 5.0, "err": 2e-4}},
            {"a": {"graph_us": 10.0, "err": 1e-4}, "b": {"graph_us": 20.0, "err": 1e-4}}]  # fmt: skip
    s = summarize(paper, [], ["a", "b"], held)["b"]
    assert s["heldout_changed"] == 2 and s["heldout_geomean_over_changed"] == pytest.approx(1.0)
    assert s["heldout_best"] == 0.5 and s["heldout_worst"] == 2.0 and s["heldout_max_err"] == 2e-4
    assert "heldout_changed" not in summarize(paper, [], ["a", "b"])["b"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--cases", "0,3"], "paper cases 1-15"), (["--cases", "a"], "comma-separated case numbers"),
    (["--rounds", "0"], "expected an integer >= 1, got 0"), (["--heldout", "5:5"], "expected 0 <= FIRST < END"),
    (["--heldout", "x"], "expected FIRST:END seeds"),
])  # fmt: skip
def test_bad_cases_or_rounds_are_usage_errors(argv, message, capsys):
    from bench.device import switch_ab

    with pytest.raises(SystemExit):
        switch_ab.main(["--switch", "fasttree.attention:_PDL", "--values", "none,auto", "--out", "x.json", *argv])
    assert message in capsys.readouterr().err


def test_aligned_pack_sweep_variants_start_with_the_tuned_config():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench" / "device"))
    try:
        from aligned_pack_sweep import PACK_TOKENS, variants
    finally:
        sys.path.pop(0)
    from fasttree import FastTreeConfig

    base = FastTreeConfig(pack_tokens=512, pack_min_units=314)
    got = variants(base)
    assert got[0] == ("tuned", base)
    assert [n for n, _ in got[1:]] == [f"pack{t}m{m}" for t in PACK_TOKENS for m in (132, 314)]
    assert all(c.pack_tokens == int(n[4:].split("m")[0]) and c.kv_tile == base.kv_tile for n, c in got[1:])
    assert len(variants(FastTreeConfig(pack_min_units=132))) == 1 + len(PACK_TOKENS)  # 132 once


def test_time_serving_trees_sums_both_paths_and_checks_both_outputs(monkeypatch):
    """bench.common.time_serving_trees on the CPU (interpreter), the graph timer faked: one
    timing per tree for the runtime and one for tree_attention, and an error from both outputs."""
    import torch

    import fasttree as ft
    from bench import common

    calls = []

    def fake_timer(fn, **kw):
        fn()
        calls.append(fn)
        return {"median": 2.0}

    monkeypatch.setattr(common, "graph_time_us", fake_timer)
    trees = [paper_tree(1), ft.KVTree.from_levels([1, 4], [40, 3])]
    gen = torch.Generator().manual_seed(0)
    rows, slots = max(t.n_queries for t in trees), max(t.max_slot for t in trees) + 1
    q = torch.randn(rows, 4, 64, generator=gen).to(torch.float16)
    k = torch.randn(slots, 2, 64, generator=gen).to(torch.float16)
    v = torch.randn(slots, 2, 64, generator=gen).to(torch.float16)
    got = common.time_serving_trees(ft.FastTreeConfig(), trees, q, k, v, torch.empty_like(q))
    assert len(calls) == 4 and got["runtime_us"] == 4.0 and got["tree_attention_us"] == 4.0
    assert 0 <= got["max_err"] < 1e-2
