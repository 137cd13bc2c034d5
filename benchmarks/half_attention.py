"""bf16 / fp16 attention on the CPU: torch's half-precision kernel against unison's rule (unison/attention.py: fp32
attention of the same rounded q, K, V, rounded once), on both sides at once, side by side in one process.

Two parts, one JSON line:

1. **The mismatch**: for each dtype and seed, the native engine samples ``--batch`` responses of
   ``--max-new-tokens`` under each arm and the learner scores them in the same dtype, under the same arm, two ways:
   fp32 parameters under autocast (``fp32``, one process's default) and parameters cast to the dtype (``compute``,
   FSDP2's mixed precision); token k3 and the fraction of tokens scored identically per seed (each arm samples its
   own tokens, so compare the seeds' spread, not one seed).
2. **The speed**: ``--rounds`` alternated rounds (ABBA) under each arm of the same generate, EOS ignored (best
   tokens/s of each), and of the learner's forward and backward over those responses in the dtype under autocast
   (best seconds of each).

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

from unison import attention
from unison.batch import collate
from unison.learner import Learner
from unison.mismatch import mismatch_metrics
from unison.models import resolve_model_dir
from unison.precision import DTYPES
from unison.rollout import SamplingParams, make_engine
from unison.sides import Side

TEXTS = ["12+35=", "Once upon a time", "def add(a, b):\n", "Let n be a positive integer."]


#: each arm's answer to "does attention over q run in fp32" (unison.attention.upcasts), for both sides
ARMS = {"torch kernel": lambda q: False, "fp32 attention": attention.upcasts}
PARAMS = ("fp32", "compute")


def forward_backward(model, batch, dtype) -> float:
    """Seconds of one forward and backward of ``model`` (fp32 masters) over ``batch``'s rows under autocast to
    ``dtype``: the learner's attention, as a training step runs it."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype):
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
    logits.float().logsumexp(-1).mean().backward()
    return time.perf_counter() - t0


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
            row = {"k3": {}, "identical": {}, "tokens_per_s": {}}
            for arm, fn in ARMS.items():
                attention.upcasts = fn
                got = {p: ([], []) for p in PARAMS}
                for seed in range(args.seeds):
                    batch = collate(engine.generate(prompts, SamplingParams(max_tokens=args.max_new_tokens, seed=seed)),
                                    engine.pad_id)
                    for p in PARAMS:
                        with learner.as_side(Side(dtype=dtype, params=p)):
                            m = mismatch_metrics(learner.score(batch), batch.logp_mu, batch.response_mask)
                        got[p][0].append(m["mismatch/k3"])
                        got[p][1].append(m["mismatch/identical_fraction"])
                for p, (k3, same) in got.items():
                    row["k3"][f"{arm}, {p}"] = {"mean": sum(k3) / len(k3), "seeds": k3}
                    row["identical"][f"{arm}, {p}"] = round(sum(same) / len(same), 3)
            if args.rounds:
                params = SamplingParams(max_tokens=args.max_new_tokens, seed=0, ignore_eos=True)
                batch = collate(engine.generate(prompts, params), engine.pad_id)
                times = {arm: [] for arm in ARMS}
                update = {arm: [] for arm in ARMS}
                for r in range(args.rounds):
                    for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
                        attention.upcasts = ARMS[arm]
                        t0 = time.perf_counter()
                        engine.generate(prompts, params)
                        times[arm].append(time.perf_counter() - t0)
                        update[arm].append(forward_backward(learner.model, batch, dtype))
                n = args.batch * args.max_new_tokens
                row["tokens_per_s"] = {arm: round(n / min(t), 1) for arm, t in times.items()}
                row["fp32_over_torch"] = round(min(times["torch kernel"]) / min(times["fp32 attention"]), 2)
                row["learner_forward_backward_s"] = {arm: round(min(t), 3) for arm, t in update.items()}
                row["learner_fp32_over_torch"] = round(min(update["torch kernel"]) / min(update["fp32 attention"]), 2)
            out["dtypes"][name] = row
            print(f"[half_attention] {name}: {row}", file=sys.stderr, flush=True)
    finally:
        attention.upcasts = ARMS["fp32 attention"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
