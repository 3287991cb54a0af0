"""``fasttree-tune tune / export / run`` through the real entry point, against temporary storages: the
studies, the format-3 export of portfolios per bucket and target (each leaf fenced with the margin
calibrated on held-out traces, ``--calibration``), the run's report.

The PostgreSQL test needs a server: ``.ci/run`` starts one on loopback and sets
``FASTTREE_TEST_POSTGRES_URL``; with ``FASTTREE_REQUIRE_POSTGRES=1`` (set there too) a
missing URL fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import optuna
import pytest

from fasttree import FastTreeConfig
from fasttree.cli import main
from fasttree.costmodel.calibration import MARGIN_QUANTILE
from fasttree.export import ExportGuard, load_portfolio, read_export
from fasttree.traces import read_traces
from fasttree.tuner import runtime_member

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "costmodel" / "data" / "h200_latency_model.skops"
PAPER = ROOT / "fasttree" / "toolkit" / "data" / "workloads" / "paper_suite.jsonl.gz"


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    """A small workload file: 4 paper-suite trees in each of the three head settings."""
    records = read_traces(PAPER, kind="workload").records
    keep = [r for r in records if int(r["workload"]["step"]) % 15 in (0, 3, 8, 11)]
    path = tmp_path_factory.mktemp("wl") / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return path


def _one_bucket(workload: Path, folder: Path, group_size: int) -> Path:
    """A folder holding the small workload's 4 trees at ``group_size``: one bucket."""
    records = read_traces(workload, kind="workload").records
    records = [r for r in records if r["num_q_heads"] == group_size * r["num_kv_heads"]]
    assert len(records) == 4
    (folder / f"g{group_size}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture(scope="module")
def workload_g4(workload, tmp_path_factory) -> Path:
    return _one_bucket(workload, tmp_path_factory.mktemp("wl4"), 4)


@pytest.fixture(scope="module")
def workload_g1(workload, tmp_path_factory) -> Path:
    return _one_bucket(workload, tmp_path_factory.mktemp("wl1"), 1)


#: What keeps a run short: two trials, the default polish, one process.
FAST = ["--trials", "2", "--timeout", "60s", "--jobs", "1", "--no-progress"]
BUCKETS = ("g1-d128-float16", "g4-d128-float16", "g16-d128-float16")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _studies(storage: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    summaries = optuna.get_all_study_summaries(storage)
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage).trials for s in summaries}


def test_tune_writes_studies_and_resumes(tmp_path, workload, capsys):
    db = tmp_path / "s.db"
    args = ["tune", str(workload), "--model", str(MODEL), "--storage", str(db), "--study", "t", "--no-progress"]
    assert main([*args, "--trials", "3", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "g4-d128-float16" in out and "speed-up (objective)" in out
    url = f"sqlite:///{db}"
    studies = _studies(url)
    assert sorted(studies) == ["t-g1-d128-float16", "t-g16-d128-float16", "t-g4-d128-float16"]
    for trials in studies.values():
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(complete) == 3
        # one family (the paper suite), balanced: a trial's value is its ratio to the defaults
        assert all(t.user_attrs["family_ratio"] == pytest.approx({"paper": t.values[0]}) for t in complete)
    summary = json.loads((tmp_path / "r.json").read_text())
    assert set(summary) == set(BUCKETS)
    for r in summary.values():
        assert r["defaults_predicted_us"] == pytest.approx(1.0)  # family-balanced: the defaults score 1
        assert r["predicted_us"] <= r["defaults_predicted_us"]  # never predicted slower than the defaults
        assert r["n_complete"] == 3
    # rerun: resumes to 5 complete trials, the defaults enqueued once (trial 0)
    assert main([*args, "--trials", "5"]) == 0
    for trials in _studies(url).values():
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(complete) == 5
        assert sorted(t.number for t in trials) == list(range(len(trials)))
        first = trials[0].user_attrs.get("config")
        assert first is None or FastTreeConfig.from_dict(first) == FastTreeConfig()


def test_tune_for_the_runtime_keeps_its_studies_apart(tmp_path, workload, capsys):
    # --runtime predicts the runtime's plans and launches: its studies are NAME-rt-... (as run names them, so
    # export finds them), carry the runtime in their fingerprint, and their configs keep the defaults' launch shapes
    db = str(tmp_path / "s.db")
    args = ["tune", str(workload), "--model", str(MODEL), "--storage", db, "--no-progress", "--trials", "2"]
    assert main([*args, "--study", "k"]) == 0
    assert main([*args, "--study", "k", "--runtime", "--json", str(tmp_path / "r.json")]) == 0
    study = optuna.load_study(study_name="k-rt-g4-d128-float16", storage=f"sqlite:///{db}")
    assert study.user_attrs["fasttree_objective"]["launch"] == "runtime"
    assert study.user_attrs["fasttree_settings"]["target"] == "runtime"
    plain = optuna.load_study(study_name="k-g4-d128-float16", storage=f"sqlite:///{db}")
    assert plain.user_attrs["fasttree_objective"].get("launch") != "runtime"
    for r in json.loads((tmp_path / "r.json").read_text()).values():
        best = FastTreeConfig.from_dict(r["best_config"])
        assert runtime_member(best) == best


@pytest.mark.parametrize("flags", [["--export", "e.json"], ["--no-balance"]])
def test_tune_has_no_export_and_always_balances_families(tmp_path, workload, capsys, flags):
    # exports are portfolios now ('run' and 'export' write them); families are always balanced
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(workload), "--model", str(MODEL), "--storage", str(tmp_path / "s.db"), *flags])
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert not (tmp_path / "s.db").exists()


