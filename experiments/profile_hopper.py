"""Where a call's time goes: host overhead of gluon_attn.attention (cProfile over back-to-back calls)
against the kernel's own GPU time, for small problems where the host can dominate.

Usage (GPU): PYTHONPATH=. python3 experiments/profile_hopper.py
             PYTHONPATH=. python3 experiments/profile_hopper.py --decode   (decode steps: the packed, split path)
             ... --decode --split-always   (the split even where the plan keeps the ordinary launch)
             ... --na   (na1d at NATTEN's 1-D case: 32768 tokens, window 2048, strides 1, 256, 2048; and dense)
"""
import cProfile
import io
import pstats
import time

import torch

from gluon_attn import decode
from gluon_attn.api import attention
from gluon_attn.problem import Problem, make_inputs


BATCH = 20  # calls per timed batch (see main)


def ncu_target():
    """Two launches per class at N_CTX=8192 D=128 (fp16 and fp8 non-causal, fp8 causal), each class's
    tuned config, for Nsight Compute (the second launch of each is the one to read)."""
    for dtype, causal in (("fp16", False), ("fp8e4m3", False), ("fp8e4m3", True)):
        p = Problem(4, 32, 8192, 128, causal, dtype)
        inp = make_inputs(p, "cuda")
        fp8 = dict(descale_q=inp.descale_q, descale_k=inp.descale_k, descale_v=inp.descale_v) if p.is_fp8 else {}
        for _ in range(2):
            attention(inp.q, inp.k, inp.v, causal=causal, **fp8)
        torch.cuda.synchronize()


def _problems(decode_steps: bool):
    if decode_steps:
        # GQA 32/8, D=128, batch 8 (experiments/decode.toml): 1 or 16 queries against 8192 to 32768 keys
        return [Problem(8, 32, n_q, 128, causal, "fp16", H_KV=8, N_KV=n_kv) for n_kv in (8192, 16384, 32768)
                for n_q in (1, 16) for causal in (False, True)]
    return [Problem(4, 32, 1024, 64, causal, dtype) for dtype, causal in
            (("fp16", False), ("fp16", True), ("fp8e4m3", False))]


def _na_calls():
    """(label, call) of na1d on NATTEN's 1-D case (bf16, B = H = 1, D = 128) and of dense attention over its tokens."""
    import gluon_attn
    q, k, v = (torch.randn(1, 32768, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    yield "dense 32768 bf16 D=128", lambda: attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    for stride in (1, 256, 2048):
        yield f"na1d 32768 window 2048 stride {stride}", lambda s=stride: gluon_attn.na1d(q, k, v, 2048, stride=s)


def _calls(argv):
    if "--na" in argv:
        yield from _na_calls()
        return
    for p in _problems("--decode" in argv):
        inp = make_inputs(p, "cuda")
        fp8 = dict(descale_q=inp.descale_q, descale_k=inp.descale_k, descale_v=inp.descale_v) if p.is_fp8 else {}
        yield p.label(), lambda inp=inp, p=p, fp8=fp8: attention(inp.q, inp.k, inp.v, causal=p.causal, **fp8)


def main():
    import sys
    if "--ncu-target" in sys.argv:
        return ncu_target()
    if "--split-always" in sys.argv:
        # The split decode wherever it applies, its host work left out of the plan's costs: to measure it
        # against the ordinary launch where the plan would not take it.
        decode.ORDINARY_HOST_BLOCKS = decode.SPLIT_HOST_BLOCKS = decode.TAIL_HOST_BLOCKS = 0
        decode.clear_plans()
    for label, fn in _calls(sys.argv):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        # Host time: batches short enough that the GPU's launch queue never fills (a split decode call launches
        # ~5 kernels; a full queue would make the host wait for the GPU and read as host time), timed from the
        # first call's issue to the last's, the GPU idle at each batch's start.
        host_s, n = 0.0, 0
        for _ in range(15):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(BATCH):
                fn()
            host_s += time.perf_counter() - t0
            n += BATCH
        host = host_s / n * 1e6
        torch.cuda.synchronize()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            fn()
        end.record()
        end.synchronize()
        events = start.elapsed_time(end) / 50 * 1e3
        # The GPU's own time: the call captured in a CUDA graph and replayed (no host work between launches).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        end.synchronize()
        print(f"{label}: host {host:.1f} us/call, back-to-back wall {wall:.1f} us/call, "
              f"events over 50 calls {events:.1f} us/call, graph replay (GPU) {start.elapsed_time(end) / 50 * 1e3:.1f}"
              f" us/call")
        prof = cProfile.Profile()
        for _ in range(10):
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(BATCH):
                fn()
            prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        print("\n".join(s.getvalue().splitlines()[:30]))


if __name__ == "__main__":
    main()
