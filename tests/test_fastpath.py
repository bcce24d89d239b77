"""The call paths' per-signature plans on the CPU: a route or prepared launch is keyed on everything that can change
it, caches have a bound, a new address gets a new descriptor encoding (never a stale one), an address TMA cannot take
falls back, and errors are the same on the first call and the hundredth."""
import pytest
import torch

from gluon_attn import api
from gluon_attn.cache import BoundedCache, Unchanged
from gluon_attn.kernels import hopper_host, launch


def test_bounded_cache_keeps_the_most_recent_entries():
    c = BoundedCache(3)
    for i in range(3):
        c.put(i, str(i))
    assert c.get(0) == "0"  # 0 is now the most recent
    c.put(3, "3")
    assert len(c) == 3 and c.get(1) is None and c.get(0) == "0" and c.get(3) == "3"
    for i in range(100):
        c.put(("n", i), i)
    assert len(c) == 3 and c.get(("n", 99)) == 99


def test_unchanged_offsets_hold_until_written_replaced_or_freed():
    """The packed route's check of offsets that a model passes layer after layer: the same tensors, not written since,
    hold; an in-place write, another tensor with the same values, a swapped order, or an inference tensor do not."""
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    seen = Unchanged()
    assert not seen.holds(cu_q, cu_k)  # nothing remembered
    seen.remember(cu_q, cu_k)
    assert seen.holds(cu_q, cu_k) and seen.holds(cu_q, cu_k)
    assert not seen.holds(cu_q.clone(), cu_k) and not seen.holds(cu_k, cu_q) and not seen.holds(cu_q)
    cu_k[1] = 4  # an in-place write bumps the version
    assert not seen.holds(cu_q, cu_k)
    seen.remember(cu_q, cu_k)
    cu_q.add_(0)
    assert not seen.holds(cu_q, cu_k)
    seen.remember(cu_q, cu_k)
    cu_q.data = torch.tensor([0, 2, 7], dtype=torch.int32)  # new storage under the same object
    assert not seen.holds(cu_q, cu_k)
    seen.remember(cu_q, cu_k)
    del cu_q  # freed: a later tensor at the same address is not the one remembered
    again = torch.tensor([0, 2, 7], dtype=torch.int32)
    assert not seen.holds(again, cu_k)
    with torch.inference_mode():
        frozen = torch.tensor([0, 3, 7], dtype=torch.int32)
    seen.remember(frozen, cu_k)
    assert not seen.holds(frozen, cu_k)  # (no version counter: never remembered)


@pytest.mark.parametrize("shape,h_kv,layout,merges", [
    ((4, 32, 1, 128), 8, "contiguous", True), ((4, 32, 1, 128), 8, "projection", True),
    ((4, 32, 16, 64), 8, "contiguous", True), ((4, 32, 16, 64), 8, "projection", False),
    ((3, 8, 5, 64), 8, "projection", False), ((1, 8, 5, 64), 8, "projection", True),
    ((2, 8, 3, 64), 1, "projection", False), ((2, 8, 3, 64), 1, "contiguous", True),
    ((2, 8, 1, 64), 2, "heads-strided", True), ((2, 8, 1, 64), 2, "batch-strided", False),
    ((1, 8, 1, 64), 2, "batch-strided", True)])
def test_decode_split_reads_queries_in_place_where_their_rows_merge(shape, h_kv, layout, merges):
    """``decode._packed_query_strides``: q [Z, H, N_Q, D] as every key chunk's [splits, Z * H_KV, G * N_Q, D] view (split
    stride 0) holds exactly the queries the copy would hold, or is None where the rows do not merge."""
    from gluon_attn import decode

    Z, H, N, D = shape
    if layout == "contiguous":
        q = torch.randn(shape)
    elif layout == "projection":  # ([Z, N, H, D] as a projection writes it)
        q = torch.randn(Z, N, H, D).transpose(1, 2)
    elif layout == "heads-strided":  # every other head of a larger tensor
        q = torch.randn(Z, 2 * H, N, D)[:, ::2]
    else:  # every other batch of a larger tensor
        q = torch.randn(2 * Z, H, N, D)[::2]
    strides = decode._packed_query_strides(q, h_kv)
    assert (strides is not None) == merges
    if merges:
        G = H // h_kv
        want = q.reshape(Z, h_kv, G, N, D).reshape(1, Z * h_kv, G * N, D).expand(3, -1, -1, -1)
        got = q.as_strided((3, Z * h_kv, G * N, D), strides, q.storage_offset())
        assert strides[0] == 0 and torch.equal(got, want)


