"""GQA/MQA, N_Q != N_KV (bottom-right causal), packed sequences, empty inputs, the custom ops under
torch.compile and CUDA-graph capture: the sm_90a kernel against the fp32 reference (run on an H100/H200)."""
import itertools

import pytest
import torch

import gluon_attn
from gluon_attn.problem import DTYPES, _quantize
from gluon_attn.reference import attention_reference, check_accuracy, varlen_reference

pytestmark = pytest.mark.gpu


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel here targets sm_90a; this GPU is not Hopper")


def _poison_allocator(nbytes=1 << 28):
    """Fill a large block with NaN and free it: the caching allocator hands it to the next outputs, so
    an element the kernel does not write stays NaN."""
    torch.full((nbytes // 4,), float("nan"), device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


def _tensors(shape_q, shape_kv, dtype, gen):
    made = []
    for shape in (shape_q, shape_kv, shape_kv):
        x = torch.randn(shape, generator=gen, device="cuda")
        made.append(_quantize(x, DTYPES[dtype]) if dtype.startswith("fp8") else (x.to(DTYPES[dtype]), 1.0))
    return made


# (Z, H, H_KV, N_Q, N_KV): GQA 4:1 and 3:1, MQA, decode (1 query) and chunked prefill against longer keys,
# more queries than keys (causal: the first rows see no key), odd sizes throughout.
SHAPES = [(2, 8, 2, 300, 300), (1, 6, 2, 1000, 1000), (1, 4, 1, 1, 4096 + 5), (2, 4, 4, 16, 1000),
          (1, 8, 2, 2048 + 1, 4096 + 3), (1, 4, 2, 1000, 300), (1, 2, 1, 300, 1), (3, 2, 1, 129, 129)]


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8e4m3"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_gqa_and_cross_lengths(dtype, head_dim, causal, shape):
    _hopper()
    Z, H, H_KV, N_Q, N_KV = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((dtype, head_dim, causal, shape)) % (1 << 31))
    (q, dq), (k, dk), (v, dv) = _tensors((Z, H, N_Q, head_dim), (Z, H_KV, N_KV, head_dim), dtype, gen)
    scales = dict(descale_q=dq, descale_k=dk, descale_v=dv) if dtype.startswith("fp8") else {}
    _poison_allocator()
    out, lse = gluon_attn.attention(q, k, v, causal=causal, return_lse=True, **scales)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True, descale_q=dq, descale_k=dk,
                                       descale_v=dv)
    acc = check_accuracy(out, ref, dtype)
    assert acc.ok, acc.message
    tol = 3e-2 if dtype.startswith("fp8") else 2e-3
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)  # (-inf where a row sees no key)
    if causal and N_Q > N_KV:
        assert (out[:, :, :N_Q - N_KV] == 0).all() and torch.isneginf(lse[:, :, :N_Q - N_KV]).all()


# (Z, H, H_KV, N_Q, N_KV): decode and short steps against long caches, which ``decode.plan`` packs and splits;
# chunks that leave a tail of keys, N_Q > 1 causal (a tail for the masked keys: the combine's own where the plan
# takes that, a launch of its own for 70 causal queries of one head each), MQA, MHA, odd sizes.
DECODE_SHAPES = [(8, 32, 8, 1, 16384), (2, 32, 8, 16, 32768 + 37), (1, 4, 1, 1, 32768 + 5), (1, 8, 8, 3, 40000),
                 (3, 12, 2, 5, 30001), (1, 16, 4, 32, 50000), (1, 2, 2, 70, 40000)]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("q_view", [False, True])
