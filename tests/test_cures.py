"""The cures the field ships (issue 27), against numbers computed by hand: IcePop, IPO, M2PO, the
DPPO-KL divergence, the mismatch-budget LR."""

import math

import pytest
import torch

from unison.algorithms.corrections import CORRECTIONS
from unison.algorithms.losses import LOSSES
from unison.algorithms.presets import correction_kwargs, loss_kwargs, resolve_policy
from unison.config import PolicyConfig, config_from_dict
from unison.errors import UnisonError
from unison.schedules import MismatchBudgetSchedule, make_schedule


# ------------------------------------------------------------------ IcePop
def test_grpo_icepop_masks_outside_ring_1t_band():
    pol = resolve_policy("grpo_icepop", PolicyConfig())
    assert (pol["loss"], pol["correction"], pol["correction_c_low"], pol["correction_c"]) == \
        ("ppo_clip", "token_mis", 0.5, 5.0)
    # ratios π_old/μ: 0.4 (below), 0.55 (kept), 4.0 (kept: Paper A's Token-MIS band [0.5, 2] masks it), 6.0 (above)
    rho = torch.tensor([[0.4, 0.55, 4.0, 6.0]])
    mu = torch.full((1, 4), -2.0)
    old = mu + rho.log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    w, m = CORRECTIONS[pol["correction"]](old, mu, mask, **correction_kwargs(pol))
    assert w[0].tolist() == pytest.approx([0.0, 0.55, 4.0, 0.0], rel=1e-5)
    assert m["correction/masked_fraction"] == 0.5
    assert m["correction/ratio_max"] == pytest.approx(6.0, rel=1e-5)  # raw, before masking


# ------------------------------------------------------------------ IPO
def _ipo_inputs():
    # p_old = 0.5 everywhere (bypass: μ); row 0 has A = +1, row 1 A = −1; row 2 is fully masked
    p = torch.tensor([[0.55, 0.3], [0.7, 0.45], [0.9, 0.01]])
    logp = p.log().requires_grad_(True)
    old = torch.full((3, 2), 0.5).log()
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    return logp, old, torch.tensor([1.0, -1.0, 1.0]), mask


def test_ipo_masks_by_the_probability_band_whatever_the_advantage_sign():
    logp, old, adv, mask = _ipo_inputs()
    tau = 0.1
    per_tok, met = LOSSES["ipo"](logp, old, old, adv, torch.ones(3, 2), mask, clip=0.1, kl_tau=tau)
    # kept: (0,0) |0.55-0.5| = 0.05, (1,1) |0.45-0.5| = 0.05; masked: (0,1) |0.3-0.5| = 0.2 with A > 0 (DPPO-TV
    # would keep it: the move is against the advantage), (1,0) |0.7-0.5| = 0.2 with A < 0 (likewise)
    pg = torch.tensor([[-1.1 * math.log(0.55), 0.0], [0.0, 0.9 * math.log(0.45)], [0.0, 0.0]])
    kl = tau * torch.tensor([[math.log(1.1) ** 2, math.log(0.6) ** 2], [math.log(1.4) ** 2, math.log(0.9) ** 2],
                             [0.0, 0.0]])
    assert torch.allclose(per_tok, pg + kl, atol=1e-6)
    assert met["policy/ipo_masked_fraction"] == 0.5
    # the mismatch KL (k3 of π_θ vs μ) over the masked and the kept tokens: r − 1 − log r
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert met["policy/masked_mismatch_kl"] == pytest.approx((k3(0.6) + k3(1.4)) / 2, rel=1e-5)
    assert met["policy/unmasked_mismatch_kl"] == pytest.approx((k3(1.1) + k3(0.9)) / 2, rel=1e-4)
    per_tok.sum().backward()
    # d/dlog p: kept −A·r + 2τ log r; masked 2τ log r only; the masked row: 0
    want = torch.tensor([[-1.1 + 2 * tau * math.log(1.1), 2 * tau * math.log(0.6)],
                         [2 * tau * math.log(1.4), 0.9 + 2 * tau * math.log(0.9)], [0.0, 0.0]])
    assert torch.allclose(logp.grad, want, atol=1e-6)
    # the same tokens under DPPO-Binary-TV at δ = 0.1: the two against-the-advantage moves are kept
    _, dmet = LOSSES["dppo_tv"](logp.detach(), old, old, adv, torch.ones(3, 2), mask, clip=0.1)
    assert dmet["policy/clip_fraction"] == 0.0


