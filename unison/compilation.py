"""Inductor compilation of the two engines' layers: config ``compile: auto | measure | on | off | engine | learner``.

What compiles (``torch.compile``, dynamic shapes):

* **the native engine** (its fast path: Llama, Mistral, Qwen2, Qwen3): one decoder layer,
  :func:`unison.rollout.decode.layer_forward` — one graph serves every layer (they differ in their parameters
  only), one for decode steps and one for prefills; a batch of one row runs eagerly (a size-1 graph would compile
  again mid-generation). vLLM compiles by its own settings; ``compile`` does not reach it.
* **the learner**: each decoder layer (``nn.Module.compile``), forward and backward; the output layer keeps its
  fused log-prob function (unison/policy.py).

``on`` compiles both, ``engine`` / ``learner`` one side, ``off`` neither (the quantization-aware learner, ``train.quantization_aware``, does not compile yet: refused in one
line, ``auto`` keeps it eager). A compiled side rounds differently from an
eager one (Inductor fuses and reorders elementwise work): a mismatch source of its own, measured by ``unison probe
--compile off,engine,on`` and, when the two sides differ in it, the mismatch ledger's ``compile`` term.

``auto`` (default) compiles a side only where this machine has **measured** that it pays, and never pays for a
measurement itself: a first run starts at once, eager. ``measure`` takes the measurement (once per machine, torch
version, model shape and run shape, kept in ``$UNISON_HOME/compile.json``) and then decides as ``auto``; every later
``auto`` run of that shape reads the kept measurement. The measurement times one decoder layer of the model's shape
(random weights) at the run's shapes — a decode step of the rollout batch, a forward and backward of a token-budget
micro-batch — eager against compiled in alternated rounds, and a side compiles when it is at least :data:`SPEEDUP`
× faster **and** the time it saves over the run's steps exceeds what its compilation cost. Both are ``off`` for
models under :data:`unison.threads.SMALL_MODEL` parameters (their steps are too small for a compiled layer to win
back its compile), in exact mode, torchrun jobs and off the CPU (untested there). A side whose eager time over the
whole run is too short for any compile to pay back is not compiled for the measurement. The choice and the figures
are printed at start and written to the run's ``config.yaml`` (``--resume`` keeps it).

Why ``auto`` does not measure on a first run (issue 56): a measurement compiles a layer, 17–82 s on 2 cores here
and 59 s on an AVX2 EPYC, to find that neither side reaches :data:`SPEEDUP` on SmolLM2 on either CPU kind
(benchmarks/compile_auto.py, docs/benchmarks.md). A newcomer's first run should not pay a minute for that.

Exact mode keeps compilation out by construction: its one forward is shared by the engine and the learner, and a
compiled copy on either side would round differently (``compile: on`` with ``exact: true`` is refused in one line).
Measured (SmolLM2-135M, fp32, 2 threads, AMD EPYC; docs/cpu.md): the engine's decode 1.05–1.1× with the engine's
products pre-packed (~20 s to compile), the learner's update 1.0–1.1× (~16 s): ``auto`` keeps both eager there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from unison.config.values import parse_compile
from unison.data_io import add_to_json_cache, read_json_cache
from unison.errors import UnisonError
from unison.gemm import alternated
from unison.models import model_config
from unison.models import unison_home
from unison.rollout.decode import FastWeights, compiled_layer_forward, layer_forward
from unison.threads import SMALL_MODEL, cpu_name, size_text

#: a side compiles under ``auto`` only this much faster than eager
SPEEDUP = 1.2
#: what a side's compilation is assumed to cost before it is measured (seconds, 2 CPU cores): a run whose whole
#: eager time on that side could not save this much even at 2× is not measured
ASSUMED_COMPILE_S = 10.0


@dataclass(frozen=True)
class Compilation:
    """Which side compiles, and why."""

    engine: bool
    learner: bool
    engine_reason: str
    learner_reason: str

    @property
    def value(self) -> str:
        """The setting that reproduces these choices (``config.yaml``)."""
        return {(True, True): "on", (False, False): "off", (True, False): "engine", (False, True): "learner"}[
            (self.engine, self.learner)]

    def __str__(self) -> str:
        if self.engine_reason == self.learner_reason:
            return f"compile {self.value} ({self.engine_reason})"
        on = {True: "on", False: "off"}
        return (f"compile: engine {on[self.engine]} ({self.engine_reason}), learner {on[self.learner]} "
                f"({self.learner_reason})")


def sides(setting) -> tuple[bool | None, bool | None]:
    """``(engine, learner)`` of a setting: True/False, or None where ``auto`` is to decide."""
    value = parse_compile(setting)
    return {"auto": (None, None), "measure": (None, None), "on": (True, True), "off": (False, False), "engine": (True, False),
            "learner": (False, True)}[value]


def check(setting, exact: bool, world_size: int, quantization_aware: bool = False) -> None:
    """Refuse, before anything is loaded or written, a compilation the run cannot have (one line each)."""
    engine, learner = sides(setting)
    if not (engine or learner):
        return
    if learner and quantization_aware:
        raise UnisonError(f"compile={parse_compile(setting)} compiles the learner, whose quantization-aware forward "
                          f"(train.quantization_aware) does not compile yet: set compile=engine (or off, auto)")
    if exact:
        raise UnisonError(f"compile={parse_compile(setting)} with exact mode: exact mode shares one forward between "
                          f"the engine and the learner by construction, and a compiled side would round differently "
                          f"— set compile=off (or auto) or exact=false")
    if world_size > 1:
        raise UnisonError(f"compile={parse_compile(setting)} under torchrun is not supported yet (FSDP2 with "
                          f"compiled layers is untested here): set compile=off (or auto)")


@dataclass(frozen=True)
class RunShape:
    """What the payback estimate needs: the run's steps, the responses of a decode step and its new tokens, the
    learner's micro-batches per step and their token budget."""

    steps: int
    rows: int
    new_tokens: int
    prompt_tokens: int
    micro_batches: int
    micro_tokens: int


