"""``gluon_attn.attention`` and ``gluon_attn.attention_varlen``: validation and dispatch to the Gluon kernel
for the current GPU. Both run through the ``torch.library`` custom ops of ``ops.py`` (so torch.compile
sees one opaque op with a fake implementation, and autograd its backward) wherever anything may watch or
transform the call; a plain eager call on CUDA tensors that needs no gradient calls the op's implementation
directly (``_plain_eager``), as do the benchmark-only options ``config``, ``out`` and ``head_group_size``."""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from . import decode
from .cache import BoundedCache, layout, signature
from .kernels import launch_module
from .kernels.naming import DEFAULT_NAME_CHOICE, resolve_name
from .kernels.tuning import context_bucket
from .problem import dtype_name
from .validation import UnsupportedError, check_qkv, check_varlen

KERNEL_BASE_NAME = "gluon_attention"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """The GPU's compute capability; the first ask also checks the toolchain (``toolchain.prepare_device``)."""
    from .kernels.toolchain import prepare_device

    major, minor = torch.cuda.get_device_capability(index)
    prepare_device(major)
    return major, minor


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: Optional[float] = None, descale_q: Optional[float] = None,
              descale_k: Optional[float] = None, descale_v: Optional[float] = None, return_lse: bool = False,
              out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None, config=None,
              kernel_name: str = DEFAULT_NAME_CHOICE, head_group_size: Optional[int] = None,
              deterministic: Optional[bool] = None):
    """Attention forward ``softmax(q k^T * sm_scale) v`` with a persistent warp-specialized Gluon kernel:
    the sm_90a kernel on Hopper, the sm_100a kernel on Blackwell (compile-verified only: no Blackwell
    GPU was available to this project, it has never run).

    q [Z, H, N_Q, D], k [Z, H_KV, N_KV, D] and v [Z, H_KV, N_KV, Dv] CUDA tensors (views whose last dim is
    contiguous are used without a copy), one dtype of fp16, bf16, float8_e5m2, float8_e4m3fn; D in {32, 64, 96,
    128, 192, 256} on Hopper (32, 96 and 192 run in the D=64, 128 and 256 kernels, padded), {64, 128} on
    Blackwell; Dv = D, or D=192 with Dv=128 on Hopper (DeepSeek-V3's; the output [Z, H, N_Q, Dv]). H_KV divides H
    (GQA; MQA with 1): query head h reads K/V head h // (H / H_KV). Any N_Q, N_KV >= 0; causal is aligned
    bottom-right (query i sees keys <= i + N_KV - N_Q, as FlashAttention and cuDNN do), a row that sees no
    key gives 0 (lse -inf); Z, N_Q or N_KV of 0 give empty (or zero) outputs without a launch. A few queries
    against a long cache (decode; 16-bit on sm_90a) run with the query heads of a K/V head packed into one tile
    and the keys split across programs, combined by their lse (``gluon_attn.decode``).
    fp8: pass per-tensor ``descale_*`` factors (x_real = x * descale); the output is fp16 (or
    ``out_dtype=torch.bfloat16``). ``return_lse`` also returns the natural-log logsumexp [Z, H, N_Q] in
    fp32. ``kernel_name``: "auto" (the default: cutlass_gluon_attention for fp8, gluon_attention
    otherwise), "plain" (gluon_attention), "cutlass" (cutlass_gluon_attention) or a literal symbol. The
    output has q's layout. Differentiable (autograd through the custom op) on sm_90a for fp16/bf16 with each
    of those head dims; other inputs that require grad under grad mode are refused naming what the backward takes.
    ``deterministic``: the backward's dQ bit-identical from run to run (its fp32 adds in a fixed order, at
    0.67-0.87x of the default speed on an H100 in run 114; dK and dV always are); None (the default) follows
    ``torch.use_deterministic_algorithms``. Benchmark options (direct launch, not the custom op, no
    autograd): ``config`` overrides the tuned tile config, ``out`` gives the output tensor,
    ``head_group_size`` how many heads the scheduler walks together (default: the query heads of one K/V
    head; causal: a divisor of the heads).
    """
    # Traced by torch.compile: one opaque op (its implementation validates when it runs).
    compiling = torch.compiler.is_compiling()
    grad = _needs_grad(q, k, v)
    if grad and not compiling:
        _check_backward(q)
    options = config is not None or out is not None or head_group_size is not None
    if grad and not compiling and not options and descale_q is None and descale_k is None and descale_v is None \
            and out_dtype is None and _plain_eager(q, k, v):
        return _eager_attention(q, k, v, (causal, sm_scale, kernel_name, _deterministic(deterministic), return_lse))
    if compiling or (not options and (grad or not _plain_eager(q, k, v))):
        # The backward needs the lse: asked for whenever autograd records the call.
        return _returned(torch.ops.gluon_attn.attention(q, k, v, causal, sm_scale, descale_q, descale_k, descale_v,
                                                         return_lse or grad, out_dtype, kernel_name,
                                                         _deterministic(deterministic)), return_lse)
    if grad:
        raise RuntimeError("gluon attention: the benchmark options config, out and head_group_size launch without "
                           "autograd; inputs that require grad need the default call")
    return forward(q, k, v, causal=causal, sm_scale=sm_scale, descale_q=descale_q, descale_k=descale_k,
                   descale_v=descale_v, return_lse=return_lse, out=out, out_dtype=out_dtype, config=config,
                   kernel_name=kernel_name, head_group_size=head_group_size)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     sm_scale: Optional[float] = None, return_lse: bool = False,
                     kernel_name: str = DEFAULT_NAME_CHOICE, deterministic: Optional[bool] = None):
    """Attention over packed sequences of different lengths, FlashAttention's varlen convention:
    q [total_q, H, D], k and v [total_k, H_KV, D] (fp16 or bf16, D as ``attention``); sequence b's queries
    are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32 offsets [B + 1] from 0, on the GPU), its keys
    likewise; max_seqlen_q / max_seqlen_k bound the lengths (they size the grid). Each cu_seqlens must start at
    0, not decrease and end at its packed length (q.shape[0], k.shape[0]): checked on the host for CPU tensors,
    on the GPU for CUDA ones (``validation.check_offsets``: no wait for the GPU; offsets that break the rule
    raise a device-side assert at the next synchronization; the same offsets tensors as the call before, not written
    since, are not checked again). Causal is aligned bottom-right per sequence.
    Returns out [total_q, H, D] (and the lse [H, total_q] with ``return_lse``).
    The persistent scheduler takes the sequences longest first and hands out work as programs free up.
    Differentiable as ``attention`` (``deterministic`` as there)."""
    grad = _needs_grad(q, k, v)
    if not grad and _plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k):
        return forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                              sm_scale=sm_scale, return_lse=return_lse, kernel_name=kernel_name)
    if grad and not torch.compiler.is_compiling():
        _check_backward(q)
    return _returned(torch.ops.gluon_attn.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                            max_seqlen_k, causal, sm_scale, return_lse or grad,
                                                            kernel_name, _deterministic(deterministic)),
                     return_lse)


