"""Host-side launch path shared by both attention kernels.

Small problems finish on the GPU in tens of microseconds, so per-call Python matters. The first call
of a specialization goes through the JIT (which compiles and caches it); later calls go straight to
the compiled kernel's C launcher with TMA descriptors that were encoded once per (address, shape,
strides) and cached, instead of being validated, built and encoded again on every call.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple, Optional

import torch
from triton import knobs
from triton.experimental.gluon.language import NVMMASharedLayout
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..cache import shallow_copy
from .common import gl_dtype
from .toolchain import COMPILE_OPTIONS, prepare_device

_SMEM_LAYOUTS: dict = {}
LOG2E = 1.4426950408889634


def tma_aligned(t: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and other strides: views such as
    ``x.view(Z, N, H, D).transpose(1, 2)`` qualify."""
    return t.data_ptr() % 16 == 0 and tma_strides(t)


def tma_strides(t: torch.Tensor) -> bool:
    """``tma_aligned``'s conditions on the strides alone (a signature's: the address is each call's)."""
    e = t.element_size()
    return t.stride(-1) == 1 and all((st * e) % 16 == 0 for st in t.stride()[:-1])


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where TMA can address it (``tma_aligned``), else a contiguous copy (a new allocation: a
    contiguous tensor at an address that is not 16-byte aligned needs one too)."""
    return t if tma_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, strides and dtype (``t.to("meta")`` makes strided views contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class DescArg(NamedTuple):
    """A TMA descriptor argument: a TMA-ready tensor (``tma_ready``), the block each load moves, and
    the global shape and strides (the tensor's own unless a padded view says otherwise). ``cga_layout``: how
    the CTAs of a cluster share the block (the shared layout's ``cga_layout`` bases; () for one CTA)."""
    base: torch.Tensor
    block_shape: list
    shape: list
    strides: list
    cga_layout: tuple = ()

    @staticmethod
    def of(t: torch.Tensor, block, shape=None, strides=None) -> "DescArg":
        return DescArg(t, block, list(shape or t.shape), list(strides or t.stride()))

    def descriptor(self) -> TensorDescriptor:
        """The JIT's descriptor object, filled in directly: ``tma_ready`` already checked what
        TensorDescriptor's own validation checks."""
        key = (tuple(self.block_shape), self.base.dtype, self.cga_layout)
        layout = _SMEM_LAYOUTS.get(key)
        if layout is None:
            layout = _SMEM_LAYOUTS[key] = NVMMASharedLayout.get_default_for(
                list(self.block_shape), gl_dtype(self.base.dtype),
                cga_layout=[list(b) for b in self.cga_layout] or None)
        desc = TensorDescriptor.__new__(TensorDescriptor)
        desc.base, desc.shape, desc.strides = self.base, self.shape, self.strides
        desc.block_shape, desc.layout, desc.padding = list(self.block_shape), layout, "zero"
        return desc


_SM_COUNT: dict = {}
_PLACEHOLDERS: dict = {}


@functools.lru_cache(maxsize=None)
def config_problems(cfg, head_dim: int, dtype: str) -> tuple:
    """A (frozen) config's ``invalid_reasons`` for a problem class, cached: checked on every launch."""
    return tuple(cfg.invalid_reasons(head_dim, dtype))


def checked_config(kind: str, config, default_config, head_dim: int, dtype: str, causal: bool, n_ctx: int):
    """The config a launch uses: the one given, else the problem class's default; refused, with the
    kernel's own reasons, when it cannot run the class."""
    cfg = config or default_config(head_dim, dtype, causal, n_ctx)
    bad = config_problems(cfg, head_dim, dtype)
    if bad:
        raise ValueError(f"{kind} config {cfg.label()} is invalid for D={head_dim} {dtype}: {'; '.join(bad)}")
    return cfg


def softmax_args(q: torch.Tensor, sm_scale: Optional[float], descale_q: float, descale_k: float,
                 return_lse: bool) -> tuple[float, Optional[torch.Tensor], torch.Tensor]:
    """(qk_scale: sm_scale, 1/sqrt(D) by default, in log2 units with q's and k's descales folded in;
    the logsumexp output [Z, H, N] or None; the kernel's lse pointer argument)."""
    Z, H, N, D = q.shape
    qk_scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * LOG2E * descale_q * descale_k
    lse = torch.empty((Z, H, N), dtype=torch.float32, device=q.device) if return_lse else None
    return qk_scale, lse, lse if lse is not None else placeholder(q.device, torch.float32)


def device_index(device: torch.device) -> int:
    """The CUDA index of ``device`` (the current device's where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device) -> int:
    """The device's SM count (the persistent grid). Every launch path asks first, so the first ask of a
    device also checks the toolchain and picks its ptxas (``toolchain.prepare_device``)."""
    idx = device.index if isinstance(device, torch.device) else torch.device(device).index
    if idx is None:
        idx = torch.cuda.current_device()
    if idx not in _SM_COUNT:
        props = torch.cuda.get_device_properties(idx)
        prepare_device(props.major)
        _SM_COUNT[idx] = props.multi_processor_count
    return _SM_COUNT[idx]


def placeholder(device, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's pointer argument when what it points to is not used (the lse without ``return_lse``,
    the scheduler's counter of a static schedule): never read or written."""
    t = _PLACEHOLDERS.get((device, dtype))
    if t is None:
        t = _PLACEHOLDERS[(device, dtype)] = torch.empty(16, dtype=dtype, device=device)
    return t


# ---------------------------------------------------------------------------------------------
# Per-stream memory for prepared calls: what a call's own kernels write and read, and nothing outlives
# ---------------------------------------------------------------------------------------------
_SCRATCH: dict = {}
_COUNTERS: dict = {}
_MAX_STREAMS = 64  # (device, stream, thread) keys kept before all are dropped (a thread that ended keeps none)
COUNTER_RING = 4096  # zeroed counters per ring: one memset serves this many launches


def _capturing() -> bool:
    return torch._C._cuda_isCurrentStreamCapturing()


def scratch(index: int, stream: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> Optional[torch.Tensor]:
    """``nbytes`` (or more) of device memory for one call's kernels, on ``stream`` from this thread, as a 1-D tensor of
    ``dtype``: the same memory for every such call, which is safe because a stream runs a call's kernels before the
    next call's (a thread's calls are issued in order; another thread gets its own). None while the stream captures a
    CUDA graph (a graph replays its addresses later, so it keeps memory of its own: the caller allocates)."""
    if _capturing():
        return None
    key = (index, stream, threading.get_ident())
    views = _SCRATCH.get(key)
    if views is None or views[torch.uint8].numel() < nbytes:
        if len(_SCRATCH) >= _MAX_STREAMS:
            _SCRATCH.clear()
        # (the caching allocator keeps the old block for this stream until its queued kernels are done)
        size = -(-max(nbytes, 2 * views[torch.uint8].numel() if views is not None else 0, 1 << 16) // 16) * 16
        views = _SCRATCH[key] = {torch.uint8: torch.empty(size, dtype=torch.uint8,
                                                          device=torch.device("cuda", index))}
    view = views.get(dtype)
    if view is None:
        view = views[dtype] = views[torch.uint8].view(dtype)
    return view


def zeroed_counter(index: int, stream: int, n: int = 1):
    """``n`` int32 zeros that one launch may count up (a dynamic schedule's unit counter; decode's arrivals, a counter
    per K/V head), in place of a ``torch.zeros(n)`` per launch: the address of the next ``n`` of a ring of
    ``COUNTER_RING`` zeros (or ``n``, if more) per (device, stream, thread), zeroed again on that stream once its
    counters are handed out (after the launches that used them, in stream order). While the stream captures a CUDA
    graph, a ``torch.zeros(n)`` of its own (as ``scratch``)."""
    if _capturing():
        return torch.zeros(n, dtype=torch.int32, device=torch.device("cuda", index))
    key = (index, stream, threading.get_ident())
    ring = _COUNTERS.get(key)
    if ring is None or ring[0].numel() < n:
        if len(_COUNTERS) >= _MAX_STREAMS:
            _COUNTERS.clear()
        # (a larger ring replaces a smaller one: the caching allocator keeps the old block until its launches are done)
        ring = _COUNTERS[key] = [torch.zeros(max(COUNTER_RING, n), dtype=torch.int32,
                                             device=torch.device("cuda", index)), 0]
    buf, used = ring
    if used + n > buf.numel():
        buf.zero_()
        used = 0
    ring[1] = used + n
    return buf.data_ptr() + 4 * used


def aligned_offsets(sizes, align: int = 128) -> tuple[list, int]:
    """Where parts of ``sizes`` bytes lie one after another in one buffer, each at a multiple of ``align`` bytes: (the
    offsets, the bytes in all)."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // align) * align
    return offsets, at


def direct_launcher(kernel_fn, args: tuple, consts: dict, grid, num_warps: int) -> Optional["_DirectLaunch"]:
    """The direct launch of ``kernel_fn`` compiled for arguments like ``args`` (a prepared call's own: the JIT
    specializes on them, ``warmup`` compiles or finds that build without launching it); None where the build needs
    the JIT's own launcher."""
    kernel = kernel_fn.warmup(*args, **consts, num_warps=num_warps, grid=grid if type(grid) is tuple else (grid,),
                              **COMPILE_OPTIONS)
    direct = _DirectLaunch(kernel)
    return direct if direct.usable else None


class _DirectLaunch:
    """A compiled kernel's C launch with a cache of encoded TMA descriptors.

    Triton 3.9 launches every kernel through one generic C launcher (``driver.utils.launch``) that reads the
    arguments by the kernel's flattened signature (``CudaLauncher.arg_annotations``, ``kernel_signature``); the
    JIT's own path first expands each descriptor argument with ``make_tensordesc_arg`` (a
    ``cuTensorMapEncodeTiled`` call) into (tensor map, shape..., strides...) on every launch. Here that expansion
    is cached per (argument, address, shape, strides): an encoded tensor map depends on nothing else (the block,
    swizzle and dtype are fixed by the binary), so a hit is exact even when the caching allocator hands the
    address to another tensor. The C launch takes the runtime arguments in signature order followed by the
    constexprs (it skips those by their annotation), as the JIT passes them. Built only when the kernel needs no
    scratch memory or sanitizer state; otherwise ``usable`` is False and the caller keeps the JIT's launcher."""
    MAX_ENTRIES = 1024

    def __init__(self, kernel):
        self.kernel = kernel
        self.usable = False
        try:
            import triton
            from triton.backends.nvidia.driver import make_tensordesc_arg
            run = kernel.run
            self.c_launch = triton.runtime.driver.active.utils.launch
            self.annotations, self.signature = run.arg_annotations, run.kernel_signature
            self.coop, self.pdl = run.launch_cooperative_grid, run.launch_pdl
            scratch = run.global_scratch_size or run.profile_scratch_size or getattr(run, "gsan_enabled", False)
        except (AttributeError, ImportError):
            return
        self.meta = list(getattr(kernel.metadata, "tensordesc_meta", None) or [])
        self.plain = not self.meta  # (no descriptor arguments: the arguments go as given)
        self.encode = make_tensordesc_arg
        self.usable = not scratch and all(m is not None for m in self.meta)
        self.cache: dict = {}

    def expand(self, args: tuple) -> list:
        out = []
        d = 0
        for a in args:
            if type(a) is DescArg:
                key = (d, a.base.data_ptr(), *a.shape, *a.strides)
                enc = self.cache.get(key)
                if enc is None:
                    if len(self.cache) >= self.MAX_ENTRIES:
                        self.cache.clear()
                    enc = self.cache[key] = self.encode(a.descriptor(), self.meta[d], None)
                out.extend(enc)
                d += 1
            else:
                out.append(a)
        return out

    def __call__(self, grid, stream: int, args: tuple, consts: dict) -> None:
        """``grid``: programs, or (x, y) programs."""
        k = self.kernel
        gx, gy = (grid, 1) if type(grid) is int else grid
        self.c_launch(gx, gy, 1, stream, k.function, self.coop, self.pdl, k.packed_metadata, None, None, None, None,
                      None, self.annotations, self.signature,
                      (*(args if self.plain else self.expand(args)), *consts.values()))


_COMPILED: dict = {}


def compiled(kernel_fn, key: tuple, device, num_ctas: int = 1) -> Optional["_DirectLaunch"]:
    """The direct launcher ``launch_cached`` made for a specialization (None before its first launch)."""
    return _COMPILED.get((device_index(device), num_ctas, key))


class FixedLaunch:
    """One kernel launch of a call signature whose descriptors' blocks, shapes and strides, grid and constexprs are
    all fixed (``hopper_host.prepare``): per call only the tensors' addresses and the runtime scalars change. A
    descriptor is encoded once per (argument, address) (``cuTensorMapEncodeTiled`` on the fixed shape and strides),
    the rest goes to the C launcher as ``_DirectLaunch`` passes it. ``descs``: per descriptor argument (block, shape,
    strides). Each descriptor has its cache of encodings by address, which a launch of other shapes for some
    descriptors shares for the others (``with_shapes``)."""
    MAX_ENTRIES = 256  # (per descriptor)

    def __init__(self, direct: "_DirectLaunch", grid: int, descs: list, consts: dict):
        import triton
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

        self.direct, self.grid, self.consts = direct, grid, tuple(consts.values())
        self.fill = triton.runtime.driver.active.utils.fill_tma_descriptor_tiled
        self.specs = []
        for (block, shape, strides), meta in zip(descs, direct.meta):
            assert not meta.get("fp4_padded") and not meta.get("is_im2col"), "plain tiled descriptors only"
            self.specs.append((meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                               list(meta["block_size"]), list(shape), list(strides)))
        self.caches = [{} for _ in self.specs]

    def with_shapes(self, changes: dict) -> "FixedLaunch":
        """This launch with descriptors ``d`` of ``changes`` {d: (shape, strides)} of other shapes and strides (a
        growing cache's keys): their encodings are made anew, the others' shared with this launch."""
        other = shallow_copy(self)
        other.specs, other.caches = list(self.specs), list(self.caches)
        for d, (shape, strides) in changes.items():
            other.specs[d] = (*self.specs[d][:4], list(shape), list(strides))
            other.caches[d] = {}
        return other

    def encoded(self, d: int, ptr: int) -> list:
        cache = self.caches[d]
        enc = cache.get(ptr)
        if enc is None:
            if len(cache) >= self.MAX_ENTRIES:
                cache.clear()
            swizzle, elem, dtype, block, shape, strides = self.specs[d]
            enc = cache[ptr] = [self.fill(ptr, swizzle, elem, dtype, block, shape, strides, 0), *shape, *strides]
        return enc

    def __call__(self, stream: int, ptrs: tuple, args: tuple) -> None:
        flat = []
        caches = self.caches
        for d, ptr in enumerate(ptrs):
            enc = caches[d].get(ptr)
            flat.extend(enc if enc is not None else self.encoded(d, ptr))
        k = self.direct
        kernel = k.kernel
        k.c_launch(self.grid, 1, 1, stream, kernel.function, k.coop, k.pdl, kernel.packed_metadata, None, None, None,
                   None, None, k.annotations, k.signature, (*flat, *args, *self.consts))


def hooks_active() -> bool:
    """Whether a profiler hook wants each launch's metadata (then every launch takes the JIT's own path)."""
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


def launch_cached(kernel_fn, num_warps: int, grid: int, args: tuple, consts: dict, device, signature: tuple = (),
                  key: Optional[tuple] = None, num_ctas: int = 1, options: Optional[dict] = None) -> None:
    """Launch through the JIT once per specialization, then straight through the compiled kernel's
    launcher (``_DirectLaunch``). The key is what the JIT would specialize on: ``signature`` (input
    and output dtypes, head dim, hence every descriptor's block and layout) and the constexprs, kernel
    name included, so each name runs its own binary. Kernels launched this way must not
    value-specialize their integer arguments (``do_not_specialize``), and must annotate ``tl.int64`` those that
    can reach 2^31 (strides of large tensors): the key holds no integer widths, and the JIT types a small value's
    argument 32-bit. ``args`` holds ``DescArg`` for descriptor arguments. ``key``, when given, stands for
    ``(kernel_fn, *signature, *consts.values())`` (callers that cache it save building it on every call).
    ``num_ctas``: CTAs per cluster (a compile option: part of the key); ``grid`` counts clusters. ``options``: more
    compile options, which the constexprs in the key must determine."""
    index = device_index(device)
    key = (index, num_ctas, key or (kernel_fn, *signature, *consts.values()))
    direct = _COMPILED.get(key)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if direct is None or enter.calls or leave.calls:
        # First launch, or a profiler hook wants launch metadata: the JIT's own path.
        jit_args = [a.descriptor() if type(a) is DescArg else a for a in args]
        kernel = kernel_fn[(grid,)](*jit_args, **consts, num_warps=num_warps, num_ctas=num_ctas, **COMPILE_OPTIONS,
                                    **(options or {}))
        if direct is None:
            _COMPILED[key] = _DirectLaunch(kernel)
        return
    stream = torch._C._cuda_getCurrentRawStream(index)  # what Triton's own launch path asks for
    if direct.usable:
        direct(grid, stream, args, consts)
        return
    k = direct.kernel
    jit_args = [a.descriptor() if type(a) is DescArg else a for a in args]
    k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, enter, leave, *jit_args, *consts.values())
