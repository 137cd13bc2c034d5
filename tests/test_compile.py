"""Compilation (unison/compilation.py), the engine's pre-packed products (unison/gemm.py, unison/rollout/decode.py)
and the allocator (unison/runtime.py): the settings and their refusals, auto's rule on hand numbers and its kept
measurements, the ledger's compile term by hand — without compiling (the default suite); then, behind the
``compile`` marker (``make test-compile``, in CI), real compiles: the same tokens as eager at temperature 0 and
log-probs within fp32 rounding, no recompiles as batches change, a run's time/compile_s and compile term."""

import contextlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from unison import compilation, gemm, ledger, runtime
from unison.batch import Completion, collate
from unison.config import load_config
from unison.errors import UnisonError
from unison.models import resolve_model_dir
from unison.sides import Side

needs_onednn = pytest.mark.skipif(not gemm.onednn_available(), reason="this torch has no oneDNN")
SHAPE = compilation.RunShape(steps=30, rows=32, new_tokens=128, prompt_tokens=30, micro_batches=6, micro_tokens=512)


# ----------------------------------------------------------------------------- settings
def test_compile_values_and_one_line_refusals():
    assert load_config(None, []).compile == "auto"
    assert load_config(None, ["compile=measure"]).compile == "measure"
    for value, want in (("ON", "on"), ("off", "off"), ("engine", "engine"), ("learner", "learner")):
        assert load_config(None, [f"compile={value}"]).compile == want
    from unison.config.values import parse_compile

    assert parse_compile(True) == "on" and parse_compile(False) == "off"
    with pytest.raises(UnisonError, match="compile 'max' is not one of auto, measure, on, off, engine, learner") as e:
        load_config(None, ["compile=max"])
    assert "\n" not in str(e.value)
    for setting in ("on", "engine", "learner"):
        with pytest.raises(UnisonError, match="exact mode shares one forward") as e:
            compilation.check(setting, exact=True, world_size=1)
        assert "\n" not in str(e.value)
        with pytest.raises(UnisonError, match="under torchrun is not supported"):
            compilation.check(setting, exact=False, world_size=2)
    compilation.check("auto", exact=True, world_size=2)  # auto decides off there: nothing to refuse
    compilation.check("off", exact=True, world_size=2)


