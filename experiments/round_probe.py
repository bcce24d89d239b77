"""Why do gluon's timing rounds of one sweep cell differ (fp16 D=128 non-causal at 8192 keys: 5-11%
between the three rounds in every seed sweep, 1-3% at 16384)? Does the provider timed just before
set it?

For each shape, one allocation of the inputs, then timing rounds (do_bench, L2 flushed before every
repetition, as the sweep times) in several orders: gluon alone, cuDNN alone, and gluon after FA2 and
after cuDNN (the sweep's order is cuDNN, FA2, gluon). Every round's repetitions are kept in order with
the round's start and end (host clock); run nvidia-smi beside it to join clocks and power to rounds.

With --warmups (ms, a list) every order is run once per warm-up length: does a longer warm-up (the
provider alone on the GPU before its timed repetitions) take away what the previous provider leaves?

Usage (GPU): PYTHONPATH=. python3 experiments/round_probe.py --out DIR [--shapes 8192,16384] [--rounds 8]
             [--orders "sweep order,sweep order reversed"] [--warmups 25,250,1000]
Writes DIR/rounds.csv (one row per round) and prints a summary table.
"""
import argparse
import itertools
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from triton.testing import do_bench

from gluon_attn.bench.providers import get_provider
from gluon_attn.problem import Problem, make_inputs

ORDERS = {
    "gluon alone": ["gluon"],
    "cudnn alone": ["cudnn"],
    "gluon after fa2": ["fa2", "gluon"],
    "gluon after cudnn": ["cudnn", "gluon"],
    "sweep order": ["cudnn", "fa2", "gluon"],
    "sweep order reversed": ["gluon", "fa2", "cudnn"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="8192,16384")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmups", default="25", help="warm-up lengths in ms, comma-separated")
    ap.add_argument("--orders", default=",".join(ORDERS), help=f"comma-separated, from: {', '.join(ORDERS)}")
    ap.add_argument("--rep-ms", type=float, default=100)
    args = ap.parse_args()
    warmups = [float(w) for w in args.warmups.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in (int(s) for s in args.shapes.split(",")):
        problem = Problem(4, 32, n, 128, False, "fp16")
        inputs = make_inputs(problem, "cuda")
        fns = {}
        for name in ("gluon", "cudnn", "fa2"):
            provider = get_provider(name)
            with provider.context():
                fns[name] = (provider, provider.prepare(inputs))
                fns[name][1]()
        torch.cuda.synchronize()
        for warmup, order_name in itertools.product(warmups, args.orders.split(",")):
            order = ORDERS[order_name]
            for r in range(args.rounds):
                for name in order:
                    provider, fn = fns[name]
                    t0 = time.time()
                    with provider.context():
                        times = do_bench(fn, warmup=warmup, rep=args.rep_ms, return_mode="all")
                    t1 = time.time()
                    t = np.asarray(times)
                    half = len(t) // 2
                    rows.append(dict(N_CTX=n, warmup_ms=warmup, order=order_name, round=r, provider=name, start=t0, end=t1,
                                     reps=len(t), p50_ms=float(np.median(t)), min_ms=float(t.min()),
                                     max_ms=float(t.max()), first_half_ms=float(np.median(t[:half or 1])),
                                     second_half_ms=float(np.median(t[half:])), tflops=problem.tflops(float(np.median(t))),
                                     times=" ".join(f"{x:.4f}" for x in t)))
            pd.DataFrame(rows).to_csv(out / "rounds.csv", index=False)
        del inputs, fns
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    summary = df.groupby(["N_CTX", "warmup_ms", "order", "provider"], sort=False).agg(
        median_tflops=("tflops", "median"), min_tflops=("tflops", "min"), max_tflops=("tflops", "max"),
        first_half_ms=("first_half_ms", "median"), second_half_ms=("second_half_ms", "median"))
    summary["spread"] = (summary.max_tflops - summary.min_tflops) / summary.median_tflops
    print(summary.round(4).to_markdown())
    med = summary.median_tflops.unstack("provider")
    if {"gluon", "cudnn"} <= set(med.columns):
        print("\ngluon / cuDNN, medians over the rounds:\n")
        print((med.gluon / med.cudnn).dropna().round(3).to_frame("ratio").to_markdown())


if __name__ == "__main__":
    main()
