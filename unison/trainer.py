"""The RL loop (``unison train``). One step, as in the papers' algorithm box:

    1. the rollout source gives this step's batch: n responses per prompt from the rollout engine μ
       (log μ per token, the policy version that sampled each), verifier rewards
    2. group advantages (Dr.GRPO by default)
    3. log π_old, decided in one place (``policy.anchor``): the learner's score pass, the training
       forward itself (one mini-batch), log μ (bypass), or AReaL's log-linear approximation;
       on-policy distillation (distill.teacher): per-token advantages −coef·(log π_old − log π_teacher)
    4. correction weights from (π_old, μ), e.g. Token-TIS min(ρ_t, C)
    5. the learner's update: policy loss over mini-batches (micro-batch accumulation), AdamW on
       fp32 master weights; fp16 uses dynamic loss scaling and skips non-finite steps
    6. the new weights go to the rollout engine(s)
    7. mismatch metrics of (π_old, μ), split into numerics and staleness for off-policy samples;
       metrics.jsonl / TensorBoard / console; checkpoints; the LR schedule observes the step

With ``rollout.max_staleness: K ≥ 1`` the source runs the engine up to K versions ahead of the
learner (unison/rollout/source.py); the loop does not change. Under ``torchrun`` every rank draws
the same prompts, generates its share of the prompt groups, and sees the gathered batch; the
learner splits the work and normalises with global counts. Only rank 0 writes. The homes of the
step's stages: the learner (unison/learner.py), the source (unison/rollout/), what is measured and
watched (unison/telemetry.py), what is said at start (unison/startup.py), checkpoints and signals
(unison/checkpoint.py).
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from unison import checkpoint as ckpt
from unison import compilation, machine, preflight
from unison.algorithms.advantages import ADVANTAGES
from unison.algorithms.anchors import Anchor
from unison.algorithms.corrections import BATCH_LEVEL, CORRECTIONS, LOSS_MASKS
from unison.algorithms.presets import correction_kwargs, resolve_policy
from unison.batch import collate
from unison.checkpoint import Checkpointer, SignalStop, resumed_choice
from unison.config import Config, resolve_paths
from unison.data_io import atomic_write_text, read_metrics
from unison.distributed import init_distributed
from unison.errors import Stopped
from unison.exact_check import self_check
from unison.filter import pass_rates
from unison.learner import Learner
from unison.ledger import build_ledger
from unison.models import load_tokenizer, resolve_model_dir
from unison.optim import GradNoiseTracker
from unison.precision import Precision
from unison.quant import check_format_available
from unison.report import write_report
from unison.retokenize import retokenize_metrics
from unison.rollout import check_engine_available, make_engine, preflight_engine
from unison.rollout.source import make_source, step_seed
from unison.runlog import RunLog, console_line, memory_metrics
from unison.schedules import MismatchBudgetSchedule, make_schedule
from unison.startup import startup_lines
from unison.sync import weights_of
from unison.tasks import make_reward, make_task
from unison.tasks.env import model_token_budget, tokens_after_prompt, with_model_tokens
from unison.teacher import Teacher
from unison.telemetry import Mismatch, Watchdogs, batch_metrics, timed
from unison.view import render as render_view
from unison.view import token_records, write_step


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, log=_stderr):
        cfg = resolve_paths(cfg)  # config.yaml holds absolute paths: --resume works from any directory
        try:
            self._build(cfg, run_dir, resume, log)
        except BaseException:  # a Trainer that fails half-built (a resume with no usable checkpoint, the run
            if getattr(self, "source", None) is not None:  # log failing to open) ends its rollout worker
                self.source.close()
            raise

    def _build(self, cfg: Config, run_dir: str | Path, resume: bool, log) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        #: optional callback ``on_step(metrics)`` after each step (progress views)
        self.on_step = None
        # ---- everything that can be checked is checked before the run directory is touched
        preflight.check_settings(cfg)
        self.dist = init_distributed(cfg.device, cfg.distributed.timeout_s or 600.0)
        self.log = log if self.dist.is_main else (lambda m: None)
        self.policy = resolve_policy(cfg.algo, cfg.policy)
        self.prec = Precision.resolve(cfg.precision, cfg.rollout_precision, cfg.learner_precision)
        check_format_available(cfg.rollout.quantization)
        model_dir = resolve_model_dir(cfg.model)
        check_engine_available(cfg.engine, cfg.vllm.mode)
        self.task = make_task(cfg.task, evaluate=bool(cfg.train.eval_every))
        self.reward = make_reward(self.task, cfg.task)
        self.tokenizer = load_tokenizer(model_dir)
        if self.task.multi_turn:  # the chat template, checked (one-line refusals)
            self.task.prepare(self.tokenizer, cfg.model)
        self.prompt_ids = [self.task.encode(self.tokenizer, it) for it in self.task.train]
        preflight.check_data(cfg, self.task, self.dist.world_size)
        preflight.check_context(cfg, model_dir, self.task, self.prompt_ids)
        self._max_len = max(len(p) for p in self.prompt_ids) + tokens_after_prompt(cfg)
        preflight_engine(cfg.engine, model_dir, self._max_len)
        self.layout = preflight.exact_layout(cfg, model_dir, self.task, self.tokenizer, self.prompt_ids) \
            if cfg.exact else None
        preflight.check_run_dir(self.run_dir, cfg, resume)
        # ---- the machine, then the models: threads and the matmul library before any model is loaded (and the
        # async worker spawned); config.yaml holds the choice, so that --resume rounds as the run began
        # the run's shapes: a decode step's rows (each rank's share; what the engine's products are measured and
        # packed for) and the learner's micro-batches (what compile's auto times)
        self._shape = compilation.run_shape(cfg, self.prompt_ids, self.dist.world_size)
        m = self.machine = machine.decide(
            cfg, model_dir, self.prec, self._shape, self.dist.world_size,
            gemm_setting=resumed_choice(cfg, self.run_dir, "gemm") if resume else None,
            compile_setting=resumed_choice(cfg, self.run_dir, "compile") if resume else None, log=self.log)
        cfg = self.cfg = cfg.model_copy(update={"gemm": m.gemm.value, "compile": m.compilation.value})
        torch.manual_seed(cfg.seed)
        self.learner = Learner.from_config(cfg, model_dir, self.dist, side=m.learner, policy=self.policy)
        self.learner.max_new_tokens = model_token_budget(cfg)  # Dr.GRPO's normaliser: an episode's model tokens
        self.teacher = None
        if cfg.distill.teacher:  # on-policy distillation: the teacher's engine, its tokenizer checked
            self.teacher = Teacher.from_config(cfg, self.tokenizer, self.dist)
            if cfg.distill.estimator == "full":  # the learner's loss takes the teacher's whole distribution
                self.teacher.check_full(self.learner.model.get_output_embeddings().weight.shape[0])
                self.learner.distill = (self.teacher, cfg.distill.coef)
        #: the policy's weights as the engines take them (unison/sync.py: the one place learner and engine meet)
        self.weights = weights_of(self.learner)
        self.source = make_source(cfg, partial(self._make_engine, model_dir), self.task, self.reward,
                                  self.tokenizer, self.prompt_ids, self.dist, self.weights, model_dir, m.engine)
        self.engine = self.source.engine  # the in-process engine, or the worker backend (K ≥ 1)
        if self.layout is not None:  # exact mode: this CPU's kernels are checked before anything is written
            ops = self_check(self.learner.exact, {self.prec.rollout_dtype, self.prec.learner_dtype}, self.layout[1])
            self.engine.exact.ops = ops

        self.ledger = build_ledger(cfg, self.learner, self.source, model_dir, m.engine)
        # ---- the algorithm
        correct = partial(CORRECTIONS[self.policy["correction"]], **correction_kwargs(self.policy))
        #: a correction that drops tokens from the loss (M2PO): under a token mean they leave its normaliser too
        masks = LOSS_MASKS.get(self.policy["correction"]) if self.policy["loss_agg"] == "token_mean" else None
        self.anchor = Anchor(self.policy["anchor"], cfg.train.mini_batches, cfg.train.fuse_score_pass, correct,
                             loss_mask=partial(masks, **correction_kwargs(self.policy)) if masks else None,
                             batch_level=self.policy["correction"] in BATCH_LEVEL,
                             dropout=bool(cfg.lora.rank and cfg.lora.dropout))
        self.schedule = make_schedule(cfg.train, asynchronous=cfg.rollout.max_staleness > 0)
        self.noise = GradNoiseTracker(cfg.train.grad_noise_ema)
        # ---- what the run measures, watches and keeps
        watched = getattr(self.schedule, "metric", None)  # the mismatch budget reads the split every step
        self.mismatch = Mismatch(cfg.mismatch.decompose_every, self.learner, self.source, self.ledger,
                                 exact=self.layout is not None, split_every_step=watched == "mismatch/staleness_k3",
                                 log=self.log, console=cfg.log.console)
        self.watch = Watchdogs(cfg.task, cfg.train.no_signal_steps, cfg.rollout.max_new_tokens, self.task.name, self.log,
                               saved=partial(ckpt.complete, self.run_dir / "checkpoints"))
        self.checkpoints = Checkpointer(self.run_dir, self.dist, cfg.checkpoint.keep, self.learner, self.tokenizer,
                                        self.source, {"learner": self.learner, "schedule": self.schedule,
                                                      "grad_noise": self.noise, "watchdogs": self.watch}, self.log)
        self.runlog = RunLog(self.run_dir, cfg, self.dist.is_main)
        resumed_from = self.step = self.checkpoints.resume() if resume else 0
        self.dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        self.runlog.open(resumed_from)
        for line in startup_lines(self):
            self.log(line)
        # compiling so far (measure's measurement, the engine's warm-up here or in its worker): the first step's
        # time/compile_s; then each step's own (the learner's first forward and backward, a new shape)
        self._compile_mark = compilation.seconds_compiling()
        self._compile_pending = self._compile_mark + getattr(getattr(self.engine, "worker", None), "compile_s", 0.0)
        self.compile_total = 0.0

    def _make_engine(self, model_dir):
        cfg = self.cfg
        vopts = cfg.vllm.model_dump()
        vopts["sync_dir"] = vopts["sync_dir"] or str(self.run_dir / "weight_sync")
        return make_engine(cfg.engine, model_dir, self.machine.engine, device=str(self.learner.device),
                           seed=cfg.seed, max_len=self._max_len, prompt_width=self.layout[0] if self.layout else None,
                           decode_rows=self._shape.rows, **vopts)

    # --------------------------------------------------------------- the step
    def train_step(self) -> dict:
        cfg, step, t = self.cfg, self.step, {}
        t_step = time.perf_counter()
        roll = self.source.next(step)                                  # 1. μ's samples and their rewards
        metrics = self.watch.rollout(step, roll, getattr(self.task, "env", None))
        roll.completions, roll.rewards = with_model_tokens(roll.completions, roll.rewards)
        if not roll.completions:
            return self._no_update(metrics, roll, t_step)
        if cfg.log.rollouts:
            self.runlog.rollouts(step + 1, roll.completions, roll.rewards, self.tokenizer)
        batch = collate(roll.completions, self.source.pad_id, layout=self.layout)
        batch.rewards = torch.tensor(roll.rewards, dtype=torch.float32)
        batch.advantages = ADVANTAGES[self.policy["advantage"]](batch.rewards, batch.group_ids)  # 2.
        with timed("time/score_s", t):                                 # 3. which log π is π_old
            old = self.anchor.before_update(batch, step, lambda b: self.learner.score(b, with_routing=True))
        metrics.update(self._retokenize(roll.completions, step))      #    (multi-turn: with π_old's weights)
        if self.teacher is not None:                                   #    distillation: per-token advantages
            with timed("time/teacher_s", t):                           #    from the teacher and π_old
                scored = batch.logp_old if self.anchor.scored else None  # bypass: μ, not the learner's
                batch.advantages, dmetrics = self.teacher.advantages(batch, self.learner, scored,
                                                                     measure_path=self.mismatch.ledger_due(step))
            metrics.update({**dmetrics, "time/teacher_s": t["time/teacher_s"]})
        weights, cmetrics, loss_mask = self.anchor.weights(batch)      # 4. correction weights
        lr = self.schedule.lr(step + 1)
        with timed("time/ledger_s", t):                                #    the ledger's passes: before 5
            chain = self.ledger.prepare(batch, step) if self.mismatch.ledger_due(step) else None
        self.source.sleep()
        with timed("time/update_s", t):
            stats = self.learner.train(batch, old, weights, lr, seed=step_seed(cfg.seed, step) + 1,  # 5.
                                       loss_mask=loss_mask)
        with timed("time/telemetry_s", t):                             # 7. (before 6: it may score with the
            known = self.anchor.known(batch, stats, cmetrics)
            metrics.update(self.mismatch.measure(batch, known, step, chain, t["time/ledger_s"]))
            metrics.update(batch_metrics(batch, step))                 #    weights 6 overwrites)
            self._record_tokens(batch, known, weights, step, metrics)  #    (unison view)
        self.source.wake()
        with timed("time/sync_s", t):
            sync = self.source.publish(self.weights, step + 1)         # 6. weights to the engine
        metrics.update({
            **stats.metrics, **self.noise.average(stats.noise_terms), **sync,
            "optim/lr": lr, "optim/loss_scale": self.learner.loss_scale,
            "optim/skipped_steps": self.learner.skipped_steps, "optim/steps": stats.steps,
            **{k: t[k] for k in ("time/score_s", "time/update_s", "time/sync_s", "time/telemetry_s")},
            **memory_metrics(self.learner.device)})
        self.watch.signal(metrics, batch)
        return self._finish_step(metrics, t_step, batch.num_response_tokens)

    def _record_tokens(self, batch, known, weights, step: int, metrics: dict) -> None:
        """``log.tokens``: the step's responses of largest mismatch, token by token, for ``unison view``."""
        lg = self.cfg.log
        if not lg.tokens or not self.dist.is_main:
            return
        if callable(weights):  # applied per micro-batch: the weights of π_old where it is known
            weights = self.anchor.correct(known.logp, batch.logp_mu, batch.response_mask)[0]
        terms = self.ledger.token_terms(step, batch.size, known.rows) if self.ledger is not None else None
        records, of = token_records(batch, known.rows, known.logp, weights, self.tokenizer, lg.tokens,
                                    batch.rewards, terms)
        write_step(self.run_dir, step + 1, records, of, metrics, lg.tokens_recent, lg.tokens_thin)

    def _retokenize(self, completions, step: int) -> dict:
        """Multi-turn, every ``mismatch.decompose_every`` steps: the mismatch a framework that decodes and
        re-tokenizes the conversation would train with (unison/retokenize.py)."""
        every = self.cfg.mismatch.decompose_every
        if not self.task.multi_turn or not every or (step + 1) % every:
            return {}

        return retokenize_metrics(self.learner, completions, self.task.template, self.source.pad_id)

    def _no_update(self, metrics: dict, roll, t_step: float) -> dict:
        why = "every sample was too stale" if roll.stale_dropped else \
            "no episode got to a model turn" if roll.episodes and not roll.dropped_groups else \
            "every group had uniform rewards"
        self.log(f"[train] step {metrics['step']}: {why}; no update")
        metrics["reward/trained_mean"], metrics["optim/steps"] = float("nan"), 0
        self.watch.signal(metrics, None)
        # the weights did not change, but they are version step + 1 now: an engine running ahead waits for it
        metrics.update(self.source.publish(self.weights, metrics["step"]))
        return self._finish_step(metrics, t_step, 0)

    def _finish_step(self, metrics: dict, t_step: float, tokens: int) -> dict:
        step_s = time.perf_counter() - t_step
        metrics["time/step_s"] = step_s
        now = compilation.seconds_compiling()
        compile_s, self._compile_pending, self._compile_mark = now - self._compile_mark + self._compile_pending, 0.0, now
        self.compile_total += compile_s
        metrics["time/compile_s"] = compile_s
        metrics["throughput/tokens_per_s"] = tokens / max(step_s, 1e-9)
        if not self.source.max_staleness:  # synchronous: the engine idles while the learner works
            metrics["time/engine_idle_s"] = max(step_s - metrics.get("time/generate_s", 0.0), 0.0)
        metrics.update(self.schedule.observe(self.step + 1, metrics))
        self.watch.budget(metrics, self.schedule)
        self.step += 1
        return metrics

    # -------------------------------------------------------------------- run
    def fit(self) -> dict:
        cfg = self.cfg
        total = cfg.train.steps
        if self.step >= total:
            self.log(f"[train] nothing to do: the run is at step {self.step} of {total}")
        t_start = time.perf_counter()
        first_step, last, saved_at = self.step, {}, time.monotonic()
        stop = SignalStop(self.log) if not self.dist.enabled else None
        try:
            while self.step < total:
                metrics = self.train_step()
                if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == total):
                    metrics["eval/accuracy"] = self.evaluate()
                self.runlog.write(metrics)
                last = metrics
                if self.on_step is not None:
                    self.on_step(metrics)
                if cfg.log.console:
                    eta = (time.perf_counter() - t_start) / (self.step - first_step) * (total - self.step)
                    self.log(console_line(metrics, total, eta))
                due = (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or \
                    (cfg.checkpoint.every_minutes and time.monotonic() - saved_at >= 60 * cfg.checkpoint.every_minutes)
                if stop is not None and stop.signum is not None:
                    self.save_checkpoint()
                    raise Stopped(stop.code, f"stopped by {stop.name} after step {self.step}: checkpoint saved; "
                                             f"continue with `unison train --out {self.run_dir} --resume`")
                if due and self.step < total:
                    self.save_checkpoint()
                    saved_at = time.monotonic()
            if last or not self.checkpoints.saved():
                self.save_checkpoint()
            summary = self._summary(last, time.perf_counter() - t_start)
            if self.dist.is_main:
                atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
                try:
                    if cfg.log.tokens:
                        render_view(self.run_dir)
                    write_report([self.run_dir], self.run_dir, title=f"run {self.run_dir.name}")
                except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the run
                    self.log(f"[train] report skipped: {e}")
        except BaseException:
            self.source.close()  # a worker process ends with the run, whatever stopped it (the final save too)
            raise
        finally:
            if stop is not None:
                stop.restore()
        self.runlog.close()
        self.source.close()
        return summary

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` (collective: every rank writes its optimizer shard)."""
        return self.checkpoints.save(self.step)

    def evaluate(self) -> float:
        """Greedy accuracy on the eval split (each rank answers its share)."""
        items = self.task.eval
        if not items:
            return float("nan")
        lo, hi = self.source.share(len(items))
        mine = items[lo:hi]
        rates = pass_rates(self.source, self.task, self.reward, mine, self.tokenizer, 1, 0.0,
                           self.cfg.rollout.max_new_tokens, self.cfg.seed) if mine else []
        rates = [x for part in self.source.gather(rates) for x in part]
        return sum(rates) / len(rates)

    def _summary(self, last: dict, wall: float) -> dict:
        rows = read_metrics(self.run_dir / "metrics.jsonl") if self.dist.is_main else []
        rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), float)]
        budget = self.schedule if isinstance(self.schedule, MismatchBudgetSchedule) else None
        return {"steps": self.step, "precision": self.prec.label, "algo": self.cfg.algo,
                "quantization": self.cfg.rollout.quantization, "max_staleness": self.cfg.rollout.max_staleness,
                "world_size": self.dist.world_size,
                "reward_first": rewards[0] if rewards else None,
                "reward_last": rewards[-1] if rewards else None,
                "reward_last5_mean": float(np.mean(rewards[-5:])) if rewards else None,
                "reward_errors": self.watch.reward_errors,
                "no_signal_steps": sum(int(r.get("train/no_signal") or 0) for r in rows),
                "skipped_steps": self.learner.skipped_steps, "wall_s_this_session": wall,
                "compile": self.cfg.compile, "compile_s_this_session": self.compile_total,
                **({"mismatch_budget": {"metric": budget.metric, "target": budget.target,
                                        "steps_without_metric": budget.missing_steps,
                                        "final_lr_factor": budget.factor}} if budget else {}),
                "final": {k: v for k, v in last.items() if not k.startswith("time/")}}
