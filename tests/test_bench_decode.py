"""bench.decode with a tiny decoder: on the CPU the eager path of the GPU benchmark (no CUDA graphs),
on a GPU machine the same run with its CUDA graphs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench import decode

BACKENDS = ("fasttree", "fasttree_overlap", "fasttree_fresh", "query_separated", "query_separated_overlap", "sdpa")
SCENARIO = "multi_level_system_prompts"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU path needs TRITON_INTERPRET=1 (conftest)
ROW_KEYS = {
    "model", "scenario", "backend", "steps", "tokens", "tokens_per_s", "step_ms_mean", "step_ms_p50",
    "step_ms_p90", "plan_ms_mean", "plan_share", "noattn_step_ms_mean", "attention_share", "mode",
    "max_rel_err", "max_rel_err_layer0", "max_rel_err_last_layer", "max_rel_err_last_step", "correct",
    "speedup_vs_query_separated", "speedup_bound_vs_query_separated", "speedup_floor_bound_vs_query_separated",
    "device_idle_share", "noattn_device_idle_share",
}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run (2 layers, 1 warm-up and 2 timed steps, batches of <= 8) of the backends."""
    out = tmp_path_factory.mktemp("decode")
    argv = [
        "--device", DEVICE, "--models", "tiny", "--scenarios", SCENARIO, "--max-batch", "8",
        "--warmup", "1", "--steps", "2", "--backends", ",".join(BACKENDS), "--out", str(out), "--label", "tiny",
    ]  # fmt: skip
    args = decode.parse_args(argv)
    report, logits = decode.run_benchmark(args, keep_logits=True)
    return SimpleNamespace(args=args, out=out, report=report, logits=logits)


def test_backends_compute_the_same_decode(run):
    """Same model, pools and tokens: the attentions give close logits and the same next tokens."""
    steps = {b: run.logits[("tiny", SCENARIO, b)] for b in BACKENDS}
    assert all(len(s) == 2 for s in steps.values())
    compared = 0
    for i in range(2):
        ref_logits, ref_tokens = steps["query_separated"][i]
        assert torch.isfinite(ref_logits).all()
        top2 = ref_logits.topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05  # rows whose argmax no rounding can flip
        for b in ("fasttree", "fasttree_overlap", "query_separated_overlap", "sdpa"):
            logits, tokens = steps[b][i]
            assert logits.shape == ref_logits.shape
            torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=2e-2)
            assert torch.equal(tokens[clear], ref_tokens[clear])
            compared += int(clear.sum())
    assert compared > 0


def test_rows_are_well_formed(run):
    rows = run.report["rows"]
    assert [r["backend"] for r in rows] == list(BACKENDS)
    workload = run.report["workloads"][0]
    for r in rows:
        assert not ROW_KEYS - r.keys(), ROW_KEYS - r.keys()
        assert (r["model"], r["scenario"], r["steps"]) == ("tiny", SCENARIO, 2)
        graphs = (
            "full_graph" if r["backend"] in ("fasttree", "fasttree_overlap", "fasttree_fresh") else "piecewise_graphs"
        )
        assert r["mode"] == (graphs if DEVICE == "cuda" else "eager")
        assert r["tokens"] == round(workload["queries_mean"] * 2)
        assert r["tokens_per_s"] > 0 and r["step_ms_p50"] > 0 and r["step_ms_p90"] >= r["step_ms_p50"]
        assert 0 <= r["plan_share"] < 1 and r["attention_share"] < 1
        if DEVICE == "cuda":  # the device's time of a step lies inside the step's wall time
            assert 0 < r["device_idle_share"] < 1 and 0 < r["noattn_device_idle_share"] < 1
        else:
            assert r["device_idle_share"] is None and r["noattn_device_idle_share"] is None
        assert r["correct"] and r["max_rel_err"] <= 2e-3
    assert rows[BACKENDS.index("query_separated")]["speedup_vs_query_separated"] == 1.0
    # compile pass (every step), warm-up, correctness check, timed steps
    info = [r["backend_info"] for r in rows[:3]]
    assert info[0]["plans"] == info[1]["plans"] == info[2]["plans"] == 3 + 1 + 1 + 2
    assert info[2]["extended_plans"] == 0 and info[2]["extend_steps"] == 0 and info[0]["extend_steps"] == 8
    # the plan's host time, fresh and extended apart (the fresh backend never extends)
    assert info[2]["plan_ms_median_extended"] is None and info[2]["plan_ms_median_fresh"] > 0
    assert info[0]["plan_ms_median_fresh"] > 0 and (info[0]["plan_ms_median_extended"] is None) == (
        info[0]["extended_plans"] == 0
    )
    assert run.report["all_correct"] and run.report["graphs"] is (DEVICE == "cuda")


