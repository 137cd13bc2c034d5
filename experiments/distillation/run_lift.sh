#!/usr/bin/env bash
# Distillation that lifts a student (issue 52, docs/experiments/distillation.md, "A student lifted"). Tiny model, 2-digit
# addition: the student is the built-in model SFT'd 40 steps (configs/sft-arithmetic.yaml, ~1% training reward), the
# teacher the same SFT run 600 steps (~38%). From the same student, at the same LR (1e-3) and number of updates
# (150, one per batch of 16 prompts x 8 samples), 3 seeds:
#   grpo         the task's reward alone (algo=opd with distill.coef=0 and the task reward: GRPO, with the teacher's
#                reverse KL logged)
#   opd_sampled  the teacher's per-token reverse KL as the advantage (distill.estimator=sampled, the default)
#   opd_full     the exact per-position reverse KL over the vocabulary, minimised (distill.estimator=full)
#   sft_teacher  SFT on the teacher's own samples (off-policy distillation: experiments/distillation/offpolicy.py)
# One command, resumable:  bash experiments/distillation/run_lift.sh   (PAR=2: two one-thread runs side by side)
#   LR=3e-3 STEPS=200 OUT=runs/distill_lift_lr3e-3 bash experiments/distillation/run_lift.sh   (the same at SFT's LR)
#   python experiments/distillation/analyze_lift.py runs/distill_lift docs/experiments/distillation.md
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
PY=${PYTHON:-python}
OUT=${OUT:-runs/distill_lift}
SEEDS=${SEEDS:-0 1 2}
PAR=${PAR:-2}
STEPS=${STEPS:-150}
LR=${LR:-1e-3}
export OMP_NUM_THREADS=1
CFG=experiments/distillation/lift.yaml
mkdir -p "$OUT"
for who in student:40 teacher:600; do
  name=${who%%:*} steps=${who##*:}
  [ -e "$OUT/$name/model/config.json" ] || \
    $UNISON sft configs/sft-arithmetic.yaml --out "$OUT/$name" --set sft.steps="$steps" > "$OUT/$name.log" 2>&1
done
S="$OUT/student/model" T="$OUT/teacher/model"
arm() {  # arm NAME SEED ARGS...
  local name=$1 seed=$2; shift 2
  local d="$OUT/$name-s$seed"
  [ -e "$d/summary.json" ] && return
  rm -rf "$d"
  if [ "$name" = sft_teacher ]; then
    $PY experiments/distillation/offpolicy.py "$CFG" --student "$S" --teacher "$T" --out "$d" --seed "$seed" \
      --set train.steps="$STEPS" --set train.lr="$LR" > "$d.log" 2>&1 || { echo "failed: $d.log"; return 1; }
  else
    $UNISON train "$CFG" --out "$d" --set model="$S" --set seed="$seed" --set train.steps="$STEPS" --set train.lr="$LR" \
      --set algo=opd --set distill.teacher="$T" "$@" > "$d.log" 2>&1 || { echo "failed: $d.log"; return 1; }
  fi
  echo "done $d"
}
jobs=()
for seed in $SEEDS; do
  jobs+=("grpo $seed --set distill.coef=0 --set distill.task_reward=true" "opd_sampled $seed"
         "opd_full $seed --set distill.estimator=full" "sft_teacher $seed")
done
running=0
for job in "${jobs[@]}"; do
  # shellcheck disable=SC2086
  arm $job &
  running=$((running + 1))
  if [ "$running" -ge "$PAR" ]; then wait -n; running=$((running - 1)); fi
done
wait
