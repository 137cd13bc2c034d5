"""Exact mode for state-space and hybrid models (issue 54, item 3): Mamba2, Nemotron-H and Qwen3-Next run the
recurrence on both sides, and the engine's log μ equals the learner's log π bit for bit, whatever the batch."""

import math

import pytest
import torch
import torch.nn.functional as F

from unison.batch import collate
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.exact import whole_vectors
from unison.exact_ssm import tree_sum
from unison.learner import Learner
from unison.rollout import SamplingParams, make_engine
from unison.sides import Side
from unison.trainer import Trainer
from unison.zoo import build

ARCHS = ("mamba2", "nemotron_h", "qwen3_next")
WIDTH = 12
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def ssm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssm")
    return {arch: build(arch, root / arch) for arch in ARCHS}


def test_tree_sum_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [2.0**24, 1.0, -(2.0**24), 1.0, 0.0]])
    # ((1 + 5) + 3) + (2 + 4) — pairs by halves, the odd width zero-padded to 8
    assert tree_sum(x).tolist() == [15.0, 2.0]  # (2²⁴ − 2²⁴) + (1 + 1): the fixed order keeps both ones
    assert tree_sum(torch.ones(3, 1)).tolist() == [1.0, 1.0, 1.0]


def test_causal_conv_by_hand():
    """Kernel 4: out_t = w0·x_{t−3} + w1·x_{t−2} + w2·x_{t−1} + w3·x_t + b (the oldest input meets w0, as
    transformers' conv1d over the left-padded window)."""
    from unison.exact import causal_conv

    seq = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).view(1, 5, 1)  # a window of 3 earlier inputs, then 2 new ones
    out = causal_conv(seq, torch.tensor([[1.0, 10.0, 100.0, 1000.0]]), torch.tensor([0.5]), 2)
    assert out.view(-1).tolist() == [4321.5, 5432.5]


def test_the_mamba2_scan_by_hand():
    """One head of one channel and one state: dt = softplus(0 + 0) = ln 2, A = −exp(0) = −1, so the decay is
    exp(−ln 2) = ½; B = C = 1, D = 1. h1 = ln2·x1, h2 = ½·h1 + ln2·x2; y = C·h + D·x."""
    from unison.exact_ssm import _recurrent

    x = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)
    one = torch.ones(1, 2, 1, 1)
    y, h = _recurrent(x, one, one, torch.zeros(1, 2, 1), torch.zeros(1), torch.zeros(1), torch.ones(1),
                      (0.0, float("inf")), torch.zeros(1, 1, 1, 1))
    ln2 = math.log(2)
    assert y.view(-1).tolist() == pytest.approx([ln2 + 1, 2.5 * ln2 + 2], abs=1e-6)
    assert float(h) == pytest.approx(2.5 * ln2, abs=1e-6)
    # a step floor above softplus's ln 2 (Nemotron-H's time_step_limit) bounds dt from below: dt = 1, decay e⁻¹
    y, _ = _recurrent(x, one, one, torch.zeros(1, 2, 1), torch.zeros(1), torch.zeros(1), torch.zeros(1),
                      (1.0, float("inf")), torch.zeros(1, 1, 1, 1))
    assert y.view(-1).tolist() == pytest.approx([1.0, math.exp(-1) + 2.0], abs=1e-6)


def test_the_gated_delta_rule_by_hand():
    """One head, dk = dv = 1, q = k = 1 (unit after the L2 norm), decay exp(0) = 1, β = ½, v = (2, 4):
    S1 = 0 + k·(v1 − k·0)·β = 1, o1 = q·S1 = 1; S2 = 1 + (4 − 1)·½ = 2.5, o2 = 2.5. Then g = ln ½ halves the state
    before each step: S1 = 1, S2 = ½ + (4 − ½)·½ = 2.25."""
    from unison.exact_gdn import _recurrent

    q = k = torch.ones(1, 2, 1, 1)
    v = torch.tensor([2.0, 4.0]).view(1, 2, 1, 1)
    beta = torch.full((1, 2, 1), 0.5)
    out, S = _recurrent(q, k, v, torch.zeros(1, 2, 1), beta, torch.zeros(1, 1, 1, 1))
    assert out.view(-1).tolist() == pytest.approx([1.0, 2.5], abs=1e-5)
    assert float(S) == pytest.approx(2.5, abs=1e-5)
    out, _ = _recurrent(q, k, v, torch.full((1, 2, 1), math.log(0.5)), beta, torch.zeros(1, 1, 1, 1))
    assert out.view(-1).tolist() == pytest.approx([1.0, 2.25], abs=1e-5)


def test_whole_vectors_gives_a_value_the_same_bits_alone_and_among_thousands():
    """A one-element fp32 SiLU runs PyTorch's scalar code, which rounds differently from its vector code on some
    values (the control below finds them); through whole_vectors every value has its bits in a call of any size."""
    x = torch.randn(40000, generator=torch.Generator().manual_seed(0)) * 3
    among = whole_vectors(F.silu, x)  # more than one grain: split into one-thread calls
    alone = torch.stack([whole_vectors(F.silu, x[i:i + 1])[0] for i in range(600)])
    assert torch.equal(alone, among[:600])
    plain = torch.stack([F.silu(x[i:i + 1])[0] for i in range(600)])
    assert not torch.equal(plain, F.silu(x)[:600])  # the control: without it some values differ
    assert torch.equal(among, F.silu(x))  # the vector code's values, unchanged


def _pair(d, dtype):
    return (make_engine("native", d, Side(dtype=dtype, exact=True), prompt_width=WIDTH),
            Learner(d, Side(dtype=dtype, exact=True)))