def test_ipo_ratios_outside_every_band_and_the_cap():
    # r = 40 and r = 1/40: far outside; only the τ term remains; with loss_c the kept weight is capped
    logp = torch.tensor([[math.log(0.4), math.log(0.01 / 40)]], requires_grad=True)
    old = torch.tensor([[math.log(0.01), math.log(0.01)]])
    per_tok, met = LOSSES["ipo"](logp, old, old, torch.tensor([1.0]), torch.ones(1, 2), torch.ones(1, 2), clip=0.1)
    assert met["policy/ipo_masked_fraction"] == 0.5  # |0.4 − 0.01| > 0.1 masked; |0.00025 − 0.01| kept
    assert per_tok[0, 0].item() == pytest.approx(1e-3 * math.log(40) ** 2, rel=1e-5)
    capped, _ = LOSSES["ipo"](logp, old, old, torch.tensor([1.0]), torch.ones(1, 2), torch.ones(1, 2), clip=0.1,
                              loss_c=0.01)
    assert capped[0, 1].item() == pytest.approx(-0.01 * math.log(0.01 / 40) + 1e-3 * math.log(1 / 40) ** 2, rel=1e-5)


def test_ipo_preset_is_bypass_anchored_and_refuses_a_bad_band():
    pol = resolve_policy("ipo", PolicyConfig())
    assert (pol["loss"], pol["anchor"], pol["bypass"]) == ("ipo", "bypass", True)
    assert loss_kwargs(pol)["clip"] == pytest.approx(0.1) and loss_kwargs(pol)["kl_tau"] == pytest.approx(1e-3)
    assert resolve_policy("ipo", PolicyConfig(anchor="recompute"))["anchor"] == "recompute"
    for bad in ("0", "1", "1.5", "-0.1"):
        with pytest.raises(UnisonError, match="policy.clip"):
            config_from_dict({"algo": "ipo"}, [f"policy.clip={bad}"])


