"""Registers the project's Gluon attention kernels as benchmark providers."""
from __future__ import annotations

from ..kernels import blackwell, hopper
from ..kernels.naming import DEFAULT_NAME_CHOICE, resolve_name
from ..problem import Inputs, Problem
from .provider import Provider, register


def _gluon_runner(inputs: Inputs):
    from ..api import attention

    q, k, v, p = inputs.q, inputs.k, inputs.v, inputs.problem
    fp8 = dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) if p.is_fp8 else {}
    return lambda: attention(q, k, v, causal=p.causal, **fp8)


def _config_label(p: Problem) -> str:
    import torch
    arch = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    mod = blackwell if arch[0] == 10 else hopper
    try:
        return mod.default_config(p.HEAD_DIM, p.dtype, p.causal, p.N_CTX).label()
    except ValueError:
        return ""


register(Provider(
    name="gluon",
    description="this project's persistent warp-specialized Gluon kernels (sm_90a; sm_100a compile-verified)",
    needs_cuda=True,
    dtypes=hopper.DTYPES,
    head_dims=lambda d: d in hopper.HEAD_DIMS,
    head_dims_text=", ".join(map(str, hopper.HEAD_DIMS)),
    arch_ok=lambda arch: arch[0] in (9, 10),
    archs_text="sm_90a (H100/H200), sm_100a (B200)",
    runner=_gluon_runner,
    label_fn=lambda: "Gluon (persistent WS)",
    kernel_name_fn=lambda p: resolve_name("gluon_attention", DEFAULT_NAME_CHOICE, is_fp8=p.is_fp8),  # attention()'s
    config_fn=_config_label,
    out_dtype_fn=lambda p: "fp16" if p.is_fp8 else p.dtype,
    package="triton",
    library="gluon-attn (Triton Gluon)",
    features="causal, non-causal; fp8 e4m3/e5m2 with per-tensor descales, fp16 output; kernel-name choice",
))
