#!/usr/bin/env bash
# Run on a machine with an NVIDIA GPU (sm86/sm89/sm120): loads the TensorRT-RTX engines built here ahead of time,
# generates, compares with the ONNX Runtime CPU bundle, prints tok/s and VRAM. Prepare bundles first with:
#   edgec build SMOLLM2.gguf --target rtx3060 -o benchmarks/out/smol.rtx3060.edgec --context 4096   (and rtx4090)
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -c constraints.txt -e ".[tensorrt-rtx]" 2>/dev/null || pip install -q -e ".[tensorrt-rtx]"
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv
python benchmarks/gpu_check.py "$@"
