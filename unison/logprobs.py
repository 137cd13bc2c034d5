"""log π of tokens: the learner's forward (never the KV-cache path the rollout engine uses).

Scoring is one full forward pass over prompt + response: the difference between it and the engine's incremental
decode is the training–inference mismatch. :class:`PolicyForward` wraps the causal LM so that a sharded learner
enters it through one root module; :func:`token_logprobs` is its one-call form; :class:`unison.policy.Scorer` holds
the policy that calls them.

Log-probabilities never materialise the whole ``[rows, positions, vocab]`` logits: hidden states go through the
output layer in chunks of positions (``train.logprob_chunk``), each giving ``logit − logsumexp`` and the entropy,
and during training every chunk but the last is recomputed in the backward pass (activation checkpointing)
instead of being kept. The last is kept: the backward starts with it, so recomputing it would cost its matmul
again and save no memory at the peak (a micro-batch within the default token budget is one chunk). On-policy
distillation's full estimator (``distill.estimator: full``) computes, chunk by chunk in the same pass, the exact
reverse KL of each position's distribution to a teacher's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from unison import gemm
from unison.models import PACKED_ATTENTION, logit_transform, packed_forward, packed_kwargs
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
            if attention_mask is None and self.lm.config._attn_implementation.endswith(PACKED_ATTENTION):
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
