"""The policy π: the learner's model and how it scores batches — loaded (rank 0 reads it under torchrun), LoRA adapters
injected, the rollout's quantizer on its forward, exact mode's shared forward, sharded by FSDP2, compiled. Its
numerics are one :class:`~unison.sides.Side` (dtype, parameter cast, quantizer, support and routing replay,
compilation, exact); :meth:`Scorer.as_side` scores under another for a while (the mismatch ledger's chain, the
probe's variants). The log-probabilities themselves: unison/logprobs.py. :class:`unison.learner.Learner` adds the
update.

Numerics, one process and ``torchrun`` + FSDP2 alike (docs/distributed.md): one process keeps fp32 parameters
under ``torch.autocast`` in the compute dtype; FSDP2 (``fully_shard`` per decoder layer + root) all-gathers them in
the compute dtype (``distributed.param_dtype: compute``, verl's and Paper A's setup) or keeps fp32 under autocast
(``fp32``, the one-process numerics).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from unison import kvcache
from unison import lora
from unison import lora as adapters
from unison import moe
from unison.batch import RolloutBatch, micro_batches
from unison.distributed import Dist, current, decoder_layers, full_tensor, shard
from unison.errors import UnisonError
from unison.exact_ssm import exact_forward
from unison.exact import learner_logprobs
from unison.logprobs import DEFAULT_CHUNK, PolicyForward, token_logprobs
from unison.models import is_recurrent, load_model, model_shell, use_packed_attention
from unison.quant import QuantizationAware
from unison.rollout.decode import no_duck_sizing
from unison.sides import Side


@dataclass(frozen=True)
class ScoringOptions:
    """How a scorer batches and runs its forwards (none of it changes a log-probability): the device, the sampling
    temperature it scores at, micro-batches (``train.micro_batch_size`` rows, or a ``train.micro_batch_tokens``
    budget), the output layer's chunk, packing, activation checkpointing, and the MoE load-balancing loss weight."""

    device: str = "cpu"
    temperature: float = 1.0
    micro_batch_size: int = 16
    micro_batch_tokens: int | None = None
    logprob_chunk: int = DEFAULT_CHUNK
    packing: bool = False
    activation_checkpointing: bool = False
    aux_loss_coef: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> ScoringOptions:
        t = cfg.train
        return cls(cfg.device, cfg.rollout.temperature, t.micro_batch_size, t.micro_batch_tokens, t.logprob_chunk,
                   t.packing, t.activation_checkpointing, cfg.moe.aux_loss_coef)