_PROFILED_AS_EAGER = False  # (``profiled_as_eager``)


@contextlib.contextmanager
def profiled_as_eager():
    """Calls inside take the plain eager path while torch.profiler records (``_plain_eager``): for a timer that
    profiles the kernels a user's call launches (``bench.timing.kernel_benchmark``), not the op's."""
    global _PROFILED_AS_EAGER
    before, _PROFILED_AS_EAGER = _PROFILED_AS_EAGER, True
    try:
        yield
    finally:
        _PROFILED_AS_EAGER = before


def _plain_eager(*tensors) -> bool:
    """Whether the custom op's dispatch can be skipped and its implementation called directly: a plain eager
    call, where the op would run that implementation and nothing else. Not while torch.compile or torch.jit
    traces or torch.profiler records (its trace keeps the op's name; but inside ``profiled_as_eager``), nor under
    a dispatch or function mode (FakeTensorMode, make_fx, FlopCounterMode, ``with torch.device``), a functorch
    transform (vmap, grad), or for tensor subclasses or tensors off the GPU (meta tensors take the op's fake).
    (The op's dispatch costs ~50 us of host time a call on the H100 machines' hosts, run 189, where a decode
    step's GPU time is ~0.1-0.2 ms.) The caller checks that no gradient is needed; a torch without one of these
    private queries takes the op."""
    for t in tensors:
        if type(t) is not torch.Tensor or not t.is_cuda:
            return False
    try:
        return (not torch.compiler.is_compiling() and torch._C._get_tracing_state() is None
                and (not torch.autograd.profiler._is_profiler_enabled or _PROFILED_AS_EAGER)
                and torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0
                and not torch._C._are_functorch_transforms_active())
    except AttributeError:
        return False


