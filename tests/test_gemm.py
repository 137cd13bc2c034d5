"""The CPU's fp32 matmul library (unison/gemm.py), the fused output layer of the learner's log-probs
(logprobs._HeadLogp), the last log-prob chunk kept rather than recomputed, and fused AdamW: what each
computes is held to the old path's numbers (fp32 rounding) or to numbers worked out by hand."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml

from unison import gemm, optim
from unison import logprobs as policy
from unison.config import load_config
from unison.errors import UnisonError
from unison.trainer import Trainer

needs_onednn = pytest.mark.skipif(not gemm.onednn_available(), reason="this torch has no oneDNN")
BASE = ["task.digits=1", "task.train_size=16", "task.eval_size=0", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.lr=1e-3", "log.console=false", "log.tensorboard=false",
        "checkpoint.every_minutes=0"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ----------------------------------------------------------------------------- the setting
def test_gemm_setting_is_auto_blas_or_onednn():
    assert load_config(None, []).gemm == "auto"
    assert load_config(None, ["gemm=oneDNN"]).gemm == "onednn"
    with pytest.raises(UnisonError, match="gemm 'mkl' is not one of auto, blas, onednn"):
        load_config(None, ["gemm=mkl"])


def test_auto_measures_only_where_the_library_can_matter(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "measure", lambda h, i: calls.append((h, i)) or (2.0, True))
    big = 135_000_000
    assert gemm.decide("auto", 576, 1536, 800_000).name == "blas"  # the tiny model: nothing measured
    assert gemm.decide("auto", 576, 1536, big, device="cuda").name == "blas"
    assert gemm.decide("auto", 576, 1536, big, world_size=2).name == "blas"
    assert gemm.decide("auto", 576, 1536, big, fp32=False).name == "blas"
    assert calls == []
    g = gemm.decide("auto", 576, 1536, big)
    assert calls == [(576, 1536)] and g.name == "onednn" and "2.0x BLAS" in str(g)
    for ratio, agree, want in ((1.05, True, "blas"), (1.1, True, "onednn"), (3.0, False, "blas")):
        monkeypatch.setattr(gemm, "measure", lambda h, i, r=ratio, a=agree: (r, a))
        assert gemm.decide("auto", 576, 1536, big).name == want, (ratio, agree)


def test_a_machine_decides_once_and_keeps_its_measurement(monkeypatch, tmp_path):
    """The measured ratio is kept per CPU, torch, threads and shape: the next decision on this machine reads it (the
    noisy timing that flipped a run between libraries is not taken again); another shape or thread count measures."""
    ratios = iter([1.5, 0.7, 0.7, 0.7])
    monkeypatch.setattr(gemm, "measure", lambda h, i: (next(ratios), True))
    monkeypatch.setattr(gemm, "measure_packed", lambda h, i, rows, vocab: (1.0, True))
    cache, big = tmp_path / "gemm.json", 135_000_000
    first = gemm.decide("auto", 576, 1536, big, cache=cache)
    assert first.name == "onednn" and first.reason == "auto: 1.5x BLAS on this CPU, measured"
    again = gemm.decide("auto", 576, 1536, big, cache=cache)  # a second run: the same choice, not 0.7's
    assert again.name == "onednn" and again.reason == f"auto: 1.5x BLAS on this CPU, measured earlier ({cache})"
    assert gemm.decide("auto", 576, 1536, big).name == "blas"  # no cache: a fresh measurement (0.7)
    assert gemm.decide("auto", 64, 128, big, cache=cache).name == "blas"  # another shape: measured (0.7)
    assert len(json.loads(cache.read_text())) == 4  # learner and engine, for each shape
    cache.write_text("{not json")  # a damaged cache costs a measurement, not the run
    assert gemm.decide("auto", 576, 1536, big, cache=cache).name == "blas"


def test_an_explicit_onednn_where_it_cannot_route_is_refused_in_one_line():
    for kw in ({"device": "cuda"}, {"world_size": 2}):
        with pytest.raises(UnisonError, match="gemm onednn routes one process's CPU matmuls") as e:
            gemm.decide("onednn", 0, 0, 0, **kw)
        assert "\n" not in str(e.value)


@needs_onednn
def test_measure_times_both_and_finds_them_agreeing():
    ratio, agree = gemm.measure(64, 128, rows=16, rounds=1)
    assert agree and math.isfinite(ratio) and ratio > 0


# ----------------------------------------------------------------------------- the oneDNN linear
@needs_onednn
@pytest.mark.parametrize("shape", [(7, 24), (2, 5, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_onednn_linear_and_its_gradients_equal_torchs_to_fp32_rounding(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    up = torch.randn(*shape[:-1], 40, generator=g)
    gemm.use("onednn")
    y = gemm.linear(x, w, b)
    assert y.grad_fn is not None and "Linear" in type(y.grad_fn).__name__  # the oneDNN function, not F.linear
    (y * up).sum().backward()
    got = [y.detach(), x.grad, w.grad] + ([b.grad] if bias else [])
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    ref_y = F.linear(x, w, b)
    (ref_y * up).sum().backward()
    ref = [ref_y.detach(), x.grad, w.grad] + ([b.grad] if bias else [])
    for a, r in zip(got, ref):
        assert a.shape == r.shape and _rel(a, r) < 1e-6


def test_blas_bf16_and_autocast_keep_torchs_own_path(monkeypatch):
    monkeypatch.setattr(gemm, "half_route", lambda dtype: False)  # a CPU with native bf16 kernels
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    gemm.use("blas")
    assert torch.equal(gemm.linear(x, w), F.linear(x, w))
    gemm.use("onednn")
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(gemm.linear(xb, wb), F.linear(xb, wb))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gemm.linear(x, w)
    assert y.dtype == torch.bfloat16


@needs_onednn
def test_apply_routes_a_models_linears_and_leaves_its_parameters(tiny_dir, monkeypatch):
    from unison.models import load_model

    monkeypatch.setattr(gemm, "half_route", lambda dtype: False)  # else apply routes half products (below)
    gemm.use("blas")
    plain = load_model(tiny_dir)
    assert all("forward" not in vars(m) for m in plain.modules())  # blas: nothing touched
    gemm.use("onednn")
    routed = load_model(tiny_dir)
    linears = [m for m in routed.modules() if type(m) is torch.nn.Linear]
    assert linears and all(vars(m).get("forward") is not None for m in linears)
    assert routed.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        a, b = routed(ids).logits, plain(ids).logits
    assert _rel(a, b) < 1e-5


# ----------------------------------------------------------------------------- half products without native kernels
@pytest.fixture()
def no_half_kernels(monkeypatch):
    """This process as on a CPU without native bf16 / fp16 kernels (AVX2-only)."""
    monkeypatch.setattr(gemm, "half_route", lambda dtype: dtype in (torch.bfloat16, torch.float16))


@pytest.mark.parametrize("dtype, small, want", [(torch.bfloat16, 2.0 ** -8, 1 + 2.0 ** -6),
                                                (torch.float16, 2.0 ** -11, 1 + 2.0 ** -9)])
def test_a_half_product_accumulates_in_fp32_and_rounds_once_by_hand(no_half_kernels, dtype, small, want):
    # 1 + 3 s in fp32 is 1 + 1.5 ulp: a tie between 1 + ulp (odd) and 1 + 2 ulp (even), so once rounded it is
    # 1 + 2 ulp. Summed in the dtype itself, each 1 + s would round back to 1 (a tie, to even).
    x = torch.tensor([[1.0, small, small, small]], dtype=dtype)
    w = torch.ones(1, 4, dtype=dtype)
    y = gemm.torch_linear(x, w)
    assert y.dtype == dtype and float(y) == want
    # a bias of -1 is added before the one rounding: 3 s exactly (rounding first, then adding it, gives 2 ulp)
    assert float(gemm.torch_linear(x, w, torch.tensor([-1.0], dtype=dtype))) == 3 * small
    with torch.autocast("cpu", dtype=dtype):  # autocast's operands: fp32 in, rounded to the dtype first
        z = gemm.torch_linear(x.float() + small / 4, w.float())
    assert z.dtype == dtype and float(z) == want
    with torch.autocast("cpu", dtype=dtype):  # an operand already in the dtype beside fp32 weights (a layer's input)
        assert float(gemm.torch_linear(x, w.float())) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_half_product_and_its_gradients_are_torchs_to_the_dtypes_rounding(no_half_kernels, dtype, autocast):
    torch.manual_seed(0)
    x0, w0, b0 = torch.randn(2, 5, 64), torch.randn(24, 64) / 8, torch.randn(24)
    cast = (lambda t: t) if autocast else (lambda t: t.to(dtype))
    grads = {}
    for name, fn in (("route", gemm.torch_linear), ("torch", F.linear)):
        x, w, b = (cast(t).clone().requires_grad_() for t in (x0, w0, b0))
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            y = fn(x, w, b)
        (y.float() * torch.linspace(-1, 1, 24)).sum().backward()
        grads[name] = (y, x.grad, w.grad, b.grad)
    for a, t in zip(*grads.values()):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert _rel(a.detach().float(), t.detach().float()) <= 2 * torch.finfo(dtype).eps  # another summation order


def test_without_native_kernels_both_engines_route_and_precision_still_orders_the_mismatch(
        no_half_kernels, tiny_dir, monkeypatch):
    from unison.batch import collate
    from unison.learner import Learner
    from unison.mismatch import mismatch_metrics
    from unison.rollout import SamplingParams, make_engine
    from unison.sides import Side

    calls = []
    real, rounded = gemm._half_product, gemm.rounded_product
    monkeypatch.setattr(gemm, "_half_product", lambda *a: calls.append(a[3]) or real(*a))
    # the engine multiplies by fp32 copies of its half weights (FastWeights.copies): the same fp32 product
    monkeypatch.setattr(gemm, "rounded_product", lambda x, w, b: calls.append(x.dtype) or rounded(x, w, b))
    learner, k3 = Learner(tiny_dir), {}
    for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]:
        engine = make_engine("native", tiny_dir, dtype)
        calls.clear()
        out = engine.generate([[3, 5, 7], [9, 4]] * 2, SamplingParams(n=2, max_tokens=32, seed=0))
        assert (calls != []) == (dtype != torch.float32) and set(calls) <= {dtype}  # the engine's products
        batch = collate(out, engine.pad_id)
        calls.clear()
        with learner.as_side(Side(dtype=dtype)):
            k3[name] = mismatch_metrics(learner.score(batch), batch.logp_mu, batch.response_mask)["mismatch/k3"]
        linears = sum(type(m) is torch.nn.Linear for m in learner.model.modules())
        assert (len(calls) >= linears) == (dtype != torch.float32) and set(calls) <= {dtype}  # every layer's
    assert k3["bf16"] > 5 * k3["fp16"] > 5 * k3["fp32"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_engines_fp32_copies_of_half_weights_sample_the_same_bits_and_follow_a_sync(no_half_kernels, tiny_dir,
                                                                                        dtype):
    from unison.rollout import SamplingParams, make_engine

    prompts, params = [[3, 5, 7], [9, 4]] * 2, SamplingParams(n=2, max_tokens=24, seed=0)
    copies, casts = make_engine("native", tiny_dir, dtype), make_engine("native", tiny_dir, dtype)
    assert copies.fast.copies and copies.fast.layers[0][0].dtype == torch.float32
    casts.fast.copies, casts.fast.product = False, gemm.plain_product(dtype)  # each product casts its half weight
    casts.fast.refresh()
    assert casts.fast.layers[0][0].dtype == dtype

    def same(a, b):
        outs = a.generate(prompts, params), b.generate(prompts, params)
        return all(x.token_ids == y.token_ids and torch.equal(torch.tensor(x.logprobs), torch.tensor(y.logprobs))
                   for x, y in zip(*outs))

    assert same(copies, casts)
    g = torch.Generator().manual_seed(1)  # a sync: the copies are taken anew
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in copies.model.named_parameters()]
    before = copies.fast.layers[0][0].clone()
    copies.load_weights(new), casts.load_weights(new)
    a = copies.model.model.layers[0].self_attn
    qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).float()
    assert not torch.equal(before, qkv) and torch.equal(copies.fast.layers[0][0], qkv) and same(copies, casts)


@needs_onednn
def test_on_onednn_the_fp32_copies_are_packed_and_round_as_the_route_does(no_half_kernels, tiny_dir):
    from unison.rollout import SamplingParams, make_engine

    gemm.use("onednn")
    try:
        e = make_engine("native", tiny_dir, torch.bfloat16)
    finally:
        gemm.use("blas")
    assert e.fast.packed and e.fast.copies and e.fast.product is gemm.packed_rounded
    a = e.model.model.layers[0].self_attn
    x = torch.randn(8, a.q_proj.weight.shape[1]).bfloat16()

    def off_route() -> float:  # the packed copy's product against the route's on the layer's current weights
        wh = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        got, route = e.fast.product(x, e.fast.layers[0][0], None).float(), gemm.torch_linear(x, wh).float()
        return ((got - route).abs().max() / route.abs().max()).item()

    assert off_route() <= 2.0 ** -7  # fp32 sums in another order, one rounding: at most about one unit apart
    g = torch.Generator().manual_seed(1)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in e.model.named_parameters()]
    e.load_weights(new)  # a sync packs the copies anew
    assert off_route() <= 2.0 ** -7
    out = e.generate([[3, 5, 7], [9, 4]], SamplingParams(n=2, max_tokens=16, seed=0))
    assert all(len(o.token_ids) == 16 or o.token_ids[-1] == e.tokenizer.eos_token_id for o in out)


# ----------------------------------------------------------------------------- a run
@needs_onednn
def test_a_run_on_onednn_trains_records_its_choice_and_resumes_with_it(tmp_path, capsys):
    cfg = load_config(None, [*BASE, "gemm=onednn", "train.steps=2"])
    messages = []
    t = Trainer(cfg, tmp_path / "run", log=messages.append)
    assert any("fp32 matmuls onednn (gemm: onednn)" in m for m in messages)
    t.fit()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["gemm"] == "onednn"
    from unison.data_io import read_metrics

    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # the engine and the learner both on oneDNN: fp32 rounding-level mismatch, as on BLAS
    assert all(r["mismatch/k3"] < 1e-9 for r in rows)
    gemm.use("blas")
    again = load_config(None, [*BASE, "gemm=auto", "train.steps=3"])  # auto on resume: the run's own choice
    messages.clear()
    Trainer(again, tmp_path / "run", resume=True, log=messages.append).fit()
    assert gemm.current() == "onednn"
    assert any("fp32 matmuls onednn (gemm: onednn)" in m for m in messages)


def test_auto_on_the_tiny_model_says_why_it_keeps_blas(tmp_path):
    messages = []
    Trainer(load_config(None, [*BASE, "train.steps=1"]), tmp_path / "run", log=messages.append)
    line = next(m for m in messages if "fp32 matmuls" in m)
    assert "fp32 matmuls blas (auto: a 0.8M-parameter model's matmuls are too small to measure)" in line, line


# ----------------------------------------------------------------------------- the fused output layer
def test_the_fused_head_gives_hand_computed_log_probs_entropy_and_gradient():
    # one row, h = [1, 0], W rows [1, 0], [0, 1], [-1, 0]  ->  z = [1, 0, -1]; target 0, temperature 1
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    h = torch.tensor([[1.0, 0.0]], requires_grad=True)
    lp, ent = policy._head_logp(h, torch.tensor([0]), head, 1.0, None, True)
    e = [math.exp(1), 1.0, math.exp(-1)]
    s = sum(e)
    p = [v / s for v in e]
    assert float(lp.detach()) == pytest.approx(1 - math.log(s), abs=1e-6)  # 0.5924
    assert float(ent.detach()) == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)  # 0.8324
    lp.sum().backward()
    # d log p_0 / dz = onehot(0) − p;  dh = (onehot − p)·W,  dW = (onehot − p)ᵀ·h
    gz = [1 - p[0], -p[1], -p[2]]
    assert h.grad[0].tolist() == pytest.approx([gz[0] - gz[2], gz[1]], abs=1e-6)
    assert head.weight.grad[:, 0].tolist() == pytest.approx(gz, abs=1e-6)
    assert head.weight.grad[:, 1].tolist() == pytest.approx([0, 0, 0], abs=1e-7)


@pytest.mark.parametrize("choice", ["blas", "onednn"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_head_equals_the_unfused_path(choice, temperature):
    if choice == "onednn" and not gemm.onednn_available():
        pytest.skip("no oneDNN")
    gemm.use(choice)
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=True)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    t, up = torch.randint(0, 50, (37,), generator=g), torch.randn(37, generator=g)
    out = []
    for transform in (None, lambda z: z):  # an identity transform takes the unfused path
        lp, ent = policy._head_logp(h, t, head, temperature, transform, True)
        (lp * up).sum().backward()
        out.append([lp.detach(), ent, h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()])
        h.grad = None
        head.zero_grad()
    for a, b in zip(*out):
        assert _rel(a, b) < 1e-6


def test_the_last_log_prob_chunk_is_kept_and_the_others_recomputed(monkeypatch, tiny_dir):
    from unison.models import load_model

    model = policy.PolicyForward(load_model(tiny_dir))
    calls = []
    real = policy._head_logp
    monkeypatch.setattr(policy, "_head_logp", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    tokens = torch.randint(3, 20, (2, 9))
    grads = {}
    for chunk in (0, 6):  # one chunk of 16 positions; chunks of 6, 6 and 4
        calls.clear()
        lp, _ = model(tokens, torch.ones_like(tokens), chunk=chunk)
        lp.sum().backward()
        grads[chunk] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        # forward: each chunk once; backward: every chunk but the last once more
        assert calls == ([16] if chunk == 0 else [6, 6, 4, 6, 6]), (chunk, calls)
    assert all(_rel(a, b) < 1e-5 for a, b in zip(grads[0], grads[6]) if b.abs().max() > 0)


# ----------------------------------------------------------------------------- the optimizer
def test_adamw_is_fused_for_plain_parameters_and_steps_as_the_loop_does():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = optim.adamw(params, lr=1e-2, weight_decay=0.1)
    loop = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True
    for _i in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, q, gr in zip(params, ref, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        fused.step()
        loop.step()
    for p, q in zip(params, ref):
        assert _rel(p.detach(), q.detach()) < 1e-6


def test_a_small_model_keeps_the_unfused_head_and_for_each_adamw(tiny_dir):
    from unison.models import load_model
    from unison.runtime import small_model
    from unison.threads import SMALL_MODEL

    tiny = load_model(tiny_dir)
    assert small_model(tiny) and not policy.PolicyForward(tiny).fused_head
    assert optim.adamw(list(tiny.parameters()), not small_model(tiny), lr=1e-3).defaults["fused"] is False
    big = torch.nn.Linear(3200, 3200)  # 10,243,200 parameters
    assert big.weight.numel() + big.bias.numel() >= SMALL_MODEL and not small_model(big)
    # the tiny model's head takes the unfused path: a transform-free call records no _HeadLogp node
    h = torch.randn(4, tiny.config.hidden_size, requires_grad=True)
    lp, _ = policy._head_logp(h, torch.tensor([1, 2, 3, 4]), tiny.get_output_embeddings(), 1.0, None, False, None,
                               False)
    assert "HeadLogp" not in type(lp.grad_fn).__name__
    lp, _ = policy._head_logp(h, torch.tensor([1, 2, 3, 4]), tiny.get_output_embeddings(), 1.0, None, False)
    assert "HeadLogp" in type(lp.grad_fn).__name__


def test_a_half_engine_on_the_route_has_its_library_decided_as_an_fp32_engines(no_half_kernels, monkeypatch):
    """Its products are fp32 ones (the fp32 copies): gemm's auto measures it as an fp32 engine; with kernels, not."""
    from unison import machine
    from unison.compilation import RunShape
    from unison.precision import Precision

    seen = []

    def fake_setup(*a, **kw):
        seen.append(kw["engine_fp32"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(machine, "setup", fake_setup)
    cfg = load_config(None, [*BASE, "precision=fp16"])
    for routes in (True, False):
        monkeypatch.setattr(gemm, "half_route", lambda dtype, r=routes: r and dtype != torch.float32)
        with pytest.raises(RuntimeError, match="stop here"):
            machine.decide(cfg, None, Precision.resolve("fp16"), RunShape(steps=2, rows=8, new_tokens=6, prompt_tokens=4, micro_batches=1, micro_tokens=64))
    assert seen == [True, False]
