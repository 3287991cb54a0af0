"""``fasttree-tune`` (CPU): duration parsing, the parser, and the real entry points (``python -m
fasttree.cli`` and the installed ``fasttree-tune`` script) for help, bad arguments and a missing GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fasttree.cli as cli
import fasttree.toolkit.profiler as prof
from fasttree.cli import build_parser, main, parse_duration

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "fasttree-tune"


def run_cli(*args: str, script: bool = False, no_gpu: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(SCRIPT)] if script else [sys.executable, "-m", "fasttree.cli"]
    env = dict(os.environ)
    if no_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, on a GPU machine too
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


# ------------------------------------------------------------------ durations
@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60s", 60), ("10m", 600), ("1h", 3600), ("90", 90), ("1.5h", 5400), (" 2M ", 120), ("0.5", 0.5), (".5m", 30)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "10x", "-5", "0", "0s", "1e3", "inf", "nan", "10 minutes", "1h30m", "5d"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_parse_duration_rejects_non_strings():
    with pytest.raises(ValueError):
        parse_duration(60)


# ------------------------------------------------------------------ parser
def test_parser_profile_defaults_and_options():
    args = build_parser().parse_args(["profile", "--out", "t.jsonl"])
    assert (args.command, args.out, args.budget, args.points, args.seed) == ("profile", "t.jsonl", None, None, 0)
    assert (args.design, args.buckets, args.trees, args.configs) == ("sampled", None, None, None)
    assert (args.families, args.precompile, args.progress, args.check_every) == (None, True, True, 10)
    assert args.repeat_every == 20
    assert (args.verbose, args.log_level) == (0, None)
    args = build_parser().parse_args(
        [
            "profile",
            "--out",
            "t.jsonl",
            "--budget",
            "10m",
            "-n",
            "50",
            "--seed",
            "3",
            "--families",
            "beam_search,no_sharing",
            "--no-precompile",
            "--no-progress",
            "--check-every",
            "0",
        ]
    )
    assert args.budget == 600 and args.points == 50 and args.seed == 3
    assert args.families == ["beam_search", "no_sharing"]
    assert (args.precompile, args.progress, args.check_every) == (False, False, 0)


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "profile", "--out", "t.jsonl"],
        ["profile", "-v", "--out", "t.jsonl"],
        ["profile", "--out", "t.jsonl", "--verbose"],
    ],
)
def test_shared_flags_go_before_or_after_the_subcommand(argv):
    args = build_parser().parse_args(argv)
    assert args.verbose == 1


def test_log_level_before_the_subcommand_survives_the_subparser():
    args = build_parser().parse_args(["--log-level", "debug", "profile", "--out", "t.jsonl"])
    assert args.log_level == "DEBUG"
    args = build_parser().parse_args(["profile", "--out", "t.jsonl", "--log-level", "warning"])
    assert args.log_level == "WARNING"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "SUBCOMMAND"),
        (["tuen"], "invalid choice: 'tuen'"),
        (["fit", "t.jsonl"], "--out"),
        (["evaluate"], "TRACES"),
        (["evaluate", "t.jsonl", "--folds", "1"], "argument --folds: expected an integer >= 2, got 1"),
        (
            ["fit", "t.jsonl", "-o", "m.json", "--n-estimators", "0"],
            "argument --n-estimators: expected an integer >= 1",
        ),
        (["fit", "t.jsonl", "-o", "m.json", "--workers", "x"], "argument --workers: expected an integer >= 1, got 'x'"),
        (["profile"], "--out"),
        (["profile", "--out", "t.jsonl", "--budget", "10x"], "argument --budget: invalid duration '10x'"),
        (["profile", "--out", "t.jsonl", "--budget", "0"], "argument --budget: invalid duration '0'"),
        (["profile", "--out", "t.jsonl", "-n", "0"], "argument -n/--points: expected a positive integer"),
        (["profile", "--out", "t.jsonl", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
        (["profile", "--out", "t.jsonl", "--families", "trees"], "unknown tree family trees"),
        (["profile", "--out", "t.jsonl", "--check-every", "x"], "argument --check-every"),
        (["--log-level", "loud", "profile", "--out", "t.jsonl"], "argument --log-level"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_main_without_gpu_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["profile", "--out", str(tmp_path / "t.jsonl")])
    assert info.value.code == 2
    assert "no CUDA GPU found" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()


def test_main_refuses_a_gzip_output(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["profile", "--out", str(tmp_path / "t.jsonl.gz")])
    assert info.value.code == 2
    assert "write a .jsonl file" in capsys.readouterr().err


def test_main_passes_the_options_to_profile(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_profile(out, **kw):
        seen.update(kw, out=out)
        return prof.ProfileSummary(points=kw["n"], measured=kw["n"], elapsed_s=1.0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prof, "profile", fake_profile)
    out = str(tmp_path / "t.jsonl")
    argv = ["profile", "--out", out, "--budget", "1h", "-n", "12", "--seed", "5", "--families", "few_shot"]
    argv += ["--no-precompile", "--no-progress", "--check-every", "3", "--split", "heldout", "--repeat-every", "0"]
    argv += ["--runtime"]
    rc = main(argv)
    assert rc == 0
    assert seen == {
        "split": "heldout",
        "out": out,
        "n": 12,
        "seed": 5,
        "budget_s": 3600.0,
        "families": ["few_shot"],
        "precompile": False,
        "progress": False,
        "check_every": 3,
        "repeat_every": 0,
        "runtime": True,
    }
    assert "12 measured" in capsys.readouterr().out


def test_main_exits_1_when_the_run_was_aborted(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prof, "profile", lambda out, **kw: prof.ProfileSummary(aborted="GPU lost (fake)"))
    assert main(["profile", "--out", str(tmp_path / "t.jsonl")]) == 1


def test_main_turns_a_value_error_of_the_run_into_exit_2(monkeypatch, capsys, tmp_path):
    def bad(out, **kw):
        raise ValueError("something named wrong (fake)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prof, "profile", bad)
    with pytest.raises(SystemExit) as info:
        main(["profile", "--out", str(tmp_path / "t.jsonl")])
    assert info.value.code == 2
    assert "something named wrong (fake)" in capsys.readouterr().err


def test_verbose_sets_fasttree_loggers_to_debug(monkeypatch, tmp_path):
    import logging

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prof, "profile", lambda out, **kw: prof.ProfileSummary())
    logger = logging.getLogger("fasttree")
    old = logger.level
    try:
        main(["-v", "profile", "--out", str(tmp_path / "t.jsonl")])
        assert logger.level == logging.DEBUG
        main(["profile", "--out", str(tmp_path / "t.jsonl"), "--log-level", "ERROR", "-v"])
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(old)


# ------------------------------------------------------------------ real entry points
@pytest.mark.parametrize("script", [False, True], ids=["python-m", "fasttree-tune"])
def test_help_explains_the_subcommands(script):
    if script:
        assert SCRIPT.exists(), f"{SCRIPT} missing: 'pip install -e .' installs the fasttree-tune script"
    top = run_cli("--help", script=script)
    assert top.returncode == 0, top.stderr
    assert "usage: fasttree-tune" in top.stdout and "profile" in top.stdout and "SUBCOMMAND --help" in top.stdout
    sub = run_cli("profile", "--help", script=script)
    assert sub.returncode == 0, sub.stderr
    for flag in (
        "--out",
        "--budget",
        "--points",
        "--seed",
        "--families",
        "--no-precompile",
        "--no-progress",
        "--check-every",
        "--verbose",
        "--log-level",
    ):
        assert flag in sub.stdout, flag
    assert "Sobol" in sub.stdout and "Resumable" in sub.stdout


@pytest.mark.parametrize("script", [False, True], ids=["python-m", "fasttree-tune"])
def test_bad_budget_exits_2(script, tmp_path):
    r = run_cli("profile", "--out", str(tmp_path / "t.jsonl"), "--budget", "10x", script=script)
    assert r.returncode == 2
    assert "argument --budget: invalid duration '10x'" in r.stderr
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("script", [False, True], ids=["python-m", "fasttree-tune"])
def test_no_gpu_exits_2_with_a_clear_message(script, tmp_path):
    r = run_cli("profile", "--out", str(tmp_path / "t.jsonl"), "--budget", "60s", script=script)
    assert r.returncode == 2
    assert "fasttree-tune profile: error: no CUDA GPU found" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "t.jsonl").exists()


def test_importing_the_package_and_cli_pulls_no_optional_dependency():
    code = (
        "import sys, fasttree, fasttree.toolkit.profiler, fasttree.cli; "
        "bad = [m for m in ('scipy', 'sklearn', 'optuna') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr


def test_cli_module_exports():
    assert set(cli.__all__) == {"build_parser", "main", "parse_duration"}
