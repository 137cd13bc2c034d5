"""Low-precision rollout (issue 19): weight-only quantization of the rollout engine, checked against
hand-computed values, and its wiring into the engine, the probe, the trainer and the sanity test."""

import pytest
import torch

from unison.config import load_config
from unison.errors import UnisonError
from unison.learner import Learner
from unison.mismatch import seq_rho_over_fraction, token_rho_outside_fraction
from unison.quant import fake_quantize, quantization_warning, quantize, targets
from unison.rollout import SamplingParams, make_engine
from unison.sync import sync
from unison.sides import Side


# ------------------------------------------------------------------ formats, by hand
def test_int8_per_output_channel_by_hand():
    w = torch.tensor([[1.27, -0.63, 0.10, 0.0], [0.0, 2.54, -1.0, 0.5]])
    q = quantize(w, "int8")
    # row 0: s = 1.27/127 = 0.01 -> codes 127, -63, 10, 0; row 1: s = 2.54/127 = 0.02 -> 0, 127, -50, 25
    assert q.codes.dtype == torch.int8
    assert q.codes.tolist() == [[127, -63, 10, 0], [0, 127, -50, 25]]
    assert torch.allclose(q.scale.flatten(), torch.tensor([0.01, 0.02]))
    assert torch.allclose(q.dequantize(), torch.tensor([[1.27, -0.63, 0.10, 0.0], [0.0, 2.54, -1.0, 0.5]]), atol=1e-6)


def test_fp8_e4m3_per_output_channel_by_hand():
    w = torch.tensor([[448.0, -3.3, 0.3, 17.5], [2.0, 0.5, -1.0, 0.01]])
    q = quantize(w, "fp8")
    assert q.codes.dtype == torch.float8_e4m3fn
    # row 0: s = 1. e4m3 has 3 mantissa bits: 3.3 -> 3.25 (step 0.25 in [2, 4)), 0.3 -> 0.3125 (step 1/32),
    # 17.5 -> 18 (step 2 in [16, 32))
    assert q.codes.float()[0].tolist() == [448.0, -3.25, 0.3125, 18.0]
    # row 1: s = 2/448; codes 448, 112, -224 exactly and 0.01·224 = 2.24 -> 2.25
    assert q.codes.float()[1].tolist() == [448.0, 112.0, -224.0, 2.25]
    deq = q.dequantize()
    assert torch.allclose(deq[0], torch.tensor([448.0, -3.25, 0.3125, 18.0]))
    assert torch.allclose(deq[1], torch.tensor([2.0, 0.5, -1.0, 2.25 / 224]), atol=1e-7)


def test_int4_groups_by_hand():
    w = torch.tensor([[0.7, -0.36, 1.4, 0.2], [-0.07, 0.0, 0.0, 0.0]])
    q = quantize(w, "int4", group_size=2)
    # groups of 2 input columns: row 0 s = 0.1 (codes 7, -4) and 0.2 (7, 1); row 1 s = 0.01 (-7, 0), zeros -> s = 1
    assert q.codes.tolist() == [[[7, -4], [7, 1]], [[-7, 0], [0, 0]]]
    assert torch.allclose(q.scale.flatten(), torch.tensor([0.1, 0.2, 0.01, 1.0]))
    assert torch.allclose(q.dequantize(), torch.tensor([[0.7, -0.4, 1.4, 0.2], [-0.07, 0.0, 0.0, 0.0]]), atol=1e-6)


def test_e2m1_rounding_by_hand():
    """e2m1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6: nearest, ties to the even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at ±6, the sign kept."""
    from unison.quant import round_e2m1

    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.8, 2.6, 5.1, 7.0, -0.3, -5.0, -9.0, 0.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 1.0, 3.0, 6.0, 6.0, -0.5, -4.0, -6.0, 0.0]
    assert round_e2m1(x).tolist() == want


def _row(head, n=32):
    return torch.tensor(head + [0.0] * (n - len(head)))


