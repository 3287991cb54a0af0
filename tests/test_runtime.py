"""TreeAttentionRuntime: plan/run buffers, capacity errors, config loading, results (CPU interpreter or GPU)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from runtime_checks import run_poisoned
from trees import random_tree, tiny_server_trees

import fasttree as ft
from fasttree.costs import QUERY_SEPARATED
from fasttree.export import ConfigExport, ExportEntry, ExportGuard, load_portfolio, write_export
from fasttree.runtime import PLAN_HEADER, TreeAttentionRuntime

HEADS = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def _runtime(device, config=None, **kw) -> TreeAttentionRuntime:
    args = {"dtype": torch.float16, "device": device, "max_queries": 64, "max_kv_entries": 4096, **HEADS, **kw}
    return TreeAttentionRuntime(config, **args)


def _inputs(
    tree: ft.KVTree, device, rows: int, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0, dtype=torch.float16
):
    gen = torch.Generator().manual_seed(seed)
    pool = max(tree.max_slot + 1, 1000)  # one pool size for every step, as a server has
    q = torch.randn(rows, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(pool + 3, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(pool + 3, hkv, d, generator=gen).to(device, dtype)
    return q, k, v


def test_header_matches_the_kernels():
    from fasttree.kernels import tree_attention as kt

    names = [n for n in dir(kt) if n.startswith("HDR_")]
    values = {n: int(getattr(kt, n).value) for n in names}
    assert values["HDR_SLOT_RANGES"] == PLAN_HEADER.index("slot0_first")
    assert values["HDR_MERGE_COUNTS"] == PLAN_HEADER.index("merge_few")
    assert values["HDR_CLASS_RANGES"] == PLAN_HEADER.index("class0_first")
    assert values["HDR_UNIT_LEADS"] == PLAN_HEADER.index("lead0")
    for n, v in values.items():
        if n not in ("HDR_SLOT_RANGES", "HDR_MERGE_COUNTS", "HDR_CLASS_RANGES", "HDR_UNIT_LEADS"):
            assert PLAN_HEADER[v] == n[4:].lower()


@pytest.mark.parametrize(
    "config",
    [
        ft.FastTreeConfig(),
        ft.FastTreeConfig(pack_tokens=0),
        ft.FastTreeConfig(kv_split_sizes=(32, 16), para_threshs1=(10**6, 10**6)),
        ft.FastTreeConfig(kv_split_sizes=(32, 16), para_threshs1=(1, 1)),  # groups past 32 tokens whole
    ],
)
@pytest.mark.parametrize(("launches", "max_variants"), [(1, 0), (2, 0), ("auto", 0), ("auto", 32), ("auto", 1)])
def test_runtime_matches_reference_over_several_trees(device, config, launches, max_variants):
    """One runtime, one q/out buffer, many trees: every step equals the float64 reference (the fixed
    launch with stage 1 as one launch over both tile classes or one per class; launch variants; one
    live variant at a time, replaced when the next plan's is not covered)."""
    rt = _runtime(device, config, stage1_launches=launches, max_variants=max_variants)
    rng = np.random.default_rng(5)
    q_rows = 64
    for step in range(4):
        tree = random_tree(rng, max_nodes=12, max_len=70)
        if tree.n_queries > q_rows:
            continue
        q, k, v = _inputs(tree, device, q_rows, seed=step)
        out = torch.full_like(q, float("nan"))
        info = rt.plan(tree)
        assert info.n_queries == tree.n_queries
        rt.forward(q, k, v, out=out)
        ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
        assert ft.max_relative_error(out[: tree.n_queries], ref) < 2e-3
        assert torch.isnan(out[tree.n_queries :]).all()  # rows past the plan untouched
        assert not rt._counters.any()  # the merge launch zeroed stage 1's item counters for the next call


def test_runtime_gqa_bf16_and_many_partials(device):
    """bf16, GQA 4, and a long chain split into many partials (the many-partials merge)."""
    heads = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 32}
    config = ft.FastTreeConfig(kv_split_sizes=(16, 16), para_threshs1=(10**6, 10**6), pack_tokens=0)
    rt = TreeAttentionRuntime(config, dtype="bfloat16", device=device, max_queries=8, max_kv_entries=4096, **heads)
    tree = ft.KVTree([-1, 0, 0], [np.arange(200), np.arange(200, 205), np.arange(205, 206)], [1, 2, 2])
    info = rt.plan(tree)
    assert info.merge_counts[1] > 0
    q, k, v = _inputs(tree, device, 8, hq=8, hkv=2, d=32, dtype=torch.bfloat16)
    out = rt.forward(q, k, v)
    ref = ft.reference_attention(q[:3], k, v, tree)
    assert ft.max_relative_error(out[:3], ref) < 1e-2


def test_query_centric_modes(device):
    rng = np.random.default_rng(0)
    # no token shared: 'auto' keeps the plan
    tree = ft.KVTree([-1, -1], [np.arange(40), np.arange(40, 90)], [0, 1])
    assert not _runtime(device).plan(tree).query_centric
    assert _runtime(device, query_centric="always").plan(tree).query_centric
    shared = random_tree(rng, max_nodes=10, max_len=40)
    assert not _runtime(device, query_centric="never").plan(shared).query_centric
    with pytest.raises(ValueError, match="query_centric"):
        _runtime(device, query_centric="sometimes")


def test_the_fixed_launch_slots_and_the_launch_view_take_the_rules_kv_tile_cap():
    # PlanRules.wide_head_kv_tile caps the KV tile of 32+ row launches above head dim 128: the
    # runtime's fixed launch slots and the latency model's view of a runtime plan cap it as the
    # per-plan launches do (fasttree.plan_rules.wide_head_tile)
    from fasttree.runtime_planning import launch_slots, launch_view, plan_for_runtime

    config = ft.FastTreeConfig()
    assert [s[:2] for s in launch_slots(config, 8, 256, 0)] == [(64, 64), (16, 64)]
    assert [s[:2] for s in launch_slots(config, 8, 256, 32)] == [(64, 32), (16, 64)]
    assert launch_slots(config, 8, 128, 32) == launch_slots(config, 8, 128, 0)  # head dim 128: no cap
    assert launch_slots(config, 1, 256, 32)[0][:2] == (64, 32)
    tree = ft.KVTree.from_lengths([-1, 0, 0, 1, 2], [200, 90, 37, 1, 150], [1, 2, 3, 4, 4])
    assert ft.PlanRules.runtime(1).wide_head_kv_tile == 32  # the runtime's rules cap by default
    for cap, tiles in ((32, [32, 64]), (0, [64, 64])):
        rules = ft.PlanRules.runtime(1).with_(wide_head_kv_tile=cap)
        plan, _ = plan_for_runtime(tree, config, num_q_heads=8, num_kv_heads=1, head_dim=256, rules=rules)
        assert [tc.block_n for tc in launch_view(plan, config).tile_classes] == tiles


