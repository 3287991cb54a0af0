"""The tuned export (format 3): round trips, lookup per target (bound to the head layout, tuned
members only inside their leaves' regions of evidence), guard and fallback, version-1 and version-2
files, and validation on load."""

import copy
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fasttree
from fasttree import (
    ConfigExport,
    ExportEntry,
    ExportGuard,
    FastTreeConfig,
    LeafRegion,
    Portfolio,
    Selector,
    load_portfolio,
    read_export,
    write_export,
)
from fasttree import export as export_module
from fasttree.export import EXPORT_SCHEMA, EXPORT_SCHEMA_VERSION, bucket_key
from fasttree.plan_arrays import DEVICE_ARRAYS
from fasttree.portfolio import MAX_SELECTOR_DEPTH, TREE_FEATURES, tree_features
from fasttree.versions import KERNEL_VERSION, defaults_fingerprint

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
DEFAULTS = FastTreeConfig()
TUNED_G4 = FastTreeConfig(alpha=0.5, gamma=-1.0, kv_tile=(128, 32), kv_split_sizes=(512, 64), pack_tokens=0)
TUNED_G1 = FastTreeConfig(q_tile_queries=(32, 8), num_warps=(8, 4), num_stages=(2, 4))
TUNED_BF16 = FastTreeConfig(beta=0.9, para_threshs1=(10, 20))
TUNED_H100 = FastTreeConfig(kv_tile=(32, 32))
#: A runtime member: plan-level fields only, so it shares the defaults' launch shapes.
TUNED_RT = FastTreeConfig(alpha=0.4, kv_split_sizes=(512, 64), pack_tokens=256)

#: One leaf picking member 1 for every tree.
ONE_LEAF = Selector(member=(1,))
#: A real split: trees of at most 64 queries (log2 6) keep the defaults, larger ones get member 1.
QUERIES = TREE_FEATURES.index("log2_queries")
SPLIT = Selector(
    feature=(QUERIES, -1, -1), threshold=(6.0, 0.0, 0.0), left=(1, -1, -1), right=(2, -1, -1), member=(0, 0, 1)
)
#: Trees on either side of SPLIT: a shared prefix and 64 (left) or 128 (right) one-query leaves.
SMALL_TREE = fasttree.KVTree.from_levels((1, 64), (256, 32))
LARGE_TREE = fasttree.KVTree.from_levels((1, 128), (256, 32))


#: KV heads the test entries' regions list (with the entry's group size): 1 to 32.
KV_HEADS = (1, 2, 4, 8, 16, 32)


def _regions(selector: Selector, g: int) -> tuple:
    """A wide box (every test tree inside) at KV_HEADS x ``g`` on every leaf naming a tuned member."""
    n = len(TREE_FEATURES)
    wide = LeafRegion(lo=(-1e6,) * n, hi=(1e6,) * n, layouts=tuple((kv, g) for kv in KV_HEADS), trees=8,
                      evidence="measured")  # fmt: skip
    return tuple(wide if f < 0 and m else None for f, m in zip(selector.feature, selector.member, strict=True))


def _portfolio(tuned, selector=ONE_LEAF, *, runtime=False, g=4) -> Portfolio:
    return Portfolio(members=(DEFAULTS, tuned), selector=selector, runtime=runtime, regions=_regions(selector, g))


