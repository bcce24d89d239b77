import torch, triton, gluon_attn
B, L, H, D = 1, 32768, 1, 128
q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
dense = lambda: gluon_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
t_dense = triton.testing.do_bench(dense, warmup=200, rep=500)
print(f"dense {t_dense:.3f} ms")
for K, S in [(2048, 1), (2048, 256), (2048, 2048)]:
    f = lambda: gluon_attn.na1d(q, k, v, K, stride=S)
    t = triton.testing.do_bench(f, warmup=200, rep=500)
    print(f"na1d K={K} S={S}: {t:.3f} ms, {t_dense / t:.2f}x dense", flush=True)
