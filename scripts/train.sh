#!/usr/bin/env bash
# Train with torchtitan + DMuon: on every local GPU if there are any, else on 2 CPU ranks (gloo).
#   scripts/train.sh                      # the showcase: the toy job with AdamW, then with
#                                         # DMuon, then the two compared (3-5 min on 2 CPU cores)
#   scripts/train.sh config.toml [torchtitan overrides...]    # one run
#   scripts/train.sh configs/toy_dmuon.toml --training.steps 50
# Offline: the tokenizer is trained here on the Python standard library (once, ~10 s).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -eq 0 ]]; then
  out=outputs/showcase
  mkdir -p "$out"
  for opt in adamw dmuon; do
    echo "== toy job, $opt (log: $out/$opt.log)"
    set +e
    "$0" "configs/toy_$opt.toml" --job.dump_folder "$out/$opt" --metrics.log_freq 10 2>&1 \
      | tee "$out/$opt.log" | grep -aE "progress:|summary:|validate step|error" | grep -v lspci
    status=${PIPESTATUS[0]}
    set -e
    [[ $status -eq 0 ]] || { echo "the $opt run failed (exit $status): see $out/$opt.log"; exit 1; }
  done
  echo "== DMuon vs AdamW, same job (same data, lr 3e-3 each: the best of each one's sweep)"
  python3 scripts/analysis/compare_loss.py "adamw=$out/adamw.log" "dmuon=$out/dmuon.log" \
    --baseline adamw
  echo "(On CPU a DMuon step costs more than an AdamW step: Newton-Schulz in float32 on the"
  echo " cores. On GPUs it runs in bf16: llama3-8B on 2 H200s 1.15x AdamW's step time, a 170M"
  echo " model on one H100 0.92-0.95x AdamW's tok/s, 0.60x the steps and about 0.66x the"
  echo " wall-clock to the same loss; see docs/benchmarks.md.)"
  exit 0
fi
CONFIG=$1
shift
NPROC=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count() or 2)")}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  :
else  # CPU ranks: one thread each, or the ranks' thread pools fight over the cores
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
color=()
[[ -t 1 ]] || color=(--metrics.disable_color_printing)  # no colour codes in log files
python3 -m dmuon_titan.toy --out outputs/assets/tokenizer
# torchrun's launcher; a failed run ends in one line instead of the launcher's traceback
exec python3 -m dmuon_titan.launch --standalone --nproc_per_node="$NPROC" --local-ranks-filter 0 --role rank --tee 3 \
  -m torchtitan.train \
  --job.config_file "$CONFIG" ${color[@]+"${color[@]}"} "$@"