def _journal(path: Path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(path)))


def test_export_subcommand_reads_the_studies(tmp_path, workload_g1, capsys):
    # GQA 1: the bucket whose tree_attention margin the shipped held-out traces calibrate (at GQA 4
    # and 16 their pairs ran 64-row tiles the sm_90 Gluon stage 1 now runs)
    journal = tmp_path / "s.log"
    common = ["--model", str(MODEL), "--storage", str(journal), "--study", "j", "--targets", "tree_attention",
              "--jobs", "1", "--heldout", str(workload_g1)]  # fmt: skip
    run = ["run", "--workloads", str(workload_g1), *common, "--out", str(tmp_path / "out"), *FAST]
    assert main(run) == 0
    capsys.readouterr()
    export = ["export", str(workload_g1), *common, "-o", str(tmp_path / "b.json")]
    assert main(export) == 0
    assert "g1-d128-float16" in capsys.readouterr().out
    a, b = read_export(tmp_path / "out" / "export.json"), read_export(tmp_path / "b.json")
    assert [(e.bucket, e.target, e.portfolio, e.guard) for e in a.entries] == [
        (e.bucket, e.target, e.portfolio, e.guard) for e in b.entries
    ]
    assert [(e.bucket, e.target) for e in b.entries] == [((1, 128, "float16"), "tree_attention")]
    assert b.entries[0].provenance["n_trials"] == 2 and b.entries[0].provenance["study_name"] == "j-g1-d128-float16"
    for trials in _studies(_journal(journal)).values():  # export ran no trial
        assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 2
    with pytest.raises(SystemExit) as exc:  # the export exists: refused before anything runs
        main(export)
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # no storage given and none in --folder: nothing was tuned there
        main(["export", str(workload_g1), "--model", str(MODEL), "--folder", str(tmp_path / "none"),
              "-o", str(tmp_path / "c.json")])  # fmt: skip
    assert exc.value.code == 2 and "nothing was tuned" in capsys.readouterr().err
    # the margin came from the shipped held-out traces; without any, every leaf serves the defaults
    (entry,) = b.entries
    calibration = entry.provenance["evidence"]["calibration"]
    assert "h200_heldout" in calibration["source"] and calibration["quantile"] == MARGIN_QUANTILE
    assert calibration["pairs"] >= 20 and 0.0 <= calibration["margin"] == entry.provenance["evidence"]["margin"] < 1
    capsys.readouterr()
    assert main([*export[:-1], str(tmp_path / "none.json"), "--calibration", "none"]) == 0
    out = capsys.readouterr()
    (bare,) = read_export(tmp_path / "none.json").entries
    assert bare.provenance["evidence"]["margin"] is None and not any(bare.portfolio.selector.member)
    assert bare.portfolio.members == entry.portfolio.members  # the candidates stay for validate and confirm
    assert "no margin calibrated" in out.out or len(bare.portfolio.members) == 1


