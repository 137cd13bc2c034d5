"""The cures the field ships (issue 27), against numbers computed by hand: IcePop, IPO, M2PO, the
DPPO-KL divergence, the mismatch-budget LR."""

import json
import math

import pytest
import torch

from unison.algorithms.corrections import CORRECTIONS
from unison.algorithms.losses import LOSSES
from unison.algorithms.presets import correction_kwargs, loss_kwargs, resolve_policy
from unison.config import PolicyConfig, config_from_dict
from unison.errors import UnisonError
from unison.schedules import MismatchBudgetSchedule, make_schedule
from unison.sync import sync
from unison.sides import Side


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


def test_ipo_preset_caps_the_ratio_weight_at_1e4_as_prime_rl():
    """μ = 1e-6 (π_old under bypass), π = 0.05: |π − μ| = 0.05 ≤ ε is kept; its weight r = 5e4 is capped at 1e4
    (prime-rl's max_importance_ratio), the gradient −A·1e4·∇log π."""
    pol = resolve_policy("ipo", PolicyConfig())
    kw = loss_kwargs(pol)
    assert kw["loss_c"] == 1e4
    logp = torch.tensor([[math.log(0.05)]], requires_grad=True)
    mu = torch.tensor([[math.log(1e-6)]])
    per_tok, met = LOSSES["ipo"](logp, mu, mu, torch.tensor([1.0]), torch.ones(1, 1), torch.ones(1, 1), **kw)
    assert met["policy/ipo_masked_fraction"] == 0.0
    per_tok.sum().backward()
    assert logp.grad.item() == pytest.approx(-1e4 + 2e-3 * math.log(5e4), rel=1e-5)


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
    w, m = CORRECTIONS["m2po_mask"](old, mu, mask, c=0.04)
    # m2 = 0.25, 0.01, 0.09, 0.0025: mean 0.088125 >= 0.04; without the largest 0.1025 / 3 = 0.034167 < 0.04
    assert w.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert m["correction/m2_before"] == pytest.approx(0.088125, rel=1e-5)
    assert m["correction/m2_after"] == pytest.approx(0.1025 / 3, rel=1e-5)
    assert m["correction/masked_fraction"] == pytest.approx(0.25)
    # row by row, row 0 alone (mean 0.1167, then 0.05) would also lose its −0.3 token: the batch keeps it
    w0, _ = CORRECTIONS["m2po_mask"](old[:1], mu[:1], mask[:1], c=0.04)
    assert w0.tolist() == [[0.0, 1.0, 0.0]]


def test_m2po_keeps_only_the_smallest_when_no_k_reaches_the_bound():
    old, mu, mask = _m2_inputs()
    w, m = CORRECTIONS["m2po_mask"](old, mu, mask, c=1e-3)  # suffix means 0.088, 0.034, 0.00625, 0.0025: none < 1e-3
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert m["correction/m2_after"] == pytest.approx(0.0025, rel=1e-4)
    # on-policy: nothing to mask
    w1, m1 = CORRECTIONS["m2po_mask"](mu, mu, mask, c=0.04)
    assert torch.equal(w1, mask) and m1["correction/m2_before"] == 0.0
    # an all-masked batch: zero weights, no error
    w2, _ = CORRECTIONS["m2po_mask"](old, mu, torch.zeros(3, 3), c=0.04)
    assert float(w2.abs().sum()) == 0.0


