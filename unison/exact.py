"""Exact mode: the sampler and the trainer compute bit-identical log-probabilities, on any CPU.

The mismatch has a root cause below any precision format: the rollout engine and the learner
compute the same function with different arithmetic. Exact mode removes every difference, so
that log μ == log π_old == log π_θ bit for bit in fp32, bf16 and fp16 (docs/exact.md):

1. **one forward** (:class:`ExactForward`) serves the engine's prefill, every decode step, the
   learner's score pass and its training forward;
2. **one shape per op, whatever the batch.** Every op that combines values — each matmul, the
   attention scores and their softmax, the RMSNorm mean, the log-softmax over the vocabulary —
   runs on **fixed-size blocks of rows** (:class:`ExactOps`: ``block`` rows for the token-wise
   ops, ``head_block`` for the output layer and its log-softmax, ``attn_block`` query rows for
   attention; the last block zero-padded), each block its own call or its own matrix of a batched
   call. A row's result then depends on its own values and on which row of the block it
   occupies, never on how many rows share the call: any BLAS that is deterministic for a fixed
   shape gives it the same bits in the engine's one-row decode step and in the learner's forward
   over thousands of rows. (Measured thresholds — "pad to ≥ 12 rows" — held on one CPU and failed
   on another: oneDNN/MKL pick kernels and blockings by shape and CPU.) Only values are blocked:
   the gradient is that of one call over all rows (:class:`_Blocked`);
3. **attention always reduces over the same keys**: the whole preallocated cache length
   ``K = prompt_width + max_new_tokens``, masked — in the engine's decode as in the learner;
4. **one layout**: every row is left-padded to the same ``prompt_width``;
5. **one dtype**: the learner casts its fp32 master weights to the engine's dtype inside the
   forward; the engine holds exactly those casts;
6. **one log-probability formula**: ``z_y − logsumexp(z)`` of the fp32 logits over the
   temperature, computed on the same blocks in both.

The properties left to the machine — the row's position inside a block does not change its
bits (true of GEMM kernels whose micro-tiles divide the block; false, say, of an edge kernel for
the last rows), nor does the number of matrices in a batched call — are checked at start-up by
:func:`self_check` on every op shape and dtype the run uses (0.3 s for the tiny model, 1.6 s for
SmolLM2-135M in fp32 + bf16), before anything is written; a failure is refused in one line naming the
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
from unison.mismatch import first_difference
from unison.models import decode_path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: (rows per block of the token-wise ops, query rows per attention block, rows per output-layer block):
#: benchmarks/exact_cost.py measured the cost of each; the start-up self-check falls back in this order
BLOCKS = ((16, 4, 64), (32, 8, 64), (8, 2, 8), (64, 16, 64))


def check_supported(config, where: str = "exact mode") -> None:
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


class _Blocked(torch.autograd.Function):
    """``fn(x, *params)`` whose value is computed on fixed-size blocks of rows (exact mode's bits) and
    whose gradient is that of one call over all rows — the same function, so the same gradient up to
    rounding, at the cost of one large backward instead of many small ones. Saves only the inputs: the
    backward recomputes the one-call forward (a matmul's gradient needs no recomputation)."""

    @staticmethod
    def forward(ctx, value, fn, x, *params):
        ctx.fn = fn
        ctx.save_for_backward(x, *[p for p in params if isinstance(p, torch.Tensor)])
        ctx.tensor_at = [isinstance(p, torch.Tensor) for p in params]
        ctx.others = [None if isinstance(p, torch.Tensor) else p for p in params]
        out = value()
        if isinstance(out, tuple):
            ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, g, *_):
        x, *tensors = ctx.saved_tensors
        it = iter(tensors)
        params = [next(it) if is_t else o for is_t, o in zip(ctx.tensor_at, ctx.others)]
        if ctx.fn is F.linear:  # y = x wᵀ + b over [m, in] rows
            w, b = params[0], params[1] if len(params) > 1 else None
            gx = g @ w if ctx.needs_input_grad[2] else None
            gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[3] else None
            gb = g.reshape(-1, g.shape[-1]).sum(0) if b is not None and ctx.needs_input_grad[4] else None
            return (None, None, gx, gw, gb)[:3 + len(params)]
        want = [x] + [p for p in params if isinstance(p, torch.Tensor)]
        needs = [ctx.needs_input_grad[2]] + [n for n, p in zip(ctx.needs_input_grad[3:], params)
                                             if isinstance(p, torch.Tensor)]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n and t.is_floating_point()) for t, n in zip(want, needs)]
            it = iter(leaves[1:])
            out = ctx.fn(leaves[0], *[next(it) if is_t else o for is_t, o in zip(ctx.tensor_at, ctx.others)])
            out = out[0] if isinstance(out, tuple) else out
            diff = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, diff, g) if diff else ())
        gl = [next(grads) if t.requires_grad else None for t in leaves]
        it = iter(gl[1:])
        return (None, None, gl[0], *[next(it) if is_t else None for is_t in ctx.tensor_at])


