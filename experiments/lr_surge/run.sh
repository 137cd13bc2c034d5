#!/usr/bin/env bash
# Paper B at CPU scale: does response length surge, does the mismatch grow with it, does decaying the
# LR hold it down, does gradient noise move with it? bf16 (a mismatch to watch), 3 seeds per arm:
#   constant LR | decay when the length surges (Paper B's trigger) | the same decay at a hand-placed step |
#   a 4x lower constant LR
# Task: chained sums after a *mixed* warm start (half the demonstrations show the working, half give the
# bare answer): worked answers are 3.5x as often right (measured: 13.7% vs 3.9%), so RL can lengthen
# the answers from ~32 tokens towards ~70. One command (~25 minutes on 2 cores; rerun to resume):
#   bash experiments/lr_surge/run.sh   -> runs/lr_surge/ and docs/experiments/lr_surge.md
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
PY=${PYTHON:-python}
OUT=${OUT:-runs/lr_surge}
B=experiments/lr_surge/base.yaml
[ -f "$OUT/sft/model/config.json" ] || $UNISON sft $B --out "$OUT/sft" --set precision=fp32
# the length trigger: baseline = mean length of the first 3 steps, fire when the 3-step mean is >= 1.5x
# (answers can at most double here: ~32 -> ~70 tokens), then halve the LR every round(1.8 t_s) steps.
# A first design (10-step baseline) never fired: the length rises within the first 10 steps here.
SURGE=(--set train.schedule=surge_decay --set train.surge.window=3 --set train.surge.multiplier=1.5
       --set train.surge.smooth=3)
for seed in 0 1 2; do
  for arm in constant length_decay decay_at_30 low; do
    dir="$OUT/arms/$arm-s$seed"
    [ -f "$dir/summary.json" ] && continue
    extra=()
    [ "$arm" = length_decay ] && extra=("${SURGE[@]}")
    [ "$arm" = decay_at_30 ] && extra=("${SURGE[@]}" --set train.surge.trigger_step=30)
    [ "$arm" = low ] && extra=(--set train.lr=5e-5)  # constant at a quarter of the LR: what decay reaches by ~54
    $UNISON train $B --out "$dir" --set model="$OUT/sft/model" --set seed=$seed "${extra[@]}" \
      $([ -d "$dir" ] && echo --resume)
  done
done
$PY experiments/analyze.py "$OUT/arms" docs/experiments/lr_surge.md --extra-cols lr,noise \
  --title "Paper B at CPU scale: length surge, mismatch and LR decay (tiny model, bf16)" \
  --intro experiments/lr_surge/intro.md
