"""Where the time of one RL step goes: proportions per phase and per op, from torch.profiler.

Runs ``--warmup`` steps of ``unison train`` (SmolLM2-135M by default, fp32, the probe's 8 short chat
prompts × 4 samples × 128 new tokens, a length reward: issue 32's shape), then one step under
``torch.profiler`` with the rollout (``engine.generate``), the score pass and the update
(``learner.train``) annotated. Prints JSON: each phase's share of the step, and within each phase
the ops with the largest share of its time (self time: the op itself, not what it calls) and the
share no op accounts for (``outside ops``: Python, the framework and waiting between ops). Shares, not
seconds, are the point: on a loaded machine every op stretches, and the proportions move much less
than the times (still, run it where nothing else runs when the figures matter).

    python benchmarks/profile_step.py [--model builtin:smollm2] [--batch 8x4] [--max-new-tokens 128] [--top 15]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "score", "update")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--batch", default="8x4", help="prompts x samples per prompt (at most 8 prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", default="auto", help="the run's threads setting")
    ap.add_argument("--warmup", type=int, default=1, help="steps before the profiled one")
    ap.add_argument("--top", type=int, default=15, help="ops listed per phase")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = ap.parse_args()
    prompts, n = (int(x) for x in args.batch.split("x"))

    from unison.config import load_config
    from unison.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="unison-profile-"))
    (work / "length_reward.py").write_text("def reward(response, item=None):\n    return min(len(response), 100) / 100\n")
    sets = [f"model={args.model}", "precision=fp32", "task.name=jsonl", f"task.path={ROOT / 'unison/data/prompts.jsonl'}",
            f"task.reward={work / 'length_reward.py'}:reward", "task.truncated_reward=null",
            f"train.prompts_per_step={prompts}", f"rollout.n={n}", f"rollout.max_new_tokens={args.max_new_tokens}",
            "train.lr=1e-6", f"train.steps={args.warmup + 1}", "log.console=false", "log.tensorboard=false",
            "checkpoint.every_minutes=0", f"threads={args.threads}", *args.set]
    t = Trainer(load_config(None, sets), work / "run", log=lambda m: None)
    for _ in range(args.warmup):
        t.train_step()

    def annotate(obj, name, label):
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            with torch.profiler.record_function(f"phase:{label}"):
                return fn(*a, **k)
        setattr(obj, name, wrapped)

    annotate(t.engine, "generate", "rollout")
    annotate(t.learner, "score", "score")
    annotate(t.learner, "train", "update")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m = t.train_step()
    step_s = m["time/step_s"]  # the step itself, not the profiler's own start and stop
    t.source.close()

    events = prof.events()
    span = defaultdict(float)        # phase -> its wall time (µs)
    self_by = defaultdict(lambda: defaultdict(float))  # phase -> op -> self time (µs)
    for e in events:
        phase, p = None, e
        while p is not None:
            if p.name.startswith("phase:"):
                phase = p.name.split(":", 1)[1]
                break
            p = p.cpu_parent
        if e.name.startswith("phase:"):
            span[e.name.split(":", 1)[1]] += e.cpu_time_total
            continue
        self_by[phase or "other"][e.name] += e.self_cpu_time_total
    total_us = step_s * 1e6
    span["other"] = max(total_us - sum(span[p] for p in PHASES), 0.0)
    phases = {}
    for ph in (*PHASES, "other"):
        if not span.get(ph):
            continue
        ops = self_by[ph]
        in_ops = sum(ops.values())
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]
        phases[ph] = {"share_of_step": round(span[ph] / total_us, 3), "seconds": round(span[ph] / 1e6, 2),
                      "outside_ops_share": round(max(span[ph] - in_ops, 0.0) / span[ph], 3),
                      "top_ops": {name: round(us / span[ph], 3) for name, us in top}}
    print(json.dumps({"benchmark": "profile_step", "model": args.model, "batch": args.batch,
                      "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                      "step_s": round(step_s, 2), "response_length_mean": round(m["response_length/mean"], 1),
                      "phases": phases,
                      "metrics_s": {k: round(v, 2) for k, v in m.items() if k.startswith("time/")
                                    and isinstance(v, float)}}, indent=2))


if __name__ == "__main__":
    main()
