"""Exact mode for state-space and hybrid models: Mamba2, and Nemotron-H (Mamba2 mixers, attention and MLPs).

A Mamba2 mixer's rollout engine decodes with the one-token recurrence; its learner re-scores with the chunk-parallel
scan: two algorithms, two roundings (docs/models.md). Exact mode runs **one form on both sides, the recurrence**: the
learner's forward steps through the sequence as the engine's decode does, and every op gives a row the same bits
however many rows share the call:

* projections and norms: :class:`~unison.exact.ExactOps`, on fixed-size blocks of rows (checked at start-up);
* the causal convolution: its taps multiplied and summed elementwise over a window of the last ``conv_kernel``
  inputs, in one order (the engine's window is its cache, the learner's the sequence itself);
* the scan: the fp32 state updated elementwise, one token at a time; its contraction with ``C`` summed by a fixed
  pairwise tree of elementwise adds (no reduction kernel, whose split could depend on the row count);
* softplus, exp and SiLU on whole vectors (:func:`~unison.exact.whole_vectors`): PyTorch's CPU kernels compute the
  last few elements of a call, and the ends of each thread's share, in scalar code, whose fp32 SiLU and softplus
  differ from the vector code's in the last bit;
* attention (Nemotron-H, no positional embedding): :meth:`~unison.exact.ExactOps.attend` over the whole cache.

The state is fp32 on both sides (``rollout.state_dtype=model`` is refused in exact mode), and the model's own
``time_step_limit`` bounds the step on both (transformers' recurrent update leaves it out; its chunked scan applies it).
The learner's forward steps through the K positions one at a time for the scan's value; its gradient is that of
transformers' chunk-parallel form of the same function (docs/exact.md has the cost).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from unison.exact import (SSM_FAMILIES, ExactForward, ExactOps, attend_cached, blocked, caster, causal_conv,
                          check_supported, normalize, tracer, tree_sum, whole_vectors)
from unison.exact_gdn import GdnExactForward


def exact_forward(lm: torch.nn.Module):
    """Exact mode's one forward for ``lm``: a Llama-family model's (unison/exact.py), a Mamba2 / Nemotron-H
    model's (:class:`SsmExactForward`) or a Qwen3-Next model's (unison/exact_gdn.py)."""
    check_supported(lm.config)
    kind = lm.config.model_type
    if kind == "qwen3_next":
        return GdnExactForward(lm)
    return SsmExactForward(lm) if kind in SSM_FAMILIES else ExactForward(lm)


def _norm_fp32w(x, w, eps):
    """Nemotron-H's RMSNorm: the weight applied in fp32, the result cast back."""
    return (w.float() * normalize(x.float(), eps)).to(x.dtype)


def _recurrent(xh, Bg, Cg, dt, dt_bias, A_log, D, limit, h):
    """The scan's value: the fp32 state ``h`` [b, heads, head_dim, state] updated one token at a time, elementwise,
    its contraction with C by :func:`tree_sum`; returns y [b, s, heads, head_dim] (D's skip added) and the last
    state."""
    b, s, nh, hd = xh.shape
    G = Bg.shape[2]
    dtf = whole_vectors(F.softplus, dt.float() + dt_bias.float())
    if tuple(limit) != (0.0, float("inf")):
        dtf = dtf.clamp(*limit)
    dA = whole_vectors(torch.exp, dtf * -whole_vectors(torch.exp, A_log.float()))
    group = torch.arange(nh, device=xh.device) // (nh // G)
    Bh, Ch = Bg[:, :, group], Cg[:, :, group]
    ys = []
    for t in range(s):
        h = h * dA[:, t, :, None, None] + (dtf[:, t, :, None, None] * xh[:, t, :, :, None]) * Bh[:, t, :, None, :]
        ys.append(tree_sum(h * Ch[:, t, :, None, :]))
    return torch.stack(ys, dim=1) + xh * D.float()[:, None], h


def _chunked(xh, Bg, Cg, dt, dt_bias, A_log, D, limit, chunk, scan):
    """The same scan in transformers' chunk-parallel form (``scan``: the model's own module's ``mamba2_chunk_scan``,
    its reference kernel): the gradient side of the learner's forward, which then pays for one chunked backward rather
    than one through every token's update."""
    return scan(xh, dt.float(), -torch.exp(A_log.float()), Bg, Cg, chunk, D=D.float(), dt_bias=dt_bias.float(),
                dt_softplus=True, dt_limit=tuple(limit))


