"""Exact mode: the sampler and the trainer compute bit-identical log-probabilities.

The mismatch has a root cause below any precision format: the rollout engine and
the learner compute the same function with different arithmetic. Remove every
difference and log μ == log π_old == log π_θ bit for bit, in fp32, bf16 and fp16:

1. **one forward** (:class:`ExactForward`) serves the engine's prefill, every decode
   step, the learner's score pass and its training forward;
2. **every matmul sees at least ``MIN_ROWS`` rows** (padded with zeros): this CPU's
   fp32 sgemm rounds differently for 1–11 rows (and bmm for 1–3) — measured, see
   ``docs/exact.md``; from 12 rows on, a row's result does not depend on the others;
3. **attention always reduces over the same keys**: the whole preallocated cache
   length ``K = prompt_width + max_new_tokens``, masked — in the engine's decode as
   in the learner's full forward;
4. **one layout**: every row is left-padded to the same ``prompt_width`` (the longest
   prompt the run can see), in the engine's cache and in the learner's batch;
5. **one dtype**: the learner casts its fp32 master weights to the engine's dtype
   inside the forward (what FSDP's mixed precision does) instead of autocast; the
   engine holds exactly those casts;
6. **one log-probability formula**: ``z_y − logsumexp(z)`` of the fp32 logits over
   the temperature, in both.

The optimizer still updates fp32 master weights; fp16 still uses loss scaling.
Families: Llama, Mistral (no sliding window in use), Qwen2, Qwen3 with SiLU MLPs.
Single process (FSDP would gather the weights through its own hooks: not yet).
On GPUs the same rules need batch-invariant kernels (``docs/exact.md``): untested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unison.errors import UnisonError

#: the smallest row count any matmul sees (this CPU's sgemm is row-count invariant from 12 on)
MIN_ROWS = 12
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def check_supported(config, where: str = "exact mode") -> None:
    from unison.rollout.native import decode_path

    if config.model_type not in FAMILIES or decode_path(config) != "fast":
        raise UnisonError(f"{where} runs Llama, Mistral (without a sliding window), Qwen2 and Qwen3 models; "
                          f"'{config.model_type}' is not one: turn exact off for this model")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnisonError(f"{where} needs a SiLU MLP; this model uses {config.hidden_act}: turn exact off")


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the rows (all leading dims flattened) padded to at least ``MIN_ROWS``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m < MIN_ROWS:
        x2 = F.pad(x2, (0, 0, 0, MIN_ROWS - m))
    return F.linear(x2, w, b)[:m].reshape(*lead, w.shape[0])


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm`` with each matrix's rows padded to at least ``MIN_ROWS``."""
    m = a.shape[1]
    if m < MIN_ROWS:
        a = F.pad(a, (0, 0, 0, MIN_ROWS - m))
    return torch.bmm(a, b)[:, :m]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm, as a function of the (cast) weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def token_logp(logits: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool = False):
    """log p(target) = z_y − logsumexp(z), z = fp32 logits / temperature (engine and learner);
    with ``want_entropy`` also the (detached) entropy of the distribution."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not want_entropy:
        return logp
    with torch.no_grad():
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, ent


class ExactForward:
    """The one forward of exact mode over a Llama-family ``lm`` (a Hugging Face model).

    ``weights(dtype)`` gives every tensor the forward uses, in ``dtype``: the engine's
    own parameters (already in it), or the learner's fp32 masters cast (differentiably).
    """

    def __init__(self, lm: torch.nn.Module):
        check_supported(lm.config)
        self.lm = lm
        cfg = lm.config
        self.n_layers = cfg.num_hidden_layers
        a0 = lm.model.layers[0].self_attn
        self.head_dim, self.scaling = a0.head_dim, a0.scaling
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.eps = cfg.rms_norm_eps
        self.qk_norm = hasattr(a0, "q_norm")
        self.bias = a0.q_proj.bias is not None
        import sys

        self._rope = sys.modules[type(a0).__module__].apply_rotary_pos_emb

    def weights(self, dtype: torch.dtype) -> dict:
        """Per layer: fused q/k/v (and bias), o, norms, fused gate/up, down; plus embed, norm, head."""
        lm = self.lm

        def c(t):
            return t if t.dtype == dtype else t.to(dtype)

        layers = []
        for layer in lm.model.layers:
            a, m = layer.self_attn, layer.mlp
            d = {"ln1": c(layer.input_layernorm.weight), "ln2": c(layer.post_attention_layernorm.weight),
                 "qkv": torch.cat([c(a.q_proj.weight), c(a.k_proj.weight), c(a.v_proj.weight)]),
                 "o": c(a.o_proj.weight), "gu": torch.cat([c(m.gate_proj.weight), c(m.up_proj.weight)]),
                 "down": c(m.down_proj.weight)}
            d["qkv_b"] = torch.cat([c(a.q_proj.bias), c(a.k_proj.bias), c(a.v_proj.bias)]) if self.bias else None
            if self.qk_norm:
                d["qn"], d["kn"] = c(a.q_norm.weight), c(a.k_norm.weight)
            layers.append(d)
        return {"layers": layers, "embed": c(lm.model.embed_tokens.weight), "norm": c(lm.model.norm.weight),
                "head": c(lm.lm_head.weight)}

    def hidden(self, w: dict, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor,
               cache: list | None = None, start: int = 0) -> torch.Tensor:
        """Final-normed hidden states of ``ids`` [b, s] at positions ``pos``.

        ``allowed`` [b, s, K] says which of the K key slots each query attends to (every row
        allows at least itself). With ``cache`` (per layer ``(k, v)`` [b, kv_heads, K, d]) the
        new keys/values are written at ``start`` and attention runs over the whole cache; without
        one, ``s == K`` and the forward's own keys are the K slots (the learner's full forward).
        """
        b, s = ids.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        h = F.embedding(ids, w["embed"])
        cos, sin = self.lm.model.rotary_emb(h, pos)
        q_size, kv_size = nh * hd, nkv * hd
        for i, L in enumerate(w["layers"]):
            x = rms_norm(h, L["ln1"], self.eps)
            q, k, v = linear(x, L["qkv"], L["qkv_b"]).split([q_size, kv_size, kv_size], dim=-1)
            q, k, v = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
            if self.qk_norm:
                q, k = rms_norm(q, L["qn"], self.eps), rms_norm(k, L["kn"], self.eps)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            if cache is not None:
                kc, vc = cache[i]
                kc[:, :, start:start + s] = k
                vc[:, :, start:start + s] = v
                k, v = kc, vc
            K = k.shape[2]
            rep = nh // nkv
            k = k[:, :, None].expand(b, nkv, rep, K, hd).reshape(b * nh, K, hd)
            v = v[:, :, None].expand(b, nkv, rep, K, hd).reshape(b * nh, K, hd)
            scores = bmm(q.reshape(b * nh, s, hd), k.transpose(1, 2)) * self.scaling
            scores = scores.view(b, nh, s, K).masked_fill(~allowed[:, None], float("-inf"))
            attn = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = bmm(attn.view(b * nh, s, K), v).view(b, nh, s, hd).transpose(1, 2).reshape(b, s, q_size)
            h = h + linear(o, L["o"])
            gate, up = linear(rms_norm(h, L["ln2"], self.eps), L["gu"]).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, L["down"])
        return rms_norm(h, w["norm"], self.eps)

    def logits(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        """Output-layer logits of hidden rows [N, H] (rows padded to ``MIN_ROWS``)."""
        return linear(h, w["head"])


def learner_logprobs(fwd: ExactForward, w: dict, tokens: torch.Tensor, key_ok: torch.Tensor,
                     positions: torch.Tensor, temperature: float, chunk: int, return_entropy: bool):
    """The learner's log π (and entropy) over a batch in the engine's layout, [b, K] like tokens."""
    from torch.utils.checkpoint import checkpoint

    b, K = tokens.shape
    pos = (key_ok.long().cumsum(-1) - 1).clamp(min=0)
    h = fwd.hidden(w, tokens, pos, full_allowed(key_ok))
    sel = key_ok[:, 1:] & positions[:, 1:].bool()
    hs, tg = h[:, :-1][sel], tokens[:, 1:][sel]

    def piece(hc, tc):
        return token_logp(fwd.logits(w, hc), tc, temperature, want_entropy=True)

    lps, ents = [], []
    step = chunk if chunk and chunk > 0 else max(hs.shape[0], 1)
    for s in range(0, hs.shape[0], step):
        hc, tc = hs[s:s + step], tg[s:s + step]
        lp, en = checkpoint(piece, hc, tc, use_reentrant=False) if hs.requires_grad else piece(hc, tc)
        lps.append(lp)
        ents.append(en)
    vals = torch.cat(lps) if lps else hs.new_zeros(0, dtype=torch.float32)
    logp = F.pad(torch.zeros((b, K - 1), dtype=torch.float32, device=h.device).masked_scatter(sel, vals), (1, 0))
    if not return_entropy:
        return logp, None
    ent = torch.zeros((b, K - 1), dtype=torch.float32, device=h.device)
    if ents:
        ent = ent.masked_scatter(sel, torch.cat(ents))
    return logp, F.pad(ent, (1, 0))


def full_allowed(key_ok: torch.Tensor) -> torch.Tensor:
    """[b, K, K]: query i attends to real keys j ≤ i, and every query to itself (pad rows stay finite)."""
    K = key_ok.shape[1]
    causal = torch.ones((K, K), dtype=torch.bool, device=key_ok.device).tril()
    eye = torch.eye(K, dtype=torch.bool, device=key_ok.device)
    return (causal[None] & key_ok[:, None, :]) | eye[None]


def divergence_report(learner, engine, batch, rows, logp_pi) -> str:
    """Where exact mode's two sides first differ (for the step-1 error)."""
    from unison.mismatch import first_difference

    return first_difference(logp_pi[rows], batch.logp_mu[rows], batch.response_mask[rows]) or "nowhere"
