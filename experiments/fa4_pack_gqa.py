"""Where FA4's GQA forward gains: FA4 with its query heads packed into the rows of a tile (``pack_gqa``, its default
for GQA) and without, beside gluon, on GQA 32/8 and on MHA 32/32 (D=128 fp16, causal and not), one harness
(``time_rounds``: turning order, warm-up per turn). Each output is checked against gluon's before timing.

Usage (peers on the path): PYTHONPATH=.:/tmp/peers:... python3 experiments/fa4_pack_gqa.py --out DIR
"""
import argparse
import json
from pathlib import Path

import torch

from gluon_attn.api import attention
from gluon_attn.bench.timing import time_rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", default="16384,32768")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=float, default=1000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from flash_attn.cute import flash_attn_func

    rows = []
    for n in map(int, args.n_ctx.split(",")):
        for h_kv in (8, 32):
            for causal in (False, True):
                torch.manual_seed(0)
                q = torch.randn(4, n, 32, 128, device="cuda", dtype=torch.float16)  # FA's [Z, N, H, D]
                k = torch.randn(4, n, h_kv, 128, device="cuda", dtype=torch.float16)
                v = torch.randn_like(k)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # gluon's [Z, H, N, D] views
                fns = {"gluon": lambda: attention(qt, kt, vt, causal=causal),
                       "fa4": lambda: flash_attn_func(q, k, v, causal=causal, pack_gqa=True)[0]}
                if h_kv != 32:
                    fns["fa4-unpacked"] = lambda: flash_attn_func(q, k, v, causal=causal, pack_gqa=False)[0]
                ref = fns["gluon"]().float()
                for key in fns:
                    got = fns[key]()
                    got = (got if key == "gluon" else got.transpose(1, 2)).float()
                    assert (got - ref).abs().max().item() < 2e-2, key
                timed, failed = time_rounds(fns, rounds=args.rounds, warmup_ms=args.warmup_ms)
                flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
                row = {"N": n, "H_KV": h_kv, "causal": causal,
                       **{k: round(flops / (t.median() * 1e-3) / 1e12, 1) for k, t in timed.items()},
                       **{f"{k} failed": str(e) for k, e in failed.items()}}
                print(row, flush=True)
                rows.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fa4-pack-gqa.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
