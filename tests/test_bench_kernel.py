"""The kernel benchmark's host side on the CPU (:mod:`fasttree.toolkit.kernel_bench`, run as
``python -m bench.kernel`` or ``fasttree-tune bench``): argument parsing (the tuned export), the
anchors it ships, the summary and the ``tuned`` variant's per-tree member."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from fasttree import ExportEntry, ExportGuard, FastTreeConfig, PlanRules, Portfolio, Selector
from fasttree.export import ConfigExport
from fasttree.portfolio import TREE_FEATURES
from fasttree.toolkit import kernel_bench as kernel
from fasttree.toolkit.suite import paper_tree
from fasttree.versions import KERNEL_VERSION


def _row(case, published, ours, tuned=None, runtime=None, floor=30.0):
    variants = {"fasttree": {"graph_us": ours, "eager_us": ours + 5, "correct": True}}
    row = {"case": case, "heads": "mha", "floor_us": floor, "published_graph_us": published, "variants": variants,
           "floor_over_ours": floor / ours, "speedup_vs_published": published / ours}  # fmt: skip
    for name, t in (("tuned", tuned), ("runtime", runtime)):
        if t is not None:
            variants[name] = {"graph_us": t, "correct": True}
            row[f"speedup_vs_published_{name}"] = published / t
    return row


def test_parse_args_reads_the_export_or_drops_the_tuned_variant():
    args = kernel.parse_args(["--cases", "1,3", "--heads", "mha"])
    assert isinstance(args.export, ConfigExport)
    assert args.export_path == "docs/tune/export.json"
    assert "tuned" in args.variants and "runtime" in args.variants
    args = kernel.parse_args(["--export", "none"])
    assert args.export is None and args.export_path is None and "tuned" not in args.variants


def test_bench_kernel_is_the_packaged_benchmark():
    from bench import kernel as entry

    assert entry.main is kernel.main


def test_outside_a_checkout_the_tuned_variant_is_skipped(tmp_path, monkeypatch):
    """No docs/tune/export.json in the working folder (an installed package): no error, no tuned variant;
    an explicit --export still must exist."""
    monkeypatch.chdir(tmp_path)
    args = kernel.parse_args([])
    assert args.export is None and args.export_path is None and args.export_missing
    assert "tuned" not in args.variants and "runtime" in args.variants
    with pytest.raises(SystemExit):
        kernel.parse_args(["--export", kernel.DEFAULT_EXPORT])


def test_the_anchors_are_package_data():
    from fasttree.toolkit.bench_common import ANCHORS_PATH, anchor_rows

    assert ANCHORS_PATH.is_file() and "fasttree" in ANCHORS_PATH.parts
    rows = anchor_rows()
    assert len(rows) == 45 and rows[(1, "mha")]["published_fasttree_graph_us"] > 0


def test_a_missing_or_bad_export_is_a_usage_error(tmp_path, capsys):
    """Not a traceback: the usage error names the file (as `fasttree-tune bench` run outside the checkout hit)."""
    bad = tmp_path / "export.json"
    bad.write_text("{ truncated")
    for path in (tmp_path / "missing.json", bad):
        with pytest.raises(SystemExit) as exc:
            kernel.parse_args(["--export", str(path)])
        assert exc.value.code == 2
        assert str(path) in capsys.readouterr().err


def test_summary_has_geomeans_of_the_tuned_and_runtime_variants():
    rows = [_row(1, 40.0, 20.0, tuned=10.0, runtime=40.0), _row(2, 90.0, 30.0, tuned=45.0)]
    s = kernel.summarize(rows)
    assert math.isclose(s["geomean_speedup_vs_published"], math.sqrt(2.0 * 3.0))
    assert math.isclose(s["geomean_speedup_vs_published_tuned"], math.sqrt(4.0 * 2.0))
    assert s["n_cases_runtime"] == 1 and math.isclose(s["geomean_speedup_vs_published_runtime"], 1.0)
    assert s["min_speedup_vs_published_tuned"] == 2.0


def test_summary_and_table_report_the_back_to_back_eager_gap():
    rows = [_row(1, 40.0, 20.0), _row(2, 90.0, 30.0)]
    rows[0]["variants"]["fasttree"]["eager_loop_us"] = 23.0
    rows[1]["variants"]["fasttree"]["eager_loop_us"] = 31.0
    s = kernel.summarize(rows)
    assert math.isclose(s["max_eager_minus_graph_us"], 5.0)
    assert math.isclose(s["max_eager_loop_minus_graph_us"], 3.0)
    assert math.isclose(s["median_eager_loop_minus_graph_us"], 2.0)
    env = {
        "gpu_name": "GPU",
        "gpu_sm_count": 1,
        "torch": "t",
        "triton": "t",
        "git_commit": "abc",
        "timestamp_utc": "now",
    }
    assert "max_eager_minus_graph_cold_us" not in s, "no cold graph time measured"
    table = kernel.markdown(rows, s, env, "label")
    assert "| eager | graph cold | eager loop |" in table and "| 25.0 | - | 23.0 |" in table
    assert "max_eager_loop_minus_graph_us: 3.0" in table
    # the cold graph time (one replay at a time, L2 cleared, as eager is timed) gives its own gap
    rows[0]["variants"]["fasttree"]["graph_cold_us"] = 21.0
    rows[1]["variants"]["fasttree"]["graph_cold_us"] = 34.0
    s = kernel.summarize(rows)
    assert math.isclose(s["max_eager_minus_graph_cold_us"], 4.0)
    assert math.isclose(s["median_eager_minus_graph_cold_us"], 2.5)
    assert "| 25.0 | 21.0 | 23.0 |" in kernel.markdown(rows, s, env, "label")
    # rows without the loop time (older results) leave it out of the summary
    del rows[0]["variants"]["fasttree"]["eager_loop_us"], rows[1]["variants"]["fasttree"]["eager_loop_us"]
    assert "max_eager_loop_minus_graph_us" not in kernel.summarize(rows)


def _split_export(gpu: str, tuned) -> ConfigExport:
    """An export whose g4/d128/fp16 entry keeps the defaults for trees of at most 64 queries."""
    q = TREE_FEATURES.index("log2_queries")
    selector = Selector(feature=(q, -1, -1), threshold=(6.0, 0.0, 0.0), left=(1, -1, -1), right=(2, -1, -1),
                        member=(0, 0, 1))  # fmt: skip
    entry = ExportEntry(
        gpu=gpu, group_size=4, head_dim=128, dtype="float16",
        portfolio=Portfolio(members=(FastTreeConfig(), tuned), selector=selector), provenance={},
        guard=ExportGuard.current(),
    )  # fmt: skip
    return ConfigExport(entries=(entry,), provenance={})


def test_the_tuned_variant_plans_each_case_with_the_selected_member():
    tuned = FastTreeConfig(kv_split_sizes=(512, 64), pack_tokens=0)
    export = _split_export("NVIDIA H200", tuned)
    shape = {"gpu": "NVIDIA H200", "hq": 32, "hkv": 8, "d": 128, "dtype": torch.float16}
    assert paper_tree(1).n_queries == 64 and paper_tree(2).n_queries == 256
    assert kernel.tuned_config(export, paper_tree(1), **shape) == (FastTreeConfig(), 0)
    assert kernel.tuned_config(export, paper_tree(2), **shape) == (tuned, 1)
    # no entry for the shape or the GPU, or no export: the variant is skipped
    assert kernel.tuned_config(export, paper_tree(2), **{**shape, "hkv": 32}) is None
    assert kernel.tuned_config(export, paper_tree(2), **{**shape, "gpu": "NVIDIA H100"}) is None
    assert kernel.tuned_config(None, paper_tree(2), **shape) is None


def test_the_tuned_variant_skips_an_entry_of_other_kernels():
    entry = _split_export("NVIDIA H200", FastTreeConfig(pack_tokens=0)).entries[0]
    stale = dataclasses.replace(entry, guard=dataclasses.replace(entry.guard, kernel_version=KERNEL_VERSION - 1))
    export = ConfigExport(entries=(stale,), provenance={})
    shape = {"gpu": "NVIDIA H200", "hq": 32, "hkv": 8, "d": 128, "dtype": torch.float16}
    assert kernel.tuned_config(export, paper_tree(2), **shape) is None


def test_the_tuned_variant_reads_the_committed_export():
    """The committed export serves its entries' picks while its guard names today's defaults and
    kernels, and falls back (no tuned variant) once either changed since it was confirmed."""
    from fasttree.versions import KERNEL_VERSION, defaults_fingerprint

    export = kernel.parse_args([]).export  # docs/tune/export.json
    (entry,) = [e for e in export.entries if e.bucket == (16, 128, "float16") and e.target == "tree_attention"]
    shape = {"gpu": entry.gpu, "hq": 32, "hkv": 2, "d": 128, "dtype": torch.float16}
    fingerprint = defaults_fingerprint()
    stale = entry.guard.defaults != fingerprint or entry.guard.kernel_version != KERNEL_VERSION
    assert (kernel.tuned_config(export, paper_tree(1), **shape) is None) == stale
    current = {"defaults": fingerprint, "kernel_version": KERNEL_VERSION}
    restamped = [dataclasses.replace(e, guard=dataclasses.replace(e.guard, **current)) for e in export.entries]
    today = dataclasses.replace(export, entries=tuple(restamped))
    for case in range(1, 16):  # the tree_attention entry's pick (the runtime entry has other members)
        tree = paper_tree(case)
        member = entry.portfolio.member_of(tree)
        assert kernel.tuned_config(today, tree, **shape) == (entry.portfolio.members[member], member)


def test_a_broken_cuda_context_stops_the_run_and_keeps_the_cases_done(monkeypatch, tmp_path, capsys):
    """A peer that breaks the CUDA context (an illegal access the probe missed) ends the run: the
    reports hold the cases before it, say where it stopped and which cases were not run, and the
    status is 3; any other error still propagates."""
    env = {"gpu_name": "GPU", "gpu_sm_count": 1, "torch": "t", "triton": "t", "git_commit": "abc",
           "timestamp_utc": "now"}  # fmt: skip
    monkeypatch.setattr(kernel.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel, "environment", lambda gpu: dict(env))
    monkeypatch.setattr(kernel, "anchor_rows", lambda: {})
    monkeypatch.setattr(kernel, "peer_status", lambda items, variants: {})
    monkeypatch.setattr(kernel, "plot", lambda rows, path: None)
    monkeypatch.setattr(kernel, "cuda_context_broken", lambda: True)
    calls = []

    def fake_case(case, heads, args, anchors):
        calls.append(case)
        if case == 2:
            raise kernel.CudaContextLostError("flashinfer_cascade broke the CUDA context (illegal memory access)")
        return _row(case, 40.0, 20.0)

    monkeypatch.setattr(kernel, "bench_case", fake_case)
    argv = ["--cases", "1-3", "--heads", "mha", "--variants", "fasttree", "--export", "none", "--out", str(tmp_path),
            "--label", "t"]  # fmt: skip
    assert kernel.main(argv) == 3
    assert calls == [1, 2]
    report = (tmp_path / "kernel_t.json").read_text()
    assert '"n_cases": 1' in report and "flashinfer_cascade broke the CUDA context" in report
    md = (tmp_path / "kernel_t.md").read_text()
    assert "**Incomplete run**: stopped at 2/mha" in md and "not run: 2/mha, 3/mha" in md

    def other_error(case, heads, args, anchors):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(kernel, "bench_case", other_error)
    monkeypatch.setattr(kernel, "cuda_context_broken", lambda: False)
    with pytest.raises(RuntimeError, match="a bug of ours"):
        kernel.main([*argv[:-1], "t2"])


def _fake_gpu(monkeypatch):
    env = {"gpu_name": "GPU", "gpu_sm_count": 1, "torch": "t", "triton": "t", "git_commit": "abc",
           "timestamp_utc": "now"}  # fmt: skip
    monkeypatch.setattr(kernel.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel, "environment", lambda gpu: dict(env))
    monkeypatch.setattr(kernel, "anchor_rows", lambda: {})
    monkeypatch.setattr(kernel, "plot", lambda rows, path: None)
    monkeypatch.setattr(kernel, "cuda_context_broken", lambda: True)


def test_a_peer_that_breaks_the_context_fails_its_case_and_the_run_goes_on_in_a_fresh_process(monkeypatch, tmp_path):
    """The peer's break is its failure on that case (passed to the fresh process as its status, so
    that process runs the case's other variants without it), the rest of the cases run there, and
    the report holds every case; a second break restarts again."""
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(kernel, "peer_status", lambda items, variants: {})
    calls, children = [], []

    def fake_case(case, heads, args, anchors):
        calls.append(case)
        raise kernel.CudaContextLostError("flashinfer_cascade broke the CUDA context (illegal access)",
                                          variant="flashinfer_cascade")  # fmt: skip

    def fake_child(argv, start, status):
        children.append((start, dict(status)))
        if len(children) == 1:  # the fresh process runs case 2 (without the peer) and breaks again on 3
            return {"rows": [_row(2, 40.0, 20.0)], "lost": [2, "flashinfer_decode", "decode broke it"],
                    "stopped": None}  # fmt: skip
        return {"rows": [_row(3, 40.0, 20.0), _row(4, 40.0, 20.0)], "lost": None, "stopped": None}

    monkeypatch.setattr(
        kernel, "bench_case", lambda c, h, a, an: _row(1, 40.0, 20.0) if c == 1 else fake_case(c, h, a, an)
    )
    monkeypatch.setattr(kernel, "_run_rest_in_child", fake_child)
    argv = ["--cases", "1-4", "--heads", "mha", "--variants", "fasttree,flashinfer_cascade", "--export", "none",
            "--out", str(tmp_path), "--label", "t"]  # fmt: skip
    assert kernel.main(argv) == 0
    assert calls == [2]
    assert [c[0] for c in children] == [1, 2]
    assert children[0][1] == {("2/mha", "flashinfer_cascade"): children[0][1][("2/mha", "flashinfer_cascade")]}
    assert children[0][1][("2/mha", "flashinfer_cascade")].startswith("error: broke the CUDA context")
    assert ("3/mha", "flashinfer_decode") in children[1][1] and ("2/mha", "flashinfer_cascade") in children[1][1]
    report = json.loads((tmp_path / "kernel_t.json").read_text())
    assert [r["case"] for r in report["rows"]] == [1, 2, 3, 4]
    assert report["summary"]["stopped"] is None
    assert report["summary"]["peer_context_losses"] == ["2/mha flashinfer_cascade", "3/mha flashinfer_decode"]


def test_the_fresh_process_runs_from_its_start_with_the_given_statuses(monkeypatch, tmp_path):
    """``--resume``: no probe, the cases from ``start`` with the statuses passed in, rows (and where it
    broke) to the state file, no reports."""
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(kernel, "peer_status", lambda items, variants: pytest.fail("the child must not probe"))
    seen = []

    def fake_case(case, heads, args, anchors):
        seen.append((case, dict(args.peer_status)))
        if case == 3:
            raise kernel.CudaContextLostError("broke", variant="flashinfer_decode")
        return _row(case, 40.0, 20.0)

    monkeypatch.setattr(kernel, "bench_case", fake_case)
    state = tmp_path / "resume.json"
    state.write_text(json.dumps({"start": 1, "peer_status": [["2/mha", "flashinfer_cascade", "error: x"]]}))
    argv = ["--cases", "1-4", "--heads", "mha", "--variants", "fasttree", "--export", "none", "--out",
            str(tmp_path / "out"), "--label", "t", "--resume", str(state)]  # fmt: skip
    assert kernel.main(argv) == 0
    assert [c for c, _ in seen] == [2, 3]
    assert seen[0][1] == {("2/mha", "flashinfer_cascade"): "error: x"}
    result = json.loads(state.read_text())
    assert [r["case"] for r in result["rows"]] == [2]
    assert result["lost"] == [1 + 1, "flashinfer_decode", "broke"] and result["stopped"] is None
    assert not (tmp_path / "out").exists()


def test_a_peer_error_that_leaves_the_context_usable_is_recorded_on_the_row(monkeypatch):
    class Boom:
        @staticmethod
        def make_runner(*a):
            raise RuntimeError("bad plan")

    import fasttree.toolkit.flashinfer_baseline as fib

    monkeypatch.setattr(fib, "import_flashinfer", lambda: (object(), None))
    monkeypatch.setattr(fib, "make_runner", Boom.make_runner)
    monkeypatch.setattr(kernel, "cuda_context_broken", lambda: False)
    assert kernel._peer_runner("flashinfer_decode", None, None, None, None, None).startswith("error: RuntimeError")
    monkeypatch.setattr(kernel, "cuda_context_broken", lambda: True)
    with pytest.raises(kernel.CudaContextLostError, match="flashinfer_decode broke the CUDA context"):
        kernel._peer_runner("flashinfer_decode", None, None, None, None, None)


def test_a_fresh_process_that_writes_no_rows_ends_the_run_with_its_status(tmp_path):
    """The real child command (here on a machine without a GPU it exits with 2 before any case): no
    rows, and the exit status as the reason."""
    argv = ["--cases", "1", "--heads", "mha", "--variants", "fasttree", "--export", "none", "--out", str(tmp_path),
            "--label", "t"]  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("on a GPU the child would run the case")
    result = kernel._run_rest_in_child(argv, 0, {("1/mha", "flashinfer_decode"): "error: x"})
    assert result == {"rows": [], "lost": None, "stopped": "the fresh process exited with 2, no rows"}
    assert not list(tmp_path.iterdir())


def test_a_candidate_is_the_defaults_with_the_named_fields_changed():
    cand, rules = kernel.parse_candidate("kv_tile=32,32; gamma=0.2")
    assert cand == FastTreeConfig().with_(kv_tile=(32, 32), gamma=0.2) and rules == PlanRules.defaults()
    assert kernel.parse_candidate("pack_tokens=512")[0].pack_tokens == 512
    cand, rules = kernel.parse_candidate("wide_head_kv_tile=16;wide_units=false")
    assert cand == FastTreeConfig() and rules == PlanRules.defaults().with_(wide_head_kv_tile=16, wide_units=False)
    assert kernel._candidate_dict(cand, rules)["rules"] == {"wide_head_kv_tile": 16, "wide_units": False}
    for bad in ("kv_tile=32", "no_such_field=1", "kv_tile=a,b", "kv_tile=64,64", " ; ", "kv_tile",
                "wide_head_kv_tile=48", "wide_head_kv_tile=32", "wide_units=1"):  # fmt: skip
        with pytest.raises(ValueError):
            kernel.parse_candidate(bad)


def test_the_candidate_variant_runs_only_with_a_candidate(capsys):
    argv = ["--export", "none", "--variants", "fasttree,query_separated", "--candidate", "kv_tile=32,32"]
    args = kernel.parse_args(argv)
    assert args.variants == ["fasttree", "query_separated", kernel.CANDIDATE]
    assert args.candidate[0].kv_tile == (32, 32)
    assert kernel.CANDIDATE not in kernel.parse_args(["--export", "none"]).variants
    for argv in (["--variants", "fasttree,candidate"], ["--candidate", "kv_tile=64,64"], ["--candidate", "bad=1"]):
        with pytest.raises(SystemExit):
            kernel.parse_args(["--export", "none", *argv])
    assert "candidate" in capsys.readouterr().err


def test_changed_only_keeps_the_trees_the_candidate_plans_or_launches_differently(capsys):
    from fasttree.launch_rules import GpuTarget
    from fasttree.toolkit.family_suite import heldout_cases, parse_shape

    target = GpuTarget(cuda=False, major=9, sms=132)
    cases = heldout_cases(30004, 4, (parse_shape("4x4/d256/fp16"),))
    cand = kernel.parse_candidate("all_large_without_large=true")
    # the first tree has no large group: planned all-small, the candidate moves it to the large tiles
    assert [kernel.candidate_changes(c, *cand, target) for c in cases] == [True, False, False, False]
    assert not kernel.candidate_changes(cases[0], FastTreeConfig(), PlanRules.defaults(), target)
    args = kernel.parse_args(["--export", "none", "--suite", "heldout", "--candidate", "gamma=0.2", "--changed-only"])
    assert args.changed_only
    for argv in (["--changed-only"], ["--suite", "paper", "--candidate", "gamma=0.2", "--changed-only"]):
        with pytest.raises(SystemExit):
            kernel.parse_args(["--export", "none", *argv])
    assert "--changed-only needs" in capsys.readouterr().err


def test_the_heldout_suite_draws_every_family_at_every_shape():
    args = kernel.parse_args(["--export", "none", "--suite", "heldout", "--seed", "123", "--trees", "56"])
    cases = args.heldout
    assert len(cases) == 56 and len({c.name for c in cases}) == 56
    assert {c.seed for c in cases} == set(range(123, 179))
    combos = {(c.family, c.heads, c.head_dim, c.dtype) for c in cases}
    assert len(combos) == 56, "7 families x 8 shapes, each once"
    again = kernel.parse_args(["--export", "none", "--suite", "heldout", "--seed", "123", "--trees", "56"])
    assert again.heldout == cases
    other = kernel.parse_args(["--export", "none", "--suite", "heldout", "--seed", "124", "--trees", "3"]).heldout
    assert [c.seed for c in other] == [124, 125, 126]
    one = kernel.parse_args(["--export", "none", "--suite", "heldout", "--trees", "4", "--shapes", "8x1/d256/bf16"])
    assert {(c.heads, c.head_dim, c.dtype) for c in one.heldout} == {((8, 1), 256, "bfloat16")}
    for bad in ("8x3/d256/bf16", "8x1/d512/bf16", "8x1/256/bf16", "8x1/d256/fp32", "8x1"):
        with pytest.raises(SystemExit):
            kernel.parse_args(["--export", "none", "--suite", "heldout", "--shapes", bad])
    with pytest.raises(SystemExit):
        kernel.parse_args(["--export", "none", "--suite", "heldout", "--trees", "0"])
    # --families narrows the draw to the named families, in turn, with the same seeds
    argv = ["--export", "none", "--suite", "heldout", "--seed", "123", "--trees", "6"]
    two = kernel.parse_args([*argv, "--families", "random_recursive,beam_search"]).heldout
    assert [c.family for c in two] == ["random_recursive", "beam_search"] * 3
    assert [c.seed for c in two] == list(range(123, 129))
    for bad in ("random", ",", "beam_search,nope"):
        with pytest.raises(SystemExit):
            kernel.parse_args([*argv, "--families", bad])
    # --family-params narrows the named families' size ranges; one a family refuses stops the parse
    from fasttree.toolkit.bench_cases import probe_item
    from fasttree.toolkit.family_suite import FamilyCase, family_tree

    narrow = [*argv, "--families", "no_sharing", "--family-params", '{"context_tokens": [1024, 2048]}']
    args = kernel.parse_args(narrow)
    for case in args.heldout:
        lengths = family_tree(case).lengths
        assert lengths.min() >= 1024 and lengths.max() <= 2048
    item = json.loads(json.dumps(probe_item(args, family=args.heldout[1])))  # as the probe child gets it
    rebuilt = FamilyCase(**{**item["family"], "heads": tuple(item["family"]["heads"])})
    np.testing.assert_array_equal(family_tree(rebuilt).slots, family_tree(args.heldout[1]).slots)
    for bad in ('{"context_tokens": [1024, 2048]}', "[1, 2]", "{nope"):
        with pytest.raises(SystemExit):
            kernel.parse_args([*argv, "--families", "random_recursive", "--family-params", bad])


def test_a_heldout_case_travels_to_the_probe_child_as_json():
    from fasttree.toolkit.bench_cases import probe_item
    from fasttree.toolkit.family_suite import FamilyCase, family_tree

    args = kernel.parse_args(["--export", "none", "--suite", "heldout", "--trees", "3"])
    item = json.loads(json.dumps(probe_item(args, family=args.heldout[2])))
    assert item["suite"] == "heldout"
    rebuilt = FamilyCase(**{**item["family"], "heads": tuple(item["family"]["heads"])})
    assert rebuilt == args.heldout[2]
    assert family_tree(rebuilt).num_tokens == family_tree(args.heldout[2]).num_tokens


def test_the_summary_reports_the_candidate_against_the_defaults_and_decode():
    rows = [_row(1, 40.0, 20.0), _row(2, 90.0, 30.0)]
    for row, cand, qs in zip(rows, (10.0, 40.0), (25.0, 30.0), strict=True):
        row["variants"][kernel.CANDIDATE] = {"graph_us": cand, "correct": True}
        row["variants"]["query_separated"] = {"graph_us": qs, "correct": True}
    s = kernel.summarize(rows)
    vs_defaults = s["candidate_vs_fasttree"]
    assert math.isclose(vs_defaults["geomean"], math.sqrt(2.0 * 0.75))
    assert vs_defaults["worst"] == 0.75 and vs_defaults["worst_case"] == "2/mha" and vs_defaults["below_0.97"] == 1
    assert math.isclose(s["candidate_vs_query_separated"]["worst"], 0.75)
    assert s["candidate_vs_query_separated"]["below_0.97"] == 1
    # where the candidate changes neither the plan nor a launch, its ratio is noise: reported apart
    rows[0]["variant_plans"] = {kernel.CANDIDATE: {"same_plan_as_fasttree": True, "same_launches_as_fasttree": False}}
    rows[1]["variant_plans"] = {kernel.CANDIDATE: {"same_plan_as_fasttree": True, "same_launches_as_fasttree": True}}
    s = kernel.summarize(rows)
    assert s["candidate_changed_cases"] == 1
    assert s["candidate_vs_fasttree_where_changed"]["n"] == 1
    assert math.isclose(s["candidate_vs_fasttree_where_changed"]["geomean"], 2.0)
    assert "candidate_changed_cases" not in kernel.summarize([_row(1, 40.0, 20.0)])


def test_a_heldout_report_records_what_regenerates_its_trees():
    """The report's ``heldout`` entry (seed, count, layouts, families in their order, parameters)
    draws the run's cases again through ``heldout_cases``."""
    from fasttree.toolkit.family_suite import heldout_cases, parse_shape

    shapes = ["--shapes", "16x1/d64/fp16,32x2/d128/bf16"]
    for narrowed in (["--families", "no_sharing,few_shot"],
                     ["--families", "no_sharing", "--family-params", '{"context_tokens": [100, 300]}']):  # fmt: skip
        args = kernel.parse_args(["--suite", "heldout", "--seed", "4100", "--trees", "7", *shapes, *narrowed])
        draw = json.loads(json.dumps(kernel._heldout_draw(args)))
        assert draw["families"] == narrowed[1].split(",") and draw["shapes"] == ["16x1/d64/fp16", "32x2/d128/bf16"]
        again = heldout_cases(
            draw["seed"],
            draw["trees"],
            tuple(parse_shape(x) for x in draw["shapes"]),
            tuple(draw["families"]),
            draw["family_params"] and kernel._family_params(json.dumps(draw["family_params"])),  # as the option
        )
        assert again == args.heldout and len(again) == 7
    assert kernel._heldout_draw(kernel.parse_args(["--suite", "heldout"]))["families"] is None


