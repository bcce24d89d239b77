"""Nsight Compute target for the backward pass: one provider's backward call (as the sweep makes it: gluon,
gluon-det, fa4, cudnn, ...) on one problem, run twice; profile the second launch of the main kernel.

Usage (GPU; the peers' packages on PYTHONPATH for fa4):
  ncu --kernel-name regex:'gluon_attention_bwd|BackwardSm90' --launch-skip 1 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \\
      -o OUT/gluon python3 experiments/profile_backward.py --provider gluon --n-ctx 8192 --head-dim 128
  ncu --import OUT/gluon.ncu-rep --page source --print-source sass --csv > OUT/gluon-sass.csv
  python3 experiments/profile_backward.py --stalls OUT/gluon-sass.csv     # stall reasons by code region
"""
import argparse
import re

import pandas as pd


def run_target(args):
    import torch

    from gluon_attn.bench.providers import get_provider
    from gluon_attn.problem import Problem, make_inputs

    p = Problem(args.batch, args.heads, args.n_ctx, args.head_dim, args.causal, args.dtype, pass_name="bwd")
    call = get_provider(args.provider).prepare(make_inputs(p, "cuda"))
    for _ in range(2):
        call()
    torch.cuda.synchronize()


def stall_summary(path: str, top: int = 12) -> str:
    """Warp-state samples of an ``ncu --page source --print-source sass --csv`` export: the stall reasons
    summed over the whole kernel, then the instructions that collect the most samples."""
    df = pd.read_csv(path, skiprows=1)  # (the first line names the kernel)
    samples = [c for c in df.columns if (c.startswith("stall_") and "Not Issued" not in c) or c.startswith("Warp Stall")]
    if not samples:
        return f"no warp-stall sample columns in {path}: {list(df.columns)[:20]}"
    for c in samples:
        df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0)
    total = next((c for c in samples if "All" in c and "Not" not in c), samples[0])
    lines = [f"{path}: {int(df[total].sum())} samples ({total})"]
    reasons = [c for c in samples if c != total]
    sums = df[reasons].sum().sort_values(ascending=False)
    lines += [f"  {c}: {v / max(df[total].sum(), 1):.1%}" for c, v in sums.items() if v > 0][:top]
    source = next(c for c in df.columns if c.lower() in ("source", "sass"))
    lines.append("instructions with the most samples:")
    for _, r in df.sort_values(total, ascending=False).head(top).iterrows():
        text = re.sub(r"\s+", " ", str(r[source]))[:100]
        lines.append(f"  {int(r[total]):6d}  {text}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="gluon")
    ap.add_argument("--batch", "-Z", type=int, default=4)
    ap.add_argument("--heads", "-H", type=int, default=32)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--stalls", metavar="CSV", help="summarise an ncu source-page export instead of running")
    args = ap.parse_args()
    if args.stalls:
        print(stall_summary(args.stalls))
    else:
        run_target(args)


if __name__ == "__main__":
    main()
