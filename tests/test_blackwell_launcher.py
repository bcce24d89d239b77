"""The sm_100a launcher's host logic on CPU tensors: descriptors, grid, cluster and config choice, validation."""
import itertools
import math

import pytest
import torch

from gluon_attn.kernels.blackwell_host import (BlackwellConfig, _cluster_args, default_config, plan_launch,
                                              single_cta_config)
from gluon_attn.kernels.launch import LOG2E


def qkv(shape=(2, 3, 1000, 128), dtype=torch.float16):
    return [torch.randn(shape).to(dtype) for _ in range(3)]


def plan(q, k, v, **kw):
    args = dict(causal=False, sm_scale=None, descale_q=1.0, descale_k=1.0, descale_v=1.0, return_lse=False,
                out=None, out_dtype=None, config=None, kernel_name="gluon_attention")
    args.update(kw)
    return plan_launch(q, k, v, **args)


def test_descriptors_cover_4d_tensors_with_half_tiles():
    q, k, v = qkv()
    p = plan(q, k, v)
    desc_q, desc_k, desc_v, desc_o = p.args[:4]
    # Non-causal 16-bit D=128: a 2-CTA cluster; a half of its tile is 256 rows, 128 per CTA.
    assert p.num_ctas == 2 and p.config.BLOCK_M == 512
    assert desc_q.shape == [2, 3, 1000, 128] and desc_q.block_shape == [1, 1, 256, 128]
    assert desc_k.block_shape == [1, 1, p.config.BLOCK_N, 128] and desc_v.block_shape == desc_k.block_shape
    assert desc_o.base is p.out and p.out.shape == q.shape and p.out.dtype == torch.float16
    assert desc_q.base is q  # contiguous input: no copy
    one = plan(q, k, v, causal=True)
    assert one.num_ctas == 1 and one.args[0].block_shape == [1, 1, 128, 128]


def test_cluster_layouts_of_the_descriptors():
    """Which CTA holds which part of each block: Q and O by rows (each CTA its 128), K by keys (each CTA of a pair
    half of them), V by columns (half of D each); a 4-CTA cluster's pairs share K and V (a zero basis)."""
    q, k, v = qkv()
    p = plan(q, k, v)
    assert p.desc_cga_layouts == ([[0, 0, 1, 0]], [[0, 0, 1, 0]], [[0, 0, 0, 1]], [[0, 0, 1, 0]])
    four = plan(q, k, v, config=BlackwellConfig(CLUSTER=4, KV_STAGES=6))
    assert four.num_ctas == 4 and four.args[0].block_shape == [1, 1, 512, 128]
    assert four.desc_cga_layouts == ([[0, 0, 1, 0], [0, 0, 2, 0]], [[0, 0, 1, 0], [0, 0, 0, 0]],
                                     [[0, 0, 0, 1], [0, 0, 0, 0]], [[0, 0, 1, 0], [0, 0, 2, 0]])
    assert plan(q, k, v, causal=True).desc_cga_layouts == ([], [], [], [])
    # The launch hands the layouts to the descriptors (``DescArg.cga_layout``), and each descriptor's shared
    # layout carries them.
    assert single_cta_config(default_config(128, "fp16", False)) == default_config(128, "fp16", True)
    args = _cluster_args(p)
    assert [list(map(list, a.cga_layout)) for a in args[:4]] == list(p.desc_cga_layouts)
    assert [a.descriptor().layout.cga_layout for a in args[:4]] == [list(map(list, c)) for c in p.desc_cga_layouts]
    assert args[4:] == p.args[4:]
    single = plan(q, k, v, causal=True)
    assert _cluster_args(single) is single.args


# plan.args: descs q k v o (0-3), o_ptr, lse, seq table, qk_scale, o_scale (4-8), N_Q, N_KV, Z*H, G, group_hz,
# n_seqs (9-14): the kernel's runtime arguments in order.
def test_grid_has_one_cluster_per_unit():
    """Cluster launch control: the grid is every work unit's cluster (not one per SM); clusters that have not
    started hand their units to those that finish first."""
    q, k, v = qkv()
    p = plan(q, k, v)
    assert p.grid == math.ceil(1000 / 512) * 2 * 3 == 12  # 2-CTA clusters: 512-row tiles
    assert p.args[9:15] == (1000, 1000, 6, 1, 1, 0)
    # Causal: one CTA, 256-row tiles, each its own unit (longest first): 4 blocks x 6 heads.
    c = plan(q, k, v, causal=True)
    assert c.grid == 24 and c.num_ctas == 1
    odd = plan(*qkv((1, 2, 700, 64)), causal=True)  # 3 query blocks per head
    assert odd.grid == 6
    # Non-causal tiles walk one head at a time unless asked to group heads.
    assert plan(q, k, v, head_group_size=3).args[13] == 3
    big = qkv((4, 32, 8192, 128))
    assert plan(*big).grid == 16 * 128 and plan(*big, config=BlackwellConfig(CLUSTER=1)).grid == 32 * 128
    fp8 = plan(*qkv((4, 32, 8192, 128), torch.float8_e4m3fn))
    assert fp8.num_ctas == 1 and fp8.grid == 32 * 128


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
    # The grid: the longest sequence's units for every sequence (an upper bound; the clusters past the table's
    # count find no unit).
    assert p.grid == 4 * 4 * 2 and p.num_ctas == 1


def test_clusters_run_non_causal_dense_problems_only():
    """A cluster config for a problem a cluster does not take runs in its one-CTA form: no deeper K/V ring than
    one CTA holds."""
    from gluon_attn.kernels.schedule import Packed

    q, k, v = qkv()
    pair = BlackwellConfig(CLUSTER=2, KV_STAGES=6)
    assert plan(q, k, v, config=pair).config == pair
    c = plan(q, k, v, causal=True, config=pair)
    assert c.num_ctas == 1 and c.config == BlackwellConfig(CLUSTER=1, KV_STAGES=3) and c.constexprs["BLOCK_M"] == 256
    cu = torch.tensor([0, 600, 1000], dtype=torch.int32)
    packed = plan(*qkv((1, 3, 1000, 128)), config=pair, varlen=Packed(cu, cu, 600, 600))
    assert packed.num_ctas == 1 and packed.config.CLUSTER == 1 and packed.constexprs["VARLEN"] is True


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
    with pytest.raises(ValueError, match="CLUSTER"):
        plan(*qkv(dtype=torch.float8_e5m2), config=BlackwellConfig(CLUSTER=2))
    with pytest.raises(ValueError, match="out_dtype"):
        plan(q, k, v, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        plan(q, k, v, out=torch.empty(1, 2, 3, 4))
