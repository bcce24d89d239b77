"""Clock, power and throughput per provider at steady state: each provider runs one problem back to back
for --seconds (after --warmup-s) while nvidia-smi samples the SM clock and board power every 50 ms;
providers take turns, --rounds times, the order turning by one each round. Prints, per provider, the
median over rounds of TFLOPS, mean SM clock, mean power and joules per PFLOP; writes the samples, the
windows and env.json to --out. At the power limit the clock follows energy per FLOP: a kernel that draws more
watts per TFLOP runs at a lower clock, which a short benchmark turn hides and a sustained one shows.
Every provider passes the sweep's accuracy gate first (a failing one is reported and left out). Sustained windows
of one kernel agree within ~0.5% where the sweep's 100 ms turns spread 3-4% on an H100 (NOTES v50), so with
--copies (before_after.py's copies of earlier commits) this is also the finer A/B.

Usage: PYTHONPATH=. python3 experiments/power_probe.py --providers gluon,fa4,cudnn-fe --h-kv 8 --causal --out DIR
       PYTHONPATH=.:.before python3 experiments/power_probe.py --copies main --providers gluon,gluon-main,fa4 ...
       PYTHONPATH=. python3 experiments/power_probe.py --varlen longtail -Z 1 --n-ctx 65536 --causal ...
       PYTHONPATH=. python3 experiments/power_probe.py --register fa4_tiles --providers gluon,fa4,fa4-m64 --pass bwd ...
"""
import argparse
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
import torch

from gluon_attn.bench.environment import write_env
from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.sweep import GateReference, gate_cell
from gluon_attn.problem import Problem, make_inputs


def sustained(call, seconds: float):
    """Calls run back to back for ``seconds``: (start, end, number of calls), timed by CUDA events."""
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.time()
    start_ev.record()
    n = 0
    while time.time() - t0 < seconds:
        for _ in range(8):
            call()
        n += 8
        torch.cuda.synchronize()
    end_ev.record()
    torch.cuda.synchronize()
    return t0, time.time(), n, start_ev.elapsed_time(end_ev)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", default="gluon,fa4")
    ap.add_argument("-Z", type=int, default=4)
    ap.add_argument("-H", type=int, default=32)
    ap.add_argument("--h-kv", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-v", type=int, default=None, help="v's head dim (default: --head-dim)")
    ap.add_argument("--n-kv", type=int, default=None, help="keys per head (default: --n-ctx)")
    ap.add_argument("--varlen", default=None, help="a packed batch of --n-ctx tokens in this length mix (-Z 1)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--pass", dest="pass_name", default="fwd")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--copies", default="", help="before_after.py copies to register (providers gluon-NAME)")
    ap.add_argument("--register", default="", help="modules of this folder whose import registers more providers "
                                                   "(fa4_tiles: fa4-m64)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.copies or args.register:
        from before_after import register_providers  # (this script's folder is on the path)
        register_providers(args.copies, args.register)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_env(out / "env.json", sys.argv)  # (the GPU, driver, versions and peers each window was taken with)
    problem = Problem(args.Z, args.H, args.n_ctx, args.head_dim, args.causal, args.dtype, HEAD_DIM_V=args.head_dim_v,
                      H_KV=args.h_kv, N_KV=args.n_kv, varlen=args.varlen, pass_name=args.pass_name)
    inputs = make_inputs(problem)
    gate = GateReference.compute(inputs)
    calls = {}
    for n in args.providers.split(","):
        row, call = gate_cell(problem, n, inputs, gate, torch.cuda.get_device_capability())
        if call is None:
            print(f"  {n}: {row['status']}: {row.get('message', '')}")
        else:
            calls[n] = call
    names = list(calls)
    if not names:
        raise SystemExit("no provider passed the accuracy gate: nothing to time")
    smi_path = out / "smi.csv"
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=open(smi_path, "w"))
    windows = []
    try:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                with get_provider(n).context():
                    sustained(calls[n], args.warmup_s)
                    t0, t1, count, ms = sustained(calls[n], args.seconds)
                windows.append(dict(round=r, provider=n, t0=t0, t1=t1, tflops=problem.tflops(ms / count)))
    finally:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
    samples = pd.read_csv(smi_path, names=["ts", "clock", "power", "temp"], skipinitialspace=True)
    # nvidia-smi prints local time; a naive datetime's timestamp() reads it as local time too (epoch seconds).
    samples["t"] = [datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp() for ts in samples.ts]
    rows = []
    for w in windows:
        s = samples[(samples.t >= w["t0"]) & (samples.t <= w["t1"])]
        rows.append({**w, "clock_mhz": s.clock.mean(), "power_w": s.power.mean(), "temp_c": s.temp.mean(),
                     "samples": len(s)})
    df = pd.DataFrame(rows)
    df["j_per_pflop"] = df.power_w / df.tflops * 1e3
    df.to_csv(out / "windows.csv", index=False)
    print(f"{problem.label()}: median over {args.rounds} rounds of {args.seconds:.0f} s sustained")
    for n in names:
        g = df[df.provider == n]
        print(f"  {n:10s} {statistics.median(g.tflops):7.1f} TFLOPS  {statistics.median(g.clock_mhz):6.0f} MHz  "
              f"{statistics.median(g.power_w):5.0f} W  {statistics.median(g.j_per_pflop):6.1f} J/PFLOP  "
              f"({int(g.samples.min())}+ samples per window)")


if __name__ == "__main__":
    main()
