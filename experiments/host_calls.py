"""Host time per call of each entry point as a model calls it (plain eager, no grad unless named, a shape seen
before), ours beside the peer a user would call instead, in one process: 20 calls back to back from an idle queue,
median of 9 batches, ours and the peer's batches taking turns so that a slow spell of the host falls on both
(``bench.timing.host_times_turns``: host_us = the time to issue a call, eager_us = the wall time per call until the
last has finished). ``--profile`` adds cProfile's top functions (cumulative) of our calls.

Usage (GPU): PYTHONPATH=. python3 experiments/host_calls.py [--profile] > host-calls.md"""
import cProfile
import functools
import io
import os
import pstats
import sys

import torch
import torch.nn.functional as F

import gluon_attn
from gluon_attn.bench.timing import host_times_turns

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (the default the peers' compiles get, named: no warning)


BATCHES = 9


def _rand(*shape, dtype=torch.float16, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)


def dense_cases():
    for Z, H, N, D in ((1, 8, 1024, 64), (4, 32, 512, 128), (1, 32, 4096, 128), (8, 32, 128, 128)):
        q, k, v = (_rand(Z, H, N, D) for _ in range(3))
        ours = lambda q=q, k=k, v=v: gluon_attn.attention(q, k, v, causal=True)  # noqa: E731
        sdpa = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        yield f"attention [{Z}, {H}, {N}, {D}] causal", ours, {"sdpa": sdpa}


def decode_cases():
    for n_q, n_kv in ((1, 1024), (1, 8192), (16, 8192), (1, 32768)):
        q = _rand(8, 32, n_q, 128)
        k, v = (_rand(8, 8, n_kv, 128) for _ in range(2))
        ours = lambda q=q, k=k, v=v: gluon_attn.attention(q, k, v)  # noqa: E731
        sdpa = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        yield f"decode Z 8, 32/8 heads, {n_q} q x {n_kv} keys", ours, {"sdpa": sdpa}


def varlen_cases():
    lengths = [700, 128, 2048, 300, 1500, 64, 900, 512]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    q, k, v = (_rand(sum(lengths), 32, 128) for _ in range(3))
    ours = lambda: gluon_attn.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)  # noqa: E731
    yield f"attention_varlen {len(lengths)} seqs, {sum(lengths)} tokens, H 32, D 128 causal", ours, {}


def grad_cases():
    q, k, v = (_rand(1, 8, 1024, 128, grad=True) for _ in range(3))
    g = torch.randn_like(q)

    def ours():
        gluon_attn.attention(q, k, v, causal=True).backward(g)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    yield "attention fwd+bwd (autograd) [1, 8, 1024, 128] causal", ours, {"sdpa": sdpa}


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_peer(q, k, v, nb):
    """FlexAttention (compiled once) over q, k, v [B, *grid, H, D] under the neighborhood ``nb``'s mask: the call."""
    from torch.nn.attention.flex_attention import create_block_mask

    from gluon_attn.neighborhood import neighborhood_mask

    allowed = neighborhood_mask(nb, device="cuda")
    n, B = allowed.shape[0], q.shape[0]
    mask = create_block_mask(lambda b, h, i, j: allowed[i, j], None, None, n, n, device="cuda")
    flat = [t.reshape(B, n, t.shape[-2], t.shape[-1]).transpose(1, 2) for t in (q, k, v)]
    return lambda: _flex()(*flat, block_mask=mask)


def na_cases():
    from gluon_attn.neighborhood import neighborhood

    for dims, shape, window in ((1, (4, 4096, 8, 64), 33), (2, (4, 64, 64, 8, 64), (7, 7)),
                                (2, (4, 96, 96, 8, 64), (13, 13)), (3, (2, 16, 16, 16, 8, 64), (5, 5, 5))):
        q, k, v = (_rand(*shape) for _ in range(3))
        fn = (gluon_attn.na1d, gluon_attn.na2d, gluon_attn.na3d)[dims - 1]
        ours = lambda q=q, k=k, v=v, fn=fn, w=window: fn(q, k, v, kernel_size=w)  # noqa: E731
        peer = _flex_peer(q, k, v, neighborhood(shape[1:-2], window))
        B, H = shape[0], shape[-2]
        yield f"na{dims}d {'x'.join(map(str, shape[1:-2]))} window {window}, B {B} H {H} D 64", ours, {"flex": peer}


