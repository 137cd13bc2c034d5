#!/usr/bin/env bash
# GPU smoke check: what unison's CPU suite cannot show, in one command under 10 minutes, no network.
#
#   bash scripts/gpu_smoke.sh [OUT_DIR]            (stage time-outs add up to 530 s)
#
# 1. install unison with the wheels carried in ./wheels (scripts/gpu_wheels.sh; the GPU image has torch,
#    transformers and the rest, but no vLLM, pydantic or math-verify);
# 2. a random Qwen2-0.5B-shaped model (vocab 151936, 24 layers, d 896) made peaked: its output layer is
#    scaled until the mean next-token entropy is 0.5-3 nats (near-uniform outputs make every precision
#    look alike: k3 ~ 0 and rewards ~ 0, a check that measures nothing);
# 3. `unison probe --device cuda --precision fp32,bf16,fp16 --param-dtype fp32,compute` (native engine):
#    the mismatch of each precision on a GPU, ordered bf16 > fp16 > fp32;
# 4. `unison train` under torchrun (world size 1, FSDP2) on CUDA: fp16 3 steps then a resume to step 4,
#    bf16 3 steps with train.packing (one causal sdpa call per packed response); loss scale, skipped
#    steps, peak GPU memory per step (reset after each read), decode and update tokens/s.
# Each check prints one JSON line; the last line is the summary {"check": "summary", "ok": <every check
# ANDed>, ...}. A failing stage prints the tail of its log. What it cannot cover: vLLM on a GPU (its wheels
# do not fit the machine), multi-GPU NCCL, the paper-scale configs.
# SMOKE_DEVICE=cpu SMOKE_SMALL=1 runs the same plumbing on a CPU with a narrow model (a dry run); on a CPU
# without fp16 units (AMD EPYC here: 2 min per fp16 step) add SMOKE_TIMEOUT_SCALE=5 to stretch the time-outs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-smoke}
DEVICE=${SMOKE_DEVICE:-cuda}
SMALL=${SMOKE_SMALL:-0}
TOKENS=256; [ "$SMALL" = 1 ] && TOKENS=16
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 UNISON_HOME="$OUT/home" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CHECKS="$OUT/checks.jsonl"
: >"$CHECKS"

emit() { echo "$1" | tee -a "$CHECKS"; }
fail() {  # check name, log file: one JSON line, and the log's tail for whoever reads the output
  emit "$($PY -c 'import json,sys; print(json.dumps({"check": sys.argv[1], "ok": False, "log": sys.argv[2]}))' "$1" "$2")"
  echo "---- last 30 lines of $2 ----"; tail -n 30 "$2"; echo "----"
}
stage() {  # name, time-out (s), log, command...
  local name=$1 t=$(( $2 * ${SMOKE_TIMEOUT_SCALE:-1} )) log=$3; shift 3
  if timeout "$t" "$@" >"$log" 2>&1; then return 0; fi
  fail "$name" "$log"; return 1
}

