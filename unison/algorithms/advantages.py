"""Advantage estimators: per-response advantages from rewards and group ids.

Registered by name in ``ADVANTAGES``; every function maps ``rewards [B]`` and
``group_ids [B]`` (responses to the same prompt share an id) to ``[B]``.
"""

from __future__ import annotations

import torch


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.double()
    sums = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inv, r)
    mean = sums / counts
    sq = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inv, (r - mean[inv]) ** 2)
    # unbiased (n−1) std as in GRPO implementations; 0 for singleton groups
    std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return mean[inv], std[inv]


def drgrpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Paper A's GRPO form): A_i = R_i − mean_{j∈g(i)} R_j. No std division."""
    mean, _ = _group_stats(rewards, group_ids)
    return (rewards.double() - mean).float()


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (R_i − mean_g R) / (std_g R + eps), std with n−1 (0 for a singleton group)."""
    mean, std = _group_stats(rewards, group_ids)
    return ((rewards.double() - mean) / (std + eps)).float()


ADVANTAGES = {"drgrpo": drgrpo, "grpo": grpo}


def uniform_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] bool: the response's group has all-equal rewards (zero advantage: no learning signal)."""
    _, std = _group_stats(rewards, group_ids)
    return std == 0
