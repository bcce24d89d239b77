"""Head dims 32, 96 and 192, and 192 with v's 128 (DeepSeek-V3's), on Hopper (run on an H100/H200): they run in
the D=64, 128 and 256 kernels with the columns past the tensors' head dims read as zeros and clipped from every
store (``hopper_host.kernel_head_dim``). Forward (16-bit and fp8, odd sizes, GQA, the lse, packed sequences), backward
(autograd, packed, deterministic) against the fp32 reference, outputs poisoned with NaN before each run."""
import dataclasses
import itertools

import pytest
import torch

import gluon_attn
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import attention_reference, check_accuracy, reference_for, varlen_reference

from .gpu_helpers import run_poisoned
from .test_backward_gpu import _check_grads, _leaves, _poison_allocator, _ref_grads, check_backward_case
from .test_hopper_gpu import check_output_and_lse

pytestmark = pytest.mark.gpu

PADDED_DIMS = (32, 96, 192)
PAIR = (192, 128)  # (q/k, v)


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("head dims 32, 96 and 192 run on the sm_90a kernels; this GPU is not Hopper")


@pytest.mark.parametrize("dtype,head_dim,causal,zhn", list(itertools.product(
    ["fp16", "bf16", "fp8e4m3"], PADDED_DIMS, [False, True], [(1, 3, 17), (2, 2, 1000), (1, 2, 4096 + 3)])))
def test_forward_matches_reference(dtype, head_dim, causal, zhn):
    _hopper()
    Z, H, N = zhn
    check_output_and_lse(make_inputs(Problem(Z, H, N, head_dim, causal, dtype), "cuda"))


@pytest.mark.parametrize("dtype,causal,zhn", list(itertools.product(
    ["fp16", "bf16", "fp8e4m3"], [False, True], [(1, 3, 17), (2, 2, 1000), (1, 2, 4096 + 3)])))
def test_forward_with_vs_own_head_dim(dtype, causal, zhn):
    """q and k 192, v 128: O [Z, H, N, 128] and the lse against the reference."""
    _hopper()
    Z, H, N = zhn
    inputs = make_inputs(Problem(Z, H, N, PAIR[0], causal, dtype, HEAD_DIM_V=PAIR[1]), "cuda")
    assert inputs.v.shape[-1] == PAIR[1]
    check_output_and_lse(inputs)


@pytest.mark.parametrize("dtype,causal,zhn", list(itertools.product(
    ["fp16", "bf16", "fp8e4m3"], [False, True], [(1, 3, 17), (2, 2, 1000), (1, 2, 4096 + 3)])))
def test_forward_pair_tile_matches_reference(dtype, causal, zhn):
    """The 192/128 pair with ``HopperConfig.PAIR_TILE`` (128-key blocks, K in 64-column pieces): output and lse against
    the reference, and GQA with cross lengths."""
    _hopper()
    from gluon_attn.kernels import hopper_host

    Z, H, N = zhn
    cfg = dataclasses.replace(hopper_host.default_config(PAIR[0], dtype, causal), PAIR_TILE=True)
    check_output_and_lse(make_inputs(Problem(Z, H, N, PAIR[0], causal, dtype, HEAD_DIM_V=PAIR[1]), "cuda"), config=cfg)
    inputs = make_inputs(Problem(2, 8, 777, PAIR[0], causal, dtype, PAIR[1], H_KV=2, N_KV=1300), "cuda")
    out = run_poisoned(gluon_attn.attention, inputs, config=cfg)
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("head_dim,head_dim_v", [(d, None) for d in PADDED_DIMS] + [PAIR])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_gqa_and_cross_lengths(head_dim, head_dim_v, causal):
    _hopper()
    inputs = make_inputs(Problem(2, 8, 777, head_dim, causal, "fp16", head_dim_v, H_KV=2, N_KV=1300), "cuda")
    out = run_poisoned(gluon_attn.attention, inputs)
    acc = check_accuracy(out, reference_for(inputs), "fp16")
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype,D,causal", list(itertools.product(("fp16", "bf16"), PADDED_DIMS + (PAIR,),
                                                                   (False, True))))
@pytest.mark.parametrize("shape", [(2, 4, 4, 300, 300), (1, 8, 2, 333, 333), (1, 4, 1, 200, 517), (1, 2, 2, 517, 200)])
def test_backward_matches_reference(dtype, D, causal, shape):
    d, dv = D if isinstance(D, tuple) else (D, D)
    check_backward_case(dtype, d, causal, shape, Dv=dv)


@pytest.mark.parametrize("D", PADDED_DIMS + (PAIR,))
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_forward_and_backward(D, causal):
    """Packed sequences store a sequence's last rows from the registers: there the columns are clipped too."""
    _hopper()
    D, Dv = D if isinstance(D, tuple) else (D, D)
    gen = torch.Generator(device="cuda").manual_seed(hash((D, Dv, causal)) % (1 << 31))
    lens_q = [300, 1, 129, 64, 517]
    lens_k = [300, 77, 129, 200, 517] if causal else [31, 400, 129, 64, 517]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device="cuda")
    q, k, v = _leaves([(sum(lens_q), 4, D), (sum(lens_k), 2, D), (sum(lens_k), 2, Dv)], "fp16", gen)
    do = torch.randn((sum(lens_q), 4, Dv), generator=gen, device="cuda").half()
    _poison_allocator()
    out = gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    out.backward(do)
    ref_out, refs = _ref_grads(lambda a, b, c: varlen_reference(a, b, c, cu_q, cu_k, causal=causal), (q, k, v), do)
    acc = check_accuracy(out.detach(), ref_out, "fp16")
    assert acc.ok, acc.message
    _check_grads((q.grad, k.grad, v.grad), refs, "fp16")


@pytest.mark.parametrize("D", PADDED_DIMS + (PAIR,))
def test_deterministic_backward(D):
    """dQ's adds in key-block order (the pair's own units: four adds a key block and query block, two a warpgroup)."""
    _hopper()
    D, Dv = D if isinstance(D, tuple) else (D, D)
    gen = torch.Generator(device="cuda").manual_seed(D + Dv)
    q, k, v = _leaves([(1, 4, 700, D), (1, 2, 700, D), (1, 2, 700, Dv)], "fp16", gen)
    do = torch.randn((1, 4, 700, Dv), generator=gen, device="cuda").half()
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        gluon_attn.attention(q, k, v, causal=True, deterministic=True).backward(do)
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    _, refs = _ref_grads(lambda a, b, c: attention_reference(a, b, c, causal=True), (q, k, v), do)
    _check_grads(grads[0], refs, "fp16")
