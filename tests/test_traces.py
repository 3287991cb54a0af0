"""Trace format: tree encoding, keys, the crash-safe writer and the validating reader (CPU only)."""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import fasttree as ft
import fasttree.traces as traces
from fasttree.traces import (
    SCHEMA,
    SCHEMA_VERSION,
    TraceError,
    TraceWriter,
    decode_tree,
    encode_tree,
    existing_keys,
    measurement_key,
    measurement_record,
    plan_summary,
    read_traces,
    record_launch,
    runtime_launch,
    timed_launch_variants,
    validate,
    workload_record,
)

REPO = Path(__file__).resolve().parents[1]

ENV = {
    "gpu_name": "NVIDIA H200",
    "gpu_sm_count": 132,
    "compute_capability": "9.0",
    "memory_clock_mhz": 3201,
    "driver": "570.86.15",
    "torch": "2.6.0",
    "triton": "3.2.0",
    "fasttree": "0.1.0",
    "git_commit": "a596450",
}
TIMING = {
    "graph_us": {"median": 12.5, "p20": 12.25, "p80": 13.0, "replays": 30, "calls_per_graph": 20},
    "eager_us": {"median": 40.0},
}


def small_tree(seed: int = 0) -> ft.KVTree:
    return ft.KVTree.from_lengths([-1, 0, 0, 1], [100 + seed, 30, 40, 5], [1, 2, 3, 3])


def measurement(seed: int = 0, gpu: str = "NVIDIA H200", **changes) -> dict:
    kwargs = dict(
        env={**ENV, "gpu_name": gpu},
        family="random_recursive",
        seed=seed,
        tree=small_tree(seed),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="float16",
        config=ft.FastTreeConfig(),
        plan={"units": [0, 3], "partial_rows": 4, "tile_mode": "all_small"},
        timing=TIMING,
        correct=True,
        max_rel_err=2e-4,
        time_utc="2025-06-01T12:00:00.000000Z",
    )
    kwargs.update(changes)
    return measurement_record(**kwargs)


def workload(step: int = 0, **changes) -> dict:
    kwargs = dict(
        family="few_shot",
        scenario="few_shot_mix",
        step=step,
        seed=7,
        tree=small_tree(step),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        weight=2.0,
    )
    kwargs.update(changes)
    return workload_record(**kwargs)


def write_lines(path: Path, lines: list) -> Path:
    """Write records (dicts, json.dumps with NaN allowed) or raw strings, one per line, bypassing the writer."""
    with open(path, "w") as f:
        for item in lines:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")
    return path


def same_tree(a: ft.KVTree, b: ft.KVTree) -> bool:
    return (
        np.array_equal(a.parents, b.parents)
        and np.array_equal(a.lengths, b.lengths)
        and np.array_equal(a.query_nodes, b.query_nodes)
    )


# ---------------------------------------------------------------- tree encoding


def test_encode_decode_round_trip_keeps_shape_and_uses_contiguous_slots():
    tree = ft.KVTree(parents=[-1, 0, 0, -1], node_slots=[[9, 3], [7], [50, 51, 52], [0]], query_nodes=[1, 2, 3, 0])
    enc = encode_tree(tree)
    assert enc == {"parents": [-1, 0, 0, -1], "lengths": [2, 1, 3, 1], "query_nodes": [1, 2, 3, 0]}
    assert all(type(v) is int for values in enc.values() for v in values)
    back = decode_tree(json.loads(json.dumps(enc)))
    assert same_tree(back, tree)
    assert back.slots.tolist() == list(range(7))


def test_encode_paper_tree_round_trip():
    tree = ft.KVTree.from_levels([1, 4, 16, 64], [256, 8, 64, 32])
    assert same_tree(decode_tree(encode_tree(tree)), tree)


@pytest.mark.parametrize(
    ("enc", "match"),
    [
        ({"parents": [1, 0], "lengths": [1, 1], "query_nodes": [0]}, "cycle"),
        ({"parents": [0], "lengths": [1], "query_nodes": [0]}, "own parent"),
        ({"parents": [-1, 5], "lengths": [1, 1], "query_nodes": [1]}, "out of range"),
        ({"parents": [-1, -2], "lengths": [1, 1], "query_nodes": [1]}, "out of range"),
        ({"parents": [-1], "lengths": [1], "query_nodes": [1]}, "out of range"),
        ({"parents": [-1], "lengths": [-3], "query_nodes": [0]}, "negative"),
        ({"parents": [-1, 0], "lengths": [0, 0], "query_nodes": [1]}, "empty context"),
        ({"parents": [], "lengths": [], "query_nodes": []}, "at least one node"),
        ({"parents": [-1], "lengths": [1], "query_nodes": []}, "at least one query"),
        ({"parents": [-1, 0], "lengths": [1], "query_nodes": [0]}, "lengths has 1 entries"),
        ({"parents": [-1], "lengths": [1.5], "query_nodes": [0]}, "only integers"),
        ({"parents": [-1], "lengths": [True], "query_nodes": [0]}, "only integers"),
        ({"parents": [-1], "lengths": [2**70], "query_nodes": [0]}, "int64"),
        ({"parents": [-1], "lengths": "1", "query_nodes": [0]}, "list of integers"),
        ({"parents": [-1], "lengths": [1]}, "lacks"),
        ({"parents": [-1], "lengths": [1], "query_nodes": [0], "slots": [0]}, "unknown keys"),
        ([[-1], [1], [0]], "must be an object"),
    ],
)
def test_decode_tree_rejects_bad_encodings(enc, match):
    with pytest.raises(ValueError, match=match):
        decode_tree(enc)