def na_pattern_cases():
    """The neighborhood calls' other patterns (the host targets hold for any window, stride, dilation and causal
    pattern, and with additional keys): na2d 64x64, B 4 H 8 D 64, against Flex under the same mask; the call with
    additional keys (64 more keys every query sees) against its own call without them; na3d at dilations (2, 2, 2)
    and (3, 3, 3) against Flex."""
    from gluon_attn.neighborhood import neighborhood

    shape, B, H = (4, 64, 64, 8, 64), 4, 8
    q, k, v = (_rand(*shape) for _ in range(3))
    for window, stride, dilation, causal in (((7, 7), (2, 2), 1, False), ((7, 7), 1, (2, 4), False),
                                             ((7, 7), 1, 1, (True, False)), ((13, 13), (4, 4), (2, 2), (False, True))):
        kw = dict(kernel_size=window, stride=stride, dilation=dilation, is_causal=causal)
        ours = lambda kw=kw: gluon_attn.na2d(q, k, v, **kw)  # noqa: E731
        peer = _flex_peer(q, k, v, neighborhood(shape[1:-2], window, stride, dilation, causal))
        yield (f"na2d 64x64 window {window} stride {stride} dilation {dilation} causal {causal}, B {B} H {H} D 64",
               ours, {"flex": peer})
    ak, av = (_rand(B, 64, H, 64) for _ in range(2))
    plain = lambda: gluon_attn.na2d(q, k, v, kernel_size=(7, 7))  # noqa: E731
    extra = lambda: gluon_attn.na2d(q, k, v, kernel_size=(7, 7), additional_keys=ak, additional_values=av)  # noqa: E731
    yield f"na2d 64x64 window (7, 7) + 64 additional keys, B {B} H {H} D 64", extra, {"na2d without them": plain}
    # na3d's dilation groups: a launch per (x, y) group, and per batch where its x does not fold (--cpu-na: 4 and 18)
    for grid, dilation in (((16, 16, 16), (2, 2, 2)), ((18, 18, 18), (3, 3, 3))):
        q3, k3, v3 = (_rand(2, *grid, 8, 64) for _ in range(3))
        ours = lambda q3=q3, k3=k3, v3=v3, d=dilation: gluon_attn.na3d(q3, k3, v3, kernel_size=(5, 5, 5),  # noqa: E731
                                                                       dilation=d)
        peer = _flex_peer(q3, k3, v3, neighborhood(grid, (5, 5, 5), 1, dilation, False))
        yield (f"na3d {'x'.join(map(str, grid))} window (5, 5, 5) dilation {dilation}, B 2 H 8 D 64", ours,
               {"flex": peer})


def main(argv):
    profile = "--profile" in argv
    print("| call | ours host us | ours eager us | peer | peer host us | peer eager us | ours / peer host |")
    print("|---|---|---|---|---|---|---|")
    profiles = []
    for cases in (dense_cases, decode_cases, varlen_cases, grad_cases, na_cases, na_pattern_cases):
        try:
            for label, ours, peers in cases():
                for fn in (ours, *peers.values()):
                    for _ in range(3):
                        fn()
                times = host_times_turns({"ours": ours, **peers}, batches=BATCHES)
                mine = times["ours"]
                row = [label, f"{mine['host_us']:.1f}", f"{mine['eager_us']:.1f}"]
                if not peers:
                    print("| " + " | ".join(row + ["", "", "", ""]) + " |")
                for name in peers:
                    theirs = times[name]
                    print("| " + " | ".join(row + [name, f"{theirs['host_us']:.1f}", f"{theirs['eager_us']:.1f}",
                                                   f"{mine['host_us'] / theirs['host_us']:.2f}"]) + " |", flush=True)
                if profile:
                    # (the backward runs on autograd's device thread, which cProfile does not see: on this one)
                    torch.autograd.set_multithreading_enabled(False)
                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(100):
                        ours()
                    pr.disable()
                    torch.autograd.set_multithreading_enabled(True)
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    stats = pstats.Stats(pr, stream=s)
                    stats.sort_stats("tottime").print_stats(22)
                    stats.sort_stats("cumulative").print_stats(22)
                    profiles.append(f"### {label}\n```\n{s.getvalue()}\n```")
        except Exception as exc:  # noqa: BLE001 - one family's failure is its line
            print(f"| {cases.__name__}: {type(exc).__name__}: {str(exc)[:200]} |", flush=True)
    for p in profiles:
        print(p)


if __name__ == "__main__":
    main(sys.argv)
