"""The sm_100a launcher's host logic on CPU tensors: descriptors, grid, config choice, validation."""
import itertools
import math

import pytest
import torch

from gluon_attn.kernels.blackwell import BlackwellConfig, default_config, plan_launch
from gluon_attn.kernels.launch import LOG2E


def qkv(shape=(2, 3, 1000, 128), dtype=torch.float16):
    return [torch.randn(shape).to(dtype) for _ in range(3)]


def plan(q, k, v, **kw):
    args = dict(causal=False, sm_scale=None, descale_q=1.0, descale_k=1.0, descale_v=1.0, return_lse=False,
                out=None, out_dtype=None, config=None, kernel_name="gluon_attention", sm_count=148)
    args.update(kw)
    return plan_launch(q, k, v, **args)


def test_descriptors_cover_4d_tensors_with_half_tiles():
    q, k, v = qkv()
    p = plan(q, k, v)
    desc_q, desc_k, desc_v, desc_o = p.args[:4]
    assert desc_q.shape == [2, 3, 1000, 128] and desc_q.block_shape == [1, 1, 128, 128]
    assert desc_k.block_shape == [1, 1, p.config.BLOCK_N, 128] and desc_v.block_shape == desc_k.block_shape
    assert desc_o.base is p.out and p.out.shape == q.shape and p.out.dtype == torch.float16
    assert desc_q.base is q  # contiguous input: no copy


# plan.args: descs q k v o (0-3), o_ptr, lse, seq table, qk_scale, o_scale (4-8), N_Q, N_KV, Z*H, G, group_hz,
# n_seqs, grid (9-15): the kernel's runtime arguments in order.
def test_grid_is_persistent_and_bounded_by_tiles():
    q, k, v = qkv()
    p = plan(q, k, v)
    tiles = math.ceil(1000 / 256) * 2 * 3
    assert p.grid == min(148, tiles) == 24
    assert p.args[9:16] == (1000, 1000, 6, 1, 1, 0, 24)
    # Causal: a work unit is a mirrored pair of query blocks (0 with 3, 1 with 2), so half as many.
    c = plan(q, k, v, causal=True)
    assert c.grid == 12
    odd = plan(*qkv((1, 2, 700, 64)), causal=True)  # 3 query blocks: pairs (0, 2) and (1) per head
    assert odd.grid == 4
    # Non-causal tiles walk one head at a time unless asked to group heads.
    assert plan(q, k, v, head_group_size=3).args[13] == 3
    big = qkv((4, 32, 8192, 128))
    assert plan(*big).grid == 148


def test_gqa_and_cross_lengths_reach_the_kernel():
    q = torch.randn(2, 8, 300, 128).half()
    k = torch.randn(2, 2, 1000, 128).half()
    p = plan(q, k, k.clone(), causal=True)
    N_Q, N_KV, ZH, G, group = p.args[9:14]
    assert (N_Q, N_KV, ZH, G) == (300, 1000, 16, 4)
    assert group == 4  # causal walks the 4 query heads of a K/V head together (L2 reuse of its blocks)
    assert p.args[1].shape == [2, 2, 1000, 128]
    assert plan(q, k, k.clone()).args[13] == 4  # non-causal head groups default to the same


def test_packed_sequences_plan():
    from gluon_attn.kernels.schedule import Packed

    lens_q, lens_k = [5, 300, 0, 1000], [7, 300, 3, 1000]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32)
    q = torch.randn(1, 4, sum(lens_q), 64).half()
    k = torch.randn(1, 2, sum(lens_k), 64).half()
    p = plan(q, k, k.clone(), causal=True, varlen=Packed(cu_q, cu_k, 1000, 1000))
    assert p.constexprs["VARLEN"] is True and p.args[14] == 4
    table = p.args[6]
    assert table.dtype == torch.int32 and table.tolist()[:10] == cu_q.tolist() + cu_k.tolist()
    # Longest first, by keys: sequence 3 (1000), 1 (300), 0 (7), 2 (3 keys, no queries: no units).
    order = table[15:].tolist()
    assert order == [3, 1, 0, 2]
    # Causal units per head: pairs of 256-row query blocks: 1000 -> 2, 300 -> 1, 5 -> 1, 0 -> 0.
    assert table[10:15].tolist() == [0, 4 * 2, 4 * 3, 4 * 4, 4 * 4]


def test_strided_views_are_used_without_copy_and_output_keeps_layout():
    base = [torch.randn(2, 500, 3, 64).half() for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    p = plan(q, k, v)
    assert p.args[0].base is q and p.args[0].strides == list(q.stride())
    assert p.out.stride() == torch.empty_like(q).stride()


def test_scales_and_fp8_output():
    q, k, v = qkv((1, 2, 300, 64), dtype=torch.float8_e4m3fn)
    p = plan(q, k, v, descale_q=0.5, descale_k=0.25, descale_v=2.0, return_lse=True, kernel_name="cutlass_x")
    qk_scale, o_scale = p.args[7], p.args[8]
    assert qk_scale == pytest.approx(LOG2E / math.sqrt(64) * 0.5 * 0.25) and o_scale == 2.0
    assert p.out.dtype == torch.float16 and p.lse.shape == (1, 2, 300) and p.lse.dtype == torch.float32
    assert p.constexprs["KERNEL_NAME"] == "cutlass_x" and p.signature == (torch.float8_e4m3fn, torch.float16, 64)
    bf = plan(q, k, v, out_dtype=torch.bfloat16)
    assert bf.out.dtype == torch.bfloat16


def test_config_choice_and_rejection():
    q, k, v = qkv()
    assert plan(q, k, v).config == default_config(128, "fp16", False)
    assert plan(q, k, v, config=BlackwellConfig(KV_STAGES=2)).constexprs["KV_STAGES"] == 2
    with pytest.raises(ValueError, match="shared memory"):
        plan(q, k, v, config=BlackwellConfig(KV_STAGES=7))
    with pytest.raises(ValueError, match="out_dtype"):
        plan(q, k, v, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        plan(q, k, v, out=torch.empty(1, 2, 3, 4))
