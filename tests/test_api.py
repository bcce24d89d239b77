"""Library API checks that need no GPU: bad input is rejected with a message naming what is supported."""
import pytest
import torch

import gluon_attn
from gluon_attn.validation import UnsupportedError


def qkv(shape=(1, 2, 16, 64), dtype=torch.float16, device="cpu"):
    return [torch.randn(shape).to(dtype).to(device) for _ in range(3)]


def test_attention_is_exported():
    assert callable(gluon_attn.attention)


def test_cpu_tensors_rejected():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gluon_attn.attention(*qkv())


def test_head_dim_rejected_with_supported_list():
    with pytest.raises(UnsupportedError, match="supported: 32, 64, 96, 128, 192, 256"):
        gluon_attn.attention(*qkv((1, 1, 8, 80)))


def test_fp32_rejected_with_supported_list():
    with pytest.raises(UnsupportedError, match="fp16, bf16, fp8e5, fp8e4m3"):
        gluon_attn.attention(*qkv(dtype=torch.float32))


def test_rank_and_shapes_rejected():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="rank 4"):
        gluon_attn.attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match=r"v must be \[Z, H_KV, N_KV, HEAD_DIM_V\]"):
        gluon_attn.attention(q, k[:, :, :8], v)
    with pytest.raises(ValueError, match="H_KV=3 must divide q heads H=2"):
        gluon_attn.attention(q, *qkv((1, 3, 16, 64))[:2])
    with pytest.raises(ValueError, match=r"k must be \[Z, H_KV, N_KV, HEAD_DIM\]"):
        gluon_attn.attention(q, *qkv((2, 2, 16, 64))[:2])