@pytest.mark.gpu
def test_a_heldout_run_times_the_candidate_on_the_gpu(tmp_path):
    """Two drawn trees at 8/1 D 256: the candidate is planned, checked against float64 and timed
    beside the defaults and decode, and the report records it."""
    argv = ["--suite", "heldout", "--trees", "2", "--seed", "77", "--shapes", "8x1/d256/bf16", "--export", "none",
            "--variants", "fasttree,query_separated", "--candidate", "kv_tile=32,32", "--out", str(tmp_path),
            "--label", "t"]  # fmt: skip
    assert kernel.main(argv) == 0
    report = json.loads((tmp_path / "kernel_t.json").read_text())
    assert report["candidate"]["config"]["kv_tile"] == [32, 32] and report["candidate"]["rules"] == {}
    assert report["heldout"] == {
        "seed": 77, "trees": 2, "shapes": ["8x1/d256/bf16"], "families": None, "family_params": None,
    }  # fmt: skip
    assert len(report["rows"]) == 2
    for row in report["rows"]:
        assert row["variants"][kernel.CANDIDATE]["correct"] and row["variants"][kernel.CANDIDATE]["graph_us"] > 0
        assert isinstance(row["variant_plans"][kernel.CANDIDATE]["same_launches_as_fasttree"], bool)
    assert report["summary"]["candidate_vs_fasttree"]["n"] == 2
    # --changed-only: of four trees, only the one the candidate changes is timed
    argv = ["--suite", "heldout", "--trees", "4", "--seed", "30004", "--shapes", "4x4/d256/fp16", "--export", "none",
            "--variants", "fasttree", "--candidate", "all_large_without_large=true", "--changed-only",
            "--out", str(tmp_path), "--label", "c"]  # fmt: skip
    assert kernel.main(argv) == 0
    report = json.loads((tmp_path / "kernel_c.json").read_text())
    assert report["changed_only"] and [row["case"] for row in report["rows"]] == ["beam_search#30004/4x4/d256/fp16"]
    assert report["summary"]["candidate_changed_cases"] == 1


