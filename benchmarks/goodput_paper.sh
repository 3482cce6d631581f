#!/usr/bin/env bash
# Issue 54's paper-scale goodput table: four V100s (sim:opt-13b-v100-32gb) per system; vllm and
# sarathi as 4 coupled instances, tetri at each static split (1P+3D, 2P+2D, 3P+1D: the table keeps
# the best), adaptive starting 2P+2D; the five workloads (traces/*.jsonl, 128 requests each) and
# the first 1,024 requests of the Azure conversation trace, at each SLO corner; the Azure code
# trace (report-only: nothing is tuned on it) beside. Each run is a `bench goodput` search per
# system on virtual time; the fair default predictor (accuracy at sklearn's measured 65.7%).
#
#   benchmarks/goodput_paper.sh OUT_DIR            # then: python benchmarks/goodput_table.py OUT_DIR
#   SYSTEMS=vllm,sarathi benchmarks/goodput_paper.sh OUT2   # those systems again; then
#                                                  # goodput_table.py OUT_DIR --overlay OUT2
#   WORKLOADS=Mixed CORNERS=balanced benchmarks/goodput_paper.sh OUT3   # one cell (sim_check.py)
#
# About 1-3 minutes a workload and corner for the synthetic traces and 10-15 for an Azure one on
# two shared cores. A run whose OUT_DIR/W_C.json exists is not run again (a cut-off run resumes).
set -euo pipefail
OUT=${1:?usage: benchmarks/goodput_paper.sh OUT_DIR}
PY=${PY:-python}
DATA=${DATA:-../shared/data/traces}
AZURE_N=${AZURE_N:-1024}
mkdir -p "$OUT"
SYS='vllm: --mode coupled --instances 4 --batching vllm ;
     sarathi: --mode coupled --instances 4 --batching sarathi ;
     tetri-1p3d: --mode disagg --prefill 1 --decode 3 ;
     tetri-2p2d: --mode disagg --prefill 2 --decode 2 ;
     tetri-3p1d: --mode disagg --prefill 3 --decode 1 ;
     adaptive: --mode adaptive --prefill 2 --decode 2'
if [ -n "${SYSTEMS:-}" ]; then  # a subset, e.g. SYSTEMS=vllm,sarathi (goodput_table.py --overlay merges it)
  SYS=$(printf '%s\n' "$SYS" | tr ';' '\n' | grep -E "^ *($(echo "$SYSTEMS" | tr ',' '|')):" | paste -sd ';')
  [ -n "$SYS" ] || { echo "SYSTEMS=$SYSTEMS names none of the systems"; exit 2; }
fi
WORKLOADS=${WORKLOADS:-LPLD,LPHD,HPLD,HPHD,Mixed,Azure,AzureCode}  # a slice: benchmarks/sim_check.py
CORNERS=${CORNERS:-balanced,tight-ttft,tight-tpot}
search() {  # W TRACE [fit flags]
  local w=$1 trace=$2; shift 2
  [[ ",$WORKLOADS," == *",$w,"* ]] || return 0
  for c in ${CORNERS//,/ }; do
    [ -f "$OUT/${w}_$c.json" ] && continue
    $PY cli.py bench goodput "$trace" "$@" --device sim:opt-13b-v100-32gb --slo "$c" --compare "$SYS" \
        --json "$OUT/${w}_$c.json" --plot "$OUT/${w}_$c.png" --no-progress > "$OUT/${w}_$c.log" 2>&1 \
        || { echo "FAILED: $w $c (see $OUT/${w}_$c.log)"; continue; }
    tail -n 12 "$OUT/${w}_$c.log"
  done
}
for W in LPLD LPHD HPLD HPHD Mixed; do
  search "$W" "traces/$W.jsonl"
done
search Azure "$DATA/azure2023_conv.csv" --num-requests "$AZURE_N"
search AzureCode "$DATA/azure2023_code.csv" --num-requests "$AZURE_N"
