#!/usr/bin/env bash
# Paper A at CPU scale on long answers: fp16 vs bf16 vs fp32, GRPO and GRPO + Token-TIS, 3 seeds each,
# on chained sums with the working written out (60-80 token answers). One command:
#   bash experiments/precision_long/run.sh        (~2.5 hours on 2 cores, most of it the fp16 arms; rerun to resume)
# writes runs/precision_long/ and docs/experiments/precision_long.md (+ its curves).
# Scale (pilots, fp32, 100 steps): lr 2e-4 learns 0.25 -> 0.62; 3e-4 and 5e-4 collapse to 0 within
# 20 steps even in fp32. 2e-4 is the edge of stability, where a precision effect has the most room.
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/precision_long}
COMMON=(--out "$OUT" --max-prompts 64
  --set task.name=scratchpad --set task.operands=7 --set task.digits=2 --set task.style=full
  --set task.train_size=600 --set task.eval_size=200
  --set rollout.max_new_tokens=96 --set sft.steps=600
  --set train.steps=60 --set train.lr=2e-4 --set train.prompts_per_step=16 --set rollout.n=8
  --set train.mini_batches=2 --set train.micro_batch_size=64 --set checkpoint.every=20
  --set train.micro_batch_tokens=null)  # measured before token budgets existed
$UNISON sanity "${COMMON[@]}" --precisions fp32,bf16,fp16 --algorithms grpo,grpo_token_tis --seeds 0,1,2
# bf16 in exact mode (docs/exact.md): the sampler and the trainer agree bit for bit, so there is no
# mismatch to correct; GRPO only (Token-TIS weights are all 1 there).
$UNISON sanity "${COMMON[@]}" --precisions bf16-exact --algorithms grpo --seeds 0,1,2
PY=${PYTHON:-python}
$PY experiments/analyze.py "$OUT/arms" docs/experiments/precision_long.md \
  --title "Precision on long answers: fp16 vs bf16 vs fp32 (tiny model, chained sums with working)" \
  --intro experiments/precision_long/intro.md