# ---- 1. install (carried wheels only) ------------------------------------------------------- 60 s
if [ -d wheels ]; then
  stage install 60 "$OUT/pip.log" $PY -m pip install -q --no-index --find-links wheels --no-deps wheels/*.whl
fi
if stage install 60 "$OUT/pip-unison.log" $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . \
   && $PY -c "import unison, pydantic, math_verify, httpx" 2>>"$OUT/pip.log"; then
  emit "$($PY - "$DEVICE" <<'EOF'
import json, sys, torch
dev = sys.argv[1]
ok = dev != "cuda" or torch.cuda.is_available()
print(json.dumps({"check": "install", "ok": ok, "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
EOF
)"
else
  fail install "$OUT/pip.log"
fi

# ---- 2. a peaked random Qwen2-0.5B-shaped model ----------------------------------------------- 90 s
MODEL="$OUT/qwen2-0.5b-random"
cat >"$OUT/model.py" <<'EOF'
import json, sys, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from unison.models import build_char_tokenizer
out, small, dev = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
t0 = time.time()
tok = build_char_tokenizer()
shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
if small:
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
cfg = Qwen2Config(vocab_size=151936, **shape, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-6,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg).to(dev)
ids = torch.tensor([tok("12+35=47. The quick brown fox jumps")["input_ids"]], device=dev)

def entropy():
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), -1)
    return float(-(lp.exp() * lp).sum(-1).mean())

scale, h = 1.0, entropy()
for _ in range(40):  # scale the output layer until the next-token distributions are peaked (0.5-3 nats)
    if 0.5 <= h <= 3.0:
        break
    f = 1.6 if h > 3.0 else 0.75
    with torch.no_grad():
        model.lm_head.weight.mul_(f)
    scale *= f
    h = entropy()
model.to("cpu").save_pretrained(out)
tok.save_pretrained(out)
print(json.dumps({"check": "model", "ok": 0.5 <= h <= 3.0, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                  "mean_entropy_nats": round(h, 3), "lm_head_scale": round(scale, 3), "seconds": round(time.time() - t0, 1)}))
EOF
if stage model 90 "$OUT/model.log" $PY "$OUT/model.py" "$MODEL" "$SMALL" "$DEVICE"; then
  emit "$(tail -n 1 "$OUT/model.log")"
fi

# ---- 3. the probe on the device: three precisions, both learner numerics ------------------- 120 s
if stage probe 120 "$OUT/probe.log" $PY -m unison probe --model "$MODEL" --device "$DEVICE" \
     --precision fp32,bf16,fp16 --param-dtype fp32,compute --n 4 --max-new-tokens "$TOKENS" --out "$OUT/probe"; then
  emit "$($PY - "$OUT/probe/probe.json" <<'EOF'
import json, sys
res = json.load(open(sys.argv[1]))["results"]
k3 = {(r["precision"], r["param_dtype"]): r["mismatch/k3"] for r in res}
ordered = all(k3[("bf16", p)] > k3[("fp16", p)] > k3[("fp32", p)] for p in ("fp32", "compute"))
print(json.dumps({"check": "probe", "ok": ordered and len(res) == 6,
                  "token_k3": {f"{a}/{b}": v for (a, b), v in k3.items()},
                  "seq_kl_k3": {f"{r['precision']}/{r['param_dtype']}": r["mismatch/seq_kl_k3"] for r in res},
                  "tokens": {r["precision"]: r["mismatch/num_tokens"] for r in res if r["param_dtype"] == "fp32"}}))
EOF
)"
fi

# ---- 4. RL under torchrun (world size 1, FSDP2): fp16 3 steps + resume, bf16 packed 3 steps - 260 s
printf 'def reward(response, item):\n    return min(len(response), 200) / 200\n' >"$OUT/length_reward.py"
cat >"$OUT/train.yaml" <<EOF
model: $MODEL
device: $DEVICE
task: {name: arithmetic, digits: 2, train_size: 64, eval_size: 0, reward: "length_reward:reward", truncated_reward: null}
rollout: {n: 8, max_new_tokens: $TOKENS}
train: {steps: 3, prompts_per_step: 16, mini_batches: 2, micro_batch_size: 8, micro_batch_tokens: 4096, lr: 1.0e-6}
checkpoint: {every: 1}
log: {console: true, tensorboard: false}
distributed: {param_dtype: compute}
EOF
summarize_train() {  # metrics file, name, expected steps
  $PY - "$1" "$2" "$3" <<'EOF'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
last = rows[-1]
tok = [r["mismatch/num_tokens"] for r in rows]
print(json.dumps({"check": f"train/{sys.argv[2]}", "ok": len(rows) == int(sys.argv[3]) and last["optim/skipped_steps"] == 0
                  and all(r["optim/grad_norm"] is not None for r in rows),
                  "step_s": [round(r["time/step_s"], 2) for r in rows],
                  "decode_tokens_per_s": [round(t / r["time/generate_s"]) for t, r in zip(tok, rows)],
                  "update_tokens_per_s": [round(t / r["time/update_s"]) for t, r in zip(tok, rows)],
                  "cuda_peak_gib_per_step": [round(r.get("memory/cuda_max_allocated_gib") or float("nan"), 2) for r in rows],
                  "token_k3": [r["mismatch/k3"] for r in rows], "loss_scale": last["optim/loss_scale"],
                  "grad_norm": [r["optim/grad_norm"] for r in rows]}))
EOF
}
TR=($PY -m torch.distributed.run --nproc-per-node 1 --master-port 29577 -m unison train "$OUT/train.yaml")
if stage train/fp16 100 "$OUT/train-fp16.log" env PYTHONPATH="$OUT" "${TR[@]}" --out "$OUT/train-fp16" --set precision=fp16; then
  emit "$(summarize_train "$OUT/train-fp16/metrics.jsonl" fp16 3)"
  if stage train/fp16-resume 60 "$OUT/train-fp16-resume.log" env PYTHONPATH="$OUT" "${TR[@]}" --out "$OUT/train-fp16" \
       --set precision=fp16 --set train.steps=4 --resume; then
    emit "$(summarize_train "$OUT/train-fp16/metrics.jsonl" fp16-resume 4)"
  fi
fi
if stage train/bf16 100 "$OUT/train-bf16.log" env PYTHONPATH="$OUT" "${TR[@]}" --out "$OUT/train-bf16" --set precision=bf16 \
     --set train.packing=true; then
  emit "$(summarize_train "$OUT/train-bf16/metrics.jsonl" bf16 3)"
fi

# ---- the summary: every check ANDed --------------------------------------------------------------
$PY - "$CHECKS" <<'EOF'
import json, sys
checks = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
want = {"install", "model", "probe", "train/fp16", "train/fp16-resume", "train/bf16"}
seen = {c["check"] for c in checks}
print(json.dumps({"check": "summary", "ok": want <= seen and all(c["ok"] for c in checks),
                  "missing": sorted(want - seen), "failed": [c["check"] for c in checks if not c["ok"]]}))
EOF
