"""Step time of every algorithm preset relative to ``grpo``, and the share of a step
spent on corrections + mismatch telemetry (``time/telemetry_s``).

Same model, task, seed and batch for every preset, all measured in this one run;
the first step of each is a warm-up and is not counted. Prints JSON.

    python benchmarks/preset_step_time.py [--steps 6] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from unison.algorithms.presets import PRESETS
from unison.config import load_config
from unison.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args()
    out = []
    for algo in PRESETS:
        cfg = load_config(None, [f"algo={algo}", f"model={args.model}", f"precision={args.precision}",
                                 "rollout.max_new_tokens=32", "train.prompts_per_step=16", "rollout.n=8",
                                 "train.mini_batches=2", "train.micro_batch_size=64", "train.lr=1e-5",
                                 "log.console=false", "log.tensorboard=false"])
        with tempfile.TemporaryDirectory() as d:
            t = Trainer(cfg, d, log=lambda m: None)
            rows = [t.train_step() for _ in range(args.steps + 1)][1:]
        step = statistics.mean(r["time/step_s"] for r in rows)
        tele = statistics.mean(r["time/telemetry_s"] for r in rows)
        out.append({"algo": algo, "step_s": round(step, 4), "telemetry_s": round(tele, 5),
                    "telemetry_share": round(tele / step, 4)})
    base = next(r["step_s"] for r in out if r["algo"] == "grpo")
    for r in out:
        r["step_time_vs_grpo"] = round(r["step_s"] / base, 3)
    print(json.dumps({"benchmark": "preset_step_time", "precision": args.precision, "steps": args.steps,
                      "results": out}, indent=2))


if __name__ == "__main__":
    main()
