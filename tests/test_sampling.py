import math

import pytest
import torch

from unison.errors import UnisonError
from unison.rollout.base import SamplingParams, _truncate, sample_tokens


def test_reported_logprob_is_that_of_the_temperature_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.5)
    tok, lp = sample_tokens(logits, params, torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 0.5, -1)[0, tok]
    assert lp.item() == pytest.approx(expected.item(), rel=1e-6)


def test_top_k_and_top_p_renormalise_the_support():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = _truncate(logp, top_k=2, top_p=1.0).exp()
    assert k2.tolist()[0] == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    # top_p = 0.8: keep 0.5 and 0.3 (mass before 0.15 is 0.8 >= 0.8, so it is dropped)
    p8 = _truncate(logp, top_k=0, top_p=0.8).exp()
    assert p8.tolist()[0] == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    # top_p = 0.81 keeps the third token too
    p81 = _truncate(logp, top_k=0, top_p=0.81).exp()
    assert p81[0, 2].item() == pytest.approx(0.15 / 0.95, rel=1e-5)


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(20000, 1)
    tok, _ = sample_tokens(logits, SamplingParams(), torch.Generator().manual_seed(1))
    freq = torch.bincount(tok, minlength=3).float() / tok.numel()
    assert freq.tolist() == pytest.approx([0.7, 0.2, 0.1], abs=0.015)


def test_greedy_reports_point_mass():
    tok, lp = sample_tokens(torch.tensor([[0.1, 3.0, 0.2]]), SamplingParams(temperature=0),
                            torch.Generator())
    assert tok.item() == 1 and lp.item() == 0.0
    assert math.isfinite(lp.item())


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                    dict(max_tokens=0)])
def test_bad_sampling_params_are_user_errors(kwargs):
    with pytest.raises(UnisonError):
        SamplingParams(**kwargs)
