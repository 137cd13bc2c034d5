"""``unison probe``: measure the training–inference mismatch offline (Paper A, Fig. 5).

For each (engine, precision) arm: sample responses with the rollout engine
(μ), score the same tokens with the learner's full forward pass (π) in the
same precision, and compute every ``mismatch/*`` metric, the per-response
sequence log-ratio and its fitted slope against response length.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from unison import kvcache
from unison import ledger
from unison import locate
from unison import moe
from unison.batch import collate
from unison.compilation import sides
from unison.config import TaskConfig, load_config
from unison.config.schema import LoRAConfig
from unison.config.values import parse_compile
from unison.data_io import encode_prompts, load_prompts
from unison.errors import UnisonError
from unison.exact import check_supported
from unison.exact_check import self_check
from unison.learner import Learner
from unison.locate import check_locatable
from unison.lora import _lora_layers
from unison.mismatch import length_slope, mismatch_metrics, seq_log_ratio
from unison.models import load_tokenizer, model_config, resolve_model_dir
from unison.models import check_state_dtype, model_shell
from unison.policy import ScoringOptions
from unison.precision import Precision, parse_precision
from unison.preflight import check_device
from unison.quant import FORMATS, check_format_available, parse_quantization
from unison.quant import check_targets
from unison.retokenize import retokenize_metrics
from unison.rollout import SamplingParams, check_engine_available, generate, make_engine, parse_engine
from unison.sides import Side
from unison.sync import sync
from unison.view import summary as view_summary
from unison.view import token_records
from unison.tasks import TASKS, make_task, task_class
from unison.tasks.env import episode_metrics


@dataclass
class ProbeConfig:
    model: str | None = None          # None: built-in tiny model
    prompts: str | None = None        # None: built-in prompts
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16", "fp16"])
    engines: list[str] = field(default_factory=lambda: ["native"])
    n: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    seed: int = 0
    device: str = "cpu"
    #: learner numerics per arm: fp32 (fp32 parameters under autocast, one-process training) and/or
    #: compute (parameters cast to the compute dtype, as FSDP2's mixed precision under torchrun)
    param_dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    #: also run each native arm in exact mode (unison/exact.py): one forward, one layout
    exact: bool = False
    #: rollout weight formats (unison/quant.py): one arm per (engine, precision, quantization)
    quantizations: list[str] = field(default_factory=lambda: ["none"])
    #: int4: input columns per scale
    quant_group_size: int = 64
    #: also score every quantized arm with a quantization-aware learner (train.quantization_aware; with a
    #: quantized KV cache, train.kv_cache_aware too)
    quantization_aware: bool = False
    #: the engine's KV-cache formats (unison/kvcache.py: auto, fp8_e4m3, fp8_e5m2): one arm per (…, format)
    kv_caches: list[str] = field(default_factory=lambda: ["auto"])
    #: a quantized cache's scales: sync (measured by the arm's batch) or one
    kv_cache_scales: str = "sync"
    #: a recurrent model's state between the engine's decode steps: fp32 or model (rollout.state_dtype)
    state_dtype: str = "fp32"
    #: sample past EOS up to max_new_tokens (responses of a fixed length: the mismatch by response length)
    ignore_eos: bool = False
    #: top-p values to sample with (1.0 = off): one arm each; truncated arms are scored without and with
    #: sampling-mask replay
    top_ps: list[float] = field(default_factory=lambda: [1.0])
    #: top-k values (0 = off): one arm each, as top_ps
    top_ks: list[int] = field(default_factory=lambda: [0])
    #: the mismatch ledger of every arm (unison/ledger.py): decode, engine, quantization, truncation, routing
    ledger: bool = False
    #: a multi-turn task (calculator, guess_number, or a YAML config with a multi-turn task section):
    #: its first items are run as episodes instead of the prompts, and every row adds the tokenization
    #: drift of a re-tokenizing loop (mismatch/retokenize_*, unison/retokenize.py)
    task: str | None = None
    #: where the engine and the learner part (unison/locate.py): every op's relative error and the full-vocabulary
    #: KL per position, on the first ``locate_rows`` responses of each native arm
    locate: bool = False
    locate_rows: int = 4
    #: compilation settings (unison/compilation.py): one arm each — off, engine (the engine's layers compiled,
    #: the learner eager), learner, on (both); native engine only
    compiles: list[str] = field(default_factory=lambda: ["off"])
    #: LoRA ranks (0 = none): one arm each. The learner carries adapters of that rank, drawn at a trained scale
    #: (each adapted weight moved by :data:`LORA_SCALE` of its norm), and the engine samples from the merged
    #: weights W + (α/r)·B·A — as a LoRA run syncs them — while the learner scores through the adapters
    lora_ranks: list[int] = field(default_factory=lambda: [0])
    tokens: int = 8  #: responses per arm and variant recorded for ``unison view`` (tokens.json; largest k3 first)


#: ``--lora-rank``: the relative change ‖(α/r)·B·A‖ / ‖W‖ the probe's random adapters make to each adapted weight
#: (a trained adapter's order of magnitude; at PEFT's own initialisation B = 0 and the merged weights are W)
LORA_SCALE = 0.01


@dataclass
class ProbeInputs:
    """Everything :func:`validate` checked, ready for :func:`run_probe`."""

    model_dir: Path
    precisions: list[str]
    engines: list[str]
    quantizations: list[str]
    prompts: list[str]
    tokenizer: object
    prompt_ids: list[list[int]]
    #: --task: the multi-turn task and the items its episodes start from
    task: object = None
    items: list = field(default_factory=list)


def probe_task(spec: str, items: int = 8):
    """``--task``: ``(task, its first items, task.max_episode_tokens)`` for a built-in multi-turn task's name or a
    YAML config whose task is multi-turn."""
    builtin = [n for n in TASKS if n != "env" and task_class(n).multi_turn]
    if spec.endswith((".yaml", ".yml")):
        tcfg = load_config(spec).task
    elif spec in builtin:
        tcfg = TaskConfig(name=spec, train_size=max(items, 16), eval_size=0)
    else:
        raise UnisonError(f"--task '{spec}' is not a multi-turn task: name {', '.join(builtin)}, or give a YAML config "
                          f"whose task section is multi-turn (task.name: env)")
    if not task_class(tcfg.name).multi_turn:
        raise UnisonError(f"--task {spec}: task.name is '{tcfg.name}', not a multi-turn task: the probe's --prompts "
                          f"covers single-turn prompts")
    task = make_task(tcfg)
    return task, task.train[:items], tcfg.max_episode_tokens


def _check_options(cfg: ProbeConfig) -> tuple[list[str], list[str], list[str]]:
    """The options alone, each checked against the others: ``(precisions, engines, quantizations)`` parsed."""
    check_device(cfg.device, "--device")
    if cfg.exact and torch.device(cfg.device).type == "cuda":
        raise UnisonError("--exact is built for CPUs: cuBLAS picks kernels by shape and no batch-invariant GPU "
                          "route has run yet (docs/exact.md); drop --exact or use --device cpu")
    precisions = [parse_precision(p) for p in cfg.precisions]
    engines = [parse_engine(e) for e in cfg.engines]
    quantizations = [parse_quantization(q) for q in cfg.quantizations]
    if not quantizations:
        raise UnisonError(f"--quantization is empty: name at least one of {', '.join(FORMATS)}")
    for q in quantizations:
        check_format_available(q)
        if q != "none" and engines != ["native"]:
            raise UnisonError(f"--quantization {q} runs on the native engine (vLLM quantizes only on GPUs, as "
                              f"`rollout.quantization: fp8` in training): use --engine native")

    compiles = [parse_compile(c) for c in cfg.compiles]
    if not compiles or {"auto", "measure"} & set(compiles):
        raise UnisonError(f"--compile {','.join(cfg.compiles) or '(empty)'}: name settings to compare, each one of "
                          f"off, engine, learner, on (auto and measure decide for a run, not for a probe)")
    if compiles != ["off"] and (engines != ["native"] or cfg.exact):
        raise UnisonError("--compile compiles the native engine's layers and the learner's, and exact mode keeps "
                          "compilation out by construction: use --engine native without --exact")
    cfg.compiles = compiles
    if not cfg.lora_ranks or any(r < 0 for r in cfg.lora_ranks):
        raise UnisonError(f"--lora-rank {cfg.lora_ranks}: every value must be 0 (no adapters) or a positive rank")
    if any(cfg.lora_ranks) and (cfg.exact or cfg.locate):
        raise UnisonError("--lora-rank: exact mode and --locate score the plain model; drop --exact / --locate "
                          "or --lora-rank")
    if cfg.locate and engines != ["native"]:
        raise UnisonError("--locate reads the engine's hidden states layer by layer, which only the native engine "
                          "exposes (vLLM keeps them inside its model runner): use --engine native")
    if cfg.state_dtype != "fp32" and (engines != ["native"] or cfg.exact):
        raise UnisonError("--state-dtype rounds the native engine's recurrent state (vLLM keeps its own, exact mode "
                          "an fp32 one on both sides): use --engine native without --exact")
    for e in engines:
        check_engine_available(e)
    if not precisions:
        raise UnisonError("--precision is empty: name at least one of fp32, bf16, fp16")
    if cfg.n < 1 or cfg.max_new_tokens < 1:
        raise UnisonError("--n and --max-new-tokens must be at least 1")
    if cfg.temperature <= 0:
        raise UnisonError(f"--temperature {cfg.temperature} is invalid: the probe needs a positive temperature")
    if not cfg.top_ps or any(not 0.0 < p <= 1.0 for p in cfg.top_ps):
        raise UnisonError(f"--top-p {cfg.top_ps}: every value must lie in (0, 1] (1.0 = off)")
    if not cfg.top_ks or any(k < 0 for k in cfg.top_ks):
        raise UnisonError(f"--top-k {cfg.top_ks}: every value must be 0 (off) or a positive integer")
    truncated = any(p < 1.0 for p in cfg.top_ps) or any(cfg.top_ks)
    if truncated and engines != ["native"]:
        raise UnisonError("--top-p / --top-k rows are scored with and without sampling-mask replay, and only the "
                          "native engine records the support it sampled from: use --engine native")
    if truncated and cfg.exact:
        raise UnisonError("--exact samples from the full distribution the learner scores: drop --exact, or keep "
                          "--top-p 1.0 and --top-k 0")
    if cfg.ledger and engines != ["native"]:
        raise UnisonError("--ledger needs an engine that re-scores its own samples in a prefill pass (its decode "
                          "term), and only the native engine does for unison: use --engine native")
    if cfg.locate and cfg.locate_rows < 1:
        raise UnisonError(f"--locate-rows {cfg.locate_rows}: trace at least 1 response")
    bad_kv = [k for k in cfg.kv_caches if k not in kvcache.FORMATS] or ([] if cfg.kv_caches else ["(empty)"])
    if bad_kv or cfg.kv_cache_scales not in kvcache.SCALES:
        raise UnisonError(f"--kv-cache '{bad_kv[0]}' is invalid: choose among {', '.join(kvcache.FORMATS)}" if bad_kv
                          else f"--kv-cache-scales '{cfg.kv_cache_scales}': choose sync or one")
    if cfg.kv_caches != ["auto"] and engines != ["native"]:
        raise UnisonError("--kv-cache quantizes the native engine's own cache (vLLM's does not give its scales to "
                          "unison): use --engine native")
    if cfg.quantization_aware and quantizations == ["none"] and cfg.kv_caches == ["auto"]:
        raise UnisonError("--quantization-aware scores quantized arms through the quantizer: add a format with "
                          "--quantization fp8, int8 or int4, or a cache with --kv-cache fp8_e4m3")
    bad = [p for p in cfg.param_dtypes if p not in ("fp32", "compute")] or ([] if cfg.param_dtypes else ["(empty)"])
    if bad:
        raise UnisonError(f"--param-dtype '{bad[0]}' is invalid: choose fp32, compute or both (fp32,compute)")
    return precisions, engines, quantizations


def validate(cfg: ProbeConfig) -> ProbeInputs:
    """Check every input before anything runs or is written: names, numbers, the prompts
    file, the model directory, and that every prompt plus ``max_new_tokens`` fits the
    model's context (``max_position_embeddings``) — before any engine is built."""
    precisions, engines, quantizations = _check_options(cfg)
    lines: list[int] = []
    task, items = None, []
    if cfg.task:
        if cfg.exact or cfg.prompts:
            raise UnisonError("--task runs episodes: drop --exact and --prompts")
        task, items, budget = probe_task(cfg.task)
        prompts = [it.prompt for it in items]
        lines = [i + 1 for i in range(len(items))]
    else:
        prompts = load_prompts(cfg.prompts, line_numbers=lines)
    model_dir = resolve_model_dir(cfg.model)
    config = model_config(model_dir)
    check_state_dtype(cfg.state_dtype, config, "--state-dtype")
    limit = getattr(config, "max_position_embeddings", None)
    tokenizer = load_tokenizer(model_dir)
    if task is not None:
        task.prepare(tokenizer, cfg.model or "builtin:tiny")
        prompt_ids = [task.encode(tokenizer, it) for it in items]
        if limit is not None and max(map(len, prompt_ids)) + budget > limit:
            raise UnisonError(f"--task {cfg.task}: a first prompt of {max(map(len, prompt_ids))} tokens plus "
                              f"task.max_episode_tokens={budget} exceeds the model's context of {limit}: lower it")
    else:
        prompt_ids = encode_prompts(tokenizer, prompts)
    if limit is not None and task is None:
        source = cfg.prompts if cfg.prompts is not None else "the built-in prompts"
        for ids, line in zip(prompt_ids, lines):
            if len(ids) + cfg.max_new_tokens > limit:
                raise UnisonError(
                    f"{source}:{line}: the prompt has {len(ids)} tokens; with --max-new-tokens "
                    f"{cfg.max_new_tokens} that exceeds the model's context of {limit} "
                    f"(max_position_embeddings): shorten or drop that prompt, or lower --max-new-tokens")
    if cfg.locate:  # the ops it reads exist in this architecture, before anything is sampled
        check_locatable(model_shell(model_dir))
    if any(q != "none" for q in quantizations):  # int4 group size vs this model's weights, before sampling
        shell = model_shell(model_dir)
        for q in quantizations:
            if q != "none":
                check_targets(shell, q, cfg.quant_group_size)
    return ProbeInputs(model_dir, precisions, engines, quantizations, prompts, tokenizer, prompt_ids, task, items)


