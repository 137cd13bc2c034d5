"""``unison sanity``: Paper A's sanity test end to end.

1. SFT warm start of the model on the task (a random tiny model earns no reward);
2. filter a *perfectible* training set: prompts whose pass rate over k samples
   lies strictly between 0 and 1 (or in ``--band``);
3. the same RL configuration once per precision (and algorithm), same seed;
4. a report comparing the arms: training accuracy must approach 100% in a
   sound run; the mismatch (token k3, |π − μ|) shows what precision did.

Rerunning with the same ``--out`` reuses the SFT model and the filtered set
and resumes unfinished arms.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from unison.config import (Config, config_from_dict, load_config, merge, override_keys, read_yaml,
                           resolve_paths)
from unison.algorithms.presets import PRESETS
from unison.algorithms.presets import resolve_policy
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.filter import run_filter
from unison.models import resolve_model_dir
from unison.precision import parse_precision
from unison.quant import check_format_available, parse_quantization
from unison.report import summarize, write_report
from unison.rollout import check_engine_available
from unison.runlog import plural
from unison.sft import run_sft
from unison.tasks import make_reward, make_task
from unison.trainer import Trainer

#: The built-in sanity recipe (CPU, built-in tiny model, 2-digit addition). Every
#: key can be overridden with --set or a YAML file.
DEFAULTS = [
    "seed=0", "model=builtin:tiny", "engine=native",
    "task.name=arithmetic", "task.digits=2", "task.train_size=2000", "task.eval_size=200",
    "rollout.n=8", "rollout.temperature=1.0", "rollout.max_new_tokens=8",
    "sft.steps=600", "sft.lr=3e-3", "sft.batch_size=64",
    "train.steps=100", "train.lr=2e-4", "train.prompts_per_step=16", "train.mini_batches=2",
    "train.micro_batch_size=64", "checkpoint.every=20", "log.console=false",
]


def sanity_config(path: str | None, overrides: list[str]) -> Config:
    """Built-in defaults, then the YAML file (if any), then ``--set`` overrides."""
    base = load_config(None, DEFAULTS).model_dump(mode="json")
    user = read_yaml(path) if path is not None else {}
    cfg = config_from_dict(merge(base, user), overrides)
    return resolve_paths(cfg, Path(path).resolve().parent if path is not None else None, override_keys(overrides))


def run_sanity(cfg: Config, out: Path, precisions: list[str], algorithms: list[str], k: int = 8,
               band=None, max_prompts: int | None = 32, log=lambda m: print(m, file=sys.stderr, flush=True),
               seeds: list[int] | None = None, quantizations: list[str] | None = None,
               variant: tuple[str, dict] | None = None, report: bool = True):
    """``variant`` = (name suffix, config overrides) applied to every arm of this call (e.g. ``("-qat",
    {"train": {"quantization_aware": True}})``); ``report`` False leaves the comparison report to the
    caller (``unison demo`` writes one over several calls). Returns (summaries, report path or None, arm dirs)."""
    precisions = [parse_arm_precision(p) for p in precisions]
    quantizations = [parse_quantization(q) for q in (quantizations or ["none"])]
    for q in quantizations:
        check_format_available(q)
        if q != "none" and any(p.endswith("-exact") for p in precisions):
            raise UnisonError(f"--quantization {q} with an exact arm: exact mode needs the engine to hold the "
                              f"learner's weights; run exact arms with --quantization none")
    if not precisions:
        raise UnisonError("--precisions is empty: name at least one of fp32, bf16, fp16")
    if not algorithms:
        raise UnisonError(f"--algorithms is empty: name at least one of {', '.join(PRESETS)}")
    for a in algorithms:
        if a not in PRESETS:
            raise UnisonError(f"unknown algorithm '{a}' in --algorithms: choose from {', '.join(PRESETS)}")
    _preflight(cfg, algorithms)  # every input checked before --out is created
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    rl_base, perf, stage_s = warm_start(cfg, out, k=k, band=band, max_prompts=max_prompts, log=log)

    arms = [(p, q, a, s) for a in algorithms for q in quantizations for p in precisions
            for s in (seeds or [cfg.seed])]
    t_rl = time.perf_counter()
    run_steps, step_time = 0, {}  # RL steps run in this session (finished arms are reused, not rerun)
    arm_dirs = []
    for i, (prec, quant, algo, seed) in enumerate(arms, 1):
        suffix, extra = variant or ("", {})
        name = f"{prec}-{'' if quant == 'none' else quant + '-'}{algo}{suffix}" + (f"-s{seed}" if seeds else "")
        run_dir = out / "arms" / name
        arm_dirs.append(run_dir)
        exact = prec.endswith("-exact")
        arm_cfg = config_from_dict(merge(merge(rl_base.model_dump(mode="json"),
                                               {"precision": prec.removesuffix("-exact"), "exact": exact,
                                                "algo": algo, "seed": seed, "task": {"path": str(perf)},
                                                "rollout": {"quantization": quant}}), extra))
        if _finished(run_dir, cfg.train.steps):  # nothing to resume: no trainer (and no config check) needed
            log(f"[sanity] 3/4 arm {i}/{len(arms)}: {name} finished ({plural(cfg.train.steps, 'step')}), reusing it")
            continue
        log(f"[sanity] 3/4 arm {i}/{len(arms)}: {name} ({plural(cfg.train.steps, 'step')})")
        trainer = Trainer(arm_cfg, run_dir, resume=run_dir.exists(), log=log)
        t_arm, start = time.perf_counter(), trainer.step

        def on_step(m, _i=i, _name=name, _prec=prec, _t=t_arm, _start=start, _tr=trainer):
            per = (time.perf_counter() - _t) / max(_tr.step - _start, 1)
            step_time[_prec] = per
            arm_left = (cfg.train.steps - _tr.step) * per
            later = sum(step_time.get(p, per) * cfg.train.steps for p, _, _, _ in arms[_i:])
            log(f"[sanity] arm {_i}/{len(arms)} {_name} step {m['step']}/{cfg.train.steps} "
                f"reward {m.get('reward/mean', float('nan')):.3f} k3 {m.get('mismatch/k3', float('nan')):.2e} "
                f"ETA arm {_fmt_s(arm_left)}, all {_fmt_s(arm_left + later)}")

        trainer.on_step = on_step
        trainer.fit()
        run_steps += trainer.step - start
    if not report:
        return [summarize(d) for d in arm_dirs], None, arm_dirs
    stages = "".join(f"; {name} {_fmt_s(sec)}" for name, sec in stage_s.items())
    log(f"[sanity] 4/4 report (RL: {plural(run_steps, 'step')} in {_fmt_s(time.perf_counter() - t_rl)}{stages}; "
        f"total {_fmt_s(time.perf_counter() - t_all)})")
    path = write_report(arm_dirs, out, title="unison sanity test",
                        notes=_notes(cfg, precisions, algorithms, perf, quantizations))
    return [summarize(d) for d in arm_dirs], path, arm_dirs


def warm_start(cfg: Config, out: Path, k: int = 8, band=None, max_prompts: int | None = 32,
               log=lambda m: print(m, file=sys.stderr, flush=True)):
    """The shared start of every arm under ``out``: the SFT warm start (``out/sft``) and the perfectible set
    (``out/perfectible.jsonl``), each made unless already there. Returns (the RL config on the SFT model, the
    set's path, seconds per stage made)."""
    out.mkdir(parents=True, exist_ok=True)
    stage_s: dict[str, float] = {}  # SFT and filter, timed apart from the RL steps

    sft_dir = out / "sft"
    if (sft_dir / "model" / "config.json").exists():
        log(f"[sanity] 1/4 SFT: reusing {sft_dir / 'model'}")
    else:
        t0 = time.perf_counter()
        log(f"[sanity] 1/4 SFT warm start ({plural(cfg.sft.steps, 'step')}) on {cfg.task.name}")
        s = run_sft(cfg, sft_dir, log=log)
        log(f"[sanity]     SFT done: train accuracy {s['train_accuracy_sampled']:.3f} sampled")
        stage_s["SFT"] = time.perf_counter() - t0
    rl_base = cfg.model_copy(update={"model": str(sft_dir / "model")})

    perf = out / "perfectible.jsonl"
    if perf.exists():
        log(f"[sanity] 2/4 filter: reusing {perf}")
    else:
        log(f"[sanity] 2/4 filter: pass rate over k={k} samples per prompt")
        t0 = time.perf_counter()
        run_filter(rl_base, perf, k=k, band=band, max_prompts=max_prompts, log=log)
        stage_s["filter"] = time.perf_counter() - t0
    return rl_base, perf, stage_s


def _finished(run_dir: Path, steps: int) -> bool:
    """An arm that completed its steps (summary written, metrics up to the last step)."""
    if not (run_dir / "summary.json").exists():
        return False
    try:
        rows = read_metrics(run_dir / "metrics.jsonl")
    except UnisonError:
        return False
    return bool(rows) and rows[-1]["step"] >= steps


def parse_arm_precision(name: str) -> str:
    """``fp32 | bf16 | fp16``, optionally with ``-exact`` (the arm runs in exact mode)."""
    text = str(name).strip().lower()
    if text.endswith("-exact"):
        return parse_precision(text.removesuffix("-exact")) + "-exact"
    return parse_precision(text)


def _preflight(cfg: Config, algorithms: list[str]) -> None:
    """What the stages would refuse later, refused now: each arm's policy, the model directory,
    the engine, the task and its data, the reward function."""
    for a in algorithms:
        resolve_policy(a, cfg.policy)
    resolve_model_dir(cfg.model)
    mode = getattr(cfg.vllm, "mode", None)  # a vLLM server needs no local vLLM
    check_engine_available(cfg.engine, *([mode] if mode else []))
    make_reward(make_task(cfg.task), cfg.task)


def _notes(cfg, precisions, algorithms, perf, quantizations=("none",)) -> str:
    n = sum(1 for _ in open(perf))
    quant = "" if list(quantizations) == ["none"] else f", rollout weight format ({', '.join(quantizations)})"
    return (f"Same seed ({cfg.seed}) and configuration for every arm; only the precision "
            f"({', '.join(precisions)}){quant} and algorithm ({', '.join(algorithms)}) change. Model: SFT "
            f"warm start of `{cfg.model}` on {cfg.task.name}; training set: {n} perfectible prompts "
            f"(`{perf.name}`); {cfg.train.prompts_per_step} prompts x {cfg.rollout.n} samples per step, "
            f"{cfg.train.steps} steps, lr {cfg.train.lr}. A sound run drives the training accuracy "
            f"towards 1.0.")


def _fmt_s(s: float) -> str:
    s = max(int(s), 0)
    return f"{s // 60}m{s % 60:02d}s"
