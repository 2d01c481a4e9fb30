#!/usr/bin/env bash
# Create .venv-cuda: the edgec runtime with onnxruntime-gpu (ONNX Runtime built with the CUDA execution provider).
# It installs a module also named `onnxruntime`, so it cannot share .venv with the plain onnxruntime the compiler
# uses: bundles are built in .venv, run here. The CUDA 13 and cuDNN 9 libraries it loads at run time come from the
# system, or add them as wheels: EDGEC_CUDA_LIBS=1 bash scripts/setup-cuda.sh (about 1.5 GB more).
# It installs and imports on a machine without a GPU; only running a bundle needs one.
#   bash scripts/setup-cuda.sh && .venv-cuda/bin/python -m edgec.runtime BUNDLE "PROMPT"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-cuda/bin/python ] || "${PYTHON:-python3}" -m venv .venv-cuda
.venv-cuda/bin/pip install -q --upgrade pip
.venv-cuda/bin/pip install -q -e ".[cuda]"
if [ "${EDGEC_CUDA_LIBS:-0}" = 1 ]; then
    .venv-cuda/bin/pip install -q "onnxruntime-gpu[cuda,cudnn]"
fi
.venv-cuda/bin/python -c "import onnxruntime as ort; print('onnxruntime-gpu', ort.__version__, ort.get_available_providers())"
