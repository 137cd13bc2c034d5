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
from unison.sync import sync
from unison.sides import Side

WIDTH = 14
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def pairs(tiny_dir):
    return {name: (make_engine("native", tiny_dir, Side(dtype=dt, exact=True), prompt_width=WIDTH),
                   Learner(tiny_dir, Side(dtype=dt, exact=True))) for name, dt in DTYPES.items()}


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
        sync(engine, learner)
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


# ------------------------------------------------------------------ by construction (issue 21)
def _engine_and_learner(tiny_dir, dtype=torch.float32, ops=None):

    engine = make_engine("native", tiny_dir, Side(dtype=dtype, exact=True), prompt_width=WIDTH)
    learner = Learner(tiny_dir, Side(dtype=dtype, exact=True))
    if ops is not None:
        engine.exact.ops = learner.exact.ops = ops
    return engine, learner


def _agree(engine, learner, n=3, max_tokens=8, seed=3, micro=5):
    tok = engine.tokenizer
    ids = [tok(p)["input_ids"] for p in ("12+", "7+8=", "abc", "1")]
    comps = engine.generate(ids, SamplingParams(n=n, max_tokens=max_tokens, seed=seed))
    batch = collate(comps, engine.pad_id, layout=(WIDTH, WIDTH + max_tokens))
    learner.micro_batch_size = micro
    old = learner.score(batch)
    mask = batch.response_mask.bool()
    return torch.equal(old[mask], batch.logp_mu[mask])


def _fake_linear(real, rule):
    """A deterministic BLAS that rounds differently by shape: ``rule(x)`` says when to sum the input
    dimension in two halves (another order, other bits) instead of at once."""
    def linear(x, w, b=None):
        if x.dim() == 2 and rule(x):
            h = x.shape[-1] // 2
            y = real(x[:, :h], w[:, :h]) + real(x[:, h:], w[:, h:])
            return y if b is None else y + b
        return real(x, w, b)
    return linear


def _use_blas(monkeypatch, linear):
    """Make ``linear`` the machine's matmul: for F.linear and for exact mode's batched fp32 matmul (a
    batched BLAS runs its one-matrix kernel on each block)."""
    import unison.exact

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(unison.exact, "batched_linear", lambda x3, w, b=None: torch.stack([linear(x, w, b) for x in x3]))


def test_a_blas_that_changes_with_the_row_count_keeps_exact_mode_exact(tiny_dir, monkeypatch):
    """Calls of more than 64 rows take another kernel (as MKL/oneDNN do by shape): the learner's forward
    over the whole batch would differ from the engine's decode step — blocks of fixed size do not."""
    real = torch.nn.functional.linear
    _use_blas(monkeypatch, _fake_linear(real, lambda x: x.shape[0] > 64))
    engine, learner = _engine_and_learner(tiny_dir)
    assert _agree(engine, learner)
    # the old rule (pad every matmul to >= 12 rows, one call for all rows) breaks on it
    x, w = torch.randn(200, 128), torch.randn(384, 128)
    assert not torch.equal(torch.nn.functional.linear(x, w)[:1], torch.nn.functional.linear(x[:12], w)[:1])


def test_the_self_check_picks_a_block_this_blas_is_invariant_for(tiny_dir, monkeypatch):
    """Rows at positions >= 12 of a call take an edge kernel: blocks of 16 or 32 rows would give a row
    other bits by where it sits, blocks of 8 do not — the start-up check finds that."""
    from unison.exact_check import self_check

    real = torch.nn.functional.linear

    def edge(x, w, b=None):
        y = real(x, w, b)
        if x.dim() == 2 and x.shape[0] > 12:
            y = torch.cat([y[:12], _fake_linear(real, lambda _: True)(x[12:], w, b)])
        return y

    _use_blas(monkeypatch, edge)
    engine, learner = _engine_and_learner(tiny_dir)
    ops = self_check(learner.exact, [torch.float32], WIDTH + 8)
    assert ops.block == 8
    engine.exact.ops = ops
    assert _agree(engine, learner)