def test_report_files(run):
    js = json.loads((run.out / "tiny.json").read_text())
    assert {"label", "env", "args", "models", "workloads", "rows", "all_correct"} <= js.keys()
    assert js["args"]["backends"] == list(BACKENDS) and js["args"]["max_batch"] == 8
    assert js["models"][0]["layers"] == 2 and js["models"][0]["hidden"] == 64
    assert js["workloads"][0]["max_rows"] == 8
    assert js["rows"] == json.loads(json.dumps(run.report["rows"]))
    md = (run.out / "tiny.md").read_text()
    assert "| model | scenario | backend | tokens/s |" in md
    ref = js["env"]["host_plan_reference_ms"]  # the host's planning speed, beside the plan shares
    assert 0 < ref < 1e3 and f"in {ref:.3f} ms (warm median)" in md
    for b in BACKENDS:
        assert f"| tiny | {SCENARIO} | {b} |" in md


def test_bound_is_the_attention_free_ratio(run):
    """The bound: each row's tokens over its attention-free step times, against the baseline's tokens/s;
    interpreted attention costs far more than its copy, so those rows' bounds exceed their ratios."""
    rows = run.report["rows"]
    base = rows[BACKENDS.index("query_separated")]
    floor_s = decode.attention_floor_s(run.report, "tiny", SCENARIO)
    work = run.report["workloads"][0]
    spec = decode.MODELS["tiny"]
    # 2 layers, each reading every entry of the mean tree once: K and V, fp16, at 4.8 TB/s
    assert floor_s == pytest.approx(2 * work["tree_tokens_mean"] * spec.num_kv_heads * spec.head_dim * 2 * 2 / 4.8e12)
    for r in rows:
        noattn_s = r["noattn_step_ms_mean"] * r["steps"] / 1e3
        bound = r["tokens"] / noattn_s / base["tokens_per_s"]
        assert r["speedup_bound_vs_query_separated"] == pytest.approx(bound)
        if r["backend"] != "sdpa":  # torch's CPU attention is ~5% of its step: within the timing noise
            assert r["speedup_bound_vs_query_separated"] > r["speedup_vs_query_separated"]
        floored = r["tokens"] / (noattn_s + r["steps"] * floor_s) / base["tokens_per_s"]
        assert r["speedup_floor_bound_vs_query_separated"] == pytest.approx(floored)
        assert r["speedup_floor_bound_vs_query_separated"] < bound


