"""Training check: a small randomly initialised Llama-style decoder (RMSNorm, rotary embeddings, GQA
attention, SwiGLU) trained on synthetic data from the same seed with gluon_attn.attention and with torch's
scaled_dot_product_attention; the loss curves should agree within noise. The noise: SDPA again from another
initialisation seed (same data), the spread any run-to-run change produces.

    PYTHONPATH=. python experiments/train_check.py --steps 300 --out results/<run>/train-check

Writes losses.csv (step, loss of each run), train-check.png (the curves and the differences) and
summary.json. The data: an order-2 Markov chain over the vocabulary (each pair of tokens has 4 equally
likely successors, entropy log 4), so the next token depends on the previous two, which the model reaches
through attention; the loss falls smoothly from log(vocab) towards log 4 (a copy task's sudden induction
step came at steps that any rounding moved, which says nothing about the kernel). bf16 autocast, AdamW.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def rotary(x, cos, sin):
    """Rotate pairs (first half, second half) of the head dim: x [B, H, N, D]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, attend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.attend = attend

    def forward(self, x, cos, sin):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        out = self.attend(q, k, v)  # [B, H, N, D], causal
        return self.o(out.transpose(1, 2).reshape(B, N, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, attend):
        super().__init__()
        self.n1, self.n2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, attend)
        hidden = 4 * dim * 2 // 3
        self.gate, self.up, self.down = (nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False),
                                         nn.Linear(hidden, dim, bias=False))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, max_len, attend):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, attend) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        d = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens):
        N = tokens.shape[1]
        cos, sin = self.cos[:N].to(torch.bfloat16), self.sin[:N].to(torch.bfloat16)
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


def gluon_attend(q, k, v):
    import gluon_attn
    return gluon_attn.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)


def sdpa_attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def batches(steps, batch, seq, vocab, seed, device):
    """Sequences of an order-2 Markov chain: token t is one of 4 successors of (t-2, t-1), drawn uniformly
    from a fixed random table; the same stream for every run (all steps drawn at once, on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, vocab, 4), generator=gen)
    seqs = torch.empty(steps * batch, seq, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, vocab, (steps * batch, 2), generator=gen)
    pick = torch.randint(0, 4, (steps * batch, seq), generator=gen)
    for t in range(2, seq):
        seqs[:, t] = table[seqs[:, t - 2], seqs[:, t - 1], pick[:, t]]
    return list(seqs.to(device).split(batch))


def train(attend, args, data, seed) -> list[float]:
    torch.manual_seed(seed)
    model = TinyLlama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.seq, attend).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step, tokens in enumerate(data):
        lr = args.lr * min(1.0, (step + 1) / 30)  # warm-up
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.item()))
    return losses


def plot(steps, runs: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, losses in runs.items():
        a.plot(steps, losses, label=name, lw=1)
    a.set_ylabel("training loss")
    a.set_yscale("log")
    a.legend()
    a.grid(True, alpha=0.3)
    a.set_title(title, fontsize=9)
    base = runs["sdpa"]
    for name, losses in runs.items():
        if name != "sdpa":
            b.plot(steps, [x - y for x, y in zip(losses, base)], lw=1, label=f"{name} - sdpa")
    b.axhline(0, color="grey", lw=0.8, ls="--")
    b.set_ylabel("loss difference")
    b.legend(fontsize=8)
    b.set_xlabel("step")
    b.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("train-check"))
    ap.add_argument("--gpu", default=None, help="(with --from-csv) the GPU the losses came from, for the title")
    ap.add_argument("--from-csv", action="store_true",
                    help="Redraw the plot and summary from --out's losses.csv (no GPU needed).")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_csv:
        with open(args.out / "losses.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        names = [k for k in rows[0] if k != "step"]
        runs = {k: [float(r[k]) for r in rows] for k in names}
        args.steps = len(rows)
        report(args, runs, args.gpu or "GPU not recorded", None)
        return
    data = batches(args.steps, args.batch, args.seq, args.vocab, args.seed + 1000, "cuda")
    runs, seconds = {}, {}
    for name, attend, seed in (("gluon", gluon_attend, args.seed), ("sdpa", sdpa_attend, args.seed),
                               ("sdpa, other init", sdpa_attend, args.seed + 1)):
        t0 = time.time()
        runs[name] = train(attend, args, data, seed)
        seconds[name] = time.time() - t0
        print(f"{name}: first loss {runs[name][0]:.3f}, last {runs[name][-1]:.4f} ({seconds[name]:.0f} s)", flush=True)
    with open(args.out / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *runs])
        w.writerows(zip(range(args.steps), *runs.values()))
    report(args, runs, torch.cuda.get_device_name(), seconds)


def report(args, runs: dict, gpu: str, seconds) -> None:
    """summary.json and train-check.png of the runs' losses."""
    g, s, n = runs["gluon"], runs["sdpa"], runs["sdpa, other init"]
    tail = max(1, args.steps // 10)

    def gap(a, b):
        d = [abs(x - y) for x, y in zip(a, b)]
        return {"max": max(d), "mean": sum(d) / len(d), "mean_last_10pct": sum(d[-tail:]) / tail}

    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "from_csv"},
        "head_dim": args.dim // args.heads, "gpu": gpu,
        "loss_first": {k: v[0] for k, v in runs.items()}, "loss_last": {k: v[-1] for k, v in runs.items()},
        "loss_mean_last_10pct": {k: sum(v[-tail:]) / tail for k, v in runs.items()},
        "gluon_vs_sdpa": gap(g, s), "noise_sdpa_vs_other_init": gap(n, s),
        "log_vocab": math.log(args.vocab), "entropy_floor": math.log(4), "seconds": seconds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = (f"TinyLlama {args.layers}x{args.dim}, {args.heads} heads / {args.kv_heads} KV (D={args.dim // args.heads}), "
             f"seq {args.seq}, batch {args.batch}, bf16 autocast\n{gpu}")
    plot(list(range(args.steps)), runs, args.out / "train-check.png", title)
    print(json.dumps({k: summary[k] for k in ("loss_mean_last_10pct", "gluon_vs_sdpa", "noise_sdpa_vs_other_init")}))


if __name__ == "__main__":
    main()
