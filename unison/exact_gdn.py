"""Exact mode for Qwen3-Next: Gated DeltaNet layers, gated attention, SiLU MLPs (dense: no experts).

As for Mamba2 (unison/exact_ssm.py), the engine's decode runs the gated delta rule's one-token recurrence and the
learner's forward the chunk-parallel form; exact mode runs **the recurrence on both sides**, every op batch-invariant
by construction or on the blocks the start-up self-check covers:

* the projections, the (1 + w) RMSNorms, the q/k norms and the gated norm's normalisation on blocks of rows;
* the causal convolution's taps elementwise in one order (:func:`~unison.exact.causal_conv`);
* the delta rule in fp32, one token at a time: the state decayed, read (``k·S``), corrected and read again (``q·S``),
  each contraction a fixed pairwise tree (:func:`~unison.exact.tree_sum`), the L2 norms of q and k the same way;
* sigmoid, softplus, exp, SiLU, the rotary cos/sin on whole vectors (:func:`~unison.exact.whole_vectors`);
* attention on :meth:`~unison.exact.ExactOps.attend` over the whole cache, its output gated by sigmoid.

In the training forward the scan's value is the recurrence and its gradient that of transformers' chunked form
(the model's module's ``torch_chunk_gated_delta_rule``, the same function).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from unison.exact import (ExactOps, attend_cached, blocked, caster, causal_conv, normalize, tracer, tree_sum,
                          whole_vectors)


def _norm_1p(x, w, eps):
    """Qwen3-Next's RMSNorm: x / rms(x) · (1 + w), in fp32, cast back."""
    return (normalize(x.float(), eps) * (1.0 + w.float())).to(x.dtype)


def _l2norm(x):
    """x / ‖x‖ over the last dim (eps 1e-6, as the reference kernels), the square sum by a fixed tree."""
    return x * whole_vectors(torch.rsqrt, tree_sum(x * x) + 1e-6)[..., None]


def _recurrent(q, k, v, g, beta, S):
    """The gated delta rule's value, one token at a time: q, k [b, s, heads, dk], v [b, s, heads, dv], g and beta
    [b, s, heads] (fp32), the state S [b, heads, dk, dv]; returns the output [b, s, heads, dv] and the last state."""
    q, k = _l2norm(q) / q.shape[-1] ** 0.5, _l2norm(k)
    decay = whole_vectors(torch.exp, g)
    outs = []
    for t in range(q.shape[1]):
        S = S * decay[:, t, :, None, None]
        kt = k[:, t, :, :, None]
        read = tree_sum((S * kt).transpose(-1, -2))  # k·S over dk: [b, heads, dv]
        S = S + kt * ((v[:, t] - read) * beta[:, t, :, None])[:, :, None, :]
        outs.append(tree_sum((S * q[:, t, :, :, None]).transpose(-1, -2)))
    return torch.stack(outs, dim=1), S


def _chunked(q, k, v, g, beta, rule):
    """The same rule in transformers' chunk-parallel form (``rule``: the model's module's
    ``torch_chunk_gated_delta_rule``, its reference kernel): the gradient side."""
    return rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


