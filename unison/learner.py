"""The learner π: fp32 master weights, the score pass, the update, weight export, its checkpoint.

Scoring is one full forward pass over prompt + response (never the KV-cache
path the rollout engine uses): the difference between the two is the
training–inference mismatch.

The learner owns everything about the update (README, "How it is built"; docs/distributed.md):
the optimizer (AdamW on fp32 master weights), the loss scaler (fp16),
gradient clipping on the global norm, skipped-step accounting, mini-batch
steps with micro-batch gradient accumulation, and the gradient-noise hooks.
One class serves one process and ``torchrun`` + FSDP2; the loop cannot tell
which it has:

* **one process**: parameters fp32, forward under ``torch.autocast`` in the
  compute dtype;
* **FSDP2** (under ``torchrun``): ``fully_shard`` per decoder layer + root,
  every rank trains on its share of each mini-batch, normalisers are global
  so the gradient equals the one-process gradient of the same batch.
  ``distributed.param_dtype: compute`` (default) all-gathers parameters in the
  compute dtype (``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``,
  verl's and Paper A's setup); ``fp32`` keeps fp32 parameters under
  autocast, the one-process numerics.

Log-probabilities never materialise the whole ``[rows, positions, vocab]``
logits: hidden states go through the output layer in chunks of positions
(``train.logprob_chunk``), each giving ``logit − logsumexp`` and the entropy,
and during training every chunk but the last is recomputed in the backward pass
(activation checkpointing) instead of being kept. The last is kept: the backward
starts with it, so recomputing it would cost its matmul again and save no memory
at the peak (a micro-batch within the default token budget is one chunk).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from unison import gemm
from unison.batch import RolloutBatch
from unison.distributed import Dist, current, decoder_layers, full_tensor, local_tensor, shard
from unison.errors import UnisonError
from unison.models import (PACKED_ATTENTION, load_model, load_tokenizer, logit_transform, model_shell, packed_forward,
                            packed_kwargs, use_packed_attention)
from unison.precision import Precision, autocast
from unison.rollout.base import support_logsumexp
from unison.threads import small_model

#: positions per chunk of the output layer (``train.logprob_chunk``'s default)
DEFAULT_CHUNK = 512


# ----------------------------------------------------------------------------- log-probs
def _head_logp(h: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float,
               transform, want_entropy: bool, support: torch.Tensor | None = None, fused: bool = True):
    """log p(target) and entropy for rows of hidden states ``h`` [N, d] (fp32 softmax). ``support`` [N]:
    the size of the support each target was sampled from (sampling-mask replay; 0 = the vocabulary):
    log p is then renormalised over it. The entropy is always the full distribution's. ``fused``: allow
    :class:`_HeadLogp` where it applies (:attr:`PolicyForward.fused_head`)."""
    if fused and transform is None and support is None and _fused_head(h, head):
        return _HeadLogp.apply(h, head.weight, head.bias, targets, temperature, want_entropy)
    logits = head(h).float()
    if transform is not None:
        logits = transform(logits)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    norm = lse if support is None else support_logsumexp(logits, targets, support)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - norm
    if not want_entropy:
        return logp, None
    with torch.no_grad():
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, ent


def _fused_head(h: torch.Tensor, head: torch.nn.Module) -> bool:
    """:class:`_HeadLogp` computes this head: a plain fp32 ``nn.Linear`` on the CPU, outside autocast."""
    w = head.weight if type(head) is torch.nn.Linear else None
    return (w is not None and type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype == torch.float32
            and h.dtype == torch.float32 and h.device.type == "cpu" and not torch.is_autocast_enabled("cpu"))


class _HeadLogp(torch.autograd.Function):
    """log p(target) under z = (h·Wᵀ + b) / T, and the (detached) entropy, for rows ``h`` [n, d]: the same
    function as the unfused path of :func:`_head_logp`, holding two [n, V] buffers instead of about ten.

    Forward: z (one buffer) shifted by its row max m in place, p = exp(z − m) (the other), log p(t) =
    (z_t − m) − log Σ p, then p normalised in place — the softmax, kept for the backward — and H = log Σ p −
    Σ pᵢ(zᵢ − m). Backward, in place on that softmax: ∂log p(t)/∂z = onehot(t) − p, so g_z = g·(onehot − p)/T,
    then g_h = g_z·W, g_W = g_zᵀ·h, g_b = Σ g_z. On the CPU every fresh [n, V] buffer is page-faulted in, and
    at SmolLM2's vocabulary the unfused path's elementwise passes took more time than its matmuls."""

    @staticmethod
    def forward(ctx, h, w, b, targets, temperature, want_entropy):
        z = gemm.linear(h, w, b)
        if temperature != 1.0:
            z.div_(temperature)
        z.sub_(z.amax(-1, keepdim=True))
        p = torch.exp(z)
        total = p.sum(-1)
        log_total = total.log()
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - log_total
        p.div_(total[:, None])
        ent = None
        if want_entropy:  # Σ pᵢ zᵢ row by row as a batched dot product: no third [n, V] buffer
            ent = log_total - torch.bmm(p[:, None, :], z[:, :, None]).view(-1)
            ctx.mark_non_differentiable(ent)
        del z
        ctx.save_for_backward(h, w, p, targets)
        ctx.temperature, ctx.has_bias = temperature, b is not None
        return logp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        h, w, p, targets = ctx.saved_tensors
        gz = p.mul_(-g[:, None])  # the saved softmax is not needed after this: reused in place
        gz.scatter_add_(-1, targets[:, None], g[:, None])
        if ctx.temperature != 1.0:
            gz.div_(ctx.temperature)
        gh = gemm.linear(gz, w.t()) if ctx.needs_input_grad[0] else None
        gw = gemm.linear(gz.t(), h.t()) if ctx.needs_input_grad[1] else None
        gb = gz.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gh, gw, gb, None, None, None


class PolicyForward(torch.nn.Module):
    """The learner's forward: ``log π(tokens[:, t] | tokens[:, <t])`` at chosen positions.

    Wraps the Hugging Face causal LM (``self.lm``) so that a sharded learner
    enters the model through one root module (FSDP2 gathers the root's own
    parameters, embedding and output layer, in its forward).
    """

    def __init__(self, lm: torch.nn.Module, aux_loss_coef: float = 0.0):
        super().__init__()
        self.lm = lm
        self._transform = logit_transform(lm.config)
        #: the fused output layer (:class:`_HeadLogp`) where it applies; a small model keeps the plain path
        self.fused_head = not small_model(lm)
        #: MoE: when > 0, training forwards also compute the router's load-balancing loss
        #: (``last_aux_loss``), which the learner adds with this weight
        self.aux_loss_coef = aux_loss_coef
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor | None = None,
                temperature: float = 1.0, chunk: int = DEFAULT_CHUNK, return_entropy: bool = False,
                cast_to: torch.dtype | None = None, position_ids: torch.Tensor | None = None,
                support: torch.Tensor | None = None):
        """``attention_mask`` None with ``position_ids`` restarting at 0: several sequences packed in one
        row, attention kept within each (by one attention call per sequence with the packed attention of
        :func:`unison.models.use_packed_attention`, else by transformers' block-diagonal mask);
        ``positions`` then marks what to score. ``support`` [B, L] (aligned with ``tokens``): the size of
        the support each token was sampled from, for sampling-mask replay (:func:`support_logsumexp`)."""
        if cast_to is not None:  # run on parameters cast to ``cast_to`` (gradients reach the originals)
            params = {n: p.to(cast_to) for n, p in self.named_parameters()}
            return torch.func.functional_call(self, params, (tokens, attention_mask, positions, temperature,
                                                             chunk, return_entropy, None, position_ids, support))
        B, L = tokens.shape
        aux = self.aux_loss_coef > 0 and torch.is_grad_enabled()
        kwargs = {"output_router_logits": True} if aux else {}
        packed = contextlib.nullcontext()
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
            if attention_mask is None and self.lm.config._attn_implementation == PACKED_ATTENTION:
                kwargs.update(packed_kwargs(position_ids))  # one causal attention per sequence
                packed = packed_forward()
        with packed:
            out = self.lm.base_model(input_ids=tokens, attention_mask=attention_mask, use_cache=False, **kwargs)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        self.last_aux_loss = _load_balancing_loss(self.lm, out.router_logits, attention_mask) if aux else None
        sel = attention_mask[:, 1:].bool() if attention_mask is not None else torch.ones_like(tokens[:, 1:], dtype=torch.bool)
        if positions is not None:
            sel = sel & positions[:, 1:].bool()
        hs, tg = h[:, :-1][sel], tokens[:, 1:][sel]
        sup = support.to(h.device)[:, 1:][sel] if support is not None else None
        head = self.lm.get_output_embeddings()
        lps, ents = [], []
        step = chunk if chunk and chunk > 0 else max(hs.shape[0], 1)
        for s in range(0, hs.shape[0], step):
            args = (hs[s:s + step], tg[s:s + step], head, temperature, self._transform, return_entropy,
                    sup[s:s + step] if sup is not None else None, self.fused_head)
            if torch.is_grad_enabled() and hs.requires_grad and s + step < hs.shape[0]:
                lp, en = checkpoint(_head_logp, *args, use_reentrant=False)
            else:
                lp, en = _head_logp(*args)
            lps.append(lp)
            ents.append(en)
        vals = torch.cat(lps) if lps else hs.new_zeros(0, dtype=torch.float32)
        logp = torch.zeros((B, L - 1), dtype=torch.float32, device=h.device).masked_scatter(sel, vals)
        logp = F.pad(logp, (1, 0))
        if not return_entropy:
            return logp, None
        ent = torch.zeros((B, L - 1), dtype=torch.float32, device=h.device)
        if ents and ents[0] is not None:
            ent = ent.masked_scatter(sel, torch.cat(ents))
        return logp, F.pad(ent, (1, 0))


def _load_balancing_loss(lm, router_logits, attention_mask) -> torch.Tensor:
    """The model's own Switch-style load-balancing loss (transformers' ``load_balancing_loss_func``
    of its modeling module), over real tokens."""
    import sys

    fn = sys.modules[type(lm).__module__].load_balancing_loss_func
    cfg = lm.config
    n_exp = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts")
    return fn(router_logits, n_exp, cfg.num_experts_per_tok, attention_mask)


def token_logprobs(model, tokens: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, compute_dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", return_entropy: bool = False,
                   positions: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK,
                   cast_to: torch.dtype | None = None, position_ids: torch.Tensor | None = None,
                   support: torch.Tensor | None = None):
    """log π(tokens[:, t] | tokens[:, <t]) for every position, aligned with ``tokens``.

    ``model`` is a Hugging Face causal LM or a :class:`PolicyForward`. Position
    0 has no context and is 0; so are padding positions and, when
    ``positions`` is given, every position it does not mark. The forward runs
    under autocast in ``compute_dtype``; logits are cast to fp32 and divided by
    ``temperature`` before the softmax; with ``cast_to`` the parameters are cast to that
    dtype for the forward instead (as FSDP2's mixed precision does). Gradients flow when called outside
    ``no_grad``. With ``return_entropy`` also returns the (detached) entropy
    of the next-token distribution at each position, aligned the same way. ``support`` [B, L]: sampling-mask replay, log π
    renormalised over the support each token was sampled from (:func:`support_logsumexp`).
    """
    fwd = model if isinstance(model, PolicyForward) else PolicyForward(model)
    tokens = tokens.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    if positions is not None:
        positions = positions.to(device)
    if position_ids is not None:
        position_ids = position_ids.to(device)
    with autocast(device, compute_dtype):
        logp, ent = fwd(tokens, attention_mask, positions, temperature, chunk, return_entropy, cast_to, position_ids,
                        support)
    return (logp, ent) if return_entropy else logp


# ----------------------------------------------------------------------------- the learner
@dataclass
class UpdateStats:
    """What one ``Learner.train`` call did."""

    metrics: dict[str, float]
    #: optimizer steps taken (not skipped)
    steps: int
    #: optimizer steps skipped (non-finite gradients or loss)
    skipped: int
    #: log π at θ_old of the rows of the first mini-batch (exactly the score pass's quantity,
    #: from the training forward); 0 on other rows
    logp_first: torch.Tensor
    first_rows: torch.Tensor
    noise_terms: list[dict] = field(default_factory=list)
    #: MoE: the learner's expert choices in the first mini-batch's forward, [B, L, layers, k]
    routing_first: torch.Tensor | None = None


def param_dtype(cfg) -> str:
    """``distributed.param_dtype`` as the run uses it: unset means ``compute``, except with a quantization-aware
    learner, which quantizes the weight FSDP2 gathers and so must gather the fp32 master the engine quantizes."""
    return cfg.distributed.param_dtype or ("fp32" if cfg.train.quantization_aware else "compute")


def adamw(params: list[torch.nn.Parameter], fused: bool = True, **kwargs) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over each parameter, in place) where torch has it for these parameters: plain
    (unsharded) floating tensors on the CPU or CUDA. The for-each-tensor default allocates a temporary per
    parameter per step (on the CPU each is page-faulted in afresh: 0.3–2.4 s per step for SmolLM2-135M against
    0.08 s fused, measured on an AMD EPYC); it rounds alike to ~5e-8 relative. ``fused=False``: the
    for-each default (a small model: :func:`unison.threads.small_model`)."""
    fused = fused and bool(params) and all(type(p) is torch.nn.Parameter and p.is_floating_point()
                                 and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, fused=fused, **kwargs)


class GradNoiseProbe:
    """Micro-batch gradients for the McCandlish noise scale (``grad_noise/*``), measured as
    differences of the accumulated gradient: ``after_micro_backward`` after each micro-batch's
    backward, ``after_step`` once the mini-batch's gradient is complete (before clipping)."""

    def __init__(self, params: list[torch.nn.Parameter], dist: Dist):
        self.params, self.dist = params, dist
        self.prev: list[torch.Tensor] | None = None
        self.sq: list[float] = []
        self.units: list[float] = []

    def begin(self) -> None:
        self.prev = [torch.zeros_like(local_tensor(p)) for p in self.params]
        self.sq, self.units = [], []

    def after_micro_backward(self, units: float) -> None:
        grads = [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(q)
                 for p, q in zip(self.params, self.prev)]
        # prev − grads in place (exactly −(grads − prev), so the same norm): no model-sized allocation per
        # micro-batch (a fresh one is page-faulted in each time: measurable on CPU with many micro-batches)
        torch._foreach_sub_(self.prev, grads)
        local = torch.stack(torch._foreach_norm(self.prev)).double().pow(2).sum() if grads else \
            torch.zeros((), dtype=torch.float64)
        self.sq.append(float(self.dist.all_reduce_(local.reshape(1), "sum")))
        torch._foreach_copy_(self.prev, grads)
        self.units.append(units)

    def after_step(self, scale: float, pre_clip_norm: float) -> dict:
        from unison.schedules import noise_scale_terms

        self.prev = None
        if len(self.sq) < 2 or not math.isfinite(pre_clip_norm):
            return {}
        big = sum(self.units)
        # micro shares were measured scaled (fp16); c_k = (B_k/B)·g_k  ->  |g_k|² = |c_k|²·(B/B_k)²
        small = [sq / scale**2 * (big / u) ** 2 for sq, u in zip(self.sq, self.units) if u > 0]
        if len(small) < 2:
            return {}
        return noise_scale_terms(sum(small) / len(small), big / len(small), pre_clip_norm**2, big)


class Learner:
    """Holds the policy π in fp32; scores rollouts; trains on them; exports weights.

    Built for scoring only (``Learner(model_dir)``, as ``unison probe`` does) or
    for training (:meth:`from_config`, with the optimizer and the loss).
    """

    def __init__(self, model_dir: str | Path, compute_dtype: torch.dtype = torch.float32,
                 device: str = "cpu", temperature: float = 1.0, dist: Dist | None = None,
                 param_dtype: str = "fp32", micro_batch_size: int = 16, logprob_chunk: int = DEFAULT_CHUNK,
                 routing_replay: bool = False, aux_loss_coef: float = 0.0, lora_cfg=None, exact: bool = False,
                 activation_checkpointing: bool = False, micro_batch_tokens: int | None = None,
                 packing: bool = False, quantization_aware: tuple[str, int] | None = None,
                 replay_sampling_mask: bool = True):
        self.model_dir = Path(model_dir)
        self.dist = dist or current()
        self.device = self.dist.device if self.dist.enabled else torch.device(device)
        self.compute_dtype = compute_dtype
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        #: token budget of a micro-batch (rows × its own longest row; packed: its tokens); None: micro_batch_size rows
        self.micro_batch_tokens = micro_batch_tokens
        self.logprob_chunk = logprob_chunk
        #: under torchrun only rank 0 reads the weights; the others build the model on the meta device and
        #: receive their shards from rank 0 after sharding (one host copy per job, not one per rank)
        shell = self.dist.enabled and not self.dist.is_main
        self.model = model_shell(self.model_dir, for_training=True) if shell else \
            load_model(self.model_dir, dtype=torch.float32, device=str(self.device))  # masters
        self.tokenizer = load_tokenizer(self.model_dir)
        self.peft = None
        if lora_cfg is not None and lora_cfg.rank > 0:  # adapters injected in place; only they train
            from unison import lora

            self.peft = lora.apply(self.model, lora_cfg, self.model_dir)
        self.forward_module = PolicyForward(self.model, aux_loss_coef=aux_loss_coef)
        #: exact mode: the forward shared with the native engine (unison/exact.py)
        self.exact = None
        if exact:
            from unison.exact import ExactForward

            if self.dist.enabled:
                raise UnisonError("exact mode runs in one process (FSDP gathers weights through its own hooks): "
                                  "launch without torchrun, or set exact=false")
            if self.peft is not None:
                raise UnisonError("exact mode does not take LoRA adapters yet (the engine would need the merged "
                                  "weights computed as the learner computes them): set lora.rank=0 or exact=false")
            self.exact = ExactForward(self.model)
        #: rollout.replay_sampling_mask: log π renormalised over the support each token was sampled from
        #: (when the batch carries it: top-p / top-k sampling on the native engine)
        self.replay_sampling_mask = replay_sampling_mask
        #: train.quantization_aware: the forward computes through the rollout's quantizer (unison/quant.py);
        #: (format, group size), or None
        self.qat = None
        if quantization_aware is not None:
            from unison.quant import QuantizationAware

            self.qat = QuantizationAware(self.model, *quantization_aware)
        from unison import moe

        #: MoE: record the learner's expert choices (router disagreement); replay the rollout's
        self.moe = bool(moe.routers(self.model))
        self.routing_replay = routing_replay and self.moe
        #: why train.packing does less than asked here (None: one attention call per packed response)
        self.packing_note = None
        if packing and self.moe:
            self.packing_note = "off: MoE models keep padded rows (routing replay's layout)"
        elif packing and exact:
            self.packing_note = "off: exact mode keeps its fixed padded layout"
        elif packing and not use_packed_attention(self.model):
            self.packing_note = (f"{self.model.config._attn_implementation} attention: packed rows use transformers' "
                                 f"block-diagonal mask (quadratic in the packed length)")
        #: several responses per row without padding (train.packing; MoE models and exact mode keep padded rows)
        self.packing = packing and not self.moe and not exact
        #: [B, L, layers, k] expert choices of the last score pass (MoE models), else None
        self.last_routing: torch.Tensor | None = None
        if activation_checkpointing:
            for layer in decoder_layers(self.model):
                _checkpoint_layer(layer)
        self.sharded = self.dist.enabled
        #: parameters cast to the compute dtype for the forward, no autocast (FSDP2's mixed precision
        #: under torchrun; one process does the same cast itself). Else fp32 parameters under autocast.
        self.cast_params = param_dtype == "compute" and compute_dtype != torch.float32
        if self.sharded:
            full = {k: v for k, v in self.model.state_dict().items()} if not shell else {}
            shard(self.forward_module, decoder_layers(self.model), self.dist,
                  param_dtype=compute_dtype if self.cast_params else None)
            if shell:
                self.forward_module.to_empty(device=self.device)
            self.load_full_state_dict(full)  # rank 0's weights, broadcast shard by shard
            del full
            import torch.distributed as tdist

            for _, buf in sorted(self.forward_module.named_buffers()):  # rotary tables etc. (not in the state dict)
                tdist.broadcast(buf, src=0)
        self.opt = None
        self.scaler = None
        self.skipped_steps = 0

    # ------------------------------------------------------------------ set-up
    @classmethod
    def from_config(cls, cfg, model_dir: str | Path, dist: Dist | None = None) -> "Learner":
        """A learner ready to train: the config's precision, optimizer, loss scaler and policy."""
        from unison.algorithms.presets import resolve_policy
        from unison.precision import make_grad_scaler

        prec = Precision.resolve(cfg.precision, cfg.rollout_precision, cfg.learner_precision)
        t = cfg.train
        self = cls(model_dir, compute_dtype=prec.learner_dtype, device=cfg.device,
                   temperature=cfg.rollout.temperature, dist=dist,
                   param_dtype=param_dtype(cfg) if (dist or current()).enabled else "fp32",
                   micro_batch_size=t.micro_batch_size, logprob_chunk=t.logprob_chunk,
                   routing_replay=cfg.moe.routing_replay, aux_loss_coef=cfg.moe.aux_loss_coef, lora_cfg=cfg.lora,
                   exact=cfg.exact, activation_checkpointing=t.activation_checkpointing,
                   micro_batch_tokens=t.micro_batch_tokens, packing=t.packing,
                   quantization_aware=(cfg.rollout.quantization, cfg.rollout.quant_group_size)
                   if t.quantization_aware else None, replay_sampling_mask=cfg.rollout.replay_sampling_mask)
        self.train_cfg, self.max_new_tokens = t, cfg.rollout.max_new_tokens
        self.policy = resolve_policy(cfg.algo, cfg.policy)
        self.params = [p for p in self.forward_module.parameters() if p.requires_grad]
        self.opt = adamw(self.params, not small_model(self.forward_module), lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                         weight_decay=t.weight_decay)
        if self.sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type, init_scale=cfg.scaler.init_scale,
                                            growth_interval=cfg.scaler.growth_interval,
                                            enabled=prec.uses_loss_scaling)
        else:
            self.scaler = make_grad_scaler(prec, self.device, init_scale=cfg.scaler.init_scale,
                                           growth_interval=cfg.scaler.growth_interval)
        self.noise = GradNoiseProbe(self.params, self.dist) if t.grad_noise else None
        return self

    # ---------------------------------------------------------------- forward
    def _numerics(self):
        """(autocast dtype, parameter cast) of the learner's forward: fp32 parameters under autocast,
        or parameters cast to the compute dtype (FSDP2 casts itself when sharded)."""
        if not self.cast_params:
            return self.compute_dtype, None
        return torch.float32, (None if self.sharded else self.compute_dtype)

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
        lp, ent = token_logprobs(self.forward_module, tokens, None, self.temperature, dt, self.device,
                                 return_entropy=True, positions=resp, chunk=self.logprob_chunk, cast_to=cast,
                                 position_ids=pos, support=support[keep][None] if support is not None else None)
        keep = keep.to(lp.device)
        out = torch.zeros((len(rows), W), dtype=lp.dtype, device=lp.device).masked_scatter(keep, lp[0])
        if not return_entropy:
            return out
        return out, torch.zeros_like(out).masked_scatter(keep, ent[0])

    def _support(self, batch: RolloutBatch, rows: torch.Tensor, W: int) -> torch.Tensor | None:
        """Sampling-mask replay (``rollout.replay_sampling_mask``): the support sizes the engine recorded for
        ``rows`` (top-p / top-k sampling), or None (the full distribution)."""
        if not self.replay_sampling_mask or "support" not in batch.extras:
            return None
        return batch.extras["support"][rows, :W]

    def _width(self, batch: RolloutBatch, rows: torch.Tensor) -> int:
        """The columns a micro-batch needs: its own longest row (right-padded layout), or the whole
        layout (exact mode, and when micro-batches are counted in rows: today's numerics)."""
        if self.exact is not None or self.micro_batch_tokens is None:
            return batch.tokens.shape[1]
        return int(batch.attention_mask[rows].sum(-1).max())

    def _forward(self, batch: RolloutBatch, rows: torch.Tensor, return_entropy: bool,
                 routing_out: torch.Tensor | None = None):
        """log π (and the entropy) of ``rows``, [rows, width] with width = :meth:`_width`."""
        if self.exact is not None:  # the engine's forward, on the engine's layout, weights cast to its dtype
            from unison.exact import learner_logprobs

            with self.qat.swapped(self.model) if self.qat is not None else contextlib.nullcontext():
                weights = self.exact.weights(self.compute_dtype)
            lp, ent = learner_logprobs(self.exact, weights,
                                       batch.tokens[rows].to(self.device),
                                       batch.attention_mask[rows].to(self.device).bool(),
                                       batch.response_mask[rows].to(self.device), self.temperature,
                                       self.logprob_chunk, return_entropy)
            return (lp, ent) if return_entropy else lp
        W = self._width(batch, rows)
        if self.packing:
            return self._packed_forward(batch, rows, W, return_entropy)
        args = (batch.tokens[rows, :W], batch.attention_mask[rows, :W], self.temperature)
        kw = dict(return_entropy=return_entropy, positions=batch.response_mask[rows, :W], chunk=self.logprob_chunk,
                  support=self._support(batch, rows, W))
        dt, kw["cast_to"] = self._numerics()
        if not self.moe:
            return token_logprobs(self.forward_module, *args, dt, self.device, **kw)
        from unison import moe

        calls: list[torch.Tensor] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(moe.record(self.model, calls))  # before replay: sees the learner's own choice
            if self.routing_replay and "routing" in batch.extras:
                stack.enter_context(moe.replay(self.model, moe.replay_indices(batch.extras["routing"][rows, :W])))
            result = token_logprobs(self.forward_module, *args, dt, self.device, **kw)
        if routing_out is not None and calls:
            routing_out[rows, :W] = calls[-1].view(len(rows), W, *calls[-1].shape[1:])
        return result

    def _shares(self, rows: torch.Tensor, batch: RolloutBatch | None = None) -> list[list[torch.Tensor]]:
        """Each rank's micro-batches of ``rows``: rank r takes rows[r::world], split into pieces of at
        most ``micro_batch_size`` rows and — with ``micro_batch_tokens`` — at most that many tokens
        (rows × the piece's longest row, or with packing the rows' own lengths: rows are grouped by
        length, longest first, as verl's dynamic batch size does). Every rank computes every rank's
        share (no communication)."""
        ws, mbs, budget = self.dist.world_size, self.micro_batch_size, self.micro_batch_tokens
        if budget is None or batch is None or self.exact is not None:
            return [list(rows[r::ws].split(mbs)) for r in range(ws)]
        lengths = batch.attention_mask.sum(-1)
        out = []
        for r in range(ws):
            mine = rows[r::ws]
            order = mine[torch.argsort(lengths[mine], descending=True, stable=True)].tolist()
            groups, cur, widest, used = [], [], 0, 0
            for i in order:
                L = int(lengths[i])
                need = used + L if self.packing else (len(cur) + 1) * max(widest, L)  # packed: no padding
                if cur and (len(cur) == mbs or need > budget):
                    groups.append(torch.tensor(cur))
                    cur, widest, used = [], 0, 0
                cur.append(i)
                widest, used = max(widest, L), used + L
            if cur:
                groups.append(torch.tensor(cur))
            out.append(groups)
        return out

    @property
    def can_score_other_weights(self) -> bool:
        """Whether :meth:`score` takes ``weights`` (one process, full weights, no adapters)."""
        return not self.sharded and self.peft is None

    @torch.no_grad()
    def score(self, batch: RolloutBatch, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """log π for every position of ``batch.tokens`` ([B, L], fp32, 0 off-response).

        Collective when sharded: each rank scores its share, every rank gets the whole tensor.
        ``weights`` (HF names -> fp32 tensors, e.g. an older policy version): score under those
        instead of the learner's own, without copying them (one process only).
        """
        if weights is not None:
            if not self.can_score_other_weights:
                raise RuntimeError("scoring under other weights needs one process and no LoRA adapters")
            params = dict(self.model.named_parameters())
            saved = {n: params[n].data for n in weights}
            try:
                for n, w in weights.items():  # views of the host ring; a copy only on another device
                    params[n].data = w.view(params[n].shape).to(params[n].device)
                return self.score(batch)
            finally:
                for n, d in saved.items():
                    params[n].data = d
        self.model.eval()
        shares = self._shares(torch.arange(batch.size), batch)
        mine = shares[self.dist.rank]
        n_fwd = max(len(s) for s in shares)
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        routing = self._routing_buffer(batch)
        for i in range(n_fwd):  # every rank runs the same number of forwards (FSDP collectives)
            rows = mine[i] if i < len(mine) else torch.arange(1)
            lp = self._forward(batch, rows, return_entropy=False, routing_out=routing if i < len(mine) else None)
            if i < len(mine):
                W = lp.shape[1]
                out[rows, :W] = lp.float().cpu() * batch.response_mask[rows, :W]
        self.last_routing = self._gather_routing(routing)
        return self.dist.all_reduce_(out, "sum")  # each rank filled only its own rows

    def _routing_buffer(self, batch: RolloutBatch) -> torch.Tensor | None:
        if not self.moe:
            return None
        from unison import moe

        n_layers, k = len(moe.routers(self.model)), moe.top_k(self.model)
        return torch.full((*batch.tokens.shape, n_layers, k), -1, dtype=torch.int64)

    def _gather_routing(self, routing: torch.Tensor | None) -> torch.Tensor | None:
        """Every rank's rows of a routing buffer (-1 elsewhere) on every rank."""
        if routing is None or not self.dist.enabled:
            return routing
        shifted = routing + 1  # rows nobody filled stay 0, so the sum over ranks is the union
        return self.dist.all_reduce_(shifted, "sum") - 1

    # ----------------------------------------------------------------- update
    def train(self, batch: RolloutBatch, old_logp, weights, lr: float, seed: int = 0) -> UpdateStats:
        """``train.mini_batches`` optimizer steps on ``batch`` (collective when sharded).

        ``old_logp(rows, logp, logp_mu, mini_batch_index)``: log π_old of a micro-batch's rows
        (:class:`unison.algorithms.anchors.OldLogp`: the score pass, μ, the detached training
        forward itself, or AReaL's log-linear approximation). ``weights``: the correction's
        per-token weights [B, L], or a function ``(logp_old, logp_mu, mask) -> weights``
        evaluated per micro-batch on that log π_old.
        The rows are split into mini-batches by a permutation seeded with ``seed``;
        every normaliser counts the whole mini-batch on every rank.
        """
        from unison.algorithms.losses import LOSSES, aggregate
        from unison.algorithms.presets import loss_kwargs

        if self.opt is None:
            raise RuntimeError("this learner was built for scoring only: use Learner.from_config")
        t, pol, ws, rank = self.train_cfg, self.policy, self.dist.world_size, self.dist.rank
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.model.eval()  # dropout off in every forward, as in the score pass (TRL: disable_dropout)
        if self.peft is not None:  # except LoRA's own dropout, when configured, in training forwards
            from unison import lora

            for d in lora.dropout_modules(self.model):
                d.train()
        loss_fn, loss_kw = LOSSES[pol["loss"]], loss_kwargs(pol)
        order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(seed))
        minis = list(order.tensor_split(min(t.mini_batches, batch.size)))  # exactly that many, sizes ±1
        per_token_units = pol["loss_agg"] == "token_mean"  # batch size in tokens, else in responses
        sums: dict[str, float] = {"policy/loss": 0.0, "policy/entropy": 0.0}
        maxes: dict[str, float] = {}
        grad_norms, noise_terms, n_opt, skipped = [], [], 0, 0
        first_rows = minis[0]
        logp_first = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        routing_first = self._routing_buffer(batch)
        aux_coef = self.forward_module.aux_loss_coef if self.moe else 0.0
        for mb_i, mb in enumerate(minis):
            n_tok, n_seq = int(batch.response_mask[mb].sum()), len(mb)
            shares = self._shares(mb, batch)
            mine, n_micro = shares[rank], max(len(s) for s in shares)
            track = self.noise is not None and n_micro > 1
            self.opt.zero_grad(set_to_none=True)
            if track:
                self.noise.begin()
            loss_sum, ent_sum = 0.0, 0.0
            local: dict[str, float] = {}
            for i in range(n_micro):
                dummy = i >= len(mine)  # this rank has no rows left: a zero-weight forward keeps FSDP in step
                rows = mb[:1] if dummy else mine[i]
                first = mb_i == 0 and not dummy
                logp, ent = self._forward(batch, rows, return_entropy=True,
                                          routing_out=routing_first if first else None)
                W = logp.shape[1]  # the micro-batch's own width: every per-token tensor is cut to it
                m = batch.response_mask[rows, :W].to(self.device)
                mu = batch.logp_mu[rows, :W].to(self.device)
                old = old_logp(rows, logp, mu, mb_i)[:, :W]
                w = weights(old, mu, m) if callable(weights) else weights[rows, :W].to(self.device)
                per_tok, lm = loss_fn(logp, old, mu, batch.advantages[rows].to(self.device), w, m, **loss_kw)
                loss = aggregate(per_tok, pol["loss_agg"], m, n_tok, n_seq, self.max_new_tokens)
                if aux_coef:  # the router's load-balancing loss, weighted by this micro-batch's share of rows
                    aux = self.forward_module.last_aux_loss
                    loss = loss + aux_coef * aux * (len(rows) / n_seq)
                    lm = {**lm, "moe/aux_loss": float(aux.detach())}
                share = 0.0 if dummy else 1.0
                self.scaler.scale(loss * (ws * share)).backward()
                loss_sum += float(loss.detach()) * share
                ent_sum += float((ent * m).sum()) * share
                frac = share * float(m.sum()) / max(n_tok, 1)
                for k, v in lm.items():  # *_max: max; others: token-weighted mean
                    if k.endswith("_max"):
                        maxes[k] = max(maxes.get(k, -math.inf), v if not dummy else -math.inf)
                    else:
                        local[k] = local.get(k, 0.0) + v * frac
                if track:
                    self.noise.after_micro_backward(self._micro_units(batch, shares, i, per_token_units))
                if first:
                    logp_first[rows, :W] = logp.detach().float().cpu() * batch.response_mask[rows, :W]
            red = self._reduce({"loss": loss_sum, "ent": ent_sum, **local})
            scale_used = float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0
            self.scaler.unscale_(self.opt)
            gn = self._clip()
            finite = math.isfinite(gn) and math.isfinite(red["loss"])
            if self.scaler.is_enabled():
                self.scaler.step(self.opt)  # skips the step itself on inf/NaN gradients (all ranks agree)
            elif finite:
                self.opt.step()
            self.scaler.update()
            if finite:
                grad_norms.append(gn)
                n_opt += 1
                if track:
                    noise_terms.append(self.noise.after_step(scale_used, gn))
            else:
                skipped += 1
            sums["policy/loss"] += red.pop("loss") / len(minis)
            sums["policy/entropy"] += red.pop("ent") / max(n_tok, 1) / len(minis)
            for k, v in red.items():
                sums[k] = sums.get(k, 0.0) + v / len(minis)
        self.skipped_steps += skipped
        self.model.eval()
        for k, v in self._reduce(maxes, op="max").items():
            sums[k] = v
        sums["optim/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        self.dist.all_reduce_(logp_first, "sum")  # each rank filled only its own rows
        return UpdateStats(metrics=sums, steps=n_opt, skipped=skipped, logp_first=logp_first,
                           first_rows=first_rows, noise_terms=[x for x in noise_terms if x],
                           routing_first=self._gather_routing(routing_first))

    def _micro_units(self, batch, shares, i, per_token: bool) -> float:
        """Size of micro-step ``i`` over all ranks, in tokens or responses."""
        rows = [s[i] for s in shares if i < len(s)]
        if not rows:
            return 0.0
        rows = torch.cat(rows)
        return float(batch.response_mask[rows].sum()) if per_token else float(len(rows))

    def _reduce(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        if not self.dist.enabled or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        self.dist.all_reduce_(t, op)
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    def _clip(self) -> float:
        """Clip to ``train.grad_clip`` by the global norm over every shard; the pre-clip norm."""
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.grad_clip)
        return float(full_tensor(gn))

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1.0 when no scaler is active)."""
        return float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else 1.0

    # ----------------------------------------------------------------- export
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` for every parameter, cast to ``dtype`` (the rollout dtype) here
        on the learner's side. Collective when sharded: every rank must iterate it to the end.
        With LoRA: the merged weights W + (α/r)·B·A under the base model's names."""
        if self.peft is not None:
            from unison import lora

            params = lora.merged_weights(self.model, full_tensor)
        else:
            params = ((n, full_tensor(p.detach())) for n, p in self.model.named_parameters())
        for name, t in params:
            yield name, (t if dtype is None else t.to(dtype))

    def export_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, full shape)`` of every tensor :meth:`export_weights` yields, in its order, without
        materialising any (what a weight transfer announces before sending). With LoRA: the base names."""
        if self.peft is not None:
            from unison import lora

            return lora.merged_shapes(self.model)
        return [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``export_weights()`` in the master dtype (the engine casts)."""
        return self.export_weights(None)

    # ------------------------------------------------------------- checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full model weights (rank 0; empty on the others), names as in the HF model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.forward_module,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k[len("lm."):]: v for k, v in sd.items()}

    def save_model(self, path: Path, tokenizer) -> None:
        """The model for others to load (collective; rank 0 writes): a Hugging Face directory
        with the full weights, or with LoRA the adapters in PEFT's format (+ the tokenizer)."""
        weights = self.full_state_dict()
        if self.dist.is_main:
            from unison.models import save_model_dir

            if self.peft is not None:
                from unison import lora

                lora.save(self.peft, weights, path)
                tokenizer.save_pretrained(path)
            else:
                save_model_dir(self.model, tokenizer, path, state_dict=weights)

    def read_model(self, path: Path) -> dict[str, torch.Tensor]:
        """The weights :meth:`save_model` wrote (rank 0 reads; the others get ``{}``). Raises
        on a file that cannot be read; :class:`UnisonError` when they do not fit this model."""
        if not self.dist.is_main:
            return {}
        from safetensors.torch import load_file

        if self.peft is not None:
            from unison import lora

            weights = lora.load(path)
            expected = {n for n, p in self.model.named_parameters() if ".lora_" in n}
            if set(weights) != expected:
                raise UnisonError(f"checkpoint '{path}' holds other adapters than lora.* describes: resume "
                                  f"with the run's own config")
            return weights
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(f))
        check_model_keys(self.model, weights, str(path))
        return weights

    def load_full_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named full weights (read on rank 0 when sharded; others pass ``{}``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.forward_module, {f"lm.{k}": v for k, v in weights.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False,
                                                      broadcast_from_rank0=self.dist.enabled))

    def save_optimizer(self, path: Path) -> None:
        """Optimizer state with ``torch.distributed.checkpoint`` (sharded: every rank writes its
        part; keyed by parameter name, so it loads on another world size)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        with _quiet_dcp():
            dcp.save({"optimizer": get_optimizer_state_dict(self.forward_module, self.opt)},
                     checkpoint_id=str(path))

    def load_optimizer(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.forward_module, self.opt)}
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=str(path))
        set_optimizer_state_dict(self.forward_module, self.opt, state["optimizer"])

    def state_dict(self) -> dict:
        """The learner's small state (the optimizer goes through :meth:`save_optimizer`)."""
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else {},
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that it runs "in a single process" when there is no process group: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _checkpoint_layer(layer: torch.nn.Module) -> None:
    """Make ``layer`` recompute its activations in the backward pass (non-reentrant checkpoint),
    whatever the module's train/eval mode (the learner runs in eval mode: no dropout)."""
    inner = layer.forward

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    layer.forward = forward


def check_model_keys(model, weights: dict, where: str) -> None:
    """Refuse weights that do not fit the model (tied output embeddings are stored once)."""
    expected = set(model.state_dict())
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in expected - set(weights) if not (tied and k == "lm_head.weight")]
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise UnisonError(f"checkpoint '{where}' does not match the model (missing {sorted(missing)[:3]}, "
                          f"unexpected {unexpected[:3]}): resume with the run's own config")