def test_a_blas_no_block_helps_is_refused_in_one_line(tiny_dir, monkeypatch):
    from unison.exact_check import self_check

    real = torch.nn.functional.linear
    _use_blas(monkeypatch, lambda x, w, b=None: real(x, w, b) + (torch.arange(x.shape[0]) % 2)[:, None] * 1e-3
              if x.dim() == 2 else real(x, w, b))
    _, learner = _engine_and_learner(tiny_dir)
    with pytest.raises(UnisonError, match=r"exact mode cannot hold on this CPU: matmul, float32, \[16, 128\] x "
                                          r"\[128, \d+\] gives a row different bits"):
        self_check(learner.exact, [torch.float32], WIDTH + 8)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_row_has_the_same_bits_in_calls_of_1_to_130_rows(dtype):
    from unison.exact import ExactOps

    ops, dt = ExactOps(), DTYPES[dtype]
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(130, 128, generator=g).to(dt), (torch.randn(384, 128, generator=g) / 11).to(dt)
    alone = torch.cat([ops.linear(x[i:i + 1], w) for i in range(130)])
    for m in range(1, 131):
        assert torch.equal(ops.linear(x[:m], w), alone[:m]), m
    perm = torch.randperm(130, generator=g)
    assert torch.equal(ops.linear(x[perm], w), alone[perm])  # shuffled batch positions
    head = (torch.randn(100, 128, generator=g) / 11).to(dt)
    t = torch.randint(0, 100, (130,), generator=g)
    lp = ops.logp(x, head, t, 1.0)
    assert torch.equal(ops.token_logp(ops.logits(x[5:6], head), t[5:6], 1.0), lp[5:6])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_prompts_one_token_apart_and_micro_batches_1_to_9_agree(tiny_dir, dtype):
    engine, learner = _engine_and_learner(tiny_dir, DTYPES[dtype])
    tok = engine.tokenizer
    ids = [tok("1" * k)["input_ids"] for k in range(1, 6)]  # lengths differ by one
    comps = engine.generate(ids, SamplingParams(n=2, max_tokens=7, seed=11))
    batch = collate(comps, engine.pad_id, layout=(WIDTH, WIDTH + 7))
    mask = batch.response_mask.bool()
    for micro in range(1, 10):
        learner.micro_batch_size = micro
        assert torch.equal(learner.score(batch)[mask], batch.logp_mu[mask]), micro


def test_a_divergence_at_step_1_names_the_layer_op_and_position(tmp_path, rewards):
    """What the self-check cannot catch: here the engine's one-query attention (its decode steps) rounds
    differently in layer 2 only; the error names that layer, op and the first decode position."""
    t = Trainer(load_config(None, BASE + ["train.steps=1"]), tmp_path / "r", log=lambda m: None)
    fwd, attend = t.engine.exact, t.engine.exact.ops.attend
    calls = {"n": 0}

    def skewed(q, k, v, allowed, scaling):
        out = attend(q, k, v, allowed, scaling)
        calls["n"] += 1
        layer = (calls["n"] - 1) % fwd.n_layers
        return out * (1 + 2**-10) if q.shape[2] == 1 and layer == 2 else out

    t.engine.exact.ops = type(fwd.ops)(fwd.ops.block, fwd.ops.attn_block)
    t.engine.exact.ops.attend = skewed
    with pytest.raises(UnisonError, match=r"exact mode broke at step 1: .*row \d+, position \d+.*; replayed alone, "
                                          r"layer 2 attention first differs at position \d+"):
        t.train_step()


def test_an_exact_probe_row_that_is_not_identical_is_a_failure(tmp_path, monkeypatch, capsys):
    from unison.cli import main
    from unison.rollout import native

    step = native._ExactBackend.step  # the engine's decode steps drift; the start-up self-check cannot see it
    monkeypatch.setattr(native._ExactBackend, "step", lambda self, tok, pos, t: step(self, tok, pos, t) * (1 + 2**-10))
    code = main(["probe", "--precision", "fp32", "--exact", "--n", "2", "--max-new-tokens", "8",
                 "--out", str(tmp_path / "p")])
    out = capsys.readouterr()
    assert code == 1 and "FAILED" in out.out
    assert "unison: error: exact mode failed for fp32: only" in out.err


def test_the_exact_learner_s_gradient_is_the_models_own(tiny_dir):
    """The exact forward's values come from fixed-size blocks, its gradient from one call over all rows
    (hand-written for matmuls, recomputed for norms, attention and the output layer): in fp32 it must be
    autograd's gradient of the Hugging Face model on the same tokens, to rounding — and with blocks of
    another size as well."""
    from unison.exact import ExactOps

    def grads(learner, batch):
        learner.model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            logp, _ = learner._forward(batch, torch.arange(batch.size), return_entropy=True)
            (-(logp * batch.response_mask).sum()).backward()
        return {n: p.grad.clone() for n, p in learner.model.named_parameters()}

    engine = make_engine("native", tiny_dir, Side(exact=True), prompt_width=WIDTH)
    tok = engine.tokenizer
    comps = engine.generate([tok(p)["input_ids"] for p in ("12+", "7+8=", "abc")],
                            SamplingParams(n=2, max_tokens=6, seed=1))
    exact, today = Learner(tiny_dir, Side(exact=True)), Learner(tiny_dir)
    g_exact = grads(exact, collate(comps, engine.pad_id, layout=(WIDTH, WIDTH + 6)))
    g_today = grads(today, collate(comps, engine.pad_id))
    exact.exact.ops = ExactOps(8, 2)
    g_other = grads(exact, collate(comps, engine.pad_id, layout=(WIDTH, WIDTH + 6)))
    assert set(g_exact) == set(g_today)
    for n in g_exact:
        scale = g_today[n].abs().max().item()
        assert scale > 0, n  # every parameter gets a gradient (the head, the norms, the embeddings)
        assert torch.allclose(g_exact[n], g_today[n], rtol=1e-4, atol=1e-5 * scale), n
        assert torch.allclose(g_other[n], g_exact[n], rtol=1e-4, atol=1e-5 * scale), n
