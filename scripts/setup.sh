#!/usr/bin/env bash
# Installs qkmap-hf and its dependencies into the current Python.
# torch first: with no torch installed, a plain dependency on it pulls a multi-GB CUDA build, so the CPU
# wheel pinned here is installed when torch is missing (on these machines pip takes it from local disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_CPU_VERSION="${QKMAP_TORCH_VERSION:-2.13.0}"

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] torch missing: installing the CPU build torch==${TORCH_CPU_VERSION}"
    # Elsewhere, add: --index-url https://download.pytorch.org/whl/cpu (not reachable from our machines).
    "$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==${TORCH_CPU_VERSION}"
fi
echo "[setup] installing qkmap-hf with its dependencies and the gguf and dev extras"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -e ".[dev]"
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
# The fused CPU kernels (feature map, wide-key attention), compiled once per machine (seconds; qkmap_hf/kernels). Without a C++ compiler the eager
# map runs and the line below says why; the setup goes on.
"$PYTHON" -m qkmap_hf kernels || echo "[setup] the fused CPU kernels were not built; the eager feature map and sdpa with padded values run"
"$PYTHON" -c "import torch, transformers, qkmap_hf; print(f'[setup] qkmap-hf {qkmap_hf.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
