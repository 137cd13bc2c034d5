#!/usr/bin/env bash
# Paper A on SmolLM2-135M (issue 52): does bf16's mismatch change the outcome on a real model? The sum task of
# experiments/smollm2 (config.yaml), GRPO at the clean run's LR (1e-5), 60 steps, both engines in one precision:
#   fp32    fp32 rollout and learner (the reference)
#   bf16    bf16 rollout and learner (the learner's fp32 masters under autocast)
#   fp16    fp16 rollout and learner with loss scaling (Paper A's fix), on a CPU with native fp16 (AVX512-FP16 /
#           AMX: checked from lscpu; skipped elsewhere, where fp16 runs ~10x slower)
# 2 seeds each, the mismatch ledger every 10 steps. One command, resumable:
#   bash experiments/smollm2/run_precision.sh      (one run at a time, two threads)
#   python experiments/smollm2/analyze_stale.py runs/smollm2_stale docs/experiments/smollm2.md
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/smollm2_stale}
SEEDS=${SEEDS:-0 1}
STEPS=${STEPS:-60}
THREADS=${THREADS:-2}
CFG=experiments/smollm2/config.yaml
PRECISIONS=${PRECISIONS:-"fp32 bf16"}
if [ -z "${PRECISIONS_SET:-}" ] && grep -q avx512_fp16 /proc/cpuinfo; then PRECISIONS="fp32 bf16 fp16"; fi
arm() {  # arm NAME SEED ARGS...
  local d="$OUT/$1-s$2"; local seed=$2; shift 2
  [ -e "$d/summary.json" ] && { echo "skip $d"; return; }
  rm -rf "$d"
  $UNISON train "$CFG" --out "$d" --set seed="$seed" --set train.steps="$STEPS" --set threads="$THREADS" \
    --set mismatch.decompose_every=10 --set checkpoint.every_minutes=0 "$@" > "$d.log" 2>&1 \
    || { echo "failed: $d.log"; return 1; }
  echo "done $d ($(tail -1 "$d.log"))"
}
mkdir -p "$OUT"
for seed in $SEEDS; do
  for p in $PRECISIONS; do
    name=clean-lr1e-5; [ "$p" != fp32 ] && name="$p-lr1e-5"
    arm "$name" "$seed" --set precision="$p" --set train.lr=1e-5
  done
done
