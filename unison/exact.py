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
SiLU MLPs; Mamba2 and Nemotron-H (unison/exact_ssm.py) and Qwen3-Next (unison/exact_gdn.py), whose scans run as the
recurrence on both sides; one process. Others are refused in one line. On GPUs the same rules need
batch-invariant kernels (docs/exact.md): refused until a GPU route has run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unison.errors import UnisonError
from unison.models import decode_path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: the state-space and hybrid families: Mamba2 and Nemotron-H (unison/exact_ssm.py), Qwen3-Next (unison/exact_gdn.py)
SSM_FAMILIES = ("mamba2", "nemotron_h", "qwen3_next")
#: (rows per block of the token-wise ops, query rows per attention block, rows per output-layer block):
#: benchmarks/exact_cost.py measured the cost of each; the start-up self-check falls back in this order
BLOCKS = ((16, 4, 64), (32, 8, 64), (8, 2, 8), (64, 16, 64))


def check_supported(config, where: str = "exact mode") -> None:
    if config.model_type in SSM_FAMILIES:
        _check_ssm(config, where)
        return
    if config.model_type not in FAMILIES or decode_path(config) != "fast":
        raise UnisonError(f"{where} runs Llama, Mistral (without a sliding window), Qwen2, Qwen3, Mamba2, Nemotron-H "
                          f"and Qwen3-Next models; '{config.model_type}' is not one: turn exact off for this model")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnisonError(f"{where} needs a SiLU MLP; this model uses {config.hidden_act}: turn exact off")


def _check_ssm(config, where: str) -> None:
    if config.model_type == "qwen3_next":
        if getattr(config, "num_experts", 0) or getattr(config, "hidden_act", "silu") != "silu":
            raise UnisonError(f"{where} runs Qwen3-Next with dense SiLU MLPs, and this one has "
                              f"{config.num_experts} experts: turn exact off for this model")
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in ("default", "linear"):  # exact mode computes the rotary angles from the fixed inv_freq
            raise UnisonError(f"{where} runs Qwen3-Next with a fixed rotary embedding, and this one's is '{rope}': "
                              f"turn exact off for this model")
        return
    act = getattr(config, "mamba_hidden_act", getattr(config, "hidden_act", "silu"))
    kinds = set(getattr(config, "layers_block_type", None) or ["linear_attention"])
    if act != "silu" or not kinds <= {"linear_attention", "full_attention", "mlp"} or \
            ("mlp" in kinds and getattr(config, "mlp_hidden_act", "relu2") != "relu2"):
        raise UnisonError(f"{where} runs {config.model_type} with SiLU mixers and dense ReLU² MLPs (no MoE blocks); "
                          f"this config has blocks {sorted(kinds)}: turn exact off for this model")


