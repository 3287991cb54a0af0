"""Model files (``fasttree.costmodel.persist``, skops archives): round trips, refusals, limits, conversion."""

from __future__ import annotations

import base64
import gzip
import io
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import skops.io

from fasttree.costmodel import persist
from fasttree.costmodel.features import FEATURE_NAMES, SIM_TOTAL
from fasttree.costmodel.gpu import KNOWN_GPUS
from fasttree.costmodel.model import KINDS, LatencyModel
from fasttree.costmodel.persist import META_MEMBER, SCHEMA_MEMBER, ModelFileError, load_model, save_model

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "costmodel" / "data" / "h200_latency_model.skops"
DATA = ROOT / "tests" / "data" / "costmodel"
H200 = KNOWN_GPUS["NVIDIA H200"]


def _data(seed: int, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.random((n, len(FEATURE_NAMES))) * 100 + 0.01
    y = 2.0 * X[:, SIM_TOTAL] * np.exp(X[:, 3] / 100 + rng.normal(0, 0.05, n))
    return X, y


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, LatencyModel, np.ndarray]:
    X, y = _data(0)
    m = LatencyModel(kind="gbrt", n_estimators=5, max_depth=3, n_seeds=2).fit(X, y)
    path = tmp_path_factory.mktemp("model") / "m.skops"
    save_model(path, m, gpu=H200, trace_hash="ab" * 32, trace_rows=len(X))
    return path, m, _data(1)[0]


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist()}


def _write(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _trees(schema: Any) -> list[dict[str, Any]]:
    """The Tree nodes of a skops schema."""
    found, stack = [], [schema]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            if obj.get("__class__") == "Tree":
                found.append(obj)
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)
    return found


def _tampered(saved_path: Path, out: Path, edit_nodes: Callable[[np.ndarray], None] | None = None, edit_tree=None):
    """A copy of the model file with the first tree's node array (``edit_nodes``) or schema entry edited."""
    members = _members(saved_path)
    schema = json.loads(members[SCHEMA_MEMBER])
    tree = _trees(schema)[0]
    state = tree["content"]["content"]
    if edit_nodes is not None:
        name = state["nodes"]["file"]
        nodes = np.load(io.BytesIO(members[name]))
        edit_nodes(nodes)
        buffer = io.BytesIO()
        np.save(buffer, nodes)
        members[name] = buffer.getvalue()
    if edit_tree is not None:
        edit_tree(tree, state)
    members[SCHEMA_MEMBER] = json.dumps(schema).encode()
    return _write(out, members)


# ------------------------------------------------------------------ round trips and the type allow-list
def test_round_trip_predicts_bit_identically(saved):
    path, m, x_new = saved
    loaded, meta = load_model(path, gpu_name="NVIDIA H200")
    assert np.array_equal(loaded.predict(x_new), m.predict(x_new))
    assert np.array_equal(loaded.predict_members(x_new), m.predict_members(x_new))
    assert meta["format_version"] == persist.MODEL_FORMAT_VERSION and meta["trace_set"]["rows"] == 200
    # a plain skops archive: skops reads it with the same allow-list
    regressors = skops.io.load(path, trusted=sorted(persist.TRUSTED_TYPES))
    assert np.array_equal(regressors[0].predict(x_new), m.estimators_[0].predict(x_new))


def test_trusted_types_are_exactly_what_the_model_kinds_are_made_of():
    X, y = _data(2, n=120)
    seen: set[str] = set()
    for kind in KINDS:
        m = LatencyModel(kind=kind, n_estimators=3, max_depth=3, n_seeds=2).fit(X, y)
        data = skops.io.dumps(list(m.estimators_))
        # skops' own audit: the tree is the one type it does not trust by default
        assert skops.io.get_untrusted_types(data=data) == ["sklearn.tree._tree.Tree"]
        stack = [json.loads(zipfile.ZipFile(io.BytesIO(data)).read(SCHEMA_MEMBER))]
        while stack:
            obj = stack.pop()
            if isinstance(obj, dict):
                if "__class__" in obj:
                    name = f"{obj['__module__']}.{obj['__class__']}"
                    assert obj["__loader__"] in persist.TRUSTED_TYPES[name], name
                    seen.add(name)
                stack.extend(obj.values())
            elif isinstance(obj, list):
                stack.extend(obj)
    # the canonical name of the loss is trusted too, for files of a scikit-learn that names it so
    assert seen <= set(persist.TRUSTED_TYPES)
    assert set(persist.TRUSTED_TYPES) - seen <= {"sklearn._loss._loss.CyHalfSquaredError"}


