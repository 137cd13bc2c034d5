"""The learner π: fp32 master weights, scoring under autocast, weight export.

Scoring is one full forward pass over prompt + response (never the KV-cache
path the rollout engine uses): the difference between the two is the
training–inference mismatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from unison.batch import RolloutBatch
from unison.models import load_model, load_tokenizer
from unison.precision import autocast


def token_logprobs(model, tokens: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, compute_dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", return_entropy: bool = False):
    """log π(tokens[:, t] | tokens[:, <t]) for every position, aligned with ``tokens``.

    Position 0 has no context and is set to 0; so are padding positions (mask
    them with the response mask). The forward runs under autocast in
    ``compute_dtype``; logits are cast to fp32 and divided by ``temperature``
    before the log-softmax. Gradients flow when called outside ``no_grad``.
    With ``return_entropy`` also returns the (detached) entropy of the
    next-token distribution at each position, aligned the same way.
    """
    tokens = tokens.to(device)
    attention_mask = attention_mask.to(device)
    with autocast(device, compute_dtype):
        logits = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    lsm = torch.log_softmax(logits, dim=-1)
    logp = lsm.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
    logp = logp * attention_mask.to(logp.dtype)
    if not return_entropy:
        return logp
    with torch.no_grad():
        ent = -(lsm.exp() * lsm).sum(-1)
        ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
    return logp, ent


class Learner:
    """Holds the policy π in fp32 and scores rollouts under the learner's compute dtype."""

    def __init__(self, model_dir: str | Path, compute_dtype: torch.dtype = torch.float32,
                 device: str = "cpu", temperature: float = 1.0):
        self.model_dir = Path(model_dir)
        self.device = device
        self.compute_dtype = compute_dtype
        self.temperature = temperature
        self.model = load_model(self.model_dir, dtype=torch.float32, device=device)  # master weights
        self.tokenizer = load_tokenizer(self.model_dir)

    @torch.no_grad()
    def score(self, batch: RolloutBatch, micro_batch_size: int = 16) -> torch.Tensor:
        """log π for every position of ``batch.tokens`` ([B, L], fp32, 0 off-response)."""
        self.model.eval()
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        for s in range(0, batch.size, micro_batch_size):
            sl = slice(s, s + micro_batch_size)
            lp = token_logprobs(self.model, batch.tokens[sl], batch.attention_mask[sl],
                                self.temperature, self.compute_dtype, self.device)
            out[sl] = lp.float().cpu() * batch.response_mask[sl]
        return out

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Weights to sync into a rollout engine (the engine casts them to its dtype)."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()
