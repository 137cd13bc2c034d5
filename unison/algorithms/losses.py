"""Policy losses (minimised) and their aggregation over tokens.

Every loss takes per-token log-probs under the current policy ``logp`` [B, L]
(with gradient), the behaviour log-probs ``logp_old`` (π_θ', the learner's
score pass, or μ in bypass mode), the rollout log-probs ``logp_mu``,
advantages ``adv`` [B] (token-level losses also take [B, L]: per-token advantages, as on-policy
distillation's reverse KL gives), correction ``weights`` [B, L] (detached; 1 for none)
and ``mask`` [B, L], and returns a per-token loss [B, L] (0 off the mask) and
metrics. :func:`aggregate` reduces it with a normaliser computed over the
whole mini-batch, so gradient accumulation over micro-batches gives exactly
the mini-batch loss. Registered by name in ``LOSSES``.

Notation (Paper A, docs/papers.md): r_t = π_θ(y_t)/π_θ'(y_t) (PPO ratio), ρ_t = π/μ,
sg = stop-gradient.
All ratios are formed in log space with exponents clamped to ±20.
"""

from __future__ import annotations

import torch

LOG_CLAMP = 20.0


def _masked_log_ratio(a, b, m):
    return torch.where(m.bool(), (a - b).clamp(-LOG_CLAMP, LOG_CLAMP), 0.0)


def _per_token(adv, dtype):
    """[B] advantages broadcast over tokens, or [B, L] per-token advantages as they are."""
    return (adv if adv.dim() == 2 else adv[:, None]).to(dtype)


def ppo_clip(logp, logp_old, logp_mu, adv, weights, mask, clip: float = 0.2,
             clip_high: float | None = None, **_):
    """PPO-clip (GRPO / Dr.GRPO), per token:

        ℓ_t = −w_t · min(r_t A, clip(r_t, 1−ε, 1+ε_high) A),  r_t = exp(log π_θ − log π_θ')

    ``w_t`` is the mismatch correction (e.g. min(ρ_t, C) for Token-TIS).

    Metrics: ``policy/ppo_kl`` = mean_t(−log r_t), the k1 estimate of KL(π_θ'‖π_θ) (verl's
    ``actor/ppo_kl``; can be negative); ``policy/ppo_kl_k3`` = mean_t(r_t − 1 − log r_t), the
    non-negative k3 estimate of the same KL; ``policy/clip_fraction`` = tokens whose clipped
    term is the minimum.
    """
    m = mask.float()
    hi = clip if clip_high is None else clip_high
    log_r = _masked_log_ratio(logp, logp_old, m)
    ratio = log_r.exp()
    a = _per_token(adv, ratio.dtype)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip, 1 + hi) * a
    per_token = -torch.minimum(unclipped, clipped) * weights.detach() * m
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        metrics = {"policy/clip_fraction": float(((unclipped > clipped) & m.bool()).float().sum() / n),
                   "policy/ppo_kl": float((-log_r).mul(m).sum() / n),
                   "policy/ppo_kl_k3": float((torch.expm1(log_r) - log_r).mul(m).sum() / n)}
    return per_token, metrics


