#!/usr/bin/env bash
# GPU smoke check: what unison's CPU suite cannot show, in one command under 10 minutes, no network.
#
#   RESULTS=DIR bash scripts/gpu_smoke.sh [WORK_DIR]       (WORK_DIR: /tmp/unison-gpu-smoke)
#
# Time: every stage has its own time-out (STAGES below: they add up to 530 s, which the first JSON line
# prints), and the script stops itself: at 550 s the running stage is cut (10 s more to end it), then the
# summary prints, within 570 s. Each stage prints one JSON line {"check": NAME, "ok": ...} (a failing one
# also the tail of its log); the last line is {"check": "summary", "ok": <every check ANDed>, ...} and the
# exit status is 0 exactly when that ok is true.
#  install    the carried wheels (./wheels, from scripts/gpu_wheels.sh) the image lacks go into a folder of
#             their own on PYTHONPATH (the image's environment is not written to; PYTHONPATH is extended,
#             never replaced); unison is imported from this tree, not installed; torch, transformers and
#             the GPU, and every torch/transformers API the smoke's code paths use (scripts/gpu_smoke.py)
#  model      a random Qwen2-0.5B-shaped model (vocab 151936, 24 layers, d 896) with a tokenizer that decodes
#             every id, made peaked (mean next-token entropy 0.5-3 nats: near-uniform outputs make every
#             precision look alike) and given stop ids (2 in 256 of its ids beside the EOS: responses end at
#             varied lengths)
#  probe      `unison probe --precision fp32,bf16,fp16 --param-dtype fp32,compute` (native engine) on the
#             device: the mismatch of each precision, ordered bf16 > fp16 > fp32
#  train/*    `unison train` under torchrun (world size 1, FSDP2), a length reward that varies: fp16 3 steps
#             (loss scale and skipped steps), then `train/gradient` (a non-zero gradient, every tensor of the
#             final checkpoint moved, only that checkpoint kept), a resume to step 4; bf16 3 steps packed and
#             1 step padded from the same seed, `train/packed_vs_padded` (same rollouts, lengths that vary,
#             loss, entropy and k3 within bf16 noise). Per-step peak GPU memory (grad-noise telemetry off: on,
#             it adds two fp32 gradient copies, +4.7 GiB), decode and update tokens/s. Only final checkpoints.
# Results: checks.jsonl, probe.json, each run's metrics.jsonl and summary.json and the tail of every log go
# to $RESULTS when it is set (small files only); everything else, checkpoints included, stays in WORK_DIR.
# What it cannot cover: vLLM (not on the GPU image: vllm 0.32 needs torch 2.13, the image has 2.11, and its
# wheel is larger than what reaches the machine), multi-GPU NCCL, the paper-scale configs.
# Dry run: SMOKE_DEVICE=cpu SMOKE_SMALL=1 (a narrow model, 16 tokens); SMOKE_TIMEOUT_SCALE=N multiplies every
# time-out (on a 2-core AMD EPYC without fp16 units train/fp16 took 63 s of its 100, twice that when the
# machine is busy: give it 2 or more there).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
INNER=0; [ "${1:-}" = --stages ] && { INNER=1; shift; }
WORK=${1:-/tmp/unison-gpu-smoke}
DEVICE=${SMOKE_DEVICE:-cuda}
SMALL=${SMOKE_SMALL:-0}
SCALE=${SMOKE_TIMEOUT_SCALE:-1}
PY=${PYTHON:-python3}
SITE=${SMOKE_SITE:-/tmp/unison-smoke-site}
SMOKE="$ROOT/scripts/gpu_smoke.py"
CHECKS="$WORK/checks.jsonl"
MODEL="$WORK/model"
TOKENS=256; PROMPTS=16; N=8
[ "$SMALL" = 1 ] && { TOKENS=16; PROMPTS=8; N=4; }
# every stage's time-out in seconds, in the order they run (the checks are stages: nothing runs untimed)
STAGES="install:30 model:60 probe:100 train/fp16:100 train/gradient:15 train/fp16-resume:80 train/bf16:80"
STAGES="$STAGES train/bf16-padded:55 train/packed_vs_padded:10"
TOTAL=550 GRACE=10  # the whole run of stages is cut at TOTAL s and given GRACE s to end; then the summary
CUT=${SMOKE_TOTAL_S:-$TOTAL}  # (tests cut it sooner)
emit() { echo "$1" | tee -a "$CHECKS"; }
timeout_of() { local s; for s in $STAGES; do [ "${s%%:*}" = "$1" ] && echo $(( ${s#*:} * SCALE )); done; }

if [ "$INNER" = 0 ]; then  # ---- the script itself: the budget, the stages under one time-out, the summary
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 UNISON_HOME="$WORK/home" \
    PYTHONUNBUFFERED=1
  mkdir -p "$WORK/logs"
  rm -rf "$MODEL" "$WORK/probe" "$WORK"/train-* "$WORK"/logs/*.log
  : >"$CHECKS"
  SUM=0; for s in $STAGES; do SUM=$((SUM + ${s#*:})); done
  OK=false; [ "$SUM" -le 530 ] && [ $((TOTAL + GRACE)) -le 570 ] && OK=true
  emit "{\"check\": \"budget\", \"ok\": $OK, \"stage_timeouts_s\": \"$STAGES\", \"sum_s\": $SUM,\
 \"stops_by_s\": $((TOTAL + GRACE)), \"cut_at_s\": $((CUT * SCALE)), \"timeout_scale\": $SCALE}"
  T0=$SECONDS
  timeout -k $((GRACE * SCALE)) $((CUT * SCALE)) bash "$0" --stages "$WORK" </dev/null
  RC=$?
  CUT_OK=true; [ $RC = 124 ] || [ $RC = 137 ] && CUT_OK=false
  emit "{\"check\": \"elapsed\", \"ok\": $CUT_OK, \"seconds\": $((SECONDS - T0)), \"cut_at_s\": $((CUT * SCALE))}"
  WANT="budget elapsed"; for s in $STAGES; do WANT="$WANT ${s%%:*}"; done
  if [ -n "${RESULTS:-}" ]; then  # small files only: what comes back from the GPU machine
    mkdir -p "$RESULTS/logs"
    [ -f "$WORK/probe/probe.json" ] && cp "$WORK/probe/probe.json" "$RESULTS/probe.json"
    for r in train-fp16 train-bf16 train-bf16-padded; do
      for f in metrics.jsonl summary.json; do [ -f "$WORK/$r/$f" ] && cp "$WORK/$r/$f" "$RESULTS/$r.$f"; done
    done
    for l in "$WORK"/logs/*.log; do [ -f "$l" ] && tail -n 200 "$l" >"$RESULTS/logs/${l##*/}"; done
  fi
  LINE=$($PY "$SMOKE" summary "$CHECKS" $WANT); STATUS=$?
  [ -n "$LINE" ] || { LINE='{"check": "summary", "ok": false, "why": "the summary did not run"}'; STATUS=1; }
  emit "$LINE"
  [ -n "${RESULTS:-}" ] && cp "$CHECKS" "$RESULTS/checks.jsonl"
  exit $STATUS
fi

# ---- the stages (run by the script above under its total time-out) -------------------------------------
CUR=""; CUR_PID=""
on_term() {  # the total time-out: end the running stage, say which it was, stop
  if [ -n "$CUR_PID" ]; then kill -TERM "$CUR_PID" 2>/dev/null; wait "$CUR_PID" 2>/dev/null; fi
  [ -n "$CUR" ] && emit "{\"check\": \"$CUR\", \"ok\": false, \"why\": \"cut by the script's total time-out\"}"
  exit 124
}
trap on_term TERM
stage() {  # name, command...: the command under the stage's time-out, its output in logs/NAME.log; one JSON line
  local name=$1 log="$WORK/logs/${1//\//-}.log" rc out t0=$SECONDS; shift
  CUR=$name
  timeout -k 5 "$(timeout_of "$name")" "$@" >"$log" 2>&1 &
  CUR_PID=$!
  wait "$CUR_PID"; rc=$?
  CUR_PID=""
  out=$($PY "$SMOKE" emit "$name" "$log" "$rc")
  [ -n "$out" ] || out="{\"check\": \"$name\", \"ok\": false, \"why\": \"exit status $rc; the check line could not be read\"}"
  emit "${out%\}}, \"stage_s\": $((SECONDS - t0)), \"timeout_s\": $(timeout_of "$name")}"; CUR=""
  case "$out" in *'"ok": true'*) return 0 ;; esac
  echo "---- last 30 lines of $log ----"; tail -n 30 "$log"; echo "----"
  return 1
}
skip() { emit "{\"check\": \"$1\", \"ok\": false, \"why\": \"not run: $2\"}"; }

cat >"$WORK/length_reward.py" <<EOF
CHARS = 3 * $TOKENS  # the most a response can decode to: 3 characters per token


def reward(response, item):
    """Longer is better: varies within every group because responses end at varied lengths (EOS is likely)."""
    return len(response) / CHARS
EOF
cat >"$WORK/train.yaml" <<EOF
model: $MODEL
device: $DEVICE
seed: 0
task: {name: arithmetic, digits: 2, train_size: 64, eval_size: 0, reward: "length_reward:reward", truncated_reward: null}
rollout: {n: $N, max_new_tokens: $TOKENS}
train: {steps: 3, prompts_per_step: $PROMPTS, mini_batches: 2, micro_batch_size: 64, micro_batch_tokens: $((8 * TOKENS)),
        lr: 1.0e-6, grad_noise: false}
checkpoint: {every: 0, every_minutes: 0, keep: 1}
log: {console: true, tensorboard: false, rollouts: true}
distributed: {param_dtype: compute}
EOF
export PY SMOKE ROOT WORK MODEL DEVICE SMALL TOKENS SITE
install_stage() { $PY "$SMOKE" install "$ROOT/wheels" "$SITE" "$DEVICE"; }
model_stage() { $PY "$SMOKE" model "$MODEL" "$SMALL" "$DEVICE" "$TOKENS"; }
probe_stage() {
  $PY -m unison probe --model "$MODEL" --device "$DEVICE" --precision fp32,bf16,fp16 --param-dtype fp32,compute \
    --n 4 --max-new-tokens "$TOKENS" --out "$WORK/probe" && $PY "$SMOKE" probe "$WORK/probe/probe.json"
}
train_run() {  # run dir, master port, unison train options...
  local run=$1 port=$2; shift 2
  $PY -m torch.distributed.run --nproc-per-node 1 --master-port "$port" -m unison train "$WORK/train.yaml" \
    --out "$run" "$@"
}
fp16_stage() { train_run "$WORK/train-fp16" 29577 --set precision=fp16 && $PY "$SMOKE" train "$WORK/train-fp16" fp16 3 fp16; }
gradient_stage() { $PY "$SMOKE" gradient "$WORK/train-fp16" "$MODEL"; }
resume_stage() {
  train_run "$WORK/train-fp16" 29578 --set precision=fp16 --set train.steps=4 --resume \
    && $PY "$SMOKE" train "$WORK/train-fp16" fp16-resume 4 fp16
}
bf16_stage() {
  train_run "$WORK/train-bf16" 29579 --set precision=bf16 --set train.packing=true \
    && $PY "$SMOKE" train "$WORK/train-bf16" bf16 3 bf16
}
padded_stage() {
  train_run "$WORK/train-bf16-padded" 29580 --set precision=bf16 --set train.steps=1 \
    && $PY "$SMOKE" train "$WORK/train-bf16-padded" bf16-padded 1 bf16
}
packed_stage() { $PY "$SMOKE" packed "$WORK/train-bf16" "$WORK/train-bf16-padded"; }
export -f install_stage model_stage probe_stage train_run fp16_stage gradient_stage resume_stage bf16_stage \
  padded_stage packed_stage

stage install bash -c install_stage
if stage model bash -c model_stage; then
  stage probe bash -c probe_stage
  stage train/fp16 bash -c fp16_stage
  if [ -d "$WORK/train-fp16/checkpoints" ]; then
    stage train/gradient bash -c gradient_stage
    stage train/fp16-resume bash -c resume_stage
  else
    skip train/gradient "train/fp16 wrote no checkpoint"; skip train/fp16-resume "train/fp16 wrote no checkpoint"
  fi
  stage train/bf16 bash -c bf16_stage
  stage train/bf16-padded bash -c padded_stage
  stage train/packed_vs_padded bash -c packed_stage
else
  for s in probe train/fp16 train/gradient train/fp16-resume train/bf16 train/bf16-padded train/packed_vs_padded; do
    skip "$s" "no model"
  done
fi
