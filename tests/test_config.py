"""FastTreeConfig: published defaults, query tiles, JSON round trips and validation."""

import dataclasses
import json
import math

import pytest

from fasttree import FastTreeConfig
from fasttree.config import CONFIG_SCHEMA_VERSION

# ------------------------------------------------------------------------ defaults


def test_defaults_are_the_published_values():
    c = FastTreeConfig()
    assert (c.alpha, c.beta, c.gamma) == (0.66, 0.33, 0.1)
    assert c.q_tile_queries is None
    assert c.kv_tile == (64, 64)  # the published (32, 32) measured slower on the H200
    assert c.kv_split_sizes == (1024, 128)
    assert c.para_threshs1 == (132, 528)
    assert c.para_threshs2 == (132, 132)
    assert c.num_warps is None  # derived from the GQA ratio: 2 warps for MHA's 16-row tiles (H200)
    assert c.launch_warps(1) == (4, 2)
    assert c.launch_warps(4) == c.launch_warps(16) == (4, 4)
    assert c.num_stages is None  # derived from the ratio and head dim: the 64-row class at 5 up to GQA 8 (H200)
    assert c.launch_stages(1, 128) == c.launch_stages(8, 64) == (5, 3)
    assert c.launch_stages(16, 128) == c.launch_stages(4, 256) == (3, 3)
    assert FastTreeConfig(num_stages=(2, 4)).launch_stages(4, 128) == (2, 4)
    with pytest.raises(ValueError, match="group size"):
        c.launch_stages(0, 128)


def test_explicit_warps_hold_for_every_ratio_and_bad_ratios_are_refused():
    c = FastTreeConfig(num_warps=(8, 4))
    assert c.launch_warps(1) == c.launch_warps(8) == (8, 4)
    assert FastTreeConfig.from_dict(FastTreeConfig().to_dict()) == FastTreeConfig()
    with pytest.raises(ValueError, match="group size"):
        FastTreeConfig().launch_warps(0)


def test_weights_are_stored_as_floats():
    c = FastTreeConfig(alpha=1, beta=0, gamma=-10)
    assert (c.alpha, c.beta, c.gamma) == (1.0, 0.0, -10.0)
    assert all(type(v) is float for v in (c.alpha, c.beta, c.gamma))


def test_pairs_are_stored_as_int_tuples():
    c = FastTreeConfig(q_tile_queries=[8, 2], kv_tile=[64, 16], kv_split_sizes=range(256, 0, -192))
    assert c.q_tile_queries == (8, 2)
    assert c.kv_tile == (64, 16)
    assert c.kv_split_sizes == (256, 64)
    assert all(type(v) is tuple for v in (c.q_tile_queries, c.kv_tile, c.kv_split_sizes))


# --------------------------------------------------------------------- query tiles


@pytest.mark.parametrize(("g", "tiles"), [(1, (64, 16)), (4, (16, 4)), (16, (4, 1))])
def test_default_query_tiles_are_published_ones(g, tiles):
    assert FastTreeConfig().query_tiles(g) == tiles


@pytest.mark.parametrize("g", [2, 3, 7, 12, 33, 64, 200])
def test_default_query_tiles_are_valid_for_any_group_size(g):
    large, small = FastTreeConfig().query_tiles(g)
    assert isinstance(large, int)
    assert isinstance(small, int)
    assert large >= small >= 1
    if g <= 64:
        assert large * g <= 64
    assert small * g <= max(16, g)


def test_default_query_tiles_for_group_size_7_fill_at_most_64_rows():
    large, small = FastTreeConfig().query_tiles(7)
    assert 1 <= small <= large
    assert large * 7 <= 64
    assert small * 7 <= 16
    assert (large + 1) * 7 > 64  # as many queries as fit


def test_explicit_query_tiles_are_used_as_given():
    c = FastTreeConfig(q_tile_queries=(8, 2))
    assert c.query_tiles(1) == (8, 2)
    assert c.query_tiles(32) == (8, 2)  # 256 rows: the limit itself is allowed


def test_query_tiles_rejects_more_than_256_rows():
    c = FastTreeConfig(q_tile_queries=(64, 16))
    with pytest.raises(ValueError, match="64 queries x GQA group size 16 = 1024 rows exceeds the kernel limit of 256"):
        c.query_tiles(16)
    with pytest.raises(ValueError, match="group size 257 = 257 rows"):
        FastTreeConfig().query_tiles(257)


