"""Nsight Compute target for the backward pass (or, with --pass fwd, the forward): one provider's call (as the
sweep makes it: gluon, gluon-det, fa4, cudnn, ...) on one problem, run twice; profile the second launch of the
main kernel (the forward's: --kernel-name regex:'gluon_attention$|ForwardSm90').

Usage (GPU; the peers' packages on PYTHONPATH for fa4):
  ncu --kernel-name regex:'gluon_attention_bwd|BackwardSm90' --launch-skip 1 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \\
      -o OUT/gluon python3 experiments/profile_backward.py --provider gluon --n-ctx 8192 --head-dim 128
  ncu --import OUT/gluon.ncu-rep --page source --print-source sass --csv > OUT/gluon-sass.csv
  python3 experiments/profile_backward.py --stalls OUT/gluon-sass.csv     # stall reasons, top instructions
  python3 experiments/profile_backward.py --phases OUT/gluon-sass.csv 0x3c80 0x5900   # one loop by phase
  python3 experiments/profile_backward.py --loops OUT/gluon-sass.csv --cycles 14.15e6 --iters-per-warp 4034
"""
import argparse
import re

import pandas as pd


def run_target(args):
    import torch

    from gluon_attn.bench.providers import get_provider
    from gluon_attn.problem import Problem, make_inputs

    p = Problem(args.batch, args.heads, args.n_ctx, args.head_dim, args.causal, args.dtype, HEAD_DIM_V=args.head_dim_v,
                H_KV=args.h_kv, varlen=args.varlen, pass_name=args.pass_name)
    call = get_provider(args.provider).prepare(make_inputs(p, "cuda"))
    for _ in range(2):
        call()
    torch.cuda.synchronize()


TOTAL = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"


def read_source_page(path: str) -> tuple[pd.DataFrame, list[str]]:
    """An ``ncu --page source --print-source sass --csv`` export (its first line names the kernel) and its
    per-reason stall sample columns (issued and not)."""
    df = pd.read_csv(path, skiprows=1)
    reasons = [c for c in df.columns if c.startswith("stall_") and "Not Issued" not in c]
    for c in reasons + [TOTAL, NOT_ISSUED]:
        df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0)
    return df, reasons


def stall_summary(path: str, top: int = 12) -> str:
    """Warp-state samples of an ``ncu --page source --print-source sass --csv`` export: the stall reasons
    summed over the whole kernel, then the instructions that collect the most samples."""
    df, reasons = read_source_page(path)
    total = df[TOTAL].sum()
    lines = [f"{path}: {int(total)} samples ({TOTAL})"]
    sums = df[[NOT_ISSUED] + reasons].sum().sort_values(ascending=False)  # (the not-issued share among them)
    lines += [f"  {c}: {v / max(total, 1):.1%}" for c, v in sums.items() if v > 0][:top]
    source = next(c for c in df.columns if c.lower() in ("source", "sass"))
    lines.append("instructions with the most samples:")
    for _, r in df.sort_values(TOTAL, ascending=False).head(top).iterrows():
        text = re.sub(r"\s+", " ", str(r[source]))[:100]
        lines.append(f"  {int(r[TOTAL]):6d}  {text}")
    return "\n".join(lines)


def phase_table(path: str, lo: int, hi: int) -> str:
    """Warp-state samples of one code span (addresses as offsets from the kernel's first instruction, e.g. a
    consumer's block loop) of an ncu source-page export, cut into phases at each wgmma group, wait, barrier,
    fence and branch: each phase's share of the span's samples and its two main stall reasons."""
    df, reasons = read_source_page(path)
    df["off"] = df["Address"].map(lambda a: int(a, 16))
    df["off"] -= df["off"].min()
    total = TOTAL
    sub = df[(df.off >= lo) & (df.off <= hi)]
    n = max(sub[total].sum(), 1)
    lines = [f"span {lo:#x}-{hi:#x}: {len(sub)} instructions, {int(sub[total].sum())} samples"]
    lines += [f"  {c}: {v / n:.1%}" for c, v in sub[reasons].sum().sort_values(ascending=False).head(8).items()]
    marks = ("DEPBAR", "BAR.SYNC", "SYNCS", "UTMAREDG", "gsb0", "MEMBAR", "FENCE", "BRA")
    seg = []
    for _, r in sub.iterrows():
        seg.append(r)
        text = re.sub(r"\s+", " ", str(r.Source).strip())
        if any(m in text for m in marks):
            part = pd.DataFrame(seg)
            got = part[total].sum()
            top = part[reasons].sum().sort_values(ascending=False)
            why = " ".join(f"{k[6:]}:{v / max(got, 1):.0%}" for k, v in top.head(2).items())
            span = f"{int(part.off.iloc[0]):#x}-{int(r.off):#x}"
            lines.append(f"{span} n={len(seg):3d} {got / n:6.1%}  {why} | {text[:70]}")
            seg = []
    return "\n".join(lines)


