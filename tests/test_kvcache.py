"""A quantized KV cache (rollout.kv_cache_dtype, unison/kvcache.py): the format by hand, the scales, the engine's
cache against the learner's replay, the ledger's kv_cache term, the probe (its one-line refusals: test_bad_inputs)."""

import pytest
import torch

from unison import kvcache
from unison.batch import collate
from unison.config import load_config
from unison.data_io import read_metrics
from unison.learner import Learner
from unison.policy import ScoringOptions
from unison.rollout import SamplingParams, make_engine
from unison.sides import Side
from unison.trainer import Trainer


def test_fp8_formats_round_to_nearest_even_and_saturate_by_hand():
    one = torch.ones(1, 1, 1, 1)
    x = torch.tensor([1.0625, 1.1875, 1.2, 500.0, -500.0, 3.0])[None, None, None]  # [1, 1, 1, 6]
    # e4m3 near 1 steps by 1/8: 1.0625 ties to 1.0 (even mantissa), 1.1875 ties to 1.25, 1.2 -> 1.25; ±448 at most
    assert kvcache.quantize(x, "fp8_e4m3", one).flatten().tolist() == [1.0, 1.25, 1.25, 448.0, -448.0, 3.0]
    # e5m2 steps by 1/4: 1.0625 -> 1.0, 1.1875 -> 1.25, 1.2 -> 1.25; 500 is 2^8·1.953: -> 512 (steps of 64 there)
    assert kvcache.quantize(x, "fp8_e5m2", one).flatten().tolist() == [1.0, 1.25, 1.25, 512.0, -512.0, 3.0]
    big = torch.tensor([60000.0, 1e9])[None, None, None]
    assert kvcache.quantize(big, "fp8_e5m2", one).flatten().tolist() == [57344.0, 57344.0]
    # a scale divides first: 2.3 / 2 = 1.15 -> 1.125 (e4m3) -> 2.25; per head: [1, 2 heads, 1, 1]
    two = torch.tensor([2.0, 0.5])[None, :, None, None]
    y = kvcache.quantize(torch.full((1, 2, 1, 1), 2.3), "fp8_e4m3", two)
    assert y.flatten().tolist() == [2.25, 2.25]  # 2.3 / 0.5 = 4.6 -> 4.5 (steps of 0.5 in [4, 8)) -> 2.25
    # a bf16 input comes back in bf16
    assert kvcache.quantize(x.bfloat16(), "fp8_e4m3", one).dtype == torch.bfloat16


def test_the_straight_through_gradient_is_the_identity():
    x = torch.tensor([[[[1.07, -3.3, 0.01]]]], requires_grad=True)
    y = kvcache._StraightThrough.apply(x, "fp8_e4m3", torch.ones(1, 1, 1, 1))
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert x.grad.flatten().tolist() == [1.0, 2.0, 3.0]


def test_calibrate_takes_each_heads_largest_real_value_by_hand():
    x = torch.zeros(2, 2, 3, 4)  # [b, heads, s, d]
    x[0, 0, 1, 2] = -8.96  # head 0's largest real value
    x[1, 0, 0, 0] = 100.0  # a padding position: not counted
    x[1, 1, 2, 3] = 4.48  # head 1's
    valid = torch.tensor([[True, True, True], [False, True, True]])
    s = kvcache.calibrate(x, valid, "fp8_e4m3")
    assert s.tolist() == pytest.approx([8.96 / 448, 4.48 / 448])
    assert kvcache.calibrate(torch.zeros(1, 1, 2, 2), torch.ones(1, 2, dtype=torch.bool), "fp8_e4m3").tolist() == [1.0]


def _engine(tiny_dir, scales="sync"):
    return make_engine("native", tiny_dir, Side(kv_cache="fp8_e4m3", kv_scales=scales))


PROMPTS = [[5, 9, 11, 3], [7, 2]]


def test_sync_scales_are_measured_by_the_first_batch_after_each_sync_and_held_until_the_next(tiny_dir):
    eng = _engine(tiny_dir)
    params = SamplingParams(n=2, max_tokens=6, seed=1)
    first = eng.generate(PROMPTS, params)
    s = first[0].kv_scale
    assert s.shape == (eng.config.num_hidden_layers, 2, eng.config.num_key_value_heads)
    assert all(torch.equal(c.kv_scale, s) for c in first) and bool((s > 0).all()) and bool((s != 1).any())
    again = eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)  # other prompts, no sync between: the same scales
    assert torch.equal(again[0].kv_scale, s)
    eng.load_weights(eng.model.named_parameters())  # a weight sync (the same weights): measured anew
    after = eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)
    assert not torch.equal(after[0].kv_scale, s)
    one = _engine(tiny_dir, "one").generate(PROMPTS, params)
    assert bool((one[0].kv_scale == 1).all())