@pytest.mark.parametrize("g", [0, -4])
def test_query_tiles_rejects_nonpositive_group_size(g):
    with pytest.raises(ValueError, match=f"GQA group size must be >= 1, got {g}"):
        FastTreeConfig().query_tiles(g)


# --------------------------------------------------------------------------- JSON

CONFIGS = [
    pytest.param(FastTreeConfig(), id="defaults"),
    pytest.param(
        FastTreeConfig(
            alpha=0.1 + 0.2,
            beta=1e-12,
            gamma=-10,
            q_tile_queries=(16, 4),
            kv_tile=(64, 16),
            kv_split_sizes=(2048, 64),
            para_threshs1=(0, 7),
            para_threshs2=(1, 0),
            num_warps=(8, 2),
            num_stages=(3, 1),
        ),
        id="every-field-changed",
    ),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_json_string_round_trip(config):
    text = config.to_json()
    assert json.loads(text)["schema_version"] == CONFIG_SCHEMA_VERSION
    back = FastTreeConfig.from_json(text)
    assert back == config
    assert back.to_json() == text


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("as_str", [False, True], ids=["Path", "str"])
def test_json_file_round_trip(tmp_path, config, as_str):
    path = tmp_path / "config.json"
    text = config.to_json(str(path) if as_str else path)
    assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary file left behind
    assert FastTreeConfig.from_json(path) == config


def test_to_json_overwrites_an_existing_file(tmp_path):
    path = tmp_path / "config.json"
    FastTreeConfig().to_json(path)
    FastTreeConfig(gamma=-10).to_json(path)
    assert FastTreeConfig.from_json(path).gamma == -10.0


def test_to_json_failing_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    """A write that fails before the rename leaves the old config whole and no temporary file."""
    import fasttree.fileio as fileio

    path = tmp_path / "config.json"
    FastTreeConfig(gamma=-10).to_json(path)

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        FastTreeConfig(gamma=3).to_json(path)
    assert FastTreeConfig.from_json(path).gamma == -10.0
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_explicit_query_tiles_survive_json():
    config = FastTreeConfig(q_tile_queries=(4, 1))
    data = json.loads(config.to_json())
    assert data["q_tile_queries"] == [4, 1]
    back = FastTreeConfig.from_json(config.to_json())
    assert back.q_tile_queries == (4, 1)
    assert back.query_tiles(16) == (4, 1)


def test_to_dict_is_plain_json():
    data = FastTreeConfig().to_dict()
    assert data["q_tile_queries"] is None
    assert data["kv_tile"] == [64, 64]
    assert set(data) == {"schema_version"} | {f.name for f in dataclasses.fields(FastTreeConfig)}


def test_from_dict_without_schema_version_and_with_partial_keys():
    assert FastTreeConfig.from_dict({"gamma": 2, "kv_tile": [64, 64]}) == FastTreeConfig(gamma=2.0, kv_tile=(64, 64))
    assert FastTreeConfig.from_dict({}) == FastTreeConfig()


def test_from_dict_rejects_unknown_keys():
    data = FastTreeConfig().to_dict() | {"delta": 1, "Alpha": 0.5}
    with pytest.raises(ValueError, match=r"unknown FastTreeConfig keys: \['Alpha', 'delta'\]"):
        FastTreeConfig.from_dict(data)


def test_from_dict_reads_schema_version_1_without_packing():
    # version 1 predates packing: its configs must keep planning as they did
    data = FastTreeConfig(gamma=0.5).to_dict()
    del data["pack_tokens"], data["pack_min_units"]
    data["schema_version"] = 1
    assert FastTreeConfig.from_dict(data) == FastTreeConfig(gamma=0.5, pack_tokens=0)
    assert FastTreeConfig.from_dict(data | {"pack_tokens": 64}).pack_tokens == 64
    # a version-1 dict without kv_tile meant the published tiles
    del data["kv_tile"]
    assert FastTreeConfig.from_dict(data).kv_tile == (32, 32)


@pytest.mark.parametrize("version", [0, 3, "1", "2", None, True, 2.0])
def test_from_dict_rejects_another_schema_version(version):
    data = FastTreeConfig().to_dict() | {"schema_version": version}
    with pytest.raises(ValueError, match=f"schema_version {version!r} is not supported"):
        FastTreeConfig.from_dict(data)


def test_from_json_rejects_another_schema_version():
    text = json.dumps({"schema_version": 99, "alpha": 0.5})
    with pytest.raises(ValueError, match="schema_version 99 is not supported"):
        FastTreeConfig.from_json(text)


@pytest.mark.parametrize("data", [[1, 2], "alpha", 3, None])
def test_from_dict_rejects_non_objects(data):
    with pytest.raises(ValueError, match=f"must be a JSON object, got {type(data).__name__}"):
        FastTreeConfig.from_dict(data)


@pytest.mark.parametrize("content", ["[0.66, 0.33]", "null", '"alpha"'])
def test_from_json_file_rejects_non_objects(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="must be a JSON object"):
        FastTreeConfig.from_json(path)


@pytest.mark.parametrize("text", ['{"alpha": 0.5', "{alpha: 0.5}", '{"alpha": 0.5,}', "{"])
def test_from_json_rejects_malformed_text(text):
    with pytest.raises(ValueError, match="FastTreeConfig JSON is malformed"):
        FastTreeConfig.from_json(text)


def test_from_json_rejects_malformed_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"alpha": }')
    with pytest.raises(ValueError, match="FastTreeConfig JSON is malformed"):
        FastTreeConfig.from_json(path)


