"""The direct-launch cache of ``tree_attention`` (CPU, with stand-in kernels): after the first call
through Triton, later calls with the same tensor layout call the compiled launchers with the new
tensors and nothing else changed; another layout goes through Triton again."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from triton.runtime.errors import OutOfResources

import fasttree as ft
from fasttree import attention, launcher
from fasttree.launch_rules import GpuTarget


class FakeCompiled:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.function, self.packed_metadata = f"fn-{name}", f"meta-{name}"

    def run(self, g0, g1, g2, stream, fn, meta, lm, enter, exit_, *args):
        assert (fn, meta, lm, enter, exit_) == (self.function, self.packed_metadata, None, None, None)
        self.log.append(("run", self.name, (g0, g1, g2), stream, args))


class FakeKernel:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages):
            self.log.append(("jit", self.name, (*grid, 1), None, args))
            return FakeCompiled(self.name, self.log)

        return launch


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))


class FakeEvent:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, stream):
        self.log.append(("record", stream.name, self.name))


@pytest.fixture
def fakes(monkeypatch):
    log: list = []
    side = (FakeStream("main", log), FakeStream("side", log), 5678, FakeEvent("fork", log), FakeEvent("join", log))
    monkeypatch.setattr(attention, "side_stream", lambda device, stream: side)
    monkeypatch.setattr(attention, "_stream_context", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(attention, "tree_attention_units_kernel", FakeKernel("units", log))
    monkeypatch.setattr(attention, "merge_partials_kernel", FakeKernel("merge", log))
    monkeypatch.setattr(attention, "merge_many_partials_kernel", FakeKernel("merge_many", log))
    for module in (attention, launcher):  # a CUDA GPU as far as the launches can tell
        monkeypatch.setattr(module, "interpreting", lambda: False)
        monkeypatch.setattr(module, "launch_hooks_active", lambda: False)
        monkeypatch.setattr(module, "current_stream", lambda device: 1234)
    monkeypatch.setattr(attention, "_is_cuda", lambda t: True)
    # an sm_90 GPU (PDL flags set) without an SM count: no one-wave launch choice
    monkeypatch.setattr(attention, "_target", lambda q: GpuTarget(cuda=True, major=9))
    monkeypatch.setattr(launcher, "_COMPILED", {})
    real_check = attention._check_inputs
    monkeypatch.setattr(attention, "_check_inputs", lambda q, *a: q.device)  # CPU tensors stand in for CUDA ones
    return log, real_check


def _launches(log: list) -> list:
    """The kernel launches of ``log`` (without the fork and join events)."""
    return [e for e in log if e[0] in ("jit", "run")]


def _setup_tree() -> ft.KVTree:
    return ft.KVTree.from_lengths([-1] + [0] * 20, [300] + [10 + i for i in range(20)], list(range(1, 21)))


def setup(gen):
    tree = _setup_tree()
    config = ft.FastTreeConfig(
        q_tile_queries=(8, 2), kv_split_sizes=(128, 32), pack_tokens=0, para_threshs1=(0, 0), para_threshs2=(0, 0)
    )
    plan = ft.plan(tree, config, num_q_heads=8, num_kv_heads=2, head_dim=64)
    assert plan.merge_queries.size and all(u > 0 for u in plan.units_per_class()), "needs both classes and a merge"
    q = torch.randn(tree.n_queries, 8, 64, generator=gen, dtype=torch.float16)
    k = torch.randn(tree.max_slot + 1, 2, 64, generator=gen, dtype=torch.float16)
    return plan, q, k, torch.randn_like(k)


def _passed_as(arg, passed) -> bool:
    """Whether ``passed`` is what a direct launcher passes for ``arg``: a tensor's address."""
    return (arg.data_ptr() if isinstance(arg, torch.Tensor) else arg) == passed