# ------------------------------------------------------------------ M2PO
def _m2_inputs():
    # log π_old − log μ on the mask: row 0 [0.5, 0.1, −0.3], row 1 [0.05, pad], row 2 fully masked
    mu = torch.full((3, 3), -1.0)
    d = torch.tensor([[0.5, 0.1, -0.3], [0.05, 7.0, 0.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    return mu + d, mu, mask


def test_m2po_masks_the_largest_second_moments_over_the_whole_batch():
    old, mu, mask = _m2_inputs()
    w, m = CORRECTIONS["m2po"](old, mu, mask, c=0.04)
    # m2 = 0.25, 0.01, 0.09, 0.0025: mean 0.088125 >= 0.04; without the largest 0.1025 / 3 = 0.034167 < 0.04
    assert w.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert m["correction/m2_before"] == pytest.approx(0.088125, rel=1e-5)
    assert m["correction/m2_after"] == pytest.approx(0.1025 / 3, rel=1e-5)
    assert m["correction/masked_fraction"] == pytest.approx(0.25)
    # row by row, row 0 alone (mean 0.1167, then 0.05) would also lose its −0.3 token: the batch keeps it
    w0, _ = CORRECTIONS["m2po"](old[:1], mu[:1], mask[:1], c=0.04)
    assert w0.tolist() == [[0.0, 1.0, 0.0]]


def test_m2po_keeps_only_the_smallest_when_no_k_reaches_the_bound():
    old, mu, mask = _m2_inputs()
    w, m = CORRECTIONS["m2po"](old, mu, mask, c=1e-3)  # suffix means 0.088, 0.034, 0.00625, 0.0025: none < 1e-3
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert m["correction/m2_after"] == pytest.approx(0.0025, rel=1e-4)
    # on-policy: nothing to mask
    w1, m1 = CORRECTIONS["m2po"](mu, mu, mask, c=0.04)
    assert torch.equal(w1, mask) and m1["correction/m2_before"] == 0.0
    # an all-masked batch: zero weights, no error
    w2, _ = CORRECTIONS["m2po"](old, mu, torch.zeros(3, 3), c=0.04)
    assert float(w2.abs().sum()) == 0.0


def test_grpo_m2po_preset_and_bad_tau():
    pol = resolve_policy("grpo_m2po", PolicyConfig())
    assert (pol["loss"], pol["correction"], correction_kwargs(pol)["c"]) == ("ppo_clip", "m2po", 0.04)
    with pytest.raises(UnisonError, match="policy.correction_c"):
        config_from_dict({"algo": "grpo_m2po"}, ["policy.correction_c=0"])
    with pytest.raises(UnisonError, match="token-level correction 'm2po'"):
        resolve_policy("gspo", PolicyConfig(correction="m2po"))


# ------------------------------------------------------------------ DPPO-KL divergence
def test_dppo_kl_first_term_is_exact_so_a_collapsed_rare_token_is_masked():
    # p_old = 0.003 collapsed to p = 1e-12 with A < 0: D = 0.003·(log 0.003 − log 1e-12) + 0.997·log(0.997 / 1)
    q, p = 0.003, 1e-12
    d = q * (math.log(q) - math.log(p)) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    assert d == pytest.approx(0.0625, abs=2e-4) and d > 0.05  # verl masks it (δ = 0.05)
    guarded = q * math.log((q + 1e-8) / (p + 1e-8)) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    assert guarded < 0.05  # the old formula (1e-8 in the first log too) kept it
    logp, old = torch.tensor([[math.log(p)]], dtype=torch.float64), torch.tensor([[math.log(q)]], dtype=torch.float64)
    per_tok, met = LOSSES["dppo_kl"](logp, old, old, torch.tensor([-1.0]), torch.ones(1, 1), torch.ones(1, 1), clip=0.05)
    assert met["policy/clip_fraction"] == 1.0 and per_tok.item() == 0.0


# ------------------------------------------------------------------ the mismatch-budget LR
def test_mismatch_budget_follows_a_scripted_metric_by_hand():
    s = MismatchBudgetSchedule(1e-4, warmup_steps=2, target=0.01, down=0.5, up=2.0, min_ratio=0.2)
    lrs, states = [], []
    # metric after steps 1..8: high, high, high, (floor), mid (hold), low (raise), low (raise, capped), nan
    seq = [0.02, 0.03, 0.5, 0.9, 0.007, 0.001, 0.0, float("nan")]
    for step, v in enumerate(seq, 1):
        lrs.append(s.lr(step))
        states.append(s.observe(step, {"mismatch/k3": v})["schedule/budget_state"])
    f = [1, 0.5, 0.25, 0.2, 0.2, 0.2, 0.4, 0.8]  # factor in force during steps 1..8
    warm = [0.5, 1, 1, 1, 1, 1, 1, 1]  # linear warm-up over 2 steps, composed
    assert lrs == pytest.approx([1e-4 * a * b for a, b in zip(f, warm)])
    assert states == [-1, -1, -1, -1, 0, 1, 1, 0]
    assert s.factor == pytest.approx(0.8)
    # resumable: a new schedule loaded from the state continues at the same LR
    t = MismatchBudgetSchedule(1e-4, warmup_steps=2, target=0.01, down=0.5, up=2.0, min_ratio=0.2)
    t.load_state_dict(s.state_dict())
    assert t.lr(9) == s.lr(9) == pytest.approx(0.8e-4)
    s.observe(9, {"mismatch/k3": 0.0})
    assert s.factor == 1.0  # capped at the base LR


def test_mismatch_budget_config_metric_default_and_bad_input():
    cfg = config_from_dict({}, ["train.schedule=mismatch_budget"])
    assert make_schedule(cfg.train).metric == "mismatch/k3"
    assert make_schedule(cfg.train, asynchronous=True).metric == "mismatch/staleness_k3"
    cfg = config_from_dict({}, ["train.schedule=mismatch_budget", "train.mismatch_budget.metric=mismatch/chi2_token"])
    assert make_schedule(cfg.train, asynchronous=True).metric == "mismatch/chi2_token"
    with pytest.raises(UnisonError, match="train.mismatch_budget.down must be below 1"):
        config_from_dict({}, ["train.mismatch_budget.down=1.0"])
    with pytest.raises(UnisonError, match="train.mismatch_budget.up must be above 1"):
        config_from_dict({}, ["train.mismatch_budget.up=0.9"])


# ------------------------------------------------------------------ the quantization-aware learner
def _perturbed(learner, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return learner


def _one_batch(engine, n=2, tokens=12, **sampling):
    from unison.batch import collate
    from unison.rollout import SamplingParams

    ids = [engine.tokenizer(t)["input_ids"] for t in ("12+35=", "7+8=")]
    comps = engine.generate(ids, SamplingParams(n=n, max_tokens=tokens, seed=3, **sampling))
    return collate(comps, engine.pad_id)


def test_quantization_aware_gradient_is_straight_through_to_the_master(tiny_dir):
    """∂L/∂W_master under QAT == ∂L/∂W_q of the same loss computed on a model that holds W_q = Q(W)."""
    from unison.learner import Learner, token_logprobs
    from unison.quant import fake_quantize, targets

    qat = _perturbed(Learner(tiny_dir, quantization_aware=("int4", 64)))
    ref = _perturbed(Learner(tiny_dir))
    quant = {t.name: t.in_dim for t in targets(ref.model)}
    with torch.no_grad():  # the reference holds the quantized weights themselves
        for name, p in ref.model.named_parameters():
            if name in quant:
                p.copy_(fake_quantize(p, "int4", torch.float32, quant[name]))
    engine = __import__("unison.rollout", fromlist=["make_engine"]).make_engine("native", tiny_dir, torch.float32)
    b = _one_batch(engine)
    losses = []
    for lrn in (qat, ref):
        lp = token_logprobs(lrn.forward_module, b.tokens, b.attention_mask, positions=b.response_mask)
        loss = -(lp * b.response_mask).sum()
        loss.backward()
        losses.append(float(loss.detach()))
    assert losses[0] == losses[1]  # the forward is exactly the quantized model's
    gq, gr = dict(qat.model.named_parameters()), dict(ref.model.named_parameters())
    assert set(quant) and all(n in gq for n in quant)
    for name in gq:
        assert torch.equal(gq[name].grad, gr[name].grad), name  # straight through, bit for bit
    # the parameters are still the fp32 masters, under their own names (not the quantized values)
    assert not torch.equal(gq["model.layers.0.mlp.up_proj.weight"].detach(), gr["model.layers.0.mlp.up_proj.weight"].detach())


def test_quantization_aware_off_is_bit_identical_and_the_engine_agrees(tiny_dir):
    from unison.learner import Learner
    from unison.mismatch import k3
    from unison.rollout import make_engine

    plain, qat = _perturbed(Learner(tiny_dir)), _perturbed(Learner(tiny_dir, quantization_aware=("int4", 64)))
    engine = make_engine("native", tiny_dir, torch.float32, quantization="int4")
    engine.sync_weights(plain)
    b = _one_batch(engine)
    with qat.qat.set(False):  # switched off: the hooks do nothing
        assert torch.equal(qat.score(b), plain.score(b))
    assert float(k3(plain.score(b), b.logp_mu, b.response_mask)) > 1e-4  # int4 vs the fp32 masters
    assert float(k3(qat.score(b), b.logp_mu, b.response_mask)) < 1e-9  # π is the policy μ samples from


def test_quantization_aware_quantizes_moe_experts_and_lora_merged_weights(tiny_dir, tmp_path):
    from unison import zoo
    from unison.config import LoRAConfig
    from unison.learner import Learner
    from unison.mismatch import k3
    from unison.rollout import make_engine

    moe_dir = zoo.build("qwen3_moe", tmp_path / "moe")
    learner = Learner(moe_dir, quantization_aware=("int8", 64))
    assert any("experts" in m for m, _, _ in learner.qat.params)  # the 3-D expert tensors are quantized too
    engine = make_engine("native", moe_dir, torch.float32, quantization="int8")
    b = _one_batch(engine, tokens=8)
    learner.routing_replay = True  # the engine's experts: the remaining gap is quantization's alone
    assert float(k3(learner.score(b), b.logp_mu, b.response_mask)) < 1e-9
    lora = Learner(tiny_dir, lora_cfg=LoRAConfig(rank=2, alpha=4.0), quantization_aware=("int4", 64))
    with torch.no_grad():  # adapters that change the merged weight
        for n, p in lora.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert lora.qat.lora and not any("lora_" in m or "base_layer" in m for m, _, _ in lora.qat.params)
    eng = make_engine("native", tiny_dir, torch.float32, quantization="int4")
    eng.sync_weights(lora)  # the merged weights W + (α/r)·B·A, quantized by the engine
    b = _one_batch(eng)
    assert float(k3(lora.score(b), b.logp_mu, b.response_mask)) < 1e-9


def test_probe_quantization_aware_rows_and_exact_bitwise(tiny_dir):
    from unison.probe import ProbeConfig, run_probe

    out = run_probe(ProbeConfig(precisions=["fp32", "bf16"], quantizations=["int4"], quantization_aware=True,
                                exact=True, n=2, max_new_tokens=24), log=lambda m: None)
    rows = {(r["precision"], r["exact"], r["quantization_aware"]): r for r in out["results"]}
    assert set(rows) == {(p, e, q) for p in ("fp32", "bf16") for e, q in ((False, False), (False, True), (True, True))}
    assert rows["fp32", False, False]["mismatch/k3"] > 1e-3
    assert rows["fp32", False, True]["mismatch/k3"] < 1e-9
    # bf16 through the quantizer: down to bf16's own mismatch (≈ 3e-4 on this model, not int4's 0.2)
    assert rows["bf16", False, True]["mismatch/k3"] < 0.1 * rows["bf16", False, False]["mismatch/k3"]
    for p in ("fp32", "bf16"):  # quantized rollout with zero mismatch
        assert rows[p, True, True]["mismatch/k3"] == 0.0 and rows[p, True, True]["mismatch/identical_fraction"] == 1.0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exact_mode_with_an_int4_rollout_trains_bitwise_equal(tmp_path, precision):
    """The engine re-quantizes the updated masters at every sync, the learner quantizes the same masters:
    log μ == log π_old on every step, while the weights move."""
    from unison.config import load_config
    from unison.trainer import Trainer, read_metrics

    (tmp_path / "r.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    cfg = load_config(None, ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4",
                             "rollout.max_new_tokens=6", "train.prompts_per_step=4", "train.steps=3", "train.lr=1e-2",
                             "log.console=false", "log.tensorboard=false", f"task.reward={tmp_path / 'r.py'}:reward",
                             "task.truncated_reward=null", "exact=true", "rollout.quantization=int4",
                             "train.quantization_aware=true", f"precision={precision}"])
    Trainer(cfg, tmp_path / "run", log=lambda m: None).fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["mismatch/identical_fraction"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["mismatch/k3"] == 0.0 for r in rows) and all(r["optim/grad_norm"] > 0 for r in rows)


def test_quantization_aware_bad_input_is_refused_before_writing(tmp_path):
    from unison.config import load_config
    from unison.trainer import Trainer

    def train(*sets):
        cfg = load_config(None, ["train.steps=1", "log.console=false", "log.tensorboard=false", *sets])
        return Trainer(cfg, tmp_path / "run", log=lambda m: None)

    with pytest.raises(UnisonError, match="train.quantization_aware needs a quantized rollout"):
        train("train.quantization_aware=true")
    with pytest.raises(UnisonError, match="lora.dropout=0"):
        train("train.quantization_aware=true", "rollout.quantization=int4", "lora.rank=2", "lora.dropout=0.1")
    with pytest.raises(UnisonError, match="set train.quantization_aware=true"):
        train("rollout.quantization=int4", "exact=true")
    with pytest.raises(UnisonError, match="rollout.replay_sampling_mask=false"):
        train("engine=vllm", "vllm.mode=server", "vllm.url=http://127.0.0.1:9", "rollout.top_p=0.9")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ sampling-mask replay
def test_support_logsumexp_by_hand():
    from unison.rollout.base import support_logsumexp

    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.5, 0.4, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    # row 0: top-2 {3, 2}; row 1: top-1 {2.0} but the target (index 3, logit 1.0) ranks below it: it takes the
    # kept slot; row 2: 0 = the whole vocabulary
    lse = support_logsumexp(logits, torch.tensor([2, 3, 0]), torch.tensor([2, 1, 0]))
    want = [math.log(math.exp(3) + math.exp(2)), 1.0, math.log(sum(math.exp(x) for x in (1, 2, 3, 4)))]
    assert lse.tolist() == pytest.approx(want, rel=1e-6)


def test_replay_removes_the_kept_mass_from_the_ratio(tiny_dir):
    """Top-p 0.9 and top-k 5 in fp32: without replay π/μ carries −log S (the kept mass); with it the
    token k3 is at fp32 rounding, as without truncation."""
    from unison.learner import Learner
    from unison.mismatch import k1, k3
    from unison.rollout import make_engine

    learner = Learner(tiny_dir)
    engine = make_engine("native", tiny_dir, torch.float32)
    for sampling in ({"top_p": 0.9}, {"top_k": 5}):
        b = _one_batch(engine, n=4, tokens=24, **sampling)
        assert "support" in b.extras and int(b.extras["support"].max()) > 0
        # recorded on response tokens only, one size per sampled token
        assert bool(((b.extras["support"] > 0) <= b.response_mask.bool()).all())
        learner.replay_sampling_mask = False
        full = learner.score(b)
        learner.replay_sampling_mask = True
        replayed = learner.score(b)
        m = b.response_mask
        assert float(k3(full, b.logp_mu, m)) > 1e-4 and float(k1(full, b.logp_mu, m)) > 0  # log μ > log π
        assert float(k3(replayed, b.logp_mu, m)) < 1e-9
    b = _one_batch(engine)  # no truncation: nothing recorded, nothing replayed
    assert "support" not in b.extras
