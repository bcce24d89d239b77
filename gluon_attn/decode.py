"""A few queries against many keys (decode, speculative steps), as FlashAttention's split-KV decode does it:

- the query heads that share a K/V head become rows of one tile (``G x N_Q`` rows, at most one tile's), so each
  K/V block is read once for all of them instead of once per query head;
- the keys are split into ``splits`` equal chunks, each its own unit of work, so that a batch of few K/V heads
  still fills the GPU; each chunk's output and lse come back and are combined by their lse (FlashDecoding);
- keys that not every query sees (causal: the last N_Q - 1) and what the equal chunks leave over run as an ordinary
  call with the causal mask, combined the same way.

The chunks are views: K [Z, H_KV, N_KV, D] whose batch and head dims merge (a contiguous cache) is seen as
[splits, Z * H_KV, chunk, D]; the queries are copied into the matching [splits, Z * H_KV, rows, D] (a few rows).
``plan`` is pure arithmetic (tested without a GPU); ``run`` launches through the backend and combines the parts
in one more launch (``combine``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_N = 128  # keys per block of the cost model (the kernel's at D <= 128)
MIN_KEYS = 1024  # fewer keys: the ordinary launch, without costing the split
MIN_CHUNK = 256  # keys per chunk at least (two blocks)
MAX_SPLITS = 64
# The cost model, in the time of one key block of a decode step (~1.5 us on the H100, run 189). The GPU's: key
# blocks per program, round by round, a unit's own work (its Q, its output and lse) about one block more, each
# extra launch (the tail's, the combine's) about two; and no faster than the cache's bytes from memory allow
# (K and V read once: KV_BYTES_PER_BLOCK, ~3 TB/s for one block's time). The host's: a call's Python and
# launches, which run ahead of the GPU, so a call takes the longer of the two. Measured with the GPU's launch
# queue kept short (run 189, H100): the ordinary launch ~90 us of host work, the split ~175 us (the query copy,
# the chunks' launch, the combine's), ~50 us more with a tail's launch. (Those calls went through the custom op,
# whose ~50 us plain eager calls now skip; hosts differ between machines by more than that: NOTES v58.)
UNIT_BLOCKS = 1
EXTRA_LAUNCH_BLOCKS = 2
KV_BYTES_PER_BLOCK = 4.5e6
ORDINARY_HOST_BLOCKS = 60
SPLIT_HOST_BLOCKS = 117
TAIL_HOST_BLOCKS = 35


@dataclass(frozen=True)
class DecodePlan:
    splits: int  # equal key chunks, one launch
    chunk: int  # keys per chunk: the chunks cover keys [0, splits * chunk)
    rows: int  # packed rows per K/V head and chunk: G * N_Q
    tail: int  # keys [splits * chunk, N_KV), run with q as given (and the causal mask)


def mergeable(t: torch.Tensor) -> bool:
    """Whether [Z, H, N, D] ``t``'s batch and head dims merge into one (a cache laid out [Z, H, N, D])."""
    return t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


@functools.lru_cache(maxsize=4096)
def plan(Z: int, H: int, H_KV: int, N_Q: int, N_KV: int, causal: bool, block_m: int, sms: int,
         kv_mergeable: bool = True, host: bool = True, head_dim: int = 128) -> Optional[DecodePlan]:
    """How to run a short-query problem as packed, split units; None where the ordinary launch is the one to use
    (more packed rows than a tile holds, few keys, a K/V layout the chunk view cannot take, or no gain).
    ``host=False`` leaves the host's work out of the costs (CUDA-graph replay)."""
    G = H // H_KV
    rows = G * N_Q
    if rows > block_m or N_KV < MIN_KEYS or not kv_mergeable or N_Q > N_KV:
        return None
    # The cache's bytes (16-bit K and V) bound either way of running it.
    memory = Z * H_KV * N_KV * head_dim * 4 / KV_BYTES_PER_BLOCK
    # Keys every query sees; causal, the last N_Q - 1 are masked for some rows and go to the tail.
    seen = N_KV - N_Q + 1 if causal else N_KV
    best = None
    for splits in range(1, MAX_SPLITS + 1):
        chunk = seen // splits
        if splits > 1 and chunk < MIN_CHUNK:
            break
        tail = N_KV - splits * chunk
        gpu = triton.cdiv(Z * H_KV * splits, sms) * (triton.cdiv(chunk, BLOCK_N) + UNIT_BLOCKS) + EXTRA_LAUNCH_BLOCKS
        if tail:
            gpu += EXTRA_LAUNCH_BLOCKS + triton.cdiv(Z * H, sms) * (triton.cdiv(tail, BLOCK_N) + UNIT_BLOCKS)
        cost = (max(gpu, memory, host * (SPLIT_HOST_BLOCKS + bool(tail) * TAIL_HOST_BLOCKS)), gpu)
        if best is None or cost < best[0]:
            best = (cost, DecodePlan(splits, chunk, rows, tail))
    direct = max(triton.cdiv(Z * H, sms) * (triton.cdiv(N_KV, BLOCK_N) + UNIT_BLOCKS), memory,
                 host * ORDINARY_HOST_BLOCKS)
    if best is None or (best[1].splits == 1 and G == 1 and not best[1].tail) or best[0][0] >= direct:
        return None
    return best[1]


