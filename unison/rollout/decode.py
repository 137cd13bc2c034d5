"""The native engine's fast path, one decoder layer at a time (Llama, Mistral, Qwen2, Qwen3).

:class:`FastWeights` holds each layer's products as the engine multiplies by them: q/k/v and gate/up fused
into one matrix each (the modules' parameters become views of it: ``load_weights`` still writes through the
original names, no extra memory), and — where the engine's fp32 products are oneDNN's (``gemm``, unison/gemm.py),
and for bf16 / fp16 engines on CPUs with native kernels for them (:func:`unison.gemm.packs_half`) — every matrix
also pre-packed into oneDNN's blocked layout once per weight sync, so that a decode step's
products (one row per response) do not re-pack the weights on every call. Packed products are bitwise the
unpacked ones.

:func:`layer_forward` is one decoder layer over the preallocated KV cache, written once: the layer's own norms
and rotary embedding, our attention. :class:`Kernels` runs it eagerly or compiled by Inductor
(``compile``: unison/compilation.py): a compiled engine rounds differently from an eager learner — a mismatch
source of its own, measured by ``unison probe --compile`` and the ledger's ``compile`` term.
"""

from __future__ import annotations

import time

import torch

from unison import attention, gemm


def fuse(layer):
    """Put a layer's q/k/v (and gate/up) weights into one tensor each and make the modules' parameters views
    of it: one matmul computes all of them, and loading weights by their original names writes through."""

    def join(linears):
        w = torch.cat([lin.weight.detach() for lin in linears])
        for lin, view in zip(linears, w.split([lin.out_features for lin in linears])):
            lin.weight = torch.nn.Parameter(view, requires_grad=False)
        b = None
        if linears[0].bias is not None:
            b = torch.cat([lin.bias.detach() for lin in linears])
            for lin, view in zip(linears, b.split([lin.out_features for lin in linears])):
                lin.bias = torch.nn.Parameter(view, requires_grad=False)
        return w, b, tuple(lin.out_features for lin in linears)

    a, mlp = layer.self_attn, layer.mlp
    return join([a.q_proj, a.k_proj, a.v_proj]), join([mlp.gate_proj, mlp.up_proj])


