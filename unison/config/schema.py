"""The training configuration's typed tree (pydantic v2) and the rules of its named values — a leaf: it imports no
other part of unison but its smaller sections (:mod:`unison.config.sections`) and the rules of its named values (:mod:`unison.config.values`). Loading (YAML, ``--set``, did-you-mean, paths): :mod:`unison.config.load`.

Every field is documented where it is declared (every key: docs/config.md). Contract keys:
``seed``, ``precision`` (with ``rollout_precision`` / ``learner_precision``
overrides beside it), ``engine``, ``algo``, ``train.steps``, ``train.lr``,
``checkpoint.every``.

Unknown keys are rejected with the nearest valid name; wrong types and
out-of-range values give one line naming the key.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from unison.config.sections import (CheckpointConfig, DistillConfig, DistributedConfig, LogConfig, LoRAConfig,
                                    MismatchConfig, MoEConfig, ScalerConfig, SFTConfig, VLLMConfig, _Section)
from unison.config.values import parse_compile, parse_engine, parse_gemm, parse_precision, parse_threads


class TaskConfig(_Section):
    """Where prompts and rewards come from (see ``unison/tasks/``)."""

    #: arithmetic | scratchpad | math (JSONL problem/answer, math-verify) | jsonl (your prompts and your
    #: reward function: docs/tasks.md, "Bring your own task") | reasoning_gym | env (multi-turn episodes with your
    #: environment and tools: docs/tasks.md, "Multi-turn environments and tools") | calculator (arithmetic solved with
    #: a calc tool, multi-turn) | guess_number (guess a number from higher/lower replies, multi-turn)
    name: Literal["arithmetic", "scratchpad", "math", "jsonl", "reasoning_gym", "env", "calculator",
                  "guess_number"] = "arithmetic"
    #: arithmetic, scratchpad, calculator: number of digits of each operand; guess_number: digits of the
    #: secret (1..10^digits − 1)
    digits: int = Field(2, ge=1, le=9)
    #: scratchpad: operands of each chained sum (7: worked answers of 60–80 characters)
    operands: int = Field(7, ge=2, le=64)
    #: scratchpad: what SFT demonstrates — full (the working), direct (the bare answer), mixed (half each);
    #: calculator: full (the calc call, its result, the answer), direct (the answer alone), mixed (half each)
    style: Literal["full", "direct", "mixed"] = "full"
    #: arithmetic, calculator: operators to draw from
    operators: list[Literal["+", "-", "*"]] = ["+"]
    #: arithmetic / reasoning_gym / calculator / guess_number: problems in the training split
    train_size: int = Field(2000, ge=1)
    #: problems in the held-out eval split. arithmetic / reasoning_gym: generated beside the train
    #: split. math without ``eval_path``: min(eval_size, ⌊rows/10⌋) rows of ``path`` (seeded
    #: shuffle) are held out, never more than a tenth of the file (16 rows -> 1 held out, 15 train;
    #: 1460 -> 146; ≥ 2000 -> eval_size); 0 holds out nothing. jsonl without ``eval_path``: the same,
    #: but only when an eval is asked for (train.eval_every > 0, or unison sft); else every row trains
    eval_size: int = Field(200, ge=0)
    #: seed of the task generator (train/eval split included)
    seed: int = 0
    #: math: JSONL file with ``problem`` and ``answer`` per row, or a set shipped with unison:
    #: builtin:sanity_math (Paper A's 1460), builtin:math500, builtin:aime2024, builtin:amc23;
    #: jsonl: rows with ``prompt`` (or ``problem``), optional ``answer``, any other fields;
    #: arithmetic: optional JSONL of ``prompt``/``answer`` rows that replaces the generated
    #: train split (e.g. the perfectible set written by ``unison filter``); env: JSONL of the items
    #: (any fields) the environment's ``reset(item)`` receives
    path: str | None = None
    #: math, jsonl, env: JSONL file for evaluation (default: hold out rows of ``path``, see ``eval_size``)
    eval_path: str | None = None
    #: math: prompt template (``{problem}``; null: Paper A's instruction after the problem, MATH_TEMPLATE in
    #: unison/tasks/math.py), printed at start; jsonl: an optional template over the row's fields (``{prompt}``,
    #: ...; null: the prompts as written); both go inside the chat template when the model has one. Other tasks
    #: ignore it
    template: str | None = None
    #: reasoning_gym: dataset name, e.g. ``basic_arithmetic``, ``chain_sum``
    dataset: str | None = None
    #: custom reward ``module:function`` (``module.py`` next to the config file, or importable) or
    #: ``path/to/file.py:function``, called as ``f(response: str, item: Item) -> float``; replaces
    #: the task's verifier (docs/tasks.md, "Bring your own task"). Multi-turn tasks: called once per episode as
    #: ``f(messages: list[dict], item) -> float`` on the whole conversation, instead of the environment's reward
    reward: str | None = None
    #: env: the environment class ``module:Class`` (``module.py`` next to the config file, or importable) or
    #: ``path/to/file.py:Class``; one instance per episode, created with no arguments, with ``reset(item) ->
    #: messages`` and ``step(text) -> (messages, reward or None, done)`` and optional ``tools`` (unison/tasks/env.py)
    env: str | None = None
    #: multi-turn tasks: model turns per episode at most (an episode still going after them is truncated);
    #: each turn samples at most rollout.max_new_tokens (a turn cut there still goes to the environment)
    max_turns: int = Field(4, ge=1)
    #: multi-turn tasks: tokens an episode may add after its first prompt, the model's and the environment's
    #: together (the sequence the learner trains on is at most first prompt + this); more truncates it
    max_episode_tokens: int = Field(512, ge=1)
    #: multi-turn tasks: the chat template episodes are rendered with (unison/chat.py) — auto (the model's own;
    #: unison's builtin:tiny when the tokenizer has none; builtin:chatml-tools when a ChatML model's template
    #: ignores tools, as SmolLM2's) | model (the model's own, else refused) | builtin:tiny | builtin:chatml-tools |
    #: a jinja file. It must be prefix-preserving (checked at start: Qwen3's, which drops earlier <think> blocks, is
    #: refused)
    chat_template: str = "auto"
    #: reward given to a response cut at max tokens, without calling the verifier or the custom reward
    #: (Paper A: 0; null: grade it too). Custom rewards keep 0: the run says so at start, and warns once
    #: when more than half of a step's responses were cut and scored this way
    truncated_reward: float | None = 0.0
    #: warn loudly when more than this fraction of a step's rewards raised (they score 0)
    reward_error_warn: float = Field(0.1, ge=0, le=1)
    #: stop the run (checkpoint intact) after this many consecutive steps in which every reward
    #: raised (0 = never stop)
    reward_error_patience: int = Field(3, ge=0)


class RolloutConfig(_Section):
    """How the rollout engine samples."""

    #: responses per prompt (group size)
    n: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    #: 1.0 = off. Truncation makes log μ that of the truncated distribution: without
    #: replay_sampling_mask, π/μ carries the log of the kept mass
    top_p: float = Field(1.0, gt=0, le=1)
    #: 0 = off
    top_k: int = Field(0, ge=0)
    #: sampling-mask replay (DeepSeek-V3.2 "keep sampling mask"): with top_p < 1 or top_k > 0 the native
    #: engine records the support each token was sampled from (its c most probable tokens) and the learner
    #: renormalises π over it, so π/μ is not biased by the kept mass; every mismatch metric and correction
    #: uses it. Native engine only (the vLLM engines do not return the support: set false there)
    replay_sampling_mask: bool = True
    max_new_tokens: int = Field(16, ge=1)
    #: the rollout engine's weight format (unison/quant.py; **contract** key): none | fp8 (e4m3, per
    #: output channel) | int8 (per output channel) | int4 (symmetric groups of quant_group_size input
    #: columns) | mxfp8, mxfp4 (OCP MX: blocks of 32, power-of-two e8m0 scales, e4m3 / e2m1 elements) |
    #: nvfp4 (blocks of 16, e2m1 elements, e4m3 block scales under a per-tensor fp32 scale) | w8a8_fp8,
    #: w8a8_int8 (fp8 / int8 weights per channel and each quantized layer's input per token, dynamic).
    #: Weights re-quantized from the learner's fp32 masters at every sync; embeddings, lm_head, norms and
    #: MoE routers stay in rollout_precision, the compute dtype. The learner trains fp32.
    quantization: Literal["none", "fp8", "int8", "int4", "mxfp8", "mxfp4", "nvfp4",
                          "w8a8_fp8", "w8a8_int8"] = "none"
    #: int4: input columns sharing one scale (must divide every quantized weight's input dimension)
    quant_group_size: int = Field(64, ge=1)
    #: the attention cache's format (unison/kvcache.py; **contract** key): auto (the compute dtype) | fp8_e4m3 |
    #: fp8_e5m2 — every key (after the rotary embedding) and value the engine writes is divided by its scale,
    #: rounded to fp8 and multiplied back, as vLLM's ``kv_cache_dtype``. Native engine, fast path (Llama,
    #: Mistral, Qwen2, Qwen3), not in exact mode; train.kv_cache_aware makes the learner attend as it did
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    #: a quantized cache's scales (**contract** key): sync (per layer and KV head, for keys and for values, max|x| /
    #: the format's largest value over the real prompt tokens of the first batch after each weight sync: vLLM's
    #: calculate_kv_scales, refreshed at every refit) | one (scale 1: vLLM without calibrated scales)
    kv_cache_scales: Literal["sync", "one"] = "sync"
    #: a hybrid's or state-space model's recurrent state between decode steps (issue 54): fp32
    #: (transformers' reference kernels, and the learner's chunked scan, always) | model (rounded to the compute
    #: dtype after every step, as vLLM's mamba_ssm_cache_dtype=auto keeps it in a bf16 run). Native engine;
    #: a no-op in fp32; refused for attention-only models
    state_dtype: Literal["fp32", "model"] = "fp32"
    #: asynchronous off-policy RL (docs/async.md; **contract** key): the engine generates up to K batches
    #: ahead of the learner, so a sample is trained on by weights at most K updates newer than the ones
    #: that generated it. 0 = the synchronous loop. Native engine: a worker process of its own;
    #: vllm.mode server: requests in flight. Refused with a colocated vLLM and with exact mode
    max_staleness: int = Field(0, ge=0)
    #: when the weights a batch needs have not reached the engine: wait (default; batch j is generated
    #: with exactly version max(0, j − K)) | drop (generate with the newest weights the engine holds and
    #: drop groups more than K versions old, counted in staleness/dropped; verl's max_off_policy_strategy)
    stale_policy: Literal["wait", "drop"] = "wait"
    #: max_staleness ≥ 1 with the native engine: torch threads of the worker process (default: half of
    #: the run's ``threads``); the learner takes the rest
    worker_threads: int | None = Field(None, ge=1)
    #: max_staleness ≥ 1 with the native engine: seconds the trainer waits for one batch from a worker that
    #: is alive before it counts as stuck and the run stops (one line; the last checkpoint stays). Default:
    #: 10 × the slowest batch so far, at least 300 s (the first batch: 3600 s)
    worker_timeout_s: float | None = Field(None, gt=0)


class PolicyConfig(_Section):
    """The objective. ``None`` fields take the value of the ``algo`` preset
    (unison/algorithms/presets.py; formulas in docs/algorithms.md)."""

    #: advantage estimator: drgrpo (R − group mean), grpo (÷ group std), rloo (leave-one-out), batch_norm
    advantage: Literal["drgrpo", "grpo", "rloo", "batch_norm"] | None = None
    #: policy loss: ppo_clip, gspo, pg_seq_is, pg_seq_mis, pg_token_is, dppo_tv, dppo_kl, ipo
    loss: Literal["ppo_clip", "gspo", "pg_seq_is", "pg_seq_mis", "pg_token_is", "dppo_tv", "dppo_kl",
                  "ipo"] | None = None
    #: mismatch correction: none, token_tis, token_mis (IcePop), seq_tis, seq_mis, geo_rs, veto, m2po (AReaL's:
    #: M2PO's batch mask × the decoupled behaviour weight π_old/μ), m2po_mask (the mask alone). Refused with
    #: anchor bypass (ρ ≡ 1 there: it would do nothing)
    correction: Literal["none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_rs", "veto",
                        "m2po", "m2po_mask"] | None = None
    #: upper threshold C of the correction (token_tis 2, token_mis 2 — grpo_icepop 5 —, seq_tis 2, seq_mis 10,
    #: geo_rs 1.01); m2po: τ, the bound on the batch's mean (log π_old − log μ)² (0.04)
    correction_c: float | None = Field(None, gt=0)
    #: lower threshold of token_mis (0.5) and geo_rs (0.99)
    correction_c_low: float | None = Field(None, ge=0)
    #: m2po: a token whose behaviour weight π_old/μ exceeds this gets weight 0 (AReaL's rejection_sampling
    #: upper, token level, action mask: 5)
    correction_cap: float | None = Field(None, gt=0)
    #: veto: drop a response with any token ratio below this (1e-4)
    veto_threshold: float | None = Field(None, gt=0)
    #: PPO ε (ppo_clip 0.2); gspo: lower band 3e-4; dppo_tv: δ of the probability band (0.2);
    #: dppo_kl: δ of the binary-KL band (0.05); ipo: ε, the band on |π − π_old| in probability (0.1)
    clip: float | None = Field(None, gt=0, lt=1)
    #: upper clip ε when asymmetric (gspo 4e-4; None = same as clip)
    clip_high: float | None = Field(None, gt=0)
    #: pg_seq_mis: mask responses whose π(y)/μ(y) exceeds this (3); dppo_*, ipo: cap of the token ratio
    #: weight (None = no cap)
    loss_c: float | None = Field(None, gt=0)
    #: dppo_*, ipo: weight of the (log π − log π_old)² term (dppo_tv 1e-3, ipo 1e-3: prime-rl's kl_tau)
    kl_tau: float | None = Field(None, ge=0)
    #: token_mean | seq_mean_token_sum | seq_mean_token_mean | seq_mean_token_sum_norm (Dr.GRPO)
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                      "seq_mean_token_sum_norm"] | None = None
    #: which log π is π_old (docs/algorithms.md, "Anchors"): recompute (the learner's score pass, or the
    #: training forward itself with one mini-batch; AReaL's decoupled PPO with a correction) | bypass
    #: (log μ, no score pass: verl bypass_mode, prime-rl, SkyRL) | loglinear (AReaL's log-linear
    #: interpolation between μ and π_θ by policy version, no score pass). None = recompute
    anchor: Literal["recompute", "bypass", "loglinear"] | None = None
    #: shorthand for anchor: bypass
    bypass: bool = False


class SurgeConfig(_Section):
    """Paper B's decay-on-surge schedule (``train.schedule: surge_decay``); docs/lr-schedule.md."""

    #: what to watch: length (mean response length, Paper B) | mismatch (token k3) | grad_noise (noise-scale EMA)
    trigger: Literal["length", "mismatch", "grad_noise"] = "length"
    #: baseline_ratio (mean of the first `window` steps after warmup) | ema_ratio (signal / its EMA)
    detector: Literal["baseline_ratio", "ema_ratio"] = "baseline_ratio"
    #: baseline_ratio: steps averaged for the baseline
    window: int = Field(50, ge=1)
    #: fire when the (smoothed) signal is ≥ multiplier × baseline (or × EMA)
    multiplier: float = Field(3.0, gt=0)
    #: consecutive steps over the threshold needed to fire
    patience: int = Field(1, ge=1)
    #: baseline_ratio: steps the signal is smoothed over
    smooth: int = Field(5, ge=1)
    #: ema_ratio: EMA coefficient
    ema_alpha: float = Field(0.1, gt=0, le=1)
    #: ema_ratio: no firing during the first / after a firing for this many steps
    cooldown: int = Field(10, ge=0)
    #: decay period multiplier: T_decay = round(k · t_s)
    k: float = Field(1.8, gt=0)
    #: decay factor per period
    gamma: float = Field(0.5, gt=0, le=1)
    #: LR floor as a fraction of train.lr
    rho_min: float = Field(0.1, ge=0, le=1)
    #: count t from step 0 (start, the default) or from the surge step (surge)
    count_from: Literal["start", "surge"] = "start"
    #: fix the surge step by hand (ablations); the detector is then ignored
    trigger_step: int | None = Field(None, ge=1)


