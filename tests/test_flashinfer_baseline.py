"""FlashInfer as a peer in the kernel benchmark (:mod:`fasttree.toolkit.flashinfer_baseline`).

On the CPU: the page tables of FlashInfer's batch decode and multi-level cascade (page size 1)
against brute-force constructions on random trees and forests with internal-node queries, and
against the float64 reference through a NumPy model of FlashInfer's semantics (a level's segment
attends to its pages; levels merged by log-sum-exp); the crash-isolated probe's restarts with a
fake child; the benchmark's handling of the peers (argument parsing, skipped without FlashInfer,
summary and table). On a GPU with FlashInfer importable: both variants against the reference,
eagerly and from a CUDA graph.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap

import numpy as np
import pytest
import torch
from trees import random_tree

import fasttree as ft
from fasttree.toolkit import flashinfer_baseline as fib
from fasttree.toolkit import kernel_bench as kernel
from fasttree.toolkit.suite import PAPER_SUITE, paper_tree


def _path_nodes(tree: ft.KVTree, node: int) -> list[int]:
    """Root-first nodes of ``node``'s path, by walking the parent links."""
    path = []
    while node >= 0:
        path.append(int(node))
        node = int(tree.parents[node])
    return path[::-1]


def _slots(tree: ft.KVTree, nodes) -> np.ndarray:
    parts = [tree.node_slots(n) for n in nodes]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _trees(count: int = 60):
    rng = np.random.default_rng(45)
    for i in range(count):
        yield random_tree(rng, max_nodes=30, max_len=40, roots=None if i % 3 else 1)
    yield ft.KVTree.from_levels((1, 3, 9), (5, 4, 2))
    yield ft.KVTree.from_lengths([-1, 0, 0, 1], [3, 0, 2, 1], [3, 2, 1, 3])  # an empty node, internal queries
    yield ft.KVTree.from_lengths([-1, -1], [4, 2], [1, 0, 1])  # no sharing


def _rows(table: fib.PageTable, i: int) -> np.ndarray:
    return table.indices[table.indptr[i] : table.indptr[i + 1]]


def test_the_decode_page_table_is_each_querys_path_root_first():
    for tree in _trees():
        table = fib.decode_page_table(tree)
        assert table.indptr.dtype == table.indices.dtype == table.last_page_len.dtype == np.int32
        assert table.indptr.size == tree.n_queries + 1 and table.indptr[0] == 0
        assert np.all(table.last_page_len == 1)
        for j, node in enumerate(tree.query_nodes):
            assert np.array_equal(_rows(table, j), _slots(tree, _path_nodes(tree, node)))


def _expected_levels(tree: ft.KVTree) -> tuple[int, list[list[np.ndarray]]]:
    """Brute force: each query's non-empty path nodes; one level per depth down to the shallowest
    query's, the last level holding the rest of the path."""
    paths = [[n for n in _path_nodes(tree, node) if tree.lengths[n] > 0] for node in tree.query_nodes]
    n_levels = min(len(p) for p in paths)
    per_query = []
    for p in paths:
        per_query.append([_slots(tree, [p[lvl]]) for lvl in range(n_levels - 1)] + [_slots(tree, p[n_levels - 1 :])])
    return n_levels, per_query


def test_cascade_levels_match_a_brute_force_construction():
    for tree in _trees():
        levels = fib.cascade_levels(tree)
        n_levels, expected = _expected_levels(tree)
        assert levels.num_levels == n_levels
        assert sorted(levels.order.tolist()) == list(range(tree.n_queries))
        paths = [[n for n in _path_nodes(tree, node) if tree.lengths[n] > 0] for node in tree.query_nodes]
        for lvl in range(n_levels):
            qo, kv = levels.qo_indptr[lvl], levels.kv[lvl]
            assert qo.dtype == np.int32 and qo[0] == 0 and qo[-1] == tree.n_queries and np.all(np.diff(qo) > 0)
            assert kv.indptr.size == qo.size and np.all(kv.last_page_len == 1) and np.all(np.diff(kv.indptr) > 0)
            for s in range(qo.size - 1):
                for r in range(qo[s], qo[s + 1]):
                    assert np.array_equal(_rows(kv, s), expected[levels.order[r]][lvl])
            if lvl < n_levels - 1:  # a shared node is read once: one segment per distinct node at the depth
                assert qo.size - 1 == len({p[lvl] for p in paths})


