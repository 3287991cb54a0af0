"""The tuned-config export: round trips, lookup and fallback, and validation on load."""

import copy
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fasttree
from fasttree import ConfigExport, ExportEntry, FastTreeConfig, read_export, write_export
from fasttree.export import EXPORT_SCHEMA, EXPORT_SCHEMA_VERSION, bucket_key, config_from_export

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
TUNED_G4 = FastTreeConfig(alpha=0.5, gamma=-1.0, kv_tile=(128, 32), kv_split_sizes=(512, 64), pack_tokens=0)
TUNED_G1 = FastTreeConfig(q_tile_queries=(32, 8), num_warps=(8, 4), num_stages=(2, 4))
TUNED_BF16 = FastTreeConfig(beta=0.9, para_threshs1=(10, 20))
TUNED_H100 = FastTreeConfig(kv_tile=(32, 32))


def _entry(gpu, g, d, dtype, config, **prov):
    provenance = {
        "study_name": f"{gpu}-g{g}-d{d}-{dtype}",
        "n_trials": 200,
        "predicted_default_us": 100.0,
        "predicted_tuned_us": 80.0,
        "predicted_gain": 0.2,
        **prov,
    }
    return ExportEntry(gpu=gpu, group_size=g, head_dim=d, dtype=dtype, config=config, provenance=provenance)


def _export() -> ConfigExport:
    return ConfigExport(
        entries=(
            _entry(H200, 4, 128, "float16", TUNED_G4),
            _entry(H200, 1, 128, "float16", TUNED_G1),
            _entry(H200, 4, 128, "bfloat16", TUNED_BF16),
            _entry(H100, 4, 128, "float16", TUNED_H100),
        ),
        provenance={
            "created_utc": "2025-01-01T00:00:00Z",
            "fasttree_version": fasttree.__version__,
            "trace_set_hash": "a" * 64,
            "model_hash": "b" * 64,
            "notes": {"trace_paths": ["traces/h200.jsonl"], "seed": 0},
        },
    )


@pytest.fixture
def export_file(tmp_path: Path) -> Path:
    return write_export(tmp_path / "tuned.json", _export())


def _doc() -> dict:
    return _export().to_dict()


def _write_doc(tmp_path: Path, doc) -> Path:
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    return path


# ------------------------------------------------------------------------- round trip


def test_round_trip_gives_back_equal_export(export_file):
    back = read_export(export_file)
    assert back == _export()
    assert back.provenance["trace_set_hash"] == "a" * 64
    assert back.provenance["notes"] == {"trace_paths": ["traces/h200.jsonl"], "seed": 0}


@pytest.mark.parametrize(
    ("gpu", "hq", "hkv", "dtype", "expected"),
    [
        (H200, 32, 8, "float16", TUNED_G4),
        (H200, 32, 32, "float16", TUNED_G1),
        (H200, 32, 8, "bfloat16", TUNED_BF16),
        (H100, 32, 8, "float16", TUNED_H100),
    ],
)
def test_lookup_after_round_trip_gives_the_tuned_config(export_file, gpu, hq, hkv, dtype, expected):
    config, entry = read_export(export_file).lookup(
        gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype=dtype
    )
    assert config == expected
    assert config != FastTreeConfig()
    assert entry is not None
    assert (entry.gpu, entry.bucket) == (gpu, (hq // hkv, 128, dtype))
    assert entry.provenance["predicted_gain"] == 0.2


def test_from_export_loads_the_matching_entry(export_file):
    config = config_from_export(export_file, gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16")
    assert config == TUNED_G4
    assert isinstance(config, FastTreeConfig)


def test_from_export_accepts_a_str_path(export_file):
    config = config_from_export(
        str(export_file), gpu=H200, num_q_heads=8, num_kv_heads=8, head_dim=128, dtype="float16"
    )
    assert config == TUNED_G1


@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (16, 4), (4, 1), (64, 16)])
def test_gqa_ratio_decides_the_bucket(export_file, hq, hkv):
    config = config_from_export(export_file, gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype="float16")
    assert config == TUNED_G4


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float16, TUNED_G4),
        ("float16", TUNED_G4),
        (torch.half, TUNED_G4),
        (torch.bfloat16, TUNED_BF16),
        ("bfloat16", TUNED_BF16),
    ],
)
def test_dtype_as_string_or_torch_dtype(export_file, dtype, expected):
    config = config_from_export(export_file, gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype)
    assert config == expected


