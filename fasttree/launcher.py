"""Triton launch plumbing shared by :func:`fasttree.tree_attention` and the runtime.

Compiles a kernel once per specialisation and launches it through Triton's compiled launcher
(:func:`launch`), builds *direct launchers* that call a compiled kernel with only the per-call
arguments replaced (:func:`direct_launcher`: the eager fast path and the runtime's launches),
and holds the CUDA stream and device helpers they need. No launch policy lives here
(:mod:`fasttree.launch_rules` decides tiles, stages, grids and waits).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import triton
from triton.runtime.errors import OutOfResources

from .kernels import (
    merge_many_partials_kernel,
    merge_partials_kernel,
    merge_partials_persistent_kernel,
    tree_attention_persistent_kernel,
    tree_attention_units_kernel,
    tree_attention_units_sm90_kernel,
)

__all__ = [
    "current_stream",
    "direct_launcher",
    "fixed_launcher",
    "interpreting",
    "launch",
    "launch_hooks_active",
    "launch_pointers",
    "on_device",
    "side_stream",
    "tensor_layout",
]

logger = logging.getLogger(__name__)

#: Compiled kernels by (kernel, device, constexprs, launch options, argument specialisation).
_COMPILED: dict[tuple, object] = {}
#: Kernels whose last constexpr is ``GDC_WAIT`` (every kernel of :mod:`fasttree.kernels`; the sm_90
#: Gluon stage 1 where the installed Triton has Gluon's Hopper ops).
GDC_KERNELS = frozenset(
    k for k in (
        tree_attention_units_kernel, tree_attention_units_sm90_kernel, merge_partials_kernel,
        merge_many_partials_kernel, tree_attention_persistent_kernel, merge_partials_persistent_kernel,
    ) if k is not None
)  # fmt: skip
#: The Triton release whose ``CudaLauncher`` C launch function :func:`_launch_entry` calls directly
#: (its argument order is Triton's internal); other releases go through the launcher's ``__call__``.
_C_LAUNCH_TRITON = (3, 6)


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return type(tree_attention_units_kernel).__name__ == "InterpretedFunction"


def launch_hooks_active() -> bool:
    """Whether a profiler registered Triton launch hooks (then every launch goes through the JIT).

    Triton >= 3.5 keeps the hooks in an always-present ``HookChain``; older ones use None.
    """
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


#: torch's raw current-device getter (CUDA builds): ``torch.cuda.current_device()`` without its
#: lazy-init check, which an eager call pays on every launch otherwise.
_RAW_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
#: torch's raw current-stream getter (CUDA builds; what Triton's launcher uses): an int handle
#: without building a ``torch.cuda.Stream`` object (about 8 us less per launch on a GPU host).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_device_index() -> int:
    return _RAW_DEVICE() if _RAW_DEVICE is not None else torch.cuda.current_device()


def current_stream(device: torch.device) -> int:
    """Raw handle of the current CUDA stream of ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def on_device(device: torch.device):
    """Make ``device`` current for the launches (a no-op when it already is, or on the CPU)."""
    if device.type == "cuda" and device.index != _current_device_index():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


#: Per (device index, raw handle of the launching stream): that stream, a side stream, the side
#: stream's raw handle, and the fork and join events (see :func:`side_stream`).
_SIDE_STREAMS: dict[tuple[int, int], tuple] = {}
#: Entries kept at most (torch's stream pool recycles a few dozen handles per device).
_MAX_SIDE_STREAMS = 64