def test_decode_split_matches_reference(dtype, head_dim, causal, shape, q_view):
    """Packed and split (the plan is checked to be taken): out and lse against the fp32 reference and
    against the ordinary launch; q as a projection's [Z, N, H, D] view too (K/V as a cache lays them out)."""
    from gluon_attn import api

    _hopper()
    Z, H, H_KV, N_Q, N_KV = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((dtype, head_dim, causal, shape)) % (1 << 31))
    (q, _), (k, _), (v, _) = _tensors((Z, H, N_Q, head_dim), (Z, H_KV, N_KV, head_dim), dtype, gen)
    if q_view:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    backend = api._backend(q, head_dim)
    assert api._decode_plan(backend, q, k, v, causal, False) is not None
    _poison_allocator()
    out, lse = gluon_attn.attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    acc = check_accuracy(out, ref, dtype)
    assert acc.ok, acc.message
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)
    assert out.stride() == q.stride()
    config = backend.default_config(head_dim, dtype, causal, N_KV)
    direct, direct_lse = gluon_attn.attention(q, k, v, causal=causal, return_lse=True, config=config)
    tol = 2e-3 if dtype == "fp16" else 1.6e-2
    torch.testing.assert_close(out, direct, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, direct_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("shape", [(2, 32, 8, 16, 32768 + 37), (3, 12, 2, 5, 30001), (1, 16, 4, 32, 50000)])
def test_decode_short_tail_as_its_own_launch(head_dim, shape, monkeypatch):
    """The shapes whose short tail the plan gives the combine, with the tail's own launch instead (what the plan
    takes where the GPU's time decides: long caches at large batches)."""
    from gluon_attn import api, decode

    _hopper()
    Z, H, H_KV, N_Q, N_KV = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((head_dim, shape)) % (1 << 31))
    (q, _), (k, _), (v, _) = _tensors((Z, H, N_Q, head_dim), (Z, H_KV, N_KV, head_dim), "fp16", gen)
    decode.clear_plans()
    monkeypatch.setattr(decode, "FUSED_TAIL_KEYS", 0)
    try:
        plan = api._decode_plan(api._backend(q, head_dim), q, k, v, True, False)
        assert plan.tail >= N_Q - 1 and not plan.fused_tail
        _poison_allocator()
        out, lse = gluon_attn.attention(q, k, v, causal=True, return_lse=True)
    finally:
        decode.clear_plans()
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    acc = check_accuracy(out, ref, "fp16")
    assert acc.ok, acc.message
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("shape, fused", [((2, 32, 8, 4, 32768 + 3), True), ((8, 32, 8, 16, 32768), False),
                                          ((1, 2, 2, 70, 40000), False)])
