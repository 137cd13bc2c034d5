"""Advantages, corrections and losses against numbers computed by hand."""

import math

import pytest
import torch

from unison.algorithms.advantages import drgrpo, grpo, uniform_groups
from unison.algorithms.corrections import none, token_tis
from unison.algorithms.losses import aggregate, ppo_clip
from unison.algorithms.presets import resolve_policy
from unison.config import PolicyConfig
from unison.errors import UnisonError

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
G = torch.tensor([0, 0, 0, 1, 1, 2])


def test_drgrpo_subtracts_the_group_mean_only():
    assert drgrpo(R, G).tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_grpo_divides_by_the_unbiased_group_std():
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    a = grpo(R, G)
    assert a[:3].tolist() == pytest.approx([(2 / 3) / std0, (-1 / 3) / std0, (-1 / 3) / std0], rel=1e-5)
    assert a[3:].tolist() == [0.0, 0.0, 0.0]  # uniform group and singleton: zero, not NaN
    assert uniform_groups(R, G).tolist() == [False, False, False, True, True, True]


def test_token_tis_truncates_at_c_and_reports_raw_ratios():
    lo = torch.tensor([[0.0, math.log(3.0), math.log(0.5), 0.0]])
    lm = torch.zeros(1, 4)
    mask = torch.tensor([[0, 1, 1, 0]])
    w, m = token_tis(lo, lm, mask, c=2.0)
    assert w.tolist()[0] == pytest.approx([0, 2.0, 0.5, 0])
    assert m["correction/ratio_max"] == pytest.approx(3.0)
    assert m["correction/ratio_min"] == pytest.approx(0.5)
    assert m["correction/weight_mean"] == pytest.approx(1.25)
    assert m["correction/masked_fraction"] == 0.0
    assert m["correction/ess"] == pytest.approx(1.25**2 / ((4 + 0.25) / 2))
    w0, m0 = none(lo, lm, mask)
    assert w0.tolist()[0] == [0, 1, 1, 0] and m0["correction/ratio_max"] == pytest.approx(3.0)


def test_ppo_clip_by_hand_with_gradient():
    # one response, two tokens; A = +1. Token 1: ratio e^{0.5} > 1.2 -> clipped (no grad);
    # token 2: ratio e^{-0.1} inside the band -> gradient −A·w·ratio.
    logp = torch.tensor([[0.0, -0.5, -1.1]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    w = torch.tensor([[0.0, 1.0, 2.0]])
    per_tok, m = ppo_clip(logp, old, torch.tensor([1.0]), w, mask, clip=0.2)
    assert per_tok[0, 1].item() == pytest.approx(-1.2)
    assert per_tok[0, 2].item() == pytest.approx(-2.0 * math.exp(-0.1), rel=1e-6)
    assert m["policy/clip_fraction"] == pytest.approx(0.5)
    per_tok.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -2.0 * math.exp(-0.1)], rel=1e-6)


def test_ppo_clip_on_policy_gradient_equals_policy_gradient():
    torch.manual_seed(0)
    logp = (-torch.rand(3, 5)).requires_grad_()
    mask = (torch.rand(3, 5) > 0.3).float()
    adv = torch.tensor([1.0, -0.5, 2.0])
    per_tok, _ = ppo_clip(logp, logp.detach(), adv, mask, mask, clip=0.2)
    per_tok.sum().backward()
    assert torch.allclose(logp.grad, -adv[:, None] * mask)


def test_aggregations():
    per_tok = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    assert aggregate(per_tok, "token_mean", num_tokens=3, num_seqs=2, max_len=8).item() == pytest.approx(2.0)
    assert aggregate(per_tok, "seq_mean_token_sum_norm", 3, 2, 8).item() == pytest.approx(6 / 16)


def test_presets_and_overrides():
    p = resolve_policy("grpo", PolicyConfig())
    assert (p["advantage"], p["correction"], p["clip"], p["loss_agg"]) == (
        "drgrpo", "none", 0.2, "seq_mean_token_sum_norm")
    p = resolve_policy("grpo_token_tis", PolicyConfig(clip=0.1))
    assert p["correction"] == "token_tis" and p["correction_c"] == 2.0 and p["clip"] == 0.1
    with pytest.raises(UnisonError, match="unknown algo"):
        resolve_policy("ppo2", PolicyConfig())
