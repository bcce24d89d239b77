"""Backward probe: the sm_90a backward's time next to SDPA's cuDNN and flash backends on a few shapes
(TFLOPS with FA's convention: backward = 2.5x the forward's FLOPs). A quick look before a sweep."""
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from gluon_attn import api

Z, H = 4, 16
for D, causal, N in [(128, False, 4096), (128, True, 4096), (64, False, 4096), (64, True, 4096), (128, True, 8192)]:
    q, k, v = (torch.randn(Z, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = api.forward(q, k, v, causal=causal, return_lse=True)
    flops = 2.5 * 4 * Z * H * N * N * D / (2 if causal else 1)
    ms = triton.testing.do_bench(lambda: api.backward(do, q, k, v, o, lse, causal=causal), warmup=50, rep=300)
    row = [f"D={D} causal={causal} N={N}: gluon {flops / ms / 1e9:.0f}"]
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        try:
            with sdpa_kernel(be):
                out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                ms2 = triton.testing.do_bench(lambda: out.backward(do, retain_graph=True), warmup=50, rep=300,
                                              grad_to_none=[qq, kk, vv])
            row.append(f"{name} {flops / ms2 / 1e9:.0f}")
        except Exception as e:  # noqa: BLE001
            row.append(f"{name} failed ({type(e).__name__})")
    print(", ".join(row), flush=True)
    del q, k, v, do, o, lse
sys.exit(0)