@pytest.mark.parametrize(
    ("enc", "match"),
    [
        ({"parents": [-1], "lengths": [2**31 - 1], "query_nodes": [0]}, r"a node holds 2147483647 tokens"),
        ({"parents": [-1, 0], "lengths": [2**23, 2**23 + 1], "query_nodes": [1]}, r"holds 16777217 tokens"),
        ({"parents": [-1] * (2**20 + 1), "lengths": [1] * (2**20 + 1), "query_nodes": [0]}, r"1048577 nodes"),
        ({"parents": [-1], "lengths": [1], "query_nodes": [0] * (2**17 + 1)}, r"131073 queries"),
    ],
    ids=["node", "tokens", "nodes", "queries"],
)
def test_decode_tree_refuses_trees_beyond_the_resource_limits(enc, match):
    with pytest.raises(ValueError, match=match + r".*more than a trace tree may hold"):
        decode_tree(enc)


def test_decode_tree_takes_trees_at_the_resource_limits():
    tree = decode_tree({"parents": [-1, 0], "lengths": [2**23, 2**23], "query_nodes": [1] * 2**17})
    assert (tree.num_tokens, tree.n_queries) == (traces.MAX_TREE_TOKENS, traces.MAX_TREE_QUERIES)


def test_a_workload_line_beyond_the_limits_is_invalid(tmp_path):
    big = workload(0)
    big["workload"]["tree"] = {"parents": [-1], "lengths": [2**31 - 1], "query_nodes": [0]}
    assert any("more than a trace tree may hold" in p for p in validate(big))
    path = write_lines(tmp_path / "w.jsonl", [workload(1), big])
    with pytest.raises(TraceError, match=r"w\.jsonl:2: workload\.tree is not a valid tree: a node holds"):
        read_traces(path)


# ------------------------------------------------------------------------- keys

KEY_ARGS = dict(
    family="random_recursive",
    seed=3,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    dtype="float16",
    config=ft.FastTreeConfig(),
    gpu_name="NVIDIA H200",
)


def test_measurement_key_is_stable_across_input_forms():
    key = measurement_key(small_tree(), **KEY_ARGS)
    assert len(key) == 64 and int(key, 16) >= 0
    # the encoding, a config dict with ints for floats, numpy ints and a torch-style dtype name hash alike
    cfg = ft.FastTreeConfig().to_dict()
    cfg["alpha"], cfg["beta"] = 0.66, 0.33
    cfg["gamma"] = 0.1
    same = measurement_key(
        json.loads(json.dumps(encode_tree(small_tree()))),
        **{**KEY_ARGS, "config": cfg, "num_q_heads": np.int64(32), "dtype": "torch.float16"},
    )
    assert same == key
    assert measurement_key(small_tree(), **{**KEY_ARGS, "config": ft.FastTreeConfig(alpha=1)}) == measurement_key(
        small_tree(), **{**KEY_ARGS, "config": {"alpha": 1.0}}
    )


def test_measurement_key_golden_value():
    # Changing the key derivation orphans every collected trace for resume: bump KEY_VERSION deliberately.
    # Packing off is the configuration every trace before config schema 2 measured: same key as then.
    tree = ft.KVTree.from_lengths([-1, 0], [64, 8], [1])
    # the defaults of config schema 1 (then every ratio ran (4, 4) warps and (3, 3) stages)
    published = ft.FastTreeConfig(pack_tokens=0, kv_tile=(32, 32), num_warps=(4, 4), num_stages=(3, 3))
    assert measurement_key(tree, **{**KEY_ARGS, "config": published}) == GOLDEN_KEY
    v1 = {k: v for k, v in published.to_dict().items() if not k.startswith("pack_")}
    assert measurement_key(tree, **{**KEY_ARGS, "config": v1 | {"schema_version": 1}}) == GOLDEN_KEY
    packed = ft.FastTreeConfig(
        pack_tokens=256, pack_min_units=528, kv_tile=(32, 32), num_warps=(4, 4), num_stages=(3, 3)
    )
    assert measurement_key(tree, **{**KEY_ARGS, "config": packed}) == GOLDEN_KEY_PACKED


