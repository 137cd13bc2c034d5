#!/usr/bin/env bash
# The ledger of the synchronous quantized arms measured again (seed 0) after the fix "ledger: the learner's
# passes run before the update": int4 and fp8 GRPO at the recipe of run.sh, into runs/cures-ledger/. Their
# training is the arms' own (the ledger changes no other metric, tested bit for bit); only the ledger columns
# of docs/experiments/cures.md come from here. A fresh `bash experiments/cures/run.sh` does not need it.
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
SRC=${SRC:-runs/cures/q-none-grpo}   # the warm start and perfectible set the arms share
OUT=${OUT:-runs/cures-ledger}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for spec in "int4-grpo int4" "fp8-grpo fp8"; do
  set -- $spec
  d="$OUT/$1"; mkdir -p "$d"
  [ -e "$d/sft" ] || { cp -r "$SRC/sft" "$d/sft"; cp "$SRC/perfectible.jsonl" "$d/"; }
  $UNISON sanity --out "$d" --max-prompts 64 --precisions fp32 --seeds 0 \
    --set task.name=scratchpad --set task.operands=7 --set task.digits=2 --set task.style=full \
    --set task.train_size=600 --set task.eval_size=200 --set rollout.max_new_tokens=96 --set sft.steps=600 \
    --set train.steps=60 --set train.lr=1e-4 --set train.prompts_per_step=16 --set rollout.n=8 \
    --set train.mini_batches=4 --set train.micro_batch_size=64 --set checkpoint.every=20 \
    --quantization "$2" --algorithms grpo --set train.micro_batch_tokens=null > "$d/log.txt" 2>&1
  echo "done $1"
done
