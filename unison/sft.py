"""``unison sft``: supervised warm start on task demonstrations (prompt -> answer + EOS).

A random model earns no reward; RL needs a start that is right sometimes.
Trains the learner in fp32 with cross-entropy on the answer tokens only,
then measures accuracy on the eval split with the rollout engine (sampled at
the rollout temperature, and greedy) and saves an HF directory.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from unison import runtime
from unison.errors import UnisonError
from unison.filter import pass_rates
from unison.logprobs import token_logprobs
from unison.models import load_model, load_tokenizer, resolve_model_dir, save_model_dir, unknown_characters
from unison.optim import adamw
from unison.rollout import make_engine
from unison.schedules import LRSchedule
from unison.tasks import make_reward, make_task


def _examples(task, tokenizer):
    """``(ids, target mask)`` per training item: prompt -> answer + EOS (loss on the answer), or a
    multi-turn demonstration (loss on the model's turns only, built token in / token out)."""
    if task.multi_turn:
        out = [task.demonstration_ids(tokenizer, item) for item in task.train]
        if any(x is None for x in out):
            raise UnisonError(f"environment {task.env} has no demonstration(item) for unison sft: add a static "
                              f"method that returns the turns after reset (unison/tasks/env.py)")
        return out
    eos = tokenizer.eos_token_id
    out = []
    for item in task.train:
        p = task.encode(tokenizer, item)
        a = list(tokenizer(task.demonstration(item), add_special_tokens=False)["input_ids"]) + [eos]
        out.append((p + a, [0] * len(p) + [1] * len(a)))
    return out


def _batch(examples, pad_id):
    L = max(len(ids) for ids, _ in examples)
    tokens = torch.full((len(examples), L), pad_id, dtype=torch.long)
    attn = torch.zeros_like(tokens)
    target = torch.zeros(tokens.shape)
    for i, (ids, mask) in enumerate(examples):
        tokens[i, :len(ids)] = torch.tensor(ids)
        attn[i, :len(ids)] = 1
        target[i, :len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return tokens, attn, target


def evaluate(engine, task, reward, items, tokenizer, temperature: float, max_new_tokens: int,
             seed: int = 0) -> float:
    """Fraction of ``items`` answered correctly (one sample each; temperature 0 = greedy)."""
    if not items:
        return float("nan")
    rates = pass_rates(engine, task, reward, items, tokenizer, 1, temperature, max_new_tokens, seed)
    return sum(rates) / len(rates)


def sft_eval(cfg, engine, task=None, reward=None, tokenizer=None, train: bool = True) -> dict:
    """A warm start's accuracy: on the task's eval set sampled (the rollout temperature, the config's seed) and
    greedy, and (``train``) on as many training prompts sampled (the numbers ``sft.json`` holds)."""
    task = task if task is not None else make_task(cfg.task)
    reward = reward if reward is not None else make_reward(task, cfg.task)
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    mnt, temp = cfg.rollout.max_new_tokens, cfg.rollout.temperature
    return {"eval_accuracy_sampled": evaluate(engine, task, reward, task.eval, tokenizer, temp, mnt, cfg.seed),
            "eval_accuracy_greedy": evaluate(engine, task, reward, task.eval, tokenizer, 0.0, mnt),
            **({"train_accuracy_sampled": evaluate(engine, task, reward, task.train[:len(task.eval) or 200],
                                                   tokenizer, temp, mnt, cfg.seed)} if train else {})}


def run_sft(cfg, out_dir: Path, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model_dir(cfg.model)
    task = make_task(cfg.task)
    reward = make_reward(task, cfg.task)
    tokenizer = load_tokenizer(model_dir)
    runtime.setup(cfg.threads, cfg.gemm, model_dir, device=cfg.device,  # after the checks, before the load
                  log=lambda m: log(f"[sft] {m}"))
    if task.multi_turn:
        task.prepare(tokenizer, cfg.model)
    model = load_model(model_dir, torch.float32, cfg.device)
    model.train()
    examples = _examples(task, tokenizer)
    unknown = unknown_characters(tokenizer, [t for it in task.train for t in (it.prompt, task.demonstration(it))],
                                 [x for p, a in examples for x in (p, a)], "prompts and answers")
    if unknown:
        log(f"[sft] WARNING {unknown}")
    rng = random.Random(cfg.seed)
    opt = adamw(list(model.parameters()), not runtime.small_model(model), lr=cfg.sft.lr, betas=(0.9, 0.95), weight_decay=0.0)
    s = cfg.sft
    schedule = LRSchedule("cosine", s.lr, s.steps, min_lr_ratio=s.min_lr_ratio)
    t0 = time.perf_counter()
    for step in range(s.steps):
        lr = schedule.lr(step + 1)
        for g in opt.param_groups:
            g["lr"] = lr
        tokens, attn, target = _batch(rng.sample(examples, min(s.batch_size, len(examples))),
                                      tokenizer.pad_token_id)
        logp = token_logprobs(model, tokens, attn, device=cfg.device)
        loss = -(logp * target.to(logp.device)).sum() / target.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == s.steps - 1:
            log(f"[sft] step {step + 1}/{s.steps} loss {loss.item():.4f} lr {lr:.2e} "
                f"({time.perf_counter() - t0:.0f}s)")
    model.eval()
    # the warm start is judged with the built-in sampler whatever the RL engine (no vLLM start-up)
    engine = make_engine("native", model_dir, torch.float32, device=cfg.device)
    engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
    summary = {"final_loss": float(loss.item()), **sft_eval(cfg, engine, task, reward, tokenizer),
               "temperature": cfg.rollout.temperature, "steps": s.steps,
               "wall_s": time.perf_counter() - t0}
    save_model_dir(model, tokenizer, out_dir / "model")
    (out_dir / "sft.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