class _EagerAttention(torch.autograd.Function):
    """A plain eager call that autograd records (``_plain_eager``, inputs that require grad): ``forward`` and
    ``backward`` called directly, as the custom op's autograd would call its implementations, without its dispatch
    (~0.8 ms of host time a forward and backward on the H200 machines' hosts, run 219). Everything that traces,
    transforms or watches the call (torch.compile, functorch, dispatch modes, the profiler) takes the op.
    ``options``: (causal, sm_scale, kernel_name, deterministic, return_lse). The lse is an output only where the
    caller asked for it (one output less for the engine to track otherwise); it is saved for the backward either
    way. The backward runs without ``once_differentiable``'s wrapper where grad mode is off (a plain ``.backward``):
    with ``create_graph`` it takes that wrapper, whose outputs refuse a second backward."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        causal, sm_scale, kernel_name, _, return_lse = options
        out, lse = forward(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True, kernel_name=kernel_name)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        if return_lse:
            ctx.set_materialize_grads(False)  # (an unused lse brings no gradient)
            return out, lse
        return out

    @staticmethod
    def backward(ctx, grad_out, grad_lse=None):
        if torch.is_grad_enabled():  # (create_graph: gradients that a second backward must refuse)
            return _once_differentiable_backward(ctx, grad_out, grad_lse)
        return _eager_backward(ctx, grad_out, grad_lse)


def _eager_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    causal, sm_scale, kernel_name, deterministic, _ = ctx.options
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, grad_lse=grad_lse, causal=causal, sm_scale=sm_scale,
                          kernel_name=kernel_name, deterministic=deterministic)
    return dq, dk, dv, None


_once_differentiable_backward = torch.autograd.function.once_differentiable(_eager_backward)
# (``Function.apply``'s C implementation: the Python classmethod around it binds default arguments for functions
# with a ``setup_context`` and unwraps dead functorch wrappers, ~1-3 us a call; the caller checks for wrappers)
_APPLY = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
_APPLY = _APPLY.__get__(None, _EagerAttention) if _APPLY is not None else _EagerAttention.apply
_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def _eager_attention(q, k, v, options):
    """``_EagerAttention`` applied: through its C ``apply`` unless a tensor is a functorch wrapper (one that escaped
    a transform: ``Function.apply`` unwraps it)."""
    if _wrapped is None or _wrapped(q) or _wrapped(k) or _wrapped(v):
        return _EagerAttention.apply(q, k, v, options)
    return _APPLY(q, k, v, options)


def _returned(out_lse, return_lse: bool):
    out, lse = out_lse
    return (out, lse) if return_lse else out


def _deterministic(deterministic: Optional[bool]) -> bool:
    """The backward's deterministic mode: as asked, else as ``torch.use_deterministic_algorithms`` says."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    return bool(deterministic)


