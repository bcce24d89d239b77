"""Input checks shared by the library API and every provider: clear messages naming what is supported."""
from __future__ import annotations

from typing import Iterable

import torch
import triton
import triton.language as tl

from .problem import DTYPE_NAMES, DTYPES


class UnsupportedError(ValueError):
    """A valid request that a provider or kernel does not support."""


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, head_dims: Iterable[int] | None = None,
              dtypes: Iterable[str] | None = None, require_cuda: bool = False, what: str = "attention",
              allow_empty: bool = False, head_dim_pairs: Iterable[tuple[int, int]] = ()) -> None:
    """Raise ValueError/UnsupportedError unless q [Z, H, N_Q, D], k [Z, H_KV, N_KV, D] and v
    [Z, H_KV, N_KV, Dv] are tensors this caller can take: H_KV divides H (GQA/MQA), N_Q and N_KV are any
    lengths (``allow_empty``: Z, N_Q or N_KV may be 0)."""
    _check_tensors(what, (("q", q), ("k", k), ("v", v)), 4, "[Z, H, N, HEAD_DIM]")
    _check_dtypes(what, q, k, v, dtypes)
    Z, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    low = 0 if allow_empty else 1
    if Z < low or N < low or n_kv < low:
        raise ValueError(f"{what}: Z, N_Q and N_KV must be >= {low}, got Z={Z} N_Q={N} N_KV={n_kv}")
    if H < 1 or h_kv < 1:
        raise ValueError(f"{what}: H and H_KV must be >= 1, got H={H} H_KV={h_kv}")
    if k.shape[0] != Z or k.shape[3] != D:
        raise ValueError(f"{what}: k must be [Z, H_KV, N_KV, HEAD_DIM] = [{Z}, H_KV, N_KV, {D}], got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"{what}: v must be [Z, H_KV, N_KV, HEAD_DIM_V] with k's [Z, H_KV, N_KV] = "
                         f"{list(k.shape[:3])}, got {tuple(v.shape)}")
    _check_heads(what, H, h_kv)
    _check_head_dims(what, D, v.shape[3], head_dims, tuple(head_dim_pairs))
    _check_device(what, q, k, v, require_cuda)