def _chunks(t: torch.Tensor, p: DecodePlan) -> torch.Tensor:
    """K or V [Z, H_KV, N_KV, D] -> its first splits * chunk keys as [splits, Z * H_KV, chunk, D] (a view)."""
    Z, H_KV, _, D = t.shape
    return t.as_strided((p.splits, Z * H_KV, p.chunk, D), (p.chunk * t.stride(2), t.stride(1), t.stride(2),
                                                          t.stride(3)), t.storage_offset())


def run(launch, q, k, v, p: DecodePlan, *, causal: bool, sm_scale, return_lse: bool, out: torch.Tensor):
    """Attention of q [Z, H, N_Q, D] against k, v [Z, H_KV, N_KV, D] by plan ``p``, into ``out`` (q's shape).
    ``launch(q, k, v, causal=..., return_lse=True, sm_scale=..., out=...)`` -> (out, lse) is the backend's launch.
    Decode steps are short on the GPU, so the host work is a handful of tensor ops: one copy of the queries, the
    launches (the tail writes into the chunks' output buffer), and the combine's."""
    Z, H, N_Q, D = q.shape
    H_KV = k.shape[1]
    G = H // H_KV
    parts = p.splits + bool(p.tail)
    # Rows (g, n) of K/V head kv: query head kv * G + g, query n; the same rows for every chunk.
    qp = torch.empty((p.splits, Z, H_KV, G, N_Q, D), dtype=q.dtype, device=q.device)
    qp.copy_(q.unflatten(1, (H_KV, G)).unsqueeze(0).expand(qp.shape))
    qp = qp.view(p.splits, Z * H_KV, p.rows, D)
    o_parts = torch.empty((parts, Z, H, N_Q, D), dtype=out.dtype, device=q.device)
    _, lse_chunks = launch(qp, _chunks(k, p), _chunks(v, p), causal=False, return_lse=True, sm_scale=sm_scale,
                           out=o_parts[:p.splits].view(qp.shape))
    lse_tail = None
    if p.tail:
        keys = slice(p.splits * p.chunk, None)
        _, lse_tail = launch(q, k[:, :, keys], v[:, :, keys], causal=causal, return_lse=True, sm_scale=sm_scale,
                             out=o_parts[p.splits])
    lse = combine(o_parts, lse_chunks, lse_tail, out)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# The combine: out = sum_p exp(lse_p - lse) o_p, lse = logsumexp_p lse_p, row by row
# ---------------------------------------------------------------------------------------------
COMBINE_WARPS = 4
COMBINE_ELEMS = 2048  # output elements of one chunk of parts a program loads at once (16 per thread)


@triton.jit
def _part_lse(lse_ptr, lse_tail_ptr, part, row, R, SPLITS: tl.constexpr, PARTS: tl.constexpr):
    """The lse of parts ``part`` of ``row``: a chunk's from [SPLITS, R], the tail's (part SPLITS) from [R]; -inf
    past the parts."""
    lse_p = tl.load(lse_ptr + part.to(tl.int64) * R + row, mask=part < SPLITS, other=-float("inf"))
    if PARTS > SPLITS:
        lse_p = tl.where(part == SPLITS, tl.load(lse_tail_ptr + row), lse_p)
    return lse_p


