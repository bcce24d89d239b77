"""One cell class over many seed sweeps: gluon's ratio to cuDNN fp16 in each run, with the config that
ran, and the median over the runs that ran the same config (a larger sample than a final three).

Usage: python3 experiments/cell_history.py --head-dim 128 --dtype fp16 [--causal] results/<run>/sweep ... > history.md
"""
import argparse

import pandas as pd

from median_table import ratios


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--n-ctx", default="4096,8192,16384,32768")
    args = ap.parse_args()
    ns = [int(n) for n in args.n_ctx.split(",")]
    rows = []
    for folder in args.folders:
        sweep = pd.read_csv(f"{folder}/rows.csv")
        r = ratios(folder)
        for n in ns:
            key = (n, args.head_dim, args.causal, args.dtype)
            if key not in r.index:
                continue
            cfg = sweep[(sweep.provider == "gluon") & (sweep.N_CTX == n) & (sweep.HEAD_DIM == args.head_dim)
                        & (sweep.causal == args.causal) & (sweep.dtype == args.dtype)].config.iloc[0]
            rows.append(dict(run=folder, N_CTX=n, ratio=r.loc[key], config=cfg))
    df = pd.DataFrame(rows)
    print(f"gluon {args.dtype} D={args.head_dim} {'causal' if args.causal else 'non-causal'} / cuDNN fp16, "
          "each ratio within its run\n")
    print("```\n" + df.pivot(index="run", columns="N_CTX", values="ratio").round(3).to_string() + "\n```")
    stats = df.groupby(["N_CTX", "config"]).ratio.agg(["median", "min", "max", "count"]).round(4)
    print("\nBy config (runs that ran it):\n")
    print("```\n" + stats.to_string() + "\n```")


if __name__ == "__main__":
    main()
