"""Same-call A/B of the kernels under two Triton versions: the package as it was under the old pin (a copy of its
tree, run with the image's Triton) against today's (run with the carried one). Two Tritons cannot share a process,
so ``experiments/gpu_run.sh triton-ab`` alternates whole sweeps, old then new, AB_ROUNDS times on one GPU, each a
sweep of the gluon provider and cuDNN (SDPA) over the same specs; this script reads those sweeps and writes
``ab.csv`` (one row per cell and round) and ``ab.md``: per cell the median over rounds of new / old gluon TFLOPS,
raw and normalised by the cuDNN of the same sweep (which cancels what the GPU's clock did between the sweeps),
and per class (dtype, head dim, causal, K/V heads, pass) the median of the cells.

Usage: python3 experiments/triton_ab.py DIR   (DIR holds old-r1/, new-r1/, old-r2/, ... each a sweep's --out)
"""
import re
import sys
from pathlib import Path

import pandas as pd

CELL = ["pass", "dtype", "HEAD_DIM", "causal", "H_KV", "N_CTX"]
CLASS = ["pass", "dtype", "HEAD_DIM", "causal", "H_KV"]


def load(run_dir: Path) -> pd.DataFrame:
    rows = pd.read_csv(run_dir / "rows.csv")
    rows = rows[rows["status"] == "ok"].copy()
    for col, default in (("pass", "fwd"), ("H_KV", None)):
        if col not in rows:
            rows[col] = default
    rows["H_KV"] = rows["H_KV"].fillna(rows["H"])
    wide = rows.pivot_table(index=CELL, columns="provider", values="tflops", aggfunc="first")
    return wide


def compare(root: Path) -> pd.DataFrame:
    out = []
    for old_dir in sorted(root.glob("old-r*")):
        rnd = re.sub(r"\D", "", old_dir.name)
        new_dir = root / f"new-r{rnd}"
        if not (old_dir / "rows.csv").exists() or not (new_dir / "rows.csv").exists():
            continue
        old, new = load(old_dir), load(new_dir)
        both = old.join(new, lsuffix="_old", rsuffix="_new", how="inner")
        ratio = both["gluon_new"] / both["gluon_old"]
        norm = (both["gluon_new"] / both["cudnn_new"]) / (both["gluon_old"] / both["cudnn_old"]) \
            if "cudnn_old" in both and "cudnn_new" in both else ratio * float("nan")
        out.append(pd.DataFrame({"round": int(rnd), "gluon_old": both["gluon_old"], "gluon_new": both["gluon_new"],
                                 "new_over_old": ratio, "new_over_old_vs_cudnn": norm}).reset_index())
    if not out:
        raise SystemExit(f"no old-rN/new-rN sweep pairs with rows.csv under {root}")
    return pd.concat(out, ignore_index=True)


def report(ab: pd.DataFrame) -> str:
    cells = ab.groupby(CELL)[["gluon_old", "gluon_new", "new_over_old", "new_over_old_vs_cudnn"]].median()
    classes = cells.groupby(CLASS)[["new_over_old", "new_over_old_vs_cudnn"]].median()
    classes["cells"] = cells.groupby(CLASS).size()
    classes["min cell"] = cells.groupby(CLASS)["new_over_old"].min()
    lines = ["# gluon under the new Triton / under the old, same call", "",
             f"Rounds: {ab['round'].nunique()} (old and new sweeps alternating); per cell the median over rounds, "
             "per class the median of its cells. `vs cudnn`: each sweep's gluon over its own cuDNN (SDPA), new / old.",
             "", "## Per class", "", classes.round(3).to_markdown(), "", "## Per cell", "",
             cells.round(3).to_markdown(), ""]
    return "\n".join(lines)


def main(argv):
    root = Path(argv[0])
    ab = compare(root)
    ab.to_csv(root / "ab.csv", index=False)
    text = report(ab)
    (root / "ab.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