def test_decode_split_under_cuda_graph(shape, fused):
    """The packed, split decode (the chunks' and the combine's launches, with the tail the combine's own or a
    launch of its own) captures and replays."""
    from gluon_attn import api

    _hopper()
    Z, H, H_KV, N_Q, N_KV = shape
    q = torch.randn(Z, H, N_Q, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(Z, H_KV, N_KV, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    plan = api._decode_plan(api._backend(q, 128), q, k, v, True, False)
    assert plan.tail and plan.fused_tail == fused
    eager = gluon_attn.attention(q, k, v, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gluon_attn.attention(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, gluon_attn.attention(q, k, v, causal=True), atol=0, rtol=0)
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("shape, fused", [((8, 32, 8, 1, 8193), "absorbed"), ((8, 32, 8, 1, 8193, 64), True),
                                          ((8, 32, 8, 16, 8192), False), ((1, 32, 8, 4, 8192), True),
                                          ((2, 32, 8, 16, 32768 + 37), True)])
def test_decode_split_with_a_tail_runs_its_prepared_launches(shape, fused):
    """A split with a tail (the combine's own, or a launch of its own, whose causal plan schedules dynamically, or
    absorbed by the last chunk: head dim 128's one launch) is a prepared route: ``PreparedSplit`` is made for it and
    serves the call (no ``decode.run``), against the fp32 reference, a second call (the workspace reused) and a new q
    at the same address of another call's."""
    from gluon_attn import api

    _hopper()
    Z, H, H_KV, N_Q, N_KV, D = (*shape, 128)[:6]
    causal = N_Q > 1
    gen = torch.Generator(device="cuda").manual_seed(hash(shape) % (1 << 31))
    (q, _), (k, _), (v, _) = _tensors((Z, H, N_Q, D), (Z, H_KV, N_KV, D), "fp16", gen)
    plan = api._decode_plan(api._backend(q, D), q, k, v, causal, False)
    assert plan.tail and (plan.absorbed if fused == "absorbed" else plan.fused_tail == fused and not plan.absorbed)
    gluon_attn.attention(q, k, v, causal=causal)  # (the route is made)
    route = api._ROUTES.get(api._route_key(q, k, v, causal, None, None, None, None, False, None, "auto"))
    assert isinstance(route, api._Route) and route.fast is not None
    _poison_allocator()
    out = route.fast(q, k, v)
    assert out is not None
    acc = check_accuracy(out, attention_reference(q, k, v, causal=causal), "fp16")
    assert acc.ok, acc.message
    torch.testing.assert_close(route.fast(q, k, v), out, atol=0, rtol=0)
    q.copy_(torch.randn_like(q))
    acc = check_accuracy(gluon_attn.attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal),
                         "fp16")
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("shape, layout", [((1, 32, 8, 1, 8192), "hf"), ((8, 32, 8, 1, 2048), "contiguous"),
                                           ((4, 64, 8, 2, 4096), "contiguous"), ((2, 16, 1, 1, 65536), "hf"),
                                           ((3, 40, 8, 1, 6000), "hf"), ((8, 32, 8, 1, 8192, 64), "hf"),
                                           ((1, 32, 8, 1, 4097), "hf"), ((1, 32, 8, 1, 8192 + 15), "hf"),
                                           ((8, 32, 8, 1, 2048 + 15), "contiguous"), ((3, 40, 8, 1, 6007), "hf"),
                                           ((2, 16, 1, 1, 65536 + 33), "hf")])
def test_decode_split_in_one_launch(shape, layout, dtype):
    """A split without a tail, or with one every query sees (absorbed: the last chunk's view longer by it), whose
    output rows lie as a contiguous [Z, H, N_Q, D]'s is one launch: the chunks' last warpgroup of each K/V head
    combines the parts (the kernel's COMBINE). Its general path (the route's first call, ``decode.run``) and its
    prepared launch (no combine launch) against the fp32 reference with the allocator's memory poisoned, the two bit
    for bit alike, a second call (the counters' ring moves on), and a CUDA graph's replay with new queries. ``hf``: q
    a transpose of [Z, N_Q, H, D], as a model's projection gives it. Head dim 64 against 8192 keys keeps the
    combine's own launch (``hopper_host.combines``: chunks of 4096 keys in the three-consumer 192-row tiles), the
    same checks. The lse returned: an absorbed plan's tail is a launch of its own (two launches and the combine's)."""
    from gluon_attn import api, decode

    _hopper()
    Z, H, H_KV, N_Q, N_KV, D = (*shape, 128)[:6]
    gen = torch.Generator(device="cuda").manual_seed(hash((shape, dtype)) % (1 << 31))
    q_shape = (Z, N_Q, H, D) if layout == "hf" else (Z, H, N_Q, D)
    (q, _), (k, _), (v, _) = _tensors(q_shape, (Z, H_KV, N_KV, D), dtype, gen)
    if layout == "hf":
        q = q.transpose(1, 2)
    plan = api._decode_plan(api._backend(q, D), q, k, v, False, False)
    assert plan is not None and (not plan.tail or plan.absorbed == (D == 128))
    api._ROUTES.clear()
    ref = attention_reference(q, k, v, causal=False)
    _poison_allocator()
    first = gluon_attn.attention(q, k, v)  # (the route is made: its general path, then its prepared launch)
    acc = check_accuracy(first, ref, dtype)
    assert acc.ok, acc.message
    route = api._ROUTES.get(api._route_key(q, k, v, False, None, None, None, None, False, None, "auto"))
    assert isinstance(route, api._Route) and route.fast is not None
    assert decode.combined(plan, False, first, q.dtype)
    assert route.fast.one_launch == (D == 128) and (route.fast.combine is None) == (D == 128)
    _poison_allocator()
    out = route.fast(q, k, v)
    assert out is not None
    torch.testing.assert_close(out, first, atol=0, rtol=0)
    torch.testing.assert_close(route.fast(q, k, v), first, atol=0, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gluon_attn.attention(q, k, v)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = attention_reference(q, k, v, causal=False, return_lse=True)
    acc = check_accuracy(captured, ref[0], dtype)
    assert acc.ok, acc.message
    for _ in range(2):  # (the general path, then the prepared launches)
        _poison_allocator()
        out, lse = gluon_attn.attention(q, k, v, return_lse=True)
        acc = check_accuracy(out, ref[0], dtype)
        assert acc.ok, acc.message
        torch.testing.assert_close(lse, ref[1], atol=2e-3, rtol=2e-3)
    route = api._ROUTES.get(api._route_key(q, k, v, False, None, None, None, None, True, None, "auto"))
    assert not route.fast.one_launch and (route.fast.tail is not None) == bool(plan.tail)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8e5"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("zhn", [(1, 1, 1), (3, 1, 1000), (2, 2, 4096 + 3)])
def test_head_dim_256_self_attention(dtype, causal, zhn):
    """Head dim 256 (64-key blocks, O stored from registers) on the correctness grid's shapes, written into
    a NaN-filled output of a strided [Z, N, H, D] layout."""
    _hopper()
    Z, H, N = zhn
    gen = torch.Generator(device="cuda").manual_seed(hash((dtype, causal, zhn)) % (1 << 31))
    (q, dq), (k, dk), (v, dv) = _tensors((Z, N, H, 256), (Z, N, H, 256), dtype, gen)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scales = dict(descale_q=dq, descale_k=dk, descale_v=dv) if dtype.startswith("fp8") else {}
    out_dtype = torch.float16 if dtype.startswith("fp8") else q.dtype
    out = torch.full((Z, N, H, 256), float("nan"), dtype=out_dtype, device="cuda").transpose(1, 2)
    gluon_attn.attention(q, k, v, causal=causal, out=out, **scales)
    ref = attention_reference(q, k, v, causal=causal, descale_q=dq, descale_k=dk, descale_v=dv)
    acc = check_accuracy(out, ref, dtype)
    assert acc.ok, acc.message


def test_empty_inputs_give_empty_outputs():
    _hopper()
    x = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16)  # noqa: E731
    assert gluon_attn.attention(x(0, 4, 100, 64), x(0, 2, 100, 64), x(0, 2, 100, 64)).shape == (0, 4, 100, 64)
    assert gluon_attn.attention(x(2, 4, 0, 64), x(2, 2, 100, 64), x(2, 2, 100, 64)).shape == (2, 4, 0, 64)
    out, lse = gluon_attn.attention(x(2, 4, 7, 64), x(2, 2, 0, 64), x(2, 2, 0, 64), return_lse=True)
    assert out.shape == (2, 4, 7, 64) and (out == 0).all() and torch.isneginf(lse).all()
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert gluon_attn.attention_varlen(x(0, 4, 64), x(0, 2, 64), x(0, 2, 64), cu, cu, 0, 0).shape == (0, 4, 64)


def test_inputs_that_require_grad_are_recorded_for_autograd():
    _hopper()
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    out = gluon_attn.attention(q, q, q)
    assert out.requires_grad and out.grad_fn is not None
    with torch.no_grad():
        assert not gluon_attn.attention(q, q, q).requires_grad


@pytest.mark.parametrize("varlen", [False, True])
def test_plain_eager_calls_skip_the_op_and_watched_ones_keep_it(varlen, monkeypatch):
    """A plain eager call without grad runs the op's implementation directly (same output, bit for bit); a call
    that a profiler, a dispatch mode or a function mode watches goes through the op. One that needs grad: a packed
    call goes through the op, a dense one through ``api._EagerAttention`` (the same implementations, no dispatch)."""
    from torch.utils.flop_counter import FlopCounterMode

    from gluon_attn import api, ops

    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(5)
    if varlen:
        q, k, v, cu_q, cu_k = _packed([300, 17, 900], [300, 17, 900], 8, 2, 64, "fp16", gen)
        name, rest = "attention_varlen", (cu_q, cu_k, 900, 900, True, None, False, "auto")
        call = lambda q: gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, 900, 900, causal=True)  # noqa: E731
    else:
        (q, _), (k, _), (v, _) = _tensors((2, 8, 300, 64), (2, 2, 300, 64), "fp16", gen)
        name, rest = "attention", (True, None, None, None, None, False, None, "auto")
        call = lambda q: gluon_attn.attention(q, k, v, causal=True)  # noqa: E731
    via_op = []  # the op implementations' calls (each ends in ``ops._with_lse``), by whether q required grad
    with_lse = ops._with_lse

    def spy(result, return_lse, q):
        via_op.append(q.requires_grad)
        return with_lse(result, return_lse, q)

    monkeypatch.setattr(ops, "_with_lse", spy)
    direct = call(q)
    assert via_op == [] and api._plain_eager(q, k, v)
    torch.testing.assert_close(direct, getattr(torch.ops.gluon_attn, name)(q, k, v, *rest)[0], atol=0, rtol=0)
    assert len(via_op) == 1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(q)
    assert any(e.name == f"gluon_attn::{name}" for e in prof.events()) and len(via_op) == 2
    with FlopCounterMode(display=False):
        call(q)
    with torch.device("cuda"):
        call(q)
    assert len(via_op) == 4
    qg = q.detach().requires_grad_()
    call(qg).float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    assert len(via_op) == 5 and via_op[-1] if varlen else len(via_op) == 4
    with torch.no_grad():
        call(qg)
    assert len(via_op) == 4 + varlen  # no grad recorded: the direct call again
    assert not api._plain_eager(q.cpu(), k, v) and not api._plain_eager(q.to("meta"), k, v)


def _packed(lens_q, lens_k, H, H_KV, D, dtype, gen):
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device="cuda")
    (q, _), (k, _), (v, _) = _tensors((sum(lens_q), H, D), (sum(lens_k), H_KV, D), dtype, gen)
    return q, k, v, cu_q, cu_k


