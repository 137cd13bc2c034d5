"""Rollout throughput: the native engine's fast and generic paths vs Hugging Face ``generate`` (and vLLM).

Same model, same prompts, batch and response length (EOS ignored so both
produce exactly ``--max-new-tokens`` per response), per dtype, both measured
in this one run. Prints JSON; compare the ``native_over_hf`` (fast path) and
``generic_over_hf`` (the model's own forward with a DynamicCache, which every
non-Llama-family architecture takes) ratios, not the absolute numbers (shared
machines are noisy). ``--vllm`` adds the vLLM engine
(needs vLLM; ``make install-vllm`` on CPU) and ``vllm_over_hf``.

    python benchmarks/rollout_throughput.py [--model DIR] [--batch 32] [--max-new-tokens 128] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from unison.models import load_model, resolve_model_dir
from unison.precision import DTYPES
from unison.rollout import SamplingParams, make_engine


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also measure the vLLM engine")
    args = ap.parse_args()
    torch.manual_seed(0)
    model_dir = resolve_model_dir(args.model)
    texts = ["12+35=", "Once upon a time", "def add(a, b):\n", "Let n be a positive integer."]
    results = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        engine = make_engine("native", model_dir, dtype)
        tok = engine.tokenizer
        prompts = [tok(texts[i % len(texts)])["input_ids"] for i in range(args.batch)]
        params = SamplingParams(n=1, max_tokens=args.max_new_tokens, seed=0, ignore_eos=True)
        n_tokens = args.batch * args.max_new_tokens
        engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        t_native = best_of(lambda: engine.generate(prompts, params), args.repeats)
        generic = make_engine("native", model_dir, dtype)
        generic.path = "generic"  # the same model through the path every other architecture takes
        generic.generate(prompts[:2], SamplingParams(max_tokens=4))
        t_generic = best_of(lambda: generic.generate(prompts, params), args.repeats)

        hf = load_model(model_dir, dtype=dtype)
        enc = tok([texts[i % len(texts)] for i in range(args.batch)], return_tensors="pt", padding=True)

        def hf_generate():
            with torch.no_grad():
                out = hf.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                  max_new_tokens=args.max_new_tokens,
                                  min_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
            assert out.shape[1] - enc["input_ids"].shape[1] == args.max_new_tokens

        hf_generate()
        t_hf = best_of(hf_generate, args.repeats)
        row = {
            "dtype": name, "batch": args.batch, "new_tokens": args.max_new_tokens,
            "native_tokens_per_s": round(n_tokens / t_native, 1),
            "hf_generate_tokens_per_s": round(n_tokens / t_hf, 1),
            "native_over_hf": round(t_hf / t_native, 2),
            "generic_tokens_per_s": round(n_tokens / t_generic, 1),
            "generic_over_hf": round(t_hf / t_generic, 2),
            "engine_path": engine.path,
        }
        if args.vllm:
            v = make_engine("vllm", model_dir, dtype, seed=0)
            v.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
            t_v = best_of(lambda: v.generate(prompts, params), args.repeats)
            row.update({"vllm_tokens_per_s": round(n_tokens / t_v, 1), "vllm_over_hf": round(t_hf / t_v, 2)})
            del v
        results.append(row)
    print(json.dumps({"benchmark": "rollout_throughput", "model": str(model_dir),
                      "threads": torch.get_num_threads(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
