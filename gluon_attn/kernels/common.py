"""What the Gluon kernels share: dtype mapping and small host helpers."""
from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl

_GL_DTYPES = {
    torch.float16: gl.float16,
    torch.bfloat16: gl.bfloat16,
    torch.float8_e5m2: gl.float8e5,
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.float32: gl.float32,
}
# Signature strings Triton uses for tensor-descriptor element types.
_SIG_DTYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e5m2: "fp8e5",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float32: "fp32",
}


def gl_dtype(dtype: torch.dtype):
    return _GL_DTYPES[dtype]


def sig_dtype(dtype: torch.dtype) -> str:
    return _SIG_DTYPES[dtype]


def descriptor_signature(dtype: torch.dtype, block_shape, layout) -> str:
    """The signature string of a tensor-descriptor argument, for compile-only builds."""
    dims = ", ".join(str(int(d)) for d in block_shape)
    return f"tensordesc<{sig_dtype(dtype)}[{dims}],{layout!r}>"
