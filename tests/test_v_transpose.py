"""The fp8 V^T layout on CPU: the key permutation the sm_90a kernel's P relabelling needs."""
import torch

from gluon_attn.kernels.v_transpose import fp8_vt_reference


def test_columns_hold_the_relabelled_keys_and_padding_is_zero():
    n = 40  # two full groups of 16 and a tail padded to 48
    v = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 2).contiguous() + 1
    vt = fp8_vt_reference(v)
    assert vt.shape == (1, 1, 2, 48)
    for pos in range(48):
        g, r = divmod(pos, 16)
        c, h, j = r // 4, (r // 2) % 2, r % 2
        key = 16 * g + 8 * h + 2 * c + j  # position 4c + 2h + j holds key 8h + 2c + j
        expected = key + 1 if key < n else 0  # keys past N_CTX are zeros, never garbage
        assert vt[0, 0, 0, pos].item() == expected and vt[0, 0, 1, pos].item() == expected


_KERNEL_SCRIPT = """
import sys, torch
from gluon_attn.kernels import v_transpose
from gluon_attn.kernels.v_transpose import fp8_vt, fp8_vt_reference
D, N = (int(a) for a in sys.argv[1:])
v_transpose.tma_ready = lambda t: t  # (CPU tensors: nothing to align)
v_transpose.launch_cached = lambda fn, warps, grid, args, consts, device, key: fn[(grid,)](*args, **consts)
torch.manual_seed(0)
v = torch.randn(2, 3, N, D)
vt, shape, strides = fp8_vt(v)
assert shape == [2, 3, D, -(-N // 16) * 16] and torch.equal(vt, fp8_vt_reference(v)), (vt - fp8_vt_reference(v)).abs().max()
print("ok")
"""


def test_the_transpose_kernel_matches_its_reference_for_every_head_dim():
    """The kernel (triton's interpreter on CPU, fp32 standing in for fp8's bytes) against the view arithmetic, for
    the head dims the kernels are built for and 96 (run padded: its columns past 96 are never touched)."""
    from .interpreter import run_interpreted
    for d in (64, 96, 128):
        run_interpreted(_KERNEL_SCRIPT, d, 40)