def run_shape(cfg, prompt_ids: list[list[int]], world_size: int = 1) -> RunShape:
    """The :class:`RunShape` of a run's config (its prompts' mean length; each rank's share of the rows)."""
    rows = max(1, cfg.train.prompts_per_step * cfg.rollout.n // max(world_size, 1))
    prompt = int(sum(len(p) for p in prompt_ids) / max(len(prompt_ids), 1)) if prompt_ids else 16
    seq = prompt + cfg.rollout.max_new_tokens // 2
    t = cfg.train
    micro_tokens = t.micro_batch_tokens or t.micro_batch_size * seq
    micro_batches = t.mini_batches * max(1, -(-rows * seq // max(micro_tokens, 1)))
    return RunShape(t.steps, rows, cfg.rollout.max_new_tokens, prompt, micro_batches, min(micro_tokens, rows * seq))


def decide(setting, model_dir, params: int, shape: RunShape, *, exact: bool = False, world_size: int = 1,
           device: str = "cpu", engine_native: bool = True, engine_packed: bool = False,
           quantization_aware: bool = False, cache: Path | None = None, log=None) -> Compilation:
    """Each side's choice for ``setting``: ``auto`` follows this machine's kept measurement of the run's shape
    (eager where there is none), ``measure`` takes it first where it is missing (:func:`measure_engine`,
    :func:`measure_learner`)."""
    check(setting, exact, world_size, quantization_aware)
    engine, learner = sides(setting)
    if engine is not None:
        why = f"compile: {parse_compile(setting)}"
        e_reason = why if engine_native or not engine else "vLLM compiles by its own settings"
        return Compilation(engine and engine_native, learner, e_reason, why)
    for cond, why in ((exact, "exact mode keeps compilation out by construction"),
                      (world_size > 1, "a torchrun job"), (device != "cpu", f"device {device} (untested there)"),
                      (params < SMALL_MODEL, f"a {size_text(params)}-parameter model's steps are too small for a "
                                             f"compile to pay back")):
        if cond:
            return Compilation(False, False, f"auto: {why}", f"auto: {why}")
    key = _cache_key(model_dir, shape, engine_packed)
    stored = read_json_cache(cache or default_cache()).get(key)
    if stored is None and parse_compile(setting) == "auto":
        why = ("auto: eager, not measured on this machine at this run's shape (compile=measure times one layer "
               "compiled, ~20-80 s, and keeps the result for auto)")
        return Compilation(False, False, why if engine_native else "vLLM compiles by its own settings", why)
    if stored is None:
        stored = {"engine": measure_engine(model_dir, shape, engine_packed, log) if engine_native else None,
                  "learner": measure_learner(model_dir, shape, log)}
        add_to_json_cache(cache or default_cache(), key, stored)
    e_on, e_reason = _verdict(stored["engine"], shape.steps) if engine_native else (False, "vLLM compiles by its own settings")
    l_on, l_reason = _verdict(stored["learner"], shape.steps)
    if quantization_aware:
        l_on, l_reason = False, "auto: the quantization-aware forward does not compile yet"
    return Compilation(e_on, l_on, e_reason, l_reason)


def _verdict(m: dict | None, steps: int) -> tuple[bool, str]:
    """A side's choice from its measurement (``eager_s`` / ``compiled_s`` per step of the run, ``compile_s``)."""
    if m is None:
        return False, "auto: not measured"
    if m.get("compiled_s") is None:
        return False, (f"auto: eager {m['eager_s']:.2f} s a step × {steps} steps could not win back a compile "
                       f"(~{ASSUMED_COMPILE_S:.0f} s)")
    ratio = m["eager_s"] / max(m["compiled_s"], 1e-9)
    saved = (m["eager_s"] - m["compiled_s"]) * steps
    figures = f"{ratio:.2f}x eager, {m['compile_s']:.0f} s to compile, {saved:.0f} s saved over {steps} steps"
    if ratio >= SPEEDUP and saved > m["compile_s"]:
        return True, f"auto: {figures}, measured"
    return False, f"auto: {figures}, measured (needs {SPEEDUP}x and the compile won back)"


# ----------------------------------------------------------------------------- measurements
def one_layer_model(model_dir):
    """The model's architecture with one decoder layer, random weights, fp32 on the CPU, eval mode: what the
    measurements time (the shapes are the model's; the values do not matter to a timing)."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(Path(model_dir))
    cfg.num_hidden_layers = 1
    if hasattr(cfg, "layer_types") and cfg.layer_types:
        cfg.layer_types = cfg.layer_types[:1]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def measure_engine(model_dir, shape: RunShape, packed: bool, log=None, rounds: int = 10) -> dict:
    """One decoder layer's decode step at the run's batch (``rows`` responses, a context of the prompt and half
    the new tokens), eager and compiled: seconds per run step (× layers × new tokens) and the compile's seconds."""
    layers = model_config(Path(model_dir)).num_hidden_layers
    model = one_layer_model(model_dir)
    fast = FastWeights(model, packed, shape.rows)
    layer, w = model.model.layers[0], fast.layers[0]
    rope = __import__(type(layer.self_attn).__module__, fromlist=["apply_rotary_pos_emb"]).apply_rotary_pos_emb
    b, ctx = max(shape.rows, 2), shape.prompt_tokens + shape.new_tokens // 2
    cfg = model.config
    kv = cfg.num_key_value_heads
    kc = torch.zeros(b, kv, ctx + 1, layer.self_attn.head_dim)
    vc = torch.zeros_like(kc)
    h = torch.randn(b, 1, cfg.hidden_size)
    pos = torch.full((b, 1), ctx, dtype=torch.long)
    cos, sin = model.model.rotary_emb(h, pos)
    mask = torch.ones(b, 1, 1, ctx + 1, dtype=torch.bool)
    args = (layer, w, fast.product, rope, h, kc, vc, cos, sin, mask, ctx)
    eager = _best(lambda: layer_forward(*args), rounds)
    per_step = layers * shape.new_tokens
    if eager * per_step * shape.steps / 2 < ASSUMED_COMPILE_S:
        return {"eager_s": eager * per_step, "compiled_s": None, "compile_s": None}
    if log is not None:
        log(f"compile measure: timing the engine's layer compiled (once for this machine, model and batch; "
            f"~{ASSUMED_COMPILE_S * 2:.0f} s)")
    fn = compiled_layer_forward()
    t0 = time.perf_counter()
    fn(*args)  # the decode graph; a prefill graph costs about as much again
    compile_s = 2 * (time.perf_counter() - t0)
    eager, compiled = alternated(lambda: layer_forward(*args), lambda: fn(*args), rounds)
    return {"eager_s": eager * per_step, "compiled_s": compiled * per_step, "compile_s": compile_s}


def measure_learner(model_dir, shape: RunShape, log=None, rounds: int = 4) -> dict:
    """One decoder layer's forward and backward on a micro-batch of the run's token budget, eager and compiled:
    seconds per run step (× layers × micro-batches) and the compile's seconds."""
    layers = model_config(Path(model_dir)).num_hidden_layers
    model = one_layer_model(model_dir)
    layer = model.model.layers[0]
    n = max(shape.micro_tokens, 2)
    h = torch.randn(1, n, model.config.hidden_size, requires_grad=True)
    pos = torch.arange(n)[None]
    emb = model.model.rotary_emb(h, pos)

    def step(fn):
        out = fn(h, attention_mask=None, position_ids=pos, position_embeddings=emb)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()

    eager = _best(lambda: step(layer), rounds)
    per_step = layers * max(shape.micro_batches, 1)
    if eager * per_step * shape.steps / 2 < ASSUMED_COMPILE_S:
        return {"eager_s": eager * per_step, "compiled_s": None, "compile_s": None}
    if log is not None:
        log("compile measure: timing the learner's layer compiled, forward and backward (once for this machine, "
            f"model and batch; ~{ASSUMED_COMPILE_S * 2:.0f} s)")
    compiled_layer = torch.compile(layer, dynamic=True)
    t0 = time.perf_counter()
    step(compiled_layer)
    compile_s = time.perf_counter() - t0
    eager, compiled = alternated(lambda: step(layer), lambda: step(compiled_layer), rounds)
    return {"eager_s": eager * per_step, "compiled_s": compiled * per_step, "compile_s": compile_s}


# ----------------------------------------------------------------------------- the kept measurements
def default_cache() -> Path:
    """Where the measurements are kept: beside the models unison caches (``$UNISON_HOME``, default ~/.cache/unison)."""
    return unison_home() / "compile.json"


def _cache_key(model_dir, shape: RunShape, packed: bool) -> str:
    cfg = model_config(Path(model_dir))
    arch = (getattr(cfg, "model_type", "?"), cfg.hidden_size, getattr(cfg, "intermediate_size", 0),
            cfg.num_hidden_layers, cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", 0),
            getattr(cfg, "vocab_size", 0))
    return json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "arch": arch, "rows": shape.rows, "new": shape.new_tokens, "prompt": shape.prompt_tokens,
                       "micro": [shape.micro_batches, shape.micro_tokens], "steps": shape.steps, "packed": packed},
                      sort_keys=True)


def seconds_compiling() -> float:
    """Seconds this process has spent in torch.compile so far (Dynamo and Inductor, forward and backward graphs)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as m
    except ImportError:  # pragma: no cover - a torch without Dynamo
        return 0.0
    return float(sum(m.get("_compile.compile_inner", [])) + sum(m.get("compile_fx.<locals>.bw_compiler", [])))
