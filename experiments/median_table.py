"""Median (min-max) over several seed sweeps of gluon's ratio to cuDNN fp16, each ratio taken within
its own run.

Usage: python3 experiments/median_table.py results/<run-a>/sweep results/<run-b>/sweep ... > median.md
"""
import sys

import pandas as pd


def ratios(folder: str) -> pd.Series:
    rows = pd.read_csv(f"{folder}/rows.csv")
    ok = rows[rows.status == "ok"]
    keys = ["N_CTX", "HEAD_DIM", "causal"]
    cudnn = ok[(ok.provider == "cudnn") & (ok.dtype == "fp16")].set_index(keys).tflops
    gluon = ok[ok.provider == "gluon"].set_index(keys + ["dtype"]).tflops
    return gluon / cudnn.reindex(gluon.index.droplevel("dtype")).values


def main(folders):
    table = pd.concat({f: ratios(f) for f in folders}, axis=1)
    cols = [(d, c, t) for d in (64, 128) for c in (False, True) for t in ("fp16", "fp8e4m3")]
    head = [f"D={d}{' causal' if c else ''} {'fp8' if t.startswith('fp8') else t}" for d, c, t in cols]
    print(f"Ratio gluon / cuDNN fp16 of the same run; each cell: median of {len(folders)} runs (min-max).\n")
    print("| N_CTX | " + " | ".join(head) + " |")
    print("|---|" + "---|" * len(cols))
    for n in sorted(table.index.get_level_values("N_CTX").unique()):
        cells = []
        for d, c, t in cols:
            r = table.loc[(n, d, c, t)]
            cells.append(f"{r.median():.2f}x ({r.min():.2f}-{r.max():.2f})")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
