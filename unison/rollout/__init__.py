"""Rollout engines (the sampling distribution μ).

Every engine returns :class:`unison.batch.Completion` objects and takes
weights from the learner with ``load_weights``. Engines never call the
learner's scoring code: the gap between the two is what unison measures.
"""

from __future__ import annotations

import torch

from unison.config.values import ENGINES, parse_engine
from unison.errors import UnisonError
from unison.gemm import DECODE_ROWS
from unison.models import model_config
from unison.rollout.base import RolloutEngine, SamplingParams
from unison.sides import Side



def make_engine(name: str, model_dir, side: Side | torch.dtype, device: str = "cpu", **options) -> RolloutEngine:
    """Build a rollout engine by name, computing as ``side`` says (a :class:`~unison.sides.Side`, or a bare dtype).
    ``options`` (the ``vllm`` config section) go to the vLLM engines, which take the side's dtype; the native
    engine takes ``prompt_width`` (exact mode's layout) and ``decode_rows`` (responses per decode step)."""
    side = Side.of(side)
    if name == "native":
        from unison.rollout.native import NativeEngine

        return NativeEngine(model_dir, side, device=device, prompt_width=options.get("prompt_width"),
                            decode_rows=options.get("decode_rows", DECODE_ROWS))
    if name == "vllm":
        from unison.rollout.vllm_engine import VLLMEngine
        from unison.rollout.vllm_server import VLLMServerEngine

        options = {k: v for k, v in options.items() if k not in ("prompt_width", "decode_rows")}
        options["quantization"] = side.quantization
        if options.get("mode") == "server":
            return VLLMServerEngine(model_dir, dtype=side.dtype, device=device, **options)
        return VLLMEngine(model_dir, dtype=side.dtype, device=device, **options)
    raise UnisonError(f"unknown engine '{name}': choose one of {', '.join(ENGINES)}")


def check_engine_available(name: str, mode: str = "colocate") -> None:
    """Raise the install line now if an engine's package is missing (start-up, never mid-run).
    A vLLM server is reached over HTTP: it needs no local vLLM."""
    if name == "vllm" and mode != "server":
        from unison.rollout.vllm_engine import check_vllm

        check_vllm()


def preflight_engine(name: str, model_dir, total_len: int) -> None:
    """Check from the model's config alone that ``name`` can serve requests of ``total_len``
    tokens (prompt + response): start-up errors before anything is loaded or written."""
    if name == "native":
        from unison.rollout.native import check_request

        check_request(model_config(model_dir), total_len, 0)


def generate(engine, prompts, params: SamplingParams) -> list:
    """``engine.generate(prompts, params)`` for token-id prompts; a batch of multi-turn episodes
    (:class:`unison.tasks.env.Episodes`, anything with ``run``) drives the engine turn by turn instead."""
    run = getattr(prompts, "run", None)
    return run(engine, params) if run is not None else engine.generate(prompts, params)


__all__ = ["RolloutEngine", "SamplingParams", "generate", "make_engine", "parse_engine", "preflight_engine", "ENGINES"]