def test_cascade_rows_keep_the_paper_suites_query_order():
    for case in PAPER_SUITE:
        tree = paper_tree(case)
        levels = fib.cascade_levels(tree)
        assert levels.identity_order
        assert levels.num_levels == int(tree.depth.max()) + 1
        assert levels.segments() == [lvl.size for lvl in tree.levels]


def _attend(q, k, v, slots, scale):
    """float64 attention of q [Hq, D] over k, v [pool, Hkv, D] at ``slots``: (out [Hq, D], lse [Hq])."""
    g = q.shape[0] // k.shape[1]
    kk = np.repeat(k[slots], g, axis=1)
    vv = np.repeat(v[slots], g, axis=1)
    s = np.einsum("hd,lhd->hl", q, kk) * scale
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    return np.einsum("hl,lhd->hd", p / p.sum(axis=1, keepdims=True), vv), (m[:, 0] + np.log(p.sum(axis=1)))


def _cascade_model(q, k, v, levels: fib.CascadeLevels) -> np.ndarray:
    """FlashInfer's cascade semantics in float64: every level's segments attend to their pages, the
    levels' states merged by log-sum-exp, rows mapped back to the queries' order."""
    nq, hq, d = q.shape
    scale = 1 / math.sqrt(d)
    out = np.zeros((nq, hq, d))
    lse = np.full((nq, hq), -np.inf)
    for qo, kv in zip(levels.qo_indptr, levels.kv, strict=True):
        for s in range(qo.size - 1):
            for r in range(qo[s], qo[s + 1]):
                j = levels.order[r]
                o, ls = _attend(q[j], k, v, _rows(kv, s), scale)
                m = np.maximum(lse[j], ls)
                wa, wb = np.exp(lse[j] - m), np.exp(ls - m)
                out[j] = (out[j] * wa[:, None] + o * wb[:, None]) / (wa + wb)[:, None]
                lse[j] = m + np.log(wa + wb)
    return out


def test_both_page_tables_give_the_reference_attention():
    rng = np.random.default_rng(7)
    for i, tree in enumerate(_trees(12)):
        hq, hkv, d = (4, 2, 8) if i % 2 else (2, 2, 16)
        q = torch.from_numpy(rng.standard_normal((tree.n_queries, hq, d)))
        k = torch.from_numpy(rng.standard_normal((tree.max_slot + 1, hkv, d)))
        v = torch.from_numpy(rng.standard_normal((tree.max_slot + 1, hkv, d)))
        ref = ft.reference_attention(q, k, v, tree)
        table = fib.decode_page_table(tree)
        decode = np.stack(
            [_attend(q[j].numpy(), k.numpy(), v.numpy(), _rows(table, j), 1 / math.sqrt(d))[0] for j in range(len(q))]
        )
        cascade = _cascade_model(q.numpy(), k.numpy(), v.numpy(), fib.cascade_levels(tree))
        for out in (decode, cascade):
            assert ft.max_relative_error(torch.from_numpy(out), ref) < 1e-12


def test_tensor_cores_follow_sglangs_rule():
    assert not fib.use_tensor_cores(32, 32) and not fib.use_tensor_cores(32, 16)
    assert fib.use_tensor_cores(32, 8) and fib.use_tensor_cores(16, 1) and fib.use_tensor_cores(28, 4)
    with pytest.raises(ValueError):
        fib.use_tensor_cores(30, 8)


def test_an_unknown_variant_is_a_value_error():
    with pytest.raises(ValueError, match="unknown FlashInfer variant"):
        fib.make_runner("flashinfer_prefill", None, None, None, paper_tree(1))


