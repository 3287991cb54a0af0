"""Launch variants: grid buckets, which variant covers which, and the ids a runtime hands out (CPU)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import triton

from fasttree.launch_rules import GpuTarget, MergeLaunch, Stage1Launch, next_pow2
from fasttree.launch_variants import FIXED_VARIANT, LaunchVariant, VariantTable, grid_bucket, unit_wave


def _stage1(tile_class: int, n_units: int, **kw) -> Stage1Launch:
    args = {"block_m": 64 if tile_class == 0 else 16, "block_n": 64, "num_warps": 4, "num_stages": 3,
            "maxnreg": None, "masked": True, "peel": False, "shrink_stages": True, **kw}  # fmt: skip
    return Stage1Launch(tile_class=tile_class, first_unit=0, n_units=n_units, **args)


def _merge(n_merge: int, many: bool = False) -> MergeLaunch:
    return MergeLaunch(many=many, n_merge=n_merge, block_h=1 if many else 4, block_p=32 if many else 0,
                       num_warps=4, num_stages=1 if many else 3)  # fmt: skip


def _variant(units: tuple[int, ...], n_merge: int | None, **kw) -> LaunchVariant:
    classes = (0, 1) if len(units) == 2 else (1,)
    stage1 = tuple(_stage1(c, n, **kw) for c, n in zip(classes, units, strict=True))
    return LaunchVariant(stage1=stage1, merge=None if n_merge is None else _merge(n_merge))


def test_grid_buckets_are_monotone_and_leave_at_most_one_program_in_eight_idle():
    n = np.arange(0, 5001)
    buckets = np.array([grid_bucket(int(x)) for x in n])
    assert (buckets >= n).all() and (np.diff(buckets) >= 0).all()
    assert (buckets[:17] == n[:17]).all()
    assert ((buckets[17:] - n[17:]) * 8 < buckets[17:]).all()
    # at most eight buckets per doubling: counts in (1024, 2048]
    assert len(set(buckets[1025:2049].tolist())) == 8


def test_a_variant_covers_the_same_launches_with_grids_no_larger():
    big = _variant((40, 72), 96)
    assert big.covers(big)
    assert big.covers(_variant((36, 72), 80)) and big.covers(_variant((40, 16), 1))
    assert not big.covers(_variant((44, 72), 96))  # more class-0 units than its grid
    assert not big.covers(_variant((40, 72), 104))  # more merged queries
    assert not big.covers(_variant((72,), 96))  # one tile class, not two
    assert not big.covers(_variant((40, 72), None))  # no merge: another launch list
    assert not _variant((40, 72), None).covers(_variant((40, 72), 8))
    assert not big.covers(_variant((8, 8), 8, num_stages=4))  # other stages
    assert not big.covers(_variant((8, 8), 8, peel=True))
    assert big.covers(_variant((8, 8), 8, masked=False))  # masked classes serve unmasked ones
    assert not _variant((40, 72), 96, masked=False).covers(_variant((8, 8), 8))
    many = LaunchVariant(stage1=big.stage1, merge=_merge(96, many=True))
    assert not big.covers(replace(many, merge=_merge(8, many=True)))  # the other merge kernel
    assert big.programs == 40 + 72 + 96


def test_past_max_variants_a_new_variant_gets_the_smallest_covering_id_else_replaces_the_least_recent():
    table = VariantTable(3)
    large = _variant((64, 72), 96)
    medium = _variant((48, 40), 64)
    other = _variant((72,), 40)
    assert [table.id_of(v) for v in (large, medium, other)] == [1, 2, 3]
    assert table.id_of(medium) == 2 and len(table) == 3  # used: large is now the least recent
    assert table.id_of(_variant((40, 40), 48)) == 2  # both cover it: the one of fewer programs
    assert table.id_of(_variant((56, 40), 48)) == 1  # only the large one covers it (other: least recent)
    assert len(table) == 3 and table.variant(2) == medium and table.evicted == []  # covering: no new id
    fresh = _variant((64, 80), 48)
    assert table.id_of(fresh) == 4  # none covers it: a new id in place of the least recent (other)
    assert table.evicted == [3] and table.variant(3) is None and table.variant(4) == fresh
    assert table.id_of(_variant((56,), 8)) == 5  # other covered it, but it left: medium (least recent) goes
    assert table.evicted == [3, 2] and len(table) == 3 and table.handed_out == 5
    assert table.id_of(medium) == 1  # the large one covers it
    assert table.id_of(other) == 6  # met again after it left: a new id (ids are never reused)


@pytest.mark.parametrize("max_variants", [0, 1])
def test_only_max_variants_zero_runs_the_fixed_launch(max_variants):
    table = VariantTable(max_variants)
    first, second = _variant((16, 16), 16), _variant((32, 16), 16)
    if max_variants == 0:
        assert table.id_of(first) == table.id_of(second) == FIXED_VARIANT and len(table) == 0
    else:
        assert (table.id_of(first), table.id_of(second)) == (1, 2)  # second is not covered: it replaces first
        assert table.id_of(first) == 2  # which second covers now
        assert table.evicted == [1] and len(table) == 1
    assert table.variant(FIXED_VARIANT) is None


def test_stage1_buckets_stop_at_whole_waves_and_never_exceed_the_lattice():
    n = np.arange(0, 3001)
    for sms, kv_heads in ((132, 1), (132, 4), (132, 8), (108, 7), (78, 16)):
        wave = unit_wave(GpuTarget(cuda=True, major=9, sms=sms), kv_heads)
        assert (wave * kv_heads) % sms == 0 and wave >= 1
        aligned = np.array([grid_bucket(int(x), wave) for x in n])
        lattice = np.array([grid_bucket(int(x)) for x in n])
        assert (aligned >= n).all() and (aligned <= lattice).all() and (np.diff(aligned) >= 0).all()
        on_wave = n[(n > 16) & (n % wave == 0)]
        # a plan whose units fill whole waves launches no idle program, whatever the lattice says
        assert (aligned[on_wave] == on_wave).all()
        assert (aligned[on_wave] < lattice[on_wave]).any()
    assert unit_wave(GpuTarget(cuda=False), 4) == 0
    assert grid_bucket(264, unit_wave(GpuTarget(cuda=True, major=9, sms=132), 1)) == 264
    assert grid_bucket(264) == 288


def test_next_pow2_is_tritons_next_power_of_2():
    """The host's power-of-two rounding (merge tiles, head-dim blocks) equals Triton's on every
    size a plan can ask for, numpy integers included."""
    sizes = [*range(1, 5000), 65535, 65536, 65537, 2**31 - 1]
    assert [next_pow2(n) for n in sizes] == [triton.next_power_of_2(n) for n in sizes]
    assert next_pow2(np.int64(100)) == 128 and next_pow2(np.int32(128)) == 128


def _covers_by_fields(mine: LaunchVariant, other: LaunchVariant) -> bool:
    """:meth:`LaunchVariant.covers` spelled out field by field (the reference for its shape index)."""
    if len(mine.stage1) != len(other.stage1) or (mine.merge is None) != (other.merge is None):
        return False
    for a, b in zip(mine.stage1, other.stage1, strict=True):
        if a.n_units < b.n_units or (b.masked and not a.masked) or replace(a, n_units=b.n_units, masked=b.masked) != b:
            return False
    return mine.merge is None or (
        mine.merge.n_merge >= other.merge.n_merge and replace(mine.merge, n_merge=other.merge.n_merge) == other.merge
    )


def test_the_tables_shape_index_hands_out_the_ids_of_a_scan_of_every_live_variant():
    """Random variants of a few shapes through tables of 1-6 live ids: every id, eviction and covering
    choice equals a reference table that scans every live variant with the field-by-field test."""
    rng = np.random.default_rng(7)
    shapes = [{}, {"num_stages": 4}, {"peel": True}, {"block_n": 32}]

    def draw() -> LaunchVariant:
        units = tuple(int(u) for u in rng.integers(1, 9, size=int(rng.integers(1, 3))) * 8)
        v = _variant(units, None if rng.random() < 0.2 else int(rng.integers(1, 9)) * 8, **shapes[rng.integers(0, 4)])
        if rng.random() < 0.3:
            v = LaunchVariant(stage1=tuple(replace(s, masked=False) for s in v.stage1), merge=v.merge)
        return v

    for max_variants in range(1, 7):
        table, ids, last, evicted = VariantTable(max_variants), {}, 0, []  # the reference: ids in LRU order
        for _ in range(400):
            v = draw()
            assert v.covers(v) and all(w.covers(v) == _covers_by_fields(w, v) for w in ids)
            if v in ids:
                ids[v] = ids.pop(v)
                want = ids[v]
            else:
                covering = [(w.programs, i, w) for w, i in ids.items() if _covers_by_fields(w, v)]
                if len(ids) >= max_variants and covering:
                    _, want, w = min(covering, key=lambda c: c[:2])
                    ids[w] = ids.pop(w)
                else:
                    if len(ids) >= max_variants:
                        evicted.append(ids.pop(next(iter(ids))))
                    last += 1
                    ids[v] = want = last
            assert table.id_of(v) == want
        assert table.evicted == evicted and len(table) == len(ids)
