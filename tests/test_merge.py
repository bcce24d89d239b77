"""merge_attentions on CPU: parts of a key set merged by their lse equal attention over the whole set, in value
and in gradient; rows that saw no key; bad input named. merge_pair_'s kernel against it."""
import pytest
import torch

from gluon_attn import attention_reference, merge_attentions
from gluon_attn.merge import merge_pair_

from .interpreter import run_interpreted


def _parts(q, k, v, cuts):
    outs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        o, lse = attention_reference(q, k[:, :, lo:hi], v[:, :, lo:hi], causal=False, return_lse=True)
        outs.append(o)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("cuts", [[0, 17, 45], [0, 5, 6, 30, 45]])
def test_merged_parts_equal_attention_over_all_keys(cuts):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 11, 16), torch.randn(2, 3, 45, 16), torch.randn(2, 3, 45, 16)
    outs, lses = _parts(q, k, v, cuts)
    out, lse = merge_attentions(outs, lses)
    ref, ref_lse = attention_reference(q, k, v, causal=False, return_lse=True)
    # fp32 both ways, summed in other orders (5e-7 off here; CPU GEMMs differ between machines); a wrong weight
    # misses by 1e-1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    # heads-last layout ([B, N, H, D], NATTEN's): the merge is row by row, whatever the leading dims
    out_t, lse_t = merge_attentions([o.transpose(1, 2) for o in outs], [x.transpose(1, 2) for x in lses])
    torch.testing.assert_close(out_t, ref.transpose(1, 2), atol=1e-4, rtol=1e-4)
    # in the outputs' dtype
    out16, _ = merge_attentions([o.half() for o in outs], lses)
    assert out16.dtype == torch.float16
    torch.testing.assert_close(out16.float(), ref, atol=2e-3, rtol=2e-3)


def test_merge_gradients_equal_attention_over_all_keys():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 7, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 19, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 19, 8, dtype=torch.float64, requires_grad=True)

    def attend(k, v):
        s = q @ k.transpose(-1, -2) / 8 ** 0.5
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    o1, l1 = attend(k[:, :, :9], v[:, :, :9])
    o2, l2 = attend(k[:, :, 9:], v[:, :, 9:])
    out, lse = merge_attentions([o1, o2], [l1.float(), l2.float()])
    full, full_lse = attend(k, v)
    w = torch.randn_like(full)
    grads = torch.autograd.grad((out * w).sum() + lse.sum(), (q, k, v))
    ref = torch.autograd.grad((full * w).sum() + full_lse.float().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_rows_that_saw_no_key_merge_to_zero_with_finite_gradients():
    o = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    lse = [torch.tensor([0.5, float("-inf"), -1.0]), torch.tensor([float("-inf"), float("-inf"), 2.0])]
    lse = [x.requires_grad_() for x in lse]
    out, merged = merge_attentions(o, lse)
    assert torch.equal(out[1], torch.zeros(4)) and merged[1] == float("-inf")
    torch.testing.assert_close(out[0], o[0][0].detach())  # the only part that saw keys
    assert merged[0] == 0.5
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in o + lse)


def test_merge_refuses_what_does_not_fit_and_names_it():
    o, lse = torch.randn(2, 5, 8), torch.randn(2, 5)
    with pytest.raises(ValueError, match="two or more outputs"):
        merge_attentions([o], [lse])
    with pytest.raises(ValueError, match="one lse per output"):
        merge_attentions([o, o], [lse])
    with pytest.raises(ValueError, match=r"outputs\[1\] has shape"):
        merge_attentions([o, o[:, :4]], [lse, lse])
    with pytest.raises(ValueError, match=r"lse_tensors\[1\] has shape \(2, 4\).*\(2, 5\)"):
        merge_attentions([o, o], [lse, lse[:, :4]])
    with pytest.raises(ValueError, match=r"lse_tensors\[0\] is torch.float16"):
        merge_attentions([o, o], [lse.half(), lse])