def _served(tuned, hq, hkv, selector=ONE_LEAF, *, runtime=False) -> Portfolio:
    """The portfolio a lookup for ``hq``/``hkv`` heads gives: :func:`_portfolio` bound to that layout."""
    return _portfolio(tuned, selector, runtime=runtime, g=hq // hkv).for_heads(hq, hkv)


def _entry(gpu, g, d, dtype, config, *, target="tree_attention", selector=ONE_LEAF, guard=None, **prov):
    provenance = {
        "study_name": f"{gpu}-g{g}-d{d}-{dtype}",
        "n_trials": 200,
        "predicted_default_us": 100.0,
        "predicted_tuned_us": 80.0,
        "predicted_gain": 0.2,
        **prov,
    }
    return ExportEntry(
        gpu=gpu, group_size=g, head_dim=d, dtype=dtype,
        portfolio=_portfolio(config, selector, runtime=target == "runtime", g=g), provenance=provenance,
        target=target, guard=ExportGuard.current("c" * 64) if guard is None else guard,
    )  # fmt: skip


def _export() -> ConfigExport:
    return ConfigExport(
        entries=(
            _entry(H200, 4, 128, "float16", TUNED_G4),
            _entry(H200, 1, 128, "float16", TUNED_G1),
            _entry(H200, 4, 128, "bfloat16", TUNED_BF16, selector=SPLIT),
            _entry(H100, 4, 128, "float16", TUNED_H100),
            _entry(H200, 4, 128, "float16", TUNED_RT, target="runtime"),
        ),
        provenance={
            "created_utc": "2025-01-01T00:00:00Z",
            "fasttree_version": fasttree.__version__,
            "trace_set_hash": "a" * 64,
            "model_hash": "b" * 64,
            "notes": {"trace_paths": ["traces/h200.jsonl"], "seed": 0},
        },
    )


# In the canonical order (gpu, dtype, group_size, head_dim, target) the entries of _export() are:
# 0 H100 g4 fp16 tree_attention, 1 H200 g4 bf16 tree_attention (SPLIT), 2 H200 g1 fp16 tree_attention,
# 3 H200 g4 fp16 runtime, 4 H200 g4 fp16 tree_attention.


@pytest.fixture
def export_file(tmp_path: Path) -> Path:
    return write_export(tmp_path / "tuned.json", _export())


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget the entries the lookup already warned about (it warns once per entry and process)."""
    monkeypatch.setattr(export_module, "_WARNED", set())


def _doc() -> dict:
    return _export().to_dict()


def _write_doc(tmp_path: Path, doc) -> Path:
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fasttree.export" and r.levelno == logging.WARNING]


# ------------------------------------------------------------------------- round trip


def test_round_trip_gives_back_equal_export(export_file):
    back = read_export(export_file)
    assert back == _export()
    assert back.provenance["trace_set_hash"] == "a" * 64
    assert back.provenance["notes"] == {"trace_paths": ["traces/h200.jsonl"], "seed": 0}
    assert [e.target for e in back.entries].count("runtime") == 1
    assert all(e.guard == ExportGuard.current("c" * 64) for e in back.entries)
    assert back.entries[1].portfolio.selector == SPLIT


@pytest.mark.parametrize(
    ("gpu", "hq", "hkv", "dtype", "expected"),
    [
        (H200, 32, 8, "float16", TUNED_G4),
        (H200, 32, 32, "float16", TUNED_G1),
        (H100, 32, 8, "float16", TUNED_H100),
    ],
)
def test_lookup_after_round_trip_gives_the_tuned_portfolio(export_file, gpu, hq, hkv, dtype, expected):
    portfolio, entry = read_export(export_file).lookup(
        gpu=gpu, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype=dtype
    )
    assert portfolio == _served(expected, hq, hkv) and portfolio.layout == (hkv, hq // hkv)
    assert portfolio.members == (DEFAULTS, expected) and not portfolio.runtime
    assert portfolio.select(SMALL_TREE) == expected  # the one-leaf selector picks member 1 for every tree
    assert portfolio.select(LARGE_TREE) == expected
    assert entry is not None and entry.portfolio.for_heads(hq, hkv) == portfolio
    assert (entry.gpu, entry.bucket, entry.target) == (gpu, (hq // hkv, 128, dtype), "tree_attention")
    assert entry.provenance["predicted_gain"] == 0.2


def test_lookup_of_a_split_portfolio_selects_per_tree(export_file):
    portfolio, entry = read_export(export_file).lookup(
        gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    assert entry is not None and portfolio == _served(TUNED_BF16, 32, 8, SPLIT)
    assert portfolio.select(SMALL_TREE) == DEFAULTS
    assert portfolio.select(LARGE_TREE) == TUNED_BF16


def test_load_portfolio_loads_the_matching_entry(export_file):
    portfolio = load_portfolio(export_file, gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16")
    assert isinstance(portfolio, Portfolio)
    assert portfolio == _served(TUNED_G4, 32, 8)


def test_load_portfolio_accepts_a_str_path(export_file):
    portfolio = load_portfolio(str(export_file), gpu=H200, num_q_heads=8, num_kv_heads=8, head_dim=128, dtype="float16")
    assert portfolio == _served(TUNED_G1, 8, 8)
    runtime = load_portfolio(
        str(export_file), gpu=H200, num_q_heads=8, num_kv_heads=2, head_dim=128, dtype="float16", target="runtime"
    )
    assert runtime == _served(TUNED_RT, 8, 2, runtime=True)


@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (16, 4), (4, 1), (64, 16)])
def test_gqa_ratio_decides_the_bucket(export_file, hq, hkv):
    portfolio = load_portfolio(export_file, gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype="float16")
    assert portfolio.members[1] == TUNED_G4


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
    portfolio = load_portfolio(export_file, gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype)
    assert portfolio.members[1] == expected


def test_entries_are_stored_in_canonical_order():
    forward = _export()
    backward = ConfigExport(entries=tuple(reversed(forward.entries)), provenance=forward.provenance)
    assert backward == forward
    assert backward.to_dict() == forward.to_dict()
    keys = [(e.gpu, e.dtype, e.group_size, e.head_dim, e.target) for e in forward.entries]
    assert keys == sorted(keys)


def test_provenance_is_copied_not_aliased():
    prov = {"trace_set_hash": "x", "notes": {"k": [1, 2]}}
    export = ConfigExport(entries=(), provenance=prov)
    prov["notes"]["k"].append(3)
    assert export.provenance["notes"]["k"] == [1, 2]
    entry_prov = {"notes": {"k": [1]}}
    entry = ExportEntry(
        gpu=H200, group_size=4, head_dim=128, dtype="float16", portfolio=_portfolio(TUNED_G4),
        provenance=entry_prov, guard=ExportGuard.current(),
    )  # fmt: skip
    entry_prov["notes"]["k"].append(2)
    assert entry.provenance["notes"]["k"] == [1]


# ---------------------------------------------------------------------------- targets


def test_a_runtime_entry_is_not_served_to_tree_attention_and_vice_versa():
    runtime_only = ConfigExport(entries=(_entry(H200, 4, 128, "float16", TUNED_RT, target="runtime"),), provenance={})
    shape = {"gpu": H200, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
    assert runtime_only.lookup(**shape) == (Portfolio(), None)
    portfolio, entry = runtime_only.lookup(**shape, target="runtime")
    assert entry is not None and portfolio == _served(TUNED_RT, 32, 8, runtime=True)

    kernels_only = ConfigExport(entries=(_entry(H200, 4, 128, "float16", TUNED_RT),), provenance={})
    assert kernels_only.lookup(**shape, target="runtime") == (Portfolio(runtime=True), None)
    portfolio, entry = kernels_only.lookup(**shape, target="tree_attention")
    assert entry is not None and portfolio == _served(TUNED_RT, 32, 8)


def test_both_targets_of_one_bucket_are_served_apart(export_file):
    export = read_export(export_file)
    shape = {"gpu": H200, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
    kernels, k_entry = export.lookup(**shape)
    runtime, r_entry = export.lookup(**shape, target="runtime")
    assert (k_entry.target, r_entry.target) == ("tree_attention", "runtime")
    assert kernels.members[1] == TUNED_G4 and not kernels.runtime
    assert runtime.members[1] == TUNED_RT and runtime.runtime


@pytest.mark.parametrize("target", ["serving", "", None, "Runtime"])
def test_an_unknown_target_is_a_value_error(export_file, target):
    with pytest.raises(ValueError, match="target"):
        read_export(export_file).lookup(
            gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16", target=target
        )


def test_a_runtime_entry_whose_members_differ_in_launch_fields_is_refused():
    with pytest.raises(ValueError, match=r"member 1 differs from member 0 in launch fields \['kv_tile'\]"):
        _entry(H200, 4, 128, "float16", TUNED_G4, target="runtime")
    with pytest.raises(ValueError, match="launch fields"):
        _entry(H200, 4, 128, "float16", DEFAULTS.with_(num_warps=(8, 4)), target="runtime")


def test_the_runtime_flag_must_match_the_target():
    guard = ExportGuard.current()
    common = {"gpu": H200, "group_size": 4, "head_dim": 128, "dtype": "float16", "provenance": {}, "guard": guard}
    with pytest.raises(ValueError, match="a runtime entry's portfolio has runtime=False"):
        ExportEntry(**common, portfolio=_portfolio(TUNED_RT), target="runtime")
    with pytest.raises(ValueError, match="a tree_attention entry's portfolio has runtime=True"):
        ExportEntry(**common, portfolio=_portfolio(TUNED_RT, runtime=True), target="tree_attention")


def test_member_0_of_a_version_2_entry_must_be_the_defaults():
    common = {"gpu": H200, "group_size": 4, "head_dim": 128, "dtype": "float16", "provenance": {}}
    with pytest.raises(ValueError, match=r"member 0 must be FastTreeConfig\(\)"):
        ExportEntry(**common, portfolio=Portfolio(members=(TUNED_G4,)), guard=ExportGuard.current())
    with pytest.raises(ValueError, match=r"member 0 must be FastTreeConfig\(\)"):
        ExportEntry(
            **common, portfolio=Portfolio(members=(TUNED_G4, DEFAULTS), selector=ONE_LEAF),
            guard=ExportGuard.current(),
        )  # fmt: skip
    # the defaults alone are a valid (if pointless) entry
    ExportEntry(**common, portfolio=Portfolio(), guard=ExportGuard.current())


def test_a_version_2_entry_needs_a_guard():
    with pytest.raises(ValueError, match="needs a guard"):
        ExportEntry(gpu=H200, group_size=4, head_dim=128, dtype="float16", portfolio=_portfolio(TUNED_G4),
                    provenance={})  # fmt: skip


# ------------------------------------------------------------------------------ guard


@pytest.mark.parametrize(
    "guard",
    [
        ExportGuard(kernel_version=KERNEL_VERSION - 1, defaults=defaults_fingerprint(), model_sha256=""),
        ExportGuard(kernel_version=KERNEL_VERSION + 1, defaults=defaults_fingerprint(), model_sha256="x"),
        ExportGuard(kernel_version=KERNEL_VERSION, defaults="0" * 16, model_sha256=""),
    ],
    ids=["older kernels", "newer kernels", "other defaults"],
)
def test_an_entry_of_other_kernels_or_defaults_is_not_served(tmp_path, caplog, fresh_warnings, guard):
    stale = _entry(H200, 4, 128, "float16", TUNED_G4, guard=guard)
    served = _entry(H200, 1, 128, "float16", TUNED_G1)
    path = write_export(tmp_path / "stale.json", ConfigExport(entries=(stale, served), provenance={}))
    export = read_export(path)  # a stale guard is no format error: the file loads, the entry is not served
    assert export.entries[1].guard == guard
    shape = {"gpu": H200, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
    with caplog.at_level(logging.INFO, logger="fasttree.export"):
        for _ in range(3):
            assert export.lookup(**shape, num_q_heads=32) == (Portfolio(), None)
            portfolio, entry = export.lookup(**shape, num_q_heads=8)
            assert entry is not None and portfolio.members[1] == TUNED_G1
    warned = _warnings(caplog)
    assert len(warned) == 1, warned  # once per entry, not per call
    assert "using the defaults" in warned[0]
    assert ("kernel version" in warned[0]) == (guard.kernel_version != KERNEL_VERSION)
    assert ("other defaults" in warned[0]) == (guard.defaults != defaults_fingerprint())
    assert load_portfolio(path, **shape, num_q_heads=32) == Portfolio()


def test_every_stale_entry_warns_once(caplog, fresh_warnings):
    old = ExportGuard(kernel_version=KERNEL_VERSION - 1, defaults=defaults_fingerprint(), model_sha256="")
    export = ConfigExport(
        entries=(
            _entry(H200, 4, 128, "float16", TUNED_G4, guard=old),
            _entry(H200, 1, 128, "float16", TUNED_G1, guard=old),
            _entry(H200, 4, 128, "float16", TUNED_RT, target="runtime", guard=old),
        ),
        provenance={},
    )
    calls = [((32, 8), "tree_attention"), ((8, 8), "tree_attention"), ((32, 8), "runtime")]
    with caplog.at_level(logging.WARNING, logger="fasttree.export"):
        for _ in range(2):
            for (hq, hkv), target in calls:
                portfolio, entry = export.lookup(
                    gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=128, dtype="float16", target=target
                )
                assert entry is None and portfolio == Portfolio(runtime=target == "runtime")
    assert len(_warnings(caplog)) == 3


def test_stale_entries_of_two_gpus_each_warn(caplog, fresh_warnings):
    old = ExportGuard(kernel_version=KERNEL_VERSION - 1, defaults=defaults_fingerprint(), model_sha256="")
    export = ConfigExport(
        entries=(
            _entry(H200, 4, 128, "float16", TUNED_G4, guard=old),
            _entry(H100, 4, 128, "float16", TUNED_H100, guard=old),
        ),
        provenance={},
    )
    with caplog.at_level(logging.WARNING, logger="fasttree.export"):
        for gpu in (H200, H100):
            assert export.lookup(gpu=gpu, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16")[1] is None
    assert len(_warnings(caplog)) == 2


def test_current_guard():
    guard = ExportGuard.current("d" * 64)
    assert (guard.kernel_version, guard.defaults, guard.model_sha256) == (KERNEL_VERSION, defaults_fingerprint(),
                                                                          "d" * 64)  # fmt: skip
    assert guard.mismatch() is None
    assert ExportGuard.from_dict(guard.to_dict()) == guard


# -------------------------------------------------------------------- version-1 files


def _v1_config() -> dict:
    """A complete config as a version-1 file wrote it (config schema 2), by hand."""
    return {
        "alpha": 0.5,
        "beta": 0.33,
        "gamma": -1.0,
        "kv_split_sizes": [512, 64],
        "kv_tile": [128, 32],
        "num_stages": [3, 4],
        "num_warps": [4, 4],
        "pack_min_units": 264,
        "pack_tokens": 0,
        "para_threshs1": [132, 528],
        "para_threshs2": [132, 132],
        "q_tile_queries": None,
        "schema_version": 2,
    }


V1_CONFIG = FastTreeConfig(
    alpha=0.5, gamma=-1.0, kv_split_sizes=(512, 64), kv_tile=(128, 32), num_stages=(3, 4), num_warps=(4, 4),
    pack_tokens=0,
)  # fmt: skip


def _v1_doc() -> dict:
    return {
        "entries": [
            {
                "config": _v1_config(),
                "dtype": "float16",
                "gpu": H200,
                "group_size": 4,
                "head_dim": 128,
                "provenance": {"n_trials": 300, "predicted_gain": 0.1, "study_name": "h200-g4-d128-float16"},
            }
        ],
        "provenance": {"created_utc": "2025-06-01T12:00:00Z", "model_hash": "9a1e"},
        "schema": "fasttree-export",
        "schema_version": 1,
    }


def test_a_version_1_file_loads_as_one_member_portfolios_for_both_targets(tmp_path, caplog, fresh_warnings):
    path = _write_doc(tmp_path, _v1_doc())
    export = read_export(path)
    (entry,) = export.entries
    assert (entry.target, entry.guard) == (None, None)
    assert entry.portfolio.members == (V1_CONFIG,)
    assert entry.serves("tree_attention") and entry.serves("runtime")
    shape = {"gpu": H200, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
    with caplog.at_level(logging.WARNING, logger="fasttree.export"):
        for target in ("tree_attention", "runtime", "tree_attention", "runtime"):
            portfolio, served = export.lookup(**shape, target=target)
            assert served is entry
            assert portfolio == Portfolio(members=(V1_CONFIG,), runtime=target == "runtime")
            assert portfolio.select(SMALL_TREE) == portfolio.select(LARGE_TREE) == V1_CONFIG
    warned = _warnings(caplog)
    assert warned and all("format 1" in m and "deprecated" in m for m in warned)
    assert len(warned) <= 2  # not once per call
    assert load_portfolio(str(path), **shape, target="runtime") == Portfolio(members=(V1_CONFIG,), runtime=True)
    other = load_portfolio(path, **{**shape, "head_dim": 64})
    assert other == Portfolio()


def test_a_version_1_export_is_not_written_back(tmp_path):
    export = read_export(_write_doc(tmp_path, _v1_doc()))
    with pytest.raises(ValueError, match="version-1 entry is not written again"):
        export.entries[0].to_dict()
    with pytest.raises(ValueError, match="version-1 entry is not written again"):
        export.to_dict()
    with pytest.raises(ValueError, match="version-1 entry is not written again"):
        write_export(tmp_path / "again.json", export)
    assert not (tmp_path / "again.json").exists()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["entries"][0].__setitem__("target", "runtime"), r"unknown entry fields \['target'\]"),
        (lambda d: d["entries"][0]["config"].__setitem__("kv_tile", [48, 32]), r"config: FastTreeConfig\.kv_tile"),
        (lambda d: d["entries"][0]["config"].pop("alpha"), r"config is missing fields \['alpha'\]"),
        (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), r"entries\[1\] duplicates entries\[0\]"),
    ],
    ids=["v2 field", "bad config", "missing field", "duplicate"],
)
def test_an_invalid_version_1_file_is_refused(tmp_path, mutate, match):
    doc = _v1_doc()
    mutate(doc)
    with pytest.raises(ValueError, match=match):
        read_export(_write_doc(tmp_path, doc))


def test_a_version_3_file_with_version_1_entries_is_refused(tmp_path):
    doc = _doc()
    doc["entries"] = _v1_doc()["entries"]
    with pytest.raises(ValueError, match=r"entries\[0\]: unknown entry fields \['config'\]"):
        read_export(_write_doc(tmp_path, doc))


def _v2_doc() -> dict:
    """The export of _export() as format 2 wrote it: no regions."""
    doc = _doc()
    doc["schema_version"] = 2
    for e in doc["entries"]:
        del e["portfolio"]["regions"]
    return doc


def test_a_version_2_file_loads_and_its_selector_alone_decides(tmp_path, caplog, fresh_warnings):
    export = read_export(_write_doc(tmp_path, _v2_doc()))
    assert [e.bucket for e in export.entries] == [e.bucket for e in _export().entries]
    g4 = {"gpu": H200, "num_q_heads": 256, "num_kv_heads": 64, "head_dim": 128}  # a layout no region of _export lists
    with caplog.at_level(logging.WARNING, logger="fasttree.export"):
        for _ in range(3):
            portfolio, entry = export.lookup(**g4, dtype="bfloat16")
            assert entry is not None and portfolio.regions is None
            # served as format 2 served it: the selector alone, whatever the layout and the tree
            assert portfolio.select(LARGE_TREE) == TUNED_BF16 and portfolio.select(SMALL_TREE) == DEFAULTS
    warned = _warnings(caplog)
    assert len(warned) == 1 and "format 2 (deprecated)" in warned[0] and "no region of evidence" in warned[0]
    assert "fasttree-tune confirm" not in warned[0] and "confirm it again" in warned[0]
    # the same lookup of the format-3 export: its regions list 1 to 32 KV heads, not 64
    fenced, _ = _export().lookup(**g4, dtype="bfloat16")
    assert fenced.layout == (64, 4) and fenced.select(LARGE_TREE) == DEFAULTS
    assert fenced.for_heads(128, 32).select(LARGE_TREE) == TUNED_BF16


def test_a_version_2_entry_with_tuned_leaves_is_not_written_back(tmp_path):
    export = read_export(_write_doc(tmp_path, _v2_doc()))
    problems = {(e.gpu, *e.bucket, e.target): e.write_problem() for e in export.entries}
    assert all("no region of evidence" in p for p in problems.values() if p is not None)
    assert sum(p is not None for p in problems.values()) == len(export.entries)  # every entry has a tuned leaf
    with pytest.raises(ValueError, match=r"NVIDIA H100.*selector leaves \[0\] name tuned members with no region"):
        write_export(tmp_path / "again.json", export)
    assert not (tmp_path / "again.json").exists()
    # an entry of the defaults alone needs no region and is written again
    doc = _v2_doc()
    doc["entries"] = doc["entries"][:1]
    doc["entries"][0]["portfolio"]["members"] = doc["entries"][0]["portfolio"]["members"][:1]
    doc["entries"][0]["portfolio"]["selector"]["member"] = [0]
    again = write_export(tmp_path / "defaults.json", read_export(_write_doc(tmp_path, doc)))
    assert json.loads(again.read_text())["entries"][0]["portfolio"]["regions"] is None


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda d: d["entries"][1]["portfolio"].__setitem__("regions", None),
            r"unknown portfolio fields \['regions'\]",
        ),
        (lambda d: d["entries"][1]["portfolio"].pop("runtime"), r"missing portfolio fields \['runtime'\]"),
    ],
    ids=["regions in format 2", "missing runtime"],
)
def test_an_invalid_version_2_file_is_refused(tmp_path, mutate, match):
    doc = _v2_doc()
    mutate(doc)
    with pytest.raises(ValueError, match=match):
        read_export(_write_doc(tmp_path, doc))


# ----------------------------------------------------------------- regions of evidence

#: Member 1's evidence trees of the fenced entries below: 128 one-query leaves of 16-64 tokens under a 256-token prefix.
EVIDENCE_TREES = [fasttree.KVTree.from_levels((1, 128), (256, n)) for n in (16, 32, 64)]


def _fenced_export(layouts=((2, 16),), evidence="measured") -> ConfigExport:
    """A GQA-16 tree_attention entry whose one leaf serves TUNED_BF16 only in the box of EVIDENCE_TREES at
    ``layouts``."""
    x = np.stack([tree_features(t) for t in EVIDENCE_TREES])
    region = LeafRegion.of_trees(x, [layouts[i % len(layouts)] for i in range(len(EVIDENCE_TREES))], evidence)
    entry = ExportEntry(
        gpu=H200, group_size=16, head_dim=128, dtype="float16",
        portfolio=Portfolio(members=(DEFAULTS, TUNED_BF16), selector=ONE_LEAF, regions=(region,)),
        provenance={}, target="tree_attention", guard=ExportGuard.current(),
    )  # fmt: skip
    return ConfigExport(entries=(entry,), provenance={})


def test_a_leaf_confirmed_at_two_kv_heads_serves_the_defaults_at_one(tmp_path):
    # the measured failure: 16 query heads over 1 KV head (tensor parallelism) where the leaf saw only 2 KV heads
    path = write_export(tmp_path / "fenced.json", _fenced_export())
    shape = {"gpu": H200, "head_dim": 128, "dtype": "float16"}
    at_two = load_portfolio(path, **shape, num_q_heads=32, num_kv_heads=2)
    at_one = load_portfolio(path, **shape, num_q_heads=16, num_kv_heads=1)
    for tree in EVIDENCE_TREES:
        assert at_two.select(tree) == TUNED_BF16 and at_one.select(tree) == DEFAULTS
    plan = fasttree.plan(EVIDENCE_TREES[0], at_one, num_q_heads=16, num_kv_heads=1, head_dim=128)
    assert plan.config == DEFAULTS
    # listed layouts are served; the runtime-style lookup binds as well
    both = write_export(tmp_path / "both.json", _fenced_export(layouts=((2, 16), (1, 16))))
    assert load_portfolio(both, **shape, num_q_heads=16, num_kv_heads=1).select(EVIDENCE_TREES[1]) == TUNED_BF16


@pytest.mark.parametrize(
    ("tree", "inside"),
    [
        (fasttree.KVTree.from_levels((1, 128), (256, 40)), True),  # between the evidence trees
        (fasttree.KVTree.from_levels((2, 16), (30000, 40)), False),  # two 30k-token documents, 8 questions each
        (fasttree.KVTree.from_levels((1, 128), (4096, 32)), False),  # a longer prefix than any evidence tree
        (fasttree.KVTree.from_levels((1, 64), (256, 32)), False),  # fewer queries
    ],
    ids=["inside", "long documents", "long prefix", "fewer queries"],
)
def test_after_a_round_trip_only_trees_inside_the_box_get_the_member(tmp_path, tree, inside):
    path = write_export(tmp_path / "fenced.json", _fenced_export())
    back = read_export(path)
    assert back == _fenced_export()
    (region,) = back.entries[0].portfolio.regions
    assert region.layouts == ((2, 16),) and region.trees == 3 and region.evidence == "measured"
    portfolio = load_portfolio(path, gpu=H200, num_q_heads=32, num_kv_heads=2, head_dim=128, dtype="float16")
    assert portfolio.select(tree) == (TUNED_BF16 if inside else DEFAULTS)
    assert portfolio.member_of(tree) == int(inside)


def test_written_regions_are_plain_json(tmp_path):
    path = write_export(tmp_path / "fenced.json", _fenced_export(evidence="predicted"))
    (region,) = json.loads(path.read_text())["entries"][0]["portfolio"]["regions"]
    assert set(region) == {"evidence", "hi", "layouts", "lo", "trees"}
    assert region["layouts"] == [[2, 16]] and region["evidence"] == "predicted" and region["trees"] == 3
    assert len(region["lo"]) == len(region["hi"]) == len(TREE_FEATURES)


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
        portfolio, entry = read_export(export_file).lookup(
            gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype
        )
    assert entry is None
    assert portfolio == Portfolio() and portfolio.select(LARGE_TREE) == DEFAULTS
    messages = [r.getMessage() for r in caplog.records if r.name == "fasttree.export" and r.levelno == logging.INFO]
    assert any("using the defaults" in m and f"({hq // hkv}, {d}, '{dtype}')" in m for m in messages), messages


def test_unseen_gpu_falls_back_to_defaults(export_file, caplog):
    with caplog.at_level(logging.INFO, logger="fasttree.export"):
        portfolio = load_portfolio(
            export_file, gpu="NVIDIA A100-SXM4-80GB", num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16"
        )
    assert portfolio == Portfolio()
    assert any("NVIDIA A100-SXM4-80GB" in r.getMessage() and "defaults" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("gpu", ["nvidia h200", "NVIDIA H200 ", "H200", "NVIDIA H100"])
def test_gpu_name_must_match_exactly(export_file, gpu):
    portfolio, entry = read_export(export_file).lookup(
        gpu=gpu, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16"
    )
    assert entry is None
    assert portfolio == Portfolio()


def test_empty_export_falls_back(tmp_path):
    path = write_export(tmp_path / "empty.json", ConfigExport(entries=(), provenance={}))
    export = read_export(path)
    shape = {"gpu": H200, "num_q_heads": 8, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
    assert export.lookup(**shape) == (Portfolio(), None)
    assert export.lookup(**shape, target="runtime") == (Portfolio(runtime=True), None)


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
        load_portfolio(export_file, gpu=H200, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)


def test_invalid_shape_is_reported_before_the_file_is_read(tmp_path):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        load_portfolio(
            tmp_path / "missing.json", gpu=H200, num_q_heads=30, num_kv_heads=8, head_dim=128, dtype="float16"
        )


@pytest.mark.parametrize(("gpu", "target"), [(H200, "serving"), ("", "tree_attention")])
def test_invalid_gpu_or_target_is_reported_before_the_file_is_read(tmp_path, gpu, target):
    with pytest.raises(ValueError, match=r"target|gpu"):
        load_portfolio(
            tmp_path / "missing.json", gpu=gpu, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16",
            target=target,
        )  # fmt: skip


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_portfolio(
            tmp_path / "missing.json", gpu=H200, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16"
        )


def test_bucket_key():
    assert bucket_key(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16) == (4, 128, "bfloat16")
    assert bucket_key(num_q_heads=16, num_kv_heads=16, head_dim=64, dtype="float16") == (1, 64, "float16")


# ------------------------------------------------------------- planning with a portfolio


@pytest.mark.parametrize("tree", [SMALL_TREE, LARGE_TREE], ids=["left of the split", "right of the split"])
def test_portfolio_select_follows_the_split(tree):
    portfolio = _served(TUNED_BF16, 32, 8, SPLIT)
    x = tree_features(tree)
    right = x[QUERIES] > 6.0
    assert right == (tree is LARGE_TREE)
    assert portfolio.member_of(tree) == int(right)
    assert portfolio.select(tree) == (TUNED_BF16 if right else DEFAULTS)


@pytest.mark.parametrize("tree", [SMALL_TREE, LARGE_TREE], ids=["left of the split", "right of the split"])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (16, 16)])
def test_plan_with_a_portfolio_is_the_plan_with_its_selected_member(tree, hq, hkv):
    tuned = FastTreeConfig(gamma=-1.0, kv_split_sizes=(64, 32), pack_tokens=0, kv_tile=(32, 32))
    portfolio = _served(tuned, hq, hkv, SPLIT)
    heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": 128}
    by_portfolio = fasttree.plan(tree, portfolio, **heads)
    by_member = fasttree.plan(tree, portfolio.select(tree), **heads)
    other = fasttree.plan(tree, DEFAULTS if portfolio.member_of(tree) else tuned, **heads)
    assert by_portfolio.config == portfolio.select(tree)
    assert by_portfolio.stats() == by_member.stats()
    assert by_portfolio.stats() != other.stats()  # the members plan the tree differently: the check can fail
    for name in DEVICE_ARRAYS:
        np.testing.assert_array_equal(getattr(by_portfolio, name), getattr(by_member, name), err_msg=name)
    assert (by_portfolio.tile_mode, by_portfolio.class_unit_ptr) == (by_member.tile_mode, by_member.class_unit_ptr)


# ------------------------------------------------------------------ validation on load


def _mutations():
    """(id, change to the dict, expected message) for every refused document."""

    def set_top(key, value):
        return lambda d: d.__setitem__(key, value)

    def set_entry(i, key, value):
        return lambda d: d["entries"][i].__setitem__(key, value)

    def set_member(i, m, key, value):
        return lambda d: d["entries"][i]["portfolio"]["members"][m].__setitem__(key, value)

    def set_portfolio(i, key, value):
        return lambda d: d["entries"][i]["portfolio"].__setitem__(key, value)

    def set_selector(i, key, value):
        return lambda d: d["entries"][i]["portfolio"]["selector"].__setitem__(key, value)

    def set_guard(i, key, value):
        return lambda d: d["entries"][i]["guard"].__setitem__(key, value)

    def del_entry_key(i, key):
        return lambda d: d["entries"][i].pop(key)

    def del_member_key(i, m, key):
        return lambda d: d["entries"][i]["portfolio"]["members"][m].pop(key)

    def duplicate(d):
        d["entries"].append(copy.deepcopy(d["entries"][1]))

    def duplicate_other_portfolio(d):
        # same GPU, bucket and target with another provenance and member: still a duplicate
        dup = copy.deepcopy(d["entries"][0])
        dup["portfolio"]["members"][1]["alpha"] = 0.1
        dup["provenance"] = {"study_name": "again"}
        d["entries"].append(dup)

    def selector(feature, threshold, left, right, member):
        return {"features": list(TREE_FEATURES), "feature": feature, "threshold": threshold, "left": left,
                "right": right, "member": member}  # fmt: skip

    def chain(depth):
        # a split per level down the right side: depth + 1 leaves, the last at `depth`
        n = 2 * depth + 1
        feature = [QUERIES if i % 2 == 0 and i < n - 1 else -1 for i in range(n)]
        left = [i + 1 if feature[i] >= 0 else -1 for i in range(n)]
        right = [i + 2 if feature[i] >= 0 else -1 for i in range(n)]
        return selector(feature, [float(i) for i in range(n)], left, right, [1] * n)

    return [
        ("wrong schema", set_top("schema", "fasttree-config"), r"not a fasttree-export file.*'fasttree-config'"),
        ("missing schema", lambda d: d.pop("schema"), r"not a fasttree-export file.*None"),
        ("version 4", set_top("schema_version", 4), r"schema_version 4 is not supported.*reads versions 1, 2 and 3"),
        ("version as str", set_top("schema_version", "3"), r"schema_version '3' is not supported"),
        ("version true", set_top("schema_version", True), r"schema_version True is not supported"),
        ("unknown top field", set_top("comment", "hi"), r"unknown export fields \['comment'\]"),
        ("missing entries", lambda d: d.pop("entries"), r"missing export fields \['entries'\]"),
        ("entries not a list", set_top("entries", {}), r"entries must be a JSON array"),
        ("top provenance not object", set_top("provenance", []), r"provenance must be a JSON object"),
        ("entry not object", set_top("entries", [1]), r"entries\[0\]: must be a JSON object"),
        ("unknown entry field", set_entry(2, "tuned_by", "me"), r"entries\[2\]: unknown entry fields \['tuned_by'\]"),
        ("old config field", set_entry(2, "config", {}), r"entries\[2\]: unknown entry fields \['config'\]"),
        ("missing entry field", del_entry_key(1, "dtype"), r"entries\[1\]: missing entry fields \['dtype'\]"),
        ("missing guard", del_entry_key(1, "guard"), r"entries\[1\]: missing entry fields \['guard'\]"),
        ("missing target", del_entry_key(1, "target"), r"entries\[1\]: missing entry fields \['target'\]"),
        ("duplicate bucket", duplicate, r"entries\[5\] duplicates entries\[1\].*group_size 4"),
        ("duplicate bucket 2", duplicate_other_portfolio, r"entries\[5\] duplicates entries\[0\]"),
        (
            "runtime entry relabelled",
            set_entry(3, "target", "tree_attention"),
            r"entries\[3\]: a tree_attention entry's portfolio has runtime=True",
        ),
        # members
        (
            "kv_tile 48",
            set_member(4, 1, "kv_tile", [48, 32]),
            r"entries\[4\]: portfolio\.members\[1\]: FastTreeConfig\.kv_tile",
        ),
        (
            "num_warps 3",
            set_member(2, 1, "num_warps", [3, 4]),
            r"entries\[2\]: portfolio\.members\[1\]: FastTreeConfig\.num_warps",
        ),
        (
            "alpha string",
            set_member(4, 1, "alpha", "0.5"),
            r"entries\[4\]: portfolio\.members\[1\]: FastTreeConfig\.alpha",
        ),
        ("alpha -5", set_member(4, 1, "alpha", -5), r"entries\[4\]: portfolio\.members\[1\]: FastTreeConfig\.alpha"),
        (
            "unknown config key",
            set_member(4, 1, "block_m", 64),
            r"entries\[4\]: portfolio\.members\[1\]: unknown FastTreeConfig keys",
        ),
        (
            "config version 9",
            set_member(4, 1, "schema_version", 9),
            r"entries\[4\]: portfolio\.members\[1\]: .*schema_version 9",
        ),
        (
            "config missing field",
            del_member_key(0, 1, "pack_tokens"),
            r"entries\[0\]: portfolio\.members\[1\] is missing.*pack_tokens",
        ),
        (
            "member 0 missing field",
            del_member_key(0, 0, "alpha"),
            r"entries\[0\]: portfolio\.members\[0\] is missing.*alpha",
        ),
        (
            "config no version",
            del_member_key(4, 1, "schema_version"),
            r"entries\[4\]: portfolio\.members\[1\]\.schema_version is miss",
        ),
        (
            "config not object",
            set_portfolio(4, "members", [[1]]),
            r"entries\[4\]: portfolio\.members\[0\] must be a JSON object",
        ),
        (
            "member 0 not the defaults",
            set_member(4, 0, "alpha", 0.5),
            r"entries\[4\]: portfolio member 0 must be FastTreeConfig\(\)",
        ),
        (
            "members swapped",
            lambda d: d["entries"][4]["portfolio"]["members"].reverse(),
            r"entries\[4\]: portfolio member 0 must be",
        ),
        ("no members", set_portfolio(4, "members", []), r"entries\[4\]: portfolio.*members count must be"),
        (
            "17 members",
            lambda d: d["entries"][4]["portfolio"]["members"].extend([DEFAULTS.to_dict()] * 15),
            r"entries\[4\]: portfolio.*members count must be",
        ),
        (
            "members not a list",
            set_portfolio(4, "members", {}),
            r"entries\[4\]: portfolio must be a JSON object with a members list",
        ),
        ("portfolio not object", set_entry(4, "portfolio", [1]), r"entries\[4\]: portfolio must be a JSON object"),
        (
            "unknown portfolio field",
            set_portfolio(4, "weights", [1, 1]),
            r"entries\[4\]: unknown portfolio fields \['weights'\]",
        ),
        (
            "runtime not bool",
            set_portfolio(4, "runtime", 0),
            r"entries\[4\]: portfolio: portfolio\.runtime must be a bool",
        ),
        (
            "runtime launch fields",
            set_member(3, 1, "kv_tile", [32, 32]),
            r"entries\[3\]: portfolio: runtime portfolio member 1 differs from member 0 in launch fields \['kv_tile'\]",
        ),
        (
            "runtime warps",
            set_member(3, 1, "num_warps", [8, 4]),
            r"entries\[3\]: portfolio: runtime portfolio member 1 differs .* \['num_warps'\]",
        ),
        (
            "runtime flag off",
            set_portfolio(3, "runtime", False),
            r"entries\[3\]: a runtime entry's portfolio has runtime=False",
        ),
        (
            "tiles too big for g",
            set_member(1, 1, "q_tile_queries", [128, 16]),
            r"entries\[1\]: portfolio member 1 does not fit group_size 4.*512 rows",
        ),
        # selector
        (
            "selector features of another version",
            set_selector(1, "features", [*TREE_FEATURES, "gpu_load"]),
            r"entries\[1\]: portfolio: the selector was fitted on features",
        ),
        (
            "selector features renamed",
            set_selector(1, "features", ["n_queries", *TREE_FEATURES[1:]]),
            r"entries\[1\]: portfolio: the selector was fitted on features",
        ),
        (
            "selector children before parents",
            set_portfolio(
                1, "selector", selector([-1, QUERIES, -1], [0.0, 6.0, 0.0], [-1, 0, -1], [-1, 2, -1], [0, 0, 1])
            ),
            r"entries\[1\]: portfolio: selector node 1 has child 0 \(children come after their parent\)",
        ),
        (
            "selector self loop",
            set_portfolio(1, "selector", selector([QUERIES, -1], [6.0, 0.0], [0, -1], [1, -1], [0, 1])),
            r"selector node 0 has child 0",
        ),
        ("selector child out of range", set_selector(1, "right", [3, -1, -1]), r"selector node 0 has child 3"),
        (
            "selector too deep",
            set_portfolio(1, "selector", chain(MAX_SELECTOR_DEPTH + 1)),
            r"entries\[1\]: portfolio: the selector is 9 levels deep, more than 8",
        ),
        (
            "selector member beyond",
            set_selector(1, "member", [0, 0, 2]),
            r"entries\[1\]: portfolio: the selector names member 2, the portfolio has 2",
        ),
        (
            "selector feature beyond",
            set_selector(1, "feature", [len(TREE_FEATURES), -1, -1]),
            r"selector node 0 splits on feature 8; there are 8",
        ),
        (
            "selector threshold string",
            set_selector(1, "threshold", ["6", 0.0, 0.0]),
            r"selector\.threshold must hold finite numbers",
        ),
        ("selector member float", set_selector(1, "member", [0, 0, 1.0]), r"selector\.member must hold integers"),
        ("selector ragged", set_selector(1, "left", [1, -1]), r"equally long, non-empty node arrays"),
        (
            "selector empty",
            set_portfolio(1, "selector", selector([], [], [], [], [])),
            r"equally long, non-empty node arrays",
        ),
        ("selector not a list", set_selector(1, "member", 1), r"selector\.member must be a list"),
        ("selector unknown field", set_selector(1, "gain", [0.1]), r"a selector has the fields"),
        ("selector not object", set_portfolio(1, "selector", [0]), r"a selector must be a JSON object"),
        # regions of evidence
        (
            "missing regions",
            lambda d: d["entries"][1]["portfolio"].pop("regions"),
            r"entries\[1\]: missing portfolio fields \['regions'\]",
        ),
        (
            "null regions with a tuned leaf",
            set_portfolio(1, "regions", None),
            r"entries\[1\]: portfolio\.regions is null but selector leaves \[2\] name tuned members",
        ),
        (
            "tuned leaf without a region",
            set_portfolio(1, "regions", [None, None, None]),
            r"entries\[1\]: portfolio: selector leaf 2 names member 1 but has no region of evidence",
        ),
        (
            "region on a defaults leaf",
            lambda d: d["entries"][1]["portfolio"]["regions"].__setitem__(
                1, d["entries"][1]["portfolio"]["regions"][2]
            ),
            r"entries\[1\]: portfolio: selector node 1 serves no member but the defaults",
        ),
        ("regions ragged", set_portfolio(1, "regions", [None]), r"regions must hold one item per selector node \(3\)"),
        (
            "region lo above hi",
            lambda d: d["entries"][1]["portfolio"]["regions"][2].__setitem__("lo", [2e6] * len(TREE_FEATURES)),
            r"entries\[1\]: portfolio: portfolio\.regions\[2\]: region\.lo must not exceed region\.hi",
        ),
        (
            "region short box",
            lambda d: d["entries"][1]["portfolio"]["regions"][2].__setitem__("hi", [1.0]),
            r"region\.hi must hold 8 finite numbers",
        ),
        (
            "region layout of another group size",
            lambda d: d["entries"][1]["portfolio"]["regions"][2].__setitem__("layouts", [[8, 4], [2, 16]]),
            r"entries\[1\]: portfolio\.regions\[2\] lists head layouts \[\[2, 16\]\] .* group size than the entry's 4",
        ),
        (
            "region layout not a pair",
            lambda d: d["entries"][1]["portfolio"]["regions"][2].__setitem__("layouts", [8]),
            r"pairs of ints >= 1",
        ),
        (
            "region unknown evidence",
            lambda d: d["entries"][1]["portfolio"]["regions"][2].__setitem__("evidence", "hoped"),
            r"region\.evidence must be one of",
        ),
        (
            "region unknown field",
            lambda d: d["entries"][1]["portfolio"]["regions"][2].__setitem__("gain", 0.1),
            r"a region is a JSON object with the fields",
        ),
        # guard and target
        ("target unknown", set_entry(0, "target", "serving"), r"entries\[0\]: target must be one of"),
        ("guard not object", set_entry(0, "guard", "v30"), r"entries\[0\]: guard must be a JSON object"),
        ("guard unknown field", set_guard(0, "gpu", H200), r"entries\[0\]: unknown guard fields \['gpu'\]"),
        (
            "guard missing field",
            lambda d: d["entries"][0]["guard"].pop("defaults"),
            r"entries\[0\]: missing guard fields \['defaults'\]",
        ),
        ("guard version str", set_guard(0, "kernel_version", "30"), r"entries\[0\]: guard\.kernel_version must be"),
        ("guard version negative", set_guard(0, "kernel_version", -1), r"entries\[0\]: guard\.kernel_version must be"),
        ("guard version bool", set_guard(0, "kernel_version", True), r"entries\[0\]: guard\.kernel_version must be"),
        (
            "guard defaults empty",
            set_guard(0, "defaults", ""),
            r"entries\[0\]: guard\.defaults must be a non-empty string",
        ),
        ("guard model not str", set_guard(0, "model_sha256", 5), r"entries\[0\]: guard\.model_sha256 must be a string"),
        # the rest of the entry
        ("group_size 0", set_entry(0, "group_size", 0), r"entries\[0\]: group_size must be >= 1, got 0"),
        ("group_size float", set_entry(0, "group_size", 4.0), r"entries\[0\]: group_size must be an integer"),
        ("head_dim 8", set_entry(0, "head_dim", 8), r"entries\[0\]: head_dim must be in \[16, 256\], got 8"),
        ("dtype float32", set_entry(0, "dtype", "float32"), r"entries\[0\]: dtype must be one of"),
        ("gpu empty", set_entry(0, "gpu", ""), r"entries\[0\]: gpu must be a non-empty string"),
        ("gpu not str", set_entry(0, "gpu", 7), r"entries\[0\]: gpu must be a non-empty string"),
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


def test_a_null_target_is_refused(tmp_path):
    doc = _doc()
    doc["entries"][4]["target"] = None
    doc["entries"][4]["portfolio"]["members"].reverse()  # member 0 no longer the defaults
    with pytest.raises(ValueError, match="target"):
        read_export(_write_doc(tmp_path, doc))


def test_the_unmutated_document_is_accepted(tmp_path):
    # the counterpart of test_invalid_document_is_refused: its baseline loads fine
    assert read_export(_write_doc(tmp_path, _doc())) == _export()


def test_the_deepest_selector_is_accepted(tmp_path):
    # the counterpart of "selector too deep": MAX_SELECTOR_DEPTH levels load
    doc = _doc()
    n = 2 * MAX_SELECTOR_DEPTH + 1
    feature = [QUERIES if i % 2 == 0 and i < n - 1 else -1 for i in range(n)]
    doc["entries"][1]["portfolio"]["selector"] = {
        "features": list(TREE_FEATURES), "feature": feature, "threshold": [float(i) for i in range(n)],
        "left": [i + 1 if f >= 0 else -1 for i, f in enumerate(feature)],
        "right": [i + 2 if f >= 0 else -1 for i, f in enumerate(feature)], "member": [1] * n,
    }  # fmt: skip
    leaf_region = doc["entries"][1]["portfolio"]["regions"][2]
    doc["entries"][1]["portfolio"]["regions"] = [None if f >= 0 else leaf_region for f in feature]
    portfolio = read_export(_write_doc(tmp_path, doc)).entries[1].portfolio
    assert len(portfolio.selector.feature) == n
    assert portfolio.for_heads(32, 8).select(LARGE_TREE) == TUNED_BF16


def test_error_indices_refer_to_the_file_order(tmp_path):
    # entries[i] in a message is the i-th entry of the file, not of the sorted export
    doc = _doc()
    doc["entries"].reverse()
    doc["entries"][0]["portfolio"]["members"][1]["kv_tile"] = [48, 48]
    with pytest.raises(ValueError, match=r"entries\[0\]: portfolio\.members\[1\]: FastTreeConfig\.kv_tile"):
        read_export(_write_doc(tmp_path, doc))


@pytest.mark.parametrize("where", ["top", "entry", "nested", "threshold"])
def test_nan_is_refused(tmp_path, where):
    doc = _doc()
    if where == "top":
        doc["provenance"]["extra"] = math.nan
    elif where == "entry":
        doc["entries"][0]["provenance"]["predicted_gain"] = math.nan
    elif where == "nested":
        doc["entries"][0]["provenance"]["notes"] = {"xs": [1.0, math.inf]}
    else:
        doc["entries"][1]["portfolio"]["selector"]["threshold"][0] = math.nan
    with pytest.raises(ValueError, match=r"(NaN|finite)"):
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
    with pytest.raises(ValueError, match=r"entries\[1\] duplicates entries\[0\].*target 'tree_attention'"):
        ConfigExport(entries=(e, _entry(H200, 4, 128, "float16", TUNED_BF16)), provenance={})
    # the same bucket for the other target is no duplicate
    ConfigExport(entries=(e, _entry(H200, 4, 128, "float16", TUNED_RT, target="runtime")), provenance={})


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


@pytest.mark.parametrize("key", ["schema_version", "target"])
def test_duplicate_json_keys_are_refused(tmp_path, key):
    text = json.dumps(_doc())
    value = {"schema_version": "2", "target": '"runtime"'}[key]
    # a second key: Python's json would silently keep the last one
    text = text.replace(f'"{key}": {value}', f'"{key}": {value}, "{key}": {value}', 1)
    path = tmp_path / "dup.json"
    path.write_text(text)
    assert text.count(f'"{key}": {value}, "{key}"') == 1
    with pytest.raises(ValueError, match=rf"dup\.json: invalid JSON \(duplicate key '{key}'"):
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
    assert doc["schema_version"] == EXPORT_SCHEMA_VERSION == 3
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"  # sorted keys, 2-space indent
    assert list(doc) == sorted(doc)
    entry = doc["entries"][0]
    assert list(entry) == sorted(entry) == ["dtype", "gpu", "group_size", "guard", "head_dim", "portfolio",
                                            "provenance", "target"]  # fmt: skip
    assert list(entry["guard"]) == ["defaults", "kernel_version", "model_sha256"]
    assert entry["guard"] == {"defaults": defaults_fingerprint(), "kernel_version": KERNEL_VERSION,
                              "model_sha256": "c" * 64}  # fmt: skip
    for construct in ("NaN", "Infinity", "(", "<", "!!python", "__", "torch", "tuple"):
        assert construct not in text, construct
    # pairs and selector nodes are JSON arrays
    for e in doc["entries"]:
        assert all(isinstance(m["kv_tile"], list) for m in e["portfolio"]["members"])
        assert all(isinstance(e["portfolio"]["selector"][k], list) for k in ("feature", "threshold", "member"))
        assert e["portfolio"]["selector"]["features"] == list(TREE_FEATURES)
    assert {e["gpu"] for e in doc["entries"]} == {H200, H100}
    assert [e["target"] for e in doc["entries"]].count("runtime") == 1


def test_written_entries_hold_every_config_field(export_file):
    doc = json.loads(export_file.read_text())
    for entry in doc["entries"]:
        members = entry["portfolio"]["members"]
        assert len(members) == 2
        assert members[0] == FastTreeConfig().to_dict()
        for member in members:
            assert set(member) == set(FastTreeConfig().to_dict())


def test_export_module_imports_no_heavy_optional_packages():
    code = (
        "import sys, fasttree.export, fasttree.portfolio, fasttree.versions; "
        "bad = [m for m in ('sklearn', 'optuna', 'scipy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_defaults_fingerprint_ignores_rules_at_the_value_they_were_added_with():
    """A planning rule added switched off (field metadata ``ADDED_AS``) is left out of the defaults'
    fingerprint at that value, so adding it keeps tuned exports valid; at another value (the rule
    adopted) it is hashed, and every other field always is."""
    from dataclasses import fields

    from fasttree.plan_rules import ADDED_AS, deciding_fields

    rules = fasttree.PlanRules.defaults()
    added = {f.name: f.metadata[ADDED_AS] for f in fields(rules) if ADDED_AS in f.metadata}
    assert {"wide_head_small_split", "unpacked_max_reads"} <= set(added)
    at_added = {name for name, value in added.items() if getattr(rules, name) == value}
    assert "unpacked_max_reads" in at_added and "wide_head_small_split" not in at_added  # the cap adopted
    state = deciding_fields(rules)
    assert set(state) == {f.name for f in fields(rules)} - at_added
    assert state["wide_head_small_split"] == 64
    switched = deciding_fields(rules.with_(unpacked_max_reads=0.9))
    assert switched == state | {"unpacked_max_reads": 0.9}
    assert "wide_head_small_split" not in deciding_fields(rules.with_(wide_head_small_split=0))
    assert deciding_fields(rules.with_(crossover_margin=1.1))["crossover_margin"] == 1.1
