"""Rollout throughput: the native engine's fast and generic paths vs Hugging Face ``generate`` (and vLLM).

Same model, same prompts, batch and response length (EOS ignored so both
produce exactly ``--max-new-tokens`` per response), per dtype, both measured
in this one run. Prints JSON; compare the ``native_over_hf`` (fast path) and
``generic_over_hf`` (the model's own forward with a DynamicCache, which every
non-Llama-family architecture takes) ratios, not the absolute numbers (shared
machines are noisy). ``--vllm`` adds the vLLM engine
(needs vLLM; ``make install-vllm`` on CPU) and ``vllm_over_hf``.

Where the time goes against what this CPU can do (issue 32): the script measures, in this process
and at its thread count, the memory bandwidth (``dst.copy_(src)`` of two 256 MiB fp32 buffers: read +
write) and the fp32 matmul peak (a 2048³ product by each library unison can use: ``blas``, torch's
``torch.mm``, and ``onednn``; unison/gemm.py — the larger is the peak), and reports for the native fast path a
roofline: every decode step reads the model's matmul weights once (and the KV cache so far) and does
2 FLOPs per weight per row, so one step takes at least max(bytes / bandwidth, FLOPs / peak) — summed
over the ``--max-new-tokens`` steps of a batch that is the best tokens/s this CPU allows, and
``roofline_fraction`` is the measured tokens/s over it (``bound``: which of the two limits; the memory
bound assumes the weights do not stay in the CPU's caches — true of SmolLM2's 540 MB in fp32, not of
the tiny model's 3 MB, whose fraction therefore means little). At 32 rows no library reaches the 2048³ peak, so
``shape_bound`` is the bound the step's own shapes allow (issue 56): the step's products alone, by the engine's own
product function over its own weights, plus attention over a cache of the steps' mean length, timed on this CPU;
``fraction`` is the measured tokens/s over it, and the step's time beyond it is what norms, rotary embedding,
residuals, cache writes, the sampler and Python cost. With
``--update-steps N`` (default 1) it also runs N RL steps of ``unison train`` on the model (the probe's 8
chat prompts, ``--batch`` responses of up to ``--max-new-tokens`` tokens, fp32, a length reward) and
reports the update's FLOP/s — 6 × the decoder's matmul parameters × tokens and 6 × the output layer's ×
response tokens for the training forward and backward (2 × for a separate score pass), plus attention —
beside the matmul peak. In fp32 the native engine is timed on each library (its linears follow the one
chosen when it is loaded; under oneDNN its products are pre-packed, unison/gemm.py) and the faster counts; the
update runs on ``gemm: auto``'s choice (in the JSON). ``--compile`` also times the engine with its layers compiled
(``compile: engine``; the compile's seconds in the JSON) and runs the update steps compiled as well as eager.
As unison's commands do, the script first asks glibc to keep freed buffers (unison/runtime.py);
``--system-allocator`` leaves glibc's defaults, for the side-by-side.

    python benchmarks/rollout_throughput.py [--model DIR] [--batch 32] [--max-new-tokens 128] [--vllm]
    python benchmarks/rollout_throughput.py --model builtin:smollm2 --dtypes fp32   # issue 32's roofline
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from machine import cpu_model  # noqa: E402 - a sibling module (python benchmarks/...)

import torch

from unison import gemm, runtime
from unison.attention import sdpa as engine_attention
from unison.models import load_model, resolve_model_dir
from unison.precision import DTYPES
from unison.rollout import SamplingParams, make_engine
from unison.sides import Side


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large copy (each byte read once and written once), best of ``repeats``."""
    n = mib * 2**20 // 4
    src, dst = torch.rand(n), torch.empty(n)
    dst.copy_(src)
    return 2 * 4 * n / best_of(lambda: dst.copy_(src), repeats)


def matmul_peak(size: int = 2048, repeats: int = 3) -> dict[str, float]:
    """fp32 FLOP/s of a large square matmul by each library torch can use (unison/gemm.py: ``blas``, torch's
    ``torch.mm``, and ``onednn``), best of ``repeats``."""
    from unison import gemm

    a, b = torch.rand(size, size), torch.rand(size, size)
    fns = {"blas": lambda: torch.mm(a, b)}
    if gemm.onednn_available():
        bt = b.t()  # x·bᵀᵀ = a·b: the oneDNN linear with a transposed view as its weight
        fns["onednn"] = lambda: gemm._onednn(a, bt, None)
    out = {}
    for name, fn in fns.items():
        fn()
        out[name] = 2 * size**3 / best_of(fn, repeats)
    return out


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: all but the input embedding's lookup table (a tied
    output layer reuses it as a matmul, so it counts once), norms and biases included (they are few)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    return sum(p.numel() for p in model.parameters()) - (0 if tied else emb.numel())