# Packed batches: lengths that are not multiples of the tile, a sequence of one token, an empty one,
# keys longer or shorter than queries (bottom-right causal per sequence), one long sequence among short ones.
MIXES = [([300, 1, 129, 1000, 64], None), ([5, 700, 0, 2000 + 7], [9, 700, 3, 2000 + 7]),
         ([1, 1, 1, 1], [4096, 100, 17, 1]), ([3000, 40, 40, 40, 40, 40], [2000, 80, 40, 10, 40, 300])]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_varlen_matches_reference(dtype, head_dim, causal, mix, heads):
    _hopper()
    lens_q, lens_k = mix
    lens_k = lens_k or lens_q
    gen = torch.Generator(device="cuda").manual_seed(hash((dtype, head_dim, causal, str(mix), heads)) % (1 << 31))
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, *heads, head_dim, dtype, gen)
    _poison_allocator()
    out, lse = gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           return_lse=True)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (heads[0], sum(lens_q))
    acc = check_accuracy(out, ref, dtype)
    assert acc.ok, acc.message
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("n_seqs", [31, 2000])
def test_varlen_table_built_on_the_gpu_matches_torch(n_seqs):
    """The packed table's one-launch GPU build (``_varlen_table_kernel``) against PyTorch's ops on the CPU, word for
    word, for every (causal, by_keys, counter): the longtail mix's 31 sequences, and 2000 short ones with many ties
    (32 programs of 32 comparison steps each); the offsets as unaligned views too."""
    from gluon_attn.kernels.schedule import varlen_table
    from gluon_attn.problem import varlen_lengths

    if n_seqs == 31:
        lens = torch.tensor(varlen_lengths("longtail", 65536))
    else:
        lens = torch.randint(0, 300, (n_seqs,), generator=torch.Generator().manual_seed(5))
    assert len(lens) == n_seqs
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), (lens // 2 * 2).flip(0).cumsum(0)]).to(torch.int32)
    for causal, by_keys, counter in itertools.product([False, True], repeat=3):
        want = varlen_table(cu_q, cu_k, 8, 128, causal, by_keys, counter)
        got = varlen_table(cu_q.cuda(), cu_k.cuda(), 8, 128, causal, by_keys, counter)
        assert got.is_cuda and torch.equal(got.cpu(), want), (causal, by_keys, counter)
        # The offsets as views 4 bytes past an aligned allocation, after the aligned launch above was cached.
        shifted = [torch.cat([torch.zeros(1, dtype=torch.int32), c]).cuda()[1:] for c in (cu_q, cu_k)]
        assert all(c.data_ptr() % 16 == 4 for c in shifted)
        assert torch.equal(varlen_table(*shifted, 8, 128, causal, by_keys, counter).cpu(), want)


def test_varlen_rejects_fp8_naming_what_it_takes():
    _hopper()
    x = torch.randn(10, 2, 64, device="cuda").to(torch.float8_e4m3fn)
    cu = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="supported: fp16, bf16"):
        gluon_attn.attention_varlen(x, x, x, cu, cu, 10, 10)