@dataclass(frozen=True)
class Arm:
    """One engine run of the probe: the engine and its numerics (precision, weight format, exact, compiled), how it
    samples (top-p, top-k) and the LoRA rank of the learner whose merged weights it holds. The learner then scores
    the same tokens once per :meth:`variants` Side."""

    engine: str
    precision: Precision
    quantization: str
    exact: bool
    top_p: float
    top_k: int
    compile: str
    lora_rank: int
    kv_cache: str = "auto"

    @property
    def truncated(self) -> bool:
        return self.top_p < 1.0 or bool(self.top_k)

    @property
    def tags(self) -> tuple[str, str, str]:
        """(weights, sampling, compile/LoRA) parts of the arm's label."""
        q = ("" if self.quantization == "none" else f"/{self.quantization}") + \
            ("" if self.kv_cache == "auto" else f"/KV {self.kv_cache}")
        t = "".join([f"/top-p {self.top_p:g}" if self.top_p < 1.0 else "", f"/top-k {self.top_k}" if self.top_k else ""])
        c = ("" if self.compile == "off" else f"/compile {self.compile}") + (f"/LoRA r{self.lora_rank}" if self.lora_rank
                                                                             else "")
        return q, t, c

    @property
    def label(self) -> str:
        return f"{self.engine}{'-exact' if self.exact else ''}/{self.precision.label}{''.join(self.tags)}"

    def engine_side(self, cfg: ProbeConfig) -> Side:
        return Side(dtype=self.precision.rollout_dtype, quantization=self.quantization,
                    group_size=cfg.quant_group_size, kv_cache=self.kv_cache, kv_scales=cfg.kv_cache_scales,
                    state=cfg.state_dtype, routing_replay=True, compiled=bool(sides(self.compile)[0]),
                    exact=self.exact)

    def learner_side(self, cfg: ProbeConfig, params: str = "fp32", quantized: bool = False,
                     replay: bool = False) -> Side:
        return Side(dtype=self.precision.learner_dtype, params=params,
                    quantization=self.quantization if quantized else "none", group_size=cfg.quant_group_size,
                    kv_cache=self.kv_cache if quantized else "auto", kv_scales=cfg.kv_cache_scales,
                    support_replay=replay, compiled=bool(sides(self.compile)[1]), exact=self.exact)

    def variants(self, cfg: ProbeConfig) -> list[tuple[str, bool, bool]]:
        """(parameter dtype, quantization-aware, sampling-mask replay) of each scoring: the parameter dtypes asked
        for (exact mode: the compute dtype, as its engine), with and without the quantizer
        (``--quantization-aware``; exact mode: with it), with and without replay (truncated arms)."""
        quantized = self.quantization != "none" or self.kv_cache != "auto"
        return [(pd, qa, rp) for pd in (["compute"] if self.exact else cfg.param_dtypes)
                for qa in ([True] if self.exact and quantized else
                           [False, True] if cfg.quantization_aware and quantized else [False])
                for rp in ([False, True] if self.truncated else [False])]


