"""A small Gluon kernel: TMA-load a [Z, H, N_CTX, D] tile into shared memory, scale it in registers,
TMA-store it back. It exercises the same 4-D descriptor path as the attention kernels and lets
``inspect`` and the tests prove the compile-only toolchain on both targets."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import cdiv
from .naming import kernel_symbol
from .toolchain import COMPILE_OPTIONS


@gluon.jit(repr=kernel_symbol)
def tma_scale_kernel(in_desc, out_desc, scale, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                     KERNEL_NAME: gl.constexpr):
    pid_m = gl.program_id(0)
    off_hz = gl.program_id(1)
    H = in_desc.shape[1]
    off_z = off_hz // H
    off_h = off_hz % H
    dtype: gl.constexpr = in_desc.dtype
    # The 4-D descriptor's block is [1, 1, BLOCK_M, HEAD_DIM]; the same bytes viewed as 2-D carry the
    # same swizzle, which is what register loads and MMAs want.
    tile_2d: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    # 8 contiguous 16-bit elements per thread = one 16-byte shared-memory access.
    regs: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])

    smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], in_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, in_desc.block_type.nbytes)
    tma.async_load(in_desc, [off_z, off_h, pid_m * BLOCK_M, 0], bar, smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)

    tile = smem.reinterpret(dtype, [BLOCK_M, HEAD_DIM], tile_2d)
    x = tile.load(regs)
    tile.store((x.to(gl.float32) * scale).to(dtype))
    fence_async_shared()
    tma.async_store(out_desc, [off_z, off_h, pid_m * BLOCK_M, 0], smem)
    tma.store_wait(0)


def tma_block_layout(block_shape, torch_dtype):
    from ..kernels.common import gl_dtype
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype(torch_dtype))


def tma_scale(x, scale: float, *, block_m: int = 64, kernel_name: str = "gluon_tma_scale"):
    """out = x * scale through TMA; x is [Z, H, N_CTX, D] on an sm_90+ GPU, last dim contiguous."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    Z, H, N, D = x.shape
    out = torch.empty_like(x)
    block = [1, 1, block_m, D]
    layout = tma_block_layout(block, x.dtype)
    in_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)
    out_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), block, layout)
    grid = (cdiv(N, block_m), Z * H)
    tma_scale_kernel[grid](in_desc, out_desc, scale, block_m, D, kernel_name, num_warps=4, **COMPILE_OPTIONS)
    return out
