#!/usr/bin/env bash
# Tuning run for the sm_90a table (gluon_attn/tuning/sm_90a.json): optimize every seed-grid class at
# N_CTX=8192 over the focused space, then record kernel traces for the profile view's test fixture.
# Usage (GPU, from the tree): experiments/tune_hopper.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=$1; mkdir -p "$out"
python3 -m gluon_attn.cli env --json > "$out/env.json"
for dtype in fp16 fp8e4m3; do for d in 64 128; do for c in --no-causal --causal; do
  python3 -m gluon_attn.cli optimize --dtype $dtype --head-dim $d $c --n-ctx 8192 --format md --rep-ms 60 \
    2>/dev/null | tee -a "$out/optimize.md"
done; done; done
cp gluon_attn/tuning/sm_90a.json "$out/sm_90a.json"
for p in gluon cudnn fa2 flex; do
  python3 -m gluon_attn.cli profile --provider $p --n-ctx 4096 --head-dim 128 --causal --format md \
    --save-events "$out/trace-$p.json" | tee -a "$out/profile.md"
done