def probe_arms(cfg: ProbeConfig, inputs: ProbeInputs) -> list[Arm]:
    """Every (engine, precision, weights, sampling, compile, LoRA rank) arm, then the exact arms (``--exact``)."""
    arms = [Arm(e, Precision.resolve(p), q, False, tp, tk, c, r, kv) for e in inputs.engines
            for p in inputs.precisions for q in inputs.quantizations for kv in cfg.kv_caches for tp in cfg.top_ps
            for tk in cfg.top_ks for c in cfg.compiles for r in cfg.lora_ranks]
    if cfg.exact:
        quants = [q for q in inputs.quantizations if q == "none" or cfg.quantization_aware]
        arms += [Arm("native", Precision.resolve(p), q, True, 1.0, 0, "off", 0) for p in inputs.precisions
                 for q in quants]
    return arms


@dataclass
class Sampled:
    """What an arm's engine gave: the batch, its completions, the seconds it took, the engine's own prefill re-score
    (``--ledger``) and its side of ``--locate``."""

    batch: object
    completions: list
    rollout_s: float
    params: SamplingParams
    pad_id: int = 0
    rescored: torch.Tensor | None = None
    traced: object = None
    engine_ops: object = None


class _Learners:
    """The learners an arm scores with, each built once: the plain one, one per LoRA rank (adapters drawn at a
    trained scale), the exact one (with this CPU's kernels checked)."""

    def __init__(self, cfg: ProbeConfig, model_dir, width: int):
        self.cfg, self.model_dir, self.width = cfg, model_dir, width
        self.options = ScoringOptions(device=cfg.device, temperature=cfg.temperature)
        self.plain = Learner(model_dir, options=self.options)
        self.adapted: dict[int, Learner] = {}
        self.exact, self.exact_ops = None, None

    def for_arm(self, arm: Arm) -> Learner:
        if arm.exact:
            return self.exact
        if arm.lora_rank:
            if arm.lora_rank not in self.adapted:
                self.adapted[arm.lora_rank] = _lora_learner(self.model_dir, self.cfg, arm.lora_rank)
            return self.adapted[arm.lora_rank]
        return self.plain

    def build_exact(self, precisions: list[str]) -> None:
        check_supported(model_config(self.model_dir), "--exact")
        self.exact = Learner(self.model_dir, Side(exact=True), self.options)
        self.exact_ops = self_check(self.exact.exact, {Precision.resolve(p).rollout_dtype for p in precisions},
                                    self.width + self.cfg.max_new_tokens)