@pytest.mark.parametrize(
    ("heads", "query_centric"), [((4, 2, 16), "auto"), ((4, 4, 16), "auto"), ((8, 1, 32), "never")]
)
def test_host_runtime_planning_is_what_the_runtime_uploads(device, heads, query_centric):
    # the profiler and the latency model plan a runtime measurement with fasttree.runtime_planning: it
    # must make the plan the runtime uploads and name the launch shapes the runtime compiles
    from fasttree.runtime_planning import launch_slots, launch_view, plan_for_runtime

    hq, hkv, d = heads
    shape = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    rng = np.random.default_rng(hq + hkv)
    config = ft.FastTreeConfig(kv_tile=(32, 16), num_warps=(8, 4), kv_split_sizes=(64, 32), pack_tokens=64)
    rt = _runtime(device, config, **shape, query_centric=query_centric, extend_steps=0, max_variants=0)
    assert rt.slots == launch_slots(config, hq // hkv, d, ft.PlanRules.defaults().wide_head_kv_tile)
    for _ in range(6):
        tree = random_tree(rng, max_nodes=12, max_len=60)
        uploaded = rt.plan(tree)
        plan, centric = plan_for_runtime(tree, config, **shape, stage1_launches=rt.stage1_launches,
                                         query_centric=query_centric)  # fmt: skip
        assert centric == uploaded.query_centric
        for name in ("kv_indices", "unit_kv_len", "unit_q_len", "pair_out_row", "merge_queries"):
            assert np.array_equal(getattr(plan, name), getattr(uploaded.plan, name)), name
        view = launch_view(plan, config, stage1_launches=rt.stage1_launches)
        assert view.unit_kv_len is plan.unit_kv_len and all(tc.masked for tc in view.tile_classes)
        fused = rt.stage1_launches == 1
        for c, tc in enumerate(view.tile_classes):
            slot = rt.slots[0 if plan.tile_mode == "all_large" else c]
            warps_stages = rt.slots[0][2:] if fused else slot[2:]
            assert (tc.block_m, tc.block_n, tc.num_warps, tc.num_stages) == (*slot[:2], *warps_stages)
    # with launch variants the runtime uploads what fasttree.plan makes (tree_attention's plan)
    rt = _runtime(device, config, **shape, query_centric="never", extend_steps=0)
    for _ in range(4):
        tree = random_tree(rng, max_nodes=12, max_len=60)
        uploaded = rt.plan(tree)
        plan = ft.plan(tree, config, **shape)
        for name in ("kv_indices", "kv_row_mask", "unit_kv_len", "unit_q_len", "pair_out_row", "merge_queries"):
            assert np.array_equal(getattr(plan, name), getattr(uploaded.plan, name)), name
        assert uploaded.variant_id >= 1 and uploaded.variant is not None
    with pytest.raises(ValueError, match="stage1_launches"):
        plan_for_runtime(tree, config, **shape, stage1_launches=3)


def test_capacity_errors_name_the_capacity_and_keep_the_previous_plan(device):
    rt = _runtime(device, max_queries=4, max_kv_entries=64, max_units=64)
    small = ft.KVTree([-1], [np.arange(10)], [0, 0])
    first = rt.plan(small)
    with pytest.raises(ValueError, match="max_queries"):
        rt.plan(ft.KVTree([-1], [np.arange(10)], [0] * 5))
    with pytest.raises(ValueError, match="max_kv_entries"):  # 200 entries: over twice max_kv_entries
        rt.plan(ft.KVTree([-1], [np.arange(200)], [0]))
    assert rt.current_plan is first


def test_forward_remembers_the_smallest_buffers(device):
    rt = _runtime(device)
    tree = ft.KVTree([-1], [np.arange(10)], [0, 0, 0])
    rt.plan(tree)
    q, k, v = _inputs(tree, device, 3)
    rt.forward(q, k, v)
    with pytest.raises(ValueError, match="smallest q"):
        rt.plan(ft.KVTree([-1], [np.arange(10)], [0] * 4))
    with pytest.raises(ValueError, match="pool slot"):
        rt.plan(ft.KVTree([-1], [np.arange(2000, 2010)], [0]))


def test_forward_validates_before_launching(device):
    rt = _runtime(device)
    tree = ft.KVTree([-1], [np.arange(10)], [0, 0])
    q, k, v = _inputs(tree, device, 2)
    with pytest.raises(ValueError, match="before plan"):
        rt.forward(q, k, v)
    rt.plan(tree)
    with pytest.raises(ValueError, match="dtype"):
        rt.forward(q.float(), k, v)
    with pytest.raises(ValueError, match="rows"):
        rt.forward(q[:1], k, v)
    with pytest.raises(ValueError, match="Hkv"):
        rt.forward(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="pool slot"):
        rt.forward(q, k[:5], v[:5])
    with pytest.raises(ValueError, match="out"):
        rt.forward(q, k, v, out=torch.empty_like(q)[:1])
    with pytest.raises(ValueError, match="sm_scale"):
        rt.forward(q, k, v, sm_scale=-1.0)
    built = _runtime(device, pool_slots=64)
    built.plan(tree)
    with pytest.raises(ValueError, match="pool_slots"):
        built.forward(q, k, v)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_queries": 0}, "max_queries"),
        ({"max_kv_entries": -1}, "max_kv_entries"),
        ({"max_units": True}, "max_units"),
        ({"dtype": "float32"}, "dtype"),
        ({"dtype": torch.float32}, "dtype"),
        ({"num_q_heads": 3}, "multiple"),
        ({"head_dim": 8}, "head_dim"),
        ({"programs_per_sm": 0}, "programs_per_sm"),
        ({"stage1_launches": 3}, "stage1_launches"),
        ({"stage1_launches": "two"}, "stage1_launches"),
        ({"stage1_launches": True}, "stage1_launches"),
    ],
)
def test_constructor_errors(device, kw, match):
    with pytest.raises(ValueError, match=match):
        _runtime(device, **kw)


