"""Views derived from a sweep's long-format rows: Markdown tables and plots."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from .sweep import ROWS_FILE

BASELINE_PROVIDER = "cudnn"
BASELINE_DTYPES = ("fp16", "bf16")


def load_rows(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    csv_path = path / ROWS_FILE if path.is_dir() else path
    if not csv_path.exists():
        raise FileNotFoundError(f"no {ROWS_FILE} in {path}")
    df = pd.read_csv(csv_path, keep_default_na=False, na_values=[""])
    df["causal"] = df["causal"].astype(str).str.lower().isin(["true", "1"])
    # A resumed sweep may record a cell twice (an error, then a retry): the last row wins.
    keys = ["Z", "H", "N_CTX", "HEAD_DIM", "HEAD_DIM_V", "causal", "dtype", "provider"]
    return df.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


def _column(provider: str, dtype: str) -> str:
    return f"{provider} {dtype}"


def _cell_text(row) -> str:
    if row["status"] == "ok":
        v = row["tflops"]
        return f"{v:.1f}" if v >= 10 else f"{v:.3g}"
    if row["status"] == "unsupported":
        return ""
    return row["status"]


def baseline_column(df: pd.DataFrame) -> Optional[str]:
    """The cuDNN column speedups are measured against: fp16 if present, else bf16."""
    for dtype in BASELINE_DTYPES:
        sel = df[(df.provider == BASELINE_PROVIDER) & (df.dtype == dtype) & (df.status == "ok")]
        if len(sel):
            return _column(BASELINE_PROVIDER, dtype)
    return None


def speedup_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Rows with an added ``speedup`` column: TFLOPS over the cuDNN baseline of the same problem
    shape (same Z, H, N_CTX, D, causal), measured in the same run."""
    base_col = baseline_column(df)
    ok = df[df.status == "ok"].copy()
    if base_col is None:
        ok["speedup"] = float("nan")
        return ok
    base_dtype = base_col.split()[-1]
    shape = ["Z", "H", "N_CTX", "HEAD_DIM", "causal"]
    base = ok[(ok.provider == BASELINE_PROVIDER) & (ok.dtype == base_dtype)][shape + ["tflops"]]
    base = base.rename(columns={"tflops": "baseline_tflops"})
    merged = ok.merge(base, on=shape, how="left")
    merged["speedup"] = merged["tflops"] / merged["baseline_tflops"]
    return merged


def tables_markdown(df: pd.DataFrame) -> str:
    """One block per ``Attention Z=.. H=.. D=.. causal=..:`` with N_CTX rows, a TFLOPS column per
    provider/dtype, and speedup-vs-cuDNN columns."""
    blocks = []
    base_col = baseline_column(df)
    speed = speedup_frame(df)
    shape = ["Z", "H", "HEAD_DIM", "causal"]
    for (Z, H, D, causal), g in df.groupby(shape, sort=True):
        cols = []
        for (prov, dtype), _ in g.groupby(["provider", "dtype"], sort=False):
            if (g[(g.provider == prov) & (g.dtype == dtype)].status != "unsupported").any():
                cols.append((prov, dtype))
        if not cols:
            continue
        names = [_column(p, d) for p, d in cols]
        ratio_cols = [(p, d) for p, d in cols if _column(p, d) != base_col] if base_col else []
        header = ["N_CTX"] + names + [f"{_column(p, d)} / {base_col}" for p, d in ratio_cols]
        lines = [f"Attention Z={Z} H={H} D={D} causal={causal}: (TFLOPS)", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for n in sorted(g.N_CTX.unique()):
            cells = [str(n)]
            for p, d in cols:
                sel = g[(g.N_CTX == n) & (g.provider == p) & (g.dtype == d)]
                cells.append(_cell_text(sel.iloc[-1]) if len(sel) else "")
            for p, d in ratio_cols:
                s = speed[(speed.Z == Z) & (speed.H == H) & (speed.HEAD_DIM == D) & (speed.causal == causal)
                          & (speed.N_CTX == n) & (speed.provider == p) & (speed.dtype == d)]
                val = s.speedup.iloc[-1] if len(s) else float("nan")
                cells.append(f"{val:.2f}x" if pd.notna(val) else "")
            lines.append("| " + " | ".join(cells) + " |")
        labels = sorted({f"{p} = {lbl}" for p, lbl in zip(g.provider, g.label) if isinstance(lbl, str) and lbl})
        if labels:
            lines += ["", "Providers: " + "; ".join(labels)]
        failed = g[g.status.isin(["wrong", "oom", "error"])]
        for _, r in failed.iterrows():
            lines.append(f"- {r['provider']} {r['dtype']} N_CTX={r['N_CTX']}: {r['status']}: {r['message']}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def plot_tflops(df: pd.DataFrame, path: str | Path, *, speedup: bool = False) -> Optional[Path]:
    """TFLOPS (or speedup vs cuDNN) against N_CTX, one panel per (head dim, causal), one line per
    provider/dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = speedup_frame(df) if speedup else df[df.status == "ok"]
    if speedup:
        data = data[data.provider != BASELINE_PROVIDER].dropna(subset=["speedup"])
    if data.empty:
        return None
    panels = sorted(data.groupby(["HEAD_DIM", "causal"]).groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    ycol = "speedup" if speedup else "tflops"
    for ax, (d, causal) in zip(axes[0], panels):
        sub = data[(data.HEAD_DIM == d) & (data.causal == causal)]
        for (prov, dtype), g in sub.groupby(["provider", "dtype"]):
            g = g.sort_values("N_CTX")
            ax.plot(g.N_CTX, g[ycol], marker="o", label=f"{prov} {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N_CTX")
        ax.set_ylabel("speedup vs cuDNN" if speedup else "TFLOPS")
        if speedup:
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"D={d} causal={causal}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    z, h = int(data.Z.iloc[0]), int(data.H.iloc[0])
    gpu = str(data.gpu.iloc[0]) if "gpu" in data and len(data) else ""
    fig.suptitle(f"Attention forward, Z={z} H={h}, {gpu}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(out_dir: str | Path) -> list[Path]:
    """tables.md, tflops.png and speedup.png from a results folder's rows."""
    out_dir = Path(out_dir)
    df = load_rows(out_dir)
    written = []
    if df.empty:
        return written
    tables = out_dir / "tables.md"
    tables.write_text(tables_markdown(df))
    written.append(tables)
    for name, sp in (("tflops.png", False), ("speedup.png", True)):
        p = plot_tflops(df, out_dir / name, speedup=sp)
        if p:
            written.append(p)
    return written
