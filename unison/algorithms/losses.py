"""Policy losses (minimised) and their aggregation over tokens.

A loss maps per-token log-probs under the current policy ``logp`` [B, L]
(with gradient), the behaviour log-probs ``logp_old`` [B, L], advantages
``adv`` [B], correction ``weights`` [B, L] and ``mask`` [B, L] to a per-token
loss [B, L] (0 off the mask) and metrics. :func:`aggregate` turns it into a
scalar with a normaliser computed over the whole mini-batch, so that
gradient accumulation over micro-batches gives exactly the mini-batch loss.
"""

from __future__ import annotations

import torch


def ppo_clip(logp, logp_old, adv, weights, mask, clip: float = 0.2, **_) -> tuple[torch.Tensor, dict]:
    """PPO-clip (GRPO / Dr.GRPO), per token, minimised:

        ℓ_t = −w_t · min(r_t A, clip(r_t, 1−ε, 1+ε) A),  r_t = exp(log π_θ − log π_old)

    ``w_t`` is the (detached) mismatch correction, e.g. min(ρ_t, C) for Token-TIS.
    """
    m = mask.float()
    log_r = torch.where(m.bool(), logp - logp_old, 0.0)
    ratio = log_r.exp()
    a = adv[:, None].to(ratio.dtype)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip, 1 + clip) * a
    per_token = -torch.minimum(unclipped, clipped) * weights.detach() * m
    with torch.no_grad():
        was_clipped = ((unclipped > clipped) & m.bool()).float()
        n = m.sum().clamp(min=1)
        metrics = {"policy/clip_fraction": float(was_clipped.sum() / n),
                   "policy/ppo_kl": float(((ratio - 1) - log_r).mul(m).sum() / n)}
    return per_token, metrics


LOSSES = {"ppo_clip": ppo_clip}

AGGREGATIONS = ("seq_mean_token_sum_norm", "token_mean")


def aggregate(per_token: torch.Tensor, mode: str, num_tokens: int, num_seqs: int,
              max_len: int) -> torch.Tensor:
    """Sum the per-token loss and divide by a mini-batch normaliser.

    * ``token_mean``: Σ ℓ_t / (response tokens in the mini-batch)
    * ``seq_mean_token_sum_norm`` (Dr.GRPO, Paper A): Σ ℓ_t / (responses × max_len),
      a constant that does not depend on the response lengths.
    """
    total = per_token.sum()
    if mode == "token_mean":
        return total / max(num_tokens, 1)
    if mode == "seq_mean_token_sum_norm":
        return total / max(num_seqs * max_len, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}")
