"""Precision as one knob: ``fp32 | bf16 | fp16`` for both engines, with per-engine overrides.

Paper A's recipe (docs/papers.md, "The fp16 recipe"):

* the **rollout engine** holds its weights cast to its dtype and computes in it;
* the **learner** keeps fp32 master weights and fp32 optimizer state, and runs
  forward/backward under ``torch.autocast`` in its dtype;
* a dynamic **loss scaler** (``torch.amp.GradScaler``) is used exactly when the
  learner's compute dtype is fp16. bf16 has fp32's range and needs none.

Log-probabilities are always taken from logits cast to fp32 in both engines
(as vLLM's sampler and verl's trainer do), so the mismatch we measure is that
of the network's compute, not of a low-precision softmax.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from unison.config.values import parse_precision

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    """Resolved precision of both engines.

    ``Precision.resolve("fp16")`` sets both; ``rollout=``/``learner=`` override one.
    """

    rollout: str = "fp32"
    learner: str = "fp32"

    @classmethod
    def resolve(cls, precision: str = "fp32", rollout: str | None = None,
                learner: str | None = None) -> Precision:
        base = parse_precision(precision)
        return cls(rollout=parse_precision(rollout or base), learner=parse_precision(learner or base))

    @property
    def rollout_dtype(self) -> torch.dtype:
        return DTYPES[self.rollout]

    @property
    def learner_dtype(self) -> torch.dtype:
        return DTYPES[self.learner]

    @property
    def uses_loss_scaling(self) -> bool:
        return self.learner == "fp16"

    @property
    def label(self) -> str:
        return self.rollout if self.rollout == self.learner else f"{self.rollout}/{self.learner}"


def autocast(device: str | torch.device, dtype: torch.dtype):
    """Autocast context for the learner's compute dtype (a no-op for fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=dtype)


def make_grad_scaler(precision: Precision, device: str | torch.device, init_scale: float = 2.0**16,
                     growth_interval: int = 400, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5) -> torch.amp.GradScaler:
    """A GradScaler, enabled exactly when the learner computes in fp16.

    A disabled scaler is a pass-through (``scale(x) is x``, ``step`` just steps),
    so the training loop has one code path for every precision.
    """
    return torch.amp.GradScaler(
        torch.device(device).type, init_scale=init_scale, growth_factor=growth_factor,
        backoff_factor=backoff_factor, growth_interval=growth_interval,
        enabled=precision.uses_loss_scaling,
    )
