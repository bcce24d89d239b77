import math

import pytest
import torch

from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import attention_reference, check_accuracy


def naive(q, k, v, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1 << 27, 50])  # whole, and a few rows per chunk
def test_reference_matches_naive(causal, chunk):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16) for _ in range(3))
    out, lse = attention_reference(q, k, v, causal=causal, return_lse=True, max_scores=chunk)
    ref, ref_lse = naive(q, k, v, causal, 1 / math.sqrt(16))
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_reference_applies_descale():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
    a = attention_reference(q * 2, k * 4, v * 8, causal=False, descale_q=0.5, descale_k=0.25, descale_v=0.125)
    b = attention_reference(q, k, v, causal=False)
    assert torch.allclose(a, b, atol=1e-5)


def test_causal_first_row_is_first_value():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    out = attention_reference(q, k, v, causal=True)
    assert torch.allclose(out[:, :, 0], v[:, :, 0])


def test_gate_accepts_close_rejects_far_and_nan():
    ref = torch.randn(1, 2, 16, 8)
    ok = check_accuracy((ref + 1e-4).half(), ref, "fp16")
    assert ok.ok and ok.max_abs < 2e-3
    bad = check_accuracy(ref + 0.1, ref, "fp16")
    assert not bad.ok and "max|out-ref|" in bad.message
    poisoned = ref.clone()
    poisoned[0, 1, 3, 2] = float("nan")
    nan = check_accuracy(poisoned, ref, "fp16")
    assert not nan.ok and "non-finite" in nan.message
    shape = check_accuracy(ref[..., :4], ref, "fp16")
    assert not shape.ok and "shape" in shape.message


def test_fp8_tolerance_looser_than_fp16():
    ref = torch.randn(1, 1, 64, 64)
    noisy = ref + 0.02 * torch.randn_like(ref)
    assert not check_accuracy(noisy, ref, "fp16").ok
    assert check_accuracy(noisy, ref, "fp8e4m3").ok


def test_fp8_output_rounding_widens_the_gate_by_half_an_ulp():
    from gluon_attn.reference import tolerance

    ref = torch.linspace(-2.0, 2.0, 4096).reshape(1, 1, 64, 64)
    for fmt, dt in (("fp8e4m3", torch.float8_e4m3fn), ("fp8e5", torch.float8_e5m2)):
        rounded = ref.to(dt).float()  # what an fp8 output holds at unit scale
        assert not check_accuracy(rounded, ref, "fp16").ok  # fp16's bound is far tighter than fp8 rounding
        acc = check_accuracy(rounded, ref, fmt, out_dtype=fmt)
        assert acc.ok, acc.message
        tol = tolerance(fmt, fmt, 2.0)
        bits = {"fp8e4m3": 3, "fp8e5": 2}[fmt]
        assert tol.max_abs == pytest.approx(tolerance(fmt).max_abs + 2.0 * 2.0 ** -(bits + 1))
        # In [1, 2) an ulp is 2^-bits: rounding reaches (and never passes) half of it.
        err = float((rounded - ref).abs().max())
        assert 0.9 * 2.0 ** -(bits + 1) <= err <= 2.0 ** -(bits + 1)
    assert tolerance("fp16", "fp16") == tolerance("fp16")