def test_from_json_validates_values():
    with pytest.raises(ValueError, match="kv_tile entries must be powers of two"):
        FastTreeConfig.from_json('{"kv_tile": [24, 32]}')


# --------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"alpha": math.nan}, "alpha must be a finite number, got nan", id="alpha-nan"),
        pytest.param({"alpha": math.inf}, "alpha must be a finite number, got inf", id="alpha-inf"),
        pytest.param({"beta": -math.inf}, "beta must be a finite number, got -inf", id="beta-neg-inf"),
        pytest.param({"gamma": math.nan}, "gamma must be a finite number", id="gamma-nan"),
        pytest.param({"alpha": True}, "alpha must be a finite number, got True", id="alpha-bool"),
        pytest.param({"gamma": False}, "gamma must be a finite number, got False", id="gamma-bool"),
        pytest.param({"beta": "0.33"}, "beta must be a finite number, got '0.33'", id="beta-string"),
        pytest.param({"alpha": None}, "alpha must be a finite number, got None", id="alpha-none"),
        pytest.param({"kv_tile": (True, 32)}, "kv_tile must be a pair of integers", id="kv-tile-bool"),
        pytest.param({"num_stages": (2, False)}, "num_stages must be a pair of integers", id="stages-bool"),
        pytest.param({"kv_tile": (32,)}, r"kv_tile must be a pair of integers, got \(32,\)", id="kv-tile-single"),
        pytest.param({"kv_tile": (32, 32, 32)}, "kv_tile must be a pair of integers", id="kv-tile-triple"),
        pytest.param({"kv_split_sizes": 1024}, "kv_split_sizes must be a pair of integers, got 1024", id="scalar"),
        pytest.param({"num_warps": ()}, "num_warps must be a pair of integers", id="empty-tuple"),
        pytest.param({"kv_split_sizes": (1024, 1.5)}, "kv_split_sizes must be a pair of integers", id="float-entry"),
        pytest.param({"para_threshs1": ("a", 528)}, "para_threshs1 must be a pair of integers", id="str-entry"),
        pytest.param({"kv_tile": "ab"}, "kv_tile must be a pair of integers, got 'ab'", id="str-pair"),
        pytest.param({"q_tile_queries": (16.0, 4)}, "q_tile_queries must be a pair of integers", id="q-tile-float"),
        pytest.param({"q_tile_queries": 16}, "q_tile_queries must be a pair of integers", id="q-tile-scalar"),
        pytest.param({"kv_tile": (24, 32)}, r"kv_tile entries must be powers of two in \[16, 512\]", id="kv-tile-24"),
        pytest.param({"kv_tile": (32, 8)}, r"kv_tile entries must be powers of two in \[16, 512\]", id="kv-tile-8"),
        pytest.param({"kv_tile": (0, 32)}, "kv_tile entries must be powers of two", id="kv-tile-0"),
        pytest.param({"kv_tile": (1024, 32)}, "kv_tile entries must be powers of two", id="kv-tile-1024"),
        pytest.param({"q_tile_queries": (4, 16)}, "large >= small >= 1, got \\(4, 16\\)", id="large-below-small"),
        pytest.param({"q_tile_queries": (4, 0)}, "large >= small >= 1", id="small-zero"),
        pytest.param({"q_tile_queries": (-1, -2)}, "large >= small >= 1", id="negative-tiles"),
        pytest.param({"kv_split_sizes": (0, 128)}, r"kv_split_sizes must be >= 1, got \(0, 128\)", id="split-0"),
        pytest.param({"kv_split_sizes": (1024, -1)}, "kv_split_sizes must be >= 1", id="split-negative"),
        pytest.param({"para_threshs1": (-1, 528)}, r"para_threshs1 must be >= 0, got \(-1, 528\)", id="thresh1-neg"),
        pytest.param({"para_threshs2": (132, -5)}, "para_threshs2 must be >= 0", id="thresh2-neg"),
        pytest.param({"num_warps": (3, 4)}, r"num_warps must be powers of two <= 16, got \(3, 4\)", id="warps-3"),
        pytest.param({"num_warps": (4, 0)}, "num_warps must be powers of two", id="warps-0"),
        pytest.param({"num_warps": (32, 4)}, "num_warps must be powers of two <= 16", id="warps-32"),
        pytest.param({"num_stages": (0, 2)}, r"num_stages must be in \[1, 8\], got \(0, 2\)", id="stages-0"),
        pytest.param({"num_stages": (2, 9)}, r"num_stages must be in \[1, 8\]", id="stages-9"),
        pytest.param({"pack_tokens": -1}, r"pack_tokens must be an integer >= 0, got -1", id="pack-neg"),
        pytest.param({"pack_tokens": 1.5}, r"pack_tokens must be an integer >= 0, got 1.5", id="pack-float"),
        pytest.param({"pack_min_units": True}, r"pack_min_units must be an integer >= 0, got True", id="pack-bool"),
    ],
)
def test_constructor_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FastTreeConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": -5}, r"FastTreeConfig.alpha must be in \[0.0, 10000.0\], got -5"),
        ({"alpha": 1e308}, r"FastTreeConfig.alpha must be in \[0.0, 10000.0\], got 1e\+308"),
        ({"gamma": -1e5}, r"FastTreeConfig.gamma must be in \[-10000.0, 10000.0\]"),
        ({"pack_tokens": 10**30}, r"FastTreeConfig.pack_tokens must be <= 16777216"),
        ({"para_threshs1": (0, 2**31)}, r"para_threshs1 must be at most 2147483647"),
    ],
)
def test_constructor_rejects_values_outside_the_planners_range(kwargs, match):
    """Weights, packing budgets and counts far outside any meaningful range are refused (a config
    with alpha = 1e308 made the planner's costs overflow), also when an export carries them."""
    with pytest.raises(ValueError, match=match):
        FastTreeConfig(**kwargs)
    data = FastTreeConfig().to_dict() | {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        FastTreeConfig.from_dict(data)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_tile": (16, 512)},
        {"q_tile_queries": (1, 1)},
        {"q_tile_queries": (256, 1)},
        {"kv_split_sizes": (1, 1)},
        {"para_threshs1": (0, 0), "para_threshs2": (0, 0)},
        {"num_warps": (1, 16)},
        {"num_stages": (1, 8)},
        {"alpha": 0, "beta": 1e4, "gamma": -1e4},
        {"pack_tokens": 1 << 24, "pack_min_units": 1 << 24, "kv_split_sizes": (2**31 - 1, 1)},
    ],
)
def test_constructor_accepts_the_boundaries(kwargs):
    c = FastTreeConfig(**kwargs)
    for key, value in kwargs.items():
        assert getattr(c, key) == value