class FastWeights:
    """The fast path's matrices of ``model`` (fused, and packed when ``packed``: fp32 on the CPU with oneDNN's
    products, or bf16 / fp16 there; packed for products of about ``rows`` rows). :meth:`refresh` after the weights
    changed."""

    def __init__(self, model, packed: bool, rows: int = gemm.DECODE_ROWS, copies: bool = False):
        self.model, self.packed, self.rows = model, packed, rows
        #: bf16 / fp16 weights on a CPU without native kernels for them (gemm's half route): kept as fp32 copies of
        #: their rounded values, refreshed per sync, so that a product does not cast its weight to fp32 every call
        #: (the same numbers: a half value is exact in fp32; twice the half weights' memory)
        self.copies = copies
        #: the products' function, chosen once (gemm.decode_product)
        self.product = gemm.decode_product(packed, copies, next(model.parameters()).dtype)
        self._fused = [fuse(layer) for layer in model.model.layers]
        self.layers: list[tuple] = []
        self.head: tuple = ()
        self.refresh()

    def refresh(self) -> None:
        """Take the model's current weights (packed: pack them anew; plain: the parameters themselves)."""
        copy = (lambda w: w.float()) if self.copies else (lambda w: w)
        conv = (lambda w: gemm.pack(copy(w), self.rows)) if self.packed else copy
        cb = (lambda b: b if b is None else b.float()) if self.copies else (lambda b: b)  # biases
        self.layers = []
        for layer, ((qkv_w, qkv_b, qkv_n), (gu_w, gu_b, gu_n)) in zip(self.model.model.layers, self._fused):
            o, down = layer.self_attn.o_proj, layer.mlp.down_proj
            self.layers.append((conv(qkv_w), cb(qkv_b), qkv_n, conv(o.weight.detach()), cb(_bias(o)),
                                conv(gu_w), cb(gu_b), gu_n, conv(down.weight.detach()), cb(_bias(down))))
        head = self.model.get_output_embeddings()
        self.head = (conv(head.weight.detach()), cb(_bias(head)))

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return self.product(x, w, b)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output layer on final-normed hidden states (the model's logit transform is the caller's)."""
        return self.linear(h, *self.head)


def _bias(linear) -> torch.Tensor | None:
    return linear.bias.detach() if linear.bias is not None else None


def layer_forward(layer, w: tuple, product, rope, h: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, start: int, act=None, kv=None) -> torch.Tensor:
    """One decoder layer: ``h`` [b, s, d] at cache positions ``start`` … ``start + s − 1`` (K/V written there),
    attending over the cache up to them under ``mask`` [b, 1, s, keys]; ``w`` one entry of
    :attr:`FastWeights.layers` and ``product`` its :attr:`FastWeights.product` (chosen once); ``rope`` the model's
    ``apply_rotary_pos_emb``; ``act``: W8A8's quantizer of each
    product's input (q/k/v and gate/up share theirs, as the modules' separate products of one input would)."""
    qkv_w, qkv_b, qkv_n, o_w, o_b, gu_w, gu_b, gu_n, down_w, down_b = w
    lin = product if act is None else (lambda x, w_, b_: product(act(x), w_, b_))
    attn, mlp = layer.self_attn, layer.mlp
    b, s, _ = h.shape
    end = start + s
    q, k, v = lin(layer.input_layernorm(h), qkv_w, qkv_b).split(qkv_n, dim=-1)
    q = q.view(b, s, -1, attn.head_dim)
    k = k.view(b, s, -1, attn.head_dim)
    v = v.view(b, s, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if kv is not None:
        k, v = kv(k, v)
    kc[:, :, start:end] = k
    vc[:, :, start:end] = v
    o = attention.sdpa(q, kc[:, :, :end], vc[:, :, :end], mask, attn.scaling)  # as the learner attends
    h = h + _as_module(attn.o_proj, lin, o.transpose(1, 2).reshape(b, s, -1), o_w, o_b)
    gate, up = lin(layer.post_attention_layernorm(h), gu_w, gu_b).split(gu_n, dim=-1)
    return h + _as_module(mlp.down_proj, lin, mlp.act_fn(gate) * up, down_w, down_b)


def _as_module(module, lin, x, w, b):
    """``lin(x, w, b)`` standing in for ``module(x)``: the module's forward hooks (``unison probe --locate`` taps
    o_proj and down_proj) see the product as if the module had made it (eager only; nothing hooks a compiled run)."""
    out = lin(x, w, b)
    if not torch.compiler.is_compiling() and module._forward_hooks:
        for hook in list(module._forward_hooks.values()):
            res = hook(module, (x,), out)
            out = out if res is None else res
    return out


_compiled = None


def compiled_layer_forward():
    """:func:`layer_forward` compiled by Inductor with dynamic shapes (one graph for every layer: they differ in
    their parameters only; one for decode steps, s = 1, and one for prefills), made once per process."""
    global _compiled
    if _compiled is None:
        no_duck_sizing()
        _compiled = torch.compile(layer_forward, dynamic=True)
    return _compiled


def no_duck_sizing() -> None:
    """Inductor's tracer gives equal sizes one symbol ("duck sizing"): a batch of as many rows as the model has
    KV heads, or as many as the prompt has tokens, would specialise a graph that the next batch fails, and each
    failure compiles again (up to torch's limit, then silently eager). unison's compiled layers take every size
    as it comes; set once, in a process that compiles."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False


class Kernels:
    """How the engine runs :func:`layer_forward`: eagerly, or compiled (``compiled``). A batch of one row runs
    eagerly either way: Inductor would specialise a graph for size 1 and compile again mid-generation."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self._fn = compiled_layer_forward() if compiled else layer_forward
        #: seconds the first calls took to compile (:meth:`warm_up`)
        self.compile_s = 0.0

    def layer(self, *args, act=None, kv=None) -> torch.Tensor:
        if act is not None or kv is not None:  # W8A8, a quantized cache: eagerly (the engine does not compile then)
            return layer_forward(*args, act=act, kv=kv)
        h = args[4]
        return (self._fn if h.shape[0] > 1 else layer_forward)(*args)

    def warm_up(self, generate) -> float:
        """Compile now: ``generate()`` makes a prefill and a decode step of two rows; the seconds it took, added to
        :attr:`compile_s`."""
        if not self.compiled:
            return 0.0
        t0 = time.perf_counter()
        generate()
        dt = time.perf_counter() - t0
        self.compile_s += dt
        return dt
