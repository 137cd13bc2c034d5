#!/usr/bin/env bash
# SmolLM2-135M on stale samples (issue 52): the sum task of experiments/smollm2 trained on samples K policy versions
# old (rollout.max_staleness, the native engine in a worker process). Where does naive GRPO break, and do the cures
# decide it? Two stages, every run reported (docs/experiments/smollm2.md):
#   screen   naive GRPO at K = 2 and 4 and LR 1e-5 (the clean run's), 3e-5 and 1e-4, 60 steps, seed 0, and the
#            clean run (K = 0) at 1e-4 beside it (at 1e-5: run_precision.sh's fp32 arm)
#   cures    where a screen arm broke (BROKEN="k4-lr1e-4", say), on SEEDS: the clean run at that LR, the broken
#            one, and Token-TIS + the mismatch-budget LR, Token-TIS at a constant low LR, the budget alone, Paper B's
#            surge_decay, M2PO
#   STAGE=screen bash experiments/smollm2/run_stale.sh     (each run one thread for the learner, one for the worker)
#   STAGE=cures BROKEN=k4-lr1e-4 SEEDS="0 1 2" bash experiments/smollm2/run_stale.sh
#   python experiments/smollm2/analyze_stale.py runs/smollm2_stale docs/experiments/smollm2.md
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/smollm2_stale}
STAGE=${STAGE:-screen}
STEPS=${STEPS:-60}
SEEDS=${SEEDS:-0 1 2}
CFG=experiments/smollm2/config.yaml
COMMON=(--set train.steps="$STEPS" --set threads=1 --set rollout.worker_threads=1 --set mismatch.decompose_every=10
        --set checkpoint.every_minutes=0)
arm() {  # arm NAME SEED ARGS...
  local d="$OUT/$1-s$2"; local seed=$2; shift 2
  [ -e "$d/summary.json" ] && { echo "skip $d"; return; }
  rm -rf "$d"
  $UNISON train "$CFG" --out "$d" --set seed="$seed" "${COMMON[@]}" "$@" > "$d.log" 2>&1 || { echo "failed: $d.log"; return 1; }
  echo "done $d ($(tail -1 "$d.log"))"
}
mkdir -p "$OUT"
if [ "$STAGE" = screen ]; then
  for spec in "k4-lr1e-5 4 1e-5" "k4-lr3e-5 4 3e-5" "k4-lr1e-4 4 1e-4" "k2-lr1e-4 2 1e-4" "clean-lr1e-4 0 1e-4"; do
    read -r name k lr <<< "$spec"
    arm "$name" 0 --set rollout.max_staleness="$k" --set train.lr="$lr"
  done
  exit 0
fi
# the cures on the arm that broke: BROKEN=k<K>-lr<LR>
K=${BROKEN%%-*}; K=${K#k}; LR=${BROKEN##*-lr}
BUDGET=(--set train.schedule=mismatch_budget --set train.mismatch_budget.start=0.1 --set train.mismatch_budget.target=3e-3
        --set train.mismatch_budget.metric=mismatch/k3)
SURGE=(--set train.schedule=surge_decay --set train.surge.window=5 --set train.surge.multiplier=1.5 --set train.surge.smooth=3)
for seed in $SEEDS; do
  arm "clean-lr$LR" "$seed" --set train.lr="$LR"
  arm "$BROKEN" "$seed" --set rollout.max_staleness="$K" --set train.lr="$LR"
  arm "$BROKEN-tis-budget" "$seed" --set rollout.max_staleness="$K" --set train.lr="$LR" --set algo=grpo_token_tis "${BUDGET[@]}"
  arm "$BROKEN-tis-const${LOW:-1e-5}" "$seed" --set rollout.max_staleness="$K" --set train.lr="${LOW:-1e-5}" --set algo=grpo_token_tis
  arm "$BROKEN-budget" "$seed" --set rollout.max_staleness="$K" --set train.lr="$LR" "${BUDGET[@]}"
  arm "$BROKEN-surge" "$seed" --set rollout.max_staleness="$K" --set train.lr="$LR" "${SURGE[@]}"
  arm "$BROKEN-m2po" "$seed" --set rollout.max_staleness="$K" --set train.lr="$LR" --set algo=grpo_m2po
done
