#!/usr/bin/env bash
# The demo recipe search's second regime (issue 38): samples K = 4 policy versions old (rollout.max_staleness=4, the
# native engine in a worker process), naive GRPO, and candidate cures built on the mismatch-budget LR
# (train.schedule=mismatch_budget, Paper B) with two controls — beside the clean K = 0 run, on the same warm start and
# perfectible set as run.sh's candidates, 30 steps. Same criterion (analyze.py). A cure screened on seeds 2 and 5
# (the two where the default budget did worst) runs on 6 only if it held there.
#   bash experiments/demo_recipe/run_stale.sh      (PAR=2: two runs side by side, one thread each; ~45 min)
set -euo pipefail
# shellcheck source=experiments/demo_recipe/common.sh
source "$(dirname "$0")/common.sh"
LR=${LR:-1e-4}
SFT=${SFT:-600}
ALL=$SEEDS
BUDGET="--set train.schedule=mismatch_budget"
# variant | seeds | arguments (after the K = 4 settings)
CURES="k4budget|$ALL|$BUDGET
k4budget-down0.5|2,5|$BUDGET --set train.mismatch_budget.down=0.5
k4budget-warmup10|2,5|$BUDGET --set train.warmup_steps=10
k4warmup10|2,5|--set train.schedule=warmup --set train.warmup_steps=10
k4lr3e-5|2,5|--set train.lr=3e-5
k4budget-start0.1|$ALL|$BUDGET --set train.mismatch_budget.start=0.1
k4budget-start0.1-target3e-3|$ALL|$BUDGET --set train.mismatch_budget.start=0.1 --set train.mismatch_budget.target=3e-3
k4budget-start0.1-target3e-3-tis|$ALL|$BUDGET --set train.mismatch_budget.start=0.1 --set train.mismatch_budget.target=3e-3 --algorithms grpo_token_tis
k4budget-start0.1-target3e-3-icepop|$ALL|$BUDGET --set train.mismatch_budget.start=0.1 --set train.mismatch_budget.target=3e-3 --algorithms grpo_icepop
k0lr2e-5|$ALL|--set rollout.max_staleness=0 --set train.lr=2e-5
k4budget-start0.1-target3e-3-tis-k3metric|0,1|$BUDGET --set train.mismatch_budget.start=0.1 --set train.mismatch_budget.target=3e-3 --set train.mismatch_budget.metric=mismatch/k3 --algorithms grpo_token_tis"
# the warm start: run.sh's, or the one unison ships for the demo (the same recipe: unison/data/demo/collapse/manifest.json)
W="$OUT/warm-sft$SFT"
if [ ! -e "$W/perfectible.jsonl" ] && [ "$SFT" = 600 ]; then
  mkdir -p "$W/sft"
  cp -r unison/data/demo/collapse/model unison/data/demo/collapse/sft.json "$W/sft/"
  cp unison/data/demo/collapse/perfectible.jsonl "$W/"
fi
STALE=(--set train.micro_batch_tokens=4096 --set mismatch.decompose_every=5 --set rollout.worker_threads=1
       --set "train.lr=$LR")
specs=("stale-clean-k0-lr$LR-sft$SFT|$ALL|--set rollout.max_staleness=0"
       "stale-broken-k4-lr$LR-sft$SFT|$ALL|--set rollout.max_staleness=4")
while IFS='|' read -r variant seeds args; do
  specs+=("stale-cure-$variant-lr$LR-sft$SFT|$seeds|--set rollout.max_staleness=4 $args")  # (a later --set wins)
done <<< "$CURES"
running=0
for spec in "${specs[@]}"; do
  IFS='|' read -r name seeds args <<< "$spec"
  # shellcheck disable=SC2086
  SEEDS=$seeds arm "$name" "$SFT" "${STALE[@]}" $args &
  running=$((running + 1))
  if [ "$running" -ge "$PAR" ]; then wait -n; running=$((running - 1)); fi
done
wait
