"""The native rollout engine: batched incremental decoding with a preallocated KV cache.

It runs the model's own modules (embeddings, projections, norms, MLPs, rotary
embedding) but its own decode loop and attention over a static KV cache held in
the engine's dtype, so it is an *incremental* sampler like vLLM, while the
learner scores with one full forward pass. Finished rows leave the batch.

Supported: Llama, Mistral, Qwen2 and Qwen3 decoder layers (q/k norms and
attention biases are picked up from the modules). Sliding-window attention is
not implemented: a request that would exceed a model's window is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from unison.batch import Completion
from unison.errors import UnisonError
from unison.models import load_model, load_tokenizer
from unison.rollout.base import SamplingParams, row_seeds, sample_tokens


class NativeEngine:
    """KV-cache sampler over a model held in ``dtype``."""

    name = "native"

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = load_model(self.model_dir, dtype=dtype, device=device)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.config = self.model.config
        self._rope = sys.modules[type(self.model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self._fused = [self._fuse(layer) for layer in self.model.model.layers]
        self._params = dict(self.model.named_parameters())
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])})
        self.pad_id = int(self.tokenizer.pad_token_id)
        from unison.distributed import current

        self.dp_rank, self.dp_size = current().rank, current().world_size  # one engine per rank

    # ------------------------------------------------------ the engine protocol
    def sync_weights(self, learner) -> dict[str, float]:
        """Take the learner's weights, cast to this engine's dtype on the learner's side."""
        self.load_weights(learner.export_weights(self.dtype))
        return {}

    def sleep(self) -> None:
        """Nothing to free: the native engine's cache lives only during ``generate``."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ weights
    @staticmethod
    def _fuse(layer):
        """Put q/k/v (and gate/up) weights into one tensor per layer and make the modules'
        parameters views of it: one matmul computes all of them, and ``load_weights``
        still writes through the original names. No extra memory."""

        def join(linears):
            w = torch.cat([lin.weight.detach() for lin in linears])
            for lin, view in zip(linears, w.split([lin.out_features for lin in linears])):
                lin.weight = torch.nn.Parameter(view, requires_grad=False)
            b = None
            if linears[0].bias is not None:
                b = torch.cat([lin.bias.detach() for lin in linears])
                for lin, view in zip(linears, b.split([lin.out_features for lin in linears])):
                    lin.bias = torch.nn.Parameter(view, requires_grad=False)
            return w, b, [lin.out_features for lin in linears]

        a, mlp = layer.self_attn, layer.mlp
        return join([a.q_proj, a.k_proj, a.v_proj]), join([mlp.gate_proj, mlp.up_proj])

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy weights (any dtype) into the engine, cast to its dtype. Returns how many."""
        count = 0
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise UnisonError(f"weight '{name}' does not exist in the rollout model: "
                                  f"sync from a learner built on the same architecture")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            count += 1
        return count

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
        self._check_context(P, params.max_tokens)
        B, T = len(rows), params.max_tokens
        dev = self.device
        ids = torch.full((B, P), self.pad_id, dtype=torch.long, device=dev)
        key_ok = torch.zeros((B, P + T), dtype=torch.bool, device=dev)
        for b, (_, _, p) in enumerate(rows):
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            key_ok[b, P - len(p):] = True
        pos = (key_ok[:, :P].long().cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache(B, P + T)

        seeds = torch.tensor(row_seeds(params, len(prompts)), dtype=torch.int64, device=dev)

        # prefill: causal over the padded prompt, padding keys masked out. A pad
        # query also sees itself, so no attention row is empty (an empty row
        # would put NaN into the cache).
        causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
        eye = torch.eye(P, dtype=torch.bool, device=dev)
        mask = (causal[None] & key_ok[:, None, :P]) | eye[None]
        logits = self._forward(ids, pos, cache, start=0, mask=mask[:, None])

        out_tokens = torch.zeros((B, T), dtype=torch.long, device=dev)
        out_logp = torch.zeros((B, T), dtype=torch.float32, device=dev)
        lengths = torch.zeros(B, dtype=torch.long)
        finish = ["length"] * B
        active = torch.arange(B, device=dev)  # original row of each live batch slot
        eos = torch.tensor([] if params.ignore_eos else self.eos_ids, dtype=torch.long, device=dev)
        next_pos = pos[:, -1] + 1
        for t in range(T):
            tok, lp = sample_tokens(logits, params, seeds[active], t)
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
                cache = [(k[keep], v[keep]) for k, v in cache]
                key_ok = key_ok[keep]
            key_ok[:, P + t] = True
            logits = self._forward(tok[:, None], next_pos[:, None], cache, start=P + t,
                                   mask=key_ok[:, None, None, :P + t + 1])
            next_pos = next_pos + 1

        toks, lps = out_tokens.cpu(), out_logp.cpu()
        return [
            Completion(prompt_ids=p, token_ids=toks[b, :lengths[b]].tolist(),
                       logprobs=lps[b, :lengths[b]].tolist(), finish_reason=finish[b],
                       prompt_index=pi, sample_index=si)
            for b, (pi, si, p) in enumerate(rows)
        ]

    # ---------------------------------------------------------------- internals
    def _check_context(self, prompt_len: int, max_tokens: int) -> None:
        check_request(self.config, prompt_len, max_tokens)

    def _new_cache(self, batch: int, length: int):
        cfg = self.config
        attn = self.model.model.layers[0].self_attn
        shape = (batch, cfg.num_key_value_heads, length, attn.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in self.model.model.layers]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, cache, start: int,
                 mask: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` [b, s] at positions ``pos`` through the decoder, writing K/V at
        ``start``; return the fp32-castable logits of the last position [b, V]."""
        core = self.model.model
        h = core.embed_tokens(ids)
        cos, sin = core.rotary_emb(h, pos)
        b, s = ids.shape
        end = start + s
        for layer, (kc, vc), ((qkv_w, qkv_b, qkv_n), (gu_w, gu_b, gu_n)) in zip(core.layers, cache, self._fused):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)
            q, k, v = F.linear(x, qkv_w, qkv_b).split(qkv_n, dim=-1)
            q = q.view(b, s, -1, attn.head_dim)
            k = k.view(b, s, -1, attn.head_dim)
            v = v.view(b, s, -1, attn.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            kc[:, :, start:end] = k
            vc[:, :, start:end] = v
            o = F.scaled_dot_product_attention(q, kc[:, :, :end], vc[:, :, :end], attn_mask=mask,
                                               scale=attn.scaling, enable_gqa=True)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            gate, up = F.linear(layer.post_attention_layernorm(h), gu_w, gu_b).split(gu_n, dim=-1)
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)
        h = core.norm(h[:, -1])
        return self.model.lm_head(h)


def check_request(config, prompt_len: int, max_tokens: int) -> None:
    """Refuse what the native engine cannot run: an architecture it does not know, a request
    longer than the context, or longer than a sliding window (read from the config alone, so
    the trainer checks it before the run directory exists)."""
    from unison.models import SUPPORTED_MODEL_TYPES

    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnisonError(f"model type '{config.model_type}' is not supported by the native engine: it runs "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)} models")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_tokens > limit:
        raise UnisonError(
            f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the model's "
            f"context of {limit}: shorten the prompt or lower max_tokens / max-new-tokens")
    window = getattr(config, "sliding_window", None)
    uses_window = window is not None and (
        config.model_type == "mistral" or getattr(config, "use_sliding_window", False))
    if uses_window and prompt_len + max_tokens > window:
        raise UnisonError(
            f"prompt + max_tokens ({prompt_len + max_tokens}) exceeds the sliding window "
            f"({window}), which the native engine does not implement: lower max_tokens")
