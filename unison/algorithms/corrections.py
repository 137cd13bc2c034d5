"""Off-policy corrections for the rollout mismatch, computed in log space.

``ρ_t = π_old(y_t) / μ(y_t)`` per token, ``ρ = Π_t ρ_t`` per response; log-ratios
are clamped to ±20 before exponentiating (as verl does), so one catastrophic
token cannot overflow the batch. Each correction maps ``(logp_old, logp_mu,
mask)`` to per-token weights ``[B, L]`` (0 off the mask; 0 on a masked-out
token or response) that multiply the policy-loss term, plus metrics.
Registered by name in ``CORRECTIONS``. Sources: Paper A (docs/papers.md) and the
peers' correction family; formulas, defaults and peer option names in docs/algorithms.md.
"""

from __future__ import annotations

import torch

LOG_CLAMP = 20.0


def log_rho(logp_old: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log ρ_t = log π_old − log μ on the mask (clamped to ±20), 0 elsewhere."""
    return torch.where(mask.bool(), (logp_old.float() - logp_mu.float()).clamp(-LOG_CLAMP, LOG_CLAMP), 0.0)


def seq_log_rho(logp_old, logp_mu, mask) -> torch.Tensor:
    """log ρ = Σ_t log ρ_t per response, clamped to ±20. Shape [B]."""
    return log_rho(logp_old, logp_mu, mask).sum(-1).clamp(-LOG_CLAMP, LOG_CLAMP)


def correction_metrics(rho: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Raw token ratio range (before truncation), mean weight, masked fraction, ESS.

    ``masked_fraction`` = response tokens whose weight is 0; ESS = (mean w)² / mean(w²)
    over response tokens (1 = all weights equal; verl's rollout_is_eff_sample_size).
    """
    sel = mask.bool()
    if not bool(sel.any()):
        return {"correction/ratio_min": 1.0, "correction/ratio_max": 1.0, "correction/weight_mean": 1.0,
                "correction/masked_fraction": 0.0, "correction/ess": 1.0}
    r, w = rho[sel], weights[sel]
    msq = (w * w).mean()
    return {
        "correction/ratio_min": float(r.min()),
        "correction/ratio_max": float(r.max()),
        "correction/weight_mean": float(w.mean()),
        "correction/masked_fraction": float((w == 0).float().mean()),
        "correction/ess": float(w.mean() ** 2 / msq) if float(msq) > 0 else 0.0,
    }


def _finish(weights, logp_old, logp_mu, m, extra=None):
    rho = log_rho(logp_old, logp_mu, m).exp()
    out = correction_metrics(rho, weights, m)
    if extra:
        out.update(extra)
    return weights, out


def none(logp_old, logp_mu, mask, **_):
    """No correction: w_t = 1 on every response token."""
    m = mask.float()
    return _finish(m.clone(), logp_old, logp_mu, m)


def token_tis(logp_old, logp_mu, mask, c: float = 2.0, **_):
    """Token truncated IS (Paper A "GRPO + Token-TIS"; verl rollout_is: token): w_t = min(ρ_t, C), C = 2."""
    m = mask.float()
    w = log_rho(logp_old, logp_mu, m).exp().clamp(max=c) * m
    return _finish(w, logp_old, logp_mu, m)


def token_mis(logp_old, logp_mu, mask, c: float = 2.0, c_low: float = 0.5, **_):
    """Token masked IS (IcePop; TRL token_mask): w_t = ρ_t if C_low ≤ ρ_t ≤ C, else 0."""
    m = mask.float()
    rho = log_rho(logp_old, logp_mu, m).exp()
    w = torch.where((rho >= c_low) & (rho <= c), rho, 0.0) * m
    return _finish(w, logp_old, logp_mu, m)


def seq_tis(logp_old, logp_mu, mask, c: float = 2.0, **_):
    """Sequence truncated IS (verl rollout_is: sequence): w = min(ρ, C) on every token of the response."""
    m = mask.float()
    w_seq = seq_log_rho(logp_old, logp_mu, m).exp().clamp(max=c)
    return _finish(w_seq[:, None] * m, logp_old, logp_mu, m)


def seq_mis(logp_old, logp_mu, mask, c: float = 10.0, **_):
    """Sequence masked IS (Paper A "GRPO + Seq-MIS", C = 10; TRL sequence_mask):
    w = ρ · 1{ρ ≤ C} on every token (the response is dropped when ρ > C)."""
    m = mask.float()
    rho = seq_log_rho(logp_old, logp_mu, m).exp()
    w_seq = torch.where(rho <= c, rho, 0.0)
    return _finish(w_seq[:, None] * m, logp_old, logp_mu, m,
                   {"correction/seq_masked_fraction": _frac_dropped(w_seq, m)})


def geo_rs(logp_old, logp_mu, mask, c: float = 1.01, c_low: float = 0.99, **_):
    """Geometric-mean rejection (Geo-RS): keep a response (w = 1) iff

        C_low ≤ (Π_t ρ_t)^{1/T} = exp(mean_t log ρ_t) ≤ C,   ρ_t = π_old(y_t)/μ(y_t),

    else drop it (w = 0). The bounded ratio is π_old/μ. verl's ``rollout_rs: seq_mean_k1``
    bounds the reciprocal: its statistic is mean_t(−log ρ_t) = log of the geometric mean of
    μ/π_old, kept in [log lo, log hi] for ``rollout_rs_threshold: "lo_hi"``. So
    ``geo_rs`` with (c=C, c_low=L) ≡ verl ``seq_mean_k1`` with ``"{1/C}_{1/L}"`` (the defaults
    [0.99, 1.01] ≡ ``"0.990099_1.010101"``), and verl's ``"lo_hi"`` ≡ c=1/lo, c_low=1/hi.
    Default bounds are ours (no paper fixes them)."""
    m = mask.float()
    n = m.sum(-1).clamp(min=1)
    geo = (log_rho(logp_old, logp_mu, m).sum(-1) / n).exp()
    keep = ((geo >= c_low) & (geo <= c)).float()
    return _finish(keep[:, None] * m, logp_old, logp_mu, m,
                   {"correction/seq_masked_fraction": _frac_dropped(keep, m)})


def veto(logp_old, logp_mu, mask, threshold: float = 1e-4, **_):
    """Veto (slime rs_veto_threshold): drop a response containing any token with ρ_t < threshold."""
    m = mask.float()
    rho = log_rho(logp_old, logp_mu, m).exp()
    bad = ((rho < threshold) & m.bool()).any(-1)
    keep = (~bad).float()
    return _finish(keep[:, None] * m, logp_old, logp_mu, m,
                   {"correction/seq_masked_fraction": _frac_dropped(keep, m)})


def _m2_keep(logp_old, logp_mu, m, c: float):
    """M2PO's mask over **every** response token given (not row by row): with m2_t = (log π_old − log μ)²
    sorted descending, drop the k largest for the smallest k whose remaining mean Σ_{j≥k} m2_(j) / (n − k) is
    strictly below τ = ``c``; when no k achieves it, keep only the smallest (AReaL ``_get_m2po_loss_mask``).
    Returns (keep [B, L] float, m2 before, m2 after)."""
    sel = m.bool()
    keep = m.clone()
    m2 = log_rho(logp_old, logp_mu, m)[sel].pow(2)
    n = m2.numel()
    if not n:
        return keep, 0.0, 0.0
    order = torch.argsort(m2, descending=True, stable=True)
    sorted_m2 = m2[order].double()
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=torch.float64)
    below = (suffix_mean < c).nonzero()
    k = int(below[0]) if below.numel() else n - 1
    kept = torch.ones(n, dtype=torch.bool)
    kept[order[:k]] = False
    keep[sel] = kept.float()
    return keep, float(sorted_m2.mean()), float(m2[kept].double().mean())


