"""Variants of the sm_90a kernel (overlap techniques, pipeline depth, scheduler grouping), each timed
against cuDNN fp16 of the same shape in the same run.

Usage (GPU): PYTHONPATH=. python3 experiments/hopper_variants.py --set NAME --n-ctx N --out DIR (sets: SETS)
Writes variants.csv and variants.md: TFLOPS per (problem, variant), ratio to cuDNN fp16.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from gluon_attn.api import attention
from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.sweep import GateReference
from gluon_attn.bench.timing import DEFAULT_WARMUP_MS, benchmark
from gluon_attn.kernels.hopper import HopperConfig, default_config
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import check_accuracy

PLAIN = dict(PINGPONG=False, OVERLAP=False)
OVERLAP = dict(PINGPONG=False, OVERLAP=True)
PINGPONG = dict(PINGPONG=True, OVERLAP=True)


def ablation():
    """Overlap techniques x K/V ring depth (first H200 session)."""
    stages16 = {64: (2, 4), 128: (2,)}
    stages8 = {64: (2, 4), 128: (2, 3, 4)}
    for dtype, d, causal in [("fp16", 128, False), ("fp16", 128, True), ("fp16", 64, False), ("fp16", 64, True),
                             ("fp8e4m3", 128, False), ("fp8e4m3", 64, False)]:
        stages = (stages8 if dtype.startswith("fp8") else stages16)[d]
        variants = [(name, dict(knobs, KV_STAGES=st), None) for name, knobs in
                    (("plain (no overlap, no ping-pong)", PLAIN), ("+ intra-WG overlap", OVERLAP),
                     ("+ overlap + ping-pong", PINGPONG)) for st in stages]
        yield dtype, d, causal, variants


def followup():
    """Causal scheduler grouping (1 head vs L2-sized groups) and fp8 after the P relabelling."""
    for d in (128, 64):
        yield "fp16", d, True, [("head-major order (group=1)", dict(PINGPONG, KV_STAGES=2), 1),
                                ("L2-sized head groups", dict(PINGPONG, KV_STAGES=2), None),
                                ("L2-sized head groups, no ping-pong", dict(OVERLAP, KV_STAGES=2), None)]
    for d, causal in ((128, False), (128, True), (64, False)):
        yield "fp8e4m3", d, causal, [(name, dict(knobs, KV_STAGES=st), None)
                                     for name, knobs in (("+ intra-WG overlap", OVERLAP),
                                                         ("+ overlap + ping-pong", PINGPONG))
                                     for st in (2, 4)]


def epilogue():
    """O stored from registers, its staging shared memory given to deeper K/V rings (third session)."""
    grid = [("fp16", 128, False, [(2, True), (3, False)]), ("fp16", 128, True, [(2, True), (3, False)]),
            ("fp16", 64, False, [(4, True), (4, False), (6, False)]), ("fp16", 64, True, [(2, True), (4, False)]),
            ("fp8e4m3", 128, False, [(2, True), (4, False), (6, False)]),
            ("fp8e4m3", 128, True, [(4, True), (4, False)]), ("fp8e4m3", 64, False, [(2, True), (4, False)])]
    for dtype, d, causal, choices in grid:
        yield dtype, d, causal, [("TMA epilogue" if tma else "register epilogue",
                                  dict(OVERLAP, KV_STAGES=st, EPILOGUE_TMA=tma), None) for st, tma in choices]


def schedule():
    """Causal scheduler (fourth session): mirrored query-block pairs vs the grouped longest-first order,
    each on the class's tuned config."""
    for dtype, d in (("fp16", 128), ("fp16", 64), ("fp8e4m3", 128)):
        yield dtype, d, True, [("mirrored pairs", dict(PAIRS=True), None),
                               ("grouped, longest first", dict(PAIRS=False), None)]


def qstages():
    """One or two Q tiles per consumer (fourth session): can the loader run a tile ahead?"""
    for dtype, d, causal in (("fp16", 128, False), ("fp16", 128, True), ("fp16", 64, False), ("fp16", 64, True),
                             ("fp8e4m3", 128, False)):
        yield dtype, d, causal, [("Q double-buffered", dict(Q_STAGES=2), None),
                                 ("Q single", dict(Q_STAGES=1), None)]


def pcvt():
    """16-bit P packed by one paired convert per register, or per value (fourth session)."""
    for dtype, d, causal in (("fp16", 128, False), ("fp16", 128, True), ("fp16", 64, False), ("fp16", 64, True)):
        yield dtype, d, causal, [("paired convert", dict(PAIRED_CVT=True), None),
                                 ("per-value convert", dict(PAIRED_CVT=False), None)]


