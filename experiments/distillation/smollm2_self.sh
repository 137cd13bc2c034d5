#!/usr/bin/env bash
# SmolLM2-135M as its own teacher (issue 40): the teacher scores in fp32 with the student's own weights, so the true
# distillation signal is 0 and what the reverse KL reports at step 1 is the precision mismatch alone. Two arms,
# 5 steps each on experiments/smollm2's task (docs/experiments/distillation.md, "SmolLM2 as its own teacher"):
#   bf16        student bf16 in both engines (sampler μ and learner π), teacher fp32
#   bf16-rollout  the sampler alone in bf16, learner fp32: log π_old is the teacher's own numerics
#   bash experiments/distillation/smollm2_self.sh      (~10 min, 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/distill_smollm2_self}
COMMON=(--set algo=opd --set distill.teacher=builtin:smollm2 --set distill.task_reward=false --set train.steps=5
        --set mismatch.decompose_every=1 --set log.tensorboard=false)
mkdir -p "$OUT"
for arm in bf16 bf16-rollout; do
  d="$OUT/$arm"
  [ -e "$d/summary.json" ] && { echo "skip $d"; continue; }
  rm -rf "$d"
  case $arm in
    bf16) extra=(--set precision=bf16) ;;
    bf16-rollout) extra=(--set precision=fp32 --set rollout_precision=bf16) ;;
  esac
  $UNISON train experiments/smollm2/config.yaml --out "$d" "${COMMON[@]}" "${extra[@]}" > "$d.log" 2>&1 \
    || { echo "failed: $d.log"; exit 1; }
  echo "done $d"
done
