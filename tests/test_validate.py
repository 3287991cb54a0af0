"""``fasttree.toolkit.validate`` on the CPU: the measuring loop with a stand-in for the GPU measurement,
every portfolio member per tree and target, the summary by hand, and ``validate -o`` through
``confirm`` to the served portfolio."""

from __future__ import annotations

import json
import math

import pytest

from fasttree import FastTreeConfig, LeafRegion, Portfolio, Selector, load_portfolio, tree_features
from fasttree.cli import main
from fasttree.export import ConfigExport, ExportEntry, ExportGuard, read_export
from fasttree.portfolio import TREE_FEATURES
from fasttree.toolkit.design import point_launch
from fasttree.toolkit.measure import point_plan
from fasttree.toolkit.shipped import workloads_path
from fasttree.toolkit.validate import (
    CaseValidation,
    earlier_measurements,
    family_of_record,
    summarise,
    validate_portfolios,
    workload_steps,
)
from fasttree.traces import TraceWriter, decode_tree, measurement_record, read_traces
from fasttree.versions import KERNEL_VERSION

HELDOUT = workloads_path("heldout")
RECORDS = read_traces(HELDOUT / "few_shot_mistral_7b.jsonl.gz", kind="workload").records
FAMILIES = read_traces(HELDOUT / "families_mistral_7b.jsonl.gz", kind="workload").records
TUNED = FastTreeConfig(num_warps=(4, 2), kv_tile=(64, 32))
TUNED_RT = FastTreeConfig(alpha=0.4, pack_tokens=0)  # planning fields only: a runtime member
#: Graph-replay medians of the stand-in measurement, by config.
US = {FastTreeConfig(): 100.0, TUNED: 80.0, TUNED_RT: 90.0}
ENV = {"gpu_name": "NVIDIA H200", "gpu_sm_count": 132, "compute_capability": "9.0", "memory_clock_mhz": None,
       "driver": None, "torch": "x", "triton": "x", "fasttree": "0.1.0", "git_commit": None}  # fmt: skip
Q = TREE_FEATURES.index("log2_queries")


class FakeMeasure:
    """Stands in for ``measure_point``: plans the point as it would, returns a record timed by ``US``
    (``fail``: the configs whose measurement fails), and remembers every call."""

    def __init__(self, fail=()):
        self.calls = []
        self.fail = set(fail)

    def __call__(self, point, *, device, check, env, tree):
        self.calls.append({"point": point, "check": check, "tree": tree})
        us = US[point.config]
        status = "failed" if point.config in self.fail else "ok"
        timing = {"graph_us": {"median": us, "p20": us, "p80": us, "replays": 5, "calls_per_graph": 10},
                  "eager_us": {"median": us + 5}} if status == "ok" else None  # fmt: skip
        rec = measurement_record(
            env=ENV, family=point.family, seed=point.seed, tree=tree, num_q_heads=point.num_q_heads,
            num_kv_heads=point.num_kv_heads, head_dim=point.head_dim, dtype=point.dtype, config=point.config,
            plan=point_plan(point, tree), status=status, timing=timing, launch=point_launch(point),
            error="it broke" if status == "failed" else None, correct=True if check else None,
        )  # fmt: skip
        rec["meta"] = {"profiler": {"kernel_version": KERNEL_VERSION}}  # as measure_point records it
        return rec


def _steps(records, k: int) -> list[dict]:
    return [r for rs in workload_steps(records, k).values() for r in rs]


def _two(family: str) -> list[dict]:
    return [r for r in FAMILIES if r["workload"]["family"] == family][:2]