def test_portfolio_from_export_file_and_fallback(device, tmp_path):
    # the runtime serves the export's runtime entry (not its tree_attention entry) for its GPU and bucket
    tuned = ft.FastTreeConfig(gamma=0.5, pack_tokens=0)  # planning fields only: a runtime member
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    common = {"gpu": gpu, "group_size": 2, "head_dim": 16, "dtype": "float16", "provenance": {},
              "guard": ExportGuard.current()}  # fmt: skip
    # member 1 for trees like the evidence trees (a short prefix, 2-4 leaves of 4-6 tokens), at 2 KV heads;
    # contexts past one KV tile, where decode merges too (else the crossover plans such a tree as decode)
    evidence = [ft.KVTree.from_levels([1, n], [60, m]) for n, m in ((2, 4), (3, 5), (4, 6))]
    region = ft.LeafRegion.of_trees([ft.tree_features(t) for t in evidence], [(2, 2)] * 3, "measured")
    runtime = ft.Portfolio((ft.FastTreeConfig(), tuned), ft.Selector(member=(1,)), runtime=True, regions=(region,))
    kernels = ft.Portfolio((ft.FastTreeConfig(), ft.FastTreeConfig(alpha=0.2)), ft.Selector(member=(1,)),
                           regions=(region,))  # fmt: skip
    entries = (
        ExportEntry(**common, portfolio=runtime, target="runtime"),
        ExportEntry(**common, portfolio=kernels, target="tree_attention"),
    )
    path = tmp_path / "export.json"
    write_export(path, ConfigExport(entries=entries, provenance={}))
    shape = {**HEADS, "dtype": "float16", "gpu": gpu}
    assert load_portfolio(path, **shape, target="runtime") == runtime.for_heads(4, 2)
    assert load_portfolio(path, **shape) == kernels.for_heads(4, 2)
    rt = _runtime(device, str(path))
    assert rt.portfolio == runtime.for_heads(4, 2) and rt.config == ft.FastTreeConfig()  # launches from member 0
    tree = ft.KVTree.from_levels([1, 3], [60, 5])
    assert rt.plan(tree).plan.config == tuned  # a tree inside the region: member 1
    # a tree unlike the evidence trees (a 400-token prefix), or the same tree at 1 KV head: the defaults
    assert rt.plan(ft.KVTree.from_levels([1, 3], [400, 5])).plan.config == ft.FastTreeConfig()
    one_kv = TreeAttentionRuntime(path, dtype="float16", device=device, max_queries=4, max_kv_entries=64,
                                  **{**HEADS, "num_q_heads": 2, "num_kv_heads": 1})  # fmt: skip
    assert one_kv.portfolio.members == runtime.members and one_kv.plan(tree).plan.config == ft.FastTreeConfig()
    # another bucket, or an entry tuned against other defaults: the defaults
    other = {**HEADS, "num_kv_heads": 4}
    fallback = TreeAttentionRuntime(path, dtype="float16", device=device, max_queries=4, max_kv_entries=64, **other)
    assert fallback.config == ft.FastTreeConfig() and fallback.portfolio == ft.Portfolio(runtime=True)
    stale = ExportEntry(**{**common, "guard": ExportGuard(0, "other", "")}, portfolio=runtime, target="runtime")
    write_export(tmp_path / "stale.json", ConfigExport(entries=(stale,), provenance={}))
    assert _runtime(device, tmp_path / "stale.json").portfolio == ft.Portfolio(runtime=True)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": 3}))
    with pytest.raises(ValueError):
        _runtime(device, bad)
    with pytest.raises(ValueError, match="config"):
        _runtime(device, 42)


def test_server_view_through_the_adapter_and_the_runtime(device):
    """A req_to_token table with shared prefixes -> KVTree (adapter) -> runtime == reference."""
    rng = np.random.default_rng(11)
    pool = rng.permutation(600)
    system, doc_a, doc_b = pool[:40], pool[40:140], pool[140:200]
    rows = [
        np.concatenate([system, doc_a, pool[200:203]]),
        np.concatenate([system, doc_a, pool[203:210]]),
        np.concatenate([system, doc_b, pool[210:211]]),
        np.concatenate([system, doc_b]),  # a prefix of the previous request: a query at an internal node
        pool[300:333],  # no sharing: a second root
    ]
    table = np.zeros((8, 256), dtype=np.int64)
    for i, r in enumerate(rows):
        table[i + 2, : r.size] = r
    tree = ft.tree_from_req_to_token(
        torch.as_tensor(table), torch.arange(2, 7), torch.as_tensor([r.size for r in rows])
    )
    assert tree.n_queries == 5 and tree.n_nodes >= 6
    rt = _runtime(device, ft.FastTreeConfig(kv_split_sizes=(64, 32)))
    rt.plan(tree)
    q, k, v = _inputs(tree, device, 8)
    out = rt.forward(q, k, v)
    ref = ft.reference_attention(q[:5], k, v, tree)
    assert ft.max_relative_error(out[:5], ref) < 2e-3
    for j, r in enumerate(rows):  # attention over the request's own slot list, without the tree
        idx = torch.as_tensor(r, device=k.device)
        kj = k[idx].double().repeat_interleave(2, dim=1)  # [len, Hq, D]: query head h reads KV head h // 2
        vj = v[idx].double().repeat_interleave(2, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[j].double(), kj) / 4.0, dim=-1)
        direct = torch.einsum("hl,lhd->hd", p, vj)
        assert ft.max_relative_error(out[j : j + 1], direct[None]) < 2e-3


def test_runtime_records_the_trees_it_plans(device, tmp_path):
    from fasttree.recording import WorkloadRecorder
    from fasttree.traces import decode_tree, read_traces

    path = tmp_path / "seen.jsonl"
    with WorkloadRecorder(path, every=2, dtype="float16", **HEADS) as rec:
        rt = _runtime(device, recorder=rec)
        trees = [ft.KVTree([-1, 0], [np.arange(10 + i), np.arange(50, 52)], [0, 1, 1]) for i in range(5)]
        for t in trees:
            rt.plan(t)
        assert rec.n_recorded == 3
    records = read_traces(path, kind="workload").records
    assert [r["workload"]["step"] for r in records] == [0, 2, 4]
    assert decode_tree(records[1]["workload"]["tree"]).num_tokens == trees[2].num_tokens
    other = WorkloadRecorder(tmp_path / "x.jsonl", dtype="bfloat16", **HEADS)
    with pytest.raises(ValueError, match="recorder"):
        _runtime(device, recorder=other)
    with pytest.raises(ValueError, match="recorder"):
        _runtime(device, recorder="seen.jsonl")


def test_plan_for_a_named_batch_bucket(device):
    """One graph per batch-size bucket: plan(rows=B) checks the tree against the bucket it will replay."""
    rt = _runtime(device)
    small = ft.KVTree([-1], [np.arange(10)], [0, 0])
    rt.plan(small)
    q2, k, v = _inputs(small, device, 2)
    rt.forward(q2, k, v)  # e.g. captured for batch size 2
    three = ft.KVTree([-1], [np.arange(10)], [0, 0, 0])
    with pytest.raises(ValueError, match="rows="):
        rt.plan(three)
    rt.plan(three, rows=4)
    q4 = torch.cat([q2, q2])
    out = rt.forward(q4, k, v)
    assert ft.max_relative_error(out[:3], ft.reference_attention(q4[:3], k, v, three)) < 2e-3
    with pytest.raises(ValueError, match="more than rows=2"):
        rt.plan(three, rows=2)
    with pytest.raises(ValueError, match="max_queries"):
        rt.plan(three, rows=65)
    with pytest.raises(ValueError, match="rows"):
        rt.plan(three, rows=0)


