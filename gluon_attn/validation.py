"""Input checks shared by the library API and every provider: clear messages naming what is supported."""
from __future__ import annotations

from typing import Iterable

import torch

from .problem import DTYPE_NAMES, DTYPES


class UnsupportedError(ValueError):
    """A valid request that a provider or kernel does not support."""


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, head_dims: Iterable[int] | None = None,
              dtypes: Iterable[str] | None = None, require_cuda: bool = False, what: str = "attention") -> None:
    """Raise ValueError/UnsupportedError unless q, k, v are [Z, H, N_CTX, D] tensors this caller can take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{what}: {name} must have rank 4 [Z, H, N_CTX, HEAD_DIM], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in DTYPE_NAMES:
        raise UnsupportedError(f"{what}: dtype {q.dtype} is not supported; supported: {', '.join(DTYPES)}")
    if dtypes is not None:
        allowed = list(dtypes)
        if DTYPE_NAMES[q.dtype] not in allowed:
            raise UnsupportedError(f"{what}: dtype {DTYPE_NAMES[q.dtype]} is not supported; "
                                   f"supported: {', '.join(allowed)}")
    Z, H, N, D = q.shape
    if N < 1:
        raise ValueError(f"{what}: N_CTX must be >= 1, got {N}")
    if Z < 1 or H < 1:
        raise ValueError(f"{what}: Z and H must be >= 1, got Z={Z} H={H}")
    if tuple(k.shape) != (Z, H, N, D):
        raise ValueError(f"{what}: k must have q's shape {tuple(q.shape)} (self-attention), got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (Z, H, N):
        raise ValueError(f"{what}: v must be [Z, H, N_CTX, HEAD_DIM_V] = [{Z}, {H}, {N}, *], got {tuple(v.shape)}")
    if head_dims is not None:
        allowed_d = sorted(set(head_dims))
        if D not in allowed_d or v.shape[3] not in allowed_d:
            raise UnsupportedError(f"{what}: head dim {D} (v: {v.shape[3]}) is not supported; "
                                   f"supported: {', '.join(map(str, allowed_d))}")
    devices = {q.device, k.device, v.device}
    if len(devices) != 1:
        raise ValueError(f"{what}: q, k, v must be on one device, got {sorted(map(str, devices))}")
    if require_cuda and q.device.type != "cuda":
        raise ValueError(f"{what}: needs CUDA tensors, got tensors on {q.device}; "
                         f"move them with .cuda() or use the 'math' provider on CPU")
