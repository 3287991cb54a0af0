"""WorkloadRecorder: sampling, limits, the trace it writes and its argument checks (CPU only)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import fasttree as ft
from fasttree.recording import WorkloadRecorder
from fasttree.traces import decode_tree, encode_tree, read_traces

HEADS = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}


def tree_of(k: int) -> ft.KVTree:
    """A small tree, different for each k: a prompt, k % 3 + 1 branches, queries on them."""
    branches = k % 3 + 1
    return ft.KVTree.from_lengths([-1] + [0] * branches, [10 + k] + [3] * branches, list(range(1, branches + 1)))


def same_structure(a: ft.KVTree, b: ft.KVTree) -> bool:
    return (
        a.parents.tolist() == b.parents.tolist()
        and a.lengths.tolist() == b.lengths.tolist()
        and a.query_nodes.tolist() == b.query_nodes.tolist()
    )


def test_sampling_every_kth_call(tmp_path):
    path = tmp_path / "rec.jsonl"
    with WorkloadRecorder(path, every=4, **HEADS) as rec:
        got = [rec.record(1000 + k, tree_of(k)) for k in range(17)]
        assert rec.n_recorded == 5 and rec.n_calls == 17
    assert [k for k, g in enumerate(got) if g] == [0, 4, 8, 12, 16]
    records = read_traces(path, kind="workload").records
    assert [r["workload"]["step"] for r in records] == [1000, 1004, 1008, 1012, 1016]
    for r, k in zip(records, [0, 4, 8, 12, 16], strict=True):
        assert same_structure(decode_tree(r["workload"]["tree"]), tree_of(k))
        assert r["workload"]["family"] == "recorded" and r["workload"]["scenario"] == "server"
        assert r["workload"]["seed"] is None and r["weight"] == 1.0
        assert (r["num_q_heads"], r["num_kv_heads"], r["head_dim"], r["dtype"]) == (32, 8, 128, "float16")


def test_sampling_ignores_step_values(tmp_path):
    # the call count decides: the same step twice, steps going back, all fine
    with WorkloadRecorder(tmp_path / "r.jsonl", every=2, **HEADS) as rec:
        assert [rec.record(s, tree_of(0)) for s in (5, 5, 3, 0, 7)] == [True, False, True, False, True]


def test_every_one_records_all_and_fields(tmp_path):
    path = tmp_path / "sub" / "dir" / "rec.jsonl"  # folders are created
    rec = WorkloadRecorder(
        path,
        every=1,
        family="sglang",
        scenario="chat",
        seed=7,
        num_q_heads=16,
        num_kv_heads=16,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    trees = [tree_of(k) for k in range(3)]
    assert all(rec.record(k, t) for k, t in enumerate(trees))
    rec.close()
    records = read_traces(path, kind="workload").records
    assert len(records) == 3
    assert {r["workload"]["family"] for r in records} == {"sglang"}
    assert {r["workload"]["scenario"] for r in records} == {"chat"}
    assert {r["workload"]["seed"] for r in records} == {7}
    assert {r["dtype"] for r in records} == {"bfloat16"}
    assert [encode_tree(decode_tree(r["workload"]["tree"])) for r in records] == [encode_tree(t) for t in trees]


def test_recorded_tree_from_adapter_round_trips(tmp_path):
    from fasttree.adapter import tree_from_token_slots

    prompt = list(range(50))
    tree = tree_from_token_slots([prompt + [100 + j] * (j + 1) for j in range(4)] + [prompt])
    with WorkloadRecorder(tmp_path / "r.jsonl", **HEADS) as rec:
        assert rec.record(0, tree)
    (r,) = read_traces(tmp_path / "r.jsonl").records
    back = decode_tree(r["workload"]["tree"])
    assert same_structure(back, tree)
    assert back.num_tokens == tree.num_tokens


def test_max_records_stops_and_logs_once(tmp_path, caplog):
    path = tmp_path / "rec.jsonl"
    with caplog.at_level(logging.INFO, logger="fasttree.recording"):
        rec = WorkloadRecorder(path, every=2, max_records=3, **HEADS)
        got = [rec.record(k, tree_of(k)) for k in range(20)]
    assert sum(got) == 3 and [k for k, g in enumerate(got) if g] == [0, 2, 4]
    assert rec.n_recorded == 3 and not rec.active
    assert "max_records" in rec.stop_reason
    stops = [m for m in caplog.messages if "recording stopped" in m]
    assert len(stops) == 1 and "max_records (3)" in stops[0]
    assert len(read_traces(path)) == 3
    rec.close()
    assert "max_records" in rec.stop_reason  # close keeps the first reason


def test_max_tokens_stops_before_exceeding(tmp_path, caplog):
    path = tmp_path / "rec.jsonl"
    trees = [tree_of(k) for k in range(6)]
    tokens = [t.num_tokens for t in trees]  # 13, 17, 21, 16, 20, 24
    limit = sum(tokens[:3]) + tokens[3] - 1  # the 4th tree would pass it
    with caplog.at_level(logging.INFO, logger="fasttree.recording"):
        rec = WorkloadRecorder(path, every=1, max_tokens=limit, **HEADS)
        got = [rec.record(k, t) for k, t in enumerate(trees)]
    assert got == [True, True, True, False, False, False]
    assert rec.recorded_tokens == sum(tokens[:3]) <= limit
    assert "max_tokens" in rec.stop_reason
    assert len([m for m in caplog.messages if "recording stopped" in m]) == 1
    assert len(read_traces(path)) == 3
    # exactly at the limit is allowed
    with WorkloadRecorder(tmp_path / "b.jsonl", every=1, max_tokens=tokens[0], **HEADS) as rec:
        assert rec.record(0, trees[0]) and not rec.record(1, trees[0])


def test_max_bytes_bounds_the_file(tmp_path):
    path = tmp_path / "rec.jsonl"
    with WorkloadRecorder(path, every=1, **HEADS) as probe:
        probe.record(0, tree_of(0))
    line = path.stat().st_size
    path.unlink()
    with WorkloadRecorder(path, every=1, max_bytes=3 * line + line // 2, **HEADS) as rec:
        got = [rec.record(k, tree_of(0)) for k in range(10)]
        assert rec.recorded_bytes == 3 * line
    assert sum(got) == 3 and path.stat().st_size == 3 * line
    assert "max_bytes" in rec.stop_reason


def test_reopening_appends(tmp_path):
    path = tmp_path / "rec.jsonl"
    with WorkloadRecorder(path, every=1, max_records=2, **HEADS) as rec:
        for k in range(5):
            rec.record(k, tree_of(k))
    with WorkloadRecorder(path, every=1, max_records=2, scenario="second", **HEADS) as rec:
        for k in range(5):
            rec.record(10 + k, tree_of(k))
        assert rec.n_recorded == 2  # the limits count this recorder's records only
    records = read_traces(path, kind="workload").records
    assert [r["workload"]["step"] for r in records] == [0, 1, 10, 11]
    assert [r["workload"]["scenario"] for r in records] == ["server", "server", "second", "second"]


def test_reopening_repairs_a_torn_last_line(tmp_path):
    path = tmp_path / "rec.jsonl"
    with WorkloadRecorder(path, every=1, **HEADS) as rec:
        rec.record(0, tree_of(0))
    with open(path, "ab") as f:  # a write cut short by a crash
        f.write(b'{"schema": "fasttree-trace", "kind": "workl')
    with WorkloadRecorder(path, every=1, **HEADS) as rec:
        rec.record(1, tree_of(1))
    assert [r["workload"]["step"] for r in read_traces(path).records] == [0, 1]


def test_closed_recorder_records_nothing(tmp_path):
    rec = WorkloadRecorder(tmp_path / "r.jsonl", every=1, **HEADS)
    assert rec.record(0, tree_of(0))
    rec.close()
    rec.close()  # idempotent
    assert not rec.record(1, tree_of(1))
    assert rec.stop_reason == "closed" and rec.n_recorded == 1 and rec.n_calls == 2
    assert "stopped: closed" in repr(rec)


def test_unsampled_calls_check_nothing(tmp_path):
    with WorkloadRecorder(tmp_path / "r.jsonl", every=3, **HEADS) as rec:
        assert rec.record(0, tree_of(0))
        assert not rec.record(-5, "not a tree")  # not sampled: only counted
        assert not rec.record(None, None)
        assert rec.n_recorded == 1 and rec.n_calls == 3
    with WorkloadRecorder(tmp_path / "s.jsonl", every=1, **HEADS) as rec:  # sampled calls check
        with pytest.raises(ValueError, match=r"step must be >= 0, got -1"):
            rec.record(-1, tree_of(0))
        with pytest.raises(ValueError, match=r"tree must be a KVTree, got list"):
            rec.record(6, [[1, 2]])
        with pytest.raises(ValueError, match=r"step must be an integer, got 1.5"):
            rec.record(1.5, tree_of(0))
        assert rec.n_recorded == 0 and rec.active
        assert rec.record(7, tree_of(0))


def test_write_error_stops_recording(tmp_path, caplog, monkeypatch):
    with WorkloadRecorder(tmp_path / "r.jsonl", every=1, **HEADS) as rec:
        assert rec.record(0, tree_of(0))

        def disk_full(record):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(rec._writer, "append", disk_full)
        with caplog.at_level(logging.ERROR, logger="fasttree.recording"):
            assert not rec.record(1, tree_of(1))
        assert not rec.record(2, tree_of(2))
        assert rec.n_recorded == 1 and "write failed" in rec.stop_reason
        assert any("No space left" in m for m in caplog.messages)
    assert len(read_traces(tmp_path / "r.jsonl")) == 1


def test_big_tree_record(tmp_path):
    tree = ft.KVTree.from_levels([1, 4, 256], [2048, 512, 64])
    with WorkloadRecorder(tmp_path / "r.jsonl", **HEADS) as rec:
        assert rec.record(0, tree)
        assert rec.recorded_tokens == tree.num_tokens
    (r,) = read_traces(tmp_path / "r.jsonl").records
    assert same_structure(decode_tree(r["workload"]["tree"]), tree)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_q_heads": 0}, r"num_q_heads must be a positive integer"),
        ({"num_q_heads": 12}, r"num_q_heads \(12\) must be a multiple of num_kv_heads \(8\)"),
        ({"head_dim": 8}, r"head_dim must be in \[16, 256\]"),
        ({"dtype": "float32"}, r"dtype must be one of \['float16', 'bfloat16'\], got 'float32'"),
        ({"dtype": torch.float32}, r"dtype must be one of"),
        ({"every": 0}, r"every must be >= 1, got 0"),
        ({"every": 2.0}, r"every must be an integer, got 2.0"),
        ({"every": True}, r"every must be an integer, got True"),
        ({"max_records": 0}, r"max_records must be >= 1"),
        ({"max_tokens": -1}, r"max_tokens must be >= 1"),
        ({"max_bytes": 0}, r"max_bytes must be >= 1"),
        ({"family": ""}, r"family must be a non-empty string"),
        ({"scenario": None}, r"scenario must be a non-empty string"),
        ({"seed": -1}, r"seed must be >= 0"),
        ({"seed": "1"}, r"seed must be an integer"),
    ],
)
def test_bad_arguments(tmp_path, changes, match):
    path = tmp_path / "r.jsonl"
    with pytest.raises(ValueError, match=match):
        WorkloadRecorder(path, **{**HEADS, **changes})
    assert not path.exists()  # nothing created for a bad argument


def test_gzip_path_refused(tmp_path):
    with pytest.raises(ValueError, match=r"cannot append to a gzip file"):
        WorkloadRecorder(tmp_path / "r.jsonl.gz", **HEADS)


def test_keyword_only(tmp_path):
    with pytest.raises(TypeError):
        WorkloadRecorder(tmp_path / "r.jsonl", 32, 8, 128, "float16")  # type: ignore[misc]


def test_numpy_integer_arguments(tmp_path):
    with WorkloadRecorder(
        tmp_path / "r.jsonl",
        num_q_heads=np.int64(32),
        num_kv_heads=np.int32(8),
        head_dim=np.int64(128),
        dtype="float16",
        every=np.int64(2),
        seed=np.int64(3),
    ) as rec:
        assert rec.record(np.int64(4), tree_of(0))
    (r,) = read_traces(tmp_path / "r.jsonl").records
    assert r["workload"]["step"] == 4 and r["workload"]["seed"] == 3 and r["num_kv_heads"] == 8
