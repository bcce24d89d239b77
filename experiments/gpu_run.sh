#!/usr/bin/env bash
# One device session's work, from the tree (nothing installed). Usage:
#   experiments/gpu_run.sh PHASE... -- OUT_DIR
# Phases: tests (GPU tests, killed after TEST_TIMEOUT s), host (host time per call),
#         variants (VARIANTS set at each N in VARIANT_N, VARIANT_ROUNDS interleaved rounds),
#         tune (optimize each class in TUNE_CLASSES, "dtype:D:causal|no-causal", at TUNE_N; the table
#         is written to gluon_attn/tuning/sm_90a.json, which later phases use, and copied to OUT),
#         sweep (SWEEP_SPEC, default the seed table: cuDNN, FA2, gluon at every N; Flex at 4096 and 16384).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
phases=()
while [ "$1" != "--" ]; do phases+=("$1"); shift; done
out=$2; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$out/gpu.txt"
python3 -m gluon_attn.cli env --json > "$out/env.json" 2>/dev/null
for phase in "${phases[@]}"; do
  echo "=== $phase $(date +%T)"
  case "$phase" in
    tests)
      timeout "${TEST_TIMEOUT:-600}" python3 -m pytest -q -m gpu -n 8 tests 2>&1 | tee "$out/gpu-tests.log" | tail -15 ;;
    host)
      python3 experiments/profile_hopper.py > "$out/host-profile.txt" 2>&1; grep "us/call" "$out/host-profile.txt" ;;
    variants)
      for n in ${VARIANT_N:-8192}; do
        python3 experiments/hopper_variants.py --set "${VARIANTS:-schedule}" --n-ctx "$n" --out "$out/variants-$n" \
          --rounds "${VARIANT_ROUNDS:-1}" \
          2>&1 | grep -v "^ " | tail -20
      done ;;
    tune)
      for cls in ${TUNE_CLASSES:-fp16:64:no-causal fp16:64:causal fp16:128:no-causal fp16:128:causal}; do
        IFS=: read -r dtype d mode <<< "$cls"
        python3 -m gluon_attn.cli optimize --dtype "$dtype" --head-dim "$d" --$mode --n-ctx "${TUNE_N:-8192}" \
          --rounds 2 --rep-ms 60 --format md 2>/dev/null | tee -a "$out/optimize.md" | grep -E "^best|^\*\*"
      done
      cp gluon_attn/tuning/sm_90a.json "$out/sm_90a.json" ;;
    sweep)
      spec=${SWEEP_SPEC:-experiments/seed-table.toml}
      python3 -m gluon_attn.cli sweep --experiment "$spec" --providers cudnn,fa2,gluon --out "$out/sweep" --quiet \
        2>&1 | tail -5
      python3 -m gluon_attn.cli sweep --experiment "$spec" --providers flex --n-ctx 4096,16384 --out "$out/sweep" \
        --resume --quiet 2>&1 | tail -3
      cat "$out/sweep/tables.md" ;;
  esac
done
echo "=== done $(date +%T)"