def side_stream(device: torch.device, stream: int) -> tuple:
    """``(main, side, side_raw, fork, join)`` for running a plan's two stage-1 launches side by side.

    A plan with two tile classes launches one stage-1 kernel per class; they write disjoint
    partial rows and output rows, so the first runs on a side stream forked from the launching
    stream (``fork`` recorded there, waited by the side stream) while the second runs on the
    launching stream, which waits for ``join`` (recorded on the side stream after its launch)
    before the merge. The long, compute-bound class and the short, memory-bound one then share
    the GPU instead of running one after the other (H200, paper suite: 0.68-0.98x of the
    one-stream time on the 11 two-class plans; bit-identical results). Under CUDA-graph capture
    the fork and join become the graph's edges. One side stream per launching stream, so calls
    on different streams do not wait for each other.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, stream)
    entry = _SIDE_STREAMS.get(key)
    if entry is None:
        if len(_SIDE_STREAMS) >= _MAX_SIDE_STREAMS:  # streams made per call would grow it without end
            _SIDE_STREAMS.clear()
        main = torch.cuda.current_stream(index)
        if main.cuda_stream != stream:
            raise RuntimeError("the launching stream is not the current stream")  # callers pass the current one
        side = torch.cuda.Stream(device=torch.device("cuda", index))
        entry = _SIDE_STREAMS[key] = (main, side, side.cuda_stream, torch.cuda.Event(), torch.cuda.Event())
    return entry


def launch_pointers(q, k_cache, v_cache, out) -> tuple[int, int, int, int]:
    """What direct launchers take for ``q, k_cache, v_cache, out``: their device addresses as ints,
    which Triton's launcher passes as they are (a tensor costs a ``data_ptr()`` call and a driver
    check of the address on every launch). The caller has checked that they are CUDA tensors of
    one device."""
    return q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()


def tensor_layout(q, k_cache, v_cache, out, ptrs: tuple | None = None) -> tuple:
    """What compiled launches depend on in ``q, k_cache, v_cache, out`` besides their addresses: the
    dtype, each tensor's 16-byte alignment (Triton specialises on it) and the strides of dims 0 and 1
    (``ptrs``: :func:`launch_pointers` of the four, when the caller has it)."""
    sq, sk, sv, so = q.stride(), k_cache.stride(), v_cache.stride(), out.stride()  # one call per tensor
    if ptrs is None:
        ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
    aq, ak, av, ao = ptrs
    return (
        q.dtype, aq % 16 == 0, ak % 16 == 0, av % 16 == 0, ao % 16 == 0,
        sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], so[0], so[1],
    )  # fmt: skip


def direct_launcher(compiled, grid: tuple[int, int], args: tuple, constexprs: tuple, qk_scale_arg: int | None):
    """A function ``(stream, q, k_cache, v_cache, out, qk_scale)`` calling ``compiled``'s launcher with
    ``args`` in which the per-call values are replaced.

    A stage-1 launch's ``args`` start with ``q, k_cache, v_cache, out`` and hold ``qk_scale`` at
    ``qk_scale_arg``; ``qk_scale_arg=None`` is a merge launch, whose ``args`` start with ``out``
    (the only value that changes). The other tensors (plan arrays, workspace) are fixed: the
    launcher passes their addresses and holds the tensors (``held``) so that the addresses stay
    valid. ``q, k_cache, v_cache, out`` come as :func:`launch_pointers` gives them.
    """
    run, head = _launch_entry(compiled)
    fn = compiled.function
    g0, g1 = grid
    held = args
    args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    if qk_scale_arg is None:
        rest = (*args[1:], *constexprs)

        def merge(stream, q, k_cache, v_cache, out, qk_scale):
            run(g0, g1, 1, stream, fn, *head, out, *rest)

        merge.held = held
        return merge
    mid = args[4:qk_scale_arg]
    tail = (*args[qk_scale_arg + 1 :], *constexprs)

    def stage1(stream, q, k_cache, v_cache, out, qk_scale):
        run(g0, g1, 1, stream, fn, *head, q, k_cache, v_cache, out, *mid, qk_scale, *tail)

    stage1.held = held
    return stage1


def fixed_launcher(compiled, grid: tuple[int, int], args: tuple, constexprs: tuple):
    """A function ``(stream)`` launching ``compiled`` on ``grid`` with ``args``, all fixed: tensors are
    passed by address (the function holds them, ``held``), so a launch skips the argument binding
    and cache lookup of :func:`launch` (for a launch that runs outside CUDA graphs with the same
    arguments every time, such as the runtime's plan relocation)."""
    run, head = _launch_entry(compiled)
    fn = compiled.function
    g0, g1 = grid
    values = (*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), *constexprs)

    def fixed(stream):
        run(g0, g1, 1, stream, fn, *head, *values)

    fixed.held = args
    return fixed


def _triton_version() -> tuple[int, ...]:
    return tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())


