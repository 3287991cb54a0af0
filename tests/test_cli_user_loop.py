"""The user's own loop through ``fasttree-tune``'s real entry point: fast start, one output convention, outputs
checked before any work, clean interrupts and errors, held-out workloads of the user's own workloads."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from fasttree.cli import build_parser, main
from fasttree.export import read_export
from fasttree.traces import read_traces

ROOT = Path(__file__).resolve().parents[1]


def test_version_imports_neither_torch_nor_triton():
    code = (
        "import sys\n"
        "from fasttree.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'optuna', 'sklearn') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    seconds = time.perf_counter() - t0
    assert "fasttree-tune 0.1.0" in done.stdout
    assert "heavy: []" in done.stdout, done.stdout
    assert seconds < 5  # 0.3 s alone; generous for a loaded 2-core machine (the import check is the real test)


MODEL = ROOT / "costmodel" / "data" / "h200_latency_model.skops"
PAPER = ROOT / "fasttree" / "toolkit" / "data" / "workloads" / "paper_suite.jsonl.gz"
EXPORT = ROOT / "docs" / "tune" / "export.json"
#: One tuning trial and no polish: what keeps a study short.
QUICK = ["--trials", "1", "--polish-passes", "0", "--no-progress"]


@pytest.fixture(scope="module")
def own_workload(tmp_path_factory) -> Path:
    """A user's own recording: 5 GQA-4 paper-suite trees of one workload (one bucket)."""
    records = [r for r in read_traces(PAPER, kind="workload").records if r["num_q_heads"] == 4 * r["num_kv_heads"]]
    folder = tmp_path_factory.mktemp("rec")
    (folder / "my_server.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    return folder


def _trials(storage: Path) -> dict[str, int]:
    url = f"sqlite:///{storage}"
    return {
        s.study_name: len(optuna.load_study(study_name=s.study_name, storage=url).trials)
        for s in optuna.get_all_study_summaries(url)
    }


def _complete(storage: Path) -> dict[str, int]:
    url = f"sqlite:///{storage}"
    states = (optuna.trial.TrialState.COMPLETE,)
    return {
        s.study_name: len(optuna.load_study(study_name=s.study_name, storage=url).get_trials(states=states))
        for s in optuna.get_all_study_summaries(url)
    }


def _usage_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"fasttree-tune {command}: error:" in err, err
    return err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- defects 2 and 3: tune, then export
def test_export_of_own_workloads_holds_out_a_split_and_reuses_the_studys_settings(tmp_path, own_workload, capsys):
    studies = tmp_path / "studies"
    assert main(["tune", str(own_workload), "--model", str(MODEL), "-o", str(studies), *QUICK]) == 0
    capsys.readouterr()
    url = f"sqlite:///{studies / 'fasttree-tune.db'}"
    settings = optuna.load_study(study_name="fasttree-g4-d128-float16", storage=url).user_attrs["fasttree_settings"]
    assert settings["heldout"] == "split" and settings["every"] == 16 and settings["target"] == "tree_attention"
    assert settings["model"] == str(MODEL) and len(settings["model_sha256"]) == 64
    before = _trials(studies / "fasttree-tune.db")
    # no --model, --every, --targets or --heldout: the studies' own settings
    out = tmp_path / "export.json"
    assert main(["export", str(own_workload), "--studies", str(studies), "-o", str(out), "--jobs", "1"]) == 0
    text = capsys.readouterr().out
    assert "held out: the last fifth of each workload" in text and "tree_attention g4-d128-float16:" in text
    assert _trials(studies / "fasttree-tune.db") == before  # export ran no trial and made no study
    (entry,) = read_export(out).entries
    assert entry.target == "tree_attention"
    assert entry.provenance["validation_steps"] == 1 and entry.provenance["tuning_steps"] == 4  # 5 trees: 1 held out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--every", "4"], "was tuned with --every 16, this command passes --every 4"),
        (["--heldout", "none"], "leave --heldout out"),
        (["--targets", "runtime"], "holds no study fasttree-rt-g4-d128-float16"),
        (["--model", "{other}"], "was tuned with --model"),
    ],
)
def test_export_names_the_setting_that_differs_and_never_starts_trials(tmp_path, own_workload, capsys, extra, message):
    studies = tmp_path / "studies"
    assert main(["tune", str(own_workload), "--model", str(MODEL), "--out", str(studies), *QUICK]) == 0
    other = tmp_path / "other.skops"
    other.write_bytes(MODEL.read_bytes() + b"\0")
    before = _trials(studies / "fasttree-tune.db")
    capsys.readouterr()
    argv = ["export", str(own_workload), "--studies", str(studies), "-o", str(tmp_path / "e.json"), "--jobs", "1"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, *[a.format(other=other) for a in extra]])
    assert exc.value.code == 2
    assert message in _usage_error(capsys, "export")
    assert _trials(studies / "fasttree-tune.db") == before
    assert not (tmp_path / "e.json").exists()


