"""The RL loop (``unison train``). One step, as in the papers' algorithm box:

    1. the rollout source gives this step's batch: n responses per prompt from the rollout engine μ
       (log μ per token, the policy version that sampled each), verifier rewards
    2. group advantages (Dr.GRPO by default)
    3. log π_old, decided in one place (``policy.anchor``): the learner's score pass, the training
       forward itself (one mini-batch), log μ (bypass), or AReaL's log-linear approximation
    4. correction weights from (π_old, μ), e.g. Token-TIS min(ρ_t, C)
    5. the learner's update: policy loss over mini-batches (micro-batch accumulation), AdamW on
       fp32 master weights; fp16 uses dynamic loss scaling and skips non-finite steps
    6. the new weights go to the rollout engine(s)
    7. mismatch metrics of (π_old, μ), split into numerics and staleness for off-policy samples;
       metrics.jsonl / TensorBoard / console; checkpoints; the LR schedule observes the step

With ``rollout.max_staleness: K ≥ 1`` the source runs the engine up to K versions ahead of the
learner (unison/rollout/source.py); the loop does not change. Under ``torchrun`` every rank draws
the same prompts, generates its share of the prompt groups, and sees the gathered batch; the
learner splits the work and normalises with global counts. Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from unison import checkpoint as ckpt
from unison import preflight
from unison.algorithms.advantages import ADVANTAGES
from unison.algorithms.anchors import OldLogp, plan
from unison.algorithms.corrections import BATCH_LEVEL, CORRECTIONS
from unison.algorithms.presets import correction_kwargs, resolve_policy
from unison.batch import collate
from unison.config import Config, resolve_paths
from unison.data_io import atomic_write_text, read_metrics
from unison.distributed import init_distributed
from unison.errors import Stopped, UnisonError
from unison.learner import Learner
from unison.mismatch import k1, k3, mismatch_metrics
from unison.models import load_tokenizer, resolve_model_dir, unknown_characters
from unison.precision import Precision
from unison.quant import check_format_available, quantization_warning
from unison.rollout import check_engine_available, make_engine, preflight_engine
from unison.rollout.source import PromptSampler, make_source, step_seed  # noqa: F401 - PromptSampler re-exported
from unison.runlog import RunLog, console_line, memory_metrics, plural
from unison.schedules import GradNoiseTracker, MismatchBudgetSchedule, make_schedule
from unison.tasks import make_reward, make_task
from unison.gemm import setup as setup_gemm
from unison.threads import setup as setup_threads
from unison.tasks.env import episode_metrics, model_token_budget, tokens_after_prompt, with_model_tokens

CKPT_PREFIX = ckpt.PREFIX


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
        if getattr(self.task, "multi_turn", False):  # the chat template, checked (one-line refusals)
            self.task.prepare(self.tokenizer, cfg.model)
        self.prompt_ids = [self.task.encode(self.tokenizer, it) for it in self.task.train]
        preflight.check_data(cfg, self.task, self.dist.world_size)
        preflight.check_context(cfg, model_dir, self.task, self.prompt_ids)
        self._max_len = max(len(p) for p in self.prompt_ids) + tokens_after_prompt(cfg)
        preflight_engine(cfg.engine, model_dir, self._max_len)
        self.layout = preflight.exact_layout(cfg, model_dir, self.task, self.tokenizer, self.prompt_ids) \
            if cfg.exact else None
        preflight.check_run_dir(self.run_dir, cfg, resume)
        self.threads = setup_threads(cfg.threads, model_dir=model_dir)  # before the async worker is spawned
        self.gemm = setup_gemm(_resumed_gemm(cfg, self.run_dir) if resume else cfg.gemm, model_dir=model_dir,
                               device=cfg.device, world_size=self.dist.world_size,
                               fp32=torch.float32 in (self.prec.rollout_dtype, self.prec.learner_dtype))
        # before any model is loaded; config.yaml holds the choice, so that --resume rounds as the run began
        cfg = self.cfg = cfg.model_copy(update={"gemm": self.gemm.name})

        torch.manual_seed(cfg.seed)
        self.learner = Learner.from_config(cfg, model_dir, self.dist)
        self.learner.max_new_tokens = model_token_budget(cfg)  # Dr.GRPO's normaliser: an episode's model tokens
        self.source = make_source(cfg, partial(self._make_engine, model_dir), self.task, self.reward,
                                  self.tokenizer, self.prompt_ids, self.dist, self.learner, model_dir,
                                  self.prec.rollout_dtype)
        self.engine = self.source.engine  # the in-process engine, or the worker backend (K ≥ 1)
        if self.layout is not None:  # exact mode: this CPU's kernels are checked before anything is written
            from unison.exact import self_check

            ops = self_check(self.learner.exact, {self.prec.rollout_dtype, self.prec.learner_dtype}, self.layout[1])
            self.engine.exact.ops = ops
        from unison.ledger import build_ledger

        self.ledger = build_ledger(cfg, self.learner, self.source, model_dir, self.prec.rollout_dtype, exact=cfg.exact)
        self.anchor = plan(self.policy["anchor"], cfg.train.mini_batches, cfg.train.fuse_score_pass,
                           batch_level=self.policy["correction"] in BATCH_LEVEL)
        self.correct = partial(CORRECTIONS[self.policy["correction"]], **correction_kwargs(self.policy))
        self.schedule = make_schedule(cfg.train, asynchronous=cfg.rollout.max_staleness > 0)
        self.noise = GradNoiseTracker(cfg.train.grad_noise_ema)
        self.step = 0
        self.truncation_warned = False
        self.budget_warned = False
        self.failed_reward_steps = 0
        self.reward_errors = 0
        self.quiet_steps = 0  # consecutive steps without a learning signal
        self.runlog = RunLog(self.run_dir, cfg, self.dist.is_main)
        resumed_from = self._resume() if resume else None
        self.dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        self.runlog.open(resumed_from)
        self._announce()

    def _make_engine(self, model_dir):
        cfg = self.cfg
        vopts = cfg.vllm.model_dump()
        vopts["sync_dir"] = vopts["sync_dir"] or str(self.run_dir / "weight_sync")
        return make_engine(cfg.engine, model_dir, self.prec.rollout_dtype, device=str(self.learner.device),
                           seed=cfg.seed, max_len=self._max_len, exact=cfg.exact,
                           prompt_width=self.layout[0] if self.layout else None,
                           quantization=cfg.rollout.quantization,
                           quant_group_size=cfg.rollout.quant_group_size, **vopts)

    def _announce(self) -> None:
        cfg, t, r = self.cfg, self.cfg.train, self.cfg.rollout
        warning = quantization_warning(r.quantization, self.policy, t.quantization_aware)
        if warning:
            self.log(f"[train] WARNING {warning}")
        if self.learner.packing_note:
            self.log(f"[train] train.packing: {self.learner.packing_note}")
        if getattr(self.task, "multi_turn", False):
            from unison.tasks.env import describe

            self.log(describe(self.task, cfg))
        ahead = f", engine up to {plural(r.max_staleness, 'version')} ahead ({r.stale_policy})" if r.max_staleness else ""
        if r.max_staleness and cfg.mismatch.decompose_every and not self.learner.can_score_other_weights:
            self.log("[train] the split of the mismatch into numerics and staleness scores with older weights in one "
                     "process without LoRA: it is off here (mismatch/k3 is still logged)")
        self.log(f"[train] {self.task.name}: {plural(len(self.task.train), 'training prompt')}, {len(self.task.eval)} eval; "
                 f"{plural(t.prompts_per_step, 'prompt')} x {plural(r.n, 'sample')} per step, {plural(t.steps, 'step')}; "
                 f"precision {self.prec.label}"
                 f"{'' if r.quantization == 'none' else f', rollout weights {r.quantization}'}, engine {cfg.engine}"
                 f"{ahead}, world size {self.dist.world_size}; {self.threads}; {self.gemm}")
        self.log(f"[train] {self._method_line()}")
        if self.ledger is not None:
            p = self.ledger.plan
            missing = "".join(f"; {t} not measured ({why}), merged into its neighbour" for t, why in p.unmeasured.items())
            self.log(f"[train] mismatch ledger every {cfg.mismatch.decompose_every} steps: {', '.join(p.measured)}"
                     f"{missing} (mismatch.ledger)")
        if self.task.name == "math":
            self.log(f"[train] math prompts: task.template {cfg.task.template!r}")
        if cfg.task.reward and cfg.task.truncated_reward is not None:
            self.log(f"[train] a response cut at rollout.max_new_tokens={r.max_new_tokens} scores "
                     f"task.truncated_reward={cfg.task.truncated_reward:g} without a call of your reward "
                     f"({cfg.task.reward}); set task.truncated_reward=null to grade it too")
        unknown = unknown_characters(self.tokenizer, [it.prompt for it in self.task.train], self.prompt_ids, "prompts")
        if unknown:
            self.log(f"[train] WARNING {unknown}")
        if getattr(self.tokenizer, "chat_template", None) is None and self.task.name in ("math", "jsonl"):
            self.log("[train] the model has no chat template: prompts go to it as raw text")
        n = sum(p.numel() for p in self.learner.model.parameters())
        c = cfg.checkpoint
        when = " and ".join(x for x in (f"every {plural(c.every, 'step')}" if c.every else "",
                                        f"every {c.every_minutes:g} min" if c.every_minutes else "") if x)
        self.log(f"[train] checkpoints: {when + ', ' if when else ''}on SIGTERM / Ctrl-C and at the end; ≈{12 * n / 2**30:.2g} GiB "
                 f"each (fp32 weights + AdamW state), {c.keep} kept (checkpoint.every, every_minutes, keep)")

    def _method_line(self) -> str:
        """What the run trains and how it samples, in one line: the algorithm, LoRA, packing, top-p/top-k."""
        cfg, p, r = self.cfg, self.policy, self.cfg.rollout
        algo = (f"algo {cfg.algo} (advantage {p['advantage']}, loss {p['loss']}, correction {p['correction']}, "
                f"π_old {p['anchor']})")
        lora = (f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {cfg.lora.target_modules}: only the adapters "
                f"train and checkpoints hold the adapters (PEFT format), the engine gets the merged weights"
                if cfg.lora.rank else "full fine-tuning")
        packing = "packing on" if self.learner.packing else "packing off"
        cut = [x for x in (f"top-p {r.top_p:g}" if r.top_p < 1 else "", f"top-k {r.top_k}" if r.top_k else "") if x]
        if not cut:
            sampling = f"sampling at temperature {r.temperature:g} from the full distribution"
        elif r.replay_sampling_mask:
            sampling = (f"sampling at temperature {r.temperature:g} with {' and '.join(cut)}: log μ is that of the "
                        f"truncated distribution, and the learner renormalises π over the same support "
                        f"(rollout.replay_sampling_mask)")
        else:
            sampling = (f"sampling at temperature {r.temperature:g} with {' and '.join(cut)}: log μ is that of the "
                        f"truncated distribution, which the learner does not score — it adds −log(kept mass) to "
                        f"the mismatch (rollout.replay_sampling_mask=true renormalises π over the sampled support)")
        return f"{algo}; {lora}; {packing}; {sampling}"

    # --------------------------------------------------------------- the step
    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        t_step = time.perf_counter()
        roll = self.source.next(step)                                  # 1. μ's samples and their rewards
        metrics = self._rollout_metrics(step, roll)
        roll.completions, roll.rewards = with_model_tokens(roll.completions, roll.rewards)
        if not roll.completions:
            return self._no_update(metrics, roll, t_step)
        if cfg.log.rollouts:
            self.runlog.rollouts(step + 1, roll.completions, roll.rewards, self.tokenizer)
        batch = collate(roll.completions, self.source.pad_id, layout=self.layout)
        batch.rewards = torch.tensor(roll.rewards, dtype=torch.float32)
        batch.advantages = ADVANTAGES[self.policy["advantage"]](batch.rewards, batch.group_ids)  # 2.
        t0 = time.perf_counter()
        old = self._old_logp(batch, step)                              # 3. which log π is π_old
        t_score = time.perf_counter() - t0
        metrics.update(self._retokenize(roll.completions, step))      #    (multi-turn: with π_old's weights)
        if batch.logp_old is not None:                                 # 4. correction weights, once
            weights, cmetrics = self.correct(batch.logp_old, batch.logp_mu, batch.response_mask)
        else:                                                          #    or per micro-batch of π_old
            weights, cmetrics = (lambda o, mu, m: self.correct(o, mu, m)[0]), {}
        lr = self.schedule.lr(step + 1)
        t0 = time.perf_counter()
        chain = self.ledger.prepare(batch, step) if self._ledger_due(step) else None  # before 5: version step
        t_ledger = time.perf_counter() - t0
        self.source.sleep()
        t0 = time.perf_counter()
        stats = self.learner.train(batch, old, weights, lr, seed=step_seed(cfg.seed, step) + 1)  # 5.
        t_update = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics.update(self._telemetry(batch, stats, cmetrics, step, chain, t_ledger))  # 7. (before 6: it may
        t_tele = time.perf_counter() - t0                              #    score with the weights 6 overwrites)
        self.source.wake()
        t0 = time.perf_counter()
        sync = self.source.publish(self.learner, step + 1)             # 6. weights to the engine
        t_sync = time.perf_counter() - t0
        metrics.update({
            **stats.metrics, **self._noise_metrics(stats.noise_terms), **sync,
            "optim/lr": lr, "optim/loss_scale": self.learner.loss_scale,
            "optim/skipped_steps": self.learner.skipped_steps, "optim/steps": stats.steps,
            "time/score_s": t_score, "time/update_s": t_update, "time/sync_s": t_sync,
            "time/telemetry_s": t_tele, **memory_metrics(self.learner.device)})
        self._watch_signal(metrics, batch)
        return self._finish_step(metrics, t_step, batch.num_response_tokens)

    def _old_logp(self, batch, step: int) -> OldLogp:
        """π_old as the plan says; a separate score pass or bypass stores it in ``batch.logp_old``."""
        if self.anchor == "score":
            batch.logp_old = self.learner.score(batch)
        elif self.anchor == "bypass":
            batch.logp_old = batch.logp_mu.clone()
        return OldLogp(self.anchor, batch.logp_old, batch.version, step, self.cfg.train.mini_batches)

    def _rollout_metrics(self, step: int, roll) -> dict:
        self.reward_errors += roll.reward_errors
        sampled = roll.sampled_rewards
        metrics = {"step": step + 1, "reward/mean": float(np.mean(sampled)) if sampled else float("nan"),
                   "data/dropped_groups": roll.dropped_groups, "reward/errors": self.reward_errors,
                   "reward/error_count": roll.reward_errors, "reward/calls": roll.reward_calls,
                   "reward/error_fraction": roll.reward_errors / max(roll.reward_calls, 1),
                   "staleness/dropped": roll.stale_dropped, **roll.timings}
        metrics.update(episode_metrics(roll.episodes))
        self._check_reward_errors(metrics, roll)
        self._check_truncation(metrics, roll)
        return metrics

    def _retokenize(self, completions, step: int) -> dict:
        """Multi-turn, every ``mismatch.decompose_every`` steps: the mismatch a framework that decodes and
        re-tokenizes the conversation would train with (unison/retokenize.py)."""
        every = self.cfg.mismatch.decompose_every
        if not getattr(self.task, "multi_turn", False) or not every or (step + 1) % every:
            return {}
        from unison.retokenize import retokenize_metrics

        return retokenize_metrics(self.learner, completions, self.task.template, self.source.pad_id)

    def _no_update(self, metrics: dict, roll, t_step: float) -> dict:
        why = "every sample was too stale" if roll.stale_dropped else \
            "no episode got to a model turn" if roll.episodes and not roll.dropped_groups else \
            "every group had uniform rewards"
        self.log(f"[train] step {metrics['step']}: {why}; no update")
        metrics["reward/trained_mean"] = float("nan")
        self._watch_signal(metrics, None)
        # the weights did not change, but they are version step + 1 now: an engine running ahead waits for it
        metrics.update(self.source.publish(self.learner, metrics["step"]))
        return self._finish_step(metrics, t_step, 0)

    def _finish_step(self, metrics: dict, t_step: float, tokens: int) -> dict:
        step_s = time.perf_counter() - t_step
        metrics["time/step_s"] = step_s
        metrics["throughput/tokens_per_s"] = tokens / max(step_s, 1e-9)
        if not self.source.max_staleness:  # synchronous: the engine idles while the learner works
            metrics["time/engine_idle_s"] = max(step_s - metrics.get("time/generate_s", 0.0), 0.0)
        metrics.update(self.schedule.observe(self.step + 1, metrics))
        if metrics.get("schedule/budget_missing") and not self.budget_warned:
            self.budget_warned = True
            import difflib

            near = difflib.get_close_matches(self.schedule.metric, [k for k in metrics if "/" in k], n=1, cutoff=0.5)
            self.log(f"[train] WARNING step {metrics['step']}: train.schedule=mismatch_budget watches "
                     f"'{self.schedule.metric}', which this step did not log: the LR factor is held at "
                     f"{self.schedule.factor:g} (schedule/budget_missing); "
                     f"{f'did you mean {near[0]!r}? ' if near else ''}set train.mismatch_budget.metric to a "
                     f"metric the run logs every step (mismatch/k3)")
        self.step += 1
        return metrics

    # ------------------------------------------------------------- telemetry
    def _telemetry(self, batch, stats, cmetrics: dict, step: int, chain=None, t_ledger: float = 0.0) -> dict:
        """Mismatch of the learner's π_old vs μ on the sampled tokens (split into numerics and
        staleness for off-policy samples), corrections, routing, lengths, staleness."""
        mask = batch.response_mask
        if self.anchor == "score":
            rows, logp_pi = torch.arange(batch.size), batch.logp_old
        else:  # π_old is known exactly on the first mini-batch's rows: the training forward at θ = θ_old
            rows = torch.arange(batch.size) if self.anchor == "fused" else stats.first_rows
            logp_pi = stats.logp_first
            if self.anchor == "fused":
                batch.logp_old = logp_pi
            if not cmetrics:  # the weights the first mini-batch applied (loglinear: π_prox at its α)
                old = OldLogp(self.anchor, None, batch.version, step, self.cfg.train.mini_batches)
                prox = old(rows, logp_pi[rows], batch.logp_mu[rows], 0) if self.anchor == "loglinear" else logp_pi[rows]
                _, cmetrics = self.correct(prox, batch.logp_mu[rows], mask[rows])
        mm = mismatch_metrics(logp_pi[rows], batch.logp_mu[rows], mask[rows])
        if self.layout is not None and mm["mismatch/identical_fraction"] < 1.0:
            from unison.exact import divergence_report

            where = divergence_report(self.learner, self.source.engine, batch, rows, logp_pi)
            raise UnisonError(f"exact mode broke at step {step + 1}: log μ and log π_old differ ({where}); "
                              f"this is a bug in unison — please report it with the config")
        learner_routing = self.learner.last_routing if self.anchor == "score" else stats.routing_first
        if learner_routing is not None and "routing" in batch.extras:
            from unison import moe

            mm["mismatch/router_disagreement"] = moe.disagreement(batch.extras["routing"][rows],
                                                                  learner_routing[rows], mask[rows])
        stale = (step - batch.version).float()
        lengths = batch.response_lens.float()
        return {**mm, **cmetrics, **self._ledger_metrics(batch, rows, logp_pi, step, chain, t_ledger),
                **self._mismatch_split(batch, rows, logp_pi, step),
                "staleness/mean": float(stale.mean()), "staleness/max": float(stale.max()),
                "reward/trained_mean": float(batch.rewards.mean()),
                "reward/std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
                "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
                "response/truncated_fraction": float(batch.truncated.float().mean())}

    def _decompose_due(self, step: int) -> bool:
        every = 1 if getattr(self.schedule, "metric", None) == "mismatch/staleness_k3" \
            else self.cfg.mismatch.decompose_every  # the mismatch budget reads the split every step
        return bool(every) and (step + 1) % every == 0

    def _ledger_due(self, step: int) -> bool:
        return self.ledger is not None and not (step + 1) % self.cfg.mismatch.decompose_every

    def _ledger_metrics(self, batch, rows, logp_pi, step: int, chain, t_ledger: float) -> dict:
        """The mismatch ledger of this step's batch (unison/ledger.py), on decompose steps, from the chain
        :meth:`Ledger.prepare` scored before the update, with its console line; warns once about a stale
        engine."""
        if chain is None:
            return {}
        from unison.ledger import shares

        t0 = time.perf_counter()
        m = self.ledger.measure(batch.select(rows), logp_pi[rows], step, chain, rows)
        m["time/ledger_s"] = t_ledger + time.perf_counter() - t0
        if self.cfg.log.console:
            self.log(f"[train] step {step + 1} {shares(m)}")
        self.ledger.check_stale(m, self.log)
        return m

    def _mismatch_split(self, batch, rows, logp_pi, step: int) -> dict:
        """``numeric``: μ against the learner under the weights that sampled (same version, other
        numerics); ``staleness``: those weights against π_old. log π_old − log μ is exactly the sum of
        the two log-ratios, so k1 adds up; k3 adds up to a cross term (docs/async.md)."""
        if not self._decompose_due(step):
            return {}
        mu, mask, v = batch.logp_mu[rows], batch.response_mask[rows], batch.version[rows]
        behave = self.ledger.behave(step) if self.ledger is not None else None  # the ledger scored them already
        if behave is None:
            behave = logp_pi[rows].clone()
            for u in sorted(set(v.tolist()) - {step}):
                weights = self.source.weights(u) if self.learner.can_score_other_weights else None
                if weights is None:
                    return {}
                sel = (v == u).nonzero().squeeze(-1)
                behave[sel] = self.learner.score(batch.select(rows[sel]), weights=weights)
        return {"mismatch/numeric_k3": float(k3(behave, mu, mask)),
                "mismatch/staleness_k3": float(k3(logp_pi[rows], behave, mask)),
                "mismatch/numeric_k1": float(k1(behave, mu, mask)),
                "mismatch/staleness_k1": float(k1(logp_pi[rows], behave, mask))}

    def _noise_metrics(self, terms: list[dict]) -> dict:
        if not terms:
            return {}
        avg = {k: sum(x[k] for x in terms) / len(terms) for k in terms[0]}
        avg["grad_noise/noise_scale"] = (avg["grad_noise/trace_sigma"] / avg["grad_noise/grad_sq"]
                                         if avg["grad_noise/grad_sq"] else float("nan"))
        return self.noise.update(avg)

    def _check_reward_errors(self, metrics: dict, roll) -> None:
        """Errors are counted over the calls actually made (truncated responses make none); a step in
        which every call raised is a failed step, and ``task.reward_error_patience`` of them stop the run."""
        t, calls, errors = self.cfg.task, roll.reward_calls, roll.reward_errors
        if errors and errors / max(calls, 1) > t.reward_error_warn:
            self.log(f"[train] WARNING step {metrics['step']}: {errors} of {calls} rewards raised "
                     f"(scored 0); last: {roll.last_error}")
        if calls:  # a step that made no call (every response truncated) neither fails nor clears the count
            self.failed_reward_steps = self.failed_reward_steps + 1 if errors >= calls else 0
        if t.reward_error_patience and self.failed_reward_steps >= t.reward_error_patience:
            fn = t.reward or f"the {self.task.name} task's verifier"
            saved = ckpt.complete(self.run_dir / "checkpoints")
            then = (f"continue with --resume from the last checkpoint ({saved[-1].name})" if saved else
                    "rerun with --resume: no checkpoint was saved yet, so it starts again from step 0")
            what = f"every call of the reward function {fn} raised" if t.reward or not getattr(self.task, "env", None) \
                else f"every episode of the environment {self.task.env} failed"
            raise UnisonError(f"{what} for {self.failed_reward_steps} "
                              f"consecutive step{'s' if self.failed_reward_steps != 1 else ''} (last: "
                              f"{roll.last_error}): fix it and {then}")

    def _check_truncation(self, metrics: dict, roll) -> None:
        """One warning, the first time more than half of a step's responses were cut at max_new_tokens and
        scored task.truncated_reward without a call of the verifier (or of the user's reward)."""
        t, comps = self.cfg.task, roll.completions
        if self.truncation_warned or t.truncated_reward is None or not comps:
            return
        cut = sum(c.finish_reason == "length" for c in comps) / len(comps)
        if cut > 0.5:
            self.truncation_warned = True
            fn = t.reward or f"the {self.task.name} task's verifier"
            self.log(f"[train] WARNING step {metrics['step']}: {cut:.0%} of the responses hit "
                     f"rollout.max_new_tokens={self.cfg.rollout.max_new_tokens} and scored "
                     f"task.truncated_reward={t.truncated_reward:g} without a call of {fn}: raise "
                     f"rollout.max_new_tokens, or set task.truncated_reward=null to grade them")

    def _watch_signal(self, metrics: dict, batch) -> None:
        """One warning when ``train.no_signal_steps`` steps in a row had nothing to learn from: every
        group's rewards equal (zero advantages) or a zero gradient."""
        patience = self.cfg.train.no_signal_steps
        uniform = batch is None or float(batch.advantages.abs().max()) == 0.0
        zero_grad = metrics.get("optim/grad_norm") == 0.0
        metrics["train/no_signal"] = int(uniform or zero_grad)
        self.quiet_steps = self.quiet_steps + 1 if (uniform or zero_grad) else 0
        if patience and self.quiet_steps == patience:
            trunc = metrics.get("response/truncated_fraction")
            graded = self.cfg.task.truncated_reward is None  # cut responses were graded: not why rewards are equal
            why = "every group's rewards were equal (zero advantage)" if uniform else "the gradient was zero"
            hint = (f"{trunc:.0%} of responses hit rollout.max_new_tokens and scored task.truncated_reward "
                    f"without a reward call: raise rollout.max_new_tokens" if trunc and trunc > 0.5 and not graded
                    else "the prompts are all too hard or all solved: use an easier set or `unison filter`")
            self.log(f"[train] WARNING nothing is being learned: for {plural(patience, 'step')} {why}; {hint}, or change "
                     f"the reward (train.no_signal_steps silences this)")

    # -------------------------------------------------------------------- run
    def fit(self) -> dict:
        cfg = self.cfg
        total = cfg.train.steps
        if self.step >= total:
            self.log(f"[train] nothing to do: the run is at step {self.step} of {total}")
        t_start = time.perf_counter()
        first_step, last, saved_at = self.step, {}, time.monotonic()
        stop = _SignalStop(self.log) if not self.dist.enabled else None
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
            if last or not ckpt.complete(self.run_dir / "checkpoints"):
                self.save_checkpoint()
            summary = self._summary(last, time.perf_counter() - t_start)
            if self.dist.is_main:
                atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
                try:
                    from unison.report import write_report

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

    def evaluate(self) -> float:
        """Greedy accuracy on the eval split (each rank answers its share)."""
        from unison.filter import pass_rates

        items = self.task.eval
        if not items:
            return float("nan")
        lo, hi = self.source._share(len(items))
        mine = items[lo:hi]
        rates = pass_rates(self.source, self.task, self.reward, mine, self.tokenizer, 1, 0.0,
                           self.cfg.rollout.max_new_tokens, self.cfg.seed) if mine else []
        rates = [x for part in self.source._gather(rates) for x in part]
        return sum(rates) / len(rates)

    def _summary(self, last: dict, wall: float) -> dict:
        rows = read_metrics(self.run_dir / "metrics.jsonl") if self.dist.is_main else []
        rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), float)]
        return {"steps": self.step, "precision": self.prec.label, "algo": self.cfg.algo,
                "quantization": self.cfg.rollout.quantization, "max_staleness": self.cfg.rollout.max_staleness,
                "world_size": self.dist.world_size,
                "reward_first": rewards[0] if rewards else None,
                "reward_last": rewards[-1] if rewards else None,
                "reward_last5_mean": float(np.mean(rewards[-5:])) if rewards else None,
                "reward_errors": self.reward_errors,
                "no_signal_steps": sum(int(r.get("train/no_signal") or 0) for r in rows),
                "skipped_steps": self.learner.skipped_steps, "wall_s_this_session": wall,
                **({"mismatch_budget": {"metric": self.schedule.metric, "target": self.schedule.target,
                                        "steps_without_metric": self.schedule.missing_steps,
                                        "final_lr_factor": self.schedule.factor}}
                   if isinstance(self.schedule, MismatchBudgetSchedule) else {}),
                "final": {k: v for k, v in last.items() if not k.startswith("time/")}}

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` (collective: every rank writes its optimizer shard)."""
        d = self.dist
        ckdir = self.run_dir / "checkpoints"
        name = f"{CKPT_PREFIX}{self.step:06d}"
        final, tmp = ckdir / name, ckdir / f".tmp-{name}"
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        d.barrier()
        self.learner.save_model(tmp / "model", self.tokenizer)  # collective; rank 0 writes
        self.learner.save_optimizer(tmp / "optimizer")  # collective
        name, keys, pos, has_gauss, gauss = np.random.get_state()  # plain data and tensors: loads weights_only
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))},
                   tmp / f"rng_rank{d.rank}.pt")
        d.barrier()
        if d.is_main:
            state = {"step": self.step, "world_size": d.world_size, "learner": self.learner.state_dict(),
                     "schedule": self.schedule.state_dict(), "sampler": self.source.state_dict()["sampler"],
                     "grad_noise": self.noise.state_dict(), "reward_errors": self.reward_errors,
                     "failed_reward_steps": self.failed_reward_steps, "source": self.source.state_dict()}
            torch.save(state, tmp / "trainer_state.pt")
            ckpt.publish(tmp, final, self.cfg.checkpoint.keep)
        d.barrier()
        return final

    def _resume(self) -> int:
        """Load the newest usable checkpoint (falling back past damaged ones); its step."""
        ckdir = self.run_dir / "checkpoints"
        found = list(reversed(ckpt.complete(ckdir)))
        if not found:
            self.log("[train] --resume: no checkpoint yet, starting from step 0")
            return 0
        for i, ck in enumerate(found):
            problem = ckpt.verify(ck) if self.dist.is_main else None
            problem = self.dist.broadcast_object(problem)
            if problem is None:
                problem = self._try_load(ck)
            if problem is None:
                newest = ", the newest usable checkpoint" if i else ""
                self.log(f"[train] resumed from {ck.name} (step {self.step}){newest}")
                return self.step
            later = f"; falling back to {found[i + 1].name}" if i + 1 < len(found) else ""
            self.log(f"[train] --resume: checkpoint {ck.name} is damaged ({problem}){later}")
        raise UnisonError(f"--resume: no usable checkpoint in '{ckdir}' (every one is damaged): "
                          f"start a new run with another --out")

    def _try_load(self, ck: Path) -> str | None:
        """Load ``ck`` into every component; a one-line reason if it cannot be read."""
        try:
            state = _load_data(ck / "trainer_state.pt")
            weights = self.learner.read_model(ck / "model")
        except UnisonError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable piece makes the checkpoint unusable
            return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        self.learner.load_full_state_dict(weights)
        self.learner.load_optimizer(ck / "optimizer")
        self.learner.load_state_dict(state["learner"])
        self.schedule.load_state_dict(state["schedule"])
        self.noise.load_state_dict(state["grad_noise"])
        self.source.load_state_dict(state.get("source") or {"sampler": state["sampler"]})
        self.reward_errors = state.get("reward_errors", 0)
        self.failed_reward_steps = state.get("failed_reward_steps", 0)
        rng = ck / f"rng_rank{self.dist.rank}.pt"
        if rng.exists():  # absent when resuming on more ranks than wrote the checkpoint
            r = _load_data(rng)
            torch.set_rng_state(r["torch"])
            random.setstate(r["python"])
            name, keys, *rest = r["numpy"]  # the keys: a tensor, or a numpy array (written by an older unison)
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
        self.step = state["step"]
        self.source.resume(self.learner, self.step)
        return None


def _resumed_gemm(cfg: Config, run_dir: Path) -> str:
    """``gemm: auto`` on --resume: the library the run chose at its start (its config.yaml), so that the
    resumed steps round as the first ones did; an explicit choice is taken as given."""
    import yaml

    if cfg.gemm != "auto":
        return cfg.gemm
    try:
        saved = (yaml.safe_load((Path(run_dir) / "config.yaml").read_text(encoding="utf-8")) or {}).get("gemm")
    except (OSError, yaml.YAMLError, UnicodeDecodeError, AttributeError):
        return cfg.gemm
    return saved if saved in ("blas", "onednn") else cfg.gemm


def _numpy_arrays() -> list:
    """What numpy arrays and scalars of plain dtypes need to unpickle (RNG files written before the keys
    became a tensor; a numpy number in a component's state), under numpy 2's names and numpy 1's."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # pragma: no cover - numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    dtypes = [type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                          np.uint32, np.uint64, np.float16, np.float32, np.float64)]
    return [_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct"), scalar,
            (scalar, "numpy.core.multiarray.scalar"), np.ndarray, np.dtype, *dtypes]


def _load_data(path: Path):
    """A checkpoint's small state, read as data only (``weights_only``: tensors, numbers, strings,
    containers, numpy arrays): a run directory written by someone else cannot run code here. Anything
    else is refused in one line, not skipped over as damage."""
    import pickle
    import re

    try:
        with torch.serialization.safe_globals(_numpy_arrays()):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if not str(e).startswith("Weights only load failed"):
            raise
        what = re.findall(r"GLOBAL (\S+)", str(e))
        raise UnisonError(f"--resume: {path} holds more than data{f' (a pickled {what[0]})' if what else ''}: unison "
                          f"reads checkpoints as data only and will not run code from a run directory; resume only "
                          f"from checkpoints unison wrote, or start a new run with another --out") from None


class _SignalStop:
    """SIGTERM / SIGINT in a one-process run: finish the step in progress, save, stop (exit 143 /
    130). A second signal stops at once, without saving (the last checkpoint stays)."""

    CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}

    def __init__(self, log):
        self.log, self.signum = log, None
        self._old = {}
        try:
            for s in self.CODES:
                self._old[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread: leave the handlers alone
            self._old = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        self.log(f"[train] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                 f"(send it again to stop now without saving)")

    @property
    def code(self) -> int:
        return self.CODES.get(self.signum, 143)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