def test_second_call_uses_the_compiled_launchers_with_the_new_tensors(fakes):
    """Later calls pass the new q, k, v, out and scale and the plan's fixed arguments; every tensor
    goes to Triton's launcher as its address (no per-launch ``data_ptr()`` and driver check
    there), and the launcher holds the fixed tensors."""
    log, _ = fakes
    gen = torch.Generator().manual_seed(0)
    plan, q, k, v = setup(gen)
    out = torch.empty_like(q)
    ft.tree_attention(q, k, v, plan, out=out)
    fork_join = [
        ("record", "main", "fork"),
        ("wait", "side", "fork"),
        ("record", "side", "join"),
        ("wait", "main", "join"),
    ]
    assert [e for e in log if e[0] in ("record", "wait")] == fork_join
    first = [e for e in log if e[0] == "jit"]
    assert [e[0] for e in log] == ["record", "wait", "jit", "record", "jit", "wait", "jit"]
    assert [e[1] for e in first] == ["units", "units", "merge"]
    log.clear()
    q2, k2, v2, out2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), torch.empty_like(q)
    ft.tree_attention(q2, k2, v2, plan, 0.5, out=out2)
    assert [e[:2] for e in log] == [
        ("record", "main"), ("wait", "side"), ("run", "units"), ("record", "side"), ("run", "units"),
        ("wait", "main"), ("run", "merge"),
    ], "class 0 on the side stream, class 1 on the launching one, which waits for both before the merge"  # fmt: skip
    runs = [e for e in log if e[0] == "run"]
    assert [e[3] for e in runs] == [5678, 1234, 1234], "the side stream's raw handle for the first launch"
    for (_, _, grid1, _, args1), (_, name, grid2, _, args2) in zip(first, runs, strict=True):
        assert grid1 == grid2 and len(args1) == len(args2)
        assert not any(isinstance(a, torch.Tensor) for a in args2), "addresses only"
        if name == "merge":
            assert _passed_as(out2, args2[0])
            assert all(_passed_as(a, b) for a, b in zip(args1[1:], args2[1:], strict=True))
            continue
        assert all(_passed_as(t, a) for t, a in zip((q2, k2, v2, out2), args2[:4], strict=True))
        qk = attention._QK_SCALE_ARG
        assert args1[qk] == pytest.approx(1 / np.sqrt(64) * attention.LOG2E) and args2[qk] == 0.5 * attention.LOG2E
        same = [i for i in range(4, len(args1)) if i != qk]
        assert all(_passed_as(args1[i], args2[i]) for i in same), "plan arrays, strides, constexprs"
    (launchers,) = [e[1] for key, e in plan._device_cache.items() if isinstance(key, tuple) and key[0] == "direct"]
    for launch, (_, _, _, _, args1) in zip(launchers, first, strict=True):
        held = launch.held  # the launch's arguments; the logged ones end with the constexprs
        assert all(a is b for a, b in zip(held, args1[: len(held)], strict=True)), "the launcher holds the tensors"


def test_another_layout_or_an_explicit_device_plan_goes_through_triton(fakes):
    log, _ = fakes
    gen = torch.Generator().manual_seed(1)
    plan, q, k, v = setup(gen)
    ft.tree_attention(q, k, v, plan)
    log.clear()
    direct = lambda: {key for key in plan._device_cache if isinstance(key, tuple) and key[0] == "direct"}  # noqa: E731
    assert len(direct()) == 1
    wide = torch.randn(k.shape[0], 4, 64, generator=gen, dtype=torch.float16)[:, 1:3]  # another stride(0)
    ft.tree_attention(q, wide, v, plan)
    assert [e[0] for e in _launches(log)] == ["run"] * 3, (
        "Triton's kernels fit (same specialisation): its cached launch path"
    )
    assert _launches(log)[0][4][1] is wide and _launches(log)[0][4][18] == wide.stride(0) == 256
    assert len(direct()) == 2, "a direct entry for the new layout"
    log.clear()
    ft.tree_attention(q, wide, v, plan)
    assert [e[0] for e in _launches(log)] == ["run"] * 3 and _launches(log)[0][4][18] == 256
    log.clear()
    flat = torch.randn(k.numel() + 1, generator=gen, dtype=torch.float16)
    odd = flat[1:].view(k.shape)  # 2-byte offset: not 16-byte aligned, which Triton specialises on
    ft.tree_attention(q, odd, v, plan)
    assert [e[0] for e in _launches(log)] == ["jit", "jit", "run"], (
        "stage 1 compiles for the unaligned pool; the merge is cached"
    )
    assert len(direct()) == 3
    log.clear()
    uploaded = attention.DevicePlan.upload(plan, q.device)  # not the plan's cached copy: no direct path
    assert attention._fast_path(plan, uploaded, q, k, v, torch.empty_like(q)) is None
    keys = direct()
    out = torch.empty_like(q)
    ft.tree_attention(q, k, v, uploaded, out=out)
    assert [e[:2] for e in _launches(log)] == [
        ("run", "units"),
        ("run", "units"),
        ("run", "merge"),
    ]  # Triton's cached kernels
    assert _launches(log)[0][4][6] is uploaded.arrays["kv_indices"] and _launches(log)[0][4][3] is out
    assert direct() == keys


def test_two_class_plans_fork_in_every_call_and_one_class_plans_never(fakes):
    """A plan with two non-empty tile classes runs their stage-1 launches side by side, through
    Triton and through the direct launchers; a plan with one class has nothing to fork."""
    log, _ = fakes
    plan, q, k, v = setup(torch.Generator().manual_seed(2))
    one_class = ft.plan(_setup_tree(), num_q_heads=8, num_kv_heads=2, head_dim=64)
    assert 0 in one_class.units_per_class()
    for p, forks in ((plan, True), (one_class, False)):
        for _ in range(2):  # through Triton, then the direct launchers
            log.clear()
            ft.tree_attention(q, k, v, p)
            events = [e for e in log if e[0] in ("record", "wait")]
            assert bool(events) == forks
            assert sum(e[1] == "units" for e in _launches(log)) == (2 if forks else 1)


