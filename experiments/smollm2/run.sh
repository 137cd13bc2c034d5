#!/usr/bin/env bash
# SmolLM2-135M where the mismatch decides the outcome (issue 38, docs/experiments/smollm2.md): the model
# learns to answer "What is a + b? Reply with only the number." within 24 tokens; three arms from the same
# start, two seeds each, one after another at 2 threads:
#   clean      fp32 rollout, fp32 learner
#   int4       the rollout engine samples with int4 weights (group 64), the learner trains fp32 masters
#   int4_qat   int4 rollout + train.quantization_aware (the learner's forward is the engine's int4 policy)
# One command, resumable (a finished arm is skipped):  bash experiments/smollm2/run.sh   (~75 min, 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
PY=${PYTHON:-python}
OUT=${OUT:-runs/smollm2}
SEEDS=${SEEDS:-0 1}
CFG=experiments/smollm2/config.yaml
arm() {  # arm NAME SEED ARGS...
  local d="$OUT/$1-s$2"; local seed=$2; shift 2
  [ -e "$d/summary.json" ] && { echo "skip $d"; return; }
  rm -rf "$d"
  $UNISON train "$CFG" --out "$d" --set seed="$seed" "$@" > "$d.log" 2>&1 || { echo "failed: $d.log"; return 1; }
  echo "done $d ($(tail -1 "$d.log"))"
}
mkdir -p "$OUT"
for seed in $SEEDS; do
  arm clean "$seed"
  arm int4 "$seed" --set rollout.quantization=int4
  arm int4_qat "$seed" --set rollout.quantization=int4 --set train.quantization_aware=true
done
$PY experiments/smollm2/analyze.py "$OUT" docs/experiments/smollm2.md
