"""``unison probe --locate`` (unison/locate.py): where the engine and the learner first part."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from unison.sides import Side

from unison import locate
from unison.batch import collate
from unison.errors import UnisonError
from unison import zoo
from unison.learner import Learner
from unison.rollout import SamplingParams, generate, make_engine


def test_compare_on_hand_numbers():
    """No layers: embed, norm, head. embed differs by 0.5 in one of (3, 4): relative error 0.5 / 5 = 0.1; norm
    agrees; the head: μ = (0.75, 0.25) against π = (0.5, 0.5): KL(μ‖π) = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.130812 and
    the probabilities' relative error ‖(0.25, −0.25)‖ / ‖(0.5, 0.5)‖ = 0.5."""
    batch = SimpleNamespace(response_mask=torch.tensor([[0, 1]]))  # position 0 predicts the response token
    lrn = {"embed": torch.tensor([[3.0, 4.0]]), "norm": torch.tensor([[1.0, 2.0]]),
           "head": torch.tensor([[0.5, 0.5]]).log()}
    eng = {"embed": torch.tensor([[3.0, 4.5]]), "norm": torch.tensor([[1.0, 2.0]]),
           "head": torch.tensor([[0.75, 0.25]]).log()}
    out = locate.compare(eng, lrn, batch, torch.bfloat16, ["embed", "norm", "head"])
    err = {o["op"]: o["rel_error"] for o in out["ops"]}
    assert err["embed"] == pytest.approx(0.1) and err["norm"] == 0.0 and err["head"] == pytest.approx(0.5)
    assert out["rounding_line"] == 4 * 2.0 ** -8
    assert out["first_above"] == "embed"
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert out["full_kl_mean"] == pytest.approx(kl, rel=1e-6) and out["full_kl_by_position"] == pytest.approx([kl])


