"""Correctness of the sm_90a kernel against the fp32 reference (run on an H100/H200)."""
import pytest
import torch

import gluon_attn
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import check_accuracy, reference_for
from gluon_attn.validation import UnsupportedError

from .gpu_helpers import CORRECTNESS_GRID, fp8_scales, projection_view_inputs, run_poisoned

pytestmark = pytest.mark.gpu


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel here targets sm_90a; this GPU is not Hopper")


def _run(inputs, **kw):
    return run_poisoned(gluon_attn.attention, inputs, **kw)


def _check_config(inputs, **knobs):
    """Run with ``HopperConfig(**knobs)`` and compare output and lse with the fp32 reference."""
    from gluon_attn.kernels.hopper import HopperConfig
    dtype = inputs.problem.dtype
    out, lse = _run(inputs, return_lse=True, config=HopperConfig(**knobs))
    ref, ref_lse = reference_for(inputs, return_lse=True)
    acc = check_accuracy(out, ref, dtype)
    assert acc.ok, acc.message
    tol = 2e-3 if not dtype.startswith("fp8") else 3e-2
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,head_dim,causal,zhn", CORRECTNESS_GRID)
def test_matches_reference(dtype, head_dim, causal, zhn):
    _hopper()
    Z, H, N = zhn
    inputs = make_inputs(Problem(Z, H, N, head_dim, causal, dtype), "cuda")
    out = _run(inputs)
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype", ["fp16", "fp8e4m3"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_views_without_copy(dtype, causal):
    _hopper()
    inputs = projection_view_inputs(2, 3, 777, 128, causal, dtype)
    q, k, v = inputs.q, inputs.k, inputs.v
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = gluon_attn.attention(q, k, v, causal=causal, **fp8_scales(inputs))
    assert out.stride() == torch.empty_like(q, dtype=out.dtype).stride()  # output keeps q's layout
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype", ["fp16", "fp8e4m3"])
@pytest.mark.parametrize("causal", [False, True])
def test_return_lse(dtype, causal):
    _hopper()
    inputs = make_inputs(Problem(1, 3, 1000, 128, causal, dtype), "cuda")
    out, lse = _run(inputs, return_lse=True)
    ref, ref_lse = reference_for(inputs, return_lse=True)
    assert check_accuracy(out, ref, dtype).ok
    assert lse.shape == (1, 3, 1000) and lse.dtype == torch.float32
    tol = 2e-3 if dtype == "fp16" else 3e-2
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


def test_kernel_name_runs_as_asked():
    _hopper()
    inputs = make_inputs(Problem(1, 2, 300, 64, False, "fp16"), "cuda")
    a = _run(inputs, kernel_name="plain")
    b = _run(inputs, kernel_name="cutlass")
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    from gluon_attn.kernels.hopper import hopper_attention_kernel
    names = {k.name for cache in hopper_attention_kernel.device_caches.values() for k in cache[0].values()}
    assert {"gluon_attention", "cutlass_gluon_attention"} <= names


