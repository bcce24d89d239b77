#!/usr/bin/env bash
# One device session's work, from the tree (nothing installed): GPU tests, the variant ablation, the
# sweep. Usage: experiments/gpu_run.sh check|sweep OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
phase=$1; out=$2; mkdir -p "$out"
case "$phase" in
  check)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -m gluon_attn.cli env >> "$out/gpu.txt"
    python3 -m pytest -q -m gpu -n 8 tests 2>&1 | tee "$out/gpu-tests.log" | tail -40
    python3 experiments/hopper_variants.py --set "${VARIANTS:-followup}" --out "$out" 2>&1 | tail -40
    ;;
  sweep)
    python3 -m gluon_attn.cli sweep --experiment experiments/hopper-targets.toml --out "$out/sweep" --quiet \
      2>&1 | tail -120
    ;;
esac
