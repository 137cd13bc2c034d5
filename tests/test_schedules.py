"""LR schedules (steps numbered from 1, as in metrics.jsonl), Paper B's surge decay,
surge detectors on synthetic series, and the gradient-noise estimator."""

import math

import pytest
import torch

from unison.optim import GradNoiseTracker, noise_scale_terms
from unison.schedules import BaselineRatioDetector, EMARatioDetector, LRSchedule, SurgeDecaySchedule


def test_constant_warmup_and_cosine_by_hand():
    c = LRSchedule("constant", 1.0, total_steps=10, warmup_steps=3)
    assert [c.lr(s) for s in (1, 5, 10)] == [1.0, 1.0, 1.0]  # constant ignores warmup
    w = LRSchedule("warmup", 1.0, total_steps=10, warmup_steps=4)
    assert [w.lr(s) for s in range(1, 7)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    cos = LRSchedule("cosine", 2.0, total_steps=6, warmup_steps=1, min_lr_ratio=0.1)
    # step 1 is warmup; steps 2..6 follow the cosine with frac = (s−2)/4
    assert cos.lr(1) == pytest.approx(2.0)
    assert cos.lr(2) == pytest.approx(2.0)
    assert cos.lr(4) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert cos.lr(6) == pytest.approx(0.2)


def _drive(schedule, lengths):
    lrs = []
    for step, length in enumerate(lengths, 1):
        lrs.append(schedule.lr(step))
        schedule.observe(step, {"response_length/mean": length})
    return lrs


def test_surge_at_step_s_gives_the_papers_decay():
    # flat 100 for 30 steps, then 400: baseline (window 10) = 100, smoothed over 1 step
    lengths = [100.0] * 30 + [400.0] * 170
    s = SurgeDecaySchedule(1.0, detector=BaselineRatioDetector(window=10, multiplier=3.0, smooth=1))
    lrs = _drive(s, lengths)
    assert s.surge_step == 31 and s.period == round(1.8 * 31) == 56
    # counted from step 0: η = max(γ^⌊t/56⌋, 0.1)
    for t, lr in enumerate(lrs, 1):
        assert lr == pytest.approx(max(0.5 ** (t // 56), 0.1) if t > 31 else 1.0), t
    assert lrs[55 - 1] == 1.0 and lrs[56 - 1] == 0.5 and lrs[112 - 1] == 0.25 and lrs[168 - 1] == 0.125
    s2 = SurgeDecaySchedule(1.0, rho_min=0.2, count_from="surge",
                            detector=BaselineRatioDetector(window=10, multiplier=3.0, smooth=1))
    lrs2 = _drive(s2, lengths)
    assert lrs2[31 + 56 - 1] == 0.5 and lrs2[31 + 55 - 1] == 1.0  # t' = t − t_s
    assert min(lrs2) == pytest.approx(0.2)  # the floor


def test_no_trigger_on_flat_or_noisy_flat_series():
    g = torch.Generator().manual_seed(0)
    noisy = (100 + 20 * torch.randn(300, generator=g)).tolist()
    for series in ([100.0] * 300, noisy):
        s = SurgeDecaySchedule(1.0, detector=BaselineRatioDetector(window=50, multiplier=3.0, smooth=5))
        assert set(_drive(s, series)) == {1.0} and s.surge_step is None
        e = SurgeDecaySchedule(1.0, detector=EMARatioDetector(alpha=0.1, multiplier=1.5, patience=3))
        assert set(_drive(e, series)) == {1.0} and e.surge_step is None


def test_ema_detector_patience_and_cooldown():
    d = EMARatioDetector(alpha=0.5, multiplier=2.0, patience=2, cooldown=3)
    fired = [d.update(v)[0] for v in [10, 10, 10, 10, 30, 80, 200, 500, 1000, 10, 10]]
    # observations 1–3 are burn-in; 5 and 6 exceed 2× EMA -> fires at the 6th; then 3 quiet ones
    assert fired == [False, False, False, False, False, True, False, False, False, False, False]
    d2 = EMARatioDetector(alpha=0.5, multiplier=2.0, patience=1, cooldown=5)
    assert not any(d2.update(v)[0] for v in [10, 100, 1000, 10000, 1e5])  # surge inside the burn-in


def test_warmup_then_manual_trigger_step():
    s = SurgeDecaySchedule(1.0, warmup_steps=2, trigger_step=10)
    lrs = _drive(s, [1.0] * 40)
    assert lrs[:3] == [0.5, 1.0, 1.0] and s.period == 18
    assert lrs[17 - 1] == 1.0 and lrs[18 - 1] == 0.5 and lrs[36 - 1] == 0.25


def test_resume_in_phase_two_reproduces_the_lr_sequence():
    lengths = [50.0] * 20 + [200.0] * 80
    make = lambda: SurgeDecaySchedule(1.0, detector=BaselineRatioDetector(window=10, multiplier=3.0))  # noqa: E731
    full = _drive(make(), lengths)
    a = make()
    first = _drive(a, lengths[:60])
    assert a.surge_step is not None and a.lr(60) < 1.0  # in phase 2
    b = make()
    b.load_state_dict(a.state_dict())
    rest = []
    for step, length in enumerate(lengths[60:], 61):
        rest.append(b.lr(step))
        b.observe(step, {"response_length/mean": length})
    assert first + rest == full


def test_noise_scale_recovers_a_known_value_on_a_quadratic():
    # loss_i(θ) = ½|θ − x_i|², x_i ~ N(μ, σ²I): per-sample gradient θ − x_i, true gradient
    # G = θ − μ, tr(Σ) = d σ², noise scale = d σ² / |θ − μ|²
    d, sigma = 50, 2.0
    g = torch.Generator().manual_seed(0)
    theta, mu = torch.zeros(d), torch.full((d,), 0.5)
    true = d * sigma**2 / float((theta - mu).pow(2).sum())
    tracker = GradNoiseTracker(alpha=0.05)
    for _ in range(300):
        micro = [(theta - (mu + sigma * torch.randn(16, d, generator=g))).mean(0) for _ in range(4)]
        small = sum(float(m.pow(2).sum()) for m in micro) / 4
        big = float(torch.stack(micro).mean(0).pow(2).sum())
        out = tracker.update(noise_scale_terms(small, 16, big, 64))
    assert out["grad_noise/noise_scale_ema"] == pytest.approx(true, rel=0.15)
    assert out["grad_noise/trace_sigma"] > 0


def test_noise_scale_terms_by_hand():
    t = noise_scale_terms(small_sq=5.0, small_batch=2, big_sq=2.0, big_batch=8)
    assert t["grad_noise/grad_sq"] == pytest.approx((8 * 2 - 2 * 5) / 6)
    assert t["grad_noise/trace_sigma"] == pytest.approx(3.0 / (0.5 - 0.125))
    assert t["grad_noise/noise_scale"] == pytest.approx(8.0 / 1.0)
    assert noise_scale_terms(1.0, 4, 1.0, 4) == {}
    # |G|² estimate exactly 0 (4·0.25 − 1·1 = 0): the noise scale is undefined, not infinite
    assert math.isnan(noise_scale_terms(1.0, 1, 0.25, 4)["grad_noise/noise_scale"])
