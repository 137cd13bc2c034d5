"""The learner: the policy π of unison/policy.py plus everything about its update.

It owns the optimizer (AdamW on the fp32 master weights), the loss scaler (fp16), gradient clipping on the
global norm, skipped-step accounting, mini-batch steps with micro-batch gradient accumulation, and the
gradient-noise probe (docs/architecture.md; docs/distributed.md). One class serves one process and
``torchrun`` + FSDP2 — every rank trains on its share of each mini-batch, normalisers are global, so the gradient
equals the one-process gradient of the same batch — and the loop cannot tell which it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unison import lora
from unison import moe
from unison.algorithms.losses import LOSSES, aggregate
from unison.algorithms.presets import loss_kwargs
from unison.algorithms.presets import resolve_policy
from unison.batch import RolloutBatch
from unison.distributed import Dist, current, full_tensor
from unison.optim import GradNoiseProbe, adamw
from unison.policy import Scorer, ScoringOptions
from unison.precision import Precision
from unison.precision import make_grad_scaler
from unison.runtime import small_model
from unison.sides import Side
from unison.sides import config_sides


@dataclass
class UpdateStats:
    """What one ``Learner.train`` call did."""

    metrics: dict[str, float]
    #: optimizer steps taken (not skipped)
    steps: int
    #: optimizer steps skipped (non-finite gradients or loss)
    skipped: int
    #: log π at θ_old of the rows of the first mini-batch (exactly the score pass's quantity,
    #: from the training forward); 0 on other rows
    logp_first: torch.Tensor
    first_rows: torch.Tensor
    noise_terms: list[dict] = field(default_factory=list)
    #: MoE: the learner's expert choices in the first mini-batch's forward, [B, L, layers, k]
    routing_first: torch.Tensor | None = None


class Learner(Scorer):
    """The policy π in fp32 that scores rollouts (:class:`unison.policy.Scorer`), trains on them and checkpoints
    its optimizer. Built for scoring only (``Learner(model_dir)``, as ``unison probe`` does) or for training
    (:meth:`from_config`, with the optimizer and the loss)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.opt = None
        self.scaler = None
        self.skipped_steps = 0
        #: on-policy distillation with ``distill.estimator: full``: (the teacher, coef) — the loss adds
        #: coef · w_t · KL(π(·|s_t) ‖ π_T(·|s_t)) per response token (unison/teacher.py gives the teacher's side)
        self.distill: tuple | None = None

    @classmethod
    def from_config(cls, cfg, model_dir: str | Path, dist: Dist | None = None, side: Side | None = None,
                    policy: dict | None = None) -> Learner:
        """A learner ready to train: the config's optimizer, loss scaler and policy; ``side``: its numerics as the
        run decided them (the :class:`~unison.sides.Machine`'s learner; from the config alone when not given);
        ``policy`` as the caller resolved it (resolved here when not given)."""
        prec = Precision.resolve(cfg.precision, cfg.rollout_precision, cfg.learner_precision)
        side = side or config_sides(cfg, prec, (dist or current()).world_size)[1]
        t = cfg.train
        self = cls(model_dir, side, ScoringOptions.from_config(cfg), lora=cfg.lora, dist=dist)
        self.train_cfg, self.max_new_tokens = t, cfg.rollout.max_new_tokens
        self.policy = policy or resolve_policy(cfg.algo, cfg.policy)
        self.params = [p for p in self.forward_module.parameters() if p.requires_grad]
        self.opt = adamw(self.params, not small_model(self.forward_module), lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                         weight_decay=t.weight_decay)
        if self.sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type, init_scale=cfg.scaler.init_scale,
                                            growth_interval=cfg.scaler.growth_interval,
                                            enabled=prec.uses_loss_scaling)
        else:
            self.scaler = make_grad_scaler(prec, self.device, init_scale=cfg.scaler.init_scale,
                                           growth_interval=cfg.scaler.growth_interval)
        self.noise = GradNoiseProbe(self.params, self.dist) if t.grad_noise else None
        return self

    # ----------------------------------------------------------------- update
    def train(self, batch: RolloutBatch, old_logp, weights, lr: float, seed: int = 0,
              loss_mask: torch.Tensor | None = None) -> UpdateStats:
        """``train.mini_batches`` optimizer steps on ``batch`` (collective when sharded).

        ``old_logp(rows, logp, logp_mu, mini_batch_index)``: log π_old of a micro-batch's rows
        (:class:`unison.algorithms.anchors.OldLogp`: the score pass, μ, the detached training
        forward itself, or AReaL's log-linear approximation). ``weights``: the correction's
        per-token weights [B, L], or a function ``(logp_old, logp_mu, mask) -> weights``
        evaluated per micro-batch on that log π_old.
        The rows are split into mini-batches by a permutation seeded with ``seed``;
        every normaliser counts the whole mini-batch on every rank. ``loss_mask`` [B, L]: the tokens the loss counts,
        where a correction drops some from it (M2PO under a token mean, AReaL's normaliser); the response tokens
        otherwise. The entropy and the metrics' weights stay over the response tokens.
        """
        if self.opt is None:
            raise RuntimeError("this learner was built for scoring only: use Learner.from_config")
        t, pol, ws, rank = self.train_cfg, self.policy, self.dist.world_size, self.dist.rank
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.model.eval()  # dropout off in every forward, as in the score pass (TRL: disable_dropout)
        if self.peft is not None:  # except LoRA's own dropout, when configured, in training forwards
            for d in lora.dropout_modules(self.model):
                d.train()
        order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(seed))
        minis = list(order.tensor_split(min(t.mini_batches, batch.size)))  # exactly that many, sizes ±1
        per_token_units = pol["loss_agg"] == "token_mean"  # batch size in tokens, else in responses
        sums: dict[str, float] = {"policy/loss": 0.0, "policy/entropy": 0.0}
        maxes: dict[str, float] = {}
        grad_norms, noise_terms, n_opt, skipped = [], [], 0, 0
        first_rows = minis[0]
        logp_first = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        routing_first = moe.routing_buffer(self.model, batch.tokens.shape) if self.moe else None
        counted = batch.response_mask if loss_mask is None else loss_mask
        for mb_i, mb in enumerate(minis):
            n_tok, n_seq = int(batch.response_mask[mb].sum()), len(mb)
            n_loss = int(counted[mb].sum())
            shares = self._shares(mb, batch)
            mine, n_micro = shares[rank], max(len(s) for s in shares)
            track = self.noise is not None and n_micro > 1
            self.opt.zero_grad(set_to_none=True)
            if track:
                self.noise.begin()
            loss_sum, ent_sum = 0.0, 0.0
            local: dict[str, float] = {}
            for i in range(n_micro):
                dummy = i >= len(mine)  # this rank has no rows left: a zero-weight forward keeps FSDP in step
                rows = mb[:1] if dummy else mine[i]
                first = mb_i == 0 and not dummy
                loss, logp, ent, m, lm = self._micro_loss(batch, rows, mb_i, old_logp, weights, loss_mask, n_loss,
                                                          n_seq, routing_first if first else None)
                W = logp.shape[1]
                share = 0.0 if dummy else 1.0
                self.scaler.scale(loss * (ws * share)).backward()
                loss_sum += float(loss.detach()) * share
                ent_sum += float((ent * m).sum()) * share
                frac = share * float(m.sum()) / max(n_tok, 1)
                for k, v in lm.items():  # *_max: max; others: token-weighted mean
                    if k.endswith("_max"):
                        maxes[k] = max(maxes.get(k, -math.inf), v if not dummy else -math.inf)
                    else:
                        local[k] = local.get(k, 0.0) + v * frac
                if track:
                    self.noise.after_micro_backward(self._micro_units(batch, shares, i, per_token_units))
                if first:
                    logp_first[rows, :W] = logp.detach().float().cpu() * batch.response_mask[rows, :W]
            red = self._reduce({"loss": loss_sum, "ent": ent_sum, **local})
            scale_used = float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0
            self.scaler.unscale_(self.opt)
            gn = self._clip()
            finite = math.isfinite(gn) and math.isfinite(red["loss"])
            if self.scaler.is_enabled():
                self.scaler.step(self.opt)  # skips the step itself on inf/NaN gradients (all ranks agree)
            elif finite:
                self.opt.step()
            self.scaler.update()
            if finite:
                grad_norms.append(gn)
                n_opt += 1
                if track:
                    noise_terms.append(self.noise.after_step(scale_used, gn))
            else:
                skipped += 1
            sums["policy/loss"] += red.pop("loss") / len(minis)
            sums["policy/entropy"] += red.pop("ent") / max(n_tok, 1) / len(minis)
            for k, v in red.items():
                sums[k] = sums.get(k, 0.0) + v / len(minis)
        self.skipped_steps += skipped
        self.model.eval()
        for k, v in self._reduce(maxes, op="max").items():
            sums[k] = v
        sums["optim/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        self.dist.all_reduce_(logp_first, "sum")  # each rank filled only its own rows
        return UpdateStats(metrics=sums, steps=n_opt, skipped=skipped, logp_first=logp_first,
                           first_rows=first_rows, noise_terms=[x for x in noise_terms if x],
                           routing_first=moe.gather_routing(routing_first, self.dist))

    def _micro_loss(self, batch, rows, mb_i: int, old_logp, weights, loss_mask, n_loss: int, n_seq: int, routing_out):
        """One micro-batch's loss (its share of the mini-batch's, with the mini-batch's normalisers ``n_loss`` tokens
        and ``n_seq`` responses), log π and the entropy at its own width, its response mask and the loss metrics."""
        pol = self.policy
        out = self._forward(batch, rows, return_entropy=True, routing_out=routing_out,
                            teacher=self.distill[0] if self.distill else None)
        logp, ent = out[0], out[1]
        W = logp.shape[1]  # the micro-batch's own width: every per-token tensor is cut to it
        m = batch.response_mask[rows, :W].to(self.device)
        mu = batch.logp_mu[rows, :W].to(self.device)
        old = old_logp(rows, logp, mu, mb_i)[:, :W]
        w = weights(old, mu, m) if callable(weights) else weights[rows, :W].to(self.device)
        adv = batch.advantages[rows]
        adv = adv[:, :W] if adv.dim() == 2 else adv  # per-token advantages (distillation): cut too
        lmask = m if loss_mask is None else loss_mask[rows, :W].to(self.device)
        per_tok, lm = LOSSES[pol["loss"]](logp, old, mu, adv.to(self.device), w, lmask, **loss_kwargs(pol))
        if self.distill:  # the exact reverse KL of each position to the teacher's, minimised directly
            kl = out[2] * lmask
            per_tok = per_tok + self.distill[1] * w * kl
            lm = {**lm, "distill/reverse_kl_full": float(kl.detach().sum() / lmask.sum().clamp(min=1))}
        loss = aggregate(per_tok, pol["loss_agg"], lmask, n_loss, n_seq, self.max_new_tokens)
        if self.moe and self.forward_module.aux_loss_coef:  # the router's load-balancing loss, by this share of rows
            aux = self.forward_module.last_aux_loss
            loss = loss + self.forward_module.aux_loss_coef * aux * (len(rows) / n_seq)
            lm = {**lm, "moe/aux_loss": float(aux.detach())}
        return loss, logp, ent, m, lm

    def _micro_units(self, batch, shares, i, per_token: bool) -> float:
        """Size of micro-step ``i`` over all ranks, in tokens or responses."""
        rows = [s[i] for s in shares if i < len(s)]
        if not rows:
            return 0.0
        rows = torch.cat(rows)
        return float(batch.response_mask[rows].sum()) if per_token else float(len(rows))

    def _reduce(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        if not self.dist.enabled or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        self.dist.all_reduce_(t, op)
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    def _clip(self) -> float:
        """Clip to ``train.grad_clip`` by the global norm over every shard; the pre-clip norm."""
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.grad_clip)
        return float(full_tensor(gn))

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1.0 when no scaler is active)."""
        return float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else 1.0

    # ------------------------------------------------------------- checkpoints (unison/checkpoint.py)
    def state_dict(self) -> dict:
        """The learner's small state: the loss scaler and the skipped steps (unison/checkpoint.py writes its weights
        and its optimizer's state itself)."""
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else {},
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
