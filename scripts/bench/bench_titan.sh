#!/usr/bin/env bash
# torchtitan llama3-8B on every local GPU: AdamW vs DMuon, the same config otherwise
# (configs/llama3_8b_{adamw,dmuon}.toml plus the same overrides). Prints step time, tok/s,
# peak memory, optimizer/NS time, the ratio, and (T_DMuon - T_AdamW) / T_floor where
# T_floor = NS FLOPs of all dedicated matrices / (GPUs x MATMUL_TFLOPS, default 786: the bf16
# 8192^3 matmul rate scripts/bench/bench_ns.py measured on an H200; docs/benchmarks.md,
# "torchtitan llama3-8B on two GPUs").
#   scripts/bench/bench_titan.sh OUTDIR [torchtitan overrides...]
#   CONFIG_PREFIX=configs/toy_ scripts/bench/bench_titan.sh /tmp/b --training.steps 6   # CPU smoke
#   scripts/bench/bench_titan.sh outputs/bench_titan                       # seq 8192, batch 2, full AC
#   scripts/bench/bench_titan.sh outputs/bench_llm --training.seq_len 2048 --activation_checkpoint.mode none
# DMUON_ARGS: extra overrides for the DMuon run only, e.g.
#   DMUON_ARGS="--dmuon.ns_algorithm auto --dmuon.ns_dtype float16" scripts/bench/bench_titan.sh out
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: scripts/bench/bench_titan.sh OUTDIR [torchtitan overrides...]}
shift
mkdir -p "$OUTDIR"
SEQ=8192 BATCH=2
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
  case ${args[i]} in
    --training.seq_len) SEQ=${args[i + 1]} ;;
    --training.local_batch_size) BATCH=${args[i + 1]} ;;
  esac
done
status=0
read -r -a dmuon_args <<<"${DMUON_ARGS:-}"
for opt in adamw dmuon; do
  extra=()
  [[ $opt == dmuon ]] && extra=("${dmuon_args[@]}")
  scripts/train.sh "${CONFIG_PREFIX:-configs/llama3_8b_}${opt}.toml" \
    --job.dump_folder "$OUTDIR/$opt" "$@" "${extra[@]}" >"$OUTDIR/$opt.log" 2>&1 \
    || { echo "$opt run failed: tail of $OUTDIR/$opt.log"; tail -20 "$OUTDIR/$opt.log"; status=1; }
done
python3 scripts/analysis/titan_log_summary.py --seq-len "$SEQ" --batch "$BATCH" \
  "$OUTDIR/adamw.log" "$OUTDIR/dmuon.log" --floor-tflops "${MATMUL_TFLOPS:-786}" || status=1
exit $status
