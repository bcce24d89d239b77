"""Context parallelism: attention over a sequence split across the ranks of a torch.distributed group.

``ring_attention``: each rank holds a chunk of the queries, keys and values; the K/V chunks travel around the
ring (asynchronous send/recv to the next rank, posted before the local attention so that the transfer overlaps
it) and each rank merges its partial outputs by their lse. Causal attention splits the sequence into 2W chunks
and gives rank r chunks r and 2W - 1 - r (``zigzag_shard``), so every rank does the same work at every step.
The backward sends the K/V chunks around again, each with its dK/dV accumulator, which ends back at its owner.
The attention on each rank is pluggable (``LocalAttention``): Gluon's kernels on a GPU, PyTorch's ops elsewhere,
so the ring logic runs in CI on CPU processes with gloo. Launch with ``torchrun``; NCCL's NVLink multicast
(NCCL_NVLS_ENABLE) stays off on the GPU machines.
"""
from __future__ import annotations

import abc
import math
from typing import Optional

import torch
import torch.distributed as dist

from .merge import merge_attentions


class LocalAttention(abc.ABC):
    """The attention a rank runs on its chunks: q [Z, H, Nq, D] against k, v [Z, H_KV, Nk, D]. ``forward``
    returns (out in q's dtype, lse fp32 [Z, H, Nq]); ``backward`` the gradients of the chunks from the *global*
    output and lse of these rows (what makes the parts of a split softmax add up)."""
    name = "base"

    @abc.abstractmethod
    def forward(self, q, k, v, causal: bool, sm_scale: float):
        ...

    @abc.abstractmethod
    def backward(self, do, q, k, v, out, lse, causal: bool, sm_scale: float):
        ...


