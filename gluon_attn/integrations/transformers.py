"""A "gluon" attention implementation for Hugging Face transformers (optional: ``pip install transformers``).

    import gluon_attn.integrations.transformers as gluon_hf
    gluon_hf.register()  # once; then
    model = AutoModelForCausalLM.from_config(config, attn_implementation="gluon")  # or model.set_attn_implementation("gluon")

What runs on the Gluon kernel: GQA/MQA natively (no K/V repeat), causal or not, prefill and decode against a
cache (causal aligned bottom-right), and packed batches (``cu_seq_lens_q``/``cu_seq_lens_k`` from
``DataCollatorWithFlattening``, or packed ``position_ids``) through ``attention_varlen``. Everything else
falls back to transformers' SDPA implementation with a one-time warning naming why: masks other than causal
(padding, sliding windows), dropout, softcap, attention weights, head dims or dtypes the kernel does not take,
CPU tensors, and inputs that require grad where no backward kernel takes them (the backward runs on sm_90a for
fp16/bf16 with head dim 32, 64, 96, 128 or 256).
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..api import attention, attention_varlen

NAME = "gluon"
_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"gluon attention: {reason}; this call (and others like it) runs transformers' SDPA "
                      f"attention instead", stacklevel=3)


@functools.lru_cache(maxsize=1)
def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


_REASONS: dict = {}


def _fallback_reason(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
    """Why this call runs SDPA instead (None: it runs the kernel); judged once per everything it depends on (a model
    calls it per layer and step)."""
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)
    signature = (query.device, query.dtype, query.shape[-1], key.shape[-1], value.shape[-1], grad,
                 bool(dropout and module.training), kwargs.get("softcap") is not None,
                 bool(kwargs.get("output_attentions")), kwargs.get("position_bias") is not None)
    if signature not in _REASONS:
        if len(_REASONS) > 256:
            _REASONS.clear()
        _REASONS[signature] = _judge(module, query, key, value, dropout, kwargs)
    return _REASONS[signature]


def _judge(module, query, key, value, dropout, kwargs) -> str | None:
    from ..kernels.backend import (ANY_BACKEND, all_head_dim_pairs, all_head_dims, backend_for_capability,
                                   head_dims_text)
    from ..problem import DTYPE_NAMES

    if query.device.type != "cuda":
        return f"tensors on {query.device.type} (the kernel runs on CUDA GPUs)"
    backend = backend_for_capability(*torch.cuda.get_device_capability(query.device))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key)):
        why = backend.backward_problems(query.shape[-1], DTYPE_NAMES.get(query.dtype, str(query.dtype)),
                                        value.shape[-1]) if backend else ["no kernel for this GPU"]
        if why:
            return f"inputs require grad and the backward cannot take them ({'; '.join(why)})"
    if dropout and module.training:
        return "attention dropout"
    if kwargs.get("softcap") is not None:
        return "softcap"
    if kwargs.get("output_attentions"):
        return "output_attentions (the kernel does not form the attention weights)"
    if kwargs.get("position_bias") is not None:
        return "an additive position bias"
    if DTYPE_NAMES.get(query.dtype) not in ANY_BACKEND.dtypes or DTYPE_NAMES.get(query.dtype).startswith("fp8"):
        return f"dtype {query.dtype} (the integration takes fp16 and bf16)"
    d, dv = query.shape[-1], value.shape[-1]
    if d not in all_head_dims() or key.shape[-1] != d or (dv != d and (d, dv) not in all_head_dim_pairs()):
        return f"head dims {d} (q, k) / {dv} (v) (supported: {head_dims_text()})"
    return backend.head_dim_problem(d, dv) if backend else None


def _packed_offsets(query, attention_mask, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) for a packed batch of one row, else None."""
    if query.shape[0] != 1:
        return None
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k", cu_q)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        return cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k
    position_ids = kwargs.get("position_ids")
    if attention_mask is None or position_ids is None or position_ids.shape[-1] != query.shape[2]:
        return None
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().view(-1)
    if starts.numel() < 2:
        return None  # one sequence: the mask is not a packing mask
    cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return cu, cu, longest, longest


def gluon_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: query [B, H, N_Q, D], key and value [B, H_KV, N_KV, D];
    returns (out [B, N_Q, H, D], None)."""
    reason = _fallback_reason(module, query, key, value, attention_mask, dropout, kwargs)
    if reason is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        packed = _packed_offsets(query, attention_mask, kwargs)
        if packed is not None:
            cu_q, cu_k, max_q, max_k = packed
            q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [1, H, T, D] -> [T, H, D] views
            out = attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k,
                                   causal=causal, sm_scale=scaling)
            return out.unsqueeze(0), None
        if attention_mask is None:
            q_len, kv_len = query.shape[2], key.shape[2]
            if causal and 1 < q_len < kv_len:
                # As transformers' SDPA path: a causal call with no mask and more keys than queries is a prefill
                # into an empty static cache, whose keys past the queries are unwritten slots.
                key, value = key[:, :, :q_len], value[:, :, :q_len]
            out = attention(query, key, value, causal=causal and q_len > 1, sm_scale=scaling)
            return out.transpose(1, 2), None
        reason = "an attention mask other than causal (padding or a window)"
    _warn_once(reason)
    return _sdpa_forward()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                           is_causal=is_causal, **kwargs)


def register(name: str = NAME) -> str:
    """Register the implementation (and SDPA's mask builder for it: no mask when causal needs none) with
    transformers' AttentionInterface; returns the name to pass as ``attn_implementation``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError as exc:
        raise ImportError("gluon_attn.integrations.transformers needs transformers: pip install transformers "
                          f"(or the 'transformers' extra) ({exc})") from None
    AttentionInterface.register(name, gluon_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name