def _other_gpu_traces(tmp_path: Path) -> Path:
    """Held-out measurements of GQA 4 that timed today's kernel launches, relabelled as an H100's."""
    from fasttree.costmodel.dataset import timed_todays_launches
    from fasttree.traces import measurement_key

    records = read_traces(ROOT / "traces" / "h200_heldout", kind="measurement").records
    keep = [r for r in records if r["num_q_heads"] == 4 * r["num_kv_heads"] and r["head_dim"] == 128
            and r["dtype"] == "float16" and timed_todays_launches(r)][:30]  # fmt: skip
    assert keep
    for r in keep:
        r["env"]["gpu_name"] = "NVIDIA H100 80GB HBM3"
        w = r["workload"]
        r["key"] = measurement_key(
            w["tree"], family=w["family"], seed=w.get("seed"), num_q_heads=r["num_q_heads"],
            num_kv_heads=r["num_kv_heads"], head_dim=r["head_dim"], dtype=r["dtype"], config=r["config"],
            gpu_name="NVIDIA H100 80GB HBM3", launch=r.get("launch"),
        )  # fmt: skip
    path = tmp_path / "h100.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return path


def test_calibration_traces_of_another_gpu_or_none_of_the_buckets_are_refused(tmp_path, workload_g4, capsys):
    common = ["run", "--workloads", str(workload_g4), "--model", str(MODEL), "--targets", "tree_attention",
              "--heldout", "none", *FAST]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main([*common, "--out", str(tmp_path / "a"), "--calibration", str(_other_gpu_traces(tmp_path))])
    assert exc.value.code == 2 and "measured on 'NVIDIA H100 80GB HBM3', the model is for 'NVIDIA H200'" in (
        capsys.readouterr().err
    )
    smoke = ROOT / "traces" / "h200_smoke"  # no GQA-4 measurement of today's kernel launches
    with pytest.raises(SystemExit) as exc:
        main([*common, "--out", str(tmp_path / "b"), "--calibration", str(smoke)])
    assert exc.value.code == 2 and "no measurements of today's kernel launches" in capsys.readouterr().err
    assert not (tmp_path / "a" / "export.json").exists() and not (tmp_path / "b" / "export.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/nonexistent/model.json"], "does not exist"),
        (["--storage", "redis://localhost/0"], "storage"),
        (["--trials", "0"], "integer >= 1"),
    ],
)
def test_tune_usage_errors(tmp_path, workload, capsys, argv, message):
    base = {"--model": str(MODEL), "--storage": str(tmp_path / "s.db"), "--trials": "2"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(workload), "--no-progress", *[x for kv in base.items() for x in kv]])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s.db").exists() or message != "does not exist"


def test_tune_refuses_a_file_without_workload_lines(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit):
        main(["tune", str(empty), "--model", str(MODEL), "--storage", str(tmp_path / "s.db")])
    assert "no workload" in capsys.readouterr().err