def test_mxfp4_blocks_of_32_with_power_of_two_scales_by_hand():
    """OCP MX: scale 2^(floor(log2 amax) − 2) per block of 32. Row 0: amax 5.9 -> 2^(2−2) = 1, elements rounded as
    e2m1. Row 1: amax 0.7 -> 2^(−1−2) = 1/8: 0.7·8 = 5.6 -> 6 (0.75), 0.35·8 = 2.8 -> 3 (0.375), −0.1·8 -> −1.
    Row 2: amax 7.5 -> scale 2^(2−2) = 1, and 7.5 saturates to 6 (the spec's floor rule clips a block's top)."""
    w = torch.stack([_row([3.0, -1.1, 0.8, 0.26, 5.9, 0.25, 2.5, 5.0]), _row([0.7, 0.35, -0.1]), _row([7.5, 1.0])])
    q = quantize(w, "mxfp4")
    assert q.scale.flatten().tolist() == [1.0, 0.125, 1.0]
    assert q.codes[0, 0, :8].tolist() == [3.0, -1.0, 1.0, 0.5, 6.0, 0.0, 2.0, 4.0]
    assert q.codes[1, 0, :3].tolist() == [6.0, 3.0, -1.0]
    assert q.codes[2, 0, :2].tolist() == [6.0, 1.0]
    deq = q.dequantize()
    assert deq.shape == w.shape and deq[1, :3].tolist() == [0.75, 0.375, -0.125] and deq[2, 0] == 6.0


def test_mxfp8_blocks_of_32_with_power_of_two_scales_by_hand():
    """scale 2^(floor(log2 amax) − 8): amax 1.0 -> 2^−8; 0.3·256 = 76.8 -> 80 (e4m3 step 8 in [64, 128)), −0.01·256
    = −2.56 -> −2.5 (step 0.25 in [2, 4)); amax 1.9 -> 2^−8 too, and 1.9·256 = 486.4 saturates at 448 (1.75)."""
    w = torch.stack([_row([1.0, 0.3, -0.01]), _row([1.9, 0.5])])
    q = quantize(w, "mxfp8")
    assert q.codes.dtype == torch.float8_e4m3fn and q.scale.flatten().tolist() == [2.0 ** -8, 2.0 ** -8]
    assert q.codes.float()[0, 0, :3].tolist() == [256.0, 80.0, -2.5] and q.codes.float()[1, 0, :2].tolist() == [448.0, 128.0]
    assert q.dequantize()[0, :3].tolist() == [1.0, 0.3125, -2.5 / 256] and q.dequantize()[1, 0] == 1.75


def test_nvfp4_blocks_of_16_with_e4m3_scales_under_a_tensor_scale_by_hand():
    """Tensor scale g = amax / (6·448) = 6 / 2688 = 1/448. Block 0 (amax 6): e4m3(6/6/g) = 448 -> scale 448·g = 1.
    Block 1 (amax 0.3): 0.3/6/g = 22.4 -> e4m3 22 (step 2 in [16, 32)) -> scale 22/448; 0.3/(22/448) = 6.11 -> 6,
    0.1 -> 2.04 -> 2, −0.05 -> −1.02 -> −1. A block whose e4m3 scale underflows (amax 1e-6: 1e-6/6·448 = 7.5e-5,
    below e4m3's smallest 2^−9) holds zeros."""
    w = torch.cat([_row([6.0, 2.9, -0.7], 16), _row([0.3, 0.1, -0.05], 16), _row([1e-6], 16)]).unsqueeze(0)
    q = quantize(w, "nvfp4")
    assert q.codes.shape == (1, 3, 16)
    assert q.scale.flatten()[:2].tolist() == pytest.approx([1.0, 22 / 448], rel=1e-6)
    assert q.codes[0, 0, :3].tolist() == [6.0, 3.0, -0.5] and q.codes[0, 1, :3].tolist() == [6.0, 2.0, -1.0]
    assert q.codes[0, 2].abs().sum() == 0
    deq = q.dequantize()[0]
    assert deq[16:19].tolist() == pytest.approx([6 * 22 / 448, 2 * 22 / 448, -22 / 448], rel=1e-6)
    assert deq[32:].abs().sum() == 0