def _needs_grad(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


def _check_backward(q: torch.Tensor) -> None:
    """Refuse, before the forward runs, inputs whose backward no kernel takes."""
    index = None
    if q.device.type == "cuda":
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    why = _backward_problems(index, q.shape[-1], q.dtype)
    if why:
        from .kernels.backend import backward_text

        raise UnsupportedError(f"gluon attention backward: inputs require grad but {'; '.join(why)}. The backward "
                               f"runs on {backward_text()}; run the forward under torch.no_grad() or detach the "
                               f"inputs.")


@functools.lru_cache(maxsize=256)
def _backward_problems(index: Optional[int], head_dim: int, dtype: torch.dtype) -> tuple:
    """Why the backward of this GPU (CUDA index; None: meta / CPU tensors, judged by the sm_90a backward's rules,
    the forward refuses CPU ones) cannot take a head dim and dtype (empty when it can); asked at every call that
    autograd records, so kept."""
    from .kernels.backend import BACKENDS, backend_for_capability

    if index is None:
        return tuple(BACKENDS["sm_90a"].backward_problems(head_dim, dtype_name(dtype)))
    major, minor = _capability(index)
    backend = backend_for_capability(major, minor)
    return tuple(backend.backward_problems(head_dim, dtype_name(dtype)) if backend else
                 [f"no kernel for sm_{major}{minor}"])


def _backend(q: torch.Tensor, head_dim: int, head_dim_v: Optional[int] = None):
    from .kernels.backend import backend_for_capability, supported_text

    major, minor = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    backend = backend_for_capability(major, minor)
    if backend is None:
        raise UnsupportedError(f"gluon attention: no kernel for sm_{major}{minor}; supported: {supported_text()}")
    why = backend.head_dim_problem(head_dim, head_dim_v)
    if why:
        raise UnsupportedError(f"gluon attention: {why}")
    return backend


def forward(q, k, v, *, causal=False, sm_scale=None, descale_q=None, descale_k=None, descale_v=None,
            return_lse=False, out=None, out_dtype=None, config=None, kernel_name=DEFAULT_NAME_CHOICE,
            head_group_size=None):
    """Validate and launch (the custom op's implementation; ``attention`` documents the arguments). A call
    signature seen before (shapes, strides, dtypes, devices, options) takes its ``_Route``: everything validated and
    planned once, only the launches left (``_ROUTES``)."""
    routed = config is None and out is None and head_group_size is None
    if routed:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
               v.dtype, v.device, causal, sm_scale, descale_q, descale_k, descale_v, return_lse, out_dtype,
               kernel_name)  # (``_route_key``, written out: every call builds it)
        route = _ROUTES.get(key)
        if route is None and len(_FAMILIES):
            route = _family_route(key, q, k, v, causal)
        if route is not None:
            res = route(q, k, v)
            if res is not None:
                return res
    from .kernels.backend import ANY_BACKEND, all_head_dim_pairs, all_head_dims
    from .kernels.common import resolve_output
    from .kernels.launch import meta_like

    check_qkv(q, k, v, head_dims=all_head_dims(), dtypes=ANY_BACKEND.dtypes, require_cuda=True,
              what="gluon attention", allow_empty=True, head_dim_pairs=all_head_dim_pairs())
    is_fp8 = dtype_name(q.dtype).startswith("fp8")
    if not is_fp8 and any(d is not None for d in (descale_q, descale_k, descale_v)):
        raise ValueError("descale factors apply to fp8 inputs only")
    if head_group_size is not None and (not isinstance(head_group_size, int) or head_group_size < 1):
        raise ValueError(f"head_group_size must be an int >= 1, got {head_group_size!r}")
    Z, H, N_Q, _ = q.shape
    if Z == 0 or N_Q == 0 or k.shape[2] == 0:
        # Nothing to launch: no rows, or rows that see no key (output 0, lse -inf).
        out, _ = resolve_output(q, out, out_dtype, is_fp8, v.shape[3])
        out.zero_()
        lse = torch.full((Z, H, N_Q), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    backend = _backend(q, q.shape[3], v.shape[3])
    symbol = resolve_name(KERNEL_BASE_NAME, kernel_name, is_fp8=is_fp8)
    split = _decode_plan(backend, q, k, v, causal, is_fp8) if routed else None
    if split is not None:
        family = _Family.of(key, backend)
        family.split = (symbol, sm_scale, return_lse, layout(resolve_output(meta_like(q), None, out_dtype, is_fp8)[0]))
        route = family.split_route(split, causal)
        _ROUTES.put(key, route)
        return route(q, k, v)  # (its first call takes the general path, then prepares the route's launches)
    options = dict(causal=causal, sm_scale=sm_scale, descale_q=descale_q or 1.0, descale_k=descale_k or 1.0,
                   descale_v=descale_v or 1.0, return_lse=return_lse, out_dtype=out_dtype, kernel_name=symbol)
    res = backend.launch(q, k, v, out=out, config=config, head_group_size=head_group_size, **options)
    prepare = getattr(backend.module, "prepare", None)
    if routed and prepare is not None:
        prepared = prepare(q, k, v, **options)
        if prepared is not None:
            _ROUTES.put(key, prepared)  # (called as a route: ``_Prepared.__call__(q, k, v)``)
            if not prepared.fp8 and hasattr(prepared, "with_keys"):
                _Family.of(key, backend).ordinary = prepared
    return res


_FAMILIES = BoundedCache(256)


class _Family:
    """What a growing cache's signatures share (``_family_key``): their backend, checks and options, and the
    routes to derive for a new count of keys: ``ordinary``, a prepared launch (``with_keys``), and ``split``, what a
    decode split's ``_Route`` takes beyond its plan (kernel symbol, sm_scale, return_lse, the output's layout), with
    ``prepared``, the prepared splits made so far by their (splits, rows) (``PreparedSplit.with_keys``). A cache
    that grows past the split's threshold holds both."""

    def __init__(self, backend):
        self.backend, self.ordinary, self.split, self.prepared = backend, None, None, {}

    @staticmethod
    def of(key: tuple, backend) -> "_Family":
        fkey = _family_key(key)
        family = _FAMILIES.get(fkey)
        if family is None or family.backend is not backend:
            family = _Family(backend)
            _FAMILIES.put(fkey, family)
        return family

    def split_route(self, split, causal: bool) -> "_Route":
        symbol, sm_scale, return_lse, out_layout = self.split
        return _Route(split=split, launch=functools.partial(self.backend.launch, kernel_name=symbol), causal=causal,
                      sm_scale=sm_scale, return_lse=return_lse, out_layout=out_layout,
                      prepare=getattr(self.backend.module, "prepare", None), symbol=symbol)


def _family_key(key: tuple) -> tuple:
    """A route key less what a growing cache changes from call to call: the keys' count in k's and v's shapes and the
    outer strides it moves, with the length's tuning class (the config's) in its place."""
    qs, qst, qd, qdev, ks, kst, kd, kdev, vs, vst, vd, vdev, *options = key
    return (qs, qst, qd, qdev, ks[:2], ks[3], kst[2:], kd, kdev, vs[:2], vs[3], vst[2:], vd, vdev,
            context_bucket(max(qs[2], ks[2])), *options)


def _family_route(key: tuple, q, k, v, causal: bool):
    """A decode step's route, derived from a signature that differs only in the keys' count (and the outer strides it
    moves; the tuning class the same): a model's cache grows by a key at every step, and a step must not pay the
    checks again. This count's plan decides the route: the ordinary launch (the family's prepared launch for this
    count, ``with_keys``) or the decode split (a ``_Route`` for this count's split, its launches prepared at once
    where the kernels it launches are compiled). None where the family has no route of that kind yet or this count
    runs otherwise (no keys, v's count not k's, a layout TMA cannot take)."""
    family = _FAMILIES.get(_family_key(key))
    if family is None:
        return None
    n_kv = k.shape[2]
    tma_strides = launch_module().tma_strides
    if n_kv == 0 or v.shape[2] != n_kv or not (tma_strides(k) and tma_strides(v)):
        return None
    split = _decode_plan(family.backend, q, k, v, causal, False)
    if split is None:
        if family.ordinary is None:
            return None
        route = family.ordinary.with_keys(k, v)
    else:
        if family.split is None:
            return None
        route = family.split_route(split, causal)
        made = family.prepared.get((split.splits, split.rows))
        route.fast = made and made.with_keys(k, v, split)
        if route.fast is not None:
            route.prepare = None  # (derived: nothing to make)
        else:
            route.prepare_now(q, k, v)
            if route.fast is not None:
                if len(family.prepared) >= 16:
                    family.prepared.clear()
                family.prepared[(split.splits, split.rows)] = route.fast
    _ROUTES.put(key, route)
    return route


def _route_key(q, k, v, *options) -> tuple:
    """What a route is made for: every tensor's shape, strides, dtype and device, and the options (as ``forward``
    builds it)."""
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
            v.dtype, v.device, *options)


