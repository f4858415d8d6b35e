#!/usr/bin/env bash
# float8 linears with DMuon on one GPU: torchtitan llama3 "8B_8layers" (the first 8 blocks of
# llama3-8B), seq 8192, batch 2, full activation checkpointing, torch.compile on (float8's
# casts are fused by it), 12 steps; AdamW vs DMuon (configs/llama3_8b_*.toml) with torchao's
# float8 (tensorwise scaling, the default recipe) and, for context, without it. Each pair is
# scripts/bench/bench_titan.sh (tok/s, step time, peak memory, optimizer/NS time, ratio).
#   scripts/run/float8_one_gpu.sh OUTDIR [float8] [bf16]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/run/float8_one_gpu.sh OUTDIR [float8] [bf16]}
shift
PARTS=${*:-float8 bf16}
COMMON=(--model.flavor 8B_8layers --compile.enable)
for part in $PARTS; do
  case $part in
    float8)
      # AdamW gets "quantize.linear.float8"; DMuon's converter comes after it (DMUON_ARGS wins)
      DMUON_ARGS="--model.converters quantize.linear.float8,dmuon" \
        scripts/bench/bench_titan.sh "$OUT/float8" "${COMMON[@]}" \
        --model.converters quantize.linear.float8 ;;
    bf16)
      scripts/bench/bench_titan.sh "$OUT/bf16" "${COMMON[@]}" ;;
  esac
done
