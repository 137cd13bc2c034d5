"""Exact mode: the sampler and the trainer compute bit-identical log-probabilities, on any CPU.

The mismatch has a root cause below any precision format: the rollout engine and the learner
compute the same function with different arithmetic. Exact mode removes every difference, so
that log μ == log π_old == log π_θ bit for bit in fp32, bf16 and fp16 (docs/exact.md):

1. **one forward** (:class:`ExactForward`) serves the engine's prefill, every decode step, the
   learner's score pass and its training forward;
2. **one shape per op, whatever the batch.** Every op that combines values — each matmul, the
   attention scores and their softmax, the RMSNorm mean, the log-softmax over the vocabulary —
   runs on **fixed-size blocks of rows** (:class:`ExactOps`: ``block`` rows for the token-wise
   ops, ``attn_block`` query rows of one sequence for attention; the last block zero-padded), one
   call per block. A row's result then depends on its own values and on which row of the block it
   occupies, never on how many rows share the call: any BLAS that is deterministic for a fixed
   shape gives it the same bits in the engine's one-row decode step and in the learner's forward
   over thousands of rows. (Measured thresholds — "pad to ≥ 12 rows" — held on one CPU and failed
   on another: oneDNN/MKL pick kernels and blockings by shape and CPU.)
3. **attention always reduces over the same keys**: the whole preallocated cache length
   ``K = prompt_width + max_new_tokens``, masked — in the engine's decode as in the learner;
4. **one layout**: every row is left-padded to the same ``prompt_width``;
5. **one dtype**: the learner casts its fp32 master weights to the engine's dtype inside the
   forward; the engine holds exactly those casts;
6. **one log-probability formula**: ``z_y − logsumexp(z)`` of the fp32 logits over the
   temperature, computed on the same blocks in both.

The one property left to the machine — the row's position inside a block does not change its
bits (true of GEMM kernels whose micro-tiles divide the block; false, say, of an edge kernel for
the last rows) — is checked at start-up by :func:`self_check` on every op shape and dtype the run
uses, in milliseconds, before anything is written; a failure is refused in one line naming the
op, dtype and shape. What that cannot catch is caught at step 1 with the op, layer and position
where the two sides first diverge (:func:`divergence_report`).

Families: Llama, Mistral (no sliding window in use), Qwen2 (attention biases), Qwen3 (q/k norms),
SiLU MLPs, one process. Others are refused in one line. On GPUs the same rules need
batch-invariant kernels (docs/exact.md): refused until a GPU route has run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unison.errors import UnisonError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: rows per call of the token-wise ops and query rows per attention call (benchmarks/exact_cost.py
#: measured the cost of each; the start-up self-check falls back to the others in this order)
BLOCKS = ((16, 4), (32, 8), (8, 2), (64, 16))


def check_supported(config, where: str = "exact mode") -> None:
    from unison.models import decode_path

    if config.model_type not in FAMILIES or decode_path(config) != "fast":
        raise UnisonError(f"{where} runs Llama, Mistral (without a sliding window), Qwen2 and Qwen3 models; "
                          f"'{config.model_type}' is not one: turn exact off for this model")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnisonError(f"{where} needs a SiLU MLP; this model uses {config.hidden_act}: turn exact off")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm, as a function of the (cast) weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def token_logp(logits: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool = False):
    """log p(target) = z_y − logsumexp(z), z = fp32 logits / temperature; with ``want_entropy``
    also the (detached) entropy of the distribution."""
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


class ExactOps:
    """The row-mixing ops of exact mode, each on one fixed shape: ``block`` rows for the token-wise
    ops, ``attn_block`` query rows (of one sequence, all heads) for attention."""

    def __init__(self, block: int = 16, attn_block: int = 4):
        self.block, self.attn_block = block, attn_block

    def rows(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn`` applied to ``x``'s rows (all leading dims flattened) in blocks of exactly ``block``
        rows (the last one zero-padded); ``fn`` must act row by row."""
        lead, R = x.shape[:-1], self.block
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        pad = (-m) % R
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        out = torch.cat([fn(x2[i:i + R]) for i in range(0, m + pad, R)]) if m else fn(x2[:0])
        return out[:m].reshape(*lead, out.shape[-1])

    def linear(self, x, w, b=None):
        return self.rows(lambda t: F.linear(t, w, b), x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """softmax(q kᵀ · scaling, masked) v per sequence, over all ``K`` key slots.

        ``q`` [b, heads, s, d], ``k``/``v`` [b, kv_heads, K, d], ``allowed`` [b, s, K] (every query
        allows at least one key). Every call is [heads, attn_block, d] @ [heads, d, K] and its
        softmax [heads, attn_block, K]: one shape, whatever ``b`` and ``s``."""
        b, nh, s, d = q.shape
        rep = nh // k.shape[1]
        Ra = self.attn_block
        pad = (-s) % Ra
        outs = []
        for i in range(b):
            kk = k[i].repeat_interleave(rep, dim=0) if rep > 1 else k[i]
            vv = v[i].repeat_interleave(rep, dim=0) if rep > 1 else v[i]
            kt = kk.transpose(1, 2)
            qi, ai = q[i], allowed[i]
            if pad:
                qi = F.pad(qi, (0, 0, 0, pad))
                ai = torch.cat([ai, ai[-1:].expand(pad, -1)])  # pad rows attend like the last: finite
            blocks = []
            for j in range(0, s + pad, Ra):
                sc = torch.bmm(qi[:, j:j + Ra], kt) * scaling
                sc = sc.masked_fill(~ai[None, j:j + Ra], float("-inf"))
                p = torch.softmax(sc, dim=-1, dtype=torch.float32).to(q.dtype)
                blocks.append(torch.bmm(p, vv))
            outs.append(torch.cat(blocks, dim=1)[:, :s])
        return torch.stack(outs)

    def logp(self, h: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, temperature: float,
             want_entropy: bool = False):
        """log p(target) (and the entropy) for hidden rows ``h`` [N, H]: the output layer and the
        log-softmax on blocks of ``block`` rows (the learner)."""
        return self._blocks(lambda hb, tb: token_logp(F.linear(hb, head), tb, temperature, want_entropy),
                            h, targets, want_entropy)

    def token_logp(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """log p(target) of logit rows [N, V] (from :meth:`logits`) on blocks of ``block`` rows (the engine)."""
        return self._blocks(lambda zb, tb: token_logp(zb, tb, temperature), logits, targets, False)

    def _blocks(self, fn, x, targets, pair: bool):
        R, m = self.block, x.shape[0]
        pad = (-m) % R
        if pad:
            x, targets = F.pad(x, (0, 0, 0, pad)), F.pad(targets, (0, pad))
        outs = [fn(x[i:i + R], targets[i:i + R]) for i in range(0, m + pad, R)]
        if not pair:
            return torch.cat(outs)[:m] if outs else x.new_zeros(0, dtype=torch.float32)
        if not outs:
            z = x.new_zeros(0, dtype=torch.float32)
            return z, z
        return torch.cat([o[0] for o in outs])[:m], torch.cat([o[1] for o in outs])[:m]

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return self.linear(h, head)


class ExactForward:
    """The one forward of exact mode over a Llama-family ``lm`` (a Hugging Face model).

    ``weights(dtype)`` gives every tensor the forward uses, in ``dtype``: the engine's
    own parameters (already in it), or the learner's fp32 masters cast (differentiably).
    """

    def __init__(self, lm: torch.nn.Module, ops: ExactOps | None = None):
        check_supported(lm.config)
        self.lm = lm
        self.ops = ops or ExactOps()
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
               cache: list | None = None, start: int = 0, trace: dict | None = None) -> torch.Tensor:
        """Final-normed hidden states of ``ids`` [b, s] at positions ``pos``.

        ``allowed`` [b, s, K] says which of the K key slots each query attends to (every row
        allows at least itself). With ``cache`` (per layer ``(k, v)`` [b, kv_heads, K, d]) the
        new keys/values are written at ``start`` and attention runs over the whole cache; without
        one, ``s == K`` and the forward's own keys are the K slots (the learner's full forward).
        ``trace`` (for :func:`divergence_report`) receives every op's output, by (layer, op).
        """
        ops, eps = self.ops, self.eps
        b, s = ids.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        h = F.embedding(ids, w["embed"])
        cos, sin = self.lm.model.rotary_emb(h, pos)
        q_size, kv_size = nh * hd, nkv * hd

        def keep(layer, op, t):
            if trace is not None:
                trace[(layer, op)] = t.detach()
            return t

        for i, L in enumerate(w["layers"]):
            qkv = keep(i, "q/k/v projection", ops.rows(lambda t: F.linear(rms_norm(t, L["ln1"], eps), L["qkv"],
                                                                           L["qkv_b"]), h))
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k, v = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
            if self.qk_norm:
                q = ops.rows(lambda t: rms_norm(t, L["qn"], eps), q)
                k = ops.rows(lambda t: rms_norm(t, L["kn"], eps), k)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            if cache is not None:
                kc, vc = cache[i]
                kc[:, :, start:start + s] = k
                vc[:, :, start:start + s] = v
                k, v = kc, vc
            o = keep(i, "attention", ops.attend(q, k, v, allowed, self.scaling))
            o = o.transpose(1, 2).reshape(b, s, q_size)
            h = keep(i, "attention output", h + ops.linear(o, L["o"]))
            h = keep(i, "MLP", h + ops.rows(lambda t: _mlp(t, L, eps), h))
        return keep(self.n_layers, "final norm", ops.rows(lambda t: rms_norm(t, w["norm"], eps), h))

    def logits(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        """Output-layer logits of hidden rows [N, H]."""
        return self.ops.logits(h, w["head"])


def _mlp(t, L, eps):
    gate, up = F.linear(rms_norm(t, L["ln2"], eps), L["gu"]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, L["down"])


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
        return fwd.ops.logp(hc, w["head"], tc, temperature, want_entropy=True)

    lps, ents = [], []
    R = fwd.ops.block
    step = max(R, (chunk // R) * R) if chunk and chunk > 0 else max(hs.shape[0], 1)  # whole blocks per chunk
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


# ------------------------------------------------------------------ the start-up self-check
def _shapes(fwd: ExactForward, K: int) -> dict:
    """Every op shape the exact forward runs, by name."""
    cfg = fwd.lm.config
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd, nh, nkv = fwd.head_dim, fwd.n_heads, fwd.n_kv
    return {"linear": sorted({(H, (nh + 2 * nkv) * hd, fwd.bias), (nh * hd, H, False), (H, 2 * I, False),
                              (I, H, False)}),
            "rms_norm": sorted({H, hd} if fwd.qk_norm else {H}), "attention": (nh, hd, K), "log-softmax": (H, V)}


def _roll_equal(fn, x: torch.Tensor, shifts) -> bool:
    """Whether ``fn``'s rows follow its input rows when they are moved to other rows of the block."""
    y = fn(x)
    return all(torch.equal(fn(x.roll(p, 0)), y.roll(p, 0)) for p in shifts)


def _check_ops(ops: ExactOps, shapes: dict, dtype: torch.dtype, gen: torch.Generator) -> str | None:
    """None if every op gives a row the same bits wherever it sits and whatever else is in its block
    (and in calls of any size, through the block wrapper); else "op, dtype, shape"."""
    R, Ra = ops.block, ops.attn_block
    shifts = sorted({1, R // 2, R - 1} - {0})

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    name = str(dtype).removeprefix("torch.")
    for n_in, n_out, bias in shapes["linear"]:
        w, x = rnd(n_out, n_in) * n_in ** -0.5, rnd(3 * R + 5, n_in)
        b = rnd(n_out) if bias else None
        whole = ops.linear(x, w, b)
        if not _roll_equal(lambda t: F.linear(t, w, b), x[:R], shifts) or \
                not torch.equal(ops.linear(x[R + 3:R + 4], w, b), whole[R + 3:R + 4]) or \
                not torch.equal(ops.linear(x[:7], w, b), whole[:7]):
            return f"matmul{' with bias' if bias else ''}, {name}, [{R}, {n_in}] x [{n_in}, {n_out}]"
    for H in shapes["rms_norm"]:
        g = rnd(H)
        if not _roll_equal(lambda t: rms_norm(t, g, 1e-6), rnd(R, H), shifts):
            return f"RMSNorm, {name}, [{R}, {H}]"
    nh, hd, K = shapes["attention"]
    q, k, v = rnd(1, nh, 2 * Ra + 1, hd), rnd(1, nh, K, hd), rnd(1, nh, K, hd)
    allowed = torch.rand(1, 2 * Ra + 1, K, generator=gen) > 0.3
    allowed[..., 0] = True
    full = ops.attend(q, k, v, allowed, hd ** -0.5)
    for j in (0, 1, Ra, 2 * Ra):
        one = ops.attend(q[:, :, j:j + 1], k, v, allowed[:, j:j + 1], hd ** -0.5)
        if not torch.equal(one, full[:, :, j:j + 1]):
            return f"attention (scores, softmax, values), {name}, [{nh}, {Ra}, {hd}] x [{nh}, {hd}, {K}]"
    H, V = shapes["log-softmax"]
    head, h = rnd(V, H) * H ** -0.5, rnd(R + 3, H)
    t = torch.randint(0, V, (R + 3,), generator=gen)
    lp = ops.logp(h, head, t, 1.0)
    engine = ops.token_logp(ops.logits(h[R:R + 1], head), t[R:R + 1], 1.0)  # the engine's one-row decode
    if not torch.equal(engine, lp[R:R + 1]) or not all(
            torch.equal(ops.logp(h[:R].roll(p, 0), head, t[:R].roll(p, 0), 1.0), lp[:R].roll(p, 0)) for p in shifts):
        return f"output layer and log-softmax, {name}, [{R}, {H}] x [{H}, {V}]"
    return None


def self_check(fwd: ExactForward, dtypes, cache_len: int) -> ExactOps:
    """Choose the block sizes this machine gives the invariance for, for every op shape and dtype the
    run uses; refuse in one line if none does. Milliseconds for small models (rows at several
    positions, calls of 1, 7 and 3·block + 5 rows)."""
    failures = []
    for block, attn_block in BLOCKS:
        ops = ExactOps(block, attn_block)
        gen = torch.Generator().manual_seed(0)
        problem = next((p for p in (_check_ops(ops, _shapes(fwd, cache_len), dt, gen) for dt in dtypes) if p), None)
        if problem is None:
            fwd.ops = ops
            return ops
        failures.append(problem)
    raise UnisonError(f"exact mode cannot hold on this CPU: {failures[0]} gives a row different bits depending on "
                      f"where it sits in the call (also with blocks of {', '.join(str(b) for b, _ in BLOCKS[1:])}); "
                      f"set exact=false (and please report the CPU: `lscpu`)")


# ------------------------------------------------------------------ when step 1 still differs
def divergence_report(learner, engine, batch, rows, logp_pi) -> str:
    """Where exact mode's two sides first differ: the row and position, and — replaying that row
    alone through the engine's decode and the learner's forward — the first layer and op whose
    outputs differ."""
    from unison.mismatch import first_difference

    where = first_difference(logp_pi[rows], batch.logp_mu[rows], batch.response_mask[rows]) or "nowhere"
    try:
        op = _first_divergent_op(learner, engine, batch, int(rows[(logp_pi[rows] != batch.logp_mu[rows])
                                                                   .logical_and(batch.response_mask[rows].bool())
                                                                   .any(-1).nonzero()[0, 0]]))
    except Exception as e:  # noqa: BLE001 - the report must not hide the error it reports
        op = f"the replay failed ({type(e).__name__})"
    return f"{where}; {op}"


def _first_divergent_op(learner, engine, batch, row: int) -> str:
    """Replay one row through both sides' code with the engine's weights (the learner's θ_old casts
    are exactly those; after the update the learner's own have moved on)."""
    fwd_l, fwd_e = learner.exact, engine.exact
    w_e = fwd_e.weights(engine.dtype)
    w_l = w_e
    tokens, key_ok = batch.tokens[row:row + 1], batch.attention_mask[row:row + 1].bool()
    K = tokens.shape[1]
    pos = (key_ok.long().cumsum(-1) - 1).clamp(min=0)
    lt: dict = {}
    with torch.no_grad():
        fwd_l.hidden(w_l, tokens, pos, full_allowed(key_ok), trace=lt)
        P = engine.prompt_width or int(batch.prompt_lens[row])
        cache = [(torch.zeros(1, fwd_e.n_kv, K, fwd_e.head_dim, dtype=engine.dtype),
                  torch.zeros(1, fwd_e.n_kv, K, fwd_e.head_dim, dtype=engine.dtype)) for _ in range(fwd_e.n_layers)]
        ok = torch.zeros(1, K, dtype=torch.bool)
        ok[:, :P] = key_ok[:, :P]
        et: dict = {}
        fwd_e.hidden(w_e, tokens[:, :P], pos[:, :P], full_allowed(ok)[:, :P], cache, 0, trace=et)
        found = _compare(lt, et, slice(0, P))
        if found:
            return f"replayed alone, {found} first differs (prefill)"
        cols = torch.arange(K)
        for c in range(P, K - 1):
            if not bool(key_ok[0, c]):
                break
            ok[:, c] = True
            et = {}
            fwd_e.hidden(w_e, tokens[:, c:c + 1], pos[:, c:c + 1], (ok & (cols <= c))[:, None, :], cache, c, trace=et)
            found = _compare(lt, et, slice(c, c + 1))
            if found:
                return f"replayed alone, {found} first differs at position {c}"
    return ("replayed alone the row agrees in every op: the weights differed (a sync that did not take) or the "
            "other rows of the batch mattered")


def _compare(full: dict, step: dict, cols: slice) -> str | None:
    for key in step:  # in the order the forward ran them
        a, b = full[key], step[key]
        a = a[:, :, cols] if key[1] == "attention" else a[:, cols]
        if not torch.equal(a, b):
            layer, op = key
            return f"layer {layer} {op}" if op != "final norm" else "the final norm"
    return None
