"""The RL loop (``unison train``). One step, as in the papers' algorithm box:

    1. sample prompts; the rollout engine μ generates n responses each (log μ per token)
    2. verifier rewards; group advantages (Dr.GRPO by default)
    3. log π_old: the learner's score pass (or log μ with ``policy.bypass``, or the
       training forward itself when one optimizer step uses the rollout)
    4. mismatch metrics of (π_old, μ); correction weights (e.g. Token-TIS min(ρ_t, C))
    5. the learner's update: policy loss over mini-batches (micro-batch accumulation),
       AdamW on fp32 master weights; fp16 uses dynamic loss scaling and skips
       non-finite steps
    6. sync weights to the rollout engine (cast to its dtype)
    7. metrics.jsonl / TensorBoard / console; checkpoints; the LR schedule observes the step

Under ``torchrun`` every rank draws the same prompts, generates its own share
of the prompt groups (group advantages stay whole), and every rank sees the
gathered batch; the learner splits the work and normalises with global counts.
Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from unison import checkpoint as ckpt
from unison.algorithms.advantages import ADVANTAGES, uniform_groups
from unison.algorithms.corrections import CORRECTIONS
from unison.algorithms.presets import correction_kwargs, resolve_policy
from unison.batch import collate
from unison.config import Config, dump_config
from unison.data_io import atomic_write_text, read_metrics
from unison.distributed import init_distributed, under_torchrun
from unison.errors import UnisonError
from unison.learner import Learner
from unison.mismatch import mismatch_metrics
from unison.models import load_tokenizer, model_config, resolve_model_dir
from unison.precision import Precision
from unison.rollout import SamplingParams, check_engine_available, make_engine, preflight_engine
from unison.rollout.base import mix64
from unison.schedules import GradNoiseTracker, make_schedule
from unison.tasks import make_reward, make_task

CKPT_PREFIX = ckpt.PREFIX


class PromptSampler:
    """Epoch-wise shuffled pass over the training prompts; its position is checkpointed."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch, self.pos = size, seed, 0, 0
        self._perm = self._make_perm()

    def _make_perm(self):
        perm = list(range(self.size))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(perm)
        return perm

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.size:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._make_perm()
            take = min(k - len(out), self.size - self.pos)
            out += self._perm[self.pos:self.pos + take]
            self.pos += take
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s):
        self.epoch, self.pos = s["epoch"], s["pos"]
        self._perm = self._make_perm()


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, log=_stderr):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        #: optional callback ``on_step(metrics)`` after each step (progress views)
        self.on_step = None
        self._check_distributed_keys()
        self.dist = init_distributed(cfg.device, cfg.distributed.timeout_s or 600.0)
        self.log = log if self.dist.is_main else (lambda m: None)
        # ---- everything that can be checked is checked before the run directory is touched
        self.policy = resolve_policy(cfg.algo, cfg.policy)
        self.prec = Precision.resolve(cfg.precision, cfg.rollout_precision, cfg.learner_precision)
        if cfg.exact:
            self._check_exact_settings()
        model_dir = resolve_model_dir(cfg.model)
        check_engine_available(cfg.engine, cfg.vllm.mode)
        self.task = make_task(cfg.task)
        self.reward = make_reward(self.task, cfg.task)
        self.tokenizer = load_tokenizer(model_dir)
        self.prompt_ids = [self.task.encode(self.tokenizer, it) for it in self.task.train]
        self._check_data()
        self._check_context(model_dir)
        self._max_len = max(len(p) for p in self.prompt_ids) + cfg.rollout.max_new_tokens
        preflight_engine(cfg.engine, model_dir, self._max_len)
        self.layout = self._check_exact(model_dir) if cfg.exact else None
        self._check_run_dir(resume)

        torch.manual_seed(cfg.seed)
        self.learner = Learner.from_config(cfg, model_dir, self.dist)
        vopts = cfg.vllm.model_dump()
        vopts["sync_dir"] = vopts["sync_dir"] or str(self.run_dir / "weight_sync")
        self.engine = make_engine(cfg.engine, model_dir, self.prec.rollout_dtype, device=str(self.learner.device),
                                  seed=cfg.seed, max_len=self._max_len, exact=cfg.exact,
                                  prompt_width=self.layout[0] if self.layout else None, **vopts)
        self.schedule = make_schedule(cfg.train)
        self.noise = GradNoiseTracker(cfg.train.grad_noise_ema)
        self.sampler = PromptSampler(len(self.task.train), cfg.seed)
        self.step = 0
        self.failed_reward_steps = 0
        self.reward_errors = 0
        resumed_from = self._resume() if resume else None
        self._open_run_dir(resumed_from, resume)
        t, r = cfg.train, cfg.rollout
        self.log(f"[train] {self.task.name}: {len(self.task.train)} training prompts, {len(self.task.eval)} eval; "
                 f"{t.prompts_per_step} prompts x {r.n} samples per step, {t.steps} steps; "
                 f"precision {self.prec.label}, engine {cfg.engine}, world size {self.dist.world_size}")

    # ------------------------------------------------------------------ set-up
    def _check_distributed_keys(self) -> None:
        d = self.cfg.distributed
        set_keys = [k for k, v in d.model_dump().items() if v is not None]
        if set_keys and not under_torchrun():
            raise UnisonError(f"distributed.{set_keys[0]} is set but unison is not running under torchrun: "
                              f"launch with `torchrun --nproc-per-node N -m unison train ...`, or remove "
                              f"the distributed section")

    def _check_data(self) -> None:
        cfg, ws = self.cfg, self.dist.world_size
        n = len(self.task.train)
        if n == 0:
            raise UnisonError("the task has no training prompts: raise task.train_size or check the data")
        if cfg.train.prompts_per_step % ws:
            raise UnisonError(f"train.prompts_per_step={cfg.train.prompts_per_step} is not divisible by the "
                              f"world size {ws}: every rank generates whole prompt groups; use a multiple of {ws}")
        if n < cfg.train.prompts_per_step and cfg.task.name == "math" and not cfg.task.eval_path:
            raise UnisonError(
                f"task.path leaves {n} training prompt(s) after holding out {len(self.task.eval)} for eval, "
                f"fewer than train.prompts_per_step={cfg.train.prompts_per_step}: lower task.eval_size "
                f"or pass task.eval_path")

    def _check_context(self, model_dir: Path) -> None:
        limit = getattr(model_config(model_dir), "max_position_embeddings", None)
        longest = max(range(len(self.prompt_ids)), key=lambda i: len(self.prompt_ids[i]))
        need = len(self.prompt_ids[longest]) + self.cfg.rollout.max_new_tokens
        if limit is not None and need > limit:
            where = self.task.train[longest].meta.get("source") or f"training prompt #{longest}"
            raise UnisonError(
                f"{where}: the prompt has {len(self.prompt_ids[longest])} tokens; with "
                f"rollout.max_new_tokens={self.cfg.rollout.max_new_tokens} that exceeds the model's "
                f"context of {limit}: lower rollout.max_new_tokens or drop long prompts")

    def _check_exact(self, model_dir: Path) -> tuple[int, int]:
        """The model family exact mode needs; the fixed layout (prompt width, total length) the
        engine's cache and the learner's batches share."""
        from unison.exact import check_supported

        check_supported(model_config(model_dir))
        eval_ids = [self.task.encode(self.tokenizer, it) for it in self.task.eval] if self.cfg.train.eval_every else []
        width = max(len(p) for p in self.prompt_ids + eval_ids)
        return width, width + self.cfg.rollout.max_new_tokens

    def _check_exact_settings(self) -> None:
        """Exact mode's requirements on the config, checked first."""
        cfg = self.cfg
        if cfg.engine != "native":
            raise UnisonError(f"exact mode needs the native engine (engine is '{cfg.engine}'): set engine=native "
                              f"or exact=false")
        if cfg.rollout.top_p < 1.0 or cfg.rollout.top_k:
            raise UnisonError("exact mode samples from the full distribution the learner scores: set "
                              "rollout.top_p=1 and rollout.top_k=0")
        if under_torchrun():
            raise UnisonError("exact mode runs in one process: launch without torchrun, or set exact=false")
        if cfg.lora.rank:
            raise UnisonError("exact mode does not take LoRA adapters yet: set lora.rank=0 or exact=false")

    def _check_run_dir(self, resume: bool) -> None:
        """Read-only: refuse an occupied --out without --resume, and a resume of another config."""
        d = self.run_dir
        cfg_path = d / "config.yaml"
        new_cfg = dump_config(self.cfg)
        if d.exists() and not d.is_dir():
            raise UnisonError(f"--out '{d}' exists and is not a directory: choose another path")
        occupied = d.exists() and any(d.iterdir())
        if occupied and not resume:
            what = "a run of a different config" if cfg_path.exists() and cfg_path.read_text() != new_cfg \
                else "a run"
            raise UnisonError(f"--out '{d}' already holds {what}: pass --resume to continue it, "
                              f"or choose a new --out")
        if resume and cfg_path.exists():
            import yaml

            try:
                old = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                raise UnisonError(f"--resume: '{cfg_path}' is damaged ({type(e).__name__}): restore it "
                                  f"or start a new run") from e
            new = yaml.safe_load(new_cfg)
            old.get("train", {}).pop("steps", None)
            new.get("train", {}).pop("steps", None)
            diff = _first_difference(old, new)
            if diff:
                raise UnisonError(f"--resume: the config differs from the run's config.yaml at '{diff}': "
                                  f"resume with the same config (only train.steps may change)")

    def _open_run_dir(self, resumed_from: int | None, resume: bool) -> None:
        """The first writes of the run (rank 0): config.yaml, checkpoints/, metrics, loggers."""
        self.tb = self.wandb = None
        self.dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        if not self.dist.is_main:
            return
        d = self.run_dir
        d.mkdir(parents=True, exist_ok=True)
        (d / "checkpoints").mkdir(exist_ok=True)
        ckpt.clean_partial(d / "checkpoints")
        atomic_write_text(d / "config.yaml", dump_config(self.cfg))
        if resume:
            _truncate_metrics(d / "metrics.jsonl", resumed_from or 0)
        self.tb = self._open_tensorboard()
        self.wandb = self._open_wandb()

    def _open_tensorboard(self):
        if not self.cfg.log.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(str(self.run_dir / "tensorboard"))

    def _open_wandb(self):
        if not self.cfg.log.wandb:
            return None
        try:
            import wandb
        except ImportError as e:
            raise UnisonError("log.wandb is true but wandb is not installed: pip install wandb, "
                              "or set log.wandb=false") from e
        return wandb.init(mode="offline", dir=str(self.run_dir), config=self.cfg.model_dump(mode="json"))

    # --------------------------------------------------------------- the step
    def _my_share(self, k: int) -> tuple[int, int]:
        """This engine replica's contiguous slice of ``k`` prompts."""
        n, r = self.engine.dp_size, self.engine.dp_rank
        return r * k // n, (r + 1) * k // n

    def _gather(self, payload) -> list:
        """Every replica's ``payload``, in replica order, on every rank (the ranks of one
        tensor-parallel vLLM replica hold the same one: it is taken once)."""
        seen, out = set(), []
        for dp_rank, p in self.dist.all_gather_object((self.engine.dp_rank, payload)):
            if dp_rank not in seen:
                seen.add(dp_rank)
                out.append(p)
        return out

    def rollout(self, step: int):
        """Generate, score and (with DAPO) filter one step's groups.

        Returns ``(completions, rewards, info)``: what is trained on, in global prompt order
        on every rank, and ``info`` with the rewards of everything sampled, dropped groups
        and reward errors."""
        cfg, r = self.cfg, self.cfg.rollout
        P = cfg.train.prompts_per_step
        kept, rewards, sampled, dropped, errors, last_error, rounds = [], [], [], 0, 0, None, 0
        while True:
            idx = self.sampler.next(P)
            seed = _step_seed(cfg.seed, step) + 104729 * rounds
            lo, hi = self._my_share(P)
            params = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    max_tokens=r.max_new_tokens, seed=seed,
                                    prompt_seeds=tuple(mix64(seed, j) for j in range(lo, hi)))
            comps = self.engine.generate([self.prompt_ids[i] for i in idx[lo:hi]], params)
            before = self.reward.errors
            rw = self.reward.score_completions(comps, [self.task.train[i] for i in idx[lo:hi]], self.tokenizer)
            for c in comps:  # group id = place in the global batch, unique across oversampling rounds
                c.prompt_index = c.prompt_index + lo + rounds * P
            parts = self._gather((comps, rw, self.reward.errors - before, self.reward.last_error))
            comps = [c for p in parts for c in p[0]]
            rw = [x for p in parts for x in p[1]]
            errors += sum(p[2] for p in parts)
            last_error = next((p[3] for p in parts if p[3]), last_error)
            sampled += rw
            if cfg.train.drop_uniform_groups:
                rt = torch.tensor(rw)
                gid = torch.tensor([c.prompt_index for c in comps])
                keep = ~uniform_groups(rt, gid)
                dropped += int((~keep).sum()) // r.n
                comps = [c for c, k in zip(comps, keep.tolist()) if k]
                rw = [x for x, k in zip(rw, keep.tolist()) if k]
            kept += comps
            rewards += rw
            rounds += 1
            enough = len(kept) >= P * r.n
            if not cfg.train.drop_uniform_groups or enough or rounds > cfg.train.oversample_rounds:
                break
        if len(kept) > P * r.n:  # oversampling overshot: train on the configured batch (whole groups)
            kept, rewards = kept[:P * r.n], rewards[:P * r.n]
        info = {"sampled_rewards": sampled, "dropped": dropped, "errors": errors, "last_error": last_error,
                "rounds": rounds}
        return kept, rewards, info

    def train_step(self) -> dict:
        cfg, pol, step = self.cfg, self.policy, self.step
        t_step = time.perf_counter()
        t0 = time.perf_counter()
        comps, rewards, info = self.rollout(step)
        t_rollout = time.perf_counter() - t0
        sampled = info["sampled_rewards"]
        self.reward_errors += info["errors"]
        metrics: dict = {"step": step + 1,
                         "reward/mean": float(np.mean(sampled)) if sampled else float("nan"),
                         "data/dropped_groups": info["dropped"],
                         "reward/errors": self.reward_errors,
                         "reward/error_count": info["errors"],
                         "reward/error_fraction": info["errors"] / max(len(sampled), 1)}
        self._check_reward_errors(metrics, info)
        if not comps:
            self.log(f"[train] step {step + 1}: every group had uniform rewards; no update")
            metrics.update({"reward/trained_mean": float("nan"), "time/rollout_s": t_rollout})
            self.step += 1
            return metrics

        if cfg.log.rollouts and self.dist.is_main:
            self._write_rollouts(step + 1, comps, rewards)
        batch = collate(comps, self.engine.pad_id, layout=self.layout)
        batch.rewards = torch.tensor(rewards, dtype=torch.float32)
        batch.advantages = ADVANTAGES[pol["advantage"]](batch.rewards, batch.group_ids)
        mask = batch.response_mask
        correct = partial(CORRECTIONS[pol["correction"]], **correction_kwargs(pol))
        fused = (cfg.train.fuse_score_pass and cfg.train.mini_batches == 1 and not pol["bypass"])

        t0 = time.perf_counter()
        if pol["bypass"]:
            batch.logp_old = batch.logp_mu.clone()
        elif not fused:
            batch.logp_old = self.learner.score(batch)
        t_score = time.perf_counter() - t0

        t0 = time.perf_counter()
        if batch.logp_old is not None:
            weights, cmetrics = correct(batch.logp_old, batch.logp_mu, mask)
        else:  # computed per micro-batch from the training forward's own log π_old
            weights = lambda old, mu, m: correct(old, mu, m)[0]  # noqa: E731
        t_tele = time.perf_counter() - t0
        lr = self.schedule.lr(step + 1)

        t0 = time.perf_counter()
        self.engine.sleep()  # a colocated vLLM frees its GPU memory for the update
        t_sleep = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = self.learner.train(batch, weights, lr, seed=_step_seed(cfg.seed, step) + 1)
        t_update = time.perf_counter() - t0

        # mismatch of the learner vs the rollout engine on the sampled tokens; in bypass
        # mode there is no score pass, so use the first mini-batch's forward (θ = θ_old there)
        t0 = time.perf_counter()
        if fused:
            batch.logp_old = stats.logp_first
            _, cmetrics = correct(batch.logp_old, batch.logp_mu, mask)
        # bypass: log π_old is log μ, so π is read from the first mini-batch's forward (its rows)
        rows = stats.first_rows if pol["bypass"] else torch.arange(batch.size)
        logp_pi = stats.logp_first if pol["bypass"] else batch.logp_old
        mm = mismatch_metrics(logp_pi[rows], batch.logp_mu[rows], mask[rows])
        if self.layout is not None and mm["mismatch/identical_fraction"] < 1.0:
            from unison.mismatch import first_difference

            where = first_difference(logp_pi[rows], batch.logp_mu[rows], mask[rows])
            raise UnisonError(f"exact mode broke at step {step + 1}: log μ and log π_old differ at {where}; "
                              f"this is a bug in unison — please report it with the config")
        learner_routing = stats.routing_first if (fused or pol["bypass"]) else self.learner.last_routing
        if learner_routing is not None and "routing" in batch.extras:
            from unison import moe

            mm["mismatch/router_disagreement"] = moe.disagreement(batch.extras["routing"][rows],
                                                                  learner_routing[rows], mask[rows])
        t_tele += time.perf_counter() - t0

        t0 = time.perf_counter()
        self.engine.wake()
        t_wake = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync_metrics = self.engine.sync_weights(self.learner)
        t_sync = time.perf_counter() - t0

        lengths = batch.response_lens.float()
        step_s = time.perf_counter() - t_step
        metrics.update({
            "reward/trained_mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response/truncated_fraction": float(batch.truncated.float().mean()),
            **mm, **cmetrics, **stats.metrics, **self._noise_metrics(stats.noise_terms), **sync_metrics,
            "optim/lr": lr,
            "optim/loss_scale": self.learner.loss_scale,
            "optim/skipped_steps": self.learner.skipped_steps,
            "optim/steps": stats.steps,
            "time/rollout_s": t_rollout, "time/score_s": t_score, "time/update_s": t_update,
            "time/sync_s": t_sync, "time/sleep_s": t_sleep, "time/wake_s": t_wake,
            "time/step_s": step_s, "time/telemetry_s": t_tele,
            "throughput/tokens_per_s": batch.num_response_tokens / max(step_s, 1e-9),
            **_memory_metrics(self.learner.device),
        })
        metrics.update(self.schedule.observe(step + 1, metrics))
        self.step += 1
        return metrics

    def _noise_metrics(self, terms: list[dict]) -> dict:
        if not terms:
            return {}
        avg = {k: sum(x[k] for x in terms) / len(terms) for k in terms[0]}
        avg["grad_noise/noise_scale"] = (avg["grad_noise/trace_sigma"] / avg["grad_noise/grad_sq"]
                                         if avg["grad_noise/grad_sq"] else float("nan"))
        return self.noise.update(avg)

    def _check_reward_errors(self, metrics: dict, info: dict) -> None:
        t = self.cfg.task
        n = max(len(info["sampled_rewards"]), 1)
        frac = info["errors"] / n
        if info["errors"] and frac > t.reward_error_warn:
            self.log(f"[train] WARNING step {metrics['step']}: {info['errors']} of {n} rewards raised "
                     f"(scored 0); last: {info['last_error']}")
        self.failed_reward_steps = self.failed_reward_steps + 1 if info["errors"] >= n else 0
        if t.reward_error_patience and self.failed_reward_steps >= t.reward_error_patience:
            raise UnisonError(f"every reward raised for {self.failed_reward_steps} consecutive steps "
                              f"(last: {info['last_error']}): fix the reward function (task.reward) and "
                              f"continue with --resume from the last checkpoint")

    # -------------------------------------------------------------------- run
    def fit(self) -> dict:
        cfg = self.cfg
        total = cfg.train.steps
        if self.step >= total:
            self.log(f"[train] nothing to do: the run is at step {self.step} of {total}")
        t_start = time.perf_counter()
        first_step = self.step
        last: dict = {}
        history = []
        while self.step < total:
            metrics = self.train_step()
            if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == total):
                metrics["eval/accuracy"] = self.evaluate()
            self._write_metrics(metrics)
            history.append(metrics)
            last = metrics
            if self.on_step is not None:
                self.on_step(metrics)
            if cfg.log.console:
                done = self.step - first_step
                eta = (time.perf_counter() - t_start) / done * (total - self.step)
                self.log(_console_line(metrics, total, eta))
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < total:
                self.save_checkpoint()
        if history or not ckpt.complete(self.run_dir / "checkpoints"):
            self.save_checkpoint()
        summary = self._summary(last, time.perf_counter() - t_start)
        if self.dist.is_main:
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
            try:
                from unison.report import write_report

                write_report([self.run_dir], self.run_dir, title=f"run {self.run_dir.name}")
            except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the run
                self.log(f"[train] report skipped: {e}")
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()
        return summary

    def evaluate(self) -> float:
        """Greedy accuracy on the eval split (each rank answers its share)."""
        from unison.filter import pass_rates

        items = self.task.eval
        if not items:
            return float("nan")
        lo, hi = self._my_share(len(items))
        mine = items[lo:hi]
        rates = pass_rates(self.engine, self.task, self.reward, mine, self.tokenizer, 1, 0.0,
                           self.cfg.rollout.max_new_tokens, self.cfg.seed) if mine else []
        rates = [x for part in self._gather(rates) for x in part]
        return sum(rates) / len(rates)

    def _summary(self, last: dict, wall: float) -> dict:
        rows = read_metrics(self.run_dir / "metrics.jsonl") if self.dist.is_main else []
        rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), float)]
        return {"steps": self.step, "precision": self.prec.label, "algo": self.cfg.algo,
                "world_size": self.dist.world_size,
                "reward_first": rewards[0] if rewards else None,
                "reward_last": rewards[-1] if rewards else None,
                "reward_last5_mean": float(np.mean(rewards[-5:])) if rewards else None,
                "skipped_steps": self.learner.skipped_steps, "wall_s_this_session": wall,
                "final": {k: v for k, v in last.items() if not k.startswith("time/")}}

    def _write_metrics(self, metrics: dict) -> None:
        if not self.dist.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, metrics["step"])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if k != "step"}, step=metrics["step"])

    def _write_rollouts(self, step: int, comps, rewards) -> None:
        tok = self.tokenizer
        rows = [{"group": c.prompt_index, "sample": c.sample_index,
                 "prompt": tok.decode(c.prompt_ids, skip_special_tokens=True),
                 "response": tok.decode(c.token_ids, skip_special_tokens=True), "reward": r,
                 "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                 "logp_mu_sum": float(sum(c.logprobs))} for c, r in zip(comps, rewards)]
        atomic_write_text(self.run_dir / "rollouts" / f"step_{step:06d}.jsonl",
                          "".join(json.dumps(r) + "\n" for r in rows))

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
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state()}, tmp / f"rng_rank{d.rank}.pt")
        d.barrier()
        if d.is_main:
            state = {"step": self.step, "world_size": d.world_size, "learner": self.learner.state_dict(),
                     "schedule": self.schedule.state_dict(), "sampler": self.sampler.state_dict(),
                     "grad_noise": self.noise.state_dict(), "reward_errors": self.reward_errors,
                     "failed_reward_steps": self.failed_reward_steps}
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
                if i:
                    self.log(f"[train] resumed from {ck.name} (step {self.step}), the newest usable checkpoint")
                else:
                    self.log(f"[train] resumed from {ck.name} (step {self.step})")
                return self.step
            later = f"; falling back to {found[i + 1].name}" if i + 1 < len(found) else ""
            self.log(f"[train] --resume: checkpoint {ck.name} is damaged ({problem}){later}")
        raise UnisonError(f"--resume: no usable checkpoint in '{ckdir}' (every one is damaged): "
                          f"start a new run with another --out")

    def _try_load(self, ck: Path) -> str | None:
        """Load ``ck`` into every component; a one-line reason if it cannot be read."""
        try:
            state = torch.load(ck / "trainer_state.pt", weights_only=False)
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
        self.sampler.load_state_dict(state["sampler"])
        self.reward_errors = state.get("reward_errors", 0)
        self.failed_reward_steps = state.get("failed_reward_steps", 0)
        rng = ck / f"rng_rank{self.dist.rank}.pt"
        if rng.exists():  # absent when resuming on more ranks than wrote the checkpoint
            r = torch.load(rng, weights_only=False)
            torch.set_rng_state(r["torch"])
            random.setstate(r["python"])
            np.random.set_state(r["numpy"])
        self.step = state["step"]
        self.engine.sync_weights(self.learner)
        return None


# ------------------------------------------------------------------ helpers
def _memory_metrics(device: torch.device) -> dict:
    """Peak resident memory of this process (rank 0) and, on CUDA, peak allocated GPU memory."""
    import resource

    out = {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device.type == "cuda":
        out["memory/cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _truncate_metrics(path: Path, step: int) -> None:
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def _first_difference(a, b, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
            if d:
                return d
        return None
    return None if a == b else prefix.rstrip(".")


def _console_line(m: dict, total: int, eta: float) -> str:
    def f(key, fmt):
        v = m.get(key)
        return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    line = (f"[train] step {m['step']}/{total} reward {f('reward/mean', '.3f')} "
            f"len {f('response_length/mean', '.1f')} k3 {f('mismatch/k3', '.2e')} "
            f"lr {f('optim/lr', '.2e')} scale {f('optim/loss_scale', '.0f')} "
            f"tok/s {f('throughput/tokens_per_s', '.0f')} ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    if m.get("reward/error_count"):
        line += f" reward-errors {m['reward/error_count']}"
    if "eval/accuracy" in m:
        line += f" eval {m['eval/accuracy']:.3f}"
    return line
