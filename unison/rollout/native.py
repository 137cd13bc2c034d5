"""The native rollout engine: batched incremental (KV-cache) decoding in the engine's dtype.

unison's own decode loop and sampler: left-padded prompts, ``n`` samples each,
finished rows leave the batch, log μ of the distribution sampled from. It is
an *incremental* sampler like vLLM, while the learner scores with one full
forward pass. Two ways through the model:

* **fast** (Llama, Mistral without a sliding window, Qwen2, Qwen3): the model's
  own modules (embeddings, norms, rotary, MLP activations) with our attention
  over a preallocated cache and q/k/v and gate/up fused into one matmul each;
* **generic** (every other Hugging Face causal LM: Gemma 2/3, Phi-3, OLMo-2,
  GPT-2, GPT-NeoX, MoE models, sliding windows...): the model's own forward with
  a ``DynamicCache`` built from its config, so sliding windows, logit
  soft-capping and every architectural detail are the model's. For MoE models
  it records which experts each token chose (``mismatch/router_disagreement``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from unison import gemm
from unison import kvcache
from unison import moe
from unison.batch import Completion
from unison.distributed import current
from unison.errors import UnisonError
from unison.exact_ssm import exact_forward
from unison.models import FAST_PATH_TYPES, check_state_dtype, decode_path, load_model, load_tokenizer, logit_transform  # noqa: F401 - re-exported
from unison.quant import activation_quantizer, check_targets, fake_quantize
from unison.rollout.base import SamplingParams, row_seeds, sample_tokens
from unison.rollout.base import support_logsumexp
from unison.rollout.decode import FastWeights, Kernels
from unison.sides import Side


class NativeEngine:
    """KV-cache sampler over a model computing as its :class:`~unison.sides.Side` says (``side``: a Side, or a bare
    dtype): its dtype, weight format (``quantization``, ``group_size``), exact mode and compiled layers."""

    name = "native"

    def __init__(self, model_dir: str | Path, side: Side | torch.dtype = torch.float32, device: str = "cpu",
                 prompt_width: int | None = None, decode_rows: int = gemm.DECODE_ROWS):
        self.side = side = Side.of(side)
        dtype, exact, compile = side.dtype, side.exact, side.compiled
        quantization, quant_group_size = side.quantization, side.group_size
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = load_model(self.model_dir, dtype=dtype, device=device)
        masters = {}
        if quantization != "none":  # quantize the fp32 weights (as every sync does from the learner's masters),
            full = load_model(self.model_dir, dtype=torch.float32, device=device)  # not their rounding to dtype
            params = dict(full.named_parameters())
            masters = {t.name: params[t.name].detach() for t in check_targets(full, quantization, quant_group_size)}
            del full, params
        self.tokenizer = load_tokenizer(self.model_dir)
        self.config = self.model.config
        #: fast: the fused path of the Llama-family decoders; generic: any causal LM's own forward
        self.path = decode_path(self.config)
        #: the fast path's matrices (fused; pre-packed where the engine's fp32 products are oneDNN's, and bf16 / fp16
        #: ones on a CPU with native kernels for them: gemm.packs_half) and how its
        #: layers run (eagerly, or compiled: ``compile``); unison/rollout/decode.py
        self.fast: FastWeights | None = None
        #: W8A8 (rollout.quantization w8a8_*): every quantized layer's input quantized per token (unison/quant.py);
        #: the fast path runs it eagerly, the generic path through forward pre-hooks on those layers
        self.act_quant = activation_quantizer(quantization)
        #: a quantized KV cache (rollout.kv_cache_dtype; unison/kvcache.py): the fast path's cache, eagerly
        self.kv: kvcache.EngineCache | None = None
        if side.kv_cache != "auto":
            kvcache.check_model(side.kv_cache, self.config, exact)
            self.kv = kvcache.EngineCache(side.kv_cache, side.kv_scales, len(self.model.model.layers),
                                          self.config.num_key_value_heads)
        self.kernels = Kernels(compile and self.path == "fast" and not exact and self.act_quant is None
                               and self.kv is None)
        if self.path == "fast":
            self._rope = sys.modules[type(self.model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
            n_params = sum(p.numel() for p in self.model.parameters())
            # a half engine on a CPU without kernels for it multiplies by fp32 copies (packed as fp32's are)
            copies = gemm.engine_copies(dtype, self.device.type, exact)
            packed = self.device.type == "cpu" and not exact and (
                gemm.engine_choice() == "onednn" and (dtype == torch.float32 or copies)
                or gemm.packs_half(dtype, n_params))
            self.fast = FastWeights(self.model, packed, decode_rows, copies=copies)

        #: rollout.state_dtype=model: a recurrent model's state rounded to the compute dtype after every forward
        check_state_dtype(side.state, self.config)
        self.state_round = dtype if side.rounds_state else None
        #: the generic path's forward arguments: Mamba2 takes its cache as ``cache_params`` and no position ids (its
        #: state is the position); every other model ``past_key_values`` and ``position_ids``
        params = inspect.signature(self.model.forward).parameters
        self.generic_args = ("cache_params" if "cache_params" in params else "past_key_values", "position_ids" in params)
        self.moe = bool(moe.routers(self.model))
        #: exact mode (unison/exact.py): one forward shared with the learner, a fixed layout
        self.exact = None
        #: exact mode: every prompt is left-padded to this width (the learner uses the same layout)
        self.prompt_width = prompt_width
        if exact:
            self.exact = exact_forward(self.model)
        self._params = dict(self.model.named_parameters())
        #: rollout.quantization (unison/quant.py): these weights hold quantize→dequantize of what is loaded
        self.quantization, self.quant_group_size = quantization, quant_group_size
        self._quant: dict[str, int] = {}
        if quantization != "none":  # (exact mode with it: only with a quantization-aware learner, preflight)
            self._quant = {t.name: t.in_dim for t in check_targets(self.model, quantization, quant_group_size)}
            self.load_weights(masters.items())
            del masters
        if self.act_quant is not None and self.path != "fast":
            modules = dict(self.model.named_modules())
            act = self.act_quant
            for owner in sorted({name.rsplit(".", 1)[0] for name in self._quant}):
                modules[owner].register_forward_pre_hook(lambda mod, args: (act(args[0]), *args[1:]))
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])})
        self.pad_id = int(self.tokenizer.pad_token_id)

        self.dp_rank, self.dp_size = current().rank, current().world_size  # one engine per rank
        if self.kernels.compiled:  # compile now (a prefill and a decode step of two rows), not in the first batch
            self.kernels.warm_up(lambda: self.generate([[self.eos_ids[0]] * 3], SamplingParams(n=2, max_tokens=2)))

    # ------------------------------------------------------ the engine protocol
    def sync_weights(self, update) -> dict[str, float]:
        """Load the pushed weights (in :attr:`weight_dtype`: this engine's dtype, or with quantized rollout the
        fp32 masters, quantized here)."""
        self.load_weights(update.tensors)
        return {}

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype a sync sends: this engine's, or ``None`` (the fp32 masters) when it quantizes them."""
        return None if self._quant else self.dtype

    def sleep(self) -> None:
        """Nothing to free: the native engine's cache lives only during ``generate``."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ weights
    def _held(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What this engine holds for weight ``name`` loaded with ``tensor``: cast to its dtype (quantized rollout:
        the decoder's linear weights quantized, then dequantized to it)."""
        param = self._params.get(name)
        if param is None:
            raise UnisonError(f"weight '{name}' does not exist in the rollout model: "
                              f"sync from a learner built on the same architecture")
        if name in self._quant:
            tensor = fake_quantize(tensor, self.quantization, param.dtype, self._quant[name], self.quant_group_size)
        return tensor.to(device=param.device, dtype=param.dtype)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy weights (any dtype) into the engine, cast to its dtype (quantized rollout: the
        decoder's linear weights quantized, then dequantized to it). Returns how many."""
        count = 0
        for name, tensor in named_tensors:
            held = self._held(name, tensor)  # refuses a name the rollout model does not have
            self._params[name].copy_(held)
            count += 1
        if count and self.fast is not None and (self.fast.packed or self.fast.copies):
            self.fast.refresh()  # the packed (or fp32) copies, anew
        if count and self.kv is not None:
            self.kv.reset()  # sync scales: measured anew by the next batch
        return count

    @torch.no_grad()
    def stale_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """``(tensors that differ, tensors compared)`` between what this engine holds and what loading
        ``named_tensors`` (the learner's current weights) would make it hold, bit for bit: a weight sync that did
        not reach the engine (the mismatch ledger's check, docs/ledger.md)."""
        differ = total = 0
        for name, tensor in named_tensors:
            total += 1
            differ += not torch.equal(self._params[name], self._held(name, tensor))
        return differ, total

    # --------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample ``params.n`` responses for each prompt (token-id lists).

        Results are ordered prompt-major: prompt 0's samples, then prompt 1's, ...
        """
        if not prompts:
            return []
        n = params.n
        rows = [(pi, si, list(p)) for pi, p in enumerate(prompts) for si in range(n)]
        P = max(len(r[2]) for r in rows)
        if min(len(r[2]) for r in rows) == 0:
            raise UnisonError("a prompt has no tokens: every prompt needs at least one token")
        if self.exact is not None:
            if params.top_p < 1.0 or params.top_k:
                raise UnisonError("exact mode samples from the full distribution the learner scores: "
                                  "set top_p=1 and top_k=0")
            width = self.prompt_width or P
            if P > width:
                raise UnisonError(f"a prompt of {P} tokens is longer than the exact layout's prompt width "
                                  f"{width}: it was fixed from the prompts known at start-up")
            P = width
        self._check_context(P, params.max_tokens)
        B, T = len(rows), params.max_tokens
        dev = self.device
        ids = torch.full((B, P), self.pad_id, dtype=torch.long, device=dev)
        key_ok = torch.zeros((B, P), dtype=torch.bool, device=dev)
        for b, (_, _, p) in enumerate(rows):
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            key_ok[b, P - len(p):] = True
        pos = (key_ok.long().cumsum(-1) - 1).clamp(min=0)
        seeds = torch.tensor(row_seeds(params, len(prompts)), dtype=torch.int64, device=dev)
        routing: list[list[torch.Tensor]] | None = [[] for _ in range(B)] if self.moe else None

        backend = self._backend(B, P, T)
        with self.kv.calibrating(key_ok) if self.kv is not None else contextlib.nullcontext():
            logits = self._run(backend.prefill, routing, None, ids, key_ok, pos)
        kv_scale = self.kv.scales.clone() if self.kv is not None else None

        out_tokens = torch.zeros((B, T), dtype=torch.long, device=dev)
        out_logp = torch.zeros((B, T), dtype=torch.float32, device=dev)
        truncated = params.temperature > 0 and bool(params.top_k or params.top_p < 1.0)
        out_support = torch.zeros((B, T), dtype=torch.long, device=dev) if truncated else None
        lengths = torch.zeros(B, dtype=torch.long)
        finish = ["length"] * B
        active = torch.arange(B, device=dev)  # original row of each live batch slot
        eos = torch.tensor([] if params.ignore_eos else self.eos_ids, dtype=torch.long, device=dev)
        next_pos = pos[:, -1] + 1
        for t in range(T):
            if out_support is None:
                tok, lp = sample_tokens(logits, params, seeds[active], t)
            else:
                tok, lp, out_support[active, t] = sample_tokens(logits, params, seeds[active], t, return_support=True)
            if self.exact is not None:  # the learner's formula, on the same logits
                lp = torch.zeros_like(lp) if params.temperature == 0 else \
                    self.exact.ops.token_logp(logits, tok, params.temperature)
            out_tokens[active, t] = tok
            out_logp[active, t] = lp
            lengths[active.cpu()] = t + 1
            done = torch.isin(tok, eos)
            for b in active[done].tolist():
                finish[b] = "stop"
            if t == T - 1:
                break
            if bool(done.any()):
                keep = ~done
                if not bool(keep.any()):
                    break
                active, tok, next_pos = active[keep], tok[keep], next_pos[keep]
                backend.select(keep)
            logits = self._run(backend.step, routing, active.cpu(), tok, next_pos, t)
            next_pos = next_pos + 1

        toks, lps = out_tokens.cpu(), out_logp.cpu()
        sup = out_support.cpu() if out_support is not None else None
        return [
            Completion(prompt_ids=p, token_ids=toks[b, :lengths[b]].tolist(),
                       logprobs=lps[b, :lengths[b]].tolist(), finish_reason=finish[b],
                       prompt_index=pi, sample_index=si,
                       routing=_row_routing(routing[b], len(p) + int(lengths[b]) - 1) if routing else None,
                       support=sup[b, :lengths[b]].tolist() if sup is not None else None, kv_scale=kv_scale)
            for b, (pi, si, p) in enumerate(rows)
        ]

    @torch.no_grad()
    def score(self, batch, params: SamplingParams, rows_per_pass: int = 8) -> torch.Tensor:
        """log μ of every response token of ``batch`` ([B, L], aligned with ``batch.tokens``, 0 elsewhere),
        re-scored by this engine in one **prefill** pass per chunk of rows: its own weights (quantized when
        it samples quantized), dtype and prefill path — no KV cache carried from one token to the next —
        at ``params.temperature``, renormalised over the support each token was sampled from when the batch
        carries it (top-p / top-k), with the experts the decode chose when it carries them (MoE: the prefill
        would otherwise pick its own, and an expert flip would count as a decode difference and, with the
        opposite sign, as an engine one). Against the log μ recorded while decoding it isolates what the decode
        path (caches, decode kernels) adds: the mismatch ledger's *decode* term."""
        if self.exact is not None:
            raise UnisonError("exact mode decodes and scores with one forward: there is no decode term to measure")

        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        support = batch.extras.get("support")
        for lo in range(0, batch.size, rows_per_pass):
            rows = slice(lo, min(lo + rows_per_pass, batch.size))
            ids, key_ok = batch.tokens[rows].to(self.device), batch.attention_mask[rows].to(self.device).bool()
            resp = batch.response_mask[rows].bool()
            if not bool(resp.any()):
                continue
            B, L = ids.shape
            self._check_context(L, 1)
            pos = (key_ok.long().cumsum(-1) - 1).clamp(min=0)
            want = torch.zeros_like(resp)
            want[:, :-1] = resp[:, 1:]  # the hidden state at t predicts token t + 1
            routing = batch.extras.get("routing")
            if routing is not None:
                replay = moe.replay(self.model, moe.replay_indices(routing[rows]))
            else:
                replay = contextlib.nullcontext()
            backend = self._backend(B, L, 0)
            if self.kv is not None:  # the cache quantized as each row's was when it was sampled
                backend.kv_rows = batch.extras["kv_scale"][rows]
            with replay:
                h = backend.hidden(ids, key_ok, pos, want.to(self.device))  # [n, d], rows of `want`
            logits = self._head(h).float()
            if params.temperature != 1.0:
                logits = logits / params.temperature
            targets = ids[:, 1:][resp[:, 1:].to(self.device)]
            sizes = support[rows][:, 1:][resp[:, 1:]] if support is not None else torch.zeros_like(targets)
            lse = support_logsumexp(logits, targets, sizes.to(self.device))
            lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
            block = torch.zeros((B, L), dtype=torch.float32)
            block[resp] = lp.cpu()
            out[rows] = block
        return out

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The output layer (and the model's own logit transform, as the learner applies it) on final hidden states:
        the fast path's products (as its decode), else the model's own."""
        if self.fast is not None:
            logits = self.fast.logits(h)
        else:  # (Mamba2's final norm returns fp32: its own forward casts to the head's dtype, as here)
            head = self.model.get_output_embeddings()
            logits = head(h.to(head.weight.dtype))
        transform = logit_transform(self.config)
        return logits if transform is None else transform(logits)

    def _backend(self, B: int, P: int, T: int):
        if self.exact is not None:
            return _ExactBackend(self, B, P, T)
        return (_FastBackend if self.path == "fast" else _GenericBackend)(self, B, P, T)

    def _run(self, fn, routing, rows, *args):
        """``fn(*args)``; for a MoE model also append each row's expert choices of this call:
        ``rows`` are the batch rows of a decode step, ``None`` for the prefill (``args[1]`` = key_ok)."""
        if routing is None:
            return fn(*args)

        calls: list[torch.Tensor] = []
        with moe.record(self.model, calls):
            logits = fn(*args)
        sel = calls[-1]  # [tokens of this call, layers, k]
        if rows is None:  # the prefill, [B·P]: keep each row's real (non-pad) positions, in order
            key_ok = args[1].cpu()
            sel = sel.view(key_ok.shape[0], key_ok.shape[1], *sel.shape[1:])
            for b in range(key_ok.shape[0]):
                routing[b].extend(sel[b][key_ok[b]].unbind(0))
        else:
            for j, b in enumerate(rows.tolist()):
                routing[b].append(sel[j])
        return logits

    # ---------------------------------------------------------------- internals
    def _check_context(self, prompt_len: int, max_tokens: int) -> None:
        check_request(self.config, prompt_len, max_tokens)


def _row_routing(steps: list[torch.Tensor], inputs: int) -> torch.Tensor:
    """A row's expert choices for its ``inputs`` fed tokens, [inputs, layers, k] (int16)."""
    return torch.stack(steps[:inputs]).to(torch.int16)


class _CacheBackend:
    """A preallocated per-layer (k, v) cache and its key mask; finished rows leave both."""

    cache: list
    key_ok: torch.Tensor

    def select(self, keep):
        self.cache = [tuple(t[keep] for t in layer) for layer in self.cache]
        self.key_ok = self.key_ok[keep]


class _FastBackend(_CacheBackend):
    """The fused path (Llama, Mistral, Qwen2, Qwen3): our own attention over a preallocated
    KV cache in the engine's dtype; q/k/v and gate/up are one matmul each."""

    #: re-scoring a batch (:meth:`NativeEngine.score`) with a quantized cache: its rows' scales [B, layers, 2, heads]
    kv_rows: torch.Tensor | None = None

    def __init__(self, eng: NativeEngine, B: int, P: int, T: int):
        self.eng, self.P = eng, P
        cfg = eng.config
        attn = eng.model.model.layers[0].self_attn
        shape = (B, cfg.num_key_value_heads, P + T, attn.head_dim)
        self.cache = [(torch.zeros(shape, dtype=eng.dtype, device=eng.device),
                       torch.zeros(shape, dtype=eng.dtype, device=eng.device)) for _ in eng.model.model.layers]
        self.key_ok = torch.zeros((B, P + T), dtype=torch.bool, device=eng.device)

    def prefill(self, ids, key_ok, pos):
        P, dev = self.P, self.eng.device
        self.key_ok[:, :P] = key_ok
        # causal over the padded prompt, padding keys masked out. A pad query also sees
        # itself, so no attention row is empty (an empty row would put NaN into the cache).
        causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
        eye = torch.eye(P, dtype=torch.bool, device=dev)
        mask = (causal[None] & key_ok[:, None, :]) | eye[None]
        return self._forward(ids, pos, start=0, mask=mask[:, None])

    def step(self, tok, pos, t):
        P = self.P
        self.key_ok[:, P + t] = True
        return self._forward(tok[:, None], pos[:, None], start=P + t, mask=self.key_ok[:, None, None, :P + t + 1])

    def hidden(self, ids, key_ok, pos, want):
        """The prefill of a whole (right- or left-padded) sequence, as :meth:`prefill` computes it: the
        final-normed hidden states at the positions ``want`` marks, [n, d]."""
        P, dev = self.P, self.eng.device
        self.key_ok[:, :P] = key_ok
        causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
        mask = (causal[None] & key_ok[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)[None]
        return self._forward(ids, pos, start=0, mask=mask[:, None], want=want)

    def _forward(self, ids, pos, start: int, mask, want=None):
        """``ids`` [b, s] at positions ``pos`` through the decoder, K/V written at ``start``;
        the logits of the last position [b, V] (with ``want`` [b, s]: the final-normed hidden states of
        those positions instead, [n, d])."""
        eng = self.eng
        core = eng.model.model
        h = core.embed_tokens(ids)
        cos, sin = core.rotary_emb(h, pos)
        fast, rope = eng.fast, eng._rope
        for i, (layer, (kc, vc), w) in enumerate(zip(core.layers, self.cache, fast.layers)):
            kv = None if eng.kv is None else functools.partial(eng.kv.apply, i, rows=self.kv_rows)
            h = eng.kernels.layer(layer, w, fast.product, rope, h, kc, vc, cos, sin, mask, start, act=eng.act_quant, kv=kv)
        if want is not None:
            return core.norm(h[want])
        return fast.logits(core.norm(h[:, -1]))


class _ExactBackend(_CacheBackend):
    """Exact mode: the forward shared with the learner (``unison.exact``) over a cache of the
    layout's full length K = prompt width + max tokens, every step attending over all K slots."""

    def __init__(self, eng: NativeEngine, B: int, P: int, T: int):
        self.fwd, self.P, self.K = eng.exact, P, P + T
        self.w = self.fwd.weights(eng.dtype)
        self.cache = self.fwd.new_cache(B, self.K, eng.dtype, eng.device)
        self.key_ok = torch.zeros((B, self.K), dtype=torch.bool, device=eng.device)

    def prefill(self, ids, key_ok, pos):
        self.key_ok[:, :self.P] = key_ok
        h = self.fwd.hidden(self.w, ids, pos, self.key_ok, self.cache, start=0)
        return self.fwd.logits(self.w, h[:, -1])

    def step(self, tok, pos, t):
        c = self.P + t
        self.key_ok[:, c] = True
        h = self.fwd.hidden(self.w, tok[:, None], pos[:, None], self.key_ok, self.cache, start=c)
        return self.fwd.logits(self.w, h[:, -1])


class _GenericBackend:
    """Any Hugging Face causal LM: the model's own forward with a ``DynamicCache`` built from
    its config (sliding-window layers keep their window; a hybrid's or a state-space model's linear layers their
    recurrent and convolution states, per row), the full-history attention mask and position ids of the
    left-padded batch; logit soft-capping and scaling are the model's own."""

    def __init__(self, eng: NativeEngine, B: int, P: int, T: int):
        from transformers import DynamicCache

        self.eng = eng
        self.cache = DynamicCache(config=eng.model.config)
        self.mask = None
        self.cache_arg, self.positions = eng.generic_args

    def prefill(self, ids, key_ok, pos):
        self.mask = key_ok.long()
        return self._forward(ids, pos)

    def select(self, keep):
        idx = keep.nonzero().squeeze(-1)
        for layer in self.cache.layers:  # beam search's row selection: every layer kind has it, a linear-attention
            layer.reorder_cache(idx)  # layer's states and a hybrid layer's (Falcon-H1: states and keys) included
        self.mask = self.mask[idx]

    def step(self, tok, pos, t):
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        return self._forward(tok[:, None], pos[:, None])

    def _forward(self, ids, pos):
        kw = {self.cache_arg: self.cache, **({"position_ids": pos} if self.positions else {})}
        out = self.eng.model(input_ids=ids, attention_mask=self.mask, use_cache=True, logits_to_keep=1, **kw)
        if self.eng.state_round is not None:  # the state as a cache in the compute dtype holds it (in place: the
            for layer in self.cache.layers:  # model reads the tensor it wrote)
                for state in getattr(layer, "recurrent_states", {}).values():
                    if state is not None:
                        state.copy_(state.to(self.eng.state_round))
        return out.logits[:, -1]

    def hidden(self, ids, key_ok, pos, want):
        """The model's own forward over whole sequences, no cache: the final hidden states at ``want``."""
        kw = {"position_ids": pos} if self.positions else {}
        out = self.eng.model.base_model(input_ids=ids, attention_mask=key_ok.long(), use_cache=False, **kw)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h[want]


def check_request(config, prompt_len: int, max_tokens: int) -> None:
    """Refuse a request longer than the model's context (read from the config alone, so the
    trainer checks it before the run directory exists)."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and prompt_len + max_tokens > limit:
        raise UnisonError(
            f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the model's "
            f"context of {limit}: shorten the prompt or lower max_tokens / max-new-tokens")
