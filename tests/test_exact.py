"""Exact mode (issue 15): log μ == log π_old == log π_θ, bit for bit."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unison.batch import collate
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.learner import Learner
from unison.rollout import SamplingParams, make_engine
from unison.trainer import Trainer

WIDTH = 14
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def pairs(tiny_dir):
    return {name: (make_engine("native", tiny_dir, dt, exact=True, prompt_width=WIDTH),
                   Learner(tiny_dir, compute_dtype=dt, exact=True)) for name, dt in DTYPES.items()}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(list(DTYPES)),
       prompts=st.lists(st.text(alphabet="0123456789+-*= abcxyz", min_size=0, max_size=WIDTH - 2), min_size=1,
                        max_size=4),
       n=st.integers(1, 3), max_tokens=st.integers(1, 16), micro=st.integers(1, 7), seed=st.integers(0, 10**6),
       update=st.booleans(), subset_seed=st.integers(0, 1000))
def test_engine_score_pass_and_training_forward_agree_bitwise(pairs, dtype, prompts, n, max_tokens, micro, seed,
                                                              update, subset_seed):
    engine, learner = pairs[dtype]
    if update:  # a weight update (as the optimizer makes on the fp32 masters), then the sync
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in learner.model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        engine.sync_weights(learner)
    tok = engine.tokenizer
    ids = [tok(p)["input_ids"] for p in prompts]
    comps = engine.generate(ids, SamplingParams(n=n, max_tokens=max_tokens, seed=seed))
    batch = collate(comps, engine.pad_id, layout=(WIDTH, WIDTH + max_tokens))
    # any batch composition: a shuffled subset of the rows, scored in micro-batches of any size
    g = torch.Generator().manual_seed(subset_seed)
    rows = torch.randperm(batch.size, generator=g)[:max(1, int(torch.randint(1, batch.size + 1, (1,), generator=g)))]
    sub = batch.select(rows)
    learner.micro_batch_size = micro
    old = learner.score(sub)
    mask = sub.response_mask.bool()
    assert torch.equal(old[mask], sub.logp_mu[mask])  # log π_old == log μ
    with torch.enable_grad():  # the training forward (autograd on, the fp32 masters cast inside)
        theta, _ = learner._forward(sub, torch.arange(sub.size), return_entropy=True)
    assert torch.equal(theta.detach()[mask], sub.logp_mu[mask])  # log π_θ == log μ at θ = θ_old
    assert theta.requires_grad


BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.micro_batch_size=8", "train.lr=1e-3", "log.console=false",
        "log.tensorboard=false", "task.reward=char_reward:reward", "task.truncated_reward=null", "exact=true"]


@pytest.fixture()
def rewards(tmp_path, monkeypatch):
    (tmp_path / "char_reward.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("precision,extra", [("bf16", ["train.mini_batches=2", "algo=grpo_token_tis"]),
                                             ("fp16", ["train.mini_batches=1"]), ("fp32", ["policy.bypass=true"])])
def test_training_in_exact_mode_has_zero_mismatch_every_step(tmp_path, rewards, precision, extra):
    cfg = load_config(None, BASE + [f"precision={precision}", "train.steps=3", *extra])
    Trainer(cfg, tmp_path / "run", log=lambda m: None).fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for r in rows:
        assert r["mismatch/identical_fraction"] == 1.0 and r["mismatch/k3"] == 0.0
        assert r["mismatch/abs_logp_diff_max"] == 0.0
        # corrections become identities: every token weight is exactly 1
        assert r["correction/ratio_min"] == r["correction/ratio_max"] == r["correction/weight_mean"] == 1.0
        assert r["optim/grad_norm"] > 0 and r["optim/skipped_steps"] == 0
    if precision == "fp16":
        assert rows[-1]["optim/loss_scale"] == 2.0**16


def test_exact_mode_refuses_what_it_cannot_do_before_writing(tmp_path, rewards):
    for extra, match in ((["engine=vllm"], "needs the native engine"), (["rollout.top_p=0.9"], "top_p=1"),
                         (["lora.rank=2"], "LoRA"), ([f"model={_gpt2(tmp_path)}"], "is not one")):
        with pytest.raises(UnisonError, match=match):
            Trainer(load_config(None, BASE + extra), tmp_path / "r", log=lambda m: None)
        assert not (tmp_path / "r").exists()


def _gpt2(tmp_path):
    from unison.zoo import build

    d = tmp_path / "gpt2"
    if not d.exists():
        build("gpt2", d)
    return d


def test_token_logp_by_hand():
    import math

    from unison.exact import token_logp

    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = (1/4, 3/4)
    lp, ent = token_logp(logits, torch.tensor([1]), 1.0, want_entropy=True)
    assert float(lp) == pytest.approx(math.log(0.75), abs=1e-7)
    assert float(ent) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-7)
    # temperature 2 halves the logits: p(1) = √3 / (1 + √3)
    lp2 = token_logp(logits, torch.tensor([1]), 2.0)
    assert float(lp2) == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-7)
    assert float(token_logp(logits, torch.tensor([0]), 1.0)) == pytest.approx(math.log(0.25), abs=1e-7)


def test_collate_in_the_exact_layout_by_hand():
    from unison.batch import Completion

    c = Completion(prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5], finish_reason="length",
                   routing=torch.tensor([[[4]], [[5]]]))  # 2 fed inputs (prompt + response − 1), 1 layer, k 1
    b = collate([c], pad_id=0, layout=(3, 5))  # prompts end at column 3, rows 5 wide
    assert b.tokens.tolist() == [[0, 1, 2, 3, 0]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 0]]
    assert b.response_mask.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    assert b.logp_mu.tolist() == [[0.0, 0.0, 0.0, -0.5, 0.0]]
    assert b.extras["routing"][0, :, 0, 0].tolist() == [-1, 4, 5, -1, -1]  # aligned with the tokens
    with pytest.raises(ValueError, match="does not fit the layout"):
        collate([c], pad_id=0, layout=(1, 5))  # a prompt wider than the layout's prompt width
