"""Softmax attention as both sides compute it: one rule for the rollout engine and the learner.

On the CPU, attention over bf16 / fp16 queries, keys and values runs in fp32 over those same rounded values and
its output is rounded once to their dtype. torch's CPU kernel for half dtypes takes 4–7× fp32's time at one query
row (a decode step: SmolLM2, 9 heads over 70 keys, 2.4 ms against 0.4 ms a layer at 32 rows, AMD EPYC Zen 4), and
it sums a decode step's row in another order than the learner's row of the whole sequence. The rule holds on both
sides, so that the engine's decode steps and prefills (:func:`sdpa`, unison/rollout/decode.py) and the learner's
forward over the whole sequence (:func:`use`: transformers' sdpa, and unison's packed sdpa, in fp32) compute the
same attention: a learner whose parameters are cast to the compute dtype (``distributed.param_dtype: compute``)
then parts from the engine only where fp32 sums do (a decode step's few-row products, a row summed over another
number of keys: docs/cpu.md measures what that leaves). Elsewhere (CUDA, fp32) attention is torch's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the attention implementation :func:`use` gives a model (transformers' sdpa under the rule above)
NAME = "unison_sdpa"


def upcasts(q: torch.Tensor) -> bool:
    """Whether attention over ``q`` runs in fp32 (a bf16 / fp16 tensor on the CPU)."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """torch's sdpa of ``q`` [b, heads, s, d] over ``k`` / ``v`` [b, kv heads, keys, d] (grouped heads) under
    the rule (module docstring)."""
    if upcasts(q):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=_mask(mask), scale=scale,
                                                  enable_gqa=True).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _mask(mask):
    return mask.float() if mask is not None and mask.is_floating_point() else mask


def hf_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention (its interface: ``module``, [b, heads, s, d] tensors, the mask) under the
    rule: autocast off and fp32 inputs where :func:`upcasts`, the output rounded back to ``query``'s dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not upcasts(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              _mask(attention_mask), **kwargs)
    return out.to(query.dtype), weights


def use(model) -> None:
    """Give ``model`` (transformers, running sdpa) :func:`hf_sdpa` as its attention. Models on another
    implementation (eager: Gemma 2's soft-capping; none: Mamba2) keep theirs."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    ALL_ATTENTION_FUNCTIONS.register(NAME, hf_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = NAME