def check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                 head_dims: Iterable[int] | None = None, dtypes: Iterable[str] | None = None,
                 what: str = "attention_varlen", require_cuda: bool = True,
                 head_dim_pairs: Iterable[tuple[int, int]] = ()) -> None:
    """Packed sequences (FlashAttention's varlen convention): q [total_q, H, D], k and v [total_k, H_KV, D],
    cu_seqlens_q / cu_seqlens_k int32 [B + 1] offsets starting at 0 on q's device, max_seqlen_* >= the
    longest sequence (checked by the caller only where it is cheap: the offsets stay on the GPU)."""
    _check_tensors(what, (("q", q), ("k", k), ("v", v)), 3, "[total, H, HEAD_DIM]")
    _check_dtypes(what, q, k, v, dtypes)
    H, D = q.shape[1], q.shape[2]
    h_kv = k.shape[1]
    if k.shape[2] != D or tuple(v.shape[:2]) != tuple(k.shape[:2]):
        raise ValueError(f"{what}: k must be [total_k, H_KV, {D}] and v [total_k, H_KV, HEAD_DIM_V], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if H < 1 or h_kv < 1:
        raise ValueError(f"{what}: H and H_KV must be >= 1, got H={H} H_KV={h_kv}")
    _check_heads(what, H, h_kv)
    _check_head_dims(what, D, v.shape[2], head_dims, tuple(head_dim_pairs))
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            raise ValueError(f"{what}: {name} must be a 1-D int32 tensor of B + 1 offsets, got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
        if cu.device != q.device:
            raise ValueError(f"{what}: {name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"{what}: cu_seqlens_q and cu_seqlens_k must both hold B + 1 >= 1 offsets, got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"{what}: {name} must be an int >= 0, got {m!r}")
    check_offsets(what, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    _check_device(what, q, k, v, require_cuda)


def offsets_rule(what: str, name: str, n: int) -> str:
    src = "q" if name == "cu_seqlens_q" else "k"
    return (f"{what}: {name} must start at 0, not decrease, and end at the packed length N "
            f"(= {src}.shape[0] = {n})")


def offsets_assert_message(what: str, name: str, n: int) -> str:
    """The device-side assert's message for offsets that break ``offsets_rule`` (the CUDA message holds at most 255
    bytes)."""
    return f"{offsets_rule(what, name, n)}; these offsets break it"[:250]


def offsets_valid(cu: torch.Tensor, n: int) -> torch.Tensor:
    """Whether the offsets ``cu`` start at 0, do not decrease and end at ``n``, as a 0-d bool tensor on cu's
    device (computed there: no copy to the host)."""
    return (cu[1:] >= cu[:-1]).all() & (cu[0] == 0) & (cu[-1] == n)


def offsets_ok_on_gpu(cu: torch.Tensor, n: int) -> torch.Tensor:
    """``offsets_valid`` of int32 CUDA offsets in one launch (a 0-d int32 tensor, 1 where they hold): the torch
    expression takes eight, ~90 us of a packed call's host time (run 217)."""
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.stride(0) != 1:
        return offsets_valid(cu, n)
    from .kernels.launch import launch_cached

    flag = torch.empty((), dtype=torch.int32, device=cu.device)
    launch_cached(_offsets_ok, 4, 1, (cu, n, cu.shape[0], flag), {"BLOCK": OFFSETS_BLOCK}, cu.device,
                  key=(_offsets_ok, OFFSETS_BLOCK))
    return flag


OFFSETS_BLOCK = 1024


@triton.jit
def offsets_bad(cu_ptr, n, count, BLOCK: tl.constexpr):
    """How many of the offsets cu[0:count] break the rule: cu[0] == 0, non-decreasing, cu[count - 1] == n (for one
    program; the packed table's kernel checks with it too, ``schedule._varlen_table_kernel``)."""
    bad = 0
    start = 0
    while start < count:  # (a while: triton's interpreter, the CPU tests' runner, cannot range over a runtime bound)
        i = start + tl.arange(0, BLOCK)
        inside = i < count
        cur = tl.load(cu_ptr + i, mask=inside, other=0)
        prev = tl.load(cu_ptr + i - 1, mask=inside & (i > 0), other=0)
        wrong = inside & (((i > 0) & (cur < prev)) | ((i == 0) & (cur != 0)) | ((i == count - 1) & (cur != n)))
        bad += tl.sum(wrong.to(tl.int32), 0)
        start += BLOCK
    return bad


@triton.jit(do_not_specialize=["n", "count"])
def _offsets_ok(cu_ptr, n, count, ok_ptr, BLOCK: tl.constexpr):
    """ok = cu[0] == 0, cu non-decreasing and cu[count - 1] == n (one program)."""
    tl.store(ok_ptr, (offsets_bad(cu_ptr, n, count, BLOCK) == 0).to(tl.int32))


def check_offsets(what: str, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int,
                  total_k: int) -> None:
    """The offsets' values (a decreasing or short one would make the kernels read and write out of place):
    each starts at 0, does not decrease and ends at its packed length (q.shape[0], k.shape[0]). Host tensors are
    checked on the host (ValueError naming what is wrong). CUDA tensors are checked on the GPU by
    ``torch._assert_async``, queued before any kernel of the call: a host check would wait for the GPU on
    every call, this one costs a few small launches and no wait; a failure surfaces as a device-side assert
    (RuntimeError) at the next synchronization, and the process's CUDA context is lost. Meta and fake tensors,
    whose values are unknown, are not checked."""
    from torch._subclasses.fake_tensor import is_fake

    pairs = [("cu_seqlens_q", cu_seqlens_q, total_q)]
    if cu_seqlens_k is not cu_seqlens_q or total_k != total_q:  # (one tensor for both: checked once)
        pairs.append(("cu_seqlens_k", cu_seqlens_k, total_k))
    for name, cu, n in pairs:
        if cu.device.type == "meta" or is_fake(cu):
            continue
        if cu.device.type == "cuda":
            torch._assert_async(offsets_ok_on_gpu(cu, n), offsets_assert_message(what, name, n))
            continue
        values = cu.tolist()
        problem = _offsets_problem(values, n)
        if problem:
            shown = values if len(values) <= 12 else f"{len(values)} offsets"
            raise ValueError(f"{offsets_rule(what, name, n)}; got {shown}: {problem}")


def _offsets_problem(values: list[int], n: int) -> str | None:
    if values[0] != 0:
        return f"it starts at {values[0]}"
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            return f"it decreases at index {i} ({values[i - 1]} -> {values[i]})"
    if values[-1] != n:
        return f"it ends at {values[-1]}, not {n}"
    return None


def _check_tensors(what, named, rank, shape_text):
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{what}: {name} must have rank {rank} {shape_text}, got shape {tuple(t.shape)}")


def _check_dtypes(what, q, k, v, dtypes):
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in DTYPE_NAMES:
        raise UnsupportedError(f"{what}: dtype {q.dtype} is not supported; supported: {', '.join(DTYPES)}")
    if dtypes is not None:
        allowed = list(dtypes)
        if DTYPE_NAMES[q.dtype] not in allowed:
            raise UnsupportedError(f"{what}: dtype {DTYPE_NAMES[q.dtype]} is not supported; "
                                   f"supported: {', '.join(allowed)}")


def _check_heads(what, H, h_kv):
    if H % h_kv:
        raise ValueError(f"{what}: k/v heads H_KV={h_kv} must divide q heads H={H} (MHA: H_KV = H, GQA: a divisor, "
                         f"MQA: 1)")


def pairs_text(pairs, lead: str = "") -> str:
    """", or 192/128 (q, k / v)" for (q/k, v) head-dim ``pairs`` ((192, 128),) and ``lead`` ", or " ("" without
    pairs)."""
    return f"{lead}{', '.join(f'{d}/{dv}' for d, dv in pairs)} (q, k / v)" if pairs else ""


def _check_head_dims(what, D, dv, head_dims, pairs=()):
    if head_dims is not None:
        allowed_d = sorted(set(head_dims))
        if D not in allowed_d or (dv != D and (D, dv) not in pairs):
            raise UnsupportedError(f"{what}: head dim {D} (v: {dv}) is not supported; supported: "
                                   f"{', '.join(map(str, allowed_d))}, the same for q, k and v"
                                   f"{pairs_text(pairs, ', or ')}")


def _check_device(what, q, k, v, require_cuda):
    devices = {q.device, k.device, v.device}
    if len(devices) != 1:
        raise ValueError(f"{what}: q, k, v must be on one device, got {sorted(map(str, devices))}")
    if require_cuda and q.device.type != "cuda":
        raise ValueError(f"{what}: needs CUDA tensors, got tensors on {q.device}; "
                         f"move them with .cuda() or use the 'math' provider on CPU")
