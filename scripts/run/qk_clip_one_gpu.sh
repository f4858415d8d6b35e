#!/usr/bin/env bash
# QK-clip's cost on one GPU: torchtitan llama3 "8B_8layers" (the first 8 blocks of
# llama3-8B), seq 8192, batch 2, full activation checkpointing, eager, 12 steps,
# configs/llama3_8b_dmuon.toml without and with [dmuon] qk_clip_threshold = 100, ROUNDS
# pairs (default 1) alternating; then the tracking kernel's own time
# (scripts/bench/bench_max_logit.py). The 170M model: small_scale.sh's dmuon_clip variant.
#   scripts/run/qk_clip_one_gpu.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/run/qk_clip_one_gpu.sh OUTDIR}
mkdir -p "$OUT"
logs=()
for ((r = 1; r <= ${ROUNDS:-1}; r++)); do
  for variant in dmuon clip; do
    extra=()
    [[ $variant == clip ]] && extra=(--dmuon.qk_clip_threshold 100)
    log="$OUT/8b_${variant}_$r.log"
    scripts/train.sh configs/llama3_8b_dmuon.toml --job.dump_folder "$OUT/8b_$variant" \
      --model.flavor 8B_8layers "${extra[@]}" >"$log" 2>&1 \
      || { echo "$variant run failed: tail of $log"; tail -20 "$log"; exit 1; }
    logs+=("$log")
  done
done
python3 scripts/analysis/titan_log_summary.py --seq-len 8192 --batch 2 "${logs[@]}"
grep -h "QK-clip" "${logs[@]}" | head -1 || true
grep -ho "max_attention_logit[^|]*" "$OUT/8b_clip_1.log" | tail -3 || true
python3 scripts/bench/bench_max_logit.py