def test_shipped_model_loads_within_the_limits_with_room():
    info = zipfile.ZipFile(SHIPPED).infolist()
    assert SHIPPED.stat().st_size * 4 <= persist.MAX_FILE_BYTES * 1.2
    assert sum(i.file_size for i in info) * 4 <= persist.MAX_INFLATED_BYTES * 1.2
    assert len(info) * 4 <= persist.MAX_MEMBERS * 1.2
    model, meta = load_model(SHIPPED, gpu_name="NVIDIA H200")
    assert meta["model_params"]["kind"] == "gbrt" and len(model.estimators_) == meta["model_params"]["n_seeds"]
    assert meta["converted_from"]["format_version"] == 2


# ------------------------------------------------------------------ refusals
def test_untrusted_types_are_refused_even_when_skops_trusts_them(saved, tmp_path):
    path = saved[0]
    members = _members(path)
    text = members[SCHEMA_MEMBER].decode()
    # LinearRegression is trusted by skops' defaults, but no latency model is made of it
    swapped = text.replace('"DummyRegressor"', '"LinearRegression"')
    members[SCHEMA_MEMBER] = swapped.replace('"sklearn.dummy"', '"sklearn.linear_model"').encode()
    with pytest.raises(ModelFileError, match=r"not made of: sklearn\.linear_model\.LinearRegression"):
        load_model(_write(tmp_path / "lr.skops", members))
    function = {"__class__": "system", "__module__": "os", "__loader__": "FunctionNode", "content": {}}
    schema = json.loads(text)
    schema["content"][0]["content"]["content"]["init"] = function
    members[SCHEMA_MEMBER] = json.dumps(schema).encode()
    with pytest.raises(ModelFileError, match=r"os\.system \(FunctionNode\)"):
        load_model(_write(tmp_path / "fn.skops", members))


def _left(i: int, value: int) -> Callable[[np.ndarray], None]:
    def edit(nodes: np.ndarray) -> None:
        nodes["left_child"][i] = value

    return edit


def _set_feature(nodes: np.ndarray) -> None:
    nodes["feature"][0] = len(FEATURE_NAMES) + 3


def _json_edit(key: str, value: Any):
    def edit(tree: dict[str, Any], state: dict[str, Any]) -> None:
        state[key]["content"] = json.dumps(value)
        state[key].pop("__id__", None)  # skops reuses the first node it read under one id

    return edit


def _outputs(tree: dict[str, Any], state: dict[str, Any]) -> None:
    tree["__reduce__"]["args"]["content"][2]["content"] = "2"
    tree["__reduce__"]["args"]["content"][2].pop("__id__", None)


@pytest.mark.parametrize(
    ("edits", "match"),
    [
        ({"edit_nodes": _left(0, 10**6)}, r"children_left\[0\] = 1000000 is out of range"),
        ({"edit_nodes": _left(1, 0)}, "the root node 0 is the child of another node"),
        ({"edit_nodes": _set_feature}, r"feature\[0\] = 84 is out of range"),
        ({"edit_tree": _json_edit("node_count", 2)}, r"children_(left|right)\[\d+\] = \d+ is out of range \[-1, 2\)"),
        ({"edit_tree": _json_edit("max_depth", 1)}, "max_depth is 1 but the tree is 3 deep"),
        ({"edit_tree": _outputs}, "not a single-output regression tree"),
    ],
)
def test_tampered_trees_are_refused_before_anything_predicts(saved, tmp_path, edits, match):
    bad = _tampered(saved[0], tmp_path / "t.skops", **edits)
    with pytest.raises(ModelFileError, match=match):
        load_model(bad)