def run_probe(cfg: ProbeConfig, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Run every arm; return ``{"results": [...], "config": ..., "samples": ...}``.

    An arm (:class:`Arm`): one engine samples, then the learner scores the same tokens once per variant — parameter
    dtype, with and without the quantizer (``--quantization-aware``), with and without sampling-mask replay
    (truncated arms). ``samples`` (token probabilities and per-response log-ratios, for plots) is not part of
    ``probe.json``.
    """
    inputs = validate(cfg)
    width = max(len(p) for p in inputs.prompt_ids)
    learners = _Learners(cfg, inputs.model_dir, width)
    if cfg.exact:
        if "native" not in inputs.engines:
            raise UnisonError("--exact needs the native engine: add native to --engine")
        learners.build_exact(inputs.precisions)
    results, samples, timings, tokens = [], [], [], []
    for arm in probe_arms(cfg, inputs):
        sampled = _sample(arm, cfg, inputs, width, learners, log)
        scorer = learners.for_arm(arm)
        first = len(results)
        for pd, qa, replay in arm.variants(cfg):
            row, sample, timing, logp_pi = _score(arm, cfg, inputs, scorer, sampled, pd, qa, replay, log)
            results.append(row)
            samples.append(sample)
            timings.append(timing)
            records, of = token_records(sampled.batch, torch.arange(sampled.batch.size), logp_pi, None,
                                        inputs.tokenizer, cfg.tokens)
            label = arm.label + "".join([f"/{pd}" if len(cfg.param_dtypes) > 1 else "", "/QAT" if qa else "",
                                         "/replay" if replay else ""])
            tokens.append({"label": label, "of": of, "summary": view_summary(row), "responses": records})
        if sampled.traced is not None:  # --locate, against the plain learner in the arm's compute dtype
            results[first]["locate"] = _locate(arm, scorer, sampled, results[first], log)
        if sampled.rescored is not None:  # the ledger, against the arm's first row: the plain learner
            results[first].update(_ledger(arm, cfg, scorer, sampled))
            tokens[first]["summary"] = view_summary(results[first])
    config = {**{k: v for k, v in asdict(cfg).items() if k != "tokens"},  # (what unison view records: not an arm)
              "model": str(inputs.model_dir) if cfg.model else "builtin:tiny",
              "precisions": inputs.precisions, "engines": inputs.engines, "quantizations": inputs.quantizations,
              "num_prompts": len(inputs.prompts)}
    return {"results": results, "config": config, "samples": samples, "timings": timings, "tokens": tokens}


def _sample(arm: Arm, cfg: ProbeConfig, inputs: ProbeInputs, width: int, learners: _Learners, log) -> Sampled:
    """The arm's engine, built, synced (LoRA: the merged weights W + (α/r)·B·A of the arm's learner, as a LoRA run's
    sync gives them; that learner is built after the engine, whose loading draws from torch's generator as PEFT's
    initialisation does), sampling every prompt ``cfg.n`` times, then closed — before scoring and before the next
    arm's engine, whatever happens (a vLLM engine holds its share of the GPU until then)."""
    log(f"[probe] {arm.label}: loading engine ({arm.precision.rollout}"
        f"{', weights ' + arm.quantization if arm.quantization != 'none' else ''})")
    engine = make_engine(arm.engine, inputs.model_dir, arm.engine_side(cfg), device=cfg.device, seed=cfg.seed,
                         prompt_width=width if arm.exact else None,
                         max_len=width + cfg.max_new_tokens)  # vLLM reserves this context, not the model's
    try:
        if arm.lora_rank:
            sync(engine, learners.for_arm(arm))
        if arm.exact:
            engine.exact.ops = learners.exact_ops
        params = SamplingParams(n=cfg.n, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                                seed=cfg.seed, top_p=arm.top_p, top_k=arm.top_k, ignore_eos=cfg.ignore_eos)
        log(f"[probe] {arm.label}: sampling {len(inputs.prompt_ids)} prompts x {cfg.n} "
            f"(max {cfg.max_new_tokens} new tokens)")
        t0 = time.perf_counter()
        completions = generate(engine, inputs.task.episodes(inputs.items) if inputs.task else inputs.prompt_ids, params)
        t_roll = time.perf_counter() - t0
        batch = collate(completions, engine.pad_id, layout=(width, width + cfg.max_new_tokens) if arm.exact else None)
        out = Sampled(batch, completions, t_roll, params, engine.pad_id)
        if cfg.ledger and not arm.exact:  # the decode term
            out.rescored = engine.score(batch, params)
        if cfg.locate and not arm.exact:  # the engine's side of --locate, before the engine closes
            out.traced = batch.select(list(range(min(cfg.locate_rows, batch.size))))
            out.engine_ops = locate.engine_trace(engine, out.traced, cfg.temperature)
        return out
    finally:
        engine.close()
        del engine


