#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU (run it where one is lent; it is not part of CI).
# Runs the model tests that matter on a GPU (bf16, sdpa, cache, the feature map's custom backward), then the
# attention-overhead benchmark in bf16 with every kernel path QKMapAttention takes: sdpa (values padded for the
# prefill/training, single_query_attention for decoding), flex_attention (values unpadded) and flash-attention 2
# when the flash_attn package is importable. Budget: under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
python3 - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible"
print("GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
# bf16 logits vs fp32, the cache paths, the feature map's backward and the wide-key kernels on the GPU.
QKMAP_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
timeout 150 python3 benchmarks/attention_overhead.py --device cuda --dtype bfloat16 --attn sdpa \
    --seq-lens 1024 4096 8192 --max-train-len 8192 --batch 8 --repeats 5 --prefill-len 2048 --decode-tokens 64 \
    --output-dir "$OUT/sdpa" | tee "$OUT/sdpa.md"
timeout 150 python3 benchmarks/attention_overhead.py --device cuda --dtype bfloat16 --attn flex_attention \
    --seq-lens 1024 4096 --batch 8 --repeats 3 --prefill-len 2048 --decode-tokens 32 \
    --output-dir "$OUT/flex" | tee "$OUT/flex.md"
if python3 -c "import flash_attn" 2>/dev/null; then
    timeout 90 python3 benchmarks/attention_overhead.py --device cuda --dtype bfloat16 --attn flash_attention_2 \
        --seq-lens 1024 4096 --batch 8 --repeats 3 --output-dir "$OUT/flash" | tee "$OUT/flash.md"
else
    echo "flash_attn not installed: flash-attention 2 rows skipped" | tee "$OUT/flash.md"
fi