def test_the_cli_refuses_compile_with_exact_mode_and_writes_nothing(tmp_path, capsys):
    from unison.cli import main

    out = tmp_path / "run"
    assert main(["train", "configs/tiny-fp32.yaml", "--out", str(out), "--set", "exact=true",
                 "--set", "compile=on"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exact mode shares one forward" in err[0] and "compile=off" in err[0]
    assert not out.exists()
    assert main(["probe", "--compile", "auto", "--out", str(tmp_path / "p")]) == 2
    assert "auto and measure decide for a run, not for a probe" in capsys.readouterr().err
    assert main(["probe", "--compile", "engine", "--exact", "--out", str(tmp_path / "p")]) == 2
    assert "keeps compilation out by construction" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


# ----------------------------------------------------------------------------- auto
def test_auto_on_the_tiny_model_chooses_off_without_measuring(monkeypatch):
    called = []
    monkeypatch.setattr(compilation, "measure_engine", lambda *a, **k: called.append("engine"))
    monkeypatch.setattr(compilation, "measure_learner", lambda *a, **k: called.append("learner"))
    tiny = resolve_model_dir("builtin:tiny")
    c = compilation.decide("auto", tiny, 800_000, SHAPE)
    assert (c.engine, c.learner, c.value) == (False, False, "off") and called == []
    assert "0.8M-parameter model's steps are too small for a compile to pay back" in str(c)
    for kw, why in (({"exact": True}, "exact mode keeps compilation out"), ({"world_size": 2}, "a torchrun job"),
                    ({"device": "cuda"}, "device cuda")):
        c = compilation.decide("auto", tiny, 10**9, SHAPE, **kw)
        assert c.value == "off" and why in str(c) and called == []
    c = compilation.decide("engine", tiny, 800_000, SHAPE)  # an explicit choice is taken as given
    assert (c.engine, c.learner) == (True, False) and "compile: engine" in str(c)
    c = compilation.decide("on", tiny, 800_000, SHAPE, engine_native=False)  # vLLM compiles by its own settings
    assert (c.engine, c.learner) == (False, True) and "vLLM compiles by its own settings" in str(c)


def test_the_verdict_on_hand_numbers():
    # per run step: eager 2.0 s, compiled 1.5 s (1.33x), 30 steps save 15 s against a 10 s compile: on
    on, why = compilation._verdict({"eager_s": 2.0, "compiled_s": 1.5, "compile_s": 10.0}, 30)
    assert on and "1.33x eager" in why and "15 s saved over 30 steps" in why
    # the same speed-up that cannot win back a 20 s compile: off
    assert not compilation._verdict({"eager_s": 2.0, "compiled_s": 1.5, "compile_s": 20.0}, 30)[0]
    # 1.1x saves 54 s of a 10 s compile but is under 1.2x: off
    on, why = compilation._verdict({"eager_s": 2.0, "compiled_s": 2.0 / 1.1, "compile_s": 10.0}, 300)
    assert not on and "needs 1.2x" in why
    # too short a run to be worth compiling at all
    on, why = compilation._verdict({"eager_s": 0.2, "compiled_s": None, "compile_s": None}, 30)
    assert not on and "could not win back a compile" in why


def test_measure_measures_once_per_machine_and_run_shape_and_auto_follows_it(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(compilation, "measure_engine",
                        lambda *a, **k: calls.append("engine") or {"eager_s": 3.0, "compiled_s": 2.0, "compile_s": 5.0})
    monkeypatch.setattr(compilation, "measure_learner",
                        lambda *a, **k: calls.append("learner") or {"eager_s": 3.0, "compiled_s": 2.9, "compile_s": 5.0})
    tiny, cache = resolve_model_dir("builtin:tiny"), tmp_path / "compile.json"
    # a first run under auto pays for no measurement: eager, and it says how to measure
    c = compilation.decide("auto", tiny, 10**9, SHAPE, cache=cache)
    assert (c.value, calls) == ("off", []) and "not measured on this machine" in str(c) and "compile=measure" in str(c)
    assert not cache.exists()
    c = compilation.decide("measure", tiny, 10**9, SHAPE, cache=cache)
    assert (c.engine, c.learner, c.value) == (True, False, "engine") and calls == ["engine", "learner"]
    assert "engine on (auto: 1.50x eager" in str(c) and "learner off (auto: 1.03x eager" in str(c)
    for setting in ("measure", "auto"):  # kept: auto follows it, and neither measures again
        assert compilation.decide(setting, tiny, 10**9, SHAPE, cache=cache) == c and calls == ["engine", "learner"]
    other = compilation.RunShape(30, 8, 128, 30, 6, 512)
    assert compilation.decide("auto", tiny, 10**9, other, cache=cache).value == "off" and len(calls) == 2
    compilation.decide("measure", tiny, 10**9, other, cache=cache)
    assert calls == ["engine", "learner"] * 2  # another batch: measured anew
    assert len(json.loads(cache.read_text())) == 2


def test_run_shape_from_a_config():
    cfg = load_config(None, ["train.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=128", "train.steps=30"])
    s = compilation.run_shape(cfg, [[1] * 20, [1] * 40])
    assert (s.steps, s.rows, s.new_tokens, s.prompt_tokens) == (30, 32, 128, 30)
    # 32 rows of 30 + 64 tokens under the default token budget
    assert s.micro_tokens == cfg.train.micro_batch_tokens
    assert s.micro_batches == math.ceil(32 * 94 / cfg.train.micro_batch_tokens)


# ----------------------------------------------------------------------------- the ledger's compile term
MU = [-1.0, -2.0]
EAGER = [-1.1, -2.2]      # the learner's eager forward
COMPILED = [-1.15, -2.1]  # the learner compiled


class _Learner:
    """Answers score() by whether it computes compiled now (its side), as a learner would."""

    moe, peft, sharded = False, None, False

    def __init__(self, compiled):
        self.side = Side(compiled=compiled)

    @contextlib.contextmanager
    def as_side(self, side):
        before, self.side = self.side, side
        yield self
        self.side = before

    def score(self, batch, weights=None):
        out = torch.zeros(batch.tokens.shape)
        out[0, 1:3] = torch.tensor(COMPILED if self.side.compiled else EAGER)
        return out


def test_the_compile_term_by_hand():
    """The engine compiled, the learner eager: the chain goes μ → the learner compiled (as the engine ran) →
    the learner eager (= π_old). k1 of the compile term = mean(log p_compiled − log p_eager)."""
    batch = collate([Completion([5], [7, 8], MU, "stop")], pad_id=0)
    for learner_compiled in (False, True):
        engine, lrn = Side(compiled=not learner_compiled), _Learner(compiled=learner_compiled)
        p = ledger.plan(engine, lrn.side, truncated=False, moe=False, asynchronous=False, can_rescore="no prefill",
                        can_score_old=True)
        assert p.present == ["decode", "engine", "compile"]
        final = torch.zeros(batch.tokens.shape)
        final[0, 1:3] = torch.tensor(COMPILED if learner_compiled else EAGER)
        m = ledger.Ledger(lrn, p, engine).measure(batch, final, step=0)
        first, last = (EAGER, COMPILED) if learner_compiled else (COMPILED, EAGER)
        want_engine = sum(m_ - f for m_, f in zip(MU, first)) / 2
        want_compile = sum(f - x for f, x in zip(first, last)) / 2
        assert m["ledger/engine_k1"] == pytest.approx(want_engine, abs=1e-6)
        assert m["ledger/compile_k1"] == pytest.approx(want_compile, abs=1e-6)
        assert m["ledger/engine_k1"] + m["ledger/compile_k1"] == pytest.approx(m["ledger/total_k1"], abs=1e-6)
        assert lrn.side.compiled == learner_compiled  # the learner is left as it runs
    same = ledger.plan(Side(), Side(), truncated=False, moe=False, asynchronous=False, can_rescore=None,
                       can_score_old=True)
    assert "compile" not in same.present


# ----------------------------------------------------------------------------- pre-packed products, the allocator
@needs_onednn
@pytest.mark.parametrize("rows", [2, 3, 17, 32, 100])
def test_packed_products_are_bitwise_the_unpacked_ones(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 48, generator=g), torch.randn(200, 48, generator=g), torch.randn(200, generator=g)
    p = gemm.pack(w, 32)
    assert torch.equal(gemm.packed_linear(x, p, b), gemm._onednn(x, w, b))
    x3 = x.view(1, rows, 48)  # leading dims kept
    assert torch.equal(gemm.packed_linear(x3, p), gemm._onednn(x, w, None).view(1, rows, 200))
    assert (gemm.packed_linear(x, p, b) - F.linear(x, w, b)).abs().max() <= 1e-5 * F.linear(x, w, b).abs().max()


needs_bf16 = pytest.mark.skipif(not gemm.half_kernels(torch.bfloat16), reason="no native bf16 kernels on this CPU")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_packed_bf16_products_are_bitwise_torchs_own(rows):
    """torch sends a bf16 product to oneDNN, which re-packs the weight on each call; packed once, the same bits."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(rows, 576, generator=g).bfloat16(), (0.02 * torch.randn(1536, 576, generator=g)).bfloat16(),
               torch.randn(1536, generator=g).bfloat16())
    assert torch.equal(gemm.packed_linear(x, gemm.pack(w, 32), b), F.linear(x, w, b))


@needs_bf16
def test_a_bf16_engine_packs_above_the_small_model_line_and_samples_the_same(tiny_dir, monkeypatch):
    from unison.rollout import SamplingParams, make_engine

    assert not make_engine("native", tiny_dir, torch.bfloat16).fast.packed  # the tiny model: below the line
    monkeypatch.setattr(gemm, "SMALL_MODEL", 0)
    packed = make_engine("native", tiny_dir, torch.bfloat16)
    assert packed.fast.packed and packed.fast.layers[0][0].is_mkldnn
    monkeypatch.setattr(gemm, "SMALL_MODEL", 10**12)
    plain = make_engine("native", tiny_dir, torch.bfloat16)
    assert not plain.fast.packed
    params = SamplingParams(n=3, max_tokens=10, seed=4, ignore_eos=True)
    a, b = packed.generate([[1, 5, 6, 7], [1, 8]], params), plain.generate([[1, 5, 6, 7], [1, 8]], params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b] and [c.logprobs for c in a] == [c.logprobs for c in b]


def test_gemm_names_each_role(monkeypatch):
    from unison.config.values import parse_gemm

    assert parse_gemm("blas/onednn") == "blas/onednn" and parse_gemm("onednn/onednn") == "onednn"
    assert gemm.split("blas/onednn") == ("blas", "onednn") and gemm.split("auto") == ("auto", "auto")
    with pytest.raises(UnisonError, match="or LEARNER/ENGINE"):
        parse_gemm("blas/mkl")
    monkeypatch.setattr(gemm, "measure", lambda h, i: (1.05, True))
    monkeypatch.setattr(gemm, "measure_packed", lambda h, i, rows, vocab: (1.8, True))
    monkeypatch.setattr(gemm, "onednn_available", lambda: True)
    g = gemm.decide("auto", 576, 1536, 135_000_000, decode_rows=32)
    assert (g.name, g.engine, g.value) == ("blas", "onednn", "blas/onednn")
    assert "learner blas (auto: oneDNN 1.05x BLAS" in str(g) and "engine onednn, pre-packed (auto: 1.8x BLAS at 32 rows" in str(g)
    g = gemm.decide("auto", 576, 1536, 135_000_000, engine_fp32=False)  # a bf16 engine keeps torch's path
    assert g.value == "blas" and "no fp32 decode here" in g.engine_reason
    before = gemm.current()
    try:
        gemm.use("blas/onednn")
        assert gemm.current() == "blas/onednn" and gemm.engine_choice() == "onednn"
    finally:
        gemm.use(before)


@needs_onednn
def test_an_engine_on_packed_products_samples_what_the_unpacked_one_does(tiny_dir, monkeypatch):
    """The native engine with its products packed (gemm engine onednn) against the same engine multiplying by the
    unpacked weights through the same library: the same tokens and log-probs, bit for bit."""
    from unison.rollout import SamplingParams, make_engine

    before = gemm.current()
    try:
        gemm.use("blas/onednn")
        packed = make_engine("native", tiny_dir, torch.float32)
        assert packed.fast.packed and packed.fast.layers[0][0].is_mkldnn
        with monkeypatch.context() as m:
            m.setattr(gemm, "pack", lambda w, rows: w.detach())  # oneDNN's products of the unpacked weights
            plain = make_engine("native", tiny_dir, torch.float32)
        assert not plain.fast.layers[0][0].is_mkldnn
        params = SamplingParams(n=3, max_tokens=10, seed=4, ignore_eos=True)
        a = packed.generate([[1, 5, 6, 7], [1, 8]], params)
        b = plain.generate([[1, 5, 6, 7], [1, 8]], params)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert [c.logprobs for c in a] == [c.logprobs for c in b]
        # a weight sync packs anew: the engine follows the new weights
        w = {n: t.clone() * 1.01 for n, t in packed.model.named_parameters()}
        packed.load_weights(w.items())
        plain.load_weights(w.items())
        assert packed.generate([[1, 5, 6, 7]], params)[0].logprobs != a[0].logprobs
        assert packed.generate([[1, 5, 6, 7]], params)[0].logprobs == plain.generate([[1, 5, 6, 7]], params)[0].logprobs
    finally:
        gemm.use(before)


def test_the_allocator_keeps_freed_memory_once(monkeypatch):
    import sys

    kept = runtime.keep_freed_memory()
    assert kept == sys.platform.startswith("linux") or kept is False
    assert runtime.keep_freed_memory() is kept  # once per process
    monkeypatch.setattr(runtime, "_kept", None)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own glibc settings: left alone
    assert runtime.keep_freed_memory() is True


# ----------------------------------------------------------------------------- real compiles (make test-compile)
@pytest.mark.compile
def test_a_compiled_engine_samples_what_the_eager_one_does(tiny_dir):
    from unison.rollout import SamplingParams, make_engine

    eager = make_engine("native", tiny_dir, torch.float32)
    comp = make_engine("native", tiny_dir, Side(compiled=True))
    assert comp.kernels.compiled and comp.kernels.compile_s > 0
    marks = compilation.seconds_compiling()
    prompts = [[1, 5, 6, 7, 9], [1, 8], [1, 4, 4]]
    greedy = SamplingParams(n=4, max_tokens=16, temperature=0, ignore_eos=True)
    assert [c.token_ids for c in comp.generate(prompts, greedy)] == [c.token_ids for c in eager.generate(prompts, greedy)]
    params = SamplingParams(n=4, max_tokens=16, seed=2)
    a, b = eager.generate(prompts, params), comp.generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    diff = max(abs(x - y) for c, d in zip(a, b) for x, y in zip(c.logprobs, d.logprobs))
    assert 0 < diff < 1e-4, diff  # fp32 rounding, not zero: it is a mismatch source of its own
    comp.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 5, SamplingParams(n=1, max_tokens=4))  # other batch, other widths
    assert compilation.seconds_compiling() == marks  # nothing compiled again after the warm-up


@pytest.mark.compile
def test_a_run_with_the_engine_compiled_logs_compile_time_and_the_compile_term(tmp_path):
    from unison.trainer import Trainer, read_metrics

    cfg = load_config(None, ["task.digits=1", "task.train_size=16", "task.eval_size=0", "rollout.n=4",
                             "rollout.max_new_tokens=6", "train.prompts_per_step=4", "train.steps=2",
                             "log.console=false", "log.tensorboard=false", "mismatch.decompose_every=1",
                             "compile=engine"])
    t = Trainer(cfg, tmp_path / "run", log=lambda m: None)
    t.fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # the first step carries the engine's warm-up and the ledger's first compiled learner pass; later steps only
    # what a new input kind compiles (the learner's layers met once with, once without an attention mask)
    assert rows[0]["time/compile_s"] > 2 * rows[1]["time/compile_s"] >= 0
    for r in rows:
        assert "ledger/compile_k1" in r and r["ledger/compile_k3"] < 1e-8  # fp32: rounding
        assert sum(r[f"ledger/{x}_k1"] for x in ledger.TERMS if f"ledger/{x}_k1" in r) == \
            pytest.approx(r["ledger/total_k1"], rel=1e-4, abs=1e-9)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["compile"] == "engine" and summary["compile_s_this_session"] == pytest.approx(
        sum(r["time/compile_s"] for r in rows))


@pytest.mark.compile
def test_a_compiled_learner_scores_as_the_eager_one_to_fp32_rounding(tiny_dir):
    from dataclasses import replace

    from unison.learner import Learner

    lrn = Learner(tiny_dir, Side(compiled=True))
    comps = [Completion([1, 5, 6], [7, 8, 9], [-1.0] * 3, "stop"), Completion([1, 4], [5, 6], [-1.0] * 2, "stop")]
    batch = collate(comps, pad_id=0)
    compiled = lrn.score(batch)
    with lrn.as_side(replace(lrn.side, compiled=False)):
        eager = lrn.score(batch)
    assert (compiled - eager).abs().max() < 1e-5
    assert lrn.compiled and all(layer._compiled_call_impl is not None for layer in lrn.model.model.layers)


@pytest.mark.compile
def test_measure_times_a_real_layer_eager_and_compiled(tiny_dir):
    # a run long enough that any compile could pay: both sides compile one layer and time it in alternated rounds
    long = compilation.RunShape(10**6, 4, 8, 8, 1, 64)
    for m in (compilation.measure_engine(tiny_dir, long, packed=False, rounds=2),
              compilation.measure_learner(tiny_dir, long, rounds=2)):
        assert m["eager_s"] > 0 and m["compiled_s"] > 0 and m["compile_s"] > 0
    # too short a run: nothing is compiled
    assert compilation.measure_learner(tiny_dir, compilation.RunShape(1, 4, 8, 8, 1, 64))["compiled_s"] is None