def _blocked(value, fn, x, *params):
    """``value()`` (blocked, exact) in the forward; with gradients wanted, the one-call gradient of ``fn``."""
    wants = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, *params))
    if not wants:
        return value()
    return _Blocked.apply(value, fn, x, *params)


class ExactOps:
    """The row-mixing ops of exact mode, each on one fixed shape: ``block`` rows for the token-wise
    ops, ``head_block`` rows for the output layer and log-softmax, ``attn_block`` query rows (per
    sequence and key head) for attention.

    The forward value is always computed on those blocks. The gradient (the learner's update) is that
    of one call over all rows (:class:`_Blocked`): gradients need no exactness, only the values."""

    def __init__(self, block: int = 16, attn_block: int = 4, head_block: int = 64):
        self.block, self.attn_block, self.head_block = block, attn_block, head_block

    def _each_block(self, fn, x2: torch.Tensor, *params, R: int | None = None) -> torch.Tensor:
        R, m = R or self.block, x2.shape[0]
        pad = (-m) % R
        x2 = F.pad(x2, (0, 0, 0, pad)) if pad else x2.contiguous()  # one memory layout, whatever the caller's
        if not m:
            return fn(x2[:0], *params)
        with torch.no_grad():
            if fn is F.linear and x2.dtype == torch.float32:  # all blocks in one batched call (below)
                return batched_linear(x2.view(-1, R, x2.shape[-1]), *params).flatten(0, 1)[:m]
            return torch.cat([fn(x2[i:i + R], *params) for i in range(0, m + pad, R)])[:m]

    def rows(self, fn, x: torch.Tensor, *params, R: int | None = None) -> torch.Tensor:
        """``fn(rows, *params)`` applied to ``x``'s rows (all leading dims flattened) in blocks of exactly
        ``R`` rows (``block`` if not given; the last one zero-padded); ``fn`` must act row by row."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out = _blocked(lambda: self._each_block(fn, x2, *params, R=R), fn, x2, *params)
        return out.reshape(*lead, out.shape[-1])

    def linear(self, x, w, b=None):
        return self.rows(F.linear, x, w, b)

    def norm(self, x, w, eps):
        return self.rows(rms_norm, x, w, eps)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """softmax(q kᵀ · scaling, masked) v per sequence, over all ``K`` key slots.

        ``q`` [b, heads, s, d], ``k``/``v`` [b, kv_heads, K, d], ``allowed`` [b, s, K] (every query
        allows at least one key). One batched call per block of ``attn_block`` query rows, for every
        sequence and key head at once; each matrix of it is [q_heads_per_kv_head · attn_block, d] @ [d, K]
        and its softmax [.., K]: one shape, whatever ``b`` and ``s`` (the number of matrices in the
        call varies; the self-check compares one sequence alone with several)."""
        return _blocked(lambda: self._attend_blocks(q, k, v, allowed, scaling), _attend_whole, q, k, v, allowed,
                        scaling)

    def _attend_blocks(self, q, k, v, allowed, scaling):
        b, nh, s, d = q.shape
        nkv, K = k.shape[1], k.shape[2]
        rep, Ra = nh // nkv, self.attn_block
        pad = (-s) % Ra
        if pad:
            q = F.pad(q, (0, 0, 0, pad))
            allowed = torch.cat([allowed, allowed[:, -1:].expand(-1, pad, -1)], dim=1)  # pad rows attend like the last
        nq = (s + pad) // Ra
        # one memory layout for every operand, whatever the caller's strides (a BLAS may take another
        # kernel for a transposed operand): the query heads that share a key head, block by block
        qb = q.reshape(b, nkv, rep, nq, Ra, d).transpose(2, 3).contiguous().view(b * nkv, nq, rep * Ra, d)
        kt = k.contiguous().view(b * nkv, K, d).transpose(1, 2)
        vv = v.contiguous().view(b * nkv, K, d)
        outs = []
        with torch.no_grad():
            for j in range(nq):  # one call for every sequence and key head: [rep·Ra, d] x [d, K] each
                sc = torch.bmm(qb[:, j].contiguous(), kt) * scaling
                sc = sc.view(b, nkv, rep, Ra, K).masked_fill(~allowed[:, None, None, j * Ra:(j + 1) * Ra],
                                                                float("-inf"))
                p = torch.softmax(sc, dim=-1, dtype=torch.float32).to(q.dtype)
                outs.append(torch.bmm(p.view(b * nkv, rep * Ra, K), vv).view(b, nkv, rep, Ra, d))
        return torch.stack(outs, dim=3).view(b, nh, nq * Ra, d)[:, :, :s]

    def logp(self, h: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, temperature: float,
             want_entropy: bool = False):
        """log p(target) (and the entropy) for hidden rows ``h`` [N, H]: the output layer and the
        log-softmax on blocks of ``head_block`` rows (the learner)."""
        def value():  # the engine's two steps (:meth:`logits`, :meth:`token_logp`), chunk by chunk
            z = self._each_block(F.linear, h, head, R=self.head_block)
            return self._blocks(lambda zb, tb: token_logp(zb, tb, temperature, want_entropy), z, targets, want_entropy)

        return _blocked(value, _head_logp, h, head, targets, temperature)

    def token_logp(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """log p(target) of logit rows [N, V] (from :meth:`logits`) on blocks of ``head_block`` rows (the engine)."""
        return self._blocks(lambda zb, tb: token_logp(zb, tb, temperature), logits, targets, False)

    def _blocks(self, fn, x, targets, pair: bool):
        R, m = self.head_block, x.shape[0]
        pad = (-m) % R
        if pad:
            x, targets = F.pad(x, (0, 0, 0, pad)), F.pad(targets, (0, pad))
        with torch.no_grad():
            outs = [fn(x[i:i + R], targets[i:i + R]) for i in range(0, m + pad, R)]
        if not pair:
            return torch.cat(outs)[:m] if outs else x.new_zeros(0, dtype=torch.float32)
        if not outs:
            z = x.new_zeros(0, dtype=torch.float32)
            return z, z
        return torch.cat([o[0] for o in outs])[:m], torch.cat([o[1] for o in outs])[:m]

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """The output layer on blocks of ``head_block`` rows (the engine's decode; :meth:`logp` is the learner's)."""
        return self.rows(F.linear, h, head, R=self.head_block)


def batched_linear(x3: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x3 [blocks, rows, in] times wᵀ, every block its own [rows, in] x [in, out] matrix of one batched
    call (the weight broadcast, not copied). Used in fp32, where it is faster than one call per block;
    bf16/fp16 batched matmuls take a slower oneDNN path here (benchmarks/exact_cost.py), so they loop.
    The self-check compares calls of one block and of many."""
    y = torch.bmm(x3, w.t().expand(x3.shape[0], -1, -1))
    return y if b is None else y + b


