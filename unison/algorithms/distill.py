"""On-policy distillation (OPD): the student samples, a teacher scores every sampled token, and the per-token
reverse KL is the (negative) advantage, with discount 0 (docs/algorithms.md, "On-policy distillation").

For a sampled token y_t of a response, with the student's log-probability s_t and the teacher's q_t:

    A_t = −coef · (s_t − q_t)          (+ the task's advantage A, the same on every token, with task_reward)

The student term s_t is the learner's log π_old — the policy being trained, scored by the trainer — not the
sampler's log μ, which the recipe most frameworks copy takes: with μ the training–inference mismatch
(log μ − log π_old, per token) enters the reward itself. Both are reported: ``distill/reverse_kl_pi`` (the
signal trained on) and ``distill/reverse_kl_mu`` (what μ would have given), and ``distill/mismatch_share``,
the part of the μ recipe's signal that is mismatch. Only response tokens the model sampled count (``mask``: prompt, padding and,
in multi-turn episodes, tool and environment tokens are 0).
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(logp_student: torch.Tensor, logp_teacher: torch.Tensor, mask: torch.Tensor,
                          coef: float, task_advantages: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L] per-token advantages: −coef·(log π_student − log π_teacher) on the mask (0 elsewhere), plus the
    task's per-response advantage ``task_advantages`` [B] on every masked token when given."""
    m = mask.to(torch.float32)
    adv = -coef * (logp_student.float() - logp_teacher.float()) * m
    if task_advantages is not None:
        adv = adv + task_advantages.float()[:, None] * m
    return adv


def reverse_kl_metrics(logp_old: torch.Tensor, logp_mu: torch.Tensor, logp_teacher: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, float]:
    """The per-token reverse KL estimate (k1, mean over masked tokens) with the student term from π_old and
    from μ, and the mismatch's share of the μ recipe's signal: mean |log μ − log π_old| over mean
    |log μ − log π_teacher| (≈ 1 or above: the μ recipe's signal is mismatch, all of it when π_old equals the teacher;
    above 1 when the learner's own numerics differ from the teacher's too; 0 when it has no signal)."""
    m = mask.to(torch.float32)
    n = max(float(m.sum()), 1.0)
    rk_pi = (logp_old.float() - logp_teacher.float()) * m
    rk_mu = (logp_mu.float() - logp_teacher.float()) * m
    gap = ((logp_mu.float() - logp_old.float()) * m).abs().sum() / n
    size = rk_mu.abs().sum() / n
    return {"distill/reverse_kl_pi": float(rk_pi.sum() / n), "distill/reverse_kl_mu": float(rk_mu.sum() / n),
            "distill/mismatch_share": float(gap / size) if float(size) > 0 else 0.0}