def test_a_study_on_the_shipped_model_survives_a_reinstall(tmp_path):
    """A study records the model's path; the shipped model's is absolute, so a reinstall or moved
    environment leaves a path that no longer exists. ``reconcile`` then takes the shipped model when
    its bytes are the ones the study recorded, and asks for ``--model`` otherwise."""
    from fasttree.cli.study_settings import reconcile, sha256_file
    from fasttree.toolkit import shipped

    gone = str(tmp_path / "old-env" / "h200_latency_model.skops")
    recorded = {"fasttree-g4-d128-float16": {"model": gone, "model_sha256": sha256_file(shipped.model_path()),
                                             "every": 16, "heldout": "split"}}  # fmt: skip
    out = reconcile(recorded, model=None, every=None, heldout=None)
    assert out["model"] == str(shipped.model_path()) and out["every"] == 16 and out["heldout"] == "split"
    recorded["fasttree-g4-d128-float16"]["model_sha256"] = "0" * 64  # another model, gone
    with pytest.raises(ValueError, match="which no longer exists: pass --model"):
        reconcile(recorded, model=None, every=None, heldout=None)


def test_export_refuses_other_workloads_than_the_studies_tuned(tmp_path, own_workload, capsys):
    studies = tmp_path / "studies"
    assert main(["tune", str(own_workload), "--model", str(MODEL), "--out", str(studies), *QUICK]) == 0
    records = read_traces(own_workload, kind="workload").records
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in records[:4]))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["export", str(changed), "--studies", str(studies), "-o", str(tmp_path / "e.json")])
    assert "was tuned on other workloads" in _usage_error(capsys, "export")


def test_held_out_workloads_equal_to_the_tuning_ones_are_warned_about(tmp_path, own_workload, caplog):
    with caplog.at_level(logging.WARNING, logger="fasttree"):
        assert main(["tune", str(own_workload), "--heldout", str(own_workload), "--model", str(MODEL),
                     "--out", str(tmp_path), *QUICK]) == 0  # fmt: skip
    (warning,) = [r.getMessage() for r in caplog.records if "held-out steps" in r.getMessage()]
    assert "5 of the 5 held-out steps" in warning and "tuning data" in warning


# ----------------------------------------------------------------------------- defect 4: one output convention
#: Outputs other than --out: a second file beside the main one, or a file appended to.
SECONDARY_OUTPUTS = {
    ("tune", "json"),
    ("validate", "markdown"),
    ("confirm", "markdown"),
    ("validate", "traces_out"),
    ("headroom", "markdown"),
}