def _areal_batch():
    """Two rows: log π_old − log μ = [0.1, −0.2, 0.5] and [ln 6, 0.0, (padding)]."""
    mu = torch.full((2, 3), -1.0)
    d = torch.tensor([[0.1, -0.2, 0.5], [math.log(6.0), 0.0, 0.0]])
    return mu + d, mu, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_grpo_m2po_is_arealss_decoupled_m2po_on_a_hand_computed_batch():
    """AReaL's M2PO: the decoupled loss's behaviour weight ρ = π_old/μ on the tokens M2PO keeps, a token with ρ > 5
    masked (rejection_sampling upper 5, action mask). By hand, τ = 0.04: m2 = 0.01, 0.04, 0.25, ln²6 = 3.2104, 0;
    sorted suffix means 0.702, 0.075, 0.01667 < τ: the 2 largest (ln 6, 0.5) are masked; the kept weights are
    e^0.1, e^−0.2, e^0 = 1.10517, 0.81873, 1. With τ = 1 nothing is masked by M2 (0.702 < 1) and the ln 6 token
    (ρ = 6 > 5) is masked by the cap."""
    pol = resolve_policy("grpo_m2po", PolicyConfig())
    assert (pol["loss"], pol["correction"], pol["anchor"]) == ("ppo_clip", "m2po", "recompute")
    assert correction_kwargs(pol) == {"c": 0.04, "cap": 5.0}
    old, mu, mask = _areal_batch()
    w, m = CORRECTIONS["m2po"](old, mu, mask, **correction_kwargs(pol))
    want = torch.tensor([[math.exp(0.1), math.exp(-0.2), 0.0], [0.0, 1.0, 0.0]])
    assert torch.allclose(w, want, rtol=1e-6, atol=0)
    assert m["correction/m2_masked_fraction"] == pytest.approx(2 / 5)
    assert m["correction/behave_masked_fraction"] == 0.0
    assert m["correction/m2_before"] == pytest.approx((0.01 + 0.04 + 0.25 + math.log(6) ** 2) / 5, rel=1e-5)
    assert m["correction/m2_after"] == pytest.approx(0.05 / 3, rel=1e-5)
    w, m = CORRECTIONS["m2po"](old, mu, mask, c=1.0, cap=5.0)
    want = torch.tensor([[math.exp(0.1), math.exp(-0.2), math.exp(0.5)], [0.0, 1.0, 0.0]])
    assert torch.allclose(w, want, rtol=1e-6, atol=0)
    assert m["correction/behave_masked_fraction"] == pytest.approx(1 / 5) and m["correction/m2_masked_fraction"] == 0.0
    # the mask-only variant, kept under its own name: the same M2 mask, no behaviour weight
    pol = resolve_policy("grpo_m2po_mask", PolicyConfig())
    w, _ = CORRECTIONS[pol["correction"]](old, mu, mask, **correction_kwargs(pol))
    assert w.tolist() == [[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    # in the decoupled loss the PPO ratio is clipped around π_old and the weight multiplies each token's term
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    per_tok, _ = LOSSES["ppo_clip"](logp, old, mu, adv, CORRECTIONS["m2po"](old, mu, mask)[0], mask, clip=0.2)
    assert torch.allclose(per_tok.detach(), -want.new_tensor([[1.0], [-1.0]]) * CORRECTIONS["m2po"](old, mu, mask)[0])


def test_m2po_under_a_token_mean_divides_by_the_tokens_it_keeps_as_areal_does(tiny_dir, tmp_path):
    """AReaL multiplies the loss mask by M2PO's, so its token mean divides by the kept tokens; unison divided by
    every response token, a step (1 − m2_masked_fraction) of AReaL's (issue 51, item 9). At r = 1 the PPO term is
    −w_t·A, so the loss is −Σ w_t A_i over the normaliser's count, by hand."""
    from unison.algorithms.anchors import OldLogp
    from unison.algorithms.corrections import LOSS_MASKS
    from unison.batch import collate
    from unison.config import load_config
    from unison.learner import Learner
    from unison.rollout import SamplingParams, make_engine

    eng = make_engine("native", tiny_dir, torch.float32)
    ids = [eng.tokenizer(t)["input_ids"] for t in ("12+35=", "7+8=")]
    b = collate(eng.generate(ids, SamplingParams(n=2, max_tokens=6, seed=1)), eng.pad_id)
    cfg = load_config(None, ["algo=grpo_m2po", "policy.loss_agg=token_mean", "train.mini_batches=1"])
    learner = Learner.from_config(cfg, tiny_dir)
    b.logp_old = learner.score(b)
    g = torch.Generator().manual_seed(0)
    b.logp_mu = (b.logp_old + 0.3 * torch.randn(b.tokens.shape, generator=g)) * b.response_mask  # a stale μ
    b.advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])
    pol = learner.policy
    w, met = CORRECTIONS["m2po"](b.logp_old, b.logp_mu, b.response_mask, **correction_kwargs(pol))
    keep = LOSS_MASKS["m2po"](b.logp_old, b.logp_mu, b.response_mask, **correction_kwargs(pol))
    n_resp, n_kept = float(b.response_mask.sum()), float(keep.sum())
    assert 0 < n_kept < n_resp and met["correction/m2_masked_fraction"] == pytest.approx(1 - n_kept / n_resp)
    assert torch.equal(keep.bool(), keep.bool() & b.response_mask.bool())
    signal = float(-(w * b.advantages[:, None]).sum())
    old = OldLogp("score", b.logp_old)
    areal = learner.train(b, old, w, lr=0.0, loss_mask=keep).metrics["policy/loss"]
    every = learner.train(b, old, w, lr=0.0).metrics["policy/loss"]
    assert areal == pytest.approx(signal / n_kept, rel=1e-5)
    assert every == pytest.approx(signal / n_resp, rel=1e-5)
    # the trainer asks for the kept tokens exactly under a token mean (the preset's Dr.GRPO normaliser is constant)
    from unison.trainer import Trainer

    for agg, wired in (("token_mean", True), ("seq_mean_token_sum_norm", False)):
        t = Trainer(load_config(None, ["algo=grpo_m2po", f"policy.loss_agg={agg}", "log.console=false",
                                       "log.tensorboard=false"]), tmp_path / agg, log=lambda m: None)
        assert (t.anchor.loss_mask is not None) == wired
        t.source.close()