def test_run_writes_portfolio_export_and_report(tmp_path, workload, capsys):
    wl = tmp_path / "wl"
    wl.mkdir()
    shutil.copy(workload, wl / "small.jsonl")
    out = tmp_path / "out"
    argv = ["run", "--workloads", str(wl), "--heldout", str(wl), "--out", str(out), "--model", str(MODEL),
            "--targets", "tree_attention,runtime", "--every", "4", *FAST]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| target | bucket | members |" in text and "export:" in text and "report:" in text
    ex = read_export(out / "export.json")
    targets = ("tree_attention", "runtime")
    assert sorted((e.bucket, e.target) for e in ex.entries) == sorted(
        ((g, 128, "float16"), t) for g in (1, 4, 16) for t in targets
    )
    sha = _sha256(MODEL)
    assert ex.provenance["model_hash"] == sha and ex.provenance["model_path"] == str(MODEL)
    for e in ex.entries:
        assert e.gpu == "NVIDIA H200" and e.guard == ExportGuard.current(sha) and e.guard.mismatch() is None
        p = e.portfolio
        assert p.members[0] == FastTreeConfig() and p.runtime == (e.target == "runtime")
        if p.runtime:
            assert all(runtime_member(m) == m for m in p.members)
        bucket = f"g{e.group_size}-d128-float16"
        assert e.provenance["study_name"] == (f"fasttree-rt-{bucket}" if p.runtime else f"fasttree-{bucket}")
        assert e.provenance["n_trials"] == 2
        # the selection rules never let a tuning family lose; the held-out trees are the same trees
        assert e.provenance["predicted_train"] <= 1.0 + 1e-12 and e.provenance["predicted_valid"] <= 1.0 + 1e-12
        served = load_portfolio(out / "export.json", gpu="NVIDIA H200", num_q_heads=8 * e.group_size, num_kv_heads=8,
                                head_dim=128, dtype="float16", target=e.target)  # fmt: skip
        assert served == p.for_heads(8 * e.group_size, 8)
        # every leaf serving a member has beaten the calibrated margin on >= 4 held-out trees, fenced by them
        evidence = e.provenance["evidence"]
        calibration = evidence["calibration"]
        assert evidence["split"] == "validation" and (calibration or {}).get("margin") == evidence["margin"]
        for leaf in evidence["leaves"]:
            if leaf["served"]:
                assert leaf["predicted_gain"] > evidence["margin"] and leaf["trees"] >= 4
                assert p.regions[leaf["leaf"]].trees == leaf["trees"]
    studies = _studies(f"sqlite:///{out / 'fasttree-tune.db'}")
    assert sorted(studies) == sorted(f"fasttree-{rt}{b}" for b in BUCKETS for rt in ("", "rt-"))
    report = json.loads((out / "report.json").read_text())
    assert report["gpu"] == "NVIDIA H200" and report["model"] == str(MODEL)
    assert sorted((j["target"], j["bucket"]) for j in report["jobs"]) == sorted(
        (t, b) for t in targets for b in BUCKETS
    )
    for j in report["jobs"]:
        assert j["study"]["n_complete"] == 2 and j["candidates"] >= 2 and len(j["designs"]) > 1
        assert set(j["rules"]) == {"margin", "family_loss", "tree_loss", "max_depth", "min_leaf"}
        assert j["train"]["families"].keys() == {"paper"} and j["train"]["objective"] <= 1.0 + 1e-12
        assert sum(j["valid"]["picks"]) == 4  # the held-out steps: 4 trees per bucket
        # the shipped held-out pairs calibrate every bucket but tree_attention's at GQA 4 and 16, whose
        # 64-row D 128 plans the sm_90 Gluon stage 1 now runs (not today's launches: the defaults there)
        calibrated = j["target"] == "runtime" or j["bucket"] == "g1-d128-float16"
        if calibrated:
            assert j["evidence"]["margin"] > 0 and j["evidence"]["calibration"]["pairs"] >= 20
        else:
            assert j["evidence"]["margin"] is None and j["evidence"]["calibration"] is None
    md = (out / "report.md").read_text()
    assert md.startswith("# fasttree-tune run") and "| calibrated margin | leaves served (model's) |" in md
    for t in targets:
        for b in BUCKETS:
            assert f"| {t} | {b} |" in md and f"## {t} {b}" in md
    assert "| paper |" in md
    assert not list(out.glob(".*.tmp")), "a temporary file of an atomic write was left behind"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--targets", "bogus"], "expected a comma list"),
        (["run", "--targets", ","], "expected a comma list"),
        (["run", "--jobs", "0"], "integer >= 1"),
        (["run", "--every", "0"], "integer >= 1"),
        (["export", "w.jsonl", "-o", "e.json", "--targets", "runtime,tree"], "expected a comma list"),
    ],
)
def test_run_and_export_usage_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out" if argv[0] == "run" else "--folder", str(tmp_path / "o")])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _postgres_url() -> str:
    url = os.environ.get("FASTTREE_TEST_POSTGRES_URL")
    if not url:
        if os.environ.get("FASTTREE_REQUIRE_POSTGRES") == "1":
            pytest.fail("FASTTREE_REQUIRE_POSTGRES=1 but FASTTREE_TEST_POSTGRES_URL is not set")
        pytest.skip("no PostgreSQL server (set FASTTREE_TEST_POSTGRES_URL; .ci/run starts one)")
    return url


