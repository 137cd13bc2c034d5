"""Advantages, corrections and losses against numbers computed by hand, on-policy
identities, and property tests over random inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison.algorithms.advantages import ADVANTAGES, batch_norm, drgrpo, grpo, rloo, uniform_groups
from unison.algorithms.corrections import CORRECTIONS
from unison.algorithms.losses import LOSSES, aggregate
from unison.algorithms.presets import PRESETS, correction_kwargs, loss_kwargs, resolve_policy
from unison.config import PolicyConfig
from unison.errors import UnisonError

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
G = torch.tensor([0, 0, 0, 1, 1, 2])


# ------------------------------------------------------------------ advantages
def test_drgrpo_subtracts_the_group_mean_only():
    assert drgrpo(R, G).tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_grpo_divides_by_the_unbiased_group_std():
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    a = grpo(R, G)
    assert a[:3].tolist() == pytest.approx([(2 / 3) / std0, (-1 / 3) / std0, (-1 / 3) / std0], rel=1e-5)
    assert a[3:].tolist() == [0.0, 0.0, 0.0]  # uniform group and singleton: zero, not NaN
    assert uniform_groups(R, G).tolist() == [False, False, False, True, True, True]


def test_rloo_uses_the_leave_one_out_mean():
    assert rloo(R, G).tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 0.0])


def test_batch_norm_normalises_over_the_batch():
    std = math.sqrt((4 * (1 / 3) ** 2 + 2 * (2 / 3) ** 2) / 5)
    a = batch_norm(R, G)
    assert a.tolist() == pytest.approx([(1 / 3) / std, -(2 / 3) / std, -(2 / 3) / std] + [(1 / 3) / std] * 3,
                                       rel=1e-5)


# ----------------------------------------------------------------- corrections
# four responses; position 0 is prompt, row 1 has one padding position.
RHO = [[3.0, 0.5], [1.2, None], [20.0, 1e-5], [2.0, 0.5]]
MASK = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]], dtype=torch.float32)
LMU = torch.full((4, 3), -1.0)
LOLD = LMU.clone()
for i, row in enumerate(RHO):
    for j, r in enumerate(row):
        if r is not None:
            LOLD[i, j + 1] = -1.0 + math.log(r)
LOLD[1, 2] = 55.0  # junk on padding


def _w(name, **kw):
    w, m = CORRECTIONS[name](LOLD, LMU, MASK, **kw)
    return [[round(x, 6) for x in row[1:]] for row in w.tolist()], m


def test_token_tis_by_hand():
    w, m = _w("token_tis", c=2.0)
    assert w == [[2.0, 0.5], [1.2, 0.0], [2.0, 1e-5], [2.0, 0.5]]
    assert m["correction/ratio_max"] == pytest.approx(20.0, rel=1e-5)  # raw, before truncation
    assert m["correction/ratio_min"] == pytest.approx(1e-5, rel=1e-3)
    assert m["correction/weight_mean"] == pytest.approx((2 + .5 + 1.2 + 2 + 1e-5 + 2 + .5) / 7, rel=1e-5)
    assert m["correction/masked_fraction"] == 0.0
    ws = torch.tensor([2, .5, 1.2, 2, 1e-5, 2, .5])
    assert m["correction/ess"] == pytest.approx(float(ws.mean() ** 2 / (ws * ws).mean()), rel=1e-5)


def test_token_mis_by_hand():
    w, m = _w("token_mis", c=2.0, c_low=0.5)
    assert w == [[0.0, 0.5], [1.2, 0.0], [0.0, 0.0], [2.0, 0.5]]
    assert m["correction/masked_fraction"] == pytest.approx(3 / 7)


def test_sequence_corrections_by_hand():
    w, _ = _w("seq_tis", c=2.0)
    assert w == [[1.5, 1.5], [1.2, 0.0], [0.0002, 0.0002], [1.0, 1.0]]
    w, m = _w("seq_mis", c=1.3)  # row 0 has ρ = 1.5 > 1.3: dropped
    assert w == [[0.0, 0.0], [1.2, 0.0], [0.0002, 0.0002], [1.0, 1.0]]
    assert m["correction/seq_masked_fraction"] == pytest.approx(0.25)
    assert m["correction/masked_fraction"] == pytest.approx(2 / 7)
    w, _ = _w("seq_mis")  # paper default C = 10: nothing dropped
    assert w[0] == [1.5, 1.5]
    w, m = _w("geo_rs", c=1.01, c_low=0.99)  # geometric means √1.5, 1.2, √2e-4, 1
    assert w == [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert m["correction/seq_masked_fraction"] == pytest.approx(0.75)
    w, _ = _w("veto", threshold=1e-4)
    assert w == [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]


# ---------------------------------------------------------------------- losses
def test_ppo_clip_by_hand_with_gradient():
    # A = +1. Token 1: ratio e^{0.5} > 1.2 -> clipped (no grad); token 2: e^{-0.1} inside the band.
    logp = torch.tensor([[0.0, -0.5, -1.1]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    w = torch.tensor([[0.0, 1.0, 2.0]])
    per_tok, m = LOSSES["ppo_clip"](logp, old, old, torch.tensor([1.0]), w, mask, clip=0.2)
    assert per_tok[0, 1].item() == pytest.approx(-1.2)
    assert per_tok[0, 2].item() == pytest.approx(-2.0 * math.exp(-0.1), rel=1e-6)
    assert m["policy/clip_fraction"] == pytest.approx(0.5)
    # log r = (0.5, −0.1). k1 (verl's ppo_kl) = mean(−log r) = (−0.5 + 0.1) / 2 = −0.2
    assert m["policy/ppo_kl"] == pytest.approx(-0.2, rel=1e-6)
    # k3 = mean(r − 1 − log r) = (e^0.5 − 1.5 + e^−0.1 − 0.9) / 2
    assert m["policy/ppo_kl_k3"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.1) - 0.9) / 2, rel=1e-6)
    per_tok.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -2.0 * math.exp(-0.1)], rel=1e-6)


def test_gspo_by_hand_value_and_gradient():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    w = mask.clone()
    s = math.exp(0.1)  # mean(0.3, -0.1)
    # A = +1: s > 1 + 4e-4 -> clipped: value −(1 + 4e-4) per token, no gradient
    logp = (old + torch.tensor([[0.0, 0.3, -0.1]])).requires_grad_()
    per_tok, m = LOSSES["gspo"](logp, old, old, torch.tensor([1.0]), w, mask, clip=3e-4, clip_high=4e-4)
    loss = aggregate(per_tok, "seq_mean_token_mean", mask, 2, 1, 8)
    assert loss.item() == pytest.approx(-(1 + 4e-4), rel=1e-6) and m["policy/clip_fraction"] == 1.0
    assert m["policy/seq_ratio_mean"] == pytest.approx(s, rel=1e-6)
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0
    # A = −1: the unclipped branch is the min: value +s, d/dlogp_t = s / T (T = 2)
    logp = (old + torch.tensor([[0.0, 0.3, -0.1]])).requires_grad_()
    per_tok, _ = LOSSES["gspo"](logp, old, old, torch.tensor([-1.0]), w, mask, clip=3e-4, clip_high=4e-4)
    loss = aggregate(per_tok, "seq_mean_token_mean", mask, 2, 1, 8)
    assert loss.item() == pytest.approx(s, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, s / 2, s / 2], rel=1e-6)


def test_pg_seq_is_stop_gradient_on_the_sequence_weight():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[0.0, -1.5, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    w = math.exp(0.5)  # π_θ(y)/μ(y)
    per_tok, _ = LOSSES["pg_seq_is"](logp, logp.detach(), mu, torch.tensor([2.0]), mask, mask)
    assert per_tok.tolist()[0] == pytest.approx([0.0, 2 * w * 1.0, 2 * w * 2.0], rel=1e-6)
    per_tok.sum().backward()
    # sg[w]: the gradient is −w·A on each token, no d(w)/dθ term
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -2 * w, -2 * w], rel=1e-6)


def test_pg_seq_mis_masks_heavy_responses_to_exactly_zero():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[0.0, -1.5, -2.0], [0.0, -1.0, -2.1]])  # weights e^0.5 = 1.65 and e^0.1
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    per_tok, m = LOSSES["pg_seq_mis"](logp, logp.detach(), mu, torch.tensor([1.0, 1.0]), mask, mask, loss_c=1.5)
    per_tok.sum().backward()
    assert logp.grad[0].abs().sum().item() == 0.0 and per_tok[0].abs().sum().item() == 0.0
    assert logp.grad[1, 1:].tolist() == pytest.approx([-math.exp(0.1)] * 2, rel=1e-6)
    assert m["policy/clip_fraction"] == pytest.approx(0.5)


def test_pg_token_is_by_hand():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[0.0, -1.5, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    per_tok, _ = LOSSES["pg_token_is"](logp, logp.detach(), mu, torch.tensor([1.0]), mask, mask)
    per_tok.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -math.exp(0.5), -1.0], rel=1e-6)


def test_aggregations_by_hand():
    per_tok = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_tok, "token_mean", mask, 3, 2, 8).item() == pytest.approx(2.0)
    assert aggregate(per_tok, "seq_mean_token_sum", mask, 3, 2, 8).item() == pytest.approx(3.0)
    assert aggregate(per_tok, "seq_mean_token_mean", mask, 3, 2, 8).item() == pytest.approx((1.5 + 3) / 2)
    assert aggregate(per_tok, "seq_mean_token_sum_norm", mask, 3, 2, 8).item() == pytest.approx(6 / 16)


# ------------------------------------------------------------ on-policy identities
def _random(seed, B=3, L=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g) * 3
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 0
    mask[:, 1] = 1
    return logp, mask, torch.randn(B, generator=g)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_on_policy_every_correction_weight_is_one(name):
    logp, mask, _ = _random(0)
    w, m = CORRECTIONS[name](logp, logp.clone(), mask)
    assert torch.equal(w, mask) and m["correction/masked_fraction"] == 0.0 and m["correction/ess"] == 1.0


@pytest.mark.parametrize("loss", ["ppo_clip", "pg_seq_is", "pg_seq_mis", "pg_token_is"])
def test_on_policy_gradients_equal_reinforce(loss):
    base, mask, adv = _random(1)
    logp = base.clone().requires_grad_()
    per_tok, _ = LOSSES[loss](logp, base, base, adv, mask, mask, clip=0.2)
    per_tok.sum().backward()
    assert torch.allclose(logp.grad, -adv[:, None] * mask, atol=1e-6)
    if loss == "pg_seq_is":  # the value is REINFORCE's too
        assert torch.allclose(per_tok, -adv[:, None] * base * mask, atol=1e-6)


def test_on_policy_gspo_gradient_is_the_per_sequence_mean_pg():
    base, mask, adv = _random(2)
    logp = base.clone().requires_grad_()
    per_tok, _ = LOSSES["gspo"](logp, base, base, adv, mask, mask, clip=3e-4, clip_high=4e-4)
    aggregate(per_tok, "seq_mean_token_mean", mask, int(mask.sum()), 3, 6).backward()
    expected = -adv[:, None] * mask / mask.sum(-1, keepdim=True) / 3
    assert torch.allclose(logp.grad, expected, atol=1e-6)


# ------------------------------------------------------------------ properties
COMBOS = [(p["loss"], p["correction"], p["loss_agg"])
          for p in (resolve_policy(a, PolicyConfig()) for a in PRESETS)]
COMBOS += [("ppo_clip", c, "token_mean") for c in CORRECTIONS] + [("gspo", "seq_mis", "seq_mean_token_mean"),
                                                                  ("gspo", "veto", "seq_mean_token_sum")]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 64), st.integers(0, 2**31 - 1), st.sampled_from(COMBOS))
def test_losses_are_finite_padding_free_and_masked_rows_get_no_gradient(B, L, seed, combo):
    loss_name, corr, agg = combo
    g = torch.Generator().manual_seed(seed)
    L += 1
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 0
    mask[0] = 0  # row 0 fully masked
    mu = -torch.rand(B, L, generator=g) * 5
    old = mu + (torch.rand(B, L, generator=g) - 0.5) * 100  # log-ratios in ±50
    cur = old + (torch.rand(B, L, generator=g) - 0.5) * 100
    adv = torch.randn(B, generator=g)

    def run(c, o, m_):
        logp = c.clone().requires_grad_()
        w, _ = CORRECTIONS[corr](o, m_, mask)
        per_tok, _ = LOSSES[loss_name](logp, o, m_, adv, w, mask, clip=0.2, loss_c=3.0)
        loss = aggregate(per_tok, agg, mask, int(mask.sum()), B, L)
        loss.backward()
        return loss, logp.grad, w

    loss, grad, w = run(cur, old, mu)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    junk = torch.where(mask.bool(), 0.0, torch.randn(B, L, generator=g) * 50)
    loss2, grad2, _ = run(cur + junk, old - junk, mu + junk)
    assert torch.allclose(loss, loss2, rtol=1e-5, atol=1e-6)
    assert torch.allclose(grad, grad2, rtol=1e-5, atol=1e-6)
    assert grad[0].abs().sum() == 0  # masked response
    dropped = (w * mask).sum(-1) == 0
    assert grad[dropped].abs().sum() == 0  # responses a correction dropped


# -------------------------------------------------------------------- presets
def test_presets_and_overrides():
    p = resolve_policy("grpo", PolicyConfig())
    assert (p["advantage"], p["correction"], p["clip"], p["loss_agg"]) == (
        "drgrpo", "none", 0.2, "seq_mean_token_sum_norm")
    p = resolve_policy("grpo_token_tis", PolicyConfig(clip=0.1))
    assert p["correction"] == "token_tis" and correction_kwargs(p) == {"c": 2.0} and p["clip"] == 0.1
    assert correction_kwargs(resolve_policy("grpo_seq_mis", PolicyConfig())) == {"c": 10.0}
    g = resolve_policy("gspo", PolicyConfig())
    assert (g["advantage"], loss_kwargs(g), g["loss_agg"]) == (
        "grpo", {"clip": 3e-4, "clip_high": 4e-4}, "seq_mean_token_mean")
    assert loss_kwargs(resolve_policy("pg_seq_mis", PolicyConfig())) == {"loss_c": 3.0}
    assert set(PRESETS) == {"grpo", "grpo_token_tis", "grpo_seq_mis", "gspo", "pg_seq_is", "pg_seq_mis",
                            "pg_token_is", "dppo_tv", "dppo_kl", "grpo_icepop", "ipo", "grpo_m2po", "grpo_m2po_mask",
                            "opd"}
    assert set(ADVANTAGES) == {"grpo", "drgrpo", "rloo", "batch_norm"}
    with pytest.raises(UnisonError, match="unknown algo"):
        resolve_policy("ppo2", PolicyConfig())


def test_nonsense_combinations_are_refused():
    with pytest.raises(UnisonError, match="already weights by"):
        resolve_policy("pg_seq_is", PolicyConfig(correction="token_tis"))
    with pytest.raises(UnisonError, match="does not compose"):
        resolve_policy("gspo", PolicyConfig(correction="token_mis"))


def test_geo_rs_equals_verl_seq_mean_k1_with_reciprocal_thresholds():
    # verl (rollout_corr_helper.compute_rollout_rejection_mask, rollout_rs="seq_mean_k1"): statistic
    # mean_t(−log ρ_t) with log ρ_t = old − rollout clamped to ±20; keep iff log lo ≤ stat ≤ log hi.
    # docs/algorithms.md: geo_rs(c=C, c_low=L) ≡ seq_mean_k1 with "lo_hi" = "{1/C}_{1/L}".
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 6, generator=g)
    mu = old + 0.02 * torch.randn(64, 6, generator=g)
    mask = (torch.rand(64, 6, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    c, c_low = 1.01, 0.98
    lo, hi = 1 / c, 1 / c_low
    stat = (-(old - mu).clamp(-20, 20) * mask).sum(-1) / mask.sum(-1)
    verl_keep = ((stat >= math.log(lo)) & (stat <= math.log(hi))).float()
    w, _ = CORRECTIONS["geo_rs"](old, mu, mask, c=c, c_low=c_low)
    assert 0 < verl_keep.sum() < 64  # both outcomes occur
    assert torch.equal((w.sum(-1) > 0).float(), verl_keep)


# ------------------------------------------------------------------ DPPO (issue 18), by hand
def _dppo_inputs():
    # π_old = 0.5 everywhere; row 0 (A = +1) moves to 0.6 and 0.8, row 1 (A = −1) to 0.2 and 0.4
    p = torch.tensor([[0.6, 0.8], [0.2, 0.4]])
    logp = p.log().requires_grad_(True)
    old = torch.full((2, 2), 0.5).log()
    return logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), torch.ones(2, 2)


def test_dppo_tv_masks_by_the_probability_band_in_the_advantage_direction():
    logp, old, adv, w, m = _dppo_inputs()
    per_tok, met = LOSSES["dppo_tv"](logp, old, old, adv, w, m, clip=0.2, kl_tau=0.1)
    # kept: (0,0) dp = +0.1 <= 0.2 and (1,1) dp = -0.1 >= -0.2; masked: (0,1) dp = +0.3, (1,0) dp = -0.3
    pg = torch.tensor([[-1.2 * math.log(0.6), 0.0], [0.0, 0.8 * math.log(0.4)]])  # -keep·A·(p/p_old)·log p
    kl = 0.1 * torch.tensor([[math.log(1.2) ** 2, math.log(1.6) ** 2], [math.log(0.4) ** 2, math.log(0.8) ** 2]])
    assert torch.allclose(per_tok, pg + kl, atol=1e-6)
    assert met["policy/clip_fraction"] == 0.5
    per_tok.sum().backward()
    # d/dlog p of a kept token: -A·r + 2·kl_tau·log r; of a masked one: the KL term only
    want = torch.tensor([[-1.2 + 0.2 * math.log(1.2), 0.2 * math.log(1.6)],
                         [0.2 * math.log(0.4), 0.8 + 0.2 * math.log(0.8)]])
    assert torch.allclose(logp.grad, want, atol=1e-6)


def test_dppo_tv_caps_the_ratio_weight_with_loss_c():
    logp, old, adv, w, m = _dppo_inputs()
    per_tok, _ = LOSSES["dppo_tv"](logp, old, old, adv, w, m, clip=0.2, loss_c=1.1)
    assert per_tok[0, 0].item() == pytest.approx(-1.1 * math.log(0.6))  # min(1.2, 1.1)


def test_dppo_kl_uses_the_bernoulli_kl_and_keeps_moves_against_the_advantage():
    p = torch.tensor([[0.6, 0.8, 0.1]])
    logp, old = p.log(), torch.full((1, 3), 0.5).log()
    # D(0.5 → 0.6) = 0.5 log(5/6) + 0.5 log(5/4) = 0.0204 <= 0.05: kept; D(0.5 → 0.8) = 0.223: masked;
    # 0.5 → 0.1 has D = 0.511 but p <= p_old with A > 0: kept
    d = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    assert d == pytest.approx(0.020411, abs=1e-6)
    per_tok, met = LOSSES["dppo_kl"](logp, old, old, torch.tensor([1.0]), torch.ones(1, 3), torch.ones(1, 3),
                                      clip=0.05)
    assert per_tok[0, 1].item() == 0.0 and per_tok[0, 0].item() != 0.0 and per_tok[0, 2].item() != 0.0
    assert met["policy/clip_fraction"] == pytest.approx(1 / 3)


def test_dppo_presets_follow_prime_rl_and_verl():
    tv = resolve_policy("dppo_tv", PolicyConfig())
    assert (tv["loss"], tv["clip"], tv["clip_high"], tv["kl_tau"], tv["anchor"]) == ("dppo_tv", 0.2, 0.2, 1e-3,
                                                                                        "recompute")
    assert resolve_policy("dppo_tv", PolicyConfig(bypass=True))["anchor"] == "bypass"
    assert resolve_policy("dppo_kl", PolicyConfig())["clip"] == 0.05
    with pytest.raises(UnisonError, match="policy.bypass is true but policy.anchor is 'loglinear'"):
        resolve_policy("grpo", PolicyConfig(bypass=True, anchor="loglinear"))


# ------------------------------------------------------------------ anchors (issue 18), by hand
def test_loglinear_alpha_and_logp_by_hand():
    from unison.algorithms.anchors import OldLogp, loglinear_alpha, loglinear_logp

    v = torch.tensor([3, 5, 5])
    # step 5 of 4 mini-batches, mini-batch 2: v_θ = 5.5, v_prox = 5
    assert loglinear_alpha(v, 5.0, 5.5).tolist() == pytest.approx([2 / 2.5, 0.0, 0.0])
    # first mini-batch: θ = θ_old, so a stale sample's proximal policy is π_θ itself (α = 1)
    assert loglinear_alpha(v, 5.0, 5.0).tolist() == pytest.approx([1.0, 0.0, 0.0])
    mu, theta = torch.full((3, 2), -2.0), torch.full((3, 2), -1.0)
    out = loglinear_logp(theta, mu, torch.tensor([0.8, 0.0, 1.0]))
    assert out[:, 0].tolist() == pytest.approx([-1.2, -2.0, -1.0])  # log μ + α (log π_θ − log μ)
    old = OldLogp("loglinear", v_behave=v, step=5, mini_batches=4)
    assert old(torch.tensor([0]), theta[:1], mu[:1], 2)[0, 0].item() == pytest.approx(-1.2)
    assert torch.equal(OldLogp("fused")(torch.tensor([0]), theta[:1], mu[:1], 0), theta[:1])
    # per token: a response a sync reached mid-way, its first token of version 3 and its second of version 4;
    # mini-batch 2 of 4 at step 5 (v_θ = 5.5): α = 2/2.5 and 1/1.5 — each token from its own version
    tv = torch.tensor([[3, 4]])
    assert loglinear_alpha(tv, 5.0, 5.5).tolist() == [pytest.approx([0.8, 2 / 3])]
    got = OldLogp("loglinear", v_behave=tv, step=5, mini_batches=4)(torch.tensor([0]), theta[:1], mu[:1], 2)
    assert got[0].tolist() == pytest.approx([-2.0 + 0.8, -2.0 + 2 / 3])


def test_the_anchor_is_the_one_writer_of_pi_old_and_knows_where_it_holds(tiny_dir):
    """The Anchor (issue 53): ``score`` scores every row before the update and π_old is known there; ``bypass``
    stores log μ; ``fused`` leaves it to the training forward, and afterwards π_old is that forward's, on every row;
    ``loglinear``, on the first mini-batch's rows only."""
    from types import SimpleNamespace

    from unison.algorithms.anchors import Anchor
    from unison.algorithms.corrections import CORRECTIONS
    from unison.batch import Completion, collate

    b = collate([Completion([1, 2], [3, 4], [-1.0, -2.0], "stop"), Completion([1], [5], [-0.5], "stop")], pad_id=0)
    scored = torch.tensor([[0.0, 0.0, -1.5, -2.5], [0.0, -0.7, 0.0, 0.0]])
    calls = []

    def score(batch):
        calls.append(batch.size)
        return scored, None

    correct = CORRECTIONS["token_tis"]
    a = Anchor("recompute", 2, True, correct)
    assert a.kind == "score" and a == "score" and a.scored
    a.before_update(b, 0, score)
    assert calls == [2] and torch.equal(b.logp_old, scored)
    w, metrics, mask = a.weights(b)
    assert torch.is_tensor(w) and metrics["correction/ratio_max"] > 0 and mask is None
    known = a.known(b, None, metrics)
    assert known.rows.tolist() == [0, 1] and known.logp is scored and known.corrections is metrics

    bypass = Anchor("bypass", 2, True, correct)
    bypass.before_update(b, 0, score)
    assert torch.equal(b.logp_old, b.logp_mu) and b.logp_old is not b.logp_mu and calls == [2]

    first = torch.tensor([[0.0, 0.0, -1.0, -2.0], [0.0, -0.5, 0.0, 0.0]])  # the training forward at θ_old: = μ
    stats = SimpleNamespace(first_rows=torch.tensor([0]), logp_first=first, routing_first=None)
    for kind, anchor, rows in (("fused", "recompute", [0, 1]), ("loglinear", "loglinear", [0])):
        a = Anchor(anchor, 1 if kind == "fused" else 2, True, correct)
        assert a.kind == kind
        a.before_update(b, 0, score)
        assert b.logp_old is None and calls == [2]  # no score pass: π_old comes from the training forward
        w, metrics, _ = a.weights(b)
        assert callable(w) and metrics == {}
        known = a.known(b, stats, metrics)
        assert known.rows.tolist() == rows and known.logp is first
        assert known.corrections["correction/ratio_max"] == pytest.approx(1.0)  # π_old = μ: every ratio 1
