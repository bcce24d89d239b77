"""A few queries against many keys (decode, speculative steps), as FlashAttention's split-KV decode does it:

- the query heads that share a K/V head become rows of one tile (``G x N_Q`` rows, at most one tile's), so each
  K/V block is read once for all of them instead of once per query head;
- the keys are split into ``splits`` equal chunks, each its own unit of work, so that a batch of few K/V heads
  still fills the GPU; each chunk's output and lse come back and are combined by their lse (FlashDecoding);
- keys that not every query sees (causal: the last N_Q - 1) and what the equal chunks leave over form the tail:
  an ordinary call with the causal mask, or (up to ``FUSED_TAIL_KEYS``, where the plan finds it shorter) attended
  to by the combine's kernel itself in fp32; either way the tail is one more part of the combine.

The chunks are views: K [Z, H_KV, N_KV, D] whose batch and head dims merge (a contiguous cache) is seen as
[splits, Z * H_KV, chunk, D]; the queries are copied into the matching [splits, Z * H_KV, rows, D] (a few rows).
``plan`` is pure arithmetic (tested without a GPU); ``run`` launches through the backend and combines the parts
in one more launch (``combine``), or, without a tail or with one the last chunk takes (``DecodePlan.absorbed``), in
the chunks' launch itself (``combined``: the last warpgroup of each K/V head to finish combines its parts).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl

from .cache import shallow_copy
from .kernels import launch_module, next_power_of_2
from .kernels.tuning import context_bucket


BLOCK_N = 128  # keys per block of the cost model (the kernel's at D <= 128)
MIN_KEYS = 1024  # fewer keys: the ordinary launch, without costing the split
MIN_CHUNK = 256  # keys per chunk at least (two blocks)
MAX_SPLITS = 64
# The cost model, in the time of one key block of a decode step (~1.5 us on the H100, run 189; 1.5-1.8 on the H200,
# run 269). The GPU's: key blocks per program, round by round, a unit's own work (its Q, its output and lse) about one
# block more, each extra launch (the tail's, the combine's) about two; and no faster than the cache's bytes from
# memory allow (K and V read once: KV_BYTES_PER_BLOCK, ~3 TB/s for one block's time). The host's: a call's Python
# and launches, which run ahead of the GPU, so a call takes the longer of the two. Measured as a model calls it
# (experiments/decode_routes.py, H200, runs 269-273, slow hosts: SDPA's step 19-46 us): the ordinary launch 13-24
# us of host work, the split 23-41 us (two launches); a fast host takes about half (runs 266-267). The costs are a
# slow host's, so that the split is taken where it wins there too; a tail's own launch is one more prepared launch.
# (Before ``PreparedSplit`` took tails, a split with one, fused or not, cost 130-245 us: runs 270-273. Run 189's ~90
# and ~175 us went through the custom op, which plain eager calls now skip, NOTES v58; with those costs the plan ran
# batch-1 steps of 4k-8k keys on the ordinary launch at 1.3-2.3x the split's time, NOTES v117.)
UNIT_BLOCKS = 1
EXTRA_LAUNCH_BLOCKS = 2
KV_BYTES_PER_BLOCK = 4.5e6
ORDINARY_HOST_BLOCKS = 12
SPLIT_HOST_BLOCKS = 20
TAIL_HOST_BLOCKS = 4
# A tail of up to this many keys may be computed inside the combine: no launch of its own and none of its host
# work, but each of the combine's programs reads its row's K/V tail (4 bytes a key and dimension, from L2), which
# took ~6 us more GPU time than the tail's own launch at 16 keys, Z x H x N_Q = 4096 rows, D=128 (run 197, H100:
# 34 MB in ~10 blocks' time). The plan costs both ways.
FUSED_TAIL_KEYS = 64
FUSED_TAIL_BYTES_PER_BLOCK = 3.4e6


@dataclass(frozen=True)
class DecodePlan:
    splits: int  # equal key chunks, one launch
    chunk: int  # keys per chunk: the chunks cover keys [0, splits * chunk)
    rows: int  # packed rows per K/V head and chunk: G * N_Q
    tail: int  # keys [splits * chunk, N_KV), run with q as given (and the causal mask)
    fused_tail: bool = False  # the combine's kernel attends to the tail itself (no launch of its own)
    # The last chunk attends to the tail (keys every query sees: the equal chunks' remainder) in the chunks' launch
    # where it combines its parts (``combined``): its view longer by the tail. Elsewhere the tail is a launch.
    absorbed: bool = False


def mergeable(t: torch.Tensor) -> bool:
    """Whether [Z, H, N, D] ``t``'s batch and head dims merge into one (a cache laid out [Z, H, N, D])."""
    return t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


_PLANS: dict = {}  # (``plan``'s arguments but N_KV) -> {N_KV: its plan}
_MAX_FAMILIES, _MAX_COUNTS = 64, 4096  # (the bound: a family's counts forgotten at once, the families likewise)
PLAN_AHEAD = 64  # a growing cache's counts planned at once
GROWTH = 16  # a cache grows by at most this many keys a step (speculative steps) where ``plan`` plans ahead