class _Route:
    """A validated call signature's decode split: the plan with the output's layout, and its prepared launches
    (``decode.PreparedSplit``) where they could be made. (Other signatures' routes are the backend's prepared launch,
    ``hopper_host.prepare``.) A route returns None where the prepared launch cannot take the tensors (an address TMA
    cannot take, a profiler hook): the caller then takes the general path, checks included."""

    def __init__(self, split=None, launch=None, causal=False, sm_scale=None, return_lse=False, out_layout=None,
                 prepare=None, symbol=None):
        self.split, self.launch, self.fast = split, launch, None
        self.causal, self.sm_scale, self.return_lse, self.out_layout = causal, sm_scale, return_lse, out_layout
        self.prepare, self.symbol = prepare, symbol  # (the backend's ``prepare``: None once tried after a call)

    def prepare_now(self, q, k, v) -> None:
        """Prepare the launches before any call where every kernel they launch is compiled (a new count of keys of
        a growing cache: no general path first); otherwise the first call's general path compiles them and then
        prepares (``__call__``)."""
        if self.prepare is not None:
            self.fast = self._made(q, k, v)

    def _made(self, q, k, v):
        shape, strides, dtype = self.out_layout
        return decode.PreparedSplit.make(self.prepare, q, k, v, self.split, causal=self.causal,
                                         sm_scale=self.sm_scale, return_lse=self.return_lse,
                                         out=torch.empty_strided(shape, strides, dtype=dtype, device="meta"),
                                         kernel_name=self.symbol)

    def __call__(self, q, k, v):
        if self.fast is not None:
            res = self.fast(q, k, v)
            if res is not None:
                return res
        shape, strides, dtype = self.out_layout
        out = torch.empty_strided(shape, strides, dtype=dtype, device=q.device)
        res = decode.run(self.launch, q, k, v, self.split, causal=self.causal, sm_scale=self.sm_scale,
                         return_lse=self.return_lse, out=out)
        if self.fast is None and self.prepare is not None:  # (once: the general path has compiled the kernels)
            self.fast = self._made(q, k, v)
            self.prepare = None
        return res


