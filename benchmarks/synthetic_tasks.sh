#!/usr/bin/env bash
# Claims 2 and 4 on synthetic tasks where position carries no information (docs/synthetic-tasks.md).
#
# Per task instance (INSTANCES, "TASK@LENGTH" each): every arm on preset tiny (2 layers x 64, 4 heads x 16, GQA 4/2),
# batch 16, STEPS steps, answer-only loss; tuned on learning rate {1e-3, 3e-3, 1e-2} x temperature
# (logit_scale_multiplier {1, 4}) on the tuning split with tuning seed 1000, each arm's choice rerun with report seeds
# 0, 1, 2 on the disjoint report split and saved. Then the accuracy report (qkmap_hf.task_report) over every
# instance, and `qkmap analyze --task` (evidence contrast, evidence key scale) on the saved MQAR models.
# Arms: the modes, both position-prior controls, F = 1/2/4 at equal key width (32), the compact layout (keys as wide
# as head_dim) and the constant-cos control. The arms of an instance run as SHARDS (default 2) parallel processes.
#   usage: benchmarks/synthetic_tasks.sh [OUTPUT_DIR] [extra qkmap compare flags...]
set -euo pipefail
OUT=${1:-runs/synthetic}
shift || true
STEPS=${STEPS:-1000}
INSTANCES=${INSTANCES:-"mqar:num_pairs=2@128 mqar:num_pairs=4@128 mqar:num_pairs=2@512 salience:levels=128@64"}
ARMS=${ARMS:-"standard qk_norm qk_map standard_prior qk_map_noprior
    qk_map_f2:qk_mode=qk_map,qkmap_num_frequencies=2,qkmap_input_dim=8
    qk_map_f4:qk_mode=qk_map,qkmap_num_frequencies=4,qkmap_input_dim=4
    qk_map_compact:qk_mode=qk_map,qkmap_input_dim=8 qk_map_constant_cos"}
status=0
folders=()
for instance in $INSTANCES; do
    task=${instance%@*} length=${instance##*@}
    folder="$OUT/${task//[:=,]/_}-T$length"
    folders+=("$folder")
    bash "$(dirname "$0")/sharded_compare.sh" "$folder" "$ARMS" --task "$task" --preset tiny --block-size "$length" \
        --batch-size 16 --steps "$STEPS" --seeds 3 --first-seed 0 --tuning-seeds 1 --tuning-first-seed 1000 \
        --max-eval-blocks 256 --eval-steps 50 --save-models --monitor-steps 0 \
        --tune learning_rate=1e-3,3e-3,1e-2 --tune logit_scale_multiplier=1,4 "$@" || status=1
    if [[ $task == mqar* ]]; then
        mapfile -t models < <(ls -d "$folder"/shard-*/models/*/seed0 2>/dev/null)
        if ((${#models[@]})); then
            ${QKMAP:-python -m qkmap_hf} analyze "${models[0]}" --compare "${models[@]:1}" --task "$task" \
                --task-length "$length" --output-dir "$folder/analysis" || status=1
        fi
    fi
done
python -m qkmap_hf.task_report "${folders[@]}" --output-dir "$OUT/report"
exit $status