class GdnExactForward:
    """The one forward of exact mode over a dense Qwen3-Next ``lm``; the interface of
    :class:`~unison.exact.ExactForward` (``weights``, ``hidden``, ``logits``, ``new_cache``, ``shapes``)."""

    def __init__(self, lm: torch.nn.Module, ops: ExactOps | None = None):
        self.lm, self.ops = lm, ops or ExactOps()
        cfg = lm.config
        self.kinds = list(cfg.layer_types[:cfg.num_hidden_layers])
        self.n_layers, self.eps = len(self.kinds), cfg.rms_norm_eps
        layers = lm.model.layers
        la = next(layers[i].linear_attn for i, k in enumerate(self.kinds) if k == "linear_attention")
        self.hk, self.hv, self.dk, self.dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
        self.k, self.conv_dim, self.key_dim, self.value_dim = la.conv_kernel_size, la.conv_dim, la.key_dim, la.value_dim
        sa = next(layers[i].self_attn for i, k in enumerate(self.kinds) if k == "full_attention")
        self.head_dim, self.scaling = sa.head_dim, sa.scaling
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.rope = lm.model.rotary_emb
        self._apply_rope = sys.modules[type(sa).__module__].apply_rotary_pos_emb
        self._chunk_rule = sys.modules[type(la).__module__].torch_chunk_gated_delta_rule

    def weights(self, dtype: torch.dtype) -> dict:
        c = caster(dtype)
        out = []
        for layer, kind in zip(self.lm.model.layers, self.kinds):
            m = layer.mlp
            d = {"kind": kind, "ln1": c(layer.input_layernorm.weight), "ln2": c(layer.post_attention_layernorm.weight),
                 "gu": torch.cat([c(m.gate_proj.weight), c(m.up_proj.weight)]), "down": c(m.down_proj.weight)}
            if kind == "linear_attention":
                a = layer.linear_attn
                d.update(qkvz=c(a.in_proj_qkvz.weight), ba=c(a.in_proj_ba.weight), conv=c(a.conv1d.weight.squeeze(1)),
                         dt_bias=c(a.dt_bias), A_log=c(a.A_log), gn=c(a.norm.weight), out=c(a.out_proj.weight))
            else:
                a = layer.self_attn
                d.update(qkv=torch.cat([c(a.q_proj.weight), c(a.k_proj.weight), c(a.v_proj.weight)]),
                         qn=c(a.q_norm.weight), kn=c(a.k_norm.weight), o=c(a.o_proj.weight))
            out.append(d)
        m = self.lm.model
        return {"layers": out, "embed": c(m.embed_tokens.weight), "norm": c(m.norm.weight),
                "head": c(self.lm.lm_head.weight)}

    def new_cache(self, B: int, K: int, dtype: torch.dtype, device) -> list:
        """Per layer: a Gated DeltaNet's (convolution window [B, k−1, conv_dim] in ``dtype``, fp32 state
        [B, v_heads, dk, dv]); an attention layer's (keys, values) [B, kv_heads, K, head_dim]."""
        def z(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        return [(z(B, self.k - 1, self.conv_dim), z(B, self.hv, self.dk, self.dv, dt=torch.float32))
                if kind == "linear_attention" else (z(B, self.n_kv, K, self.head_dim), z(B, self.n_kv, K, self.head_dim))
                for kind in self.kinds]

    def shapes(self, K: int) -> dict:
        cfg = self.lm.config
        H, I, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, self.head_dim
        lin = {(H, 2 * I, False), (I, H, False), (H, 2 * self.key_dim + 2 * self.value_dim, False),
               (H, 2 * self.hv, False), (self.value_dim, H, False), (H, (2 * self.n_heads + 2 * self.n_kv) * hd, False),
               (self.n_heads * hd, H, False)}
        return {"linear": sorted(lin), "rms_norm": sorted({H, hd, self.dv}),
                "attention": (self.n_heads, self.n_kv, hd, K), "log-softmax": (H, V)}

    def _cos_sin(self, pos: torch.Tensor, dtype: torch.dtype):
        """The rotary cos/sin at ``pos`` [b, s] (transformers' formula; cos and sin on whole vectors)."""
        freqs = pos[..., None].float() * self.rope.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = self.rope.attention_scaling
        return ((whole_vectors(torch.cos, emb) * scale).to(dtype), (whole_vectors(torch.sin, emb) * scale).to(dtype))

    def hidden(self, w: dict, ids: torch.Tensor, pos: torch.Tensor, key_ok: torch.Tensor, cache: list | None = None,
               start: int = 0, trace: dict | None = None) -> torch.Tensor:
        """As :meth:`unison.exact_ssm.SsmExactForward.hidden`; ``pos`` gives the attention layers' rotary positions."""
        ops, eps = self.ops, self.eps
        b, s = ids.shape
        dtype = w["embed"].dtype
        m = key_ok[:, start:start + s, None].to(dtype)
        h = F.embedding(ids, w["embed"])
        cos, sin = self._cos_sin(pos, dtype)

        keep = tracer(trace)
        for i, L in enumerate(w["layers"]):
            x = ops.rows(_norm_1p, h, L["ln1"], eps)
            state = None if cache is None else cache[i]
            if L["kind"] == "linear_attention":
                h = keep(i, "gated deltanet", h + self._gdn(i, L, x * m, state, keep))
            else:
                h = keep(i, "attention output", h + self._attention(i, L, x, key_ok, start, cos, sin, state, keep))
            gate, up = ops.linear(ops.rows(_norm_1p, h, L["ln2"], eps), L["gu"]).chunk(2, dim=-1)
            h = keep(i, "MLP", h + ops.linear(whole_vectors(F.silu, gate) * up, L["down"]))
        return keep(self.n_layers, "final norm", ops.rows(_norm_1p, h, w["norm"], eps))

    def _gdn(self, i, L, x, state, keep):
        b, s, _ = x.shape
        dtype, ops = x.dtype, self.ops
        hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.hv // self.hk
        qkvz = keep(i, "in_proj", ops.linear(x, L["qkvz"])).view(b, s, hk, 2 * dk + 2 * r * dv)
        ba = ops.linear(x, L["ba"]).view(b, s, hk, 2 * r)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)  # transformers' per-key-head grouping
        bb, a = (t.reshape(b, s, hv) for t in ba.split([r, r], dim=-1))
        mixed = torch.cat([q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], dim=-1)
        prior = state[0] if state else mixed.new_zeros(b, self.k - 1, self.conv_dim)
        seq = torch.cat([prior, mixed], dim=1)
        if state:
            state[0].copy_(seq[:, -(self.k - 1):])
        mixed = whole_vectors(F.silu, causal_conv(seq, L["conv"], None, s).to(dtype))
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (t.reshape(b, s, hk, dk).float().repeat_interleave(r, dim=2) for t in (q, k))
        v = v.reshape(b, s, hv, dv).float()
        beta = whole_vectors(torch.sigmoid, bb).float()
        g = -whole_vectors(torch.exp, L["A_log"].float()) * whole_vectors(F.softplus, a.float() + L["dt_bias"].float())
        if state:
            core, last = _recurrent(q, k, v, g, beta, state[1])
            state[1].copy_(last)
        else:
            core = blocked(lambda: _recurrent(q, k, v, g, beta, q.new_zeros(b, hv, dk, dv))[0], _chunked, q, k, v, g,
                           beta, self._chunk_rule)
        core = keep(i, "scan", core.to(dtype))
        gated = (ops.norm(core, L["gn"], self.eps).float() * whole_vectors(F.silu, z.reshape(b, s, hv, dv).float()))
        gated = keep(i, "gate", gated.to(dtype).reshape(b, s, self.value_dim))
        return keep(i, "linear", ops.linear(gated, L["out"]))

    def _attention(self, i, L, x, key_ok, start, cos, sin, state, keep):
        b, s, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        qkv = keep(i, "q/k/v projection", self.ops.linear(x, L["qkv"]))
        qg, k, v = qkv.split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, gate = qg.view(b, s, nh, 2 * hd).chunk(2, dim=-1)
        q = self.ops.rows(_norm_1p, q, L["qn"], self.eps).transpose(1, 2)
        k = self.ops.rows(_norm_1p, k.view(b, s, nkv, hd), L["kn"], self.eps).transpose(1, 2)
        v = v.view(b, s, nkv, hd).transpose(1, 2)
        q, k = self._apply_rope(q, k, cos, sin)  # the rotary part of each head (partial_rotary_factor)
        o = keep(i, "attention", attend_cached(self.ops, q, k, v, key_ok, start, state, self.scaling))
        o = o.transpose(1, 2).reshape(b, s, nh * hd) * whole_vectors(torch.sigmoid, gate.reshape(b, s, nh * hd))
        return self.ops.linear(o, L["o"])

    def logits(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        return self.ops.logits(h, w["head"])