@pytest.mark.parametrize(
    ("heads", "expected"),
    [((4, 4, 16), 2), ((8, 8, 128), 2), ((8, 8, 256), 1), ((4, 2, 16), 1), ((16, 1, 64), 1)],
)
def test_auto_stage1_launches_splits_only_mha(device, heads, expected):
    """'auto': one launch per tile class for MHA at D <= 128 (memory-bound small units), one launch otherwise."""
    hq, hkv, d = heads
    rt = TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float16, device=device,
        max_queries=8, max_kv_entries=256,
    )  # fmt: skip
    assert rt.stage1_launches == expected


@pytest.mark.parametrize(
    ("launches", "hq", "hkv", "d", "dtype"),
    [
        (1, 4, 2, 16, torch.float16),
        (2, 4, 2, 16, torch.float16),
        (1, 4, 4, 16, torch.bfloat16),
        (2, 4, 4, 32, torch.float16),
        (1, 8, 1, 32, torch.bfloat16),
    ],
)
def test_programs_claim_items_past_the_first_wave(device, launches, hq, hkv, d, dtype):
    """Far more (unit, KV head) items than persistent programs, of uneven lengths, in both tile
    classes (a 300-token root read by every query, at least 40 short leaves, more than one
    program per SM can take): programs claim them from the
    launch's counters, every item runs once (the reference, twice in a row), and the merge
    launch leaves the counters at zero. GQA 2, MHA and GQA 8, fp16 and bf16."""
    config = ft.FastTreeConfig(
        kv_split_sizes=(64, 16), para_threshs1=(1, 1), para_threshs2=(1, 1), pack_tokens=0, gamma=0.0
    )  # two tile classes: the root's 64-token chunks (40 queries) and the leaves
    heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    rt = TreeAttentionRuntime(config, dtype=dtype, device=device, max_queries=512, max_kv_entries=32768,
                              stage1_launches=launches, programs_per_sm=1, max_variants=0, **heads)  # fmt: skip
    n = max(40, rt._sm_count // hkv + 8)  # leaves: more small-class items than one program per SM
    lengths = [300] + [1 + (7 * i) % 45 for i in range(n)]
    starts = np.cumsum([0, *lengths])
    slots = [np.arange(a, b) for a, b in itertools.pairwise(starts)]
    tree = ft.KVTree([-1] + [0] * n, slots, list(range(1, n + 1)))
    info = rt.plan(tree)
    assert min(b - a for a, b in info.slot_units) > 0  # both tile classes have items
    q, k, v = _inputs(tree, device, n, hq=hq, hkv=hkv, d=d, dtype=dtype)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        rt.forward(q, k, v, out=out)
        ref = ft.reference_attention(q, k, v, tree)
        assert ft.max_relative_error(out, ref) < tol
        assert not rt._counters.any()
    items = [(b - a) * rt.num_kv_heads for a, b in info.slot_units]
    assert max(items) > max(rt._programs)  # the claims ran


def test_register_caps_only_for_small_tiles_at_four_warps(device):
    """The small-tile launch's register cap (as measured: 16-row tiles, 4 warps, own launch) is
    derived from the GPU's registers per SM; 8 warps, large tiles and a fused launch keep the
    compiler's choice."""
    from types import SimpleNamespace

    four = _runtime(device, ft.FastTreeConfig(num_warps=(4, 4)), stage1_launches=2)
    eight = _runtime(device, ft.FastTreeConfig(num_warps=(4, 8)), stage1_launches=2)
    fused = _runtime(device, ft.FastTreeConfig(num_warps=(4, 4)), stage1_launches=1)
    for rt in (four, eight, fused):
        rt._props = SimpleNamespace(regs_per_multiprocessor=65536)
    assert [s[0] for s in four.slots] == [64, 16]  # HEADS: GQA 2, so the small tile has 16 rows
    assert four._register_caps() == [None, 128]
    assert eight._register_caps() == [None, None]
    assert fused._register_caps() == [None, None]
    four._props = SimpleNamespace(regs_per_multiprocessor=32768)
    assert four._register_caps() == [None, 64]


@pytest.mark.parametrize(("hq", "hkv", "launches"), [(32, 8, 1), (32, 8, 2)])
def test_one_launch_stage1_keeps_long_units_in_bins(hq, hkv, launches, device):
    # paper case 8's 256-token private leaves leave the bins for per-plan launches; a one-launch
    # stage 1 would run them with the large tile's registers, so there they stay packed
    from fasttree.toolkit.suite import paper_tree

    tree = paper_tree(8)
    rt = TreeAttentionRuntime(
        None, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype="float16", device=device,
        max_queries=tree.n_queries, max_kv_entries=1 << 20, max_units=1 << 14, max_partial_rows=1 << 14,
        pool_slots=tree.max_slot + 1, stage1_launches=launches, max_variants=0,
    )  # fmt: skip
    got = rt.plan(tree).plan
    heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": 128}
    shared = ft.plan(tree, **heads, rules=ft.PlanRules(solo_units=False))
    separate = ft.plan(tree, **heads)
    assert shared.units_per_class() != separate.units_per_class()
    expected = shared if launches == 1 else separate
    assert got.units_per_class() == expected.units_per_class()
    assert np.array_equal(got.unit_kv_len, expected.unit_kv_len)


def _decode_steps(rng: np.random.Generator, steps: int) -> list[ft.KVTree]:
    """Decode steps of one batch: a shared prefix, private leaves that each gain a token per
    step (new slots from a free pool), and one request arriving midway (a new node)."""
    free = list(rng.permutation(np.arange(60, 900)))
    shared = np.arange(60)
    leaves = [np.array([free.pop() for _ in range(int(rng.integers(1, 20)))]) for _ in range(5)]
    trees = []
    for step in range(steps):
        if step == steps // 2:
            leaves.append(np.array([free.pop() for _ in range(3)]))
        parents = [-1, *[0] * len(leaves)]
        trees.append(ft.KVTree(parents, [shared, *leaves], list(range(1, len(leaves) + 1))))
        leaves = [np.append(leaf, free.pop()) for leaf in leaves]
    return trees


@pytest.mark.parametrize("extend_steps", [0, 2, 8])
def test_runtime_extends_plans_of_growing_trees(device, extend_steps):
    """Steps that only grow private leaves reuse the last plan (up to extend_steps in a row),
    a new request plans afresh, and every step equals the float64 reference."""
    rt = _runtime(device, ft.FastTreeConfig(pack_tokens=64, pack_min_units=0), extend_steps=extend_steps)
    rng = np.random.default_rng(9)
    trees = _decode_steps(rng, 8)
    q, k, v = _inputs(trees[-1], device, 64, seed=3)
    flags = []
    for tree in trees:
        out = torch.full_like(q, float("nan"))
        flags.append(rt.plan(tree).extended)
        rt.forward(q, k, v, out=out)
        n = tree.n_queries
        assert ft.max_relative_error(out[:n], ft.reference_attention(q[:n], k, v, tree)) < 2e-3
    if extend_steps == 0:
        assert not any(flags)
    elif extend_steps == 2:  # fresh, 2 extended, fresh (the chain is full), arrival at step 4: fresh, ...
        assert flags == [False, True, True, False, False, True, True, False]
    else:
        assert flags == [False, True, True, True, False, True, True, True]


def test_extended_plans_keep_their_fresh_plans_launches(device, monkeypatch):
    """An extended plan runs the launch variant of the plan it extends (same units, classes and
    partials): the launch rules run only for fresh plans, and the step's graph id stays."""
    import fasttree.runtime as runtime_module

    real, fresh = runtime_module.launch_variant, []

    def counting(plan, *rest):
        fresh.append(plan)
        return real(plan, *rest)

    monkeypatch.setattr(runtime_module, "launch_variant", counting)
    rt = _runtime(device, ft.FastTreeConfig(pack_tokens=64, pack_min_units=0), extend_steps=8)
    trees = _decode_steps(np.random.default_rng(9), 8)
    q, k, v = _inputs(trees[-1], device, 64, seed=3)
    steps = []
    for tree in trees:
        steps.append(rt.plan(tree))
        out = torch.full_like(q, float("nan"))
        rt.forward(q, k, v, out=out)
        n = tree.n_queries
        assert ft.max_relative_error(out[:n], ft.reference_attention(q[:n], k, v, tree)) < 2e-3
    assert [s.extended for s in steps] == [False, True, True, True, False, True, True, True]
    assert len(fresh) == 2 and steps[0].variant_id != 0
    assert [p is s.plan for p, s in zip(fresh, [s for s in steps if not s.extended], strict=True)] == [True, True]
    for before, after in itertools.pairwise(steps):
        if after.extended:
            assert after.variant_id == before.variant_id and after.variant == before.variant


@pytest.mark.parametrize("extend_steps", [-1, 1.0, True, "8"])
def test_extend_steps_is_validated(device, extend_steps):
    with pytest.raises(ValueError, match="extend_steps"):
        _runtime(device, extend_steps=extend_steps)


def test_extension_over_a_capacity_plans_afresh(device):
    """An extended plan over max_kv_entries is replaced by a fresh plan, which then must fit or
    fail with the capacity's name, leaving the previous plan in place."""
    rt = _runtime(device, ft.FastTreeConfig(pack_tokens=0), max_kv_entries=35)  # arrays of 70 entries
    tree = ft.KVTree([-1, 0, 0], [np.arange(60), np.arange(60, 64), np.arange(64, 66)], [1, 2])
    first = rt.plan(tree)
    assert rt.kv_capacity == 70 and first.plan.kv_indices.size <= 70
    grown = np.concatenate([np.arange(60, 64), np.arange(100, 110)])  # leaf 1 grows by 10 tokens: 76 entries
    big = ft.KVTree([-1, 0, 0], [np.arange(60), grown, np.arange(64, 66)], [1, 2])
    assert rt._extender.extend(big) is not None
    with pytest.raises(ValueError, match="max_kv_entries"):
        rt.plan(big)
    assert rt.current_plan is first


@pytest.mark.parametrize("max_variants", [0, 8])
@pytest.mark.parametrize(("pool_slots", "expected"), [(None, False), (1003, True)])
def test_int32_kv_offsets_only_with_a_fixed_pool(device, monkeypatch, pool_slots, expected, max_variants):
    """Stage 1 (fixed or variant launches) uses int32 K/V offsets only when the runtime knows every
    slot a later plan may read (pool_slots): its launches, and graphs of them, serve every later plan."""
    import fasttree.runtime as runtime_module

    seen = []
    real = runtime_module.launch

    def recording(kernel, grid, args, constexprs, *rest, **kw):
        if kernel is runtime_module.tree_attention_persistent_kernel:
            seen.append(constexprs[10])  # OFFSETS_32
        if kernel is ft.attention.tree_attention_units_kernel:  # a launch variant's stage 1
            seen.append(constexprs[7])
        return real(kernel, grid, args, constexprs, *rest, **kw)

    monkeypatch.setattr(runtime_module, "launch", recording)  # the fixed launch's and the relocation's
    monkeypatch.setattr(ft.attention, "launch", recording)  # the variants' (fasttree.attention.launch_through_triton)
    rt = _runtime(device, pool_slots=pool_slots, max_variants=max_variants)
    tree = random_tree(np.random.default_rng(8), max_nodes=10, max_len=60)
    q, k, v = _inputs(tree, device, 64)
    assert k.shape[0] == 1003
    rt.plan(tree)
    out = rt.forward(q, k, v)
    assert seen and all(flag is expected for flag in seen)
    ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
    assert ft.max_relative_error(out[: tree.n_queries], ref) < 2e-3


#: Positions of ``PEEL_0``, ``PEEL_1`` and ``HEADS_FASTEST`` among the persistent stage 1's constexprs.
_PEEL_0, _PEEL_1, _HEADS_FASTEST = 11, 12, 13


def _runtime_outputs(device, monkeypatch, tree, q, k, v, launches, forced: dict) -> tuple[torch.Tensor, list]:
    """A runtime's output for ``tree`` (two calls: through Triton, then the direct launchers) with
    some of the persistent stage 1's constexprs replaced (``forced``: position -> value), and the
    constexprs its stage-1 launches were made with."""
    import fasttree.runtime as runtime_module

    real, seen = runtime_module.launch, []

    def forcing(kernel, grid, args, constexprs, *rest, **kw):
        if kernel is runtime_module.tree_attention_persistent_kernel:
            constexprs = tuple(forced.get(i, c) for i, c in enumerate(constexprs))
            seen.append(constexprs)
        return real(kernel, grid, args, constexprs, *rest, **kw)

    monkeypatch.setattr(runtime_module, "launch", forcing)
    rt = _runtime(device, stage1_launches=launches, pool_slots=k.shape[0], max_variants=0)
    rt.plan(tree)
    for _ in range(2):
        out = rt.forward(q, k, v, out=torch.full_like(q, float("nan")))
    monkeypatch.undo()
    return out[: tree.n_queries].clone(), seen


@pytest.mark.parametrize("launches", [1, 2])
def test_peeled_tail_tiles_give_identical_runtime_outputs(device, monkeypatch, launches):
    rng = np.random.default_rng(12)
    tree = random_tree(rng, max_nodes=12, max_len=120)
    q, k, v = _inputs(tree, device, 64)
    masked, _ = _runtime_outputs(device, monkeypatch, tree, q, k, v, launches, {_PEEL_0: False, _PEEL_1: False})
    peeled, _ = _runtime_outputs(device, monkeypatch, tree, q, k, v, launches, {_PEEL_0: True, _PEEL_1: True})
    ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
    assert ft.max_relative_error(peeled, ref) < 2e-3
    torch.testing.assert_close(peeled, masked, rtol=0, atol=0)


@pytest.mark.parametrize("launches", [1, 2])
def test_heads_fastest_item_order_gives_identical_runtime_outputs(device, monkeypatch, launches):
    rng = np.random.default_rng(13)
    tree = random_tree(rng, max_nodes=12, max_len=120)
    q, k, v = _inputs(tree, device, 64)
    fastest, seen = _runtime_outputs(device, monkeypatch, tree, q, k, v, launches, {})
    assert seen and all(c[_HEADS_FASTEST] is True for c in seen)  # the runtime's order
    units_first, _ = _runtime_outputs(device, monkeypatch, tree, q, k, v, launches, {_HEADS_FASTEST: False})
    ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
    assert ft.max_relative_error(fastest, ref) < 2e-3
    torch.testing.assert_close(units_first, fastest, rtol=0, atol=0)


def test_device_bytes_counts_the_buffers(device):
    """device_bytes is what the runtime allocates on its device: plan buffer, fp32 partials and LSEs,
    counters (the GPU refuses a runtime whose buffers exceed its memory before allocating them)."""
    rt = _runtime(device, max_partial_rows=100)
    held = [rt._plan_buf, rt._fixed, rt._fixed_dst, rt._part_o, rt._part_lse, rt._counters]
    assert rt.device_bytes == sum(t.numel() * t.element_size() for t in held)
    assert rt.device_bytes >= 100 * HEADS["num_q_heads"] * (HEADS["head_dim"] + 1) * 4


# ------------------------------------------------------------------------ portfolios


def _split_on_queries(threshold: float) -> ft.Selector:
    """Trees of at most ``2**threshold`` queries get member 0, larger ones member 1."""
    q = ft.portfolio.TREE_FEATURES.index("log2_queries")
    return ft.Selector(feature=(q, -1, -1), threshold=(threshold, 0.0, 0.0), left=(1, -1, -1), right=(2, -1, -1),
                       member=(0, 0, 1))  # fmt: skip


def test_runtime_portfolio_plans_each_tree_with_the_selected_member(device):
    tuned = ft.FastTreeConfig(kv_split_sizes=(32, 16), pack_tokens=0, gamma=-1.0)  # plan-level fields only
    portfolio = ft.Portfolio(members=(ft.FastTreeConfig(), tuned), selector=_split_on_queries(3.0), runtime=True)
    rt = _runtime(device, portfolio)
    assert rt.portfolio is portfolio and rt.config == ft.FastTreeConfig()  # launches from member 0
    small = ft.KVTree.from_levels((1, 4), (200, 8))  # 4 queries: member 0
    large = ft.KVTree.from_levels((1, 2, 16), (300, 60, 9))  # 16 queries: member 1 (a tree plan, not decode's)
    assert [portfolio.member_of(t) for t in (small, large, small)] == [0, 1, 0]
    for step, tree in enumerate((small, large, small)):
        info = rt.plan(tree)
        assert info.plan.config == portfolio.select(tree)
        assert not info.query_centric
        q, k, v = _inputs(tree, device, 64, seed=step)
        out = rt.forward(q, k, v)
        ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
        assert ft.max_relative_error(out[: tree.n_queries], ref) < 2e-3
    # the members plan the large tree differently, so the check above could fail
    assert ft.plan(large, tuned, **HEADS).stats() != ft.plan(large, ft.FastTreeConfig(), **HEADS).stats()


def test_with_launch_variants_members_may_differ_in_launch_fields(device):
    """A tree_attention portfolio whose member 1 has other KV tiles: each tree runs its member's own
    plan and launches (as tree_attention would), a new variant replacing the least recently used
    one past max_variants; with the fixed launch alone (max_variants=0) such a portfolio is refused
    before any work."""
    other = ft.FastTreeConfig(kv_tile=(32, 32))
    mixed = ft.Portfolio(members=(ft.FastTreeConfig(), other), selector=_split_on_queries(3.0))
    with pytest.raises(ValueError, match="launch fields"):
        _runtime(device, mixed, max_variants=0)
    with pytest.raises(ValueError, match="launch fields"):  # nor can it be made a runtime portfolio
        ft.Portfolio(members=mixed.members, selector=mixed.selector, runtime=True)
    small = ft.KVTree.from_levels((1, 4), (200, 8))  # 4 queries: member 0
    large = ft.KVTree.from_levels((1, 2, 16), (300, 60, 9))  # 16 queries: member 1 (a tree plan, not decode's)
    larger = ft.KVTree.from_levels((1, 4, 16), (300, 60, 9))  # 64 queries: member 1, another variant
    rt = _runtime(device, mixed, max_variants=2)
    expected = [(small, ft.FastTreeConfig(), 1), (large, other, 2), (larger, other, 3), (small, ft.FastTreeConfig(), 4)]
    for step, (tree, member, variant_id) in enumerate(expected):
        up = rt.plan(tree)
        assert up.plan.config == member and up.variant_id == variant_id, step
        if member == other:
            assert up.variant.stage1[0].block_n == 32  # member 1's KV tile, as tree_attention launches it
        q, k, v = _inputs(tree, device, 64, seed=step)
        out = rt.forward(q, k, v, out=torch.full_like(q, float("nan")))
        ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
        assert ft.max_relative_error(out[: tree.n_queries], ref) < 2e-3, step
    assert rt.variants.evicted == [] and len(rt.variants) == 2 and rt.variants.handed_out == 4


def test_runtime_masks_rows_when_any_member_packs(device):
    # member 0 packs nothing, member 1 packs every unit: the runtime must carry row masks for member 1
    members = (ft.FastTreeConfig(pack_tokens=0), ft.FastTreeConfig(pack_min_units=0))
    portfolio = ft.Portfolio(members=members, selector=ft.Selector(member=(1,)), runtime=True)
    rt = _runtime(device, portfolio)
    tree = ft.KVTree.from_levels([1, 8], [64, 20])
    info = rt.plan(tree)
    assert info.plan.config == members[1] and info.plan.kv_row_mask.size > 0  # the plan packs
    q, k, v = _inputs(tree, device, 64, seed=3)
    out = rt.forward(q, k, v)
    ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
    assert ft.max_relative_error(out[: tree.n_queries], ref) < 2e-3


@pytest.mark.parametrize(("max_variants", "leaves"), [(8, 19), (1, 17)])
def test_a_variants_idle_programs_find_empty_units_first_and_the_filler_query_last(device, max_variants, leaves):
    """After a large plan, a smaller one's relocation puts its units of each tile class after as
    many empty units (zeros) as its variant's grid has beyond them (its own grid bucket, or with
    one live variant the large plan's covering grid; those programs run first and do nothing), and
    the filler query (``max_queries``, of no partial) past its merge list; both steps are right."""
    rt = _runtime(device, max_variants=max_variants, max_kv_entries=1 << 14)
    big = ft.KVTree.from_lengths([-1] + [0] * 30, [400] + [90] * 30, list(range(1, 31)))
    small = ft.KVTree.from_lengths([-1] + [0] * leaves, [400] + [90] * leaves, list(range(1, leaves + 1)))
    q, k, v = _inputs(big, device, 64)
    rt.plan(big)
    up = rt.plan(small)
    assert up.variant_id >= 1
    f = {name: t.cpu().numpy() for name, t in rt._fixed_arrays.items()}
    plan, region = up.plan, rt.unit_region
    ptr = plan.class_unit_ptr
    led = 0
    for s in up.variant.stage1:
        c = s.tile_class
        lo, n = c * region, int(ptr[c + 1] - ptr[c])
        lead = s.n_units - n
        led += lead
        for name in ("unit_kv_start", "unit_kv_len", "unit_q_start", "unit_q_len"):
            assert not f[name][lo : lo + lead].any(), name
            assert np.array_equal(f[name][lo + lead : lo + lead + n], getattr(plan, name)[ptr[c] : ptr[c + 1]]), name
    assert led > 0  # the grid runs past the plan's units
    n_merge = plan.merge_queries.size
    assert (f["merge_queries"][n_merge:] == rt.max_queries).all()
    assert f["query_num_partials"][rt.max_queries] == 0
    out = rt.forward(q, k, v, out=torch.full_like(q, float("nan")))
    ref = ft.reference_attention(q[: small.n_queries], k, v, small)
    assert ft.max_relative_error(out[: small.n_queries], ref) < 2e-3
    rt.plan(big)  # back to the large plan: its units, no stale ones, and the right step
    out = rt.forward(q, k, v, out=torch.full_like(q, float("nan")))
    ref = ft.reference_attention(q[: big.n_queries], k, v, big)
    assert ft.max_relative_error(out[: big.n_queries], ref) < 2e-3


def test_past_max_variants_a_covering_variant_serves_the_plan_else_a_new_id_replaces_the_old(device):
    """With one live variant, the runtime serves a smaller plan of the same launches (or of unmasked
    ones: all-ones row masks) with that variant (its extra programs find empty units and the filler
    query) and a plan of other launches under a new id that replaces it (its launchers dropped);
    every step equals the reference."""
    from fasttree.launch_variants import launch_variant

    rt = _runtime(device, max_variants=1, max_kv_entries=1 << 14)

    def star(n: int) -> ft.KVTree:  # a 400-token prompt read by n questions of 90 tokens
        return ft.KVTree.from_lengths([-1] + [0] * n, [400] + [90] * n, list(range(1, n + 1)))

    first = rt.plan(star(30))
    assert first.variant_id == 1
    q, k, v = _inputs(star(30), device, 64)
    other = ft.KVTree.from_lengths([-1, 0, 0, 1, 1], [300, 40, 500, 30, 20], [2, 3, 4])
    expected_ids = []
    for tree, vid in ((star(28), 1), (star(12), 1), (other, 2), (star(30), 3)):
        up = rt.plan(tree)
        own = launch_variant(up.plan, rt._target)
        assert up.variant_id == vid
        if vid == 1:
            assert up.variant == first.variant and first.variant.covers(own) and own != first.variant
        else:  # nothing live covers it: a new id, its own launches
            assert up.variant == own and rt.variants.variant(vid - 1) is None
        out = rt.forward(q, k, v, out=torch.full_like(q, float("nan")))
        ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
        assert ft.max_relative_error(out[: tree.n_queries], ref) < 2e-3
        assert torch.isnan(out[tree.n_queries :]).all()
        expected_ids.append(vid)
        assert {key[0] for key in rt._variant_launchers} <= {vid}  # a replaced id's launchers are gone
    assert len(rt.variants) == 1 and rt.variants.handed_out == 3


@pytest.mark.parametrize(("launches", "max_variants"), [(1, 0), (2, 0), ("auto", 32)])
def test_runtime_serves_the_crossover_decode_plan(device, launches, max_variants):
    """Forests at 16 query heads over one KV head that the crossover rule sends to plain decode's
    plan: the runtime uploads that plan and its outputs match the reference, with the fixed
    persistent launch and with launch variants. The fixed launch plans all-small trees all-large,
    so a small forest with internal queries crosses over there; with variants the runtime plans as
    ``ft.plan`` does, where only trees of enough units (here 132 one-query roots) pack 64-row bins."""
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 16}
    if max_variants:
        tree = ft.KVTree.from_lengths([-1] * 132, [2] * 132, list(range(132)))
    else:
        tree = ft.KVTree.from_lengths([4, -1, 0, 1, -1, 4], [16, 1, 2, 1, 16, 2], [3, 2, 1, 5, 4])
    rt = TreeAttentionRuntime(
        None, dtype=torch.float16, device=device, max_queries=136, max_kv_entries=512, stage1_launches=launches,
        max_variants=max_variants, **heads,
    )  # fmt: skip
    info = rt.plan(tree)
    assert info.plan.tile_mode == QUERY_SEPARATED and not info.bounded
    q, k, v = _inputs(tree, device, 136, hq=16, hkv=1, d=16, seed=5)
    out = rt.forward(q, k, v)
    assert ft.max_relative_error(out[: tree.n_queries], ft.reference_attention(q[: tree.n_queries], k, v, tree)) < 2e-3