def test_every_subcommand_that_writes_names_its_output_dash_o_and_dash_dash_out():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    writers = []
    for name, p in sub.choices.items():
        defaults = p._defaults
        outputs = [*defaults.get("output_files", ()), *defaults.get("append_files", ())]
        if defaults.get("output_folder") or defaults.get("output_folder_files"):
            outputs.append("out")
        if not outputs:
            assert name in ("traces", "bench"), name  # traces prints; bench forwards its own --out
            continue
        writers.append(name)
        (out,) = [a for a in p._actions if a.dest == "out" and a.help != "==SUPPRESS=="]
        assert out.option_strings == ["-o", "--out"], name
        assert out.metavar in ("FILE", "DIR"), name
        for dest in outputs:
            assert dest == "out" or (name, dest) in SECONDARY_OUTPUTS, (name, dest)
    assert sorted(writers) == sorted(
        ["profile", "headroom", "fit", "evaluate", "tune", "export", "run", "validate", "confirm", "refine"]
    )


def test_an_unknown_option_names_the_subcommand(tmp_path, own_workload, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(own_workload), "--bogus", "x", "--out", str(tmp_path)])
    assert exc.value.code == 2
    line = _usage_error(capsys, "tune")
    assert "unrecognized arguments: --bogus x" in line


# ----------------------------------------------------------------------------- defect 5: evaluate, refine
def test_evaluate_folds_on_traces_without_repeated_trees_skips_the_rank_metrics(tmp_path, capsys, caplog):
    records = read_traces(ROOT / "traces" / "h200_smoke", kind="measurement").records
    seen, keep = set(), []
    for r in records:  # one measurement per tree: no tree has two
        tree = json.dumps(r["workload"]["tree"], sort_keys=True)
        if r["status"] == "ok" and tree not in seen:
            seen.add(tree)
            keep.append(r)
    single = tmp_path / "single.jsonl"
    single.write_text("".join(json.dumps(r) + "\n" for r in keep))
    argv = ["evaluate", str(single), "--folds", "2", "--n-estimators", "5", "--n-seeds", "1", "--workers", "1",
            "--jobs", "1", "-o", str(tmp_path / "m.json")]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fasttree"):
        assert main(argv) == 0
    assert any("rank metrics" in r.getMessage() for r in caplog.records)
    out = capsys.readouterr().out
    assert "mape" in out and "kendall" not in out and "published cost" not in out
    assert set(json.loads((tmp_path / "m.json").read_text())) == {"simulator", "learned (gbrt)"}


def test_refine_without_cuda_fails_at_once_in_one_line(tmp_path, own_workload, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for device in ("cpu", "cuda"):
        t0 = time.perf_counter()
        with pytest.raises(SystemExit) as exc:
            main(["refine", str(own_workload), "--config", str(EXPORT), "-o", str(tmp_path / "r.json"),
                  "--device", device])  # fmt: skip
        assert exc.value.code == 2 and time.perf_counter() - t0 < 10
        assert "no CUDA GPU is visible" in _usage_error(capsys, "refine")
    assert not (tmp_path / "r.json").exists()
    (sub,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    help_text = sub.choices["refine"].format_help()
    assert "smoke" not in help_text and "cpu" not in help_text.split("--device", 1)[1]


# ----------------------------------------------------------------------------- defect 6: outputs, Ctrl-C
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["fit", "traces/h200_smoke", "-o", "/proc/x.skops"], "--out /proc/x.skops"),
        (["tune", "{workload}", "--json", "/proc/x.json"], "--json /proc/x.json"),
        (["export", "{workload}", "-o", "/proc/x.json"], "--out /proc/x.json"),
        (["run", "--out", "/proc/x"], "--out /proc/x"),
        (["fit", "traces/h200_smoke", "-o", "{folder}", "--overwrite"], "--out {folder}: is a folder"),
        (["evaluate", "traces/h200_smoke", "-o", "{folder}"], "--out {folder}: is a folder"),
    ],
)
def test_unwritable_outputs_are_refused_before_any_work(tmp_path, own_workload, capsys, monkeypatch, argv, flag):
    monkeypatch.chdir(ROOT)
    folder = tmp_path / "a_folder"
    folder.mkdir()
    values = {"workload": own_workload, "folder": folder}
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        main([a.format(**values) for a in argv])
    assert exc.value.code == 2
    assert time.perf_counter() - t0 < 5  # refused before reading traces, fitting or tuning
    assert flag.format(**values) in _usage_error(capsys, argv[0])
    assert list(folder.iterdir()) == []