def test_entries_are_stored_in_canonical_order():
    forward = _export()
    backward = ConfigExport(entries=tuple(reversed(forward.entries)), provenance=forward.provenance)
    assert backward == forward
    assert backward.to_dict() == forward.to_dict()


def test_provenance_is_copied_not_aliased():
    prov = {"trace_set_hash": "x", "notes": {"k": [1, 2]}}
    export = ConfigExport(entries=(), provenance=prov)
    prov["notes"]["k"].append(3)
    assert export.provenance["notes"]["k"] == [1, 2]


# -------------------------------------------------------------------------- fallback


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "dtype"),
    [
        (32, 8, 64, "float16"),  # unseen head_dim
        (16, 2, 128, "float16"),  # unseen GQA ratio (8)
        (32, 32, 128, "bfloat16"),  # g=1 is tuned for float16 only
    ],
)
def test_unseen_bucket_falls_back_to_defaults(export_file, caplog, hq, hkv, d, dtype):
    with caplog.at_level(logging.INFO, logger="fasttree.export"):
        config, entry = read_export(export_file).lookup(
            gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype
        )
    assert entry is None
    assert config == FastTreeConfig()
    messages = [r.getMessage() for r in caplog.records if r.name == "fasttree.export" and r.levelno == logging.INFO]
    assert any("using the defaults" in m and f"head_dim={d}" in m for m in messages), messages


def test_unseen_gpu_falls_back_to_defaults(export_file, caplog):
    with caplog.at_level(logging.INFO, logger="fasttree.export"):
        config = config_from_export(
            export_file, gpu="NVIDIA A100-SXM4-80GB", num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16"
        )
    assert config == FastTreeConfig()
    assert any("NVIDIA A100-SXM4-80GB" in r.getMessage() and "defaults" in r.getMessage() for r in caplog.records)


def test_gpu_name_must_match_exactly(export_file):
    config, entry = read_export(export_file).lookup(
        gpu="nvidia h200", num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16"
    )
    assert entry is None
    assert config == FastTreeConfig()


def test_empty_export_falls_back(tmp_path):
    path = write_export(tmp_path / "empty.json", ConfigExport(entries=(), provenance={}))
    config, entry = read_export(path).lookup(gpu=H200, num_q_heads=8, num_kv_heads=8, head_dim=128, dtype="float16")
    assert (config, entry) == (FastTreeConfig(), None)


