# Which --na providers survive --timing graph, each alone (run on a GPU machine after gpu_run.sh stash triton peers)
export PYTHONPATH=/tmp/triton:.:/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
good=""
for p in gluon dense-gluon dense-cudnn dense-fa4 flex; do
  timeout 100 python3 -m gluon_attn.cli sweep --na --token-layout 32768 --window 2048 -Z 1 -H 1 --head-dim 128 --dtype bf16 --rounds 1 --warmup-ms 50 --rep-ms 50 --timing graph --providers $p --out /tmp/g-$p > /tmp/g-$p.log 2>&1
  s=$(python3 -c "import pandas as pd; d=pd.read_csv('/tmp/g-$p/rows.csv', keep_default_na=False); print(d.status[0], d.p50_ms[0], str(d.message[0])[:90].replace(chr(10),' '))" 2>&1 | tail -1)
  echo "$p: $s"; case "$s" in ok*) good="$good,$p";; esac
done
good=${good#,}; echo "good: $good"
timeout 200 python3 -m gluon_attn.cli sweep --na --token-layout 32768 --window 2048 --stride "1;256;2048" -Z 1 -H 1 --head-dim 128 --dtype bf16 --rounds 3 --warmup-ms 500 --timing graph --providers "$good" --out /tmp/na1g2 2>&1 | grep -v "^ - \|nanobind" | tail -28
mkdir -p $OUT/r/na-1d-graph && cp /tmp/na1g2/{rows.csv,env.json} $OUT/r/na-1d-graph/
