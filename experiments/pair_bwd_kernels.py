"""Where the 192/128 pair's backward spends its time, per kernel (the main kernel, the preprocess, the accumulator's
zeroing, dQ's cast), with dQ staged transposed or in fragment order (DQ_FRAG): torch.profiler over ten calls of
``hopper_attention_bwd`` in each config (the launch path a given config takes), causal and not, Z 4, H 32; and dQ's
largest difference between the two stagings. Runs 251-252 (NOTES v113).

Usage (GPU): PYTHONPATH=. python3 experiments/pair_bwd_kernels.py [N_CTX, default 8192]
"""
import collections
import dataclasses
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from gluon_attn import api
from gluon_attn.kernels import hopper_bwd_host as hb

Z, H, N = 4, 32, int(sys.argv[1]) if len(sys.argv) > 1 else 8192
torch.manual_seed(0)
q = torch.randn(Z, H, N, 192, device="cuda", dtype=torch.float16)
k = torch.randn(Z, H, N, 192, device="cuda", dtype=torch.float16)
v = torch.randn(Z, H, N, 128, device="cuda", dtype=torch.float16)
do = torch.randn(Z, H, N, 128, device="cuda", dtype=torch.float16)
for causal in (False, True):
    o, lse = api.forward(q, k, v, causal=causal, return_lse=True)
    base = hb.default_config(192, "fp16", causal, N, 128)
    ref = None
    for frag in (False, True):
        cfg = dataclasses.replace(base, DQ_FRAG=frag)
        for _ in range(3):
            dq, dk, dv = hb.hopper_attention_bwd(do, q, k, v, o, lse, causal=causal, config=cfg)
        torch.cuda.synchronize()
        if ref is None:
            ref = dq.float()
        else:
            print("max |dq - dq(transposed)|", (dq.float() - ref).abs().max().item())
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                hb.hopper_attention_bwd(do, q, k, v, o, lse, causal=causal, config=cfg)
            torch.cuda.synchronize()
        times = collections.defaultdict(float)
        counts = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                counts[e.name[:60]] += 1
        print(f"causal={causal} {cfg.label()}:")
        for name, t in sorted(times.items(), key=lambda x: -x[1]):
            print(f"   {t / 10:10.1f} us/call  x{counts[name] // 10}  {name}")
