#!/usr/bin/env bash
# Distillation on SmolLM2-135M (issue 52): the teacher is SmolLM2 after the clean GRPO run of run_precision.sh /
# run_stale.sh (clean-lr1e-5-s0, 60 steps: its final checkpoint), the student the base model. From the same student,
# the sum task of experiments/smollm2, LR 1e-5, 30 steps, 2 seeds:
#   grpo          the task's reward alone
#   opd_sampled   the teacher's per-token reverse KL as the advantage (distill.estimator=sampled)
#   opd_full      the exact per-position reverse KL over the 49k vocabulary, minimised (distill.estimator=full)
# What it reports (docs/experiments/distillation.md, experiments/smollm2/analyze_distill.py): the steps each arm
# takes to 80% of the teacher's training accuracy.
#   bash experiments/smollm2/run_distill.sh       (one run at a time, two threads)
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/smollm2_stale}
SEEDS=${SEEDS:-0 1}
STEPS=${STEPS:-30}
THREADS=${THREADS:-2}
CFG=experiments/smollm2/config.yaml
TEACHER=${TEACHER:-$OUT/clean-lr1e-5-s0/checkpoints/step_000060/model}
[ -e "$TEACHER/config.json" ] || { echo "no teacher at $TEACHER: run experiments/smollm2/run_precision.sh first"; exit 2; }
arm() {  # arm NAME SEED ARGS...
  local d="$OUT/distill-$1-s$2"; local seed=$2; shift 2
  [ -e "$d/summary.json" ] && { echo "skip $d"; return; }
  rm -rf "$d"
  $UNISON train "$CFG" --out "$d" --set seed="$seed" --set train.steps="$STEPS" --set threads="$THREADS" \
    --set mismatch.decompose_every=10 --set checkpoint.every_minutes=0 --set train.lr=1e-5 "$@" > "$d.log" 2>&1 \
    || { echo "failed: $d.log"; return 1; }
  echo "done $d ($(tail -1 "$d.log"))"
}
mkdir -p "$OUT"
for seed in $SEEDS; do
  arm grpo "$seed" --set algo=opd --set distill.teacher="$TEACHER" --set distill.coef=0 --set distill.task_reward=true
  arm opd_sampled "$seed" --set algo=opd --set distill.teacher="$TEACHER"
  arm opd_full "$seed" --set algo=opd --set distill.teacher="$TEACHER" --set distill.estimator=full
done
