"""bench/device/tile_variants_ab.py's CPU parts: the variants each family builds for a head ratio."""

import pytest

import fasttree as ft
from bench.device.tile_variants_ab import FAMILIES, split_variants, variants
from fasttree.toolkit.suite import paper_tree


@pytest.mark.parametrize("g", [1, 4, 16])
def test_each_tile_variant_changes_one_class_of_the_default(g):
    base = ft.FastTreeConfig()
    out = variants(g)
    assert out["default"] == base
    plans = {n: ft.plan(paper_tree(9), c, num_q_heads=16 * g, num_kv_heads=16, head_dim=128) for n, c in out.items()}
    for name, cfg in out.items():
        assert name == "default" or cfg != base
        assert name[:2] in ("de", "L_", "S_")
    # a small-class variant leaves the large class's launch alone and the reverse
    default_large = plans["default"].tile_classes[0]
    assert all(plans[n].tile_classes[0] == default_large for n in out if n.startswith("S_"))
    if g == 1:  # MHA: the 128-row query tile needs 128 queries of one KV head
        assert "L_q128_w8" in out and out["L_q128_w8"].query_tiles(g)[0] == 128


def test_split_variants_lengthen_the_small_split_only():
    out = split_variants(4)
    assert set(FAMILIES) == {"tiles", "splits"}
    assert [c.kv_split_sizes for c in out.values()] == [(1024, 128), (1024, 256), (1024, 512), (1024, 1024)]


def test_timed_in_turn_records_a_failing_variant_once_and_times_the_rest():
    from bench.common import timed_in_turn

    order, times = [], iter([3.0, 1.0, 2.0])

    def ok():
        order.append("ok")
        return {"graph_us": next(times), "err": 1e-4}

    def broken():
        order.append("broken")
        raise RuntimeError("out of shared memory")

    out = timed_in_turn({"ok": ok, "broken": broken}, 3, keep_errors=True)
    assert order == ["ok", "broken", "ok", "ok"]  # in turn; the failed one is not called again
    assert out["ok"] == {"graph_us": 2.0, "err": 1e-4, "graph_us_rounds": [3.0, 1.0, 2.0]}
    assert out["broken"] == {"error": "RuntimeError: out of shared memory"}
    with pytest.raises(RuntimeError):
        timed_in_turn({"broken": broken}, 1)
