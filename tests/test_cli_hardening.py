"""Issue 38 through the real entry points (``python -m fasttree.cli``, ``python -m fasttree``): crafted inputs
get one clear error line and exit status 2, in bounded memory, and the CLI's rough edges are gone.

The memory tests run the command under an address-space limit (``RLIMIT_AS``): what the same command
needs on a small valid input plus 1 GiB, far below what the crafted input would take if it were read
whole or allocated per token.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fasttree.traces import MAX_LINE_BYTES, read_traces

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "fasttree" / "toolkit" / "data" / "workloads" / "paper_suite.jsonl.gz"
MODEL = ROOT / "costmodel" / "data" / "h200_latency_model.skops"

resource = pytest.importorskip("resource")
_HAS_PROC = Path("/proc/self/status").exists()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = "1"  # the address space of thread pools grows with the machine's cores
    return env


def run(*args: str, module: str = "fasttree.cli", limit: int | None = None, cwd: Path = ROOT, timeout: int = 300):
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=timeout,
        preexec_fn=cap if limit else None,
    )


def peak_address_space(*args: str) -> int:
    """Bytes of address space ``fasttree-tune ARGS`` peaks at (VmPeak); the command must succeed."""
    code = (
        "import sys\n"
        "from fasttree.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "peak = [l for l in open('/proc/self/status') if l.startswith('VmPeak:')][0].split()[1]\n"
        "print('VMPEAK', peak, file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    kb = next(line.split()[1] for line in r.stderr.splitlines() if line.startswith("VMPEAK"))
    return int(kb) * 1024


def assert_usage_error(r: subprocess.CompletedProcess, command: str, *fragments: str) -> str:
    """Exit status 2, no traceback, and the last stderr line is argparse's one error line holding ``fragments``."""
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{command}: error: "), line
    for fragment in fragments:
        assert fragment in line, line
    return line


def small_workload(path: Path, *, kv_heads: int = 1, every: int = 15) -> Path:
    records = read_traces(PAPER, kind="workload").records
    keep = [r for r in records if r["num_kv_heads"] == kv_heads and int(r["workload"]["step"]) % every == 0]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return path


# ------------------------------------------------------------------ D2: one huge line
@pytest.mark.skipif(not _HAS_PROC, reason="reads VmPeak from /proc (Linux)")
def test_traces_refuses_a_3_gib_line_in_bounded_memory(tmp_path):
    # 3 GiB of one line in a 3 MB gzip: 3072 gzip members of 1 MiB each (a reader inflates them back to back)
    member = gzip.compress(b"x" * 2**20, compresslevel=9)
    huge = tmp_path / "huge.jsonl.gz"
    with open(huge, "wb") as f:
        for _ in range(3 * 1024):
            f.write(member)
    assert huge.stat().st_size < 8 * 2**20
    small = ROOT / "traces" / "h200_smoke" / "run0_smoke_1fd251a.jsonl"  # a valid measurement file
    limit = peak_address_space("traces", str(small)) + 2**30  # 1 GiB more than reading a valid file needs
    ok = run("traces", str(small), limit=limit)
    assert ok.returncode == 0, ok.stderr
    r = run("traces", str(huge), limit=limit)
    assert_usage_error(r, "fasttree-tune traces", f"{huge}:1: a line longer than {MAX_LINE_BYTES} bytes")
    assert "MemoryError" not in r.stderr


# ------------------------------------------------------------------ D3: a node of 2**31 - 1 tokens
@pytest.mark.skipif(not _HAS_PROC, reason="reads VmPeak from /proc (Linux)")
def test_tune_refuses_a_tree_beyond_the_resource_limits_at_read_time(tmp_path):
    record = json.loads(small_workload(tmp_path / "one.jsonl").read_text().splitlines()[0])
    record["workload"]["tree"] = {"parents": [-1], "lengths": [2**31 - 1], "query_nodes": [0]}
    crafted = tmp_path / "crafted.jsonl"
    crafted.write_text(json.dumps(record) + "\n")
    assert crafted.stat().st_size < 1024
    # the same command on the valid file: model, workloads, one trial and its polish
    args = ["--model", str(MODEL), "--trials", "1", "--polish-passes", "0", "--no-progress"]
    limit = peak_address_space("tune", str(tmp_path / "one.jsonl"), *args, "--out", str(tmp_path / "ok")) + 2**30
    r = run("tune", str(crafted), *args, "--out", str(tmp_path / "out"), limit=limit, timeout=120)
    assert_usage_error(r, "fasttree-tune tune", f"{crafted}:1:", "a node holds 2147483647 tokens", "16777216")
    assert not (tmp_path / "out").exists()


