"""A bf16 / fp16 decode step's attention on the CPU: torch's half-precision kernel against unison's fp32 attention of
the same rounded q, K, V, rounded once (``unison.rollout.decode.attend``), side by side in one process.

Two parts, one JSON line:

1. **The mismatch**: for each dtype and seed, the native engine samples ``--batch`` responses of
   ``--max-new-tokens`` with each attention and the learner scores them in the same dtype; token k3 per seed, both
   arms (each arm samples its own tokens, so compare the seeds' spread, not one seed).
2. **The decode's speed**: ``--rounds`` alternated rounds (ABBA) of the same generate with each attention, EOS
   ignored; best tokens/s of each.

    python benchmarks/half_attention.py --model <SmolLM2 dir> --batch 8 --seeds 3
    python benchmarks/half_attention.py --model builtin:tiny --seeds 8 --rounds 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from machine import cpu_model  # noqa: E402 - a sibling module (python benchmarks/...)

import torch
import torch.nn.functional as F

from unison.batch import collate
from unison.learner import Learner
from unison.mismatch import mismatch_metrics
from unison.models import resolve_model_dir
from unison.precision import DTYPES
from unison.rollout import SamplingParams, decode, make_engine
from unison.sides import Side

TEXTS = ["12+35=", "Once upon a time", "def add(a, b):\n", "Let n be a positive integer."]


def torch_kernel(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


ARMS = {"torch kernel": torch_kernel, "fp32 attention": decode.attend}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="alternated timing rounds (0: no timing)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model_dir(args.model)
    learner = Learner(model)
    out = {"benchmark": "half_attention", "cpu": cpu_model(), "torch": torch.__version__, "threads": args.threads,
           "model": str(model), "batch": args.batch, "new_tokens": args.max_new_tokens, "dtypes": {}}
    try:
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            engine = make_engine("native", model, dtype)
            prompts = [engine.tokenizer(TEXTS[i % len(TEXTS)])["input_ids"] for i in range(args.batch)]
            row = {"k3": {}, "tokens_per_s": {}}
            for arm, fn in ARMS.items():
                decode.attend = fn
                k3 = []
                for seed in range(args.seeds):
                    batch = collate(engine.generate(prompts, SamplingParams(max_tokens=args.max_new_tokens, seed=seed)),
                                    engine.pad_id)
                    with learner.as_side(Side(dtype=dtype)):
                        k3.append(mismatch_metrics(learner.score(batch), batch.logp_mu,
                                                   batch.response_mask)["mismatch/k3"])
                row["k3"][arm] = {"mean": sum(k3) / len(k3), "seeds": k3}
            if args.rounds:
                params = SamplingParams(max_tokens=args.max_new_tokens, seed=0, ignore_eos=True)
                times = {arm: [] for arm in ARMS}
                for r in range(args.rounds):
                    for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
                        decode.attend = ARMS[arm]
                        t0 = time.perf_counter()
                        engine.generate(prompts, params)
                        times[arm].append(time.perf_counter() - t0)
                n = args.batch * args.max_new_tokens
                row["tokens_per_s"] = {arm: round(n / min(t), 1) for arm, t in times.items()}
                row["fp32_over_torch"] = round(min(times["torch kernel"]) / min(times["fp32 attention"]), 2)
            out["dtypes"][name] = row
            print(f"[half_attention] {name}: {row}", file=sys.stderr, flush=True)
    finally:
        decode.attend = ARMS["fp32 attention"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