def normalize(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 rows over their root mean square: the RMSNorms' shared step (each model applies its weight its own way)."""
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm, as a function of the (cast) weight."""
    return w * normalize(x.float(), eps).to(x.dtype)


def caster(dtype: torch.dtype):
    """``t`` in ``dtype`` (itself when it already is; None stays None): the exact forwards' weights."""
    return lambda t: None if t is None else (t if t.dtype == dtype else t.to(dtype))


def tracer(trace: dict | None):
    """``keep(layer, op, t)``: ``t``, recorded in ``trace`` by (layer, op) when one is given (divergence_report)."""
    def keep(layer, op, t):
        if trace is not None:
            trace[(layer, op)] = t.detach()
        return t
    return keep


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


#: elements per vector step of PyTorch's CPU elementwise loop, for every dtype and ISA (2 × 512 bits of bf16)
LANES = 64
#: PyTorch's grain: an elementwise call of more elements may be split between threads at any element
GRAIN = 32768


def whole_vectors(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, every element computed by the vector code. PyTorch's CPU loops compute
    the last elements of a call (and of each thread's share) in scalar code, whose fp32 SiLU, sigmoid and softplus
    differ from the vector code's in the last bit — so a value's bits would depend on how many share the call. Here
    the input is flattened, zero-padded to a multiple of :data:`LANES`, in calls of at most :data:`GRAIN` elements
    (one thread)."""
    n = x.numel()
    flat = x.reshape(-1)
    pad = (-n) % LANES
    if pad:
        flat = F.pad(flat, (0, pad))
    out = fn(flat) if flat.numel() <= GRAIN else torch.cat([fn(c) for c in flat.split(GRAIN)])
    return out[:n].view(x.shape)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim, by halves (a fixed pairwise tree of elementwise adds; zero-padded to a power of 2)."""
    w = x.shape[-1]
    p = 1 << (w - 1).bit_length()
    if p != w:
        x = F.pad(x, (0, p - w))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def causal_conv(seq: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, s: int) -> torch.Tensor:
    """A depthwise causal convolution's last ``s`` outputs over ``seq`` [b, k − 1 + s, channels] (the window of
    earlier inputs, then this call's), weights ``w`` [channels, k]: the taps multiplied and added elementwise in one
    order, in fp32 — the same bits for one new input (the engine's decode) as for a whole sequence (the learner)."""
    wf = w.float()
    acc = seq[:, 0:s].float() * wf[:, 0]
    for j in range(1, w.shape[1]):
        acc = acc + seq[:, j:j + s].float() * wf[:, j]
    return acc if bias is None else acc + bias.float()


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


def blocked(value, fn, x, *params):
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
        out = blocked(lambda: self._each_block(fn, x2, *params, R=R), fn, x2, *params)
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
        return blocked(lambda: self._attend_blocks(q, k, v, allowed, scaling), _attend_whole, q, k, v, allowed,
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

        return blocked(value, _head_logp, h, head, targets, temperature)

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

        c = caster(dtype)
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

    def new_cache(self, B: int, K: int, dtype: torch.dtype, device) -> list:
        """The engine's cache: per layer (keys, values) [B, kv_heads, K, head_dim]."""
        shape = (B, self.n_kv, K, self.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(self.n_layers)]

    def shapes(self, K: int) -> dict:
        """Every blocked op shape the forward runs, by name (the start-up self-check's)."""
        cfg = self.lm.config
        H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        return {"linear": sorted({(H, (nh + 2 * nkv) * hd, self.bias), (nh * hd, H, False), (H, 2 * I, False),
                                  (I, H, False)}),
                "rms_norm": sorted({H, hd} if self.qk_norm else {H}), "attention": (nh, nkv, hd, K),
                "log-softmax": (H, V)}

    def hidden(self, w: dict, ids: torch.Tensor, pos: torch.Tensor, key_ok: torch.Tensor,
               cache: list | None = None, start: int = 0, trace: dict | None = None) -> torch.Tensor:
        """Final-normed hidden states of ``ids`` [b, s] at positions ``pos``: the tokens at columns ``start``.. of
        the layout whose real key slots ``key_ok`` [b, K] marks (:func:`allowed_keys`: each query attends to the
        real keys up to its own column, and to itself).

        With ``cache`` (:meth:`new_cache`) the new keys/values are written at ``start`` and attention runs over
        the whole cache; without one, ``s == K`` and the forward's own keys are the K slots (the learner's full
        forward). ``trace`` (for :func:`divergence_report`) receives every op's output, by (layer, op).
        """
        ops, eps = self.ops, self.eps
        b, s = ids.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        h = F.embedding(ids, w["embed"])
        cos, sin = self.lm.model.rotary_emb(h, pos)
        q_size, kv_size = nh * hd, nkv * hd

        keep = tracer(trace)
        for i, L in enumerate(w["layers"]):
            qkv = keep(i, "q/k/v projection", ops.linear(ops.norm(h, L["ln1"], eps), L["qkv"], L["qkv_b"]))
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k, v = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
            if self.qk_norm:
                q, k = ops.norm(q, L["qn"], eps), ops.norm(k, L["kn"], eps)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            o = keep(i, "attention", attend_cached(ops, q, k, v, key_ok, start, cache and cache[i], self.scaling))
            o = o.transpose(1, 2).reshape(b, s, q_size)
            h = keep(i, "attention output", h + ops.linear(o, L["o"]))
            gate, up = ops.linear(ops.norm(h, L["ln2"], eps), L["gu"]).chunk(2, dim=-1)
            h = keep(i, "MLP", h + ops.linear(whole_vectors(F.silu, gate) * up, L["down"]))
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
    h = fwd.hidden(w, tokens, pos, key_ok)
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


def attend_cached(ops: ExactOps, q, k, v, key_ok: torch.Tensor, start: int, cache, scaling: float) -> torch.Tensor:
    """Attention of this call's queries [b, heads, s, d]: with ``cache`` (keys, values) [b, kv_heads, K, d], the new
    keys and values written at ``start`` and every query over the whole cache; without one, over its own K keys."""
    if cache:
        kc, vc = cache
        kc[:, :, start:start + q.shape[2]] = k
        vc[:, :, start:start + q.shape[2]] = v
        k, v = kc, vc
    return ops.attend(q, k, v, allowed_keys(key_ok, start, q.shape[2]), scaling)


def allowed_keys(key_ok: torch.Tensor, start: int, s: int) -> torch.Tensor:
    """[b, s, K]: the query at column ``start + i`` attends to the real keys up to its own column, and to itself
    (pad rows stay finite)."""
    K = key_ok.shape[1]
    cols = torch.arange(K, device=key_ok.device)
    q = torch.arange(start, start + s, device=key_ok.device)[:, None]
    return (key_ok[:, None, :] & (cols <= q)[None]) | (cols == q)[None]
