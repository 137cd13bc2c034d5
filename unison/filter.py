"""``unison filter``: keep the prompts a model is neither hopeless nor perfect on.

Paper A's sanity test trains on a "perfectible" set: the starting model's
pass rate over k samples lies in a band (default strictly between 0 and 1;
the paper does not publish its exact rule). A sound RL run must then drive
the training accuracy towards 100%.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from unison import runtime
from unison.data_io import atomic_write_text
from unison.errors import UnisonError
from unison.models import load_tokenizer, resolve_model_dir
from unison.precision import Precision
from unison.rollout import SamplingParams
from unison.rollout import check_engine_available, make_engine
from unison.rollout import generate
from unison.tasks import make_reward, make_task


def parse_band(text: str | None) -> tuple[float, float] | None:
    """``"lo,hi"`` -> inclusive band; ``None`` -> the default open band (0, 1)."""
    if text is None:
        return None
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError as e:
        raise UnisonError(f"--band '{text}' is not lo,hi: write e.g. --band 0.2,0.8") from e
    if not 0.0 <= lo <= hi <= 1.0:
        raise UnisonError(f"--band '{text}' must satisfy 0 <= lo <= hi <= 1")
    return lo, hi


def in_band(rate: float, band: tuple[float, float] | None) -> bool:
    if band is None:
        return 0.0 < rate < 1.0
    return band[0] <= rate <= band[1]


def pass_rates(engine, task, reward, items, tokenizer, k: int, temperature: float, max_new_tokens: int,
               seed: int, chunk: int = 256) -> list[float]:
    """Fraction of ``k`` samples per item that the verifier accepts."""
    rates = []
    params = SamplingParams(n=k, temperature=temperature, max_tokens=max_new_tokens, seed=seed)
    for s in range(0, len(items), chunk):
        part = items[s:s + chunk]
        if task.multi_turn:  # episodes, turn by turn
            task.prepare(tokenizer)
            prompts = task.episodes(part)
        else:
            prompts = [task.encode(tokenizer, it) for it in part]
        comps = generate(engine, prompts, SamplingParams(**{**params.__dict__, "seed": seed + s}))
        wins = [0.0] * len(part)
        for c, r in zip(comps, reward.score_completions(comps, part, tokenizer)):
            wins[c.prompt_index] += r
        rates += [w / k for w in wins]
    return rates


def run_filter(cfg, out_file: Path, k: int = 8, band: tuple[float, float] | None = None,
               max_prompts: int | None = None, log=print) -> dict:
    """Sample ``k`` responses per training prompt of ``cfg.task`` with ``cfg.model``; write
    the prompts whose pass rate is in ``band`` as JSONL (``prompt``, ``answer``, ``pass_rate``)."""
    if k < 1:
        raise UnisonError(f"--k {k} is invalid: sample at least one response per prompt")
    model_dir = resolve_model_dir(cfg.model)
    task = make_task(cfg.task, evaluate=False)
    reward = make_reward(task, cfg.task)
    prec = Precision.resolve(cfg.precision, cfg.rollout_precision, cfg.learner_precision)
    check_engine_available(cfg.engine, cfg.vllm.mode)
    tokenizer = load_tokenizer(model_dir)
    runtime.setup(cfg.threads, cfg.gemm, model_dir, device=cfg.device,  # after the checks, before the engine loads
                  fp32=prec.rollout_dtype == torch.float32, log=lambda m: log(f"[filter] {m}"))
    engine = make_engine(cfg.engine, model_dir, prec.rollout_dtype, device=cfg.device, seed=cfg.seed,
                         **cfg.vllm.model_dump())
    torch.manual_seed(cfg.seed)
    log(f"[filter] sampling {k} responses for each of {len(task.train)} prompts")
    rates = pass_rates(engine, task, reward, task.train, tokenizer, k, cfg.rollout.temperature,
                       cfg.rollout.max_new_tokens, cfg.seed)
    kept = [(it, r) for it, r in zip(task.train, rates) if in_band(r, band)]
    if max_prompts is not None:
        kept = kept[:max_prompts]
    if not kept:
        raise UnisonError(f"no prompt has a pass rate in the band ({_band_text(band)}): widen --band, "
                          f"raise --k, or start from a different model")
    rows = [{"prompt": it.prompt, "answer": it.answer, "pass_rate": r} for it, r in kept]
    atomic_write_text(out_file, "".join(json.dumps(r) + "\n" for r in rows))
    summary = {"prompts_seen": len(task.train), "kept": len(rows), "k": k, "band": _band_text(band),
               "mean_pass_rate_all": sum(rates) / len(rates),
               "mean_pass_rate_kept": sum(r for _, r in kept) / len(kept)}
    log(f"[filter] kept {len(rows)} of {len(task.train)} prompts (band {summary['band']}, "
        f"mean pass rate {summary['mean_pass_rate_kept']:.3f}) -> {out_file}")
    return summary


def _band_text(band) -> str:
    return "0 < p < 1" if band is None else f"{band[0]} <= p <= {band[1]}"
