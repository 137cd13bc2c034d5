"""How each side computes log-probabilities: one :class:`Side` for the rollout engine (μ), one for the learner (π).

Every numerics knob of a run is a field of a Side, decided once at start (``machine.decide``: the
:class:`Machine`) and never re-derived from a config string afterwards:

* ``dtype`` — the compute precision; ``params`` — the learner's parameters as fp32 masters under autocast
  (``fp32``) or cast to ``dtype`` for the forward (``compute``, FSDP2's mixed precision);
* ``quantization`` and ``group_size`` — the weight format (``rollout.quantization``; the learner's is the
  engine's under ``train.quantization_aware``, else ``none``);
* ``kv_cache`` and ``kv_scales`` — the attention cache's format and its scales (``rollout.kv_cache_dtype``,
  ``rollout.kv_cache_scales``; the learner's is the engine's under ``train.kv_cache_aware``, else ``auto``);
* ``state`` — a recurrent model's state between decode steps (``rollout.state_dtype``: ``fp32`` or ``model``, the
  compute dtype); the learner's chunked scan keeps fp32 (transformers' kernels), so a rounded state is part of the
  ledger's ``decode`` term;
* ``support_replay`` — log-probs over the support each token was sampled from (the engine's own, always; the
  learner's with ``rollout.replay_sampling_mask``); ``routing_replay`` — MoE experts as the engine chose them
  (the engine's own, always; the learner's with ``moe.routing_replay``);
* ``compiled`` — Inductor's layers (``compile``); ``gemm`` — the fp32 matmul library (``gemm``); ``exact`` —
  the one forward both sides share (exact mode).

Where the two Sides differ is where their log-probabilities part: :meth:`Side.differs` names the mismatch
ledger's terms in the chain's order, and the ledger walks from the learner "as the engine ran" to the learner
one knob at a time (:meth:`Side.toward`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

#: the ledger's knob terms, in the chain's order, and the fields of a Side each one changes
KNOBS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("quantization", ("quantization", "group_size")),
    ("kv_cache", ("kv_cache", "kv_scales")),
    ("truncation", ("support_replay",)),
    ("routing", ("routing_replay",)),
    ("compile", ("compiled",)),
)

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Side:
    """One engine's numerics (module docstring). The defaults: fp32, full-precision weights, log-probs over the
    sampled support (where the batch records one), the model's own MoE routing, eager, BLAS."""

    dtype: torch.dtype = torch.float32
    quantization: str = "none"
    group_size: int = 64
    kv_cache: str = "auto"
    kv_scales: str = "sync"
    state: str = "fp32"
    support_replay: bool = True
    routing_replay: bool = False
    compiled: bool = False
    gemm: str = "blas"
    exact: bool = False
    params: str = "fp32"

    @classmethod
    def of(cls, side_or_dtype) -> Side:
        """A Side, or a bare ``torch.dtype`` as the plain Side of that precision (the short form for an engine of
        nothing but a dtype)."""
        return side_or_dtype if isinstance(side_or_dtype, Side) else cls(dtype=side_or_dtype)

    @property
    def precision(self) -> str:
        return _NAMES.get(self.dtype, str(self.dtype))

    @property
    def cast_params(self) -> bool:
        """Parameters cast to the compute dtype for the forward (not fp32 masters under autocast)."""
        return self.params == "compute" and self.dtype != torch.float32

    @property
    def rounds_state(self) -> bool:
        """The recurrent state is rounded to the compute dtype between decode steps (``state`` model, not fp32)."""
        return self.state == "model" and self.dtype != torch.float32

    def differs(self, other: Side, *, truncated: bool = True, moe: bool = True) -> list[str]:
        """The knob terms of the mismatch ledger from this side (the engine) to ``other`` (the learner), in the
        chain's order: ``quantization``, ``kv_cache``, ``truncation`` (only where sampling ``truncated`` the support),
        ``routing`` (only for a ``moe`` model), ``compile``. The rest — dtype, parameter cast, matmul library — is
        what the ledger's ``engine`` term measures with the kernels."""
        out = []
        for term, fields in KNOBS:
            if (term == "truncation" and not truncated) or (term == "routing" and not moe):
                continue
            if any(getattr(self, f) != getattr(other, f) for f in fields):
                out.append(term)
        return out

    def toward(self, other: Side, *terms: str) -> Side:
        """This side with the fields of ``terms`` (:data:`KNOBS`' names) taken from ``other``."""
        fields = {f: getattr(other, f) for term, fs in KNOBS if term in terms for f in fs}
        return replace(self, **fields)

    def describe(self) -> str:
        """The start-up phrase: the precision and every knob away from its plain value."""
        parts = [self.precision + (" (parameters cast)" if self.cast_params else "")]
        if self.quantization != "none":
            parts.append(f"{self.quantization}{f' g{self.group_size}' if self.quantization == 'int4' else ''} weights")
        if self.kv_cache != "auto":
            parts.append(f"{self.kv_cache} KV cache ({self.kv_scales} scales)")
        if self.rounds_state:
            parts.append(f"{self.precision} recurrent state")
        if self.exact:
            parts.append("exact")
        if self.compiled:
            parts.append("compiled")
        if self.gemm != "blas":
            parts.append(f"{self.gemm} matmuls")
        return ", ".join(parts)


