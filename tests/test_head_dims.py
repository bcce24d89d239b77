"""Head dims 32, 96 and 192 (and 192/128) without a GPU: they run in the D=64, 128 and 256 kernels
(``hopper_host.kernel_head_dim``), S = Q K^T over their own columns only; the builds that store
from registers (packed sequences; D=256's O, dK and dV) clip the columns past the tensors' head dim; the launch
plans, the configs and the refusals name the head dims taken."""
import collections
import dataclasses
import re

import pytest
import torch

from gluon_attn.inspection import BuildRequest, inspect_kernel, wgmma_operand_hazards
from gluon_attn.kernels import hopper_bwd_host, hopper_host
from gluon_attn.kernels.backend import BACKENDS, all_head_dim_pairs, all_head_dims, head_dims_text
from gluon_attn.problem import dtype_from_name
from gluon_attn.validation import check_qkv


def _sass(kernel, dtype, d, causal, varlen=False, config=None):
    got = inspect_kernel(BuildRequest(kernel=kernel, arch="sm_90a", dtype=dtype, head_dim=d, causal=causal,
                                      varlen=varlen, config=config or {}))
    return got, re.sub(r"\s+", " ", got.sass)


def _hgmma(sass: str) -> collections.Counter:
    """The wgmma instructions by shape (one per k-step): ``64x128x16.F32`` -> count."""
    return collections.Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)\.F32", sass))


@pytest.mark.compile
@pytest.mark.parametrize("kernel,dtype,d,causal", [("attention", "fp16", 96, True), ("attention", "fp8e4m3", 96, False),
                                                   ("attention", "bf16", 32, True), ("attention_bwd", "fp16", 96, True),
                                                   ("attention", "fp16", 192, False),
                                                   ("attention_bwd", "fp16", 192, True)])
def test_a_padded_head_dim_reduces_over_its_own_columns(kernel, dtype, d, causal):
    """S = Q K^T (and the backward's dP^T = V dO^T) take only the k-steps of the tensors' head dim, in power-of-two
    pieces of the kernel's tiles (96 = 64 + 32, 192 = 128 + 64): fewer wgmma steps than the kernel's own build, no
    spill in the block loops. Both builds take the padded head dim's config (D=96's tuned classes are its own; its
    backward's V_SPLIT, which the D=128 build cannot take, is left out here: its own test counts its MMA work)."""
    own = (hopper_host if kernel == "attention" else hopper_bwd_host).default_config(d, dtype, causal)
    knobs = {**dataclasses.asdict(own), **({"V_SPLIT": False} if kernel == "attention_bwd" else {})}
    padded, sass = _sass(kernel, dtype, d, causal, config=knobs)
    _, kernel_sass = _sass(kernel, dtype, hopper_host.kernel_head_dim(d), causal, config=knobs)
    assert sass != kernel_sass
    assert f"D={d} (the D={hopper_host.kernel_head_dim(d)} kernel)" in padded.report.description
    assert padded.report.loop_spill_instructions == 0 and wgmma_operand_hazards(padded.sass) == []
    if dtype != "fp8e4m3":  # (fp8's are QGMMA)
        steps, kernel_steps = _hgmma(sass), _hgmma(kernel_sass)
        assert sum(steps.values()) < sum(kernel_steps.values())
        if kernel == "attention" and d == 192:  # (S's wgmmas are the 64x64 ones there, O's 64x256: S's scale by d/D)
            assert steps["64x64x16"] * 256 == kernel_steps["64x64x16"] * 192
            assert steps["64x256x16"] == kernel_steps["64x256x16"]


