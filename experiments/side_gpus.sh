#!/usr/bin/env bash
# One call on a host of 4 GPUs, after `gpu_run.sh stash triton peers` has unpacked Triton and the peers: GPU 0 runs
# the multi phase (its one-GPU sweep: MULTI_GPUS=1, MULTI_* as given), while GPUs 1-3 run neighborhood-attention
# work of their own (each a gpu_run.sh pinned to one GPU by CUDA_VISIBLE_DEVICES, stopped after SIDE_TIMEOUT s):
#   GPU 1: the neighborhood GPU tests;
#   GPU 2: the 3-D targets' problem (NATTEN's 30x48x80, window 18x24x24, strides 1 and (16,8,8)) against dense and
#          Flex, then FA4 with the same mask in a run of its own (a crash there cannot take the others' rows);
#   GPU 3: na1d's backward against the dense backward (graph-timed), then FA4 with the mask in 1-D and 2-D.
# Each job's output is one archive in OUT (a call brings back 8 files). The wall time of GPU 0's sweep shares the
# host's CPUs (64 cores) with these jobs.
# Usage: experiments/side_gpus.sh OUT
set -u
cd "$(dirname "$0")/.."
out=$1; mkdir -p "$out"; o=/tmp/side; rm -rf "$o"; mkdir -p "$o"
run="experiments/gpu_run.sh triton peers"
t=${SIDE_TIMEOUT:-470}
common="--head-dim 128 --dtype bf16 --rounds 3 --warmup-ms 500 --quiet"
l1="--token-layout 32768 --window 2048 --stride 1;256;2048 -Z 1 -H 1 $common"
l2="--token-layout 256x256 --window 80x80 --stride 1;16x16 -Z 1 -H 24 $common"
l3="--token-layout 30x48x80 --window 18x24x24 --stride 1;16x8x8 -Z 1 -H 24 $common"
(CUDA_VISIBLE_DEVICES=1 TEST_FILES=tests/test_neighborhood_gpu.py TEST_TIMEOUT=$((t - 20)) \
  timeout -k 10 "$t" $run tests -- "$o/tests" > "$o/tests.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=2 NA_TIMEOUT=330 NA_RUNS="na-3d=$l3 --providers gluon,flex,dense-gluon,dense-cudnn,dense-fa4 \
// na-3d-fa4=$l3 --providers gluon,fa4,dense-fa4" timeout -k 10 "$t" $run na -- "$o/na3" > "$o/na3.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=3 NA_TIMEOUT=200 NA_RUNS="na-1d-bwd=$l1 --pass bwd --timing graph \
--providers gluon,dense-gluon,dense-fa4,dense-cudnn,flex // na-1d-fa4=$l1 --timing graph --providers gluon,fa4,dense-fa4 \
// na-2d-fa4=$l2 --providers gluon,fa4,dense-fa4" timeout -k 10 "$t" $run na -- "$o/na13" > "$o/na13.log" 2>&1) &
CUDA_VISIBLE_DEVICES=0 MULTI_GPUS=1 CP_RANKS= MULTI_TIMEOUT=${MULTI_TIMEOUT:-$((t - 10))} $run multi -- "$o/multi"
wait
for d in tests na3 na13 multi; do tar -czf "$out/$d.tgz" -C "$o" "$d" $(cd "$o" && ls "$d".log 2>/dev/null); done
tail -3 "$o"/*.log; cat "$o/multi/multi/wall.txt" 2>/dev/null