def test_bf16_output_for_fp8():
    _hopper()
    inputs = make_inputs(Problem(1, 2, 256, 128, False, "fp8e4m3"), "cuda")
    out = gluon_attn.attention(inputs.q, inputs.k, inputs.v, descale_q=inputs.descale_q,
                               descale_k=inputs.descale_k, descale_v=inputs.descale_v, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert check_accuracy(out, reference_for(inputs), "fp8e4m3").ok


def test_unsupported_gpu_gets_a_clear_error():
    if torch.cuda.get_device_capability()[0] in (9, 10):
        pytest.skip("this GPU has a Gluon kernel (sm_90a or sm_100a)")
    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    with pytest.raises(UnsupportedError, match="supported: sm_90a"):
        gluon_attn.attention(q, k, v)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8e4m3"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [17, 1000])
def test_register_epilogue_and_deeper_ring(dtype, causal, n):
    """The variant that stores O from registers and gives its staging memory to a third K/V stage
    (with one Q tile per consumer: the loader does not run a tile ahead)."""
    _hopper()
    from gluon_attn.kernels.hopper import HopperConfig
    cfg = HopperConfig(KV_STAGES=3, EPILOGUE_TMA=False, PINGPONG=False, Q_STAGES=1)
    inputs = projection_view_inputs(2, 3, n, 128, causal, dtype)
    out = _run(inputs, config=cfg)
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message


def test_sizes_after_a_first_launch_reuse_the_binary_correctly():
    """The direct launch path keys on constexprs only: sizes that would have specialized differently
    (N_CTX == 1, N_CTX % 16 != 0) must still be right after a first launch with N_CTX = 1024."""
    _hopper()
    for n in (1024, 1, 1000, 4096 + 3):
        inputs = make_inputs(Problem(1, 2, n, 64, True, "fp16"), "cuda")
        acc = check_accuracy(_run(inputs), reference_for(inputs), "fp16")
        assert acc.ok, (n, acc.message)


def test_direct_launch_distinguishes_dtype_and_head_dim():
    """Classes whose constexprs coincide (fp16/bf16, D=64/128, e4m3/e5m2) must not share a binary."""
    _hopper()
    for dtype, d in (("fp16", 64), ("bf16", 64), ("fp16", 128), ("bf16", 128), ("fp8e4m3", 64), ("fp8e5", 64),
                     ("fp16", 64)):
        inputs = make_inputs(Problem(1, 2, 300, d, True, dtype), "cuda")
        acc = check_accuracy(_run(inputs), reference_for(inputs), dtype)
        assert acc.ok, (dtype, d, acc.message)


@pytest.mark.parametrize("dtype", ["fp16", "fp8e4m3"])
def test_direct_launch_with_reused_addresses(dtype):
    """Encoded TMA descriptors are cached per (address, shape, strides): views of one storage with other
    shapes or strides, and new data at the same address, must all be computed from what is there now."""
    _hopper()
    from gluon_attn.problem import Inputs
    src = make_inputs(Problem(1, 4, 300, 64, True, dtype), "cuda")
    flat = [t.reshape(-1) for t in (src.q, src.k, src.v)]
    shapes = [(1, 4, 300, 64), (1, 2, 600, 64), None]  # as made; same addresses, other shape; other strides
    for i, shape in enumerate(shapes):
        if shape is None:  # [Z, N, H, D] storage seen as [Z, H, N, D]
            q, k, v = (f.view(1, 300, 4, 64).transpose(1, 2) for f in flat)
        else:
            q, k, v = (f.view(*shape) for f in flat)
        inputs = Inputs(Problem(*q.shape, True, dtype), q, k, v, src.descale_q, src.descale_k, src.descale_v)
        for _ in range(2):
            acc = check_accuracy(_run(inputs), reference_for(inputs), dtype)
            assert acc.ok, (i, acc.message)
            for f in flat:  # new data at the same addresses (rotated; copy_ works for every dtype)
                old = f.clone()
                f[:-7].copy_(old[7:])
                f[-7:].copy_(old[:7])


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("n", [1, 1000, 4096 + 3])
def test_causal_schedules(pairs, n):
    """Both causal schedules cover every query block once: mirrored pairs (the default; an odd count of
    query blocks leaves a single middle block per head) and the grouped longest-first order."""
    _hopper()
    from gluon_attn.kernels.hopper import HopperConfig
    inputs = make_inputs(Problem(1, 3, n, 64, True, "fp16"), "cuda")
    acc = check_accuracy(_run(inputs, config=HopperConfig(PAIRS=pairs)), reference_for(inputs), "fp16")
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_vt_matches_its_reference(dtype):
    """The fp8 V^T kernel (transpose + the key permutation P's relabelling needs) equals the slow
    PyTorch construction exactly, padded keys zero, for tails and strided views."""
    _hopper()
    from gluon_attn.kernels.v_transpose import fp8_vt, fp8_vt_reference
    for z, h, n, d in ((1, 1, 1, 64), (2, 3, 17, 128), (1, 2, 1000, 64), (2, 2, 4096 + 3, 128)):
        v = torch.randn(z, n, h, d, device="cuda").to(dtype).transpose(1, 2)  # a model-projection view
        vt, shape, strides = fp8_vt(v)
        ref = fp8_vt_reference(v)
        assert shape == list(ref.shape) and strides == list(vt.stride())
        assert torch.equal(vt.view(torch.uint8), ref.view(torch.uint8)), (z, h, n, d)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_paired_p_convert_is_exactly_the_per_value_convert(dtype, causal):
    """P packed by one paired convert per register (cvt.rn.*x2) must give bit-identical outputs to the
    per-value conversion: same rounding, same key order in the A operand."""
    _hopper()
    from gluon_attn.kernels.hopper import HopperConfig
    inputs = make_inputs(Problem(2, 3, 1000, 128, causal, dtype), "cuda")
    paired = _run(inputs, config=HopperConfig(PAIRED_CVT=True))
    single = _run(inputs, config=HopperConfig(PAIRED_CVT=False))
    assert torch.equal(paired, single)
    assert check_accuracy(paired, reference_for(inputs), dtype).ok


@pytest.mark.parametrize("dtype,head_dim,block_n", [("fp16", 64, 64), ("fp16", 128, 64), ("bf16", 64, 64),
                                                     ("fp8e4m3", 64, 128), ("fp16", 64, 128), ("bf16", 64, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096 + 3])
def test_three_consumer_warpgroups(dtype, head_dim, block_n, causal, n):
    """192-row tiles (three consumer warpgroups at 160 registers): tails of one, two or three
    warpgroups' rows, causal diagonals that cross a warpgroup boundary, odd Z*H."""
    _hopper()
    from gluon_attn.kernels.hopper import HopperConfig
    cfg = HopperConfig(BLOCK_M=192, BLOCK_N=block_n, KV_STAGES=2, CONSUMER_REGS=160)
    inputs = projection_view_inputs(1, 3, n, head_dim, causal, dtype)
    acc = check_accuracy(_run(inputs, config=cfg), reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp16", 128, dict(BLOCK_N=160, Q_STAGES=1)), ("bf16", 64, dict(BLOCK_N=192, KV_STAGES=3)),
    ("fp8e4m3", 128, dict(BLOCK_N=192, KV_STAGES=3)), ("fp8e5", 64, dict(BLOCK_N=160, KV_STAGES=4)),
    ("fp16", 64, dict(BLOCK_M=192, BLOCK_N=96, KV_STAGES=2, CONSUMER_REGS=160, PINGPONG=True))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 150, 1000, 4096 + 3])
def test_split_key_blocks(dtype, head_dim, knobs, causal, n):
    """Key blocks of 96, 160 or 192 keys (two wgmmas per GEMM): tails inside either part (n=150 ends in
    the second part of a 160-key block, n=17 leaves it empty), diagonals through both parts."""
    _hopper()
    from gluon_attn.kernels.hopper import HopperConfig
    inputs = projection_view_inputs(1, 3, n, head_dim, causal, dtype)
    acc = check_accuracy(_run(inputs, config=HopperConfig(**knobs)), reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_late_and_early_pack_agree(causal, head_dim):
    """P packed from f16 pairs next to the PV wgmma (late) against Triton's fp32 -> fp8 convert at the
    softmax's end (early): the double rounding moves at most a few P values by one fp8 unit."""
    _hopper()
    from gluon_attn.kernels.hopper import HopperConfig
    inputs = make_inputs(Problem(2, 3, 1000, head_dim, causal, "fp8e4m3"), "cuda")
    late = _run(inputs, config=HopperConfig(FP8_LATE_PACK=True))
    early = _run(inputs, config=HopperConfig(FP8_LATE_PACK=False))
    ref = reference_for(inputs)
    assert check_accuracy(late, ref, "fp8e4m3").ok and check_accuracy(early, ref, "fp8e4m3").ok
    assert (late.float() - early.float()).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp16", 128, {}), ("fp8e4m3", 128, dict(KV_STAGES=4)), ("fp16", 64, dict(PAIRS=False)),
    ("bf16", 64, dict(BLOCK_M=192, BLOCK_N=128, KV_STAGES=2, CONSUMER_REGS=160, PINGPONG=True))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("zhn", [(1, 3, 1), (2, 3, 1000), (1, 5, 4096 + 3), (3, 47, 1024)])
def test_dynamic_scheduler(dtype, head_dim, knobs, causal, zhn):
    """Units from the global counter (DYNAMIC): every tile once, whichever program takes it, with fewer
    units than programs (N=1), about one round (2 x 3 x 8) and many rounds (141 heads x 8 blocks); a
    second call on the same inputs (a fresh counter) gives the same output."""
    _hopper()
    from gluon_attn.kernels.hopper import HopperConfig
    Z, H, N = zhn
    inputs = make_inputs(Problem(Z, H, N, head_dim, causal, dtype), "cuda")
    cfg = HopperConfig(DYNAMIC=True, **knobs)
    out = _run(inputs, config=cfg)
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message
    torch.testing.assert_close(_run(inputs, config=cfg), out, atol=0, rtol=0)


def test_dynamic_scheduler_lse():
    _hopper()
    _check_config(make_inputs(Problem(2, 29, 1000, 128, True, "fp16"), "cuda"), DYNAMIC=True)


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp16", 128, {}), ("bf16", 64, {}), ("fp8e4m3", 128, dict(KV_STAGES=4, DYNAMIC=True)), ("fp8e5", 128, {}),
    ("fp8e4m3", 128, dict(BLOCK_N=192, KV_STAGES=3)), ("fp16", 128, dict(BLOCK_N=160, Q_STAGES=1)),
    ("fp16", 64, dict(BLOCK_M=192, BLOCK_N=128, KV_STAGES=2, CONSUMER_REGS=160, PINGPONG=True)),
    ("fp8e4m3", 64, dict(BLOCK_M=192, BLOCK_N=128, KV_STAGES=4, CONSUMER_REGS=160))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096 + 3])
