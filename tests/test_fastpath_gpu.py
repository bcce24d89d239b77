"""The per-signature routes and prepared launches on the GPU: every repeated call is checked against the fp32
reference with fresh inputs, into memory the caching allocator last held NaN in; new addresses, a freed and
reallocated address with another shape, an address TMA cannot take, and views all give correct results. Skipped
without a GPU."""
import pytest
import torch

import gluon_attn
from gluon_attn import api
from gluon_attn.kernels import hopper_host
from gluon_attn.neighborhood import na_reference
from gluon_attn.reference import attention_reference

pytestmark = pytest.mark.gpu


def _poison(n_bytes: int) -> None:
    """Leave NaN in the allocator's free blocks, so that an output whose rows the kernel did not write shows."""
    junk = torch.full((n_bytes // 2 + 1024,), float("nan"), dtype=torch.float16, device="cuda")
    del junk


def _check(out, ref, atol=2e-2):
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=2e-2)


@pytest.mark.parametrize("shape,causal", [((1, 8, 1000, 64), True), ((2, 4, 129, 128), False),
                                          ((3, 2, 1, 128), False)])
def test_repeated_calls_take_one_route_and_stay_correct(shape, causal):
    api._ROUTES.clear()
    for i in range(4):
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
        _poison(q.numel() * 2)
        out = gluon_attn.attention(q, k, v, causal=causal)
        _check(out, attention_reference(q, k, v, causal=causal))
    assert len(api._ROUTES) == 1


def test_projection_views_and_contiguous_tensors_take_their_own_routes():
    api._ROUTES.clear()
    Z, N, H, D = 2, 300, 4, 128
    x = [torch.randn(Z, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    views = [t.transpose(1, 2) for t in x]
    dense = [t.contiguous() for t in views]
    for _ in range(2):
        for q, k, v in (views, dense):
            out = gluon_attn.attention(q, k, v, causal=True)
            assert out.stride() == torch.empty_like(q).stride()
            _check(out, attention_reference(q, k, v, causal=True))
    assert len(api._ROUTES) == 2


def test_a_freed_address_reused_with_another_shape_gets_its_own_descriptors():
    q1, k1, v1 = (torch.randn(1, 4, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    gluon_attn.attention(q1, k1, v1)
    gluon_attn.attention(q1, k1, v1)
    del q1, k1, v1
    torch.cuda.synchronize()
    q2 = torch.randn(1, 4, 1024, 64, device="cuda", dtype=torch.float16)  # fits the freed block: likely its address
    k2, v2 = (torch.randn(1, 4, 1024, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    for _ in range(2):
        _check(gluon_attn.attention(q2, k2, v2), attention_reference(q2, k2, v2, causal=False))


def test_an_address_tma_cannot_take_falls_back_to_a_copy():
    shape = (1, 2, 256, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
    gluon_attn.attention(q, k, v)
    flat = torch.empty(q.numel() + 8, device="cuda", dtype=torch.float16)
    shifted = flat[4:4 + q.numel()].view(shape)
    shifted.copy_(q)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    for _ in range(2):
        _check(gluon_attn.attention(shifted, k, v), attention_reference(q, k, v, causal=False))


@pytest.mark.parametrize("layout", ["contiguous", "projection"])
@pytest.mark.parametrize("n_q,n_kv", [(1, 8192), (16, 8192)])
def test_decode_split_route(n_q, n_kv, layout):
    """The split's route reads the queries in place (a split stride of 0) where their rows merge, else copies them
    (a projection's [Z, N, H, D] view with 16 queries): correct either way, the route checked to take that way."""
    api._ROUTES.clear()
    for _ in range(3):
        q = torch.randn(8, 32, n_q, 128, device="cuda", dtype=torch.float16)
        if layout == "projection":
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k, v = (torch.randn(8, 8, n_kv, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        out, lse = gluon_attn.attention(q, k, v, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, causal=False, return_lse=True)
        _check(out, ref)
        torch.testing.assert_close(lse, ref_lse.float(), atol=1e-2, rtol=1e-3)
    assert len(api._ROUTES) == 1
    (route,) = api._ROUTES._d.values()
    assert route.fast is not None and route.fast.copies == (layout == "projection" and n_q > 1)


def test_growing_key_lengths_stay_correct():
    """A generate loop: the key length grows by one at every call."""
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    for n_kv in range(1020, 1030):
        k, v = (torch.randn(2, 8, n_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        _check(gluon_attn.attention(q, k, v), attention_reference(q, k, v, causal=False))


@pytest.mark.parametrize("start", [500, 4090])
@pytest.mark.parametrize("n_q,causal", [(1, False), (4, True)])
def test_a_growing_cache_is_checked_once(monkeypatch, n_q, causal, start):
    """A generate loop's cache grows by a key a step: after its first step each new count of keys takes the route of
    the signature it grew from (``api._family_route``: the checks once), and every step is correct. From 4090 keys
    the plan splits them (``decode.plan``; with a tail where no split count divides them, and causal with N_Q > 1):
    each count's split route is derived from the family with its launches prepared from the second split step on,
    once the kernels it launches are compiled. One query: the one-launch split, its tail absorbed, made once per
    split count and derived for the other counts (``PreparedSplit.with_keys``)."""
    from gluon_attn import decode

    api._ROUTES.clear()
    api._FAMILIES.clear()
    checks, makes = [], []
    monkeypatch.setattr(api, "check_qkv", lambda *a, **kw: checks.append(1))
    make = decode.PreparedSplit.make
    monkeypatch.setattr(decode.PreparedSplit, "make", lambda *a, **kw: makes.append(1) or make(*a, **kw))
    q = torch.randn(8, 32, n_q, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 8, 8, start + 40, 128, device="cuda", dtype=torch.bfloat16)
    routes = []
    for n_kv in range(start, start + 30):
        k, v = (torch.cat([cache[i, :, :, :n_kv - 1], cache[i, :, :, n_kv - 1:n_kv]], 2) for i in range(2))
        _poison(q.numel() * 2)
        _check(gluon_attn.attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal))
        routes.append(api._ROUTES.get(api._route_key(q, k, v, causal, None, None, None, None, False, None, "auto")))
    assert len(checks) == 1 and len(api._FAMILIES) == 1
    splits = [r for r in routes if isinstance(r, api._Route)]
    assert (len(splits) == 30) == (start > 1024)
    assert all(r.fast is not None for r in splits)
    if splits and n_q == 1:  # (made once per split count and tuning class of the chunks, the first route's once more)
        from gluon_attn.kernels.tuning import context_bucket

        assert all(r.fast.one_launch for r in splits)
        made = {(r.split.splits, context_bucket(r.split.chunk + r.split.tail)) for r in splits}
        assert len(makes) <= 1 + len(made) < len(splits), len(makes)


def test_varlen_repeated_calls():
    lengths = [5, 300, 128, 1000]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    for _ in range(3):
        q, k, v = (torch.randn(sum(lengths), 8, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        _poison(q.numel() * 2)
        out = gluon_attn.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        assert not out.isnan().any()
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            view = lambda t: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
            ref = attention_reference(view(q), view(k), view(v), causal=True)[0].transpose(0, 1)
            _check(out[a:b], ref)


def test_varlen_offsets_rewritten_in_place_take_a_new_table():
    """Layers pass the same offsets tensors: the route builds their table once while they are unchanged, and builds
    it again when the same tensors are written in place with other lengths (same totals), or when new tensors come."""
    lengths, other = [5, 300, 128, 1000], [700, 33, 600, 100]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 8, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for new_lengths, write in ((lengths, None), (lengths, None), (other, "in place"), (other, None),
                               (lengths, "new tensor"), (other, "in place")):
        values = torch.tensor([0] + list(torch.tensor(new_lengths).cumsum(0)), dtype=torch.int32)
        if write == "in place":
            cu.copy_(values)
        elif write == "new tensor":
            cu = values.cuda()
        _poison(q.numel() * 2)
        out = gluon_attn.attention_varlen(q, k, v, cu, cu, 1000, 1000, causal=True)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            view = lambda t: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
            ref = attention_reference(view(q), view(k), view(v), causal=True)[0].transpose(0, 1)
            _check(out[a:b], ref)


@pytest.mark.parametrize("dims", [1, 2])
def test_na_routes(dims):
    shape = (2, 1000, 4, 64) if dims == 1 else (2, 40, 37, 4, 64)
    kernel = 13 if dims == 1 else (7, 5)
    fn = gluon_attn.na1d if dims == 1 else gluon_attn.na2d
    for _ in range(3):
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
        _poison(q.numel() * 2)
        out = fn(q, k, v, kernel_size=kernel, dilation=2)
        _check(out, na_reference(q, k, v, kernel_size=kernel, dilation=2))


# (Z, H, H_KV, N_Q, N_KV, D[, v's D]): odd lengths, GQA, N_Q != N_KV, a padded head dim; fragment-ordered dQ (D 64
# and 128, not deterministic) and rows (deterministic, D 96's padded kernel); the 192/128 pair in its own units
# (32-query blocks, 128-key units split by keys), deterministic too
@pytest.mark.parametrize("shape,causal,deterministic", [((1, 8, 8, 1000, 1000, 64), True, False),
                                                        ((2, 4, 2, 129, 300, 128), False, False),
                                                        ((1, 4, 4, 300, 300, 96), True, True),
                                                        ((2, 8, 2, 257, 257, 128), True, True),
                                                        ((1, 4, 2, 300, 333, 192, 128), True, False),
                                                        ((2, 4, 2, 300, 333, 192, 128), True, True)])
def test_repeated_backward_takes_one_route_and_stays_correct(shape, causal, deterministic):
    """The eager autograd path (``api._EagerAttention``) and the prepared backward (``hopper_bwd_host.prepare``): every
    call's gradients, from fresh inputs into NaN-poisoned memory, against the fp32 reference's; one route."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the backward kernel targets sm_90a")
    Z, H, H_KV, N_Q, N_KV, D, *v_dim = shape
    Dv = v_dim[0] if v_dim else D
    api._BWD_ROUTES.clear()
    for _ in range(3):
        q = torch.randn(Z, H, N_Q, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(Z, H_KV, N_KV, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for d in (D, Dv))
        g = torch.randn(Z, H, N_Q, Dv, device="cuda", dtype=torch.bfloat16)
        _poison(8 * Z * H * 1024 * D * 4)
        gluon_attn.attention(q, k, v, causal=causal, deterministic=deterministic).backward(g)
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        attention_reference(*leaves, causal=causal).backward(g.float())
        for got, ref in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
            assert not got.isnan().any()
            scale = ref.abs().max().item() + 1e-6
            assert (got.float() - ref).abs().max().item() <= 6e-2 * scale
    assert len(api._BWD_ROUTES) == 1


def test_eager_autograd_matches_the_custom_op_bit_for_bit():
    """A plain eager call that autograd records runs ``forward`` and ``backward`` directly; the custom op (what
    torch.compile, functorch and the profiler see) runs the same kernels: outputs, lse and gradients (the lse's
    own included), deterministic, bit for bit."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the backward kernel targets sm_90a")
    base = [torch.randn(1, 8, 333, 128, device="cuda", dtype=torch.float16) for _ in range(3)]
    g, g_lse = torch.randn_like(base[0]), torch.randn(1, 8, 333, device="cuda")
    results = []
    for via_op in (False, True):
        leaves = [t.clone().requires_grad_() for t in base]
        if via_op:
            out, lse = torch.ops.gluon_attn.attention(*leaves, True, None, None, None, None, True, None, "auto", True)
        else:
            out, lse = gluon_attn.attention(*leaves, causal=True, return_lse=True, deterministic=True)
        ((out.float() * g).sum() + (lse * g_lse).sum()).backward()
        results.append([out, lse] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_scratch_memory_shared_by_interleaved_calls_stays_correct():
    """Decode splits and packed calls use the stream's scratch memory (``launch.scratch``) one after another with no
    synchronization between them: each result is still its own."""
    api._ROUTES.clear()
    lengths = [5, 300, 128, 1000]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    calls = []
    for i in range(6):
        q = torch.randn(2, 32, 1 + 15 * (i % 2), 128, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(2, 8, 8192, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        qp, kp, vp = (torch.randn(sum(lengths), 8, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        calls.append(((q, k, v), gluon_attn.attention(q, k, v), (qp, kp, vp),
                      gluon_attn.attention_varlen(qp, kp, vp, cu, cu, max(lengths), max(lengths), causal=True)))
    for (q, k, v), out, (qp, kp, vp), packed in calls:
        _check(out, attention_reference(q, k, v, causal=False))
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            view = lambda t: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
            _check(packed[a:b], attention_reference(view(qp), view(kp), view(vp), causal=True)[0].transpose(0, 1))


def test_prepared_launch_cache_is_bounded():
    assert len(hopper_host._PREPARED) <= hopper_host._PREPARED.maxsize and len(api._ROUTES) <= api._ROUTES.maxsize
    assert len(api._BWD_ROUTES) <= api._BWD_ROUTES.maxsize


def test_offsets_check_in_one_launch_matches_the_rule():
    from gluon_attn.validation import _offsets_problem, offsets_ok_on_gpu

    cases = [[0, 5, 5, 9], [1, 5, 9], [0, 6, 5, 9], [0, 5, 8], [0], list(range(0, 3000, 3))]
    for values in cases:
        cu = torch.tensor(values, device="cuda", dtype=torch.int32)
        n = 9 if len(values) < 10 else values[-1]
        assert bool(offsets_ok_on_gpu(cu, n)) == (_offsets_problem(values, n) is None), values
