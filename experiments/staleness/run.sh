#!/usr/bin/env bash
# Asynchronous off-policy RL (issue 18): does naive PPO degrade with staleness while the decoupled and
# DPPO anchors hold, as AReaL reports? Paper A's sanity recipe on the scratchpad task (tiny model,
# 60-80-token answers, SFT warm start, perfectible set, 4 mini-batches per step), the engine running
# K in {0, 4} versions ahead of the learner (stale_policy wait: batch j is sampled with exactly
# version max(0, j - K)), 3 seeds; at K = 0 the four arms are the same loss up to fp32 rounding (mu = pi_old),
# so only the naive arm runs there. KS="0 1 4" adds K = 1. One command, resumable (rerun to continue):
#   bash experiments/staleness/run.sh        (~1 h on 2 cores)
# writes runs/staleness/ and docs/experiments/staleness.md (+ curves).
#
# Arms (the anchor is which log pi is pi_old; docs/algorithms.md):
#   naive      grpo: PPO-clip around the recomputed pi_old, no weight for the stale mu (the issue's "naive")
#   behave     grpo + policy.anchor=bypass: PPO-clip around mu itself (AReaL's "naive PPO")
#   decoupled  grpo_token_tis: PPO-clip around the recomputed pi_old, weight min(pi_old/mu, 2) (AReaL's decoupled PPO)
#   dppo       dppo_tv + policy.anchor=bypass (prime-rl's default DPPO-Binary-TV)
#   lowlr      naive at a 4x smaller LR (2.5e-5; Paper B: a smaller LR suppresses the mismatch), K in {0, 4}
set -euo pipefail
cd "$(dirname "$0")/../.."
UNISON=${UNISON:-unison}
PY=${PYTHON:-python}
OUT=${OUT:-runs/staleness}
COMMON=(--max-prompts 64 --precisions fp32 --seeds 0,1,2
  --set task.name=scratchpad --set task.operands=7 --set task.digits=2 --set task.style=full
  --set task.train_size=600 --set task.eval_size=200
  --set rollout.max_new_tokens=96 --set sft.steps=600
  --set train.steps=60 --set train.lr=1e-4 --set train.prompts_per_step=16 --set rollout.n=8
  --set train.mini_batches=4 --set train.micro_batch_size=64 --set checkpoint.every=20
  --set mismatch.decompose_every=5 --set train.micro_batch_tokens=4096)  # the budget these runs were measured with
SHARED=${SHARED:-runs/quantized_rollout/pilot}  # the same warm start and perfectible set, when present
for K in ${KS:-0 4}; do
  for ARM in naive behave decoupled dppo lowlr; do
    [ "$K" = 0 ] && [ "$ARM" != naive ] && [ "$ARM" != lowlr ] && continue
    [ "$K" = 1 ] && [ "$ARM" = lowlr ] && continue
    case $ARM in
      naive) ALGO=(--algorithms grpo) ;;
      behave) ALGO=(--algorithms grpo --set policy.anchor=bypass) ;;
      decoupled) ALGO=(--algorithms grpo_token_tis) ;;
      dppo) ALGO=(--algorithms dppo_tv --set policy.anchor=bypass) ;;
      lowlr) ALGO=(--algorithms grpo --set train.lr=2.5e-5) ;;
    esac
    D="$OUT/K$K-$ARM"
    mkdir -p "$D"
    if [ -d "$SHARED/sft" ] && [ ! -e "$D/sft" ]; then cp -r "$SHARED/sft" "$D/sft"; cp "$SHARED/perfectible.jsonl" "$D/"; fi
    if [ ! -d "$SHARED/sft" ] && [ "$D" != "$OUT/K0-naive" ] && [ ! -e "$D/sft" ]; then
      cp -r "$OUT/K0-naive/sft" "$D/sft"; cp "$OUT/K0-naive/perfectible.jsonl" "$D/"
    fi
    $UNISON sanity --out "$D" "${COMMON[@]}" "${ALGO[@]}" --set rollout.max_staleness=$K
  done
done
$PY experiments/staleness/analyze.py "$OUT" docs/experiments/staleness.md