def test_row_tree(dtype, head_dim, knobs, causal, n):
    """ROW_TREE (S's row max as a tree): whole and split key blocks (a 32- and a 64-key second part),
    two- and three-warpgroup tiles, tails and diagonals; output and lse against the fp32 reference."""
    _hopper()
    inputs = projection_view_inputs(1, 3, n, head_dim, causal, dtype)
    _check_config(inputs, ROW_TREE=True, **knobs)


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp8e4m3", 128, dict(KV_STAGES=4, DYNAMIC=True)), ("fp8e5", 128, {}), ("fp8e4m3", 128, dict(ROW_TREE=True)),
    ("bf16", 64, {}), ("fp16", 64, dict(OVERLAP=False)),
    ("fp8e4m3", 64, dict(BLOCK_M=192, BLOCK_N=128, KV_STAGES=4, CONSUMER_REGS=160)),
    ("fp16", 128, dict(ROW_TREE=True)), ("bf16", 64, dict(BLOCK_M=192, BLOCK_N=128, CONSUMER_REGS=160))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096 + 3])
def test_sum_mma(dtype, head_dim, knobs, causal, n):
    """SUM_MMA (the row sums by a wgmma against a ones tile): with and without the overlap, two and three
    warpgroups (16-bit: reading one shared tile), tails and diagonals; output and lse against the fp32
    reference."""
    _hopper()
    inputs = projection_view_inputs(1, 3, n, head_dim, causal, dtype)
    _check_config(inputs, SUM_MMA=True, **knobs)