def test_w8a8_activations_per_token_by_hand():
    """Per token (row), s = max|x| / qmax. int8: row 0 s = 1/127: −0.5·127 = −63.5 -> −64 (ties to even), 0.3·127 =
    38.1 -> 38; row 1 s = 254/127 = 2: 1/2 = 0.5 -> 0, −0.7/2 -> 0. e4m3: row 0 s = 1/448: −0.5 -> −224 exactly, 0.3 ->
    134.4 -> 128 (step 16 in [128, 256)); row 1 s = 254/448: 1 -> 1.764 -> 1.75 (step 1/8), −0.7 -> −1.235 -> −1.25.
    A row of zeros stays zeros; the weights are fp8 / int8 per output channel."""
    from unison.quant import quantize_activation

    x = torch.tensor([[1.0, -0.5, 0.3, 0.0], [254.0, 1.0, -0.7, 0.0], [0.0, 0.0, 0.0, 0.0]])
    i8 = quantize_activation(x, "w8a8_int8")
    assert i8[0].tolist() == pytest.approx([1.0, -64 / 127, 38 / 127, 0.0], rel=1e-6)
    assert i8[1].tolist() == [254.0, 0.0, 0.0, 0.0] and i8[2].abs().sum() == 0
    f8 = quantize_activation(x, "w8a8_fp8")
    assert f8[0].tolist() == pytest.approx([1.0, -0.5, 128 / 448, 0.0], rel=1e-6)
    assert f8[1].tolist() == pytest.approx([254.0, 1.75 * 254 / 448, -1.25 * 254 / 448, 0.0], rel=1e-6)
    assert quantize_activation(x.to(torch.bfloat16), "w8a8_fp8").dtype == torch.bfloat16
    w = torch.randn(3, 8)
    assert torch.equal(fake_quantize(w, "w8a8_fp8", torch.float32), fake_quantize(w, "fp8", torch.float32))
    assert torch.equal(fake_quantize(w, "w8a8_int8", torch.float32), fake_quantize(w, "int8", torch.float32))


@pytest.mark.parametrize("fmt", ["w8a8_fp8", "w8a8_int8"])
def test_w8a8_learner_is_the_quantized_model_with_quantized_inputs(tiny_dir, fmt):
    """The quantization-aware learner under W8A8 computes exactly what a model holding the quantized weights, with
    every quantized layer's input quantized per token, computes (the same forward, bit for bit); switched off, the
    plain learner's."""
    from unison.logprobs import token_logprobs
    from unison.quant import quantize_activation

    qat, ref, plain = Learner(tiny_dir, Side(quantization=fmt)), Learner(tiny_dir), Learner(tiny_dir)
    quant = {t.name: t.in_dim for t in targets(ref.model)}
    modules = dict(ref.model.named_modules())
    with torch.no_grad():
        for name, p in ref.model.named_parameters():
            if name in quant:
                p.copy_(fake_quantize(p, fmt, torch.float32, quant[name]))
    for owner in {n.rsplit(".", 1)[0] for n in quant}:
        modules[owner].register_forward_pre_hook(lambda m, a: (quantize_activation(a[0], fmt), *a[1:]))
    tokens = torch.randint(0, 60, (2, 12))
    mask = torch.ones_like(tokens)
    pos = torch.zeros_like(tokens, dtype=torch.bool)
    pos[:, 6:] = True
    with torch.no_grad():
        got = token_logprobs(qat.forward_module, tokens, mask, positions=pos)
        want = token_logprobs(ref.forward_module, tokens, mask, positions=pos)
        with qat.qat.set(False):
            off = token_logprobs(qat.forward_module, tokens, mask, positions=pos)
        base = token_logprobs(plain.forward_module, tokens, mask, positions=pos)
    assert torch.equal(got, want) and torch.equal(off, base) and not torch.equal(got, base)


def test_w8a8_engine_and_its_quantization_aware_learner(tiny_dir):
    """W8A8 in the engine (its fused fast path quantizes each product's input) against the learner: the
    quantization-aware learner removes most of the mismatch — measured (tiny model, fp32, --n 8, 128 tokens):
    w8a8_fp8 k3 0.027 -> 2.6e-4, w8a8_int8 2.3e-3 -> 5.3e-5 — but not all of it: the two sides' fp32 kernels differ
    by rounding, an activation that lands on the other side of a rounding boundary moves by a whole step, and its
    token's K/V carry that to every later token (docs/quantized-rollout.md)."""
    from unison.probe import ProbeConfig, run_probe

    out = run_probe(ProbeConfig(precisions=["fp32"], quantizations=["w8a8_int8"], n=4, max_new_tokens=32,
                                quantization_aware=True), log=lambda m: None)
    rows = {bool(r.get("quantization_aware")): r["mismatch/k3"] for r in out["results"] if r["quantization"] != "none"}
    assert rows[False] > 10 * rows[True] > 0