def test_render_rewrites_the_table_from_the_rows(run, tmp_path):
    """--render: the markdown of an earlier report, with ratios recomputed from its rows (here a
    report written before the bound existed, its rows edited to known times)."""
    report = json.loads((run.out / "tiny.json").read_text())
    for r in report["rows"]:
        for key in ("speedup_vs_query_separated", "speedup_bound_vs_query_separated"):
            r.pop(key, None)
        r.pop("speedup_floor_bound_vs_query_separated", None)
        # 100 tokens in 2 steps: query_separated 2 s (50 tokens/s), the others 1 s, attention-free 0.5 s
        fast = r["backend"] != "query_separated"
        r.update(tokens=100, steps=2, tokens_per_s=100.0 if fast else 50.0, noattn_step_ms_mean=250.0)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(report))
    assert decode.main(["--render", str(path)]) == 0
    md = (tmp_path / "old.md").read_text()
    floored = 100 / (0.5 + 2 * decode.attention_floor_s(report, "tiny", SCENARIO)) / 50
    assert "| vs query_separated | bound | floor bound | p50 step ms | plan+upload | GPU idle |" in md
    assert f"| tiny | {SCENARIO} | fasttree | 100 | 2.00 | 4.00 | {floored:.2f} |" in md
    assert f"| tiny | {SCENARIO} | query_separated | 50 | 1.00 | 4.00 | {floored:.2f} |" in md
    assert json.loads(path.read_text()) == report  # the results themselves are left as they were
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert decode.main(["--render", str(tmp_path / "bad.json")]) == 2
    assert decode.main(["--render", str(tmp_path / "missing.json")]) == 2


def test_device_idle_share_is_the_wall_time_outside_the_steps_device_time():
    times = {"step_s": np.array([0.010, 0.012]), "device_s": np.array([0.009, 0.0105])}
    assert decode.device_idle_share(times) == pytest.approx(1 - 0.0195 / 0.022)
    assert decode.device_idle_share({**times, "device_s": None}) is None
    row = decode.summarize_times(
        {**times, "plan_s": np.array([0.001, 0.001]), "queries": np.array([4, 4])},
        {"step_s": np.array([0.008, 0.008]), "device_s": np.array([0.0079, 0.0079])},
    )  # fmt: skip
    assert row["device_idle_share"] == pytest.approx(1 - 0.0195 / 0.022)
    assert row["noattn_device_idle_share"] == pytest.approx(1 - 0.0158 / 0.016)
    assert "| 1.0% |" in decode.results_table([{
        "model": "m", "scenario": "s", "backend": "fasttree", **row, "max_rel_err": 1e-4, "correct": True,
        "device_idle_share": 0.01,
    }])  # fmt: skip


def test_workload_inputs():
    wl = decode.make_workload(SCENARIO, seed=0, warmup=1, steps=2, max_batch=8, vocab=100)
    assert len(wl.trees) == len(wl.inputs) == 3 and list(wl.timed) == [1, 2]
    assert wl.pool_slots == max(t.max_slot + 1 for t in wl.trees) and wl.pool_rows == wl.pool_slots + 1
    for tree, arr in zip(wl.trees, wl.inputs, strict=True):
        n = tree.n_queries
        indptr, slots = tree.query_slots()
        assert arr.shape == (3, wl.max_rows)
        assert np.array_equal(arr[1, :n], slots[indptr[1:] - 1])  # each query's last context slot
        assert (arr[1, n:] == wl.pool_slots).all()  # padding rows write the sink slot
        assert np.array_equal(arr[2, :n], np.diff(indptr) - 1)
        assert ((arr[0] >= 0) & (arr[0] < 100)).all()


def test_sdpa_skipped_over_budget(tmp_path):
    args = decode.parse_args(
        ["--device", "cpu", "--models", "tiny", "--scenarios", SCENARIO, "--max-batch", "8", "--warmup", "1",
         "--steps", "1", "--backends", "sdpa", "--sdpa-max-gib", "0", "--out", str(tmp_path)]
    )  # fmt: skip
    model = decode.build_model(decode.MODELS["tiny"], layers=1, dtype=torch.float16, device=torch.device("cpu"), seed=0)
    summary, rows = decode.bench_scenario(model, "tiny", SCENARIO, args, graphs=False)
    assert summary["sdpa_padded_kv_gib"] > 0
    assert rows == [{"model": "tiny", "scenario": SCENARIO, "backend": "sdpa", "skipped": rows[0]["skipped"]}]
    assert "--sdpa-max-gib" in rows[0]["skipped"]
    assert "skipped" in decode.results_table(rows)