class _VarlenRoute:
    """A validated ``attention_varlen`` call signature: the output's layout, the prepared launch by address, and one
    launch before it that builds the table of this call's offsets and checks their values (``schedule``'s
    ``checked_table_launcher``: the same rule as the checked path, raised by ``torch._assert_async`` with the same
    message). A model's layers pass the same offsets tensors call after call: while they are the tensors of the call
    before, unchanged (``cache.Unchanged``: same objects, addresses and versions), that call's table and check serve
    and only the attention launches (offsets rewritten through their raw address, bypassing torch, are not seen)."""

    def __init__(self, prepared, out: torch.Tensor, cu_seqlens_q, cu_seqlens_k, total_k: int):
        from .cache import Unchanged
        from .kernels.launch import aligned_offsets, device_index
        from .kernels.schedule import checked_table_launcher
        from .validation import offsets_assert_message

        self.prepared = prepared
        self.out_layout = layout(out)
        self.lse_shape = (1, out.shape[1], out.shape[0])
        self.index = device_index(out.device)
        self.total = (out.shape[0], total_k)
        p = prepared
        self.table = checked_table_launcher(cu_seqlens_q, cu_seqlens_k, p.heads, p.plan.consts["BLOCK_M"], p.causal,
                                            p.plan.dynamic)
        n_seqs = cu_seqlens_q.shape[0] - 1
        words = 4 * n_seqs + 3 + p.plan.dynamic
        (_, flags_at), nbytes = aligned_offsets((4 * words, 8))  # (the table, then the two flags)
        self.words, self.flags_word = nbytes // 4, flags_at // 4
        what = "gluon attention_varlen"
        self.messages = [offsets_assert_message(what, "cu_seqlens_q", self.total[0])]
        if cu_seqlens_k is not cu_seqlens_q or self.total[1] != self.total[0]:  # (one tensor for both: checked once)
            self.messages.append(offsets_assert_message(what, "cu_seqlens_k", total_k))
        self.seen, self.seen_table = Unchanged(), None  # (the last call's offsets, and its table with its stream)

    def _table(self, stream: int, cu_seqlens_q, cu_seqlens_k) -> torch.Tensor:
        held = self.seen_table
        if held is not None and held[0] == stream and self.seen.holds(cu_seqlens_q, cu_seqlens_k):
            return held[1]
        words = torch.empty(self.words, dtype=torch.int32, device=cu_seqlens_q.device)
        t = words.data_ptr()
        self.table(stream, cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), t, t + 4 * self.flags_word, *self.total)
        for i, message in enumerate(self.messages):
            torch._assert_async(words[self.flags_word + i], message)
        self.seen.remember(cu_seqlens_q, cu_seqlens_k)
        self.seen_table = (stream, words)
        return words

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        launch = launch_module()
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (qp | kp | vp) & 15 or self.table is None or launch.hooks_active() or \
                torch._C._cuda_isCurrentStreamCapturing():
            return None  # (a CUDA graph's capture: the checked path, its memory its own)
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        t = self._table(stream, cu_seqlens_q, cu_seqlens_k).data_ptr()
        shape, strides, dtype = self.out_layout
        out = torch.empty_strided(shape, strides, dtype=dtype, device=q.device)
        p = self.prepared
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if p.return_lse else None
        sched = launch.zeroed_counter(self.index, stream) if p.plan.dynamic else p.unused
        op = out.data_ptr()
        if not p.run_ptrs(stream, (qp, kp, vp, op), op, p.unused_f32 if lse is None else lse.data_ptr(), table=t,
                          sched=sched):
            return None
        return (out, lse[0]) if p.return_lse else out


_ROUTES = BoundedCache(1024)


def _decode_plan(backend, q, k, v, causal: bool, is_fp8: bool):
    """A few queries against many keys on the sm_90a kernel (16-bit): the query heads of a K/V head packed into
    one tile and the keys split across programs (``decode.plan``), or None for the ordinary launch."""
    if is_fp8 or backend.arch != "sm_90a":
        return None
    Z, H, N_Q, D = q.shape
    if D not in backend.module.KERNEL_HEAD_DIMS:  # (a padded head dim: the combine takes whole rows of D)
        return None
    H_KV, N_KV = k.shape[1], k.shape[2]
    # (Cheap exits before the config lookup: more packed rows than the largest tile's 192, or few keys.)
    if H // H_KV * N_Q > 192 or N_KV < decode.MIN_KEYS:
        return None
    block_m = backend.default_config(D, dtype_name(q.dtype), False, N_KV).BLOCK_M
    # (absorb: the chunks' launch combines its parts and takes the tail in its last chunk where its tiles combine,
    # head dim 128 in 128-row tiles: ``hopper_host.combines``; elsewhere an absorbed tail runs as a launch)
    return decode.plan(Z, H, H_KV, N_Q, N_KV, causal, block_m, launch_module().sm_count(q.device),
                       decode.mergeable(k) and decode.mergeable(v), head_dim=D, absorb=D == 128 and block_m == 128)