def test_warps_from_the_ratio_are_keyed_and_stored_as_launched():
    """num_warps=None and num_stages=None (the defaults) resolve to the bucket's warps and stages
    in keys and records: the same measurement keeps one key whether its config says None or
    what it ran."""
    tree = ft.KVTree.from_lengths([-1, 0], [64, 8], [1])
    for hq, hkv, d in ((32, 32, 128), (32, 8, 128), (16, 1, 128), (32, 8, 256)):
        args = {**KEY_ARGS, "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}
        auto = ft.FastTreeConfig()
        g = hq // hkv
        explicit = ft.FastTreeConfig(num_warps=auto.launch_warps(g), num_stages=auto.launch_stages(g, d))
        key = measurement_key(tree, **{**args, "config": auto})
        assert key == measurement_key(tree, **{**args, "config": explicit})
        three = dataclasses.replace(explicit, num_stages=(3, 3))
        assert (key == measurement_key(tree, **{**args, "config": three})) == (g > 8 or d > 128)
    mha = {**KEY_ARGS, "num_q_heads": 32, "num_kv_heads": 32}
    four = ft.FastTreeConfig(num_warps=(4, 4))
    assert measurement_key(tree, **{**mha, "config": ft.FastTreeConfig()}) != measurement_key(
        tree, **{**mha, "config": four}
    )


GOLDEN_KEY_PACKED = "77bf0321e937a4fda229deadafac86a95afe472bbda3a9cd286145c2dd32fb05"


GOLDEN_KEY = "79eeb67e2674bd651fc937ae0550b77f698dd204de6eb8c43257c18b402f9330"


@pytest.mark.parametrize(
    "change",
    [
        {"family": "beam"},
        {"seed": 4},
        {"seed": None},
        {"num_q_heads": 16},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"dtype": "bfloat16"},
        {"config": ft.FastTreeConfig(gamma=-10)},
        {"config": ft.FastTreeConfig(num_stages=(2, 3))},
        {"config": ft.FastTreeConfig(pack_tokens=128)},
        {"config": ft.FastTreeConfig(pack_min_units=0)},
        {"gpu_name": "NVIDIA H100 80GB HBM3"},
    ],
)
def test_measurement_key_changes_with_each_identity_field(change):
    assert measurement_key(small_tree(), **{**KEY_ARGS, **change}) != measurement_key(small_tree(), **KEY_ARGS)


def test_measurement_key_changes_with_the_tree_and_ignores_timing_and_env_versions():
    assert measurement_key(small_tree(1), **KEY_ARGS) != measurement_key(small_tree(0), **KEY_ARGS)
    a = measurement(timing={**TIMING, "eager_us": {"median": 99.0}}, time_utc="2024-01-01T00:00:00Z")
    b = measurement(env={**ENV, "torch": "9.9", "git_commit": None}, correct=None, max_rel_err=None)
    assert a["key"] == b["key"] == measurement()["key"]


def test_a_runtime_measurement_carries_its_launch_in_record_and_key():
    launch = runtime_launch(stage1_launches=1)
    rec = measurement(launch=launch)
    assert validate(rec) == [] and record_launch(rec) == launch and record_launch(measurement()) is None
    assert rec["key"] == measurement_key(small_tree(), **{**KEY_ARGS, "seed": 0, "launch": launch})
    assert rec["key"] != measurement()["key"]  # tree_attention's records keep the keys they always had
    assert rec["key"] != measurement(launch=runtime_launch(stage1_launches=2))["key"]
    # a record whose launch was edited no longer matches its key; a malformed launch names what is wrong
    assert any("does not match" in p for p in validate({**rec, "launch": runtime_launch(stage1_launches=2)}))
    assert validate({**rec, "launch": {**launch, "waves": 2}}) == ["launch has an unknown field 'waves'"]
    assert validate({**rec, "launch": {**launch, "kind": "eager"}}) == [
        "launch.kind must be one of ['runtime', 'runtime_variants'], got 'eager'"
    ]
    # the runtime timed with its launch variants (validate's) is another launch, another key
    served = runtime_launch(stage1_launches=1, variants=True)
    rec_served = measurement(launch=served)
    assert validate(rec_served) == [] and served["kind"] == "runtime_variants"
    assert rec_served["key"] != rec["key"]
    assert timed_launch_variants(rec_served) and not timed_launch_variants(rec)
    assert not timed_launch_variants(measurement())
    with pytest.raises(ValueError, match="stage1_launches must be one of"):
        runtime_launch(stage1_launches=3)
    with pytest.raises(ValueError, match="query_centric must be one of"):
        runtime_launch(stage1_launches=1, query_centric="sometimes")


# ------------------------------------------------------------------- validation


def test_builders_produce_valid_records():
    assert validate(measurement()) == []
    assert validate(workload()) == []
    failed = measurement(status="failed", timing=None, plan=None, error="ValueError: query tile too big")
    assert validate(failed) == []


