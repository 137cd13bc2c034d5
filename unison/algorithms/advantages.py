"""Advantage estimators: per-response advantages from rewards and group ids.

Registered by name in ``ADVANTAGES``; every function maps ``rewards [B]`` and
``group_ids [B]`` (responses to the same prompt share an id) to ``[B]``.
Groups of one response get advantage 0 from group baselines (no baseline exists).
"""

from __future__ import annotations

import torch

EPS = 1e-6


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.double()
    sums = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inv, r)
    mean = sums / counts
    sq = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inv, (r - mean[inv]) ** 2)
    # unbiased (n−1) std as in GRPO implementations; 0 for singleton groups
    std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return mean[inv], std[inv], sums[inv], counts[inv]


def drgrpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025; Paper A's GRPO form): A_i = R_i − mean_{j∈g(i)} R_j. No std division."""
    mean, *_ = _group_stats(rewards, group_ids)
    return (rewards.double() - mean).float()


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO (Shao et al. 2024): A_i = (R_i − mean_g R) / (std_g R + 1e-6), std with n−1."""
    mean, std, *_ = _group_stats(rewards, group_ids)
    return ((rewards.double() - mean) / (std + EPS)).float()


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = R_i − mean_{j∈g(i), j≠i} R_j = n/(n−1)·(R_i − mean_g R)."""
    _, _, sums, counts = _group_stats(rewards, group_ids)
    r = rewards.double()
    loo = (sums - r) / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, r - loo, torch.zeros_like(r)).float()


def batch_norm(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Batch-normalised (REINFORCE++-style): A_i = (R_i − mean_batch R) / (std_batch R + 1e-6), std with n−1."""
    r = rewards.double()
    std = r.std() if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return ((r - r.mean()) / (std + EPS)).float()


ADVANTAGES = {"drgrpo": drgrpo, "grpo": grpo, "rloo": rloo, "batch_norm": batch_norm}


def uniform_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] bool: the response's group has all-equal rewards (zero advantage: no learning signal)."""
    _, std, *_ = _group_stats(rewards, group_ids)
    return std == 0
