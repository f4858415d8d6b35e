#!/usr/bin/env bash
# Train with torchtitan + DMuon: on every local GPU if there are any, else on 2 CPU ranks (gloo).
#   scripts/train.sh [config.toml] [torchtitan overrides...]
#   scripts/train.sh configs/toy_dmuon.toml --training.steps 50
# Offline: the tokenizer is trained here on the Python standard library (once, ~10 s).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/toy_dmuon.toml}
[[ $# -gt 0 ]] && shift
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
exec torchrun --standalone --nproc_per_node="$NPROC" --local-ranks-filter 0 --role rank --tee 3 \
  -m torchtitan.train \
  --job.config_file "$CONFIG" ${color[@]+"${color[@]}"} "$@"
