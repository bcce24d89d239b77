"""The multi-GPU run's figures from its folder (experiments/gpu_run.sh multi): the sweep's wall time on N GPUs
against one (wall.txt), each worker's span from its first row to its last, whether gluon's ratios to each peer
agree with the one-GPU run within the rounds' spread, and ring attention's per-GPU TFLOPS against the single-GPU
kernel (cp<N>-rows.csv).

    python experiments/multi_gpu_report.py results/h200x4-run-201-multi-gpu
"""
import re
import sys
from pathlib import Path

import pandas as pd

KEY = ["N_CTX", "HEAD_DIM", "causal", "dtype"]


def ratios(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    ok = rows[rows.status == "ok"]
    tflops = ok.pivot_table(index=KEY, columns="provider", values="tflops")
    spread = ok.pivot_table(index=KEY, columns="provider", values="round_spread")
    peers = [p for p in tflops.columns if p != "gluon"]
    return (pd.DataFrame({p: tflops.gluon / tflops[p] for p in peers}),
            pd.DataFrame({p: spread.gluon + spread[p] for p in peers}))


def main(folder: Path) -> None:
    # A run stopped inside a call's limit and resumed by the next (gpu_run.sh MULTI_TIMEOUT, MULTI_RESUME) has a line
    # per part: its wall time is their sum (the resumed part's start-up counted, which a single run would not pay).
    walls, parts = {}, {}
    for key, s in re.findall(r"(gpus=\d+|cp=\d+) wall_s=(\d+)", (folder / "wall.txt").read_text()):
        walls[key] = walls.get(key, 0) + int(s)
        parts[key] = parts.get(key, 0) + 1
    one = float(walls["gpus=1"])
    base, base_spread = ratios(pd.read_csv(folder / "rows-gpus1.csv"))
    print("| GPUs | wall s | / one GPU | workers' spans s (first row to last) | ratios to peers within the spread "
          "(N >= 2048) |")
    print("|---|---|---|---|---|")
    for path in sorted(folder.glob("rows-gpus*.csv"), key=lambda p: int(p.stem[9:])):
        n = int(path.stem[9:])
        rows = pd.read_csv(path)
        t = pd.to_datetime(rows.timestamp)
        spans = (t.groupby(rows.gpu_index).max() - t.groupby(rows.gpu_index).min()).dt.total_seconds()
        r, spread = ratios(rows)
        change = (r / base - 1).abs()
        long = change.index.get_level_values("N_CTX") >= 2048
        measured = change[long].notna().values
        within = (change <= spread + base_spread)[long].values[measured]
        agree = "" if n == 1 else f"{within.sum()} of {measured.sum()} (largest change {change[long].max().max():.3f})"
        in_parts = f" ({parts[f'gpus={n}']} parts)" if parts[f"gpus={n}"] > 1 else ""
        print(f"| {n} | {walls[f'gpus={n}']}{in_parts} | {float(walls[f'gpus={n}']) / one:.3f} | "
              f"{', '.join(f'{s:.0f}' for s in spans)} | {agree} |")
    for path in sorted(folder.glob("cp*-rows.csv")):
        rows = pd.read_csv(path)
        print(f"\n{path.name}: ring attention (wall {walls.get('cp=' + path.stem[2:-5], '?')} s)\n")
        print("| N_CTX | pass | TFLOPS per GPU | vs single GPU at N_CTX / ranks | status | rel. L2 vs single GPU |")
        print("|---|---|---|---|---|---|")
        for _, row in rows.iterrows():
            print(f"| {row.N_CTX} | {row['pass']} | {row.tflops:.1f} | {row.vs_single_gpu:.3f} | {row.status} | "
                  f"{row.rel_l2_err:.1e} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