class MathAttention(LocalAttention):
    """PyTorch's ops in fp32 on any device (the reference, and the CPU path)."""
    name = "math"

    @staticmethod
    def _scores(q, k, causal, sm_scale):
        g = q.shape[1] // k.shape[1]
        s = torch.matmul(q.float(), k.float().repeat_interleave(g, 1).transpose(-1, -2)) * sm_scale
        if causal:  # (equal query and key chunks: the diagonal step)
            n_q, n_k = s.shape[-2:]
            keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
            s = s.masked_fill(~keep, float("-inf"))
        return s, g

    def forward(self, q, k, v, causal, sm_scale):
        s, g = self._scores(q, k, causal, sm_scale)
        lse = torch.logsumexp(s, -1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float().repeat_interleave(g, 1))
        return out.to(q.dtype), lse

    def backward(self, do, q, k, v, out, lse, causal, sm_scale):
        s, g = self._scores(q, k, causal, sm_scale)
        p = torch.exp(s - lse.unsqueeze(-1))
        dof = do.float()
        dv = torch.matmul(p.transpose(-1, -2), dof)
        dp = torch.matmul(dof, v.float().repeat_interleave(g, 1).transpose(-1, -2))
        ds = p * (dp - (dof * out.float()).sum(-1, keepdim=True))
        dq = torch.matmul(ds, k.float().repeat_interleave(g, 1)) * sm_scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float()) * sm_scale

        def heads(t):  # the query heads of a K/V head add into it
            return t.reshape(t.shape[0], t.shape[1] // g, g, *t.shape[2:]).sum(2)
        return dq.to(q.dtype), heads(dk).to(k.dtype), heads(dv).to(v.dtype)


class GluonAttention(LocalAttention):
    """The package's kernels (``api.forward``/``api.backward``): CUDA tensors, the dtypes and head dims they take."""
    name = "gluon"

    def forward(self, q, k, v, causal, sm_scale):
        from .api import forward
        return forward(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)

    def backward(self, do, q, k, v, out, lse, causal, sm_scale):
        from .api import backward
        return backward(do, q, k, v, out, lse.contiguous(), causal=causal, sm_scale=sm_scale)


def _local(local) -> LocalAttention:
    if isinstance(local, LocalAttention):
        return local
    impls = {"math": MathAttention, "gluon": GluonAttention}
    if local not in impls:
        raise ValueError(f"unknown local attention {local!r}; supported: {', '.join(impls)} or a LocalAttention")
    return impls[local]()


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s part of a sequence for causal ring attention: chunks ``rank`` and ``2 * world - 1 - rank``
    of ``2 * world`` equal chunks along ``dim``, concatenated."""
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"zigzag_shard: the sequence ({n}) must split into 2 x world ({2 * world}) equal chunks")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's ``zigzag_shard`` part, in rank order."""
    world = len(parts)
    chunks = [None] * (2 * world)
    for r, p in enumerate(parts):
        chunks[r], chunks[2 * world - 1 - r] = p.chunk(2, dim)
    return torch.cat(chunks, dim)


def shard_sequence(x: torch.Tensor, rank: int, world: int, causal: bool, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s chunk of a whole sequence for ``ring_attention``: zigzag for causal, else the rank-th of
    ``world`` contiguous chunks (a contiguous copy)."""
    return (zigzag_shard(x, rank, world, dim) if causal else x.chunk(world, dim)[rank]).contiguous()


def gather_sequence(x: torch.Tensor, causal: bool, group=None, dim: int = 2) -> torch.Tensor:
    """The whole sequence on every rank from each rank's chunk (``shard_sequence``'s inverse, an all-gather)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    return zigzag_unshard(parts, dim) if causal else torch.cat(parts, dim)


# ---------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------

def _exchange(tensors: list[torch.Tensor], group) -> tuple[list, list[torch.Tensor]]:
    """Post sends of ``tensors`` to the next rank and receives of as many from the previous one; returns the
    requests and the receive buffers."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors] + \
          [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _pieces(step_src: int, rank: int, causal: bool, n_local: int):
    """What rank ``rank`` computes against the K/V chunk of rank ``step_src``: (query rows, key rows, causal) slices
    of its local chunks. Non-causal: everything. Causal (zigzag): its own chunk causally; an earlier rank's first
    half (its early chunk) against all local queries; a later rank's chunks from the local late half only."""
    everything = slice(0, n_local)
    if not causal:
        return everything, everything, False
    half = n_local // 2
    if step_src == rank:
        return everything, everything, True
    if step_src < rank:
        return everything, slice(0, half), False
    return slice(half, n_local), everything, False


def _merge_into(out: torch.Tensor, lse: torch.Tensor, rows: slice, part_out: torch.Tensor, part_lse: torch.Tensor):
    """Merge a part over more keys into the running (fp32 output, lse) of the query rows ``rows``."""
    out[:, :, rows], lse[:, :, rows] = merge_attentions([out[:, :, rows], part_out], [lse[:, :, rows], part_lse])


def _ring_forward(q, k, v, causal, sm_scale, local: LocalAttention, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    Z, H, n, _ = q.shape
    out = torch.zeros(Z, H, n, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((Z, H, n), float("-inf"), dtype=torch.float32, device=q.device)
    k_cur, v_cur = k, v
    for step in range(world):
        reqs, nxt = _exchange([k_cur, v_cur], group) if step < world - 1 else ([], None)
        rows, keys, c = _pieces((rank - step) % world, rank, causal, n)
        part_out, part_lse = local.forward(q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys], c, sm_scale)
        _merge_into(out, lse, rows, part_out, part_lse)
        _wait(reqs)
        if nxt is not None:
            k_cur, v_cur = nxt
    return out.to(q.dtype), lse


def _ring_backward(do, q, k, v, out, lse, causal, sm_scale, local: LocalAttention, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = q.shape[2]
    dq = torch.zeros_like(q, dtype=torch.float32)
    k_cur, v_cur = k, v
    dk_acc = torch.zeros_like(k, dtype=torch.float32)  # travels with the K/V chunk it belongs to
    dv_acc = torch.zeros_like(v, dtype=torch.float32)
    for step in range(world):
        reqs, nxt = _exchange([k_cur, v_cur], group) if step < world - 1 else ([], None)
        rows, keys, c = _pieces((rank - step) % world, rank, causal, n)
        dq_p, dk_p, dv_p = local.backward(do[:, :, rows], q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys],
                                          out[:, :, rows], lse[:, :, rows], c, sm_scale)
        dq[:, :, rows] += dq_p.float()
        dk_acc[:, :, keys] += dk_p.float()
        dv_acc[:, :, keys] += dv_p.float()
        # the accumulators follow their chunk to the next rank; after the last step they go home (the next rank
        # owns the chunk this rank holds last)
        acc_reqs, (dk_acc, dv_acc) = _exchange([dk_acc, dv_acc], group) if world > 1 else ([], (dk_acc, dv_acc))
        _wait(reqs + acc_reqs)
        if nxt is not None:
            k_cur, v_cur = nxt
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, local, group):
        out, lse = _ring_forward(q, k, v, causal, sm_scale, local, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, sm_scale, local, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, sm_scale, local, group = ctx.args
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, causal, sm_scale, local, group)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   sm_scale: Optional[float] = None, group=None, local=None, return_lse: bool = False):
    """Attention over a sequence split across the ranks of ``group`` (default: the world), differentiable.

    Each rank passes its chunk: q [Z, H, N_local, D], k and v [Z, H_KV, N_local, D] (H_KV dividing H: GQA
    without repeating K/V), the same N_local on every rank. Non-causal: rank r holds the r-th contiguous chunk.
    Causal: rank r holds ``zigzag_shard(x, r, world)`` (chunks r and 2W - 1 - r of 2W; ``zigzag_unshard``
    puts the sequence back), so N_local is even. Returns this rank's rows of the output (and their lse
    [Z, H, N_local], fp32, not differentiable). ``local``: "gluon" (the default on CUDA tensors), "math"
    (PyTorch's ops, the default elsewhere) or a ``LocalAttention``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs an initialized torch.distributed process group (torchrun, or "
                           "torch.distributed.init_process_group)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3] or \
            (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"ring_attention takes q [Z, H, N_local, D] and k, v [Z, H_KV, N_local, D] chunks of one "
                         f"length; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: H_KV ({k.shape[1]}) must divide H ({q.shape[1]})")
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal ring_attention takes zigzag chunks (zigzag_shard): an even local length, got "
                         f"{q.shape[2]}")
    impl = _local(local if local is not None else ("gluon" if q.is_cuda else "math"))
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _RingAttention.apply(q, k, v, causal, scale, impl, group)
    return (out, lse) if return_lse else out
