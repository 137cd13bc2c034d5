"""log π of tokens, and the policy that computes it: the learner's forward (never the KV-cache path).

Scoring is one full forward pass over prompt + response (never the KV-cache path the rollout engine uses):
the difference between the two is the training–inference mismatch. :class:`PolicyForward` wraps the causal LM
so that a sharded learner enters it through one root module; :func:`token_logprobs` is its one-call form;
:class:`Scorer` holds the fp32 policy — loaded, adapted (LoRA), quantization-aware, exact, sharded — and scores
batches (the probe uses it alone; :class:`unison.learner.Learner` adds the update).

Log-probabilities never materialise the whole ``[rows, positions, vocab]`` logits: hidden states go through the
output layer in chunks of positions (``train.logprob_chunk``), each giving ``logit − logsumexp`` and the entropy,
and during training every chunk but the last is recomputed in the backward pass (activation checkpointing)
instead of being kept. The last is kept: the backward starts with it, so recomputing it would cost its matmul
again and save no memory at the peak (a micro-batch within the default token budget is one chunk).

Numerics, one process and ``torchrun`` + FSDP2 alike (docs/distributed.md): one process keeps fp32 parameters
under ``torch.autocast`` in the compute dtype; FSDP2 (``fully_shard`` per decoder layer + root) all-gathers them in
the compute dtype (``distributed.param_dtype: compute``, verl's and Paper A's setup) or keeps fp32 under autocast
(``fp32``, the one-process numerics).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from unison import gemm, moe
from unison.batch import RolloutBatch, micro_batches
from unison.distributed import Dist, current, decoder_layers, full_tensor, shard
from unison.errors import UnisonError
from unison.models import (PACKED_ATTENTION, load_model, logit_transform, model_shell, packed_forward, packed_kwargs,
                           use_packed_attention)
from unison.precision import autocast
from unison.rollout.base import support_logsumexp
from unison.runtime import small_model

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


def _head_logp_kl(h: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float, transform,
                  want_entropy: bool, support: torch.Tensor | None, h_teacher: torch.Tensor, teacher,
                  fused: bool = True):
    """:func:`_head_logp` and the exact reverse KL of each row's next-token distribution to the teacher's,
    KL(π(·|s) ‖ π_T(·|s)) = Σ_v π(v|s) (log π(v|s) − log π_T(v|s)) over the whole vocabulary, both at ``temperature``
    (on-policy distillation, ``distill.estimator: full``). ``h_teacher`` [n, d_T]: the teacher's hidden states at the
    same positions; ``teacher.log_probs(h_teacher, temperature)`` its log-softmax [n, V] (no gradient), computed
    here so that a checkpointed chunk recomputes it in the backward instead of keeping it. The KL is always the
    full distribution's (``support``, sampling-mask replay, renormalises log p(target) only). Returns (log p, the
    entropy or None, KL)."""
    with torch.no_grad():
        logq = teacher.log_probs(h_teacher, temperature)
    if fused and transform is None and support is None and _fused_head(h, head):
        return _HeadKL.apply(h, head.weight, head.bias, targets, temperature, want_entropy, logq)
    logits = head(h).float()
    if transform is not None:
        logits = transform(logits)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits - lse[:, None]
    norm = lse if support is None else support_logsumexp(logits, targets, support)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - norm
    p = lp.exp()
    kl = (p * (lp - logq)).sum(-1)
    ent = (-(p * lp).sum(-1)).detach() if want_entropy else None
    return logp, ent, kl


class _HeadKL(torch.autograd.Function):
    """:class:`_HeadLogp` with the reverse KL to a fixed distribution q beside log p(target): for z = (h·Wᵀ + b)/T,
    log p = z − logsumexp(z), KL = Σᵢ pᵢ (log pᵢ − log qᵢ). Backward, by hand (tested against autograd):

        ∂KL/∂zⱼ = pⱼ (log pⱼ − log qⱼ − KL),    ∂log p(t)/∂zⱼ = δⱼₜ − pⱼ,

    so g_z = (g_KL · p ⊙ (log p − log q − KL) + g_lp · (onehot(t) − p)) / T, then g_h = g_z·W, g_W = g_zᵀ·h,
    g_b = Σ g_z. Keeps log p [n, V] (and the caller's log q) for the backward; nothing else of size V."""

    @staticmethod
    def forward(ctx, h, w, b, targets, temperature, want_entropy, logq):
        z = gemm.linear(h, w, b)
        if temperature != 1.0:
            z.div_(temperature)
        z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # log p, in place
        p = torch.exp(z)
        logp = z.gather(-1, targets[:, None]).squeeze(-1)
        kl = torch.bmm(p[:, None, :], (z - logq)[:, :, None]).view(-1)
        ent = None
        if want_entropy:
            ent = -torch.bmm(p[:, None, :], z[:, :, None]).view(-1)
            ctx.mark_non_differentiable(ent)
        del p
        ctx.save_for_backward(h, w, z, logq, targets, kl)
        ctx.temperature, ctx.has_bias = temperature, b is not None
        return logp, ent, kl

    @staticmethod
    def backward(ctx, g_lp, _g_ent, g_kl):
        h, w, lp, logq, targets, kl = ctx.saved_tensors
        p = torch.exp(lp)
        gz = torch.zeros_like(p)
        if g_kl is not None:
            gz = (lp - logq).sub_(kl[:, None]).mul_(p).mul_(g_kl[:, None])
        if g_lp is not None:
            gz.sub_(p.mul_(g_lp[:, None]))
            gz.scatter_add_(-1, targets[:, None], g_lp[:, None])
        if ctx.temperature != 1.0:
            gz.div_(ctx.temperature)
        gh = gemm.linear(gz, w.t()) if ctx.needs_input_grad[0] else None
        gw = gemm.linear(gz.t(), h.t()) if ctx.needs_input_grad[1] else None
        gb = gz.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gh, gw, gb, None, None, None, None


def selected_positions(tokens: torch.Tensor, attention_mask: torch.Tensor | None,
                       positions: torch.Tensor | None) -> torch.Tensor:
    """[B, L − 1] bool: the positions whose next token is scored — real tokens (``attention_mask``; None: packed
    rows, every position) marked by ``positions`` when given; hidden state t predicts token t + 1."""
    sel = attention_mask[:, 1:].bool() if attention_mask is not None else torch.ones_like(tokens[:, 1:], dtype=torch.bool)
    if positions is not None:
        sel = sel & positions[:, 1:].bool()
    return sel


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
                support: torch.Tensor | None = None, teacher=None):
        """``attention_mask`` None with ``position_ids`` restarting at 0: several sequences packed in one
        row, attention kept within each (by one attention call per sequence with the packed attention of
        :func:`unison.models.use_packed_attention`, else by transformers' block-diagonal mask);
        ``positions`` then marks what to score. ``support`` [B, L] (aligned with ``tokens``): the size of
        the support each token was sampled from, for sampling-mask replay (:func:`support_logsumexp`).
        ``teacher`` (on-policy distillation, ``distill.estimator: full``; :meth:`unison.teacher.Teacher.kl_target`):
        also the exact per-position reverse KL to the teacher over the vocabulary, [B, L] aligned like log π (0
        where not scored) — returned third."""
        if cast_to is not None:  # run on parameters cast to ``cast_to`` (gradients reach the originals)
            params = {n: p.to(cast_to) for n, p in self.named_parameters()}
            return torch.func.functional_call(self, params, (tokens, attention_mask, positions, temperature,
                                                             chunk, return_entropy, None, position_ids, support,
                                                             teacher))
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
        sel = selected_positions(tokens, attention_mask, positions)
        hs, tg = h[:, :-1][sel], tokens[:, 1:][sel]
        sup = support.to(h.device)[:, 1:][sel] if support is not None else None
        ht = teacher.hidden(tokens, attention_mask, positions, position_ids) if teacher is not None else None
        head = self.lm.get_output_embeddings()
        lps, ents, kls = [], [], []
        step = chunk if chunk and chunk > 0 else max(hs.shape[0], 1)
        for s in range(0, hs.shape[0], step):
            args = (hs[s:s + step], tg[s:s + step], head, temperature, self._transform, return_entropy,
                    sup[s:s + step] if sup is not None else None)
            fn = _head_logp if teacher is None else _head_logp_kl
            if teacher is not None:
                args += (ht[s:s + step], teacher)
            args += (self.fused_head,)
            if torch.is_grad_enabled() and hs.requires_grad and s + step < hs.shape[0]:
                out = checkpoint(fn, *args, use_reentrant=False)
            else:
                out = fn(*args)
            lps.append(out[0])
            ents.append(out[1])
            if teacher is not None:
                kls.append(out[2])
        vals = torch.cat(lps) if lps else hs.new_zeros(0, dtype=torch.float32)
        logp = torch.zeros((B, L - 1), dtype=torch.float32, device=h.device).masked_scatter(sel, vals)
        logp = F.pad(logp, (1, 0))
        ent = None
        if return_entropy:
            ent = torch.zeros((B, L - 1), dtype=torch.float32, device=h.device)
            if ents and ents[0] is not None:
                ent = ent.masked_scatter(sel, torch.cat(ents))
            ent = F.pad(ent, (1, 0))
        if teacher is None:
            return logp, ent
        kl = torch.zeros((B, L - 1), dtype=torch.float32, device=h.device)
        kl = F.pad(kl.masked_scatter(sel, torch.cat(kls) if kls else vals.new_zeros(0)), (1, 0))
        return logp, ent, kl


