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
    from gluon_attn.kernels.hopper_host import HopperConfig
    check_output_and_lse(inputs, config=HopperConfig(**knobs))


def check_output_and_lse(inputs, **kw):
    """Output (poisoned first) and lse against the fp32 reference (also the padded head dims' test)."""
    dtype = inputs.problem.dtype
    out, lse = _run(inputs, return_lse=True, **kw)
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
def test_deeper_ring_and_pingpong(dtype, causal, n):
    """A third K/V stage at D=64 with the warpgroups taking turns (ping-pong), on a projection view."""
    _hopper()
    from gluon_attn.kernels.hopper_host import HopperConfig
    cfg = HopperConfig(KV_STAGES=3, PINGPONG=True)
    inputs = projection_view_inputs(2, 3, n, 64, causal, dtype)
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


@pytest.mark.parametrize("n", [1, 1000, 4096 + 3])
def test_causal_pairs_cover_every_block(n):
    """The causal schedule of mirrored query-block pairs covers every block once (an odd count of query
    blocks leaves a single middle block per head)."""
    _hopper()
    inputs = make_inputs(Problem(1, 3, n, 64, True, "fp16"), "cuda")
    acc = check_accuracy(_run(inputs), reference_for(inputs), "fp16")
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


@pytest.mark.parametrize("dtype,head_dim", [("fp8e4m3", 64), ("fp16", 64), ("bf16", 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096 + 3])
def test_three_consumer_warpgroups(dtype, head_dim, causal, n):
    """192-row tiles (three consumer warpgroups at 160 registers): tails of one, two or three
    warpgroups' rows, causal diagonals that cross a warpgroup boundary, odd Z*H."""
    _hopper()
    from gluon_attn.kernels.hopper_host import HopperConfig
    cfg = HopperConfig(BLOCK_M=192, KV_STAGES=2)
    inputs = projection_view_inputs(1, 3, n, head_dim, causal, dtype)
    acc = check_accuracy(_run(inputs, config=cfg), reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp16", 128, {}), ("fp8e4m3", 128, dict(KV_STAGES=4)), ("fp16", 64, dict(PINGPONG=True)),
    ("bf16", 64, dict(BLOCK_M=192, KV_STAGES=2, PINGPONG=True))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("zhn", [(1, 3, 1), (2, 3, 1000), (1, 5, 4096 + 3), (3, 47, 1024)])
def test_dynamic_scheduler(dtype, head_dim, knobs, causal, zhn):
    """Units from the global counter (DYNAMIC): every tile once, whichever program takes it, with fewer
    units than programs (N=1), about one round (2 x 3 x 8) and many rounds (141 heads x 8 blocks); a
    second call on the same inputs (a fresh counter) gives the same output."""
    _hopper()
    from gluon_attn.kernels.hopper_host import HopperConfig
    Z, H, N = zhn
    inputs = make_inputs(Problem(Z, H, N, head_dim, causal, dtype), "cuda")
    cfg = HopperConfig(DYNAMIC=True, **knobs)
    out = _run(inputs, config=cfg)
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message
    torch.testing.assert_close(_run(inputs, config=cfg), out, atol=0, rtol=0)


@pytest.mark.parametrize("h,h_kv,n_kv", [(2, 2, None), (4, 1, 128 * 128 + 200)])
def test_single_tile_units(h, h_kv, n_kv):
    """Long causal contexts under the dynamic scheduler take one tile per unit, longest first (``singles``):
    every tile once (also GQA, and bottom-right with N_KV > N_Q), output and lse as the fp32 reference's."""
    _hopper()
    from gluon_attn.kernels.hopper_host import HopperConfig, singles
    n = 128 * 128 + 3  # 129 query blocks: the single-tile schedule, its last block 3 rows
    assert singles(HopperConfig(DYNAMIC=True), True, False, n)
    _check_config(make_inputs(Problem(1, h, n, 128, True, "fp16", H_KV=h_kv, N_KV=n_kv), "cuda"), DYNAMIC=True)


def test_dynamic_scheduler_lse():
    _hopper()
    _check_config(make_inputs(Problem(2, 29, 1000, 128, True, "fp16"), "cuda"), DYNAMIC=True)


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp16", 128, {}), ("bf16", 64, {}), ("fp8e4m3", 128, dict(KV_STAGES=4, DYNAMIC=True)), ("fp8e5", 128, {}),
    ("fp16", 64, dict(BLOCK_M=192, KV_STAGES=2, PINGPONG=True)), ("fp8e4m3", 64, dict(BLOCK_M=192, KV_STAGES=4))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096 + 3])
def test_masked_blocks(dtype, head_dim, knobs, causal, n):
    """The key-tail and diagonal masks (``masks.mask_block``: each register's column constant against its
    thread's bound): two- and three-warpgroup tiles, both schedulers, tails and diagonals; output and lse
    against the fp32 reference."""
    _hopper()
    inputs = projection_view_inputs(1, 3, n, head_dim, causal, dtype)
    _check_config(inputs, **knobs)


@pytest.mark.parametrize("dtype,head_dim,knobs", [
    ("fp8e4m3", 128, dict(KV_STAGES=4, DYNAMIC=True)), ("fp8e5", 128, {}), ("fp8e4m3", 128, dict(KV_STAGES=3)),
    ("bf16", 64, {}), ("fp16", 64, dict(PINGPONG=True)), ("fp8e4m3", 64, dict(BLOCK_M=192, KV_STAGES=4)),
    ("fp16", 128, {}), ("bf16", 64, dict(BLOCK_M=192))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096 + 3])
def test_sum_mma(dtype, head_dim, knobs, causal, n):
    """SUM_MMA (the row sums by a wgmma against a ones tile): with and without ping-pong, two and three
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