def test_grpo_m2po_preset_and_bad_input():
    with pytest.raises(UnisonError, match="policy.correction_c"):
        config_from_dict({"algo": "grpo_m2po"}, ["policy.correction_c=0"])
    with pytest.raises(UnisonError, match="policy.correction_cap"):
        config_from_dict({"algo": "grpo_m2po"}, ["policy.correction_cap=-1"])
    with pytest.raises(UnisonError, match="token-level correction 'm2po'"):
        resolve_policy("gspo", PolicyConfig(correction="m2po"))
    with pytest.raises(UnisonError, match="interpolates per mini-batch"):
        resolve_policy("grpo_m2po", PolicyConfig(anchor="loglinear"))


@pytest.mark.parametrize("algo", ["grpo_m2po", "grpo_icepop", "grpo_token_tis"])
def test_a_correction_with_mu_as_pi_old_is_refused_not_silently_a_no_op(algo):
    with pytest.raises(UnisonError, match="ρ = π_old/μ ≡ 1"):
        resolve_policy(algo, PolicyConfig(anchor="bypass"))
    assert resolve_policy("grpo", PolicyConfig(anchor="bypass"))["correction"] == "none"


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


def test_mismatch_budget_that_starts_low_earns_its_lr_by_hand():
    """train.mismatch_budget.start: f starts at 0.25 (the floor 0.1 below it) and rises ×2 while the metric stays
    under half the target, falls ×0.5 above it."""
    s = MismatchBudgetSchedule(1e-4, target=0.01, down=0.5, up=2.0, min_ratio=0.1, start=0.25)
    lrs = []
    for step, v in enumerate([0.001, 0.001, 0.02, 0.007, 0.02, 0.02], 1):
        lrs.append(s.lr(step))
        s.observe(step, {"mismatch/k3": v})
    assert lrs == pytest.approx([1e-4 * f for f in (0.25, 0.5, 1.0, 0.5, 0.5, 0.25)])
    assert s.factor == pytest.approx(0.125)
    cfg = config_from_dict({}, ["train.schedule=mismatch_budget", "train.mismatch_budget.start=0.1"])
    assert make_schedule(cfg.train).lr(1) == pytest.approx(1e-5)
    assert make_schedule(config_from_dict({}, ["train.schedule=mismatch_budget"]).train).lr(1) == 1e-4  # default 1
    with pytest.raises(UnisonError, match=r"train.mismatch_budget.start \(0.05\) is below its floor min_ratio"):
        config_from_dict({}, ["train.mismatch_budget.start=0.05"])


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