@pytest.mark.parametrize("max_variants", [0, 4])
def test_runtime_serves_the_one_wave_crossovers_decode_plan(device, max_variants):
    """A small tree whose tree plan chains more KV tiles per program than decode's (32-token tiles, GQA 2):
    with launch variants the runtime plans as ``ft.plan`` does, so the one-wave crossover
    (``PlanRules.crossover_wave_programs``) gives it decode's plan; the fixed launch's rules keep the
    tree plan. Either way the outputs match the float64 reference."""
    config = ft.FastTreeConfig(kv_tile=(32, 32))
    tree = ft.KVTree.from_levels((1, 2, 16), (200, 40, 8))
    assert ft.plan(tree, config, **HEADS).tile_mode == QUERY_SEPARATED
    rt = _runtime(device, config, max_variants=max_variants)
    info = rt.plan(tree)
    assert (info.plan.tile_mode == QUERY_SEPARATED) == bool(max_variants) and not info.bounded
    q, k, v = _inputs(tree, device, 64, seed=11)
    out = rt.forward(q, k, v, out=torch.full_like(q, float("nan")))
    ref = ft.reference_attention(q[: tree.n_queries], k, v, tree)
    assert ft.max_relative_error(out[: tree.n_queries], ref) < 2e-3


def test_the_merge_filler_query_keeps_no_partials_across_plans(device):
    """The relocation copies each array's aligned length, so a per-query array's padding lands on the
    queries past the plan's, the merge list's filler (query ``max_queries``) among them when
    ``max_queries`` is not a multiple of the alignment: the padding is zeroed, and the filler reads
    no partials after every upload (stale words from an earlier plan in the staging buffer once gave
    it 13 partials, and a merge program wrote output row ``max_queries``, past ``out``)."""
    trees = tiny_server_trees()
    rows = max(t.n_queries for t in trees)
    rt = _runtime(device, ft.FastTreeConfig(pack_tokens=16, pack_min_units=0), max_queries=rows, max_variants=4)
    assert rows % 32 and any(t.n_queries > rows - rows % 32 for t in trees)  # plans whose padding reaches it
    for step, tree in enumerate(trees):
        rt.plan(tree, rows=rows)
        fixed = {n: rt._fixed_arrays[n].cpu().numpy() for n in ("query_num_partials", "merge_queries")}
        assert fixed["query_num_partials"][rt.max_queries] == 0, step
        n_merge = sum(rt._current.merge_counts)  # past the plan's merge list, only the filler
        assert (fixed["merge_queries"][n_merge:] == rt.max_queries).all(), step


