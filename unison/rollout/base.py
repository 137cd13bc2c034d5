"""Sampling parameters and the token-sampling rule shared by rollout engines."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unison.errors import UnisonError


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout engine samples.

    ``temperature`` divides the logits; 0 means greedy (log μ reported as 0,
    a point mass). ``top_k`` (0 = off) and ``top_p`` (1.0 = off) truncate the
    support and renormalise: the reported log μ is then that of the truncated
    distribution, which differs from the learner's π at the same temperature.
    That bias is real (users hit it in every framework); keep both off for RL
    unless you mean it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int = 0
    #: keep sampling past EOS up to ``max_tokens`` (as vLLM's ``ignore_eos``):
    #: fixed-length responses for benchmarks and length studies.
    ignore_eos: bool = False

    def __post_init__(self):
        if self.n < 1:
            raise UnisonError(f"n={self.n} is invalid: sample at least one response per prompt")
        if self.temperature < 0:
            raise UnisonError(f"temperature={self.temperature} is invalid: use 0 (greedy) or a positive value")
        if not 0.0 < self.top_p <= 1.0:
            raise UnisonError(f"top_p={self.top_p} is invalid: use a value in (0, 1]")
        if self.top_k < 0:
            raise UnisonError(f"top_k={self.top_k} is invalid: use 0 (off) or a positive integer")
        if self.max_tokens < 1:
            raise UnisonError(f"max_tokens={self.max_tokens} is invalid: generate at least one token")


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` [b, V].

    Returns ``(tokens [b], logp [b])`` where ``logp`` is the log-probability of
    the sampled token under the distribution it was drawn from, computed in fp32.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.zeros_like(tokens, dtype=torch.float32)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_k or params.top_p < 1.0:
        logp = _truncate(logp, params.top_k, params.top_p)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask the support to top-k / top-p and renormalise (log space)."""
    if top_k and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_lp.exp()
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logp, dim=-1)