def test_plan_summary_of_a_real_plan_is_stored_as_json():
    tree = ft.KVTree.from_levels([1, 2, 16], [64, 32, 8])
    plan = ft.plan(tree, ft.FastTreeConfig(), num_q_heads=32, num_kv_heads=8, head_dim=128)
    summary = plan_summary(plan)
    assert json.loads(json.dumps(summary)) == summary  # plain JSON: lists, ints, strings
    assert summary["units"] == list(plan.units_per_class())
    rec = measurement(tree=tree, plan=plan)
    assert rec["plan"] == summary
    assert validate(rec) == []


def test_validate_lists_every_problem():
    rec = measurement()
    rec["head_dim"] = 0
    rec["dtype"] = "float32"
    rec["timing"]["graph_us"]["median"] = float("nan")
    problems = validate(rec)
    assert len(problems) == 3, problems
    assert any("head_dim" in p for p in problems)
    assert any("dtype" in p for p in problems)
    assert any("graph_us.median" in p for p in problems)


def test_validate_stops_at_an_unknown_schema_version():
    rec = measurement()
    rec["schema_version"] = 2
    del rec["timing"]
    assert validate(rec) == ["schema_version 2 is not supported (this reader knows 1)"]


# ----------------------------------------------------------------------- writer


def test_round_trip_both_kinds(tmp_path):
    path = tmp_path / "t.jsonl"
    records = [measurement(0), workload(0), measurement(1), workload(1, weight=0.5)]
    with TraceWriter(path) as w:
        for r in records:
            w.append(r)
        assert w.n_written == 4
    assert len(path.read_text().splitlines()) == 4
    ts = read_traces(path)
    assert ts.records == records
    assert ts.n_invalid == 0 and ts.files == [str(path)]
    assert [r["workload"]["seed"] for r in read_traces(path, kind="measurement")] == [0, 1]
    assert [r["weight"] for r in read_traces(path, kind="workload")] == [2.0, 0.5]
    assert same_tree(decode_tree(ts.records[2]["workload"]["tree"]), small_tree(1))
    # stored with the warps and stages the GQA-4 launches ran (the defaults derive them from the bucket)
    stored = ft.FastTreeConfig.from_dict(ts.records[0]["config"])
    assert stored == ft.FastTreeConfig(num_warps=(4, 4), num_stages=(5, 3))


def test_writer_stores_numpy_values_as_plain_json(tmp_path):
    path = tmp_path / "t.jsonl"
    rec = measurement(num_q_heads=np.int64(32), max_rel_err=np.float32(0.25), plan={"units": np.array([1, 2])})
    with TraceWriter(path) as w:
        w.append(rec)
    back = read_traces(path).records[0]
    assert back["num_q_heads"] == 32 and back["max_rel_err"] == 0.25 and back["plan"]["units"] == [1, 2]
    assert back["key"] == measurement()["key"]


def test_workload_weight_defaults_to_one(tmp_path):
    rec = workload()
    del rec["weight"]
    assert validate(rec) == []
    ts = read_traces(write_lines(tmp_path / "w.jsonl", [rec]))
    assert ts.records[0]["weight"] == 1.0


def _invalid_records():
    def mutate(fn):
        rec = measurement()
        fn(rec)
        return rec

    return {
        "nan median": mutate(lambda r: r["timing"]["graph_us"].update(median=float("nan"))),
        "missing timing": mutate(lambda r: r.pop("timing")),
        "bad key": mutate(lambda r: r.update(key="0" * 64)),
        "dtype": mutate(lambda r: r.update(dtype="float32")),
        "failed without error": mutate(lambda r: r.update(status="failed", timing=None)),
        "cyclic tree": mutate(lambda r: r["workload"]["tree"].update(parents=[1, 0, 0, 1])),
        "not serialisable": mutate(lambda r: r["plan"].update(obj=object())),
        "not a dict": ["schema", SCHEMA],
    }


@pytest.mark.parametrize("name", list(_invalid_records()))
def test_writer_never_writes_an_invalid_record(tmp_path, name):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.append(measurement(0))
        before = path.read_bytes()
        with pytest.raises(TraceError, match="record not written"):
            w.append(_invalid_records()[name])
        assert path.read_bytes() == before
        assert w.n_written == 1
        w.append(measurement(1))  # still usable
    assert len(read_traces(path)) == 2


def test_writer_refuses_gzip_paths(tmp_path):
    with pytest.raises(ValueError, match="gzip it once the set is finished"):
        TraceWriter(tmp_path / "t.jsonl.gz")
    assert not (tmp_path / "t.jsonl.gz").exists()


def test_writer_closed_refuses_appends(tmp_path):
    w = TraceWriter(tmp_path / "t.jsonl")
    w.close()
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.append(measurement())


