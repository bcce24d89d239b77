"""Ablation of the sm_90a kernel's overlap techniques and pipeline depth, with cuDNN in the same run.

Usage (GPU): PYTHONPATH=. python3 experiments/hopper_variants.py --out DIR
Writes variants.csv and variants.md: TFLOPS per (problem, config), ratio to cuDNN fp16 of the same shape.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import pandas as pd
import torch

from gluon_attn.api import attention
from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.timing import benchmark
from gluon_attn.kernels.hopper import HopperConfig
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import check_accuracy
from gluon_attn.bench.sweep import GateReference

BASE = HopperConfig(PINGPONG=False, OVERLAP=False)
VARIANTS = {
    "plain (no overlap, no ping-pong)": dict(PINGPONG=False, OVERLAP=False),
    "+ intra-WG overlap": dict(PINGPONG=False, OVERLAP=True),
    "+ overlap + ping-pong": dict(PINGPONG=True, OVERLAP=True),
}
STAGES = {64: (2, 4), 128: (2,)}
FP8_STAGES = {64: (2, 4), 128: (2, 3, 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--rep-ms", type=float, default=100)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype, d, causal in [("fp16", 128, False), ("fp16", 128, True), ("fp16", 64, False), ("fp16", 64, True),
                             ("fp8e4m3", 128, False), ("fp8e4m3", 64, False)]:
        p = Problem(4, 32, args.n_ctx, d, causal, dtype)
        inputs = make_inputs(p, "cuda")
        gate = GateReference.compute(inputs)
        base16 = make_inputs(Problem(4, 32, args.n_ctx, d, causal, "fp16"), "cuda") if p.is_fp8 else inputs
        cudnn = get_provider("cudnn")
        with cudnn.context():
            t = benchmark(cudnn.prepare(base16), rep_ms=args.rep_ms)
        cudnn_tf = p.tflops(t.p50_ms)
        rows.append(dict(dtype=dtype, D=d, causal=causal, variant="cuDNN fp16", config="", tflops=cudnn_tf,
                         ratio=1.0, status="ok"))
        fp8 = dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) \
            if p.is_fp8 else {}
        stages = (FP8_STAGES if p.is_fp8 else STAGES)[d]
        for (vname, knobs), st in [(v, s) for v in VARIANTS.items() for s in stages]:
            cfg = dataclasses.replace(BASE, KV_STAGES=st, **knobs)
            if cfg.invalid_reasons(d, dtype):
                continue
            fn = lambda: attention(inputs.q, inputs.k, inputs.v, causal=causal, config=cfg, **fp8)  # noqa: E731
            try:
                acc = check_accuracy(gate.select(fn()), gate.out, dtype)
                if not acc.ok:
                    rows.append(dict(dtype=dtype, D=d, causal=causal, variant=vname, config=cfg.label(),
                                     status="wrong: " + acc.message))
                    continue
                t = benchmark(fn, rep_ms=args.rep_ms)
            except Exception as exc:  # record and go on
                rows.append(dict(dtype=dtype, D=d, causal=causal, variant=vname, config=cfg.label(),
                                 status=f"error: {type(exc).__name__}: {exc}"[:200]))
                continue
            tf = p.tflops(t.p50_ms)
            rows.append(dict(dtype=dtype, D=d, causal=causal, variant=vname, config=cfg.label(), tflops=tf,
                             ratio=tf / cudnn_tf, status="ok"))
            print(f"{dtype} D={d} causal={causal} {vname} {cfg.label()}: {tf:.1f} TFLOPS "
                  f"({tf / cudnn_tf:.3f}x cuDNN)", flush=True)
        del inputs, base16, gate
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    df.to_csv(out / "variants.csv", index=False)
    with open(out / "variants.md", "w") as f:
        f.write(f"Z=4 H=32 N_CTX={args.n_ctx}, {torch.cuda.get_device_name()}\n\n")
        try:
            f.write(df.to_markdown(index=False, floatfmt=".3f"))
        except ImportError:  # tabulate missing
            f.write(df.to_string(index=False))
        f.write("\n")
    print(df.to_string(), file=sys.stderr)


if __name__ == "__main__":
    main()