@pytest.mark.compile
def test_the_192_128_pair_reduces_over_q_and_accumulates_over_v_head_dims():
    """DeepSeek-V3's pair in the D=256 kernel: S over q's 192 columns (64x64 wgmmas), O's accumulator and PV over v's
    128 (64x128 instead of 64x256): the pair's own MMA work, and no spill."""
    from gluon_attn.inspection import compile_build, mma_loop_spills, resource_usage, sass_text

    def steps(head_dim_v):
        build = hopper_host.build("fp16", 192, True, hopper_host.default_config(192, "fp16", True), "attn",
                                  head_dim_v=head_dim_v)
        cubin = compile_build(build, "sm_90a").asm["cubin"]
        sass = sass_text(cubin)
        assert mma_loop_spills(sass) == 0 and wgmma_operand_hazards(sass) == []
        return build, _hgmma(sass), resource_usage(cubin)["STACK"]

    pair, got, stack = steps(128)
    _, square, _ = steps(192)
    assert "D=192/128 (the D=256 kernel)" in pair.description and stack == 0
    assert got["64x64x16"] == square["64x64x16"] and got["64x128x16"] == square["64x256x16"] > 0
    assert "64x256x16" not in got


@pytest.mark.parametrize("qk,v", [(256, 256), (192, 128), (192, 192)])
def test_the_wide_backward_shares_each_gradients_columns_once(qk, v):
    """The D=256 backward's two warpgroups split dK's, dV's and dQ's head dims (``hopper_bwd.wide_share``): together
    exactly the tensors' own columns (dQ's in 64-column chunks), none past them; the 192/128 pair's MMA columns are
    the same in both warpgroups."""
    from gluon_attn.kernels.hopper_bwd import wide_share

    for grad, dim in (("dk", qk), ("dv", v), ("dq", qk // 64)):
        cols = [c for wg in (0, 1) for first, n in [wide_share(qk, v, wg, grad)] for c in range(first, first + n)]
        assert sorted(cols) == list(range(dim)), (grad, cols)
    work = [sum(wide_share(qk, v, wg, g)[1] * (64 if g == "dq" else 1) for g in ("dk", "dv", "dq")) for wg in (0, 1)]
    assert work[0] == work[1] if (qk, v) != (192, 192) else abs(work[0] - work[1]) == 64


def test_the_d256_kernel_keeps_q_192_columns_of_dq_accumulator():
    """``acc_cols``: q's 192 columns of dQ's fp32 accumulator in the D=256 kernel (the pair, 192/192): every chunk those
    kernels add lies inside them (``wide_share``'s chunks, the pair's chunks WG and 2; in fragment order three [64, 32]
    chunks a 32-query block), so the cast reads the accumulator whole; the other head dims keep their kernel's."""
    from gluon_attn.kernels.hopper_bwd import wide_share

    assert [hopper_bwd_host.acc_cols(d, r) for d, r in ((256, 192), (256, 256), (128, 96), (128, 128), (64, 32))] == \
        [192, 256, 128, 128, 64]
    for v in (128, 192):
        chunks = [c for wg in (0, 1) for first, n in [wide_share(192, v, wg, "dq")] for c in range(first, first + n)]
        assert max(chunks) * 64 + 64 <= 192
    assert max(wg * 64 for wg in (0, 1)) + 64 <= 192 and 128 + 64 <= 192  # (the pair's own units: chunk WG, 2)


def test_d96_backward_configs_walk_v_split_and_the_table_takes_three_stages():
    """``optimize --pass bwd`` walks V_SPLIT where it is valid (D=96 alone), and D=96's tuned classes take the split
    with three Q/dO stages (room for them at D=96, not at D=128: NOTES v115); its short contexts keep the rule's."""
    space = list(hopper_bwd_host.config_space())
    valid_96 = [c for c in space if not c.invalid_reasons(96, "fp16")]
    assert {c.V_SPLIT for c in valid_96} == {False, True}
    assert not any(c.V_SPLIT for c in space if not c.invalid_reasons(128, "fp16"))
    assert not any(c.V_SPLIT for c in space if not c.invalid_reasons(192, "fp16", 128))
    for causal in (False, True):
        cfg = hopper_bwd_host.default_config(96, "bf16", causal, 16384)
        assert (cfg.V_SPLIT, cfg.Q_STAGES, cfg.DQ_FIRST) == (True, 3, False)
        assert not cfg.invalid_reasons(96, "bf16")
        short = hopper_bwd_host.default_config(96, "fp16", causal, 1024)
        assert (short.V_SPLIT, short.Q_STAGES, short.DQ_FIRST) == (True, 2, True)
        assert hopper_bwd_host.default_config(128, "fp16", causal, 16384).Q_STAGES == 2
    fwd = hopper_host.default_config(96, "fp16", True, 16384)
    assert fwd.SUM_MMA and fwd.DYNAMIC and not hopper_host.default_config(128, "fp16", True, 16384).SUM_MMA


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_d96_backward_splits_dk_and_dv_over_its_own_head_dims(causal):
    """V_SPLIT (D=96's default, its tuned classes' and the rule's): dK and dV as [64, 64] + [64, 32] accumulators, so
    the MMA work the SASS issues is 64 keys x 64 queries x (S^T 96 + dP^T 96 + dV 96 + dK 96 + dQ^T's 128 keys over 64
    head dims) per block loop (two warpgroups, a masked and an unmasked loop each), 8/9 of the [64, 128]
    accumulators'; no loop spills, no operand hazard."""
    from gluon_attn.inspection import compile_build, mma_loop_spills, sass_text

    cfg = hopper_bwd_host.default_config(96, "fp16", causal, 8192)
    assert cfg.V_SPLIT and "_vs" in cfg.label() and cfg.invalid_reasons(96, "fp16") == []
    assert any("V_SPLIT" in r for r in cfg.invalid_reasons(128, "fp16"))
    sass = sass_text(compile_build(hopper_bwd_host.build("fp16", 96, causal, cfg, "attn_bwd"), "sm_90a").asm["cubin"])
    assert mma_loop_spills(sass) == 0 and wgmma_operand_hazards(sass) == []
    work = sum(int(m) * int(n) * int(k) * c for (m, n, k), c in
               ((shape.split("x"), c) for shape, c in _hgmma(sass).items()))
    assert work == 4 * 64 * 64 * (96 + 96 + 96 + 96 + 128)


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_the_pair_backward_runs_in_its_own_units(causal):
    """The 192/128 pair's backward in its own units (``hopper_bwd._bwd_blocks_pair``): 32-query blocks against 128-key
    units split by keys, dK in a 128- and a 64-column accumulator. Every wgmma k-step is real work: the MMA work the
    SASS issues (M x N x K summed over its HGMMAs) is exactly 64 keys x 32 queries x (S^T 192 + dP^T 128 + dV 128 + dK
    192 + dQ 192) per block loop (two warpgroups, a masked and an unmasked loop each), where the D=256 kernel's
    64-key units issued 1280 of D=256's columns for the pair's 832. No spill in the block loops, within the shared
    memory; D=256 and 192/192 keep their 64-key units."""
    from gluon_attn.inspection import compile_build, mma_loop_spills, mma_loops, sass_rows, sass_text

    cfg = hopper_bwd_host.default_config(192, "fp16", causal, 8192, 128)
    assert cfg.BLOCK_M == 32 and hopper_bwd_host.block_n(256, cfg.BLOCK_M) == 128
    assert hopper_bwd_host.default_config(192, "fp16", causal, 8192, 0).BLOCK_M == 64
    assert hopper_bwd_host.block_n(256, hopper_bwd_host.default_config(256).BLOCK_M) == 64
    build = hopper_bwd_host.build("fp16", 192, causal, cfg, "attn_bwd", head_dim_v=128)
    kernel = compile_build(build, "sm_90a")
    sass = sass_text(kernel.asm["cubin"])
    assert mma_loop_spills(sass) == 0 and wgmma_operand_hazards(sass) == []
    assert kernel.metadata.shared <= hopper_bwd_host.SM90_SMEM_BYTES
    work = sum(int(m) * int(n) * int(k) * c for (m, n, k), c in
               ((shape.split("x"), c) for shape, c in _hgmma(sass).items()))
    assert work == 4 * 64 * 32 * (192 + 128 + 128 + 192 + 192)
    # Non-causal: dQ^T's two chunks a block staged in their registers' order (DQ_FRAG), 4 STS.128 a chunk in every
    # block loop, none of the transposed tile's 16 STS.32, and the adds 2-D reduces of [64, 32] chunks; causal keeps
    # the transposed [32 queries, 64 head dims] tiles (the fragment order ran slower there: NOTES v113)
    rows = sass_rows(sass)
    for lo, hi in mma_loops(sass):
        stores = collections.Counter(m.group(1) for a, t in rows if lo <= a <= hi
                                     for m in [re.search(r"\*/\s+(?:@\S+\s+)?(STS(?!M)\S*)\s", t)] if m)
        assert stores == ({"STS.128": 8} if not causal else {"STS": 32}), stores
    assert sass.count("UTMAREDG.2D.ADD" if not causal else "UTMAREDG.3D.ADD") == 8 and sass.count("UTMAREDG") == 8
    assert ("bwd_BM32_Q3_FR" in build.description) == (not causal)
    assert "D=192/128 (the D=256 kernel)" in build.description and "bwd_BM32" in build.description
    assert cfg.invalid_reasons(192, "fp16", 128) == []
    assert any("BLOCK_M 32" in r for r in cfg.invalid_reasons(192, "fp16", 0))  # (192/192: the 64-key units only)


@pytest.mark.compile
@pytest.mark.parametrize("dtype,causal", [("fp16", False), ("bf16", True), ("fp8e4m3", False)])
def test_pair_tile_runs_the_pair_in_128_key_blocks(dtype, causal):
    """``HopperConfig.PAIR_TILE`` (FA4's tile for the 192/128 pair): 128-key blocks, K loaded in 64-column pieces,
    V in v's 128 columns; S and O as [64, 128] wgmmas only, no spill or operand hazard, within the shared memory; a
    config error for any other head dims."""
    from gluon_attn.inspection import compile_build, mma_loop_spills, resource_usage, sass_text

    cfg = dataclasses.replace(hopper_host.default_config(192, dtype, causal), PAIR_TILE=True)
    is_fp8 = dtype.startswith("fp8")
    blocks = hopper_host.block_shapes(256, cfg, is_fp8, pair_tile=True)
    assert blocks["desc_k"] == [1, 1, 128, 64] and blocks["desc_v"] == [1, 1, 128, 128]
    build = hopper_host.build(dtype, 192, causal, cfg, "attn", head_dim_v=128)
    kernel = compile_build(build, "sm_90a")
    sass = sass_text(kernel.asm["cubin"])
    assert mma_loop_spills(sass) == 0 and resource_usage(kernel.asm["cubin"])["STACK"] == 0
    assert wgmma_operand_hazards(sass) == [] and kernel.metadata.shared <= hopper_host.SM90_SMEM_BYTES
    k = 32 if is_fp8 else 16
    assert set(re.findall(r"[HQ]GMMA\.(\d+x\d+x\d+)", sass)) == {f"64x128x{k}"}
    assert "PAIR_TILE is the 192/128 pair's" in "; ".join(cfg.invalid_reasons(128, dtype))
    with pytest.raises(ValueError, match="PAIR_TILE is the dense 192/128 pair's"):
        hopper_host.build(dtype, 192, causal, cfg, "attn")  # (v's head dim 192)
    torch_dtype = dtype_from_name(dtype)
    plan = hopper_host._launch_plan(Z=1, H=4, H_KV=4, N_Q=300, N_KV=300, D=192, D_V=128, dtype=torch_dtype,
                                    out_dtype=torch.float16 if is_fp8 else torch_dtype, causal=causal, config=cfg,
                                    return_lse=False, kernel_name="gluon_attention", head_group_size=None, n_sms=132,
                                    n_seqs=0)
    assert plan.blocks == blocks and plan.consts["V_DIM"] == 128


def test_the_pair_runs_in_pair_tile_blocks_by_default_and_the_provider_takes_the_64_key_ones(monkeypatch):
    """A dense 192/128 launch without a config takes PAIR_TILE's 128-key blocks (``hopper_host.pair_config``); 192/192,
    packed sequences and a given config keep theirs. experiments/pair_tile.py's ``gluon-64keys`` is the pair's config
    with the knob off (the D=256 kernel's 64-key blocks)."""
    from gluon_attn.bench import provider

    from .experiment_scripts import load_experiment

    def plan(d_v, n_seqs=0, config=None):
        return hopper_host._launch_plan(Z=1, H=4, H_KV=4, N_Q=300, N_KV=300, D=192, D_V=d_v, dtype=torch.bfloat16,
                                   out_dtype=torch.bfloat16, causal=True, config=config, return_lse=False,
                                   kernel_name="gluon_attention", head_group_size=None, n_sms=132, n_seqs=n_seqs)

    assert plan(128).blocks["desc_k"] == [1, 1, 128, 64] and plan(128).consts["V_DIM"] == 128
    assert plan(192).blocks["desc_k"] == [1, 1, 64, 256]
    assert plan(128, n_seqs=2).blocks["desc_k"] == [1, 1, 64, 256]
    assert plan(128, config=hopper_host.default_config(192, "bf16", True)).blocks["desc_k"] == [1, 1, 64, 256]
    monkeypatch.setattr(provider, "PROVIDERS", dict(provider.PROVIDERS))  # (the module registers gluon-64keys)
    cfg = load_experiment("pair_tile").keys64_config("bf16", True, 16384)
    assert cfg == hopper_host.default_config(192, "bf16", True, 16384) and not cfg.PAIR_TILE
    assert "gluon-64keys" in provider.PROVIDERS


@pytest.mark.compile
def test_the_backward_of_head_dim_32_runs_the_d64_binary():
    """D=32's backward keeps the D=64 kernel's four k-steps (``hopper_bwd_host._reduce_dims``: in two, its causal block
    loop spilled twice as much)."""
    assert _sass("attention_bwd", "bf16", 32, False)[1] == _sass("attention_bwd", "bf16", 64, False)[1]


@pytest.mark.compile
@pytest.mark.parametrize("kernel,d,varlen", [("attention", 96, True), ("attention_bwd", 96, True),
                                            ("attention", 192, False), ("attention_bwd", 192, True)])
def test_padded_builds_clip_the_columns_they_store_from_registers(kernel, d, varlen):
    """Packed sequences' last tiles, and D=256's O at every tile, are stored from registers: the padded builds
    mask the columns past the tensors' head dim (192/128 runs this same build: the kernel reads v's and O's head
    dim from their descriptors). (The backward's D=256 dK and dV go out by TMA, which clips them: a dense
    D=192 backward is the D=256 binary.)"""
    padded, sass = _sass(kernel, "fp16", d, False, varlen=varlen)
    _, unpadded = _sass(kernel, "fp16", hopper_host.kernel_head_dim(d), False, varlen=varlen)
    assert sass != unpadded
    rep = padded.report
    assert rep.loop_spill_instructions == 0 and wgmma_operand_hazards(padded.sass) == []
    if kernel == "attention":
        # (D=256's O clipped by its descriptor's head dim costs ptxas a register there: a few spills in the
        # epilogue, outside the block loops; 2 non-causal, 14 causal under the wheel's ptxas 12.9)
        assert rep.spill_instructions <= (16 if d == 192 else 0)


def test_launch_plans_take_the_kernels_blocks_and_say_padded():
    args = dict(Z=2, H=8, H_KV=2, N_Q=1000, N_KV=1000, dtype=torch.float16, out_dtype=torch.float16, causal=True,
                config=None, return_lse=False, kernel_name="gluon_attention", head_group_size=None, n_sms=132,
                n_seqs=0)
    p96 = hopper_host._launch_plan(D=96, D_V=96, **args)
    p128 = hopper_host._launch_plan(D=128, D_V=128, **args)
    assert p96.blocks == p128.blocks and p96.blocks["desc_q"][3] == 128
    assert p96.consts["PADDED"] and not p128.consts["PADDED"] and p96.key != p128.key
    assert (p96.consts["QK_DIM"], p128.consts["QK_DIM"]) == (96, 0)  # (S over 96 columns; 0: the kernel's)
    assert hopper_host._launch_plan(D=32, D_V=32, **args).blocks["desc_k"][3] == 64
    p192 = hopper_host._launch_plan(D=192, D_V=128, **args)  # DeepSeek-V3's: D=256's kernel, PAIR_TILE's blocks
    assert p192.blocks["desc_v"][3] == 128 and p192.blocks["desc_k"][3] == 64 and p192.consts["PADDED"]
    p192_192 = hopper_host._launch_plan(D=192, D_V=192, **args)
    assert p192_192.blocks["desc_v"][3] == 256 and p192.consts["QK_DIM"] == p192_192.consts["QK_DIM"] == 192
    assert (p192.consts["V_DIM"], p192_192.consts["V_DIM"]) == (128, 0)  # (O over v's 128 columns; 0: the kernel's)
    # (D=96 takes its kernel's entries where it has none of its own: non-causal; causal adds the row sums by wgmma)
    assert hopper_host.default_config(96, "fp16", False) == hopper_host.default_config(128, "fp16", False)
    assert hopper_host.default_config(96, "fp16", True) == dataclasses.replace(
        hopper_host.default_config(128, "fp16", True), SUM_MMA=True)
    assert hopper_bwd_host.default_config(32, "bf16", False) == hopper_bwd_host.default_config(64, "bf16", False)


def test_the_head_dims_taken_and_the_refusal_of_others():
    sm90 = BACKENDS["sm_90a"]
    assert sm90.head_dims == (32, 64, 96, 128, 192, 256) and hopper_bwd_host.HEAD_DIMS == sm90.head_dims
    assert sm90.head_dim_pairs == ((192, 128),) == hopper_bwd_host.HEAD_DIM_PAIRS
    assert all(sm90.backward_problems(d, "fp16") == [] for d in (32, 96, 192))
    assert sm90.backward_problems(192, "bf16", 128) == [] and sm90.head_dim_problem(192, 128) is None
    assert "head dim 80 (the backward takes 32, 64, 96, 128, 192, 256)" in sm90.backward_problems(80, "fp16")
    assert "head dims 128/64 (the backward takes v's head dim equal to q's, or 192/128 (q, k / v))" in \
        sm90.backward_problems(128, "fp16", 64)
    assert "head dims 128 (q, k) and 64 (v) are not supported on sm_90a" in sm90.head_dim_problem(128, 64)
    assert "not supported on sm_100a" in BACKENDS["sm_100a"].head_dim_problem(192, 128)
    assert head_dims_text() == "32, 64, 96, 128, 192, 256, 192/128 (sm_90a); 32, 64, 96, 128 (sm_100a)"
    q = torch.zeros(1, 2, 8, 80, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"32, 64, 96, 128, 192, 256"):
        check_qkv(q, q, q, head_dims=all_head_dims())
    q, v = torch.zeros(1, 2, 8, 192, dtype=torch.float16), torch.zeros(1, 2, 8, 128, dtype=torch.float16)
    check_qkv(q, q, v, head_dims=all_head_dims(), head_dim_pairs=all_head_dim_pairs())
    with pytest.raises(ValueError, match=r"head dim 192 \(v: 64\) is not supported.*or 192/128 \(q, k / v\)"):
        check_qkv(q, q, v[..., :64], head_dims=all_head_dims(), head_dim_pairs=all_head_dim_pairs())
    with pytest.raises(ValueError, match=r"the same for q, k and v$"):
        check_qkv(q, q, v, head_dims=all_head_dims())  # (a caller without pairs)
    assert hopper_host.HopperConfig().invalid_reasons(96, "fp16") == []
    assert "head dim 80 not supported (supported: 32, 64, 96, 128, 192, 256)" in \
        hopper_host.HopperConfig().invalid_reasons(80, "fp16")
