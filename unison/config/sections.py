"""The smaller sections of the training configuration's typed tree (:mod:`unison.config.schema` holds the root, the
task, the rollout, the policy and the training loop): vLLM, torchrun, LoRA, MoE, SFT, distillation, the fp16 loss
scaler, checkpoints, the mismatch telemetry, logging. A leaf, as the schema is. Every key: docs/config.md."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class VLLMConfig(_Section):
    """Options of ``engine: vllm`` (docs/engines.md). GPU options are UNTESTED until run on a GPU."""

    #: colocate: an in-process vllm.LLM (one per torchrun rank: external_launcher) | server: a running
    #: `vllm serve` at `url`
    mode: Literal["colocate", "server"] = "colocate"
    #: server: base URL, e.g. http://localhost:8000
    url: str | None = None
    #: server: how weights reach it after each update — disk (safetensors in sync_dir, reloaded by the
    #: server) | nccl (vLLM's weight-transfer API, GPU) | auto (nccl on CUDA, else disk)
    weight_sync: Literal["auto", "disk", "nccl"] = "auto"
    #: server + disk: a directory the server can read (default: OUT/weight_sync)
    sync_dir: str | None = None
    #: server: seconds one request may take, and retries before the run stops with an error
    request_timeout_s: float = Field(600.0, gt=0)
    retries: int = Field(3, ge=0)
    #: colocate + enable_sleep_mode: 1 offloads the weights to CPU memory, 2 drops them (the sync reloads)
    sleep_level: Literal[1, 2] = 2

    #: fraction of GPU memory vLLM may take (GPU only; default 0.6 with sleep mode, which frees it
    #: during every update, else 0.3)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    #: tensor-parallel degree (GPU only)
    tensor_parallel_size: int = Field(1, ge=1)
    #: sleep mode for training colocated on the same GPU (default: on on GPUs, off on CPUs)
    enable_sleep_mode: bool | None = None
    #: context length vLLM reserves for (default: the run's longest request, prompt + max_new_tokens)
    max_model_len: int | None = Field(None, ge=1)


class DistributedConfig(_Section):
    """``torchrun`` + FSDP2 (docs/distributed.md). Only meaningful under ``torchrun``: setting a
    key in a single process is refused. ``None`` = the default named here."""

    #: compute (default): parameters all-gathered in the learner's compute dtype
    #: (MixedPrecisionPolicy, fp32 reduction; verl's and Paper A's setup) | fp32: fp32 parameters
    #: under autocast, the numerics of one process (the default with train.quantization_aware, which
    #: quantizes the gathered weight: it must be the fp32 master the engine quantizes; compute is refused there)
    param_dtype: Literal["compute", "fp32"] | None = None
    #: seconds any collective may wait before the job fails (a rank that died): default 600
    timeout_s: float | None = Field(None, gt=0)


class LoRAConfig(_Section):
    """LoRA adapters via PEFT (``rank`` > 0): the learner trains only the adapters (fp32); the
    rollout engine gets the merged weights W + (α/r)·B·A after each update; checkpoints hold
    the adapters in PEFT's format."""

    #: adapter rank; 0 = full fine-tuning (Paper A's LoRA recipe: 1)
    rank: int = Field(0, ge=0)
    #: scaling numerator: the update is (alpha / rank)·B·A (Paper A: 2)
    alpha: float = Field(16.0, gt=0)
    #: dropout on the adapter input, in training forwards only (0 keeps π_θ = π_old exactly); with it π_old comes
    #: from a score pass without dropout, and the anchors that read the training forward (bypass, loglinear) refuse
    dropout: float = Field(0.0, ge=0, lt=1)
    #: module names to adapt (suffixes, e.g. [q_proj, v_proj]) or "all-linear"
    target_modules: list[str] | str = "all-linear"


class MoEConfig(_Section):
    """Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE); ignored for dense models."""

    #: the learner uses the rollout engine's expert choices (Rollout Routing Replay); the weights
    #: are the learner's own router probabilities at those experts
    routing_replay: bool = False
    #: weight of the router's load-balancing loss in RL (off by default: RL rewards, not balance,
    #: should move the router; the model's config value, e.g. 0.001, restores pre-training behaviour)
    aux_loss_coef: float = Field(0.0, ge=0)


