"""Neighborhood attention (NATTEN's na1d/na2d/na3d pattern, ``neighborhood.Neighborhood``) run by FlashAttention-4's
Hopper forward, as a benchmark provider: FA4 sees the tokens flattened row-major ([B, N, H, D] views of
[B, *spatial, H, D] tensors), a ``mask_mod`` that says which (query, key) pairs the pattern attends, and block-sparse
tensors that list, for each query tile, the key tiles to visit, so it skips every key tile no query of the tile needs
and evaluates the mask only on the tiles that are partly attended.

The FA4 API it relies on (flash-attn-4 4.0.0b36, package ``flash_attn.cute``):

- ``interface.flash_attn_func(q, k, v, softmax_scale=..., mask_mod=..., aux_tensors=[...],
  block_sparse_tensors=...)``, which returns (out, lse) with out [B, N, H, Dv];
- ``block_sparsity.BlockSparseTensorsTorch(mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx,
  block_size=(tile_m, tile_n))``: int32 CUDA tensors [B or 1, H or 1, n_q_tiles] (counts) and [B or 1, H or 1,
  n_q_tiles, width] (key tile indices, ascending, width at most the number of key tiles); the "mask" lists hold the
  tiles that need ``mask_mod``, the "full" lists those every query of the tile attends wholly. On sm_90 the key block
  must equal the kernel's tile_n and the query block a multiple of its tile_m (``normalize_block_sparse_config``).
  Batch and head dimensions are 1 here (FA4 broadcasts them), and a head dimension of 1 keeps PackGQA on for GQA;
- the sm_90 tile size: ``interface._tile_size_fwd_sm90`` (128 x 128 at head dim 128; 192 x 128 up to 64; 192 x 144
  up to 96; 128 x 128 or 112 up to 192; 128 x 80 at 256) and ``interface._fit_sm90_fwd_tile_to_block_sparsity``;
  this module asks FA4 for them and sizes its blocks to match;
- the mask_mod signature (``mask.call_mask_mod``): ``mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)``,
  a ``@cute.jit`` function of shape-(1,) Int32 ``TensorSSA`` indices returning a Boolean ``TensorSSA``;
  ``aux_tensors`` is the list passed to ``flash_attn_func`` as CuTe tensors. FA4 keys its compiled kernels by
  ``utils.hash_callable`` (the function's source and the ``repr`` of its closure cells), so the mask_mod is made by a
  factory whose closure holds the layout's sizes and dilations: problems with another layout compile their own
  kernel; problems differing only in window sizes, strides or causality share one (those live in the aux table).

The mask_mod reads one int32 aux table: per dimension, for each coordinate x, the first and the last coordinate of
x's window (``lo = start * dilation + group``, ``hi = (end - 1) * dilation + group`` from
``neighborhood.dim_windows``); a key attends when, in every dimension, its coordinate lies in [lo, hi] and is
congruent to lo modulo the dilation. Coordinates are taken modulo each dimension's size, so the padded rows and
columns of the last tiles read inside the table. The block lists come from the exact mask, built on the device a few
query tiles at a time (``block_sparsity``).

Forward only. Written from FA4 4.0.0b36's source and tests; its kernels also compile for sm_90a on a machine without
a GPU (FA4's FakeTensorMode path, with FLASH_ATTENTION_ARCH and CUTE_DSL_ARCH set to sm_90a), for 1-, 2- and 3-D
layouts, head dims 64, 96 and 128 and GQA. On an H200 (run 209) its GPU test and NATTEN's 1-D, 2-D and 3-D cases
pass the accuracy gate.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..neighborhood import Neighborhood, dim_windows

FA4_VERSION = "4.0.0b36"  # the version whose source this module follows
MASK_ELEMENTS = 1 << 26  # (query, key) booleans per chunk when building the block lists


# ---------------------------------------------------------------------------------------------
# The mask's aux table and the block lists (torch only: they build and test without FA4)
# ---------------------------------------------------------------------------------------------

def mask_table(nb: Neighborhood, device=None) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The mask_mod's aux table: one int32 tensor holding, per dimension d of size L, ``lo`` (L values) then ``hi``
    (L values), the first and the last coordinate of each coordinate's window in that dimension; and the offsets of
    each dimension's ``lo`` and ``hi`` in it."""
    parts, lo_at, hi_at, at = [], [], [], 0
    for d in range(nb.dims):
        L, dil = nb.spatial[d], nb.dilation[d]
        g, _, start, end = dim_windows(L, nb.kernel_size[d], nb.stride[d], dil, nb.is_causal[d], device)
        parts += [start * dil + g, (end - 1) * dil + g]
        lo_at.append(at)
        hi_at.append(at + L)
        at += 2 * L
    return torch.cat(parts).to(torch.int32).contiguous(), tuple(lo_at), tuple(hi_at)