def _qkv(shape=(2, 4, 64, 64), dtype=torch.float16, device="cpu"):
    return tuple(torch.randn(shape).to(dtype=dtype, device=device) for _ in range(3))


def test_route_keys_differ_for_every_property_a_plan_depends_on():
    q, k, v = _qkv()
    base = api._route_key(q, k, v, True, None)
    assert api._route_key(q.clone(), k.clone(), v.clone(), True, None) == base  # new tensors, same signature
    variants = {
        "stride": (q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
        "contiguity": (q, k.transpose(2, 3).contiguous().transpose(2, 3), v),
        "dtype": (q.to(torch.bfloat16), k, v),
        "device": (q.to("meta"), k, v),
        "shape": (q[:, :, :32], k, v),
        "v's dtype": (q, k, v.to(torch.bfloat16)),
    }
    keys = {name: api._route_key(*t, True, None) for name, t in variants.items()}
    for name, key in keys.items():
        assert key != base, name
    assert len(set(keys.values())) == len(keys)
    assert api._route_key(q, k, v, False, None) != base  # an option
    assert hopper_host.call_key(q, k, v, None, 1) != hopper_host.call_key(q, k, v, q, 1)  # an output given


def test_a_growing_caches_signatures_share_one_family_and_nothing_else_does():
    """``api._family_key``: the route key less the keys' count and the outer strides it moves (a cache that grew by
    a key), with the length's tuning class in its place; any other difference makes another family."""
    q = torch.randn(2, 8, 1, 64, dtype=torch.float16)
    kv = lambda n, **kw: [torch.randn(2, 2, n, 64, **kw).half() for _ in range(2)]  # noqa: E731
    fam = lambda q, k, v, causal=False: api._family_key(api._route_key(q, k, v, causal, None))  # noqa: E731
    base = fam(q, *kv(500))
    assert fam(q, *kv(501)) == base and fam(q, *kv(2048)) == base
    k, v = kv(500)
    others = {"another tuning class": (q, *kv(2049)), "q's length": (q.expand(2, 8, 2, 64), *kv(500)),
              "k's heads": (q, *(t[:, :1] for t in kv(500))), "k's row stride": (q, torch.randn(2, 500, 2, 64).half().transpose(1, 2), kv(500)[1]),
              "v's dtype": (q, k, v.bfloat16()), "the head dim": (q[..., :32], *(t[..., :32] for t in kv(500)))}
    for name, args in others.items():
        assert fam(*args) != base, name
    assert fam(q, *kv(500), causal=True) != base


def test_backward_route_keys_differ_for_every_property_a_plan_depends_on():
    q, k, v = _qkv()
    do, out, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(2, 4, 64)
    opts = (True, None, "auto", False)
    base = api._bwd_route_key(do, q, k, v, out, lse, None, *opts)
    assert api._bwd_route_key(do.clone(), q.clone(), k, v, out, lse.clone(), None, *opts) == base
    variants = {
        "the lse's gradient": (do, q, k, v, out, lse, torch.randn_like(lse)),
        "do's strides": (do.transpose(1, 2).contiguous().transpose(1, 2), q, k, v, out, lse, None),
        "k's dtype": (do, q, k.to(torch.bfloat16), v, out, lse, None),
        "v's shape": (do, q, k, v[:, :, :32], out, lse, None),
        "out's device": (do, q, k, v, out.to("meta"), lse, None),
    }
    keys = {name: api._bwd_route_key(*t, *opts) for name, t in variants.items()}
    for name, key in keys.items():
        assert key != base, name
    assert len(set(keys.values())) == len(keys)
    for i, other in enumerate((False, 0.1, "plain", True)):  # causal, sm_scale, kernel name, deterministic
        changed = list(opts)
        changed[i] = other
        assert api._bwd_route_key(do, q, k, v, out, lse, None, *changed) != base
    assert api._bwd_route_key(do, q, k, v, out, lse.tolist(), None, *opts) is None  # (not a tensor: checked path)


def test_aligned_offsets_lay_parts_out_at_multiples_of_the_alignment():
    offsets, total = launch.aligned_offsets([0, 1, 128, 129, 4])
    assert offsets == [0, 0, 128, 256, 512] and total == 640
    assert launch.aligned_offsets([10, 20], align=16) == ([0, 16], 48)


class _FakeDirect:
    """What FixedLaunch reads of a compiled kernel's direct launcher; its C launch records the arguments."""

    def __init__(self, n_descs: int):
        self.meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [1, 1, 64, 64]}] * n_descs
        self.kernel = type("K", (), {"function": 0, "packed_metadata": None})()
        self.coop = self.pdl = False
        self.annotations = self.signature = None
        self.usable = True
        self.launches = []
        self.c_launch = lambda *a: self.launches.append(a)