def test_two_writers_in_sequence_append(tmp_path):
    path = tmp_path / "sub" / "t.jsonl"  # parent folders are created
    with TraceWriter(path) as w:
        for s in range(3):
            w.append(measurement(s))
    with TraceWriter(path, fsync=False) as w:
        assert w.torn_bytes == 0
        for s in range(3, 5):
            w.append(measurement(s))
    assert [r["workload"]["seed"] for r in read_traces(path)] == [0, 1, 2, 3, 4]
    assert not (tmp_path / "sub" / "t.jsonl.torn").exists()


def test_torn_last_line_is_moved_aside_on_open(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.append(measurement(0))
        w.append(measurement(1))
    full = path.read_bytes()
    third = json.dumps(measurement(2)).encode()
    fragment = third[: len(third) // 2]
    path.write_bytes(full + fragment)  # a crash halfway through the third line
    with pytest.raises(TraceError, match=r"t\.jsonl:3: malformed JSON"):
        read_traces(path)

    with TraceWriter(path) as w:
        assert w.torn_bytes == len(fragment)
        assert path.read_bytes() == full
        w.append(measurement(3))
    torn = tmp_path / "t.jsonl.torn"
    assert torn.read_bytes() == fragment + b"\n"
    assert [r["workload"]["seed"] for r in read_traces(path)] == [0, 1, 3]

    # a second crash: its fragment is appended to the .torn file, the first one is kept
    path.write_bytes(path.read_bytes() + b'{"schema": "fastt')
    with TraceWriter(path):
        pass
    assert torn.read_bytes() == fragment + b"\n" + b'{"schema": "fastt\n'
    assert len(read_traces(path)) == 3


def test_torn_only_line_truncates_to_empty(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"schema":')
    with TraceWriter(path) as w:
        assert w.torn_bytes == 10
    assert path.read_bytes() == b""
    assert (tmp_path / "t.jsonl.torn").read_bytes() == b'{"schema":\n'


def test_complete_last_line_missing_only_its_newline_is_kept(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(measurement(0)) + "\n" + json.dumps(measurement(1)))
    with TraceWriter(path) as w:
        assert w.torn_bytes == 0
        w.append(measurement(2))
    assert [r["workload"]["seed"] for r in read_traces(path)] == [0, 1, 2]
    assert not (tmp_path / "t.jsonl.torn").exists()


APPEND_SCRIPT = textwrap.dedent(
    """
    import sys
    import fasttree as ft
    from fasttree.traces import TraceWriter, existing_keys, measurement_record

    path, n = sys.argv[1], int(sys.argv[2])
    env = {ENV!r}
    timing = {TIMING!r}
    done = existing_keys(path)
    with TraceWriter(path) as w:
        for seed in range(n):
            rec = measurement_record(
                env=env, family="loop", seed=seed,
                tree=ft.KVTree.from_lengths([-1, 0, 0], [seed % 500 + 1, 3, 4], [1, 2]),
                num_q_heads=8, num_kv_heads=8, head_dim=64, dtype="float16",
                config=ft.FastTreeConfig(), plan={{"units": [1, 1]}}, timing=timing,
            )
            if rec["key"] in done:
                continue
            w.append(rec)
    """
).format(ENV=ENV, TIMING=TIMING)


def _run_append_script(tmp_path: Path, path: Path, n: int) -> subprocess.Popen:
    script = tmp_path / "append.py"
    script.write_text(APPEND_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(script), str(path), str(n)], env=env, cwd=tmp_path)


def test_sigkill_mid_run_leaves_only_whole_lines_and_resume_adds_no_duplicates(tmp_path):
    path = tmp_path / "t.jsonl"
    proc = _run_append_script(tmp_path, path, 10**7)
    try:
        deadline = time.monotonic() + 120
        while not (path.exists() and path.stat().st_size > 0):  # wait for the imports, then let it write
            assert proc.poll() is None, "the append script exited early"
            assert time.monotonic() < deadline, "the append script wrote nothing in 120 s"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    ts = read_traces(path)  # strict: every line valid
    n_first = len(ts)
    assert n_first > 0
    keys = [r["key"] for r in ts]
    assert len(set(keys)) == n_first
    assert [r["workload"]["seed"] for r in ts] == list(range(n_first))  # a prefix, in order

    total = n_first + 25
    proc = _run_append_script(tmp_path, path, total)  # resume to completion
    assert proc.wait(timeout=300) == 0
    ts = read_traces(path)
    assert len(ts) == total
    assert sorted(r["workload"]["seed"] for r in ts) == list(range(total))
    assert len(ts.keys()) == total
    assert not (tmp_path / "t.jsonl.torn").exists()


# ----------------------------------------------------------------------- reader


def _bad(fn):
    def make():
        rec = measurement(2)
        fn(rec)
        return rec

    return make


def _set(path: str, value):
    """Mutator setting a dotted path (``timing.graph_us.median``) of a record."""
    *parents, last = path.split(".")

    def fn(rec):
        obj = rec
        for k in parents:
            obj = obj[k]
        obj[last] = value

    return _bad(fn)


def _drop(path: str):
    *parents, last = path.split(".")

    def fn(rec):
        obj = rec
        for k in parents:
            obj = obj[k]
        del obj[last]

    return _bad(fn)


READER_CASES = {
    "malformed json": (lambda: '{"schema": "fasttree-trace", ', "malformed JSON"),
    "not an object": (lambda: "[1, 2, 3]", "must be a JSON object"),
    "empty line": (lambda: "", "empty line"),
    "wrong schema name": (_set("schema", "fasttree-bench"), "schema must be 'fasttree-trace'"),
    "schema version 2": (_set("schema_version", 2), "schema_version 2 is not supported"),
    "schema version string": (_set("schema_version", "1"), "schema_version '1' is not supported"),
    "missing schema version": (_drop("schema_version"), "schema_version None is not supported"),
    "unknown kind": (_set("kind", "benchmark"), "kind must be one of"),
    "missing timing": (_drop("timing"), re.escape("lacks required field(s) ['timing']")),
    "missing key": (_drop("key"), re.escape("lacks required field(s) ['key']")),
    "missing env field": (_drop("env.driver"), re.escape("env lacks required field(s) ['driver']")),
    "missing workload tree": (_drop("workload.tree"), re.escape("workload lacks required field(s) ['tree']")),
    "missing graph p80": (_drop("timing.graph_us.p80"), "timing.graph_us lacks"),
    "unknown field": (_set("extra", 1), re.escape("unknown field(s) ['extra']")),
    "nan median": (_set("timing.graph_us.median", float("nan")), "timing.graph_us.median must be a finite number"),
    "inf p80": (_set("timing.graph_us.p80", float("inf")), "timing.graph_us.p80 must be a finite number"),
    "negative eager": (_set("timing.eager_us.median", -3.0), "timing.eager_us.median must be a finite number > 0"),
    "zero median": (_set("timing.graph_us.median", 0.0), "timing.graph_us.median must be a finite number > 0"),
    "string median": (_set("timing.graph_us.median", "12"), "timing.graph_us.median must be a finite number"),
    "percentiles out of order": (_set("timing.graph_us.p20", 20.0), "p20 <= median <= p80"),
    "zero replays": (_set("timing.graph_us.replays", 0), "timing.graph_us.replays must be an integer >= 1"),
    "ok without timing": (_set("timing", None), "timing must be an object for status 'ok'"),
    "ok without plan": (_set("plan", None), "plan must be an object for status 'ok'"),
    "ok with error": (_set("error", "boom"), "error must be null for status 'ok'"),
    "bad status": (_set("status", "skipped"), "status must be 'ok' or 'failed'"),
    "nan in plan": (_set("plan.flops", float("nan")), "plan.flops is nan"),
    "bad max_rel_err": (_set("max_rel_err", -1.0), "max_rel_err must be a finite number >= 0"),
    "bad correct": (_set("correct", "yes"), "correct must be true, false or null"),
    "cyclic tree": (_set("workload.tree.parents", [1, 0, 0, 1]), "workload.tree is not a valid tree: .*cycle"),
    "parent out of range": (_set("workload.tree.parents", [-1, 0, 0, 9]), "workload.tree .* out of range"),
    "query out of range": (_set("workload.tree.query_nodes", [1, 4]), "query_nodes\\[1\\] = 4 is out of range"),
    "tree lengths mismatch": (_set("workload.tree.lengths", [1, 2]), "workload.tree is not a valid tree"),
    "bad config value": (_set("config.kv_tile", [24, 32]), "config does not load as a FastTreeConfig: .*kv_tile"),
    "unknown config key": (_set("config.block", 3), "config does not load .*unknown FastTreeConfig keys"),
    "config version": (_set("config.schema_version", 9), "config does not load .*schema_version 9"),
    "config not a dict": (_set("config", [1, 2]), "config does not load as a FastTreeConfig"),
    "dtype": (_set("dtype", "float32"), "dtype must be one of"),
    "heads not a multiple": (_set("num_kv_heads", 5), "must be a multiple of num_kv_heads"),
    "negative head_dim": (_set("head_dim", -128), "head_dim must be an integer >= 1"),
    "bool heads": (_set("num_q_heads", True), "num_q_heads must be an integer >= 1"),
    "negative seed": (_set("workload.seed", -1), "workload.seed must be an integer >= 0 or null"),
    "sm count zero": (_set("env.gpu_sm_count", 0), "env.gpu_sm_count must be an integer >= 1"),
    "compute capability": (_set("env.compute_capability", 9.0), "env.compute_capability must be a 'major.minor'"),
    "empty gpu name": (_set("env.gpu_name", ""), "env.gpu_name must be a non-empty string"),
    "key not hex": (_set("key", "abc"), "key must be 64 lowercase hex digits"),
    "key mismatch": (_set("key", "f" * 64), "does not match the record's identity"),
    "edited identity": (_set("head_dim", 64), "does not match the record's identity"),
    "time not utc": (_set("time_utc", "2025-06-01T12:00:00+02:00"), "must be in UTC"),
    "time not iso": (_set("time_utc", "yesterday"), "is not ISO 8601"),
    "failed without error": (
        _bad(lambda r: r.update(status="failed", timing=None)),
        "error must be a non-empty string",
    ),
    "failed with timing": (_bad(lambda r: r.update(status="failed", error="oom")), "timing must be null"),
    "workload zero weight": (lambda: {**workload(), "weight": 0}, "weight must be a finite number > 0"),
    "workload negative step": (
        lambda: {**workload(), "workload": {**workload()["workload"], "step": -1}},
        "workload.step must be an integer >= 0",
    ),
    "workload missing scenario": (
        lambda: {**workload(), "workload": {k: v for k, v in workload()["workload"].items() if k != "scenario"}},
        re.escape("workload lacks required field(s) ['scenario']"),
    ),
    "workload with timing": (lambda: {**workload(), "timing": TIMING}, re.escape("unknown field(s) ['timing']")),
}


@pytest.mark.parametrize("name", list(READER_CASES))
def test_reader_names_file_and_line_of_a_bad_line(tmp_path, name):
    make, match = READER_CASES[name]
    path = write_lines(tmp_path / "t.jsonl", [measurement(0), workload(1), make(), measurement(3)])
    with pytest.raises(TraceError, match=match) as info:
        read_traces(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert (info.value.path, info.value.line) == (str(path), 3)
    ts = read_traces(path, skip_invalid=True)
    assert ts.n_invalid == 1 and ts.invalid[0][:2] == (str(path), 3)
    assert [r["kind"] for r in ts] == ["measurement", "workload", "measurement"]


def test_reader_rejects_bad_utf8(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(measurement(0)).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r":2: not UTF-8"):
        read_traces(path)


@pytest.mark.parametrize("gz", [False, True], ids=["jsonl", "gzip"])
def test_a_line_longer_than_the_cap_is_refused_without_reading_it_whole(tmp_path, monkeypatch, gz):
    monkeypatch.setattr(traces, "MAX_LINE_BYTES", 4096)
    reads = []
    real_lines = traces._lines

    def lines(path):  # the largest readline the reader asks for
        for item in real_lines(path):
            reads.append(item)
            yield item

    monkeypatch.setattr(traces, "_lines", lines)
    body = [json.dumps(workload(0)), "x" * 100_000, json.dumps(workload(2)), "y" * 4096, json.dumps(workload(4))]
    data = ("\n".join(body) + "\n").encode()
    path = tmp_path / ("t.jsonl.gz" if gz else "t.jsonl")
    path.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(TraceError, match=r":2: a line longer than 4096 bytes"):
        read_traces(path)
    assert len(reads) == 2 and reads[1] == (2, None)  # stopped at the long line
    ts = read_traces(path, skip_invalid=True)  # skipping reads through it in bounded chunks and goes on
    assert [r["workload"]["step"] for r in ts] == [0, 2, 4]
    assert [n for _, n, _ in ts.invalid] == [2, 4]
    assert all(reason.startswith("a line longer than 4096 bytes") for _, _, reason in ts.invalid)


def test_a_line_of_exactly_the_cap_is_read(tmp_path, monkeypatch):
    line = json.dumps(workload(0)).encode() + b"\n"
    monkeypatch.setattr(traces, "MAX_LINE_BYTES", len(line))
    path = tmp_path / "t.jsonl"
    path.write_bytes(line + line[:-1])  # the last line without its newline
    assert len(read_traces(path)) == 2
    monkeypatch.setattr(traces, "MAX_LINE_BYTES", len(line) - 1)
    with pytest.raises(TraceError, match=":1: a line longer than"):
        read_traces(path)


def test_skip_invalid_counts_and_locates_every_bad_line(tmp_path):
    nan = measurement(5)
    nan["timing"]["graph_us"]["median"] = math.nan
    a = write_lines(tmp_path / "a.jsonl", [measurement(0), "{oops", measurement(1), nan])
    b = write_lines(tmp_path / "b.jsonl", [{**workload(), "schema_version": 3}, workload(2), "", measurement(9)])
    ts = read_traces([a, b], skip_invalid=True)
    assert len(ts) == 4
    assert ts.n_invalid == 4
    assert [(f, n) for f, n, _ in ts.invalid] == [(str(a), 2), (str(a), 4), (str(b), 1), (str(b), 3)]
    assert "malformed JSON" in ts.invalid[0][2] and "median" in ts.invalid[1][2]
    assert ts.files == [str(a), str(b)]
    assert len(read_traces([a, b], kind="workload", skip_invalid=True)) == 1
    with pytest.raises(TraceError, match=r"a\.jsonl:2:"):
        read_traces([a, b])


def test_reader_reads_gzip_and_folders(tmp_path):
    plain = tmp_path / "run" / "part1.jsonl"
    with TraceWriter(plain) as w:
        for s in range(3):
            w.append(measurement(s))
    gz = tmp_path / "run" / "part2.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        for s in range(3, 6):
            f.write(json.dumps(measurement(s)) + "\n")
    (tmp_path / "run" / "notes.txt").write_text("not a trace")
    (tmp_path / "run" / "part1.jsonl.torn").write_text('{"schema": "fas\n')
    assert [r["workload"]["seed"] for r in read_traces(gz)] == [3, 4, 5]
    ts = read_traces(tmp_path / "run")
    assert ts.files == [str(plain), str(gz)]
    assert [r["workload"]["seed"] for r in ts] == list(range(6))
    assert existing_keys(gz) == {measurement(s)["key"] for s in range(3, 6)}


def test_reader_reports_bad_lines_in_gzip_and_cut_streams(tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps(measurement(0)) + "\n" + "{bad\n")
    with pytest.raises(TraceError, match=r"t\.jsonl\.gz:2: malformed JSON"):
        read_traces(gz)

    cut = tmp_path / "cut.jsonl.gz"
    with gzip.open(cut, "wt") as f:
        for s in range(50):
            f.write(json.dumps(measurement(s)) + "\n")
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) - 40])
    with pytest.raises(TraceError, match=r"cut\.jsonl\.gz:\d+: unreadable"):
        read_traces(cut)
    ts = read_traces(cut, skip_invalid=True)
    assert ts.n_invalid == 1 and "unreadable" in ts.invalid[0][2]
    assert 0 < len(ts) < 50


