#!/usr/bin/env bash
# Issue 54, item 4: what a hybrid's recurrent-state dtype does to a run. A random Qwen3-Next of the built-in tiny
# model's width (hidden 128, 4 layers: Gated DeltaNet in 0-2, gated attention in 3; zoo.build), then Paper A's sanity
# test (unison sanity: SFT warm start 60 steps, a perfectible set, GRPO 100 steps) on 2 seeds:
#   fp32             both engines fp32 (the reference)
#   bf16             both bf16, the engine's recurrent state fp32 between decode steps (transformers' kernels)
#   bf16-state-bf16  both bf16, the state rounded to bf16 after every step (rollout.state_dtype=model, as vLLM keeps
#                    it in a bf16 run)
#   bf16-exact       both bf16 in exact mode: the recurrence on both sides, log μ == log π bit for bit
# One command, resumable:  bash experiments/hybrid/run.sh   then   python experiments/hybrid/analyze.py runs/hybrid
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/hybrid}
SEEDS=${SEEDS:-0,1}
SFT=${SFT:-60}  # SFT steps: 600 (the built-in tiny model's) make this hybrid perfect on the task (train accuracy 1.000)
mkdir -p "$OUT"
[ -e "$OUT/model/config.json" ] || python -c "
from unison.zoo import build
build('qwen3_next', '$OUT/model', hidden_size=128, intermediate_size=384, head_dim=32, linear_key_head_dim=32,
      linear_value_head_dim=32)"
$UNISON sanity --out "$OUT/state-fp32" --set model="$OUT/model" --precisions fp32,bf16 --seeds "$SEEDS" --set sft.steps="$SFT" "$@"
$UNISON sanity --out "$OUT/state-model" --set model="$OUT/model" --precisions bf16 --seeds "$SEEDS" --set sft.steps="$SFT" \
  --set rollout.state_dtype=model "$@"
$UNISON sanity --out "$OUT/exact" --set model="$OUT/model" --precisions bf16-exact --seeds "$SEEDS" --set sft.steps="$SFT" "$@"
