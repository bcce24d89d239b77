"""Views derived from a sweep's long-format rows: Markdown tables and plots."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from ..problem import FP8_DTYPES

ROWS_FILE = "rows.csv"  # what a sweep writes and every view reads

BASELINE_PROVIDER = "cudnn"
BASELINE_DTYPES = ("fp16", "bf16")


def load_rows(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    csv_path = path / ROWS_FILE if path.is_dir() else path
    if not csv_path.exists():
        raise FileNotFoundError(f"no {ROWS_FILE} in {path}")
    df = pd.read_csv(csv_path, keep_default_na=False, na_values=[""])
    missing = [c for c in ("provider", "N_CTX", "HEAD_DIM", "causal", "dtype") if c not in df.columns]
    if missing:
        raise ValueError(f"{csv_path} is not a sweep's rows (no {', '.join(missing)} column"
                         f"{'s' if len(missing) > 1 else ''}): `plot` draws `gluon-attn sweep` results; an --na "
                         f"sweep writes its own tables.md")
    df["causal"] = df["causal"].astype(str).str.lower().isin(["true", "1"])
    df = with_shape_columns(df)
    # A resumed sweep may record a cell twice (an error, then a retry): the last row wins.
    keys = ["Z", "H", "H_KV", "N_CTX", "N_KV", "varlen", "HEAD_DIM", "HEAD_DIM_V", "causal", "dtype", "pass",
            "provider"]
    return df.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


SHAPE = ["Z", "H", "H_KV", "N_CTX", "N_KV", "varlen", "HEAD_DIM", "HEAD_DIM_V", "causal", "pass"]


def with_shape_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Rows from before GQA / cross lengths / packed batches / passes get their meaning: as many K/V heads as
    query heads, N_KV = N_CTX, v's head dim q's, dense (varlen ""), the forward (pass "fwd"). Idempotent."""
    if df.empty:
        return df
    df = df.copy()
    for col, default in (("H_KV", "H"), ("N_KV", "N_CTX"), ("HEAD_DIM_V", "HEAD_DIM")):
        if col not in df:
            df[col] = df[default]
        df[col] = df[col].astype("float").fillna(df[default]).astype(int)
    mix = df["varlen"] if "varlen" in df else pd.Series([""] * len(df), index=df.index)
    df["varlen"] = mix.astype(object).where(mix.notna(), "").astype(str).replace("nan", "")
    direction = df["pass"] if "pass" in df else pd.Series(["fwd"] * len(df), index=df.index)
    df["pass"] = direction.astype(object).where(direction.notna(), "fwd").astype(str).replace(["nan", ""], "fwd")
    return df


def _dims(d, dv) -> str:
    """"128", or "192/128" where v's head dim is its own."""
    return f"{d}" if d == dv else f"{d}/{dv}"


def _column(provider: str, dtype: str) -> str:
    return f"{provider} {dtype}"


def _cell_text(row) -> str:
    if row["status"] == "ok":
        v = row["tflops"]
        return f"{v:.1f}" if v >= 10 else f"{v:.3g}"
    if row["status"] == "unsupported":
        return ""
    return row["status"]


def _ratio_text(val) -> str:
    return f"{val:.2f}x" if pd.notna(val) else ""


def peer_providers(df: pd.DataFrame) -> list[str]:
    """The providers of ``df`` that the registry marks as peers (the libraries a user would pick
    instead of ours), in order of appearance; names the registry does not know are not peers."""
    from .providers import PROVIDERS, provider_names

    provider_names()
    return [p for p in dict.fromkeys(df.provider) if p in PROVIDERS and PROVIDERS[p].peer]


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
    df = with_shape_columns(df)
    base_col = baseline_column(df)
    ok = df[df.status == "ok"].copy()
    if base_col is None:
        ok["speedup"] = float("nan")
        return ok
    base_dtype = base_col.split()[-1]
    base = ok[(ok.provider == BASELINE_PROVIDER) & (ok.dtype == base_dtype)][SHAPE + ["tflops"]]
    base = base.rename(columns={"tflops": "baseline_tflops"})
    merged = ok.merge(base, on=SHAPE, how="left")
    merged["speedup"] = merged["tflops"] / merged["baseline_tflops"]
    return merged


