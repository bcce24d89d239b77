"""Small neighborhood windows on the GPU: where the time of na2d/na3d goes (the tiles issue's 7x7 and 3x3x3 classes).

For each problem: the kernels one call launches (torch.profiler), then the GPU time of one call (a CUDA graph of
``--calls`` calls, replayed ``--reps`` times, median per call) of
  - na2d/na3d with the plan's boxes on NATTEN's [B, *grid, H, D] tensors,
  - the same call on heads-first memory ([B, H, *grid, D] contiguous, passed as the permuted view),
  - the plan's next best box pairs (``--pairs``),
  - Flex with the same mask (compiled) and our dense kernel over the same tokens.
Prints one markdown table per problem; ``--out`` also writes them to a file.

Usage: python3 experiments/na_small_probe.py [--out FILE] [--pairs 4]"""
import argparse
import sys

import torch
from dataclasses import replace

import gluon_attn
from gluon_attn import neighborhood as nbm
from gluon_attn.profiler import record_events
from na_tree_ab import gpu_us  # (experiments/, beside this script)

PROBLEMS = [  # (name, grid, window, B, H, D)
    ("2-D 64x64 7x7", (64, 64), (7, 7), 4, 8, 64),
    ("2-D 56x56 7x7", (56, 56), (7, 7), 16, 4, 64),
    ("2-D 96x96 13x13", (96, 96), (13, 13), 4, 8, 64),
    ("2-D 128x128 13x13", (128, 128), (13, 13), 2, 16, 64),
    ("3-D 16^3 3x3x3", (16, 16, 16), (3, 3, 3), 4, 8, 64),
    ("3-D 16^3 5x5x5", (16, 16, 16), (5, 5, 5), 4, 8, 64),
]


def flex_fn(q, k, v, nb):
    """The sweep's Flex provider (the neighborhood as a mask_mod, block mask and kernel compiled)."""
    from gluon_attn.bench.neighborhood import NAProblem, PROVIDERS
    p = NAProblem(q.shape[0], q.shape[-2], k.shape[-2], q.shape[-1], "fp16", nb)
    return PROVIDERS["flex"](p, q, k, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", default="")
    ap.add_argument("--variants", action="store_true", help="config variants of the launch (compiles each)")
    args = ap.parse_args()
    lines = [f"# na_small_probe ({torch.cuda.get_device_name()}, triton {__import__('triton').__version__})", ""]
    torch.manual_seed(0)
    for name, grid, window, B, H, D in PROBLEMS:
        if args.only and args.only not in name:
            continue
        dims = len(grid)
        op = gluon_attn.na2d if dims == 2 else gluon_attn.na3d
        shape = (B, *grid, H, D)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
        # heads-first memory, the same values, passed as NATTEN's view
        hf = [t.movedim(-2, 1).contiguous().movedim(1, -2) for t in (q, k, v)]
        nb = nbm.neighborhood(grid, window)
        taken, default = nbm.sm90_tiles(nb, D, torch.float16)
        # (the forward walks each query tile's halo boxes: ranked on them)
        ranked = sorted(taken, key=lambda p: nbm.plan_rank(nb, p, True))
        st = nbm.plan_stats(nb, *default, halo=True)
        lines += [f"## {name}, B {B}, H {H}, D {D} (default boxes {default}, computing "
                  f"{st.computed_pairs / nbm.attended_pairs(nb):.2f}x the attended pairs, bound "
                  f"{nb.tokens ** 2 / st.computed_pairs:.2f}x dense)", ""]
        ref = op(q, k, v, window)
        for ev in record_events(lambda: op(q, k, v, window), iters=1):
            lines.append(f"- kernel `{ev['name'][:60]}`: {ev['device_time_us']:.1f} us")
        lines += ["", "| variant | GPU us / call | max err vs default |", "|---|---|---|"]
        rows = [("default, NATTEN layout", lambda: op(q, k, v, window))]
        rows.append(("default, heads-first memory", lambda: op(*hf, window)))
        if dims == 3:  # (na3d's batches in one launch, against a launch per batch)
            def per_batch(folds=nbm._folds):
                nbm._folds = lambda *a: False
                try:
                    # (the scale given: a call signature of its own, so that its route is made per batch)
                    return op(q, k, v, window, scale=D ** -0.5)
                finally:
                    nbm._folds = folds
            rows.append(("default, a launch per batch", per_batch))
        old = min(taken, key=lambda p: nbm.plan_rank(nb, p))
        if old != default:  # (the default ranked on the lattice's key tiles, walked as halo boxes)
            rows.append((f"boxes {old}: the lattice's default", lambda: op(q, k, v, window, q_tile_shape=old[0],
                                                                              kv_tile_shape=old[1])))
        for pair in ranked[:args.pairs]:
            if pair == default:
                continue
            st = nbm.plan_stats(nb, *pair, halo=True)
            rows.append((f"boxes {pair} (computes {st.computed_pairs / nbm.attended_pairs(nb):.2f}x attended)",
                         lambda pair=pair: op(q, k, v, window, q_tile_shape=pair[0], kv_tile_shape=pair[1])))
        # the kernel launch alone on one group's view (3-D: batch 0), with config variants
        from gluon_attn.kernels.backend import backend_for_arch
        kernels = backend_for_arch("sm_90a").module
        cfg, boxes = nbm.na_box_config(kernels, D, torch.float16, nb)
        perm = (0, 3, 1, 2, 4) if dims == 2 else (3, 0, 1, 2, 4)
        views = [(t if dims == 2 else t[0]).permute(*perm) for t in (q, k, v)]
        out_v = torch.empty_like(views[0])
        variants = [("launch only, plan's config", cfg), ("launch only, PINGPONG off", replace(cfg, PINGPONG=False)),
                    ("launch only, KV_STAGES 3", replace(cfg, KV_STAGES=3)),
                    ("launch only, DYNAMIC", replace(cfg, DYNAMIC=True)),
                    ("launch only, SUM_MMA off", replace(cfg, SUM_MMA=False))]
        for label, c in variants[:None if args.variants else 1]:
            rows.append((f"{label} ({'1 batch' if dims == 3 else 'all batches'})",
                         lambda c=c: kernels.hopper_na_boxes(*views, window=tuple((w, 1, False) for w in window),
                                                             boxes=boxes, sm_scale=D ** -0.5, out=out_v, config=c)))
        n = q[0, ..., 0, 0].numel()
        qd, kd, vd = (t.reshape(B, n, H, D).transpose(1, 2).contiguous() for t in (q, k, v))
        rows.append(("dense gluon over the same tokens", lambda: gluon_attn.attention(qd, kd, vd)))
        try:
            rows.append(("flex, same mask (compiled)", flex_fn(q, k, v, nb)))
        except Exception as e:  # (recorded, not fatal)
            lines.append(f"flex: {type(e).__name__}: {e}")
        for label, fn in rows:
            try:
                o = fn()
                err = float("nan")
                if o.numel() == ref.numel() and not label.startswith(("dense", "launch")):
                    err = (o.float().reshape(ref.shape) - ref.float()).abs().max().item()
                us = gpu_us(fn, args.calls, args.reps)
                lines.append(f"| {label} | {us:.1f} | {err:.2e} |")
            except Exception as e:
                lines.append(f"| {label} | error: {type(e).__name__}: {str(e)[:120]} | |")
            print(lines[-1], flush=True)
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