def fp8pack():
    """fp8 P packed next to its PV wgmma (from f16 pairs), or at the softmax's end as bytes (fifth session)."""
    for dtype, d, causal in (("fp8e4m3", 128, False), ("fp8e4m3", 128, True), ("fp8e4m3", 64, False),
                             ("fp8e4m3", 64, True)):
        yield dtype, d, causal, [("packed late (x4 converts)", dict(FP8_LATE_PACK=True), None),
                                 ("packed early (bytes)", dict(FP8_LATE_PACK=False), None)]


def consumers():
    """The class's tuned config against three consumer warpgroups (192-row tiles at 160 registers, FA3's
    tile for D=64), fifth session. The tuned config had two warpgroups when this set was first run
    (run 17); after the re-tune, fp16 D=64 non-causal and fp8 D=64 have three (run 24)."""
    three = dict(BLOCK_M=192, CONSUMER_REGS=160, EPILOGUE_TMA=True, Q_STAGES=2)
    grid = {("fp16", 64): [(64, 2, False), (64, 3, False), (64, 4, False), (64, 4, True)],
            ("fp16", 128): [(64, 2, False), (64, 2, True)],
            ("fp8e4m3", 64): [(128, 3, True), (128, 4, True), (64, 4, False)],
            ("fp8e4m3", 128): [(64, 3, False), (64, 4, False)]}
    for (dtype, d), tiles in grid.items():
        for causal in (False, True):
            yield dtype, d, causal, [("the class's tuned config", {}, None)] + [
                (f"three warpgroups BN{bn} S{st}{' pp' if pp else ''}",
                 dict(three, BLOCK_N=bn, KV_STAGES=st, PINGPONG=pp), None) for bn, st, pp in tiles]


def splitn():
    """Wider key blocks than a power of two (sixth session): 160 or 192 keys as two wgmmas per GEMM
    (FA3 runs D=128 non-causal at 176), 96 keys for the 192-row tile; against the class's tuned config.
    Only builds that compile without spills are listed (``inspect``): the causal D=128 ones spilled
    6-43 instructions (the mask's row bounds on top of the wider S)."""
    two = dict(BLOCK_M=128, CONSUMER_REGS=240, PINGPONG=False, EPILOGUE_TMA=True, Q_STAGES=2)
    three = dict(BLOCK_M=192, CONSUMER_REGS=160, PINGPONG=False, EPILOGUE_TMA=True, Q_STAGES=2)
    grid = {
        ("fp16", 128, False): [(two, 160, 2, dict(Q_STAGES=1)), (two, 160, 2, dict(EPILOGUE_TMA=False))],
        ("fp8e4m3", 128, False): [(two, 160, 4, {}), (two, 160, 3, {}), (two, 192, 3, {}),
                                  (two, 192, 4, dict(EPILOGUE_TMA=False))],
        ("fp16", 64, False): [(three, 96, 2, dict(PINGPONG=True)), (three, 96, 4, dict(PINGPONG=True)),
                              (three, 96, 4, {}), (two, 160, 3, {}), (two, 192, 3, {})],
        ("fp16", 64, True): [(two, 160, 3, {}), (three, 96, 4, {}), (three, 96, 2, dict(PINGPONG=True))],
        ("fp8e4m3", 64, False): [(two, 192, 4, {}), (two, 160, 4, {})],
    }
    for (dtype, d, causal), tiles in grid.items():
        yield dtype, d, causal, [("the class's tuned config", {}, None)] + [
            (f"{base['BLOCK_M'] // 64} WGs BN{bn} S{st}", dict(base, BLOCK_N=bn, KV_STAGES=st, **extra), None)
            for base, bn, st, extra in tiles]


def splitn_fp8():
    """fp8 D=128 non-causal with 192-key blocks, the one class 'splitn' found faster (N=16384), at
    more context lengths and with ping-pong."""
    two = dict(BLOCK_M=128, CONSUMER_REGS=240, EPILOGUE_TMA=True, Q_STAGES=2, BLOCK_N=192)
    yield "fp8e4m3", 128, False, [("the class's tuned config", {}, None)] + [
        (f"2 WGs BN192 S{st}{' pp' if pp else ''}", dict(two, KV_STAGES=st, PINGPONG=pp), None)
        for st, pp in ((3, False), (2, False), (3, True))]