def test_the_flashinfer_backend_is_opt_in_and_skipped_with_its_reason(tmp_path):
    """Accepted by --backends, not in the default; where it cannot run (here: the CPU, or no
    flashinfer) its row says why."""
    assert "flashinfer_decode" not in decode.parse_args([]).backends
    args = decode.parse_args(
        ["--device", "cpu", "--models", "tiny", "--scenarios", SCENARIO, "--max-batch", "8", "--warmup", "1",
         "--steps", "1", "--backends", "flashinfer_decode", "--out", str(tmp_path)]
    )  # fmt: skip
    assert args.backends == ["flashinfer_decode"]
    model = decode.build_model(decode.MODELS["tiny"], layers=1, dtype=torch.float16, device=torch.device("cpu"), seed=0)
    _, rows = decode.bench_scenario(model, "tiny", SCENARIO, args, graphs=False)
    assert rows == [
        {"model": "tiny", "scenario": SCENARIO, "backend": "flashinfer_decode", "skipped": rows[0]["skipped"]}
    ]
    assert "needs a CUDA device" in rows[0]["skipped"]
    assert "skipped" in decode.results_table(rows)


def test_bad_arguments():
    with pytest.raises(SystemExit):
        decode.parse_args(["--backends", "flash"])
    with pytest.raises(SystemExit):
        decode.parse_args(["--warmup", "0"])


def test_stable_slots_keep_every_node_at_its_slots():
    """--slots stable: the trees of the contiguous layout, with a node's old tokens at the same
    slots in every later step, no slot used twice in a step, and freed slots reused."""
    from fasttree.plan_extend import PlanExtender
    from fasttree.toolkit.workloads import iter_serving

    served = list(iter_serving("chain_reasoning", seed=0, steps=40))
    trees = decode.stable_slot_trees(served)
    where: dict[int, np.ndarray] = {}
    ext, extended = PlanExtender(), 0
    for s, t in zip(served, trees, strict=True):
        for attr in ("parents", "lengths", "query_nodes"):
            assert np.array_equal(getattr(t, attr), getattr(s.tree, attr))
        assert np.unique(t.slots).size == t.slots.size
        for i, nid in enumerate(s.node_ids.tolist()):
            mine = t.slots[t.slot_indptr[i] : t.slot_indptr[i + 1]]
            if nid in where:
                assert np.array_equal(mine[: where[nid].size], where[nid])
            where[nid] = mine
        plan = ext.extend(t)
        extended += plan is not None
        ext.remember(t, plan if plan is not None else decode.ft.plan(t, num_q_heads=4, num_kv_heads=4, head_dim=16))
    assert extended >= len(trees) // 2  # most decode steps only grow private nodes
    assert max(t.max_slot for t in trees) < sum(t.num_tokens for t in trees[-3:])  # freed slots are reused
    wl = decode.make_workload("chain_reasoning", seed=0, warmup=1, steps=4, max_batch=None, vocab=10)
    assert all(np.array_equal(a.slots, b.slots) for a, b in zip(wl.trees, trees, strict=False))
    with pytest.raises(ValueError, match="slots"):
        decode.make_workload("chain_reasoning", seed=0, warmup=1, steps=4, max_batch=None, vocab=10, slots="x")


def test_timed_trees_are_new_objects_without_the_planner_index():
    import fasttree.planner as planner
    from fasttree.toolkit.workloads import iter_serving

    tree = decode.stable_slot_trees(list(iter_serving("few_shot", seed=0, steps=2)))[1]
    first = decode.ft.plan(tree, num_q_heads=4, num_kv_heads=4, head_dim=16)
    assert getattr(tree, "_planner_index", None) is not None
    new = decode.as_new_tree(tree)
    assert new is not tree and getattr(new, "_planner_index", None) is None
    assert tree._planner_index is planner._tree_index(tree)  # the original keeps its index
    again = decode.ft.plan(new, num_q_heads=4, num_kv_heads=4, head_dim=16)
    for name in ("kv_indices", "unit_kv_start", "unit_kv_len", "pair_query", "pair_out_row"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
