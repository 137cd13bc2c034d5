#!/usr/bin/env bash
# Issue 54, item 2: the probe table of docs/models.md ("Hybrid and state-space models"): each hybrid of the zoo x
# response length (32, 256, 1024 tokens, past EOS) x the engine's recurrent-state dtype, fp32 and bf16, with the
# mismatch ledger. One command, resumable:  bash experiments/hybrid/probe.sh   (about 15 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/hybrid_probe}
mkdir -p "$OUT"
[ -e "$OUT/zoo/falcon_h1/config.json" ] || python -m unison.zoo "$OUT/zoo" > /dev/null
for a in qwen3_next mamba2 nemotron_h falcon_h1; do for L in 32 256 1024; do for s in fp32 model; do
  o=$OUT/$a-$L-$s; [ -e "$o/probe.json" ] && continue
  $UNISON probe --model "$OUT/zoo/$a" --precision fp32,bf16 --ledger --max-new-tokens $L --state-dtype $s \
    --ignore-eos --n 4 --threads 1 --out "$o" > "$o.log" 2>&1 || { echo "failed: $o.log"; exit 1; }
  echo "done $o"
done; done; done
