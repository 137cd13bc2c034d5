"""Learning-rate schedules. The length-triggered decay of Paper B will live here too.

A schedule is a small stateful object: ``lr(step)`` gives the LR for a
training step, ``observe(step, metrics)`` lets a schedule react to what the
run measured (response length, mismatch, gradient noise), and
``state_dict``/``load_state_dict`` carry its state through checkpoints.
"""

from __future__ import annotations

import math


class LRSchedule:
    """constant | warmup (linear from 0 over ``warmup_steps``, then constant) |
    cosine (warmup, then cosine from ``lr`` to ``min_lr_ratio·lr`` at the last step)."""

    def __init__(self, kind: str, base_lr: float, total_steps: int, warmup_steps: int = 0,
                 min_lr_ratio: float = 0.0):
        self.kind, self.base_lr, self.total = kind, base_lr, total_steps
        self.warmup, self.min_ratio = warmup_steps, min_lr_ratio

    def lr(self, step: int) -> float:
        if self.kind != "constant" and self.warmup and step < self.warmup:
            return self.base_lr * (step + 1) / self.warmup
        if self.kind == "cosine":
            span = max(self.total - self.warmup - 1, 1)
            frac = min(max(step - self.warmup, 0) / span, 1.0)
            return self.base_lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        return self.base_lr

    def observe(self, step: int, metrics: dict) -> dict:
        """React to a step's metrics; return metrics of the schedule itself (none here)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_schedule(train_cfg) -> LRSchedule:
    return LRSchedule(train_cfg.schedule, train_cfg.lr, train_cfg.steps, train_cfg.warmup_steps,
                      train_cfg.min_lr_ratio)