def _score(arm: Arm, cfg: ProbeConfig, inputs: ProbeInputs, scorer, sampled: Sampled, pd: str, qa: bool,
           replay: bool, log) -> tuple[dict, dict, dict, torch.Tensor]:
    """One variant of an arm: the learner scores the arm's tokens as ``(pd, qa, replay)`` say; its probe row, its
    plot samples, its timings and the learner's log-probs."""
    batch, mask = sampled.batch, sampled.batch.response_mask
    vtag = "".join([", quantization-aware" if qa else "", ", sampling-mask replay" if replay else ""])
    log(f"[probe] {arm.label}: scoring {batch.num_response_tokens} tokens with the learner (parameters: {pd}{vtag})")
    side = arm.learner_side(cfg, pd, qa, replay)
    t0 = time.perf_counter()
    moe_routing = scorer.moe and "routing" in batch.extras
    with scorer.as_side(side):
        scored = scorer.score(batch, with_routing=moe_routing)
        logp_pi, routing = scored if moe_routing else (scored, None)
        t_score = time.perf_counter() - t0
        metrics = mismatch_metrics(logp_pi, batch.logp_mu, mask)
        if inputs.task is not None:  # episodes: their shape, and what re-tokenizing them would train on
            metrics.update(episode_metrics([c.episode for c in sampled.completions]))
            metrics.update(retokenize_metrics(scorer, sampled.completions, inputs.task.template, sampled.pad_id))
    if moe_routing:  # MoE: routing flips, and replaying them
        metrics["mismatch/router_disagreement"] = moe.disagreement(batch.extras["routing"], routing, mask)
        with scorer.as_side(replace(side, routing_replay=True)):
            replayed = mismatch_metrics(scorer.score(batch), batch.logp_mu, mask)
        for key in ("k3", "seq_kl_k3", "prob_diff_mean"):
            metrics[f"mismatch/{key}_routing_replay"] = replayed[f"mismatch/{key}"]
    seq_lr = seq_log_ratio(logp_pi, batch.logp_mu, mask)
    lengths = batch.response_lens
    prec = arm.precision
    row = {**({"task": cfg.task} if cfg.task else {}), "engine": arm.engine, "precision": prec.label,
           "quantization": arm.quantization, "kv_cache": arm.kv_cache, "state_dtype": cfg.state_dtype, "param_dtype": pd, "exact": arm.exact, "quantization_aware": qa,
           "top_p": arm.top_p, "top_k": arm.top_k, "replay_sampling_mask": replay, "compile": arm.compile,
           "lora_rank": arm.lora_rank, **metrics, "num_responses": batch.size,
           "mean_response_length": float(lengths.float().mean()),
           "truncated_fraction": float(batch.truncated.float().mean()),
           "seq_log_ratio_slope_per_1k": length_slope(seq_lr, lengths)}
    sel = mask.bool()
    qtag, ttag, ctag = arm.tags
    tag = qtag + ("/QAT" if qa else "") + ttag + ("/replay" if replay else "") + ctag
    sample = {"engine": arm.engine + ("-exact" if arm.exact else ""),
              "precision": (prec.label if len(cfg.param_dtypes) == 1 else f"{prec.label}/{pd}") + tag,
              "p_pi": logp_pi[sel].exp().tolist(), "p_mu": batch.logp_mu[sel].exp().tolist(),
              "seq_log_ratio": seq_lr.tolist(), "lengths": lengths.tolist()}
    timing = {"engine": arm.engine, "precision": prec.label, "quantization": arm.quantization,
              "rollout_s": sampled.rollout_s, "score_s": t_score, "peak_rss_gib": _peak_rss_gib(),
              "rollout_tokens_per_s": batch.num_response_tokens / max(sampled.rollout_s, 1e-9)}
    return row, sample, timing, logp_pi


