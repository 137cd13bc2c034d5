#!/usr/bin/env bash
# The demo recipe search's second regime (issue 38): samples K = 4 policy versions old (rollout.max_staleness=4, the
# native engine in a worker process), naive GRPO, and its cure, the mismatch-budget LR (train.schedule=mismatch_budget,
# Paper B) — beside the clean K = 0 run, on the same warm start and perfectible set as run.sh's candidates, 30 steps,
# 6 seeds. Same criterion (analyze.py).
#   bash experiments/demo_recipe/run_stale.sh      (PAR=2: two runs side by side, one thread each)
set -euo pipefail
# shellcheck source=experiments/demo_recipe/common.sh
source "$(dirname "$0")/common.sh"
LR=${LR:-1e-4}
SFT=${SFT:-600}
STALE=(--set train.micro_batch_tokens=4096 --set mismatch.decompose_every=5 --set rollout.worker_threads=1
       --set "train.lr=$LR")
arm "stale-clean-k0-lr$LR-sft$SFT" "$SFT" "${STALE[@]}" --set rollout.max_staleness=0 &
arm "stale-broken-k4-lr$LR-sft$SFT" "$SFT" "${STALE[@]}" --set rollout.max_staleness=4 &
wait -n
arm "stale-cure-k4budget-lr$LR-sft$SFT" "$SFT" "${STALE[@]}" --set rollout.max_staleness=4 --set train.schedule=mismatch_budget &
wait
