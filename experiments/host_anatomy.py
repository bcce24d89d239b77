"""Where the host time of one plain eager ``attention`` call goes, piece by piece, beside SDPA's whole call, in one
process: each piece timed as ``bench.timing.host_times`` times a call (batches of calls back to back from an idle queue;
a small problem, so the GPU never holds the host back), the median batch's issue time per call in microseconds.

A second table takes a forward and backward under autograd apart: the whole step with autograd's device thread
(the default) and without it (``torch.autograd.set_multithreading_enabled(False)``: the backward on the calling
thread), ours beside SDPA's, a one-kernel Python ``autograd.Function`` beside the same kernel as a C++ node (what a
Python backward costs the engine), and our forward and backward alone.

A third takes a packed call (``attention_varlen``, host_calls.py's 8 sequences) apart the same way.

``--decode``: a decode step's split route (``decode.PreparedSplit``, two launches) piece by piece beside SDPA's step,
and a generate-like loop: 16 layers, each with its own cache grown by ``torch.cat`` at every step (as transformers'
dynamic cache grows), ours and SDPA's steps taking turns, with the TMA descriptors the loop encodes counted.
``--generate-like P1,P2,...``: that loop alone from caches of each prompt length (long ones take the decode split,
a new count of keys every step).

``--cpu-node`` (no GPU needed): the eager autograd node's own cost (``api._eager_attention``, the forward and backward
stood in for by allocations on the CPU, a small problem) beside a one-kernel Python ``autograd.Function`` and a C++ node
on the same tensors: what the node adds to a forward and backward, apart from the kernels and the host's CUDA calls.
``--cpu-new-count [D]`` (no GPU needed): a growing cache's decode step at a new count of keys (8192 keys and up, batch
1, 32 query and 8 K/V heads, head dim D, 128 by default), the route derived from the family's as a model's first layer
of a step takes it (``api._family_route``), the kernels, SM count, stream and descriptor encodings stood in for, beside
the same route's call at a count already seen; then the derivation piece by piece.
``--cpu-na`` (no GPU needed): seen na1d/na2d/na3d calls (host_calls.py's shapes: windows, a dilation, additional
keys) with the kernels' launches stood in for by no-ops counted, the routes and prepared launches made as on a GPU:
each call's Python and its launches, prepared (by address) or checked (the general path). The additional keys'
``attention`` is stood in for by a fixed result (its own call is a seen dense route's).

Usage (GPU): PYTHONPATH=. python3 experiments/host_anatomy.py [SHAPE] [--varlen | --decode | --generate-like P,... |
--cpu-node | --cpu-new-count [D] | --cpu-na] > host-anatomy.md (``--varlen``, ``--decode``, ``--generate-like``,
``--cpu-node``, ``--cpu-new-count``, ``--cpu-na``: that table only)"""
import sys

import torch
import torch.nn.functional as F

import gluon_attn
from gluon_attn import api, decode
from gluon_attn.bench.provider import autograd_call
from gluon_attn.bench.timing import host_times
from gluon_attn.kernels import hopper_host

CALLS, BATCHES = 100, 15


def per_call_us(fn) -> float:
    return host_times(fn, calls=CALLS, batches=BATCHES)["host_us"]


def print_pieces(pieces):
    """A table of (name, call) pieces: each called once first, then its host time per call."""
    print("| piece | us per call |\n|---|---|")
    for name, fn in pieces:
        fn()
        print(f"| {name} | {per_call_us(fn):.2f} |", flush=True)