def _load_balancing_loss(lm, router_logits, attention_mask) -> torch.Tensor:
    """The model's own Switch-style load-balancing loss (transformers' ``load_balancing_loss_func``
    of its modeling module), over real tokens."""
    import sys

    fn = sys.modules[type(lm).__module__].load_balancing_loss_func
    cfg = lm.config
    n_exp = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return fn(router_logits, n_exp, cfg.num_experts_per_tok, attention_mask)


def token_logprobs(model, tokens: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, compute_dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", return_entropy: bool = False,
                   positions: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK,
                   cast_to: torch.dtype | None = None, position_ids: torch.Tensor | None = None,
                   support: torch.Tensor | None = None, teacher=None):
    """log π(tokens[:, t] | tokens[:, <t]) for every position, aligned with ``tokens``.

    ``model`` is a Hugging Face causal LM or a :class:`PolicyForward`. Position
    0 has no context and is 0; so are padding positions and, when
    ``positions`` is given, every position it does not mark. The forward runs
    under autocast in ``compute_dtype``; logits are cast to fp32 and divided by
    ``temperature`` before the softmax; with ``cast_to`` the parameters are cast to that
    dtype for the forward instead (as FSDP2's mixed precision does). Gradients flow when called outside
    ``no_grad``. With ``return_entropy`` also returns the (detached) entropy
    of the next-token distribution at each position, aligned the same way. ``support`` [B, L]: sampling-mask replay, log π
    renormalised over the support each token was sampled from (:func:`support_logsumexp`). ``teacher``: also
    the per-position reverse KL to it (:meth:`PolicyForward.forward`), returned last.
    """
    fwd = model if isinstance(model, PolicyForward) else PolicyForward(model)
    tokens = tokens.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    if positions is not None:
        positions = positions.to(device)
    if position_ids is not None:
        position_ids = position_ids.to(device)
    with autocast(device, compute_dtype):
        out = fwd(tokens, attention_mask, positions, temperature, chunk, return_entropy, cast_to, position_ids,
                  support, teacher)
    if teacher is not None:
        return out if return_entropy else (out[0], out[2])
    return out if return_entropy else out[0]


