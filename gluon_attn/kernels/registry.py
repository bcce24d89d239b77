"""Compile-only builders for ``gluon-attn inspect``: one per kernel kind."""
from __future__ import annotations

import dataclasses

from .backend import VARLEN_DTYPES, backend_for_arch
from .build import BuildRequest, KernelBuild, register_builder
from ..problem import dtype_from_name, own_v_dim
from .common import descriptor_signature
from .naming import resolve_name
from .tma_copy import tma_block_layout, tma_scale_kernel


@register_builder("tma_copy")
def build_tma_copy(req: BuildRequest) -> KernelBuild:
    dtype = dtype_from_name(req.dtype)
    if req.dtype not in ("fp16", "bf16"):
        raise ValueError(f"tma_copy supports dtypes fp16, bf16; got {req.dtype}")
    block_m = int(req.config.get("BLOCK_M", 64))
    block = [1, 1, block_m, req.head_dim]
    layout = tma_block_layout(block, dtype)
    desc = descriptor_signature(dtype, block, layout)
    name = resolve_name("gluon_tma_scale", req.kernel_name)
    return KernelBuild(
        fn=tma_scale_kernel,
        signature={"in_desc": desc, "out_desc": desc, "scale": "fp32", "BLOCK_M": "constexpr",
                   "HEAD_DIM": "constexpr", "KERNEL_NAME": "constexpr"},
        constexprs={"BLOCK_M": block_m, "HEAD_DIM": req.head_dim, "KERNEL_NAME": name},
        num_warps=4,
        name=name,
        description=f"TMA load/scale/store tile [{block_m}, {req.head_dim}] {req.dtype}",
    )


def _config_from(req: BuildRequest, base):
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(req.config) - fields
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(fields)}")
    values = {k: (bool(v) if isinstance(getattr(base, k), bool) else v) for k, v in req.config.items()}
    return dataclasses.replace(base, **values)


@register_builder("attention")
def build_attention(req: BuildRequest) -> KernelBuild:
    backend = backend_for_arch(req.arch)
    dtype_from_name(req.dtype)  # a clear error for an unknown dtype
    if req.head_dim not in backend.head_dims:
        raise ValueError(f"head dim {req.head_dim} not supported; supported: {', '.join(map(str, backend.head_dims))}")
    v_dim = own_v_dim(req.head_dim, req.head_dim_v)
    why = backend.head_dim_problem(req.head_dim, v_dim or None)
    if why:
        raise ValueError(why)
    # (a dense launch's default for the pair: ``Backend.default_config`` with v's head dim; packed ones keep theirs)
    base = backend.default_config(req.head_dim, req.dtype, req.causal, head_dim_v=0 if req.varlen else v_dim)
    if req.varlen:
        if req.dtype not in VARLEN_DTYPES:
            raise ValueError(f"the packed-sequence build takes dtypes {', '.join(VARLEN_DTYPES)}; got {req.dtype}")
        base = backend.packed_config(base)  # the launcher's default for packed sequences; overrides still win
    cfg = _config_from(req, base)
    bad = cfg.invalid_reasons(req.head_dim, req.dtype, v_dim)
    if bad:
        raise ValueError(f"config {cfg.label()} invalid: {'; '.join(bad)}")
    name = resolve_name("gluon_attention", req.kernel_name, is_fp8=req.dtype.startswith("fp8"))
    if v_dim:
        return backend.build(req.dtype, req.head_dim, req.causal, cfg, name, req.varlen, head_dim_v=v_dim)
    return backend.build(req.dtype, req.head_dim, req.causal, cfg, name, req.varlen)


@register_builder("attention_bwd")
def build_attention_bwd(req: BuildRequest) -> KernelBuild:
    """The backward kernel (``inspect --pass bwd``): its arch's backward module, refused naming where it runs."""
    backend = backend_for_arch(req.arch)
    dtype_from_name(req.dtype)
    v_dim = own_v_dim(req.head_dim, req.head_dim_v)
    why = backend.backward_problems(req.head_dim, req.dtype, v_dim or None)
    if why:
        raise ValueError(f"backward: {'; '.join(why)}")
    # (v's head dim, 0 where it is q's, picks the pair's own units: ``hopper_bwd_host.default_config``)
    base = backend.default_config(req.head_dim, req.dtype, req.causal, pass_name="bwd", head_dim_v=v_dim)
    cfg = _config_from(req, base)
    bad = cfg.invalid_reasons(req.head_dim, req.dtype, v_dim)
    if bad:
        raise ValueError(f"config {cfg.label()} invalid: {'; '.join(bad)}")
    name = resolve_name("gluon_attention_bwd", req.kernel_name)
    return backend.bwd.build(req.dtype, req.head_dim, req.causal, cfg, name, req.varlen, req.deterministic,
                             head_dim_v=v_dim)
