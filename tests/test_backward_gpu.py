"""The sm_90a backward against fp32 reference gradients (run on an H100/H200): dq, dk, dv through autograd,
head dims 64, 128 and 256, odd sizes, causal (bottom-right) or not, GQA/MQA, N_Q != N_KV, packed sequences,
the lse's own gradient, the deterministic mode, torch.compile of a forward + backward."""
import itertools

import pytest
import torch

import gluon_attn
from gluon_attn.reference import attention_reference, varlen_reference

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the backward kernel targets sm_90a; this GPU is not Hopper")


def _poison_allocator(nbytes=1 << 28):
    """NaN into a large freed block: outputs the kernel fails to write come back NaN."""
    torch.full((nbytes // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def _leaves(shapes, dtype, gen):
    return [torch.randn(s, generator=gen, device="cuda").to(DTYPES[dtype]).requires_grad_() for s in shapes]


def _ref_grads(fn, leaves, do):
    """fp32 reference gradients: the same function on fp32 copies of the leaves."""
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    out = fn(*ref_leaves)
    out.backward(do.float())
    return out.detach(), [t.grad for t in ref_leaves]


def _check_grads(grads, refs, dtype):
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        _check(name, got, ref, dtype)


def _check(name, got, ref, dtype):
    assert not torch.isnan(got).any(), f"{name}: NaN (an element the kernel did not write)"
    # Gradients sum over a whole sequence: compare against the reference's scale (fp16: ~1e-3 relative of
    # the largest element, bf16 ~8x looser), and the bulk by the mean error.
    scale = ref.abs().max().item() + 1e-6
    err = (got.float() - ref).abs()
    tol = 2e-2 if dtype == "fp16" else 6e-2
    assert err.max().item() <= tol * scale, f"{name}: max error {err.max().item():.3g} vs scale {scale:.3g}"
    assert err.mean().item() <= tol / 8 * ref.abs().mean().item() + 1e-6, f"{name}: mean error {err.mean().item():.3g}"


# (Z, H, H_KV, N_Q, N_KV): odd sizes, GQA 4:1 and MQA, N_Q < N_KV and N_Q > N_KV (causal: rows with no key).
SHAPES = [(2, 4, 4, 300, 300), (1, 8, 2, 333, 333), (1, 4, 1, 200, 517), (1, 2, 2, 517, 200), (2, 3, 3, 1024, 1024),
          (1, 2, 1, 1, 777), (1, 4, 2, 64, 129)]


@pytest.mark.parametrize("dtype,D,causal,shape", [
    (dt, d, c, s) for dt, d, c, s in itertools.product(("fp16", "bf16"), (64, 128, 256), (False, True), SHAPES)])
def test_backward_matches_reference(dtype, D, causal, shape):
    check_backward_case(dtype, D, causal, shape)


def check_backward_case(dtype, D, causal, shape, Dv=None):
    """dq, dk, dv through autograd against the fp32 reference (also the padded head dims' test; ``Dv``: v's head
    dim, default D)."""
    _hopper()
    Z, H, H_KV, N_Q, N_KV = shape
    Dv = Dv or D
    gen = torch.Generator(device="cuda").manual_seed(hash((dtype, D, Dv, causal, shape)) % (1 << 31))
    q, k, v = _leaves([(Z, H, N_Q, D), (Z, H_KV, N_KV, D), (Z, H_KV, N_KV, Dv)], dtype, gen)
    do = torch.randn((Z, H, N_Q, Dv), generator=gen, device="cuda").to(DTYPES[dtype])
    _poison_allocator()
    out = gluon_attn.attention(q, k, v, causal=causal)
    out.backward(do)
    _, refs = _ref_grads(lambda a, b, c: attention_reference(a, b, c, causal=causal), (q, k, v), do)
    _check_grads((q.grad, k.grad, v.grad), refs, dtype)


@pytest.mark.parametrize("D,causal,frag", list(itertools.product((64, 128), (False, True), (False, True))))
def test_both_dq_accumulators_match_the_reference(D, causal, frag):
    """dQ's shares staged in fragment order into a fragment-ordered accumulator (DQ_FRAG, the default for dense
    D 64/128) and as [rows, D] tiles: each against the reference, sizes off the blocks."""
    import dataclasses

    from gluon_attn.api import backward
    from gluon_attn.kernels import hopper_bwd_host

    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(hash((D, causal, frag)) % (1 << 31))
    Z, H, H_KV, N = 2, 4, 2, 333
    q, k, v = _leaves([(Z, H, N, D), (Z, H_KV, N, D), (Z, H_KV, N, D)], "fp16", gen)
    do = torch.randn((Z, H, N, D), generator=gen, device="cuda").half()
    with torch.no_grad():
        out, lse = gluon_attn.attention(q, k, v, causal=causal, return_lse=True)
    cfg = dataclasses.replace(hopper_bwd_host.default_config(D, "fp16", causal), DQ_FRAG=frag)
    _poison_allocator()
    grads = backward(do, q.detach(), k.detach(), v.detach(), out, lse, causal=causal, config=cfg)
    _, refs = _ref_grads(lambda a, b, c: attention_reference(a, b, c, causal=causal), (q, k, v), do)
    _check_grads(grads, refs, "fp16")


def test_backward_layouts_and_scale():
    """[Z, N, H, D] views (transformers' layout) in, a custom sm_scale, grads in the inputs' layouts."""
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(7)
    Z, N, H, D = 2, 250, 4, 128
    base = [torch.randn((Z, N, H, D), generator=gen, device="cuda").half().requires_grad_() for _ in range(3)]
    views = [t.transpose(1, 2) for t in base]
    do = torch.randn((Z, H, N, D), generator=gen, device="cuda").half()
    out = gluon_attn.attention(*views, causal=True, sm_scale=0.05)
    out.backward(do)
    ref_leaves = [t.detach().float().transpose(1, 2).requires_grad_() for t in base]
    attention_reference(*ref_leaves, causal=True, sm_scale=0.05).backward(do.float())
    for name, t, r in zip("qkv", base, ref_leaves):
        _check(f"d{name}", t.grad.transpose(1, 2), r.grad, "fp16")


def test_backward_through_lse():
    """A loss that uses the lse as well as the output: its gradient enters the backward's delta."""
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = _leaves([(1, 4, 300, 64), (1, 2, 300, 64), (1, 2, 300, 64)], "fp16", gen)
    w = torch.randn((1, 4, 300), generator=gen, device="cuda")
    out, lse = gluon_attn.attention(q, k, v, causal=True, return_lse=True)
    (out.float().sum() + (lse * w).sum()).backward()
    refs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = attention_reference(*refs, causal=True, return_lse=True)
    (r_out.sum() + (r_lse * w).sum()).backward()
    for name, t, r in zip("qkv", (q, k, v), refs):
        _check(f"d{name}", t.grad, r.grad, "fp16")


@pytest.mark.parametrize("dtype,D,causal", list(itertools.product(("fp16", "bf16"), (64, 128, 256), (False, True))))
def test_varlen_backward(dtype, D, causal):
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(hash((dtype, D, causal)) % (1 << 31))
    lens_q = [300, 1, 129, 64, 517]
    lens_k = [300, 77, 129, 200, 517] if causal else [31, 400, 129, 64, 517]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device="cuda")
    H, H_KV = 4, 2
    q, k, v = _leaves([(sum(lens_q), H, D), (sum(lens_k), H_KV, D), (sum(lens_k), H_KV, D)], dtype, gen)
    do = torch.randn((sum(lens_q), H, D), generator=gen, device="cuda").to(DTYPES[dtype])
    _poison_allocator()
    out = gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    out.backward(do)
    _, refs = _ref_grads(lambda a, b, c: varlen_reference(a, b, c, cu_q, cu_k, causal=causal), (q, k, v), do)
    _check_grads((q.grad, k.grad, v.grad), refs, dtype)


def _grads_of(fn, leaves, do):
    for t in leaves:
        t.grad = None
    fn(*leaves).backward(do)
    return [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("D,causal,gqa", [(128, True, False), (128, False, True), (64, True, True), (64, False, False),
                                          (256, True, True)])
def test_deterministic_backward_repeats_bit_for_bit(D, causal, gqa):
    """deterministic=True: dQ (and dK, dV) identical over repeated runs, and right (the default mode's dQ adds
    come in arrival order, so its rounding may change from run to run: not asserted, timing decides)."""
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(D + causal)
    Z, H, N = 2, 8, 1999
    H_KV = 2 if gqa else H
    q, k, v = _leaves([(Z, H, N, D), (Z, H_KV, N, D), (Z, H_KV, N, D)], "bf16", gen)
    do = torch.randn((Z, H, N, D), generator=gen, device="cuda").to(torch.bfloat16)

    def fn(a, b, c):
        return gluon_attn.attention(a, b, c, causal=causal, deterministic=True)

    first = _grads_of(fn, (q, k, v), do)
    for _ in range(4):
        _poison_allocator()
        again = _grads_of(fn, (q, k, v), do)
        for name, x, y in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(x, y), f"{name} changed between deterministic runs"
    _, refs = _ref_grads(lambda a, b, c: attention_reference(a, b, c, causal=causal), (q, k, v), do)
    _check_grads(first, refs, "bf16")


def test_deterministic_follows_torch_and_covers_packed():
    """torch.use_deterministic_algorithms(True) turns the mode on; packed sequences repeat bit for bit."""
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(11)
    lens = [700, 1, 1500, 333]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
    q, k, v = _leaves([(sum(lens), 4, 128), (sum(lens), 2, 128), (sum(lens), 2, 128)], "fp16", gen)
    do = torch.randn((sum(lens), 4, 128), generator=gen, device="cuda").to(torch.float16)

    def fn(a, b, c):
        return gluon_attn.attention_varlen(a, b, c, cu, cu, max(lens), max(lens), causal=True)

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = [_grads_of(fn, (q, k, v), do) for _ in range(4)]
    finally:
        torch.use_deterministic_algorithms(was)
    for again in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(runs[0], again)), "packed deterministic run changed"
    _, refs = _ref_grads(lambda a, b, c: varlen_reference(a, b, c, cu, cu, causal=True), (q, k, v), do)
    _check_grads(runs[0], refs, "fp16")


def test_compiled_training_step():
    """torch.compile(fullgraph=True) of attention + loss, forward and backward, equals eager."""
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = _leaves([(2, 8, 256, 128), (2, 2, 256, 128), (2, 2, 256, 128)], "bf16", gen)

    def step(a, b, c):
        return (gluon_attn.attention(a, b, c, causal=True).float() ** 2).mean()

    step(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.compile(step, fullgraph=True)(q, k, v).backward()
    for e, c in zip(eager, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(c, e, rtol=2e-2, atol=2e-3)  # (dq's fp32 atomics add in any order)


def test_unsupported_backward_is_refused():
    _hopper()
    q8 = torch.randn(1, 2, 64, 64, device="cuda").to(torch.float8_e4m3fn).requires_grad_(False)
    leaf = torch.randn(1, 2, 64, 64, device="cuda", requires_grad=True)
    with pytest.raises(Exception, match="fp16, bf16"):
        gluon_attn.attention(leaf.to(torch.float8_e4m3fn), q8, q8)