#: Two trees of the few-shot serving workload and two of each of two generator families (all GQA 4).
CASES = _steps(RECORDS, 2) + _two("few_shot") + _two("speculative")
#: Splits the cases' queries in two (both sides non-empty: checked in the test).
THRESHOLD = float(sorted(tree_features(decode_tree(r["workload"]["tree"]))[Q] for r in CASES)[len(CASES) // 2 - 1])


def export(gpu="NVIDIA H200") -> ConfigExport:
    """A tree_attention entry that picks TUNED for trees of more queries than THRESHOLD, and a runtime
    entry that picks TUNED_RT for every tree."""
    split = Selector(feature=(Q, -1, -1), threshold=(THRESHOLD, 0, 0), left=(1, -1, -1), right=(2, -1, -1),
                     member=(0, 0, 1))  # fmt: skip
    every = Selector(member=(1,))
    n = len(TREE_FEATURES)
    wide = LeafRegion((-1e6,) * n, (1e6,) * n, ((8, 4),), trees=20, evidence="predicted")  # 32/8 heads, any tree
    common = {"gpu": gpu, "group_size": 4, "head_dim": 128, "dtype": "float16", "provenance": {},
              "guard": ExportGuard.current()}  # fmt: skip
    return ConfigExport(
        entries=(
            ExportEntry(**common, portfolio=Portfolio((FastTreeConfig(), TUNED), split, regions=(None, None, wide)),
                        target="tree_attention"),
            ExportEntry(**common, portfolio=Portfolio((FastTreeConfig(), TUNED_RT), every, runtime=True,
                                                      regions=(wide,)),
                        target="runtime"),
        ),
        provenance={},
    )  # fmt: skip


def _case(r) -> str:
    w = r["workload"]
    return f"{w['family']}/{w['scenario']}/seed{w['seed']}/step{w['step']} {r['num_q_heads']}/{r['num_kv_heads']}"


def test_workload_steps_are_evenly_spaced():
    steps = workload_steps(RECORDS, 4)
    assert list(steps) == ["serving/few_shot/seed1 32/8"]
    assert [r["workload"]["step"] for r in steps["serving/few_shot/seed1 32/8"]] == [0, 85, 170, 255]
    with pytest.raises(ValueError, match=">= 1"):
        workload_steps(RECORDS, 0)


def test_family_of_record():
    assert family_of_record(RECORDS[0]) == "serving/few_shot"
    assert {family_of_record(r) for r in FAMILIES} == {r["workload"]["family"] for r in FAMILIES}
    assert "paper_random" in {family_of_record(r) for r in FAMILIES}
    paper = read_traces(workloads_path() / "paper_suite.jsonl.gz", kind="workload").records[0]
    assert family_of_record(paper) == "paper"


def test_validate_measures_every_member_per_tree_and_target(tmp_path):
    ex = export()
    assert len(CASES) == 6 and len({family_of_record(r) for r in CASES}) == 3
    measure = FakeMeasure()
    with TraceWriter(tmp_path / "v.jsonl") as w:
        results = validate_portfolios(ex, CASES, gpu_name="NVIDIA H200", writer=w, env=ENV, measure=measure)
    assert [(v.case, v.target) for v in results] == [
        (_case(r), t) for r in CASES for t in ("tree_attention", "runtime")
    ]
    for r, (kernels, runtime) in zip(CASES, zip(results[::2], results[1::2], strict=True), strict=True):
        tree = decode_tree(r["workload"]["tree"])
        large = tree_features(tree)[Q] > THRESHOLD
        assert (kernels.family, kernels.bucket) == (family_of_record(r), "g4-d128-float16")
        assert kernels.picked == int(large) and kernels.member_us == [100.0, 80.0]
        assert kernels.leaf == (2 if large else 1)  # the selector node the tree reaches
        assert kernels.features == tree_features(tree).tolist() and kernels.heads == [32, 8]  # for confirm's regions
        assert kernels.speedup == pytest.approx(1.25 if large else 1.0) and kernels.best_us == 80.0
        assert runtime.picked == 1 and runtime.member_us == [100.0, 90.0] and runtime.leaf == 0
        assert runtime.speedup == pytest.approx(100 / 90)
    assert {v.picked for v in results[::2]} == {0, 1}  # the selector splits the cases
    # every member measured once per tree and target, as that target runs it
    points = [c["point"] for c in measure.calls]
    expected = [
        (_case(r), t == "runtime", m)
        for r in CASES
        for t, ms in (("tree_attention", (FastTreeConfig(), TUNED)), ("runtime", (FastTreeConfig(), TUNED_RT)))
        for m in ms
    ]
    assert [(_point_case(p), p.runtime, p.config) for p in points] == expected
    assert all(p.split == "validate" and p.default_config == (p.config == FastTreeConfig()) for p in points)
    assert all(p.variants == p.runtime for p in points)  # the runtime as servers run it: its launch variants
    assert len({p.index for p in points}) == len(points)
    # the first tree of each (family, bucket, heads) is checked against the reference, no later one
    first = {}
    for r in CASES:
        first.setdefault(family_of_record(r), _case(r))
    checked = {_point_case(c["point"]) for c in measure.calls if c["check"]}
    assert checked == set(first.values())
    # every measurement is appended, with its target, member and the member picked
    lines = read_traces(tmp_path / "v.jsonl", kind="measurement").records
    assert len(lines) == len(CASES) * 4 and all(r["status"] == "ok" for r in lines)
    assert {r["meta"]["split"] for r in lines} == {"validate"}
    meta = [tuple(r["meta"][k] for k in ("case", "target", "member", "picked", "leaf")) for r in lines]
    assert meta == [(v.case, v.target, m, v.picked, v.leaf) for v in results for m in range(2)]
    assert [("launch" in r) for r in lines] == [r["meta"]["target"] == "runtime" for r in lines]
    assert {r["launch"]["kind"] for r in lines if "launch" in r} == {"runtime_variants"}


def _point_case(p) -> str:
    """The case of a measured point (the cases' seeds are integers)."""
    return f"{p.family}/seed{p.seed}/step{p.tree_index} {p.num_q_heads}/{p.num_kv_heads}"


def test_validate_checks_every_member_of_the_first_tree_in_every_target():
    measure = FakeMeasure()
    validate_portfolios(export(), CASES[:2], gpu_name="NVIDIA H200", env=ENV, measure=measure)
    assert [c["check"] for c in measure.calls] == [True] * 4 + [False] * 4  # the family's second tree: no check


def test_validate_one_target_and_another_gpu_fall_back_to_the_defaults():
    measure = FakeMeasure()
    results = validate_portfolios(export("NVIDIA H100"), CASES[:2], gpu_name="NVIDIA H200", targets=("runtime",),
                                  env=ENV, measure=measure)  # fmt: skip
    assert [v.target for v in results] == ["runtime", "runtime"]
    assert all(v.picked == 0 and v.member_us == [100.0] and v.speedup == 1.0 for v in results)
    assert [c["point"].config for c in measure.calls] == [FastTreeConfig()] * 2


def test_validate_raises_on_a_failed_measurement_and_still_writes_it(tmp_path):
    measure = FakeMeasure(fail={TUNED_RT})
    with TraceWriter(tmp_path / "v.jsonl") as w, pytest.raises(RuntimeError, match="runtime member 1: it broke"):
        validate_portfolios(export(), CASES, gpu_name="NVIDIA H200", writer=w, env=ENV, measure=measure)
    lines = read_traces(tmp_path / "v.jsonl", kind="measurement").records
    assert [r["status"] for r in lines] == ["ok", "ok", "ok", "failed"]  # the first tree's, up to the failure
    with pytest.raises(ValueError, match="workload records"):
        validate_portfolios(export(), lines, gpu_name="NVIDIA H200", env=ENV, measure=FakeMeasure())


def test_summarise_by_hand():
    results = [
        CaseValidation("f", "f/x/seed0/step0 32/8", "g4-d128-float16", "tree_attention", 1, [100.0, 80.0]),
        CaseValidation("f", "f/x/seed0/step1 32/8", "g4-d128-float16", "tree_attention", 0, [100.0, 90.0]),
        CaseValidation("h", "h/x/seed0/step0 32/8", "g4-d128-float16", "tree_attention", 1, [50.0, 60.0]),
        CaseValidation("f", "f/x/seed0/step0 32/8", "g4-d128-float16", "runtime", 0, [70.0]),
    ]
    s = summarise(results)
    rows = {(r["target"], r["family"]): r for r in s["families"]}
    assert [(r["target"], r["family"]) for r in s["families"]] == [
        ("runtime", "f"), ("tree_attention", "f"), ("tree_attention", "h")
    ]  # fmt: skip
    f = rows[("tree_attention", "f")]
    assert (f["cases"], f["switched"], f["bucket"]) == (2, 1, "g4-d128-float16")
    assert f["geomean"] == pytest.approx(math.sqrt(1.25 * 1.0)) and f["worst"] == pytest.approx(1.0)
    assert f["regret"] == pytest.approx((80 + 100) / (80 + 90) - 1)  # picked over the best member, summed
    assert f["default_regret"] == pytest.approx((100 + 100) / (80 + 90) - 1)  # always the defaults, the same
    h = rows[("tree_attention", "h")]
    assert h["geomean"] == pytest.approx(50 / 60) == h["worst"] and h["regret"] == pytest.approx(60 / 50 - 1)
    assert h["default_regret"] == 0.0  # the selector switched where the defaults were best
    rt = rows[("runtime", "f")]
    assert (rt["geomean"], rt["worst"], rt["regret"], rt["default_regret"], rt["switched"]) == (1.0, 1.0, 0.0, 0.0, 0)
    t = s["targets"]["tree_attention"]
    assert t["cases"] == 3 and t["geomean"] == pytest.approx((1.25 * 1.0 * 50 / 60) ** (1 / 3))
    assert t["worst"] == pytest.approx(50 / 60) and t["below_0.97"] == 1
    assert t["worst_family_regret"] == pytest.approx(0.2)  # family h
    assert t["worst_family_default_regret"] == pytest.approx(200 / 170 - 1)  # family f
    assert s["targets"]["runtime"] == {"cases": 1, "geomean": 1.0, "worst": 1.0, "below_0.97": 0,
                                       "worst_family_regret": 0.0, "worst_family_default_regret": 0.0}  # fmt: skip
    assert summarise([]) == {"families": [], "targets": {}}


def test_validate_cli_needs_a_gpu(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "e.json"
    path.write_text(json.dumps(export().to_dict()))
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--config", str(path), "--traces-out", str(tmp_path / "t.jsonl")])
    assert exc.value.code == 2 and "CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()


def test_validate_cli_refuses_a_gzip_trace_output_before_measuring(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    path = tmp_path / "e.json"
    path.write_text(json.dumps(export().to_dict()))
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--config", str(path), str(HELDOUT / "few_shot_mistral_7b.jsonl.gz"), "--steps", "1",
              "--traces-out", str(tmp_path / "t.jsonl.gz")])  # fmt: skip
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--traces-out" in err and "cannot append to a gzip file" in err
    assert not (tmp_path / "t.jsonl.gz").exists()


def test_validate_path_never_imports_optuna():
    code = (
        "import sys; sys.modules['optuna'] = None\n"  # an import of optuna would raise
        "import fasttree.cli, fasttree.toolkit.validate, fasttree.costmodel.features\n"
        "args = fasttree.cli.build_parser().parse_args(['validate', '--config', 'e.json', '--traces-out', 't.jsonl'])\n"
        "assert args.func.__name__ == '_cmd_validate'\n"
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_validate_cli_writes_the_cases_confirm_fences_leaves_with(tmp_path, monkeypatch):
    """validate -o on a stand-in GPU, then confirm, then the served portfolio: the confirmed leaf serves its member
    to trees at the measured layout (32/8 heads) and the defaults at one KV head (4/1, the same bucket)."""
    import torch

    import fasttree.toolkit.validate as validate_module

    real = validate_module.validate_portfolios
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(validate_module, "collect_env", lambda device: ENV)
    monkeypatch.setattr(
        validate_module, "validate_portfolios", lambda *a, **k: real(*a, **k, env=ENV, measure=FakeMeasure())
    )
    config, measured, confirmed = tmp_path / "e.json", tmp_path / "v.json", tmp_path / "c.json"
    config.write_text(json.dumps(export().to_dict()))
    assert main(["validate", "--config", str(config), str(HELDOUT / "families_mistral_7b.jsonl.gz"), "--steps", "3",
                 "--traces-out", str(tmp_path / "t.jsonl"), "-o", str(measured)]) == 0  # fmt: skip
    doc = json.loads(measured.read_text())
    assert doc["cases"] and all(
        len(c["features"]) == len(TREE_FEATURES) and c["heads"] == [32, 8] for c in doc["cases"]
    )
    assert main(["confirm", "--config", str(config), "--measured", str(measured), "-o", str(confirmed)]) == 0
    entry = {e.target: e for e in read_export(confirmed).entries}["tree_attention"]
    region = entry.portfolio.regions[2]
    assert region.evidence == "measured" and region.layouts == ((8, 4),)
    large = [c for c in doc["cases"] if c["target"] == "tree_attention" and c["leaf"] == 2]
    assert region.trees == len(large) >= 4
    tree = decode_tree(next(r for r in FAMILIES if _case(r) == large[0]["case"])["workload"]["tree"])
    shape = {"gpu": "NVIDIA H200", "head_dim": 128, "dtype": "float16"}
    assert load_portfolio(confirmed, **shape, num_q_heads=32, num_kv_heads=8).select(tree) == TUNED
    assert load_portfolio(confirmed, **shape, num_q_heads=4, num_kv_heads=1).select(tree) == FastTreeConfig()


def test_a_rerun_into_the_same_trace_file_reads_its_measurements_back(tmp_path):
    """A validate stopped after two trees, rerun into its trace file: the members measured before are read
    back (not measured, not written again), the rest measured; the results equal an uninterrupted run's."""
    path = tmp_path / "v.jsonl"
    whole = validate_portfolios(export(), CASES, gpu_name="NVIDIA H200", env=ENV, measure=FakeMeasure())
    with TraceWriter(path) as w:
        validate_portfolios(export(), CASES[:2], gpu_name="NVIDIA H200", writer=w, env=ENV, measure=FakeMeasure())
    earlier = earlier_measurements(path, "NVIDIA H200")
    assert len(earlier) == 2 * 4  # two trees, two members of two targets
    measure = FakeMeasure()
    with TraceWriter(path) as w:
        again = validate_portfolios(export(), CASES, gpu_name="NVIDIA H200", writer=w, env=ENV, measure=measure,
                                    earlier=earlier)  # fmt: skip
    assert [(v.case, v.target, v.picked, v.member_us) for v in again] == [
        (v.case, v.target, v.picked, v.member_us) for v in whole
    ]
    assert {_point_case(c["point"]) for c in measure.calls} == {_case(r) for r in CASES[2:]}
    lines = read_traces(path, kind="measurement").records
    assert len(lines) == len(CASES) * 4 and len({r["key"] for r in lines}) == len(lines)  # none written twice
    # another GPU's, another kernel version's or a failed measurement is never read back
    assert earlier_measurements(path, "NVIDIA H100") == {}
    assert earlier_measurements(tmp_path / "missing.jsonl", "NVIDIA H200") == {}
    stale = tmp_path / "stale.jsonl"
    with TraceWriter(stale) as w:
        for r in lines[:3]:
            w.append({**r, "meta": {**r["meta"], "profiler": {"kernel_version": KERNEL_VERSION - 1}}})
        w.append({**lines[3], "status": "failed", "timing": None, "error": "it broke"})
    assert earlier_measurements(stale, "NVIDIA H200") == {}


def test_validate_cli_resumes_from_its_trace_file_unless_told_to_remeasure(tmp_path, monkeypatch):
    import torch

    import fasttree.toolkit.validate as validate_module

    real = validate_module.validate_portfolios
    measures = []

    def run(*a, **k):
        measures.append(FakeMeasure())
        return real(*a, **k, env=ENV, measure=measures[-1])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(validate_module, "validate_portfolios", run)
    config = tmp_path / "e.json"
    config.write_text(json.dumps(export().to_dict()))
    argv = ["validate", "--config", str(config), str(HELDOUT / "few_shot_mistral_7b.jsonl.gz"), "--steps", "2",
            "--traces-out", str(tmp_path / "t.jsonl")]  # fmt: skip
    assert main(argv) == 0 and main(argv) == 0 and main([*argv, "--remeasure"]) == 0
    first, resumed, remeasured = (len(m.calls) for m in measures)
    assert first == 2 * 4 and resumed == 0 and remeasured == first
    assert len(read_traces(tmp_path / "t.jsonl", kind="measurement").records) == 2 * first


def test_a_case_measured_in_part_or_over_two_runs_is_measured_again_whole(tmp_path):
    path = tmp_path / "v.jsonl"
    with TraceWriter(path) as w:
        validate_portfolios(export(), CASES[:1], gpu_name="NVIDIA H200", writer=w, env=ENV, measure=FakeMeasure(),
                            run="first")  # fmt: skip
    lines = read_traces(path, kind="measurement").records
    assert {r["meta"]["run"] for r in lines} == {"first"}
    full = earlier_measurements(path, "NVIDIA H200")
    (k0, k1) = [r["key"] for r in lines if r["meta"]["target"] == "tree_attention"]
    for earlier, measured in (
        (full, 0),  # the whole case from one run: read back
        ({k: v for k, v in full.items() if k != k1}, 2),  # member 1 missing: both members measured again
        ({**full, k1: (full[k1][0], "second")}, 2),  # members from two runs: both measured again
    ):
        measure = FakeMeasure()
        validate_portfolios(export(), CASES[:1], gpu_name="NVIDIA H200", targets=("tree_attention",), env=ENV,
                            measure=measure, earlier=earlier)  # fmt: skip
        assert len(measure.calls) == measured
    assert k0 in full and full[k0][1] == "first"
