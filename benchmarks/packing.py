"""Micro-batches by tokens (and packed) against padded micro-batches: the learner's update on one rollout.

One rollout of real lengths (``--model``, default builtin:smollm2: 8 math prompts with the chat template
x 4 samples, up to 128 new tokens, fp32), then the same update — one optimizer step, the fused score pass —
in a fresh process per variant, so that each peak RSS is its own:

* ``padded``: the default before ``train.micro_batch_tokens``: ``micro_batch_size`` rows (32) at the
  whole batch's width (on a 23 GiB machine it is killed for memory: reported as such);
* ``padded_8``: the same with 8 rows per micro-batch, the padded setting that fits;
* ``budget``: ``train.micro_batch_tokens`` (4096): rows grouped by length, each micro-batch cut to its own
  longest row;
* ``packed``: the same micro-batches with ``train.packing``: responses back to back in one row, one
  causal attention call per response;
* ``budget_512`` / ``packed_512``: the same at the default budget (512 tokens).

Prints JSON: padded-token fraction (positions computed that are padding), update seconds (best of
``--repeats``), peak RSS, and each variant's ratios to ``padded`` (goal: update time and peak memory −30%).

    python benchmarks/packing.py [--model builtin:smollm2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"padded": ["train.micro_batch_tokens=null"],
            "padded_8": ["train.micro_batch_tokens=null", "train.micro_batch_size=8"],
            "budget": ["train.micro_batch_tokens=4096"],
            "packed": ["train.micro_batch_tokens=4096", "train.packing=true"],
            "budget_512": ["train.micro_batch_tokens=512"],
            "packed_512": ["train.micro_batch_tokens=512", "train.packing=true"]}

ONE = """
import json, resource, sys, time, torch
from unison.algorithms.anchors import OldLogp
from unison.batch import Completion, collate
from unison.config import load_config
from unison.learner import Learner
from unison.models import load_tokenizer, resolve_model_dir
rollout, repeats, sets = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = json.load(open(rollout))
cfg = load_config(None, sets)
learner = Learner.from_config(cfg, resolve_model_dir(cfg.model))
comps = [Completion(prompt_ids=r["p"], token_ids=r["t"], logprobs=r["l"], finish_reason="length") for r in rows]
batch = collate(comps, load_tokenizer(learner.model_dir).pad_token_id)
batch.rewards = torch.tensor([len(r["t"]) / 128 for r in rows])
batch.advantages = batch.rewards - batch.rewards.mean()
shares = learner._shares(torch.arange(batch.size), batch)[0]
real = int(batch.attention_mask.sum())
computed = sum(len(g) * learner._width(batch, g) for g in shares)
if learner.packing:
    computed = real
ones = lambda o, mu, m: m
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    learner.train(batch, OldLogp("fused"), ones, 1e-7)
    times.append(time.perf_counter() - t0)
print(json.dumps({"update_s": min(times), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "padded_fraction": 1 - real / computed, "micro_batches": len(shares), "rows": batch.size,
                  "tokens": real}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import torch

    from unison.models import resolve_model_dir
    from unison.rollout import SamplingParams, make_engine
    from unison.tasks import make_task
    from unison.config import TaskConfig

    model_dir = resolve_model_dir(args.model)
    engine = make_engine("native", model_dir, torch.float32)
    task = make_task(TaskConfig(name="math", path="builtin:sanity_math", eval_size=0))
    prompts = [task.encode(engine.tokenizer, it) for it in task.train[:8]]
    comps = engine.generate(prompts, SamplingParams(n=4, max_tokens=128, seed=0))
    del engine
    work = Path(tempfile.mkdtemp(prefix="unison-packing-"))
    rollout = work / "rollout.json"
    rollout.write_text(json.dumps([{"p": c.prompt_ids, "t": c.token_ids, "l": c.logprobs} for c in comps]))
    lengths = sorted(len(c.prompt_ids) + len(c.token_ids) for c in comps)
    base = [f"model={args.model}", "precision=fp32", "train.micro_batch_size=32", "train.grad_noise=false"]
    out = {}
    for name, sets in VARIANTS.items():
        p = subprocess.run([sys.executable, "-c", ONE, str(rollout), str(args.repeats), *base, *sets],
                           capture_output=True, text=True, timeout=3600, env=dict(os.environ))
        if p.returncode < 0:  # killed: on a small machine the padded variant can run out of memory
            out[name] = {"failed": f"killed by signal {-p.returncode} (9: most likely out of memory)"}
            continue
        if p.returncode:
            raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    for base_name in ("padded", "padded_8"):
        if "failed" in out[base_name]:
            continue
        for name in ("budget", "packed", "budget_512", "packed_512"):
            if "failed" not in out[name]:
                out[f"{name}_over_{base_name}"] = {
                    "update_time": round(out[name]["update_s"] / out[base_name]["update_s"], 2),
                    "peak_rss": round(out[name]["peak_rss_gib"] / out[base_name]["peak_rss_gib"], 2)}
    print(json.dumps({"benchmark": "packing", "model": str(model_dir), "threads": torch.get_num_threads(),
                      "sequence_lengths": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
                      **out}, indent=2))


if __name__ == "__main__":
    main()