# --------------------------------------------------------------- lookup argument errors


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "dtype", "match"),
    [
        (30, 8, 128, "float16", "multiple of num_kv_heads"),
        (0, 8, 128, "float16", "num_q_heads must be a positive integer"),
        (32, 0, 128, "float16", "num_kv_heads must be a positive integer"),
        (32, 8, 8, "float16", "head_dim must be in"),
        (32.0, 8, 128, "float16", "num_q_heads must be a positive integer"),
        (32, 8, 128, "float32", "dtype must be one of"),
        (32, 8, 128, "fp16", "dtype must be one of"),
        (32, 8, 128, torch.float32, "dtype must be one of"),
    ],
)
def test_invalid_shape_is_a_value_error(export_file, hq, hkv, d, dtype, match):
    export = read_export(export_file)
    with pytest.raises(ValueError, match=match):
        export.lookup(gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        config_from_export(export_file, gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)


def test_invalid_shape_is_reported_before_the_file_is_read(tmp_path):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        config_from_export(
            tmp_path / "missing.json", gpu=H200, num_q_heads=30, num_kv_heads=8, head_dim=128, dtype="float16"
        )


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        config_from_export(
            tmp_path / "missing.json", gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16"
        )


def test_bucket_key():
    assert bucket_key(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16) == (4, 128, "bfloat16")
    assert bucket_key(num_q_heads=16, num_kv_heads=16, head_dim=64, dtype="float16") == (1, 64, "float16")


# ------------------------------------------------------------------ validation on load


def _mutations():
    """(id, change to the dict, expected message) for every refused document."""

    def set_top(key, value):
        return lambda d: d.__setitem__(key, value)

    def set_entry(i, key, value):
        return lambda d: d["entries"][i].__setitem__(key, value)

    def set_config(i, key, value):
        return lambda d: d["entries"][i]["config"].__setitem__(key, value)

    def del_entry_key(i, key):
        return lambda d: d["entries"][i].pop(key)

    def del_config_key(i, key):
        return lambda d: d["entries"][i]["config"].pop(key)

    def duplicate(d):
        d["entries"].append(copy.deepcopy(d["entries"][1]))

    def duplicate_other_config(d):
        # same GPU and bucket with another provenance and config: still a duplicate
        dup = copy.deepcopy(d["entries"][0])
        dup["config"]["alpha"] = 0.1
        dup["provenance"] = {"study_name": "again"}
        d["entries"].append(dup)

    return [
        ("wrong schema", set_top("schema", "fasttree-config"), r"not a fasttree-export file.*'fasttree-config'"),
        ("missing schema", lambda d: d.pop("schema"), r"not a fasttree-export file.*None"),
        ("version 2", set_top("schema_version", 2), r"schema_version 2 is not supported.*reads version 1"),
        ("version as str", set_top("schema_version", "1"), r"schema_version '1' is not supported"),
        ("version true", set_top("schema_version", True), r"schema_version True is not supported"),
        ("unknown top field", set_top("comment", "hi"), r"unknown export fields \['comment'\]"),
        ("missing entries", lambda d: d.pop("entries"), r"missing export fields \['entries'\]"),
        ("entries not a list", set_top("entries", {}), r"entries must be a JSON array"),
        ("top provenance not object", set_top("provenance", []), r"provenance must be a JSON object"),
        ("entry not object", set_top("entries", [1]), r"entries\[0\]: must be a JSON object"),
        ("unknown entry field", set_entry(2, "tuned_by", "me"), r"entries\[2\]: unknown entry fields \['tuned_by'\]"),
        ("missing entry field", del_entry_key(1, "dtype"), r"entries\[1\]: missing entry fields \['dtype'\]"),
        ("duplicate bucket", duplicate, r"entries\[4\] duplicates entries\[1\].*group_size 4"),
        ("duplicate bucket 2", duplicate_other_config, r"entries\[4\] duplicates entries\[0\]"),
        ("kv_tile 48", set_config(0, "kv_tile", [48, 32]), r"entries\[0\]: config: FastTreeConfig\.kv_tile"),
        ("num_warps 3", set_config(1, "num_warps", [3, 4]), r"entries\[1\]: config: FastTreeConfig\.num_warps"),
        ("alpha string", set_config(0, "alpha", "0.5"), r"entries\[0\]: config: FastTreeConfig\.alpha"),
        ("unknown config key", set_config(0, "block_m", 64), r"entries\[0\]: config: unknown FastTreeConfig keys"),
        ("config version 9", set_config(0, "schema_version", 9), r"entries\[0\]: config: .*schema_version 9"),
        ("config missing field", del_config_key(3, "pack_tokens"), r"entries\[3\]: config is missing.*pack_tokens"),
        ("config no version", del_config_key(0, "schema_version"), r"entries\[0\]: config\.schema_version is miss"),
        ("config not object", set_entry(0, "config", [1]), r"entries\[0\]: config must be a JSON object"),
        ("group_size 0", set_entry(0, "group_size", 0), r"entries\[0\]: group_size must be an integer >= 1"),
        ("group_size float", set_entry(0, "group_size", 4.0), r"entries\[0\]: group_size must be an integer"),
        ("head_dim 8", set_entry(0, "head_dim", 8), r"entries\[0\]: head_dim must be an integer in \[16, 256\]"),
        ("dtype float32", set_entry(0, "dtype", "float32"), r"entries\[0\]: dtype must be one of"),
        ("gpu empty", set_entry(0, "gpu", ""), r"entries\[0\]: gpu must be a non-empty string"),
        ("gpu not str", set_entry(0, "gpu", 7), r"entries\[0\]: gpu must be a non-empty string"),
        (
            "tiles too big for g",
            set_config(1, "q_tile_queries", [128, 16]),
            r"entries\[1\]: config does not fit group_size 4.*512 rows",
        ),
        ("n_trials negative", set_entry(0, "provenance", {"n_trials": -1}), r"provenance\.n_trials must be"),
        (
            "predicted_tuned_us zero",
            set_entry(0, "provenance", {"predicted_tuned_us": 0}),
            r"entries\[0\]: provenance\.predicted_tuned_us must be a finite number > 0",
        ),
        ("hash not str", lambda d: d["provenance"].__setitem__("model_hash", 5), r"provenance\.model_hash must be"),
    ]


_MUTATIONS = _mutations()


@pytest.mark.parametrize(("mutate", "match"), [m[1:] for m in _MUTATIONS], ids=[m[0] for m in _MUTATIONS])
def test_invalid_document_is_refused(tmp_path, mutate, match):
    doc = _doc()
    mutate(doc)
    with pytest.raises(ValueError, match=match):
        ConfigExport.from_dict(doc)
    path = _write_doc(tmp_path, doc)
    with pytest.raises(ValueError, match=match) as info:
        read_export(path)
    assert str(path) in str(info.value)


def test_the_unmutated_document_is_accepted(tmp_path):
    # the counterpart of test_invalid_document_is_refused: its baseline loads fine
    assert read_export(_write_doc(tmp_path, _doc())) == _export()


def test_error_indices_refer_to_the_file_order(tmp_path):
    # entries[i] in a message is the i-th entry of the file, not of the sorted export
    doc = _doc()
    doc["entries"].reverse()
    doc["entries"][0]["config"]["kv_tile"] = [48, 48]
    with pytest.raises(ValueError, match=r"entries\[0\]: config: FastTreeConfig\.kv_tile"):
        read_export(_write_doc(tmp_path, doc))


@pytest.mark.parametrize("where", ["top", "entry", "nested"])
def test_nan_in_provenance_is_refused(tmp_path, where):
    doc = _doc()
    if where == "top":
        doc["provenance"]["extra"] = math.nan
    elif where == "entry":
        doc["entries"][0]["provenance"]["predicted_gain"] = math.nan
    else:
        doc["entries"][0]["provenance"]["notes"] = {"xs": [1.0, math.inf]}
    with pytest.raises(ValueError, match=r"provenance.*(NaN|finite)"):
        ConfigExport.from_dict(doc)
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(doc))  # Python's json writes the NaN/Infinity literals
    with pytest.raises(ValueError, match=r"nan\.json: invalid JSON \((NaN|Infinity) is not valid JSON\)"):
        read_export(path)