def test_reader_argument_errors(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_traces(tmp_path / "missing.jsonl")
    path = write_lines(tmp_path / "t.jsonl", [measurement()])
    with pytest.raises(ValueError, match="kind must be one of"):
        read_traces(path, kind="measurements")


def test_mixed_gpus_are_detected(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [measurement(0), measurement(1), workload()])
    b = write_lines(tmp_path / "b.jsonl", [measurement(2, gpu="NVIDIA H100 80GB HBM3")])
    single = read_traces(a)
    assert single.gpus() == ["NVIDIA H200"]
    assert single.require_single_gpu() == "NVIDIA H200"
    mixed = read_traces([a, b])
    assert mixed.gpus() == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    with pytest.raises(TraceError, match="2 GPUs") as info:
        mixed.require_single_gpu()
    assert "NVIDIA H100 80GB HBM3" in str(info.value) and "NVIDIA H200" in str(info.value)
    only_workloads = read_traces(write_lines(tmp_path / "w.jsonl", [workload()]))
    with pytest.raises(TraceError, match="no measurement records"):
        only_workloads.require_single_gpu()


def test_by_key_groups_repeat_measurements(tmp_path):
    again = measurement(0, timing={**TIMING, "eager_us": {"median": 41.0}})
    ts = read_traces(write_lines(tmp_path / "t.jsonl", [measurement(0), measurement(1), again, workload()]))
    groups = ts.by_key()
    assert sorted(len(v) for v in groups.values()) == [1, 2]
    assert [r["timing"]["eager_us"]["median"] for r in groups[measurement(0)["key"]]] == [40.0, 41.0]
    assert len(ts.of_kind("workload")) == 1


def test_existing_keys(tmp_path):
    path = tmp_path / "t.jsonl"
    assert existing_keys(path) == set()
    failed = measurement(2, status="failed", timing=None, plan=None, error="CompilationError: out of resources")
    bad = measurement(3)
    bad["timing"]["graph_us"]["median"] = -1.0
    write_lines(path, [measurement(0), workload(), failed, bad, "{torn"])
    keys = existing_keys(path)
    assert keys == {measurement(0)["key"], failed["key"]}
    assert existing_keys(path, status="ok") == {measurement(0)["key"]}
    assert existing_keys(path, status="failed") == {failed["key"]}
    other = write_lines(tmp_path / "u.jsonl", [measurement(7)])
    assert existing_keys([path, other, tmp_path / "missing.jsonl"]) == keys | {measurement(7)["key"]}


def test_record_copies_do_not_share_state():
    # the builders copy what they are given: mutating a built record leaves the inputs alone
    timing = copy.deepcopy(TIMING)
    rec = measurement(timing=timing)
    rec["timing"]["graph_us"]["median"] = 1.0
    assert timing["graph_us"]["median"] == 12.5
    assert SCHEMA_VERSION == 1 and rec["schema_version"] == SCHEMA_VERSION