@pytest.mark.parametrize("max_variants", [0, 4])
@pytest.mark.parametrize("hq, hkv", [(4, 2), (2, 2), (16, 1)])
def test_runtime_follows_a_simulated_server_step_by_step(device, max_variants, hq, hkv):
    """:func:`trees.tiny_server_trees` step by step: every step's plan (fresh or extended, under few
    launch-variant ids or the fixed launch; MHA's two stage-1 launches, GQA 2, GQA 16 over one KV
    head) gives the float64 reference's outputs, with the outputs poisoned before each step and the
    rows past the step's queries left untouched."""
    trees = tiny_server_trees()
    rows = max(t.n_queries for t in trees)
    config = ft.FastTreeConfig(pack_tokens=16, pack_min_units=0)
    heads = {"num_q_heads": hq, "num_kv_heads": hkv}
    rt = _runtime(device, config, max_queries=rows, max_variants=max_variants, **heads)
    q, k, v = _inputs(trees[-1], device, rows, hq=hq, hkv=hkv, seed=11)
    pool = k.shape[0]
    assert all(t.max_slot < pool for t in trees)
    kinds = set()
    for step, tree in enumerate(trees):
        kinds.add(rt.plan(tree, rows=rows).extended)
        err = run_poisoned(rt, tree, q, k, v, rows)
        assert err < 2e-3, (step, err)
    assert kinds == {False, True}  # both fresh and extended plans were served
    assert len({t.n_queries for t in trees}) > 2  # the batch grew and shrank