class CudaLauncher:
    """Stands in for Triton's ``CudaLauncher`` (the class name :func:`launcher._launch_entry` checks)."""

    def __init__(self, log, scratch=0):
        self.log = log
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):  # Triton's C launch function
        self.log.append(("c", args))

    def __call__(self, *args):  # its Python wrapper
        self.log.append(("py", args))


@pytest.mark.parametrize(("scratch", "same_triton", "path"), [(0, True, "c"), (16, True, "py"), (0, False, "py")])
def test_direct_launchers_call_tritons_c_launch_with_what_its_wrapper_adds(monkeypatch, scratch, same_triton, path):
    """A direct launcher calls the C launch function with the arguments ``CudaLauncher.__call__``
    would add (flags, no scratch buffers, then the metadata and hooks), except for a kernel that
    needs scratch memory or under another Triton version than the one checked, which go through
    ``__call__``; both get the kernel's arguments with the plan's tensors as addresses."""
    from types import SimpleNamespace

    version = launcher._triton_version()  # the release is faked, not switched: another one takes __call__
    monkeypatch.setattr(launcher, "_C_LAUNCH_TRITON", version if same_triton else (*version, 99))
    log: list = []
    compiled = SimpleNamespace(run=CudaLauncher(log, scratch), function=7, packed_metadata=(4, 1, 0))
    fixed = torch.arange(6, dtype=torch.int32)
    direct = launcher.direct_launcher(compiled, (3, 2), ("q", "k", "v", "o", fixed, 0.25, 16), (64,), 5)
    direct(99, 11, 12, 13, 14, 0.5)
    ((kind, args),) = log
    assert kind == path
    head = (False, True, None, None) if path == "c" else ()
    assert args == (3, 2, 1, 99, 7, *head, (4, 1, 0), None, None, None, 11, 12, 13, 14, fixed.data_ptr(), 0.5, 16, 64)


def test_every_launch_passes_one_value_per_kernel_parameter(monkeypatch, device):
    """A compiled kernel's launcher takes every parameter positionally, constexprs included,
    and knows no defaults: the direct launchers of ``tree_attention`` and of the runtime pass
    exactly one value per parameter of the real kernels (a new constexpr with a default
    would otherwise pass under the interpreter and fail on the GPU)."""
    from fasttree import runtime as runtime_module

    calls = []
    for module in (attention, runtime_module):
        real = module.launch

        def recording(kernel, grid, args, constexprs, *rest, real=real, **kw):
            calls.append((kernel, len(args) + len(constexprs)))
            return real(kernel, grid, args, constexprs, *rest, **kw)

        monkeypatch.setattr(module, "launch", recording)
    gen = torch.Generator().manual_seed(3)
    plan, *tensors = setup(gen)
    q, k, v = (t.to(device) for t in tensors)
    ft.tree_attention(q, k, v, plan)
    rt = runtime_module.TreeAttentionRuntime(
        None, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, device=device, max_queries=32,
        max_kv_entries=2048, max_variants=0,
    )  # fmt: skip
    rt.plan(_setup_tree())
    rt.forward(q, k, v)
    kernels = {kernel for kernel, _ in calls}
    assert {attention.tree_attention_units_kernel, runtime_module.tree_attention_persistent_kernel} <= kernels
    for kernel, passed in calls:
        assert passed == len(kernel.arg_names), f"{kernel.fn.__name__}: {passed} values for {len(kernel.arg_names)}"


class ShortOfSharedMemory:
    """A stand-in kernel whose launches above ``fits`` stages fail as Triton's do for shared memory."""

    def __init__(self, fits: int, what: str = "shared memory"):
        self.fits, self.what, self.tried = fits, what, []

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages):
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(1000 * num_stages, 1000 * self.fits, self.what)
            return ("compiled", num_stages)

        return launch


class _Arg:
    class device:  # noqa: N801 - stands in for a tensor's device
        index = 0


def test_a_default_stages_launch_short_of_shared_memory_compiles_with_fewer_stages(monkeypatch, caplog):
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setattr(launcher, "launch_hooks_active", lambda: False)
    kernel = ShortOfSharedMemory(fits=3)
    with caplog.at_level("WARNING", logger="fasttree.launcher"):
        got = launcher.launch(kernel, (1, 1), (_Arg(),), ("fallback-test",), 4, 5, shrink_stages=True)
    assert got == ("compiled", 3) and kernel.tried == [5, 4, 3]
    assert "compiled with 3 stages" in caplog.text
    # explicit stages (no shrinking), other resources, or no stage left to drop still raise
    with pytest.raises(OutOfResources):
        launcher.launch(ShortOfSharedMemory(fits=3), (1, 1), (_Arg(),), ("explicit-test",), 4, 5)
    with pytest.raises(OutOfResources):
        launcher.launch(ShortOfSharedMemory(fits=3, what="registers"), (1, 1), (_Arg(),), ("regs-test",), 4, 5,
                          shrink_stages=True)  # fmt: skip
    with pytest.raises(OutOfResources):
        launcher.launch(ShortOfSharedMemory(fits=0), (1, 1), (_Arg(),), ("none-fits",), 4, 2, shrink_stages=True)