def plan(Z: int, H: int, H_KV: int, N_Q: int, N_KV: int, causal: bool, block_m: int, sms: int,
         kv_mergeable: bool = True, host: bool = True, head_dim: int = 128, absorb: bool = False
         ) -> Optional[DecodePlan]:
    """How to run a short-query problem as packed, split units; None where the ordinary launch is the one to use
    (more packed rows than a tile holds, few keys, a K/V layout the chunk view cannot take, or no gain).
    ``host=False`` leaves the host's work out of the costs (CUDA-graph replay). ``absorb``: the chunks' launch
    combines its parts (the backend's COMBINE tiles), so that a tail every query sees goes into the last chunk
    (``DecodePlan.absorbed``): one launch.

    Kept per count (bounded). A cache that grows at every step asks for a new count each time: where one of the
    ``GROWTH`` counts before was planned, this one and the next ``PLAN_AHEAD - 1`` are planned at once (``plans``, the
    same arithmetic over arrays), so that a step's plan is a lookup."""
    family = (Z, H, H_KV, N_Q, causal, block_m, sms, kv_mergeable, host, head_dim, absorb)
    counts = _PLANS.get(family)
    if counts is None:
        if len(_PLANS) >= _MAX_FAMILIES:
            _PLANS.clear()
        counts = _PLANS[family] = {}
    elif N_KV in counts:
        return counts[N_KV]
    if len(counts) >= _MAX_COUNTS:
        counts.clear()
    if any(N_KV - d in counts for d in range(1, GROWTH + 1)):
        made = plans(*family[:4], range(N_KV, N_KV + PLAN_AHEAD), *family[4:])
        counts.update(zip(range(N_KV, N_KV + PLAN_AHEAD), made))
        return made[0]
    p = counts[N_KV] = plan_one(Z, H, H_KV, N_Q, N_KV, causal, block_m, sms, kv_mergeable, host, head_dim, absorb)
    return p


def clear_plans() -> None:
    """Forget every plan kept (``plan``): a test that changes the cost model's constants calls it."""
    _PLANS.clear()