def test_mismatch_budget_without_its_metric_warns_once_and_says_so_in_the_summary(tmp_path, capsys):
    """A metric the run never logs (misspelled here) held the LR silently with budget_state 0, which reads as
    "within budget": the step now says schedule/budget_missing, the run warns once naming the nearest metric, and
    the summary and the done line count the steps."""
    from unison.cli import main
    from unison.data_io import read_metrics

    (tmp_path / "r.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    (tmp_path / "c.yaml").write_text("seed: 0\n")
    args = ["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")] + [f"--set={s}" for s in [
        "task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.steps=2", "log.tensorboard=false", "train.schedule=mismatch_budget",
        "train.mismatch_budget.metric=mismatch/k3x", f"task.reward={tmp_path / 'r.py'}:reward",
        "task.truncated_reward=null"]]
    assert main(args) == 0
    out = capsys.readouterr()
    text = out.err + out.out
    assert text.count("train.schedule=mismatch_budget watches 'mismatch/k3x'") == 1
    assert "did you mean 'mismatch/k3'?" in text
    assert "the mismatch budget's metric mismatch/k3x missing on 2 steps (LR held)" in text
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["schedule/budget_missing"] for r in rows] == [1, 1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mismatch_budget"]["steps_without_metric"] == 2


def test_a_step_without_an_update_is_not_a_missing_budget_metric(tmp_path, capsys):
    """Every group uniform: the step makes no update and measures no mismatch. The budget holds its LR without
    counting the step as missing, and no warning tells the user to set a metric that is set (issue 51, item 7)."""
    from unison.cli import main
    from unison.data_io import read_metrics

    (tmp_path / "flat.py").write_text("def reward(response, item):\n    return 0.0\n")
    (tmp_path / "c.yaml").write_text("seed: 0\n")
    args = ["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")] + [f"--set={s}" for s in [
        "task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.steps=2", "log.tensorboard=false", "train.schedule=mismatch_budget",
        f"task.reward={tmp_path / 'flat.py'}:reward", "task.truncated_reward=null", "train.drop_uniform_groups=true"]]
    assert main(args) == 0
    text = "".join(capsys.readouterr())
    assert "no update" in text and "watches" not in text
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["schedule/budget_missing"] for r in rows] == [0, 0]
    assert [r["schedule/budget_factor"] for r in rows] == [1.0, 1.0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mismatch_budget"]["steps_without_metric"] == 0


@pytest.mark.parametrize("sets,why", [(["train.mismatch_budget.metric=mismatch/staleness_k3"], "synchronous"),
                                      (["rollout.max_staleness=1", "lora.rank=2", "train.quantization_aware=true",
                                        "rollout.quantization=int4"], "quantization-aware learner with LoRA"),
                                      # a vLLM server keeps no older weights: the split never runs (issue 51, item 6)
                                      (["rollout.max_staleness=1", "engine=vllm", "vllm.mode=server",
                                        "vllm.url=http://127.0.0.1:9"], "engine vllm (server) keeps none")])
def test_mismatch_budget_on_a_metric_the_run_cannot_log_is_refused(tmp_path, capsys, sets, why):
    from unison.cli import main

    (tmp_path / "c.yaml").write_text("seed: 0\n")
    args = ["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run"), "--set=train.schedule=mismatch_budget"]
    args += [f"--set={s}" for s in sets]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "watches mismatch/staleness_k3, which this run never logs" in err and why in err
    assert "train.mismatch_budget.metric=mismatch/k3" in err and not (tmp_path / "run").exists()


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
    from unison.learner import Learner
    from unison.logprobs import token_logprobs
    from unison.quant import fake_quantize, targets

    qat = _perturbed(Learner(tiny_dir, Side(quantization="int4", group_size=64)))
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


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4", "mxfp8"])
def test_quantization_aware_off_is_bit_identical_and_the_engine_agrees(tiny_dir, fmt):
    """The cure for every format: the quantization-aware learner scores exactly what the quantized engine samples
    (k3 < 1e-9), and switched off it is the plain learner bit for bit."""
    from unison.learner import Learner
    from unison.mismatch import k3
    from unison.rollout import make_engine

    plain, qat = _perturbed(Learner(tiny_dir)), _perturbed(Learner(tiny_dir, Side(quantization=fmt, group_size=64)))
    engine = make_engine("native", tiny_dir, Side(quantization=fmt))
    sync(engine, plain)
    b = _one_batch(engine)
    with qat.qat.set(False):  # switched off: the hooks do nothing
        assert torch.equal(qat.score(b), plain.score(b))
    assert float(k3(plain.score(b), b.logp_mu, b.response_mask)) > 1e-6  # the format vs the fp32 masters
    assert float(k3(qat.score(b), b.logp_mu, b.response_mask)) < 1e-9  # π is the policy μ samples from


