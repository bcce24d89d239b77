import os, sys
import torch, triton.testing
from gluon_attn import api
from gluon_attn.kernels import hopper_bwd as hb
from gluon_attn.kernels import launch as L
Z, H, N = 4, 16, 4096
for D, causal in [(128, False), (128, True), (64, False)]:
    q, k, v = (torch.randn(Z, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = api.forward(q, k, v, causal=causal, return_lse=True)
    flops = 2.5 * 4 * Z * H * N * N * D / (2 if causal else 1)
    row = []
    for mode in (0, 1):
        for st in (2, 3):
            os.environ["GLUON_BWD_DQ_MODE"] = str(mode)
            cfg = hb.HopperBwdConfig(BLOCK_M=64 if D == 128 else 128, Q_STAGES=st)
            if cfg.invalid_reasons(D, "fp16"):
                continue
            ms = triton.testing.do_bench(lambda: api.backward(do, q, k, v, o, lse, causal=causal, config=cfg), warmup=50, rep=300)
            row.append(f"m{mode}s{st} {flops / ms / 1e9:.0f}")
    os.environ["GLUON_BWD_DQ_MODE"] = "0"
    ms = triton.testing.do_bench(lambda: hb.preprocess(o, do, lse), warmup=20, rep=100)
    ms2 = triton.testing.do_bench(lambda: torch.zeros((Z, H, D, N), dtype=torch.float32, device="cuda"), warmup=20, rep=100)
    print(f"D={D} causal={causal}: " + ", ".join(row) + f" | preprocess {ms*1e3:.0f} us, zeros {ms2*1e3:.0f} us", flush=True)