def test_nan_in_provenance_is_refused_when_building():
    with pytest.raises(ValueError, match=r"provenance\.predicted_gain is nan; NaN"):
        _entry(H200, 4, 128, "float16", TUNED_G4, predicted_gain=math.nan)
    with pytest.raises(ValueError, match=r"provenance\.x is nan; NaN"):
        ConfigExport(entries=(), provenance={"x": math.nan})


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({1: "a"}, "non-string key 1"),
        ({"a": {1, 2}}, r"provenance\.a is a set"),
        ({"a": b"bytes"}, r"provenance\.a is a bytes"),
        ({"a": object()}, r"provenance\.a is a object"),
    ],
)
def test_non_json_provenance_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        ConfigExport(entries=(), provenance=value)


def test_duplicate_entry_is_refused_when_building():
    e = _entry(H200, 4, 128, "float16", TUNED_G4)
    with pytest.raises(ValueError, match=r"entries\[1\] duplicates entries\[0\]"):
        ConfigExport(entries=(e, _entry(H200, 4, 128, "float16", TUNED_G1)), provenance={})


def test_non_json_file_is_refused(tmp_path):
    path = tmp_path / "tuned.py"
    path.write_text("CONFIG = dict(alpha=0.5)\n")
    with pytest.raises(ValueError, match=r"tuned\.py: malformed or truncated JSON"):
        read_export(path)


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "tuned.pkl"
    path.write_bytes(b"\x80\x04\x95\xff\xfe")
    with pytest.raises(ValueError, match=r"tuned\.pkl: not a UTF-8 text file"):
        read_export(path)


