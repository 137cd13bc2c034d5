"""The deploy gap of every int4 arm of experiments/cures (issue 27): each seed's final fp32 masters sampled by
two engines over the same weights — fp32 (π, what the learner optimises) and int4 (μ, what the run measured
and what a quantized deployment serves) — on the 64 perfectible prompts, 8 samples each; plus the SFT start.

    python experiments/cures/deploy_gap.py runs/cures [--k 8] [--step 60]

Resumable: rows already in ``runs/cures/deploy_gap.json`` are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quantized_rollout"))

from deploy_gap import accuracy  # noqa: E402 - experiments/quantized_rollout/deploy_gap.py

from unison.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--step", type=int, default=60)
    a = ap.parse_args()
    path = a.root / "deploy_gap.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    done = {(r["arm"], r["seed"], r["engine"]) for r in rows}

    def add(arm, seed, engine, model, cfg):
        if (arm, seed, engine) in done:
            return
        rows.append({"arm": arm, "seed": seed, "engine": engine, "acc": accuracy(model, cfg, engine, a.k)})
        print(json.dumps(rows[-1]), flush=True)
        path.write_text(json.dumps(rows, indent=1))

    first = sorted((a.root / "q-none-grpo" / "arms").iterdir())[0]
    cfg0 = load_config(first / "config.yaml")
    for q in ("none", "int4"):
        add("SFT start", None, q, Path(cfg0.model), cfg0)
    arms = ["q-none-grpo"] + sorted(p.name for p in a.root.glob("q-int4-*"))
    for arm in arms:
        for run in sorted((a.root / arm / "arms").glob("*-s*")):
            model = run / "checkpoints" / f"step_{a.step:06d}" / "model"
            if not model.exists():
                print(f"skip {run}: no checkpoint at step {a.step}", file=sys.stderr)
                continue
            cfg = load_config(run / "config.yaml")
            seed = int(run.name.rsplit("-s", 1)[1])
            for q in ("none", "int4"):
                add(arm, seed, q, model, cfg)


if __name__ == "__main__":
    main()
