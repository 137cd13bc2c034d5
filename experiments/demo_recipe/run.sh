#!/usr/bin/env bash
# The demo's recipe search (issue 38): regimes where int4 rollout makes GRPO collapse large and early, and the
# quantization-aware learner cures it — on every seed. Seeds stand in for CPUs: a CPU changes the sampled path as a
# seed does (other kernels, other rounding, other samples), so a recipe that holds over 6 seeds on one CPU is the
# one that can hold on a CPU we never ran.
#
# Every candidate is (lr, int4 group size, SFT steps), run for 30 steps on 6 seeds as three arms sharing one warm
# start and perfectible set: clean (fp32 rollout), int4 GRPO, int4 + train.quantization_aware. The pick: the broken
# run ends (last 10 steps) below 80% of the clean run on >= 5/6 seeds and the cure at >= 95% of it on 6/6.
#   bash experiments/demo_recipe/run.sh            (PAR=2: two runs side by side, one thread each)
#   python experiments/demo_recipe/analyze.py runs/demo_recipe docs
# CANDIDATES="lr:group:sft ..." picks the candidates; finished runs are reused.
set -euo pipefail
# shellcheck source=experiments/demo_recipe/common.sh
source "$(dirname "$0")/common.sh"
CANDIDATES=${CANDIDATES:-"1e-4:64:600 2e-4:64:600 3e-4:64:600 2e-4:128:600 3e-4:128:600 2e-4:64:300"}
warm() {  # warm SFT_STEPS: the shared warm start and perfectible set
  local d="$OUT/warm-sft$1"
  [ -e "$d/perfectible.jsonl" ] && return 0
  mkdir -p "$d"
  # shellcheck disable=SC2046
  $UNISON sanity --out "$d" $(base "$1") --seeds 0 --set train.steps=1 > "$d/log.txt" 2>&1
}
specs=()
for c in $CANDIDATES; do
  IFS=: read -r lr group sft <<< "$c"
  warm "$sft"
  specs+=("clean-lr$lr-sft$sft $sft --set train.lr=$lr")
  specs+=("int4-lr$lr-g$group-sft$sft $sft --set train.lr=$lr --quantization int4 --set rollout.quant_group_size=$group")
  specs+=("qat-lr$lr-g$group-sft$sft $sft --set train.lr=$lr --quantization int4 --set rollout.quant_group_size=$group --set train.quantization_aware=true")
done
running=0
declare -A seen=()
for spec in "${specs[@]}"; do
  name=${spec%% *}
  [ -n "${seen[$name]:-}" ] && continue
  seen[$name]=1
  # shellcheck disable=SC2086
  arm $spec &
  running=$((running + 1))
  if [ "$running" -ge "$PAR" ]; then wait -n; running=$((running - 1)); fi
done
wait