@triton.jit(do_not_specialize=["R", "H", "N_Q", "s_z", "s_h", "s_n"])
def _combine_kernel(o_ptr, lse_ptr, lse_tail_ptr, out_ptr, lse_out_ptr, R, H, N_Q, s_z, s_h, s_n,
                    SPLITS: tl.constexpr, PARTS: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr,
                    CHUNK_P: tl.constexpr):
    """One row (z, h, n) of R = Z * H * N_Q: its parts' lse, then their outputs ([PARTS, R, D], the tail's last)
    CHUNK_P parts at a time, weighed by exp(lse_p - max) and summed in fp32."""
    row = tl.program_id(0).to(tl.int64)
    # Every row sees a chunk's keys, so the max is finite; a tail that saw no key (lse -inf) weighs 0.
    m = tl.max(_part_lse(lse_ptr, lse_tail_ptr, tl.arange(0, BLOCK_P), row, R, SPLITS, PARTS), 0)
    d = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    total = 0.0
    for p0 in tl.static_range(0, PARTS, CHUNK_P):
        part = p0 + tl.arange(0, CHUNK_P)
        w = tl.exp(_part_lse(lse_ptr, lse_tail_ptr, part, row, R, SPLITS, PARTS) - m)
        o = tl.load(o_ptr + (part.to(tl.int64) * R + row)[:, None] * D + d[None, :], mask=(part < PARTS)[:, None],
                    other=0.0)
        acc += tl.sum(o.to(tl.float32) * w[:, None], 0)
        total += tl.sum(w, 0)
    n = row % N_Q
    zh = row // N_Q
    z = zh // H
    tl.store(out_ptr + z * s_z + (zh - z * H) * s_h + n * s_n + d, (acc / total).to(out_ptr.dtype.element_ty))
    tl.store(lse_out_ptr + row, m + tl.log(total))


def combine(o_parts: torch.Tensor, lse_chunks: torch.Tensor, lse_tail: Optional[torch.Tensor],
            out: torch.Tensor) -> torch.Tensor:
    """Combine the parts of a split decode into ``out`` [Z, H, N_Q, D] (unit last stride) and return its lse
    [Z, H, N_Q]: ``o_parts`` [parts, Z, H, N_Q, D] (the chunks', then the tail's if any), ``lse_chunks`` the
    chunks' lse (their rows in the order (z, h, n)), ``lse_tail`` the tail's [Z, H, N_Q] or None. One launch on
    the GPU (``_combine_kernel``); PyTorch's ops elsewhere, and the kernel's reference in the tests."""
    parts, Z, H, N_Q, D = o_parts.shape
    splits = parts - (lse_tail is not None)
    lse_parts = lse_chunks.reshape(splits, Z, H, N_Q)
    if not o_parts.is_cuda:
        if lse_tail is not None:
            lse_parts = torch.cat([lse_parts, lse_tail.unsqueeze(0)])
        lse = torch.logsumexp(lse_parts, 0)
        weights = (lse_parts - lse).exp_().unsqueeze(-1)
        out.copy_((o_parts * weights).sum(0))
        return lse
    from .kernels.launch import launch_cached, placeholder

    assert out.stride(3) == 1 and o_parts.is_contiguous() and lse_parts.is_contiguous(), "combine's layouts"
    R = Z * H * N_Q
    lse = torch.empty((Z, H, N_Q), dtype=torch.float32, device=out.device)
    tail = lse_tail if lse_tail is not None else placeholder(out.device, torch.float32)
    consts, key = _combine_plan(splits, parts, D, o_parts.dtype, out.dtype)
    args = (o_parts, lse_parts, tail, out, lse, R, H, N_Q, out.stride(0), out.stride(1), out.stride(2))
    launch_cached(_combine_kernel, COMBINE_WARPS, R, args, consts, out.device, key=key)
    return lse


@functools.lru_cache(maxsize=256)
def _combine_plan(splits: int, parts: int, D: int, dtype: torch.dtype, out_dtype: torch.dtype):
    """The combine's constexprs and its launch key, once per (splits, parts, D, dtypes): a decode step's host
    time is the step's time where the GPU's is short."""
    block_p = triton.next_power_of_2(parts)
    consts = dict(SPLITS=splits, PARTS=parts, D=D, BLOCK_P=block_p, CHUNK_P=min(block_p, COMBINE_ELEMS // D))
    return consts, (_combine_kernel, dtype, out_dtype, *consts.values())