def test_quantization_aware_quantizes_moe_experts_and_lora_merged_weights(tiny_dir, tmp_path):
    from unison import zoo
    from unison.config import LoRAConfig
    from unison.learner import Learner
    from unison.mismatch import k3
    from unison.rollout import make_engine

    moe_dir = zoo.build("qwen3_moe", tmp_path / "moe")
    # the engine's experts replayed: the remaining gap is quantization's alone
    learner = Learner(moe_dir, Side(quantization="int8", group_size=64, routing_replay=True))
    assert any("experts" in m for m, _, _ in learner.qat.params)  # the 3-D expert tensors are quantized too
    engine = make_engine("native", moe_dir, Side(quantization="int8"))
    b = _one_batch(engine, tokens=8)
    assert float(k3(learner.score(b), b.logp_mu, b.response_mask)) < 1e-9
    lora = Learner(tiny_dir, Side(quantization="int4", group_size=64), lora=LoRAConfig(rank=2, alpha=4.0))
    with torch.no_grad():  # adapters that change the merged weight
        for n, p in lora.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert lora.qat.lora and not any("lora_" in m or "base_layer" in m for m, _, _ in lora.qat.params)
    eng = make_engine("native", tiny_dir, Side(quantization="int4"))
    sync(eng, lora)  # the merged weights W + (α/r)·B·A, quantized by the engine
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


def test_the_quantization_aware_lora_learner_scores_with_parameters_cast_to_bf16(tiny_dir):
    # LoRA under the quantization-aware learner, parameters cast to bf16 (FSDP2's mixed precision, the probe's
    # --param-dtype compute): the adapted layer merged in fp32 and multiplied a bf16 input by an fp32 weight
    # ("expected m1 and m2 to have the same dtype"); it now multiplies in the input's dtype
    from unison.probe import ProbeConfig, run_probe

    out = run_probe(ProbeConfig(precisions=["bf16"], quantizations=["int4"], quantization_aware=True, lora_ranks=[2],
                                param_dtypes=["compute"], n=2, max_new_tokens=12), log=lambda m: None)
    rows = {r["quantization_aware"]: r for r in out["results"]}
    assert rows[True]["mismatch/k3"] < 0.5 * rows[False]["mismatch/k3"]  # the quantizer still removes int4's gap


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
        with learner.as_side(Side(support_replay=False)):
            full = learner.score(b)
        with learner.as_side(Side(support_replay=True)):
            replayed = learner.score(b)
        m = b.response_mask
        assert float(k3(full, b.logp_mu, m)) > 1e-4 and float(k1(full, b.logp_mu, m)) > 0  # log μ > log π
        assert float(k3(replayed, b.logp_mu, m)) < 1e-9
    b = _one_batch(engine)  # no truncation: nothing recorded, nothing replayed
    assert "support" not in b.extras


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_quantization_aware_lora_under_autocast_quantizes_the_engines_fp32_merge(tiny_dir, precision, monkeypatch):
    """QAT + LoRA in bf16/fp16: the learner merges W + (α/r)·B·A in fp32 outside autocast, as the engine's weight
    export does, so the int4 codes and scales it computes with are the engine's (before, B @ A ran in the
    autocast dtype and the codes differed once B ≠ 0)."""
    from unison import quant
    from unison.batch import collate
    from unison.config import LoRAConfig
    from unison.learner import Learner
    from unison.precision import DTYPES

    learner = Learner(tiny_dir, Side(dtype=DTYPES[precision], quantization="int4", group_size=64),
                      lora=LoRAConfig(rank=2, alpha=4.0))
    with torch.no_grad():
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    seen = []
    real = quant.straight_through
    monkeypatch.setattr(quant, "straight_through", lambda w, *a: seen.append(w.detach().clone()) or real(w, *a))
    from unison.batch import Completion

    b = collate([Completion([1, 5, 7], [9, 11, 2], [-1.0, -1.0, -1.0], "stop")], 0)
    learner.score(b)
    engine_side = dict(learner.export_weights(None))  # what the engine quantizes at every sync
    merged = [engine_side[f"{n}.weight"] for n in learner.qat.lora]
    assert len(seen) == len(merged) and all(w.dtype == torch.float32 for w in seen)
    for got in seen:  # the forward's order: each is exactly one of the engine's merged weights
        want = [w for w in merged if w.shape == got.shape and torch.equal(w, got)]
        assert len(want) == 1
        q_l, q_e = quant.quantize(got, "int4"), quant.quantize(want[0], "int4")
        assert torch.equal(q_l.codes, q_e.codes) and torch.equal(q_l.scale, q_e.scale)


