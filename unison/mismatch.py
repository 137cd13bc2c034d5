"""Training–inference mismatch metrics: pure functions of (log π, log μ, mask).

Notation (Paper A; docs/papers.md, "Measuring the mismatch"): tokens ``y_t`` are sampled from
the rollout engine μ; the learner's log-probability of the same token is
``log π(y_t)``. Per token ``r_t = log π(y_t) − log μ(y_t)`` and the
importance ratio ``ρ_t = π/μ = e^{r_t}``. Per response ``R = Σ_t r_t``
(the sequence log-ratio ``log π(y) − log μ(y)``).

Inputs are tensors of the same shape ``[B, L]``; ``mask`` is 1 on response
tokens and 0 on prompt and padding. Token metrics average over all unmasked
tokens of the batch; sequence metrics average over responses with at least
one unmasked token. An all-masked batch yields 0.0 for every metric (not NaN).
Exponents are clamped to ±``EXP_CLAMP`` so one catastrophic token cannot
overflow a metric.
"""

from __future__ import annotations

import math

import torch

EXP_CLAMP = 20.0


def _tok_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    return (x * mask).sum() / n.clamp(min=1)


def _valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Values at unmasked positions (flattened)."""
    return x[mask.bool()]


def log_ratio(logp_pi: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r_t = log π − log μ on the mask, 0 elsewhere (whatever is stored there), in fp32."""
    return torch.where(mask.bool(), logp_pi.float() - logp_mu.float(), 0.0)