def d64wide():
    """fp16 D=64 with 192 x 128 tiles (FA3's D=64 tile; three warpgroups at 160 registers), which the
    register estimate used to refuse: its spills (24 non-causal, 68-76 causal) sit in the per-tile
    code, none in the K/V loops (sixth session)."""
    three = dict(BLOCK_M=192, CONSUMER_REGS=160, EPILOGUE_TMA=True, Q_STAGES=2, BLOCK_N=128)
    for dtype, causal in (("fp16", False), ("fp16", True)):
        yield dtype, 64, causal, [("the class's tuned config", {}, None)] + [
            (f"3 WGs BN128 S{st}{' pp' if pp else ''}", dict(three, KV_STAGES=st, PINGPONG=pp), None)
            for st, pp in ((2, True), (2, False), (3, False), (4, False))]


def dynamic():
    """Units handed out by a global counter as programs free up (DYNAMIC) against the static
    pid + k x grid assignment, every class on its tuned config (seventh session: v18 found the run's end
    set by the spread between programs, not by its last round)."""
    for dtype in ("fp16", "fp8e4m3"):
        for d in (128, 64):
            for causal in (False, True):
                yield dtype, d, causal, [("the class's tuned config (static)", dict(DYNAMIC=False), None),
                                         ("dynamic scheduler", dict(DYNAMIC=True), None)]


def causal_dyn():
    """D=128 causal, the classes left short of their targets after v19: K/V ring depth and ping-pong
    under the dynamic scheduler (fp8), dynamic against static (fp16)."""
    yield "fp8e4m3", 128, True, [("the class's tuned config (dynamic, S2)", {}, None)] + [
        (f"dynamic S{st}{' pp' if pp else ''}", dict(DYNAMIC=True, KV_STAGES=st, PINGPONG=pp), None)
        for st, pp in ((3, False), (4, False), (2, True), (3, True))] + [
        ("static S2", dict(DYNAMIC=False), None)]
    yield "fp16", 128, True, [("the class's tuned config (static)", {}, None),
                              ("dynamic", dict(DYNAMIC=True), None),
                              ("dynamic pp", dict(DYNAMIC=True, PINGPONG=True), None)]


def longdyn():
    """16-bit classes at long contexts (N >= 16384), static against dynamic: causal_dyn saw fp16 D=128
    causal +5.5% dynamic at 32768 after -2.2% at 4096 (v19)."""
    for d in (128, 64):
        for causal in (True, False):
            yield "fp16", d, causal, [("the class's tuned config (static)", dict(DYNAMIC=False), None),
                                      ("dynamic", dict(DYNAMIC=True), None)]


def xlong16():
    """fp16 D=128 beyond 16384 keys (both modes 1.02-1.04x in runs 44-46): one Q tile per warpgroup and
    O stored from registers buy a third K/V stage; static and dynamic."""
    deeper = dict(Q_STAGES=1, KV_STAGES=3, EPILOGUE_TMA=False)
    for causal in (False, True):
        yield "fp16", 128, causal, [("the class's tuned config", {}, None),
                                    ("Q1 S3 register epilogue, static", dict(deeper, DYNAMIC=False), None),
                                    ("Q1 S3 register epilogue, dynamic", dict(deeper, DYNAMIC=True), None),
                                    ("dynamic" if not causal else "static", dict(DYNAMIC=not causal), None)]


def tree():
    """S's row max as a tree of independent FMNMX (ROW_TREE) against the dependent chain of
    ``gl.max``, every class on its tuned config (ncu, results/h200-run-54-ncu: fp8 D=128 has its
    tensor pipe, MUFU and issue slots each about half busy, so latency sets its speed)."""
    for dtype in ("fp16", "fp8e4m3"):
        for d in (128, 64):
            for causal in (False, True):
                yield dtype, d, causal, [("the class's tuned config", {}, None),
                                         ("row max as a tree", dict(ROW_TREE=True), None)]


def tree16():
    """fp16 D=128 non-causal, the one class 'tree' found faster (+1.7% at 8192, +1.2% at 16384; 1.046-1.048x
    at 8192 and 32768 in runs 51-53), at every long context length."""
    yield "fp16", 128, False, [("the class's tuned config", {}, None),
                               ("row max as a tree", dict(ROW_TREE=True), None)]