def _fixed(n_descs=2):
    direct = _FakeDirect(n_descs)
    fl = launch.FixedLaunch.__new__(launch.FixedLaunch)
    fl.direct, fl.grid, fl.consts = direct, 7, (1, 2)
    fl.specs = [(3, 2, 6, [1, 1, 64, 64], [2, 4, 64, 64], [16384, 4096, 64, 1])] * n_descs
    fl.caches = [{} for _ in range(n_descs)]
    encodes = []
    fl.fill = lambda ptr, *a: encodes.append(ptr) or f"map@{ptr}"
    return fl, direct, encodes


def test_fixed_launch_encodes_each_address_once_and_never_reuses_another():
    fl, direct, encodes = _fixed()
    fl(0, (4096, 8192), ("x",))
    fl(0, (4096, 8192), ("y",))
    assert encodes == [4096, 8192]  # the second call reused both encodings
    fl(0, (4096, 12288), ("z",))
    assert encodes == [4096, 8192, 12288]  # a new address: a new encoding
    args = direct.launches[-1][-1]
    assert args[0] == "map@4096" and args[9] == "map@12288" and args[-3:] == ("z", 1, 2)
    for i in range(launch.FixedLaunch.MAX_ENTRIES * 2):
        fl(0, (16 * i, 16 * i + 8), ())
    assert all(len(c) <= launch.FixedLaunch.MAX_ENTRIES for c in fl.caches)


def test_a_launch_of_other_shapes_encodes_those_anew_and_shares_the_rest():
    """``FixedLaunch.with_shapes`` (a growing cache's keys): the changed descriptor is encoded again on its new shape
    and strides, even at an address the first launch had encoded; the unchanged one reuses the first's encoding;
    the first launch keeps its own shapes."""
    fl, direct, encodes = _fixed()
    seen = []
    fl.fill = lambda ptr, swizzle, elem, dtype, block, shape, strides, _: seen.append((ptr, shape[2])) or f"m{ptr}"
    fl(0, (4096, 8192), ())
    grown = fl.with_shapes({1: ([2, 4, 65, 64], [16640, 4160, 64, 1])})
    grown(0, (4096, 8192), ())
    assert seen == [(4096, 64), (8192, 64), (8192, 65)]
    assert direct.launches[-1][-1][9 + 1 + 2] == 65  # (the first map, shape, strides; the map, its key count)
    fl(0, (4096, 8192), ())
    assert len(seen) == 3 and direct.launches[-1][-1][9 + 1 + 2] == 64


@pytest.fixture
def prepared_env(monkeypatch):
    """hopper_host.prepare on CPU tensors: the GPU's SM count, stream and compiled kernel stood in for."""
    fl, direct, encodes = _fixed(4)
    monkeypatch.setattr(hopper_host, "sm_count", lambda device: 132)
    monkeypatch.setattr(hopper_host, "compiled", lambda *a, **k: direct)
    monkeypatch.setattr(hopper_host, "FixedLaunch", lambda direct, grid, descs, consts: fl)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hopper_host._PREPARED.clear()
    yield direct, encodes
    hopper_host._PREPARED.clear()


def test_prepared_launch_makes_outputs_in_qs_layout_and_falls_back_on_a_misaligned_address(prepared_env):
    direct, encodes = prepared_env
    q, k, v = _qkv((2, 64, 4, 64))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [Z, H, N, D] views of [Z, N, H, D]: a model's projections
    call = hopper_host.prepare(q, k, v, causal=True, return_lse=True)
    assert call is not None and hopper_host.prepare(q, k, v, causal=True, return_lse=True) is call
    out, lse = call(q, k, v, None, None)
    assert out.stride() == torch.empty_like(q).stride() and out.dtype == q.dtype
    assert lse.shape == (2, 4, 64) and lse.dtype == torch.float32
    assert encodes[:3] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    # The same signature at an address TMA cannot take (8 bytes past an aligned one): no launch, the general path.
    flat = torch.empty(q.numel() + 8, dtype=q.dtype)
    shifted = flat[4:4 + q.numel()].view(2, 64, 4, 64).transpose(1, 2)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    n = len(direct.launches)
    assert call(shifted, k, v, None, None) is None and len(direct.launches) == n
    # Another layout of the same shape is another signature: another prepared launch.
    assert hopper_host.prepare(q.contiguous(), k, v, causal=True, return_lse=True) is not call


