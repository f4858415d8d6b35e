#!/usr/bin/env bash
# Small-scale measurements on one GPU (torchtitan llama3 170M, configs/llm170m_*.toml, batch
# 8 x 1024, bf16), written to OUTDIR:
#   throughput  AdamW and DMuon each run alone, alternating (A D A D ...), ROUNDS rounds
#               (default 2) of STEPS steps (default 300) with validation every 100 and logs every 10 steps: median training and
#               validation (forward only) tok/s per run, by scripts/analysis/titan_log_summary.py;
#               VARIANTS (default "adamw dmuon") may add dmuon_sync (async_step off: the
#               captured step on the compute stream), dmuon_auto (ns_algorithm "auto") and
#               dmuon_clip (QK-clip at threshold 100: its tracking and clip cost); a
#               variant ending in _w (adamw_w, dmuon_auto_w, ...) runs with one data-loader
#               worker (num_workers 1, prefetch_factor 4) for training and one persistent
#               worker for validation, so that one call compares the loop with and without
#               them on the same machine (a persistent validation worker goes on where the last
#               validation stopped: other batches each time, so its losses are not comparable
#               across validations; its throughput no longer counts tokenization)
#   forward     forward-only (validation) throughput: FWD_VARIANTS (default "adamw dmuon";
#               the first is the baseline) alternating, ROUNDS rounds of FWD_STEPS (default
#               60) training steps with a validation of the whole split every 10: median
#               validation tok/s per run (the first validation, at step 1, left out)
#   profile     PROFILE_ACTIVE (default 1) profiled steps ending at step 60 of each of
#               PROFILE_VARIANTS (default "adamw dmuon"): torchtitan's profiler traces in
#               OUTDIR/dump_profile_VARIANT/profile_traces (Perfetto or chrome://tracing)
#   loss        time-to-loss: SEEDS (default "1 2 3") x LOSS_SPECS (default "adamw:5e-4
#               dmuon:2e-3", VARIANT:lr, e.g. "dmuon_auto:2e-3"; AdamW at 5e-4 and DMuon at 2e-3
#               are each one's best in the learning-rate sweep of docs/benchmarks.md, "Training
#               quality: time to loss"; the first spec is the baseline of the comparison, the
#               second the challenger; logs are named
#               VARIANT_s<seed>.log, VARIANT without underscores), 1000 steps on the stdlib corpus
#               in a shuffled order (dataset pystdlib_shuffled_<seed>), debug.seed = seed,
#               validation every VAL_FREQ (default 100) steps on the whole split; the
#               runs share the GPU side by side (the step counts do not depend on it), and the
#               wall-clock ratio is steps x the step times of the throughput runs
#               (scripts/analysis/time_to_loss.py)
#   larger      one size up (FLAVOR, default 500M): AdamW at 5e-4 then DMuon at 2e-3 (the 170M
#               sweep's best, not re-tuned), each alone, LARGER_STEPS (default 500) steps on
#               pystdlib_shuffled_1, validation every 50; into OUTDIR/larger/ with the
#               throughput summary and the steps to AdamW's final validation loss
#   PIN (e.g. "0-3"): run every torchrun under `taskset -c PIN`, so that all runs use the same
#               host cores (pinning was measured not to remove the run-to-run spread)
#   TITAN_ARGS: more torchtitan overrides for every run, e.g. "--training.dataloader.num_workers
#               1" (batches tokenized ahead in a worker: the loop no longer waits on the data)
#   Every run's config and overrides are appended to OUTDIR/commands.txt.
#   scripts/run/small_scale.sh OUTDIR [throughput] [forward] [profile] [loss] [larger]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: scripts/run/small_scale.sh OUTDIR [throughput] [forward] [profile] [loss] [larger]}
shift
PARTS=${*:-throughput profile loss}
STEPS=${STEPS:-300}
ROUNDS=${ROUNDS:-2}
SEEDS=${SEEDS:-1 2 3}
LOSS_SPECS=${LOSS_SPECS:-adamw:5e-4 dmuon:2e-3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -m dmuon_titan.toy --out outputs/assets/tokenizer_8k --vocab-size 8192
titan() {  # titan NAME VARIANT [overrides...]: VARIANT adamw, dmuon, dmuon_sync or dmuon_auto,
  # each optionally with _w (one data-loader worker)
  local name=$1 opt=$2 extra=()
  shift 2
  if [[ $opt == *_w ]]; then
    opt=${opt%_w}
    extra=(--training.dataloader.num_workers 1 --training.dataloader.prefetch_factor 4
      --validation.dataloader.num_workers 1 --validation.dataloader.persistent_workers
      --validation.dataloader.prefetch_factor 4)
  fi
  case $opt in
    dmuon_sync) opt=dmuon extra+=(--dmuon.no_async_step) ;;
    dmuon_auto) opt=dmuon extra+=(--dmuon.ns_algorithm auto) ;;
    dmuon_clip) opt=dmuon extra+=(--dmuon.qk_clip_threshold 100) ;;
  esac
  echo "$name: configs/llm170m_${opt}.toml $* ${extra[*]} ${TITAN_ARGS:-}" >>"$OUT/commands.txt"
  ${PIN:+taskset -c "$PIN"} torchrun --standalone --nproc_per_node=1 --role rank --tee 3 \
    -m torchtitan.train \
    --job.config_file "configs/llm170m_${opt}.toml" --job.dump_folder "$OUT/dump_$name" \
    --metrics.disable_color_printing "$@" "${extra[@]}" ${TITAN_ARGS:-} >"$OUT/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -30 "$OUT/$name.log"; return 1; }
}
alternate() {  # alternate PART "VARIANT..." [overrides...]: ROUNDS rounds, each run alone; logs in logs
  local part=$1 variants=$2 round variant
  shift 2
  logs=()
  for round in $(seq "$ROUNDS"); do
    for variant in $variants; do
      titan "${part}_${variant}_$round" "$variant" "$@"
      logs+=("$OUT/${part}_${variant}_$round.log")
    done
  done
}
summarize() {  # summarize SKIP OUTFILE LOG...: the runs' medians after step SKIP, printed and kept
  local skip=$1 out=$2
  shift 2
  (cd scripts/analysis && python3 titan_log_summary.py --seq-len 1024 --batch 8 --skip "$skip" \
    "$@") | tee "$out" || true
}
for part in $PARTS; do
  case $part in
    throughput)
      alternate throughput "${VARIANTS:-adamw dmuon}" --training.steps "$STEPS" \
        --metrics.log_freq 10 --validation.freq 100 --training.dataset pystdlib_shuffled_1
      summarize 20 "$OUT/throughput.md" "${logs[@]}" ;;
    forward)
      alternate forward "${FWD_VARIANTS:-adamw dmuon}" --training.steps "${FWD_STEPS:-60}" \
        --metrics.log_freq 10 --validation.freq 10 --training.dataset pystdlib_shuffled_1
      summarize 1 "$OUT/forward.md" "${logs[@]}" ;;
    profile)
      for opt in ${PROFILE_VARIANTS:-adamw dmuon}; do
        titan "profile_$opt" "$opt" --training.steps 62 --validation.no-enable \
          --profiling.enable_profiling --profiling.profile_freq 60 \
          --profiling.profiler_active "${PROFILE_ACTIVE:-1}" --profiling.profiler_warmup 3 \
          --profiling.save_traces_folder profile_traces
      done ;;
    loss)
      pids=()
      for seed in $SEEDS; do
        for spec in $LOSS_SPECS; do
          variant=${spec%%:*} lr=${spec##*:}
          # time_to_loss.py reads <optimizer>_s<seed>.log, the optimizer without underscores
          titan "${variant//_/}_s$seed" "$variant" --optimizer.lr "$lr" --debug.seed "$seed" \
            --training.dataset "pystdlib_shuffled_$seed" --validation.freq "${VAL_FREQ:-100}" &
          pids+=($!)
        done
      done
      status=0
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      [[ $status -eq 0 ]] || exit 1
      specs=($LOSS_SPECS)  # the first is the baseline, the second the challenger
      baseline=${specs[0]%%:*} challenger=${specs[1]:-none}
      challenger=${challenger%%:*}
      (cd scripts/analysis && python3 time_to_loss.py "$OUT" --json "$OUT/time_to_loss.json" \
        --baseline "${baseline//_/}" --challenger "${challenger//_/}") \
        | tee "$OUT/time_to_loss.md" || true ;;
    larger)
      mkdir -p "$OUT/larger"
      for spec in adamw:5e-4 dmuon:2e-3; do
        opt=${spec%%:*} lr=${spec##*:}
        titan "larger/${opt}_s1" "$opt" --model.flavor "${FLAVOR:-500M}" --optimizer.lr "$lr" \
          --debug.seed 1 --training.dataset pystdlib_shuffled_1 \
          --training.steps "${LARGER_STEPS:-500}" --validation.freq 50 --metrics.log_freq 10
      done
      (cd scripts/analysis && python3 titan_log_summary.py --seq-len 1024 --batch 8 --skip 20 \
        "$OUT"/larger/*_s1.log && python3 time_to_loss.py "$OUT/larger") \
        | tee "$OUT/larger/summary.md" || true ;;
  esac
done
