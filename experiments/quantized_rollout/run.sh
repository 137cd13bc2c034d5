#!/usr/bin/env bash
# Low-precision rollout (issue 19): Paper A's sanity test where the mismatch is large enough to decide the
# outcome. The rollout engine samples with weight-only quantized weights (unison/quant.py), the learner
# trains fp32 masters; everything else as in experiments/precision_long (tiny model, chained sums with the
# working written out, 60-80-token answers, SFT warm start, perfectible set) but with Paper A's 4
# mini-batches per step. One command, resumable (rerun to continue):
#   bash experiments/quantized_rollout/run.sh     (~2 h on 2 cores)
# writes runs/quantized_rollout/ and docs/experiments/quantized_rollout.md (+ curves).
#
# 1. pilot: one seed, grpo and grpo_seq_mis, every format (none, int8, fp8, int4): where does GRPO fall?
# 2. the grid: none + the two formats whose token k3 spans ~1e-4..1e-2 in the pilot (fp8, int4) x Paper A's
#    six algorithms x 3 seeds;
# 3. Paper B under the largest mismatch (int4): grpo with surge_decay triggered by response length (as the
#    paper prescribes) and by the mismatch itself (token k3), 3 seeds each.
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
PY=${PYTHON:-python}
OUT=${OUT:-runs/quantized_rollout}
COMMON=(--max-prompts 64 --precisions fp32
  --set task.name=scratchpad --set task.operands=7 --set task.digits=2 --set task.style=full
  --set task.train_size=600 --set task.eval_size=200
  --set rollout.max_new_tokens=96 --set sft.steps=600
  --set train.steps=60 --set train.lr=1e-4 --set train.prompts_per_step=16 --set rollout.n=8
  --set train.mini_batches=4 --set train.micro_batch_size=64 --set checkpoint.every=20
  --set train.micro_batch_tokens=null)  # the micro-batching these runs were measured with (64 rows at full width)
$UNISON sanity --out "$OUT/pilot" "${COMMON[@]}" --quantization none,int8,fp8,int4 --algorithms grpo,grpo_seq_mis
share() {  # later stages reuse the pilot's warm start and perfectible set
  mkdir -p "$1"; [ -e "$1/sft" ] || cp -r "$OUT/pilot/sft" "$1/sft"
  [ -e "$1/perfectible.jsonl" ] || cp "$OUT/pilot/perfectible.jsonl" "$1/perfectible.jsonl"
}
share "$OUT/grid"
$UNISON sanity --out "$OUT/grid" "${COMMON[@]}" --quantization none,fp8,int4 --seeds 0,1,2 \
  --algorithms grpo,grpo_token_tis,grpo_seq_mis,gspo,pg_seq_is,pg_seq_mis
share "$OUT/surge_length"
$UNISON sanity --out "$OUT/surge_length" "${COMMON[@]}" --quantization int4 --seeds 0,1,2 --algorithms grpo \
  --set train.schedule=surge_decay --set train.surge.trigger=length --set train.surge.window=10 \
  --set train.surge.multiplier=1.2 --set train.surge.smooth=3
share "$OUT/surge_mismatch"
$UNISON sanity --out "$OUT/surge_mismatch" "${COMMON[@]}" --quantization int4 --seeds 0,1,2 --algorithms grpo \
  --set train.schedule=surge_decay --set train.surge.trigger=mismatch --set train.surge.window=10 \
  --set train.surge.multiplier=1.5 --set train.surge.smooth=3
$PY experiments/quantized_rollout/analyze.py "$OUT" docs/experiments/quantized_rollout.md