def test_ctrl_c_in_tune_ends_with_one_line_saying_what_was_kept(tmp_path, own_workload, capsys, monkeypatch):
    from fasttree.tuner import study

    real = study.run_trials

    def interrupted(s, objective, *, n_trials, timeout=None, progress=False):
        real(s, objective, n_trials=1, timeout=timeout, progress=progress)
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "run_trials", interrupted)
    argv = ["tune", str(own_workload), "--model", str(MODEL), "--out", str(tmp_path), "--trials", "2",
            "--polish-passes", "0", "--no-progress"]  # fmt: skip
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    assert line.startswith("fasttree-tune tune: interrupted; the studies in")
    assert "keep every complete trial" in line and "resume" in line
    assert _complete(tmp_path / "fasttree-tune.db") == {"fasttree-g4-d128-float16": 1}
    monkeypatch.setattr(study, "run_trials", real)
    assert main(argv) == 0  # resumes to 2 complete trials
    assert _complete(tmp_path / "fasttree-tune.db") == {"fasttree-g4-d128-float16": 2}


# ----------------------------------------------------------------------------- defect 7: the frozen test
def test_confirm_refuses_measurements_of_the_frozen_test(tmp_path, capsys):
    import hashlib

    # the committed frozen-test measurements, as if they had measured today's committed export
    measured = json.loads((ROOT / "docs" / "tune" / "validation.json").read_text())
    measured["export_sha256"] = hashlib.sha256(EXPORT.read_bytes()).hexdigest()
    (tmp_path / "validation.json").write_text(json.dumps(measured))
    with pytest.raises(SystemExit) as exc:
        main(["confirm", "--config", str(EXPORT), "--measured", str(tmp_path / "validation.json"),
              "-o", str(tmp_path / "c.json")])  # fmt: skip
    assert exc.value.code == 2
    line = _usage_error(capsys, "confirm")
    assert "frozen test split" in line and "workloads_test" in line
    assert not (tmp_path / "c.json").exists()


def test_validate_measures_the_validation_split_by_default():
    from fasttree.toolkit.shipped import workloads_path

    args = build_parser().parse_args(["validate", "--config", "e.json", "--traces-out", "t.jsonl"])
    assert [Path(p) for p in args.workloads] == [workloads_path("heldout")]
    assert args.split == "all"
    readme = (ROOT / "README.md").read_text()
    assert "workloads_test" not in readme.split("## Use")[0]  # the README's steps never measure the test


# ----------------------------------------------------------------------------- defect 8: an export for other GPUs
def test_an_export_without_this_gpu_warns_naming_its_gpus_and_how_to_tune(caplog):
    from fasttree import FastTreeConfig, load_portfolio

    with caplog.at_level(logging.INFO, logger="fasttree"):
        p = load_portfolio(EXPORT, gpu="NVIDIA H100 80GB HBM3", num_q_heads=32, num_kv_heads=8, head_dim=128,
                           dtype="float16")  # fmt: skip
    assert p.members == (FastTreeConfig(),)
    (w,) = [r for r in caplog.records if r.levelno == logging.WARNING and "NVIDIA H100" in r.getMessage()]
    assert "'NVIDIA H200'" in w.getMessage() and "fasttree-tune profile" in w.getMessage()
    assert "docs/walkthrough.md" in w.getMessage()


