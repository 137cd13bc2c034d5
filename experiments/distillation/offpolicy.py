"""Off-policy distillation, the control arm of run_lift.sh: the student trained by SFT on the teacher's own samples.

    python experiments/distillation/offpolicy.py CONFIG --student DIR --teacher DIR --out RUN_DIR --seed S [--set k=v]

Each step draws ``train.prompts_per_step`` prompts of the task's training split, samples ``rollout.n`` responses per
prompt from the **teacher** (its native engine, fp32, at the rollout's temperature) and takes one AdamW step of
the student (``train.lr``, ``train.betas``, ``train.eps``, ``train.weight_decay``, gradient clip ``train.grad_clip``,
as the RL arms' learner) on the token mean of −log π_student(y) over those responses — sequence-level knowledge
distillation (Kim & Rush 2016), the off-policy counterpart of OPD. Same student, LR, batch size and number of
updates as the RL arms. So that its curves compare with theirs, every step also samples ``rollout.n`` responses per
prompt from the **student** (its engine synced after each update, as an RL run's) and logs, as the RL arms do:

* ``reward/mean`` — the task's reward of the student's own samples (the RL arms' training reward);
* ``distill/reverse_kl_pi`` — mean over the student's sampled tokens of log π_student − log π_teacher (the
  per-token reverse-KL estimate OPD logs).

Writes RUN_DIR/metrics.jsonl (one line per step) and summary.json. Uses unison's own pieces (task, reward,
engines, learner, optimizer); nothing here is part of unison's CLI.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from unison.batch import collate  # noqa: E402
from unison.config import load_config  # noqa: E402
from unison.learner import Learner  # noqa: E402
from unison.models import load_tokenizer  # noqa: E402
from unison.logprobs import token_logprobs  # noqa: E402
from unison.policy import Scorer, ScoringOptions  # noqa: E402
from unison.rollout import SamplingParams, make_engine  # noqa: E402
from unison.rollout.sync import push  # noqa: E402
from unison.tasks import make_reward, make_task  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("--student", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args(argv)
    cfg = load_config(a.config, [*a.set, f"seed={a.seed}", f"model={a.student}"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    task = make_task(cfg.task, evaluate=False)
    reward = make_reward(task, cfg.task)
    tok = load_tokenizer(Path(a.student))
    prompts = [task.encode(tok, it) for it in task.train]
    learner = Learner.from_config(cfg, a.student)
    teacher_engine = make_engine("native", a.teacher, torch.float32, seed=cfg.seed)
    student_engine = make_engine("native", a.student, torch.float32, seed=cfg.seed)
    teacher = Scorer(a.teacher, options=ScoringOptions(temperature=cfg.rollout.temperature))
    t, r = cfg.train, cfg.rollout
    rng = random.Random(cfg.seed)
    rows = []
    t0 = time.perf_counter()
    with (out / "metrics.jsonl").open("w") as f:
        for step in range(t.steps):
            idx = rng.sample(range(len(prompts)), t.prompts_per_step)
            ids = [prompts[i] for i in idx]
            # the student's own samples: what an RL arm trains on and logs
            own = student_engine.generate(ids, SamplingParams(n=r.n, max_tokens=r.max_new_tokens,
                                                              temperature=r.temperature, seed=2 * step + 1))
            items = [task.train[i] for i in idx]
            rewards = reward.score_completions(own, items, tok)
            sb = collate(own, student_engine.pad_id)
            m = sb.response_mask
            with torch.no_grad():
                rk = float(((learner.score(sb) - teacher.score(sb)) * m).sum() / m.sum().clamp(min=1))
            # the teacher's samples: what this arm trains on
            theirs = teacher_engine.generate(ids, SamplingParams(n=r.n, max_tokens=r.max_new_tokens,
                                                                 temperature=r.temperature, seed=2 * step))
            tb = collate(theirs, teacher_engine.pad_id)
            for g in learner.opt.param_groups:
                g["lr"] = t.lr
            learner.opt.zero_grad(set_to_none=True)
            logp = token_logprobs(learner.forward_module, tb.tokens, tb.attention_mask, r.temperature,
                                  positions=tb.response_mask, chunk=t.logprob_chunk)
            loss = -(logp * tb.response_mask).sum() / tb.response_mask.sum().clamp(min=1)
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(learner.params, t.grad_clip))
            learner.opt.step()
            push(student_engine, learner)
            row = {"step": step + 1, "reward/mean": sum(rewards) / len(rewards), "distill/reverse_kl_pi": rk,
                   "sft/loss": float(loss), "optim/grad_norm": gn, "optim/lr": t.lr,
                   "response_length/mean": float(sb.response_lens.float().mean()),
                   "time/step_s": time.perf_counter() - t0}
            t0 = time.perf_counter()
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
    last = rows[-5:]
    (out / "summary.json").write_text(json.dumps({
        "steps": t.steps, "algo": "sft_on_teacher_samples", "reward_first": rows[0]["reward/mean"],
        "reward_last": rows[-1]["reward/mean"], "reward_last5_mean": sum(x["reward/mean"] for x in last) / len(last),
        "final": rows[-1]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
