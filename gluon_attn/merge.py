"""Merging attention outputs by their logsumexp: NATTEN's ``merge_attentions``.

Attention over a key set split in parts is the parts' outputs weighed by exp(lse_p - lse), with
lse = logsumexp_p lse_p: what the split decode's combine does inside its kernel (``gluon_attn.decode``),
here for any tensors and differentiable, for neighborhood attention with additional keys and for context
parallelism across GPUs.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .kernels import cdiv, launch_module, next_power_of_2


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


# ---------------------------------------------------------------------------------------------
# Two parts merged in one launch: neighborhood attention's output and its additional keys'
# ---------------------------------------------------------------------------------------------
MERGE_ROWS = 16  # rows (b, n, h) per program of ``_merge_pair_kernel``


@triton.jit(do_not_specialize=["R", "N", "H", "o_b", "o_n", "o_h", "l_b", "l_n", "l_h", "x_b", "x_n", "x_h", "y_b",
                               "y_n", "y_h", "m_b", "m_n", "m_h"])
def _merge_pair_kernel(o_ptr, lse_ptr, x_ptr, x_lse_ptr, m_lse_ptr, R: tl.int64, N: tl.int64, H: tl.int64,
                       o_b: tl.int64, o_n: tl.int64, o_h: tl.int64, l_b: tl.int64, l_n: tl.int64, l_h: tl.int64,
                       x_b: tl.int64, x_n: tl.int64, x_h: tl.int64, y_b: tl.int64, y_n: tl.int64, y_h: tl.int64,
                       m_b: tl.int64, m_n: tl.int64, m_h: tl.int64, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       ROWS: tl.constexpr, LSE_OUT: tl.constexpr, ALIGNED: tl.constexpr = False):
    """ROWS rows (b, n, h) of R = B * N * H: output o (rows [D], unit stride along D) and its lse, merged in place
    with x and its lse (y_*: x's lse strides) as ``merge_attentions`` merges two parts; the merged lse to m_lse_ptr
    where LSE_OUT. Each tensor by its (b, n, h) strides. The sizes and strides are 64-bit arguments whatever their
    values: ``launch_cached`` keys a build without its integers' widths, so a build the JIT typed 32-bit on a first
    call's small strides would take a later call's 2^31 or more truncated. ALIGNED: o's and x's rows start at
    multiples of 16 bytes (``merge_pair_args`` checks), so that their loads and stores are 16 bytes wide."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = rows < R
    h = rows % H
    bn = rows // H
    n = bn % N
    b = bn // N
    l1 = tl.load(lse_ptr + b * l_b + n * l_n + h * l_h, mask=ok, other=-float("inf"))
    l2 = tl.load(x_lse_ptr + b * y_b + n * y_n + h * y_h, mask=ok, other=-float("inf"))
    m = tl.maximum(l1, l2)
    m = tl.where(m == -float("inf"), 0.0, m)  # (no key seen by either part: weights 0, lse -inf)
    e1 = tl.exp(l1 - m)
    e2 = tl.exp(l2 - m)
    total = e1 + e2
    seen = total > 0
    safe = tl.where(seen, total, 1.0)
    d = tl.arange(0, BLOCK_D)
    keep = ok[:, None] & (d < D)[None, :]
    o_row = b * o_b + n * o_n + h * o_h
    x_row = b * x_b + n * x_n + h * x_h
    if ALIGNED:
        o_row = tl.multiple_of(o_row, 128 // o_ptr.dtype.element_ty.primitive_bitwidth)
        x_row = tl.multiple_of(x_row, 128 // x_ptr.dtype.element_ty.primitive_bitwidth)
    o_at = o_ptr + o_row[:, None] + d[None, :]
    o = tl.load(o_at, mask=keep, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + x_row[:, None] + d[None, :], mask=keep, other=0.0).to(tl.float32)
    tl.store(o_at, ((e1 / safe)[:, None] * o + (e2 / safe)[:, None] * x).to(o_ptr.dtype.element_ty), mask=keep)
    if LSE_OUT:
        tl.store(m_lse_ptr + b * m_b + n * m_n + h * m_h, tl.where(seen, m + tl.log(safe), -float("inf")), mask=ok)


def merge_pair_(out: torch.Tensor, lse: torch.Tensor, x: torch.Tensor, x_lse: torch.Tensor,
                merged_lse: Optional[torch.Tensor] = None) -> None:
    """``merge_attentions([out, x], [lse, x_lse])`` written into ``out`` (in place) and ``merged_lse`` (when given),
    for [B, N, H, D] outputs and [B, N, H] fp32 lse's of any strides (outputs with a unit stride along D): one launch
    on the GPU (``_merge_pair_kernel``, no autograd), PyTorch's ops elsewhere. ``merged_lse`` may be ``lse``."""
    if not out.is_cuda:
        merged, m_lse = merge_attentions([out, x], [lse, x_lse])
        out.copy_(merged)
        if merged_lse is not None:
            merged_lse.copy_(m_lse)
        return
    launch = launch_module()
    grid, args, consts = merge_pair_args(out, lse, x, x_lse, merged_lse, launch.placeholder(out.device, torch.float32))
    launch.launch_cached(_merge_pair_kernel, 4, grid, args, consts, out.device,
                         key=(_merge_pair_kernel, out.dtype, x.dtype, *consts.values()))


def merge_pair_args(out, lse, x, x_lse, merged_lse, unused: torch.Tensor) -> tuple:
    """``_merge_pair_kernel``'s (grid, arguments, constexprs) (``merge_pair_``'s GPU path; the interpreter's tests
    launch with them too); ``unused`` stands for ``merged_lse`` where there is none."""
    B, N, H, D = out.shape
    o_s, x_s = out.stride(), x.stride()
    assert o_s[3] == 1 and x_s[3] == 1, "merge_pair_: outputs with a unit stride along D"
    m, m_strides = (unused, (0, 0, 0)) if merged_lse is None else (merged_lse, merged_lse.stride())
    R = B * N * H
    # (rows at 16-byte multiples in both: 16-byte loads and stores; 16 bits, as the outputs merged here are. These
    # are launch.tma_aligned's conditions written out: through it the check costs ~2.7 us a call against 0.5)
    aligned = out.element_size() == x.element_size() == 2 and (out.data_ptr() | x.data_ptr()) % 16 == 0 \
        and not (o_s[0] | o_s[1] | o_s[2] | x_s[0] | x_s[1] | x_s[2] | D) % 8
    consts = dict(D=D, BLOCK_D=next_power_of_2(D), ROWS=MERGE_ROWS, LSE_OUT=merged_lse is not None,
                  ALIGNED=aligned)
    return cdiv(R, MERGE_ROWS), (out, lse, x, x_lse, m, R, N, H, *o_s[:3], *lse.stride(), *x_s[:3],
                                 *x_lse.stride(), *m_strides), consts