def test_m2po_mask_is_the_batchs_whatever_the_micro_batching_and_the_logged_m2_is_the_applied_one(tmp_path,
                                                                                                monkeypatch):
    """With the defaults (one mini-batch, fuse_score_pass) a fused π_old exists one micro-batch at a time, and M2PO
    was evaluated per micro-batch (5-row chunks at micro_batch_tokens 64 masked other tokens than the batch): a
    batch-level correction now takes the score pass, is computed once over the whole batch, and what the step logs
    is what it applied."""
    from unison.algorithms import corrections
    from unison.config import load_config
    from unison.data_io import read_metrics
    from unison.trainer import Trainer

    (tmp_path / "r.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    calls = []
    real = corrections.CORRECTIONS["m2po"]

    def spy(o, mu, m, **kw):
        w, met = real(o, mu, m, **kw)
        calls.append((tuple(m.shape), w.clone(), met))
        return w, met

    monkeypatch.setitem(corrections.CORRECTIONS, "m2po", spy)
    runs = {}
    for budget in (64, 4096):
        calls.clear()
        cfg = load_config(None, ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4",
                                 "rollout.max_new_tokens=10", "train.prompts_per_step=8", "train.steps=1",
                                 "log.console=false", "log.tensorboard=false", "rollout.quantization=int4",
                                 "rollout.quant_group_size=32", "algo=grpo_m2po", "policy.correction_c=0.002",
                                 f"train.micro_batch_tokens={budget}", "threads=1",
                                 f"task.reward={tmp_path / 'r.py'}:reward", "task.truncated_reward=null"])
        t = Trainer(cfg, tmp_path / f"b{budget}", log=lambda m: None)
        assert t.anchor == "score"  # not fused: the whole batch's π_old before the update
        t.fit()
        assert len(calls) == 1 and calls[0][0][0] == 32  # once, over all 32 rows
        row = read_metrics(tmp_path / f"b{budget}" / "metrics.jsonl")[0]
        applied = calls[0][2]
        for k in ("correction/m2_after", "correction/m2_masked_fraction", "correction/masked_fraction"):
            assert row[k] == applied[k], k
        runs[budget] = (calls[0][1], row)
    (w64, r64), (w4k, r4k) = runs[64], runs[4096]
    assert 0 < r64["correction/m2_masked_fraction"] < 1  # the mask did something
    assert torch.equal(w64, w4k)
    assert r64["optim/grad_norm"] == pytest.approx(r4k["optim/grad_norm"], rel=1e-5)
