"""Merging attention outputs by their logsumexp: NATTEN's ``merge_attentions``.

Attention over a key set split in parts is the parts' outputs weighed by exp(lse_p - lse), with
lse = logsumexp_p lse_p: what the split decode's combine does inside its kernel (``gluon_attn.decode``),
here for any tensors and differentiable, for neighborhood attention with additional keys and for context
parallelism across GPUs.
"""
from __future__ import annotations

from typing import Sequence

import torch


def merge_attentions(outputs: Sequence[torch.Tensor], lse_tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """Merge attention outputs computed over disjoint key sets into the output over their union.

    ``outputs``: two or more tensors of one shape [..., D] (any layout: [B, *spatial, H, D] as NATTEN,
    [Z, H, N, D] as ``attention``), each normalised over its own keys; ``lse_tensors``: their natural-log
    logsumexp, fp32, of the shape ``outputs[0].shape[:-1]``. A row whose every part saw no key (lse -inf)
    merges to 0 with lse -inf. Returns (output in ``outputs[0]``'s dtype, lse fp32). Differentiable in
    every output and lse (PyTorch's ops: autograd gives the backward)."""
    outputs, lse_tensors = list(outputs), list(lse_tensors)
    if len(outputs) < 2 or len(outputs) != len(lse_tensors):
        raise ValueError(f"merge_attentions takes two or more outputs and one lse per output; got {len(outputs)} "
                         f"outputs and {len(lse_tensors)} lse tensors")
    shape, device = outputs[0].shape, outputs[0].device
    for i, (o, lse) in enumerate(zip(outputs, lse_tensors)):
        if o.shape != shape:
            raise ValueError(f"merge_attentions: outputs[{i}] has shape {tuple(o.shape)}, outputs[0] {tuple(shape)}")
        if lse.shape != shape[:-1]:
            raise ValueError(f"merge_attentions: lse_tensors[{i}] has shape {tuple(lse.shape)}; an output of shape "
                             f"{tuple(shape)} needs its lse of shape {tuple(shape[:-1])}")
        if lse.dtype != torch.float32:
            raise ValueError(f"merge_attentions: lse_tensors[{i}] is {lse.dtype}; the lse is float32")
        if o.device != device or lse.device != device:
            raise ValueError(f"merge_attentions: every tensor on one device; outputs[{i}] on {o.device}, "
                             f"lse_tensors[{i}] on {lse.device}, outputs[0] on {device}")
        if not o.is_floating_point():
            raise ValueError(f"merge_attentions: outputs[{i}] is {o.dtype}; outputs are floating point")
    lses = torch.stack(lse_tensors)
    # Shifted by the row's largest lse (detached: the merge does not depend on the shift). A row where every part
    # is -inf (no key seen) has no shift and a zero sum: its weights are 0 and its lse -inf, with finite gradients.
    m = lses.detach().amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(lses - m)
    total = e.sum(0)
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(safe), torch.full_like(total, float("-inf")))
    out = sum((w / safe).unsqueeze(-1) * o.float() for w, o in zip(e, outputs))
    return out.to(outputs[0].dtype), lse
