"""Where a split decode call's host time goes: each stage of ``decode.run`` timed alone, in batches short enough
that the GPU's launch queue never fills (the host never waits for the GPU), median over batches.

Usage (GPU): PYTHONPATH=. python3 experiments/decode_host.py [N_KV ...]
"""
import statistics
import sys
import time

import torch

import gluon_attn
from gluon_attn import api, decode
from gluon_attn.kernels.backend import backend_for_capability
from gluon_attn.problem import Problem, make_inputs

BATCH, BATCHES = 20, 25


def gpu_us(fn, calls: int, sleep_cycles: int) -> float:
    """GPU time per call: ``calls`` back-to-back calls queued behind a sleep kernel of ``sleep_cycles`` (long enough
    that the host has queued them all before it ends, so it never holds the GPU up), timed by CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def host_us(fn) -> float:
    for _ in range(5):
        fn()
    per_batch = []
    for _ in range(BATCHES):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn()
        per_batch.append((time.perf_counter() - t0) / BATCH * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_batch)


def main():
    backend = backend_for_capability(*torch.cuda.get_device_capability())
    for n_kv in [int(a) for a in sys.argv[1:]] or [8192]:
        for n_q, causal in ((1, False), (16, True)):
            p = Problem(8, 32, n_q, 128, causal, "fp16", H_KV=8, N_KV=n_kv)
            inp = make_inputs(p, "cuda")
            q, k, v = inp.q, inp.k, inp.v
            plan = decode.plan(8, 32, 8, n_q, n_kv, causal, 128, torch.cuda.get_device_properties(0).multi_processor_count,
                               host=False)
            config = backend.default_config(128, "fp16", causal, n_kv)
            out = torch.empty_like(q)
            launch = lambda *a, **kw: backend.launch(*a, kernel_name=api.resolve_name(api.KERNEL_BASE_NAME, "auto"),  # noqa: E731
                                                     **kw)
            Z, H, N_Q, D = q.shape
            parts = plan.splits + bool(plan.tail)
            qp = torch.empty((plan.splits, 8 * 8, plan.rows, D), dtype=q.dtype, device=q.device)
            o_parts = torch.empty((parts, Z, H, N_Q, D), dtype=q.dtype, device=q.device)
            _, lse_c = launch(qp, decode._chunks(k, plan), decode._chunks(v, plan), causal=False, return_lse=True,
                              sm_scale=None, out=o_parts[:plan.splits].view(qp.shape))
            lse_t = launch(q, k[:, :, -plan.tail:], v[:, :, -plan.tail:], causal=causal, return_lse=True, sm_scale=None,
                           out=o_parts[plan.splits])[1] if plan.tail else None

            def q_copy():
                t = torch.empty((plan.splits, Z, 8, 4, N_Q, D), dtype=q.dtype, device=q.device)
                t.copy_(q.unflatten(1, (8, 4)).unsqueeze(0).expand(t.shape))

            stages = {
                "gluon_attn.attention (public)": lambda: gluon_attn.attention(q, k, v, causal=causal),
                "custom op (the plan's choice)": lambda: torch.ops.gluon_attn.attention(q, k, v, causal, None, None, None,
                                                                                      None, False, None, "auto"),
                "api.forward (ordinary)": lambda: api.forward(q, k, v, causal=causal, config=config),
                "backend.launch (ordinary)": lambda: launch(q, k, v, causal=causal, sm_scale=None),
                "decode.run (split plan)": lambda: decode.run(launch, q, k, v, plan, causal=causal, sm_scale=None,
                                                               return_lse=False, out=out),
                "  query copy": q_copy,
                "  chunks' launch": lambda: launch(qp, decode._chunks(k, plan), decode._chunks(v, plan), causal=False,
                                                   return_lse=True, sm_scale=None,
                                                   out=o_parts[:plan.splits].view(qp.shape)),
                "  combine": lambda: decode.combine(o_parts, lse_c, lse_t, out),
                "  torch.empty (one)": lambda: torch.empty((parts, Z, H, N_Q, D), dtype=q.dtype, device=q.device),
            }
            print(f"{p.label()} plan {plan}")
            for name, fn in stages.items():
                print(f"  {name:32s} {host_us(fn):7.1f} us")


if __name__ == "__main__":
    main()