_MERGE_PAIR_SCRIPT = r"""
import sys
import torch
from gluon_attn import merge

B, N, H, D, lse_out, in_place, shift = map(int, sys.argv[1:])
gen = torch.Generator().manual_seed(5)
out = torch.randn(B * N * H * D + shift, generator=gen).half()[shift:].view(B, N, H, D)  # (shift: unaligned rows)
x = torch.randn(B, H, N, D, generator=gen).half().transpose(1, 2)  # [B, N, H, D] strided, unit stride along D
lse = torch.randn(B, N, H, generator=gen) * 4
x_lse = (torch.randn(B, H, N, generator=gen) * 4).transpose(1, 2)  # [B, H, N] seen as [B, N, H]
lse[0, 0, 0] = float("-inf")  # one part saw no key
lse[0, 1, 0] = x_lse[0, 1, 0] = float("-inf")  # neither did
want, want_lse = merge.merge_attentions([out, x], [lse, x_lse])
merged = (lse if in_place else torch.full((B, N, H), float("nan"))) if lse_out else None
grid, args, consts = merge.merge_pair_args(out, lse, x, x_lse, merged, torch.empty(1))
assert consts["ALIGNED"] == (shift % 8 == 0)
merge._merge_pair_kernel[(grid,)](*args, **consts)
torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)
assert (out[0, 1, 0] == 0).all()
if lse_out:
    torch.testing.assert_close(merged, want_lse, atol=1e-5, rtol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("shape", [(2, 37, 3, 64, 1, 0, 0), (1, 5, 4, 96, 0, 0, 0), (3, 17, 2, 32, 1, 1, 0),
                                   (2, 9, 3, 64, 1, 0, 3)])
def test_merge_pair_kernel_matches_merge_attentions(shape):
    """``merge_pair_``'s one-launch kernel (triton's interpreter, on CPU) against ``merge_attentions``: row counts
    that are not multiples of its rows per program, a head dim below its padded width (96), x and its lse strided as
    ``attention`` returns them, rows where one part or both saw no key, the merged lse written apart, into the first
    part's lse, or not at all; rows at 16-byte multiples (the 16-byte loads' build) and not."""
    run_interpreted(_MERGE_PAIR_SCRIPT, *shape)


def test_merge_pair_off_the_gpu_takes_torchs_ops():
    gen = torch.Generator().manual_seed(3)
    out, x = (torch.randn(2, 9, 3, 16, generator=gen) for _ in range(2))
    lse, x_lse = (torch.randn(2, 9, 3, generator=gen) for _ in range(2))
    want, want_lse = merge_attentions([out, x], [lse, x_lse])
    merged = torch.empty(2, 9, 3)
    merge_pair_(out, lse, x, x_lse, merged)
    assert torch.equal(out, want) and torch.equal(merged, want_lse)


def _binding(kernel, args, consts) -> tuple:
    """(the types, the attributes) the JIT gives ``kernel``'s arguments for these values (its binder, for an sm_90
    target: no GPU): the attributes, the pointers' alignment, as ``triton.compile`` takes them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    spec = create_function_from_signature(kernel.signature, kernel.params, backend)(*args, **consts)[1]
    return ({p.name: s[0] for p, s in zip(kernel.params, spec)},
            {(i,): backend.parse_attr(s[1]) for i, s in enumerate(spec) if isinstance(s[1], str)})


def test_the_launch_cached_kernels_take_strides_64_bit_whatever_their_values():
    """``launch_cached`` keys a build without its integers' widths: a kernel whose strides the JIT typed 32-bit on
    small values would take a later call's stride of 2^31 or more truncated. The merge's sizes and strides and the
    decode combine's strides are 64-bit at small values too."""
    from gluon_attn import decode, merge

    out, lse = torch.empty(2, 3, 4, 64, dtype=torch.float16), torch.empty(2, 3, 4)
    _, args, consts = merge.merge_pair_args(out, lse, out.clone(), lse.clone(), None, torch.empty(1))
    types = _binding(merge._merge_pair_kernel, args, consts)[0]
    ints = [n for n in types if not n.endswith("_ptr") and types[n] != "constexpr"]
    assert len(ints) == 18 and all(types[n] == "i64" for n in ints), types
    parts = torch.empty(2, 1, 4, 3, 64, dtype=torch.float16)
    o = torch.empty(1, 4, 3, 64, dtype=torch.float16)
    lses = torch.empty(2, 1, 4, 3)
    args, consts, _ = decode.combine_args(parts, lses, None, o, torch.empty(1, 4, 3), None, lses)
    types = _binding(decode._combine_kernel, args, consts)[0]
    strides = [f"{t}_{d}" for t in "qkv" for d in "zhnd"] + ["s_z", "s_h", "s_n"]
    assert all(types[n] == "i64" for n in strides), types


@pytest.mark.compile
@pytest.mark.parametrize("shift", [0, 3])
def test_merge_pair_kernel_loads_aligned_rows_16_bytes_wide(shift):
    """Rows at 16-byte multiples (ALIGNED): the sm_90 build loads and stores o and x 16 bytes at a time, in a few
    registers; unaligned rows: 2 bytes at a time, correct at any address."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gluon_attn import merge
    from gluon_attn.inspection import resource_usage, sass_text
    from gluon_attn.kernels.toolchain import COMPILE_OPTIONS

    out = torch.empty(2 * 30 * 4 * 96 + shift, dtype=torch.float16)[shift:].view(2, 30, 4, 96)
    lse = torch.empty(2, 30, 4)
    _, args, consts = merge.merge_pair_args(out, lse, out.clone(), lse.clone(), lse, torch.empty(1))
    kernel = merge._merge_pair_kernel
    types, attrs = _binding(kernel, args, consts)
    constexprs = {(i,): v for i, (p, v) in enumerate(zip(kernel.params, [*args, *consts.values()]))
                  if p.is_constexpr}
    built = triton.compile(ASTSource(kernel, signature=types, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(COMPILE_OPTIONS))
    sass = sass_text(built.asm["cubin"])
    widths = set(re.findall(r"LDG\.E(\.\w+)?", sass))
    if shift:
        assert not consts["ALIGNED"] and ".128" not in widths
    else:
        assert consts["ALIGNED"] and ".128" in widths and ".U16" not in widths
        assert resource_usage(built.asm["cubin"])["REG"] <= 64