def seq_log_ratio(logp_pi: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per response: R = Σ_t r_t = log π(y) − log μ(y). Shape [B]; 0 for an empty response."""
    return log_ratio(logp_pi, logp_mu, mask).sum(-1)


def k1(logp_pi, logp_mu, mask) -> torch.Tensor:
    """k1 = mean_t(−r_t): unbiased token-level estimate of KL(μ‖π) (can be negative)."""
    m = mask.float()
    return _tok_mean(-log_ratio(logp_pi, logp_mu, m), m)


def k2(logp_pi, logp_mu, mask) -> torch.Tensor:
    """k2 = mean_t(½ r_t²)."""
    m = mask.float()
    return _tok_mean(0.5 * log_ratio(logp_pi, logp_mu, m) ** 2, m)


def k3(logp_pi, logp_mu, mask) -> torch.Tensor:
    """k3 = mean_t(e^{r_t} − 1 − r_t): non-negative, low-variance estimate of KL(μ‖π)."""
    m = mask.float()
    r = log_ratio(logp_pi, logp_mu, m).clamp(-EXP_CLAMP, EXP_CLAMP)
    return _tok_mean(torch.expm1(r) - r, m)


def seq_kl(logp_pi, logp_mu, mask) -> torch.Tensor:
    """Sequence KL[μ‖π] = mean over responses of −Σ_t r_t (Paper A: 7.64 bf16 vs 0.32 fp16)."""
    m = mask.float()
    has = (m.sum(-1) > 0).float()
    return (-seq_log_ratio(logp_pi, logp_mu, m) * has).sum() / has.sum().clamp(min=1)


def seq_kl_k3(logp_pi, logp_mu, mask) -> torch.Tensor:
    """Low-variance sequence KL[μ‖π]: mean over responses of Σ_t (e^{r_t} − 1 − r_t).

    Each k3 term is an unbiased, non-negative estimate of the per-position
    KL(μ‖π | prefix), so their sum estimates the sequence KL (chain rule)
    with far less variance than ``seq_kl``'s −Σ r_t, whose noise swamps a
    small KL (fp16) at a few dozen responses. Not in the papers; ours.
    """
    m = mask.float()
    has = (m.sum(-1) > 0).float()
    r = log_ratio(logp_pi, logp_mu, m).clamp(-EXP_CLAMP, EXP_CLAMP)
    per_seq = ((torch.expm1(r) - r) * m).sum(-1)
    return (per_seq * has).sum() / has.sum().clamp(min=1)


def prob_diff(logp_pi, logp_mu, mask) -> dict[str, torch.Tensor]:
    """|π(y_t) − μ(y_t)| mean and max over tokens, and min/max of the signed π − μ."""
    m = mask.float()
    d = torch.where(m.bool(), logp_pi.float().exp() - logp_mu.float().exp(), 0.0)
    vals = _valid(d, m)
    if vals.numel() == 0:
        z = torch.zeros(())
        return {"mean": z, "max": z, "signed_min": z, "signed_max": z}
    return {"mean": _tok_mean(d.abs(), m), "max": vals.abs().max(),
            "signed_min": vals.min(), "signed_max": vals.max()}


def log_ppl_diffs(logp_pi, logp_mu, mask) -> torch.Tensor:
    """Per response: log PPL_π − log PPL_μ = mean_t(log μ − log π) = mean_t(−r_t). Shape [B]."""
    m = mask.float()
    return -log_ratio(logp_pi, logp_mu, m).sum(-1) / m.sum(-1).clamp(min=1)


def chi2_token(logp_pi, logp_mu, mask) -> torch.Tensor:
    """χ²_token = mean_t(ρ_t²) − 1 = mean_t(expm1(2 r_t)), ρ_t = e^{r_t}.

    The expm1 form keeps the digits that ``mean(e^{2r}) − 1`` cancels away: in fp32,
    e^{2r} rounds to exactly 1 for |r| ≲ 3e-8, so the naive form reports 0 for the tiny
    mismatch of an fp32 run while this one gives ≈ 2·mean(r).
    """
    m = mask.float()
    r = log_ratio(logp_pi, logp_mu, m).clamp(-EXP_CLAMP, EXP_CLAMP)
    if m.sum() == 0:
        return torch.zeros(())
    return _tok_mean(torch.expm1(2 * r), m)


def chi2_seq(logp_pi, logp_mu, mask) -> torch.Tensor:
    """χ²_seq = mean_y(ρ(y)²) − 1 = mean_y(expm1(2R)), ρ(y) = e^{R}, R clamped to ±EXP_CLAMP."""
    m = mask.float()
    has = m.sum(-1) > 0
    if not bool(has.any()):
        return torch.zeros(())
    R = seq_log_ratio(logp_pi, logp_mu, m)[has].clamp(-EXP_CLAMP, EXP_CLAMP)
    return torch.expm1(2 * R).mean()


#: the band of token TIS / token MIS (Paper A: C = 2; IcePop's lower 0.5) and seq-MIS's C (Paper A: 10):
#: the clip-fraction metrics say how much of a batch those corrections would touch
TOKEN_RHO_BAND = (0.5, 2.0)
SEQ_RHO_C = 10.0


def token_rho_outside_fraction(logp_pi, logp_mu, mask, band=TOKEN_RHO_BAND) -> torch.Tensor:
    """Fraction of response tokens whose ρ_t = π/μ lies outside [low, high] (compared in log space):
    the tokens token TIS would truncate (ρ_t > high) or token MIS would mask. 0 for no tokens."""
    m = mask.float()
    r = log_ratio(logp_pi, logp_mu, m)
    out = ((r < math.log(band[0])) | (r > math.log(band[1]))).float()
    return _tok_mean(out, m)


def seq_rho_over_fraction(logp_pi, logp_mu, mask, c: float = SEQ_RHO_C) -> torch.Tensor:
    """Fraction of responses whose sequence ratio ρ(y) = Π_t ρ_t exceeds ``c``: those seq-MIS drops."""
    m = mask.float()
    has = m.sum(-1) > 0
    if not bool(has.any()):
        return torch.zeros(())
    return (seq_log_ratio(logp_pi, logp_mu, m)[has] > math.log(c)).float().mean()


def mismatch_metrics(logp_pi: torch.Tensor, logp_mu: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Every ``mismatch/*`` metric of the contract, as Python floats.

    ``log_ppl_diff`` = mean_y(log PPL_π − log PPL_μ); ``log_ppl_abs_diff`` its
    mean absolute value; ``ppl_ratio`` = mean_y(PPL_π / PPL_μ). Also
    ``abs_logp_diff_mean/max`` (mean/max |r_t|, the figure TRL
    reports), ``seq_kl_k3`` (see :func:`seq_kl_k3`), ``token_rho_outside_fraction`` (ρ_t outside
    [0.5, 2]: what token TIS/MIS would touch), ``seq_rho_over_c_fraction`` (ρ(y) > 10: what seq-MIS
    drops), ``identical_fraction`` (the share of
    tokens whose log π and log μ are bitwise equal: 1.0 in exact mode) and ``num_tokens`` /
    ``num_sequences``.
    """
    m = mask.float()
    has = m.sum(-1) > 0
    lpd = log_ppl_diffs(logp_pi, logp_mu, m)[has]
    pd = prob_diff(logp_pi, logp_mu, m)
    r = _valid(log_ratio(logp_pi, logp_mu, m), m)
    zero = torch.zeros(())
    out = {
        "mismatch/k1": k1(logp_pi, logp_mu, m),
        "mismatch/k2": k2(logp_pi, logp_mu, m),
        "mismatch/k3": k3(logp_pi, logp_mu, m),
        "mismatch/seq_kl": seq_kl(logp_pi, logp_mu, m),
        "mismatch/seq_kl_k3": seq_kl_k3(logp_pi, logp_mu, m),
        "mismatch/prob_diff_mean": pd["mean"],
        "mismatch/prob_diff_max": pd["max"],
        "mismatch/prob_diff_signed_min": pd["signed_min"],
        "mismatch/prob_diff_signed_max": pd["signed_max"],
        "mismatch/abs_logp_diff_mean": r.abs().mean() if r.numel() else zero,
        "mismatch/abs_logp_diff_max": r.abs().max() if r.numel() else zero,
        "mismatch/log_ppl_diff": lpd.mean() if lpd.numel() else zero,
        "mismatch/log_ppl_abs_diff": lpd.abs().mean() if lpd.numel() else zero,
        "mismatch/ppl_ratio": lpd.clamp(-EXP_CLAMP, EXP_CLAMP).exp().mean() if lpd.numel() else torch.ones(()),
        "mismatch/chi2_token": chi2_token(logp_pi, logp_mu, m),
        "mismatch/chi2_seq": chi2_seq(logp_pi, logp_mu, m),
        "mismatch/token_rho_outside_fraction": token_rho_outside_fraction(logp_pi, logp_mu, m),
        "mismatch/seq_rho_over_c_fraction": seq_rho_over_fraction(logp_pi, logp_mu, m),
    }
    metrics = {k: float(v) for k, v in out.items()}
    sel = m.bool()
    metrics["mismatch/identical_fraction"] = (float((logp_pi[sel] == logp_mu[sel]).float().mean())
                                              if bool(sel.any()) else 1.0)
    metrics["mismatch/num_tokens"] = int(m.sum())
    metrics["mismatch/num_sequences"] = int(has.sum())
    return metrics


def first_difference(logp_pi: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor) -> str | None:
    """Where log π and log μ first differ bitwise on the mask (``None`` if nowhere)."""
    diff = (logp_pi != logp_mu) & mask.bool()
    if not bool(diff.any()):
        return None
    b, t = (int(x) for x in diff.nonzero()[0])
    return f"row {b}, position {t}: log π {float(logp_pi[b, t])!r} vs log μ {float(logp_mu[b, t])!r}"


def length_slope(seq_log_ratios, lengths, per: int = 1000) -> float | None:
    """Least-squares slope of the sequence log-ratio against response length, per ``per`` tokens.

    Paper A fits this line (−1.01 per 1K tokens in BF16 vs −0.07 in FP16).
    ``None`` when fewer than two distinct lengths make a slope undefined.
    """
    x = torch.as_tensor(lengths, dtype=torch.float64)
    y = torch.as_tensor(seq_log_ratios, dtype=torch.float64)
    if x.numel() < 2 or float(x.max() - x.min()) == 0.0:
        return None
    xc = x - x.mean()
    slope = float((xc * (y - y.mean())).sum() / (xc * xc).sum()) * per
    return slope if math.isfinite(slope) else None