def test_damaged_and_foreign_files_are_refused(saved, tmp_path):
    raw = saved[0].read_bytes()
    bad = tmp_path / "bad.skops"
    for data, match in [
        (raw[: len(raw) // 2], "damaged zip"),
        (raw[:200] + b"\x00" * 100 + raw[300:], "damaged zip|cannot be rebuilt"),
        (b"PK\x03\x04" + b"\x00" * 50, "damaged zip"),
        (b"\x89PNG\r\n", "not a model file"),
        (gzip.compress(b'{"format": "fasttree-latency-model"}'), "gzip or JSON.*persist convert"),
    ]:
        bad.write_bytes(data)
        with pytest.raises(ModelFileError, match=match):
            load_model(bad)
    members = _members(saved[0])
    _write(bad, {k: v for k, v in members.items() if k != META_MEMBER})
    with pytest.raises(ModelFileError, match=r"no fasttree_model\.json"):
        load_model(bad)
    _write(bad, {**members, "notes.txt": b"x"})
    with pytest.raises(ModelFileError, match=r"unexpected member 'notes\.txt'"):
        load_model(bad)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.skops")


def _zip_bomb(path: Path, saved_path: Path) -> Path:
    """A model with one more member that inflates past the limit (declared honestly in the zip directory)."""
    _write(path, _members(saved_path))
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as zf, zf.open("pad.npy", "w") as f:
        chunk = bytes(2**20)
        for _ in range(persist.MAX_INFLATED_BYTES // 2**20 + 1):
            f.write(chunk)
    return path


def _lying_schema(path: Path, saved_path: Path) -> Path:
    """schema.json inflates to 512 MiB, its local header and directory entry say 4 kB."""
    members = _members(saved_path)
    del members[SCHEMA_MEMBER]
    _write(path, members)
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as zf, zf.open(SCHEMA_MEMBER, "w") as f:
        for _ in range(512):
            f.write(b" " * 2**20)
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(SCHEMA_MEMBER).header_offset
    raw = bytearray(path.read_bytes())
    raw[local + 22 : local + 26] = (4096).to_bytes(4, "little")
    for entry in re.finditer(re.escape(b"PK\x01\x02"), raw):
        at = entry.start()
        n = int.from_bytes(raw[at + 28 : at + 30], "little")
        if bytes(raw[at + 46 : at + 46 + n]) == SCHEMA_MEMBER.encode():
            raw[at + 24 : at + 28] = (4096).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    return path


def _array_bomb(path: Path, saved_path: Path) -> Path:
    """An array member whose header declares 8 TB."""
    members = _members(saved_path)
    name = next(k for k in members if k.endswith(".npy"))
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"
    header += " " * (63 - (len(header) + 10) % 64) + "\n"
    members[name] = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(64)
    return _write(path, members)


def _token_bomb(path: Path, saved_path: Path) -> Path:
    """A schema.json of 3.2 million tiny JSON values (12 MB: inflates to many more bytes of Python objects)."""
    members = _members(saved_path)
    members[SCHEMA_MEMBER] = b"[" + b"1.5," * 3_200_000 + b"1]"
    return _write(path, members)


def _json_bomb(path: Path, saved_path: Path) -> Path:
    """The old-format bomb of issue 38 (D1), on a smaller scale: a gzip JSON document of 300 MB."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"format": "fasttree-latency-model", "extra": [')
        for _ in range(300):
            f.write(b"{}, " * 2**18)
        f.write(b"{}]}")
    return path


def _deep(path: Path, saved_path: Path) -> Path:
    members = _members(saved_path)
    members[SCHEMA_MEMBER] = b'{"a": ' * 500 + b"1" + b"}" * 500
    return _write(path, members)


CRAFTED = {
    "zip_bomb": (_zip_bomb, "inflate to .* more than any model"),
    "lying_headers": (_lying_schema, "damaged zip"),
    "array_bomb": (_array_bomb, "not its array's"),
    "token_bomb": (_token_bomb, "JSON tokens, more than any model's"),
    "old_json_bomb": (_json_bomb, "gzip or JSON file"),
    "deep": (_deep, "nested more than 64 deep"),
}


@pytest.fixture(scope="module")
def crafted(saved, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("crafted")
    return {name: make(folder / f"{name}.skops", saved[0]) for name, (make, _) in CRAFTED.items()}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_files_are_refused(crafted, name):
    with pytest.raises(ModelFileError, match=CRAFTED[name][1]):
        load_model(crafted[name])


# The load runs under an address-space limit of the process's own size after the imports plus 4x the shipped
# model's inflated size (38 MB): the shipped model loads within it, the crafted files are refused within it.
_UNDER_LIMIT = """
import resource, sys, zipfile
import numpy, sklearn.ensemble, skops.io
from fasttree.costmodel.persist import ModelFileError, load_model
shipped = zipfile.ZipFile(sys.argv[1])
extra = 4 * sum(i.file_size for i in shipped.infolist())
size = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))
for path in sys.argv[1:]:
    try:
        load_model(path)
        print("loaded", path)
    except ModelFileError as exc:
        print("refused", exc)
"""


def test_crafted_files_are_refused_under_a_memory_limit(crafted):
    paths = [str(SHIPPED), *(str(crafted[name]) for name in CRAFTED)]
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", _UNDER_LIMIT, *paths], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == f"loaded {SHIPPED}"
    assert len(lines) == 1 + len(CRAFTED) and all(line.startswith("refused ") for line in lines[1:]), r.stdout
    for line, (_, match) in zip(lines[1:], CRAFTED.values(), strict=True):
        assert "MemoryError" not in line
        assert re.search(match, line), line


def test_save_refuses_a_model_load_would_refuse(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(persist, "MAX_INFLATED_BYTES", 10_000)
    with pytest.raises(ValueError, match="cannot save a model that load_model would refuse"):
        save_model(tmp_path / "big.skops", saved[1], gpu=H200, trace_hash="x", trace_rows=1)
    assert not (tmp_path / "big.skops").exists()


# ------------------------------------------------------------------ the real entry points
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fasttree.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.fixture(scope="module")
def no_kind(saved, tmp_path_factory) -> Path:
    """Issue 38 D4: a model whose model_params is empty."""
    members = _members(saved[0])
    meta = json.loads(members[META_MEMBER])
    members[META_MEMBER] = json.dumps({**meta, "model_params": {}}).encode()
    return _write(tmp_path_factory.mktemp("d4") / "no_kind.skops", members)


@pytest.mark.parametrize("which", ["no_kind", "zip_bomb", "old_json_bomb"])
@pytest.mark.parametrize("command", ["evaluate", "tune"])
def test_the_cli_refuses_a_crafted_model_with_one_line(command, which, no_kind, crafted, tmp_path):
    model = str(no_kind if which == "no_kind" else crafted[which])
    if command == "evaluate":
        r = _cli("evaluate", "--model", model, "traces/h200_heldout")
    else:
        workloads = "fasttree/toolkit/data/workloads/paper_suite.jsonl.gz"
        r = _cli("tune", workloads, "--model", model, "--trials", "1", "--storage", str(tmp_path / "s.db"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
    error = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and model in error[0], r.stderr
    if which == "no_kind":
        assert "model_params lacks kind" in error[0]


# ------------------------------------------------------------------ converting older JSON files
def test_format_2_files_convert_bit_identically(tmp_path):
    expected = json.loads((DATA / "format2_expected.json").read_text())
    X = np.array(expected["X"])
    for name, old in [("gbrt", DATA / "format2_gbrt.json.gz"), ("forest", DATA / "format2_forest.json")]:
        with pytest.raises(ModelFileError, match="persist convert"):
            load_model(old)
        new = tmp_path / f"{name}.skops"
        r = subprocess.run(
            [sys.executable, "-m", "fasttree.costmodel.persist", "convert", str(old), str(new)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        model, meta = load_model(new)
        # the expected predictions were computed on another CPU: gradient boosting's sums of many
        # trees may differ there in the last bit (1.5e-16 relative seen), a wrong conversion by far more
        np.testing.assert_allclose(model.predict(X), np.array(expected[name]), rtol=1e-12, atol=0)
        assert meta["converted_from"]["format_version"] == 2 and meta["extra"]["simulator_baseline"]["coef"]
        assert meta["model_params"]["kind"] == name
    r = subprocess.run(
        [sys.executable, "-m", "fasttree.costmodel.persist", "convert", str(old), str(new)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "exists" in r.stderr and "Traceback" not in r.stderr


def test_format_1_files_convert_as_one_seed_models(tmp_path):
    expected = json.loads((DATA / "format2_expected.json").read_text())
    doc = json.loads((DATA / "format2_forest.json").read_text())
    v1 = {k: v for k, v in doc.items() if k != "estimators"}
    v1["format_version"], v1["estimator"] = 1, doc["estimators"][0]
    v1["model_params"] = {k: v for k, v in doc["model_params"].items() if k not in ("n_seeds", "n_jobs")}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    persist.convert(tmp_path / "v1.json", tmp_path / "v1.skops")
    model, meta = load_model(tmp_path / "v1.skops")
    assert model.n_seeds == 1 and meta["converted_from"]["format_version"] == 1
    assert np.array_equal(model.predict(np.array(expected["X"])), np.array(expected["forest"]))


def test_conversion_refuses_bad_old_files(tmp_path):
    doc = json.loads(gzip.decompress((DATA / "format2_gbrt.json.gz").read_bytes()))
    bad = tmp_path / "bad.json"
    tree = doc["estimators"][0]["estimators"][0]["tree"]
    left = np.frombuffer(base64.b64decode(tree["nodes"]["children_left"]["data"]), "<i8").copy()
    left[0] = 10**6
    tree["nodes"]["children_left"]["data"] = base64.b64encode(left.tobytes()).decode()
    bad.write_text(json.dumps(doc))
    with pytest.raises(ModelFileError, match=r"children_left\[0\] = 1000000 is out of range"):
        persist.convert(bad, tmp_path / "x.skops")
    bad.write_text(json.dumps({**doc, "model_params": {}}))
    with pytest.raises(ModelFileError, match="model_params lacks kind"):
        persist.convert(bad, tmp_path / "x.skops")
    bad.write_bytes(gzip.compress(b"{" * 10)[:-4])
    with pytest.raises(ModelFileError, match="gzip"):
        persist.convert(bad, tmp_path / "x.skops")
    assert not (tmp_path / "x.skops").exists()