def main(shape_arg: str):
    shape = tuple(int(x) for x in shape_arg.split(","))
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        gluon_attn.attention(q, k, v, causal=True)
    key = api._route_key(q, k, v, True, None, None, None, None, False, None, "auto")
    route = api._ROUTES.get(key)
    assert isinstance(route, hopper_host._Prepared), type(route)
    launch = route.launch
    out = torch.empty_like(q)
    stream = torch._C._cuda_getCurrentRawStream(0)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    args = (out, route.unused_f32, route.unused, route.unused, route.qk_scale, *route.scalars)
    layout = (route.out_shape, route.out_strides)
    pieces = [
        ("SDPA, the whole call", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("gluon_attn.attention, the whole call", lambda: gluon_attn.attention(q, k, v, causal=True)),
        ("api.forward (no grad or mode checks)", lambda: api.forward(q, k, v, causal=True)),
        ("the route: _Prepared.__call__", lambda: route(q, k, v)),
        ("FixedLaunch alone (descriptors cached)", lambda: launch(stream, ptrs, args)),
        ("torch.empty_strided of the output", lambda: torch.empty_strided(*layout, dtype=q.dtype, device=q.device)),
        ("api._plain_eager", lambda: api._plain_eager(q, k, v)),
        ("api._needs_grad", lambda: api._needs_grad(q, k, v)),
        ("the route key", lambda: api._route_key(q, k, v, True, None, None, None, None, False, None, "auto")),
        ("the route lookup", lambda: api._ROUTES.get(key)),
        ("current raw stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("an empty Python call", lambda: None),
    ]
    # A decode step (8 x 32 query heads, 8 K/V heads, 700 keys): its route, a new key count's (the route derived from
    # the signature the cache grew from), and a signature never seen (checks, plan, prepare).
    dq = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    dk, dv = (torch.randn(8, 8, 700, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def new_count():
        api._ROUTES.clear()
        gluon_attn.attention(dq, dk, dv)

    def new_signature():
        api._ROUTES.clear()
        api._FAMILIES.clear()
        hopper_host._PREPARED.clear()
        gluon_attn.attention(dq, dk, dv)

    pieces[2:2] = [("decode step [8, 32, 1, 128] x 700 keys, its route", lambda: gluon_attn.attention(dq, dk, dv)),
                   ("the same, a new key count (the grown-from route)", new_count),
                   ("the same, a new signature (checks, plan, prepare)", new_signature),
                   ("SDPA's decode step", lambda: F.scaled_dot_product_attention(dq, dk, dv, enable_gqa=True))]
    print(f"# Host anatomy of attention {list(shape)} fp16 causal ({torch.cuda.get_device_name()})\n")
    print_pieces(pieces)


class _PyDouble(torch.autograd.Function):
    """One kernel forward and one backward, written in Python: the engine's cost of a Python node."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def backward_pieces():
    q, k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    g = torch.randn_like(q)
    x = torch.randn(1024, device="cuda", requires_grad=True)
    gx = torch.randn_like(x)
    with torch.no_grad():
        out, lse = gluon_attn.attention(q, k, v, causal=True, return_lse=True)

    def graded(attend):  # (the sweep's fwd+bwd call itself)
        return autograd_call(lambda *t: lambda: attend(*t), q, k, v, g, "fwd+bwd")

    steps = [
        ("ours: attention(...).backward(g)", lambda: gluon_attn.attention(q, k, v, causal=True).backward(g)),
        ("SDPA: the same", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)),
        ("ours: torch.autograd.grad (the sweep's call)",
         graded(lambda *t: gluon_attn.attention(*t, causal=True))),
        ("SDPA: the same", graded(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True))),
        ("a Python autograd.Function, one kernel each way", lambda: _PyDouble.apply(x).backward(gx)),
        ("the same kernels as a C++ node ((x * 2).backward)", lambda: (x * 2).backward(gx)),
    ]
    alone = [
        ("ours: the forward alone, recorded (no backward)", lambda: gluon_attn.attention(q, k, v, causal=True)),
        ("ours: api.backward alone (its route)", lambda: api.backward(g, q, k, v, out, lse, causal=True)),
    ]
    stored = []
    put = api._BWD_ROUTES.put
    api._BWD_ROUTES.put = lambda key, value: (stored.append(key), put(key, value))[1]
    print("\n# Forward and backward under autograd [1, 8, 1024, 128] fp16 causal\n")
    print("| step | us per call, device thread (default) | us per call, calling thread |\n|---|---|---|")
    for name, fn in steps:
        fn()
        threaded = per_call_us(fn)
        with torch.autograd.set_multithreading_enabled(False):
            fn()
            inline = per_call_us(fn)
        print(f"| {name} | {threaded:.2f} | {inline:.2f} |", flush=True)
    for name, fn in alone:
        fn()
        print(f"| {name} | {per_call_us(fn):.2f} | |", flush=True)
    print(f"\nBackward routes made during the table: {len(stored)} (one per signature: more is a route missed)")


def varlen_pieces():
    from gluon_attn.kernels.launch import zeroed_counter

    lengths = [700, 128, 2048, 300, 1500, 64, 900, 512]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 32, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    m = max(lengths)
    for _ in range(3):
        gluon_attn.attention_varlen(q, k, v, cu, cu, m, m, causal=True)
    key = api._varlen_route_key(q, k, v, cu, cu, True, None, False, "auto", m, m)
    route = api._ROUTES.get(key)
    assert isinstance(route, api._VarlenRoute), type(route)
    stream = torch._C._cuda_getCurrentRawStream(0)
    p = route.prepared
    out = torch.empty(route.out_layout[0], dtype=q.dtype, device=q.device)
    table = route._table(stream, cu, cu).data_ptr()
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    shape, strides, dtype = route.out_layout
    pieces = [
        ("gluon_attn.attention_varlen, the whole call",
         lambda: gluon_attn.attention_varlen(q, k, v, cu, cu, m, m, causal=True)),
        ("api.forward_varlen", lambda: api.forward_varlen(q, k, v, cu, cu, m, m, causal=True)),
        ("the route: _VarlenRoute.__call__", lambda: route(q, k, v, cu, cu)),
        ("the route's table (the offsets unchanged: held)", lambda: route._table(stream, cu, cu)),
        ("run_ptrs alone (table and counter given)",
         lambda: p.run_ptrs(stream, ptrs, ptrs[3], p.unused_f32, table=table, sched=zeroed_counter(0, stream))),
        ("zeroed_counter", lambda: zeroed_counter(0, stream)),
        ("torch.empty_strided of the output",
         lambda: torch.empty_strided(shape, strides, dtype=dtype, device=q.device)),
        ("the route key (signature of 5 tensors)",
         lambda: api._varlen_route_key(q, k, v, cu, cu, True, None, False, "auto", m, m)),
        ("the route lookup", lambda: api._ROUTES.get(key)),
        ("api._plain_eager of 5 tensors", lambda: api._plain_eager(q, k, v, cu, cu)),
        ("an empty Python call", lambda: None),
    ]
    print(f"\n# Host anatomy of attention_varlen, {len(lengths)} sequences, {sum(lengths)} tokens, H 32, D 128, fp16 "
          f"causal\n")
    print_pieces(pieces)


def decode_pieces():
    from gluon_attn.kernels.launch import scratch

    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        gluon_attn.attention(q, k, v)
    route = api._ROUTES.get(api._route_key(q, k, v, False, None, None, None, None, False, None, "auto"))
    assert isinstance(route, api._Route) and route.fast is not None, route
    fast = route.fast
    stream = torch._C._cuda_getCurrentRawStream(0)
    ws = scratch(0, stream, fast.ws_elems * q.element_size(), q.dtype)
    w = ws.data_ptr()
    op, lse_chunks = w + fast.o_at, w + fast.lse_chunks_at
    out = torch.empty_like(q)
    chunk_ptrs = (w if fast.copies else q.data_ptr(), k.data_ptr(), v.data_ptr(), op)
    from gluon_attn.kernels.launch import zeroed_counter

    if fast.one_launch:  # (``PreparedSplit.one_launch``: the chunks' launch combines, its counters and output a call's)
        counted = dict(table=zeroed_counter(0, stream, fast.heads), sched=out.data_ptr())
        second = ("a zeroed counter per K/V head", lambda: zeroed_counter(0, stream, fast.heads))
    else:
        counted = {}
        combine_args = (op, lse_chunks, fast.unused, out.data_ptr(), w + fast.lse_at, *fast.combine_tail)
        second = ("the combine's launch alone", lambda: fast.combine(fast.grid, stream, combine_args, fast.consts))
    p = fast.plan
    dk, dv = (t[:, :, :700].contiguous() for t in (k, v))
    pieces = [
        ("SDPA's decode step (enable_gqa)", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        ("gluon_attn.attention, the whole call", lambda: gluon_attn.attention(q, k, v)),
        ("api.forward", lambda: api.forward(q, k, v)),
        ("the route: _Route.__call__", lambda: route(q, k, v)),
        ("its launches: PreparedSplit.__call__", lambda: fast(q, k, v)),
        ("the chunks' launch alone (run_ptrs)",
         lambda: fast.chunk.run_ptrs(stream, chunk_ptrs, op, lse_chunks, **counted)),
        second,
        ("scratch", lambda: scratch(0, stream, fast.ws_elems * q.element_size(), q.dtype)),
        ("torch.empty_like of the output", lambda: torch.empty_like(q)),
        ("an ordinary launch's route ([8, 32, 1, 128] x 700 keys)", lambda: gluon_attn.attention(q, dk, dv)),
        ("an empty Python call", lambda: None),
    ]
    print(f"\n# A decode step's split route: [8, 32, 1, 128] bf16 against 8 K/V heads x 8192 keys "
          f"(plan: {p.splits} chunks of {p.chunk} keys, tail {p.tail}, queries copied: {fast.copies}, "
          f"{'one launch (the chunks combine)' if fast.one_launch else 'two launches'})\n")
    print_pieces(pieces)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        gluon_attn.attention(q, k, v)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    print("\n2000 split calls under cProfile, by own time:\n\n```\n" + text.getvalue().strip() + "\n```")
    generate_like()


def generate_like(layers: int = 16, prompt: int = 512, steps: int = 64, rounds: int = 3, unseen: bool = False):
    """Decode steps as a Llama-style model at batch 1 makes them (32 query / 8 K/V heads, head dim 128, bf16): each of
    ``layers`` layers appends a key to its own cache with ``torch.cat`` and attends; host time per layer call, the cat
    included, ours and SDPA's taking turns round by round (each from a fresh prompt-long cache). Every round makes the
    same counts of keys, so from the second on their routes are known; ``unseen``: each round first forgets every
    route and plan (``api._ROUTES``, ``decode.plan``'s, the prepared launches and their plans), as a first generate to
    these lengths finds them (the compiled kernels and the families of signatures stay)."""
    import statistics
    import time

    from gluon_attn.kernels import launch as launch_mod

    encodes = [0]
    encoded = launch_mod.FixedLaunch.encoded

    def counted(self, d, ptr):
        encodes[0] += 1
        return encoded(self, d, ptr)

    launch_mod.FixedLaunch.encoded = counted
    g = torch.Generator(device="cuda").manual_seed(0)

    def forget():  # (every route and plan a count of keys makes; the compiled kernels and the families stay)
        api._ROUTES.clear()
        (getattr(decode, "clear_plans", None) or decode.plan.cache_clear)()  # (an older package: an lru_cache)
        hopper_host._launch_plan.cache_clear()
        hopper_host._PREPARED.clear()

    def fresh():
        return [[torch.randn(1, 8, prompt, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
                for _ in range(layers)]

    impls = {"ours": lambda q, k, v: gluon_attn.attention(q, k, v),
             "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    new = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    times = {name: [] for name in impls}
    walls = {name: [] for name in impls}
    firsts = {name: [] for name in impls}
    others = {name: [] for name in impls}
    counts = {name: [] for name in impls}
    for r in range(rounds + 1):  # (round 0 warms both up)
        for name, fn in impls.items():
            caches = fresh()
            if unseen and name == "ours":
                forget()
            torch.cuda.synchronize()
            encodes[0] = 0
            t0 = time.perf_counter()
            calls = [0.0, 0.0]  # (the first layer's calls, a new count of keys each; the other layers')
            for _ in range(steps):
                for i, c in enumerate(caches):
                    c[0] = torch.cat([c[0], new], dim=2)
                    c[1] = torch.cat([c[1], new], dim=2)
                    a = time.perf_counter()
                    fn(q, c[0], c[1])
                    calls[i > 0] += time.perf_counter() - a
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if r:
                times[name].append((t1 - t0) / (steps * layers) * 1e6)
                walls[name].append((t2 - t0) / (steps * layers) * 1e6)
                counts[name].append(encodes[0] / (steps * layers))
                firsts[name].append(calls[0] / steps * 1e6)
                others[name].append(calls[1] / (steps * (layers - 1)) * 1e6)
    launch_mod.FixedLaunch.encoded = encoded
    route = api._ROUTES.get(api._route_key(q, caches[0][0], caches[0][1], False, None, None, None, None, False, None,
                                           "auto"))
    split = getattr(route, "split", None)
    taken = "the ordinary launch" if split is None else f"split {split.splits} x {split.chunk}" + (
        f" + tail {split.tail}" if split.tail else "")
    print(f"\n# Generate-like decode steps: {layers} layers, caches from {prompt} keys grown by torch.cat, {steps} "
          f"steps, [1, 32, 1, 128] bf16 against 8 K/V heads ({rounds} rounds taking turns; our last step: {taken}"
          f"{'; every count of keys unseen' if unseen else ''})\n")
    print("| impl | host us per layer call (two cats included), median | rounds | wall us per layer call, median | "
          "the call alone: first layer (a new count of keys) / other layers, us | descriptors encoded per call |")
    print("|---|---|---|---|---|---|")
    for name in impls:
        print(f"| {name} | {statistics.median(times[name]):.2f} | {', '.join(f'{t:.2f}' for t in times[name])} | "
              f"{statistics.median(walls[name]):.2f} | {statistics.median(firsts[name]):.1f} / "
              f"{statistics.median(others[name]):.1f} | {statistics.median(counts[name]):.2f} |", flush=True)
    if unseen:  # (where a new count of keys' first call goes: our steps once more under cProfile)
        import cProfile
        import io
        import pstats

        forget()
        caches = fresh()
        prof = cProfile.Profile()
        for _ in range(steps):
            for i, c in enumerate(caches):
                c[0] = torch.cat([c[0], new], dim=2)
                c[1] = torch.cat([c[1], new], dim=2)
                if i == 0:
                    prof.enable()
                impls["ours"](q, c[0], c[1])
                prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
        print(f"\nThe first layer's {steps} calls (a new count of keys each) under cProfile, cumulative:\n\n```\n"
              + text.getvalue().strip() + "\n```")


def cpu_node(calls: int = 2000, batches: int = 9):
    """The eager autograd node on the CPU, kernels stood in for (``--cpu-node``)."""
    torch.set_num_threads(1)

    def fake_forward(q, k, v, *, causal, sm_scale, return_lse, kernel_name):
        return torch.empty_like(q), torch.empty(q.shape[:3])

    def fake_backward(do, q, k, v, out, lse, *, grad_lse, causal, sm_scale, kernel_name, deterministic):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    api.forward, api.backward = fake_forward, fake_backward
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 4, 8)
    x = torch.randn(8, requires_grad=True)
    gx = torch.randn_like(x)
    if hasattr(api, "_eager_attention"):
        node = lambda lse: api._eager_attention(q, k, v, (True, None, "auto", False, lse))  # noqa: E731
    else:  # (the package before 8800ba9: the lse always an output, through Function.apply)
        node = lambda lse: api._returned(api._EagerAttention.apply(q, k, v, True, None, "auto", False),  # noqa: E731
                                         lse)
    steps = [("the eager node, kernels stood in for: forward + .backward(g)", lambda: node(False).backward(g)),
             ("the same, the lse returned and unused", lambda: node(True)[0].backward(g)),
             ("the stand-ins alone (forward, backward)", lambda: (fake_forward(q, k, v, causal=True, sm_scale=None,
                                                                               return_lse=True, kernel_name="auto"),
                                                                  fake_backward(g, q, k, v, q, q, grad_lse=None,
                                                                                causal=True, sm_scale=None,
                                                                                kernel_name="auto",
                                                                                deterministic=False))),
             ("a Python autograd.Function, one op each way", lambda: _PyDouble.apply(x).backward(gx)),
             ("the same ops as a C++ node ((x * 2).backward)", lambda: (x * 2).backward(gx))]
    print("# The eager autograd node on the CPU (kernels stood in for)\n")
    print("| step | us per call |\n|---|---|")
    for name, fn in steps:
        fn()
        print(f"| {name} | {host_times(fn, device='cpu', calls=calls, batches=batches)['host_us']:.2f} |", flush=True)


def _stand_in_device(launch):
    """The CPU harnesses' GPU: an H100/H200's SM count, device 0 and its stream, the scheduler's counter (``launch``:
    gluon_attn.kernels.launch)."""
    hopper_host.sm_count = launch.sm_count = lambda device: 132
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    launch.zeroed_counter = lambda *a, **k: 0


def cpu_new_count(head_dim: int = 128, steps: int = 400, calls: int = 2000):
    """A new count's decode route on the CPU, the GPU stood in for (``--cpu-new-count``)."""
    import statistics
    import time

    from gluon_attn.cache import layout
    from gluon_attn.kernels import launch
    from gluon_attn.kernels.backend import backend_for_arch
    from gluon_attn.kernels.common import resolve_output

    torch.set_num_threads(1)

    class Direct:  # (what FixedLaunch reads of a compiled kernel; its C launch does nothing)
        meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [1, 1, 64, 64]}] * 4
        kernel = type("K", (), {"function": 0, "packed_metadata": None})()
        coop = pdl = False
        annotations = signature = None
        usable = True
        c_launch = staticmethod(lambda *a: None)

    def fixed(direct, grid, descs, consts):
        fl = launch.FixedLaunch.__new__(launch.FixedLaunch)
        fl.direct, fl.grid, fl.consts = direct, grid, tuple(consts.values())
        fl.specs = [(3, 2, 6, [1, 1, 64, 64], list(s), list(st)) for _, s, st in descs]
        fl.caches = [{} for _ in descs]
        fl.fill = lambda ptr, *a: b"map"
        return fl

    _stand_in_device(launch)
    hopper_host.compiled = lambda *a, **k: Direct()
    hopper_host.FixedLaunch = fixed
    launch.scratch = lambda index, stream, nbytes, dtype: torch.empty(nbytes // 2 + 8, dtype=dtype)
    backend = backend_for_arch("sm_90a")
    options = (False, None, None, None, None, False, None, "gluon_attention")

    def tensors(n_kv):  # (a model's query projection as [Z, H, 1, D]; a cache grown by torch.cat: [Z, H_KV, N, D])
        q = torch.randn(1, 1, 32, head_dim, dtype=torch.bfloat16).transpose(1, 2)
        return q, *(torch.empty(1, 8, n_kv, head_dim, dtype=torch.bfloat16) for _ in range(2))

    q, k, v = tensors(8192)
    key = api._route_key(q, k, v, *options)
    split = api._decode_plan(backend, q, k, v, False, False)
    family = api._Family.of(key, backend)  # (what the first call of the family leaves)
    family.split = ("gluon_attention", None, False, layout(resolve_output(q.to("meta"), None, None, False)[0]))
    first = family.split_route(split, False)
    first.prepare_now(q, k, v)
    family.prepared[(split.splits, split.rows)] = first.fast
    if first.fast is None or not first.fast.one_launch:
        print(f"(this tree derives no split at head dim {head_dim}: its chunks do not combine their parts, "
              "`hopper_host.combines`, and a split in two launches is made again at each new count)")
        return

    def step(n_kv):
        q, k, v = tensors(n_kv)
        t0 = time.perf_counter_ns()
        key = api._route_key(q, k, v, *options)
        route = api._ROUTES.get(key) or api._family_route(key, q, k, v, False)
        route(q, k, v)
        t1 = time.perf_counter_ns()
        route(q, k, v)
        derived = getattr(route, "fast", None) is not None and route.prepare is None  # (not made again)
        return (t1 - t0) / 1e3, (time.perf_counter_ns() - t1) / 1e3, derived

    times = [step(n) for n in range(8193, 8193 + steps)]
    print(f"# A growing cache's decode step on the CPU (the GPU stood in for): head dim {head_dim}, batch 1, "
          f"32 / 8 heads, {steps} counts from 8193 keys; {sum(t[2] for t in times)} of them derived from the "
          "family's split (the others: a split count not made before)\n")
    print("| call | us per call (median) |\n|---|---|")
    print(f"| a new count of keys: route derived and called | {statistics.median(t[0] for t in times):.1f} |")
    print(f"| the same count again: the route called | {statistics.median(t[1] for t in times):.1f} |")
    q, k, v = tensors(8192 + steps)  # (the last count stepped: the family's prepared split derives it)
    key = api._route_key(q, k, v, *options)
    plan = api._decode_plan(backend, q, k, v, False, False)
    made = family.prepared[(plan.splits, plan.rows)]
    assert made.with_keys(k, v, plan) is not None
    pieces = [("the route key", lambda: api._route_key(q, k, v, *options)),
              ("the family key", lambda: api._family_key(key)),
              ("_decode_plan (its count planned)", lambda: api._decode_plan(backend, q, k, v, False, False)),
              ("the split's route object", lambda: family.split_route(plan, False)),
              ("PreparedSplit.with_keys", lambda: made.with_keys(k, v, plan))]
    one = getattr(decode, "plan_one", None) or decode.plan.__wrapped__  # (the package before: an lru_cache)
    pieces.append(("one count's plan made", lambda: one(1, 32, 8, 1, 8192 + steps, False, 128, 132, True, True,
                                                          head_dim, head_dim == 128)))
    print("\n| piece of a new count's route | us |\n|---|---|")
    for name, fn in pieces:
        print(f"| {name} | {host_times(fn, device='cpu', calls=calls, batches=9)['host_us']:.2f} |", flush=True)


def cpu_na(calls: int = 2000, rounds: int = 5):
    """Seen neighborhood calls on the CPU, the launches stood in for (``--cpu-na``)."""
    import timeit

    from gluon_attn import merge
    from gluon_attn import neighborhood as nh
    from gluon_attn import validation
    from gluon_attn.kernels import launch
    from gluon_attn.kernels.backend import backend_for_arch

    torch.set_num_threads(1)
    backend = backend_for_arch("sm_90a")
    launches = {"prepared": 0, "checked": 0}
    _stand_in_device(launch)
    nh._sm90_backend = lambda what, q: backend
    api._plain_eager = lambda *tensors: True
    check_qkv = validation.check_qkv
    validation.check_qkv = lambda *a, **kw: check_qkv(*a, **{**kw, "require_cuda": False})

    def prepared(plan, descs, device):
        def run(stream, ptrs, rest):
            launches["prepared"] += 1
        return run

    def checked_boxes(q, k, v, *, window, return_lse=False, out=None, batches=1, **_):
        launches["checked"] += 1
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        if len(window) == 2:
            lse = torch.empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])
        else:
            n = q.shape[1] * q.shape[2] * q.shape[3]
            lse = torch.empty(batches, q.shape[0], n // batches) if batches > 1 else torch.empty(q.shape[0], n)
        return (out, lse) if return_lse else out

    def checked_1d(q, k, v, *, out=None, return_lse=False, **_):
        launches["checked"] += 1
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        return (out, torch.empty(q.shape[:3])) if return_lse else out

    hopper_host._fixed_launch = prepared
    backend.module.hopper_na_boxes, backend.module.launch = checked_boxes, checked_1d
    extra = (torch.empty(4, 8, 4096, 64, dtype=torch.float16), torch.empty(4, 8, 4096))
    api.attention = lambda *a, **kw: extra
    unused = torch.empty(1)
    merge.merge_pair_ = lambda out, lse, x, x_lse, m=None: merge.merge_pair_args(out, lse, x, x_lse, m, unused)
    rand = lambda *shape: torch.randn(*shape, dtype=torch.float16)  # noqa: E731
    ak, av = rand(4, 64, 8, 64), rand(4, 64, 8, 64)
    cases = [("na1d 4096, window 33, B 4 H 8 D 64", gluon_attn.na1d, (4, 4096, 8, 64), dict(kernel_size=33)),
             ("na2d 64x64, window (7, 7), B 4 H 8 D 64", gluon_attn.na2d, (4, 64, 64, 8, 64), dict(kernel_size=(7, 7))),
             ("the same, dilation (2, 4)", gluon_attn.na2d, (4, 64, 64, 8, 64), dict(kernel_size=(7, 7),
                                                                                    dilation=(2, 4))),
             ("the same, dilation (1, 1), 64 additional keys", gluon_attn.na2d, (4, 64, 64, 8, 64),
              dict(kernel_size=(7, 7), additional_keys=ak, additional_values=av)),
             ("na3d 16x16x16, window (5, 5, 5), B 2 H 8 D 64", gluon_attn.na3d, (2, 16, 16, 16, 8, 64),
              dict(kernel_size=(5, 5, 5))),
             ("the same, dilation (2, 2, 2)", gluon_attn.na3d, (2, 16, 16, 16, 8, 64),
              dict(kernel_size=(5, 5, 5), dilation=(2, 2, 2)))]
    print("# Seen neighborhood calls on the CPU (the launches stood in for by no-ops)\n")
    print("| call | us per call | launches a call: prepared / checked |\n|---|---|---|")
    for name, fn, shape, kw in cases:
        q, k, v = (rand(*shape) for _ in range(3))
        call = lambda fn=fn, q=q, k=k, v=v, kw=kw: fn(q, k, v, **kw)  # noqa: E731
        for _ in range(3):  # (the first makes the route, the second its prepared launches)
            call()
        launches.update(prepared=0, checked=0)
        call()
        counted = dict(launches)
        us = min(timeit.repeat(call, number=calls, repeat=rounds)) / calls * 1e6
        print(f"| {name} | {us:.1f} | {counted['prepared']} / {counted['checked']} |", flush=True)
    print("\nThe additional keys' attention and merge launch besides (stood in for, not counted). A checked 2-D/3-D "
          "launch's lse is copied into the call's layout: on the CPU that copy's time is in the row, on a GPU it is "
          "a launch.")


if __name__ == "__main__":
    if "--cpu-new-count" in sys.argv:
        at = sys.argv.index("--cpu-new-count") + 1
        cpu_new_count(int(sys.argv[at]) if at < len(sys.argv) else 128)
        sys.exit(0)
    if "--cpu-na" in sys.argv:
        cpu_na()
        sys.exit(0)
    if "--cpu-node" in sys.argv:
        cpu_node()
        sys.exit(0)
    args = [a for a in sys.argv[1:] if a not in ("--varlen", "--decode")]
    if "--generate-like" in sys.argv:
        for prompt in sys.argv[sys.argv.index("--generate-like") + 1].split(","):
            generate_like(prompt=int(prompt))
            generate_like(prompt=int(prompt), unseen=True)
        sys.exit(0)
    if "--decode" in sys.argv:
        decode_pieces()
        sys.exit(0)
    if "--varlen" not in sys.argv:
        main(args[0] if args else "1,8,512,64")
        backward_pieces()
    varlen_pieces()