def m2po(logp_old, logp_mu, mask, c: float = 0.04, cap: float = 5.0, **_):
    """M2PO (arXiv 2510.01161) as AReaL runs it (``actor.m2_threshold`` with ``use_decoupled_loss``): the decoupled
    PPO loss's behaviour weight, on the tokens M2PO keeps,

        w_t = keep_t · ρ_t · 1{ρ_t ≤ cap},   ρ_t = π_old(y_t)/μ(y_t)   (detached; π_old the recomputed proximal
                                                                      policy, the PPO ratio clipped around it)

    keep_t: M2PO's mask (:func:`_m2_keep`, τ = ``c`` = 0.04) over **the whole batch's response tokens** — a
    batch-level correction (:data:`BATCH_LEVEL`): the trainer computes it once, from the score pass, so the mask
    is the same whatever the micro-batching and the number of ranks (AReaL applies it per micro-batch and rank;
    its example config uses one mini-batch of up to 10240 tokens per micro-batch). The cap is a mask, as AReaL's
    ``rejection_sampling`` (``upper`` 5.0, token level, ``action: mask``): a token with ρ_t > cap gets weight 0;
    kept tokens the raw ratio. Without the behaviour weight (AReaL without the decoupled loss) its M2 term is
    identically 0; :func:`m2po_mask` is the 0/1 mask with no weight (the variant unison shipped as M2PO before).

    Metrics: ``correction/m2_before`` (mean m2 over all tokens), ``correction/m2_after`` (over the kept ones),
    ``correction/m2_masked_fraction``, ``correction/behave_masked_fraction`` (kept by M2PO, ρ_t > cap)."""
    m = mask.float()
    keep, before, after = _m2_keep(logp_old, logp_mu, m, c)
    rho = log_rho(logp_old, logp_mu, m).exp()
    capped = (rho > cap) & keep.bool()
    w = torch.where(capped, 0.0, rho) * keep
    n = m.sum().clamp(min=1)
    return _finish(w, logp_old, logp_mu, m, {
        "correction/m2_before": before, "correction/m2_after": after,
        "correction/m2_masked_fraction": float(((keep == 0) & m.bool()).sum() / n),
        "correction/behave_masked_fraction": float(capped.sum() / n)})


