#!/usr/bin/env bash
# Claims 2 and 4 on synthetic tasks where position carries no information (qkmap_lab/notes/synthetic-tasks.md).
#
# Per task instance (INSTANCES, "TASK@LENGTH" each): every arm on preset tiny (2 layers x 64, 4 heads x 16, GQA 4/2),
# batch BATCH_SIZE (16), STEPS steps, answer-only loss, evaluated every 100 steps; tuned on learning rate
# (LEARNING_RATES, 3e-4 ... 3e-2) x temperature (logit_scale_multiplier: TEMPERATURES, x0.0625 ... x16: the grid
# inside which every arm's choice fell on both tasks; {1, 4} left QK-MAP on its edge) on the tuning split with tuning seed
# 1000, each arm's choice rerun with report seeds 0, 1, 2 on the disjoint report split and saved. The instances run
# side by side, one niced one-thread process each (SHARDS=1 of benchmarks/sharded_compare.sh; SHARDS=2 splits an
# instance's arms over two). Then the accuracy report (qkmap_lab.task_report, with the saved models scored on other
# pair counts and lengths: GENERALIZE) and `qkmap analyze --task` (evidence contrast, evidence key scale) on every
# saved model of every instance, which the report summarises per arm over seeds with paired intervals.
# Arms: the modes, both position-prior controls, F = 1/2/4 at equal key width (32), the compact layout (keys as wide
# as head_dim) and the constant-cos control. Resumable: a rerun skips finished runs; widening a grid runs only the
# new points. With --tune-only among the extra flags only the tuning grid runs (a sweep split over sittings or
# machines: copy each shard's sweep_losses.csv and timing.json along), and the report is the tuning tables alone.
#   usage: benchmarks/synthetic_tasks.sh [OUTPUT_DIR] [extra qkmap compare flags...]
set -euo pipefail
OUT=${1:-runs/synthetic}
shift || true
STEPS=${STEPS:-2000}
BATCH_SIZE=${BATCH_SIZE:-16}
SHARDS=${SHARDS:-1}
LEARNING_RATES=${LEARNING_RATES:-3e-4,1e-3,3e-3,1e-2,3e-2}
TEMPERATURES=${TEMPERATURES:-0.0625,0.125,0.25,0.5,1,4,16}
INSTANCES=${INSTANCES:-"mqar:num_pairs=2@64 salience:levels=128@64"}
GENERALIZE=${GENERALIZE:-"mqar:num_pairs=1@64,128,256,512 mqar:num_pairs=2@64,128,256,512
    mqar:num_pairs=4@64,128,256,512 mqar:num_pairs=8@64,128,256,512 salience:levels=128@32,64,128,256,512"}
ARMS=${ARMS:-"standard qk_norm qk_map standard_prior qk_map_noprior
    qk_map_f2:qk_mode=qk_map,qkmap_num_frequencies=2,qkmap_input_dim=8
    qk_map_f4:qk_mode=qk_map,qkmap_num_frequencies=4,qkmap_input_dim=4
    qk_map_compact:qk_mode=qk_map,qkmap_input_dim=8 qk_map_constant_cos"}
QKMAP=${QKMAP:-python -m qkmap_hf}
export QKMAP SHARDS
instances=($INSTANCES) folders=() pids=()
for instance in "${instances[@]}"; do
    task=${instance%@*} length=${instance##*@}
    folder="$OUT/${task//[:=,]/_}-T$length"
    folders+=("$folder")
    bash "$(dirname "$0")/sharded_compare.sh" "$folder" "$ARMS" --task "$task" --preset tiny --block-size "$length" \
        --batch-size "$BATCH_SIZE" --steps "$STEPS" --seeds 3 --first-seed 0 --tuning-seeds 1 --tuning-first-seed 1000 \
        --max-eval-blocks 256 --eval-steps 100 --save-models --monitor-steps 0 \
        --tune learning_rate="$LEARNING_RATES" --tune logit_scale_multiplier="$TEMPERATURES" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if [[ " $* " == *" --tune-only "* ]]; then
    python -m qkmap_lab.task_report "${folders[@]}" --tuning-only --output-dir "$OUT/report" || status=1
    exit $status
fi
for index in "${!folders[@]}"; do
    instance=${instances[index]} task=${instance%@*} length=${instance##*@}
    mapfile -t models < <(ls -d "${folders[index]}"/shard-*/models/*/seed* 2>/dev/null)
    if ((${#models[@]})); then
        $QKMAP analyze "${models[0]}" --compare "${models[@]:1}" --task "$task" --task-length "$length" \
            --output-dir "${folders[index]}/analysis" || status=1
    fi
done
python -m qkmap_lab.task_report "${folders[@]}" --output-dir "$OUT/report" --generalize $GENERALIZE || status=1
exit $status
