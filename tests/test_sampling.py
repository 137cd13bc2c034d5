import math

import pytest
import torch

from unison.errors import UnisonError
from unison.rollout.base import SamplingParams, _truncate, row_seeds, row_uniforms, sample_tokens


def test_reported_logprob_is_that_of_the_temperature_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.5)
    tok, lp = sample_tokens(logits, params, torch.tensor([7]), 0)
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


def test_top_p_is_taken_over_the_renormalised_top_k_mass_as_hf_and_vllm_do():
    """p = 0.5, 0.2 (+ 0.3 outside top-k 2), top-p 0.6: over the renormalised top-k mass (0.714, 0.286) the mass
    before the second token already reaches 0.6, so only the first is kept (HF's TopK then TopP warper, vLLM's
    apply_top_k_top_p); over the un-renormalised mass (0.5 before it) both were kept."""
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.15]]))
    kept = _truncate(logp, top_k=2, top_p=0.6).exp()
    assert kept.tolist()[0] == pytest.approx([1.0, 0.0, 0.0, 0.0], abs=1e-6)
    assert _truncate(logp, top_k=2, top_p=0.75).exp().tolist()[0] == pytest.approx([5 / 7, 2 / 7, 0, 0], abs=1e-6)


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(20000, 1)
    tok, _ = sample_tokens(logits, SamplingParams(), torch.arange(20000), 3)
    freq = torch.bincount(tok, minlength=3).float() / tok.numel()
    assert freq.tolist() == pytest.approx([0.7, 0.2, 0.1], abs=0.015)


def test_greedy_reports_point_mass():
    tok, lp = sample_tokens(torch.tensor([[0.1, 3.0, 0.2]]), SamplingParams(temperature=0),
                            torch.tensor([0]), 0)
    assert tok.item() == 1 and lp.item() == 0.0
    assert math.isfinite(lp.item())


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                    dict(max_tokens=0)])
def test_bad_sampling_params_are_user_errors(kwargs):
    with pytest.raises(UnisonError):
        SamplingParams(**kwargs)


def test_row_uniforms_are_uniform_and_independent_of_the_batch():
    seeds = torch.tensor(row_seeds(SamplingParams(n=4, seed=11), 5000))
    u = row_uniforms(seeds, 0)
    assert u.min() > 0 and u.max() < 1 and seeds.unique().numel() == seeds.numel()
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert hist.tolist() == pytest.approx([0.1] * 10, abs=0.01)
    assert abs(torch.corrcoef(torch.stack([u, row_uniforms(seeds, 1)]))[0, 1]) < 0.03  # steps decorrelated
    # a row's draw is the same alone, in a batch, or in a permuted batch
    perm = torch.randperm(seeds.numel())
    assert torch.equal(row_uniforms(seeds[perm], 5), row_uniforms(seeds, 5)[perm])
    assert torch.equal(row_uniforms(seeds[3:4], 5), row_uniforms(seeds, 5)[3:4])


def test_prompt_seeds_make_a_prompts_rows_independent_of_its_neighbours():
    a = row_seeds(SamplingParams(n=2, prompt_seeds=(5, 6, 7)), 3)
    b = row_seeds(SamplingParams(n=2, prompt_seeds=(6,)), 1)
    assert a[2:4] == b and len(set(a)) == 6
    with pytest.raises(UnisonError, match="prompt seeds"):
        row_seeds(SamplingParams(n=2, prompt_seeds=(1, 2)), 3)
