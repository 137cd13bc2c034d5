#!/usr/bin/env bash
# GPU smoke check (one GPU, about 5-8 minutes, no network): what unison's CPU suite cannot show.
#
#   bash scripts/gpu_smoke.sh [OUT_DIR]
#
# 1. installs unison with the wheels carried in ./wheels (the GPU image has torch and transformers;
#    bring pydantic, math-verify, ... with scripts/gpu_wheels.sh on a machine with network);
# 2. builds a random Qwen2.5-0.5B-shaped model (vocab 151936, 24 layers, d 896) with unison's
#    character tokenizer;
# 3. `unison probe --device cuda --precision fp32,bf16,fp16` (native engine; vLLM too when installed);
# 4. 2 steps of `unison train` in fp16 and in bf16 on CUDA under torchrun (world size 1, FSDP2);
# and prints one JSON line per check (`{"check": ..., "ok": ..., ...}`), then a summary line.
# The README ("Status") records what it showed the last time it ran, with the date and the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-smoke}
# SMOKE_DEVICE=cpu SMOKE_SMALL=1 runs the same plumbing on a CPU with a narrow model (a dry run)
DEVICE=${SMOKE_DEVICE:-cuda}
SMALL=${SMOKE_SMALL:-0}
TOKENS=256; [ "$SMALL" = 1 ] && TOKENS=16
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 UNISON_HOME="$OUT/home" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

json() { $PY -c 'import json,sys; print(json.dumps(dict(a.split("=",1) for a in sys.argv[1:])))' "$@"; }

# ---- 1. install (no network: carried wheels only)
if [ -d wheels ]; then
  $PY -m pip install -q --no-index --find-links wheels --no-deps wheels/*.whl >"$OUT/pip.log" 2>&1
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1
if $PY -c "import unison, pydantic, math_verify, httpx" 2>>"$OUT/pip.log"; then
  json check=install ok=true
else
  json check=install ok=false log="$OUT/pip.log"; exit 1
fi
$PY - <<'EOF'
import json, torch
print(json.dumps({"check": "device", "ok": torch.cuda.is_available(), "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
EOF

# ---- 2. a random Qwen2.5-0.5B-shaped model
MODEL="$OUT/qwen2-0.5b-random"
$PY - "$MODEL" "$SMALL" <<'EOF'
import json, sys, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from unison.models import build_char_tokenizer
t0 = time.time()
tok = build_char_tokenizer()
shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
if sys.argv[2] == "1":
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
cfg = Qwen2Config(vocab_size=151936, **shape, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=True, initializer_range=0.02, rms_norm_eps=1e-6,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg)
model.save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
print(json.dumps({"check": "model", "ok": True, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                  "seconds": round(time.time() - t0, 1)}))
EOF

# ---- 3. the probe on CUDA
ENGINES=native
[ "$SMALL" != 1 ] && $PY -c "import vllm" 2>/dev/null && ENGINES=native,vllm
if timeout 300 $PY -m unison probe --model "$MODEL" --device $DEVICE --precision fp32,bf16,fp16 --engine $ENGINES \
     --n 4 --max-new-tokens $TOKENS --out "$OUT/probe" >"$OUT/probe.log" 2>&1; then
  $PY - "$OUT/probe/probe.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(json.dumps({"check": f"probe/{r['engine']}/{r['precision']}", "ok": True, "token_k3": r["mismatch/k3"],
                      "seq_kl_k3": r["mismatch/seq_kl_k3"], "mean_abs_prob_diff": r["mismatch/prob_diff_mean"],
                      "tokens": r["mismatch/num_tokens"]}))
EOF
else
  json check=probe ok=false log="$OUT/probe.log"
fi

# ---- 4. two RL steps per precision, torchrun world size 1 (FSDP2, param_dtype compute)
# a random model earns no task reward: pay for length so that groups differ and gradients are real
printf 'def reward(response, item):\n    return min(len(response), 200) / 200\n' >"$OUT/length_reward.py"
export PYTHONPATH="$OUT${PYTHONPATH:+:$PYTHONPATH}"
cat >"$OUT/train.yaml" <<EOF
model: $MODEL
device: $DEVICE
task: {name: arithmetic, digits: 2, train_size: 64, eval_size: 0, reward: "length_reward:reward", truncated_reward: null}
rollout: {n: 8, max_new_tokens: $TOKENS}
train: {steps: 2, prompts_per_step: 16, mini_batches: 2, micro_batch_size: 8, lr: 1.0e-6}
log: {console: true, tensorboard: false}
distributed: {param_dtype: compute}
EOF
for PREC in fp16 bf16; do
  if timeout 400 $PY -m torch.distributed.run --nproc-per-node 1 --master-port 29577 -m unison train "$OUT/train.yaml" \
       --out "$OUT/train-$PREC" --set precision=$PREC >"$OUT/train-$PREC.log" 2>&1; then
    $PY - "$OUT/train-$PREC/metrics.jsonl" "$PREC" <<'EOF'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
last = rows[-1]
print(json.dumps({"check": f"train/{sys.argv[2]}", "ok": len(rows) == 2 and last["optim/skipped_steps"] == 0,
                  "step_s": [round(r["time/step_s"], 2) for r in rows],
                  "rollout_s": [round(r["time/rollout_s"], 2) for r in rows],
                  "update_s": [round(r["time/update_s"], 2) for r in rows],
                  "cuda_max_allocated_gib": round(last.get("memory/cuda_max_allocated_gib", float("nan")), 2),
                  "token_k3": [r["mismatch/k3"] for r in rows], "loss_scale": last["optim/loss_scale"],
                  "grad_norm": [r["optim/grad_norm"] for r in rows]}))
EOF
  else
    json check=train/$PREC ok=false log="$OUT/train-$PREC.log"
  fi
done
json check=done ok=true out="$OUT"