@pytest.mark.parametrize("dtype,head_dim,knobs", [("fp8e4m3", 128, dict(KV_STAGES=4, DYNAMIC=True)),
                                                  ("fp8e5", 128, {}), ("fp16", 64, {}), ("fp16", 128, {})])
@pytest.mark.parametrize("causal", [False, True])
def test_sum_mma_long_rows(dtype, head_dim, knobs, causal):
    """SUM_MMA over 32768 keys: l grows to thousands while each block adds at most 128 (an fp8 wgmma
    carrying l across blocks lost 60% of it here; the tests above, at most 4099 keys, passed)."""
    _hopper()
    inputs = make_inputs(Problem(1, 2, 32768, head_dim, causal, dtype), "cuda")
    _check_config(inputs, SUM_MMA=True, **knobs)


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp16", 128, dict(ROW_TREE=True)), ("bf16", 128, dict(ROW_TREE=True, DYNAMIC=True)), ("fp16", 64, {}),
    ("fp8e4m3", 128, dict(KV_STAGES=4, SUM_MMA=True)), ("fp8e5", 128, dict(DYNAMIC=True)),
    ("fp8e4m3", 64, dict(BLOCK_M=192, BLOCK_N=64, KV_STAGES=4, CONSUMER_REGS=160))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096 + 3])
