"""A quantized KV cache (``rollout.kv_cache_dtype``): the engine's keys and values held in fp8, and the learner's
replay of it (``train.kv_cache_aware``).

GPU engines store the attention cache in fp8 to fit more sequences (vLLM ``kv_cache_dtype=fp8_e4m3``, used for
rollout by NeMo RL and open-instruct): every key and value a layer writes is divided by a scale, rounded to the fp8
format (round to nearest even, saturating at the format's largest value) and multiplied back when attention reads
it. The learner's full forward never rounds its keys and values: a mismatch of its own, growing with the length
attended over. Here:

* **formats** — ``fp8_e4m3`` (OCP ``float8_e4m3fn``: max 448, 3 mantissa bits) and ``fp8_e5m2`` (max 57344, 2
  mantissa bits); ``auto`` = the engine's compute dtype (no quantization);
* **scales** (``rollout.kv_cache_scales``) — ``sync``: one per layer, per KV head, for keys and for values, s =
  max|x| / max(format) over the real prompt tokens of the first batch the engine generates after each weight
  sync (vLLM's ``calculate_kv_scales``, refreshed at every refit as NeMo RL does); a later token beyond that range
  saturates. ``one``: s = 1 (vLLM's default for a checkpoint without calibrated scales);
* what is quantized — keys after the rotary embedding (and Qwen3's k-norm), values as projected: what the cache
  holds. Every attention read sees the rounded values, the prompt's prefill included (vLLM reads the cache it has
  just written). Queries and the attention's arithmetic keep the compute dtype;
* **the replay** — every row of a batch carries the scales its cache was quantized with (``extras["kv_scale"]``,
  [B, layers, 2, KV heads]); the learner's attention (a wrapper around its sdpa) quantizes its own keys and values
  with them, straight through (the gradient passes as if unrounded), so π attends over what μ attended over.

The native engine's fast path (Llama, Mistral, Qwen2, Qwen3) only; on a CPU the cache holds the dequantized values
in the compute dtype (the point is the numerics: no memory is saved).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from unison.errors import UnisonError
from unison.models import decode_path
from unison.quant import round_float8

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2")
SCALES = ("sync", "one")
#: each format's torch dtype (its largest finite value: ``torch.finfo(dtype).max``, 448 and 57344)
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def quantize(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [b, heads, s, d] divided by ``scale`` (fp32, broadcastable: [b or 1, heads, s or 1, 1]), rounded to
    ``fmt`` (nearest, ties to even, saturating), multiplied back in fp32, returned in ``x``'s dtype."""
    return (round_float8(x.float() / scale, FP8[fmt]) * scale).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, scale):
        return quantize(x, fmt, scale)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def calibrate(x: torch.Tensor, valid: torch.Tensor, fmt: str) -> torch.Tensor:
    """The scale of each head, [heads] fp32: max|x| over the positions ``valid`` [b, s] marks (every row, every
    channel) / the format's largest value; 1 for a head with nothing but zeros there."""
    amax = x.float().abs().amax(-1).masked_fill(~valid[:, None, :], 0.0).amax(dim=(0, 2))
    return torch.where(amax > 0, amax / torch.finfo(FP8[fmt]).max, torch.ones_like(amax))


def check_model(fmt: str, config, exact: bool) -> None:
    """The one refusal of a quantized cache a model or mode cannot hold (the trainer's preflight, before anything is
    written, and the engine itself): the native engine's fast path quantizes its own cache; nothing else does.
    ``config`` None: the mode alone."""
    if fmt == "auto":
        return
    if exact:
        raise UnisonError("exact mode shares one forward between the engine and the learner, which does not quantize "
                          "its cache: set rollout.kv_cache_dtype=auto or exact=false")
    if config is not None and decode_path(config) != "fast":
        raise UnisonError(f"rollout.kv_cache_dtype={fmt} quantizes the native engine's own cache (Llama, Mistral, "
                          f"Qwen2, Qwen3 without a sliding window), and {config.model_type} decodes through its own "
                          f"forward: set rollout.kv_cache_dtype=auto")