def test_w8a8_is_refused_with_exact_mode_and_for_expert_tensors(tmp_path, tiny_dir):
    from unison import zoo
    from unison.quant import check_targets

    with pytest.raises(UnisonError, match="quantizes activations too"):
        _train(tmp_path, "rollout.quantization=w8a8_fp8", "exact=true", "train.quantization_aware=true")
    assert not (tmp_path / "run").exists()
    moe_dir = zoo.build("qwen3_moe", tmp_path / "moe")
    from unison.models import load_model

    with pytest.raises(UnisonError, match="expert tensor: use int8 \\(weight-only\\)"):
        check_targets(load_model(moe_dir), "w8a8_int8", 64)


@pytest.mark.parametrize("fmt,block", [("mxfp8", 32), ("mxfp4", 32), ("nvfp4", 16)])
def test_block_formats_refuse_an_input_dimension_their_block_does_not_divide(fmt, block):
    with pytest.raises(UnisonError, match=f"{fmt} groups of {block} do not divide an input dimension of 24"):
        quantize(torch.ones(2, 24), fmt)


def test_input_dimension_first_layout_and_dtype():
    """GPT-2's Conv1D stores [in, out]: the scale is per output column."""
    w = torch.tensor([[1.27, 0.0], [-0.63, 2.54]])  # columns are output channels
    assert torch.allclose(fake_quantize(w, "int8", torch.float32, in_dim=0),
                          fake_quantize(w.t(), "int8", torch.float32).t())
    assert fake_quantize(w, "int8", torch.bfloat16, in_dim=0).dtype == torch.bfloat16


