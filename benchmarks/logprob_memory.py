"""Peak memory of the learner's log-probs at a 152k vocabulary: whole-vocabulary logits vs chunks.

"before" is unison's previous ``token_logprobs``: the model's fp32 logits for every
position, ``log_softmax`` over the vocabulary, ``gather`` (and the entropy from
``exp``). "after" is today's: hidden states through the output layer in chunks of
``train.logprob_chunk`` positions (``logit − logsumexp``), recomputed in the
backward pass. A narrow random Qwen2-shaped model (vocab 152064, as Qwen2.5) and
one 4096-token sequence; each variant runs in a fresh subprocess, and the peak is
the rise of the resident set (VmHWM after resetting it) over the resident set just
before the call. Prints JSON.

    python benchmarks/logprob_memory.py [--tokens 4096] [--vocab 152064] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from unison.logprobs import token_logprobs

variant, mode, T, V, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
torch.set_num_threads(2)
cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T + 8,
                  tie_word_embeddings=False)
model = Qwen2ForCausalLM(cfg).eval()
tokens = torch.randint(0, V, (1, T))
mask = torch.ones_like(tokens)
resp = torch.zeros_like(tokens, dtype=torch.float32)
resp[:, 64:] = 1  # a 64-token prompt, then the response


def before(grad):  # the previous implementation, verbatim in effect
    logits = model(input_ids=tokens, attention_mask=mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    lsm = torch.log_softmax(logits, dim=-1)
    logp = lsm.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1) * mask
    if grad:
        with torch.no_grad():
            ent = -(lsm.exp() * lsm).sum(-1)
    return logp


def after(grad):
    out = token_logprobs(model, tokens, mask, positions=resp, chunk=chunk, return_entropy=grad)
    return out[0] if grad else out


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


fn = before if variant == "before" else after
grad = mode == "train"
with torch.set_grad_enabled(grad):
    fn(grad)  # warm-up (allocator, kernels), then measure a fresh call
    model.zero_grad(set_to_none=True)
    import gc; gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM)
    base = status("VmRSS:")
    logp = fn(grad)
    if grad:
        (-(logp * resp).sum()).backward()
    peak = status("VmHWM:")
print(json.dumps({"peak_rise_bytes": peak - base, "logp": (logp.detach() * resp)[0, 64:].tolist()}))
"""


def run(variant: str, mode: str, args) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, variant, mode, str(args.tokens), str(args.vocab),
                          str(args.chunk)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    res = {"benchmark": "logprob_memory", "tokens": args.tokens, "vocab": args.vocab, "chunk": args.chunk}
    for mode in ("score", "train"):
        b, a = run("before", mode, args), run("after", mode, args)
        diff = max(abs(x - y) for x, y in zip(b["logp"], a["logp"]))
        res[mode] = {"before_peak_MiB": round(b["peak_rise_bytes"] / 2**20, 1),
                     "after_peak_MiB": round(a["peak_rise_bytes"] / 2**20, 1),
                     "before_over_after": round(b["peak_rise_bytes"] / max(a["peak_rise_bytes"], 1), 2),
                     "max_abs_logp_diff": diff}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