def test_prepared_launch_refuses_a_layout_tma_cannot_take(prepared_env):
    q, k, v = (t[..., :64] for t in _qkv((1, 2, 64, 68)))  # rows 136 bytes apart: not 16-byte strides
    assert hopper_host.prepare(q, k, v) is None


@pytest.mark.parametrize("bad", ["cpu", "head_dim", "dtype"])
def test_errors_are_the_same_on_the_first_and_the_hundredth_call(bad):
    q, k, v = _qkv()
    if bad == "head_dim":
        q, k, v = _qkv((1, 2, 16, 40))
    elif bad == "dtype":
        q, k, v = _qkv(dtype=torch.float32)
    messages = set()
    for _ in range(100):
        with pytest.raises((ValueError, RuntimeError)) as exc:
            api.forward(q, k, v, causal=True)
        messages.add(str(exc.value))
    assert len(messages) == 1
    assert len(api._ROUTES) == 0 or all(key[3].type == "cuda" for key in api._ROUTES._d)


def test_clearing_a_backends_caches_forgets_every_route_and_prepared_launch():
    from gluon_attn.kernels.backend import backend_for_arch

    api._ROUTES.put(("k",), "route")
    hopper_host._PREPARED.put(("k",), "prepared")
    backend_for_arch("sm_90a").clear_caches()
    assert len(api._ROUTES) == 0 and len(hopper_host._PREPARED) == 0


def test_a_grown_cache_derives_its_one_launch_split_as_make_makes_it(prepared_env):
    """``PreparedSplit.with_keys`` (a growing cache's new count of keys, ``api._family_route``): where the plan keeps
    its splits and rows, the derived split's chunk launch has the descriptors, scalars (the even chunk's N_KV, the
    absorbed tail's keys in n_seqs) and build that ``make`` gives the new count, and the rest of it as made; another
    split count, a tail that is not absorbed or another tuning class of the chunks: None (``make`` then)."""
    from gluon_attn import decode

    bf16 = torch.bfloat16
    q = torch.randn(1, 1, 32, 128, dtype=bf16).transpose(1, 2)  # (a model's projection: [Z, N_Q, H, D] seen as [Z, H, ...])
    out = torch.empty(1, 32, 1, 128, dtype=bf16, device="meta")

    def made(n_kv, p=None):
        k, v = (torch.empty(1, 8, n_kv, 128, dtype=bf16) for _ in range(2))  # (addresses, shapes, strides)
        p = p or decode.plan(1, 32, 8, 1, n_kv, False, 128, 132, absorb=True)
        split = decode.PreparedSplit.make(hopper_host.prepare, q, k, v, p, causal=False, sm_scale=None,
                                          return_lse=False, out=out, kernel_name="gluon_attention")
        return k, v, p, split

    _, _, first_plan, first = made(8193)
    assert first.one_launch and first_plan.splits >= 2 and first_plan.absorbed
    derived_any = False
    for n_kv in [8192, *range(8194, 8193 + 3 * first_plan.splits)]:
        k, v, p, fresh = made(n_kv)
        derived = first.with_keys(k, v, p)
        if (p.splits, p.rows) != (first_plan.splits, first_plan.rows):
            assert derived is None
            continue
        derived_any = True
        assert p.absorbed == bool(p.tail) and derived.plan == p
        mine, theirs = derived.chunk, fresh.chunk
        assert mine.descs == theirs.descs and mine.scalars == theirs.scalars and mine.plan == theirs.plan
        assert mine.scalars[2] == p.chunk and mine.scalars[6] == p.tail
        same = {name: value for name, value in vars(fresh).items() if name not in ("chunk", "plan")}
        assert {name: getattr(derived, name) for name in same} == same
    assert derived_any
    k, v, p, _ = made(8193)
    assert first.with_keys(k, v, decode.DecodePlan(p.splits, p.chunk, p.rows, p.tail)) is None  # (a tail launch)
    assert first.with_keys(k, v, decode.DecodePlan(p.splits + 1, 8193 // (p.splits + 1), p.rows,
                                                   8193 % (p.splits + 1), absorbed=True)) is None
    long_k, long_v, long_plan, _ = made(first_plan.splits * 70000)  # (chunks of another tuning class)
    assert long_plan.splits != first_plan.splits or first.with_keys(long_k, long_v, long_plan) is None


