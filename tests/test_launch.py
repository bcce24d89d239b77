"""The shared host launch path on CPU tensors: TMA readiness, descriptor arguments, the encoded-descriptor
cache of the direct launcher (its C launch needs a GPU; the cache logic does not)."""
import torch

from gluon_attn.kernels.launch import DescArg, _DirectLaunch, tma_ready


def test_tma_ready_keeps_aligned_views_and_copies_the_rest():
    base = torch.randn(2, 100, 3, 64).half()
    view = base.transpose(1, 2)  # [Z, H, N, D] view of [Z, N, H, D] storage: strides are 16-byte multiples
    assert tma_ready(view) is view
    odd = torch.randn(2, 3, 100, 65).half()[..., :64]  # row pitch 130 bytes: not a multiple of 16
    fixed = tma_ready(odd)
    assert fixed is not odd and fixed.is_contiguous() and torch.equal(fixed, odd)
    last_strided = torch.randn(2, 3, 64, 100).half().transpose(2, 3)  # last dim not unit-stride
    assert tma_ready(last_strided).stride()[-1] == 1


def test_desc_arg_defaults_and_descriptor_object():
    t = torch.randn(1, 2, 300, 64).half()
    a = DescArg.of(t, [1, 1, 64, 64])
    assert a.shape == [1, 2, 300, 64] and a.strides == list(t.stride()) and a.block_shape == [1, 1, 64, 64]
    padded = DescArg.of(t, [1, 1, 64, 64], shape=[1, 2, 304, 64], strides=[1, 2, 3, 1])
    assert padded.shape == [1, 2, 304, 64] and padded.strides == [1, 2, 3, 1]
    d = a.descriptor()
    assert d.base is t and d.shape == a.shape and d.block_shape == a.block_shape and d.padding == "zero"
    assert d.layout == DescArg.of(t, [1, 1, 64, 64]).descriptor().layout  # one layout object per block/dtype


def _launcher():
    calls = []

    def encode(desc, meta, _):  # (make_tensordesc_arg's signature in triton 3.9)
        calls.append((desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), meta))
        return [f"map{len(calls)}", *desc.shape, *desc.strides]

    d = _DirectLaunch.__new__(_DirectLaunch)
    d.cache, d.meta, d.encode = {}, ["meta-q", "meta-k"], encode
    return d, calls


def test_direct_launch_encodes_each_descriptor_once_per_address_shape_and_strides():
    d, calls = _launcher()
    storage = torch.randn(4 * 300 * 64).half()
    q = storage.view(1, 4, 300, 64)
    k = storage.view(1, 4, 300, 64)  # same address and layout as q, but another argument slot
    args = (DescArg.of(q, [1, 1, 64, 64]), DescArg.of(k, [1, 1, 64, 64]), 0.5, 300)
    first = d.expand(args)
    assert first[0] == "map1" and first[-2:] == [0.5, 300] and len(calls) == 2
    assert [c[3] for c in calls] == ["meta-q", "meta-k"]  # each slot with its own binary metadata
    assert d.expand(args) == first and len(calls) == 2  # hits: nothing encoded again
    # Same address, other shape or strides: a different tensor map.
    other = storage.view(1, 2, 600, 64)
    d.expand((DescArg.of(other, [1, 1, 64, 64]), DescArg.of(k, [1, 1, 64, 64])))
    assert len(calls) == 3 and calls[-1][1] == (1, 2, 600, 64)
    strided = storage.view(1, 300, 4, 64).transpose(1, 2)
    d.expand((DescArg.of(strided, [1, 1, 64, 64]), DescArg.of(k, [1, 1, 64, 64])))
    assert len(calls) == 4 and calls[-1][2] == tuple(strided.stride())


def test_direct_launch_cache_is_bounded():
    d, calls = _launcher()
    d.MAX_ENTRIES = 3
    tensors = [torch.randn(1, 1, 16, 64).half() for _ in range(5)]
    for t in tensors:
        d.expand((DescArg.of(t, [1, 1, 16, 64]),))
    assert len(d.cache) <= 3 and len(calls) == 5


def test_direct_launch_passes_a_kernel_without_descriptors_its_arguments_as_given_then_the_constexprs():
    launched = []
    d = _DirectLaunch.__new__(_DirectLaunch)
    d.meta, d.plain, d.cache = [], True, {}
    d.encode = lambda *a: launched.append("encoded")
    d.c_launch = lambda *a: launched.append(a)
    d.coop = d.pdl = False
    d.annotations, d.signature = "annotations", "signature"

    class Kernel:
        function, packed_metadata = "fn", "meta"

    d.kernel = Kernel()
    d((3, 2), 7, (11, 12.5, 13), {"BLOCK": 64, "WARPS": 4})
    (a,) = launched
    assert a[:4] == (3, 2, 1, 7) and a[4] == "fn" and a[-3:] == ("annotations", "signature", (11, 12.5, 13, 64, 4))


def test_host_arithmetic_matches_triton_and_calls_no_constexpr_function(monkeypatch):
    """``kernels.cdiv`` and ``kernels.next_power_of_2`` equal triton's (ConstexprFunctions since 3.9, ~1.9 us a call
    from Python); the per-call host paths that work out a grid or a block (the merge's arguments, the backward's
    preprocess and grid, the combine's and V^T's plans) call neither of triton's."""
    import triton

    from gluon_attn import decode, merge
    from gluon_attn.kernels import cdiv, hopper_bwd_host, hopper_bwd_prepost, next_power_of_2, v_transpose

    for n in range(0, 600):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 7, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d)

    def refused(*a):
        raise AssertionError("triton's ConstexprFunction called on a host path")

    monkeypatch.setattr(triton, "cdiv", refused)
    monkeypatch.setattr(triton, "next_power_of_2", refused)
    out, lse = torch.empty(2, 9, 3, 96, dtype=torch.float16), torch.empty(2, 9, 3)
    grid, _, consts = merge.merge_pair_args(out, lse, out.clone(), lse.clone(), None, torch.empty(1))
    assert grid == 4 and consts["BLOCK_D"] == 128
    o = torch.empty(1, 2, 100, 96, dtype=torch.float16)
    assert hopper_bwd_prepost._preprocess_terms(o, o, False)[0] == (2, 2)
    cfg = hopper_bwd_host.default_config(128)
    assert hopper_bwd_host._dense_grid(1, 2, 300, 300, 128, cfg, 132)[1] % cfg.BLOCK_M == 0
    assert hopper_bwd_host._group_hz(1, 2, 300, 128, 6, False, False) >= 1
    decode._combine_plan.cache_clear()
    decode._combine_plan(4, 5, 128, torch.float16, torch.float16, 7)
    v_transpose._vt_plan.cache_clear()
    assert v_transpose._vt_plan(1, 2, 100, 96, torch.float8_e4m3fn)[3]["D_BLOCK"] == 128