class SsmExactForward:
    """The one forward of exact mode over a Mamba2 or Nemotron-H ``lm`` (a Hugging Face model); the interface of
    :class:`~unison.exact.ExactForward` (``weights``, ``hidden``, ``logits``, ``new_cache``, ``shapes``)."""

    def __init__(self, lm: torch.nn.Module, ops: ExactOps | None = None):
        self.lm, self.ops = lm, ops or ExactOps()
        cfg = lm.config
        dec = lm.get_decoder()
        self.nemotron = cfg.model_type == "nemotron_h"
        self.kinds = [getattr(layer, "block_type", "linear_attention") for layer in dec.layers]
        self.n_layers = len(self.kinds)
        self.eps = cfg.layer_norm_epsilon
        self.residual_fp32 = bool(getattr(cfg, "residual_in_fp32", False))
        mixer = next(layer.mixer for layer, k in zip(dec.layers, self.kinds) if k == "linear_attention")
        self.nh, self.hd, self.N, self.G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
        self.I, self.conv_dim, self.k = mixer.intermediate_size, mixer.conv_dim, mixer.conv_kernel_size
        self.norm_group = getattr(mixer.norm, "group_size", self.I)
        self.dt_limit = tuple(float(v) for v in mixer.time_step_limit)
        self.chunk = mixer.chunk_size
        #: the gradient side of the scan: the model's modeling module's chunked scan (Mamba2's and Nemotron-H's own)
        self.chunk_scan = sys.modules[type(mixer).__module__].mamba2_chunk_scan
        self.act = getattr(mixer, "activation", "silu")
        attn = next((layer.mixer for layer, k in zip(dec.layers, self.kinds) if k == "full_attention"), None)
        self.head_dim = attn.head_dim if attn is not None else None
        self.n_heads = cfg.num_attention_heads if attn is not None else None
        self.n_kv = cfg.num_key_value_heads if attn is not None else None
        self.scaling = attn.scaling if attn is not None else None
        self.mlp_act = getattr(cfg, "mlp_hidden_act", None)

    # ----------------------------------------------------------------------------------------- weights and caches
    def weights(self, dtype: torch.dtype) -> dict:
        """Per layer its block's tensors in ``dtype``; plus embed, norm, head."""
        c = caster(dtype)
        dec, layers = self.lm.get_decoder(), []
        for layer, kind in zip(dec.layers, self.kinds):
            m, d = layer.mixer, {"kind": kind, "ln": c(layer.norm.weight)}
            if kind == "linear_attention":
                d.update(inp=c(m.in_proj.weight), inp_b=c(m.in_proj.bias), conv=c(m.conv1d.weight.squeeze(1)),
                         conv_b=c(m.conv1d.bias), dt_bias=c(m.dt_bias), A_log=c(m.A_log), D=c(m.D),
                         gn=c(m.norm.weight), out=c(m.out_proj.weight), out_b=c(m.out_proj.bias))
            elif kind == "full_attention":
                d.update(qkv=torch.cat([c(m.q_proj.weight), c(m.k_proj.weight), c(m.v_proj.weight)]),
                         o=c(m.o_proj.weight))
            else:  # mlp
                d.update(up=c(m.up_proj.weight), up_b=c(m.up_proj.bias), down=c(m.down_proj.weight),
                         down_b=c(m.down_proj.bias))
            layers.append(d)
        return {"layers": layers, "embed": c(dec.embeddings.weight), "norm": c(dec.norm_f.weight),
                "head": c(self.lm.lm_head.weight)}

    def new_cache(self, B: int, K: int, dtype: torch.dtype, device) -> list:
        """Per layer: a Mamba2 mixer's (convolution window [B, k−1, conv_dim] in ``dtype``, fp32 state
        [B, heads, head_dim, state]); an attention layer's (keys, values) [B, kv_heads, K, head_dim]; an MLP's ()."""
        out = []
        for kind in self.kinds:
            if kind == "linear_attention":
                out.append((torch.zeros(B, self.k - 1, self.conv_dim, dtype=dtype, device=device),
                            torch.zeros(B, self.nh, self.hd, self.N, dtype=torch.float32, device=device)))
            elif kind == "full_attention":
                shape = (B, self.n_kv, K, self.head_dim)
                out.append((torch.zeros(shape, dtype=dtype, device=device),
                            torch.zeros(shape, dtype=dtype, device=device)))
            else:
                out.append(())
        return out

    def shapes(self, K: int) -> dict:
        """Every blocked op shape the forward runs, by name (the start-up self-check's)."""
        cfg = self.lm.config
        H, V = cfg.hidden_size, cfg.vocab_size
        lin, norms = set(), {H}

        def shape(linear):  # [in, out, bias] of one nn.Linear, as the forward multiplies by it
            return linear.in_features, linear.out_features, linear.bias is not None

        for layer, kind in zip(self.lm.get_decoder().layers, self.kinds):
            m = layer.mixer
            if kind == "linear_attention":
                lin |= {shape(m.in_proj), shape(m.out_proj)}
                norms.add(self.norm_group)
            elif kind == "full_attention":  # q/k/v fused into one product
                lin |= {(H, (self.n_heads + 2 * self.n_kv) * self.head_dim, False), shape(m.o_proj)}
            else:
                lin |= {shape(m.up_proj), shape(m.down_proj)}
        attention = (self.n_heads, self.n_kv, self.head_dim, K) if self.n_heads else None
        return {"linear": sorted(lin), "rms_norm": sorted(norms), "attention": attention, "log-softmax": (H, V)}

    # ---------------------------------------------------------------------------------------------- the forward
    def _norm(self, x, w):
        return self.ops.rows(_norm_fp32w, x, w, self.eps) if self.nemotron else self.ops.norm(x, w, self.eps)

    def hidden(self, w: dict, ids: torch.Tensor, pos: torch.Tensor, key_ok: torch.Tensor, cache: list | None = None,
               start: int = 0, trace: dict | None = None) -> torch.Tensor:
        """Final-normed hidden states of ``ids`` [b, s], the tokens at columns ``start``.. of the layout whose real
        slots ``key_ok`` [b, K] marks (the learner: no cache, ``s == K``; the engine: ``cache`` from
        :meth:`new_cache`, updated in place). ``pos`` is unused (a state-space block's state is its position)."""
        b, s = ids.shape
        dtype = w["embed"].dtype
        m = key_ok[:, start:start + s, None].to(dtype)
        h = F.embedding(ids, w["embed"])

        keep = tracer(trace)
        for i, L in enumerate(w["layers"]):
            res = h.float() if self.residual_fp32 else h
            x = self._norm(h.to(dtype), L["ln"])
            state = None if cache is None else cache[i]
            if L["kind"] == "linear_attention":
                out = self._mamba(i, L, x, m, state, cache is not None, keep)
            elif L["kind"] == "full_attention":
                out = self._attention(i, L, x, key_ok, start, state, keep)
            else:
                up = self.ops.linear(x, L["up"], L["up_b"])
                out = self.ops.linear(torch.square(F.relu(up)), L["down"], L["down_b"])
            h = keep(i, L["kind"].replace("linear_attention", "mamba mixer"), res + out)
        hf = self.ops.rows(_norm_fp32w, h, w["norm"], self.eps) if self.nemotron else \
            self.ops.norm(h, w["norm"], self.eps)
        return keep(self.n_layers, "final norm", hf.to(dtype))

    def _mamba(self, i, L, x, m, state, cached: bool, keep):
        b, s, _ = x.shape
        dtype, ops = x.dtype, self.ops
        nh, hd, N, G, I = self.nh, self.hd, self.N, self.G, self.I
        proj = keep(i, "in_proj", ops.linear(x * m, L["inp"], L["inp_b"]))
        z, xbc, dt = proj.split([I, self.conv_dim, nh], dim=-1)
        # the causal convolution over the window [earlier inputs, this call's]: taps in one order, in fp32
        prior = state[0] if cached else xbc.new_zeros(b, self.k - 1, self.conv_dim)
        seq = torch.cat([prior, xbc], dim=1)
        if cached:
            state[0].copy_(seq[:, -(self.k - 1):])
        xbc = whole_vectors(F.silu, causal_conv(seq, L["conv"], L["conv_b"], s).to(dtype)) * m
        xs, Bs, Cs = xbc.split([I, G * N, G * N], dim=-1)
        # the scan, one token at a time (its value); its gradient that of transformers' chunk-parallel form
        xh, Bg, Cg = xs.float().view(b, s, nh, hd), Bs.float().view(b, s, G, N), Cs.float().view(b, s, G, N)
        params = (Bg, Cg, dt, L["dt_bias"], L["A_log"], L["D"], self.dt_limit)
        if cached:
            yh, last = _recurrent(xh, *params, state[1])
            state[1].copy_(last)
        else:
            yh = blocked(lambda: _recurrent(xh, *params, xh.new_zeros(b, nh, hd, N))[0], _chunked, xh, *params,
                         self.chunk, self.chunk_scan)
        y = keep(i, "scan", yh.to(dtype).view(b, s, I))
        # the gated norm (per group of channels), then out_proj
        g = y.float() * whole_vectors(F.silu, z.float())
        gn = ops.rows(normalize, g.view(b, s, I // self.norm_group, self.norm_group), self.eps).view(b, s, I)
        gate = keep(i, "gate", L["gn"] * gn.to(dtype))
        return keep(i, "linear", ops.linear(gate, L["out"], L["out_b"]))

    def _attention(self, i, L, x, key_ok, start, state, keep):
        b, s, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        qkv = keep(i, "q/k/v projection", self.ops.linear(x, L["qkv"]))
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
        o = keep(i, "attention", attend_cached(self.ops, q, k, v, key_ok, start, state, self.scaling))
        return self.ops.linear(o.transpose(1, 2).reshape(b, s, nh * hd), L["o"])

    def logits(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        return self.ops.logits(h, w["head"])
