"""Cost of the gradient-noise telemetry: the same run with ``train.grad_noise`` on and off.

Two trainers with the same seed and micro-batching, stepped alternately in this one
run (so machine noise hits both alike); the first step of each is a warm-up.
Prints JSON with the step-time ratio on/off.

    python benchmarks/grad_noise_overhead.py [--steps 8] [--precision fp32] [--micro 16]
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
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--model", default="builtin:tiny")
    args = ap.parse_args()
    base = [f"model={args.model}", f"precision={args.precision}", "rollout.max_new_tokens=32",
            "train.prompts_per_step=16", "rollout.n=8", "train.mini_batches=2",
            f"train.micro_batch_size={args.micro}", "train.lr=1e-5", "log.console=false",
            "log.tensorboard=false"]
    with tempfile.TemporaryDirectory() as d:
        on = Trainer(load_config(None, base + ["train.grad_noise=true"]), f"{d}/on", log=lambda m: None)
        off = Trainer(load_config(None, base + ["train.grad_noise=false"]), f"{d}/off", log=lambda m: None)
        rows = {"on": [], "off": []}
        for _ in range(args.steps + 1):
            rows["on"].append(on.train_step())
            rows["off"].append(off.train_step())
    res = {}
    for k, rs in rows.items():
        rs = rs[1:]
        res[k] = {"step_s": statistics.mean(r["time/step_s"] for r in rs),
                  "update_s": statistics.mean(r["time/update_s"] for r in rs)}
    print(json.dumps({
        "benchmark": "grad_noise_overhead", "precision": args.precision, "micro_batch_size": args.micro,
        "steps": args.steps, "on": res["on"], "off": res["off"],
        "step_time_on_over_off": round(res["on"]["step_s"] / res["off"]["step_s"], 3),
        "update_time_on_over_off": round(res["on"]["update_s"] / res["off"]["update_s"], 3),
        "noise_scale_ema_last": rows["on"][-1].get("grad_noise/noise_scale_ema"),
    }, indent=2))


if __name__ == "__main__":
    main()