def test_tune_refuses_workloads_holding_more_tokens_than_a_run_takes(tmp_path):
    from fasttree.traces import MAX_TREE_TOKENS, MAX_WORKLOAD_TOKENS

    record = json.loads(small_workload(tmp_path / "one.jsonl").read_text().splitlines()[0])
    record["workload"]["tree"] = {"parents": [-1], "lengths": [MAX_TREE_TOKENS], "query_nodes": [0]}
    n = MAX_WORKLOAD_TOKENS // MAX_TREE_TOKENS + 1  # each line within the limits, together beyond the budget
    crafted = tmp_path / "many.jsonl"
    crafted.write_text((json.dumps(record) + "\n") * n)
    r = run("tune", str(crafted), "--model", str(MODEL), "--trials", "1", "--out", str(tmp_path / "out"))
    assert_usage_error(r, "fasttree-tune tune", f"hold {n * MAX_TREE_TOKENS} KV tokens in all", "MAX_WORKLOAD_TOKENS")


# ------------------------------------------------------------------ D15 + D16: --skip-invalid, no bar in a log
def test_tune_skips_invalid_lines_and_draws_no_bar_into_a_pipe(tmp_path):
    wl = small_workload(tmp_path / "wl.jsonl")
    lines = wl.read_text().splitlines()
    wl.write_text("\n".join([lines[0], '{"schema": "oops"}', *lines[1:]]) + "\n")
    common = ["--model", str(MODEL), "--trials", "1", "--polish-passes", "0", "--out", str(tmp_path / "o")]
    r = run("tune", str(wl), *common)
    assert_usage_error(r, "fasttree-tune tune", f"{wl}:2: schema must be")
    r = run("tune", str(wl), *common, "--skip-invalid")  # progress bar not turned off: stderr is a pipe
    assert r.returncode == 0, r.stderr
    assert f"skipped 1 invalid trace line(s); first: {wl}:2" in r.stderr
    assert "\r" not in r.stderr and "trial/s" not in r.stderr, "a progress bar was drawn into a pipe"
    assert "g16-d128-float16" in r.stdout


def test_progress_bar_only_on_a_terminal(tmp_path):
    import io

    from fasttree.cli.args import progress_bar_wanted

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_bar_wanted(True, Tty())
    assert not progress_bar_wanted(False, Tty())
    assert not progress_bar_wanted(True, io.StringIO())
    with open(tmp_path / "log", "w") as f:
        assert not progress_bar_wanted(True, f)
    assert not progress_bar_wanted(True, f)  # closed: isatty raises ValueError


# ------------------------------------------------------------------ D8 + D10: python -m fasttree, --version
def test_python_m_fasttree_without_a_gpu_or_interpreter_is_one_line():
    env = _env()
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "fasttree", "--case", "1"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)  # fmt: skip
    line = assert_usage_error(r, "python -m fasttree", "no CUDA GPU found", "TRITON_INTERPRET=1")
    assert r.stdout == "" and line == r.stderr.strip().splitlines()[-1]


