"""One forward fewer when on-policy: a separate score pass vs log π_old from the training forward.

With one mini-batch per rollout (θ = θ_old during the only optimizer step), the
no-grad score pass recomputes what the training forward computes; with
``train.fuse_score_pass`` (the default) the learner takes log π_old and the
mismatch from the detached training forward. Two trainers, same seed and config
but that switch, stepped alternately in this one run (machine noise hits both
alike); the first step of each is a warm-up. Prints JSON with the step-time ratio.

    python benchmarks/score_pass_fusion.py [--steps 6] [--precision fp32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from unison.config import load_config
from unison.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="builtin:tiny")
    args = ap.parse_args()
    base = [f"model={args.model}", f"precision={args.precision}", f"rollout.max_new_tokens={args.tokens}",
            "train.prompts_per_step=16", "rollout.n=8", "train.mini_batches=1", "train.micro_batch_size=32",
            "train.lr=1e-5", "log.console=false", "log.tensorboard=false"]
    with tempfile.TemporaryDirectory() as d:
        fused = Trainer(load_config(None, base + ["train.fuse_score_pass=true"]), f"{d}/fused", log=lambda m: None)
        sep = Trainer(load_config(None, base + ["train.fuse_score_pass=false"]), f"{d}/sep", log=lambda m: None)
        rows = {"fused": [], "separate": []}
        for _ in range(args.steps + 1):
            rows["fused"].append(fused.train_step())
            rows["separate"].append(sep.train_step())
    res = {}
    for k, rs in rows.items():
        rs = rs[1:]
        res[k] = {key: statistics.median(r[f"time/{key}"] for r in rs) for key in ("step_s", "score_s", "update_s")}
        res[k]["k3_mean"] = statistics.mean(r["mismatch/k3"] for r in rs)
    same = [a["reward/mean"] == b["reward/mean"] for a, b in zip(rows["fused"], rows["separate"])]
    print(json.dumps({
        "benchmark": "score_pass_fusion", "precision": args.precision, "max_new_tokens": args.tokens,
        "steps": args.steps, "fused": res["fused"], "separate": res["separate"],
        "step_time_fused_over_separate": round(res["fused"]["step_s"] / res["separate"]["step_s"], 3),
        "learner_time_fused_over_separate": round(
            (res["fused"]["score_s"] + res["fused"]["update_s"])
            / (res["separate"]["score_s"] + res["separate"]["update_s"]), 3),
        "same_rewards_every_step": all(same),
    }, indent=2))


if __name__ == "__main__":
    main()
