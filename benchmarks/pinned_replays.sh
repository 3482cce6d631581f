#!/usr/bin/env bash
# Issue 24's real rows on a machine with many cores: the systems of a workload replayed at the
# same time, each in its own process pinned (taskset) to its own two cores, one torch thread per
# instance, so every system of a workload runs in the same minutes of the same machine (on a shared
# VM, one system after another meets the machine's drift: docs/notes/adaptive.md, the LPLD study).
#
#   benchmarks/pinned_replays.sh OUT_DIR SECONDS LANE...
#     LANE = WORKLOADS[:SYSTEMS]    e.g. HPHD   LPLD,HPLD   LPLD,HPLD:adaptive,vllm
#     WORKLOADS run one after another in the lane; the SYSTEMS of one workload (default
#     adaptive,vllm,sarathi) run side by side, one pair of cores each. Lanes run at once, each on its
#     own pairs, so the machine needs 2 x (systems in all lanes) cores. A replay still running
#     SECONDS after the start is stopped (its JSON is then missing).
#   ARGS (env): extra replay flags, e.g. '--num-requests 8' for a quick try.
#   PROFILE=keep (env): use the one-thread profile already in the cache (measured when missing);
#   by default it is measured again, which replaces the cached one (and what `sim:local` models).
#
# Each replay writes OUT_DIR/run_W_SYSTEM_LANE.json, its log and its step log (steps_*.jsonl, for
# benchmarks/step_speed.py and `aserve profile device --from-steps`); cpus.txt says which cores each
# used and how the machine's cores share physical cores. The profile for one thread is measured once
# first (alone), so no replay measures it under its neighbours' load. Round 1's caps, as
# benchmarks/adaptive_compare.sh: prompts to 1,024 tokens, outputs to 512, 0.5 GiB of KV an instance.
set -uo pipefail
OUT=${1:?usage: benchmarks/pinned_replays.sh OUT_DIR SECONDS LANE...}
LIMIT=${2:?usage: benchmarks/pinned_replays.sh OUT_DIR SECONDS LANE...}
shift 2
PY=${PY:-python3}
mkdir -p "$OUT"
START=$SECONDS

declare -A SYS=(
  [adaptive]='--mode adaptive --prefill 1 --decode 1'
  [tetri]='--mode disagg --prefill 1 --decode 1'
  [vllm]='--mode coupled --instances 2 --batching vllm'
  [sarathi]='--mode coupled --instances 2 --batching sarathi'
)

# Cores ordered so that consecutive ones sit on distinct physical cores where the machine has
# hyperthreads: every core's first thread, then every core's second.
mapfile -t CPUS < <(for d in /sys/devices/system/cpu/cpu[0-9]*; do
  n=${d##*cpu}; sib=$(cat "$d/topology/thread_siblings_list" 2>/dev/null || echo "$n")
  first=${sib%%[,-]*}; echo "$([ "$first" = "$n" ] && echo 0 || echo 1) $n"; done | sort -k1,1n -k2,2n | awk '{print $2}')
{ echo "cores in order: ${CPUS[*]}"
  for d in /sys/devices/system/cpu/cpu[0-9]*; do echo "${d##*/}: siblings $(cat "$d/topology/thread_siblings_list" 2>/dev/null)"; done
} >"$OUT/cpus.txt"

needed=0
for lane in "$@"; do
  systems=${lane#*:}; [ "$systems" = "$lane" ] && systems=adaptive,vllm,sarathi
  IFS=, read -ra s <<<"$systems"; needed=$((needed + 2 * ${#s[@]}))
  for sys in "${s[@]}"; do
    [ -n "${SYS[$sys]:-}" ] || { echo "pinned_replays: unknown system '$sys' in lane '$lane' (known: ${!SYS[*]})" >&2; exit 2; }
  done
  IFS=, read -ra ws <<<"${lane%%:*}"
  for w in "${ws[@]}"; do
    [ -f "traces/$w.jsonl" ] || { echo "pinned_replays: no trace traces/$w.jsonl (lane '$lane')" >&2; exit 2; }
  done
done
if [ "$needed" -gt "${#CPUS[@]}" ]; then
  echo "pinned_replays: the lanes need $needed cores, this machine has ${#CPUS[@]}" >&2; exit 2
fi

echo "== profile (1 thread, alone on cores ${CPUS[0]},${CPUS[1]})"
if [ "${PROFILE:-}" = keep ]; then  # the replay's own lookup: the cached profile, or measured now
  taskset -c "${CPUS[0]},${CPUS[1]}" $PY -c 'from aserve.config import EngineConfig
from aserve.profiles.device_profile import load_or_measure
print("saturate chunk", load_or_measure(EngineConfig(), 1).saturate_chunk())' >"$OUT/profile.log" 2>&1
else
  taskset -c "${CPUS[0]},${CPUS[1]}" $PY cli.py profile device --threads 1 >"$OUT/profile.log" 2>&1
fi || { tail -n 20 "$OUT/profile.log"; exit 1; }
tail -n 3 "$OUT/profile.log"

run_lane() {  # run_lane INDEX FIRST_PAIR WORKLOADS SYSTEMS
  local k=$1 pair=$2 w sys i pids
  IFS=, read -ra ws <<<"$3"; IFS=, read -ra ss <<<"$4"
  for w in "${ws[@]}"; do
    pids=()
    for i in "${!ss[@]}"; do
      sys=${ss[$i]}
      local cpus="${CPUS[$((2 * (pair + i)))]},${CPUS[$((2 * (pair + i) + 1))]}"
      local left=$((LIMIT - (SECONDS - START)))
      [ "$left" -gt 10 ] || return 0
      local tag="${w}_${sys}_$k"
      echo "lane $k: $w $sys on cores $cpus (at $((SECONDS - START)) s)" | tee -a "$OUT/cpus.txt"
      # shellcheck disable=SC2086
      timeout --signal=INT "$left" taskset -c "$cpus" $PY cli.py replay "traces/$w.jsonl" --device cpu --threads 2 \
        --max-prompt-tokens 1024 --max-output-tokens 512 --kv-cache-gb 0.5 --no-progress ${ARGS:-} \
        --compare "$sys: ${SYS[$sys]}" --json "$OUT/run_$tag.json" --step-log="$OUT/steps_$tag.jsonl" \
        >"$OUT/log_$tag.txt" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    echo "lane $k: $w done at $((SECONDS - START)) s" | tee -a "$OUT/cpus.txt"
  done
}

pair=0; k=0; lanes=()
for lane in "$@"; do
  systems=${lane#*:}; [ "$systems" = "$lane" ] && systems=adaptive,vllm,sarathi
  run_lane "$k" "$pair" "${lane%%:*}" "$systems" &
  lanes+=($!)
  IFS=, read -ra s <<<"$systems"; pair=$((pair + ${#s[@]})); k=$((k + 1))
done
wait "${lanes[@]}"
echo "== done in $((SECONDS - START)) s: $(ls "$OUT"/run_*.json 2>/dev/null | wc -l) replays with a report"