def mma_loop_table(path: str, cycles: float = 0.0, iters_per_warp: float = 0.0, top: int = 3) -> str:
    """Each innermost loop of an ncu source-page export that issues a wgmma (a consumer's block loop): its
    instructions, warp-iterations (the first instruction's executions), and its warp-state samples by stall
    reason, with the instructions that collect the most samples of the loop's three main reasons.

    Per-iteration cycles: a sample interval picks one warp of each scheduler, so a loop's samples divided by its
    warp-iterations are not cycles. With ``cycles`` (the kernel's elapsed cycles, from the details page) and
    ``iters_per_warp`` (block iterations per consumer warp: the loop pair's warp-iterations over the consumer warps
    of the grid), each reason is shown as cycles of one iteration: its share of the loop's samples x cycles /
    iters_per_warp (NOTES v52: ~3500 cycles per causal D=128 block, 738 of them short-scoreboard waits)."""
    from gluon_attn.inspection import innermost

    df, reasons = read_source_page(path)
    source = next(c for c in df.columns if c.lower() in ("source", "sass"))
    df["addr"] = df["Address"].map(lambda a: int(str(a), 16))
    df = df.sort_values("addr").reset_index(drop=True)
    df["text"] = df[source].astype(str).str.strip().str.replace(r"\s+", " ", regex=True)
    executed = pd.to_numeric(df["Instructions Executed"].astype(str).str.replace(",", ""), errors="coerce").fillna(0)
    spans = []
    for _, r in df.iterrows():
        m = re.match(r"(?:@!?U?P\w+ )?BRA\b.*?0x([0-9a-f]+)", r.text)
        if m and int(m.group(1), 16) < r.addr:
            spans.append((int(m.group(1), 16), r.addr))
    lines = []
    for lo, hi in innermost(spans):
        loop = df[(df.addr >= lo) & (df.addr <= hi)]
        if not loop.text.str.contains("HGMMA").any():
            continue
        iters = int(executed[loop.index[0]])
        by_reason = loop[reasons].sum()
        n = max(by_reason.sum(), 1)
        scale = cycles / iters_per_warp if cycles and iters_per_warp else 0.0
        lines.append(f"loop {lo - df.addr.min():#x}-{hi - df.addr.min():#x}: {len(loop)} instructions, "
                     f"{iters} warp-iterations, {int(loop[TOTAL].sum())} samples")
        for reason, v in by_reason.sort_values(ascending=False).items():
            if v > 0:
                lines.append(f"  {reason[6:]:18s} {v / n:6.1%}" + (f" {v / n * scale:7.0f} cycles" if scale else ""))
        for reason in by_reason.sort_values(ascending=False).index[:3]:
            col = pd.to_numeric(loop[reason], errors="coerce").fillna(0)
            for i in col.sort_values(ascending=False).index[:top]:
                if col[i] > 0:
                    lines.append(f"    {reason[6:]:12s} {col[i] / max(col.sum(), 1):5.1%}  {df.text[i][:80]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="gluon")
    ap.add_argument("--batch", "-Z", type=int, default=4)
    ap.add_argument("--heads", "-H", type=int, default=32)
    ap.add_argument("--h-kv", type=int, default=None, help="K/V heads (GQA; default: as many as query heads)")
    ap.add_argument("--pass", dest="pass_name", default="bwd", choices=["fwd", "bwd"])
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-v", type=int, default=None, help="v's head dim where it differs (192/128: 128)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--varlen", default=None, help="a packed batch of --n-ctx tokens in this length mix (-Z 1)")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--register", default="", help="modules of this folder whose import registers more providers "
                                                   "(fa4_tiles: fa4-m64)")
    ap.add_argument("--copies", default="", help="before_after.py copies to register (providers gluon-NAME; "
                                                 "PYTHONPATH takes .before)")
    ap.add_argument("--stalls", metavar="CSV", help="summarise an ncu source-page export instead of running")
    ap.add_argument("--phases", nargs=3, metavar=("CSV", "LO", "HI"),
                    help="phases of one code span (hex offsets) of an ncu source-page export")
    ap.add_argument("--loops", metavar="CSV", help="stall reasons per wgmma block loop of an ncu source-page export")
    ap.add_argument("--cycles", type=float, default=0.0, help="--loops: the kernel's elapsed cycles")
    ap.add_argument("--iters-per-warp", type=float, default=0.0, help="--loops: block iterations per consumer warp")
    args = ap.parse_args()
    if args.loops:
        print(mma_loop_table(args.loops, args.cycles, args.iters_per_warp))
    elif args.phases:
        print(phase_table(args.phases[0], int(args.phases[1], 16), int(args.phases[2], 16)))
    elif args.stalls:
        print(stall_summary(args.stalls))
    else:
        if args.copies or args.register:
            from before_after import register_providers  # (this script's folder is on the path)
            register_providers(args.copies, args.register)
        run_target(args)


if __name__ == "__main__":
    main()
