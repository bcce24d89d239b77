"""Are a cell's slow and fast timings two modes, and do they follow where the inputs lie in memory?

The sweep's fp16 D=128 non-causal cells at 4096 and 8192 keys read 1.04-1.08x between runs, and the
gluon times of one cell fall into two groups (p20 and p50 ~4% apart, the slower value repeating to
0.1% across runs). For each shape this allocates the inputs afresh several times (behind a pad of a
different size each time, moving their addresses), and times gluon and cuDNN on each allocation with
do_bench (L2 flushed before every repetition), printing every repetition's time in sorted groups.

Usage (GPU): PYTHONPATH=. python3 experiments/mode_probe.py [--shapes N:D:causal,...] [--trials T] > probe.md
"""
import argparse

import numpy as np
import torch
from triton.testing import do_bench

from gluon_attn.bench.providers import get_provider
from gluon_attn.problem import Problem, make_inputs


def summary(times):
    t = np.sort(np.asarray(times))
    q = np.quantile(t, [0.0, 0.2, 0.5, 0.8, 1.0])
    # a gap of more than 1.5% between neighbouring sorted times splits the reps into groups
    cuts = np.nonzero(t[1:] / t[:-1] > 1.015)[0]
    groups, lo = [], 0
    for c in list(cuts) + [len(t) - 1]:
        groups.append(f"{len(t[lo:c + 1])} x {np.median(t[lo:c + 1]):.4f}")
        lo = c + 1
    return " ".join(f"{v:.4f}" for v in q), "; ".join(groups)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096:128:0,8192:128:0")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--rep-ms", type=float, default=300)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| shape | trial | pad MB | provider | min p20 p50 p80 max (ms) | groups (count x median ms) |")
    print("|---|---|---|---|---|---|")
    for spec in args.shapes.split(","):
        n, d, causal = (int(x) for x in spec.split(":"))
        p = Problem(4, 32, n, d, bool(causal), "fp16")
        for trial in range(args.trials):
            pad_mb = int(rng.integers(0, 256))
            pad = torch.empty(pad_mb * 2**20 + 4096 * trial, dtype=torch.uint8, device="cuda")
            inputs = make_inputs(p, "cuda")
            for name in ("gluon", "cudnn"):
                provider = get_provider(name)
                with provider.context():
                    fn = provider.prepare(inputs)
                    fn()
                    times = do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="all")
                q, groups = summary(times)
                shape = f"N={n} D={d} causal={bool(causal)}"
                print(f"| {shape} | {trial} | {pad_mb} | {name} | {q} | {groups} |", flush=True)
            del inputs, pad
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