def test_q_in_registers(dtype, head_dim, knobs, causal, n):
    """Q_REGS (Q loaded into registers once per tile, its slot released at once): every dtype, both
    head dims, tails and diagonals, both schedulers; output and lse against the fp32 reference."""
    _hopper()
    inputs = projection_view_inputs(1, 3, n, head_dim, causal, dtype)
    _check_config(inputs, Q_REGS=True, **knobs)


def _growing_keys(inputs, gain: float = 3.0):
    """The same (16-bit) inputs with keys scaled up along the sequence (x1 at key 0 to x(1 + gain) at
    the last): the rows' maxima keep rising from block to block, as a lazily rescaled softmax must
    follow."""
    import dataclasses
    n = inputs.k.shape[2]
    ramp = 1.0 + gain * torch.arange(n, device="cuda", dtype=torch.float32) / n
    return dataclasses.replace(inputs, k=(inputs.k.float() * ramp[:, None]).to(inputs.k.dtype))


def _max_moves(inputs, block_n: int) -> float:
    """Share of (row, key block after the first) steps where a lazily kept max moves (non-causal)."""
    from gluon_attn.kernels.hopper import RESCALE_HEADROOM
    headroom = RESCALE_HEADROOM.value
    s = torch.matmul(inputs.q.float(), inputs.k.float().transpose(-1, -2))
    s = s * (1.4426950408889634 / inputs.q.shape[-1] ** 0.5)
    blocks = [s[..., i:i + block_n].amax(-1) for i in range(0, s.shape[-1], block_n)]
    m, moves = blocks[0], 0
    for b in blocks[1:]:
        moved = b > m + headroom
        moves += moved.sum().item()
        m = torch.where(moved, b, m)
    return moves / max(1, blocks[0].numel() * (len(blocks) - 1))


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp16", 128, dict(ROW_TREE=True)), ("bf16", 128, dict(ROW_TREE=True, DYNAMIC=True, Q_REGS=True)),
    ("fp16", 64, {}), ("fp16", 128, dict(BLOCK_N=160, Q_STAGES=1)),
    ("bf16", 64, dict(BLOCK_M=192, BLOCK_N=64, KV_STAGES=4, CONSUMER_REGS=160, PINGPONG=True))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [17, 1000, 4096 + 3])
def test_lazy_rescale(dtype, head_dim, knobs, causal, n):
    """LAZY_RESCALE on keys whose scores grow along the sequence: some steps move a row's max (O
    rescaled in that warp), most do not (O's rescale skipped); output and lse against the fp32
    reference."""
    _hopper()
    inputs = _growing_keys(projection_view_inputs(1, 3, n, head_dim, causal, dtype))
    if n > 1000:
        share = _max_moves(inputs, knobs.get("BLOCK_N", 128))
        assert 0.002 < share < 0.5, share  # both paths of the skip are taken
    _check_config(inputs, LAZY_RESCALE=True, **knobs)