def test_the_cache_changes_what_the_engine_samples_from(tiny_dir):
    """The engine's own prefill re-score (the ledger's decode pass) of its samples holds to fp32 rounding with the
    cache quantized as it sampled, and moves by far more with an unquantized cache."""
    params = SamplingParams(n=2, max_tokens=8, seed=3)
    eng = _engine(tiny_dir)
    batch = collate(eng.generate(PROMPTS, params), pad_id=0)
    m = batch.response_mask.bool()
    own = eng.score(batch, params)
    plain = make_engine("native", tiny_dir, Side()).score(batch, params)
    assert float((own - batch.logp_mu)[m].abs().max()) < 1e-5
    assert float((plain - batch.logp_mu)[m].abs().max()) > 1e-3


@pytest.mark.parametrize("packing", [False, True])
def test_the_replaying_learner_scores_what_the_engine_sampled_from(tiny_dir, packing):
    """fp32 on both sides: the learner with the batch's scales on its keys and values removes the cache's mismatch,
    padded or packed, though not bit for bit: the engine's and the learner's fp32 kernels differ by rounding
    (max |Δ log p| 4e-6 with no cache quantized), and a key that lands on the other side of an fp8 rounding
    boundary moves by a whole fp8 step (measured here: k3 3.1e-3 -> 1.8e-9, max |Δ| 0.22 -> 4.4e-4)."""
    from unison.mismatch import k3

    eng = _engine(tiny_dir)
    batch = collate(eng.generate([[5, 9, 11, 3, 8, 8, 1], [7, 2], [4, 4, 4]], SamplingParams(n=3, max_tokens=10,
                                                                                               seed=4)), pad_id=0)
    opts = ScoringOptions(packing=packing, micro_batch_size=4)
    aware = Learner(tiny_dir, Side(kv_cache="fp8_e4m3"), opts)
    plain = Learner(tiny_dir, Side(), opts)
    m = batch.response_mask.bool()

    def gap(lp):
        return float(k3(lp, batch.logp_mu, batch.response_mask)), float((lp - batch.logp_mu)[m].abs().max())

    base_k3, base_max = gap(plain.score(batch))
    assert base_k3 > 1e-3 and base_max > 0.1
    got_k3, got_max = gap(aware.score(batch))
    assert got_k3 < 1e-3 * base_k3 and got_max < 1e-2
    with plain.as_side(Side(kv_cache="fp8_e4m3")):  # the ledger's "as the engine ran"
        assert gap(plain.score(batch)) == (got_k3, got_max)
    assert gap(plain.score(batch)) == (base_k3, base_max)  # and back


BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=8",
        "train.prompts_per_step=4", "train.mini_batches=2", "train.micro_batch_size=8", "train.lr=3e-3",
        "log.console=false", "log.tensorboard=false", "mismatch.decompose_every=1", "train.steps=2",
        "rollout.kv_cache_dtype=fp8_e4m3"]


def _fit(tmp_path, name, sets):
    Trainer(load_config(None, BASE + sets), tmp_path / name, log=lambda m: None).fit()
    return read_metrics(tmp_path / name / "metrics.jsonl")


def test_the_ledger_names_the_cache_and_the_replaying_learner_removes_it(tmp_path, char_reward):
    """Measured (tiny model, fp32, 3 steps): kv_cache k3 6.9e-3, 1.5e-3, 1.1e-3 (e4m3), 1.9e-2 … (e5m2); the
    KV-cache-aware learner's total k3 2e-12 – 7e-11 (rows of one prompt length here: a key that rounds to the other
    fp8 neighbour on one side only would leave ~1e-7)."""
    from unison import ledger

    rows = _fit(tmp_path, "kv", char_reward)
    for r in rows:
        assert [t for t in ledger.TERMS if f"ledger/{t}_k1" in r] == ["decode", "engine", "kv_cache"]
        assert r["ledger/kv_cache_k3"] > 1e-4 > r["ledger/engine_k3"]
        assert sum(r[f"ledger/{t}_k1"] for t in ("decode", "engine", "kv_cache")) == pytest.approx(
            r["ledger/total_k1"], rel=1e-4, abs=1e-9)
    aware = _fit(tmp_path, "aware", char_reward + ["train.kv_cache_aware=true"])
    for r in aware:
        assert "ledger/kv_cache_k1" not in r and r["mismatch/k3"] < 1e-3 * min(x["ledger/kv_cache_k3"] for x in rows)


def test_the_probe_adds_a_row_per_cache_and_scores_it_with_and_without_the_replay():
    from unison.probe import ProbeConfig, run_probe

    out = run_probe(ProbeConfig(precisions=["fp32"], kv_caches=["auto", "fp8_e4m3"], n=2, max_new_tokens=24,
                                quantization_aware=True, ledger=True), log=lambda m: None)
    rows = {(r["kv_cache"], r["quantization_aware"]): r for r in out["results"]}
    assert sorted(rows) == [("auto", False), ("fp8_e4m3", False), ("fp8_e4m3", True)]
    plain, replayed = rows["fp8_e4m3", False], rows["fp8_e4m3", True]
    assert plain["mismatch/k3"] > 1e-4 and replayed["mismatch/k3"] < 1e-3 * plain["mismatch/k3"]
    assert plain["ledger/kv_cache_k3"] == pytest.approx(plain["mismatch/k3"], rel=0.05)
    assert "ledger/kv_cache_k3" not in rows["auto", False]
