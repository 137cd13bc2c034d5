"""Mismatch metrics against numbers computed by hand."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison import mismatch as mm

# Two responses. Position 0 is a prompt token, the last position of row 0 is
# padding; row 1 is a one-token response. Values off the mask are junk on
# purpose: they must not matter.
LOGP_PI = torch.tensor([[9.0, -1.0, -2.0, 7.0], [3.0, -0.5, 5.0, 5.0]])
LOGP_MU = torch.tensor([[-4.0, -1.5, -1.0, -9.0], [1.0, -0.5, -8.0, 2.0]])
MASK = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
# r = log π − log μ on the mask: [0.5, -1.0] and [0.0]


def test_token_estimators_by_hand():
    m = mm.mismatch_metrics(LOGP_PI, LOGP_MU, MASK)
    assert m["mismatch/k1"] == pytest.approx((-0.5 + 1.0 + 0.0) / 3)
    assert m["mismatch/k2"] == pytest.approx(0.5 * (0.25 + 1.0) / 3)
    k3 = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-1.0) - 1 + 1.0) + 0.0) / 3
    assert m["mismatch/k3"] == pytest.approx(k3, rel=1e-6)
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(0.5)
    assert m["mismatch/abs_logp_diff_max"] == pytest.approx(1.0)
    assert m["mismatch/num_tokens"] == 3
    assert m["mismatch/num_sequences"] == 2


def test_sequence_metrics_by_hand():
    m = mm.mismatch_metrics(LOGP_PI, LOGP_MU, MASK)
    # seq log-ratios: R0 = 0.5 - 1.0 = -0.5, R1 = 0
    assert mm.seq_log_ratio(LOGP_PI, LOGP_MU, MASK).tolist() == pytest.approx([-0.5, 0.0])
    assert m["mismatch/seq_kl"] == pytest.approx((0.5 + 0.0) / 2)
    seq_k3_row0 = (math.exp(0.5) - 1.5) + math.exp(-1.0)
    assert m["mismatch/seq_kl_k3"] == pytest.approx(seq_k3_row0 / 2, rel=1e-6)
    # log PPL_π − log PPL_μ per response: mean(−r) = 0.25 and 0
    assert m["mismatch/log_ppl_diff"] == pytest.approx(0.125)
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx(0.125)
    assert m["mismatch/ppl_ratio"] == pytest.approx((math.exp(0.25) + 1.0) / 2, rel=1e-6)
    assert m["mismatch/chi2_token"] == pytest.approx((math.e + math.exp(-2) + 1) / 3 - 1, rel=1e-6)
    assert m["mismatch/chi2_seq"] == pytest.approx((math.exp(-1.0) + 1) / 2 - 1, rel=1e-6)


def test_probability_gap_by_hand():
    m = mm.mismatch_metrics(LOGP_PI, LOGP_MU, MASK)
    d1 = math.exp(-1.0) - math.exp(-1.5)   # +0.1447
    d2 = math.exp(-2.0) - math.exp(-1.0)   # -0.2325
    assert m["mismatch/prob_diff_mean"] == pytest.approx((abs(d1) + abs(d2)) / 3, rel=1e-6)
    assert m["mismatch/prob_diff_max"] == pytest.approx(abs(d2), rel=1e-6)
    assert m["mismatch/prob_diff_signed_min"] == pytest.approx(d2, rel=1e-6)
    assert m["mismatch/prob_diff_signed_max"] == pytest.approx(d1, rel=1e-6)


def test_one_token_response():
    m = mm.mismatch_metrics(torch.tensor([[0.0, -0.2]]), torch.tensor([[0.0, -0.5]]),
                            torch.tensor([[0, 1]]))
    assert m["mismatch/k1"] == pytest.approx(-0.3)
    assert m["mismatch/k3"] == pytest.approx(math.exp(0.3) - 1.3, rel=1e-5)
    assert m["mismatch/seq_kl"] == pytest.approx(-0.3)
    assert m["mismatch/log_ppl_diff"] == pytest.approx(-0.3)


def test_all_masked_batch_is_defined():
    m = mm.mismatch_metrics(torch.randn(3, 5), torch.randn(3, 5), torch.zeros(3, 5))
    for key, value in m.items():
        assert math.isfinite(value), key
        # nothing to compare: ratios are 1, divergences 0, and no token disagrees (vacuously identical)
        expected = 1.0 if key in ("mismatch/ppl_ratio", "mismatch/identical_fraction") else 0.0
        assert value == expected, key


def test_identical_engines_give_zero_mismatch():
    lp = -torch.rand(4, 6)
    m = mm.mismatch_metrics(lp, lp.clone(), torch.ones(4, 6))
    for key in ("k1", "k2", "k3", "seq_kl", "seq_kl_k3", "prob_diff_max", "chi2_token", "chi2_seq"):
        assert m[f"mismatch/{key}"] == pytest.approx(0.0, abs=1e-6), key
    assert m["mismatch/ppl_ratio"] == pytest.approx(1.0)


def test_catastrophic_token_stays_finite():
    m = mm.mismatch_metrics(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -500.0]]),
                            torch.tensor([[0, 1]]))
    assert all(math.isfinite(v) for v in m.values())


def test_length_slope_by_hand():
    # y = 2 - 0.003 x exactly -> -3 per 1K tokens
    assert mm.length_slope([2 - 0.003 * x for x in (10, 20, 40)], [10, 20, 40]) == pytest.approx(-3.0)
    assert mm.length_slope([-0.5, 0.0], [2, 1]) == pytest.approx(-500.0)
    assert mm.length_slope([1.0, 2.0], [5, 5]) is None
    assert mm.length_slope([1.0], [5]) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_padding_never_changes_metrics(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    pi = -torch.rand(batch, length, generator=g) * 5
    mu = -torch.rand(batch, length, generator=g) * 5
    mask = (torch.rand(batch, length, generator=g) > 0.3).float()
    junk_pi = torch.where(mask.bool(), pi, torch.randn(batch, length, generator=g) * 50)
    junk_mu = torch.where(mask.bool(), mu, torch.randn(batch, length, generator=g) * 50)
    a = mm.mismatch_metrics(pi, mu, mask)
    b = mm.mismatch_metrics(junk_pi, junk_mu, mask)
    for k in a:
        assert math.isfinite(a[k])
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    assert a["mismatch/k3"] >= 0 and a["mismatch/k2"] >= 0


def test_chi2_keeps_a_tiny_mismatch_that_the_naive_form_cancels():
    # r_t = log π − log μ = 1e-8 on both tokens of one response (prob ≈ 1: log-probs near 0 are
    # exact in fp32). By hand: χ²_token = mean(e^{2r} − 1) = expm1(2e-8) ≈ 2e-8 (+ 2e-16);
    # χ²_seq = expm1(2R) with R = 2e-8, ≈ 4e-8. The naive mean(e^{2r}) − 1 gives exactly 0 in fp32.
    logp_mu = torch.tensor([[-2e-8, -2e-8]])
    logp_pi = torch.tensor([[-1e-8, -1e-8]])
    mask = torch.ones(1, 2)
    r = mm.log_ratio(logp_pi, logp_mu, mask)
    assert r[0].tolist() == pytest.approx([1e-8, 1e-8], rel=1e-6)
    assert float(torch.exp(2 * r).mean() - 1.0) == 0.0  # the old formula: cancelled to nothing
    assert float(mm.chi2_token(logp_pi, logp_mu, mask)) == pytest.approx(2e-8, rel=1e-5)
    assert float(mm.chi2_seq(logp_pi, logp_mu, mask)) == pytest.approx(4e-8, rel=1e-5)
    m = mm.mismatch_metrics(logp_pi, logp_mu, mask)
    assert m["mismatch/chi2_token"] == pytest.approx(2e-8, rel=1e-5)
    assert m["mismatch/chi2_seq"] == pytest.approx(4e-8, rel=1e-5)
