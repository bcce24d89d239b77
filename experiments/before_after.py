"""Same-run A/B of the Gluon kernel at two commits: the package as it was at BEFORE (a copy imported as
``gluon_attn_before``) is registered as the provider ``gluon-before`` beside today's ``gluon``, and a
sweep spec runs both, interleaved in turning order as every sweep does. Writes the sweep's files and
``before-after.md``: gluon / gluon-before per cell, with the cells below a threshold named.

Usage:
  git archive BEFORE gluon_attn | tar -x -C .before && mv .before/gluon_attn .before/gluon_attn_before
  PYTHONPATH=.:.before python3 experiments/before_after.py --spec experiments/hopper-targets.toml --out DIR
"""
import argparse
from pathlib import Path

import pandas as pd

from gluon_attn.bench.gluon_providers import attention_runner
from gluon_attn.bench.provider import Provider, register
from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.sweep import SweepSpec, run_sweep


def register_before() -> Provider:
    import gluon_attn_before
    from gluon_attn_before.api import attention as before_attention

    today = get_provider("gluon")
    return register(Provider(
        name="gluon-before", description=f"the Gluon kernel as of {gluon_attn_before.__file__}",
        needs_cuda=True, dtypes=today.dtypes, head_dims=today.head_dims, head_dims_text=today.head_dims_text,
        arch_ok=today.arch_ok, archs_text=today.archs_text, runner=attention_runner(before_attention),
        label_fn=lambda: "Gluon (before)",
        out_dtype_fn=today.out_dtype_fn, package="triton", library="gluon-attn at the earlier commit"))


def ratio_table(rows: pd.DataFrame, threshold: float) -> str:
    ok = rows[rows.status == "ok"]
    if not {"gluon", "gluon-before"} <= set(ok.provider):
        return "no cell ran both kernels (no Hopper GPU?)\n"
    t = ok.pivot_table(index=["dtype", "HEAD_DIM", "causal", "N_CTX"], columns="provider", values="tflops")
    ratio = (t["gluon"] / t["gluon-before"]).rename("after / before")
    lines = ["| dtype | D | causal | N_CTX | before TFLOPS | after TFLOPS | after / before |",
             "|---|---|---|---|---|---|---|"]
    for (dtype, d, causal, n), r in ratio.items():
        lines.append(f"| {dtype} | {d} | {causal} | {n} | {t.loc[(dtype, d, causal, n), 'gluon-before']:.1f} | "
                     f"{t.loc[(dtype, d, causal, n), 'gluon']:.1f} | {r:.3f} |")
    low = ratio[ratio < threshold]
    lines += ["", f"{len(ratio)} cells; after / before: min {ratio.min():.3f}, median {ratio.median():.3f}, "
                  f"max {ratio.max():.3f}; below {threshold}: {len(low)}"]
    lines += [f"- {dtype} D={d} causal={causal} N_CTX={n}: {r:.3f}" for (dtype, d, causal, n), r in low.items()]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="experiments/hopper-targets.toml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threshold", type=float, default=0.99)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--cell", help="one cell of the spec only: DTYPE:D:causal|no-causal:N_CTX (a re-check)")
    ap.add_argument("--rounds", type=int, default=None, help="override the spec's rounds")
    args = ap.parse_args()
    register_before()
    overrides = {"providers": ("gluon-before", "gluon")}
    if args.cell:
        dtype, d, mode, n = args.cell.split(":")
        overrides.update(dtypes=(dtype,), head_dims=(int(d),), causal=(mode == "causal",), n_ctx=(int(n),))
    if args.rounds:
        overrides["rounds"] = args.rounds
    spec = SweepSpec.from_file(args.spec, **overrides)
    out = run_sweep(spec, args.out, resume=args.resume)
    table = ratio_table(pd.read_csv(Path(out) / "rows.csv"), args.threshold)
    (Path(out) / "before-after.md").write_text(table)
    print(table.splitlines()[-1] if "below" in table.splitlines()[-1] else table)


if __name__ == "__main__":
    main()