def xlong8():
    """fp8 D=128 beyond 16384 keys (runs 57-59: 1.49x at 32768 both modes, against 1.5): ring depth, the
    192-key split block (run 26 saw +5% at 32768 in a single round; run 50 -3% at 8192/16384) and the
    scheduler, against the class's tuned config (the long bucket's)."""
    yield "fp8e4m3", 128, False, [("the class's tuned config", {}, None)] + [
        (name, knobs, None) for name, knobs in (
            ("BN192 S3 dynamic", dict(BLOCK_N=192, KV_STAGES=3, DYNAMIC=True)),
            ("BN192 S3 static", dict(BLOCK_N=192, KV_STAGES=3, DYNAMIC=False)),
            ("S3 dynamic", dict(KV_STAGES=3)), ("S2 dynamic", dict(KV_STAGES=2)),
            ("S4 static", dict(DYNAMIC=False)), ("S4 dynamic pp", dict(PINGPONG=True)))]
    yield "fp8e4m3", 128, True, [("the class's tuned config", {}, None)] + [
        (name, knobs, None) for name, knobs in (
            ("S3 dynamic", dict(KV_STAGES=3)), ("S4 dynamic", dict(KV_STAGES=4)),
            ("S2 static", dict(DYNAMIC=False)), ("S2 dynamic pp", dict(PINGPONG=True)))]


def summma():
    """The row sums by a wgmma against a ones tile (SUM_MMA: 64 x 8 per block beside PV) instead of adds
    in the softmax: fp8 D=128's loop body 468 -> 416 instructions, with its issue slots ~half busy
    (results/h200-run-54-ncu). Against each class's tuned config (runs 66-67 also had the tree with it
    for fp8 D=128: 2-5% slower)."""
    for dtype, d, causal in (("fp8e4m3", 128, False), ("fp8e4m3", 128, True), ("fp8e4m3", 64, False),
                             ("fp8e4m3", 64, True), ("fp16", 64, False), ("fp16", 64, True)):
        yield dtype, d, causal, [("the class's tuned config", {}, None),
                                 ("row sums by wgmma", dict(SUM_MMA=True), None)]


def causal8():
    """fp8 D=128 causal once its table entry has SUM_MMA (run 68: +1.3/-1.1% at 8192/32768; run 69's
    sweep: 1.49x at 8192 against 1.5): ring depth, ping-pong, the static scheduler, and the entry
    without SUM_MMA."""
    yield "fp8e4m3", 128, True, [("the class's tuned config", {}, None), ("without SUM_MMA", dict(SUM_MMA=False), None),
                                 ("S3", dict(KV_STAGES=3), None), ("S4", dict(KV_STAGES=4), None),
                                 ("ping-pong", dict(PINGPONG=True), None), ("static", dict(DYNAMIC=False), None)]


def sum16():
    """fp16 D=128 at long contexts (runs 69, 71, 72: causal 1.045x at 32768 against 1.05): the row max as a
    tree for causal (run 55: +0.0/+0.2% at 8192/16384), and the row sums by wgmma, whose ones tiles fit
    beside one Q tile per warpgroup only (the class is tensor-pipe bound: the 64 x 8 wgmma adds 1/32
    to its GEMM work)."""
    yield "fp16", 128, True, [("the class's tuned config", {}, None), ("row max as a tree", dict(ROW_TREE=True), None),
                              ("row sums by wgmma, one Q tile", dict(SUM_MMA=True, Q_STAGES=1), None)]
    yield "fp16", 128, False, [("the class's tuned config", {}, None),
                               ("row sums by wgmma, one Q tile", dict(SUM_MMA=True, Q_STAGES=1), None)]


def tree16c():
    """fp16 D=128 causal, the row max as a tree once more (run 73 at 32768: +5.9% against a tuned cell whose
    rounds spread 16%; +0.6% at 16384; run 55: +0.0/+0.2% at 8192/16384)."""
    yield "fp16", 128, True, [("the class's tuned config", {}, None), ("row max as a tree", dict(ROW_TREE=True), None)]


def ones16():
    """fp16 D=128 with the row sums by wgmma and two Q tiles per consumer (one shared ones tile, 2 KB, now
    fits; run 73's one-Q-tile build lost 0.4-3.9%), the dynamic scheduler for causal once more (v20 at
    16384: 0.0%, before the tree), and fp16 D=64 causal's tuned entry (its SUM_MMA now reads the shared
    tile) against the entry without SUM_MMA."""
    yield "fp16", 128, False, [("the class's tuned config", {}, None), ("row sums by wgmma", dict(SUM_MMA=True), None)]
    yield "fp16", 128, True, [("the class's tuned config", {}, None), ("row sums by wgmma", dict(SUM_MMA=True), None),
                              ("dynamic scheduler", dict(DYNAMIC=True), None)]
    yield "fp16", 64, True, [("the class's tuned config", {}, None), ("without SUM_MMA", dict(SUM_MMA=False), None)]


