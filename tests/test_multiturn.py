"""Multi-turn episodes (issue 29): the masked data shape, the environment interface, token in /
token out, tool calls, tokenization drift, and faults."""

import pytest
import torch

from unison.algorithms.anchors import OldLogp
from unison.algorithms.corrections import CORRECTIONS
from unison.algorithms.losses import AGGREGATIONS, LOSSES, aggregate
from unison.batch import Completion, collate
from unison.config import load_config
from unison.learner import Learner
from unison.mismatch import mismatch_metrics

# ----------------------------------------------------------------------- the data shape
# prompt | model turn 1 (EOS = 2) | environment reply | model turn 2
PROMPT, TURN1, OBS, TURN2 = [4, 40, 41], [50, 51, 2], [60, 61, 62], [52, 2]
MASK = [1] * len(TURN1) + [0] * len(OBS) + [1] * len(TURN2)


def _two_turn(obs=OBS, lp_obs=0.0):
    ids = TURN1 + obs + TURN2
    lps = [-1.0, -2.0, -0.5] + [lp_obs] * len(obs) + [-1.5, -0.2]
    return Completion(prompt_ids=list(PROMPT), token_ids=ids, logprobs=lps, finish_reason="stop", mask=list(MASK))


def test_collate_puts_exactly_the_models_tokens_in_the_response_mask():
    single = Completion(prompt_ids=[4, 40], token_ids=[50, 2], logprobs=[-1.0, -0.1], finish_reason="stop")
    b = collate([_two_turn(lp_obs=-9.0), single], pad_id=0)
    assert b.tokens[0].tolist() == PROMPT + TURN1 + OBS + TURN2  # the ids sampled, turn by turn
    assert b.response_mask[0].tolist() == [0, 0, 0] + MASK
    assert b.response_mask[1].tolist() == [0, 0, 1, 1] + [0] * 7
    assert b.logp_mu[0, 6:9].tolist() == [0.0, 0.0, 0.0]  # nothing claims a log μ for an observation
    assert b.attention_mask[0].sum() == 11  # the observation is context for turn 2
    assert b.response_lens.tolist() == [5, 2] and b.num_response_tokens == 7
    with pytest.raises(ValueError, match="mask"):
        Completion(prompt_ids=[1], token_ids=[2, 3], logprobs=[0.0, 0.0], finish_reason="stop", mask=[1])


def test_metrics_corrections_and_losses_ignore_the_observation_tokens():
    """Junk log-probs on the observation positions change nothing: no metric, correction, loss or
    normaliser sees them (and the model's tokens do move them: the check can fail)."""
    b = collate([_two_turn(), _two_turn()], pad_id=0)
    m = b.response_mask
    torch.manual_seed(0)
    old = b.logp_mu + 0.1 * torch.randn(b.logp_mu.shape)
    junk_old, junk_mu = old.clone(), b.logp_mu.clone()
    obs = torch.zeros_like(m, dtype=torch.bool)
    obs[:, 6:9] = True
    junk_old[obs], junk_mu[obs] = 7.0, -30.0
    assert mismatch_metrics(old, b.logp_mu, m) == mismatch_metrics(junk_old, junk_mu, m)
    moved = old.clone()
    moved[:, 3] += 0.5  # a model token
    assert mismatch_metrics(moved, b.logp_mu, m)["mismatch/k3"] != mismatch_metrics(old, b.logp_mu, m)["mismatch/k3"]
    for name, fn in CORRECTIONS.items():
        w1, c1 = fn(old, b.logp_mu, m)
        w2, c2 = fn(junk_old, junk_mu, m)
        assert torch.equal(w1 * m, w2 * m) and c1 == c2, name
    adv = torch.tensor([1.0, -0.5])
    for name, fn in LOSSES.items():
        for agg in AGGREGATIONS:
            logp = old.clone().requires_grad_(True)
            per_tok, _ = fn(logp, old, b.logp_mu, adv, torch.ones_like(m), m)
            loss = aggregate(per_tok, agg, m, int(m.sum()), 2, 8)
            loss.backward()
            assert torch.all(logp.grad[obs] == 0), (name, agg)  # observation tokens get no gradient
            assert logp.grad[m.bool()].abs().sum() > 0, (name, agg)
    # token_mean normalises by the model's 10 tokens, not the 16 of the response spans
    per_tok = torch.where(m.bool(), torch.ones_like(m), torch.zeros_like(m))
    assert float(aggregate(per_tok, "token_mean", m, int(m.sum()), 2, 8)) == 1.0


def test_the_learners_update_takes_the_gradient_of_the_models_tokens_only(tiny_dir):
    """A hand-built two-turn batch through Learner.train: the gradient equals the one computed by
    hand from the model's tokens alone (an on-policy PPO step: −A ∇ mean log π over model tokens),
    and differs from the one that would also score the observation."""
    cfg = load_config(None, ["train.grad_clip=1e9", "train.micro_batch_tokens=4", "algo=grpo",
                             "policy.loss_agg=token_mean", "train.grad_noise=false"])
    learner = Learner.from_config(cfg, tiny_dir)
    b = collate([_two_turn(), _two_turn(obs=[63, 64, 65])], pad_id=0)
    b.advantages = torch.tensor([1.0, -2.0])
    grads = {}

    def capture():
        grads.update({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})

    learner.opt.step = capture
    ref_model = learner.model
    before = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    learner.train(b, OldLogp("fused"), torch.ones_like(b.response_mask), lr=1e-3)
    assert all(torch.equal(before[n], p) for n, p in ref_model.named_parameters())  # the step was captured

    def hand(mask):
        ref_model.zero_grad(set_to_none=True)
        logits = ref_model(input_ids=b.tokens, attention_mask=b.attention_mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.tokens[:, 1:, None]).squeeze(-1)
        lp = torch.nn.functional.pad(lp, (1, 0))
        loss = -(lp * b.advantages[:, None] * mask).sum() / mask.sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    want = hand(b.response_mask)
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-3, atol=1e-6)
    with_obs = hand(b.attention_mask.float() * (torch.arange(b.tokens.shape[1]) >= 3))
    assert any((with_obs[n] - g).abs().max() > 1e-5 for n, g in grads.items())
    # the score pass gives log π on the model's tokens and exactly 0 on the observation
    lp = learner.score(b)
    assert torch.all(lp[:, 6:9] == 0) and torch.all(lp[b.response_mask.bool()] < 0)