class _Block(torch.nn.Module):
    """Projections around the attention op, as a transformer layer calls it (GQA 8/2)."""

    def __init__(self, d_model=512, H=8, H_KV=2, D=64):
        super().__init__()
        self.H, self.H_KV, self.D = H, H_KV, D
        self.q = torch.nn.Linear(d_model, H * D, bias=False)
        self.kv = torch.nn.Linear(d_model, 2 * H_KV * D, bias=False)
        self.o = torch.nn.Linear(H * D, d_model, bias=False)

    def forward(self, x):
        Z, N, _ = x.shape
        q = self.q(x).view(Z, N, self.H, self.D).transpose(1, 2)
        k, v = self.kv(x).view(Z, N, 2, self.H_KV, self.D).unbind(2)
        o = gluon_attn.attention(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return self.o(o.transpose(1, 2).reshape(Z, N, -1))


def test_torch_compile_fullgraph_matches_eager():
    _hopper()
    torch._dynamo.reset()
    block = _Block().cuda().half()
    x = torch.randn(2, 333, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True)(x)  # fullgraph: a graph break raises
    torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)


def test_torch_compile_varlen_fullgraph():
    _hopper()
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, cu_q, cu_k = _packed([100, 7, 300], [100, 7, 300], 4, 2, 128, "bf16", gen)

    def f(q, k, v):
        return gluon_attn.attention_varlen(q * 1.0, k, v, cu_q, cu_k, 300, 300, causal=True) + 1

    eager = f(q, k, v)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), eager, atol=0, rtol=0)