def _launch_entry(compiled) -> tuple:
    """``(run, head)``: what to call to launch ``compiled`` and the arguments that go between
    ``(grid_x, grid_y, grid_z, stream, function)`` and the kernel's own.

    On the Triton release of :data:`_C_LAUNCH_TRITON`, the C launch function of Triton's
    ``CudaLauncher`` with the arguments its ``__call__`` adds (the cooperative-grid and PDL
    flags, no scratch buffers), which skips that Python ``__call__`` on every launch; elsewhere
    the launcher itself.
    """
    launcher = compiled.run
    meta = compiled.packed_metadata
    if type(launcher).__name__ == "CudaLauncher" and _triton_version() == _C_LAUNCH_TRITON:
        launch_fn = getattr(launcher, "launch", None)
        scratch = getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
        if callable(launch_fn) and not scratch:
            coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
            return launch_fn, (coop, pdl, None, None, meta, None, None, None)
    return launcher, (meta, None, None, None)


def _arg_spec(arg: object) -> object:
    """What Triton specialises a launch argument on: pointer dtype and 16-byte alignment,
    an int's value 1, divisibility by 16 and width."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31)
    return None


def launch(
    kernel,
    grid: tuple[int, int],
    args: tuple,
    constexprs: tuple,
    num_warps: int,
    num_stages: int,
    maxnreg: int | None = None,
    shrink_stages: bool = False,
):
    """Launch ``kernel[grid](*args, *constexprs)``; returns the compiled kernel (None under the interpreter or hooks).

    The first launch of a specialisation goes through Triton's JIT (compiling if needed);
    later ones call the compiled kernel's launcher directly, skipping Triton's Python
    argument binding. The cache key holds everything Triton specialises on (see
    :func:`_arg_spec`), so a cached kernel is only reused where the JIT would pick the
    same one. ``constexprs`` are the kernel's trailing ``tl.constexpr`` parameters in
    signature order. ``maxnreg`` caps the registers per thread (None: the compiler's choice).
    A kernel of :data:`GDC_KERNELS` whose last constexpr (``GDC_WAIT``) is non-zero is compiled to
    launch with programmatic dependent launch; so are its direct launchers.

    With ``shrink_stages`` (the config's stages are its defaults, ``num_stages=None``) a kernel
    whose pipeline needs more shared memory than the GPU gives a program is compiled with fewer
    stages, each try one stage less (logged once per specialisation): the default stages of
    :meth:`fasttree.FastTreeConfig.launch_stages` fit an H100 or H200 but not every GPU.
    Explicit stages that do not fit raise Triton's ``OutOfResources``.
    """
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    if kernel in GDC_KERNELS and constexprs and constexprs[-1]:  # GDC_WAIT non-zero: launched with PDL
        options["launch_pdl"] = True
    if interpreting() or launch_hooks_active():
        kernel[grid](*args, *constexprs, **options)
        return None
    device = args[0].device.index
    key = (kernel, device, constexprs, num_warps, num_stages, maxnreg, tuple(_arg_spec(x) for x in args))
    compiled = _COMPILED.get(key)
    if compiled is None:
        if shrink_stages:
            compiled = _compile_within_shared_memory(kernel, grid, args, constexprs, options)
        else:
            compiled = kernel[grid](*args, *constexprs, **options)
        _COMPILED[key] = compiled
        return compiled
    stream = current_stream(args[0].device)
    compiled.run(
        grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *constexprs
    )
    return compiled


def _compile_within_shared_memory(kernel, grid, args: tuple, constexprs: tuple, options: dict):
    """``kernel[grid](*args, *constexprs, **options)`` (compiling and launching it), retried with one
    pipeline stage less while the compiler reports too little shared memory; returns the compiled kernel."""
    stages = options["num_stages"]
    while True:
        try:
            compiled = kernel[grid](*args, *constexprs, **{**options, "num_stages": stages})
        except OutOfResources as err:
            if getattr(err, "name", None) != "shared memory" or stages <= 1:
                raise
            stages -= 1
            continue
        if stages != options["num_stages"]:
            logger.warning(
                "%s at %d pipeline stages needs more shared memory than this GPU gives a program: "
                "compiled with %d stages", getattr(kernel, "__name__", kernel), options["num_stages"], stages,
            )  # fmt: skip
        return compiled
