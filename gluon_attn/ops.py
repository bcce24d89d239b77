"""The ``torch.library`` custom ops behind ``attention`` and ``attention_varlen``: ``gluon_attn::attention``
and ``gluon_attn::attention_varlen``, each returning (out, lse) (lse empty unless asked for), with fake
implementations so that torch.compile traces them without a graph break and meta/fake tensors get
outputs of the right shape, dtype and strides; their backward ops ``gluon_attn::attention_backward`` and
``::attention_varlen_backward`` (dq, dk, dv), wired in with ``torch.library.register_autograd``; and
``gluon_attn::neighborhood_attention`` behind na1d/na2d/na3d (out, lse; the pattern per dimension) with its
``::neighborhood_attention_backward``. Importing the package registers them."""
from __future__ import annotations

from typing import Optional

import torch

from . import api

_EMPTY = (0,)


def _with_lse(result, return_lse: bool, q: torch.Tensor):
    """The ops' fixed (out, lse) pair from what the API returns: lse empty unless asked for."""
    return result if return_lse else (result, q.new_empty(_EMPTY, dtype=torch.float32))


@torch.library.custom_op("gluon_attn::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: Optional[float],
                 descale_q: Optional[float], descale_k: Optional[float], descale_v: Optional[float], return_lse: bool,
                 out_dtype: Optional[torch.dtype], kernel_name: str,
                 deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # (``deterministic`` is the backward's: kept by the autograd context)
    result = api.forward(q, k, v, causal=causal, sm_scale=sm_scale, descale_q=descale_q, descale_k=descale_k,
                         descale_v=descale_v, return_lse=return_lse, out_dtype=out_dtype, kernel_name=kernel_name)
    return _with_lse(result, return_lse, q)


@attention_op.register_fake
def _attention_fake(q, k, v, causal, sm_scale, descale_q, descale_k, descale_v, return_lse, out_dtype, kernel_name,
                    deterministic=False):
    is_fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    dtype = out_dtype or (torch.float16 if is_fp8 else q.dtype)
    from .kernels.common import empty_in_layout_of
    # (the kernel's output keeps q's layout, with v's head dim: kernels/common.resolve_output)
    out = empty_in_layout_of(q, (*q.shape[:-1], v.shape[-1]), dtype)
    Z, H, N_Q, _ = q.shape
    lse = q.new_empty((Z, H, N_Q) if return_lse else _EMPTY, dtype=torch.float32)
    return out, lse


@torch.library.custom_op("gluon_attn::attention_varlen", mutates_args=())
def attention_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                        sm_scale: Optional[float], return_lse: bool, kernel_name: str,
                        deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    result = api.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                sm_scale=sm_scale, return_lse=return_lse, kernel_name=kernel_name)
    return _with_lse(result, return_lse, q)


@attention_varlen_op.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale,
                           return_lse, kernel_name, deterministic=False):
    total_q, H, _ = q.shape
    out = q.new_empty((total_q, H, v.shape[2]))
    lse = q.new_empty((H, total_q) if return_lse else _EMPTY, dtype=torch.float32)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("gluon_attn::attention_backward", mutates_args=())
def attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, grad_lse: Optional[torch.Tensor], causal: bool, sm_scale: Optional[float],
                          kernel_name: str,
                          deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return api.backward(do, q, k, v, out, lse, grad_lse=grad_lse, causal=causal, sm_scale=sm_scale,
                        kernel_name=kernel_name, deterministic=deterministic)


@attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, out, lse, grad_lse, causal, sm_scale, kernel_name, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("gluon_attn::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, grad_lse: Optional[torch.Tensor],
                                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                                 max_seqlen_k: int, causal: bool, sm_scale: Optional[float], kernel_name: str,
                                 deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return api.backward_varlen(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               grad_lse=grad_lse, causal=causal, sm_scale=sm_scale, kernel_name=kernel_name,
                               deterministic=deterministic)


@attention_varlen_backward_op.register_fake
def _attention_varlen_backward_fake(do, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, sm_scale, kernel_name, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _lse_grad(grad_lse, lse):
    """The lse's incoming gradient when the caller used the lse (else None: nothing to add)."""
    if grad_lse is None or lse.numel() == 0 or grad_lse.shape != lse.shape:
        return None
    return grad_lse


def _setup_dense(ctx, inputs, output):
    q, k, v, causal, sm_scale, _dq, _dk, _dv, return_lse, _odt, kernel_name, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.sm_scale, ctx.kernel_name, ctx.deterministic = causal, sm_scale, kernel_name, deterministic


def _backward_dense(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if lse.numel() == 0 and q.numel() > 0:
        raise RuntimeError("gluon_attn::attention was recorded without its lse: call gluon_attn.attention (which "
                           "asks for it when the inputs require grad), or pass return_lse=True")
    dq, dk, dv = torch.ops.gluon_attn.attention_backward(grad_out, q, k, v, out, lse, _lse_grad(grad_lse, lse),
                                                         ctx.causal, ctx.sm_scale, ctx.kernel_name, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, return_lse, kernel_name, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.causal, ctx.sm_scale, ctx.kernel_name = max_q, max_k, causal, sm_scale, kernel_name
    ctx.deterministic = deterministic


def _backward_varlen(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if lse.numel() == 0 and q.numel() > 0:
        raise RuntimeError("gluon_attn::attention_varlen was recorded without its lse: call "
                           "gluon_attn.attention_varlen, or pass return_lse=True")
    dq, dk, dv = torch.ops.gluon_attn.attention_varlen_backward(grad_out, q, k, v, out, lse, _lse_grad(grad_lse, lse),
                                                                cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.causal,
                                                                ctx.sm_scale, ctx.kernel_name, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("gluon_attn::attention", _backward_dense, setup_context=_setup_dense)
torch.library.register_autograd("gluon_attn::attention_varlen", _backward_varlen, setup_context=_setup_varlen)


# ---------------------------------------------------------------------------------------------
# Neighborhood attention (na1d, na2d, na3d): one op for every dimension count, its pattern per dimension
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("gluon_attn::neighborhood_attention", mutates_args=())
def neighborhood_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: list[int],
                              stride: list[int], dilation: list[int], is_causal: list[bool], scale: float,
                              q_tile_shape: Optional[list[int]], kv_tile_shape: Optional[list[int]],
                              backward_q_tile_shape: Optional[list[int]], backward_kv_tile_shape: Optional[list[int]],
                              descale_q: float, descale_k: float, descale_v: float, need_lse: bool,
                              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # (the backward tile shapes and ``deterministic`` are the backward's: kept by the autograd context)
    from .neighborhood import na_forward

    out, lse = na_forward(q, k, v, kernel_size, stride, dilation, is_causal, scale, q_tile_shape, kv_tile_shape,
                          (descale_q, descale_k, descale_v), need_lse, (backward_q_tile_shape, backward_kv_tile_shape))
    return out, lse if lse is not None else q.new_empty(_EMPTY, dtype=torch.float32)


@neighborhood_attention_op.register_fake
def _neighborhood_attention_fake(q, k, v, kernel_size, stride, dilation, is_causal, scale, q_tile_shape, kv_tile_shape,
                                 backward_q_tile_shape, backward_kv_tile_shape, descale_q, descale_k, descale_v,
                                 need_lse, deterministic):
    is_fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float16 if is_fp8 else q.dtype)
    return out, q.new_empty(q.shape[:-1] if need_lse else _EMPTY, dtype=torch.float32)


@torch.library.custom_op("gluon_attn::neighborhood_attention_backward", mutates_args=())
def neighborhood_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       out: torch.Tensor, lse: torch.Tensor, grad_lse: Optional[torch.Tensor],
                                       kernel_size: list[int], stride: list[int], dilation: list[int],
                                       is_causal: list[bool], scale: float,
                                       backward_q_tile_shape: Optional[list[int]],
                                       backward_kv_tile_shape: Optional[list[int]],
                                       deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .neighborhood import na_backward

    return na_backward(do, q, k, v, out, lse, grad_lse, kernel_size, stride, dilation, is_causal, scale,
                       backward_q_tile_shape, backward_kv_tile_shape, deterministic)


@neighborhood_attention_backward_op.register_fake
def _neighborhood_attention_backward_fake(do, q, k, v, out, lse, grad_lse, kernel_size, stride, dilation, is_causal,
                                          scale, backward_q_tile_shape, backward_kv_tile_shape, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_neighborhood(ctx, inputs, output):
    q, k, v, kernel_size, stride, dilation, is_causal, scale, _qt, _kvt, bq, bkv, _dq, _dk, _dv, _lse, det = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # (an unused lse brings no gradient: the kernel's grad_lse is None)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.pattern = (kernel_size, stride, dilation, is_causal)
    ctx.scale, ctx.backward_tiles, ctx.deterministic = scale, (bq, bkv), det


def _backward_neighborhood(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if lse.numel() == 0 and q.numel() > 0:
        raise RuntimeError("gluon_attn::neighborhood_attention was recorded without its lse: call gluon_attn.na1d, "
                           "na2d or na3d (which ask for it when the inputs require grad), or pass need_lse=True")
    grad_out = grad_out if grad_out is not None else torch.zeros_like(out)
    dq, dk, dv = torch.ops.gluon_attn.neighborhood_attention_backward(grad_out, q, k, v, out, lse,
                                                                      _lse_grad(grad_lse, lse), *ctx.pattern,
                                                                      ctx.scale, *ctx.backward_tiles,
                                                                      ctx.deterministic)
    return (dq, dk, dv) + (None,) * 14


torch.library.register_autograd("gluon_attn::neighborhood_attention", _backward_neighborhood,
                                setup_context=_setup_neighborhood)
