"""Trace summaries: counts per split and family, profiling rate, repeat spread; `fasttree-tune traces`."""

from __future__ import annotations

import json

import pytest
from test_traces import measurement, write_lines

from fasttree.cli import main
from fasttree.toolkit.trace_stats import trace_stats
from fasttree.traces import read_traces


def _line(seed, *, split=None, run="r1", minute=0, graph=10.0, status="ok", family="random_recursive"):
    timing = {
        "graph_us": {"median": graph, "p20": graph, "p80": graph, "replays": 30, "calls_per_graph": 20},
        "eager_us": {"median": 30.0},
    }
    extra = {"timing": timing}
    if status == "failed":
        extra = {
            "status": "failed",
            "error": "OutOfResources: fake",
            "timing": None,
            "correct": None,
            "max_rel_err": None,
        }
    rec = measurement(seed, family=family, time_utc=f"2026-11-29T10:{minute:02d}:00.000000Z", **extra)
    rec["meta"] = ({"profiler": {"run_id": run}} if run else {}) | ({"split": split} if split else {})
    return rec


@pytest.fixture
def trace_dir(tmp_path):
    lines = [_line(i, split="train", minute=i // 4) for i in range(20)]  # run r1: 20 lines over 4 minutes
    lines += [_line(100, split="train", run="r2", graph=10.0), _line(100, split="train", run="r2", graph=12.0)]
    lines += [_line(200, split="heldout", run="r3", family="beam_search", status="failed")]
    write_lines(tmp_path / "a.jsonl", lines)
    write_lines(tmp_path / "b.jsonl", [_line(300, run=None)])  # unmarked, not from the profiler
    return tmp_path


def test_trace_stats_counts_rate_and_spread(trace_dir):
    stats = trace_stats(read_traces(trace_dir))
    assert stats.counts == {
        ("train", "random_recursive", "ok"): 21,  # key 100's second line is a repeat, counted apart
        ("heldout", "beam_search", "failed"): 1,
        ("unmarked", "random_recursive", "ok"): 1,
    }
    assert stats.lines == 23 and stats.repeat_lines == 1 and stats.gpus == ["NVIDIA H200"]
    assert stats.runs["r1"] == (20, 4.0)
    assert stats.per_minute() == pytest.approx(5.0)  # r2 and r3 are too short to time
    # key 100 measured 10 and 12 us: median 11, both 1/11 away
    assert stats.repeated_keys == 1
    assert stats.spread_median == pytest.approx(1 / 11) and stats.spread_p90 == pytest.approx(1 / 11)


def test_cli_traces_prints_the_summary(trace_dir, capsys):
    assert main(["traces", str(trace_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 file(s), 24 valid line(s), 0 invalid" in out
    assert "heldout    beam_search              0       1" in out
    assert "lines per minute: 5.0" in out
    assert "1 keys; median relative deviation 9.09%" in out
    assert "repeat lines (a key measured again; not counted above): 1" in out


def test_cli_traces_reports_bad_lines(tmp_path, capsys):
    path = write_lines(tmp_path / "bad.jsonl", [_line(1), "{not json", json.dumps({"schema": "other"})])
    with pytest.raises(SystemExit) as exc:
        main(["traces", str(path)])
    assert exc.value.code == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["traces", "--skip-invalid", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 valid line(s), 2 invalid" in out and "bad.jsonl:3" in out
    assert "repeat measurements: none" in out
