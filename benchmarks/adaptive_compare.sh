#!/usr/bin/env bash
# Issue 24's comparison: adaptive against tetri, vllm and sarathi on the same hardware, every
# workload, one system after another (docs/notes/adaptive.md, "Adaptive roles"). Then the criteria
# table (benchmarks/adaptive_table.py) and the Shift trace with ratio flips.
#
#   benchmarks/adaptive_compare.sh [OUT_DIR]                       # real CPU: 2 instances, 1 thread each
#   DEVICE=sim:local benchmarks/adaptive_compare.sh /tmp/sim        # this machine's profile, virtual time
#   DEVICE=sim:opt-13b-v100-32gb SCALE=paper benchmarks/adaptive_compare.sh /tmp/paper   # 2P+2D vs 4 + 4
#
# Real device: about 2.5-17 minutes a system and workload (round 1), some 3-4 hours in all; run it
# with nothing else on the machine. AZURE (default ../shared/data/traces/azure2023_conv.csv) adds the
# first 10 minutes of the Azure conversation trace where the file exists. A workload whose
# OUT_DIR/run_W.json exists is not run again (so a cut-off run resumes); STEPLOG=1 also writes each
# replay's steps to OUT_DIR/steps_W.jsonl (`replay --step-log`), what `aserve profile device
# --from-steps` calibrates the simulated device on (docs/SIMULATION.md).
set -euo pipefail
OUT=${1:-adaptive_runs}
DEVICE=${DEVICE:-cpu}
SCALE=${SCALE:-local}
PY=${PY:-python}
AZURE=${AZURE:-../shared/data/traces/azure2023_conv.csv}
mkdir -p "$OUT"

if [ "$SCALE" = paper ]; then
  # OPT-13B on four V100s per system; lengths clipped only to the model's 2,048-token context
  FIT=(--predictor accuracy --predictor-option accuracy=0.749)
  SYS='adaptive: --mode adaptive --prefill 2 --decode 2 ; tetri: --mode disagg --prefill 2 --decode 2 ;
       vllm: --mode coupled --instances 4 --batching vllm ; sarathi: --mode coupled --instances 4 --batching sarathi'
else
  # round 1's caps: every instance one of the two cores, 0.5 GiB of KV each
  FIT=(--max-prompt-tokens 1024 --max-output-tokens 512 --kv-cache-gb 0.5)
  SYS='adaptive: --mode adaptive --prefill 1 --decode 1 ; tetri: --mode disagg --prefill 1 --decode 1 ;
       vllm: --mode coupled --instances 2 --batching vllm ; sarathi: --mode coupled --instances 2 --batching sarathi'
fi

steplog() { [ -n "${STEPLOG:-}" ] && echo "--step-log=$OUT/steps_$1.jsonl" || true; }
for W in LPLD LPHD HPLD Mixed HPHD; do
  [ -f "$OUT/run_$W.json" ] && continue
  $PY cli.py replay traces/$W.jsonl --device "$DEVICE" "${FIT[@]}" --compare "$SYS" --json "$OUT/run_$W.json" \
      $(steplog "$W") --no-progress | tail -n 3
done
if [ -f "$AZURE" ] && [ ! -f "$OUT/run_azure.json" ]; then
  $PY cli.py replay "$AZURE" --num-requests 2867 --length-scale 0.1 --time-scale 1.5 --device "$DEVICE" \
      "${FIT[@]}" --compare "$SYS" --json "$OUT/run_azure.json" $(steplog azure) --no-progress | tail -n 3
fi
$PY benchmarks/adaptive_table.py "$OUT"/run_*.json | tee "$OUT/table.md"

# The Shift trace (HPLD then LPHD) with ratio flips, 4 instances each owning its share of the machine
# (round 1: 'ratio' x0.83 mean JCT against 'off'); flips over time in $OUT/shift_plots/timeline.png
# (a simulated device ignores --device-share: one device per instance is what it models)
$PY cli.py workload Shift --num-requests 64 --out "$OUT/Shift64.jsonl"
SHARE=--device-share=dedicated
$PY cli.py replay "$OUT/Shift64.jsonl" --device "$DEVICE" --max-prompt-tokens 1024 --max-output-tokens 512 \
    --kv-cache-gb 0.5 --no-progress --json "$OUT/shift.json" --plots "$OUT/shift_plots" \
    --compare "off: --mode disagg --prefill 2 --decode 2 $SHARE ;
    ratio: --mode disagg --prefill 2 --decode 2 $SHARE --flip ratio --flip-window 6 ;
    adaptive: --mode adaptive --prefill 2 --decode 2 $SHARE ;
    adaptive-ratio: --mode adaptive --prefill 2 --decode 2 $SHARE --flip ratio --flip-window 6" | tail -n 40
