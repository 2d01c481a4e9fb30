#!/usr/bin/env bash
# The GPU check, on the GPU machine, offline. Make the pack here first (no GPU needed):
#   python benchmarks/gpu_prepare.py          # → benchmarks/out/gpu-pack/ (bundles, packs with wheels, this script)
# copy that folder to the GPU machine and run, there:
#   bash gpu-pack/gpu_check.sh [--budget 450] [--out results.json]
# It picks the bundles the GPU it finds can run (TensorRT-RTX only on sm75/86/89/120, the engine built for this
# GPU; ONNX Runtime CUDA anywhere), installs the pack's wheels into a venv of its own, gives each bundle one try
# and prints a table (results.json beside it). Details: benchmarks/gpu_check.py, docs/BENCHMARKS.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python3}" "$here/gpu_check.py" "$@"