def gspo(logp, logp_old, logp_mu, adv, weights, mask, clip: float = 3e-4,
         clip_high: float | None = 4e-4, **_):
    """GSPO (Zheng et al. 2025): sequence ratio s = exp(mean_t(log π_θ − log π_θ')), PPO-clip
    on s with a tiny band [1−ε_low, 1+ε_high] (≈[1−3e-4, 1+4e-4]).

    Token form with the same value and gradient: s_t = sg[s] · π_θ(y_t)/sg[π_θ(y_t)], so that
    mean_t ∇s_t = ∇s; ℓ_t = −w_t · min(s_t A, clip(s_t) A). Aggregate with
    ``seq_mean_token_mean`` for the sequence mean of −min(sA, clip(s)A).
    """
    m = mask.float()
    hi = clip if clip_high is None else clip_high
    n_tok = m.sum(-1).clamp(min=1)
    log_s = (_masked_log_ratio(logp, logp_old, m).sum(-1) / n_tok).clamp(-LOG_CLAMP, LOG_CLAMP)
    s = log_s.detach().exp()[:, None] * torch.exp(logp - logp.detach())
    a = adv[:, None].to(s.dtype)
    unclipped = s * a
    clipped = s.clamp(1 - clip, 1 + hi) * a
    per_token = -torch.minimum(unclipped, clipped) * weights.detach() * m
    with torch.no_grad():
        has = m.sum(-1) > 0
        seq_clipped = ((unclipped > clipped) & m.bool()).any(-1)
        metrics = {"policy/clip_fraction": float(seq_clipped[has].float().mean()) if bool(has.any()) else 0.0,
                   "policy/seq_ratio_mean": float(log_s[has].exp().mean()) if bool(has.any()) else 1.0}
    return per_token, metrics


def _seq_weight(logp, logp_mu, m):
    """sg[π_θ(y)/μ(y)] per response, from clamped log space. Shape [B]."""
    return _masked_log_ratio(logp.detach(), logp_mu, m).sum(-1).clamp(-LOG_CLAMP, LOG_CLAMP).exp()


def pg_seq_is(logp, logp_old, logp_mu, adv, weights, mask, **_):
    """PG-Seq-IS (Paper A): vanilla policy gradient with the full sequence IS weight, unclipped:

        ℓ_t = −sg[π_θ(y)/μ(y)] · A · log π_θ(y_t)

    Summed over tokens this is −sg[π_θ(y)/μ(y)]·A·log π_θ(y): unbiased for samples from μ.
    """
    m = mask.float()
    w = _seq_weight(logp, logp_mu, m)
    per_token = -(w * adv.to(w.dtype))[:, None] * logp * m
    has = m.sum(-1) > 0
    return per_token, {"policy/is_weight_max": float(w[has].max()) if bool(has.any()) else 1.0,
                       "policy/clip_fraction": 0.0}


def pg_seq_mis(logp, logp_old, logp_mu, adv, weights, mask, loss_c: float = 3.0, **_):
    """PG-Seq-MIS (Paper A, C = 3): as PG-Seq-IS, but a response whose weight
    π_θ(y)/μ(y) exceeds C is masked out (contributes exactly zero). Masking as named;
    Paper A's released code clamps instead (use ``pg_seq_is`` with ``seq_tis`` for that)."""
    m = mask.float()
    w = _seq_weight(logp, logp_mu, m)
    keep = (w <= loss_c).to(w.dtype)
    per_token = -(w * keep * adv.to(w.dtype))[:, None] * logp * m
    has = m.sum(-1) > 0
    return per_token, {"policy/clip_fraction": float(1 - keep[has].mean()) if bool(has.any()) else 0.0,
                       "policy/is_weight_max": float(w[has].max()) if bool(has.any()) else 1.0}


def pg_token_is(logp, logp_old, logp_mu, adv, weights, mask, **_):
    """PG-Token-IS (Paper A): per-token weight, unclipped: ℓ_t = −sg[π_θ(y_t)/μ(y_t)] · A · log π_θ(y_t)."""
    m = mask.float()
    w = _masked_log_ratio(logp.detach(), logp_mu, m).exp() * m
    per_token = -w * _per_token(adv, w.dtype) * logp * m
    return per_token, {"policy/clip_fraction": 0.0}


def _dppo(keep, logp, logp_old, adv, weights, mask, loss_c, kl_tau):
    """The DPPO update on the kept tokens: −keep · w · A · sg[min(r, C)] · log π_θ, r = π_θ/π_old,
    plus ``kl_tau`` · (log π_θ − log π_old)² on every response token."""
    m = mask.float()
    log_r = _masked_log_ratio(logp, logp_old, m)
    r = log_r.detach().exp()
    if loss_c is not None:
        r = r.clamp(max=loss_c)
    a = _per_token(adv, r.dtype)
    per_token = -(keep.float() * weights.detach() * r * a) * logp * m
    if kl_tau:
        per_token = per_token + kl_tau * log_r.pow(2) * m
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        metrics = {"policy/clip_fraction": float(((~keep) & m.bool()).float().sum() / n),
                   "policy/ppo_kl": float((-log_r).mul(m).sum() / n),
                   "policy/ppo_kl_k3": float((torch.expm1(log_r) - log_r).mul(m).sum() / n)}
    return per_token, metrics