def _random_server(seed: int) -> tuple[list[ft.KVTree], dict, tuple[int, int, int]]:
    """A random small server (prefix levels, forks, arrivals, answer lengths, batch cap) with stable
    slots, and runtime settings drawn with it: heads, head dim, config, launch-variant bound,
    extension steps, stage-1 launches, ``max_queries`` up to 4 past the largest batch and
    ``max_kv_entries`` from 0.6x to 4x the largest batch's context entries."""
    from bench.decode import stable_slot_trees
    from fasttree.toolkit.workloads import ServingScenario, iter_serving

    rng = np.random.default_rng(seed)
    top = int(rng.integers(5, 80))
    levels = [(1, top, top + int(rng.integers(0, 40)))]
    if rng.random() < 0.7:
        low = int(rng.integers(1, 40))
        levels.append((int(rng.integers(1, 4)), low, low + int(rng.integers(0, 20))))
    forks = () if rng.random() < 0.5 else (int(rng.integers(2, 4)),)
    scenario = ServingScenario(
        name="random", description="test", prefix_levels=tuple(levels),
        questions_per_prefix=int(rng.integers(1, 6)), question_tokens=(1, int(rng.integers(1, 12))),
        output_tokens=(1, int(rng.integers(2, 12))), forks=forks, fork_after=(1, 4),
        max_batch=int(rng.integers(3, 20)) * (forks[0] if forks else 1), arrival_rate=float(rng.uniform(0.2, 2.0)),
    )  # fmt: skip
    trees = stable_slot_trees(list(iter_serving(scenario, seed=seed, steps=int(rng.integers(8, 16)))))
    hq, hkv = [(4, 2), (2, 2), (16, 1), (8, 1), (7, 1), (8, 8), (16, 2)][int(rng.integers(0, 7))]
    d = (16, 32)[int(rng.integers(0, 2))]
    context = max(int(t.path_lengths[t.query_nodes].sum()) for t in trees)
    settings = {
        "config": (None, ft.FastTreeConfig(pack_tokens=16, pack_min_units=0), ft.FastTreeConfig(pack_tokens=0))[
            int(rng.integers(0, 3))
        ],
        "max_variants": (0, 1, 2, 32)[int(rng.integers(0, 4))],
        "extend_steps": (0, 1, 8)[int(rng.integers(0, 3))],
        "stage1_launches": ("auto", 1, 2)[int(rng.integers(0, 3))],
        "max_queries": max(t.n_queries for t in trees) + int(rng.integers(0, 5)),
        "max_kv_entries": int(context * (0.6, 1.0, 4.0)[int(rng.integers(0, 3))]) + 1,
    }
    return trees, settings, (hq, hkv, d)