def test_op_names_follow_the_forward(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    ops = locate.op_names(Learner(tiny_dir).model)
    assert ops[:7] == ["embed", "L0.attn_norm", "L0.attn", "L0.mlp_norm", "L0.mlp", "L0.out", "L1.attn_norm"]
    assert ops[-3:] == ["L3.out", "norm", "head"] and len(ops) == 1 + 4 * 5 + 2
    hybrid = {arch: locate.op_names(AutoModelForCausalLM.from_pretrained(zoo.build(arch, tmp_path / arch)))
              for arch in zoo.RECURRENT}
    # Gated DeltaNet in layers 0-2: a per-head gated norm (its input flattened over heads), attention in layer 3
    assert hybrid["qwen3_next"][:9] == ["embed", "L0.attn_norm", "L0.in_proj", "L0.scan", "L0.gate", "L0.linear",
                                        "L0.mlp_norm", "L0.mlp", "L0.out"]
    assert "L3.attn" in hybrid["qwen3_next"] and "L3.scan" not in hybrid["qwen3_next"]
    assert hybrid["mamba2"] == ["embed", "L0.norm", "L0.in_proj", "L0.scan", "L0.gate", "L0.linear", "L0.out",
                                "L1.norm", "L1.in_proj", "L1.scan", "L1.gate", "L1.linear", "L1.out", "norm", "head"]
    # one block type a layer: a Mamba2 mixer, an MLP, attention, an MLP
    assert hybrid["nemotron_h"][1:8] == ["L0.norm", "L0.in_proj", "L0.scan", "L0.gate", "L0.linear", "L0.out",
                                         "L1.norm"]
    assert hybrid["nemotron_h"][8:13] == ["L1.mlp", "L1.out", "L2.norm", "L2.attn", "L2.out"]
    # attention and an SSM side by side (no gated norm by default: mamba_rms_norm false), then the MLP
    assert hybrid["falcon_h1"][1:9] == ["L0.attn_norm", "L0.attn", "L0.in_proj", "L0.gate", "L0.linear",
                                        "L0.mlp_norm", "L0.mlp", "L0.out"]


@pytest.mark.parametrize("arch", zoo.RECURRENT)
def test_a_hybrid_perturbed_input_projection_is_named(tmp_path, arch):
    """A hybrid's engine (its prefill: the chunked scan) against the learner, fp32: within the rounding line at every
    op; the engine's first input projection perturbed by 1e-3 of its scale: that op is the first above it."""
    d = zoo.build(arch, tmp_path / arch)
    engine = make_engine("native", d, torch.float32)
    batch = collate(generate(engine, [[5, 9, 11, 3, 8], [7, 2, 4]], SamplingParams(n=2, max_tokens=20, seed=0)),
                    engine.pad_id)
    learner = Learner(d)
    same = locate.locate(engine, learner, batch, 1.0, torch.float32)
    assert same["first_above"] is None
    mixer = next(m for m in engine.model.modules() if hasattr(m, "out_proj") and
                 (hasattr(m, "in_proj") or hasattr(m, "in_proj_qkvz")))
    w = (getattr(mixer, "in_proj", None) or mixer.in_proj_qkvz).weight
    with torch.no_grad():
        w.add_(1e-3 * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    out = locate.locate(engine, learner, batch, 1.0, torch.float32)
    assert out["first_above"] == "L0.in_proj" and out["ops"][-1]["above"]


@pytest.fixture(scope="module")
def sampled(tiny_dir):
    engine = make_engine("native", tiny_dir, torch.float32, max_len=64)
    prompts = [engine.tokenizer.encode("12+34="), engine.tokenizer.encode("7+8=")]
    batch = collate(generate(engine, prompts, SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=0)),
                    engine.pad_id)
    return engine, batch


@pytest.mark.parametrize("where,op", [(lambda m: m.model.layers[2].mlp.down_proj.weight, "L2.mlp"),
                                      (lambda m: m.model.layers[1].self_attn.o_proj.weight, "L1.attn"),
                                      (lambda m: m.model.layers[3].input_layernorm.weight, "L3.attn_norm")])
def test_a_perturbed_layer_is_named(tiny_dir, sampled, where, op):
    """fp32 on both sides agrees exactly on the tiny model; one weight of the engine's copy perturbed by 1e-3 of
    its scale: every op before it stays within the rounding line, the perturbed op is the first above it, and the
    error reaches the head."""
    engine, batch = sampled
    learner = Learner(tiny_dir)
    w = where(engine.model)
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(1e-3 * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
        out = locate.locate(engine, learner, batch, 1.0, torch.float32)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    names = [o["op"] for o in out["ops"]]
    assert out["first_above"] == op
    before = out["ops"][:names.index(op)]
    assert all(o["rel_error"] <= out["rounding_line"] for o in before)
    assert out["ops"][-1]["above"] and out["full_kl_mean"] > 0


def test_unperturbed_fp32_is_exact_and_bf16_parts_later(tiny_dir, sampled):
    engine, batch = sampled
    learner = Learner(tiny_dir)
    same = locate.locate(engine, learner, batch, 1.0, torch.float32)
    assert same["first_above"] is None and all(o["rel_error"] == 0.0 for o in same["ops"])
    assert same["full_kl_mean"] == 0.0
    bf = make_engine("native", tiny_dir, torch.bfloat16, max_len=64)
    with learner.as_side(Side(dtype=torch.bfloat16)):
        out = locate.locate(bf, learner, batch, 1.0, torch.bfloat16)
    err = {o["op"]: o["rel_error"] for o in out["ops"]}
    assert 0 < err["embed"] <= 2.0 ** -8  # the embedding table rounded to bf16: at most one rounding
    assert out["full_kl_mean"] > 0 and len(out["full_kl_by_position"]) == int(batch.response_lens.max())


def test_refuses_what_it_cannot_read():
    with pytest.raises(UnisonError, match="dense Llama-family decoder"):
        locate.check_locatable(SimpleNamespace(model=SimpleNamespace(), config=SimpleNamespace(model_type="gpt2")))
    with pytest.raises(UnisonError, match="only the native engine"):
        locate.engine_trace(SimpleNamespace(name="vllm"), None, 1.0)


def test_probe_locate_writes_table_and_plot(tmp_path, tiny_dir):
    from unison.cli import main

    out = tmp_path / "p"
    assert main(["probe", "--precision", "fp32", "--quantization", "none,int4", "--locate", "--locate-rows", "2",
                 "--n", "1", "--max-new-tokens", "12", "--out", str(out)]) == 0
    results = json.loads((out / "probe.json").read_text())["results"]
    located = {(r["precision"], r["quantization"]): r["locate"] for r in results}
    assert located[("fp32", "none")]["first_above"] is None
    assert located[("fp32", "int4")]["first_above"] == "L0.attn"  # the first quantized linear layer's output
    md = (out / "locate.md").read_text()
    assert "| first op above | none | L0.attn |" in md
    assert (out / "plots" / "locate.png").stat().st_size > 10_000
