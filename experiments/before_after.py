"""Same-run A/B of the Gluon kernels at several commits: the package as it was at each earlier commit (a copy
imported as ``gluon_attn_<name>``, its custom ops in the namespace ``gluon_attn_<name>``) is registered as
the provider ``gluon-<name>`` beside today's ``gluon``, and a sweep spec runs them all (and the spec's peers),
interleaved in turning order as every sweep does; forward and backward passes alike. Writes the sweep's
files and ``before-after.md``: gluon / each copy per cell, with the cells below a threshold named.

Usage:
  PYTHONPATH=. python3 experiments/before_after.py --make before=57309cd --make v1=fb035c8  # into .before/
  PYTHONPATH=.:.before python3 experiments/before_after.py --copies before,v1 --spec SPEC.toml --out DIR
"""
import argparse
import dataclasses
import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pandas as pd

from gluon_attn.bench.gluon_providers import attention_runner
from gluon_attn.bench.provider import Provider, register
from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.sweep import SweepSpec, run_sweep

COPIES = Path(".before")


def make_copy(name: str, rev: str) -> Path:
    """.before/gluon_attn_<name>: the package at ``rev`` with its imports and op namespace renamed, so that it
    loads beside today's (two copies may not register the same torch.library op)."""
    dest = COPIES / f"gluon_attn_{name}"
    shutil.rmtree(dest, ignore_errors=True)
    tar = subprocess.run(["git", "archive", rev, "gluon_attn"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():
            if not m.isfile():
                continue
            path = dest / Path(m.name).relative_to("gluon_attn")
            path.parent.mkdir(parents=True, exist_ok=True)
            data = t.extractfile(m).read()
            if m.name.endswith(".py"):
                text = data.decode()
                text = re.sub(r"\bgluon_attn::", f"gluon_attn_{name}::", text)
                text = re.sub(r"\btorch\.ops\.gluon_attn\.", f"torch.ops.gluon_attn_{name}.", text)
                data = text.encode()
            path.write_bytes(data)
    (dest / "REVISION").write_text(rev + "\n")
    return dest


def register_copy(name: str) -> Provider:
    module = __import__(f"gluon_attn_{name}.api", fromlist=["attention", "attention_varlen"])
    # (the copy's own config choice for the rows' ``config`` column; today's would label the copy's cells with
    # today's config)
    own = __import__(f"gluon_attn_{name}.bench.gluon_providers", fromlist=["_config_label"])
    rev = (COPIES / f"gluon_attn_{name}" / "REVISION").read_text().strip() if (COPIES / f"gluon_attn_{name}").is_dir() \
        else "?"
    return register(dataclasses.replace(
        get_provider("gluon"), name=f"gluon-{name}", description=f"the Gluon kernels as of {rev} ({name})",
        runner=attention_runner(module.attention, module.attention_varlen), backward_runner=None,
        config_fn=getattr(own, "_config_label", get_provider("gluon").config_fn),
        label_fn=lambda: f"Gluon ({name}: {rev})", library=f"gluon-attn at {rev}"))


def register_providers(copies: str = "", modules: str = "") -> None:
    """Providers beside the registry's for one run: the comma-separated ``copies`` (``register_copy``) and the
    providers that importing the comma-separated ``modules`` of this folder registers (fa4_tiles: fa4-m64)."""
    for name in filter(None, copies.split(",")):
        register_copy(name)
    for module in filter(None, modules.split(",")):
        __import__(module)


def ratio_table(rows: pd.DataFrame, copies: list[str], threshold: float) -> str:
    ok = rows[rows.status == "ok"]
    names = [f"gluon-{c}" for c in copies]
    if "gluon" not in set(ok.provider) or not set(names) & set(ok.provider):
        return "no cell ran today's kernel beside a copy (no Hopper GPU?)\n"
    keys = [k for k in ("pass", "dtype", "HEAD_DIM", "causal", "N_CTX") if k in ok.columns]
    t = ok.pivot_table(index=keys, columns="provider", values="tflops")
    cols = [n for n in names if n in t.columns]
    lines = ["| " + " | ".join(keys) + " | gluon TFLOPS | " + " | ".join(f"gluon / {n}" for n in cols) + " |",
             "|" + "---|" * (len(keys) + 1 + len(cols))]
    for idx, r in t.iterrows():
        idx = idx if isinstance(idx, tuple) else (idx,)
        lines.append("| " + " | ".join(map(str, idx)) + f" | {r['gluon']:.1f} | "
                     + " | ".join(f"{r['gluon'] / r[n]:.3f}" for n in cols) + " |")
    lines.append("")
    for n in cols:
        ratio = (t["gluon"] / t[n]).dropna()
        low = ratio[ratio < threshold]
        lines.append(f"gluon / {n}: {len(ratio)} cells, min {ratio.min():.3f}, median {ratio.median():.3f}, "
                     f"max {ratio.max():.3f}; below {threshold}: {len(low)}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make", action="append", default=[], metavar="NAME=REV",
                    help="copy the package at REV into .before/gluon_attn_NAME (no run)")
    ap.add_argument("--copies", default="before", help="comma-separated copy names to run beside gluon")
    ap.add_argument("--spec", default="experiments/hopper-targets.toml")
    ap.add_argument("--out")
    ap.add_argument("--threshold", type=float, default=0.99)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--cell", help="one cell of the spec only: DTYPE:D:causal|no-causal:N_CTX (a re-check)")
    ap.add_argument("--rounds", type=int, default=None, help="override the spec's rounds")
    args = ap.parse_args()
    if args.make:
        for item in args.make:
            name, rev = item.split("=", 1)
            print(make_copy(name, rev))
        return
    if not args.out:
        ap.error("--out is required for a run")
    copies = [c for c in args.copies.split(",") if c]
    for c in copies:
        register_copy(c)
    spec = SweepSpec.from_file(args.spec)
    peers = tuple(p for p in spec.providers if not p.startswith("gluon"))
    overrides = {"providers": tuple(f"gluon-{c}" for c in copies) + ("gluon",) + peers}
    if args.cell:
        dtype, d, mode, n = args.cell.split(":")
        overrides.update(dtypes=(dtype,), head_dims=(int(d),), causal=(mode == "causal",), n_ctx=(int(n),))
    if args.rounds:
        overrides["rounds"] = args.rounds
    spec = SweepSpec.from_file(args.spec, **overrides)
    out = run_sweep(spec, args.out, resume=args.resume)
    table = ratio_table(pd.read_csv(Path(out) / "rows.csv"), copies, args.threshold)
    (Path(out) / "before-after.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