@pytest.mark.parametrize("seed", range(6))
def test_random_servers_match_the_reference(device, seed):
    """Random small servers (:func:`_random_server`): each step planned for a random batch bucket
    ``rows`` between its queries and ``max_queries`` gives the float64 reference's outputs (outputs
    poisoned, rows past the queries untouched), or, past ``max_kv_entries``, a ValueError naming it."""
    trees, settings, (hq, hkv, d) = _random_server(seed)
    config = settings.pop("config")
    rt = TreeAttentionRuntime(
        config, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float16, device=device, **settings
    )
    rng = np.random.default_rng(1000 + seed)
    gen = torch.Generator().manual_seed(seed)
    pool = max(t.max_slot for t in trees) + 4
    q = torch.randn(rt.max_queries, hq, d, generator=gen).to(device, torch.float16)
    k = torch.randn(pool, hkv, d, generator=gen).to(device, torch.float16)
    v = torch.randn(pool, hkv, d, generator=gen).to(device, torch.float16)
    served = 0
    for step, tree in enumerate(trees):
        rows = int(rng.integers(tree.n_queries, rt.max_queries + 1))
        try:
            rt.plan(tree, rows=rows)
        except ValueError as err:
            assert "max_kv_entries" in str(err), (step, err)
            continue
        assert run_poisoned(rt, tree, q, k, v, rows) < 2e-3, step
        served += 1
    assert served > 0
