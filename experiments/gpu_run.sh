#!/usr/bin/env bash
# One device session's work, from the tree (nothing installed). Usage:
#   experiments/gpu_run.sh PHASE... -- OUT_DIR
# The phases run in one shell, in the order given: what one exports (PYTHONPATH) the later ones see.
# Carried files live in the ignored folder .carry/ (docs/usage.md, "Triton 3.9 on the GPU machines" and "Peers"):
# a call carries at most 64 MiB and a warm machine keeps /tmp for ~30 s between calls, so the halves of an
# archive come in calls back to back, each running `stash`.
# Phases: stash (copy what this call carries into /tmp: .carry/triton39/part.* to /tmp/tritonstash, the peer
#           archives of .carry/peers*/ to /tmp/peerstash; or both as a bundle in fewer calls, .carry/bundle*/:
#           experiments/carry_bundle.sh),
#         triton (unpack /tmp/tritonstash, both halves, into /tmp/triton once and put it first on PYTHONPATH:
#           the image's triton 3.6.0 cannot build the kernels; prints the triton imported, rewrites OUT/env.json),
#         peers (unpack /tmp/peerstash into /tmp/peers once, put it on PYTHONPATH, list the providers),
#         tests (GPU tests, killed after TEST_TIMEOUT s; TEST_FILES to run only some),
#         host (host time per call; HOST_ARGS for experiments/profile_hopper.py, e.g. --na),
#         host-study (the sweeps of experiments/host/*.toml (HOST_SPECS) and, unless HOST_NA=0, na1d/na2d/na3d with
#           windows 3-33 against Flex: host_us and eager_us per call, into OUT/host),
#         generate (experiments/generate_bench.py: HF generate, gluon against sdpa, GEN_ARGS; OUT/generate),
#         train (experiments/train_check.py: a small Llama-style model trained with our attention and with
#           SDPA, TRAIN_STEPS steps; losses, plot and summary into OUT/train-check),
#         views (profile --backprop and optimize --pass bwd of fp16 D=128 causal, into OUT/views),
#         tune (optimize each class in TUNE_CLASSES, "dtype:D:causal|no-causal[:fwd|bwd[:NAME+NAME...]]" (only the
#           named configs), at TUNE_N; the table
#           is written to gluon_attn/tuning/sm_90a.json, which later phases use, and copied to OUT),
#         sweep (SWEEP_SPEC, one or more specs, default the seed table, with their providers or
#           SWEEP_PROVIDERS, and with SWEEP_FLEX=1 Flex at 4096 and 16384, into SWEEP_DIR (kept in /tmp
#           between calls on a warm machine: a second call with the same SWEEP_DIR resumes), stopped after
#           SWEEP_TIMEOUT s or at SWEEP_DEADLINE (epoch seconds, so that a call of several phases can end
#           inside its limit; SWEEP_ARGS: more sweep options, e.g. --rounds 2); rows.csv, env.json and tables.md
#           land in OUT/sweep),
#         triton-ab (the package under the old pin, .carry/base36 with the image's triton 3.6.0, against today's
#           under the carried one: rounds AB_FIRST..AB_ROUNDS of alternating sweeps of gluon and cuDNN over
#           AB_SPECS; OUT/ab; make the copy with `git archive 3d58aff gluon_attn | tar -x -C .carry/base36`),
#         multi (a multi-GPU host: one sweep on 1 GPU and on more (MULTI_GPUS), wall times from cold caches; ring
#           attention by sweep --cp over CP_RANKS ranks: OUT/multi),
#         na (sweep --na, NA_ARGS or several runs in NA_RUNS (or NA_RUNS_FILE, a run a line: experiments/*.runs);
#           default NATTEN's 1-D case against dense and Flex: OUT/na),
#         tree-ab (an older tree against this one: experiments/na_tree_ab.py, the small-window problems' default
#           calls graph-timed, under TREE_AB_OLD (default .carry/old: `git archive COMMIT gluon_attn | tar -x -C
#           .carry/old` and a copy of the script there) and under this tree, TREE_AB_ROUNDS rounds (default 2) taking
#           turns, TREE_AB_ONLY for its --only: OUT/tree-ab.jsonl and tree-ab.md),
#         bwd-parity (the backward before its refactor against today's, same Triton: OUT/bwd-parity.md),
#         ncu (Nsight Compute on the backward kernels of NCU_PROVIDERS: OUT/ncu.tgz, see the phase),
#         ncu-na (Nsight Compute on the forward kernel of each na_tree_ab.py problem named in NCU_NA (default
#           "56x56 3x3x3 128x128"): the sections' details, the raw metrics and the stall reasons per SASS line as CSVs
#           in OUT/ncu-na.tgz, the stall summary printed),
#         branches (the GPU tests of the branch trees carried in .carry/br-*/, each as its GPU_TESTS file names
#           them: experiments/carry_branches.sh --tests; OUT/branches/NAME.log),
#         pack (last: everything under OUT_DIR into OUT_DIR.tgz, the folder removed: a call brings back only a few
#           files of $OUT, run 227 lost three sweeps' rows.csv that way).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
# NCCL's NVLink multicast stays off on these machines (ring attention, sweep --cp)
export NCCL_NVLS_ENABLE=0
phases=()
while [ "$1" != "--" ]; do phases+=("$1"); shift; done
out=$2; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$out/gpu.txt"
python3 -m gluon_attn.cli env --json > "$out/env.json" 2>/dev/null
for phase in "${phases[@]}"; do
  echo "=== $phase $(date +%T)"
  case "$phase" in
    stash)
      carried=0
      if compgen -G ".carry/triton39/part.*" > /dev/null; then
        mkdir -p /tmp/tritonstash && cp .carry/triton39/part.* /tmp/tritonstash/ && carried=1
      fi
      if compgen -G ".carry/peers*/*" > /dev/null; then
        mkdir -p /tmp/peerstash && cp .carry/peers*/* /tmp/peerstash/ && carried=1
      fi
      # .carry/bundle*/bundle-ofK.NN: K parts of one tar of both (paths tritonstash/... and peerstash/...), cut
      # in parts as large as a call carries; once the K parts are stashed, they are unpacked into /tmp.
      if compgen -G ".carry/bundle*/bundle-of*" > /dev/null; then
        mkdir -p /tmp/bundlestash && cp .carry/bundle*/bundle-of* /tmp/bundlestash/ && carried=1
        first=$(ls /tmp/bundlestash | head -1); k=${first#bundle-of}; k=${k%%.*}
        if [ "$(ls /tmp/bundlestash | wc -l)" = "$k" ]; then
          cat /tmp/bundlestash/bundle-of* | tar -x -C /tmp && rm -rf /tmp/bundlestash && echo "stash: bundle unpacked"
        fi
      fi
      [ "$carried" = 1 ] || echo "stash: nothing carried in .carry/triton39/, .carry/peers*/ or .carry/bundle*/"
      ls -l /tmp/tritonstash /tmp/peerstash 2>/dev/null ;;
    triton)
      if [ ! -f /tmp/triton/.done ]; then
        if [ -f /tmp/tritonstash/part.00 ] && [ -f /tmp/tritonstash/part.01 ]; then
          mkdir -p /tmp/triton && cat /tmp/tritonstash/part.* | xz -dc -T0 | tar -x -C /tmp/triton \
            && touch /tmp/triton/.done
        else
          echo "triton: /tmp/tritonstash lacks part.00 or part.01 (stash both halves first)"
        fi
      fi
      export PYTHONPATH=/tmp/triton:$PYTHONPATH
      python3 -c "import triton; print(triton.__version__, triton.__file__)"
      python3 -m gluon_attn.cli env --json > "$out/env.json" 2>/dev/null ;;
    peers)
      if [ ! -f /tmp/peers/.done ]; then
        mkdir -p /tmp/peers
        xz -dc /tmp/peerstash/rest.tar.xz | tar -x -C /tmp/peers \
          && cat /tmp/peerstash/cu13.part.* | xz -dc | tar -x -C /tmp/peers \
          && { [ ! -f /tmp/peerstash/tf.tar.xz ] || xz -dc /tmp/peerstash/tf.tar.xz | tar -x -C /tmp/peers; } \
          && touch /tmp/peers/.done
      fi
      # pip --target leaves cutlass-dsl's .pth unprocessed: its dsl_packages go on the path by hand.
      # (appended: a triton put first by the triton phase stays first)
      export PYTHONPATH=$PYTHONPATH:/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages
      # FA4 keeps its compiled kernels on disk, so a second call on the same machine reuses them.
      export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
      python3 -m gluon_attn.cli providers --format md | tee "$out/providers.md" ;;
    tests)
      timeout "${TEST_TIMEOUT:-600}" python3 -m pytest -q -m gpu -n "${TEST_WORKERS:-8}" ${TEST_FILES:-tests} 2>&1 \
        | tee "$out/gpu-tests.log" | tail -15 ;;
    train)
      timeout "${TRAIN_TIMEOUT:-300}" python3 experiments/train_check.py --steps "${TRAIN_STEPS:-300}" \
        --out "$out/train-check" 2>&1 | tail -4 ;;
    views)
      mkdir -p "$out/views"
      python3 -m gluon_attn.cli profile --backprop -Z 2 -H 16 --n-ctx 4096 --head-dim 128 --causal --format md \
        > "$out/views/profile-backprop.md" 2>&1; head -20 "$out/views/profile-backprop.md"
      python3 -m gluon_attn.cli optimize --pass bwd -Z 4 -H 32 --n-ctx 8192 --head-dim 128 --causal --rounds 2 \
        --rep-ms 60 --format md --out /tmp/optimize-bwd > "$out/views/optimize-bwd.md" 2>&1
      tail -8 "$out/views/optimize-bwd.md" ;;
    host-study)
      # results/targets-h200/host/: the small and decode shapes' host and end-to-end eager time per call
      mkdir -p "$out/host"
      for spec in ${HOST_SPECS:-experiments/host/*.toml}; do
        name=$(basename "$spec" .toml)
        timeout "${HOST_TIMEOUT:-300}" python3 -m gluon_attn.cli sweep --experiment "$spec" --out "$out/host/$name" \
          --quiet > "$out/host/$name.log" 2>&1; echo "$name rc=$?"
      done
      [ "${HOST_NA:-1}" = 1 ] || continue  # (HOST_NA=0: the specs only, not the neighborhood sweeps)
      na=(--na --providers "${NA_HOST_PROVIDERS:-gluon,flex,dense-gluon}" --dtype fp16 --head-dim 64 --rounds 1 --rep-ms 25
          --warmup-ms 25)
      timeout "${NA_TIMEOUT:-300}" python3 -m gluon_attn.cli sweep "${na[@]}" --token-layout 4096 --window "${NA1_WINDOWS:-3;7;13;33}" -Z 4 -H 8 \
        --out "$out/host/na1d" > "$out/host/na1d.log" 2>&1; echo "na1d rc=$?"
      timeout "${NA_TIMEOUT:-300}" python3 -m gluon_attn.cli sweep "${na[@]}" --token-layout 64x64 --window '3x3;7x7;13x13;33x33' \
        -Z 4 -H 8 --out "$out/host/na2d" > "$out/host/na2d.log" 2>&1; echo "na2d rc=$?"
      timeout "${NA_TIMEOUT:-300}" python3 -m gluon_attn.cli sweep "${na[@]}" --token-layout 16x16x16 --window '3x3x3;5x5x5;9x9x9' \
        -Z 2 -H 8 --out "$out/host/na3d" > "$out/host/na3d.log" 2>&1; echo "na3d rc=$?" ;;
    generate)
      timeout "${GEN_TIMEOUT:-500}" python3 experiments/generate_bench.py --out "$out/generate" ${GEN_ARGS:-} \
        > "$out/generate.log" 2>&1; echo "generate rc=$?"; tail -12 "$out/generate.log" ;;
    host)
      python3 experiments/profile_hopper.py ${HOST_ARGS:-} > "$out/host-profile.txt" 2>&1; grep "us/call" "$out/host-profile.txt" ;;
    tune)
      for cls in ${TUNE_CLASSES:-fp16:64:no-causal fp16:64:causal fp16:128:no-causal fp16:128:causal}; do
        IFS=: read -r dtype d mode pass names <<< "$cls"
        only=(); [ -n "${names:-}" ] && only=(--configs "${names//+/,}")
        python3 -m gluon_attn.cli optimize --dtype "$dtype" --head-dim "$d" --$mode --pass "${pass:-fwd}" \
          --n-ctx "${TUNE_N:-8192}" "${only[@]}" --rounds 2 --rep-ms 60 --format md --out "$out/tune" --install \
          2>/dev/null | tee -a "$out/optimize.md" | grep -E "^best|^error"
      done
      cp gluon_attn/tuning/sm_90a.json "$out/sm_90a.json" ;;
    sweep)
      dir=${SWEEP_DIR:-/tmp/sweep}
      deadline=${SWEEP_DEADLINE:-$(( $(date +%s) + ${SWEEP_TIMEOUT:-100000} ))}
      left() { echo $(( deadline - $(date +%s) )); }
      # SWEEP_SPEC may name several specs: their rows go into one folder (each resumes the same rows.csv).
      for spec in ${SWEEP_SPEC:-experiments/seed-table.toml}; do
        [ "$(left)" -gt 0 ] || break
        providers=()
        [ -n "${SWEEP_PROVIDERS:-}" ] && providers=(--providers "$SWEEP_PROVIDERS")
        timeout "$(left)" python3 -m gluon_attn.cli sweep --experiment "$spec" "${providers[@]}" --out "$dir" \
          --resume --quiet ${SWEEP_ARGS:-} 2>&1 | tail -5
        if [ "${SWEEP_FLEX:-0}" = 1 ] && [ "$(left)" -gt 0 ]; then
          timeout "$(left)" python3 -m gluon_attn.cli sweep --experiment "$spec" --providers flex \
            --n-ctx 4096,16384 --out "$dir" --resume --quiet 2>&1 | tail -3
        fi
      done
      # At most 8 files come back from a call: the plots are redrawn from rows.csv (`gluon-attn plot`).
      mkdir -p "$out/sweep" && cp "$dir"/{rows.csv,env.json,tables.md} "$out/sweep/"
      cat "$dir/tables.md" ;;
    triton-ab)
      # The package under the old pin (a copy of its tree in .carry/base36, run with the image's triton 3.6.0)
      # against today's (PYTHONPATH as the triton phase left it): rounds AB_FIRST..AB_ROUNDS of sweeps, old then new, of
      # gluon and cuDNN over AB_SPECS at AB_WARMUP_MS, then experiments/triton_ab.py compares them (OUT/ab).
      # (Each side runs from its own tree's folder: python -m puts the working directory first on sys.path.)
      dir=${AB_DIR:-/tmp/ab}; root=$(pwd); new_path=$(echo "$PYTHONPATH" | sed "s#\(^\|:\)\.\(:\|$\)#\1$root\2#")
      for r in $(seq "${AB_FIRST:-1}" "${AB_ROUNDS:-2}"); do
        for side in old new; do
          if [ "$side" = old ]; then tree=$root/.carry/base36; path=$tree; else tree=$root; path=$new_path; fi
          for spec in ${AB_SPECS:-experiments/hopper-targets.toml experiments/gqa.toml experiments/backward.toml}; do
            (cd "$tree" && PYTHONPATH=$path python3 -m gluon_attn.cli sweep --experiment "$root/$spec" \
              --providers gluon,cudnn --rounds 1 --warmup-ms "${AB_WARMUP_MS:-300}" --out "$dir/$side-r$r" \
              --resume --quiet 2>&1 | tail -1)
          done
          (cd "$tree" && PYTHONPATH=$path python3 -c "import gluon_attn, triton; print('$side', triton.__version__, gluon_attn.__file__)")
        done
      done
      mkdir -p "$out/ab" && python3 experiments/triton_ab.py "$dir" > /dev/null && cp "$dir"/ab.{md,csv} "$out/ab/"
      head -30 "$out/ab/ab.md" ;;
    multi)
      # A multi-GPU host: the same sweep (MULTI_SPEC, MULTI_PROVIDERS, MULTI_ARGS) on each GPU count in MULTI_GPUS
      # (default 1 and all; sweep --gpus), each from cold caches of its own (Triton's, FA4's: the one-GPU run and
      # the N-GPU run both compile), wall times into OUT/multi/wall.txt; then ring attention (sweep --cp) over each
      # rank count in CP_RANKS (default all) on CP_ARGS: OUT/multi. An empty MULTI_GPUS or CP_RANKS skips that part.
      mkdir -p "$out/multi"; n=$(nvidia-smi -L | wc -l)
      spec=${MULTI_SPEC:-experiments/hopper-targets.toml}; prov=${MULTI_PROVIDERS:-gluon,cudnn-fe,fa4}
      # MULTI_TIMEOUT stops a run (SIGINT: the parent kills its workers) so that a call ends inside its limit; the next
      # call on the warm machine with MULTI_RESUME=1 continues it from its rows, caches kept, and wall.txt gets a
      # line per part (a run's wall time is the sum of its parts; a resumed part pays the start-up again).
      for g in ${MULTI_GPUS-1 $n}; do
        t0=$(date +%s); resume=()
        if [ "${MULTI_RESUME:-0}" = 1 ] && [ -d "/tmp/multi-$g" ]; then resume=(--resume)
        else rm -rf "/tmp/multi-$g" "/tmp/tcache-$g" "/tmp/fcache-$g"; fi
        TRITON_CACHE_DIR=/tmp/tcache-$g FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fcache-$g \
          timeout -s INT -k 20 "${MULTI_TIMEOUT:-100000}" python3 -m gluon_attn.cli sweep --experiment "$spec" \
          --providers "$prov" --gpus "$g" --quiet ${MULTI_ARGS:-} "${resume[@]}" --out "/tmp/multi-$g" 2>&1 | tail -1
        rc=${PIPESTATUS[0]}; pkill -f -- "--out /tmp/multi-$g/gpu-" && sleep 2
        echo "gpus=$g wall_s=$(( $(date +%s) - t0 ))${resume:+ resumed}$([ "$rc" = 124 ] && echo ' stopped')" \
          | tee -a "$out/multi/wall.txt"
        cp "/tmp/multi-$g/rows.csv" "$out/multi/rows-gpus$g.csv" 2>/dev/null
        for f in /tmp/multi-$g/gpu-*/rows.csv; do cp "$f" "$out/multi/part-gpus$g-$(basename "$(dirname "$f")").csv"; done
      done
      for r in ${CP_RANKS-$n}; do
        t0=$(date +%s)
        python3 -m gluon_attn.cli sweep --cp "$r" ${CP_ARGS:---n-ctx 131072,262144 --head-dim 128 --kv-heads 8 -H 32 -Z 1 --causal true --dtype fp16 --pass fwd,bwd} \
          --quiet --out "/tmp/cp-$r" 2>&1 | grep -v "^ - \|nanobind" | tail -14
        echo "cp=$r wall_s=$(( $(date +%s) - t0 ))" | tee -a "$out/multi/wall.txt"
        cp "/tmp/cp-$r/rows.csv" "$out/multi/cp$r-rows.csv"; cp "/tmp/cp-$r/env.json" "$out/multi/cp$r-env.json"
      done ;;
    na)
      # Neighborhood attention (sweep --na): NA_ARGS, default the 1-D targets' problem (32768 tokens, window 2048,
      # strides 1, 256 and 2048; B = H = 1, D = 128, bf16) against dense attention and FlexAttention: OUT/na.
      # NA_DIR (default /tmp/na-NAME; kept between calls on a warm machine: a second call resumes) lands in OUT/NA_NAME.
      # NA_RUNS="name=args // name=args ...": several sweeps one after the other, each into /tmp/na-<name> and
      # OUT/<name>, NA_TIMEOUT each (args word-split: no quotes, ';' needs none).
      [ -n "${NA_RUNS_FILE:-}" ] && NA_RUNS=$(cat "$NA_RUNS_FILE")
      runs=${NA_RUNS:-${NA_NAME:-na}=${NA_ARGS:---token-layout 32768 --window 2048 --stride 1;256;2048 -Z 1 -H 1 \
        --head-dim 128 --dtype bf16 --rounds 3 --warmup-ms 500}}
      while read -r run; do
        [ -n "$run" ] || continue
        name=${run%%=*}; args=${run#*=}; dir=${NA_DIR:-/tmp/na-$name}; mkdir -p "$out/$name"
        echo "--- na $name: $args"
        timeout "${NA_TIMEOUT:-500}" python3 -m gluon_attn.cli sweep --na $args --out "$dir" \
          --resume 2>&1 | grep -v "^ - \|nanobind" | tail -30
        cp "$dir"/{rows.csv,env.json,tables.md} "$out/$name/"
      done <<< "$(echo "$runs" | sed 's# // #\n#g')" ;;
    tree-ab)
      # (each script's own folder comes first on sys.path: the old copy imports the old tree, the new one this tree)
      only=(); [ -n "${TREE_AB_ONLY:-}" ] && only=(--only "$TREE_AB_ONLY")
      for r in $(seq 1 "${TREE_AB_ROUNDS:-2}"); do
        python3 "${TREE_AB_OLD:-.carry/old}/na_tree_ab.py" old "${only[@]}" >> "$out/tree-ab.jsonl"
        python3 experiments/na_tree_ab.py new "${only[@]}" >> "$out/tree-ab.jsonl"
      done
      python3 experiments/na_tree_ab.py --compare "$out/tree-ab.jsonl" | tee "$out/tree-ab.md" ;;
    bwd-parity)
      # The backward of the tree in PARITY_BASE (default .carry/prebwd: `git archive f7fbd0a^ gluon_attn`, the
      # last tree before the backward's refactor) against today's, both under the Triton the earlier phases put
      # on PYTHONPATH: PARITY_ROUNDS alternating rounds of experiments/bwd_parity.py (deterministic D=64
      # non-causal; PARITY_CONFIG pins the config), compared into OUT/bwd-parity.md.
      root=$(pwd); base=${PARITY_BASE:-.carry/prebwd}; rm -f /tmp/parity.jsonl
      for r in $(seq 1 "${PARITY_ROUNDS:-3}"); do
        (cd "$base" && python3 "$root/experiments/bwd_parity.py" time base /tmp/parity.jsonl)
        python3 experiments/bwd_parity.py time new /tmp/parity.jsonl
      done
      python3 experiments/bwd_parity.py compare /tmp/parity.jsonl base new | tee "$out/bwd-parity.md"
      cp /tmp/parity.jsonl "$out/bwd-parity.jsonl" ;;
    ncu)
      # Nsight Compute on the backward kernel (NCU_PASS=fwd: the forward's) of each provider in NCU_PROVIDERS
      # (default gluon fa4), in each of NCU_MASKS (default non-causal and causal), NCU_ARGS for the problem (default
      # Z=4 H=32 N=8192 D=128): stall reasons per SASS line (source page) and the sections' details, as CSVs in one
      # archive (a call brings back 8 files).
      mkdir -p /tmp/ncu
      pass=${NCU_PASS:-bwd}
      if [ "$pass" = fwd ]; then kernels='gluon_attention$|ForwardSm90'; else kernels='gluon_attention_bwd|BackwardSm90'; fi
      for prov in ${NCU_PROVIDERS:-gluon fa4}; do
        for c in ${NCU_MASKS:-no-causal causal}; do
          if [ "$c" = causal ]; then flag=--causal; else flag=; fi
          n=$pass-$prov${flag:+-causal}
          ncu --kernel-name regex:"$kernels" --launch-skip 1 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
            -f -o /tmp/ncu/$n python3 experiments/profile_backward.py --pass "$pass" --provider "$prov" $flag \
            ${NCU_ARGS:-} \
            > /tmp/ncu/$n.log 2>&1; tail -2 /tmp/ncu/$n.log
          ncu --import /tmp/ncu/$n.ncu-rep --page source --print-source sass --csv > /tmp/ncu/$n-sass.csv 2>&1
          ncu --import /tmp/ncu/$n.ncu-rep --page details --csv > /tmp/ncu/$n-details.csv 2>&1
          python3 experiments/profile_backward.py --stalls /tmp/ncu/$n-sass.csv 2>&1 | head -16
        done
      done
      tar -C /tmp/ncu -czf "$out/ncu.tgz" --exclude='*.ncu-rep' . ;;
    ncu-na)
      rm -rf /tmp/ncu-na && mkdir -p /tmp/ncu-na
      for name in ${NCU_NA:-56x56 3x3x3 128x128}; do
        n=/tmp/ncu-na/$name
        ncu --kernel-name regex:gluon_attention --launch-skip 1 --launch-count 1 --section SpeedOfLight \
          --section WarpStateStats --section SchedulerStats --section SourceCounters --section ComputeWorkloadAnalysis \
          --section Occupancy --section LaunchStats -f -o "$n" python3 experiments/na_tree_ab.py ncu --only "$name" \
          --ncu > "$n.log" 2>&1; tail -1 "$n.log"
        ncu --import "$n.ncu-rep" --page source --print-source sass --csv > "$n-sass.csv" 2>&1
        ncu --import "$n.ncu-rep" --page details --csv > "$n-details.csv" 2>&1
        ncu --import "$n.ncu-rep" --page raw --csv > "$n-raw.csv" 2>&1
        echo "--- $name"; python3 -c "import pandas as pd, sys; d = pd.read_csv(sys.argv[1]); m = d['Metric Name']
