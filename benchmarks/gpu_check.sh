#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU (run it where one is lent; it is not part of CI). Budget: <= 7 minutes.
#
#   benchmarks/gpu_check.sh               # on the GPU: every step below; exit status 1 if any step failed or a
#                                         # path is missing (flash_attn not installed counts: install it, or set
#                                         # QKMAP_GPU_CHECK_WITHOUT_FLASH=1 to accept its absence explicitly)
#   benchmarks/gpu_check.sh --cpu-smoke   # the same steps on the CPU with tiny sizes (flash: not on a CPU)
#
# Steps, each under its own timeout, each reported PASS/FAIL in the summary at the end:
#   1. tests/plugin/test_gpu.py on the device: bf16 against fp32 and the cache for every mode, the feature map's custom
#      backward against the written-out formula, the wide layout's sdpa training step and decoding against eager,
#      the parameter rows decoding keeps between tokens after a move to the device and an update there, the
#      compiled feature map (qkmap_compile_feature_map: Triton) against the eager one;
#   2. benchmarks/kernel_paths.py: every kernel path of the wide layout (sdpa with padded values and
#      single_query_attention decoding, flex_attention with unpadded values, flash-attention 2) against eager:
#      forward, backward, greedy decoding; a missing path is a failure, named with the reason;
#   3. benchmarks/attention_overhead.py in bf16 per path (sdpa, flex_attention, flash_attention_2): training
#      step, forward, prefill and decode against standard, activation and cache bytes;
#   4. benchmarks/shape_grid.py (sdpa, bf16) on a GPU-sized subset of the issue-23 grid: head_dim 64 and 128,
#      16 heads with and without GQA 4:1, 2 layers, T = 2048, every variant (the wide layout also with
#      qkmap_recompute_projections): per shape the same ratios with their matmul-FLOP
#      floors (decode also its memory floor; training also the floor with the attention kernel's measured time,
#      --kernel-time) and the KV-cache bytes per token after generate() (dynamic and static cache);
#   5. the same grid's decoding with a StaticCache (--decode-cache static, the cache of generate(
#      cache_implementation="static") and of compiled decoding): decode ratios, the cache written in place;
#   6. benchmarks/map_share.py on the same shapes: the training step without the feature map and the map's own
#      sin/cos alone, against standard: what a fused feature-map kernel could save on this GPU at most;
#   7. benchmarks/shape_grid.py on one of those shapes (d128 h16/kv4) with each layout's feature map compiled
#      (qkmap_compile_feature_map) next to the eager one: what the fused map saves on this GPU.
# The fused CPU kernels (qkmap_fused_feature_map, qkmap_fused_attention; qkmap_hf/kernels) run on CPU tensors only:
# on the GPU the layouts run the eager (or compiled) map and sdpa with padded values whatever those fields say.
# --cpu-smoke's grid step measures the product's CPU defaults too (qk_map_compact_kernels,
# qk_map_wide_recompute_kernels) and the fused map alone (..._fused); the kernels are built first if missing.
# It ends with the PASS/FAIL list and ONE Markdown table of every benchmark step's ratios (shape_grid.py
# --summarize; also written to $OUT/summary_table.md), to paste into docs/performance.md, and map_share.py's table
# ($OUT/map_share/map_share_table.md).
# The timeouts are caps, not measurements: this script has never run on a GPU (none was lent so far).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
MODE=gpu
if [[ "${1:-}" == "--cpu-smoke" ]]; then MODE=cpu; elif [[ -n "${1:-}" ]]; then
    echo "unknown argument $1 (use --cpu-smoke or nothing)" >&2; exit 2
fi
declare -a SUMMARY=()
FAILED=0

step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $OUT/NAME.log, record PASS/FAIL
    local name=$1 seconds=$2; shift 2
    echo "=== $name (timeout ${seconds}s): $*"
    timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    if [[ $status -eq 0 ]]; then SUMMARY+=("PASS $name"); else
        [[ $status -eq 124 ]] && reason="timed out after ${seconds}s" || reason="exit status $status"
        SUMMARY+=("FAIL $name ($reason; see $OUT/$name.log)"); FAILED=1
    fi
}

if [[ $MODE == gpu ]]; then
    if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "FAIL: torch sees no CUDA GPU (torch $(python3 -c 'import torch; print(torch.__version__)')). For the" \
             "CPU-runnable parts use: benchmarks/gpu_check.sh --cpu-smoke" >&2
        exit 1
    fi
    python3 -c "import torch; print('GPU:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
    DEVICE=cuda DTYPE=bfloat16
    PATHS=(sdpa flex_attention flash_attention_2)
    if [[ "${QKMAP_GPU_CHECK_WITHOUT_FLASH:-0}" == 1 ]] && ! python3 -c "import flash_attn" 2>/dev/null; then
        PATHS=(sdpa flex_attention); SUMMARY+=("ACCEPTED-MISSING flash_attention_2 (QKMAP_GPU_CHECK_WITHOUT_FLASH=1)")
    fi
    BENCH=(--device cuda --dtype bfloat16 --variants standard qk_map_compact qk_map_wide --batch 8 --repeats 3)
    SDPA_SIZES=(--seq-lens 1024 4096 --max-train-len 4096 --prefill-len 2048 --decode-tokens 32)
    OTHER_SIZES=(--seq-lens 1024 --max-train-len 1024 --prefill-len 1024 --decode-tokens 16)
    GRID=(--head-dims 64 128 --heads 16 --kv-ratios 1 4 --layers 2 --seq-lens 2048 --batch 4 --repeats 3
          --decode-tokens 16 --variants standard qk_norm qk_map_compact qk_map_wide qk_map_wide_recompute)
    MAP_SHARE=(--head-dims 64 128 --heads 16 --kv-ratios 1 4 --layers 2 --seq-lens 2048 --batch 4 --repeats 5
               --in-process)
    COMPILED=(--head-dims 128 --heads 16 --kv-ratios 4 --layers 2 --seq-lens 2048 --batch 4 --repeats 3
              --decode-tokens 4 --variants standard qk_map_compact qk_map_compact_compiled qk_map_wide
              qk_map_wide_compiled)
    # 405 s of step timeouts at most, plus start-up and the summary tables (a few seconds): <= 7 minutes
    T_TESTS=60 T_PATHS=45 T_SDPA=45 T_FLEX=40 T_FLASH=35 T_GRID=65 T_GRID_STATIC=25 T_MAP_SHARE=40 T_COMPILED=50
