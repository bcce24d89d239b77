"""One tree against another on the same GPU: the GPU time of na2d/na3d's default call (the plan's own tiles) for the
small-window problems, under whichever ``gluon_attn`` is first on the path. Run it once per tree, the trees taking
turns, and compare the lines (the same script works with trees from before and after a kernel change: it uses the
public calls and ``timing.graphed`` only).

Usage: PYTHONPATH=TREE python3 experiments/na_tree_ab.py LABEL [--only NAME[,NAME...]] [--config K=V,...] >> ab.jsonl
       python3 experiments/na_tree_ab.py --compare ab.jsonl [OLD NEW]   (the medians per problem, OLD / NEW)
       ncu --kernel-name regex:gluon_attention --launch-skip 1 --launch-count 1 ... \
           python3 experiments/na_tree_ab.py ncu --only NAME --ncu        (two eager calls, nothing else: a target)
Each line: {"tree": LABEL, "problem": ..., "us": GPU us per call (median of --reps replays of --calls calls in one
CUDA graph), "err": max abs error against the fp32 reference on batch 0's first two heads}. ``--config``: fields of
the sm_90a config replaced in the plan's default (e.g. ``KV_STAGES=3,PINGPONG=0``); a problem whose plan refuses them
is left out with the refusal on stderr."""
import argparse
import dataclasses
import json
import statistics
import sys

import torch

import gluon_attn
from gluon_attn.bench.timing import graphed
from gluon_attn.neighborhood import na_reference

PROBLEMS = [  # (name, grid, window, B, H, D)
    ("2-D 56x56 7x7", (56, 56), (7, 7), 16, 4, 64),
    ("2-D 64x64 7x7 D128", (64, 64), (7, 7), 8, 8, 128),
    ("2-D 96x96 13x13", (96, 96), (13, 13), 4, 8, 64),
    ("2-D 128x128 13x13", (128, 128), (13, 13), 2, 16, 64),
    ("3-D 16^3 3x3x3", (16, 16, 16), (3, 3, 3), 4, 8, 64),
    ("3-D 16^3 5x5x5", (16, 16, 16), (5, 5, 5), 4, 8, 64),
]


def gpu_us(fn, calls: int, reps: int) -> float:
    replay = graphed(lambda: [fn() for _ in range(calls)])
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times)


def override_config(spec: str) -> dict:
    """``--config``: replace fields of the sm_90a default config (``hopper_host.default_config``, which the
    neighborhood plans start from) for this process; returns the fields."""
    from gluon_attn.kernels import hopper_host
    fields = dict(item.split("=") for item in filter(None, spec.split(",")))
    base = hopper_host.default_config

    def replaced(head_dim, dtype, *args, **kw):
        cfg = base(head_dim, dtype, *args, **kw)  # (each field as its own type: "0" -> False for a flag)
        return dataclasses.replace(cfg, **{k: type(getattr(cfg, k))(int(v)) for k, v in fields.items()})
    hopper_host.default_config = replaced
    return fields


def compare(path: str, old: str = "old", new: str = "new") -> str:
    """A markdown table of the lines in ``path``: per problem the median us of each tree, OLD / NEW, the largest
    error of each."""
    import pandas as pd
    df = pd.read_json(path, lines=True)
    us = df.pivot_table(index="problem", columns="tree", values="us", aggfunc="median", sort=False)
    err = df.pivot_table(index="problem", columns="tree", values="err", aggfunc="max", sort=False)
    lines = [f"| problem | {old} us | {new} us | {old} / {new} | err {old} | err {new} |", "|---|---|---|---|---|---|"]
    for prob in us.index:
        a, b = us.loc[prob, old], us.loc[prob, new]
        lines.append(f"| {prob} | {a:.1f} | {b:.1f} | {a / b:.3f}x | {err.loc[prob, old]:.2e} | "
                     f"{err.loc[prob, new]:.2e} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--compare":
        print(compare(*sys.argv[2:]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--only", default="")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ncu", action="store_true", help="two eager calls of each problem, no timing or reference")
    ap.add_argument("--config", default="", help="K=V,... fields of the sm_90a config replaced (KV_STAGES, PINGPONG)")
    args = ap.parse_args()
    fields = override_config(args.config) if args.config else {}
    for name, grid, window, B, H, D in PROBLEMS:
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, *grid, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
        op = gluon_attn.na2d if len(grid) == 2 else gluon_attn.na3d
        if fields:  # (the plan refuses a config its head dim cannot take, naming why)
            try:
                op(q, k, v, window)
            except ValueError as exc:
                print(f"{name}: {exc}", file=sys.stderr)
                continue
        if args.ncu:
            for _ in range(2):
                op(q, k, v, window)
            torch.cuda.synchronize()
            continue
        out = op(q, k, v, window)
        ref = na_reference(*(t[:1, ..., :2, :].float() for t in (q, k, v)), window)  # (batch 0, heads 0-1)
        err = (out[:1, ..., :2, :].float() - ref).abs().max().item()
        us = gpu_us(lambda: op(q, k, v, window), args.calls, args.reps)
        print(json.dumps({"tree": args.label, "problem": name, "us": round(us, 2), "err": err}), flush=True)


if __name__ == "__main__":
    main()