class EngineCache:
    """The engine's quantizer of its cache: the format, the scales of the current weights ([layers, 2, heads]:
    keys, values), :meth:`reset` at each weight sync. ``sync`` scales are measured by the first prefill after it
    (:meth:`calibrating`)."""

    def __init__(self, fmt: str, scales: str, layers: int, heads: int):
        self.fmt, self.mode, self.layers, self.heads = fmt, scales, layers, heads
        self.scales: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None  # during a calibrating prefill: its real prompt tokens [b, s]

    def reset(self) -> None:
        self.scales = None

    @contextlib.contextmanager
    def calibrating(self, key_ok: torch.Tensor):
        """Around a prefill (``key_ok`` [b, P]: its real tokens): with no scales for the current weights, each layer
        measures its own from what it writes; after it, the scales hold until the next :meth:`reset`."""
        if self.scales is not None:
            yield
            return
        if self.mode == "one":
            self.scales = torch.ones(self.layers, 2, self.heads)
            yield
            return
        self.scales, self._valid = torch.full((self.layers, 2, self.heads), float("nan")), key_ok
        try:
            yield
        finally:
            self._valid = None

    def apply(self, i: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None):
        """Layer ``i``'s keys and values [b, heads, s, d] as the cache holds them: under this engine's scales (measured
        now in a calibrating prefill), or under ``rows`` [b, layers, 2, heads] (re-scoring a batch whose rows
        recorded their own)."""
        if rows is not None:
            s = rows[:, i].to(device=k.device, dtype=torch.float32)
        else:
            if self._valid is not None:
                self.scales[i, 0] = calibrate(k, self._valid, self.fmt)
                self.scales[i, 1] = calibrate(v, self._valid, self.fmt)
            s = self.scales[i][None].to(k.device)
        return quantize(k, self.fmt, s[:, 0, :, None, None]), quantize(v, self.fmt, s[:, 1, :, None, None])


# ----------------------------------------------------------------------------- the learner's replay
#: the replay of the current forward: (format, per-row scales [rows, layers, 2, heads], each position's row in a
#: packed forward [T] or None)
_REPLAY = contextvars.ContextVar("unison_kv_replay", default=None)
_WRAPPED = "unison_kv_"


@contextlib.contextmanager
def replay(fmt: str, scales: torch.Tensor, segments: torch.Tensor | None = None):
    """The learner's forwards inside quantize their keys and values as the engine's cache did: ``scales`` [rows,
    layers, 2, heads] of the rows in the forward (``segments`` [T]: the row of each position of one packed row)."""
    token = _REPLAY.set((fmt, scales, segments))
    try:
        yield
    finally:
        _REPLAY.reset(token)


def _replayed(module, key, value):
    """The keys and values [b, heads, s, d] of ``module`` (an attention layer) under the current replay."""
    fmt, scales, segments = _REPLAY.get()
    s = scales[:, module.layer_idx].to(device=key.device, dtype=torch.float32)  # [rows, 2, heads]
    if segments is not None:  # one packed row: each position its own row's scales, [1, heads, T, 1]
        s = s[segments.to(key.device)].permute(1, 2, 0)[None]  # [1, 2, heads, T]
        ks, vs = s[:, 0, :, :, None], s[:, 1, :, :, None]
    else:
        ks, vs = s[:, 0, :, None, None], s[:, 1, :, None, None]
    return _StraightThrough.apply(key, fmt, ks), _StraightThrough.apply(value, fmt, vs)


def wrap_attention(model) -> None:
    """Give ``model`` an attention that replays a quantized cache inside :func:`replay` and is its own attention
    (sdpa, or unison's packed sdpa) call for call outside it. Idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = model.config._attn_implementation
    if inner.startswith(_WRAPPED):
        return
    if inner not in ALL_ATTENTION_FUNCTIONS:
        raise UnisonError(f"train.kv_cache_aware replays the cache in the learner's attention, and this model runs "
                          f"'{inner}' attention: set train.kv_cache_aware=false")
    name = _WRAPPED + inner

    def attention(module, query, key, value, attention_mask, **kwargs):
        if _REPLAY.get() is not None:
            key, value = _replayed(module, key, value)
        return ALL_ATTENTION_FUNCTIONS[inner](module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.config._attn_implementation = name
