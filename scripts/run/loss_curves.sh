#!/usr/bin/env bash
# AdamW vs DMuon loss curves on real text (the Python standard library's source), with an LR
# sweep. Each (optimizer, lr) is one single-device torchtitan run of configs/llm170m_adamw.toml /
# configs/llm170m_dmuon.toml (identical but for the optimizer). With two or more GPUs, AdamW and
# DMuon at the same lr run side by side on GPUs 0 and 1; with one, one after the other.
#   scripts/run/loss_curves.sh OUTDIR [LR ...] [-- torchtitan overrides]
#   scripts/run/loss_curves.sh outputs/loss_curves 1e-3 2e-3 4e-3
# Writes OUTDIR/<optimizer>_lr<lr>.log per run, then OUTDIR/loss_curves.png and the table
# (scripts/analysis/compare_loss.py; the PNG needs matplotlib). Environment: DUMP_ROOT puts the runs'
# torchtitan dump folders elsewhere; RUN_TIMEOUT (seconds) bounds each run (its log stays);
# OPTIMIZERS="adamw" (or "dmuon") runs one side only, on the first visible GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: scripts/run/loss_curves.sh OUTDIR [LR ...] [-- overrides]}
shift
LRS=()
while [[ $# -gt 0 && $1 != "--" ]]; do LRS+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
[[ ${#LRS[@]} -eq 0 ]] && LRS=(2e-3)
mkdir -p "$OUTDIR"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -m dmuon_titan.toy --out outputs/assets/tokenizer_8k --vocab-size 8192

run() {  # run OPTIMIZER LR DEVICE [overrides...]
  local opt=$1 lr=$2 dev=$3 name="${1}_lr${2}"
  shift 3
  local visible=()
  [[ $GPUS -ge 2 ]] && visible=(env CUDA_VISIBLE_DEVICES="$dev")
  "${visible[@]}" timeout "${RUN_TIMEOUT:-0}" torchrun --standalone --nproc_per_node=1 --role rank --tee 3 \
    -m torchtitan.train --job.config_file "configs/llm170m_${opt}.toml" \
    --job.dump_folder "${DUMP_ROOT:-$OUTDIR}/$name" --optimizer.lr "$lr" "$@" >"$OUTDIR/$name.log" 2>&1 \
    || { echo "run $name failed: tail of $OUTDIR/$name.log"; tail -20 "$OUTDIR/$name.log"; return 1; }
  echo "done: $name ($(grep -a 'step:' "$OUTDIR/$name.log" | grep -cav 'validate\|dmuon') logged steps)"
}

status=0
OPTIMIZERS=${OPTIMIZERS:-adamw dmuon}
for lr in "${LRS[@]}"; do
  if [[ $OPTIMIZERS != "adamw dmuon" ]]; then
    for opt in $OPTIMIZERS; do run "$opt" "$lr" 0 "$@" || status=1; done
  elif [[ $GPUS -ge 2 ]]; then
    run adamw "$lr" 0 "$@" & a=$!
    run dmuon "$lr" 1 "$@" & d=$!
    wait $a || status=1
    wait $d || status=1
  else
    run adamw "$lr" 0 "$@" || status=1
    run dmuon "$lr" 0 "$@" || status=1
  fi
done
shopt -s nullglob
logs=("$OUTDIR"/adamw_lr*.log "$OUTDIR"/dmuon_lr*.log)
[[ ${#logs[@]} -ge 2 && $OPTIMIZERS == "adamw dmuon" ]] || exit $status
png=()
python3 -c "import matplotlib" 2>/dev/null && png=(--png "$OUTDIR/loss_curves.png")
python3 scripts/analysis/compare_loss.py "${logs[@]}" --baseline adamw --json "$OUTDIR/compare.json" \
  --title "llama3 170M on Python stdlib source: DMuon vs AdamW" "${png[@]}" || status=1
exit $status