def test_instances_report_their_spread_and_at_least_one_is_asked_for(capsys):
    rows = [_row(1, 40.0, 20.0, runtime=21.0), _row(2, 90.0, 30.0, runtime=30.0)]
    rows[0]["variants"]["fasttree"]["graph_instances_us"] = [20.0, 19.0, 21.0]
    rows[0]["variants"]["runtime"]["graph_instances_us"] = [21.0, 22.05, 21.5]
    rows[1]["variants"]["fasttree"]["graph_instances_us"] = [30.0, 30.3, 29.9]
    s = kernel.summarize(rows)
    spread = s["instance_spread"]
    assert spread["n"] == 3 and math.isclose(spread["worst"], 21.0 / 19.0) and spread["worst_case"] == "1/mha/fasttree"
    assert math.isclose(spread["median"], 1.05)
    env = {"gpu_name": "GPU", "gpu_sm_count": 1, "torch": "t", "triton": "t", "git_commit": "abc",
           "timestamp_utc": "now"}  # fmt: skip
    assert "as 3 independent instances" in kernel.markdown(rows, s, env, "label", instances=3)
    assert "independent instances" not in kernel.markdown(rows, s, env, "label")
    assert "instance_spread" not in kernel.summarize([_row(1, 40.0, 20.0)])
    assert kernel.parse_args(["--export", "none", "--instances", "3"]).instances == 3
    with pytest.raises(SystemExit):
        kernel.parse_args(["--export", "none", "--instances", "0"])
    assert "--instances must be at least 1" in capsys.readouterr().err


@pytest.mark.gpu
def test_instances_time_independent_allocations_of_each_of_our_variants(tmp_path):
    """With --instances 2, every one of our variants (the runtime included) is built, checked against
    float64 and timed twice on fresh allocations; its time is the median of the two."""
    argv = ["--suite", "heldout", "--trees", "1", "--seed", "77", "--shapes", "16x2/d128/fp16", "--export", "none",
            "--variants", "fasttree,query_separated,runtime", "--instances", "2", "--out", str(tmp_path),
            "--label", "i"]  # fmt: skip
    assert kernel.main(argv) == 0
    report = json.loads((tmp_path / "kernel_i.json").read_text())
    assert report["instances"] == 2
    for name in ("fasttree", "query_separated", "runtime"):
        v = report["rows"][0]["variants"][name]
        assert v["correct"] and len(v["graph_instances_us"]) == 2
        assert math.isclose(v["graph_us"], sum(v["graph_instances_us"]) / 2)
    assert report["summary"]["instance_spread"]["n"] == 3