def plan_one(Z: int, H: int, H_KV: int, N_Q: int, N_KV: int, causal: bool, block_m: int, sms: int,
             kv_mergeable: bool = True, host: bool = True, head_dim: int = 128, absorb: bool = False
             ) -> Optional[DecodePlan]:
    """``plan`` of one count of keys, made (not kept)."""
    G = H // H_KV
    rows = G * N_Q
    if rows > block_m or N_KV < MIN_KEYS or not kv_mergeable or N_Q > N_KV:
        return None
    # The cache's bytes (16-bit K and V) bound either way of running it.
    memory = Z * H_KV * N_KV * head_dim * 4 / KV_BYTES_PER_BLOCK
    # Keys every query sees; causal, the last N_Q - 1 are masked for some rows and go to the tail.
    seen = N_KV - N_Q + 1 if causal else N_KV
    # (A growing cache asks for a new count of keys every step: the loop is plain integer arithmetic, -(-a // b) for
    # cdiv, and a plan is made for the best candidate only.)
    units, tail_units = Z * H_KV, -(-Z * H // sms)
    fused_per_key = Z * H * N_Q * head_dim * 4 / FUSED_TAIL_BYTES_PER_BLOCK
    split_host, tail_host = host * SPLIT_HOST_BLOCKS, host * (SPLIT_HOST_BLOCKS + TAIL_HOST_BLOCKS)
    best = best_cost = None
    for splits in range(1, MAX_SPLITS + 1):
        chunk = seen // splits
        if splits > 1 and chunk < MIN_CHUNK:
            break
        tail = N_KV - splits * chunk
        gpu = -(-units * splits // sms) * (-(-chunk // BLOCK_N) + UNIT_BLOCKS) + EXTRA_LAUNCH_BLOCKS
        if not tail or (absorb and seen == N_KV):
            # (absorbed: the last chunk's units take the tail's keys too, fewer than the splits; costed as if every
            # unit did, an upper bound)
            gpu += -(-units * splits // sms) * (-(-(chunk + tail) // BLOCK_N) + (chunk // -BLOCK_N))
            cost = (max(gpu, memory, split_host), gpu)
            if best_cost is None or cost < best_cost:
                best, best_cost = (splits, chunk, tail, False, tail > 0), cost
            continue
        # The tail as a launch of its own, or inside the combine where it is short enough.
        t_gpu = gpu + EXTRA_LAUNCH_BLOCKS + tail_units * (-(-tail // BLOCK_N) + UNIT_BLOCKS)
        cost = (max(t_gpu, memory, tail_host), t_gpu)
        if best_cost is None or cost < best_cost:
            best, best_cost = (splits, chunk, tail, False, False), cost
        if tail <= FUSED_TAIL_KEYS:
            f_gpu = gpu + fused_per_key * tail
            cost = (max(f_gpu, memory, split_host), f_gpu)
            if cost < best_cost:
                best, best_cost = (splits, chunk, tail, True, False), cost
    direct = max(-(-Z * H // sms) * (-(-N_KV // BLOCK_N) + UNIT_BLOCKS), memory, host * ORDINARY_HOST_BLOCKS)
    if best is None or (best[0] == 1 and G == 1 and not best[2]) or best_cost[0] >= direct:
        return None
    return DecodePlan(best[0], best[1], rows, best[2], best[3], best[4])


def plans(Z: int, H: int, H_KV: int, N_Q: int, counts, causal: bool, block_m: int, sms: int,
          kv_mergeable: bool = True, host: bool = True, head_dim: int = 128, absorb: bool = False) -> list:
    """``plan_one`` of each count of keys in ``counts``, the same arithmetic over [counts, splits] arrays: every
    split count's cost (the chunks with no tail or an absorbed one; else the tail's launch, then the fused tail),
    the first least (cost, GPU time) in ``plan_one``'s order of candidates taken. float64 holds every cost exactly
    as Python's floats do."""
    n = np.asarray(counts, dtype=np.int64)
    G = H // H_KV
    rows = G * N_Q
    if rows > block_m or not kv_mergeable:
        return [None] * len(n)
    memory = Z * H_KV * n * head_dim * 4 / KV_BYTES_PER_BLOCK
    seen = n - N_Q + 1 if causal else n
    units, tail_units = Z * H_KV, -(-Z * H // sms)
    fused_per_key = Z * H * N_Q * head_dim * 4 / FUSED_TAIL_BYTES_PER_BLOCK
    split_host, tail_host = host * SPLIT_HOST_BLOCKS, host * (SPLIT_HOST_BLOCKS + TAIL_HOST_BLOCKS)
    # (more splits than the longest chunks allow are never valid)
    splits = np.arange(1, max(1, min(MAX_SPLITS, int(seen.max()) // MIN_CHUNK)) + 1, dtype=np.int64)
    chunk = seen[:, None] // splits
    tail = n[:, None] - splits * chunk
    # (split counts past the first whose chunks are short: ``plan_one``'s loop stops there; chunks shrink with them)
    valid = (splits == 1) | (chunk >= MIN_CHUNK)
    rounds = -(-units * splits // sms)
    gpu = rounds * (-(-chunk // BLOCK_N) + UNIT_BLOCKS) + EXTRA_LAUNCH_BLOCKS
    whole = (tail == 0) | (absorb & (seen == n))[:, None]
    w_gpu = gpu + rounds * (-(-(chunk + tail) // BLOCK_N) + chunk // -BLOCK_N)
    t_gpu = gpu + EXTRA_LAUNCH_BLOCKS + tail_units * (-(-tail // BLOCK_N) + UNIT_BLOCKS)
    a_gpu = np.where(whole, w_gpu, t_gpu).astype(np.float64)
    a_cost = np.maximum(np.maximum(a_gpu, memory[:, None]), np.where(whole, split_host, tail_host))
    f_gpu = gpu + fused_per_key * tail
    f_cost = np.maximum(np.maximum(f_gpu, memory[:, None]), split_host)
    fused_ok = valid & ~whole & (tail <= FUSED_TAIL_KEYS)
    inf = np.inf
    # Candidates in plan_one's order: for each split count, the first form, then the fused tail.
    cost = np.stack([np.where(valid, a_cost, inf), np.where(fused_ok, f_cost, inf)], 2).reshape(len(n), -1)
    second = np.stack([a_gpu, f_gpu], 2).reshape(len(n), -1)
    least = cost == cost.min(1, keepdims=True)
    second = np.where(least, second, inf)
    pick = np.argmax(least & (second == second.min(1, keepdims=True)), 1)
    at = np.arange(len(n))
    s, form = pick // 2, pick % 2
    best_cost = cost[at, pick]
    direct = np.maximum(np.maximum(-(-Z * H // sms) * (-(-n // BLOCK_N) + UNIT_BLOCKS), memory),
                        host * ORDINARY_HOST_BLOCKS)
    chunk, tail, whole = chunk[at, s], tail[at, s], whole[at, s]  # (the picked candidate's)
    none = (n < MIN_KEYS) | (N_Q > n) | ((s == 0) & (G == 1) & (tail == 0)) | (best_cost >= direct)
    c, t, whole = chunk.tolist(), tail.tolist(), whole.tolist()
    out = []
    for i, (skip, si, fused) in enumerate(zip(none.tolist(), s.tolist(), form.tolist())):
        out.append(None if skip else DecodePlan(si + 1, c[i], rows, t[i], bool(fused),
                                                not fused and whole[i] and t[i] > 0))
    return out


def _chunks(t: torch.Tensor, p: DecodePlan, absorbed: bool = False) -> torch.Tensor:
    """K or V [Z, H_KV, N_KV, D] -> its first splits * chunk keys as [splits, Z * H_KV, chunk, D] (a view);
    ``absorbed``: [splits, Z * H_KV, chunk + tail, D], each chunk's view longer by the tail's keys (the next chunk's
    first, which the kernel masks; the last chunk's are the tail, which it attends to: ``Shape.LAST_KEYS``)."""
    return t.as_strided(*_chunk_layout(t.shape, t.stride(), p, absorbed), t.storage_offset())


def _chunk_layout(shape, strides, p: DecodePlan, absorbed: bool = False) -> tuple:
    """``_chunks``' view's shape and strides (lists), from K's or V's."""
    Z, H_KV, _, D = shape
    return ([p.splits, Z * H_KV, p.chunk + p.tail * absorbed, D],
            [p.chunk * strides[2], strides[1], strides[2], strides[3]])


def run(launch, q, k, v, p: DecodePlan, *, causal: bool, sm_scale, return_lse: bool, out: torch.Tensor):
    """Attention of q [Z, H, N_Q, D] against k, v [Z, H_KV, N_KV, D] by plan ``p``, into ``out`` (q's shape).
    ``launch(q, k, v, causal=..., return_lse=True, sm_scale=..., out=...)`` -> (out, lse) is the backend's launch.
    Decode steps are short on the GPU, so the host work is a handful of tensor ops: one copy of the queries, the
    launches (the tail writes into the chunks' output buffer), and the combine's."""
    Z, H, N_Q, D = q.shape
    H_KV = k.shape[1]
    G = H // H_KV
    parts = p.splits + (p.tail > 0 and not p.fused_tail)
    # Rows (g, n) of K/V head kv: query head kv * G + g, query n; the same rows for every chunk.
    qp = torch.empty((p.splits, Z, H_KV, G, N_Q, D), dtype=q.dtype, device=q.device)
    qp.copy_(q.unflatten(1, (H_KV, G)).unsqueeze(0).expand(qp.shape))
    qp = qp.view(p.splits, Z * H_KV, p.rows, D)
    o_parts = torch.empty((parts, Z, H, N_Q, D), dtype=out.dtype, device=q.device)
    if combined(p, return_lse, out, q.dtype):
        # (the chunks' launch combines its parts: the backend's COMBINE, its counters zeroed per call here, the last
        # chunk the tail's keys too where absorbed; None where the chunks' tiles do not combine: the prepared
        # launch's ``combines``, and the tail is a launch as below)
        counters = torch.zeros(Z * H_KV, dtype=torch.int32, device=q.device)
        last = p.tail * p.absorbed
        if launch(qp, _chunks(k, p, p.absorbed), _chunks(v, p, p.absorbed), causal=False, return_lse=True,
                  sm_scale=sm_scale, out=o_parts[:p.splits].view(qp.shape), combine=(out, counters, last)) is not None:
            return out
    _, lse_chunks = launch(qp, _chunks(k, p), _chunks(v, p), causal=False, return_lse=True, sm_scale=sm_scale,
                           out=o_parts[:p.splits].view(qp.shape))
    lse_tail = tail = None
    if p.fused_tail:
        tail = TailKeys(q, k, v, p.splits * p.chunk, causal, D ** -0.5 if sm_scale is None else sm_scale)
    elif p.tail:
        keys = slice(p.splits * p.chunk, None)
        _, lse_tail = launch(q, k[:, :, keys], v[:, :, keys], causal=causal, return_lse=True, sm_scale=sm_scale,
                             out=o_parts[p.splits])
    lse = combine(o_parts, lse_chunks, lse_tail, out, tail)
    return (out, lse) if return_lse else out


def combined(p: DecodePlan, return_lse: bool, out: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the chunks' launch combines its parts itself (the kernel's COMBINE: the last warpgroup of each K/V head
    to finish reads the others' parts), so that a split is one launch: no tail or an absorbed one, the lse not
    returned (the parts' is), 16-bit, and the output's rows one after another as in a contiguous [Z, H, N_Q, D] (the
    parts' row order)."""
    Z, H, N_Q, D = out.shape
    sz, sh, sn, sd = out.stride()
    return ((not p.tail or p.absorbed) and not return_lse and out.dtype == dtype
            and dtype in (torch.float16, torch.bfloat16) and sd == 1 and (N_Q == 1 or sn == D)
            and (H == 1 or sh == N_Q * D) and (Z == 1 or sz == H * N_Q * D))


class PreparedSplit:
    """``run`` of one call signature (q, k, v's shapes, strides, dtype, device; the plan and options) with its
    launches prepared (the backend's ``prepare``d chunk and tail launches, the combine's direct launch and its fixed
    arguments, or the chunks' launch alone where it combines: ``combined``, ``one_launch``): a call makes the output
    (and the lse where it is returned) and one workspace (the parts' outputs and lse's, at fixed byte offsets, and
    the queries copied for every chunk where the chunks cannot read q itself with a split stride of 0,
    ``_packed_query_strides``) and launches by address. ``make`` returns None where a part cannot be prepared (then
    ``run`` serves the signature); a call returns None where it cannot launch (an address TMA cannot take, a
    profiler hook), and the caller runs ``run``."""

    @staticmethod
    def make(prepare, q, k, v, p: DecodePlan, *, causal: bool, sm_scale, return_lse: bool, out: torch.Tensor,
             kernel_name: str, one_launch: bool = True) -> Optional["PreparedSplit"]:
        from .cache import layout
        from .kernels.launch import aligned_offsets, compiled, device_index, placeholder

        Z, H, N_Q, D = q.shape
        H_KV = k.shape[1]
        G = H // H_KV
        if not decode_views_ok(q, k) or out.dtype != q.dtype:
            return None
        self = PreparedSplit()
        self.one_launch = one_launch and combined(p, return_lse, out, q.dtype)
        absorbed = self.one_launch and p.absorbed  # (the last chunk attends to the tail: ``_chunks``)
        # (a fused tail is the combine's own, an absorbed one the last chunk's: no part, no launch)
        tail_launch = p.tail > 0 and not p.fused_tail and not absorbed
        parts = p.splits + tail_launch
        qp_shape = (p.splits, Z, H_KV, G, N_Q, D)
        o_shape = (parts, Z, H, N_Q, D)
        o_parts = torch.empty(o_shape, dtype=out.dtype, device=q.device)
        opts = dict(sm_scale=sm_scale, return_lse=True, kernel_name=kernel_name)
        chunk_out = o_parts[:p.splits].view(p.splits, Z * H_KV, p.rows, D)
        # Every chunk reads the same queries: where q's (K/V head, group, query) rows are one strided run, the chunks'
        # view of q itself with a split stride of 0 (TMA takes it); otherwise a copy per call into the workspace.
        packed = _packed_query_strides(q, H_KV)
        self.chunk = None
        if self.one_launch:
            opts["combine"] = True
        kc, vc = _chunks(k, p, absorbed), _chunks(v, p, absorbed)
        if packed is not None:
            self.chunk = prepare(q.as_strided((p.splits, Z * H_KV, p.rows, D), packed, q.storage_offset()), kc, vc,
                                 causal=False, out=chunk_out, **opts)
        self.copies = self.chunk is None
        if self.copies:
            qp = torch.empty(qp_shape, dtype=q.dtype, device=q.device).view(p.splits, Z * H_KV, p.rows, D)
            self.chunk = prepare(qp, kc, vc, causal=False, out=chunk_out, **opts)
        self.tail = None
        if tail_launch:
            keys = slice(p.splits * p.chunk, None)
            self.tail = prepare(q, k[:, :, keys], v[:, :, keys], causal=causal, out=o_parts[p.splits], **opts)
            self.tail_offset = p.splits * p.chunk * k.stride(2) * k.element_size()
        for call in (self.chunk, self.tail):
            # (a dynamic schedule's counter: ``run_ptrs`` hands each launch one)
            if call is not None and (call.fp8 or call.window_table is not None):
                return None
        if self.chunk is None or (tail_launch and self.tail is None):
            return None
        if self.one_launch and not self.chunk.combines:  # (these chunks' tiles keep the combine's own launch)
            return PreparedSplit.make(prepare, q, k, v, p, causal=causal, sm_scale=sm_scale, return_lse=return_lse,
                                      out=out, kernel_name=kernel_name, one_launch=False)
        if absorbed:
            self.chunk = self.chunk.with_last_keys(p.tail)
        unused = placeholder(q.device, torch.float32)
        self.heads = Z * H_KV  # (one counter each: ``one_launch``)
        self.combine, self.fused = None, False
        if not self.one_launch:  # (the combine's launch: its build and fixed arguments)
            lse_parts = torch.empty((p.splits, Z * H_KV, p.rows), dtype=torch.float32, device=q.device)
            lse_parts = lse_parts.reshape(p.splits, Z, H, N_Q)
            lse_tail = torch.empty((Z, H, N_Q), dtype=torch.float32, device=q.device) if tail_launch else None
            lse = torch.empty((Z, H, N_Q), dtype=torch.float32, device=q.device)
            fused = TailKeys(q, k, v, p.splits * p.chunk, causal, D ** -0.5 if sm_scale is None else sm_scale) \
                if p.fused_tail else None
            args, self.consts, key = combine_args(o_parts, lse_parts, lse_tail, out, lse, fused, unused)
            self.combine = compiled(_combine_kernel, key, q.device)
            if self.combine is None or not self.combine.usable:
                return None
            # (R, H, N_Q, out's strides, the tail's unused words; pointers as addresses, as ``hopper_host._Prepared``
            # notes)
            self.combine_tail = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args[5:])
            self.fused = fused is not None  # (then the combine's q, k and v words are each call's: ``__call__``)
        # The workspace's parts, at byte offsets: the queries copied for every chunk, the parts' outputs, the chunks'
        # and the tail's lse, and the combined lse where it is not returned.
        (_, self.o_at, self.lse_chunks_at, self.lse_tail_at, self.lse_at), nbytes = aligned_offsets(
            [p.splits * Z * H * N_Q * D * q.element_size() * self.copies, parts * Z * H * N_Q * D * out.element_size(),
             p.splits * Z * H * N_Q * 4, Z * H * N_Q * 4 if tail_launch else 0, 0 if return_lse else Z * H * N_Q * 4])
        self.ws_elems = -(-nbytes // q.element_size())
        self.tail_out = p.splits * Z * H * N_Q * D * out.element_size()
        contiguous = torch.empty(qp_shape, device="meta").stride()
        self.qp_view = (qp_shape, contiguous)
        sz, sh, sn, sd = q.stride()
        self.q_view = (qp_shape, (0, sz, G * sh, sh, sn, sd))  # (every chunk's copy reads the same queries)
        self.unused, self.grid, self.plan, self.return_lse = unused.data_ptr(), Z * H * N_Q, p, return_lse
        self.out_layout = layout(out)
        self.lse_shape = (Z, H, N_Q)
        self.index = device_index(q.device)
        return self

    def with_keys(self, k, v, p: DecodePlan) -> Optional["PreparedSplit"]:
        """This one-launch split for a cache of another count of keys whose plan ``p`` has the same splits and rows
        (no tail or an absorbed one), its chunks in the same tuning class (hence the same build): the chunks'
        launch with the new K and V views (``_Prepared.with_keys``, ``with_last_keys``), everything else as made. A
        growing cache meets a new count at every step; None where ``make`` is needed."""
        mine = self.plan
        if not self.one_launch or p.splits != mine.splits or p.rows != mine.rows or (p.tail and not p.absorbed):
            return None
        if context_bucket(max(p.rows, p.chunk + p.tail)) != context_bucket(max(mine.rows, mine.chunk + mine.tail)):
            return None
        other = shallow_copy(self)
        other.plan = p
        other.chunk = self.chunk.with_key_layouts(*_chunk_layout(k.shape, k.stride(), p, True),
                                                  *_chunk_layout(v.shape, v.stride(), p, True), p.tail)
        return other

    def __call__(self, q, k, v):
        launch = launch_module()
        qk, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (qk | kp | vp) & 15 or launch.hooks_active():
            return None
        device = q.device
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        ws = launch.scratch(self.index, stream, self.ws_elems * q.element_size(), q.dtype)
        if ws is None:  # (a CUDA graph's capture: memory of its own)
            ws = torch.empty(self.ws_elems, dtype=q.dtype, device=device)
        if self.copies:
            ws.as_strided(*self.qp_view).copy_(q.as_strided(*self.q_view))
        shape, strides, dtype = self.out_layout
        out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        w = ws.data_ptr()
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device) if self.return_lse else None
        op, lse_chunks = w + self.o_at, w + self.lse_chunks_at
        if self.one_launch:  # (the counters as the table, the output through the scheduler's word)
            if not self.chunk.run_ptrs(stream, (w if self.copies else qk, kp, vp, op), op, lse_chunks,
                                       table=launch.zeroed_counter(self.index, stream, self.heads),
                                       sched=out.data_ptr()):
                return None
            return out
        if not self.chunk.run_ptrs(stream, (w if self.copies else qk, kp, vp, op), op, lse_chunks):
            return None
        lse_tail = self.unused
        if self.tail is not None:
            lse_tail = w + self.lse_tail_at
            self.tail.run_ptrs(stream, (qk, kp + self.tail_offset, vp + self.tail_offset, op + self.tail_out),
                               op + self.tail_out, lse_tail)
        tail_args = self.combine_tail
        if self.fused:  # (R, H, N_Q, out's strides, then the tail's q, k and v: this call's)
            tail_args = (*tail_args[:6], qk, kp, vp, *tail_args[9:])
        self.combine(self.grid, stream, (op, lse_chunks, lse_tail, out.data_ptr(),
                                         w + self.lse_at if lse is None else lse.data_ptr(), *tail_args),
                     self.consts)
        return (out, lse) if self.return_lse else out


def _packed_query_strides(q: torch.Tensor, h_kv: int) -> Optional[tuple]:
    """The strides of q [Z, H, N_Q, D] seen as [splits, Z * H_KV, G * N_Q, D] with a split stride of 0 (every chunk
    of keys reads the same queries), where (batch, K/V head) and (group, query) each merge into one strided run;
    None where they do not (a copy then)."""
    Z, H, N_Q, _ = q.shape
    sz, sh, sn, sd = q.stride()
    G = H // h_kv
    if N_Q == 1 or sh == N_Q * sn:
        rows = sh if N_Q == 1 else sn
    elif G == 1:
        rows = sn
    else:
        return None
    if h_kv == 1:
        heads = sz
    elif Z == 1 or sz == h_kv * G * sh:
        heads = G * sh
    else:
        return None
    return 0, heads, rows, sd


def decode_views_ok(q, k) -> bool:
    """Whether ``PreparedSplit``'s views hold: q's head dim splits into (K/V head, group) as a view."""
    try:
        q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))
    except RuntimeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The combine: out = sum_p exp(lse_p - lse) o_p, lse = logsumexp_p lse_p, row by row
# ---------------------------------------------------------------------------------------------
COMBINE_WARPS = 4
COMBINE_ELEMS = 2048  # output elements of one chunk of parts a program loads at once (16 per thread)
LN2 = tl.constexpr(0.6931471805599453)  # (a constexpr: the kernel reads it)
LOG2E = 1.4426950408889634


class TailKeys(NamedTuple):
    """Keys [start, N_KV) of k, v [Z, H_KV, N_KV, D] for q [Z, H, N_Q, D], for the combine to attend to itself."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    start: int
    causal: bool  # bottom-right: query n sees keys <= n + N_KV - N_Q
    sm_scale: float


def tail_reference(t: TailKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail's output (fp32, normalised) and lse [Z, H, N_Q] by PyTorch's ops: the combine kernel's reference
    and its CPU path. The fp32 reference over the tail's keys alone: its bottom-right causal mask (query n sees
    slice keys <= n + tail - N_Q) is the whole problem's (keys <= n + N_KV - N_Q); a row that sees no tail key
    has output 0 and lse -inf."""
    from .reference import attention_reference

    return attention_reference(t.q, t.k[:, :, t.start:], t.v[:, :, t.start:], causal=t.causal, return_lse=True,
                               sm_scale=t.sm_scale)


@triton.jit
def _part_lse(lse_ptr, lse_tail_ptr, part, row, R, SPLITS: tl.constexpr, PARTS: tl.constexpr):
    """The lse of parts ``part`` of ``row``: a chunk's from [SPLITS, R], the tail's (part SPLITS) from [R]; -inf
    past the parts."""
    lse_p = tl.load(lse_ptr + part.to(tl.int64) * R + row, mask=part < SPLITS, other=-float("inf"))
    if PARTS > SPLITS:
        lse_p = tl.where(part == SPLITS, tl.load(lse_tail_ptr + row), lse_p)
    return lse_p


@triton.jit
def _tail_part(q_ptr, k_ptr, v_ptr, q_st, k_st, v_st, z, h, n, G, start, n_tail, shift, qk_scale,
               D: tl.constexpr, BLOCK_T: tl.constexpr, STEP_T: tl.constexpr, CAUSAL: tl.constexpr):
    """Row (z, h, n)'s attention over keys [start, start + n_tail) of K/V head h // G, STEP_T keys at a time with
    the online softmax, in fp32: (its unnormalised output [D], its row sum, its max in log2 units). ``*_st`` are
    each tensor's (batch, head, row, column) strides; causal, key j is seen while j <= n + shift."""
    d = tl.arange(0, D)
    hk = h // G
    q = tl.load(q_ptr + z * q_st[0] + h * q_st[1] + n * q_st[2] + d * q_st[3]).to(tl.float32)
    k_row = k_ptr + z * k_st[0] + hk * k_st[1]
    v_row = v_ptr + z * v_st[0] + hk * v_st[1]
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for t0 in tl.static_range(0, BLOCK_T, STEP_T):
        t = t0 + tl.arange(0, STEP_T)
        seen = t < n_tail
        if CAUSAL:
            seen = seen & (start + t <= n + shift)
        key = (start + t).to(tl.int64)
        kt = tl.load(k_row + key[:, None] * k_st[2] + d[None, :] * k_st[3], mask=seen[:, None], other=0.0)
        s = tl.where(seen, tl.sum(kt.to(tl.float32) * q[None, :], 1) * qk_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # (no key seen yet: every exponential is 0)
        p = tl.exp2(s - m_use)
        alpha = tl.exp2(m - m_use)
        vt = tl.load(v_row + key[:, None] * v_st[2] + d[None, :] * v_st[3], mask=seen[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), 0)
        l = l * alpha + tl.sum(p, 0)
        m = m_new
    return acc, l, m


@triton.jit(do_not_specialize=["R", "H", "N_Q", "s_z", "s_h", "s_n", "q_z", "q_h", "q_n", "q_d", "k_z", "k_h", "k_n",
                               "k_d", "v_z", "v_h", "v_n", "v_d", "G", "start", "n_tail", "shift"],
            do_not_specialize_on_alignment=["q_ptr", "k_ptr", "v_ptr"])
def _combine_kernel(o_ptr, lse_ptr, lse_tail_ptr, out_ptr, lse_out_ptr, R, H, N_Q, s_z: tl.int64, s_h: tl.int64,
                    s_n: tl.int64, q_ptr, k_ptr, v_ptr, q_z: tl.int64, q_h: tl.int64, q_n: tl.int64, q_d: tl.int64,
                    k_z: tl.int64, k_h: tl.int64, k_n: tl.int64, k_d: tl.int64, v_z: tl.int64, v_h: tl.int64,
                    v_n: tl.int64, v_d: tl.int64, G, start, n_tail, shift, qk_scale,
                    SPLITS: tl.constexpr, PARTS: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr,
                    CHUNK_P: tl.constexpr, BLOCK_T: tl.constexpr = 0, STEP_T: tl.constexpr = 1,
                    CAUSAL: tl.constexpr = False):
    """One row (z, h, n) of R = Z * H * N_Q: its parts' lse, then their outputs ([PARTS, R, D], the tail's last)
    CHUNK_P parts at a time, weighed by exp(lse_p - max) and summed in fp32. With BLOCK_T > 0 the tail is not a
    part: the row attends to its ``n_tail`` keys from ``start`` here (``_tail_part``), one more term of the sum.
    The strides are 64-bit arguments whatever their values (a cache of 2^31 elements a batch has one of 2^31 or
    more; ``launch_cached`` keys a build without its integers' widths)."""
    row = tl.program_id(0).to(tl.int64)
    n = row % N_Q
    zh = row // N_Q
    z = zh // H
    h = zh - z * H
    # Every row sees a chunk's keys, so the max is finite; a tail that saw no key (lse -inf) weighs 0.
    m = tl.max(_part_lse(lse_ptr, lse_tail_ptr, tl.arange(0, BLOCK_P), row, R, SPLITS, PARTS), 0)
    if BLOCK_T > 0:
        t_acc, t_l, t_m = _tail_part(q_ptr, k_ptr, v_ptr, (q_z, q_h, q_n, q_d), (k_z, k_h, k_n, k_d),
                                     (v_z, v_h, v_n, v_d), z, h, n, G, start, n_tail, shift, qk_scale,
                                     D, BLOCK_T, STEP_T, CAUSAL)
        t_lse = tl.where(t_l > 0, (t_m + tl.log2(t_l)) * LN2, -float("inf"))
        m = tl.maximum(m, t_lse)
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
    if BLOCK_T > 0:
        w_t = tl.exp(t_lse - m)  # exp(-inf) = 0 for a row without tail keys
        acc += t_acc * tl.where(t_l > 0, w_t / t_l, 0.0)
        total += w_t
    tl.store(out_ptr + z * s_z + h * s_h + n * s_n + d, (acc / total).to(out_ptr.dtype.element_ty))
    tl.store(lse_out_ptr + row, m + tl.log(total))


def combine(o_parts: torch.Tensor, lse_chunks: torch.Tensor, lse_tail: Optional[torch.Tensor],
            out: torch.Tensor, tail: Optional[TailKeys] = None) -> torch.Tensor:
    """Combine the parts of a split decode into ``out`` [Z, H, N_Q, D] (unit last stride) and return its lse
    [Z, H, N_Q]: ``o_parts`` [parts, Z, H, N_Q, D] (the chunks', then the tail's if any), ``lse_chunks`` the
    chunks' lse (their rows in the order (z, h, n)), ``lse_tail`` the tail's [Z, H, N_Q] or None; or ``tail``, the
    tail's keys, which the combine attends to itself (then ``o_parts`` holds the chunks only). One launch on the
    GPU (``_combine_kernel``); PyTorch's ops elsewhere, and the kernel's reference in the tests."""
    parts, Z, H, N_Q, D = o_parts.shape
    splits = parts - (lse_tail is not None)
    assert tail is None or lse_tail is None, "the tail is a part or the combine's own, not both"
    lse_parts = lse_chunks.reshape(splits, Z, H, N_Q)
    if not o_parts.is_cuda:
        if tail is not None:
            o_tail, lse_tail = tail_reference(tail)
            o_parts = torch.cat([o_parts, o_tail.to(o_parts.dtype).unsqueeze(0)])
        if lse_tail is not None:
            lse_parts = torch.cat([lse_parts, lse_tail.unsqueeze(0)])
        lse = torch.logsumexp(lse_parts, 0)
        weights = (lse_parts - lse).exp_().unsqueeze(-1)
        out.copy_((o_parts * weights).sum(0))
        return lse
    from .kernels.launch import launch_cached, placeholder

    assert out.stride(3) == 1 and o_parts.is_contiguous() and lse_parts.is_contiguous(), "combine's layouts"
    lse = torch.empty((Z, H, N_Q), dtype=torch.float32, device=out.device)
    f32 = placeholder(out.device, torch.float32)
    args, consts, key = combine_args(o_parts, lse_parts, lse_tail, out, lse, tail, f32)
    launch_cached(_combine_kernel, COMBINE_WARPS, Z * H * N_Q, args, consts, out.device, key=key)
    return lse


def combine_args(o_parts, lse_parts, lse_tail, out, lse, tail: Optional[TailKeys], unused: torch.Tensor):
    """``_combine_kernel``'s arguments, constexprs and launch key (``combine``'s GPU path; the interpreter's tests
    launch with them too); ``unused`` stands for the pointers the kernel does not read."""
    parts, Z, H, N_Q, D = o_parts.shape
    splits = parts - (lse_tail is not None)
    args = (o_parts, lse_parts, lse_tail if lse_tail is not None else unused, out, lse, Z * H * N_Q, H, N_Q,
            *out.stride()[:3])
    n_tail = 0 if tail is None else tail.k.shape[2] - tail.start
    consts, key = _combine_plan(splits, parts, D, o_parts.dtype, out.dtype, n_tail, tail is not None and tail.causal,
                                None if tail is None else tail.q.dtype)
    if tail is None:
        args += (unused, unused, unused, *(0,) * 12, 1, 0, 0, 0, 1.0)
    else:
        q, k, v = tail.q, tail.k, tail.v
        args += (q, k, v, *q.stride(), *k.stride(), *v.stride(), H // k.shape[1], tail.start, n_tail,
                 k.shape[2] - N_Q, tail.sm_scale * LOG2E)
    return args, consts, key


@functools.lru_cache(maxsize=256)
def _combine_plan(splits: int, parts: int, D: int, dtype: torch.dtype, out_dtype: torch.dtype, n_tail: int = 0,
                  causal: bool = False, tail_dtype: Optional[torch.dtype] = None):
    """The combine's constexprs and its launch key, once per (splits, parts, D, dtypes, the fused tail's padded
    length, mask and input dtype): a decode step's host time is the step's time where the GPU's is short."""
    block_p = next_power_of_2(parts)
    block_t = next_power_of_2(n_tail) if n_tail else 0
    consts = dict(SPLITS=splits, PARTS=parts, D=D, BLOCK_P=block_p, CHUNK_P=min(block_p, COMBINE_ELEMS // D),
                  BLOCK_T=block_t, STEP_T=max(1, min(block_t, COMBINE_ELEMS // D)), CAUSAL=causal)
    return consts, (_combine_kernel, dtype, out_dtype, tail_dtype, *consts.values())
