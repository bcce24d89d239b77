"""Compile-only builders for ``gluon-attn inspect``: one per kernel kind."""
from __future__ import annotations

from .build import BuildRequest, KernelBuild, register_builder
from ..problem import dtype_from_name
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
    import dataclasses
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(req.config) - fields
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(fields)}")
    values = {k: (bool(v) if isinstance(getattr(base, k), bool) else v) for k, v in req.config.items()}
    return dataclasses.replace(base, **values)


@register_builder("attention")
def build_attention(req: BuildRequest) -> KernelBuild:
    from triton.experimental.gluon import language as gl

    from . import blackwell, hopper
    from .common import gl_dtype

    kernels = {"sm_90a": hopper, "sm_100a": blackwell}
    if req.arch not in kernels:
        raise ValueError(f"no attention kernel for {req.arch}; available: {', '.join(kernels)}")
    mod = kernels[req.arch]
    dtype = dtype_from_name(req.dtype)
    if req.head_dim not in mod.HEAD_DIMS:
        raise ValueError(f"head dim {req.head_dim} not supported; supported: {', '.join(map(str, mod.HEAD_DIMS))}")
    is_fp8 = req.dtype.startswith("fp8")
    cfg = _config_from(req, mod.default_config(req.head_dim, req.dtype, req.causal))
    bad = cfg.invalid_reasons(req.head_dim, req.dtype)
    if bad:
        raise ValueError(f"config {cfg.label()} invalid: {'; '.join(bad)}")
    name = resolve_name("gluon_attention", req.kernel_name, is_fp8=is_fp8)
    out_dtype = dtype_from_name("fp16") if is_fp8 else dtype

    def desc(t, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype(t))
        return descriptor_signature(t, block, layout)

    if mod is hopper:
        blocks = hopper.block_shapes(req.head_dim, cfg, is_fp8)
        constexprs = hopper.kernel_constexprs(cfg, req.causal, is_fp8, False, name)
        descs = {n: desc(out_dtype if n == "desc_o" else dtype, block) for n, block in blocks.items()}
        fn = hopper.hopper_attention_kernel
    else:
        bq, bk, bv, bo = blackwell.block_shapes(req.head_dim, cfg)
        constexprs = blackwell.kernel_constexprs(cfg, req.causal, False, name)
        descs = {"desc_q": desc(dtype, bq), "desc_k": desc(dtype, bk), "desc_v": desc(dtype, bv),
                 "desc_o": desc(out_dtype, bo)}
        fn = blackwell.blackwell_attention_kernel
    signature = {**descs, **mod.RUNTIME_SIGNATURE, **{k: "constexpr" for k in constexprs}}
    return KernelBuild(
        fn=fn, signature=signature, constexprs=constexprs, num_warps=mod.NUM_WARPS, name=name,
        description=f"{'Hopper' if mod is hopper else 'Blackwell'} attention {req.dtype} D={req.head_dim} "
                    f"causal={req.causal} {cfg.label()}",
    )
