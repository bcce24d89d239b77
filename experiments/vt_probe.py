"""Time the fp8 V^T pass (v_transpose.py) alone: block sizes and warps, in GB/s moved (read + write).

It runs inside every fp8 attention call; at N_CTX=8192 causal its bytes are a few percent of the call.
Usage (GPU): PYTHONPATH=. python3 experiments/vt_probe.py > vt.md
"""
import torch

from gluon_attn.bench.timing import benchmark
from gluon_attn.kernels import v_transpose as vt
from gluon_attn.kernels.launch import tma_ready


def run(v, block, warps):
    Z, H, N, D = v.shape
    n_pad = -(-N // 16) * 16
    n_blocks = -(-n_pad // block)
    out = torch.empty((Z, H, D, n_pad), dtype=v.dtype, device=v.device)
    sv, st = v.stride(), out.stride()

    def fn():
        vt._v_transpose_kernel[(n_blocks * Z * H,)](v, out, N, n_pad // 16, H, n_blocks, sv[0], sv[1], sv[2], st[0],
                                                    st[1], st[2], D=D, BLOCK=block, num_warps=warps)
    fn()
    ref = vt.fp8_vt_reference(v)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    return benchmark(fn, rep_ms=100).p50_ms


def main():
    print("| N | D | BLOCK | warps | ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for n, d in ((8192, 128), (8192, 64), (32768, 128)):
        v = tma_ready(torch.randn(4, 32, n, d, device="cuda").to(torch.float8_e4m3fn))
        nbytes = 2 * v.numel()
        for block in (64, 128, 256):
            for warps in (2, 4, 8):
                ms = run(v, block, warps)
                print(f"| {n} | {d} | {block} | {warps} | {ms:.4f} | {nbytes / ms / 1e6:.0f} |", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                vt.fp8_vt(v)
        torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=4))
        del v


if __name__ == "__main__":
    main()