def peer_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows with the fastest peer of the same problem shape and dtype in the same run
    (``best_peer``, ``best_peer_tflops``) and ``vs_peer`` = TFLOPS / best_peer_tflops. fp8 rows meet
    the fp8 peers (cuDNN's fp8 graph), 16-bit rows the 16-bit ones (cuDNN, FA4): no cross-dtype ratio."""
    df = with_shape_columns(df)
    ok = df[df.status == "ok"].copy()
    peers = ok[ok.provider.isin(peer_providers(df))]
    cols = ["best_peer", "best_peer_tflops", "vs_peer"]
    if peers.empty:
        return ok.assign(**{c: float("nan") for c in cols})
    best = peers.loc[peers.groupby(SHAPE + ["dtype"]).tflops.idxmax(), SHAPE + ["dtype", "provider", "tflops"]]
    best = best.rename(columns={"provider": "best_peer", "tflops": "best_peer_tflops"})
    merged = ok.merge(best, on=SHAPE + ["dtype"], how="left")
    merged["vs_peer"] = merged["tflops"] / merged["best_peer_tflops"]
    return merged


def _lookup(frame: pd.DataFrame, key: dict, column: str):
    sel = frame
    for k, v in key.items():
        sel = sel[sel[k] == v]
    return sel[column].iloc[-1] if len(sel) else float("nan")


def tables_markdown(df: pd.DataFrame) -> str:
    """One block per ``Attention Z=.. H=.. D=.. causal=..:``, a row per (dtype, N_CTX), a TFLOPS column
    per provider (peers first), the fastest peer of that dtype, and for every other provider its ratio
    to that peer (the primary figure) and to cuDNN fp16 of the same shape (secondary)."""
    blocks = []
    df = with_shape_columns(df)
    base_col = baseline_column(df)
    speed, vs_peer = speedup_frame(df), peer_frame(df)
    peers = peer_providers(df)
    for (direction, Z, H, H_KV, mix, D, Dv, causal), g in df.groupby(["pass", "Z", "H", "H_KV", "varlen", "HEAD_DIM",
                                                                      "HEAD_DIM_V", "causal"], sort=True):
        shown = [p for p in dict.fromkeys(g.provider) if (g[g.provider == p].status != "unsupported").any()]
        if not shown:
            continue
        # Peers first, then the providers rated against them, ours leading.
        shown = [p for p in shown if p in peers] + sorted((p for p in shown if p not in peers),
                                                          key=lambda p: p != "gluon")
        subjects = [p for p in shown if p not in peers]
        cross = bool((g.N_KV != g.N_CTX).any())  # a column for the key length where it is not N_CTX
        header = ["dtype", "N_CTX"] + (["N_KV"] if cross else []) + shown + (["best peer"] if peers else [])
        header += [f"{p} / best peer" for p in subjects if peers]
        header += [f"{p} / {base_col}" for p in subjects if base_col]
        title = ("Attention" if direction == "fwd" else f"Attention {direction}") + f" Z={Z} H={H}"
        title += f" H_KV={H_KV}" if H_KV != H else ""
        title += f" varlen={mix} (N_CTX: tokens in all)" if mix else ""
        lines = [f"{title} D={_dims(D, Dv)} causal={causal}: (TFLOPS)", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for dtype in dict.fromkeys(g.dtype):
            gd = g[g.dtype == dtype]
            if not (gd.status != "unsupported").any():
                continue
            for n, n_kv in sorted(set(zip(gd.N_CTX, gd.N_KV))):
                key = dict(Z=Z, H=H, H_KV=H_KV, varlen=mix, HEAD_DIM=D, HEAD_DIM_V=Dv, causal=causal, N_CTX=n,
                           N_KV=n_kv, dtype=dtype, **{"pass": direction})
                cells = [dtype, str(n)] + ([str(n_kv)] if cross else [])
                for p in shown:
                    sel = gd[(gd.N_CTX == n) & (gd.N_KV == n_kv) & (gd.provider == p)]
                    cells.append(_cell_text(sel.iloc[-1]) if len(sel) else "")
                if peers:
                    best = _lookup(vs_peer, key, "best_peer")
                    cells.append(best if isinstance(best, str) else "")
                    cells += [_ratio_text(_lookup(vs_peer, {**key, "provider": p}, "vs_peer")) for p in subjects]
                if base_col:
                    cells += [_ratio_text(_lookup(speed, {**key, "provider": p}, "speedup")) for p in subjects]
                lines.append("| " + " | ".join(cells) + " |")
        labels = sorted({f"{p} = {lbl}" for p, lbl in zip(g.provider, g.label) if isinstance(lbl, str) and lbl})
        if labels:
            lines += ["", "Providers: " + "; ".join(labels)]
        if "out_dtype" in g:
            # What fp8 providers write differs (fp8, fp16, bf16): say it wherever it is not the input's 16-bit type.
            written = g[(g.status == "ok") & g.out_dtype.notna()
                        & ((g.out_dtype != g.dtype) | g.dtype.isin(FP8_DTYPES))]
            notes = sorted({f"{r.provider} {r.dtype} writes {r.out_dtype}" for r in written.itertuples()})
            if notes:
                lines.append("Outputs: " + "; ".join(notes))
        lines += _memory_table(g, shown, cross)
        lines += _eager_table(g, shown, peers, cross)
        failed = g[g.status.isin(["wrong", "oom", "error"])]
        for _, r in failed.iterrows():
            at = f"N_CTX={r['N_CTX']}" + (f" N_KV={r['N_KV']}" if r['N_KV'] != r['N_CTX'] else "")
            lines.append(f"- {r['provider']} {r['dtype']} {at}: {r['status']}: {r['message']}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


MEMORY_REFERENCE = "math"  # the naive O(N^2) attention the memory table compares with


def _memory_table(g: pd.DataFrame, shown: list[str], cross: bool) -> list[str]:
    """Peak device memory (MB) per provider and N_CTX of one block, with each provider's ratio to the math
    reference where it ran; nothing where no row recorded its memory (CPU sweeps)."""
    if "peak_mem_mb" not in g:
        return []
    ok = g[(g.status == "ok") & g.peak_mem_mb.notna()]
    cols = [p for p in shown if p in set(ok.provider)]
    if not cols:
        return []
    ref = MEMORY_REFERENCE if MEMORY_REFERENCE in cols else None
    header = ["dtype", "N_CTX"] + (["N_KV"] if cross else []) + cols + [f"{p} / {ref}" for p in cols if ref and p != ref]
    lines = ["", "Peak memory of a call (MB, beyond the inputs):", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for (dtype, n, n_kv), gd in ok.groupby(["dtype", "N_CTX", "N_KV"], sort=True):
        mb = {r.provider: r.peak_mem_mb for r in gd.itertuples()}
        cells = [dtype, str(n)] + ([str(n_kv)] if cross else []) + [f"{mb[p]:.1f}" if p in mb else "" for p in cols]
        if ref:
            cells += [_ratio_text(mb[p] / mb[ref]) if p in mb and ref in mb and mb[ref] > 0 else ""
                      for p in cols if p != ref]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _eager_table(g: pd.DataFrame, shown: list[str], peers: list[str], cross: bool) -> list[str]:
    """A call as a model makes it: end-to-end eager time per call (us; calls back to back, ``timing.host_times``)
    per provider, its host time beside it, and each of ours against the fastest peer end to end (> 1: ours
    faster), so that host-bound cells show; nothing where no row recorded it."""
    if "eager_us" not in g:
        return []
    ok = g[(g.status == "ok") & g.eager_us.notna()]
    cols = [p for p in shown if p in set(ok.provider)]
    if not cols:
        return []
    subjects = [p for p in cols if p not in peers]
    ranked = [p for p in cols if p in peers]
    header = ["dtype", "N_CTX"] + (["N_KV"] if cross else []) + [f"{p} (host)" for p in cols]
    header += (["best peer"] + [f"{p} / best peer" for p in subjects]) if ranked else []
    lines = ["", "End to end, eager (us per call, calls back to back; host time in brackets):", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (dtype, n, n_kv), gd in ok.groupby(["dtype", "N_CTX", "N_KV"], sort=True):
        e2e = {r.provider: r.eager_us for r in gd.itertuples()}
        host = {r.provider: r.host_us for r in gd.itertuples()}
        cells = [dtype, str(n)] + ([str(n_kv)] if cross else [])
        cells += [f"{e2e[p]:.1f} ({host[p]:.1f})" if p in e2e else "" for p in cols]
        present = [p for p in ranked if p in e2e]
        if ranked:
            best = min(present, key=lambda p: e2e[p]) if present else None
            cells.append(best or "")
            cells += [_ratio_text(e2e[best] / e2e[p]) if best and p in e2e else "" for p in subjects]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


PLOTS = {
    # file: (what is drawn, y label, reference line)
    "tflops.png": ("tflops", "TFLOPS", None),
    "speedup.png": ("speedup", "speedup vs cuDNN fp16", 1.0),
    "speedup-vs-peer.png": ("vs_peer", "speedup vs the best peer of its dtype", 1.0),
    "memory.png": ("peak_mem_mb", "peak memory of a call (MB, log)", None),
}


def plot_frame(df: pd.DataFrame, what: str) -> pd.DataFrame:
    """The rows a plot draws: every ok row (TFLOPS), every row but cuDNN's (vs cuDNN fp16), or every
    row but the peers' (vs the best peer)."""
    if what == "speedup":
        data = speedup_frame(df)
        return data[data.provider != BASELINE_PROVIDER].dropna(subset=["speedup"])
    if what == "vs_peer":
        data = peer_frame(df)
        return data[~data.provider.isin(peer_providers(df))].dropna(subset=["vs_peer"])
    if what == "peak_mem_mb":
        return df[(df.status == "ok") & df.peak_mem_mb.notna()] if "peak_mem_mb" in df else df.iloc[:0]
    return df[df.status == "ok"]


def plot_tflops(df: pd.DataFrame, path: str | Path, *, what: str = "tflops") -> Optional[Path]:
    """``what`` (tflops, speedup or vs_peer) against N_CTX, one panel per (head dims, causal), one line
    per provider/dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ylabel, hline = next((y, h) for w, y, h in PLOTS.values() if w == what)
    data = plot_frame(with_shape_columns(df), what)
    if data.empty:
        return None
    panels = sorted(data.groupby(["HEAD_DIM", "HEAD_DIM_V", "causal"]).groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (d, dv, causal) in zip(axes[0], panels):
        sub = data[(data.HEAD_DIM == d) & (data.HEAD_DIM_V == dv) & (data.causal == causal)]
        for (prov, dtype, h_kv, n_kv_given, mix, direction), g in sub.groupby(
                ["provider", "dtype", "H_KV", sub.N_KV != sub.N_CTX, "varlen", "pass"]):
            g = g.sort_values(["N_KV", "N_CTX"])
            extra = (f" H_KV={h_kv}" if (sub.H_KV != sub.H).any() else "") + (f" {mix}" if mix else "")
            extra += f" {direction}" if sub["pass"].nunique() > 1 or direction != "fwd" else ""
            if n_kv_given:  # one line per key length (decode / chunked prefill against N_KV keys)
                for n_kv, gk in g.groupby("N_KV"):
                    ax.plot(gk.N_CTX, gk[what], marker="o", label=f"{prov} {dtype}{extra} N_KV={n_kv}")
                continue
            ax.plot(g.N_CTX, g[what], marker="o", label=f"{prov} {dtype}{extra}")
        ax.set_xscale("log", base=2)
        if what == "peak_mem_mb":  # O(N^2) against O(N): a log scale shows both
            ax.set_yscale("log")
        ax.set_xlabel("N_CTX")
        ax.set_ylabel(ylabel)
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls="--")
        ax.set_title(f"D={_dims(d, dv)} causal={causal}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    gpu = str(data.gpu.iloc[0]) if "gpu" in data and len(data) else ""
    shape = ""
    if data.Z.nunique() == 1 and data.H.nunique() == 1:  # (several specs in one folder: the legend says)
        shape = f" Z={int(data.Z.iloc[0])} H={int(data.H.iloc[0])},"
    passes = sorted(set(data["pass"]))
    what_pass = "forward" if passes == ["fwd"] else ", ".join(passes)
    fig.suptitle(f"Attention {what_pass},{shape} {gpu}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(out_dir: str | Path) -> list[Path]:
    """tables.md, tflops.png, speedup.png, speedup-vs-peer.png and memory.png from a results folder's rows."""
    out_dir = Path(out_dir)
    df = load_rows(out_dir)
    written = []
    if df.empty:
        return written
    tables = out_dir / "tables.md"
    tables.write_text(tables_markdown(df))
    written.append(tables)
    for name, (what, _, _) in PLOTS.items():
        p = plot_tflops(df, out_dir / name, what=what)
        if p:
            written.append(p)
    return written
