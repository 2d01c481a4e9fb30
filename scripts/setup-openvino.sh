#!/usr/bin/env bash
# Create .venv-openvino: the edgec runtime with onnxruntime-openvino (ONNX Runtime built with the OpenVINO
# execution provider). It installs a module also named `onnxruntime`, so it cannot share .venv with the plain
# onnxruntime the compiler uses: bundles are built in .venv, run here.
#   bash scripts/setup-openvino.sh && .venv-openvino/bin/python -m edgec.runtime BUNDLE "PROMPT"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-openvino/bin/python ] || "${PYTHON:-python3}" -m venv .venv-openvino
.venv-openvino/bin/pip install -q --upgrade pip
.venv-openvino/bin/pip install -q -e ".[openvino]"
.venv-openvino/bin/python -c "import onnxruntime as ort; print('onnxruntime', ort.__version__, ort.get_available_providers())"
