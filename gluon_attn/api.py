"""``gluon_attn.attention``: validation and dispatch to the Gluon kernel for the current GPU."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .kernels.naming import DEFAULT_NAME_CHOICE, resolve_name
from .problem import dtype_name
from .validation import UnsupportedError, check_qkv

KERNEL_BASE_NAME = "gluon_attention"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: Optional[float] = None, descale_q: Optional[float] = None,
              descale_k: Optional[float] = None, descale_v: Optional[float] = None, return_lse: bool = False,
              out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None, config=None,
              kernel_name: str = DEFAULT_NAME_CHOICE, head_group_size: Optional[int] = None):
    """Attention forward ``softmax(q k^T * sm_scale) v`` with a persistent warp-specialized Gluon kernel:
    the sm_90a kernel on Hopper, the sm_100a kernel on Blackwell (compile-verified only: no Blackwell
    GPU was available to this project, it has never run).

    q, k, v: [Z, H, N_CTX, D] CUDA tensors (views whose last dim is contiguous are used without a
    copy), one dtype of fp16, bf16, float8_e5m2, float8_e4m3fn; D in {64, 128}; any N_CTX >= 1.
    fp8: pass per-tensor ``descale_*`` factors (x_real = x * descale); the output is fp16 (or
    ``out_dtype=torch.bfloat16``). ``return_lse`` also returns the natural-log logsumexp [Z, H, N] in
    fp32. ``kernel_name``: "auto" (the default: cutlass_gluon_attention for fp8, gluon_attention
    otherwise), "plain" (gluon_attention), "cutlass" (cutlass_gluon_attention) or a literal symbol. Output has q's layout. ``config`` overrides the tuned tile
    config; ``head_group_size`` overrides how many heads the persistent scheduler groups (L2 reuse) where
    it walks tiles in head groups (non-causal only; causal walks mirrored query-block pairs).
    """
    from .kernels.backend import ANY_BACKEND, backend_for_capability, supported_text

    check_qkv(q, k, v, head_dims=ANY_BACKEND.head_dims, dtypes=ANY_BACKEND.dtypes, require_cuda=True,
              what="gluon attention")
    if v.shape[-1] != q.shape[-1]:
        raise UnsupportedError(f"gluon attention: HEAD_DIM_V {v.shape[-1]} must equal HEAD_DIM {q.shape[-1]}")
    name = dtype_name(q.dtype)
    is_fp8 = name.startswith("fp8")
    if not is_fp8 and any(d is not None for d in (descale_q, descale_k, descale_v)):
        raise ValueError("descale factors apply to fp8 inputs only")
    major, minor = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    backend = backend_for_capability(major, minor)
    if backend is None:
        raise UnsupportedError(f"gluon attention: no kernel for sm_{major}{minor}; supported: {supported_text()}")
    symbol = resolve_name(KERNEL_BASE_NAME, kernel_name, is_fp8=is_fp8)
    return backend.launch(
        q, k, v, causal=causal, sm_scale=sm_scale, descale_q=descale_q or 1.0, descale_k=descale_k or 1.0,
        descale_v=descale_v or 1.0, return_lse=return_lse, out=out, out_dtype=out_dtype, config=config,
        kernel_name=symbol, head_group_size=head_group_size)
