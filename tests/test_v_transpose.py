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