@pytest.mark.parametrize("return_lse", [False, True])
def test_the_eager_autograd_node_passes_what_each_backward_needs(monkeypatch, return_lse):
    """``api._EagerAttention`` (a plain eager call that autograd records; the kernels stood in for on the CPU): its
    outputs are the forward's (the lse only where asked for), its backward receives the saved tensors and the incoming
    gradients (the lse's where it was used) and gives the backward's gradients to q, k and v; with ``create_graph``
    those gradients refuse a second backward (once differentiable), as the custom op's do."""
    calls = []

    def fake_forward(q, k, v, *, causal, sm_scale, return_lse, kernel_name):
        assert return_lse  # (the backward needs the lse whether the caller asked for it or not)
        return (q * 2).detach(), (k.sum(-1) + 1).detach()

    def fake_backward(do, q, k, v, out, lse, *, grad_lse, causal, sm_scale, kernel_name, deterministic):
        calls.append((do, out, lse, grad_lse, (causal, sm_scale, kernel_name, deterministic)))
        return do * 3, torch.full_like(k, 5.0), torch.full_like(v, 7.0)

    monkeypatch.setattr(api, "forward", fake_forward)
    monkeypatch.setattr(api, "backward", fake_backward)
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    options = (True, 0.5, "plain", False, return_lse)
    res = api._eager_attention(q, k, v, options)
    out, lse = res if return_lse else (res, None)
    assert isinstance(res, tuple) == return_lse
    assert torch.equal(out, q.detach() * 2) and out.grad_fn is not None
    g = torch.randn_like(out)
    loss = (out * g).sum() + (0 if lse is None else (lse * 2).sum())
    loss.backward()
    (do, saved_out, saved_lse, grad_lse, opts), = calls
    assert torch.equal(do, g) and torch.equal(saved_out, q.detach() * 2)
    assert torch.equal(saved_lse, k.detach().sum(-1) + 1) and opts == (True, 0.5, "plain", False)
    assert (grad_lse is None) == (not return_lse)
    if return_lse:
        assert torch.equal(grad_lse, torch.full_like(lse, 2.0))
    assert torch.equal(q.grad, g * 3) and torch.equal(k.grad, torch.full_like(k, 5.0))
    assert torch.equal(v.grad, torch.full_like(v, 7.0))
    res = api._eager_attention(q, k, v, options)
    out = res[0] if return_lse else res
    g = g.clone().requires_grad_()  # (a gradient that itself requires grad: what a second backward would follow)
    dq, = torch.autograd.grad((out * g).sum(), q, create_graph=True)
    assert torch.equal(dq, g * 3) and dq.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_the_cpu_new_count_harness_derives_every_counts_split():
    """``host_anatomy.py --cpu-new-count`` (the GPU stood in for, in a process of its own: it replaces the launch
    module's GPU calls): a growing cache's new counts take the derived one-launch split but where the plan changes
    its split count, and the tables print."""
    import subprocess
    import sys

    from .experiment_scripts import EXPERIMENTS

    script = (f"import sys; sys.path.insert(0, {str(EXPERIMENTS)!r}); import host_anatomy as h; "
              "h.cpu_new_count(128, steps=70, calls=20)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    derived = int(res.stdout.split("70 counts from 8193 keys; ")[1].split(" of them derived")[0])
    assert derived >= 66  # (all but the counts where the plan takes a split count not made before)
    assert "| a new count of keys: route derived and called |" in res.stdout
    assert "| PreparedSplit.with_keys |" in res.stdout and "derives no split" not in res.stdout


def test_the_cpu_na_harness_takes_every_seen_calls_prepared_launches():
    """``host_anatomy.py --cpu-na`` (the launches stood in for, in a process of its own): seen na1d, na2d and na3d
    calls take their routes' prepared launches, one a call for a plain window, one per x group for na2d's dilation
    (2, 4) (y's groups as heads) and per (x, y) group for na3d's (2, 2, 2) (z's as heads); none takes the checked
    path but the additional keys' call, whose neighborhood part main does not prepare."""
    import subprocess
    import sys

    from .experiment_scripts import EXPERIMENTS

    script = (f"import sys; sys.path.insert(0, {str(EXPERIMENTS)!r}); import host_anatomy as h; "
              "h.cpu_na(calls=20, rounds=1)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[2].strip(" |") for line in res.stdout.splitlines()
            if line.startswith("| n") or line.startswith("| the")}
    assert rows["na1d 4096, window 33, B 4 H 8 D 64"] == "1 / 0"
    assert rows["na2d 64x64, window (7, 7), B 4 H 8 D 64"] == "1 / 0"
    assert rows["the same, dilation (2, 4)"] == "2 / 0"
    assert rows["na3d 16x16x16, window (5, 5, 5), B 2 H 8 D 64"] == "1 / 0"
    assert rows["the same, dilation (2, 2, 2)"] == "4 / 0"