def _locate(arm: Arm, scorer, sampled: Sampled, row: dict, log) -> dict:
    """``--locate`` of an arm: where its engine and the plain learner (fp32 parameters, the arm's compute dtype)
    first part, op by op."""
    with scorer.as_side(Side(dtype=arm.precision.learner_dtype)):
        found = locate.compare(sampled.engine_ops, locate.learner_trace(scorer, sampled.traced, scorer.temperature),
                               sampled.traced, arm.precision.rollout_dtype, locate.op_names(scorer.model))
    log(f"[probe] {arm.label}: engine and learner first part at "
        f"{found['first_above'] or 'no op (every op within its rounding)'}; full-vocabulary KL "
        f"{found['full_kl_mean']:.3g} per position (max {found['full_kl_max']:.3g})")
    return {"arm": locate.arm_label(row), **found}


def _ledger(arm: Arm, cfg: ProbeConfig, scorer, sampled: Sampled) -> dict:
    """The mismatch ledger of one arm: its chain from the engine's log μ to the plain learner's log π (the first
    parameter dtype asked for, no quantizer, no replay, compiled as the arm says)."""
    batch = sampled.batch
    engine, learner = arm.engine_side(cfg), arm.learner_side(cfg, cfg.param_dtypes[0])
    p = ledger.plan(engine, learner, truncated=arm.truncated, moe=scorer.moe and "routing" in batch.extras,
                    asynchronous=False, can_rescore=None, can_score_old=True, lora=scorer.peft is not None)
    led = ledger.Ledger(scorer, p, engine, rescore=lambda sub, version: sampled.rescored)
    with scorer.as_side(learner):
        return led.measure(batch, scorer.score(batch), step=0)


def _lora_learner(model_dir, cfg: ProbeConfig, rank: int) -> Learner:
    """A learner with LoRA adapters of ``rank`` on every linear layer, B drawn (seeded) so that each adapted weight
    moves by :data:`LORA_SCALE` of its norm: what a LoRA run's learner holds after some training."""
    with torch.random.fork_rng():  # PEFT initialises A from torch's generator, which each process seeds its own way
        torch.manual_seed(cfg.seed + 7919 * rank)
        lrn = Learner(model_dir, options=ScoringOptions(device=cfg.device, temperature=cfg.temperature),
                      lora=LoRAConfig(rank=rank))
    g = torch.Generator().manual_seed(cfg.seed + 7919 * rank)
    with torch.no_grad():
        for _, layer in _lora_layers(lrn.model):
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=g))
            delta = layer.scaling["default"] * (b @ a)
            b.mul_(LORA_SCALE * layer.base_layer.weight.norm() / delta.norm().clamp(min=1e-30))
    return lrn


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