def test_truncated_file_is_refused(export_file):
    text = export_file.read_text()
    export_file.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"tuned\.json: malformed or truncated JSON"):
        read_export(export_file)


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("")
    with pytest.raises(ValueError, match=r"empty\.json: malformed or truncated JSON"):
        read_export(path)


@pytest.mark.parametrize("doc", [[], "fasttree-export", 1, None])
def test_non_object_document_is_refused(tmp_path, doc):
    with pytest.raises(ValueError, match=r"doc\.json: an export must be a JSON object"):
        read_export(_write_doc(tmp_path, doc))


def test_duplicate_json_keys_are_refused(tmp_path):
    text = json.dumps(_doc())
    # a second "schema_version" key: Python's json would silently keep the last one
    text = text.replace('"schema_version": 1', '"schema_version": 1, "schema_version": 1', 1)
    path = tmp_path / "dup.json"
    path.write_text(text)
    assert text.count('"schema_version": 1') == 2
    with pytest.raises(ValueError, match=r"dup\.json: invalid JSON \(duplicate key 'schema_version'"):
        read_export(path)


# ----------------------------------------------------------------------------- writing


def test_write_refuses_to_overwrite(export_file):
    before = export_file.read_bytes()
    other = ConfigExport(entries=(), provenance={"trace_set_hash": "c"})
    with pytest.raises(FileExistsError, match=r"tuned\.json exists.*overwrite=True"):
        write_export(export_file, other)
    assert export_file.read_bytes() == before
    write_export(export_file, other, overwrite=True)
    assert read_export(export_file) == other


def test_write_creates_missing_folders(tmp_path):
    path = write_export(tmp_path / "a" / "b" / "tuned.json", _export())
    assert read_export(path) == _export()


def test_write_takes_only_a_config_export(tmp_path):
    with pytest.raises(ValueError, match="must be a ConfigExport"):
        write_export(tmp_path / "x.json", _doc())


def test_written_file_is_sorted_pretty_plain_json(export_file):
    text = export_file.read_text()
    assert text.endswith("}\n")
    doc = json.loads(text)
    assert doc["schema"] == EXPORT_SCHEMA
    assert doc["schema_version"] == EXPORT_SCHEMA_VERSION
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"  # sorted keys, 2-space indent
    assert list(doc) == sorted(doc)
    assert list(doc["entries"][0]) == sorted(doc["entries"][0])
    for construct in ("NaN", "Infinity", "(", "<", "!!python", "__", "torch", "tuple"):
        assert construct not in text, construct
    # pairs are JSON arrays
    assert all(isinstance(e["config"]["kv_tile"], list) for e in doc["entries"])
    assert {e["gpu"] for e in doc["entries"]} == {H200, H100}


def test_written_entries_hold_every_config_field(export_file):
    doc = json.loads(export_file.read_text())
    for entry in doc["entries"]:
        assert set(entry["config"]) == set(FastTreeConfig().to_dict())


def test_export_module_imports_no_heavy_optional_packages():
    code = (
        "import sys, fasttree.export; "
        "bad = [m for m in ('sklearn', 'optuna', 'scipy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