def _head_logp(h, head, targets, temperature):
    """The gradient side of :meth:`ExactOps.logp`: the output layer and log p(target) in one call."""
    return token_logp(F.linear(h, head), targets, temperature)


def _attend_whole(q, k, v, allowed, scaling):
    """The gradient side of :meth:`ExactOps.attend`: the same attention, one call per sequence."""
    b, nh, s, d = q.shape
    nkv = k.shape[1]
    outs = []
    for i in range(b):
        sc = q[i].reshape(nkv, nh // nkv * s, d) @ k[i].transpose(1, 2) * scaling
        sc = sc.view(nh, s, -1).masked_fill(~allowed[i][None], float("-inf"))
        p = torch.softmax(sc, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append((p.view(nkv, -1, p.shape[-1]) @ v[i]).view(nh, s, d))
    return torch.stack(outs)


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
            qkv = keep(i, "q/k/v projection", ops.linear(ops.norm(h, L["ln1"], eps), L["qkv"], L["qkv_b"]))
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k, v = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
            if self.qk_norm:
                q, k = ops.norm(q, L["qn"], eps), ops.norm(k, L["kn"], eps)
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
            gate, up = ops.linear(ops.norm(h, L["ln2"], eps), L["gu"]).chunk(2, dim=-1)
            h = keep(i, "MLP", h + ops.linear(F.silu(gate) * up, L["down"]))
        return keep(self.n_layers, "final norm", ops.norm(h, w["norm"], eps))

    def logits(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        """Output-layer logits of hidden rows [N, H]."""
        return self.ops.logits(h, w["head"])


def learner_logprobs(fwd: ExactForward, w: dict, tokens: torch.Tensor, key_ok: torch.Tensor,
                     positions: torch.Tensor, temperature: float, chunk: int, return_entropy: bool):
    """The learner's log π (and entropy) over a batch in the engine's layout, [b, K] like tokens.
    The output layer runs ``chunk`` rows at a time; its gradient keeps only the hidden rows and
    recomputes the chunk's logits in the backward (as a checkpoint would)."""
    b, K = tokens.shape
    pos = (key_ok.long().cumsum(-1) - 1).clamp(min=0)
    h = fwd.hidden(w, tokens, pos, full_allowed(key_ok))
    sel = key_ok[:, 1:] & positions[:, 1:].bool()
    hs, tg = h[:, :-1][sel], tokens[:, 1:][sel]

    lps, ents = [], []
    R = fwd.ops.head_block
    step = max(R, (chunk // R) * R) if chunk and chunk > 0 else max(hs.shape[0], 1)  # whole blocks per chunk
    for s in range(0, hs.shape[0], step):
        hc, tc = hs[s:s + step], tg[s:s + step]
        lp, en = fwd.ops.logp(hc, w["head"], tc, temperature, want_entropy=True)
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
            "rms_norm": sorted({H, hd} if fwd.qk_norm else {H}), "attention": (nh, nkv, hd, K), "log-softmax": (H, V)}


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
        w, x = rnd(n_out, n_in) * n_in ** -0.5, rnd(9 * R + 5, n_in)  # ten blocks in one call
        b = rnd(n_out) if bias else None
        whole = ops.linear(x, w, b)
        if not _roll_equal(lambda t, w=w, b=b: ops.linear(t, w, b), x[:R], shifts) or \
                not torch.equal(ops.linear(x[R + 3:R + 4], w, b), whole[R + 3:R + 4]) or \
                not torch.equal(ops.linear(x[:7], w, b), whole[:7]):
            return f"matmul{' with bias' if bias else ''}, {name}, [{R}, {n_in}] x [{n_in}, {n_out}]"
    for H in shapes["rms_norm"]:
        g = rnd(H)
        if not _roll_equal(lambda t, g=g: rms_norm(t, g, 1e-6), rnd(R, H), shifts):
            return f"RMSNorm, {name}, [{R}, {H}]"
    nh, nkv, hd, K = shapes["attention"]
    q, k, v = rnd(3, nh, 2 * Ra + 1, hd), rnd(3, nkv, K, hd), rnd(3, nkv, K, hd)
    allowed = torch.rand(3, 2 * Ra + 1, K, generator=gen) > 0.3
    allowed[..., 0] = True
    full = ops.attend(q, k, v, allowed, hd ** -0.5)  # three sequences in one call
    for i, j in ((1, 0), (1, 1), (0, Ra), (2, 2 * Ra)):  # one row of one sequence alone
        one = ops.attend(q[i:i + 1, :, j:j + 1], k[i:i + 1], v[i:i + 1], allowed[i:i + 1, j:j + 1], hd ** -0.5)
        if not torch.equal(one, full[i:i + 1, :, j:j + 1]):
            return (f"attention (scores, softmax, values), {name}, [{nh // nkv * Ra}, {hd}] x [{hd}, {K}] "
                    f"per key head")
    H, V = shapes["log-softmax"]
    Rh = ops.head_block
    head, h = rnd(V, H) * H ** -0.5, rnd(Rh + 3, H)
    t = torch.randint(0, V, (Rh + 3,), generator=gen)
    lp = ops.logp(h, head, t, 1.0)
    engine = ops.token_logp(ops.logits(h[Rh:Rh + 1], head), t[Rh:Rh + 1], 1.0)  # the engine's one-row decode
    if not torch.equal(engine, lp[Rh:Rh + 1]) or not all(
            torch.equal(ops.logp(h[:Rh].roll(p, 0), head, t[:Rh].roll(p, 0), 1.0), lp[:Rh].roll(p, 0))
            for p in sorted({1, Rh // 2, Rh - 1} - {0})):
        return f"output layer and log-softmax, {name}, [{Rh}, {H}] x [{H}, {V}]"
    return None


def self_check(fwd: ExactForward, dtypes, cache_len: int) -> ExactOps:
    """Choose the block sizes this machine gives the invariance for, for every op shape and dtype the
    run uses; refuse in one line if none does. About a second for a 135M model (rows at several
    positions of a block, calls of 1, 7 and 9·block + 5 rows, one sequence's attention alone and
    among others)."""
    failures = []
    for blocks in BLOCKS:
        ops = ExactOps(*blocks)
        gen = torch.Generator().manual_seed(0)
        problem = next((p for p in (_check_ops(ops, _shapes(fwd, cache_len), dt, gen) for dt in dtypes) if p), None)
        if problem is None:
            fwd.ops = ops
            return ops
        failures.append(problem)
    raise UnisonError(f"exact mode cannot hold on this CPU: {failures[0]} gives a row different bits depending on "
                      f"where it sits in the call (also with blocks of {', '.join(str(b[0]) for b in BLOCKS[1:])}); "
                      f"set exact=false (and please report the CPU: `lscpu`)")


# ------------------------------------------------------------------ when step 1 still differs
def divergence_report(learner, engine, batch, rows, logp_pi) -> str:
    """Where exact mode's two sides first differ: the row and position, and — replaying that row
    alone through the engine's decode and the learner's forward — the first layer and op whose
    outputs differ."""
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