def _rows_mask(nb: Neighborhood, windows: list, rows: torch.Tensor) -> torch.Tensor:
    """[len(rows), N] bool: the query tokens ``rows`` attend each key (every dimension's window holds it)."""
    R = rows.numel()
    keep = None
    for d in range(nb.dims):
        g, p, start, end = windows[d]
        qc = (rows // math.prod(nb.spatial[d + 1:])) % nb.spatial[d]
        m = (g[qc][:, None] == g[None, :]) & (p[None, :] >= start[qc][:, None]) & (p[None, :] < end[qc][:, None])
        shape = [R] + [1] * nb.dims
        shape[d + 1] = nb.spatial[d]
        m = m.view(shape)
        keep = m if keep is None else keep & m
    return keep.reshape(R, nb.tokens)


def _block_lists(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile (row of ``selected``, [n_q_tiles, n_kv_tiles] bool): the count of selected key tiles and their
    indices in ascending order, [n_q_tiles] and [n_q_tiles, width] int32 (width: the largest count, at least 1;
    slots past a row's count hold 0, a valid tile, though FA4 reads only the first count)."""
    n_kv = selected.shape[1]
    cnt = selected.sum(-1)
    width = max(1, int(cnt.max())) if cnt.numel() else 1
    cols = torch.arange(n_kv, device=selected.device).expand_as(selected)
    idx = torch.where(selected, cols, torch.full_like(cols, n_kv)).sort(dim=-1).values[:, :width]
    idx = torch.where(idx == n_kv, torch.zeros_like(idx), idx)
    return cnt.to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()


def block_sparsity(nb: Neighborhood, tile_m: int, tile_n: int, device=None,
                   max_elements: int = MASK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's forward block lists for the pattern at tiles of ``tile_m`` queries and ``tile_n`` keys (of the tokens
    in row-major order): (mask_block_cnt [n_q], mask_block_idx [n_q, w], full_block_cnt [n_q], full_block_idx
    [n_q, w']), int32. A key tile is full for a query tile when every query of the tile inside the layout attends
    every one of its keys and the tile lies wholly inside the layout (the last, partial key tile is always a masked
    one, so FA4 masks its columns past the layout), masked when some pair is attended but not all, skipped when none
    is. Built from the exact mask on ``device``, about ``max_elements`` (query, key) pairs at a time."""
    N = nb.tokens
    n_q, n_kv = -(-N // tile_m), -(-N // tile_n)
    windows = [dim_windows(nb.spatial[d], nb.kernel_size[d], nb.stride[d], nb.dilation[d], nb.is_causal[d], device)
               for d in range(nb.dims)]
    cols_in = torch.full((n_kv,), tile_n, dtype=torch.long, device=device)
    cols_in[-1] = N - (n_kv - 1) * tile_n
    per_chunk = max(1, max_elements // (tile_m * n_kv * tile_n))
    masked, full = [], []
    for b0 in range(0, n_q, per_chunk):
        b1 = min(n_q, b0 + per_chunk)
        r0, r1 = b0 * tile_m, min(N, b1 * tile_m)
        keep = torch.zeros((b1 - b0) * tile_m, n_kv * tile_n, dtype=torch.bool, device=device)
        keep[:r1 - r0, :N] = _rows_mask(nb, windows, torch.arange(r0, r1, device=device))
        counts = keep.view(b1 - b0, tile_m, n_kv, tile_n).sum(dim=(1, 3))
        rows_in = (N - torch.arange(b0, b1, device=device) * tile_m).clamp(max=tile_m)
        whole = (counts == rows_in[:, None] * cols_in[None, :]) & (cols_in[None, :] == tile_n)
        full.append(whole)
        masked.append((counts > 0) & ~whole)
    mask_cnt, mask_idx = _block_lists(torch.cat(masked))
    full_cnt, full_idx = _block_lists(torch.cat(full))
    return mask_cnt, mask_idx, full_cnt, full_idx


# ---------------------------------------------------------------------------------------------
# FA4: the mask_mod, the tile size, the call
# ---------------------------------------------------------------------------------------------

def _make_mask_mod(spatial: tuple[int, ...], dilation: tuple[int, ...], lo_at: tuple[int, ...],
                   hi_at: tuple[int, ...]) -> Callable:
    """The CuTe mask_mod of a layout (sizes ``spatial``, ``dilation`` per dimension) reading ``mask_table``'s
    table (aux_tensors[0]) at offsets ``lo_at``/``hi_at``. Everything that shapes the generated code is a closure
    cell, so FA4's ``hash_callable`` tells layouts apart."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils as fa_utils

    dims = len(spatial)
    strides = tuple(math.prod(spatial[d + 1:]) for d in range(dims))

    @cute.jit
    def na_mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        table = aux_tensors[0]
        zero = fa_utils.scalar_to_ssa(0, cutlass.Int32)
        keep = q_idx >= zero
        for d in cutlass.range_constexpr(dims):
            stride = fa_utils.scalar_to_ssa(strides[d], cutlass.Int32)
            size = fa_utils.scalar_to_ssa(spatial[d], cutlass.Int32)
            qc = (q_idx // stride) % size
            kc = (kv_idx // stride) % size
            lo = fa_utils.scalar_to_ssa(table[qc[0] + lo_at[d]], cutlass.Int32)
            hi = fa_utils.scalar_to_ssa(table[qc[0] + hi_at[d]], cutlass.Int32)
            keep = keep & (kc >= lo) & (kc <= hi)
            if cutlass.const_expr(dilation[d] > 1):
                step = fa_utils.scalar_to_ssa(dilation[d], cutlass.Int32)
                keep = keep & (((kc - lo) % step) == zero)
        return keep

    return na_mask_mod


@dataclass(frozen=True)
class _Plan:
    """What one pattern needs on one device at one tile size, built once: the aux table, the mask_mod, the block
    lists (batch and head dimensions of size 1)."""
    table: torch.Tensor
    mask_mod: Callable
    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_cnt: torch.Tensor
    full_idx: torch.Tensor


@functools.lru_cache(maxsize=8)
def _plan(nb: Neighborhood, tile: tuple[int, int], device: str) -> _Plan:
    table, lo_at, hi_at = mask_table(nb, device)
    mask_mod = _make_mask_mod(nb.spatial, nb.dilation, lo_at, hi_at)
    mask_cnt, mask_idx, full_cnt, full_idx = block_sparsity(nb, tile[0], tile[1], device)
    return _Plan(table, mask_mod, *(t[None, None] for t in (mask_cnt, mask_idx, full_cnt, full_idx)))


def _sm90_tile(fa_interface, unsupported, head_dim: int, head_dim_v: int, block_size) -> tuple[int, int]:
    """The (tile_m, tile_n) FA4's sm_90 forward runs a mask_mod problem at (neither causal nor local: a mask_mod
    turns both off), or the given ``block_size``, checked to be a tile FA4 then runs as it is."""
    pick = getattr(fa_interface, "_tile_size_fwd_sm90", None)
    fit = getattr(fa_interface, "_fit_sm90_fwd_tile_to_block_sparsity", None)
    if pick is None or fit is None:
        raise unsupported(f"fa4: this flash_attn.cute has no _tile_size_fwd_sm90/_fit_sm90_fwd_tile_to_block_sparsity "
                          f"(the sm_90 tile choice this provider follows, from FA4 {FA4_VERSION})")
    if block_size is None:
        cfg = pick(head_dim, head_dim_v, False, False)
        block_size = (cfg.m_block_size, cfg.n_block_size)
    block_size = (int(block_size[0]), int(block_size[1]))
    cfg = fit(pick(head_dim, head_dim_v, False, False, sparse_block_size_q=block_size[0]), *block_size)
    if (cfg.m_block_size, cfg.n_block_size) != block_size:
        raise unsupported(f"fa4: at head dims ({head_dim}, {head_dim_v}) FA4's sm_90 forward runs blocks of "
                          f"{block_size} as {cfg.m_block_size} x {cfg.n_block_size} tiles; give a block size it keeps")
    return block_size


def fa4_na_call(nb: Neighborhood, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                *, block_size: Optional[tuple[int, int]] = None) -> Callable[[], torch.Tensor]:
    """A callable of no arguments running FA4's sm_90 forward on the neighborhood pattern ``nb`` and returning the
    output [B, N, H, Dv] (N = nb.tokens, row-major over the layout): q [B, *spatial, H, D], k and v
    [B, *spatial, H_KV, D] / [.., Dv] CUDA fp16 or bf16 tensors (H_KV dividing H). ``scale`` defaults to D ** -0.5;
    ``block_size`` (query, key tokens) to the tile FA4 picks for the head dims. The aux table, the mask_mod and the
    block lists are built here, once per pattern, device and tile (and cached); the callable only launches.

    Raises ``bench.refusal.Unsupported`` naming what FA4 lacks: not importable, not an sm_90 GPU (this provider
    follows the sm_90 path: on sm_100 the query blocks are two tiles, q_stage 2), a dtype other than fp16/bf16 (FA4's
    fp8 forward is sm_100 only), head dims outside 8-256 or not multiples of 8, H not a multiple of H_KV."""
    from .refusal import Unsupported

    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute import interface as fa_interface
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception as exc:  # (ImportError, or the CuTe DSL failing to load)
        raise Unsupported(f"fa4: FlashAttention-4 (flash_attn.cute, flash-attn-4) is not importable: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

    dims = nb.dims
    if any(t.dim() != dims + 3 for t in (q, k, v)) or tuple(q.shape[1:dims + 1]) != nb.spatial or \
            tuple(k.shape[:dims + 1]) != tuple(q.shape[:dims + 1]) or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"fa4: q, k and v must be [B, {', '.join(map(str, nb.spatial))}, heads, head_dim] (k and v "
                         f"sharing their heads); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.device.type != "cuda":
        raise Unsupported("fa4: FA4's kernels run on CUDA")
    arch = torch.cuda.get_device_capability(q.device)
    fa_arch = getattr(fa_interface, "_get_device_arch", None)
    fa_arch = fa_arch() if fa_arch is not None else arch[0] * 10 + arch[1]
    if arch[0] != 9 or fa_arch // 10 != 9:
        raise Unsupported(f"fa4: this provider runs FA4's sm_90 forward (mask_mod with block sparsity at sm_90 tiles); "
                          f"this GPU is sm_{arch[0]}{arch[1]}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise Unsupported(f"fa4: FA4's sm_90 forward takes fp16 or bf16 (its fp8 forward is sm_100 only); got "
                          f"{q.dtype}, {k.dtype}, {v.dtype}")
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    H_KV, Dv = k.shape[-2], v.shape[-1]
    if not all(8 <= d <= 256 and d % 8 == 0 for d in (D, Dv)):
        raise Unsupported(f"fa4: FA4's sm_90 forward takes head dims from 8 to 256 in multiples of 8; got ({D}, {Dv})")
    if H % H_KV:
        raise Unsupported(f"fa4: FA4 shares each K/V head among H / H_KV query heads; H={H} is not a multiple of "
                          f"H_KV={H_KV}")

    tile = _sm90_tile(fa_interface, Unsupported, D, Dv, block_size)
    plan = _plan(nb, tile, str(q.device))
    # batch and head dimensions of size 1: FA4 broadcasts them (normalize_block_sparse_tensors), and a head
    # dimension of 1 keeps PackGQA on for GQA
    sparse = BlockSparseTensorsTorch(mask_block_cnt=plan.mask_cnt, mask_block_idx=plan.mask_idx,
                                     full_block_cnt=plan.full_cnt, full_block_idx=plan.full_idx, block_size=tile)
    N = nb.tokens
    qf, kf, vf = (t.reshape(B, N, t.shape[-2], t.shape[-1]) for t in (q, k, v))
    aux, mask_mod = [plan.table], plan.mask_mod

    def call() -> torch.Tensor:
        out, _ = flash_attn_func(qf, kf, vf, softmax_scale=scale, mask_mod=mask_mod, aux_tensors=aux,
                                 block_sparse_tensors=sparse)
        return out

    return call
