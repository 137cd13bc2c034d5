#!/usr/bin/env bash
# The demo recipe search's second regime (issue 38): samples K = 4 policy versions old (rollout.max_staleness=4, the
# native engine in a worker process), naive GRPO, and its cure, the mismatch-budget LR (train.schedule=mismatch_budget,
# Paper B) — beside the clean K = 0 run, on the same warm start and perfectible set as run.sh's candidates, 30 steps,
# 6 seeds. Same criterion (analyze.py).
#   bash experiments/demo_recipe/run_stale.sh      (PAR=2: two runs side by side, one thread each)
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/demo_recipe}
SEEDS=${SEEDS:-0,1,2,3,4,5}
PAR=${PAR:-2}
STEPS=${STEPS:-30}
LR=${LR:-1e-4}
SFT=${SFT:-600}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
base() {
  echo --max-prompts 64 --precisions fp32 --seeds "$SEEDS" \
    --set task.name=scratchpad --set task.operands=7 --set task.digits=2 --set task.style=full \
    --set task.train_size=600 --set task.eval_size=200 --set rollout.max_new_tokens=96 --set "sft.steps=$SFT" \
    --set "train.steps=$STEPS" --set train.prompts_per_step=16 --set rollout.n=8 --set train.mini_batches=4 \
    --set train.micro_batch_size=64 --set train.micro_batch_tokens=4096 --set mismatch.decompose_every=5 \
    --set rollout.worker_threads=1 --set "train.lr=$LR"
}
arm() {  # arm NAME ARGS...
  local name=$1; shift
  local d="$OUT/$name"
  mkdir -p "$d"
  [ -e "$d/sft" ] || { cp -r "$OUT/warm-sft$SFT/sft" "$d/sft"; cp "$OUT/warm-sft$SFT/perfectible.jsonl" "$d/"; }
  # shellcheck disable=SC2046
  $UNISON sanity --out "$d" $(base) "$@" > "$d/log.txt" 2>&1 || { echo "arm $name failed: $d/log.txt"; return 1; }
  echo "arm $name done"
}
arm "stale-clean-k0-lr$LR-sft$SFT" --set rollout.max_staleness=0 &
arm "stale-broken-k4-lr$LR-sft$SFT" --set rollout.max_staleness=4 &
wait -n
arm "stale-cure-k4budget-lr$LR-sft$SFT" --set rollout.max_staleness=4 --set train.schedule=mismatch_budget &
wait
