#!/bin/bash
# Run the refactor-check benchmarks on two trees side by side (before, after), each benchmark back to back.
# usage: scripts/bench_before_after.sh BEFORE_TREE AFTER_TREE OUTDIR  (PYTHON=... picks the interpreter)
set -u
B=$1; A=$2; OUT=$3; mkdir -p $OUT
PY=${PYTHON:-python}
run() { # tree label name cmd...   ("loraplex.tools." in cmd follows the tree: trees before
  # issue 45 have the tools at loraplex.bench / loraplex.sim)
  local tree=$1 label=$2 name=$3; shift 3
  local args=("$@")
  if [ ! -d "$tree/src/loraplex/tools" ]; then args=("${args[@]//loraplex.tools./loraplex.}"); fi
  echo "== $name [$label] $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $OUT/$name.txt
  (cd $tree && PYTHONPATH=$tree/src LORAPLEX_CACHE_DIR=${LORAPLEX_CACHE_DIR:-/tmp/lpbench-cache} "${args[@]}") >> $OUT/$name.txt 2>&1
  echo "rc=$?" >> $OUT/$name.txt
}
for t in "$B before" "$A after"; do set -- $t; run $1 $2 sim_hotburst $PY -m loraplex.tools.sim --workload hotburst --slots 8 --policy lru,lfu,fifo,hybrid; done
for t in "$B before" "$A after"; do set -- $t; run $1 $2 sim_zipf $PY -m loraplex.tools.sim --workload zipf:s=1,n=256,requests=20000,rate=50 --slots 8 --policy lru,lfu,fifo,hybrid; done
for t in "$B before" "$A after"; do set -- $t; run $1 $2 sim_tiered $PY -m loraplex.tools.sim --workload tiered:5x12%,5x6%,5x2% --slots 8 --policy lru,lfu,fifo,hybrid; done
for t in "$B before" "$A after"; do set -- $t; run $1 $2 sim_bytes $PY -m loraplex.tools.sim --workload zipf:s=1,n=256,ranks=8/16/64 --slots 8 --host-bytes 1GiB --disk-bytes 4GiB --policy lru,lfu,hybrid; done
for t in "$B before" "$A after" "$B before" "$A after"; do set -- $t; run $1 $2 lora_ops $PY -m loraplex.tools.bench.lora_ops; done
for t in "$B before" "$A after" "$B before" "$A after" "$B before" "$A after"; do set -- $t; run $1 $2 profile_step $PY -m loraplex.tools.bench.profile_step --dtypes bfloat16 float32 --steps 48; done
for t in "$B before" "$A after" "$B before" "$A after" "$B before" "$A after"; do set -- $t; run $1 $2 throughput $PY -m loraplex.tools.bench.throughput --dtypes float32 bfloat16 --skip-peft; done
for t in "$B before" "$A after"; do set -- $t; run $1 $2 cache_live $PY -m loraplex.tools.bench.cache_live --cache-dir ${LORAPLEX_CACHE_DIR:-/tmp/lpbench-cache}/bench-cache; done
echo done > $OUT/DONE