def test_docs_cite_nothing_a_clone_cannot_reach():
    owned = [p for p in (ROOT / "docs").glob("*.md") if p.name != "runtime.md"]  # runtime.md: the runtime issue's
    owned += [ROOT / "README.md", ROOT / "traces" / "README.md", ROOT / "bench" / "README.md"]
    for page in owned:
        text = page.read_text()
        assert "lab-archive" not in text, page
        assert "costmodel_notes" not in text, page
    assert not (ROOT / "docs" / "costmodel_notes.md").exists()


# ----------------------------------------------------------------------------- defect 9: traces, repr, labels
def test_traces_refuses_a_workload_file_and_an_empty_folder(tmp_path, own_workload, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["traces", str(own_workload)])
    assert exc.value.code == 2
    assert "5 workload lines and no measurement lines" in _usage_error(capsys, "traces")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["traces", str(empty)])
    assert exc.value.code == 2 and "no trace files" in _usage_error(capsys, "traces")


def test_traces_logs_progress_per_file(tmp_path, capsys, caplog):
    for i in range(2):
        shutil.copy(ROOT / "traces" / "h200_smoke" / "run0_smoke_1fd251a.jsonl", tmp_path / f"t{i}.jsonl")
    with caplog.at_level(logging.INFO, logger="fasttree"):
        assert main(["traces", str(tmp_path)]) == 0
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("read ")]
    assert [m.split(":")[0] for m in progress] == [f"read 1/2 {tmp_path / 't0.jsonl'}",
                                                   f"read 2/2 {tmp_path / 't1.jsonl'}"]  # fmt: skip
    assert "2 file(s)" in capsys.readouterr().out


def test_a_plans_repr_is_short():
    import fasttree as ft

    tree = ft.KVTree(parents=[-1, 0, 0], node_slots=[range(0, 100), range(100, 130), range(130, 170)],
                     query_nodes=[1, 2, 2])  # fmt: skip
    plan = ft.plan(tree, ft.FastTreeConfig(), num_q_heads=32, num_kv_heads=8, head_dim=128)
    text = repr(plan)
    assert len(text) < 200 and text.startswith("Plan(n_queries=3, heads=32/8, head_dim=128") and "array" not in text


def _fake_gpu(monkeypatch, name: str) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)


def test_validate_on_a_gpu_the_export_has_no_entry_for_stops_before_measuring(tmp_path, monkeypatch, capsys):
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--config", str(ROOT / "docs" / "tune" / "run_export.json"), "--steps", "1",
              "--traces-out", str(tmp_path / "t.jsonl"), "-o", str(tmp_path / "v.json")])  # fmt: skip
    assert exc.value.code == 2
    line = _usage_error(capsys, "validate")
    assert "no entry for this GPU ('NVIDIA H100 80GB HBM3'" in line and "'NVIDIA H200'" in line
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "v.json").exists()


def test_validate_of_an_export_no_entry_of_which_is_served_stops_before_measuring(tmp_path, monkeypatch, capsys):
    from fasttree.export import ExportGuard

    doc = json.loads((ROOT / "docs" / "tune" / "run_export.json").read_text())
    for entry in doc["entries"]:
        entry["guard"] = dict(ExportGuard.current("0" * 64).to_dict(), defaults="0123456789abcdef")
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(doc))
    _fake_gpu(monkeypatch, "NVIDIA H200")
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--config", str(stale), "--steps", "1", "--traces-out", str(tmp_path / "t.jsonl")])
    assert exc.value.code == 2
    line = _usage_error(capsys, "validate")
    assert "none of its 6 entries for 'NVIDIA H200'" in line and "0123456789abcdef" in line
    assert "re-tune" in line and not (tmp_path / "t.jsonl").exists()


def test_validate_goes_on_when_an_entry_for_this_gpu_is_served():
    from fasttree.cli.tune import _nothing_to_validate

    export = read_export(ROOT / "docs" / "tune" / "run_export.json")
    assert _nothing_to_validate(export, "NVIDIA H200") is None
    assert _nothing_to_validate(export, "NVIDIA A100") is not None