# --------------------------------------------------------------- with_ / frozen


def test_with_returns_a_changed_copy():
    base = FastTreeConfig()
    changed = base.with_(gamma=-10, kv_tile=[64, 64])
    assert changed is not base
    assert changed.gamma == -10.0
    assert changed.kv_tile == (64, 64)
    assert changed.alpha == base.alpha
    assert base == FastTreeConfig()  # the original is untouched


def test_with_validates_the_copy():
    with pytest.raises(ValueError, match="num_warps must be powers of two"):
        FastTreeConfig().with_(num_warps=(3, 3))
    with pytest.raises(ValueError, match="large >= small"):
        FastTreeConfig(q_tile_queries=(16, 4)).with_(q_tile_queries=(2, 4))


def test_with_rejects_unknown_fields():
    with pytest.raises(TypeError):
        FastTreeConfig().with_(delta=1)


def test_configs_are_hashable_and_compare_by_value():
    a = FastTreeConfig(q_tile_queries=[16, 4])
    b = FastTreeConfig(q_tile_queries=(16, 4))
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, FastTreeConfig()}) == 2
    assert {a: "x"}[b] == "x"
    assert a != FastTreeConfig()


@pytest.mark.parametrize(("field", "value"), [("alpha", 1.0), ("kv_tile", (64, 64)), ("q_tile_queries", (1, 1))])
def test_configs_are_frozen(field, value):
    c = FastTreeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(c, field, value)
    assert c == FastTreeConfig()
