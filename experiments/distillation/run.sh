#!/usr/bin/env bash
# On-policy distillation vs GRPO from the same weak start (issue 40, docs/experiments/distillation.md).
# Tiny model, the demo's scratchpad recipe (unison/demo.py COLLAPSE_RECIPE). Teacher: the demo's shipped warm
# start (600 SFT steps on the generated problems, unison/data/demo/collapse); student: the same SFT stopped at
# $SFT_STEPS steps. The RL runs train on the teacher's perfectible set (64 prompts of the same train split).
# Arms, 3 seeds each, 30 steps, two one-thread runs side by side:
#   grpo      the task's reward alone
#   opd       algo=opd: the teacher's per-token reverse KL alone (distill.task_reward=false)
#   opd_task  the reverse KL + the task's reward
#   opd_lr1e-3, grpo_lr1e-3: both at a 10x LR (distillation is closer to supervised training, whose LR is 3e-3)
# One command, resumable:  bash experiments/distillation/run.sh   (~20 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
PY=${PYTHON:-python}
OUT=${OUT:-runs/distillation}
SEEDS=${SEEDS:-0 1 2}
SFT_STEPS=${SFT_STEPS:-150}
export OMP_NUM_THREADS=1
TEACHER=unison/data/demo/collapse/model
CFG=experiments/distillation/config.yaml
mkdir -p "$OUT"
[ -e "$OUT/student/model/config.json" ] || \
  $UNISON sft "$CFG" --out "$OUT/student" --set task.path=null --set sft.steps="$SFT_STEPS" > "$OUT/student.log" 2>&1
arm() {  # arm NAME SEED ARGS...
  local d="$OUT/$1-s$2" seed=$2; shift 2
  [ -e "$d/summary.json" ] && return
  rm -rf "$d"
  $UNISON train "$CFG" --out "$d" --set model="$OUT/student/model" --set seed="$seed" "$@" > "$d.log" 2>&1 \
    || { echo "failed: $d.log"; return 1; }
  echo "done $d: $(tail -1 "$d.log")"
}
jobs=()
for seed in $SEEDS; do
  jobs+=("grpo $seed" "opd $seed --set algo=opd --set distill.teacher=$TEACHER"
         "opd_task $seed --set algo=opd --set distill.teacher=$TEACHER --set distill.task_reward=true"
         "opd_lr1e-3 $seed --set algo=opd --set distill.teacher=$TEACHER --set train.lr=1e-3"
         "grpo_lr1e-3 $seed --set train.lr=1e-3")
done
running=0
for job in "${jobs[@]}"; do  # two at a time
  # shellcheck disable=SC2086
  arm $job &
  running=$((running + 1))
  if [ "$running" -ge 2 ]; then wait -n; running=$((running - 1)); fi
done
wait
$PY experiments/distillation/analyze.py "$OUT" docs/experiments/distillation.md
