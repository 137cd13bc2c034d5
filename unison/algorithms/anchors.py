"""Which log π is π_old: the one place that decides it (``policy.anchor``).

π_old is the policy the PPO ratio r_t = π_θ/π_old is clipped around and the policy the
mismatch corrections compare μ with (ρ_t = π_old/μ). With off-policy data (the rollout
engine runs ahead by up to ``rollout.max_staleness`` versions, docs/async.md) the choice
matters, and every option is a published one:

* ``recompute`` (default): the learner's score pass under the weights of this step, θ_old —
  AReaL's *decoupled PPO* (Hilton et al. 2021; AReaL ``use_decoupled_loss``) when a correction
  is on: clip around the recomputed proximal policy, weight by π_prox/μ. With one mini-batch
  per rollout the score pass is **fused** into the training forward (θ = θ_old there, so the
  detached forward *is* log π_old; one forward fewer).
* ``bypass``: log μ itself (no score pass; ρ ≡ 1, the PPO ratio is π_θ/μ) — verl
  ``bypass_mode``, prime-rl and SkyRL (rollout-anchored).
* ``loglinear``: AReaL's ``prox_logp_method: loglinear``
  (``areal/trainer/ppo/actor.py``, ``compute_prox_logp_approximations``): no score pass;
  log π_prox ≈ log μ + α · (sg[log π_θ] − log μ),
  α = clamp((v_prox − v_behave) / (v_θ − v_behave), 0, 1), α = 0 when v_θ ≤ v_behave.
  Versions count weight updates: v_behave is the token's behaviour version (a response a weight
  sync reached mid-way has two: ``RolloutBatch.token_version``), v_prox = t the
  weights this step started from, and v_θ = t + i/m for mini-batch i of m (the current
  weights have taken i of this step's m optimizer steps). So the first mini-batch (i = 0,
  θ = θ_old) gets log π_prox = log π_θ exactly for stale samples, and later mini-batches
  interpolate. **A variant of AReaL's**: AReaL reads the current version once per step and
  sets v_prox = current − 1, so its α is one number for all the step's mini-batches; ours
  follows the weights through the mini-batches, which makes the first one exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ANCHORS = ("recompute", "bypass", "loglinear")


def loglinear_alpha(v_behave: torch.Tensor, v_prox: float, v_theta: float) -> torch.Tensor:
    """α per token (``v_behave`` [B, L]: the version that sampled each token) or per response ([B]):
    (v_prox − v_behave)/(v_θ − v_behave) clamped to [0, 1]; 0 where v_θ ≤ v_behave."""
    vb = v_behave.double()
    den = v_theta - vb
    alpha = torch.where(den > 0, (v_prox - vb) / den.clamp(min=1e-12), torch.zeros_like(vb))
    return alpha.clamp(0.0, 1.0).float()


def loglinear_logp(logp_theta: torch.Tensor, logp_mu: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """log π_prox = log μ + α · (sg[log π_θ] − log μ), α [B, L] per token or [B] per response, tensors [B, L]."""
    a = alpha.to(logp_mu.dtype)
    a = a[:, None] if a.dim() == 1 else a
    return logp_mu + a * (logp_theta.detach() - logp_mu)


def plan(anchor: str, mini_batches: int, fuse_score_pass: bool, batch_level: bool = False,
         dropout: bool = False) -> str:
    """What the step does for π_old: ``score`` (a separate score pass), ``fused`` (the training
    forward's own detached log-probs), ``bypass`` (log μ) or ``loglinear``. A ``batch_level`` correction
    (M2PO: one token's weight depends on every token of the batch) needs the whole batch's π_old before the
    update: never fused (a fused π_old exists one micro-batch at a time). ``dropout``: the training forward
    samples a dropout mask (LoRA dropout), so its log-probs are not π_old: never fused either (the score pass runs
    without dropout)."""
    if anchor == "bypass":
        return "bypass"
    if anchor == "loglinear":
        return "loglinear"
    return "fused" if (fuse_score_pass and mini_batches == 1 and not batch_level and not dropout) else "score"


class OldLogp:
    """log π_old for a micro-batch, as the plan says: the stored tensor (``score``, ``bypass``) or
    one computed from the training forward's detached log-probs (``fused``, ``loglinear``; ``v_behave``:
    the batch's per-token versions, [B, L], or one per response, [B]). A micro-batch's tensors are as wide as its
    longest row (``train.micro_batch_tokens``), which may be narrower than the batch: the versions are cut to it."""

    def __init__(self, kind: str, stored: torch.Tensor | None = None, v_behave: torch.Tensor | None = None,
                 step: int = 0, mini_batches: int = 1):
        self.kind, self.stored = kind, stored
        self.v_behave, self.step, self.m = v_behave, step, mini_batches

    def __call__(self, rows: torch.Tensor, logp: torch.Tensor, logp_mu: torch.Tensor, mb_index: int) -> torch.Tensor:
        if self.kind in ("score", "bypass"):
            return self.stored[rows].to(logp.device)
        if self.kind == "fused":
            return logp.detach()
        v = self.v_behave[rows]
        if v.dim() == 2:  # per-token versions over the batch's width: cut to the micro-batch's own (its longest row)
            v = v[:, :logp.shape[1]]
        alpha = loglinear_alpha(v, float(self.step), self.step + mb_index / self.m)
        return loglinear_logp(logp, logp_mu, alpha.to(logp.device))


@dataclass
class Known:
    """Where π_old is known exactly once the step's update is done, for its mismatch metrics: ``rows`` and their
    ``logp`` ([B, L], valid on ``rows``), the correction's metrics over them and the experts the learner chose there
    (MoE; else None)."""

    rows: torch.Tensor
    logp: torch.Tensor
    corrections: dict
    routing: torch.Tensor | None = None


class Anchor:
    """π_old of a step, and everything that follows from how it is obtained — the one writer of ``batch.logp_old``.

    :func:`plan` picks the kind (``score``, ``fused``, ``bypass``, ``loglinear``). Its consequences, kept here:

    * :meth:`before_update` (the step's item 3): the learner's score pass for ``score``, log μ for ``bypass``, nothing
      for the kinds that take π_old from the training forward; the :class:`OldLogp` the update reads;
    * :meth:`weights` (item 4): the correction's weights from π_old once (``score``, ``bypass``), or a function the
      update applies per micro-batch to the π_old it computes; with M2PO under a token mean, the tokens its loss
      counts;
    * :meth:`known` (item 7): the rows where π_old is known exactly afterwards — every row, or the first
      mini-batch's (the training forward at θ = θ_old) — and the correction's metrics there.

    ``correct(logp_old, logp_mu, mask) -> (weights, metrics)``: the policy's correction; ``loss_mask(...)``: the tokens
    a correction drops from the loss (M2PO under a token mean), or None."""

    def __init__(self, anchor: str, mini_batches: int, fuse_score_pass: bool, correct, loss_mask=None,
                 batch_level: bool = False, dropout: bool = False):
        self.kind = plan(anchor, mini_batches, fuse_score_pass, batch_level=batch_level, dropout=dropout)
        self.mini_batches, self.correct, self.loss_mask = mini_batches, correct, loss_mask
        self._old: OldLogp | None = None
        self._routing: torch.Tensor | None = None

    def __eq__(self, other) -> bool:  # ``anchor == "score"``: the kind
        return self.kind == other if isinstance(other, str) else self is other

    __hash__ = object.__hash__

    @property
    def scored(self) -> bool:
        """π_old is the learner's own score of every row, before the update."""
        return self.kind == "score"

    def before_update(self, batch, step: int, score) -> OldLogp:
        """π_old as the plan says; ``score(batch) -> (log π, routing)``: the learner's score pass (run for ``score``
        only). Stores it in ``batch.logp_old`` (``score``, ``bypass``) and returns what the update reads."""
        self._routing = None
        if self.kind == "score":
            batch.logp_old, self._routing = score(batch)
        elif self.kind == "bypass":
            batch.logp_old = batch.logp_mu.clone()
        else:
            batch.logp_old = None
        self._old = OldLogp(self.kind, batch.logp_old, batch.token_versions(step), step, self.mini_batches)
        return self._old

    def weights(self, batch):
        """``(weights, metrics, loss_mask)``: the correction's weights [B, L] and metrics from the stored π_old, or a
        function ``(logp_old, logp_mu, mask) -> weights`` evaluated per micro-batch and no metrics yet (``known``
        computes them); ``loss_mask``: the tokens the loss counts where a correction drops some, else None."""
        if batch.logp_old is None:
            return (lambda o, mu, m: self.correct(o, mu, m)[0]), {}, None
        weights, metrics = self.correct(batch.logp_old, batch.logp_mu, batch.response_mask)
        mask = self.loss_mask(batch.logp_old, batch.logp_mu, batch.response_mask) if self.loss_mask else None
        return weights, metrics, mask

    def known(self, batch, stats, corrections: dict) -> Known:
        """After the update (``stats``: its :class:`~unison.learner.UpdateStats`): every row after a score pass (and
        fused), the first mini-batch's otherwise; ``corrections``: :meth:`weights`' metrics — for weights applied per
        micro-batch, those the first mini-batch applied (loglinear: at its π_prox) are computed here."""
        if self.kind == "score":
            return Known(torch.arange(batch.size), batch.logp_old, corrections, self._routing)
        rows = torch.arange(batch.size) if self.kind == "fused" else stats.first_rows
        logp, mu, mask = stats.logp_first, batch.logp_mu[rows], batch.response_mask[rows]
        if not corrections:
            prox = self._old(rows, logp[rows], mu, 0) if self.kind == "loglinear" else logp[rows]
            corrections = self.correct(prox, mu, mask)[1]
        return Known(rows, logp, corrections, stats.routing_first)
