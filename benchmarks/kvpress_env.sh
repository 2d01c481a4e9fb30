#!/usr/bin/env bash
# Create .venv-kvpress (at the checkout's root) holding NVIDIA's kvpress, the external peer of benchmarks/kvpress_compare.py.
# kvpress 0.5.5 pins transformers < 5.3, which the main .venv (transformers 5.x) cannot share: hence its own venv.
# torch is pinned by constraints.txt (the CPU wheel on local disk; an unpinned torch pulls a multi-GB CUDA build).
#   bash benchmarks/kvpress_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-kvpress/bin/python ] || "${PYTHON:-python3}" -m venv .venv-kvpress
.venv-kvpress/bin/pip install -q --upgrade pip
.venv-kvpress/bin/pip install -q -c constraints.txt kvpress==0.5.5
.venv-kvpress/bin/python -c "import kvpress, torch, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'torch', torch.__version__, 'transformers', transformers.__version__)"
