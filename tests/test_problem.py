import math

import pytest
import torch

from gluon_attn.problem import DTYPES, Problem, dtype_from_name, make_inputs


def test_flops_match_formula():
    p = Problem(4, 32, 1024, 128, causal=False)
    assert p.flops == 4 * 4 * 32 * 1024**2 * 128
    assert Problem(4, 32, 1024, 128, causal=True).flops == p.flops / 2
    # A different V head dim counts its own matmul.
    pv = Problem(1, 1, 16, 64, causal=False, HEAD_DIM_V=128)
    assert pv.flops == 2 * 16 * 16 * (64 + 128)


def test_tflops_from_ms():
    p = Problem(1, 1, 1000, 64, causal=False)
    assert math.isclose(p.tflops(1.0), p.flops / 1e-3 / 1e12)


@pytest.mark.parametrize("field,value", [("N_CTX", 0), ("Z", -1), ("HEAD_DIM", 0), ("H", 1.5)])
def test_problem_rejects_bad_sizes(field, value):
    kwargs = dict(Z=1, H=1, N_CTX=8, HEAD_DIM=64, causal=False)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        Problem(**kwargs)


def test_unknown_dtype_names_supported():
    with pytest.raises(ValueError, match="fp16, bf16, fp8e5, fp8e4m3"):
        dtype_from_name("fp32")
    with pytest.raises(ValueError, match="supported"):
        Problem(1, 1, 8, 64, False, dtype="int8")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_inputs_are_fresh_random(dtype):
    p = Problem(2, 3, 33, 64, causal=False, dtype=dtype)
    a = make_inputs(p, "cpu", seed=1)
    b = make_inputs(p, "cpu", seed=2)
    assert a.q.shape == (2, 3, 33, 64) and a.q.dtype == DTYPES[dtype]
    for t in (a.q, a.k, a.v):
        assert t.float().abs().sum() > 0
        assert t.float().std() > 0
    assert not torch.equal(a.q.float(), b.q.float())


@pytest.mark.parametrize("dtype", ["fp8e4m3", "fp8e5"])
def test_fp8_inputs_record_scales(dtype):
    p = Problem(1, 2, 64, 64, causal=False, dtype=dtype)
    inp = make_inputs(p, "cpu", seed=3)
    assert inp.descale_q != 1.0 and inp.descale_v > 0
    # Dequantized values look like the unit normal the factory draws from.
    deq = inp.q.float() * inp.descale_q
    assert 0.8 < deq.std().item() < 1.2
    assert inp.out_dtype == torch.float16
    # Scaled into range: the largest magnitude uses a good part of the format.
    assert inp.q.float().abs().max().item() > 0.25 * torch.finfo(DTYPES[dtype]).max
