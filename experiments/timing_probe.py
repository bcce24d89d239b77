"""How much of a provider's timed median is host time, and how much the median moves between rounds.

For a few shapes, cuDNN fp16 and gluon (fp16, fp8) are timed three ways:
  * do_bench p50 (what the sweep reports), in interleaved rounds (A, B, A, B, ...; 3 by default);
  * CUDA-graph replay of 10 back-to-back calls (no host work inside the timed region), per call;
  * host dispatch per call: CPU time to enqueue 100 calls behind a long sleep kernel.
If the do_bench median exceeds the graph time by about the host dispatch, the sweep's figure for that
provider includes host time (do_bench records its start event before the call is issued).

Usage (GPU): PYTHONPATH=. python3 experiments/timing_probe.py [--shapes N:D:causal,...] [--rounds R] > probe.md
"""
import argparse
import statistics
import time

import torch

from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.timing import benchmark
from gluon_attn.problem import Problem, make_inputs

SHAPES = [(1024, 128, False), (4096, 128, False), (16384, 128, False), (4096, 64, False), (4096, 128, True)]


def graph_ms(fn, calls: int = 10, replays: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def host_us(fn, calls: int = 100) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keep the GPU busy so that enqueueing never waits on it
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(f"{n}:{d}:{int(c)}" for n, d, c in SHAPES),
                    help="N:D:causal (0/1), comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    shapes = [(int(n), int(d), c == "1") for n, d, c in (x.split(":") for x in args.shapes.split(","))]
    print("| N | D | causal | provider | do_bench p50 rounds (ms) | graph ms/call | host us/call | "
          "do_bench - graph (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, d, causal in shapes:
        fns = {}
        for dtype in ("fp16", "fp8e4m3"):
            p = Problem(4, 32, n, d, causal, dtype)
            inputs = make_inputs(p, "cuda")
            names = ["cudnn", "gluon"] if dtype == "fp16" else ["gluon"]
            for name in names:
                prov = get_provider(name)
                ctx = prov.context()
                ctx.__enter__()
                fns[f"{name} {dtype}"] = (prov.prepare(inputs), ctx)
        rounds = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, (fn, _) in fns.items():
                rounds[k].append(benchmark(fn, rep_ms=100).p50_ms)
        for k, (fn, ctx) in fns.items():
            g = graph_ms(fn)
            h = host_us(fn)
            med = statistics.median(rounds[k])
            print(f"| {n} | {d} | {causal} | {k} | {', '.join(f'{x:.4f}' for x in rounds[k])} | {g:.4f} | {h:.1f} | "
                  f"{(med - g) * 1e3:.1f} |", flush=True)
            ctx.__exit__(None, None, None)
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
