#!/usr/bin/env bash
# Runs the arms of one `qkmap compare` as SHARDS parallel processes (one thread each, niced), each in OUT/shard-K
# with every SHARDS-th arm; the data, its split and the seeds are the same in every shard, so reports pair runs
# across shards (python -m qkmap_lab.stability / qkmap_lab.task_report read OUT/shard-*). Resumable like qkmap compare.
#   usage: benchmarks/sharded_compare.sh OUT "ARM ARM ..." [qkmap compare flags...]
set -euo pipefail
OUT=$1 ARMS=($2)
shift 2
SHARDS=${SHARDS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
pids=()
for ((shard = 0; shard < SHARDS; shard++)); do
    variants=()
    for ((i = shard; i < ${#ARMS[@]}; i += SHARDS)); do variants+=(--variant "${ARMS[i]}"); done
    mkdir -p "$OUT/shard-$shard"
    nice -n 19 ${QKMAP:-python -m qkmap_hf} compare "$@" "${variants[@]}" --output-dir "$OUT/shard-$shard" \
        >"$OUT/shard-$shard/log.txt" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
