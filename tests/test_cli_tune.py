"""``fasttree-tune tune / export / run`` through the real entry point, against temporary storages.

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
from fasttree.export import read_export
from fasttree.traces import read_traces

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


def _studies(storage: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    summaries = optuna.get_all_study_summaries(storage)
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage).trials for s in summaries}


def test_tune_writes_studies_export_and_resumes(tmp_path, workload, capsys):
    db = tmp_path / "s.db"
    export = tmp_path / "e.json"
    args = ["tune", str(workload), "--model", str(MODEL), "--storage", str(db), "--study", "t", "--no-progress"]
    assert main([*args, "--trials", "3", "--export", str(export), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "g4-d128-float16" in out and "predicted speedup" in out
    url = f"sqlite:///{db}"
    studies = _studies(url)
    assert sorted(studies) == ["t-g1-d128-float16", "t-g16-d128-float16", "t-g4-d128-float16"]
    for trials in studies.values():
        assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 3
    # the export holds one entry per bucket, never predicted slower than the defaults
    ex = read_export(export)
    assert {e.bucket for e in ex.entries} == {(1, 128, "float16"), (4, 128, "float16"), (16, 128, "float16")}
    for e in ex.entries:
        assert e.provenance["predicted_tuned_us"] <= e.provenance["predicted_default_us"]
        assert e.provenance["polish_evaluations"] > 1  # the best trial's config was polished (2 passes)
        moves = e.provenance["polish_moves"]
        assert all(isinstance(m[0], str) and 0 < m[2] < 1 for m in moves)
    assert any(e.provenance["polish_moves"] for e in ex.entries), "3 trials leave room to polish somewhere"
    assert len(ex.provenance["model_hash"]) == 64
    summary = json.loads((tmp_path / "r.json").read_text())
    assert set(summary) == {"g1-d128-float16", "g4-d128-float16", "g16-d128-float16"}
    # rerun: resumes to 5 complete trials, the defaults enqueued once (trial 0)
    assert main([*args, "--trials", "5"]) == 0
    for trials in _studies(url).values():
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(complete) == 5
        assert sorted(t.number for t in trials) == list(range(len(trials)))
        first = trials[0].user_attrs.get("config")
        assert first is None or FastTreeConfig.from_dict(first) == FastTreeConfig()


def test_tune_for_the_runtime_keeps_its_studies_apart(tmp_path, workload, capsys):
    # --runtime predicts the runtime's plans and launches: its studies carry that in their fingerprint, so
    # a study tuned for tree_attention is not resumed by it, and the export says which launches it predicted
    db = str(tmp_path / "s.db")
    args = ["tune", str(workload), "--model", str(MODEL), "--storage", db, "--no-progress", "--trials", "2"]
    assert main([*args, "--study", "k"]) == 0
    with pytest.raises(SystemExit) as exc:
        main([*args, "--study", "k", "--runtime"])
    assert exc.value.code == 2 and "launch" in capsys.readouterr().err
    assert main([*args, "--study", "r", "--runtime", "--export", str(tmp_path / "r.json")]) == 0
    assert read_export(tmp_path / "r.json").provenance["predicted_launches"] == "runtime"


def _journal(path: Path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(path)))


def test_export_subcommand_reads_the_studies(tmp_path, workload):
    journal = tmp_path / "s.log"
    common = ["--model", str(MODEL), "--storage", str(journal), "--study", "j"]
    tune = ["tune", str(workload), *common, "--trials", "2", "--no-progress", "--export", str(tmp_path / "a.json")]
    assert main(tune) == 0
    with pytest.raises(SystemExit) as exc:  # the export exists: refused before any trial runs
        main(tune)
    assert exc.value.code == 2
    assert main(["export", str(workload), *common, "-o", str(tmp_path / "b.json")]) == 0
    a, b = read_export(tmp_path / "a.json"), read_export(tmp_path / "b.json")
    assert [(e.bucket, e.config) for e in a.entries] == [(e.bucket, e.config) for e in b.entries]
    for trials in _studies(_journal(journal)).values():  # export ran no trial
        assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 2


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


def test_run_writes_export_report_and_plots(tmp_path, workload, capsys):
    wl = tmp_path / "wl"
    wl.mkdir()
    shutil.copy(workload, wl / "small.jsonl")
    out = tmp_path / "out"
    argv = ["run", "--workloads", str(wl), "--heldout", str(wl), "--out", str(out), "--trials", "2", "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "held-out g4-d128-float16" in text and "export:" in text
    ex = read_export(out / "export.json")
    assert len(ex.entries) == 3
    report = json.loads((out / "report.json").read_text())
    assert set(report["heldout"]) == {"g1-d128-float16", "g4-d128-float16", "g16-d128-float16"}
    for h in report["heldout"].values():
        assert h["tuned_us"] <= h["defaults_us"] * (1 + 1e-12)  # same steps as tuned: never worse than defaults
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert any(p.startswith("history_") for p in pngs) and any(p.startswith("heldout_steps_") for p in pngs)
    assert (out / "report.md").read_text().count("![") == len(pngs)
    assert all((out / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for name in pngs)
    assert not list(out.glob(".*.tmp")), "a temporary file of an atomic write was left behind"


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
    defaults = [t for t in trials if FastTreeConfig.from_dict(t.user_attrs["config"]) == FastTreeConfig()]
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


def test_run_refit_fits_the_model_from_traces(tmp_path, workload, capsys):
    from fasttree.costmodel.persist import load_model

    wl = tmp_path / "wl"
    wl.mkdir()
    shutil.copy(workload, wl / "small.jsonl")
    out = tmp_path / "out"
    argv = ["run", "--refit", "--traces", str(ROOT / "traces" / "h200_smoke"), "--workloads", str(wl),
            "--heldout", str(wl), "--out", str(out), "--trials", "2", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "fitted" in capsys.readouterr().out
    _, meta = load_model(out / "latency_model.json")
    smoke = read_traces(ROOT / "traces" / "h200_smoke", kind="measurement").records
    assert meta["trace_set"]["rows"] == len({r["key"] for r in smoke if r["status"] == "ok"})  # one row per key
    assert "simulator_baseline" in meta["extra"] and "training_metrics" in meta["extra"]
    assert read_export(out / "export.json").provenance["model_path"] == str(out / "latency_model.json")