class MismatchBudgetConfig(_Section):
    """``train.schedule: mismatch_budget`` (docs/lr-schedule.md): after each step the LR factor f is
    multiplied by ``down`` when the metric is above ``target``, by ``up`` (f capped at 1, the base LR)
    when it is below half of it; η = train.lr · f, never below ``min_ratio`` · train.lr. f starts at ``start``."""

    #: the metric watched; null = mismatch/k3, or mismatch/staleness_k3 when rollout.max_staleness ≥ 1
    #: (then measured every step instead of every mismatch.decompose_every)
    metric: str | None = None
    #: the mismatch the run may carry (token k3)
    target: float = Field(1e-2, gt=0)
    #: factor per step above the target (< 1)
    down: float = Field(0.7, gt=0)
    #: factor per step below half the target (> 1)
    up: float = Field(1.1, gt=0)
    #: the LR floor as a fraction of train.lr
    min_ratio: float = Field(0.1, gt=0, le=1)
    #: f at step 1: 1 = the full LR from the start; lower = the run earns its LR (f rises by ``up`` each step the
    #: metric stays below half the target), so the first updates — made before any mismatch can be measured on
    #: samples they produced — are small (docs/experiments/demo_recipe.md: what K = 4 staleness needs)
    start: float = Field(1.0, gt=0, le=1)

    @field_validator("down")
    @classmethod
    def _down(cls, v):
        if v >= 1:
            raise ValueError(f"train.mismatch_budget.down must be below 1 (it lowers the LR), got {v}")
        return v

    @field_validator("up")
    @classmethod
    def _up(cls, v):
        if v <= 1:
            raise ValueError(f"train.mismatch_budget.up must be above 1 (it raises the LR back), got {v}")
        return v

    @model_validator(mode="after")
    def _start(self):
        if self.start < self.min_ratio:
            raise ValueError(f"train.mismatch_budget.start ({self.start}) is below its floor min_ratio "
                             f"({self.min_ratio}): raise start or lower min_ratio")
        return self


