"""Low-precision rollout: weight-only quantization of the rollout engine's decoder weights.

Production RL samples with quantized weights because rollout dominates the step (verl
``rollout.quantization=fp8``, slime, FlashRL); the learner keeps training fp32 masters. The
gap between the quantized sampler μ and the full-precision learner π is a training–inference
mismatch of its own, and a large one — the regime where corrections decide the outcome.

``rollout.quantization`` (**contract** key) selects the format of the engine's weights; the
compute dtype stays ``rollout_precision``. Formats (all symmetric, no zero point):

* ``int8``: per output channel, scale s = max|w| / 127, codes round(w / s) ∈ [−127, 127];
* ``fp8``: float8 e4m3 (OCP ``float8_e4m3fn``, max 448), per output channel, s = max|w| / 448,
  codes = w / s rounded to the nearest e4m3 value;
* ``int4``: groups of ``group_size`` (default 64) consecutive input columns of each output
  channel, s = max|w_group| / 7, codes round(w / s) ∈ [−7, 7] (as GPTQ/AWQ-style W4A16
  kernels with symmetric groups; −8 is never produced).
* ``mxfp8`` / ``mxfp4`` (OCP Microscaling v1.0): blocks of 32 consecutive input columns share a
  power-of-two scale (e8m0) 2^(⌊log2 max|w_block|⌋ − e), e the element format's largest exponent
  (e4m3: 8, max 448; e2m1: 2, max 6); elements w / scale rounded to the nearest e4m3 / e2m1 value
  (ties to even), saturating at ±448 / ±6 — the spec's rule, so a block's largest element can clip
  to 6 (e2m1 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6).
* ``nvfp4`` (NVIDIA's FP4, the Blackwell tensor-core format): blocks of 16 input columns, e2m1
  elements, each block's scale max|w_block| / 6 stored in e4m3 relative to a per-tensor fp32 scale
  max|w| / (6 · 448) (TensorRT Model Optimizer's recipe): scale = e4m3(max|w_block| / 6 / g) · g.

The block formats fix their block size (32, 32, 16): ``rollout.quant_group_size`` is int4's.

* ``w8a8_fp8`` / ``w8a8_int8``: the weights as ``fp8`` / ``int8`` (per output channel) and every quantized linear
  layer's *input* quantized too, per token and dynamically — s = max|x_token| / 448 (e4m3) or / 127 (int8,
  round-to-nearest-even), x ↦ Q(x / s) · s — what W8A8 kernels (vLLM's fp8 and int8 "dynamic per-token") compute.
  Linear layers only (a model whose experts are 3-D tensors is refused), not in exact mode.

Dequantization is ``codes · s`` in fp32, rounded to the compute dtype: the weights a W8A16 /
W4A16 kernel multiplies by. Which weights: every linear weight inside the decoder layers
(``nn.Linear``, GPT-2's ``Conv1D``, MoE experts stored as 3-D tensors); embeddings, the
output layer (``lm_head``), norms, biases and MoE routers stay in the compute dtype — verl's
rule. The engine re-quantizes from the learner's weights at every sync.

On a CPU the dequantized weights are held in the compute dtype (no memory or speed is
saved): the point here is the numerics; the speed of low-bit kernels is a GPU property.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from unison import gemm
from unison import lora
from unison import moe
from unison.algorithms.losses import SELF_CORRECTING
from unison.distributed import decoder_layers
from unison.errors import UnisonError

FORMATS = ("none", "fp8", "int8", "int4", "mxfp8", "mxfp4", "nvfp4", "w8a8_fp8", "w8a8_int8")
#: int4: input columns per scale (``rollout.quant_group_size``)
DEFAULT_GROUP = 64
_QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0, "mxfp8": 448.0, "mxfp4": 6.0, "nvfp4": 6.0}
#: the block formats' fixed block sizes (input columns per scale)
BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}
#: the largest exponent of each MX element format (e4m3: 448 = 1.75·2^8; e2m1: 6 = 1.5·2^2)
_EMAX = {"mxfp8": 8, "mxfp4": 2}
#: every e2m1 value ≥ 0; the index's parity is the mantissa bit (ties round to the even index)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


#: W8A8: the weight format under each (the activations are quantized per token in the same element format)
W8A8 = {"w8a8_fp8": "fp8", "w8a8_int8": "int8"}


def weight_format(fmt: str) -> str:
    """The format the weights are held in (a W8A8 format's weights: fp8 / int8 per output channel)."""
    return W8A8.get(fmt, fmt)


def quantize_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` quantized per token (its last dimension) with a dynamic scale max|x| / qmax in ``W8A8[fmt]``'s element
    format, dequantized in fp32 and returned in ``x``'s dtype. A token of zeros stays zeros."""
    elem = W8A8[fmt]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX[elem], torch.ones_like(amax))
    y = xf / scale
    y = round_e4m3(y) if elem == "fp8" else torch.round(y).clamp(-127, 127)
    return (y * scale).to(x.dtype)


class _StraightThroughActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt):
        return quantize_activation(x, fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def activation_quantizer(fmt: str):
    """The function a W8A8 format applies to every quantized layer's input (straight-through gradient), or None."""
    if fmt not in W8A8:
        return None
    return lambda x: _StraightThroughActivation.apply(x, fmt)


def group_of(fmt: str, group_size: int) -> int | None:
    """Input columns per scale: the block formats' fixed block, int4's ``group_size``, None per channel."""
    return BLOCK.get(fmt, group_size if fmt == "int4" else None)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest e2m1 value, ties to even (fp32 in, fp32 out), saturating at ±6."""
    grid = E2M1.to(x.device)
    a = x.abs().clamp(max=6.0)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, len(grid) - 2)  # grid[lo] ≤ a < grid[lo + 1]
    d_lo, d_hi = a - grid[lo], grid[lo + 1] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))  # a tie goes to the even index (lo + 1 when lo is odd)
    return torch.copysign(grid[lo + up.long()], x)


def round_float8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``x`` rounded to the nearest value of the float8 ``dtype`` (ties to even), saturating at its largest finite
    value (e4m3: ±448, e5m2: ±57344), back in fp32 — torch's cast alone would give NaN or inf beyond it."""
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype).float()


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest e4m3 (OCP ``float8_e4m3fn``) value, saturating at ±448, back in fp32."""
    return round_float8(x, torch.float8_e4m3fn)


def parse_quantization(name: str) -> str:
    key = str(name).strip().lower()
    if key not in FORMATS:
        raise UnisonError(f"unknown quantization '{name}': choose one of {', '.join(FORMATS)}")
    return key


def check_format_available(fmt: str) -> None:
    """fp8 and the e4m3-based formats need torch's float8 dtypes (torch ≥ 2.1)."""
    if fmt in ("fp8", "mxfp8", "nvfp4", "w8a8_fp8") and not hasattr(torch, "float8_e4m3fn"):
        raise UnisonError(f"rollout.quantization {fmt} needs a torch with float8 dtypes (this is {torch.__version__}): "
                          f"upgrade torch (≥ 2.1), or use int8, int4 or mxfp4")


@dataclass(frozen=True)
class Target:
    """A quantized weight: its name and which dimension is the matmul's input (reduction) dim."""

    name: str
    in_dim: int


def _codes(w: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    x = w / scale
    if fmt in ("fp8", "mxfp8"):
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    if fmt in ("mxfp4", "nvfp4"):
        return round_e2m1(x)  # e2m1 values held in fp32 (torch has no e2m1 arithmetic)
    q = _QMAX[fmt]
    return torch.round(x).clamp(-q, q).to(torch.int8)


@dataclass
class Quantized:
    """A quantized weight: ``codes`` (int8 / float8, input dimension last; int4 split into
    ``[..., groups, group_size]``), fp32 ``scale`` broadcasting against them, and how to put
    the dequantized weight back into its original layout."""

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str
    in_dim: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes · scale`` in fp32, in the original layout, rounded to ``dtype``."""
        w = self.codes.float() * self.scale
        if self.fmt == "int4" or self.fmt in BLOCK:
            w = w.reshape(*w.shape[:-2], -1)
        return w.movedim(-1, self.in_dim).to(dtype)


def quantize(w: torch.Tensor, fmt: str, in_dim: int = -1, group_size: int = DEFAULT_GROUP) -> Quantized:
    """Quantize ``w`` (any shape; ``in_dim`` is its input dimension) in fp32, per output channel
    (int4: per group of ``group_size`` input columns; the block formats per block of ``BLOCK[fmt]``).
    A channel (group, block) of zeros gets scale 1. A W8A8 format's weights: its weight format's."""
    fmt = weight_format(fmt)
    if fmt not in _QMAX:
        raise UnisonError(f"unknown quantization '{fmt}': choose one of {', '.join(FORMATS)}")
    check_format_available(fmt)
    x = w.detach().float().movedim(in_dim, -1)
    n_in = x.shape[-1]
    g = group_of(fmt, group_size)
    if g is not None:
        if n_in % g:
            fix = (f"set rollout.quant_group_size to a divisor of {n_in}" if fmt == "int4" else
                   f"{fmt}'s blocks are fixed by the format: use int4 with a group size dividing {n_in}, or fp8")
            raise UnisonError(f"{fmt} groups of {g} do not divide an input dimension of {n_in}: {fix}")
        x = x.reshape(*x.shape[:-1], n_in // g, g)
    amax = x.abs().amax(-1, keepdim=True)
    if fmt in _EMAX:  # e8m0: a power of two, 2^(floor(log2 amax) − emax), its exponent within e8m0's [−127, 127]
        e = torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - _EMAX[fmt]
        scale = torch.where(amax > 0, torch.exp2(e.clamp(-127, 127)), torch.ones_like(amax))
    elif fmt == "nvfp4":  # e4m3 block scales under one fp32 tensor scale
        g_amax = x.abs().amax()
        tensor_scale = g_amax / (6.0 * 448.0) if g_amax > 0 else torch.ones_like(g_amax)
        block = round_e4m3(amax / 6.0 / tensor_scale)
        x = torch.where(block > 0, x, torch.zeros_like(x))  # a block whose e4m3 scale underflows to 0 is zeros
        scale = torch.where(block > 0, block * tensor_scale, torch.ones_like(amax))
    else:
        scale = torch.where(amax > 0, amax / _QMAX[fmt], torch.ones_like(amax))
    return Quantized(_codes(x, fmt, scale), scale, fmt, in_dim)


def fake_quantize(w: torch.Tensor, fmt: str, dtype: torch.dtype, in_dim: int = -1,
                  group_size: int = DEFAULT_GROUP) -> torch.Tensor:
    """``quantize(w).dequantize(dtype)``: what a quantized engine holds in place of ``w``."""
    return quantize(w, fmt, in_dim, group_size).dequantize(dtype)


class _StraightThrough(torch.autograd.Function):
    """``fake_quantize(w)`` forward (bit for bit what the engine holds), identity backward: the
    straight-through estimator, so the gradient reaches the fp32 master unchanged."""

    @staticmethod
    def forward(ctx, w, fmt, in_dim, group_size):
        return fake_quantize(w, fmt, w.dtype, in_dim, group_size)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def straight_through(w: torch.Tensor, fmt: str, in_dim: int = -1, group_size: int = DEFAULT_GROUP) -> torch.Tensor:
    """``fake_quantize(w)`` in ``w``'s dtype with a straight-through gradient (d out / d w = identity)."""
    return _StraightThrough.apply(w, fmt, in_dim, group_size)


class QuantizationAware:
    """``train.quantization_aware``: the learner's forward computes through the rollout's quantizer.

    Every weight the engine quantizes (:func:`targets`) is replaced, inside the forward of the module
    that owns it, by :func:`straight_through` of itself — the same function and group size the engine
    applies at every sync, so π is the quantized policy μ samples from, and the gradient goes straight
    through to the fp32 master. The parameters, their names, the optimizer state and the checkpoints
    stay the masters: nothing but the forward changes. The swap happens in a forward pre-hook of the
    owning module and is undone by its forward hook, so under FSDP2 it sees the weight FSDP has just
    gathered for that module (the gathered weight is what is quantized), and activation checkpointing
    recomputes it in the backward.

    LoRA (PEFT): the engine samples with the merged weight W + (α/r)·B·A quantized, so an adapted
    layer computes ``F.linear(x, Q(W + (α/r)·B·A), bias)``: the base weight and the adapters are merged
    in fp32 and quantized together (QeRL instead keeps the adapters outside the quantized base; that
    is not what this engine samples from). The gradient reaches A and B through the merge. With the adapters
    disabled (PEFT's ``disable_adapter``, as the learner scores under merged weights of another version) the
    layer quantizes its base weight alone.

    ``enabled`` switches it off and on (the mismatch ledger scores with and without the quantizer).
    """

    def __init__(self, model: torch.nn.Module, fmt: str, group_size: int = DEFAULT_GROUP):
        self.fmt, self.group_size, self.enabled = fmt, group_size, True
        #: W8A8: each quantized layer's input quantized per token (straight through), as the engine's kernels do
        self.act = activation_quantizer(fmt)
        lora_layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
        inside_lora = {id(x) for m in lora_layers.values() for x in m.modules()}
        modules = dict(model.named_modules())
        owners: dict[str, list[tuple[str, int]]] = {}
        found = targets(model)
        for t in found:
            mname, pname = t.name.rsplit(".", 1)
            if id(modules[mname]) in inside_lora:
                continue  # an adapter's own Linear, or the base layer it merges into: the LoRA layer does both
            owners.setdefault(mname, []).append((pname, t.in_dim))
        kept = [t for t in found if t.name.rsplit(".", 1)[0] in owners]
        kept += [Target(f"{n}.base_layer.weight", 0 if getattr(m, "fan_in_fan_out", False) else -1)
                 for n, m in lora_layers.items()]
        check_targets(model, fmt, group_size, kept, params=dict(model.named_parameters()))
        #: (module name, parameter name, input dim) of every weight quantized on its own
        self.params = [(m, p, d) for m, ps in owners.items() for p, d in ps]
        #: the LoRA layers whose merged weight is quantized
        self.lora = sorted(lora_layers)
        self._saved: dict[int, list] = {}
        self._handles = []
        for mname, params in owners.items():
            mod = modules[mname]
            self._handles.append(mod.register_forward_pre_hook(self._pre(params)))
            self._handles.append(mod.register_forward_hook(self._post, always_call=True))
        for layer in lora_layers.values():
            layer.forward = self._lora_forward(layer, layer.forward)

    def _pre(self, params):
        def hook(mod, args):
            self._post(mod, args, None)  # nothing left over from a forward that raised
            if not self.enabled:
                return
            saved = []
            for pname, in_dim in params:
                w = mod._parameters[pname]
                saved.append((pname, w))
                mod._parameters[pname] = straight_through(w, self.fmt, in_dim, self.group_size)
            self._saved[id(mod)] = saved
            if self.act is not None and args:
                return (self.act(args[0]), *args[1:])
        return hook

    def _post(self, mod, args, output):
        for pname, w in self._saved.pop(id(mod), []):
            mod._parameters[pname] = w

    def _lora_forward(self, layer, original):
        conv1d = getattr(layer, "fan_in_fan_out", False)  # GPT-2's Conv1D: weight [in, out], x @ W + b

        def forward(x, *args, **kwargs):
            if not self.enabled:
                return original(x, *args, **kwargs)

            base = layer.base_layer
            if layer.disable_adapters or layer.merged:
                # adapters off (PEFT's disable_adapter: the base weight holds merged weights, e.g. an older version
                # scored as the engine holds it) or merged in place: the base weight alone is the engine's weight
                merged = base.weight
            else:
                with torch.autocast(x.device.type, enabled=False):  # merged in fp32, as the engine merges it
                    merged = base.weight + lora.delta(layer)
            q = straight_through(merged, self.fmt, 0 if conv1d else -1, self.group_size)
            q = q.t() if conv1d else q  # in the input's dtype: parameters cast to bf16/fp16 (FSDP2's, the probe's
            x = self.act(x) if self.act is not None else x  # --param-dtype compute) meet an fp32 merge here
            return gemm.torch_linear(x, q.to(x.dtype), base.bias)  # half products without native kernels: gemm.py
        return forward

    @contextmanager
    def swapped(self, model: torch.nn.Module):
        """Every quantized weight replaced at once for the duration (exact mode reads the weights outside
        the modules' forwards; one process, no LoRA)."""
        if self.lora:
            raise UnisonError("exact mode does not take LoRA adapters: set lora.rank=0 or exact=false")
        modules = dict(model.named_modules())
        saved = []
        try:
            if self.enabled:
                for mname, pname, in_dim in self.params:
                    mod = modules[mname]
                    w = mod._parameters[pname]
                    saved.append((mod, pname, w))
                    mod._parameters[pname] = straight_through(w, self.fmt, in_dim, self.group_size)
            yield
        finally:
            for mod, pname, w in reversed(saved):
                mod._parameters[pname] = w

    @contextmanager
    def set(self, enabled: bool):
        """Score with (``True``) or without the quantizer for the duration."""
        before, self.enabled = self.enabled, enabled
        try:
            yield
        finally:
            self.enabled = before


def targets(model: torch.nn.Module) -> list[Target]:
    """The weights a quantized rollout quantizes (see the module docstring), in module order."""
    routers = {id(m) for m in moe.routers(model)}
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    out = []
    for mname, mod in model.named_modules():
        if id(mod) not in inside or id(mod) in routers:
            continue
        kind = type(mod).__name__
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if isinstance(mod, torch.nn.Linear) and pname == "weight":
                out.append(Target(full, -1))
            elif kind == "Conv1D" and pname == "weight":  # GPT-2: weight [in, out]
                out.append(Target(full, 0))
            elif kind.endswith("Experts") and p.dim() == 3:  # [experts, out, in], used as F.linear(x, W[e])
                hidden = getattr(model.config, "hidden_size", None)
                if hidden is not None and not _linear_layout(pname, p.shape, hidden):
                    raise UnisonError(f"rollout.quantization: '{full}' has shape {tuple(p.shape)}, not the "
                                      f"[experts, out, in] layout unison knows: set rollout.quantization=none for "
                                      f"{type(model).__name__}")
                out.append(Target(full, -1))
    return out


def _linear_layout(name: str, shape, hidden: int) -> bool:
    """A fused expert tensor in the [experts, out, in] layout of transformers' Qwen3-MoE / Mixtral / OLMoE:
    gate_up maps the hidden size in, down maps it out."""
    return shape[-1] == hidden if "down" not in name else shape[-2] == hidden


def check_targets(model: torch.nn.Module, fmt: str, group_size: int, found: list[Target] | None = None,
                  params: dict | None = None) -> list[Target]:
    """The model's targets (or ``found``), refusing in one line a format the model or this torch cannot take."""
    check_format_available(fmt)
    found = targets(model) if found is None else found
    if not found:
        raise UnisonError(f"rollout.quantization {fmt}: found no linear weights inside the decoder layers of "
                          f"{type(model).__name__}: set rollout.quantization=none for this model")
    if fmt in W8A8:
        params = dict(model.named_parameters()) if params is None else params
        experts = [t.name for t in found if params[t.name].dim() != 2]
        if experts:
            raise UnisonError(f"rollout.quantization {fmt} quantizes the inputs of linear layers, and "
                              f"'{experts[0]}' is a {params[experts[0]].dim()}-D expert tensor: use "
                              f"{W8A8[fmt]} (weight-only) for this model")
    g = group_of(fmt, group_size)
    if g is not None:
        params = dict(model.named_parameters()) if params is None else params
        for t in found:
            n_in = params[t.name].shape[t.in_dim]
            if n_in % g:
                fix = (f"set rollout.quant_group_size to a divisor of {n_in}" if fmt == "int4" else
                       f"{fmt}'s blocks of {g} are fixed by the format: use int4 with a group size dividing {n_in}")
                raise UnisonError(f"rollout.quantization {fmt}: groups of {g} do not divide the {n_in} input "
                                  f"columns of '{t.name}': {fix}")
    return found


#: token k3 of each format against the fp32 learner, measured with `unison probe --quantization ...`
#: (docs/quantized-rollout.md, fp32 rows): the built-in tiny model (--n 8 --max-new-tokens 128) and
#: SmolLM2-135M (--n 4) — what the start-up warning cites; the warm-started tiny model of the
#: experiment (docs/experiments/quantized_rollout.md) is lower, 3.5e-5 / 7e-4 / 2–4e-2
MEASURED_K3 = {"fp8": "1.4e-2 on the built-in tiny model and 2.2e-2 on SmolLM2-135M",
               "int8": "9.2e-4 on the built-in tiny model and 4.5e-3 on SmolLM2-135M",
               "int4": "0.213 on the built-in tiny model and 0.757 on SmolLM2-135M",
               "mxfp8": "2.1e-2 on the built-in tiny model (not yet measured on SmolLM2-135M)",
               "mxfp4": "0.225 on the built-in tiny model (not yet measured on SmolLM2-135M)",
               "nvfp4": "0.159 on the built-in tiny model (not yet measured on SmolLM2-135M)",
               "w8a8_fp8": "2.7e-2 on the built-in tiny model (not yet measured on SmolLM2-135M)",
               "w8a8_int8": "2.3e-3 on the built-in tiny model (not yet measured on SmolLM2-135M)"}
#: what unison's own experiment found (docs/experiments/quantized_rollout.md)
MEASURED_EFFECT = {"int4": "; in unison's experiment uncorrected GRPO fell from 0.81 to 0.58 training accuracy at int4"}


def quantization_warning(fmt: str, policy: dict, quantization_aware: bool = False) -> str | None:
    """One start-up line when a quantized rollout runs without any correction (the algorithm is
    never changed silently); None when the learner is quantization-aware, or a correction or a
    self-correcting loss is in place."""
    if fmt == "none" or quantization_aware or policy.get("correction") != "none" or policy.get("loss") in SELF_CORRECTING:
        return None
    return (f"rollout.quantization={fmt} with policy.correction=none: {fmt} rollout weights put the "
            f"training–inference mismatch at token k3 {MEASURED_K3[fmt]} (unison probe, fp32; docs/quantized-rollout.md)"
            f"{MEASURED_EFFECT.get(fmt, '')}, "
            f"and peers report uncorrected GRPO degrading there (verl, FlashRL); consider train.quantization_aware=true "
            f"(the learner computes through the same quantizer: π = μ), or algo=gspo, grpo_icepop or grpo_token_tis")