def backward(do, q, k, v, out, lse, *, grad_lse=None, causal=False, sm_scale=None, kernel_name=DEFAULT_NAME_CHOICE,
             config=None, deterministic=False):
    """dq, dk, dv of ``attention`` from the forward's output and lse [Z, H, N_Q] (the backward custom op's
    implementation; the benchmark calls it directly). Shapes as ``attention``; returns tensors laid out as
    q, k and v; ``deterministic``: dQ's adds in a fixed order."""
    key = _bwd_route_key(do, q, k, v, out, lse, grad_lse, causal, sm_scale, kernel_name, deterministic) \
        if config is None else None
    if key is not None:
        route = _BWD_ROUTES.get(key)
        if route is not None:
            res = route(do, q, k, v, out, lse, grad_lse)
            if res is not None:
                return res
    from .kernels.backend import all_head_dim_pairs, all_head_dims

    check_qkv(q, k, v, head_dims=all_head_dims(), dtypes=("fp16", "bf16", "fp8e5", "fp8e4m3"), require_cuda=True,
              what="gluon attention backward", allow_empty=True, head_dim_pairs=all_head_dim_pairs())
    _check_grad_inputs(do, out, lse, (*q.shape[:3], v.shape[3]), (q.shape[0], q.shape[1], q.shape[2]))
    Z, H, N_Q, D = q.shape
    if Z == 0 or N_Q == 0 or k.shape[2] == 0 or H == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    backend = _backend(q, D, v.shape[3])
    why = backend.backward_problems(D, dtype_name(q.dtype), v.shape[3])
    if why:
        raise UnsupportedError(f"gluon attention backward: {'; '.join(why)}")
    symbol = resolve_name(KERNEL_BASE_NAME + "_bwd", kernel_name)
    res = backend.bwd.launch(do, q, k, v, out, lse, causal=causal, sm_scale=sm_scale, grad_lse=grad_lse,
                             kernel_name=symbol, config=config, deterministic=bool(deterministic))
    prepare = getattr(backend.bwd, "prepare", None)
    if key is not None and prepare is not None:
        prepared = prepare(do, q, k, v, out, lse, grad_lse, causal=causal, sm_scale=sm_scale, kernel_name=symbol,
                           deterministic=bool(deterministic))
        if prepared is not None:
            _BWD_ROUTES.put(key, prepared)
    return res


_BWD_ROUTES = BoundedCache(256)


def _bwd_route_key(do, q, k, v, out, lse, grad_lse, *options) -> Optional[tuple]:
    """What a backward route is made for: every tensor's shape, strides, dtype and device (the lse's incoming gradient
    or its absence included) and the options; None for arguments that are not plain tensors (the checked path)."""
    tensors = (do, q, k, v, out, lse) if grad_lse is None else (do, q, k, v, out, lse, grad_lse)
    if not all(type(t) is torch.Tensor for t in tensors):
        return None
    return (*signature(*tensors), grad_lse is None, *options)


def backward_varlen(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, grad_lse=None,
                    causal=False, sm_scale=None, kernel_name=DEFAULT_NAME_CHOICE, config=None, deterministic=False):
    """dq, dk, dv of ``attention_varlen`` (packed [total, H, D] tensors, lse [H, total_q])."""
    from .kernels.backend import VARLEN_DTYPES, all_head_dim_pairs, all_head_dims
    from .kernels.schedule import Packed

    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dims=all_head_dims(),
                 dtypes=VARLEN_DTYPES, what="gluon attention_varlen backward", head_dim_pairs=all_head_dim_pairs())
    _check_grad_inputs(do, out, lse, (*q.shape[:2], v.shape[2]), (q.shape[1], q.shape[0]))
    total_q, H, D = q.shape
    if total_q == 0 or cu_seqlens_q.shape[0] <= 1 or max_seqlen_q == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    backend = _backend(q, D, v.shape[2])
    why = backend.backward_problems(D, dtype_name(q.dtype), v.shape[2])
    if why:
        raise UnsupportedError(f"gluon attention_varlen backward: {'; '.join(why)}")
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731  ([total, H, D] -> [1, H, total, D])
    packed = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    glse = None if grad_lse is None else grad_lse.unsqueeze(0)
    dq, dk, dv = backend.bwd.launch(view(do), view(q), view(k), view(v), view(out), lse.unsqueeze(0), causal=causal,
                                    sm_scale=sm_scale, grad_lse=glse,
                                    kernel_name=resolve_name(KERNEL_BASE_NAME + "_bwd", kernel_name), config=config,
                                    varlen=packed, deterministic=bool(deterministic))
    unview = lambda t: t[0].transpose(0, 1)  # noqa: E731
    return unview(dq), unview(dk), unview(dv)


