"""The direct launcher (``launch.launch_cached``) on the GPU: its second and later launches bypass the JIT and
hand triton's generic C launcher the arguments themselves, so a wrong order, a descriptor expanded wrongly or a
constexpr passed where a runtime argument belongs shows up here as a wrong result. Skipped without a GPU."""
import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gluon_attn.kernels import launch
from gluon_attn.kernels.launch import DescArg, launch_cached

pytestmark = pytest.mark.gpu

ROWS = gl.constexpr(64)
COLS = gl.constexpr(64)


@gluon.jit(do_not_specialize=["row_off", "tag"])
def _args_probe(src_desc, dst_desc, words_ptr, scale, row_off, tag, BIAS: gl.constexpr, WORDS: gl.constexpr):
    """dst rows [64 pid, +64) = src rows [64 pid + row_off, +64) * scale + BIAS (TMA in and out, [1, 1, 64, 64]
    blocks of [Z, H, N, 64] views); program 0 writes (row_off, tag, BIAS, WORDS, the shapes the descriptors
    carry) to words_ptr."""
    pid = gl.program_id(0)
    dtype: gl.constexpr = src_desc.dtype
    smem = gl.allocate_shared_memory(dtype, [1, 1, ROWS, COLS], src_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, src_desc.block_type.nbytes)
    tma.async_load(src_desc, [0, 0, pid * ROWS + row_off, 0], bar, smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)
    tile = smem.reinterpret(dtype, [ROWS, COLS], gl.NVMMASharedLayout.get_default_for([ROWS, COLS], dtype))
    regs: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    x = tile.load(regs)
    tile.store((x.to(gl.float32) * scale + BIAS).to(dtype))
    fence_async_shared()
    tma.async_store(dst_desc, [0, 0, pid * ROWS, 0], smem)
    tma.store_wait(0)
    if pid == 0:
        words: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        i = gl.arange(0, 32 * gl.num_warps(), words)
        v = gl.where(i == 0, row_off, gl.where(i == 1, tag, gl.where(i == 2, BIAS, WORDS)))
        v = gl.where(i == 4, src_desc.shape[2], gl.where(i == 5, dst_desc.shape[2], v))
        gl.store(words_ptr + i, v, mask=i < WORDS)


def _launch(src, dst, words, scale, row_off, tag, bias):
    block = [1, 1, ROWS.value, COLS.value]
    grid = dst.shape[2] // ROWS.value
    args = (DescArg.of(src, block), DescArg.of(dst, block), words, scale, row_off, tag)
    launch_cached(_args_probe, 4, grid, args, {"BIAS": bias, "WORDS": 6}, src.device,
                  key=(_args_probe, src.dtype, bias))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_direct_launch_passes_every_argument_in_its_place(dtype):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    torch.manual_seed(0)
    runs = [(256, 128, 0.5, 64, 7), (448, 256, 3.0, 128, -2), (320, 192, -1.5, 0, 123456)]
    for i, (n_src, n_dst, scale, row_off, tag) in enumerate(runs):
        src = torch.randn(1, 1, n_src, COLS.value, device="cuda", dtype=dtype)
        dst = torch.full((1, 1, n_dst, COLS.value), float("nan"), device="cuda", dtype=dtype)
        words = torch.full((8,), -99, device="cuda", dtype=torch.int32)
        _launch(src, dst, words, scale, row_off, tag, 2)
        torch.cuda.synchronize()
        expect = (src[:, :, row_off:row_off + n_dst].float() * scale + 2).to(dtype)
        torch.testing.assert_close(dst, expect, atol=0, rtol=0)
        assert words.tolist() == [row_off, tag, 2, 6, n_src, n_dst, -99, -99]
        key = (torch.cuda.current_device(), 1, (_args_probe, dtype, 2))
        direct = launch._COMPILED[key]
        # The first launch compiled through the JIT; the later ones went straight to the C launcher.
        assert direct.usable and (i == 0 or direct.cache), "the later launches must take the direct path"
