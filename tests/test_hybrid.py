"""Hybrid and state-space models (issue 54): a tiny random qwen3_next (Gated DeltaNet layers 0-2, gated attention in
layer 3) and mamba2 decoded by the native engine's generic path with the model's own recurrent state per row, scored
by the learner's chunked scan, trained, resumed, probed."""

import pytest
import torch

from unison.batch import collate
from unison.config import load_config
from unison.data_io import read_metrics
from unison.learner import Learner
from unison.policy import ScoringOptions
from unison.rollout import SamplingParams, make_engine
from unison.rollout.native import _GenericBackend
from unison.sides import Side
from unison.trainer import Trainer
from unison.zoo import RECURRENT, build


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    return {arch: build(arch, root / arch) for arch in RECURRENT}


PROMPTS = [[5, 9, 11, 3, 8, 8, 1, 4], [7, 2], [4, 4, 4, 6]]


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_left_padded_batch_decodes_each_row_as_alone_and_as_the_learner_scores_it(hybrids, arch):
    """Rows of different prompt lengths (left padding through the recurrent and convolution states) and rows that
    finish early (leaving the batch: the states' rows selected): each row samples the tokens it samples alone, its
    log μ to fp32 rounding, and the learner's chunked forward agrees with the recurrent decode to fp32 rounding."""
    eng = make_engine("native", hybrids[arch], torch.float32)
    params = SamplingParams(n=2, max_tokens=40, seed=7)
    batch_rows = eng.generate(PROMPTS, params)
    assert {c.finish_reason for c in batch_rows} == {"stop", "length"}  # some rows left the batch mid-way
    alone = eng.generate(PROMPTS[:1], params)  # seeds go by prompt index: prompt 0 alone draws as in the batch
    for a, b in zip(alone, batch_rows[:2]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    batch = collate(batch_rows, eng.pad_id)
    m = batch.response_mask.bool()
    learner = Learner(hybrids[arch], options=ScoringOptions(packing=True))
    assert learner.packing_note.startswith("off:")  # a state would run on from one packed response to the next
    assert float((learner.score(batch) - batch.logp_mu)[m].abs().max()) < 1e-4
    assert float((eng.score(batch, params) - batch.logp_mu)[m].abs().max()) < 1e-4  # the ledger's decode pass


BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=8",
        "train.prompts_per_step=4", "train.micro_batch_size=8", "train.lr=3e-3", "log.console=false",
        "log.tensorboard=false", "mismatch.decompose_every=1", "checkpoint.every=1"]


def _fit(run, sets, resume=False):
    Trainer(load_config(None, BASE + sets), run, log=lambda m: None, resume=resume).fit()
    return read_metrics(run / "metrics.jsonl")


@pytest.mark.parametrize("arch", [  # Nemotron-H's Mamba2 mixers stand for Mamba2 and Falcon-H1's in the default suite
    a if a in ("qwen3_next", "nemotron_h") else pytest.param(a, marks=pytest.mark.slow) for a in RECURRENT])
def test_grpo_trains_resumes_bit_for_bit_and_the_ledger_adds_up(tmp_path, hybrids, char_reward, arch):
    sets = char_reward + [f"model={hybrids[arch]}"]
    whole = _fit(tmp_path / "whole", sets + ["train.steps=3"])
    assert whole[-1]["optim/grad_norm"] > 0
    for r in whole:  # fp32 both sides: decode, engine — and the chain adds up
        assert r["ledger/decode_k3"] < 1e-9 and r["ledger/engine_k3"] < 1e-9
        assert r["ledger/decode_k1"] + r["ledger/engine_k1"] == pytest.approx(r["ledger/total_k1"], abs=1e-9)
    _fit(tmp_path / "cut", sets + ["train.steps=2"])
    resumed = _fit(tmp_path / "cut", sets + ["train.steps=3"], resume=True)
    assert resumed[-1]["policy/loss"] == whole[-1]["policy/loss"] and resumed[-1]["reward/mean"] == whole[-1]["reward/mean"]


@pytest.mark.parametrize("arch,targets", [("qwen3_next", "all-linear"), ("nemotron_h", "[in_proj,q_proj,down_proj]"),
                                          ("falcon_h1", "[in_proj,q_proj,down_proj]")])
def test_lora_trains_on_a_hybrid(tmp_path, hybrids, char_reward, arch, targets):
    """(On the Mamba2 mixers PEFT refuses the default all-linear targets — their out_proj and conv1d: one line,
    test_bad_inputs; named Linear targets train.)"""
    rows = _fit(tmp_path / "lora", char_reward + [f"model={hybrids[arch]}", "train.steps=2", "lora.rank=4",
                                                  f"lora.target_modules={targets}"])
    assert len(rows) == 2 and rows[-1]["optim/grad_norm"] > 0


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_model_state_is_the_compute_dtype_after_every_step_and_fp32_is_left_alone(hybrids, arch):
    """rollout.state_dtype=model: after the prefill and after each decode step every recurrent state the cache holds
    is exactly representable in bf16 (rounded as a bf16 cache would hold it); with fp32 (the default) it is not, so
    the check can fail. In an fp32 run ``model`` is a no-op."""
    assert not Side(dtype=torch.float32, state="model").rounds_state
    ids = torch.tensor([[5, 9, 11, 3, 8, 8, 1, 4], [0, 0, 0, 0, 7, 2, 6, 6]])
    key_ok = torch.ones_like(ids, dtype=torch.bool)
    key_ok[1, :4] = False
    pos = (key_ok.cumsum(-1) - 1).clamp(min=0)
    held = {}
    for state in ("fp32", "model"):
        eng = make_engine("native", hybrids[arch], Side(dtype=torch.bfloat16, state=state))
        backend = _GenericBackend(eng, 2, ids.shape[1], 4)
        backend.prefill(ids, key_ok, pos)
        for t in range(3):
            backend.step(torch.tensor([3, 4]), pos[:, -1] + 1 + t, t)
        states = [s for layer in backend.cache.layers for s in getattr(layer, "recurrent_states", {}).values()
                  if s is not None]
        assert states and all(s.dtype == torch.float32 for s in states)  # the reference kernels keep fp32
        held[state] = all(torch.equal(s, s.to(torch.bfloat16).float()) for s in states)
    assert held == {"fp32": False, "model": True}
