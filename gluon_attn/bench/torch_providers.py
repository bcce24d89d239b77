"""The providers torch ships: cuDNN and FlashAttention-2 through SDPA, SDPA's math backend (the CPU
oracle) and compiled FlexAttention."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..problem import Inputs
from .provider import SIXTEEN_BIT, Provider, cudnn_label, register


# ---------------------------------------------------------------------------------------------
# SDPA-backed providers
# ---------------------------------------------------------------------------------------------

def _sdpa_context(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, backend_name))


def _sdpa_runner(inputs: Inputs) -> Callable[[], torch.Tensor]:
    q, k, v, causal = inputs.q, inputs.k, inputs.v, inputs.problem.causal
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if k.shape[1] != q.shape[1]:  # GQA/MQA: SDPA shares each K/V head among H / H_KV query heads
        return lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=True)
    return lambda: sdpa(q, k, v, is_causal=causal)


# SDPA's is_causal aligns the mask top-left: with N_KV != N_CTX that is not the bottom-right causal
# attention the others compute, so those cells are non-causal only.
_SDPA_SHAPES = dict(gqa=True, cross_lengths="non-causal", backward=True,
                    features="causal, non-causal; GQA/MQA (enable_gqa); N_KV != N_CTX non-causal; backward")


register(Provider(
    name="cudnn",
    description="torch SDPA, CUDNN_ATTENTION backend",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d % 8 == 0 and d <= 256,
    head_dims_text="multiples of 8 up to 256",
    min_arch=(9, 0),
    archs_text="sm_90+",
    runner=_sdpa_runner,
    context=functools.partial(_sdpa_context, "CUDNN_ATTENTION"),
    label_fn=cudnn_label,
    kernel_name_fn=lambda p: "cudnn sdpa",
    library="cuDNN via torch SDPA",
    peer=True,
    **_SDPA_SHAPES,
))

register(Provider(
    name="fa2",
    description="torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d % 8 == 0 and d <= 256,
    head_dims_text="multiples of 8 up to 256",
    runner=_sdpa_runner,
    context=functools.partial(_sdpa_context, "FLASH_ATTENTION"),
    label_fn=lambda: "FA2 (SDPA flash)",
    kernel_name_fn=lambda p: "flash_fwd",
    library="FlashAttention-2 via torch SDPA",
    **_SDPA_SHAPES,
))

register(Provider(
    name="math",
    description="torch SDPA, MATH backend: any device, for tests and CPU runs",
    needs_cuda=False,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d >= 1,
    head_dims_text="any",
    archs_text="any device (CPU too)",
    runner=_sdpa_runner,
    context=functools.partial(_sdpa_context, "MATH"),
    label_fn=lambda: "SDPA math",
    library="torch SDPA math (CPU oracle)",
    **_SDPA_SHAPES,
))


# ---------------------------------------------------------------------------------------------
# FlexAttention (compiled)
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex_runner(inputs: Inputs) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v, p = inputs.q, inputs.k, inputs.v, inputs.problem
    block_mask = None
    if p.causal:
        block_mask = create_block_mask(_causal_mask, None, None, p.N_CTX, p.N_CTX, device=q.device)
    flex = _compiled_flex()
    return lambda: flex(q, k, v, block_mask=block_mask)


register(Provider(
    name="flex",
    description="torch FlexAttention, compiled (block mask for causal)",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d >= 16 and d <= 256 and (d & (d - 1)) == 0,
    head_dims_text="powers of two from 16 to 256",
    runner=_flex_runner,
    label_fn=lambda: "Flex (compiled)",
    kernel_name_fn=lambda p: "triton flex_attention",
    library="torch FlexAttention",
    features="causal (block mask), non-causal; backward",
    backward=True,
))