@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_graph_capture_and_replay(varlen):
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(7)
    if varlen:
        q, k, v, cu_q, cu_k = _packed([500, 33, 1200], [500, 33, 1200], 8, 2, 128, "fp16", gen)
        call = lambda: gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, 1200, 1200, causal=True)  # noqa: E731
    else:
        (q, _), (k, _), (v, _) = _tensors((2, 8, 700, 128), (2, 2, 900, 128), "fp16", gen)
        call = lambda: gluon_attn.attention(q, k, v, causal=True)  # noqa: E731
    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(2):  # new inputs in the captured buffers, then replay
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, call(), atol=0, rtol=0)


_BAD_OFFSETS_SCRIPT = """
import os, sys
import torch
import gluon_attn

which, path = sys.argv[1:3]
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(300, 4, 64, device="cuda", generator=gen).half()
k, v = (torch.randn(300, 2, 64, device="cuda", generator=gen).half() for _ in range(2))
good = torch.tensor([0, 100, 200, 300], dtype=torch.int32, device="cuda")
bad = {"q-decreasing": torch.tensor([0, 200, 100, 300], dtype=torch.int32, device="cuda"),
       "k-short": torch.tensor([0, 100, 200, 299], dtype=torch.int32, device="cuda")}[which]
# "route": the same signature ran twice with offsets that hold, so the bad call takes its route (the offsets checked
# by the table's launch); "in-place": the same, then the very offsets tensors of those calls written with the bad
# values (the route's last check must not serve them); "first": a signature not seen before (the checked path)
good_q = good.clone()
for _ in range(1 if path == "first" else 2):
    gluon_attn.attention_varlen(q, k, v, good_q, good, 100 if path == "first" else 200, 200, causal=True)
torch.cuda.synchronize()  # offsets that hold: no assert
if path == "in-place":
    (good_q if which.startswith("q") else good).copy_(bad)
    cu_q, cu_k = good_q, good
else:
    cu_q, cu_k = (bad, good) if which.startswith("q") else (good.clone(), bad)
try:
    gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, 200, 200, causal=True)
    torch.cuda.synchronize()
except RuntimeError as e:
    print("raised:", str(e).replace(chr(10), " ")[:300], flush=True)
    os._exit(0)
print("no error", flush=True)
os._exit(1)
"""


@pytest.mark.parametrize("path", ["first", "route", "in-place"])
@pytest.mark.parametrize("which", ["q-decreasing", "k-short"])
def test_varlen_bad_offsets_on_the_gpu_raise(which, path):
    """CUDA offsets are checked on the GPU without a sync (torch._assert_async before the launch): offsets that
    decrease or end short of the packed length raise a RuntimeError (a device-side assert) by the next
    synchronization, on a signature's first call and on its route (the table's launch checks them). Run in a fresh
    process: the assert leaves that process's CUDA context unusable."""
    import os
    import subprocess
    import sys

    _hopper()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", _BAD_OFFSETS_SCRIPT, which, path], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.startswith("raised:"), (res.stdout + res.stderr)[-3000:]
    assert "device-side assert" in res.stdout or "cu_seqlens" in res.stdout + res.stderr, res.stdout