def test_clip_fraction_metrics_by_hand():
    lp_mu = torch.zeros(2, 4)
    # log ρ per token: row 0 [0.8, -0.8, 0.1, pad]; row 1 [2.0, 1.0, 0, 0] (ρ(y) = e^3 > 10)
    lp_pi = torch.tensor([[0.8, -0.8, 0.1, 9.0], [2.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    # outside [0.5, 2] (|log ρ| > log 2 = 0.693): 0.8, -0.8, 2.0, 1.0 -> 4 of 7 tokens
    assert float(token_rho_outside_fraction(lp_pi, lp_mu, mask)) == pytest.approx(4 / 7)
    # sequence log-ratios 0.1 and 3.0: only the second exceeds log 10 = 2.303
    assert float(seq_rho_over_fraction(lp_pi, lp_mu, mask)) == pytest.approx(0.5)


# ------------------------------------------------------------------ what is quantized
def test_targets_leave_embeddings_head_norms_and_routers_alone(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from unison.zoo import build

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    names = {t.name for t in targets(model)}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.3.mlp.down_proj.weight" in names
    assert len(names) == 4 * 7  # q k v o gate up down in each of 4 layers
    assert not any(k in n for n in names for k in ("embed", "lm_head", "norm", "bias"))
    moe = AutoModelForCausalLM.from_pretrained(build("qwen3_moe", tmp_path / "moe"))
    mnames = {t.name for t in targets(moe)}
    assert "model.layers.0.mlp.experts.gate_up_proj" in mnames  # experts as 3-D tensors
    assert not any(".mlp.gate." in n for n in mnames)  # the router stays in the compute dtype
    gpt2 = AutoModelForCausalLM.from_pretrained(build("gpt2", tmp_path / "gpt2"))
    assert {t.in_dim for t in targets(gpt2)} == {0}  # Conv1D: [in, out]


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "mxfp8", "mxfp4", "nvfp4", "w8a8_fp8", "w8a8_int8"])
def test_engine_holds_quantize_of_the_learner_after_every_sync(tiny_dir, fmt):
    engine = make_engine("native", tiny_dir, Side(dtype=torch.bfloat16, quantization=fmt))
    learner = Learner(tiny_dir)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sync(engine, learner)
    quant = {t.name: t.in_dim for t in targets(learner.model)}
    eng = dict(engine.model.named_parameters())
    for name, w in learner.model.named_parameters():
        want = fake_quantize(w, fmt, torch.bfloat16, quant[name]) if name in quant else w.detach().to(torch.bfloat16)
        assert torch.equal(eng[name], want), name
    assert not torch.equal(eng["model.layers.0.mlp.up_proj.weight"],
                           learner.model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16))


def test_quantization_none_holds_the_learner_weights_bit_for_bit(tiny_dir):
    engine = make_engine("native", tiny_dir, Side())
    learner = Learner(tiny_dir)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sync(engine, learner)
    eng = dict(engine.model.named_parameters())
    assert all(torch.equal(eng[n], w) for n, w in learner.model.named_parameters())
    # and the probe's fp32 row is rounding-level, as before quantization existed
    ids = [engine.tokenizer("12+35=")["input_ids"]]
    comps = engine.generate(ids, SamplingParams(n=4, max_tokens=16, seed=1))
    from unison.batch import collate
    from unison.mismatch import k3

    b = collate(comps, engine.pad_id)
    assert float(k3(learner.score(b), b.logp_mu, b.response_mask)) < 1e-10


def test_probe_rows_per_quantization_are_ordered(tiny_dir, tmp_path):
    from unison.probe import ProbeConfig, run_probe

    out = run_probe(ProbeConfig(precisions=["fp32"], quantizations=["none", "int8", "int4"], n=4,
                                max_new_tokens=32), log=lambda m: None)
    rows = {r["quantization"]: r for r in out["results"]}
    assert set(rows) == {"none", "int8", "int4"}
    assert rows["none"]["mismatch/k3"] < 1e-9 < rows["int8"]["mismatch/k3"] < rows["int4"]["mismatch/k3"]
    assert rows["int4"]["mismatch/token_rho_outside_fraction"] > rows["none"]["mismatch/token_rho_outside_fraction"] == 0


def test_probe_rows_of_the_block_formats(tiny_dir, tmp_path):
    """The 8-bit block format is far closer to the learner than the 4-bit ones (tiny model, fp32: mxfp8 k3 2.1e-2,
    nvfp4 0.159, mxfp4 0.225 at --n 8 --max-new-tokens 128), and every start-up warning can cite its figure."""
    from unison.algorithms.presets import resolve_policy
    from unison.config import PolicyConfig
    from unison.probe import ProbeConfig, run_probe

    out = run_probe(ProbeConfig(precisions=["fp32"], quantizations=["none", "mxfp8", "mxfp4", "nvfp4"], n=4,
                                max_new_tokens=32), log=lambda m: None)
    k3 = {r["quantization"]: r["mismatch/k3"] for r in out["results"]}
    assert k3["none"] < 1e-9 < k3["mxfp8"] < min(k3["mxfp4"], k3["nvfp4"]) / 3
    for fmt in ("mxfp8", "mxfp4", "nvfp4"):
        assert "on the built-in tiny model" in quantization_warning(fmt, resolve_policy("grpo", PolicyConfig()))


# ------------------------------------------------------------------ bad input: one line, nothing written
def _train(tmp_path, *sets):
    from unison.trainer import Trainer

    cfg = load_config(None, ["train.steps=1", "log.console=false", "log.tensorboard=false", *sets])
    return Trainer(cfg, tmp_path / "run", log=lambda m: None)


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(UnisonError, match="rollout.quantization"):
        load_config(None, ["rollout.quantization=fp4"])
    assert not (tmp_path / "run").exists()


def test_int4_group_that_does_not_divide_is_refused_before_writing(tmp_path):
    with pytest.raises(UnisonError, match="quant_group_size to a divisor of 128"):
        _train(tmp_path, "rollout.quantization=int4", "rollout.quant_group_size=48")
    assert not (tmp_path / "run").exists()


def test_quantization_with_exact_mode_is_refused(tmp_path):
    with pytest.raises(UnisonError, match="exact mode needs the engine to hold the learner's weights"):
        _train(tmp_path, "rollout.quantization=int8", "exact=true")
    assert not (tmp_path / "run").exists()


def test_fp8_without_float8_dtypes_is_refused(tmp_path, monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(UnisonError, match="float8 dtypes"):
        _train(tmp_path, "rollout.quantization=fp8")
    assert not (tmp_path / "run").exists()


def test_an_engine_that_cannot_quantize_is_refused(tmp_path):
    from unison.probe import ProbeConfig, validate

    with pytest.raises(UnisonError, match="native engine"):
        validate(ProbeConfig(engines=["vllm"], quantizations=["int8"]))


def test_uncorrected_quantized_rollout_warns_once_and_corrections_silence_it():
    from unison.algorithms.presets import resolve_policy
    from unison.config import PolicyConfig

    grpo = resolve_policy("grpo", PolicyConfig())
    msg = quantization_warning("int4", grpo)
    assert msg and "policy.correction=none" in msg and "grpo_token_tis" in msg
    assert quantization_warning("none", grpo) is None
    assert quantization_warning("int4", resolve_policy("grpo_token_tis", PolicyConfig())) is None
    assert quantization_warning("int4", resolve_policy("pg_seq_mis", PolicyConfig())) is None
