#!/usr/bin/env bash
# Does a cell's ratio depend on the board's thermal/power state? Times one seed-sweep cell cold, then
# after a warm-up of sustained load (gluon and cuDNN at N_CTX=65536), then again, with nvidia-smi
# logging clocks, power and temperature every 0.5 s. Usage: experiments/heat_probe.sh OUT [N_CTX] [HEAT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=$1; n=${2:-8192}; heat=${3:-90}
mkdir -p "$out"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv -lms 500 > "$out/smi-log.csv" & smi=$!
cell() {
  echo "=== $1 $(date +%T)" >> "$out/marks.txt"
  python3 -m gluon_attn.cli sweep --n-ctx "$n" --head-dim 128 --causal false --dtype fp16,fp8e4m3 \
    --providers cudnn,fa2,gluon --rounds 3 --quiet --out "$out/$1" > /dev/null 2>&1
  python3 -c "
import pandas as pd; d = pd.read_csv('$out/$1/rows.csv'); d = d[d.dtype == 'fp16']
g, c = (d[d.provider == p].tflops.iloc[0] for p in ('gluon', 'cudnn'))
print('$1: gluon %.1f cuDNN %.1f TFLOPS, ratio %.3f' % (g, c, g / c))" | tee -a "$out/marks.txt"
}
cell cold
echo "=== heat $(date +%T)" >> "$out/marks.txt"
python3 - "$heat" <<'PY'
import sys, time
from gluon_attn.bench.providers import get_provider
from gluon_attn.problem import Problem, make_inputs
import torch
inputs = make_inputs(Problem(4, 32, 65536, 128, False, "fp16"), "cuda")
fns = []
for name in ("gluon", "cudnn"):
    p = get_provider(name)
    with p.context():
        fns.append((p, p.prepare(inputs)))
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for p, fn in fns:
        with p.context():
            fn()
    torch.cuda.synchronize()
PY
cell hot
cell hot-again
kill $smi