class SFTConfig(_Section):
    """Supervised warm start (``unison sft``): prompt -> reference answer + EOS."""

    steps: int = Field(600, ge=1)
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(64, ge=1)
    #: cosine-decay the LR to this fraction of ``lr`` over the steps
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class DistillConfig(_Section):
    """On-policy distillation (``algo: opd``, or any token-level loss): a teacher scores every sampled token
    and the per-token reverse KL −coef·(log π_old − log π_teacher) is the advantage (unison/algorithms/distill.py)."""

    #: the teacher: any model unison loads (a local HF directory, a .gguf file, builtin:NAME) with the
    #: student's tokenizer; None: no distillation
    teacher: str | None = None
    #: weight of the reverse-KL advantage (sampled) or of the reverse-KL loss term (full)
    coef: float = Field(1.0, ge=0)
    #: how the reverse KL KL(π ‖ π_T) enters the update: ``sampled`` — the per-token advantage −coef·(log π_old −
    #: log π_T) of the sampled token, through the policy loss (the recipe of Thinking Machines' on-policy
    #: distillation and verl/TRL); ``full`` — the exact per-position KL over the whole vocabulary, Σ_v π(v|s)(log π(v|s)
    #: − log π_T(v|s)), against the teacher's logits, minimised directly (coef · w_t · KL_t per response token, w_t the
    #: correction's weight; chunked over positions as the log-probs are). ``full`` needs the teacher in this process
    #: (no distill.teacher_url, no torchrun), the padded layout (no train.packing, no exact) and the student's
    #: vocabulary size
    estimator: Literal["sampled", "full"] = "sampled"
    #: add the task's advantage (its reward, group-baselined) to every token's, or train on the teacher alone
    task_reward: bool = False
    #: a vLLM server serving the teacher (`vllm serve TEACHER`, e.g. http://localhost:8001): the teacher's token
    #: log-probs come from its prompt_logprobs instead of unison's own fp32 scoring pass; ``teacher`` still names
    #: a local copy (the tokenizer is checked against it, and the ledger's teacher term compares the two paths).
    #: Needs rollout.temperature 1 (prompt log-probs are the model's raw distribution)
    teacher_url: str | None = None


class ScalerConfig(_Section):
    """Dynamic loss scaling, active exactly when the learner computes in fp16."""

    init_scale: float = Field(2.0**16, gt=0)
    growth_interval: int = Field(400, ge=1)


class CheckpointConfig(_Section):
    """Checkpoints (docs/cli.md, "Nothing lost"): periodic, at the end, and on SIGTERM / Ctrl-C."""

    #: save every N steps (0 = by time only)
    every: int = Field(0, ge=0)
    #: also save when this many minutes have passed since the last checkpoint (0 = by steps only)
    every_minutes: float = Field(10.0, ge=0)
    #: checkpoints kept (older ones are deleted); 2 lets --resume fall back past a damaged newest one
    keep: int = Field(2, ge=1)


class MismatchConfig(_Section):
    """Mismatch telemetry beyond the per-step ``mismatch/*`` metrics."""

    #: every N steps, split the mismatch of off-policy samples into numerics and staleness
    #: (``mismatch/numeric_k3``: μ vs the learner under the weights that generated the sample;
    #: ``mismatch/staleness_k3``: those weights vs π_old) — one extra score pass per older version in
    #: the batch (≈ one forward more on that step); 0 = off. Free when every sample is on-policy.
    #: The mismatch ledger (below) runs on the same steps
    decompose_every: int = Field(10, ge=0)
    #: the mismatch ledger (docs/ledger.md): on decompose steps the sampled tokens are scored along a chain
    #: from log μ to log π_old — decode, engine, quantization, truncation, routing, staleness — whose k1 terms
    #: add up to mismatch/k1 (``ledger/<term>_k1``, ``_k3``, a console line, a plot; a stale engine warns).
    #: auto: every term this run can measure (the others merged into a neighbour, said at start) | on: refuse
    #: a run in which a term cannot be measured | off: no ledger. One scoring pass per term present
    ledger: Literal["auto", "on", "off"] = "auto"

    @field_validator("ledger", mode="before")
    @classmethod
    def _yaml_on_off(cls, v):  # YAML 1.1 reads a bare on / off as a boolean
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class LogConfig(_Section):
    #: write TensorBoard event files when the tensorboard package is installed
    tensorboard: bool = True
    #: log to wandb in offline mode when wandb is installed
    wandb: bool = False
    #: print a line per step
    console: bool = True
    #: write every trained-on completion (prompt and response text, token ids, reward, finish
    #: reason, Σ log μ) to rollouts/step_NNNNNN.jsonl — for reading samples and offline analysis;
    #: multi-turn episodes also turn by turn (``turns``: whose tokens — the model's or the environment's —
    #: each span holds) and as messages; the run's report.md then shows the newest step's episodes
    rollouts: bool = False
    #: per-token records for `unison view` (tokens/step_N.json): each step, up to this many responses — those of
    #: largest mismatch — with every token's log μ, log π_old, version, correction weight and, on ledger steps, the
    #: ledger's terms; 0 = off
    tokens: int = Field(32, ge=0)
    #: the last this many steps' records are kept whole; before them only every ``tokens_thin``-th step's
    tokens_recent: int = Field(100, ge=1)
    tokens_thin: int = Field(10, ge=1)