def dppo_tv(logp, logp_old, logp_mu, adv, weights, mask, clip: float = 0.2, clip_high: float | None = None,
            loss_c: float | None = None, kl_tau: float = 0.0, **_):
    """DPPO with the binary total-variation trust region (DPPO, arXiv 2602.04879; verl
    ``compute_policy_loss_dppo_tv``; prime-rl's default loss "DPPO-Binary-TV").

    The trust region lives in probability space: with p = π_θ(y_t), p_old = π_old(y_t), a token
    is kept iff it has not yet moved past the band in the advantage's direction,

        A > 0: p − p_old ≤ δ_high,     A ≤ 0: p − p_old ≥ −δ_low     (δ = ``clip``/``clip_high``, 0.2),

    and a kept token takes the policy-gradient step weighted by the ratio r_t = p/p_old:
    ℓ_t = −keep_t · w_t · A · sg[min(r_t, C)] · log π_θ(y_t) (C = ``loss_c``, None = no cap) +
    ``kl_tau`` · (log π_θ − log π_old)² (prime-rl's 1e-3, no ½). With ``policy.anchor: bypass``
    π_old is μ, prime-rl's setting; the loss value differs from prime-rl's −keep·A·r, its gradient
    A·r·∇log π does not.
    """
    hi = clip if clip_high is None else clip_high
    dp = logp.detach().exp() - logp_old.exp()
    keep = torch.where(_per_token(adv, logp.dtype) > 0, dp <= hi, dp >= -clip)
    return _dppo(keep, logp, logp_old, adv, weights, mask, loss_c, kl_tau)


def dppo_kl(logp, logp_old, logp_mu, adv, weights, mask, clip: float = 0.05, clip_high: float | None = None,
            loss_c: float | None = None, kl_tau: float = 0.0, **_):
    """DPPO with the binary KL trust region (verl ``compute_policy_loss_dppo_kl``): the divergence of
    the Bernoulli "this token or not" between π_old and π_θ,

        D_t = p_old (log p_old − log p) + (1 − p_old) log((1 − p_old + 1e-8)/(1 − p + 1e-8)),

(the first term from the log-probs themselves, as verl computes it — a guard there would keep a
token whose p ≈ 1e-9 collapsed from a p_old of 0.5),

    keeps a token iff A > 0: D_t ≤ δ_high or p ≤ p_old; A ≤ 0: D_t ≤ δ_low or p ≥ p_old
    (δ = ``clip``/``clip_high``, verl's example 0.05); the update on kept tokens is as in
    :func:`dppo_tv`."""
    hi = clip if clip_high is None else clip_high
    p, q = logp.detach().exp(), logp_old.exp()
    eps = 1e-8
    d = q * (logp_old - logp.detach()) + (1 - q) * torch.log((1 - q + eps) / (1 - p + eps))
    keep = torch.where(_per_token(adv, logp.dtype) > 0, (d <= hi) | (p <= q), (d <= clip) | (p >= q))
    return _dppo(keep, logp, logp_old, adv, weights, mask, loss_c, kl_tau)