# ----------------------------------------------------------------------------- the policy
class Scorer:
    """The policy π in fp32: loaded (rank 0 reads it under torchrun), LoRA adapters injected, the rollout's
    quantizer on its forward (``quantization_aware``), exact mode's shared forward, sharded by FSDP2. Scores
    batches (:meth:`score`) and exports its weights (:meth:`export_weights`); :class:`unison.learner.Learner`
    trains it. ``temperature``, ``replay_sampling_mask`` and ``routing_replay`` are its defaults for scoring;
    :meth:`score` takes each for one call."""

    def __init__(self, model_dir: str | Path, compute_dtype: torch.dtype = torch.float32,
                 device: str = "cpu", temperature: float = 1.0, dist: Dist | None = None,
                 param_dtype: str = "fp32", micro_batch_size: int = 16, logprob_chunk: int = DEFAULT_CHUNK,
                 routing_replay: bool = False, aux_loss_coef: float = 0.0, lora_cfg=None, exact: bool = False,
                 activation_checkpointing: bool = False, micro_batch_tokens: int | None = None,
                 packing: bool = False, quantization_aware: tuple[str, int] | None = None,
                 replay_sampling_mask: bool = True, compile: bool = False):
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
        self.peft = None
        if lora_cfg is not None and lora_cfg.rank > 0:  # adapters injected in place; only they train
            from unison import lora

            self.peft = lora.apply(self.model, lora_cfg, self.model_dir)
        self.forward_module = PolicyForward(self.model, aux_loss_coef=aux_loss_coef)
        #: exact mode: the forward shared with the native engine (unison/exact.py)
        self.exact = _exact_forward(self.model, self.dist, self.peft) if exact else None
        #: rollout.replay_sampling_mask: log π renormalised over the support each token was sampled from
        #: (when the batch carries it: top-p / top-k sampling on the native engine)
        self.replay_sampling_mask = replay_sampling_mask
        #: train.quantization_aware: the forward computes through the rollout's quantizer (unison/quant.py);
        #: (format, group size), or None
        self.qat = None
        if quantization_aware is not None:
            from unison.quant import QuantizationAware

            self.qat = QuantizationAware(self.model, *quantization_aware)
        #: MoE: record the learner's expert choices (router disagreement); replay the rollout's
        self.moe = bool(moe.routers(self.model))
        self.routing_replay = routing_replay and self.moe
        #: several responses per row without padding (train.packing), and why it does less than asked here
        #: (None: one attention call per packed response)
        self.packing, self.packing_note = packing_plan(self.model, packing, self.moe, exact)
        if activation_checkpointing:
            for layer in decoder_layers(self.model):
                _checkpoint_layer(layer)
        #: the decoder layers compiled by Inductor (``compile``, unison/compilation.py): one graph for all of them
        self.compiled = compile
        for layer in decoder_layers(self.model) if compile else []:
            _compile_layer(layer)
            layer._compiled_call_impl = layer._unison_compiled
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
                 routing_out: torch.Tensor | None = None, teacher=None):
        """log π (and the entropy) of ``rows``, [rows, width] with width = :meth:`_width`; with ``teacher`` (the
        full-vocabulary distillation target) also the per-position reverse KL to it, last."""
        if teacher is not None and (self.exact is not None or self.packing):
            raise UnisonError("distill.estimator=full runs on the padded layout: set train.packing=false and exact=false")
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
                  support=self._support(batch, rows, W), teacher=teacher)
        dt, kw["cast_to"] = self._numerics()
        if not self.moe:
            return token_logprobs(self.forward_module, *args, dt, self.device, **kw)
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
        """Each rank's micro-batches of ``rows`` (:func:`unison.batch.micro_batches`): a token budget needs the
        batch's lengths; exact mode keeps its fixed layout (row counts only)."""
        lengths = batch.attention_mask.sum(-1) if batch is not None and self.exact is None else None
        return micro_batches(rows, self.dist.world_size, self.micro_batch_size,
                             self.micro_batch_tokens if lengths is not None else None, lengths, self.packing)

    # ---------------------------------------------------------------- scoring
    @property
    def can_score_other_weights(self) -> bool:
        """Whether :meth:`score` takes ``weights`` (one process, full weights; with LoRA, merged weights under the
        base names, as :meth:`export_weights` gives the engine: scored with the adapters off — not with the
        quantization-aware learner, which merges the layer's own adapters into what it quantizes)."""
        return not self.sharded and (self.peft is None or self.qat is None)

    @torch.no_grad()
    def score(self, batch: RolloutBatch, weights: dict[str, torch.Tensor] | None = None, *,
              temperature: float | None = None, replay_sampling_mask: bool | None = None,
              routing_replay: bool | None = None, with_routing: bool = False):
        """log π for every position of ``batch.tokens`` ([B, L], fp32, 0 off-response).

        Collective when sharded: each rank scores its share, every rank gets the whole tensor.
        ``weights`` (HF names -> fp32 tensors, e.g. an older policy version): score under those
        instead of the learner's own, without copying them (one process only). ``temperature``,
        ``replay_sampling_mask`` and ``routing_replay`` override this scorer's own for the call (the mismatch
        ledger scores "as the engine ran"). ``with_routing``: ``(log π, the experts it chose [B, L, layers, k]
        or None for a dense model)``.
        """
        with self._options(temperature, replay_sampling_mask, routing_replay), _swapped(self, weights):
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
    def _options(self, temperature, replay_sampling_mask, routing_replay):
        saved = (self.temperature, self.replay_sampling_mask, self.routing_replay)
        if temperature is not None:
            self.temperature = temperature
        if replay_sampling_mask is not None:
            self.replay_sampling_mask = replay_sampling_mask
        if routing_replay is not None:
            self.routing_replay = routing_replay and self.moe
        try:
            yield
        finally:
            self.temperature, self.replay_sampling_mask, self.routing_replay = saved

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

    # ------------------------------------------------------------- its weights on disk (unison/checkpoint.py)
    def save_model(self, path: Path, tokenizer) -> None:
        """The model for others to load (collective; rank 0 writes): a Hugging Face directory, or with LoRA the
        adapters in PEFT's format (+ the tokenizer)."""
        from unison.checkpoint import save_model

        save_model(self, path, tokenizer)

    def read_model(self, path: Path) -> dict[str, torch.Tensor]:
        """The weights :meth:`save_model` wrote (rank 0 reads; the others get ``{}``)."""
        from unison.checkpoint import read_model

        return read_model(self, path)

    def load_full_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named full weights (read on rank 0 when sharded; others pass ``{}``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.forward_module, {f"lm.{k}": v for k, v in weights.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False,
                                                      broadcast_from_rank0=self.dist.enabled))