# ----------------------------------------------------------------------------- the probe
_FAKE_CHILD = textwrap.dedent(
    """
    import json, os, sys
    jobs = json.loads(sys.stdin.read())
    for j, job in enumerate(jobs):
        print(json.dumps({"event": "start", "job": j}), flush=True)
        key = job["item"]["key"]
        if key == "crash" and job["variant"] == "flashinfer_cascade":
            sys.stderr.write("an illegal memory access was encountered\\n")
            os._exit(1)
        error = "ValueError: bad plan" if key == "raise" and job["variant"] == "flashinfer_decode" else None
        print(json.dumps({"event": "done", "job": j, "error": error}), flush=True)
    """
)


def test_the_probe_records_a_crash_and_restarts_past_it(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(_FAKE_CHILD)
    items = [{"key": k} for k in ("ok", "crash", "raise", "after")]
    failures = fib.probe(items, fib.FLASHINFER_VARIANTS, command=[sys.executable, str(child)])
    assert set(failures) == {("crash", "flashinfer_cascade"), ("raise", "flashinfer_decode")}
    assert (
        "died" in failures[("crash", "flashinfer_cascade")]
        and "illegal memory access" in failures[("crash", "flashinfer_cascade")]
    )
    assert failures[("raise", "flashinfer_decode")] == "ValueError: bad plan"


def test_a_probe_child_that_cannot_start_fails_every_call(tmp_path):
    child = tmp_path / "child.py"
    child.write_text("import sys; sys.exit('no CUDA')")
    failures = fib.probe([{"key": "a"}, {"key": "b"}], ["flashinfer_decode"], command=[sys.executable, str(child)])
    assert set(failures) == {("a", "flashinfer_decode"), ("b", "flashinfer_decode")}
    assert all("probe process failed" in why for why in failures.values())


# ----------------------------------------------------------------------------- the benchmark's side
def test_parse_args_accepts_the_peers_and_leaves_them_out_by_default():
    args = kernel.parse_args(["--export", "none", "--variants", "fasttree,flashinfer_decode,flashinfer_cascade"])
    assert args.variants == ["fasttree", "flashinfer_decode", "flashinfer_cascade"]
    default = kernel.parse_args(["--export", "none"]).variants
    assert "fasttree" in default and not set(kernel.PEER_VARIANTS) & set(default)
    assert set(kernel.PEER_VARIANTS) == set(fib.FLASHINFER_VARIANTS) <= set(kernel.VARIANTS)
    with pytest.raises(SystemExit):
        kernel.parse_args(["--variants", "flashinfer"])


@pytest.fixture
def no_flashinfer(monkeypatch):
    """FlashInfer not importable, whatever this machine has."""
    monkeypatch.setattr(fib, "_IMPORTED", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    yield
    fib._IMPORTED = None


def test_without_flashinfer_the_peers_are_skipped_with_the_reason(no_flashinfer):
    args = kernel.parse_args(["--export", "none", "--cases", "1,2", "--heads", "mha"])
    items = [kernel.probe_item(args, case=c, heads="mha") for c in (1, 2)]
    status = kernel.peer_status(items, ["fasttree", *kernel.PEER_VARIANTS])
    assert set(status) == {(f"{c}/mha", n) for c in (1, 2) for n in kernel.PEER_VARIANTS}
    assert all(why.startswith("flashinfer cannot be imported") for why in status.values())
    assert kernel.peer_status(items, ["fasttree"]) == {}
    why = kernel._peer_runner("flashinfer_decode", None, None, None, paper_tree(1), None)
    assert isinstance(why, str) and "flashinfer cannot be imported" in why
    assert fib.flashinfer_version() is None


def test_probe_items_rebuild_the_cases_trees():
    from fasttree.toolkit.family_suite import FAMILY_CASES

    args = kernel.parse_args(["--export", "none"])
    item = kernel.probe_item(args, case=3, heads="gqa4")
    assert item["key"] == "3/gqa4" and json.loads(json.dumps(item)) == item
    fc = FAMILY_CASES[0]
    fam = kernel.probe_item(args, family=fc)
    assert fam["key"] == kernel.case_key(fc.name, f"{fc.heads[0]}/{fc.heads[1]}")


def _row(case, ours, decode, cascade, ours_eager=None):
    variants = {"fasttree": {"graph_us": ours, "eager_us": ours_eager or ours + 5, "correct": True}}
    for name, v in (("flashinfer_decode", decode), ("flashinfer_cascade", cascade)):
        if isinstance(v, (int, float)):
            variants[name] = {"graph_us": v, "eager_us": v + 10, "max_rel_err": 1e-4, "correct": True}
        elif v is not None:
            variants[name] = v
    return {"case": case, "heads": "mha", "floor_us": 10.0, "variants": variants, "floor_over_ours": 10.0 / ours}


def test_summary_and_table_compare_ours_with_each_peer():
    rows = [
        _row(1, 10.0, 40.0, 20.0),
        _row(2, 20.0, 10.0, {"error": "RuntimeError: CUDA error: an illegal memory access", "correct": False}),
        _row(3, 30.0, {"skipped": "flashinfer cannot be imported"}, {"graph_us": 60.0, "eager_us": 70.0,
             "max_rel_err": 0.5, "correct": False}),
    ]  # fmt: skip
    s = kernel.summarize(rows)
    assert s["all_correct"], "a peer's failure does not fail our run"
    dec, cas = s["fasttree_vs_flashinfer_decode"], s["fasttree_vs_flashinfer_cascade"]
    assert dec["graph_n"] == 2 and math.isclose(dec["graph_geomean"], math.sqrt(4.0 * 0.5))
    assert (
        dec["graph_worst"] == 0.5
        and dec["graph_worst_case"] == "2/mha"
        and dec["graph_ours_slower"] == ["2/mha (0.500)"]
    )
    assert dec["skipped"] == {"flashinfer cannot be imported": 1} and dec["failed"] == []
    assert cas["failed"] == ["2/mha: RuntimeError: CUDA error: an illegal memory access"]
    assert cas["wrong"] == ["3/mha: max_rel_err 5.00e-01"] and cas["graph_ours_slower"] == []
    assert any("vs flashinfer_decode" in loss for loss in s["losses_to_baselines"])
    env = {
        "gpu_name": "GPU",
        "gpu_sm_count": 1,
        "torch": "t",
        "triton": "t",
        "git_commit": "abc",
        "timestamp_utc": "now",
    }
    table = kernel.markdown(rows, s, env, "label")
    assert "| fasttree | flashinfer_decode | flashinfer_cascade |" in table
    assert (
        "| 10.0 | 40.0 | 20.0 |" in table and "| 20.0 | 10.0 | fail |" in table and "| 30.0 | skip | 60.0 x |" in table
    )


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_flashinfer_variants_match_the_reference(heads):
    """Both variants on two small trees (a three-level tree; a forest with internal-node queries
    and an empty node), eagerly and replayed from a CUDA graph, against the float64 reference."""
    fi, reason = fib.import_flashinfer()
    if fi is None:
        pytest.skip(reason)
    from fasttree.toolkit.timing import _captured

    hq, hkv = heads
    trees = [
        ft.KVTree.from_levels((1, 4, 16), (300, 40, 7)),
        random_tree(np.random.default_rng(3), max_nodes=40, max_len=200, roots=3),
    ]
    for tree in trees:
        q, k, v = kernel.case_inputs(tree, hq, hkv, 128, torch.float16, 5)
        ref = ft.reference_attention(q, k, v, tree)
        for name in fib.FLASHINFER_VARIANTS:
            runner = fib.make_runner(name, q, k, v, tree)
            eager = runner.call().clone()
            torch.cuda.synchronize()
            assert ft.max_relative_error(eager, ref) <= 2e-3, (name, tree)
            holder = {}
            graph = _captured(lambda r=runner, h=holder: h.__setitem__("out", r.call()), 1)
            holder["out"].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert ft.max_relative_error(holder["out"], ref) <= 2e-3, (name, tree, "graph")


def test_probe_items_of_the_crossover_suite_rebuild_its_trees():
    from fasttree.toolkit.bench_cases import probe_item
    from fasttree.toolkit.family_suite import CROSSOVER_CASES, family_tree

    args = kernel.parse_args(["--suite", "crossover", "--export", "none"])
    fc = CROSSOVER_CASES[-1]
    item = probe_item(args, family=fc)
    assert item["suite"] == "crossover" and item["name"] == fc.name
    tree = family_tree(fc)
    assert tree.n_queries > 0 and fc.family == "random_recursive"
