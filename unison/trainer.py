"""The RL loop (``unison train``). One step, as in the papers' algorithm box:

    1. sample prompts; the rollout engine μ generates n responses each (log μ per token)
    2. verifier rewards; group advantages (Dr.GRPO by default)
    3. learner score pass: log π_old (or log μ with ``policy.bypass``)
    4. mismatch metrics of (π_old, μ); correction weights (e.g. Token-TIS min(ρ_t, C))
    5. policy loss over mini-batches (gradient accumulation over micro-batches),
       AdamW on fp32 master weights; fp16 uses dynamic loss scaling and skips
       non-finite steps
    6. sync weights to the rollout engine (cast to its dtype)
    7. metrics.jsonl / TensorBoard / console; checkpoints; the LR schedule observes the step
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from unison.algorithms.advantages import ADVANTAGES, uniform_groups
from unison.algorithms.corrections import CORRECTIONS
from unison.algorithms.losses import LOSSES, aggregate
from unison.algorithms.presets import correction_kwargs, loss_kwargs, resolve_policy
from unison.batch import collate
from unison.config import Config, dump_config
from unison.data_io import atomic_write_text
from unison.errors import UnisonError
from unison.learner import Learner, token_logprobs
from unison.mismatch import mismatch_metrics
from unison.models import resolve_model_dir, save_model_dir
from unison.precision import Precision, make_grad_scaler
from unison.rollout import SamplingParams, check_engine_available, make_engine
from unison.schedules import GradNoiseTracker, make_schedule, noise_scale_terms
from unison.sft import evaluate
from unison.tasks import make_reward, make_task

CKPT_PREFIX = "step_"


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


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False,
                 log=lambda m: print(m, file=sys.stderr, flush=True)):
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        #: optional callback ``on_step(metrics)`` after each step (progress views)
        self.on_step = None
        self.policy = resolve_policy(cfg.algo, cfg.policy)
        self.prec = Precision.resolve(cfg.precision, cfg.rollout_precision, cfg.learner_precision)
        model_dir = resolve_model_dir(cfg.model)
        check_engine_available(cfg.engine)
        self.task = make_task(cfg.task)
        self.reward = make_reward(self.task, cfg.task)
        if not self.task.train:
            raise UnisonError("the task has no training prompts: raise task.train_size or check the data")
        self._prepare_run_dir(resume)

        torch.manual_seed(cfg.seed)
        self.learner = Learner(model_dir, compute_dtype=self.prec.learner_dtype, device=cfg.device,
                               temperature=cfg.rollout.temperature)
        self.tokenizer = self.learner.tokenizer
        self.engine = make_engine(cfg.engine, model_dir, self.prec.rollout_dtype, device=cfg.device,
                                  seed=cfg.seed, **cfg.vllm.model_dump())
        self.prompt_ids = [self.task.encode(self.tokenizer, it) for it in self.task.train]
        self._check_context()

        t = cfg.train
        self.params = [p for p in self.learner.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                                     weight_decay=t.weight_decay)
        self.scaler = make_grad_scaler(self.prec, cfg.device, init_scale=cfg.scaler.init_scale,
                                       growth_interval=cfg.scaler.growth_interval)
        self.schedule = make_schedule(t)
        self.noise = GradNoiseTracker(t.grad_noise_ema)
        self.sampler = PromptSampler(len(self.task.train), cfg.seed)
        self.step = 0
        self.skipped_steps = 0
        self.tb = self._open_tensorboard()
        self.wandb = self._open_wandb()
        if resume:
            self._resume()

    # ------------------------------------------------------------------ set-up
    def _prepare_run_dir(self, resume: bool) -> None:
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

            old, new = yaml.safe_load(cfg_path.read_text()), yaml.safe_load(new_cfg)
            old.get("train", {}).pop("steps", None)
            new.get("train", {}).pop("steps", None)
            diff = _first_difference(old, new)
            if diff:
                raise UnisonError(f"--resume: the config differs from the run's config.yaml at '{diff}': "
                                  f"resume with the same config (only train.steps may change)")
        d.mkdir(parents=True, exist_ok=True)
        (d / "checkpoints").mkdir(exist_ok=True)
        atomic_write_text(cfg_path, new_cfg)

    def _check_context(self) -> None:
        limit = getattr(self.learner.model.config, "max_position_embeddings", None)
        longest = max(range(len(self.prompt_ids)), key=lambda i: len(self.prompt_ids[i]))
        need = len(self.prompt_ids[longest]) + self.cfg.rollout.max_new_tokens
        if limit is not None and need > limit:
            raise UnisonError(
                f"training prompt #{longest} has {len(self.prompt_ids[longest])} tokens; with "
                f"rollout.max_new_tokens={self.cfg.rollout.max_new_tokens} that exceeds the model's "
                f"context of {limit}: lower rollout.max_new_tokens or drop long prompts")

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
    def rollout(self, step: int):
        cfg = self.cfg
        r = cfg.rollout
        params = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_tokens=r.max_new_tokens, seed=_step_seed(cfg.seed, step))
        kept, rewards, dropped, rounds = [], [], 0, 0
        while True:
            idx = self.sampler.next(cfg.train.prompts_per_step)
            comps = self.engine.generate([self.prompt_ids[i] for i in idx], params)
            rw = self.reward.score_completions(comps, [self.task.train[i] for i in idx], self.tokenizer)
            for c in comps:  # group id = prompt index, unique across oversampling rounds
                c.prompt_index = c.prompt_index + rounds * cfg.train.prompts_per_step
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
            enough = len(kept) >= cfg.train.prompts_per_step * r.n
            if not cfg.train.drop_uniform_groups or enough or rounds > cfg.train.oversample_rounds:
                break
            params = SamplingParams(**{**params.__dict__, "seed": params.seed + 104729 * rounds})
        return kept, rewards, dropped

    def train_step(self) -> dict:
        pol, step = self.policy, self.step
        t_step = time.perf_counter()
        t0 = time.perf_counter()
        comps, rewards, dropped = self.rollout(step)
        t_rollout = time.perf_counter() - t0
        metrics: dict = {"step": step + 1}
        all_rewards = torch.tensor(rewards, dtype=torch.float32)
        metrics["data/dropped_groups"] = dropped
        metrics["reward/errors"] = self.reward.errors
        if not comps:
            self.log(f"[train] step {step + 1}: every group had uniform rewards; no update")
            metrics.update({"reward/mean": float("nan"), "time/rollout_s": t_rollout})
            self.step += 1
            return metrics

        batch = collate(comps, self.engine.pad_id)
        batch.rewards = all_rewards
        batch.advantages = ADVANTAGES[pol["advantage"]](batch.rewards, batch.group_ids)
        mask = batch.response_mask

        t0 = time.perf_counter()
        batch.logp_old = batch.logp_mu.clone() if pol["bypass"] else self.learner.score(batch)
        t_score = time.perf_counter() - t0

        t0 = time.perf_counter()
        weights, cmetrics = CORRECTIONS[pol["correction"]](batch.logp_old, batch.logp_mu, mask,
                                                           **correction_kwargs(pol))
        t_tele = time.perf_counter() - t0
        lr = self.schedule.lr(step + 1)
        for g in self.opt.param_groups:
            g["lr"] = lr

        t0 = time.perf_counter()
        umetrics, logp_first = self.update(batch, weights)
        t_update = time.perf_counter() - t0

        # mismatch of the learner vs the rollout engine on the sampled tokens; in bypass
        # mode there is no score pass, so use the first mini-batch's forward (θ = θ_old there)
        t0 = time.perf_counter()
        if pol["bypass"]:
            rows = logp_first["rows"]
            mm = mismatch_metrics(logp_first["logp"], batch.logp_mu[rows], mask[rows])
        else:
            mm = mismatch_metrics(batch.logp_old, batch.logp_mu, mask)
        t_tele += time.perf_counter() - t0

        t0 = time.perf_counter()
        self.engine.load_weights(self.learner.named_weights())
        t_sync = time.perf_counter() - t0

        lengths = batch.response_lens.float()
        n_tokens = batch.num_response_tokens
        step_s = time.perf_counter() - t_step
        metrics.update({
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response/truncated_fraction": float(batch.truncated.float().mean()),
            **mm, **cmetrics, **umetrics,
            "optim/lr": lr,
            "optim/loss_scale": float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0,
            "optim/skipped_steps": self.skipped_steps,
            "time/rollout_s": t_rollout, "time/score_s": t_score, "time/update_s": t_update,
            "time/sync_s": t_sync, "time/step_s": step_s, "time/telemetry_s": t_tele,
            "throughput/tokens_per_s": n_tokens / max(step_s, 1e-9),
        })
        metrics.update(self.schedule.observe(step + 1, metrics))
        self.step += 1
        return metrics

    def update(self, batch, weights):
        """Mini-batch optimizer steps with micro-batch gradient accumulation."""
        cfg, pol, t = self.cfg, self.policy, self.cfg.train
        model = self.learner.model
        model.train()
        loss_fn, loss_kw = LOSSES[pol["loss"]], loss_kwargs(pol)
        g = torch.Generator().manual_seed(_step_seed(cfg.seed, self.step) + 1)
        order = torch.randperm(batch.size, generator=g)
        chunks = [c for c in order.chunk(min(t.mini_batches, batch.size))]
        sums = {"policy/loss": 0.0, "policy/clip_fraction": 0.0, "policy/entropy": 0.0,
                "optim/grad_norm": 0.0}
        first = {"rows": chunks[0], "logp": torch.zeros((len(chunks[0]), batch.tokens.shape[1]))}
        n_opt = 0
        noise_terms = []
        per_token_units = pol["loss_agg"] == "token_mean"  # batch size in tokens, else in responses
        for mb_i, mb in enumerate(chunks):
            mask_mb = batch.response_mask[mb]
            n_tok, n_seq = int(mask_mb.sum()), len(mb)
            self.opt.zero_grad(set_to_none=True)
            loss_total, ent_sum = 0.0, 0.0
            track = t.grad_noise and len(mb) > t.micro_batch_size
            prev = [torch.zeros_like(p) for p in self.params] if track else None
            micro_sq, micro_units = [], []
            for start in range(0, len(mb), t.micro_batch_size):
                rows = mb[start:start + t.micro_batch_size]
                m = batch.response_mask[rows].to(cfg.device)
                logp, ent = token_logprobs(model, batch.tokens[rows], batch.attention_mask[rows],
                                           cfg.rollout.temperature, self.prec.learner_dtype, cfg.device,
                                           return_entropy=True)
                per_tok, lm = loss_fn(logp, batch.logp_old[rows].to(cfg.device),
                                      batch.logp_mu[rows].to(cfg.device),
                                      batch.advantages[rows].to(cfg.device),
                                      weights[rows].to(cfg.device), m, **loss_kw)
                loss = aggregate(per_tok, pol["loss_agg"], m, n_tok, n_seq, cfg.rollout.max_new_tokens)
                self.scaler.scale(loss).backward()
                loss_total += float(loss.detach())
                if track:  # this micro-batch's share of the gradient, as a difference of sums
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
                    diffs = torch._foreach_sub(grads, prev)
                    micro_sq.append(torch.stack(torch._foreach_norm(diffs)).double().pow(2).sum())
                    torch._foreach_copy_(prev, grads)
                    micro_units.append(float(m.sum()) if per_token_units else len(rows))
                frac = float(m.sum()) / max(n_tok, 1)
                for k, v in lm.items():  # *_max: max; others: token-weighted mean
                    if k.endswith("_max"):
                        sums[k] = max(sums.get(k, v), v)
                    else:
                        sums[k] = sums.get(k, 0.0) + v * frac / len(chunks)
                ent_sum += float((ent * m).sum())
                if mb_i == 0:
                    first["logp"][start:start + len(rows)] = logp.detach().float().cpu()
            scale_used = float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0
            self.scaler.unscale_(self.opt)
            gn = float(torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip))
            finite = math.isfinite(gn) and math.isfinite(loss_total)
            if self.scaler.is_enabled():
                self.scaler.step(self.opt)  # skips the step itself on inf/NaN gradients
            elif finite:
                self.opt.step()
            self.scaler.update()
            if not finite:
                self.skipped_steps += 1
            else:
                sums["optim/grad_norm"] += gn
                n_opt += 1
                if track and len(micro_sq) > 1:
                    big_units = sum(micro_units)
                    # micro shares were measured scaled (fp16); c_k = (B_k/B)·g_k -> |g_k|² = |c_k|²·(B/B_k)²
                    small = [float(sq) / scale_used**2 * (big_units / u) ** 2
                             for sq, u in zip(micro_sq, micro_units)]
                    pre_clip_sq = gn ** 2
                    noise_terms.append(noise_scale_terms(sum(small) / len(small),
                                                         big_units / len(small), pre_clip_sq, big_units))
            sums["policy/loss"] += loss_total / len(chunks)
            sums["policy/entropy"] += ent_sum / max(n_tok, 1) / len(chunks)
        sums["optim/grad_norm"] = sums["optim/grad_norm"] / n_opt if n_opt else float("nan")
        noise_terms = [x for x in noise_terms if x]
        if noise_terms:
            avg = {k: sum(x[k] for x in noise_terms) / len(noise_terms) for k in noise_terms[0]}
            avg["grad_noise/noise_scale"] = (avg["grad_noise/trace_sigma"] / avg["grad_noise/grad_sq"]
                                             if avg["grad_noise/grad_sq"] else float("nan"))
            sums.update(self.noise.update(avg))
        model.eval()
        return sums, first

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
        if history or not self._latest_checkpoint():
            self.save_checkpoint()
        summary = self._summary(last, time.perf_counter() - t_start)
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
        items = self.task.eval
        return evaluate(self.engine, self.task, self.reward, items, self.tokenizer, 0.0,
                        self.cfg.rollout.max_new_tokens)

    def _summary(self, last: dict, wall: float) -> dict:
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), float)]
        return {"steps": self.step, "precision": self.prec.label, "algo": self.cfg.algo,
                "reward_first": rewards[0] if rewards else None,
                "reward_last": rewards[-1] if rewards else None,
                "reward_last5_mean": float(np.mean(rewards[-5:])) if rewards else None,
                "skipped_steps": self.skipped_steps, "wall_s_this_session": wall,
                "final": {k: v for k, v in last.items() if not k.startswith("time/")}}

    def _write_metrics(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, metrics["step"])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if k != "step"}, step=metrics["step"])

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        ckdir = self.run_dir / "checkpoints"
        final = ckdir / f"{CKPT_PREFIX}{self.step:06d}"
        tmp = ckdir / f".tmp-{CKPT_PREFIX}{self.step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model_dir(self.learner.model, self.tokenizer, tmp / "model")
        state = {
            "step": self.step, "skipped_steps": self.skipped_steps,
            "optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict(),
            "schedule": self.schedule.state_dict(), "sampler": self.sampler.state_dict(),
            "grad_noise": self.noise.state_dict(),
            "reward_errors": self.reward.errors,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state()},
        }
        torch.save(state, tmp / "trainer_state.pt")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckdir)
        for old in sorted(p for p in ckdir.iterdir() if p.name.startswith(CKPT_PREFIX))[:-self.cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _latest_checkpoint(self) -> Path | None:
        ckdir = self.run_dir / "checkpoints"
        done = sorted(p for p in ckdir.glob(f"{CKPT_PREFIX}*") if (p / "trainer_state.pt").exists())
        return done[-1] if done else None

    def _resume(self) -> None:
        ckdir = self.run_dir / "checkpoints"
        for tmp in ckdir.glob(".tmp-*"):  # a checkpoint interrupted mid-write
            shutil.rmtree(tmp, ignore_errors=True)
        ck = self._latest_checkpoint()
        if ck is None:
            self.log("[train] --resume: no checkpoint yet, starting from step 0")
            _truncate_metrics(self.run_dir / "metrics.jsonl", 0)
            return
        from safetensors.torch import load_file

        weights = {}
        for f in sorted((ck / "model").glob("*.safetensors")):
            weights.update(load_file(f))
        missing, unexpected = self.learner.model.load_state_dict(weights, strict=False)
        tied = getattr(self.learner.model.config, "tie_word_embeddings", False)
        missing = [k for k in missing if not (tied and k == "lm_head.weight")]  # saved once when tied
        if missing or unexpected:
            raise UnisonError(f"checkpoint '{ck}' does not match the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}): resume with the run's own config")
        state = torch.load(ck / "trainer_state.pt", weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.schedule.load_state_dict(state["schedule"])
        self.noise.load_state_dict(state["grad_noise"])
        self.sampler.load_state_dict(state["sampler"])
        self.reward.errors = state.get("reward_errors", 0)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        self.engine.load_weights(self.learner.named_weights())
        _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.log(f"[train] resumed from {ck.name} (step {self.step})")


# ------------------------------------------------------------------ helpers
def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_metrics(path: Path, step: int) -> None:
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


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
    if "eval/accuracy" in m:
        line += f" eval {m['eval/accuracy']:.3f}"
    return line
