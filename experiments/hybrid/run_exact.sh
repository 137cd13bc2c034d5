#!/usr/bin/env bash
# Issue 54, items 3-4: exact mode on a hybrid run. A random Nemotron-H of the built-in tiny model's width (hidden 128;
# blocks: Mamba2 mixer, MLP, Mamba2 mixer, MLP, attention, MLP; zoo.build), then Paper A's sanity test (unison sanity:
# SFT warm start 60 steps, a perfectible set, GRPO 100 steps) on 2 seeds:
#   fp32        both engines fp32 (the reference)
#   bf16        both bf16: the engine decodes with the recurrence, the learner re-scores with the chunked scan
#   bf16-exact  both bf16 in exact mode: one forward (the recurrence) on both sides, log μ == log π bit for bit
# One command, resumable:  bash experiments/hybrid/run_exact.sh   then
#   python experiments/hybrid/analyze.py runs/hybrid_exact --arms fp32,bf16,bf16-exact
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/hybrid_exact}
SEEDS=${SEEDS:-0,1}
SFT=${SFT:-60}
mkdir -p "$OUT"
[ -e "$OUT/model/config.json" ] || python -c "
from unison.zoo import build
build('nemotron_h', '$OUT/model', hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
      head_dim=32, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32,
      layers_block_type=['linear_attention', 'mlp', 'linear_attention', 'mlp', 'full_attention', 'mlp'])"
$UNISON sanity --out "$OUT/arms" --set model="$OUT/model" --precisions fp32,bf16,bf16-exact --seeds "$SEEDS" \
  --set sft.steps="$SFT" "$@"