def test_python_m_fasttree_refuses_bad_heads_in_one_line():
    env = {**_env(), "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "fasttree", "--num-q-heads", "3", "--num-kv-heads", "2"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert_usage_error(r, "python -m fasttree", "num_q_heads (3) must be a multiple of num_kv_heads (2)")


@pytest.mark.parametrize("module", ["fasttree.cli", "fasttree"])
def test_version(module):
    import fasttree

    r = run("--version", module=module)
    assert r.returncode == 0, r.stderr
    prog = "fasttree-tune" if module == "fasttree.cli" else "python -m fasttree"
    assert r.stdout.strip() == f"{prog} {fasttree.__version__}"


def test_top_level_help_names_every_subcommand():
    r = run("--help")
    assert r.returncode == 0
    description = r.stdout.split("options:")[0]
    commands = ("profile", "traces", "headroom", "fit", "evaluate", "tune", "export", "run", "validate", "refine")
    for command in (*commands, "bench"):
        assert f" {command} " in description, command


# ------------------------------------------------------------------ D5 + D6: export after run, run's --timeout
def test_export_reuses_the_every_setting_the_studies_were_tuned_with(tmp_path):
    records = read_traces(PAPER.parent / "chain_reasoning_mistral_7b.jsonl.gz", kind="workload").records[:80]
    wl = tmp_path / "long.jsonl"  # one workload of 80 steps: --every thins it
    wl.write_text("".join(json.dumps(r) + "\n" for r in records))
    folder = tmp_path / "run"
    common = ["--model", str(MODEL)]
    r = run("tune", str(wl), *common, "--every", "4", "--trials", "1", "--polish-passes", "0", "--out", str(folder))
    assert r.returncode == 0, r.stderr
    export = ["export", str(wl), "--studies", str(folder), "-o", str(tmp_path / "x.json"), "--jobs", "1"]
    r = run(*export, "--every", "8")
    line = assert_usage_error(r, "fasttree-tune export", "was tuned with --every 4", "leave --every out")
    assert "another objective" not in line
    r = run(*export)  # the study's --every 4 (and model, held-out split, target)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "x.json").exists()


def test_run_tunes_a_fixed_trial_count_without_a_time_limit():
    """``run``'s studies stop at a trial count, not after a time: the same workloads, model and seed
    give the same export on a fast or a slow host (a time limit would cut them at whatever trial
    the host reached). Its help states the defaults it runs with."""
    from fasttree.cli import build_parser
    from fasttree.cli.tune import RUN_EVERY, RUN_TRIALS, TUNE_TRIALS

    r = run("run", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert f"(default {RUN_TRIALS})" in text and "default: none" in text
    assert f"default {RUN_EVERY};" in text
    args = build_parser().parse_args(["run"])
    assert (args.trials, args.timeout, args.every) == (RUN_TRIALS, None, RUN_EVERY)
    assert build_parser().parse_args(["tune", "x"]).trials == TUNE_TRIALS
    assert build_parser().parse_args(["run", "--timeout", "90s"]).timeout == 90.0


# ------------------------------------------------------------------ D11: one --out convention, one overwrite rule
@pytest.mark.parametrize(
    ("command", "argv", "flag"),
    [
        ("fit", ["traces/h200_smoke", "-o", "{existing}"], "--out"),
        ("headroom", ["traces/h200_smoke", "-o", "{existing}"], "--out"),
        ("headroom", ["traces/h200_smoke", "--markdown", "{existing}"], "--markdown"),
        ("evaluate", ["traces/h200_smoke", "--model", "{model}", "-o", "{existing}"], "--out"),
        ("tune", ["{workload}", "--json", "{existing}"], "--json"),
        ("export", ["{workload}", "-o", "{existing}"], "--out"),
        ("refine", ["--config", "docs/tune/export.json", "--out", "{existing}"], "--out"),
        ("validate", ["--config", "docs/tune/export.json", "--traces-out", "{tmp}/t.jsonl", "-o", "{existing}"],
         "--out"),
    ],
)  # fmt: skip
def test_every_subcommand_refuses_an_existing_output_without_overwrite(tmp_path, command, argv, flag):
    existing = tmp_path / "existing.json"
    existing.write_text("{}\n")
    values = {"existing": existing, "model": MODEL, "workload": small_workload(tmp_path / "w.jsonl"), "tmp": tmp_path}
    r = run(command, *[a.format(**values) for a in argv])
    assert_usage_error(r, f"fasttree-tune {command}", f"{flag} {existing} exists; pass --overwrite to replace it")
    assert existing.read_text() == "{}\n"


def test_run_refuses_to_replace_a_finished_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "export.json").write_text("{}\n")
    r = run("run", "--out", str(out))
    assert_usage_error(r, "fasttree-tune run", f"{out / 'export.json'} exists", "--overwrite")
    assert "--overwrite" in " ".join(run("run", "--help").stdout.split())


def test_bench_refuses_to_replace_its_reports(tmp_path):
    (tmp_path / "kernel_x.md").write_text("old\n")
    r = run("bench", "--", "--out", str(tmp_path), "--label", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'kernel_x.md'} exist; pass --overwrite" in r.stderr.strip().splitlines()[-1]


def test_a_missing_model_is_one_clean_line(tmp_path):
    missing = tmp_path / "nope.skops"
    for command in (["evaluate", "traces/h200_smoke"], ["tune", str(small_workload(tmp_path / "w.jsonl"))]):
        r = run(*command, "--model", str(missing))
        line = assert_usage_error(r, f"fasttree-tune {command[0]}", f"--model {missing} does not exist")
        assert "Errno" not in line


def test_a_run_that_fails_early_leaves_no_empty_output_folder(tmp_path):
    out = tmp_path / "new" / "run"
    r = run("run", "--out", str(out), "--model", str(tmp_path / "nope.skops"), "--traces", str(tmp_path / "none"))
    assert_usage_error(r, "fasttree-tune run", f"--traces {tmp_path / 'none'}")
    assert not (tmp_path / "new").exists()
    r = run("tune", str(tmp_path / "missing.jsonl"), "--model", str(MODEL), "--out", str(out))
    assert_usage_error(r, "fasttree-tune tune", "no such trace file or folder")
    assert list(tmp_path.iterdir()) == []


def test_help_documents_the_output_convention():
    top = " ".join(run("--help").stdout.split())
    assert "--out (-o) is a FILE" in top and "a FOLDER for those that write several" in top
    for command, kind in [("fit", "FILE"), ("export", "FILE"), ("refine", "FILE"), ("profile", "FILE"),
                          ("tune", "FOLDER"), ("run", "FOLDER")]:  # fmt: skip
        text = " ".join(run(command, "--help").stdout.split())
        assert kind in text.split("--out", 1)[1], command
        if command != "profile":
            assert "--overwrite" in text, command


# ------------------------------------------------------------------ D7: a non-editable install runs from anywhere
@pytest.mark.skipif(not _HAS_PROC, reason="POSIX paths")
def test_a_wheel_install_runs_the_main_job_from_another_folder(tmp_path):
    """Build the wheel from a copy of the sources (the checkout stays clean), install it without its
    dependencies into a folder put first on PYTHONPATH, and run from a folder that holds nothing: the
    model and workloads come from the package (about 40 s on 2 CPU cores)."""
    import shutil

    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("fasttree", "kernels", "costmodel", "tuner"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("fasttree-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    here = tmp_path / "elsewhere"
    here.mkdir()
    env = {**_env(), "PYTHONPATH": str(site)}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fasttree.cli", *args], capture_output=True, text=True, env=env,
                              cwd=here, timeout=300)  # fmt: skip

    where = subprocess.run([sys.executable, "-c", "import fasttree; print(fasttree.__file__)"], capture_output=True,
                           text=True, env=env, cwd=here)  # fmt: skip
    assert where.stdout.strip() == str(site / "fasttree" / "__init__.py"), "the installed package is imported"
    assert cli("run", "--help").returncode == 0
    # --refit needs the measurement traces, which only a checkout has: one clear line, no folder left behind
    r = cli("run", "--refit")
    assert_usage_error(r, "fasttree-tune run", "--refit fits the model from measurement traces: pass --traces DIR")
    assert list(here.iterdir()) == []
    r = cli("run", "--trials", "1", "--polish-passes", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    export = json.loads((here / "fasttree-run" / "export.json").read_text())
    assert export["provenance"]["model_path"] == str(
        site / "fasttree" / "costmodel" / "data" / "h200_latency_model.skops"
    )
    assert (here / "fasttree-run" / "report.md").exists()
    r = cli("run", "--trials", "1")  # a finished run is replaced only with --overwrite
    assert_usage_error(r, "fasttree-tune run", "export.json exists", "--overwrite")


# ------------------------------------------------------------------ D14: buckets outside the model's training data
def test_tune_warns_once_per_bucket_outside_the_training_domain(tmp_path):
    from fasttree.costmodel.persist import load_model

    _, meta = load_model(MODEL)
    assert meta["extra"]["training_domain"] == {"group_sizes": [1, 4, 16], "head_dims": [64, 128]}
    lines = small_workload(tmp_path / "w.jsonl").read_text().splitlines()
    records = []
    for line in lines:
        d100, g8 = json.loads(line), json.loads(line)
        d100["head_dim"] = 100  # GQA 16 as trained, head dim never seen
        g8["num_q_heads"], g8["num_kv_heads"] = 32, 4  # GQA 8: only in the held-out traces
        records += [json.loads(line), d100, g8]
    wl = tmp_path / "mixed.jsonl"
    wl.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = run("tune", str(wl), "--model", str(MODEL), "--trials", "1", "--polish-passes", "0", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if "outside the model's training data" in line]
    assert len(warnings) == 2, warnings
    assert any("bucket g16-d100-float16: head dim 100 (trained on 64, 128)" in w for w in warnings)
    assert any("bucket g8-d128-float16: GQA ratio 8 (trained on 1, 4, 16)" in w for w in warnings)
    assert "g16-d128-float16:" not in " ".join(warnings)


def test_fit_records_the_training_domain(tmp_path):
    from fasttree.costmodel.dataset import load_dataset
    from fasttree.costmodel.persist import load_model

    out = tmp_path / "m.skops"
    args = ["fit", "traces/h200_smoke", "-o", str(out), "--n-estimators", "5", "--n-seeds", "1", "--jobs", "1"]
    r = run(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    _, meta = load_model(out)
    assert meta["extra"]["training_domain"] == load_dataset("traces/h200_smoke", workers=1).domain()
    assert set(meta["extra"]["training_domain"]) == {"group_sizes", "head_dims"}


# ------------------------------------------------------------------ D9 + the report
def test_study_table_labels_its_unitless_objective():
    from types import SimpleNamespace

    from fasttree.tuner import Bucket
    from fasttree.tuner.report import OBJECTIVE_NOTE, study_table

    b = Bucket.of(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16")
    r = SimpleNamespace(study_name="s-g4", n_complete=9, n_pruned=1, predicted_us=0.8, defaults_predicted_us=1.0,
                        speedup=1.25)  # fmt: skip
    table = study_table({b: r})
    assert "| g4-d128-float16 | s-g4 | 9 / 1 | 1 -> 0.8 | 1.250x |" in table
    assert table.endswith(OBJECTIVE_NOTE) and "unitless" in OBJECTIVE_NOTE


def test_run_report_names_model_date_time_and_holds_the_printed_table(tmp_path, capsys):
    from fasttree.cli import main

    wl = small_workload(tmp_path / "wl.jsonl", kv_heads=8)  # GQA 4
    (tmp_path / "ho").mkdir()
    small_workload(tmp_path / "ho" / "ho.jsonl", kv_heads=8)
    out = tmp_path / "out"
    argv = ["run", "--workloads", str(wl), "--heldout", str(tmp_path / "ho"), "--out", str(out), "--trials", "3",
            "--polish-passes", "0", "--targets", "tree_attention", "--jobs", "1", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    text = (out / "report.md").read_text()
    start = printed.index("| target | bucket | members |")
    table = printed[start : printed.index("\nexport: ", start)]
    assert table.count("\n") >= 2 and table in text, "the report's table is the one the command printed"
    assert "- date: 20" in text and "(UTC); run time " in text
    assert f"- model: `{MODEL}` (SHA-256 " in text
    summary = json.loads((out / "report.json").read_text())
    assert summary["model_sha256"] == hashlib.sha256(MODEL.read_bytes()).hexdigest()
    assert [(j["target"], j["bucket"]) for j in summary["jobs"]] == [("tree_attention", "g4-d128-float16")]
