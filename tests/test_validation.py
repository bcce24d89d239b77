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
    with pytest.raises(ValueError, match=r"rank 4 \[Z, H, N, HEAD_DIM\]"):
        check_qkv(t(2, 8, 64), t(2, 8, 64), t(2, 8, 64))


def test_gqa_and_cross_lengths_accepted():
    check_qkv(t(2, 8, 5, 64), t(2, 2, 300, 64), t(2, 2, 300, 64))  # GQA, N_Q != N_KV
    check_qkv(t(2, 8, 5, 64), t(2, 1, 3, 64), t(2, 1, 3, 64))  # MQA


def test_mismatched_shapes():
    with pytest.raises(ValueError, match="v must be"):
        check_qkv(t(1, 2, 8, 64), t(1, 2, 9, 64), t(1, 2, 8, 64))
    with pytest.raises(ValueError, match="v must be"):
        check_qkv(t(1, 2, 8, 64), t(1, 2, 8, 64), t(1, 3, 8, 64))
    with pytest.raises(ValueError, match="H_KV=3 must divide q heads H=4"):
        check_qkv(t(1, 4, 8, 64), t(1, 3, 8, 64), t(1, 3, 8, 64))
    with pytest.raises(ValueError, match=r"k must be \[Z, H_KV, N_KV, HEAD_DIM\] = \[1, H_KV, N_KV, 64\]"):
        check_qkv(t(1, 4, 8, 64), t(1, 2, 8, 128), t(1, 2, 8, 128))


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
    with pytest.raises(ValueError, match="Z, N_Q and N_KV must be >= 1"):
        check_qkv(t(1, 1, 0, 64), t(1, 1, 0, 64), t(1, 1, 0, 64))
    check_qkv(t(0, 1, 0, 64), t(0, 1, 0, 64), t(0, 1, 0, 64), allow_empty=True)


def test_varlen_arguments_checked():
    from gluon_attn.validation import check_varlen

    q, k = t(10, 4, 64), t(12, 2, 64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    check_varlen(q, k, k, cu, cu_k, 6, 7, head_dims=(64, 128), require_cuda=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        check_varlen(q, k, k, cu, cu_k, 6, 7)
    with pytest.raises(ValueError, match="1-D int32 tensor"):
        check_varlen(q, k, k, cu.long(), cu_k, 6, 7)
    with pytest.raises(ValueError, match=r"both hold B \+ 1"):
        check_varlen(q, k, k, cu, cu_k[:2], 6, 7)
    with pytest.raises(ValueError, match="rank 3"):
        check_varlen(q[None], k, k, cu, cu_k, 6, 7)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int"):
        check_varlen(q, k, k, cu, cu_k, 6, -1)


def test_cpu_tensors_for_gpu_provider():
    p = Problem(1, 1, 8, 64, causal=False)
    inputs = Inputs(p, t(1, 1, 8, 64), t(1, 1, 8, 64), t(1, 1, 8, 64))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        get_provider("cudnn").prepare(inputs)
