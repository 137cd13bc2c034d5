#!/usr/bin/env bash
# The cures the field ships, on the two runs that collapse (issue 27). The recipe of
# experiments/quantized_rollout and experiments/staleness (tiny model, SFT warm start on 7-operand chained
# sums with the working written out, the 64 perfectible prompts, 16 prompts x 8 samples, 4 mini-batches per
# step, lr 1e-4, 60 steps, fp32 compute on both sides, 3 seeds), every lever at its source's defaults — no
# per-regime tuning:
#   int4 rollout  x {grpo, grpo + quantization_aware, grpo_icepop, ipo (eps 0.1 / tau 1e-3 and 0.3 / 0),
#                    grpo_m2po (AReaL's), grpo_m2po_mask, grpo + mismatch_budget}; fp8 x {grpo, grpo + quantization_aware}; clean: none/grpo
#   K = 4 staleness x {naive, decoupled, dppo, grpo_icepop, ipo (both), grpo_m2po, grpo_m2po_mask,
#                    naive + mismatch_budget};
#                    clean: K = 0 naive
#   top-p 0.9      x grpo with and without sampling-mask replay
# Every arm is a directory of its own under $OUT sharing one warm start and perfectible set; rerun to
# continue (finished arms are reused). Then the deploy gap of the int4 arms and the reports:
#   bash experiments/cures/run.sh          (one command; ~4 h on 2 cores, one thread per run)
# ARMS="name ..." runs only those arms (and no analysis), e.g. the M2PO re-run of issue 42:
#   ARMS="q-none-grpo q-int4-grpo q-int4-m2po k0-naive k4-naive k4-m2po" OUT=runs/cures-m2po PAR=2 \
#     bash experiments/cures/run.sh && python experiments/cures/analyze.py --m2po runs/cures-m2po docs
# writes runs/cures/ and docs/experiments/cures.md (+ the cures sections of
# docs/experiments/quantized_rollout.md and docs/experiments/staleness.md). PAR=2 runs two arms side by side (one thread each).
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
PY=${PYTHON:-python}
OUT=${OUT:-runs/cures}
SEEDS=${SEEDS:-0,1,2}
PAR=${PAR:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RECIPE=(--max-prompts 64 --precisions fp32 --seeds "$SEEDS"
  --set task.name=scratchpad --set task.operands=7 --set task.digits=2 --set task.style=full
  --set task.train_size=600 --set task.eval_size=200
  --set rollout.max_new_tokens=96 --set sft.steps=600
  --set train.steps=60 --set train.lr=1e-4 --set train.prompts_per_step=16 --set rollout.n=8
  --set train.mini_batches=4 --set train.micro_batch_size=64 --set checkpoint.every=20)
QUANT=(--set train.micro_batch_tokens=null)  # the micro-batching experiments/quantized_rollout was measured with
STALE=(--set train.micro_batch_tokens=4096 --set mismatch.decompose_every=5 --set rollout.worker_threads=1)
IPO_WIDE=(--set policy.clip=0.3 --set policy.kl_tau=0)

ARMS=${ARMS:-}
wanted() { [ -z "$ARMS" ] || [[ " $ARMS " == *" $1 "* ]]; }

arm() {  # arm NAME ARGS...: one sanity run (3 seeds) in $OUT/NAME, sharing the first arm's warm start
  local name=$1; shift
  wanted "$name" || [ "$name" = q-none-grpo ] || return 0
  local d="$OUT/$name"
  mkdir -p "$d"
  if [ "$name" != q-none-grpo ] && [ ! -e "$d/sft" ]; then
    cp -r "$OUT/q-none-grpo/sft" "$d/sft"; cp "$OUT/q-none-grpo/perfectible.jsonl" "$d/"
  fi
  $UNISON sanity --out "$d" "${RECIPE[@]}" "$@" > "$d/log.txt" 2>&1 || { echo "arm $name failed: $d/log.txt"; tail -5 "$d/log.txt"; return 1; }
  echo "arm $name done"
}

run_all() {  # run_all "NAME ARGS" ...: PAR at a time
  local running=0
  for spec in "$@"; do
    # shellcheck disable=SC2086
    arm $spec &
    running=$((running + 1))
    if [ "$running" -ge "$PAR" ]; then wait -n; running=$((running - 1)); fi
  done
  wait
}

arm q-none-grpo --algorithms grpo "${QUANT[@]}"   # first: the warm start and the perfectible set every arm shares
run_all \
  "q-int4-grpo --quantization int4 --algorithms grpo ${QUANT[*]}" \
  "q-int4-qat --quantization int4 --algorithms grpo --set train.quantization_aware=true ${QUANT[*]}" \
  "q-int4-icepop --quantization int4 --algorithms grpo_icepop ${QUANT[*]}" \
  "q-int4-ipo --quantization int4 --algorithms ipo ${QUANT[*]}" \
  "q-int4-ipo_wide --quantization int4 --algorithms ipo ${IPO_WIDE[*]} ${QUANT[*]}" \
  "q-int4-m2po --quantization int4 --algorithms grpo_m2po ${QUANT[*]}" \
  "q-int4-m2po_mask --quantization int4 --algorithms grpo_m2po_mask ${QUANT[*]}" \
  "q-int4-budget --quantization int4 --algorithms grpo --set train.schedule=mismatch_budget ${QUANT[*]}" \
  "q-fp8-grpo --quantization fp8 --algorithms grpo ${QUANT[*]}" \
  "q-fp8-qat --quantization fp8 --algorithms grpo --set train.quantization_aware=true ${QUANT[*]}" \
  "k0-naive --algorithms grpo --set rollout.max_staleness=0 ${STALE[*]}" \
  "k4-naive --algorithms grpo --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-decoupled --algorithms grpo_token_tis --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-dppo --algorithms dppo_tv --set policy.anchor=bypass --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-icepop --algorithms grpo_icepop --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-ipo --algorithms ipo --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-ipo_wide --algorithms ipo ${IPO_WIDE[*]} --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-m2po --algorithms grpo_m2po --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-m2po_mask --algorithms grpo_m2po_mask --set rollout.max_staleness=4 ${STALE[*]}" \
  "k4-budget --algorithms grpo --set train.schedule=mismatch_budget --set rollout.max_staleness=4 ${STALE[*]}" \
  "p-topp-replay --algorithms grpo --set rollout.top_p=0.9 ${QUANT[*]}" \
  "p-topp-noreplay --algorithms grpo --set rollout.top_p=0.9 --set rollout.replay_sampling_mask=false ${QUANT[*]}"
[ -n "$ARMS" ] && exit 0
$PY experiments/cures/deploy_gap.py "$OUT"
$PY experiments/cures/analyze.py "$OUT" docs
