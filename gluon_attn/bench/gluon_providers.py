"""Registers the project's Gluon attention kernels as benchmark providers."""
from __future__ import annotations

import dataclasses
import functools

from ..kernels.backend import ANY_BACKEND, BACKENDS, VARLEN_DTYPES, backend_for_capability, head_dims_text
from ..kernels.naming import DEFAULT_NAME_CHOICE, resolve_name
from ..problem import Inputs, Problem
from .provider import Call, Provider, register


def attention_runner(attention, attention_varlen=None):
    """A provider runner calling ``attention`` (gluon_attn.attention, or a build of it from another
    commit) on prepared inputs: causal as the problem says, fp8 with its descales; packed problems go to
    ``attention_varlen``."""
    def runner(inputs: Inputs):
        q, k, v, p = inputs.q, inputs.k, inputs.v, inputs.problem
        if p.varlen:
            cu, m = inputs.cu_seqlens, inputs.max_seqlen
            return lambda: attention_varlen(q, k, v, cu, cu, m, m, causal=p.causal)
        fp8 = dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) \
            if p.is_fp8 else {}
        return lambda: attention(q, k, v, causal=p.causal, **fp8)
    return runner


def config_variant(name: str, label: str, description: str, config_for) -> Provider:
    """``gluon`` with the forward launched in ``config_for(problem, dtype)``'s config, forward only: a knob's A/B
    against the default (experiments/pingpong.py, pair_tile.py register theirs)."""
    def runner(inputs: Inputs):
        from ..api import attention
        from ..problem import dtype_name
        cfg = config_for(inputs.problem, dtype_name(inputs.q.dtype))
        return attention_runner(functools.partial(attention, config=cfg))(inputs)
    def config(p: Problem) -> str:
        return config_for(p, p.dtype).label()
    return dataclasses.replace(GLUON, name=name, runner=runner, backward_runner=None, description=description,
                               label_fn=lambda: label, config_fn=config)


def bwd_config_variant(name: str, label: str, description: str, config_for) -> Provider:
    """``gluon`` with the backward launched in ``config_for(problem, dtype)``'s config (``api.backward(config=...)``,
    after gluon's forward): a backward knob's A/B in one sweep without a copy of the tree. A given config takes the
    launch path without the prepared route (the accumulator zeroed by its own kernel), so the default config through
    this path is the fair reference (experiments/pair_configs.py registers both); dense problems only."""
    def backward_runner(inputs: Inputs) -> Call:
        from ..api import backward, forward
        p, q, k, v, do = inputs.problem, inputs.q, inputs.k, inputs.v, inputs.do
        cfg = config_for(p, p.dtype)
        grad = do.reshape(*q.shape[:3], v.shape[3])
        if p.pass_name == "bwd":
            out, lse = forward(q, k, v, causal=p.causal, return_lse=True)
            return Call(lambda: backward(grad, q, k, v, out, lse, causal=p.causal, config=cfg))

        def both():
            out, lse = forward(q, k, v, causal=p.causal, return_lse=True)
            return backward(grad, q, k, v, out, lse, causal=p.causal, config=cfg)
        return Call(both)

    def rule(p: Problem, arch) -> str | None:
        if not p.backward:
            return "a backward config's variant (its forward is gluon's): passes bwd and fwd+bwd"
        if p.varlen or p.is_fp8:
            return "a backward config's variant runs dense 16-bit problems"
        return _gluon_rule(p, arch)
    return dataclasses.replace(GLUON, name=name, backward_runner=backward_runner, description=description,
                               label_fn=lambda: label, config_fn=lambda p: config_for(p, p.dtype).label(), rule=rule)


def _gluon_runner(inputs: Inputs):
    from ..api import attention, attention_varlen
    return attention_runner(attention, attention_varlen)(inputs)


def _gluon_det_runner(inputs: Inputs):
    from ..api import attention, attention_varlen
    return attention_runner(functools.partial(attention, deterministic=True),
                            functools.partial(attention_varlen, deterministic=True))(inputs)


def _det_rule(p: Problem, arch) -> str | None:
    if not p.backward:
        return "the deterministic mode changes the backward only (the forward is gluon's)"
    return _gluon_rule(p, arch)


def _gluon_rule(p: Problem, arch) -> str | None:
    if p.varlen and p.dtype not in VARLEN_DTYPES:
        return f"packed (varlen) batches take dtypes {', '.join(VARLEN_DTYPES)}, not {p.dtype}"
    if p.head_dim_v != p.HEAD_DIM:
        backend = backend_for_capability(*arch) if arch else ANY_BACKEND
        return backend.head_dim_problem(p.HEAD_DIM, p.head_dim_v) if backend else None
    return None


def _backward_rule(p: Problem, arch) -> str | None:
    """What the backward kernel takes on this GPU (its arch, dtypes, head dims)."""
    backend = backend_for_capability(*arch) if arch else ANY_BACKEND
    why = backend.backward_problems(p.HEAD_DIM, p.dtype, p.head_dim_v) if backend else ["no kernel for this GPU"]
    return "; ".join(why) or None


def _current_backend():
    """The current GPU's backend (the first backend without a GPU, or on a GPU no backend runs on)."""
    import torch
    backend = backend_for_capability(*torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    return backend or ANY_BACKEND


def _config_label(p: Problem) -> str:
    """The config the current GPU's backend runs the problem with."""
    try:
        return _current_backend().default_config(p.HEAD_DIM, p.dtype, p.causal, p.N_CTX, p.pass_name,
                                                 p.head_dim_v).label()
    except ValueError:
        return ""


GLUON = register(Provider(
    name="gluon",
    description="this project's persistent warp-specialized Gluon kernels (sm_90a; sm_100a compile-verified)",
    needs_cuda=True,
    dtypes=ANY_BACKEND.dtypes,
    head_dims=lambda d: d in _current_backend().head_dims,
    head_dims_text=head_dims_text(),
    arch_ok=lambda arch: backend_for_capability(*arch) is not None,
    archs_text=", ".join(b.description for b in BACKENDS.values()),
    runner=_gluon_runner,
    label_fn=lambda: "Gluon (persistent WS)",
    kernel_name_fn=lambda p: resolve_name("gluon_attention", DEFAULT_NAME_CHOICE, is_fp8=p.is_fp8),  # attention()'s
    config_fn=_config_label,
    out_dtype_fn=lambda p: "fp16" if p.is_fp8 else p.dtype,
    package="triton",
    library="gluon-attn (Triton Gluon)",
    features="causal (bottom-right), non-causal; GQA/MQA; N_KV != N_CTX; packed batches (16-bit); "
             "fp8 e4m3/e5m2 with per-tensor descales, fp16 output; q/k and v head dims 192/128 (sm_90a); "
             "kernel-name choice; backward on sm_90a "
             "(fp16/bf16, D 32/64/96/128/192/256, 192/128)",
    rule=_gluon_rule,
    gqa=True,
    cross_lengths="all",
    varlen=True,
    backward=True,
    backward_rule=_backward_rule,
))
register(dataclasses.replace(
    GLUON,
    name="gluon-det",
    description="gluon with deterministic=True: the backward's dQ adds in key-block order (bit-identical runs)",
    runner=_gluon_det_runner,
    label_fn=lambda: "Gluon (deterministic bwd)",
    features="as gluon, backward passes only: dQ's fp32 adds in a fixed order",
    rule=_det_rule,
))