def dyn16():
    """fp16 D=128 at 4096-16384, the two classes' tuned configs against the dynamic scheduler (run 78:
    causal -0.5/+2.2/+1.0% at 4096/8192/16384; v19-v20 before the tree: non-causal -1.6/-1.7/-1.0%, causal
    -2.2/-1.5/0.0%) and ping-pong turns (never more than noise in the first sessions' ablations)."""
    for causal in (False, True):
        yield "fp16", 128, causal, [("the class's tuned config", {}, None),
                                    ("dynamic scheduler", dict(DYNAMIC=True), None),
                                    ("ping-pong", dict(PINGPONG=True), None)]


def steady():
    """D=128 classes near their targets once timed at steady state (1 s warm-up per turn, run 88: fp16
    non-causal 1.047/1.068/1.058/1.049x, causal 1.048x at 32768, fp8 non-causal 1.500x at 8192): at the
    power limit speed follows energy per FLOP, so configs ranked with 25 ms warm-ups are ranked again.
    A variant equal to the tuned config (the knob already set in that N's bucket) is not timed twice."""
    yield "fp16", 128, False, [("the class's tuned config", {}, None), ("static", dict(DYNAMIC=False), None),
                               ("dynamic scheduler", dict(DYNAMIC=True), None),
                               ("row sums by wgmma", dict(SUM_MMA=True), None),
                               ("ping-pong", dict(PINGPONG=True), None),
                               ("64-key blocks, 4 stages", dict(BLOCK_N=64, KV_STAGES=4), None)]
    yield "fp16", 128, True, [("the class's tuned config", {}, None), ("static", dict(DYNAMIC=False), None),
                              ("dynamic scheduler", dict(DYNAMIC=True), None),
                              ("row sums by wgmma", dict(SUM_MMA=True), None),
                              ("ping-pong", dict(PINGPONG=True), None)]
    yield "fp8e4m3", 128, False, [("the class's tuned config", {}, None), ("static", dict(DYNAMIC=False), None),
                                  ("2 stages", dict(KV_STAGES=2), None), ("ping-pong", dict(PINGPONG=True), None),
                                  ("row max as a tree", dict(ROW_TREE=True), None)]


def energy():
    """Fewer shared-memory reads and instructions per key block, for energy per FLOP at the power limit
    (seventh session): Q held in registers (the S wgmma reads only K from shared memory) and lazy
    rescaling (O's 64 multiplies per block skipped while no row's max moves by more than 8 log2 units)."""
    yield "fp16", 128, False, [("the class's tuned config", {}, None), ("Q in registers", dict(Q_REGS=True), None),
                               ("lazy rescale", dict(LAZY_RESCALE=True), None),
                               ("Q in registers + lazy rescale", dict(Q_REGS=True, LAZY_RESCALE=True), None)]
    yield "fp16", 128, True, [("the class's tuned config", {}, None), ("lazy rescale", dict(LAZY_RESCALE=True), None)]
    yield "fp8e4m3", 128, False, [("the class's tuned config", {}, None), ("Q in registers", dict(Q_REGS=True), None),
                                  ("3 stages", dict(KV_STAGES=3), None), ("2 stages", dict(KV_STAGES=2), None)]


SETS = {"ablation": ablation, "followup": followup, "epilogue": epilogue, "schedule": schedule, "qstages": qstages,
        "pcvt": pcvt, "fp8pack": fp8pack, "consumers": consumers, "splitn": splitn,
        "splitn_fp8": splitn_fp8, "d64wide": d64wide, "dynamic": dynamic,
        "causal_dyn": causal_dyn, "longdyn": longdyn,
        "xlong16": xlong16, "tree": tree, "tree16": tree16, "xlong8": xlong8, "summma": summma,
        "causal8": causal8, "sum16": sum16, "tree16c": tree16c, "ones16": ones16,
        "dyn16": dyn16, "steady": steady, "energy": energy}
