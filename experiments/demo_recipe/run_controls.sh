#!/usr/bin/env bash
# The demo's controls (issue 52): is it the feedback of the mismatch-budget LR that cures the K = 4 run, or a
# correction plus a small LR? Every arm on the recipe search's 6 seeds, the same warm start and perfectible set as
# run_stale.sh (its clean and broken arms are shared), 30 steps:
#   the demo's cure        Token-TIS + the budget from 0.1x, target 3e-3, watching mismatch/k3
#   Token-TIS constant     at 1e-5, 2e-5, 3e-5, 5e-5 and the recipe's 1e-4 (the range the budget holds: 1-7e-5)
#   GRPO constant          at 1e-5 and 2e-5 (the LR without the correction)
#   the budget alone       the demo's budget without Token-TIS
#   Paper B's schedule     train.schedule=surge_decay on response length (CPU-scale detector, as lr_surge/run.sh),
#                          with and without Token-TIS
#   what the budget adds   the demo's cure from other base LRs (5e-5, 2e-4, 5e-4: it starts at 0.1x of each), beside
#                          the constant-LR arms: does the feedback find the safe LR without a search?
#   bash experiments/demo_recipe/run_controls.sh      (PAR=2: two runs side by side, one thread each)
#   python experiments/demo_recipe/analyze.py runs/demo_recipe docs
set -euo pipefail
# shellcheck source=experiments/demo_recipe/common.sh
source "$(dirname "$0")/common.sh"
LR=1e-4
SFT=600
W="$OUT/warm-sft$SFT"
if [ ! -e "$W/perfectible.jsonl" ]; then  # the warm start unison ships for the demo (the same recipe)
  mkdir -p "$W/sft"
  cp -r unison/data/demo/collapse/model unison/data/demo/collapse/sft.json "$W/sft/"
  cp unison/data/demo/collapse/perfectible.jsonl "$W/"
fi
BUDGET="--set train.schedule=mismatch_budget --set train.mismatch_budget.start=0.1 --set train.mismatch_budget.target=3e-3 --set train.mismatch_budget.metric=mismatch/k3"
SURGE="--set train.schedule=surge_decay --set train.surge.window=3 --set train.surge.multiplier=1.5 --set train.surge.smooth=3"
TIS="--algorithms grpo_token_tis"
# variant | arguments (after the K = 4 settings; a later --set wins)
CURES="k4budget-start0.1-target3e-3-tis-k3metric|$BUDGET $TIS
k4tis-const1e-5|--set train.lr=1e-5 $TIS
k4tis-const2e-5|--set train.lr=2e-5 $TIS
k4tis-const3e-5|--set train.lr=3e-5 $TIS
k4tis-const5e-5|--set train.lr=5e-5 $TIS
k4tis-const1e-4|$TIS
k4lr1e-5|--set train.lr=1e-5
k4lr2e-5|--set train.lr=2e-5
k4budget-start0.1-target3e-3-k3metric|$BUDGET
k4surge|$SURGE
k4surge-tis|$SURGE $TIS
k4budget-tis-base5e-5|$BUDGET $TIS --set train.lr=5e-5
k4budget-tis-base2e-4|$BUDGET $TIS --set train.lr=2e-4
k4budget-tis-base5e-4|$BUDGET $TIS --set train.lr=5e-4"
STALE=(--set train.micro_batch_tokens=4096 --set mismatch.decompose_every=5 --set rollout.worker_threads=1
       --set "train.lr=$LR")
specs=("stale-clean-k0-lr$LR-sft$SFT|--set rollout.max_staleness=0"
       "stale-broken-k4-lr$LR-sft$SFT|--set rollout.max_staleness=4")
while IFS='|' read -r variant args; do
  specs+=("stale-cure-$variant-lr$LR-sft$SFT|--set rollout.max_staleness=4 $args")
done <<< "$CURES"
running=0
for spec in "${specs[@]}"; do
  IFS='|' read -r name args <<< "$spec"
  # shellcheck disable=SC2086
  arm "$name" "$SFT" "${STALE[@]}" $args &
  running=$((running + 1))
  if [ "$running" -ge "$PAR" ]; then wait -n; running=$((running - 1)); fi
done
wait
