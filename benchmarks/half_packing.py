"""Does pre-packing a bf16 / fp16 engine's matrices pay? (issue 56, item 3; unison/gemm.py ``packs_half``)

The native engine with its fast path's matrices pre-packed into oneDNN's layout once per sync, against the same
engine multiplying by the plain weights (torch's path: oneDNN re-packs each weight on every call), on the same
prompts, ``--max-new-tokens`` per response (EOS ignored), alternated for ``--repeats`` rounds in ABBA order, best of
each. Also checks that the two sample the same tokens and log-probs, bit for bit. One JSON line per dtype and batch.
A model under 10M parameters, or a CPU without native kernels for the dtype, is not packed by the engine: the
script says so and times nothing for it.

    python benchmarks/half_packing.py --model DIR [--dtypes bf16,fp16] [--batches 8,32] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from unison import gemm  # noqa: E402
from unison.models import resolve_model_dir  # noqa: E402
from unison.precision import DTYPES  # noqa: E402
from unison.rollout import SamplingParams, make_engine  # noqa: E402
from unison.runtime import keep_freed_memory  # noqa: E402

TEXTS = ["Once upon a time", "12+35=", "def add(a, b):", "Let n be a positive integer."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    keep_freed_memory()
    model_dir = resolve_model_dir(args.model)
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        packed = make_engine("native", model_dir, dt)
        if not packed.fast.packed:
            print(json.dumps({"benchmark": "half_packing", "dtype": name, "packed": False,
                              "why": "the engine does not pack here (a model under 10M parameters, or no native "
                                     f"{name} kernels on this CPU)"}))
            continue
        real, gemm.SMALL_MODEL = gemm.SMALL_MODEL, 10**15  # the same engine, told not to pack
        try:
            plain = make_engine("native", model_dir, dt)
        finally:
            gemm.SMALL_MODEL = real
        tok = packed.tokenizer
        for B in (int(b) for b in args.batches.split(",")):
            prompts = [tok(TEXTS[i % len(TEXTS)])["input_ids"] for i in range(B)]
            params = SamplingParams(n=1, max_tokens=args.max_new_tokens, seed=0, ignore_eos=True)
            best = {"packed": float("inf"), "plain": float("inf")}
            for e in (packed, plain):  # warm-up
                e.generate(prompts[:2], SamplingParams(n=1, max_tokens=4, seed=0))
            for r in range(args.repeats):
                order = (("packed", packed), ("plain", plain)) if r % 2 == 0 else (("plain", plain), ("packed", packed))
                for key, e in order:
                    t0 = time.perf_counter()
                    e.generate(prompts, params)
                    best[key] = min(best[key], time.perf_counter() - t0)
            a, b = packed.generate(prompts, params), plain.generate(prompts, params)
            same = [c.token_ids for c in a] == [c.token_ids for c in b] and \
                [c.logprobs for c in a] == [c.logprobs for c in b]
            tokens = B * args.max_new_tokens
            print(json.dumps({"benchmark": "half_packing", "cpu": cpu_model(), "threads": torch.get_num_threads(),
                              "dtype": name, "batch": B, "new_tokens": args.max_new_tokens,
                              "packed_tokens_per_s": round(tokens / best["packed"], 1),
                              "plain_tokens_per_s": round(tokens / best["plain"], 1),
                              "packed_over_plain": round(best["plain"] / best["packed"], 2),
                              "bitwise_same_samples": same}), flush=True)


if __name__ == "__main__":
    main()