PROMPTS = ["12+", "7+8=", "abc", "1", "9*9="]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_engine_and_learner_agree_bitwise_in_any_micro_batch(ssm_dirs, arch, dtype):
    """Left-padded prompts of different lengths, rows that finish early (leaving the engine's batch: its states'
    rows selected), scored in micro-batches of 1 to 7 rows and in the training forward: log π == log μ."""
    engine, learner = _pair(ssm_dirs[arch], DTYPES[dtype])
    tok = engine.tokenizer
    comps = engine.generate([tok(p)["input_ids"] for p in PROMPTS], SamplingParams(n=3, max_tokens=20, seed=5))
    assert {c.finish_reason for c in comps} == {"stop", "length"}
    batch = collate(comps, engine.pad_id, layout=(WIDTH, WIDTH + 20))
    mask = batch.response_mask.bool()
    for micro in (1, 3, 7):
        learner.micro_batch_size = micro
        assert torch.equal(learner.score(batch)[mask], batch.logp_mu[mask]), micro
    with torch.enable_grad():
        theta, _ = learner._forward(batch, torch.arange(batch.size), return_entropy=True)
    assert torch.equal(theta.detach()[mask], batch.logp_mu[mask]) and theta.requires_grad


@pytest.mark.parametrize("arch", ARCHS)
def test_the_exact_forward_is_the_models_function_and_gradient(ssm_dirs, arch):
    """In fp32 the recurrent exact forward computes what the Hugging Face model's chunked scan computes, and its
    gradient is autograd's of the model, to rounding: one model, two algorithms."""
    engine = make_engine("native", ssm_dirs[arch], Side(exact=True), prompt_width=WIDTH)
    tok = engine.tokenizer
    comps = engine.generate([tok(p)["input_ids"] for p in PROMPTS[:3]], SamplingParams(n=2, max_tokens=14, seed=1))
    exact, today = Learner(ssm_dirs[arch], Side(exact=True)), Learner(ssm_dirs[arch])

    def run(learner, batch):
        learner.model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            logp, _ = learner._forward(batch, torch.arange(batch.size), return_entropy=True)
            (-(logp * batch.response_mask).sum()).backward()
        return logp.detach(), {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}

    b_exact = collate(comps, engine.pad_id, layout=(WIDTH, WIDTH + 14))
    b_today = collate(comps, engine.pad_id)
    lp_e, g_e = run(exact, b_exact)
    lp_t, g_t = run(today, b_today)
    m_e, m_t = b_exact.response_mask.bool(), b_today.response_mask.bool()
    assert float((lp_e[m_e] - lp_t[m_t]).abs().max()) < 1e-4
    assert set(g_e) == set(g_t) and len(g_e) == len(list(exact.model.parameters()))
    for n in g_e:
        scale = g_t[n].abs().max().item()
        assert scale > 0, n
        assert torch.allclose(g_e[n], g_t[n], rtol=1e-3, atol=1e-4 * scale), n


BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.micro_batch_size=3", "train.lr=1e-3", "log.console=false",
        "log.tensorboard=false", "exact=true", "precision=bf16", "train.steps=2"]


def test_training_a_hybrid_in_exact_mode_has_zero_mismatch_every_step(tmp_path, char_reward, ssm_dirs):
    cfg = load_config(None, BASE + char_reward + [f"model={ssm_dirs['nemotron_h']}"])
    Trainer(cfg, tmp_path / "run", log=lambda m: None).fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["mismatch/identical_fraction"] == 1.0 and r["mismatch/k3"] == 0.0
        assert r["optim/grad_norm"] > 0 and r["optim/skipped_steps"] == 0


def test_exact_mode_refuses_a_rounded_state_and_experts(tmp_path, char_reward, ssm_dirs):
    with pytest.raises(UnisonError, match="keeps a recurrent state in fp32 on both sides"):
        Trainer(load_config(None, BASE + char_reward + [f"model={ssm_dirs['mamba2']}", "rollout.state_dtype=model"]),
                tmp_path / "r", log=lambda m: None)
    moe = build("nemotron_h", tmp_path / "moe", layers_block_type=["linear_attention", "moe"], n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
    with pytest.raises(UnisonError, match=r"dense ReLU² MLPs \(no MoE blocks\)"):
        Trainer(load_config(None, BASE + char_reward + [f"model={moe}"]), tmp_path / "r", log=lambda m: None)
    moe = build("qwen3_next", tmp_path / "moe-next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(UnisonError, match="Qwen3-Next with dense SiLU MLPs, and this one has 4 experts"):
        Trainer(load_config(None, BASE + char_reward + [f"model={moe}"]), tmp_path / "r", log=lambda m: None)
    assert not (tmp_path / "r").exists()


def test_a_divergence_names_the_mixer_and_the_decode_position(tmp_path, char_reward, ssm_dirs):
    """The engine's Mamba2 mixer rounds differently on its decode steps only: step 1 stops, naming that layer and
    the first decode position."""
    cfg = load_config(None, BASE + char_reward + [f"model={ssm_dirs['nemotron_h']}", "train.steps=1"])
    t = Trainer(cfg, tmp_path / "r", log=lambda m: None)
    fwd = t.engine.exact
    mamba = fwd._mamba
    fwd._mamba = lambda i, L, x, *a: mamba(i, L, x, *a) * (1 + 2**-6) if x.shape[1] == 1 else mamba(i, L, x, *a)
    P = t.layout[0]  # the prompt width: the first decode step feeds the first sampled token at column P
    with pytest.raises(UnisonError, match=rf"exact mode broke at step 1: .*; replayed alone, layer 0 mamba mixer "
                                          rf"first differs at position {P}\)"):
        t.train_step()