def config_sides(cfg, prec, world_size: int = 1, gemm: tuple[str, str] = ("blas", "blas"),
                 compiled: tuple[bool, bool] = (False, False)) -> tuple[Side, Side]:
    """``(engine, learner)`` Sides of a training config, given its resolved precision ``prec``
    (:class:`unison.precision.Precision`) and the machine's decisions: the matmul library and compilation of each
    side (``machine.decide``). Under torchrun the learner's parameters are cast as ``distributed.param_dtype`` says
    (unset: ``compute``, but fp32 under the quantization-aware learner, which quantizes the master FSDP2 gathers)."""
    r, t = cfg.rollout, cfg.train
    engine = Side(dtype=prec.rollout_dtype, quantization=r.quantization, group_size=r.quant_group_size,
                  kv_cache=r.kv_cache_dtype, kv_scales=r.kv_cache_scales, state=r.state_dtype, support_replay=True,
                  routing_replay=True, compiled=compiled[0], gemm=gemm[0], exact=cfg.exact)
    params = "fp32"
    if world_size > 1:
        params = cfg.distributed.param_dtype or ("fp32" if t.quantization_aware else "compute")
    learner = Side(dtype=prec.learner_dtype, quantization=r.quantization if t.quantization_aware else "none",
                   group_size=r.quant_group_size, kv_cache=r.kv_cache_dtype if t.kv_cache_aware else "auto",
                   kv_scales=r.kv_cache_scales, support_replay=r.replay_sampling_mask,
                   routing_replay=cfg.moe.routing_replay, compiled=compiled[1], gemm=gemm[1], exact=cfg.exact,
                   params=params)
    return engine, learner


@dataclass(frozen=True)
class Machine:
    """What a process decided about the machine before it loaded a model (``machine.decide``): its torch threads
    (:class:`unison.threads.Threads`), each side's numerics, and the decisions behind them with their reasons —
    the matmul library (:class:`unison.gemm.Gemm`), the compilation (:class:`unison.compilation.Compilation`) — and
    the model's sizes they were read from. Each decision prints as its start-up phrase; ``config.yaml`` records the
    settings that reproduce them (``gemm``, ``compile``), so that ``--resume`` computes as the run began."""

    threads: object
    engine: Side
    learner: Side
    gemm: object = None
    compilation: object = None
    sizes: object = None

    def describe(self) -> str:
        return f"engine {self.engine.describe()}; learner {self.learner.describe()}"
