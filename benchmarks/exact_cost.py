"""What exact mode costs: rollout tokens/s and the learner's forward+backward, exact vs today's.

Same model, prompts and samples; the native engine's fast path against its exact path (one forward
shared with the learner, every row-mixing op on fixed-size blocks of rows, attention over the whole
cache), and the learner's forward+backward (autocast, chunked log-probs) against the exact learner's
(weights cast inside the forward, the engine's layout), for each block size in ``--blocks`` (rows of the
token-wise ops x query rows of attention x rows of the output layer, 64 if not given). Measured alternately in this one run (best of
``--repeats``); prints JSON with the ratios ``exact / today`` of time (goal: rollout ≤ 1.3, update ≤ 1.2).

    python benchmarks/exact_cost.py [--model builtin:tiny] [--dtypes fp32,bf16] [--batch 32] [--tokens 128]
                                    [--blocks 16x4x64,32x8x64,8x2x8,64x16x64]
"""

from __future__ import annotations

import argparse
import json

import torch

from unison.batch import collate
from unison.learner import Learner
from unison.models import resolve_model_dir
from unison.precision import DTYPES
from unison.rollout import SamplingParams, make_engine
from unison.sides import Side
from unison.policy import ScoringOptions

from rollout_throughput import best_of  # noqa: E402 - a sibling script (python benchmarks/exact_cost.py)

TEXTS = ["12+35=", "Once upon a time", "def add(a, b):\n", "Let n be a positive integer."]


def fwd_bwd(learner, batch):
    learner.model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logp, _ = learner._forward(batch, torch.arange(batch.size), return_entropy=True)
        (-(logp * batch.response_mask).sum()).backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--blocks", default="16x4x64,32x8x64,8x2x8,64x16x64")
    args = ap.parse_args()
    from unison.exact import ExactOps

    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
    model_dir = resolve_model_dir(args.model)
    rows = []
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        today = make_engine("native", model_dir, dt)
        tok = today.tokenizer
        prompts = [tok(TEXTS[i % len(TEXTS)])["input_ids"] for i in range(args.batch // 4)]
        width = max(len(p) for p in prompts)
        exact = make_engine("native", model_dir, Side(dtype=dt, exact=True), prompt_width=width)
        params = SamplingParams(n=4, max_tokens=args.tokens, seed=0, ignore_eos=True)
        n_tok = len(prompts) * 4 * args.tokens
        comps = today.generate(prompts, params)
        l_today = Learner(model_dir, Side(dtype=dt), ScoringOptions(micro_batch_size=args.batch))
        l_exact = Learner(model_dir, Side(dtype=dt, exact=True), ScoringOptions(micro_batch_size=args.batch))
        b_today = collate(comps, today.pad_id)
        b_exact = collate(comps, today.pad_id, layout=(width, width + args.tokens))
        for b in blocks:
            ops = exact.exact.ops = l_exact.exact.ops = ExactOps(*b)
            for e in (today, exact):
                e.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
            fwd_bwd(l_today, b_today)
            fwd_bwd(l_exact, b_exact)
            t_today, t_exact, u_today, u_exact = [], [], [], []
            for _ in range(args.repeats):  # alternate, so machine noise hits both
                t_today.append(best_of(lambda: today.generate(prompts, params), 1))
                t_exact.append(best_of(lambda: exact.generate(prompts, params), 1))
                u_today.append(best_of(lambda: fwd_bwd(l_today, b_today), 1))
                u_exact.append(best_of(lambda: fwd_bwd(l_exact, b_exact), 1))
            rows.append({"dtype": name, "block": ops.block, "attn_block": ops.attn_block,
                         "head_block": ops.head_block, "responses": len(comps),
                         "new_tokens": args.tokens,
                         "rollout_tokens_per_s_today": round(n_tok / min(t_today), 1),
                         "rollout_tokens_per_s_exact": round(n_tok / min(t_exact), 1),
                         "rollout_time_exact_over_today": round(min(t_exact) / min(t_today), 2),
                         "update_s_today": round(min(u_today), 3), "update_s_exact": round(min(u_exact), 3),
                         "update_time_exact_over_today": round(min(u_exact) / min(u_today), 2)})
    print(json.dumps({"benchmark": "exact_cost", "model": str(model_dir), "threads": torch.get_num_threads(),
                      "results": rows}, indent=2))


if __name__ == "__main__":
    main()
