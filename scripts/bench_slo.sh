#!/bin/bash
# SLO-class proof on a live server (issue 19): per policy one server, three workloads: gold
# alone, gold + batch (batch over 120 cold adapters, max-loras 8), two tenants flooding.
# usage: scripts/bench_slo.sh [ROUNDS=2] [OUTDIR=/tmp/bench_slo] [POLICIES="fcfs fair"]
# (env: PY the python with loraplex's deps, FIRST_ROUND to add rounds, PORT the first port - 1,
#  DURATION seconds per workload, default 30; SKIP_FLOOD=1 skips the two-tenant flood)
# Assets (a small random Llama, 123 rank-8 adapters) are built once in $OUTDIR/assets.
set -u
ROUNDS=${1:-2}; OUT=${2:-/tmp/bench_slo}; POLICIES=${3:-"fcfs fair"}; DUR=${DURATION:-30}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}; [ -x "$PY" ] || PY=python
export PYTHONPATH=$ROOT/src
A=$OUT/assets; mkdir -p $OUT
[ -d $A/adapters ] || $PY $ROOT/scripts/slo_assets.py $A > $OUT/assets.log
MODS=$(for d in $A/adapters/*; do echo -n "$(basename $d)=$d "; done)
one() {  # POLICY PORT DIR
  local P=$1 PORT=$2 D=$3; mkdir -p $D
  $PY -m loraplex serve $A/model --enable-lora --lora-modules $MODS --max-loras 8 \
    --max-cpu-loras 64 --max-lora-rank 8 --max-num-seqs 8 --scheduling-policy $P --port $PORT \
    --num-threads 1 --dtype float32 --disable-log-requests --uvicorn-log-level warning \
    > $D/server-$P.log 2>&1 &
  local SPID=$!
  for i in $(seq 1 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
  local GP="" BP=""; [ "$P" = fcfs ] || { GP=",priority=-1"; BP=",priority=1"; }
  local GOLD="gold:models=gold,rate=2,prompt=64,output=16$GP"
  local BATCH="batch:models=batch-*,concurrency=16,prompt=128,output=32$BP"
  run() { local name=$1; shift; echo "== $P $name  loadavg $(cat /proc/loadavg)"
    $PY -m loraplex bench serve --url http://127.0.0.1:$PORT --no-progress --seed 1 \
      --save $D/$P-$name.json "$@"; echo; }
  run gold-alone --duration $DUR --tenant "$GOLD"
  run gold-batch --duration $DUR --tenant "$GOLD" --tenant "$BATCH"
  [ -n "${SKIP_FLOOD:-}" ] || run flood --duration $DUR --tenant "a:models=flood-a,concurrency=32,prompt=64,output=32" \
    --tenant "b:models=flood-b,concurrency=12,prompt=64,output=32"
  echo "== $P server: $(curl -s localhost:$PORT/metrics | grep -E '^vllm:num_preemptions' | tr '\n' ' ')"
  kill $SPID; wait $SPID 2>/dev/null
}
port=${PORT:-18800}
for r in $(seq ${FIRST_ROUND:-1} $ROUNDS); do for P in $POLICIES; do
  port=$((port + 1)); one $P $port $OUT/round$r | tee $OUT/round$r-$P.txt
done; done
$PY $ROOT/scripts/slo_summary.py $OUT | tee $OUT/summary.txt