def ipo(logp, logp_old, logp_mu, adv, weights, mask, clip: float = 0.1, loss_c: float | None = None,
        kl_tau: float = 1e-3, **_):
    """IPO (prime-rl's default loss, ``ipo_loss_fn``; ``[trainer.loss] type="ipo"``): a trust region in
    probability space on both sides, whatever the advantage's sign. With p = π_θ(y_t) and
    p_old = π_old(y_t) (μ itself under ``policy.anchor: bypass``, prime-rl's setting), a token is kept iff

        |p − p_old| ≤ ε      (ε = ``clip``),

    and ℓ_t = (−keep_t · w_t · A · sg[r_t] · log π_θ(y_t) + τ · (log r_t)²) · mask,
    r_t = exp(clamp(log π_θ − log π_old, ±20)) (capped at ``loss_c`` when set; prime-rl has no cap),
    τ = ``kl_tau``. The gradient of a kept token is −w·A·r·∇log π, prime-rl's; the τ term pulls every
    response token back towards π_old. Unlike DPPO-Binary-TV (:func:`dppo_tv`) the band does not
    depend on A's sign: a token that moved too far is masked in either direction.

    Metrics: ``policy/ipo_masked_fraction`` (response tokens outside the band), and the mismatch KL
    over the masked and the kept tokens, ``policy/masked_mismatch_kl`` and
    ``policy/unmasked_mismatch_kl`` (prime-rl's names: the k3 of π_θ against μ)."""
    keep = (logp.detach().exp() - logp_old.exp()).abs() <= clip
    per_token, metrics = _dppo(keep, logp, logp_old, adv, weights, mask, loss_c, kl_tau)
    with torch.no_grad():
        m = mask.bool()
        log_r = _masked_log_ratio(logp.detach(), logp_mu, mask.float())
        k3 = torch.expm1(log_r) - log_r
        masked, kept = m & ~keep, m & keep
        metrics["policy/ipo_masked_fraction"] = metrics["policy/clip_fraction"]
        metrics["policy/masked_mismatch_kl"] = float(k3[masked].sum() / masked.sum().clamp(min=1))
        metrics["policy/unmasked_mismatch_kl"] = float(k3[kept].sum() / kept.sum().clamp(min=1))
    return per_token, metrics


LOSSES = {"ppo_clip": ppo_clip, "gspo": gspo, "pg_seq_is": pg_seq_is, "pg_seq_mis": pg_seq_mis,
          "pg_token_is": pg_token_is, "dppo_tv": dppo_tv, "dppo_kl": dppo_kl, "ipo": ipo}
#: losses that already weight by π/μ themselves: a further correction would apply it twice
SELF_CORRECTING = {"pg_seq_is", "pg_seq_mis", "pg_token_is"}
#: losses whose ratio is a sequence quantity: token-level corrections do not compose
SEQUENCE_LEVEL = {"gspo"}
#: losses that take per-token advantages [B, L] (on-policy distillation); the others weigh a response as a whole
PER_TOKEN_ADVANTAGES = {"ppo_clip", "pg_token_is", "dppo_tv", "dppo_kl", "ipo"}

AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate(per_token: torch.Tensor, mode: str, mask: torch.Tensor, num_tokens: int, num_seqs: int,
              max_len: int) -> torch.Tensor:
    """Reduce a per-token loss with a mini-batch normaliser (``num_tokens``/``num_seqs``
    count the whole mini-batch, ``mask`` is the micro-batch's):

    * ``token_mean``: Σ_{i,t} ℓ / (response tokens in the mini-batch)
    * ``seq_mean_token_sum``: Σ_i Σ_t ℓ / (responses in the mini-batch)
    * ``seq_mean_token_mean``: Σ_i (Σ_t ℓ / T_i) / (responses in the mini-batch)
    * ``seq_mean_token_sum_norm`` (Dr.GRPO, Paper A): Σ_{i,t} ℓ / (responses × max_len),
      a constant normaliser independent of the response lengths.
    """
    if mode == "token_mean":
        return per_token.sum() / max(num_tokens, 1)
    if mode == "seq_mean_token_sum":
        return per_token.sum() / max(num_seqs, 1)
    if mode == "seq_mean_token_mean":
        lens = mask.float().sum(-1).clamp(min=1)
        return (per_token.sum(-1) / lens).sum() / max(num_seqs, 1)
    if mode == "seq_mean_token_sum_norm":
        return per_token.sum() / max(num_seqs * max_len, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}")
