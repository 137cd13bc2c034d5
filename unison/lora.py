"""LoRA adapters through PEFT: inject, export merged weights, save and load adapters.

PEFT injects its ``lora.Linear`` layers into the Hugging Face model in place; unison
keeps using that model object (its forward is unchanged), trains only the adapter
parameters (``lora_A``/``lora_B``, fp32 masters), and gives rollout engines the
merged weights ``W + (α/r)·B·A`` under the base model's own parameter names, so
every engine (native, vLLM in-process or server) takes them as a full-weight sync.
Checkpoints hold the adapters in PEFT's own format::

    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "checkpoints/step_N/model")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from unison.errors import UnisonError

ADAPTER = "default"


def apply(model: torch.nn.Module, cfg, base_dir: Path):
    """Inject LoRA into ``model`` (in place); the ``PeftModel`` wrapper (for saving)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise UnisonError("lora.rank > 0 needs PEFT: pip install 'unison[lora]' (peft)") from e
    targets = cfg.target_modules
    lcfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      task_type="CAUSAL_LM", base_model_name_or_path=str(base_dir))
    try:
        peft_model = get_peft_model(model, lcfg)
    except ValueError as e:  # NoMatchingPeftModuleError, or a module LoRA cannot adapt
        raise UnisonError(f"lora.target_modules {targets!r}: {str(e).splitlines()[0][:160]}: name Linear "
                          f"modules of the model (e.g. q_proj, v_proj) or use all-linear") from e
    if isinstance(targets, list):  # PEFT accepts a list where only some names match: we do not
        hit = set(peft_model.targeted_module_names)
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in hit)]
        if missing:
            raise UnisonError(f"lora.target_modules: no module named {missing[0]!r} in the model: name Linear "
                              f"modules it has (e.g. q_proj, v_proj) or use all-linear")
    return peft_model


def _lora_layers(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def _exported(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.nn.Module | None]]:
    """``(base name, tensor, LoRA layer or None)`` in export order: an adapted layer's weight comes once,
    under the base name, with its layer (to merge); every other tensor as it is."""
    layers = dict(_lora_layers(model))
    done = set()
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        layer_name = owner.removesuffix(".base_layer").rsplit(".lora_", 1)[0]
        if layer_name in layers:
            if layer_name in done:
                continue
            done.add(layer_name)
            m = layers[layer_name]
            yield f"{layer_name}.weight", m.base_layer.weight, m
            if m.base_layer.bias is not None:
                yield f"{layer_name}.bias", m.base_layer.bias, None
        else:
            yield name, p, None


def base_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """An adapted layer's base weight (and bias) under the base model's names: where a merged tensor of
    :func:`merged_weights` goes when the learner scores with the adapters off."""
    out = {}
    for name, _t, m in _exported(model):
        if m is not None:
            out[name] = m.base_layer.weight
            if m.base_layer.bias is not None:
                out[name.removesuffix(".weight") + ".bias"] = m.base_layer.bias
    return out


def delta(layer, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """(α/r)·B·A of an adapted layer in its base weight's layout, computed in fp32 whatever autocast is on:
    [out, in] for ``nn.Linear``, transposed to [in, out] for GPT-2's ``Conv1D`` (PEFT's ``fan_in_fan_out``).
    ``a``/``b``: the adapter matrices when given (materialised shards), else the layer's own (with gradient).
    The one merge rule: the engine's weights (:func:`merged_weights`) and the quantization-aware learner's
    (unison/quant.py) both come from here."""
    a = layer.lora_A[ADAPTER].weight if a is None else a
    b = layer.lora_B[ADAPTER].weight if b is None else b
    with torch.autocast(a.device.type, enabled=False):
        d = b.float() @ a.float()
        if getattr(layer, "fan_in_fan_out", False):
            d = d.t()
        return d * layer.scaling[ADAPTER]


def merged_weights(model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(base name, merged tensor)`` for every parameter, the model itself unchanged.
    ``full`` materialises a (possibly sharded) parameter; every rank must iterate in step."""
    for name, t, m in _exported(model):
        if m is None:
            yield name, full(t.detach())
            continue
        w = full(t.detach()).clone()
        w += delta(m, full(m.lora_A[ADAPTER].weight.detach()), full(m.lora_B[ADAPTER].weight.detach()))
        yield name, w


def merged_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(base name, full shape)`` of what :func:`merged_weights` yields, in its order, nothing
    materialised (a sharded parameter's shape is its global one)."""
    return [(name, tuple(t.shape)) for name, t, _ in _exported(model)]


def adapter_state(full_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a full (HF-named) state dict under PEFT's file names."""
    return {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v for k, v in full_sd.items() if ".lora_" in k}


def save(peft_model, full_sd: dict[str, torch.Tensor], out: Path) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's format) into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter_state(full_sd).items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    peft_model.peft_config[ADAPTER].save_pretrained(str(out))


def load(path: Path) -> dict[str, torch.Tensor]:
    """Adapter tensors saved by :func:`save`, under the learner's parameter names."""
    from safetensors.torch import load_file

    sd = load_file(str(path / "adapter_model.safetensors"))
    out = {}
    for k, v in sd.items():
        name = k.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[name] = v
    return out


def dropout_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The adapters' dropout layers (trained with dropout, scored without)."""
    return [d for _, m in _lora_layers(model) for d in m.lora_dropout.values()]