def m2po_mask(logp_old, logp_mu, mask, c: float = 0.04, **_):
    """M2PO's mask alone (:func:`_m2_keep`, τ = ``c``), kept tokens w = 1, masked w = 0: no behaviour weight, so
    samples from μ train as if from π_old — the variant unison shipped as ``grpo_m2po`` before it followed AReaL
    (``grpo_m2po_mask``; the cures report's rows of that name). Batch-level, as :func:`m2po`."""
    m = mask.float()
    keep, before, after = _m2_keep(logp_old, logp_mu, m, c)
    n = m.sum().clamp(min=1)
    return _finish(keep, logp_old, logp_mu, m, {
        "correction/m2_before": before, "correction/m2_after": after,
        "correction/m2_masked_fraction": float(((keep == 0) & m.bool()).sum() / n)})


def m2_loss_mask(logp_old, logp_mu, mask, c: float = 0.04, **_) -> torch.Tensor:
    """The tokens M2PO keeps (:func:`_m2_keep`, τ = ``c``) as a loss mask [B, L]: AReaL multiplies its loss mask by
    M2PO's, so its token mean divides by the kept tokens only (a token the behaviour cap masks stays in it)."""
    return _m2_keep(logp_old, logp_mu, mask.float(), c)[0]


def _frac_dropped(w_seq: torch.Tensor, m: torch.Tensor) -> float:
    has = m.sum(-1) > 0
    return float((w_seq[has] == 0).float().mean()) if bool(has.any()) else 0.0


CORRECTIONS = {"none": none, "token_tis": token_tis, "token_mis": token_mis, "seq_tis": seq_tis,
               "seq_mis": seq_mis, "geo_rs": geo_rs, "veto": veto, "m2po": m2po, "m2po_mask": m2po_mask}
TOKEN_LEVEL = {"token_tis", "token_mis", "m2po", "m2po_mask"}
#: corrections whose weight of one token depends on every token of the batch (M2PO's mask is over the batch's
#: second moment): computed once from the whole batch's π_old (a score pass), never per micro-batch
BATCH_LEVEL = {"m2po", "m2po_mask"}
#: corrections that drop tokens from the loss itself, not only from its weights: with ``loss_agg: token_mean`` the
#: normaliser counts the tokens left (AReaL's token mean over M2PO's mask); other aggregations are per response or
#: constant and do not change
LOSS_MASKS = {"m2po": m2_loss_mask, "m2po_mask": m2_loss_mask}