class TrainConfig(_Section):
    steps: int = Field(40, ge=1)
    lr: float = Field(1e-4, gt=0)
    #: prompts sampled per step (× rollout.n responses)
    prompts_per_step: int = Field(16, ge=1)
    #: optimizer steps per rollout batch (Paper A: 4); the batch is split into this many mini-batches
    mini_batches: int = Field(1, ge=1)
    #: rows per forward/backward (gradient accumulation inside a mini-batch)
    micro_batch_size: int = Field(32, ge=1)
    #: token budget of a micro-batch (verl's ppo_max_token_len_per_gpu): rows are grouped by length,
    #: longest first, into micro-batches of at most this many tokens (rows × the micro-batch's own
    #: longest row, to which it is cut) and at most micro_batch_size rows. Bounds the activation memory
    #: whatever the response lengths (SmolLM2, fp32, 8 × 4 × 128 tokens: the run peaks at 5.4 GiB at 512,
    #: 6.4 at 1024, 13.5 at 4096, step times within noise: benchmarks/trl_compare.py and docs/benchmarks.md). GPUs have
    #: the memory for far more (verl sizes it per GPU, e.g. 16384). null = micro_batch_size rows at the whole
    #: batch's width (the numerics of unison ≤ 0.1 before this key). Ignored in exact mode (its layout is fixed)
    micro_batch_tokens: int | None = Field(512, ge=1)
    #: padding-free packing: the responses of a micro-batch back to back in one row, positions restarted,
    #: one causal sdpa call per response (no [T, T] mask; eager models such as Gemma 2 use transformers'
    #: block-diagonal mask); the token budget then counts the rows' own tokens. Pays where rows differ
    #: in length and budgets are large (GPUs); at the 512 default on CPU it changes little
    #: (benchmarks/packing.py). MoE models and exact mode keep padded rows (the run says so at start)
    packing: bool = False
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    #: constant | warmup (linear warmup, then constant) | cosine (warmup, then cosine to min_lr_ratio)
    #: | surge_decay (Paper B: step decay after a response-length surge; see train.surge)
    #: | mismatch_budget (the LR follows the measured mismatch; see train.mismatch_budget)
    schedule: Literal["constant", "warmup", "cosine", "surge_decay", "mismatch_budget"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    #: DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage)
    drop_uniform_groups: bool = False
    #: with drop_uniform_groups, sample more prompts (up to this many extra rounds) to refill the batch
    oversample_rounds: int = Field(0, ge=0)
    #: evaluate on the held-out split every N steps (0 = never); greedy decoding
    eval_every: int = Field(0, ge=0)
    surge: SurgeConfig = SurgeConfig()
    mismatch_budget: MismatchBudgetConfig = MismatchBudgetConfig()
    #: gradient-noise telemetry (McCandlish et al.) from micro-batch gradients; needs ≥ 2
    #: micro-batches per optimizer step
    grad_noise: bool = True
    #: EMA coefficient of the noise-scale estimate
    grad_noise_ema: float = Field(0.1, gt=0, le=1)
    #: positions per chunk of the output layer when computing log-probs (0 = all at once): the
    #: [positions, vocab] logits never exist for more than this many positions at a time
    logprob_chunk: int = Field(512, ge=0)
    #: recompute each decoder layer's activations in the backward pass instead of keeping them
    #: (activation checkpointing): far less memory for long sequences, ~30% more compute
    activation_checkpointing: bool = False
    #: quantization-aware learner (needs rollout.quantization ≠ none, the native engine): every weight the
    #: engine quantizes is, in the learner's forward (score pass and training pass), the same quantizer's
    #: output, with a straight-through gradient to the fp32 master — π is the quantized policy μ samples
    #: from (verl NVFP4 QAT, NeMo RL QARL, SkyRL FakeInt4Qat). Parameters, optimizer and checkpoints stay
    #: the fp32 masters. With LoRA the merged weight W + (α/r)·B·A is what is quantized (what the engine
    #: holds); under FSDP2 the gathered weight; exact mode with a quantized rollout needs it
    quantization_aware: bool = False
    #: the learner replays a quantized KV cache (rollout.kv_cache_dtype ≠ auto): its attention's keys and values
    #: quantized with the scales each row's cache held (straight through), in the score pass and the training pass,
    #: so π attends over what μ attended over. Not with activation_checkpointing (its recompute would not replay)
    kv_cache_aware: bool = False
    #: with one mini-batch (one optimizer step per rollout, θ = θ_old), take log π_old and the
    #: mismatch from the training forward instead of a separate score pass (one forward fewer)
    fuse_score_pass: bool = True
    #: warn once when this many consecutive steps had nothing to learn from (every group's rewards
    #: equal, or a zero gradient), with the likely cause; 0 = never
    no_signal_steps: int = Field(5, ge=0)


class Config(_Section):
    """A training run."""

    seed: int = 0
    #: fp32 | bf16 | fp16 for both engines
    precision: str = "fp32"
    #: override for the rollout engine only
    rollout_precision: str | None = None
    #: override for the learner only
    learner_precision: str | None = None
    #: rollout engine: native (built-in KV-cache sampler) | vllm (needs vLLM installed; options in `vllm`)
    engine: str = "native"
    #: exact mode (docs/exact.md): the native engine and the learner share one forward and one
    #: layout, so log μ == log π_old == log π_θ bit for bit (native engine; Llama/Mistral/Qwen2/Qwen3)
    exact: bool = False
    #: preset (unison/algorithms/presets.py): grpo, grpo_token_tis, grpo_seq_mis, gspo,
    #: pg_seq_is, pg_seq_mis, pg_token_is, dppo_tv, dppo_kl, grpo_icepop, ipo, grpo_m2po, grpo_m2po_mask,
    #: opd (on-policy distillation: needs distill.teacher)
    algo: str = "grpo"
    #: local HF model directory, or builtin:tiny
    model: str = "builtin:tiny"
    device: str = "cpu"
    #: torch threads of every process unison runs (unison/threads.py; CLI --threads): auto (default)
    #: honours OMP_NUM_THREADS / MKL_NUM_THREADS and a torch.set_num_threads the calling program made,
    #: else measures at start — the cores this process may use (divided among torchrun's local ranks),
    #: how many of them other processes leave idle, and the model's size (under 10M parameters: 1,
    #: its ops are too small for more) — or N threads. The choice and its reason are printed at start.
    #: The async worker takes rollout.worker_threads of it. --resume may change it
    threads: int | str = "auto"
    #: the library of the CPU's fp32 matmuls (unison/gemm.py): auto (default) measures BLAS against oneDNN
    #: at start on the model's shapes, for the learner (micro-batch rows) and the native engine (a decode step's
    #: rows, weights pre-packed) apart, and takes oneDNN for a role when it is ≥ 1.3× faster there (models under
    #: 10M parameters, CUDA and torchrun jobs: blas) | blas (torch's default) | onednn | LEARNER/ENGINE (e.g.
    #: blas/onednn). The choice is printed at start and written to the run's config.yaml, so --resume keeps it
    gemm: str = "auto"
    #: Inductor compilation of the layers (unison/compilation.py): auto (default: follows this machine's kept
    #: measurement of the run's shape, eager at no cost where there is none) | measure (one layer timed at start at
    #: the run's shapes; a side compiles where it ran ≥ 1.2× faster compiled and the time saved over the run exceeds
    #: the compile; kept per machine and model in $UNISON_HOME (~/.cache/unison) for auto; under 10M parameters,
    #: exact mode, torchrun and CUDA: off) | on (the native engine's layers and the learner's) | off | engine |
    #: learner. A compiled side rounds differently from an eager one: probe --compile and the ledger's compile term
    #: measure it. exact mode refuses on/engine/learner. The choice is printed at start and written to config.yaml
    #: (--resume keeps it)
    compile: str = "auto"
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    policy: PolicyConfig = PolicyConfig()
    train: TrainConfig = TrainConfig()
    scaler: ScalerConfig = ScalerConfig()
    sft: SFTConfig = SFTConfig()
    distill: DistillConfig = DistillConfig()
    vllm: VLLMConfig = VLLMConfig()
    distributed: DistributedConfig = DistributedConfig()
    moe: MoEConfig = MoEConfig()
    lora: LoRAConfig = LoRAConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mismatch: MismatchConfig = MismatchConfig()
    log: LogConfig = LogConfig()

    @field_validator("precision", "rollout_precision", "learner_precision", "engine")
    @classmethod
    def _named(cls, v, info):
        """A named value through its rule (unison/config/values.py); a precision override may be unset."""
        return None if v is None else _RULES[info.field_name](v)

    @field_validator("threads", "gemm", "compile", mode="before")
    @classmethod
    def _named_raw(cls, v, info):
        """``threads``, ``gemm`` and ``compile`` read the raw value (an int, a bool or a string)."""
        return _RULES[info.field_name](v)


_RULES = {"precision": parse_precision, "rollout_precision": parse_precision, "learner_precision": parse_precision,
          "engine": parse_engine, "threads": parse_threads, "gemm": parse_gemm, "compile": parse_compile}
