import pytest

from unison.schedules import LRSchedule


def test_constant_warmup_and_cosine_by_hand():
    c = LRSchedule("constant", 1.0, total_steps=10, warmup_steps=3)
    assert [c.lr(s) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]  # constant ignores warmup
    w = LRSchedule("warmup", 1.0, total_steps=10, warmup_steps=4)
    assert [w.lr(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    cos = LRSchedule("cosine", 2.0, total_steps=6, warmup_steps=1, min_lr_ratio=0.1)
    # after warmup: frac = (s-1)/4 over steps 1..5 -> 2·(0.1 + 0.9·½(1+cos(π·frac)))
    assert cos.lr(0) == pytest.approx(2.0)
    assert cos.lr(1) == pytest.approx(2.0)
    assert cos.lr(3) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert cos.lr(5) == pytest.approx(0.2)