def decode_roofline(model, batch: int, prompt_len: float, new_tokens: int, bytes_per: int, bw: float,
                    peak: float) -> dict:
    """The least time ``new_tokens`` decode steps of ``batch`` rows can take on this CPU: per step the
    weights (and the KV cache so far) are read once, 2 FLOPs per weight per row plus attention."""
    c = model.config
    layers, heads = c.num_hidden_layers, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    w = matmul_params(model)
    t_mem = t_flop = t = 0.0
    for i in range(new_tokens):
        ctx = prompt_len + i
        step_bytes = (w + batch * ctx * layers * 2 * kv * head_dim) * bytes_per  # weights + K and V so far
        step_flops = batch * (2 * w + layers * 4 * ctx * heads * head_dim)  # matmuls + q·K and p·V
        t_mem += step_bytes / bw
        t_flop += step_flops / peak
        t += max(step_bytes / bw, step_flops / peak)
    return {"bound_tokens_per_s": round(batch * new_tokens / t, 1), "bound": "memory" if t_mem > t_flop else "compute",
            "weights_mib_per_step": round(w * bytes_per / 2**20, 1),
            "memory_bound_tokens_per_s": round(batch * new_tokens / t_mem, 1),
            "compute_bound_tokens_per_s": round(batch * new_tokens / t_flop, 1)}


def decode_shape_bound(engine, batch: int, prompt_len: float, new_tokens: int, repeats: int) -> dict:
    """What a decode step cannot do without, at the shapes it runs: every product it makes (each layer's fused
    q/k/v, o, fused gate/up and down, and the output layer; one row per response) by the engine's own product
    function over the engine's own weights (packed where it packs them), and each layer's attention over a cache
    of the steps' mean length — timed alone, best of ``repeats`` steps. The 2048³ peak is out of reach at 32
    rows; this is the bound the step's shapes allow on this CPU. What the step spends beyond it (norms, rotary
    embedding, residuals, cache writes, the sampler, Python) is the gap. ``products_cache_hot_ms_per_step``: the
    same products, each repeated on one layer's weight (so read from the CPU's caches, not memory) — what the
    products would cost if the weights' streaming from memory were free."""
    fast, c = engine.fast, engine.model.config
    dtype = next(engine.model.parameters()).dtype
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    x_d = torch.randn(batch, 1, c.hidden_size, dtype=dtype)
    x_o = torch.randn(batch, 1, heads * head_dim, dtype=dtype)
    x_i = torch.randn(batch, 1, c.intermediate_size, dtype=dtype)
    ctx = int(round(prompt_len + (new_tokens - 1) / 2))  # the mean number of keys a step attends over
    q = torch.randn(batch, heads, 1, head_dim, dtype=dtype)
    caches = [(torch.randn(batch, kv, ctx + new_tokens, head_dim, dtype=dtype),
               torch.randn(batch, kv, ctx + new_tokens, head_dim, dtype=dtype)) for _ in fast.layers]
    mask = torch.ones(batch, 1, 1, ctx, dtype=torch.bool)

    def products():
        for qkv_w, qkv_b, _, o_w, o_b, gu_w, gu_b, _, d_w, d_b in fast.layers:
            fast.linear(x_d, qkv_w, qkv_b), fast.linear(x_o, o_w, o_b)
            fast.linear(x_d, gu_w, gu_b), fast.linear(x_i, d_w, d_b)
        fast.logits(x_d)

    def attention():
        for kc, vc in caches:
            engine_attention(q, kc[:, :, :ctx], vc[:, :, :ctx], mask, head_dim ** -0.5)  # the engine's own

    def hot(x, w, b):  # one product again and again on one weight: in the CPU's caches after the first call
        fast.linear(x, w, b)
        return best_of(lambda: fast.linear(x, w, b), 5)

    with torch.no_grad():
        products(), attention()  # warm
        t_p, t_a = best_of(products, repeats), best_of(attention, repeats)
        qkv_w, qkv_b, _, o_w, o_b, gu_w, gu_b, _, d_w, d_b = fast.layers[0]
        t_hot = len(fast.layers) * (hot(x_d, qkv_w, qkv_b) + hot(x_o, o_w, o_b) + hot(x_d, gu_w, gu_b)
                                    + hot(x_i, d_w, d_b)) + hot(x_d, *fast.head)
    # ms to 4 decimals: a tiny model's step is a fraction of a ms, and the report's own arithmetic must hold
    return {"tokens_per_s": round(batch / (t_p + t_a), 1), "products_ms_per_step": round(1e3 * t_p, 4),
            "attention_ms_per_step": round(1e3 * t_a, 4), "mean_keys": ctx,
            "products_cache_hot_ms_per_step": round(1e3 * t_hot, 4)}