def test_two_workers_share_a_postgres_study(tmp_path, workload):
    url = _postgres_url()
    study = f"ci-{uuid.uuid4().hex[:8]}"
    g16 = tmp_path / "g16.jsonl"  # one bucket keeps the test short
    records = [r for r in read_traces(workload, kind="workload").records if r["num_kv_heads"] == 1]
    assert records, "the workload has GQA-16 steps"
    g16.write_text("".join(json.dumps(r) + "\n" for r in records))

    def worker(k: int, trials: int = 8) -> subprocess.Popen:
        argv = [sys.executable, "-m", "fasttree.cli", "tune", str(g16), "--model", str(MODEL), "--storage", url,
                "--study", study, "--trials", str(trials), "--worker", str(k), "--no-progress",
                "--out", str(tmp_path)]  # fmt: skip
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [worker(0), worker(1)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
    name = f"{study}-g16-d128-float16"
    trials = optuna.load_study(study_name=name, storage=url).trials
    numbers = [t.number for t in trials]
    assert numbers == sorted(set(numbers)) == list(range(len(trials))), "every trial stored once"
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert 8 <= len(complete) <= 9  # two workers may overshoot by the trial in flight
    configs = {t.number: t.user_attrs["config"] for t in trials if "config" in t.user_attrs}  # pruned: none
    defaults = [
        t for t in trials if t.number in configs and FastTreeConfig.from_dict(configs[t.number]) == FastTreeConfig()
    ]
    assert len(defaults) >= 1 and defaults[0].number == 0
    # the study resumes: a third run to 12 adds only what is missing
    p = worker(2, trials=12)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    trials = optuna.load_study(study_name=name, storage=url).trials
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 12
    assert [t.number for t in trials] == list(range(len(trials)))


def test_bench_forwards_to_the_kernel_benchmark(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exc:  # the benchmark's own --help
        main(["bench", "--", "--help"])
    assert exc.value.code == 0
    assert "usage: fasttree-tune bench --" in capsys.readouterr().out


def test_bench_runs_from_the_package_outside_a_checkout(tmp_path, monkeypatch, capsys):
    """The benchmark is part of the package: no bench/ folder on the path, nothing imported from it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "bench.kernel", raising=False)
    monkeypatch.delitem(sys.modules, "bench", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--", "--help"])
    assert exc.value.code == 0 and "--suite" in capsys.readouterr().out
    assert "bench" not in sys.modules


def test_run_refit_fits_the_model_from_traces(tmp_path, workload_g4, capsys):
    from fasttree.costmodel.persist import load_model

    out = tmp_path / "out"
    argv = ["run", "--refit", "--traces", str(ROOT / "traces" / "h200_smoke"), "--workloads", str(workload_g4),
            "--heldout", str(workload_g4), "--out", str(out), "--targets", "tree_attention", *FAST]  # fmt: skip
    assert main(argv) == 0
    assert "fitted" in capsys.readouterr().out
    model = out / "latency_model.skops"
    _, meta = load_model(model)
    smoke = read_traces(ROOT / "traces" / "h200_smoke", kind="measurement").records
    assert meta["trace_set"]["rows"] == len({r["key"] for r in smoke if r["status"] == "ok"})  # one row per key
    assert "simulator_baseline" in meta["extra"] and "training_metrics" in meta["extra"]
    ex = read_export(out / "export.json")
    assert ex.provenance["model_path"] == str(model) and ex.provenance["model_hash"] == _sha256(model)
    ((entry,),) = [ex.entries]
    assert entry.target == "tree_attention" and entry.guard.model_sha256 == _sha256(model)
