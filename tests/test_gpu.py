"""GPU correctness (run on the device: ``pytest -m gpu``): all 45 paper-suite cases and
random forests at realistic sizes, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attention import TOL, make_inputs
from trees import random_tree

import fasttree as ft
from fasttree.toolkit.suite import PAPER_HEADS, PAPER_SUITE, paper_tree

pytestmark = pytest.mark.gpu

_SAMPLED_QUERIES = 96


def _max_rel_error(out: torch.Tensor, q, k, v, tree, rows: np.ndarray) -> float:
    ref = ft.reference_attention(q, k, v, tree, queries=rows)
    # per-query relative error, worst over the sampled queries
    return ft.max_relative_error(out[torch.as_tensor(rows, device=out.device)], ref)


def _sample(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.sort(rng.choice(n, size=min(n, _SAMPLED_QUERIES), replace=False))


@pytest.mark.parametrize("heads", sorted(PAPER_HEADS))
@pytest.mark.parametrize("case", sorted(PAPER_SUITE))
def test_paper_suite_case(case, heads):
    hq, hkv = PAPER_HEADS[heads]
    tree = paper_tree(case)
    gen = torch.Generator().manual_seed(case * 10 + hq + hkv)
    q, k, v = make_inputs(tree, hq, hkv, 128, torch.float16, "cuda", gen)
    rng = np.random.default_rng(case)
    rows = _sample(tree.n_queries, rng)
    for plan in (
        ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128),
        ft.plan_query_separated(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128),
    ):
        out = torch.full_like(q, float("nan"))
        ft.tree_attention(q, k, v, plan, out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"unwritten outputs ({plan.tile_mode})"
        err = _max_rel_error(out, q, k, v, tree, rows)
        assert err <= TOL[torch.float16], f"case {case} {heads} {plan.tile_mode}: max relative error {err:.2e}"


@pytest.mark.parametrize("seed", range(8))
def test_random_forests(seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        g = int(rng.choice([1, 4, 7, 8, 16]))
        hkv = int(rng.choice([1, 2, 8])) if g < 16 else 1
        d = int(rng.choice([64, 128, 256]))
        dtype = torch.float16 if rng.random() < 0.5 else torch.bfloat16
        tree = random_tree(rng, max_nodes=300, max_len=3000)
        cfg = ft.FastTreeConfig(
            gamma=float(rng.choice([0.1, -10.0, 10.0])),
            kv_split_sizes=(int(rng.choice([256, 1024])), int(rng.choice([64, 128]))),
            kv_tile=(int(rng.choice([32, 64])), 32),
        )
        plan = ft.plan(tree, cfg, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d)
        q, k, v = make_inputs(tree, g * hkv, hkv, d, dtype, "cuda", gen)
        out = torch.full_like(q, float("nan"))
        ft.tree_attention(q, k, v, plan, out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        err = _max_rel_error(out, q, k, v, tree, _sample(tree.n_queries, rng))
        assert err <= TOL[dtype], f"seed {seed}: g={g} hkv={hkv} d={d} {dtype}: {err:.2e}"


def test_same_shapes_fp16_then_bf16_use_their_own_kernels():
    # the cached launcher must not reuse a kernel compiled for another dtype
    tree = paper_tree(1)
    gen = torch.Generator().manual_seed(7)
    plan = ft.plan(tree, num_q_heads=8, num_kv_heads=2, head_dim=128)
    for dtype in (torch.float16, torch.bfloat16, torch.float16):
        q, k, v = make_inputs(tree, 8, 2, 128, dtype, "cuda", gen)
        for _ in range(2):  # the second call takes the cached path
            out = torch.full_like(q, float("nan"))
            ft.tree_attention(q, k, v, plan, out=out)
            torch.cuda.synchronize()
            err = _max_rel_error(out, q, k, v, tree, np.arange(tree.n_queries))
            assert err <= TOL[dtype], f"{dtype}: {err:.2e}"


@pytest.mark.gpu_timing
def test_graph_timing_captures_fewer_calls_when_one_call_is_slow():
    from fasttree.toolkit.timing import graph_time_us

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def slow():  # about 0.2-0.5 ms on an H100-class GPU
        return x @ x

    one = graph_time_us(slow, calls=4, replays=5)["median"] / 1e3  # ms per call
    capped = graph_time_us(slow, calls=50, replays=5, max_graph_ms=3 * one)
    assert 1 <= capped["calls_per_graph"] <= 4, capped
    assert graph_time_us(slow, calls=50, replays=5, max_graph_ms=one / 10)["calls_per_graph"] == 1
    assert abs(capped["median"] / 1e3 - one) < 0.3 * one, "fewer calls per graph must not change the time per call"


@pytest.mark.gpu_timing
def test_eager_loop_timing_matches_the_graph_for_a_gpu_bound_call():
    """A call whose GPU time dwarfs its launch: back-to-back eager calls time as the graph does,
    and a call that waits on the host (a sync) shows its gap."""
    from fasttree.toolkit.timing import eager_loop_time_us, graph_time_us

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def slow():
        return x @ x

    tries = []
    for _ in range(3):  # gpu_timing keeps other workers' GPU tests out; one quiet try of three is enough
        graph = graph_time_us(slow, calls=10, replays=5)["median"]
        loop = eager_loop_time_us(slow, calls=10, replays=5)
        assert loop["p20"] <= loop["median"] <= loop["p80"]
        tries.append((loop["median"], graph))
        if abs(loop["median"] - graph) < 0.1 * graph:
            break
    else:
        raise AssertionError(f"eager loop vs graph median (us), every try more than 10% apart: {tries}")

    small = x[:64, :64].contiguous()

    def quick():
        return small @ small

    def synced():
        y = small @ small
        torch.cuda.synchronize()  # the GPU idles while the host returns and launches again
        return y

    quick_us = eager_loop_time_us(quick, calls=10, replays=5)["median"]
    assert eager_loop_time_us(synced, calls=10, replays=5)["median"] > quick_us


@pytest.mark.gpu_timing
def test_cold_graph_timing_matches_the_eager_call_at_the_same_cache_state():
    """One replay at a time with L2 cleared (graph cold) times a GPU-bound call as do_bench times
    it eagerly, and a call whose data fits in L2 no faster than 20 warm replays in one graph."""
    from fasttree.toolkit.timing import eager_time_us, graph_cold_time_us, graph_time_us

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    tries = []
    for _ in range(3):  # gpu_timing keeps other workers' GPU tests out; one quiet try of three is enough
        cold = graph_cold_time_us(lambda: x @ x, rep_ms=30)
        eager = eager_time_us(lambda: x @ x, rep_ms=30)
        tries.append((cold, eager))
        if abs(cold - eager) < 0.1 * eager:
            break
    else:
        raise AssertionError(f"cold graph vs eager (us), every try more than 10% apart: {tries}")
    small = torch.randn(1 << 20, device="cuda")  # 4 MiB: in L2 across back-to-back replays
    warm = graph_time_us(lambda: small.mul(2.0))["median"]
    assert graph_cold_time_us(lambda: small.mul(2.0), rep_ms=30) >= 0.8 * warm


def test_direct_launch_path_is_correct_across_calls_layouts_and_graph_capture():
    from fasttree import attention

    tree = random_tree(np.random.default_rng(5), max_nodes=200, max_len=2000, roots=3)
    plan = ft.plan(tree, num_q_heads=32, num_kv_heads=8, head_dim=128)
    gen = torch.Generator().manual_seed(5)
    rows = _sample(tree.n_queries, np.random.default_rng(5))
    outs = []
    for call in range(3):  # the first call goes through Triton, later ones through the direct launchers
        q, k, v = make_inputs(tree, 32, 8, 128, torch.float16, "cuda", gen)
        out = torch.full_like(q, float("nan"))
        ft.tree_attention(q, k, v, plan, out=out)
        assert _max_rel_error(out, q, k, v, tree, rows) < TOL[torch.float16], call
        outs.append(out)
    assert any(isinstance(key, tuple) and key[0] == "direct" for key in plan._device_cache)
    wide_k = torch.randn(k.shape[0], 16, 128, device="cuda", dtype=torch.float16)[:, 3:11]
    wide_k.copy_(k)
    out = torch.full_like(q, float("nan"))
    ft.tree_attention(q, wide_k, v, plan, out=out)  # another stride: its own entry
    assert _max_rel_error(out, q, k, v, tree, rows) < TOL[torch.float16]
    # capture after the direct path is cached, then replay on new data in the same buffers
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        ft.tree_attention(q, k, v, plan, out=out)
    for t in (q, k, v):  # new data in the captured buffers (make_inputs would size a new pool)
        t.normal_()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _max_rel_error(out, q, k, v, tree, rows) < TOL[torch.float16]
    assert attention._fast_path(plan, plan.to(q.device), q, k, v, out) is not None


def test_two_class_plans_run_their_stage1_launches_side_by_side_and_stay_correct():
    """A two-class plan (9/gqa4) forks its first stage-1 launch onto a side stream, under graph
    capture and in eager calls: every call (through Triton, through the direct launchers, on
    another stream, replayed from a CUDA graph with new data) matches the reference, and the
    direct entry records the fork."""
    tree = paper_tree(9)
    hq, hkv = PAPER_HEADS["gqa4"]
    plan = ft.plan(tree, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    assert all(u > 0 for u in plan.units_per_class()), "needs both tile classes"
    gen = torch.Generator().manual_seed(9)
    q, k, v = make_inputs(tree, hq, hkv, 128, torch.float16, "cuda", gen)
    rows = _sample(tree.n_queries, np.random.default_rng(9))
    out = torch.empty_like(q)
    for call in range(3):
        for t in (q, k, v):
            t.normal_()
        out.fill_(float("nan"))
        ft.tree_attention(q, k, v, plan, out=out)
        assert _max_rel_error(out, q, k, v, tree, rows) < TOL[torch.float16], call
    entries = [e for key, e in plan._device_cache.items() if isinstance(key, tuple) and key[0] == "direct"]
    assert len(entries) == 1 and entries[0][0] is True, "the direct entry forks"
    other = torch.cuda.Stream()
    other.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(other):
        out.fill_(float("nan"))
        ft.tree_attention(q, k, v, plan, out=out)
    torch.cuda.current_stream().wait_stream(other)
    assert _max_rel_error(out, q, k, v, tree, rows) < TOL[torch.float16], "on another stream"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ft.tree_attention(q, k, v, plan, out=out)
    for _ in range(2):
        for t in (q, k, v):
            t.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _max_rel_error(out, q, k, v, tree, rows) < TOL[torch.float16], "graph replay"


def test_validate_measures_export_and_defaults_on_the_gpu(tmp_path):
    from fasttree.export import ConfigExport, ExportEntry, ExportGuard
    from fasttree.toolkit.shipped import workloads_path
    from fasttree.toolkit.validate import summarise, validate_portfolios, workload_steps
    from fasttree.traces import TraceWriter, read_traces

    records = read_traces(workloads_path("heldout") / "few_shot_mistral_7b.jsonl.gz", kind="workload")
    (steps,) = workload_steps(records.records, 2).values()
    gpu = torch.cuda.get_device_name()
    tuned = ft.FastTreeConfig(num_warps=(4, 2))
    portfolio = ft.Portfolio((ft.FastTreeConfig(), tuned), ft.Selector(member=(1,)))  # member 1 for every tree
    entry = ExportEntry(gpu=gpu, group_size=4, head_dim=128, dtype="float16", portfolio=portfolio, provenance={},
                        target="tree_attention", guard=ExportGuard.current())  # fmt: skip
    export = ConfigExport(entries=(entry,), provenance={})
    with TraceWriter(tmp_path / "v.jsonl") as w:
        results = validate_portfolios(export, steps, gpu_name=gpu, writer=w)
    # per tree: both members for tree_attention, the defaults alone for the runtime (no runtime entry)
    assert [(v.target, v.picked, len(v.member_us)) for v in results] == [
        ("tree_attention", 1, 2), ("runtime", 0, 1)
    ] * 2  # fmt: skip
    assert all(us > 0 for v in results for us in v.member_us)
    assert all(v.speedup == 1.0 for v in results if v.target == "runtime")
    lines = read_traces(tmp_path / "v.jsonl", kind="measurement").records
    assert len(lines) == 6 and all(r["status"] == "ok" for r in lines)
    assert [(r["meta"]["target"], r["meta"]["member"]) for r in lines] == [
        ("tree_attention", 0), ("tree_attention", 1), ("runtime", 0)
    ] * 2  # fmt: skip
    assert [r["meta"]["picked"] for r in lines] == [1, 1, 0] * 2
    assert lines[0]["correct"] is True  # the first tree of the family is checked against the reference
    assert lines[1]["config"]["num_warps"] == [4, 2] and "launch" in lines[2]  # the tuned member; the runtime
    assert lines[2]["launch"]["kind"] == "runtime_variants" and lines[2]["correct"] is True  # as servers run it
    s = summarise(results)
    assert set(s["targets"]) == {"tree_attention", "runtime"} and s["targets"]["tree_attention"]["cases"] == 2


def test_non_blocking_upload_does_not_wait_for_the_stream():
    """A non-blocking upload returns while earlier work still runs on the stream (no host sync), and
    the kernels launched after it on that stream read the uploaded plan."""
    rng = np.random.default_rng(9)
    gen = torch.Generator().manual_seed(9)
    tree = random_tree(rng, max_nodes=40, max_len=300)
    plan = ft.plan(tree, num_q_heads=32, num_kv_heads=8, head_dim=128)
    q, k, v = make_inputs(tree, 32, 8, 128, torch.float16, "cuda", gen)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of the copy
    dev = plan.to("cuda", non_blocking=True)
    pending = not torch.cuda.current_stream().query()
    out = torch.full_like(q, float("nan"))
    ft.tree_attention(q, k, v, dev, out=out)
    torch.cuda.synchronize()
    assert pending, "the upload waited for the stream's earlier work"
    rows = np.arange(tree.n_queries)
    assert _max_rel_error(out, q, k, v, tree, rows) <= TOL[torch.float16]


@pytest.mark.gpu_timing
def test_interleaved_graph_timing_orders_calls_by_their_work():
    """Interleaved replays time each call as its own graph does: a call of twice the work takes
    about twice as long, and a call timed beside others keeps its own time."""
    from fasttree.toolkit.timing import graph_time_us, interleaved_graph_times_us

    x = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)

    def one():
        return x @ x

    def two():
        x @ x
        return x @ x

    times = interleaved_graph_times_us({"one": one, "two": two}, calls=5, rounds=4, replays=3)
    assert set(times) == {"one", "two"} and times["one"]["replays"] == 12
    assert 1.6 < times["two"]["median"] / times["one"]["median"] < 2.4, times
    alone = graph_time_us(one, calls=5, replays=10)["median"]
    assert abs(times["one"]["median"] - alone) < 0.25 * alone, (times, alone)


def test_interleaved_graph_timing_rotates_which_call_runs_first(monkeypatch):
    """Every call leads some round and follows every other one (none always runs after the same
    heavy call), with at least as many rounds as calls even when the time budget allows fewer."""
    from fasttree.toolkit import timing

    x = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    fns = {name: (lambda: x @ x) for name in ("a", "b", "c")}
    graph_of = {}
    ran = []
    real = timing._per_call_us

    def recording(run, replays, calls):
        ran.append(run.__self__)
        return real(run, replays, calls)

    monkeypatch.setattr(timing, "_per_call_us", recording)
    captured = timing._captured

    def naming(fn, calls):
        graph = captured(fn, calls)
        graph_of[graph] = next(name for name, f in fns.items() if f is fn)
        return graph

    monkeypatch.setattr(timing, "_captured", naming)
    timing.interleaved_graph_times_us(fns, calls=2, rounds=10, replays=2, budget_s=0.0)
    names = [graph_of[g] for g in ran]
    rounds = [names[i : i + 3] for i in range(0, len(names), 3)]
    assert len(rounds) >= 3 and all(sorted(r) == ["a", "b", "c"] for r in rounds), names
    assert {r[0] for r in rounds} == {"a", "b", "c"}, names
    follows = {(r[i], r[i + 1]) for r in rounds for i in range(2)}
    assert {("a", "b"), ("b", "c"), ("c", "a")} <= follows, names
    # min_rounds lowers the floor of one round per call (instances of a few variants)
    ran.clear()
    timing.interleaved_graph_times_us(fns, calls=2, rounds=10, replays=2, budget_s=0.0, min_rounds=2)
    assert len(ran) == 2 * 3, [graph_of[g] for g in ran]