# Sets whose knobs adjust the class's tuned config (the others adjust HopperConfig()'s defaults).
TUNED_BASE = {"schedule", "qstages", "pcvt", "fp8pack", "consumers", "splitn", "splitn_fp8", "d64wide", "dynamic",
              "causal_dyn", "longdyn", "xlong16", "tree", "tree16", "xlong8", "summma", "causal8", "sum16", "tree16c",
              "ones16", "dyn16", "steady", "energy"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=list(SETS), default="ablation")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--warmup-ms", type=float, default=DEFAULT_WARMUP_MS,
                    help="warm-up per turn (at the power limit a turn inherits its predecessor's clock for "
                         "a few hundred ms: results/h200-run-87-warmup)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time cuDNN and every variant this many times, interleaved, and keep the medians")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype, d, causal, variants in SETS[args.set]():
        p = Problem(4, 32, args.n_ctx, d, causal, dtype)
        inputs = make_inputs(p, "cuda")
        gate = GateReference.compute(inputs)
        base16 = make_inputs(Problem(4, 32, args.n_ctx, d, causal, "fp16"), "cuda") if p.is_fp8 else inputs
        cudnn = get_provider("cudnn")
        fp8 = dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) \
            if p.is_fp8 else {}
        timed = []  # (variant name, config label, callable), each checked against the gate first
        for vname, knobs, group in variants:
            base = default_config(d, dtype, causal, args.n_ctx) if args.set in TUNED_BASE else HopperConfig()
            cfg = dataclasses.replace(base, **knobs)
            if cfg.invalid_reasons(d, dtype):
                continue
            label = cfg.label() + (f"_g{group}" if group else "")
            if any(label == other for _, other, _ in timed):
                continue  # the same build as a variant already taken

            def fn(cfg=cfg, group=group):
                return attention(inputs.q, inputs.k, inputs.v, causal=causal, config=cfg, head_group_size=group,
                                 **fp8)
            try:
                acc = check_accuracy(gate.select(fn()), gate.out, dtype)
            except Exception as exc:  # record and go on
                rows.append(dict(dtype=dtype, D=d, causal=causal, variant=vname, config=label,
                                 status=f"error: {type(exc).__name__}: {exc}"[:200]))
                continue
            if not acc.ok:
                rows.append(dict(dtype=dtype, D=d, causal=causal, variant=vname, config=label,
                                 status="wrong: " + acc.message))
                continue
            timed.append((vname, label, fn))
        def time_cudnn():
            with cudnn.context():
                return benchmark(cudnn.prepare(base16), warmup_ms=args.warmup_ms, rep_ms=args.rep_ms).p50_ms

        def timer(fn):
            return lambda: benchmark(fn, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms).p50_ms
        turns = [("cuDNN fp16", time_cudnn)] + [(vname, timer(fn)) for vname, _, fn in timed]
        times = {name: [] for name, _ in turns}
        # Interleaved rounds (clock drift between rounds hits every variant alike), the order turned by
        # one each round as the sweep's is: at the power limit a turn starts at its predecessor's clock.
        for r in range(args.rounds):
            k = r % len(turns)
            for name, run in turns[k:] + turns[:k]:
                times[name].append(run())
        cudnn_tf = p.tflops(float(np.median(times["cuDNN fp16"])))
        rows.append(dict(dtype=dtype, D=d, causal=causal, variant="cuDNN fp16", config="", tflops=cudnn_tf,
                         ratio=1.0, status="ok"))
        for vname, label, _ in timed:
            tf = p.tflops(float(np.median(times[vname])))
            spread = (max(times[vname]) - min(times[vname])) / min(times[vname])
            rows.append(dict(dtype=dtype, D=d, causal=causal, variant=vname, config=label, tflops=tf,
                             ratio=tf / cudnn_tf, round_spread=spread, status="ok"))
            print(f"{dtype} D={d} causal={causal} {vname} {label}: {tf:.1f} TFLOPS ({tf / cudnn_tf:.3f}x cuDNN)",
                  flush=True)
        del inputs, base16, gate
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    df.to_csv(out / "variants.csv", index=False)
    with open(out / "variants.md", "w") as f:
        f.write(f"Set '{args.set}': Z=4 H=32 N_CTX={args.n_ctx}, {torch.cuda.get_device_name()}, "
                f"median of {args.rounds} interleaved round(s) (order turned by one each round), "
                f"{args.warmup_ms:g} ms warm-up per turn\n\n")
        try:
            f.write(df.to_markdown(index=False, floatfmt=".3f"))
        except ImportError:  # tabulate missing
            f.write(df.to_string(index=False))
        f.write("\n")
    print(df.to_string(), file=sys.stderr)


if __name__ == "__main__":
    main()
