#!/usr/bin/env bash
# The constant-vs-decay experiment of Paper B on the tiny model (about 20 minutes on 2 cores).
# Needs the SFT'd tiny model: unison sft configs/sft-arithmetic.yaml --out runs/sft
set -euo pipefail
cd "$(dirname "$0")/../.."
B=experiments/lr_vs_mismatch/base.yaml
OUT=${OUT:-runs/lr_vs_mismatch}
[ -f runs/sft/model/config.json ] || unison sft configs/sft-arithmetic.yaml --out runs/sft
unison train $B --out $OUT/constant                      ${RESUME:+--resume}
# length-triggered decay: baseline = mean length of the first 10 steps; fire when the
# 3-step mean is >= 1.3x baseline (arithmetic answers are ~4 tokens: a 3x surge cannot fit)
unison train $B --out $OUT/decay --set train.schedule=surge_decay \
  --set train.surge.window=10 --set train.surge.multiplier=1.3 --set train.surge.smooth=3 \
  ${RESUME:+--resume}
unison train $B --out $OUT/low --set train.lr=5.0e-5 ${RESUME:+--resume}
# the same decay rule with the surge placed by hand at step 20 (first halving at step 36),
# to see what decaying does to the mismatch whether or not the detector fires
unison train $B --out $OUT/decay_at_20 --set train.schedule=surge_decay --set train.surge.trigger_step=20 \
  ${RESUME:+--resume}
unison report $OUT/constant $OUT/decay $OUT/low $OUT/decay_at_20 --out $OUT
