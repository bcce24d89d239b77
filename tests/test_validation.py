import pytest
import torch

from gluon_attn.bench.providers import get_provider
from gluon_attn.problem import Inputs, Problem
from gluon_attn.validation import UnsupportedError, check_qkv


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


def test_accepts_good_inputs():
    check_qkv(t(1, 2, 8, 64), t(1, 2, 8, 64), t(1, 2, 8, 64), head_dims=(64, 128))


def test_wrong_rank():
    with pytest.raises(ValueError, match=r"rank 4 \[Z, H, N_CTX, HEAD_DIM\]"):
        check_qkv(t(2, 8, 64), t(2, 8, 64), t(2, 8, 64))


def test_mismatched_shapes():
    with pytest.raises(ValueError, match="k must have q's shape"):
        check_qkv(t(1, 2, 8, 64), t(1, 2, 9, 64), t(1, 2, 8, 64))
    with pytest.raises(ValueError, match="v must be"):
        check_qkv(t(1, 2, 8, 64), t(1, 2, 8, 64), t(1, 3, 8, 64))


def test_mixed_dtypes():
    with pytest.raises(ValueError, match="share one dtype"):
        check_qkv(t(1, 1, 8, 64), t(1, 1, 8, 64, dtype=torch.bfloat16), t(1, 1, 8, 64))


def test_unsupported_dtype_names_supported():
    with pytest.raises(UnsupportedError, match="supported: fp16, bf16, fp8e5, fp8e4m3"):
        check_qkv(t(1, 1, 8, 64, dtype=torch.float32), t(1, 1, 8, 64, dtype=torch.float32),
                  t(1, 1, 8, 64, dtype=torch.float32))


def test_unsupported_head_dim():
    with pytest.raises(UnsupportedError, match="head dim 96 .* supported: 64, 128"):
        check_qkv(t(1, 1, 8, 96), t(1, 1, 8, 96), t(1, 1, 8, 96), head_dims=(64, 128))


def test_empty_context():
    with pytest.raises(ValueError, match="N_CTX must be >= 1"):
        check_qkv(t(1, 1, 0, 64), t(1, 1, 0, 64), t(1, 1, 0, 64))


def test_cpu_tensors_for_gpu_provider():
    p = Problem(1, 1, 8, 64, causal=False)
    inputs = Inputs(p, t(1, 1, 8, 64), t(1, 1, 8, 64), t(1, 1, 8, 64))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        get_provider("cudnn").prepare(inputs)
