#!/usr/bin/env bash
# Issue 54's real-CPU goodput rows: the four systems on this machine's CPU, two instances of one
# thread each and the same KV memory (0.5 GiB an instance) per system: vllm and sarathi as 2
# coupled instances, tetri as 1P+1D (the only static split of two), adaptive starting 1P+1D.
# Mixed and the Azure conversation trace at each SLO corner (the committed rows: about 35 minutes on
# a 2-core AVX512-BF16 machine in bf16, twice that in fp32 on an AVX2 one); the Azure code trace
# (report-only, nothing tuned on it) at balanced when asked for by name.
#
# The traces are shrunk to fit a session: lengths x0.1 (LENGTH_SCALE) and the first 32 requests
# (N). At their full lengths a search on this CPU is a day: `--estimate-only` on Mixed's 128
# requests put each system's search at 20-25 hours (knee near 0.01 req/s: one request alone runs
# for tens of seconds at one thread), so every point is a real replay of hours.
#
#   benchmarks/goodput_cpu.sh OUT_DIR [CELL...]   # then: python benchmarks/goodput_table.py OUT_DIR --cpu
#
# CELL is W_CORNER (e.g. Mixed_tight-ttft); none: the six committed cells. PRECISION (0.15) is the knee's
# relative step (with 32 requests one request is 3% of the attainment, so a finer step buys little).
# REPEATS (1): replays of each probed rate, pooled (`bench goodput --repeats`): one replay is one draw of
# the machine's minutes, and near Azure's burst the same system passes one draw and fails the next at
# the same rate; REPEATS=3 triples the wall time.
#
# Each search starts at the knee simulated on sim:local (this machine's measured profile: run
# `aserve profile device --threads 1` on a machine at rest first) and states its wall time; about
# 5-15 minutes a workload and corner, nothing else running. A cell whose OUT_DIR/W_C.json exists
# is not run again (a cut-off run resumes).
set -euo pipefail
OUT=${1:?usage: benchmarks/goodput_cpu.sh OUT_DIR}
PY=${PY:-python}
DATA=${DATA:-../shared/data/traces}
N=${N:-32}
LENGTH_SCALE=${LENGTH_SCALE:-0.1}
PRECISION=${PRECISION:-0.15}
REPEATS=${REPEATS:-1}
shift
WANT=" $* "
mkdir -p "$OUT"
SYS='vllm: --mode coupled --instances 2 --batching vllm ;
     sarathi: --mode coupled --instances 2 --batching sarathi ;
     tetri: --mode disagg --prefill 1 --decode 1 ;
     adaptive: --mode adaptive --prefill 1 --decode 1'
cell() {  # W CORNER TRACE [extra: only when named]
  local w=$1 c=$2 trace=$3
  [ -f "$OUT/${w}_$c.json" ] && return 0
  [ "$WANT" = "  " ] && [ "${4:-}" = extra ] && return 0
  [ "$WANT" = "  " ] || [[ "$WANT" == *" ${w}_$c "* ]] || return 0
  $PY cli.py bench goodput "$trace" --num-requests "$N" --length-scale "$LENGTH_SCALE" --precision "$PRECISION" \
      --repeats "$REPEATS" --device cpu --threads 2 --kv-cache-gb 0.5 --slo "$c" --compare "$SYS" \
      --json "$OUT/${w}_$c.json" --plot "$OUT/${w}_$c.png" --no-progress > "$OUT/${w}_$c.log" 2>&1 \
      || { echo "FAILED: $w $c (see $OUT/${w}_$c.log)"; return 0; }
  grep -v 'length predictor' "$OUT/${w}_$c.log" | tail -n 12
}
cell Mixed balanced traces/Mixed.jsonl
cell Azure balanced "$DATA/azure2023_conv.csv"
cell Azure tight-ttft "$DATA/azure2023_conv.csv"
cell Azure tight-tpot "$DATA/azure2023_conv.csv"
cell Mixed tight-ttft traces/Mixed.jsonl
cell Mixed tight-tpot traces/Mixed.jsonl
cell AzureCode balanced "$DATA/azure2023_code.csv" extra