class Scorer:
    """The policy π in fp32 masters, computing as its :class:`~unison.sides.Side` says; scores batches
    (:meth:`score`) and exports its weights (:meth:`export_weights`). ``lora``: the config's LoRA section (adapters
    when its rank is above 0)."""

    def __init__(self, model_dir: str | Path, side: Side | None = None, options: ScoringOptions | None = None,
                 lora=None, dist: Dist | None = None):
        side, options = side or Side(), options or ScoringOptions()
        self.model_dir, self.options = Path(model_dir), options
        self.dist = dist or current()
        self.device = self.dist.device if self.dist.enabled else torch.device(options.device)
        self.temperature = options.temperature
        #: under torchrun only rank 0 reads the weights; the others build the model on the meta device and
        #: receive their shards from rank 0 after sharding (one host copy per job, not one per rank)
        shell = self.dist.enabled and not self.dist.is_main
        self.model = model_shell(self.model_dir, for_training=True) if shell else \
            load_model(self.model_dir, dtype=torch.float32, device=str(self.device))  # masters
        self.peft = None
        if lora is not None and lora.rank > 0:  # adapters injected in place; only they train
            self.peft = adapters.apply(self.model, lora, self.model_dir)
        self.forward_module = PolicyForward(self.model, aux_loss_coef=options.aux_loss_coef)
        #: exact mode: the forward shared with the native engine (unison/exact.py)
        self.exact = _exact_forward(self.model, self.dist, self.peft) if side.exact else None
        #: the rollout's quantizer on the forward (unison/quant.py), one per (format, group size) asked for; the
        #: side's own is on, others only under :meth:`as_side`
        self._quantizers: dict[tuple[str, int], object] = {}
        #: MoE: record the learner's expert choices (router disagreement); replay the rollout's
        self.moe = bool(moe.routers(self.model))
        #: several responses per row without padding (train.packing), and why it does less than asked here
        #: (None: one attention call per packed response)
        self.packing, self.packing_note = packing_plan(self.model, options.packing, self.moe, side.exact)
        if options.activation_checkpointing:
            for layer in decoder_layers(self.model):
                _checkpoint_layer(layer)
        self.sharded = self.dist.enabled
        #: a quantization-aware learner with LoRA merges its own adapters into what it quantizes
        self._merges_own_adapters = self.peft is not None and side.quantization != "none"
        self.side = Side(dtype=side.dtype, params=side.params, exact=side.exact, gemm=side.gemm,
                         routing_replay=False)  # the plain forward; :meth:`_apply` puts the side's knobs on
        self._apply(side)
        if self.sharded:
            full = {k: v for k, v in self.model.state_dict().items()} if not shell else {}
            shard(self.forward_module, decoder_layers(self.model), self.dist,
                  param_dtype=side.dtype if side.cast_params else None)
            if shell:
                self.forward_module.to_empty(device=self.device)
            self.load_full_state_dict(full)  # rank 0's weights, broadcast shard by shard
            del full
            import torch.distributed as tdist

            for _, buf in sorted(self.forward_module.named_buffers()):  # rotary tables etc. (not in the state dict)
                tdist.broadcast(buf, src=0)

    # ---------------------------------------------------------------- batching (ScoringOptions), settable
    def _set_option(self, **kw) -> None:
        self.options = replace(getattr(self, "options", None) or ScoringOptions(), **kw)

    micro_batch_size = property(lambda self: self.options.micro_batch_size,
                                lambda self, v: self._set_option(micro_batch_size=v))
    micro_batch_tokens = property(lambda self: self.options.micro_batch_tokens,
                                  lambda self, v: self._set_option(micro_batch_tokens=v))
    logprob_chunk = property(lambda self: self.options.logprob_chunk, lambda self, v: self._set_option(logprob_chunk=v))

    # ---------------------------------------------------------------- numerics
    @property
    def compute_dtype(self) -> torch.dtype:
        return self.side.dtype

    @property
    def qat(self):
        """The quantizer on the forward now (``train.quantization_aware`` or :meth:`as_side`), or None."""
        if self.side.quantization == "none":
            return None
        return self._quantizers.get((self.side.quantization, self.side.group_size))

    @property
    def quantization_aware(self) -> bool:
        return self.side.quantization != "none"

    @property
    def routing_replay(self) -> bool:
        return self.side.routing_replay and self.moe

    @property
    def compiled(self) -> bool:
        return self.side.compiled

    def quantizer(self, fmt: str, group_size: int):
        """The quantizer of ``fmt`` on this scorer's forward (made, switched off, the first time asked)."""
        key = (fmt, group_size)
        if key not in self._quantizers:
            self._quantizers[key] = QuantizationAware(self.model, fmt, group_size)
            self._quantizers[key].enabled = False
        return self._quantizers[key]

    def _apply(self, side: Side) -> None:
        """Compute as ``side`` from now on: its quantizer on and the others off, its layers compiled or eager. The
        exact forward and, when sharded, the parameter cast are fixed when the scorer is built."""
        if side.exact != (self.exact is not None):
            raise ValueError("a scorer's exact forward is decided when it is built")
        if self.sharded and side.cast_params != self.side.cast_params:
            raise ValueError("FSDP2 casts the parameters as it was built: another parameter dtype needs another scorer")
        active = self.quantizer(side.quantization, side.group_size) if side.quantization != "none" else None
        for q in self._quantizers.values():
            q.enabled = q is active
        if side.kv_cache != "auto":  # the attention that replays a quantized cache (a no-op outside the replay)
            kvcache.wrap_attention(self.model)
        if side.compiled != self.side.compiled or (side.compiled and not _is_compiled(self.model)):
            for layer in decoder_layers(self.model):
                if side.compiled and getattr(layer, "_unison_compiled", None) is None:
                    _compile_layer(layer)
                layer._compiled_call_impl = layer._unison_compiled if side.compiled else None
        self.side = side

    @contextlib.contextmanager
    def as_side(self, side: Side):
        """Score as ``side`` while the context is open (the mismatch ledger's "as the engine ran", the probe's
        variants), then as before."""
        saved = self.side
        self._apply(side)
        try:
            yield self
        finally:
            self._apply(saved)

    # ---------------------------------------------------------------- forward
    def _numerics(self):
        """(autocast dtype, parameter cast) of the learner's forward: fp32 parameters under autocast,
        or parameters cast to the compute dtype (FSDP2 casts itself when sharded)."""
        if not self.side.cast_params:
            return self.side.dtype, None
        return torch.float32, (None if self.sharded else self.side.dtype)

    def _packed_forward(self, batch: RolloutBatch, rows: torch.Tensor, W: int, return_entropy: bool):
        """``train.packing``: the micro-batch's rows without their padding, one after another in a single
        row, positions restarting at each; log π scattered back into the [rows, W] layout."""
        lens = batch.attention_mask[rows, :W].sum(-1)
        keep = torch.arange(W)[None, :] < lens[:, None]
        tokens = batch.tokens[rows, :W][keep][None]
        pos = (keep.long().cumsum(-1) - 1)[keep][None]
        resp = batch.response_mask[rows, :W][keep][None]
        support = self._support(batch, rows, W)
        dt, cast = self._numerics()
        segments = torch.arange(len(rows))[:, None].expand(-1, W)[keep]  # the row of each packed position
        with self._kv_replay(batch, rows, segments):
            lp, ent = token_logprobs(self.forward_module, tokens, None, self.temperature, dt, self.device,
                                     return_entropy=True, positions=resp, chunk=self.options.logprob_chunk,
                                     cast_to=cast, position_ids=pos,
                                     support=support[keep][None] if support is not None else None)
        keep = keep.to(lp.device)
        out = torch.zeros((len(rows), W), dtype=lp.dtype, device=lp.device).masked_scatter(keep, lp[0])
        if not return_entropy:
            return out
        return out, torch.zeros_like(out).masked_scatter(keep, ent[0])

    def _support(self, batch: RolloutBatch, rows: torch.Tensor, W: int) -> torch.Tensor | None:
        """Sampling-mask replay (``rollout.replay_sampling_mask``): the support sizes the engine recorded for
        ``rows`` (top-p / top-k sampling), or None (the full distribution)."""
        if not self.side.support_replay or "support" not in batch.extras:
            return None
        return batch.extras["support"][rows, :W]

    def _kv_replay(self, batch: RolloutBatch, rows: torch.Tensor, segments: torch.Tensor | None = None):
        """The engine's quantized KV cache replayed for ``rows`` (the side's ``kv_cache``; unison/kvcache.py), or
        nothing."""
        if self.side.kv_cache == "auto":
            return contextlib.nullcontext()
        if "kv_scale" not in batch.extras:
            raise UnisonError(f"the learner replays a {self.side.kv_cache} KV cache, and this batch's rows carry no "
                              f"scales: sample it with the native engine at rollout.kv_cache_dtype={self.side.kv_cache}")
        return kvcache.replay(self.side.kv_cache, batch.extras["kv_scale"][rows], segments)

    def _width(self, batch: RolloutBatch, rows: torch.Tensor) -> int:
        """The columns a micro-batch needs: its own longest row (right-padded layout), or the whole
        layout (exact mode, and when micro-batches are counted in rows: today's numerics)."""
        if self.exact is not None or self.options.micro_batch_tokens is None:
            return batch.tokens.shape[1]
        return int(batch.attention_mask[rows].sum(-1).max())

    def _forward(self, batch: RolloutBatch, rows: torch.Tensor, return_entropy: bool,
                 routing_out: torch.Tensor | None = None, teacher=None):
        """log π (and the entropy) of ``rows``, [rows, width] with width = :meth:`_width`; with ``teacher`` (the
        full-vocabulary distillation target) also the per-position reverse KL to it, last."""
        if teacher is not None and (self.exact is not None or self.packing):
            raise UnisonError("distill.estimator=full runs on the padded layout: set train.packing=false and exact=false")
        if self.exact is not None:  # the engine's forward, on the engine's layout, weights cast to its dtype
            with self.qat.swapped(self.model) if self.qat is not None else contextlib.nullcontext():
                weights = self.exact.weights(self.side.dtype)
            lp, ent = learner_logprobs(self.exact, weights,
                                       batch.tokens[rows].to(self.device),
                                       batch.attention_mask[rows].to(self.device).bool(),
                                       batch.response_mask[rows].to(self.device), self.temperature,
                                       self.options.logprob_chunk, return_entropy)
            return (lp, ent) if return_entropy else lp
        W = self._width(batch, rows)
        if self.packing:
            return self._packed_forward(batch, rows, W, return_entropy)
        args = (batch.tokens[rows, :W], batch.attention_mask[rows, :W], self.temperature)
        kw = dict(return_entropy=return_entropy, positions=batch.response_mask[rows, :W], chunk=self.options.logprob_chunk,
                  support=self._support(batch, rows, W), teacher=teacher)
        dt, kw["cast_to"] = self._numerics()
        if not self.moe:
            with self._kv_replay(batch, rows):
                return token_logprobs(self.forward_module, *args, dt, self.device, **kw)
        calls: list[torch.Tensor] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._kv_replay(batch, rows))
            stack.enter_context(moe.record(self.model, calls))  # before replay: sees the learner's own choice
            if self.routing_replay and "routing" in batch.extras:
                stack.enter_context(moe.replay(self.model, moe.replay_indices(batch.extras["routing"][rows, :W])))
            result = token_logprobs(self.forward_module, *args, dt, self.device, **kw)
        if routing_out is not None and calls:
            routing_out[rows, :W] = calls[-1].view(len(rows), W, *calls[-1].shape[1:])
        return result

    def _shares(self, rows: torch.Tensor, batch: RolloutBatch | None = None) -> list[list[torch.Tensor]]:
        """Each rank's micro-batches of ``rows`` (:func:`unison.batch.micro_batches`): a token budget needs the
        batch's lengths; exact mode keeps its fixed layout (row counts only)."""
        lengths = batch.attention_mask.sum(-1) if batch is not None and self.exact is None else None
        o = self.options
        return micro_batches(rows, self.dist.world_size, o.micro_batch_size,
                             o.micro_batch_tokens if lengths is not None else None, lengths, self.packing)

    # ---------------------------------------------------------------- scoring
    @property
    def can_score_other_weights(self) -> bool:
        """Whether :meth:`score` takes ``weights`` (one process, full weights; with LoRA, merged weights under the
        base names, as :meth:`export_weights` gives the engine: scored with the adapters off — not with the
        quantization-aware learner, which merges the layer's own adapters into what it quantizes)."""
        return not self.sharded and (self.peft is None or not self._merges_own_adapters)

    @torch.no_grad()
    def score(self, batch: RolloutBatch, weights: dict[str, torch.Tensor] | None = None, *,
              temperature: float | None = None, with_routing: bool = False):
        """log π for every position of ``batch.tokens`` ([B, L], fp32, 0 off-response), as the scorer's side
        computes it (:meth:`as_side` for another).

        Collective when sharded: each rank scores its share, every rank gets the whole tensor.
        ``weights`` (HF names -> fp32 tensors, e.g. an older policy version): score under those
        instead of the learner's own, without copying them (one process only). ``temperature``: another than
        the scorer's for the call (a server's probe log-probs are at 1). ``with_routing``: ``(log π, the experts it
        chose [B, L, layers, k] or None for a dense model)``.
        """
        with self._temperature(temperature), _swapped(self, weights):
            self.model.eval()
            shares = self._shares(torch.arange(batch.size), batch)
            mine = shares[self.dist.rank]
            n_fwd = max(len(s) for s in shares)
            out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
            routing = moe.routing_buffer(self.model, batch.tokens.shape) if self.moe else None
            for i in range(n_fwd):  # every rank runs the same number of forwards (FSDP collectives)
                rows = mine[i] if i < len(mine) else torch.arange(1)
                lp = self._forward(batch, rows, return_entropy=False, routing_out=routing if i < len(mine) else None)
                if i < len(mine):
                    W = lp.shape[1]
                    out[rows, :W] = lp.float().cpu() * batch.response_mask[rows, :W]
            logp = self.dist.all_reduce_(out, "sum")  # each rank filled only its own rows
        return (logp, moe.gather_routing(routing, self.dist)) if with_routing else logp

    @contextlib.contextmanager
    def _temperature(self, temperature: float | None):
        saved = self.temperature
        if temperature is not None:
            self.temperature = temperature
        try:
            yield
        finally:
            self.temperature = saved

    # ----------------------------------------------------------------- export
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` for every parameter, cast to ``dtype`` (the rollout dtype) here
        on the learner's side. Collective when sharded: every rank must iterate it to the end.
        With LoRA: the merged weights W + (α/r)·B·A under the base model's names."""
        if self.peft is not None:
            params = lora.merged_weights(self.model, full_tensor)
        else:
            params = ((n, full_tensor(p.detach())) for n, p in self.model.named_parameters())
        for name, t in params:
            yield name, (t if dtype is None else t.to(dtype))

    def export_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, full shape)`` of every tensor :meth:`export_weights` yields, in its order, without
        materialising any (what a weight transfer announces before sending). With LoRA: the base names."""
        if self.peft is not None:
            return lora.merged_shapes(self.model)
        return [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``export_weights()`` in the master dtype (the engine casts)."""
        return self.export_weights(None)

    # ------------------------------------------------------------- its weights loaded (unison/checkpoint.py writes them)
    def load_full_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named full weights (read on rank 0 when sharded; others pass ``{}``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.forward_module, {f"lm.{k}": v for k, v in weights.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False,
                                                      broadcast_from_rank0=self.dist.enabled))


def _is_compiled(model) -> bool:
    layers = decoder_layers(model)
    return bool(layers) and layers[0]._compiled_call_impl is not None


def _compile_layer(layer: torch.nn.Module) -> None:
    """``layer.compile(dynamic=True)``, keeping the compiled call (``_unison_compiled``) so that
    :func:`compiled_as` can switch it off and on."""
    no_duck_sizing()
    before = layer._compiled_call_impl
    layer.compile(dynamic=True)
    layer._unison_compiled = layer._compiled_call_impl
    layer._compiled_call_impl = before


@contextlib.contextmanager
def _swapped(scorer: Scorer, weights: dict[str, torch.Tensor] | None):
    """The scorer's parameters replaced by ``weights`` (views; a copy only on another device) for the duration.
    With LoRA, ``weights`` are merged ones under the base names (what the engine holds, e.g. an older version from
    the weight ring): an adapted layer's goes into its ``base_layer`` and the adapters are off meanwhile."""
    if weights is None:
        yield
        return
    if not scorer.can_score_other_weights:
        raise RuntimeError("scoring under other weights needs one process (FSDP2 shards the parameters)")
    params = dict(scorer.model.named_parameters())
    adapters = contextlib.nullcontext()
    if scorer.peft is not None:
        params = {**params, **lora.base_params(scorer.model)}
        adapters = scorer.peft.disable_adapter()
    saved = {n: params[n].data for n in weights}
    try:
        for n, w in weights.items():
            params[n].data = w.view(params[n].shape).to(params[n].device)
        with adapters:
            yield
    finally:
        for n, d in saved.items():
            params[n].data = d


def packing_plan(model, packing: bool, is_moe: bool, exact: bool) -> tuple[bool, str | None]:
    """``train.packing`` as this model can run it: (packed, why it does less than asked — None when it does all)."""
    if packing and is_moe:
        return False, "off: MoE models keep padded rows (routing replay's layout)"
    if packing and is_recurrent(model.config):  # a recurrent state would run on from one packed response to the next
        return False, f"off: {model.config.model_type}'s recurrent layers keep padded rows (their state spans a row)"
    if packing and exact:
        return False, "off: exact mode keeps its fixed padded layout"
    if packing and not use_packed_attention(model):
        return True, (f"{model.config._attn_implementation} attention: packed rows use transformers' "
                      f"block-diagonal mask (quadratic in the packed length)")
    return packing, None


def _exact_forward(model, dist: Dist, peft):
    if dist.enabled:
        raise UnisonError("exact mode runs in one process (FSDP gathers weights through its own hooks): "
                          "launch without torchrun, or set exact=false")
    if peft is not None:
        raise UnisonError("exact mode does not take LoRA adapters yet (the engine would need the merged "
                          "weights computed as the learner computes them): set lora.rank=0 or exact=false")
    return exact_forward(model)


def _checkpoint_layer(layer: torch.nn.Module) -> None:
    """Make ``layer`` recompute its activations in the backward pass (non-reentrant checkpoint),
    whatever the module's train/eval mode (the learner runs in eval mode: no dropout)."""
    inner = layer.forward

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    layer.forward = forward
