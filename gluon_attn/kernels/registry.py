"""Compile-only builders for ``gluon-attn inspect``: one per kernel kind."""
from __future__ import annotations

from ..inspect import BuildRequest, KernelBuild, register_builder
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
