#!/usr/bin/env bash
# Mixture-of-experts measurements on one GPU, written to OUTDIR:
#   bench   the optimizer step on expert stacks, DMuon vs torch.optim.Muon on every slice, and
#           Newton-Schulz batched vs one expert at a time (scripts/bench/bench_experts.py):
#           DeepSeek-V3-like [32 x 2048 x 7168] stacks and Qwen3-30B-A3B-like [128 x 768 x 2048]
#   titan   torchtitan qwen3 "moe_1B" (8 blocks of 64 experts, 1.2 B parameters), AdamW then
#           DMuon, the same job (configs/toy_*.toml on the stdlib corpus, fp32, seq 2048; the
#           toy config's float32 Newton-Schulz, for CPUs)
#   titan_bf16  the DMuon run again with bf16 Newton-Schulz, plain and "auto" (GPU settings)
#   models  DMuon trains deepseek_v3 and gpt_oss debug models (gpt_oss's FlexAttention has no
#           CPU backward, so this is where it runs)
#   gpt_oss AdamW then DMuon on gpt_oss debugmodel_small, 20 steps from the same seed, with
#           FlexAttention compiled in Inductor's default mode (scripts/bench/titan_flex_default.py:
#           torchtitan's max-autotune compile outlasts a device call)
#   scripts/run/moe_one_gpu.sh OUTDIR [bench] [titan] [titan_bf16] [models] [gpt_oss]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/run/moe_one_gpu.sh OUTDIR [bench] [titan] [titan_bf16] [models] [gpt_oss]}
shift
PARTS=${*:-bench titan titan_bf16 models}
QWEN_MOE=(--model.name qwen3 --model.flavor moe_1B --training.seq_len 2048
  --training.local_batch_size 4 --training.steps 30 --metrics.log_freq 5
  --lr_scheduler.warmup_steps 5)
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -m dmuon_titan.toy --out outputs/assets/tokenizer
titan() {  # titan NAME CONFIG [overrides...]; ENTRY: the trainer (default -m torchtitan.train)
  local name=$1 config=$2
  shift 2
  torchrun --standalone --nproc_per_node=1 --role rank --tee 3 ${ENTRY:--m torchtitan.train} \
    --job.config_file "$config" --job.dump_folder "$OUT/dump_$name" \
    --metrics.disable_color_printing --validation.no-enable "$@" >"$OUT/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -30 "$OUT/$name.log"; return 1; }
  echo "$name: $(grep -a 'summary:' "$OUT/$name.log" | tail -1)"
}
for part in $PARTS; do
  case $part in
    bench)
      python3 scripts/bench/bench_experts.py --shape deepseek_v3 --experts 32 \
        --json "$OUT/bench_deepseek_v3.json" | tee "$OUT/bench_deepseek_v3.md"
      python3 scripts/bench/bench_experts.py --shape qwen3_30b --experts 128 \
        --json "$OUT/bench_qwen3_30b.json" | tee "$OUT/bench_qwen3_30b.md" ;;
    titan)
      for opt in adamw dmuon; do
        titan "qwen3_moe_1B_$opt" "configs/toy_$opt.toml" "${QWEN_MOE[@]}"
      done ;;
    titan_bf16)
      for algo in plain auto; do
        titan "qwen3_moe_1B_dmuon_bf16_$algo" configs/toy_dmuon.toml "${QWEN_MOE[@]}" \
          --dmuon.ns_dtype bfloat16 --dmuon.ns_algorithm "$algo"
      done ;;
    models)
      titan deepseek_v3_dmuon configs/toy_dmuon.toml --model.name deepseek_v3 \
        --model.flavor debugmodel --training.steps 20 --metrics.log_freq 5
      titan gpt_oss_dmuon configs/toy_dmuon.toml --model.name gpt_oss \
        --model.flavor debugmodel_small --training.steps 20 --metrics.log_freq 5 ;;
    gpt_oss)
      for opt in adamw dmuon; do
        ENTRY=scripts/bench/titan_flex_default.py titan "gpt_oss_flex_default_$opt" \
          "configs/toy_$opt.toml" --model.name gpt_oss --model.flavor debugmodel_small \
          --training.steps 20 --metrics.log_freq 1 --debug.seed 1
      done ;;
  esac
done
