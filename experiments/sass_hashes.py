"""SASS hashes of a broad set of builds, one line each (``label<TAB>sha256``): the check that a restructuring of the
kernels' source changes no instruction (NOTES v92, v95, v96). Compile-only (no GPU); run as a script, each build compiles afresh.

Usage: python3 experiments/sass_hashes.py OUT [JOBS]      then diff the hash column against an earlier OUT, e.g.
       diff <(cut -f2 before.txt) <(cut -f2 after.txt)
``experiments/sass-hashes.txt`` holds them for the tree that last changed a kernel on purpose; tests/test_sass_hashes.py
compiles a few of them and compares."""
import dataclasses
import hashlib
import os
import sys
import tempfile
import time


def _fwd(dtype, d, causal, packed=False, block_m=None, box_causal=None, pair_tile=False, **kw):
    from gluon_attn.kernels import hopper_host as h
    cfg = h.default_config(d, dtype, causal)
    cfg = h.packed_config(cfg) if packed else cfg
    # (64-row tiles as the 2-D/3-D plans take them: one consumer, no ping-pong, the softmax's own row sums)
    cfg = dataclasses.replace(cfg, BLOCK_M=block_m, PINGPONG=cfg.PINGPONG and block_m > 64,
                              SUM_MMA=cfg.SUM_MMA and block_m > 64) if block_m else cfg
    cfg = dataclasses.replace(cfg, PAIR_TILE=True) if pair_tile else cfg
    if box_causal is not None:
        kw["window"] = h.window_box_mode(box_causal)
    return h.build(dtype, d, causal, cfg, "gluon_attention", **kw)


def _bwd(dtype, d, causal, **kw):
    from gluon_attn.kernels import hopper_bwd_host as b
    # (the 192/128 pair's config as its launch takes it: ``head_dim_v`` decides its Q/dO stages)
    cfg = b.default_config(d, dtype, causal, 8192, kw.get("head_dim_v", 0))
    return b.build(dtype, d, causal, cfg, "gluon_attention_bwd", **kw)


def _bw(dtype, d, causal, packed=False, **kw):
    from gluon_attn.kernels import blackwell_host as m
    cfg = m.default_config(d, dtype, causal)
    return m.build(dtype, d, causal, m.packed_config(cfg) if packed else cfg, "gluon_attention", **kw)


BOX2, BOX3 = ((32, 4), (16, 8)), ((2, 8, 8), (2, 8, 8))
BUILDS = [("hopper", "sm_90a", _fwd, args) for args in [
    ("fp16", 64, False, {}), ("fp16", 64, True, {}), ("fp16", 128, False, {}), ("fp16", 128, True, {}),
    ("bf16", 64, False, {}), ("bf16", 128, True, {}), ("fp8e4m3", 64, False, {}), ("fp8e4m3", 128, True, {}),
    ("fp16", 256, True, {}), ("bf16", 256, False, {}), ("fp16", 96, False, {}), ("bf16", 32, True, {}),
    ("fp16", 192, True, {"head_dim_v": 128}), ("bf16", 192, False, {"head_dim_v": 128, "pair_tile": True}),
    ("fp16", 128, True, {"varlen": True, "packed": True}), ("fp16", 128, True, {"single_tiles": True, "packed": True}),
    ("fp16", 128, False, {"window": 1}), ("bf16", 64, False, {"window": 2}),
    ("fp16", 128, False, {"block_m": 128, "box_causal": (False, False), "boxes": BOX2}),
    ("bf16", 128, False, {"block_m": 128, "box_causal": (False, True, False), "boxes": BOX3}),
    ("fp16", 64, False, {"block_m": 128, "box_causal": (False, False), "boxes": ((16, 8), (8, 16))}),
    ("fp16", 64, False, {"block_m": 64, "box_causal": (False, False), "boxes": ((8, 8), (8, 16))}),
    ("fp16", 64, False, {"block_m": 64, "box_causal": (False, False), "boxes": ((8, 8), (8, 16)), "unit_strides": True}),
    ("bf16", 64, False, {"block_m": 64, "box_causal": (False, False, False), "boxes": ((2, 2, 16), (4, 2, 16)),
                         "unit_strides": True})]] + \
    [("hopper_bwd", "sm_90a", _bwd, args) for args in [
        ("fp16", 64, False, {}), ("fp16", 128, True, {}), ("bf16", 128, False, {"deterministic": True}),
        ("fp16", 128, False, {"window": 1}), ("fp16", 128, False, {"window": 4, "boxes": ((8, 8), (8, 16))}),
        ("bf16", 192, True, {"head_dim_v": 128}),
        ("bf16", 128, False, {"window": 9, "boxes": ((2, 4, 8), (2, 8, 8))})]] + \
    [("blackwell", "sm_100a", _bw, args) for args in [
        ("fp16", 64, False, {}), ("fp16", 128, True, {}), ("bf16", 128, False, {}), ("fp8e4m3", 128, True, {}),
        ("fp16", 128, True, {"varlen": True, "packed": True}), ("fp16", 128, False, {"window": 1}),
        ("fp16", 128, False, {"window": 4, "boxes": ((16, 16), (8, 16))}),
        ("fp16", 128, False, {"window": 8, "boxes": ((4, 8, 8), (2, 8, 8))})]]


def label(i: int) -> str:
    kind, _, _, (dtype, d, causal, kw) = BUILDS[i]
    return f"{kind} {dtype} D={d} causal={causal} {kw}"


def sass_hash(i: int) -> str:
    from gluon_attn.inspection import compile_build, sass_text
    _, arch, make, (dtype, d, causal, kw) = BUILDS[i]
    return hashlib.sha256(sass_text(compile_build(make(dtype, d, causal, **kw), arch).asm["cubin"]).encode()).hexdigest()


def _line(i: int) -> tuple[str, float]:
    t = time.time()
    try:
        h = sass_hash(i)
    except Exception as e:  # noqa: BLE001  (a build that fails is a line of the report, not the end of it)
        h = f"ERROR {type(e).__name__}: {str(e)[:200]}"
    return f"{label(i)}\t{h}", time.time() - t


def main():
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="sass_hashes_"))  # (before the first compile)
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    out, jobs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs) as ex:
            lines = list(ex.map(_line, range(len(BUILDS))))
    else:
        lines = [_line(i) for i in range(len(BUILDS))]
    for n, (line, dt) in enumerate(lines, 1):
        print(f"[{n}/{len(lines)}] {dt:.0f}s {line}")
    with open(out, "w") as f:
        f.write("\n".join(line for line, _ in lines) + "\n")
    print(f"{len(lines)} builds, {sum('ERROR' in line for line, _ in lines)} errors -> {out}")


if __name__ == "__main__":
    main()
