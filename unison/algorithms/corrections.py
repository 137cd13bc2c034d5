"""Off-policy corrections for the rollout mismatch, computed in log space.

``ρ_t = π_old(y_t) / μ(y_t)`` with ``log ρ_t`` clamped to ±20 before
exponentiating. Each correction maps ``(logp_old, logp_mu, mask)`` to
per-token weights ``[B, L]`` (0 off the mask) that multiply the policy-loss
term, plus metrics. Registered by name in ``CORRECTIONS``.
"""

from __future__ import annotations

import torch

LOG_CLAMP = 20.0


def log_rho(logp_old: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), (logp_old - logp_mu).clamp(-LOG_CLAMP, LOG_CLAMP), 0.0)


def correction_metrics(rho: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Raw ratio range (before truncation), mean weight, masked fraction, ESS.

    ESS = (mean w)² / mean(w²) over response tokens (1 = all weights equal).
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


def none(logp_old, logp_mu, mask, **_) -> tuple[torch.Tensor, dict]:
    """No correction: weight 1 on every response token."""
    m = mask.float()
    rho = log_rho(logp_old, logp_mu, m).exp()
    return m.clone(), correction_metrics(rho, m, m)


def token_tis(logp_old, logp_mu, mask, c: float = 2.0, **_) -> tuple[torch.Tensor, dict]:
    """Token-level truncated IS (Paper A "GRPO + Token-TIS"): w_t = min(ρ_t, C), C = 2."""
    m = mask.float()
    rho = log_rho(logp_old, logp_mu, m).exp()
    w = rho.clamp(max=c) * m
    return w, correction_metrics(rho, w, m)


CORRECTIONS = {"none": none, "token_tis": token_tis}