@contextlib.contextmanager
def compiled_as(scorer: Scorer, on: bool):
    """The scorer's decoder layers compiled by Inductor (``on``) or eager while the context is open, whatever the
    scorer runs otherwise (``compile``): the learner scoring "as the engine ran" for the mismatch ledger's
    ``compile`` term and ``unison probe --compile``. An eager scorer's layers are compiled at the first such use."""
    layers = decoder_layers(scorer.model)
    saved = [layer._compiled_call_impl for layer in layers]
    try:
        for layer in layers:
            if on and getattr(layer, "_unison_compiled", None) is None:
                _compile_layer(layer)
            layer._compiled_call_impl = layer._unison_compiled if on else None
        yield
    finally:
        for layer, impl in zip(layers, saved):
            layer._compiled_call_impl = impl


def _compile_layer(layer: torch.nn.Module) -> None:
    """``layer.compile(dynamic=True)``, keeping the compiled call (``_unison_compiled``) so that
    :func:`compiled_as` can switch it off and on."""
    from unison.rollout.decode import no_duck_sizing

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
        from unison import lora

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
    if packing and exact:
        return False, "off: exact mode keeps its fixed padded layout"
    if packing and not use_packed_attention(model):
        return True, (f"{model.config._attn_implementation} attention: packed rows use transformers' "
                      f"block-diagonal mask (quadratic in the packed length)")
    return packing, None


def _exact_forward(model, dist: Dist, peft):
    from unison.exact import ExactForward

    if dist.enabled:
        raise UnisonError("exact mode runs in one process (FSDP gathers weights through its own hooks): "
                          "launch without torchrun, or set exact=false")
    if peft is not None:
        raise UnisonError("exact mode does not take LoRA adapters yet (the engine would need the merged "
                          "weights computed as the learner computes them): set lora.rank=0 or exact=false")
    return ExactForward(model)


def _checkpoint_layer(layer: torch.nn.Module) -> None:
    """Make ``layer`` recompute its activations in the backward pass (non-reentrant checkpoint),
    whatever the module's train/eval mode (the learner runs in eval mode: no dropout)."""
    inner = layer.forward

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    layer.forward = forward