else
    echo "CPU smoke: the GPU steps at tiny sizes on the CPU; flash-attention 2 needs CUDA and is not run"
    DEVICE=cpu DTYPE=float32
    PATHS=(sdpa flex_attention)
    BENCH=(--device cpu --dtype float32 --variants standard qk_map_wide --batch 1 --repeats 1 --threads 1)
    SDPA_SIZES=(--seq-lens 64 --max-train-len 64 --prefill-len 32 --decode-tokens 4)
    OTHER_SIZES=(--seq-lens 64 --max-train-len 0 --prefill-len 32 --decode-tokens 4)  # no flex backward on CPU
    GRID=(--head-dims 16 --heads 4 --kv-ratios 1 4 --layers 1 --seq-lens 32 --repeats 1 --decode-tokens 2
          --kv-prompt-len 4 --kv-new-tokens 2 --threads 1
          --variants standard qk_norm qk_map_compact qk_map_wide qk_map_wide_recompute qk_map_compact_fused
          qk_map_wide_recompute_fused qk_map_compact_kernels qk_map_wide_recompute_kernels)
    MAP_SHARE=(--head-dims 16 --heads 4 --kv-ratios 1 --layers 1 --seq-lens 32 --repeats 2 --threads 1 --in-process)
    COMPILED=(--head-dims 16 --heads 4 --kv-ratios 4 --layers 1 --seq-lens 32 --repeats 1 --decode-tokens 2
              --kv-prompt-len 4 --kv-new-tokens 2 --threads 1 --variants standard qk_map_compact_compiled
              qk_map_wide_compiled)
    T_TESTS=180 T_PATHS=240 T_SDPA=120 T_FLEX=240 T_FLASH=0 T_GRID=120 T_GRID_STATIC=120 T_MAP_SHARE=60  # caps
    T_COMPILED=180
fi

rm -rf "$OUT"/bench_* "$OUT/grid" "$OUT/grid_static" "$OUT/map_share" "$OUT/compiled"  # the table at the end must not show an earlier run's CSVs
step gpu_tests "$T_TESTS" env QKMAP_TEST_DEVICE="$DEVICE" python3 -m pytest -q -x -p no:cacheprovider tests/plugin/test_gpu.py
step kernel_paths "$T_PATHS" python3 benchmarks/kernel_paths.py --device "$DEVICE" --dtype "$DTYPE" --paths "${PATHS[@]}"
for path in "${PATHS[@]}"; do
    case $path in
        sdpa) sizes=("${SDPA_SIZES[@]}") seconds=$T_SDPA ;;
        flex_attention) sizes=("${OTHER_SIZES[@]}") seconds=$T_FLEX ;;
        *) sizes=("${OTHER_SIZES[@]}") seconds=$T_FLASH ;;
    esac
    step "bench_$path" "$seconds" python3 benchmarks/attention_overhead.py "${BENCH[@]}" "${sizes[@]}" \
        --attn "$path" --output-dir "$OUT/bench_$path"
done

step grid "$T_GRID" python3 benchmarks/shape_grid.py --device "$DEVICE" --dtype "$DTYPE" --attn sdpa "${GRID[@]}" \
    --kernel-time --output-dir "$OUT/grid"
step grid_static "$T_GRID_STATIC" python3 benchmarks/shape_grid.py --device "$DEVICE" --dtype "$DTYPE" --attn sdpa \
    "${GRID[@]}" --no-train --decode-cache static --output-dir "$OUT/grid_static"
step map_share "$T_MAP_SHARE" python3 benchmarks/map_share.py --device "$DEVICE" --dtype "$DTYPE" "${MAP_SHARE[@]}" \
    --output-dir "$OUT/map_share"
step compiled "$T_COMPILED" python3 benchmarks/shape_grid.py --device "$DEVICE" --dtype "$DTYPE" --attn sdpa \
    "${COMPILED[@]}" --output-dir "$OUT/compiled"

echo "=== summary ($MODE; logs and CSVs under $OUT)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
RUNS=()
for path in "${PATHS[@]}"; do RUNS+=("bench_$path=$OUT/bench_$path"); done
echo "=== one table of every benchmark step (cost ratio vs standard, median [min-max] over repeats; floors: matmul" \
     "FLOPs, and for decode / memory: elements moved per token)"
python3 benchmarks/shape_grid.py --summarize "${RUNS[@]}" "grid=$OUT/grid" "grid_static=$OUT/grid_static" \
    "compiled=$OUT/compiled" \
    | tee "$OUT/summary_table.md"
echo "=== the feature map's share of the training step (map_share.py: step, without the map, sin/cos alone)"
cat "$OUT/map_share/map_share_table.md" 2>/dev/null || echo "(map_share did not finish: see $OUT/map_share.log)"
[[ $FAILED -eq 0 ]] || { echo "gpu_check: FAILED (see above)" >&2; exit 1; }