def update_flops(model_dir, batch: int, new_tokens: int, steps: int, peak: float, compile_: str = "off") -> dict:
    """``steps`` RL steps of ``unison train`` (fp32, the probe's 8 prompts); the last step's update and score
    pass in FLOP/s against the matmul peak."""
    import unison
    from unison.config import load_config
    from unison.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="unison-roofline-"))
    (work / "length_reward.py").write_text("def reward(response, item=None):\n    return min(len(response), 100) / 100\n")
    prompts = Path(unison.__file__).parent / "data" / "prompts.jsonl"
    n_prompts = min(8, batch)
    sets = [f"model={model_dir}", "precision=fp32", "task.name=jsonl", f"task.path={prompts}",
            f"task.reward={work / 'length_reward.py'}:reward", "task.truncated_reward=null",
            f"train.prompts_per_step={n_prompts}", f"rollout.n={max(2, batch // n_prompts)}",
            f"rollout.max_new_tokens={new_tokens}", "train.lr=1e-6", f"train.steps={steps}", "log.console=false",
            "log.tensorboard=false", "checkpoint.every_minutes=0", f"threads={torch.get_num_threads()}",
            f"compile={compile_}"]
    t = Trainer(load_config(None, sets), work / "run", log=lambda m: None)
    for _ in range(steps):
        m = t.train_step()
    t.source.close()
    model = t.learner.model
    c = model.config
    head = model.get_output_embeddings().weight.numel()
    body = matmul_params(model) - head  # every position goes through the decoder; only response tokens need logits
    n = max(2, batch // n_prompts)
    prompt_tokens = n * sum(len(p) for p in t.prompt_ids[:n_prompts])
    rows = n * n_prompts
    seq = prompt_tokens / rows + m["response_length/mean"]  # mean tokens per sequence
    responses = rows * m["response_length/mean"]
    # matmuls + causal attention + the output layer at response positions
    fwd = rows * (2 * body * seq + 2 * c.num_hidden_layers * c.hidden_size * seq * seq) + 2 * head * responses
    separate_score = t.anchor == "score"
    update_s, score_s = m["time/update_s"], m.get("time/score_s") or 0.0
    flops = 3 * fwd + (fwd if separate_score else 0.0)
    return {"gemm": str(t.machine.gemm), "compile": str(t.machine.compilation), "rows": rows, "mean_sequence_tokens": round(seq, 1), "response_tokens": round(responses),
            "score_pass": "separate" if separate_score else "fused into the training forward",
            "update_s": round(update_s, 2), "score_s": round(score_s, 2), "generate_s": round(m.get("time/generate_s", 0), 2),
            "step_s": round(m["time/step_s"], 2), "compile_s_last_step": round(m["time/compile_s"], 2),
            "update_gflop": round(flops / 1e9, 1),
            "update_gflop_per_s": round(flops / (update_s + score_s) / 1e9, 2),
            "fraction_of_matmul_peak": round(flops / (update_s + score_s) / peak, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also measure the vLLM engine")
    ap.add_argument("--update-steps", type=int, default=1,
                    help="RL steps of unison train whose last update is measured against the matmul peak (0: none)")
    ap.add_argument("--bandwidth-mib", type=int, default=256, help="size of each buffer of the bandwidth copy")
    ap.add_argument("--matmul-size", type=int, default=2048, help="side of the square matmul of the peak")
    ap.add_argument("--compile", action="store_true", help="also the engine and the update compiled (Inductor)")
    ap.add_argument("--system-allocator", action="store_true", help="leave glibc's defaults for freed buffers")
    args = ap.parse_args()
    kept = False if args.system_allocator else runtime.keep_freed_memory()
    torch.manual_seed(0)
    model_dir = resolve_model_dir(args.model)
    bw, peaks = memory_bandwidth(args.bandwidth_mib), matmul_peak(args.matmul_size)
    peak = max(peaks.values())  # the CPU's best fp32 matmul rate that torch can reach
    texts = ["12+35=", "Once upon a time", "def add(a, b):\n", "Let n be a positive integer."]
    results = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        params = SamplingParams(n=1, max_tokens=args.max_new_tokens, seed=0, ignore_eos=True)
        n_tokens = args.batch * args.max_new_tokens
        by_gemm, engines = {}, {}
        # bf16/fp16 linears are oneDNN's in torch already, except on a CPU without kernels for them: there the
        # engine's products are fp32 ones (gemm.half_route) and each library is timed as for fp32
        for lib in (peaks if dtype == torch.float32 or gemm.half_route(dtype) else ["blas"]):
            gemm.use(lib)  # the engine's linears follow the library chosen when it is loaded
            engine = make_engine("native", model_dir, dtype)
            tok = engine.tokenizer
            prompts = [tok(texts[i % len(texts)])["input_ids"] for i in range(args.batch)]
            engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
            by_gemm[lib] = best_of(lambda: engine.generate(prompts, params), args.repeats)
            engines[lib] = engine
        gemm.use("blas")  # HF generate and the generic path below: torch's own linears, as before
        lib_native = min(by_gemm, key=by_gemm.get)
        t_native = by_gemm[lib_native]
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
        compiled = None
        if args.compile:  # the engine on the faster library, its layers compiled
            gemm.use(lib_native)
            t0 = time.perf_counter()
            ce = make_engine("native", model_dir, Side(dtype=dtype, compiled=True), decode_rows=args.batch)
            ce.generate(prompts[:2], SamplingParams(max_tokens=4))
            compile_s = time.perf_counter() - t0
            t_c = best_of(lambda: ce.generate(prompts, params), args.repeats)
            gemm.use("blas")
            compiled = {"tokens_per_s": round(n_tokens / t_c, 1), "over_eager": round(t_native / t_c, 3),
                        "compile_s": round(compile_s, 1)}
            del ce
        row = {
            "dtype": name, "batch": args.batch, "new_tokens": args.max_new_tokens,
            "native_tokens_per_s": round(n_tokens / t_native, 1), "native_gemm": lib_native,
            "native_tokens_per_s_by_gemm": {k: round(n_tokens / v, 1) for k, v in by_gemm.items()},
            "hf_generate_tokens_per_s": round(n_tokens / t_hf, 1),
            "native_over_hf": round(t_hf / t_native, 2),
            "native_blas_over_hf": round(t_hf / by_gemm["blas"], 2),  # the same linears as HF's: the engine alone
            "generic_tokens_per_s": round(n_tokens / t_generic, 1),
            "generic_over_hf": round(t_hf / t_generic, 2),
            "engine_path": engine.path,
        }
        prompt_len = sum(len(p) for p in prompts) / len(prompts)
        roof = decode_roofline(engine.model, args.batch, prompt_len, args.max_new_tokens, dtype.itemsize, bw,
                               peak if dtype == torch.float32 else float("nan"))
        if dtype != torch.float32:  # the peak was measured in fp32: only the memory bound applies
            roof = {k: v for k, v in roof.items() if not k.startswith("compute")}
            roof["bound_tokens_per_s"], roof["bound"] = roof["memory_bound_tokens_per_s"], "memory (fp32 peak only)"
        row["roofline"] = {**roof, "roofline_fraction": round(row["native_tokens_per_s"] / roof["bound_tokens_per_s"], 3)}
        gemm.use(lib_native)
        engine = engines.pop(lib_native)  # the faster library's engine
        engines.clear()
        shape = decode_shape_bound(engine, args.batch, prompt_len, args.max_new_tokens, max(3, args.repeats))
        step_ms = 1e3 * t_native / args.max_new_tokens
        row["shape_bound"] = {**shape, "native_ms_per_step": round(step_ms, 4),
                              "fraction": round(row["native_tokens_per_s"] / shape["tokens_per_s"], 3)}
        gemm.use("blas")
        if compiled is not None:
            compiled["roofline_fraction"] = round(compiled["tokens_per_s"] / roof["bound_tokens_per_s"], 3)
            row["native_compiled"] = compiled
        if args.vllm:
            v = make_engine("vllm", model_dir, dtype, seed=0)
            v.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
            t_v = best_of(lambda: v.generate(prompts, params), args.repeats)
            row.update({"vllm_tokens_per_s": round(n_tokens / t_v, 1), "vllm_over_hf": round(t_hf / t_v, 2)})
            del v
        results.append(row)
    update = update_flops(model_dir, args.batch, args.max_new_tokens, args.update_steps, peak) \
        if args.update_steps else None
    update_c = update_flops(model_dir, args.batch, args.max_new_tokens, args.update_steps + 1, peak, "learner") \
        if args.update_steps and args.compile else None
    print(json.dumps({"benchmark": "rollout_throughput", "model": str(model_dir), "cpu": cpu_model(),
                      "threads": torch.get_num_threads(), "allocator_keeps_freed_buffers": kept,
                      "machine": {"memory_bandwidth_gb_s": round(bw / 1e9, 2), "fp32_matmul_gflop_s": round(peak / 1e9, 1),
                                  "fp32_matmul_gflop_s_by_gemm": {k: round(v / 1e9, 1) for k, v in peaks.items()},
                                  "bandwidth_copy_mib": args.bandwidth_mib, "matmul_size": args.matmul_size},
                      "results": results, **({"update_fp32": update} if update else {}),
                      **({"update_fp32_compiled": update_c} if update_c else {})}, indent=2))


if __name__ == "__main__":
    main()