def _check_grad_inputs(do, out, lse, out_shape, lse_shape) -> None:
    if tuple(do.shape) != tuple(out_shape) or tuple(out.shape) != tuple(out_shape):
        raise ValueError(f"grad_out and out must have the output's shape {tuple(out_shape)}; got "
                         f"{tuple(do.shape)} and {tuple(out.shape)}")
    if tuple(lse.shape) != tuple(lse_shape) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 {tuple(lse_shape)}; got {lse.dtype} {tuple(lse.shape)}")
    if do.dtype != out.dtype:
        raise ValueError(f"grad_out dtype {do.dtype} differs from the output's {out.dtype}")


def _varlen_route_key(q, k, v, cu_seqlens_q, cu_seqlens_k, *options) -> tuple:
    """What a packed call's route is made for (``forward_varlen``): every tensor's shape, strides, dtype and device,
    the options, and whether one offsets tensor serves both sides."""
    return (*signature(q, k, v, cu_seqlens_q, cu_seqlens_k), *options, cu_seqlens_q is cu_seqlens_k)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, sm_scale=None,
                   return_lse=False, kernel_name=DEFAULT_NAME_CHOICE, config=None):
    """Validate and launch packed sequences (the custom op's implementation; see ``attention_varlen``); a call
    signature seen before takes its ``_VarlenRoute`` (the offsets' values checked again unless they are the same
    tensors as the call before, unchanged)."""
    from .kernels.backend import VARLEN_DTYPES, all_head_dim_pairs, all_head_dims
    from .kernels.schedule import Packed

    key = None
    if config is None and all(type(t) is torch.Tensor for t in (cu_seqlens_q, cu_seqlens_k)):
        key = _varlen_route_key(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, sm_scale, return_lse, kernel_name,
                                max_seqlen_q, max_seqlen_k)
        route = _ROUTES.get(key)
        res = None if route is None else route(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if res is not None:
            return res
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dims=all_head_dims(),
                 dtypes=VARLEN_DTYPES, what="gluon attention_varlen", head_dim_pairs=all_head_dim_pairs())
    total_q, H, _ = q.shape
    n_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or n_seqs == 0 or max_seqlen_q == 0 or k.shape[0] == 0:
        out = torch.zeros(total_q, H, v.shape[2], dtype=q.dtype, device=q.device)
        lse = torch.full((H, total_q), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    backend = _backend(q, q.shape[2], v.shape[2])
    # [total, H, D] -> [1, H, total, D] views: the kernels' 4-D descriptors with the packed row stride.
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    out = torch.empty(total_q, H, v.shape[2], dtype=q.dtype, device=q.device)
    packed = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    symbol = resolve_name(KERNEL_BASE_NAME, kernel_name)
    result = backend.launch(view(q), view(k), view(v), causal=causal, sm_scale=sm_scale, return_lse=return_lse,
                            out=view(out), kernel_name=symbol, config=config, varlen=packed)
    prepare = getattr(backend.module, "prepare", None)
    if key is not None and prepare is not None and cu_seqlens_q.is_cuda and cu_seqlens_k.is_cuda:
        prepared = prepare(view(q), view(k), view(v), causal=causal, sm_scale=sm_scale, return_lse=return_lse,
                           out=view(out), kernel_name=symbol, varlen=packed)
        if prepared is not None and not prepared.fp8 and all(
                c.dtype == torch.int32 and c.stride(0) == 1 for c in (cu_seqlens_q, cu_seqlens_k)):
            _ROUTES.put(key, _VarlenRoute(prepared, out, cu_seqlens_q, cu_seqlens_k, k.shape[0]))
    if return_lse:
        return out, result[1][0]
    return out
