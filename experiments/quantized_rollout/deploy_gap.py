"""Is the learner worse after an int4-rollout run, or only its int4 copy? (issue 19)

The training accuracy of the sanity test is measured on the rollout engine's samples, so under int4
rollout it is the accuracy of the *quantized* policy. This script re-scores checkpoints of the grid on
the same 64 perfectible prompts with two engines over the same fp32 weights: fp32 sampling (π, what the
learner optimises) and int4 sampling (μ, what the run measured). The SFT warm start is the step-0 row.

    python experiments/quantized_rollout/deploy_gap.py runs/quantized_rollout [--k 8] [--step 60]

Prints one JSON line per (arm, seed, engine) and a markdown table; writes
``runs/quantized_rollout/deploy_gap.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from unison.config import load_config  # noqa: E402
from unison.filter import pass_rates  # noqa: E402
from unison.models import load_tokenizer  # noqa: E402
from unison.rollout import make_engine  # noqa: E402
from unison.tasks import make_reward, make_task  # noqa: E402

import torch  # noqa: E402
from unison.sides import Side

ARMS = ["grpo", "int4-grpo", "int4-gspo", "int4-grpo_token_tis"]


def accuracy(model_dir: Path, cfg, quantization: str, k: int, seed: int = 1234) -> float:
    task = make_task(cfg.task)
    reward = make_reward(task, cfg.task)
    engine = make_engine("native", model_dir, Side(quantization=quantization))
    torch.manual_seed(seed)
    rates = pass_rates(engine, task, reward, task.train, load_tokenizer(model_dir), k, cfg.rollout.temperature,
                       cfg.rollout.max_new_tokens, seed)
    return sum(rates) / len(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--step", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2")
    a = ap.parse_args()
    grid = a.root / "grid" / "arms"
    rows = []
    cfg0 = load_config(grid / "fp32-grpo-s0" / "config.yaml")
    for q in ("none", "int4"):
        acc = accuracy(Path(cfg0.model), cfg0, q, a.k)
        rows.append({"arm": "SFT start", "seed": None, "engine": q, "acc": acc})
        print(json.dumps(rows[-1]), flush=True)
    for arm in ARMS:
        for s in a.seeds.split(","):
            run = grid / f"fp32-{arm}-s{s}"
            cfg = load_config(run / "config.yaml")
            model = run / "checkpoints" / f"step_{a.step:06d}" / "model"
            for q in ("none", "int4"):
                rows.append({"arm": arm, "seed": int(s), "engine": q, "acc": accuracy(model, cfg, q, a.k)})
                print(json.dumps(rows[-1]), flush=True)
    (a.root / "deploy_gap.json").write_text(json.dumps(rows, indent=1))
    print("\n| checkpoint | fp32 sampling (π) | int4 sampling (μ) |\n| --- | --- | --- |")
    for arm in ["SFT start"] + ARMS:
        cell = []
        for q in ("none", "int4"):
            xs = [r["acc"] for r in rows if r["arm"] == arm and r["engine"] == q]
            cell.append(f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""))
        name = arm if arm == "SFT start" else f"{arm} step {a.step}"
        print(f"| {name} | {cell[0]} | {cell[1]} |")


if __name__ == "__main__":
    main()
