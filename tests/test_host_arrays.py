"""The reused host memory of plans' per-KV-entry arrays (fasttree.host_arrays): a slab is handed
out again only when no array uses it, the pool stays within its bounds, and plans kept alive keep
their arrays intact while later plans are made; the per-thread work memory is reused within a
thread and never shared across threads."""

import gc
import threading

import numpy as np
import pytest
import torch

import fasttree as ft
from fasttree.host_arrays import EntryArrayPool, eighth_step_ceil, work_array


def _pool(**kw) -> EntryArrayPool:
    pool = EntryArrayPool(**{"min_entries": 8, **kw})
    if not pool._exact:
        pytest.skip("reference counts are not exact on this interpreter: the pool allocates every array")
    return pool


def test_a_slab_is_reused_only_once_every_view_of_it_is_gone():
    pool = _pool()
    a = pool.empty(100)
    b = pool.empty(100)
    assert a.dtype == np.int32 and a.shape == (100,) and a.flags.c_contiguous
    assert not np.shares_memory(a, b)
    view = a[10:20].reshape(2, 5)[1:]  # a view of a view still holds the slab
    del a
    gc.collect()
    c = pool.empty(60)
    assert not np.shares_memory(c, view) and not np.shares_memory(c, b)
    del view
    gc.collect()
    d = pool.empty(90)  # the first slab is free again
    assert len(pool._slabs) == 3 and np.shares_memory(d, pool._slabs[0])


def test_a_tensor_over_a_pooled_array_keeps_its_slab():
    pool = _pool()
    t = torch.from_numpy(pool.empty(64))
    t.fill_(7)
    for _ in range(4):
        pool.empty(64).fill(-1)
    assert (t == 7).all()
    del t
    gc.collect()
    assert pool.empty(64).base is pool._slabs[0]


def test_the_pool_keeps_within_its_slab_count_and_bytes():
    pool = _pool(max_slabs=2, max_bytes=4 * 1024)
    held = [pool.empty(200), pool.empty(200)]
    extra = pool.empty(200)  # both slabs in use: memory of its own
    assert len(pool._slabs) == 2 and extra.base is None
    del held[0]
    gc.collect()
    big = pool.empty(600)  # replaces the free slab (the count bound), within the bytes bound
    assert len(pool._slabs) == 2 and big.base is pool._slabs[-1]
    del held, big
    gc.collect()
    huge = pool.empty(2000)  # over max_bytes: its own memory
    assert huge.base is None and pool.held_bytes() <= 4 * 1024
    assert pool.empty(3).base is None  # below min_entries


def test_slabs_round_up_so_that_similar_sizes_share_one():
    assert eighth_step_ceil(1000) >= 1000
    assert eighth_step_ceil(1000) - 1000 < 1000 / 8
    assert eighth_step_ceil(64) == 64
    assert [eighth_step_ceil(n) for n in (0, 1, 15, 16, 17, 18, 19)] == [0, 1, 15, 16, 18, 18, 20]
    for n in range(1, 5000):
        up = eighth_step_ceil(n)
        assert n <= up < n + max(1, n / 8) and eighth_step_ceil(up) == up


def _deep_tree(seed: int, tokens: int) -> ft.KVTree:
    rng = np.random.default_rng(seed)
    n = 120
    parents = [-1, *(int(rng.integers(0, i)) for i in range(1, n))]
    lengths = [tokens, *rng.integers(1, 400, n - 1).tolist()]
    children = set(parents[1:])
    leaves = [i for i in range(n) if i not in children]
    return ft.KVTree.from_lengths(parents, lengths, leaves)


@pytest.mark.parametrize("heads", [(32, 32), (32, 4)])
def test_plans_kept_alive_keep_their_arrays_while_later_plans_are_made(heads):
    hq, hkv = heads
    cfg = ft.FastTreeConfig()
    kept = []
    for seed in range(6):
        tree = _deep_tree(seed, 60_000)
        plan = ft.plan(tree, cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
        assert plan.kv_indices.size >= 1 << 15  # large enough to come from the pool
        kept.append((plan, plan.kv_indices.copy(), plan.kv_row_mask.copy(), plan.groups.kv_slots.copy()))
        if seed % 2:
            kept.pop(0)  # some plans die, and their memory returns to later plans
            gc.collect()
    for plan, kv, mask, slots in kept:
        assert np.array_equal(plan.kv_indices, kv)
        assert np.array_equal(plan.kv_row_mask, mask)
        assert np.array_equal(plan.groups.kv_slots, slots)
    again = ft.plan(_deep_tree(5, 60_000), cfg, num_q_heads=hq, num_kv_heads=hkv, head_dim=128)
    assert np.array_equal(again.kv_indices, kept[-1][1]) and np.array_equal(again.kv_row_mask, kept[-1][2])
    for plan, *_ in kept:
        assert not np.shares_memory(again.kv_indices, plan.kv_indices)
        assert not np.shares_memory(again.kv_row_mask, plan.kv_row_mask)


def test_work_array_is_reused_within_a_thread_and_not_across_threads():
    a = work_array(1000)
    assert a.dtype == np.int64 and a.shape == (1000,) and a.flags.c_contiguous
    b = work_array(900)
    assert np.shares_memory(a, b)  # the same thread's next call reuses it
    other = {}
    thread = threading.Thread(target=lambda: other.setdefault("a", work_array(1000)))
    thread.start()
    thread.join()
    assert not np.shares_memory(other["a"], b)
    big = work_array((1 << 23) + 1)
    assert big.size == (1 << 23) + 1 and not np.shares_memory(big, work_array(10))
