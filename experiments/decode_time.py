"""GPU and host time per decode call (a few queries against a long cache), today's package against a copy
(``before_after.py --make NAME=REV``), with the ordinary launch (no split: ``config=`` the default) beside them.

GPU time: CALLS back-to-back calls queued behind a sleep kernel long enough that the host never holds the GPU up,
timed by CUDA events; host time: ``decode_host.host_us`` (batches of 20 calls from an idle GPU, median).

Usage (GPU): PYTHONPATH=.:.before python3 experiments/decode_time.py --copy dec0 [--cases 16:8192:causal,...]
"""
import argparse
import importlib

import torch

from decode_host import gpu_us, host_us  # (this folder is the script's first path entry)

CALLS = 100
SLEEP_CYCLES = 300_000_000  # ~0.15-0.2 s of spinning: 100 calls of ~0.25 ms host work each are queued before it ends


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copy", required=True, help="the copy's name (package gluon_attn_NAME on the path)")
    ap.add_argument("--cases", default="16:8192:causal,16:16384:causal,16:32768:causal,16:8192:full,1:8192:full",
                    help="N_Q:N_KV:causal|full, comma-separated (Z=8, H=32, H_KV=8, D=128, fp16)")
    args = ap.parse_args()

    from gluon_attn.kernels.backend import backend_for_capability
    from gluon_attn.problem import Problem, make_inputs

    backend = backend_for_capability(*torch.cuda.get_device_capability())
    print(f"{'case':22s} {'package':24s} {'GPU us':>8s} {'host us':>8s}")
    for case in args.cases.split(","):
        n_q, n_kv, mask = case.split(":")
        causal = mask == "causal"
        p = Problem(8, 32, int(n_q), 128, causal, "fp16", H_KV=8, N_KV=int(n_kv))
        inp = make_inputs(p, "cuda")
        config = backend.default_config(128, "fp16", causal, int(n_kv))
        for name in ("gluon_attn", f"gluon_attn_{args.copy}", "ordinary"):
            pkg = importlib.import_module("gluon_attn" if name == "ordinary" else name)
            kw = {"config": config} if name == "ordinary" else {}

            def call():
                return pkg.attention(inp.q, inp.k, inp.v, causal=causal, **kw)

            print(f"{case:22s} {name:24s} {gpu_us(call, CALLS, SLEEP_CYCLES):8.1f} {host_us(call):8.1f}", flush=True)


if __name__ == "__main__":
    main()