print(d[m.str.contains('Duration|SM Frequency|Compute .SM. Throughput|Issue Slots Busy|Executed Ipc Active|No Eligible|Eligible Warps|Active Warps Per|Registers Per')][['Metric Name', 'Metric Unit', 'Metric Value']].to_string(index=False))" "$n-details.csv" 2>&1 | head -14
        python3 experiments/profile_backward.py --stalls "$n-sass.csv" 2>&1 | head -14
      done
      tar -C /tmp --exclude="*.ncu-rep" -czf "$out/ncu-na.tgz" ncu-na && ls -l "$out/ncu-na.tgz" ;;
    branches)
      # Each carried branch tree .carry/br-NAME (experiments/carry_branches.sh) runs the GPU tests its GPU_TESTS file
      # names (pytest arguments), in its own folder under the Triton the earlier phases put on PYTHONPATH, on
      # BRANCH_WORKERS processes (default 4), killed after BRANCH_TIMEOUT s (default 170; three folders must fit one
      # call's 600 with the triton phase): each log in OUT/branches/NAME.log, its last lines printed.
      # (PYTHONPATH's "." is then the branch's folder: its gluon_attn is the one imported)
      mkdir -p "$out/branches"
      for dir in .carry/br-*/; do
        name=$(basename "$dir"); [ -f "$dir/GPU_TESTS" ] || { echo "$name: no GPU_TESTS file"; continue; }
        echo "--- $name: $(cat "$dir/GPU_TESTS")"
        (cd "$dir" && eval "timeout ${BRANCH_TIMEOUT:-170} python3 -m pytest -q -m gpu -x -n ${BRANCH_WORKERS:-4} \
          $(cat GPU_TESTS)") \
          > "$out/branches/$name.log" 2>&1
        tail -3 "$out/branches/$name.log"
      done ;;
    pack)
      tar -C "$(dirname "$out")" -czf "$out.tgz" "$(basename "$out")" && rm -rf "$out" && ls -l "$out.tgz"
      break ;;
  esac
done
echo "=== done $(date +%T)"
