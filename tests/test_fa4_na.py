"""The FA4 neighborhood provider's torch parts, on CPU: the mask_mod's aux table (each dimension's window as the first
and last coordinate) gives NATTEN's mask under the mask_mod's arithmetic, and the block lists class every (query
tile, key tile) pair as full, masked or skipped exactly as the mask does, whatever the chunking. FA4 itself runs
only on a GPU (its GPU test is in test_neighborhood_gpu.py)."""
import math
import random

import pytest
import torch

from gluon_attn.bench.fa4_na import block_sparsity, mask_table
from gluon_attn.neighborhood import neighborhood, neighborhood_mask


def _mask_mod_on_cpu(nb, table, lo_at, hi_at, qi, ki):
    """What the cute mask_mod computes, in torch: per dimension the coordinates (modulo the size), the window's first
    and last coordinate from the table, and the dilation group's congruence."""
    keep = torch.ones(qi.shape[0], ki.shape[1], dtype=torch.bool)
    for d in range(nb.dims):
        stride, size = math.prod(nb.spatial[d + 1:]), nb.spatial[d]
        qc, kc = (qi // stride) % size, (ki // stride) % size
        lo, hi = table[qc + lo_at[d]].long(), table[qc + hi_at[d]].long()
        keep &= (kc >= lo) & (kc <= hi) & ((kc - lo) % nb.dilation[d] == 0)
    return keep


def _random_pattern(rng):
    dims = rng.choice([1, 2, 3])
    spatial, ks, ss, ds, cs = [], [], [], [], []
    for _ in range(dims):
        L = rng.randint(2, {1: 300, 2: 24, 3: 9}[dims])
        dil = rng.randint(1, max(1, L // 2))
        if L // dil < 2:
            dil = 1
        K = rng.randint(2, L // dil)
        spatial.append(L)
        ks.append(K)
        ss.append(rng.randint(1, K))
        ds.append(dil)
        cs.append(rng.random() < 0.3)
    return neighborhood(spatial, tuple(ks), tuple(ss), tuple(ds), tuple(cs))


@pytest.mark.parametrize("seed", range(4))
def test_the_aux_table_and_block_lists_are_natten_mask(seed):
    rng = random.Random(seed)
    for _ in range(25):
        nb = _random_pattern(rng)
        N = nb.tokens
        mask = neighborhood_mask(nb)
        table, lo_at, hi_at = mask_table(nb)
        ar = torch.arange(N)
        assert table.dtype == torch.int32
        assert torch.equal(_mask_mod_on_cpu(nb, table, lo_at, hi_at, ar[:, None], ar[None, :]), mask), nb
        tm, tn = rng.choice([(16, 16), (8, 24), (32, 8), (128, 128), (12, 20)])
        mc, mi, fc, fi = block_sparsity(nb, tm, tn, max_elements=rng.choice([1 << 26, 64, 1000]))
        n_q, n_kv = -(-N // tm), -(-N // tn)
        padded = torch.zeros(n_q * tm, n_kv * tn, dtype=torch.bool)
        padded[:N, :N] = mask
        counts = padded.view(n_q, tm, n_kv, tn).sum((1, 3))
        for bq in range(n_q):
            rows = min(tm, N - bq * tm)
            masked, full = mi[bq, :mc[bq]].tolist(), fi[bq, :fc[bq]].tolist()
            assert masked == sorted(masked) and full == sorted(full) and not set(masked) & set(full)
            for bk in range(n_kv):
                cols = min(tn, N - bk * tn)
                c = int(counts[bq, bk])
                want = "full" if c == rows * cols and cols == tn else "masked" if c else "skipped"
                got = "full" if bk in full else "masked" if bk in masked else "skipped"
                assert got == want, (nb, tm, tn, bq, bk)


def test_without_fa4_the_provider_says_so():
    from gluon_attn.bench.fa4_na import fa4_na_call
    from gluon_attn.bench.refusal import Unsupported
    try:
        import flash_attn.cute  # noqa: F401
        pytest.skip("FA4 is installed here")
    except ImportError:
        pass
    nb = neighborhood((64,), 7)
    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    with pytest.raises(Unsupported, match="fa4: FlashAttention-4 .* is not importable"):
        fa4_na_call(nb, q, q, q)
