"""V^T for the fp8 Hopper kernel: one pass that transposes V and permutes its keys.

fp8 wgmma reads its B operand K-major, so P V needs V^T tiles ([D, keys], keys contiguous), and the
kernel renames P's keys within each group of 16 (``hopper._p_operand``) so V^T's columns must be
permuted the same way: position 4c + 2h + j of each 16 holds key 8h + 2c + j. This runs inside the
timed call, so it must run near memory speed: a tiled kernel reads rows of V (contiguous along D),
transposes the tile through shared memory and writes rows of V^T (contiguous along keys). PyTorch's
strided copy of the same permutation ran at a fraction of that (at N_CTX=1024 it took longer than
the attention kernel).
"""
import functools

import torch
import triton
import triton.language as tl

from . import cdiv, next_power_of_2
from .launch import launch_cached, tma_ready

BLOCK_KEYS = 128  # keys per program: a multiple of the 16-key permutation group


@triton.jit(do_not_specialize=["N", "n_groups", "H", "n_blocks"])
def _v_transpose_kernel(v_ptr, vt_ptr, N, n_groups, H, n_blocks, svz, svh, svn, stz, sth, std,
                        D: tl.constexpr, BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    # The padded length as a multiple of 16 the compiler can see: the store mask is then constant over
    # 16 columns and the stores are 16-byte vectors. D_BLOCK: D rounded up to a power of two (96: 128, its
    # columns past D masked).
    n_pad = n_groups * 16
    pid = tl.program_id(0)
    hz = pid // n_blocks
    pos = (pid - hz * n_blocks) * BLOCK + tl.arange(0, BLOCK)  # output columns
    r = pos % 16
    key = pos - r + 8 * ((r // 2) % 2) + 2 * (r // 4) + (r % 2)
    d = tl.arange(0, D_BLOCK)
    z = hz // H
    h = hz - z * H
    src = v_ptr + z.to(tl.int64) * svz + h.to(tl.int64) * svh + key.to(tl.int64)[:, None] * svn + d[None, :]
    load_mask = (key < N)[:, None]
    if D_BLOCK != D:
        load_mask = load_mask & (d < D)[None, :]
    tile = tl.load(src, mask=load_mask, other=0.0)  # padded keys are zeros (P is 0 there, not NaN)
    dst = vt_ptr + z.to(tl.int64) * stz + h.to(tl.int64) * sth + d.to(tl.int64)[:, None] * std + pos[None, :]
    store_mask = (pos < n_pad)[None, :]
    if D_BLOCK != D:
        store_mask = store_mask & (d < D)[:, None]
    tl.store(dst, tl.trans(tile), mask=store_mask)


@functools.lru_cache(maxsize=256)
def _vt_plan(Z: int, H: int, N: int, D: int, dtype: torch.dtype):
    n_pad = -(-N // 16) * 16
    n_blocks = -(-n_pad // BLOCK_KEYS)
    consts = dict(D=D, BLOCK=BLOCK_KEYS, D_BLOCK=next_power_of_2(D))
    return n_pad, n_blocks, n_blocks * Z * H, consts, (_v_transpose_kernel, dtype, D, *consts.values())


def fp8_vt(v: torch.Tensor):
    """[Z, H, N, D] fp8 V -> (V^T [Z, H, D, n_pad] with keys permuted, its shape, its strides); n_pad is
    N rounded up to 16 (TMA needs 16-byte row pitches)."""
    v = tma_ready(v)  # aligned base, unit last stride, 16-byte strides: one specialization serves all
    Z, H, N, D = v.shape
    n_pad, n_blocks, grid, consts, key = _vt_plan(Z, H, N, D, v.dtype)
    vt = torch.empty((Z, H, D, n_pad), dtype=v.dtype, device=v.device)
    sv, st = v.stride(), vt.stride()
    args = (v, vt, N, n_pad // 16, H, n_blocks, sv[0], sv[1], sv[2], st[0], st[1], st[2])
    launch_cached(_v_transpose_kernel, 4, grid, args, consts, v.device, key=key)
    return vt, [Z, H, D, n_pad], list(st)


def fp8_vt_reference(v: torch.Tensor) -> torch.Tensor:
    """The same V^T by PyTorch view arithmetic (slow, for tests): [Z, H, groups, h, c, j, D] ->
    [Z, H, D, groups, c, h, j]."""
    Z, H, N, D = v.shape
    n_pad = cdiv(N, 16) * 16
    src = torch.zeros((Z, H, n_pad, D), dtype=v.dtype, device=v.device)
    src[:, :, :N].copy_(v)
    vt = torch.empty((Z, H, D, n_pad), dtype=v.dtype, device=v.device)
    view = src.view(Z, H, n_pad // 16, 2, 4, 2, D).permute(0, 1, 6, 2, 4, 3, 5)
    vt.view(Z, H, D, n_pad // 16, 4, 2, 2).copy_(view)
    return vt
