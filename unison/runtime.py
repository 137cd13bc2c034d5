"""What a process decides about the machine before it loads a model: its torch threads and its fp32 matmul library.

Every command that runs a model calls :func:`setup` once, after its inputs are checked (an error stays one line)
and before any model is loaded (models loaded afterwards follow the matmul choice): the model's sizes are read
once from its architecture (:func:`model_sizes`, no weights), the thread count is decided and given to torch
(unison/threads.py), then the matmul library, measured at that thread count where ``auto`` measures
(unison/gemm.py). The decisions and their reasons come back for the start-up line.

A model under :data:`unison.threads.SMALL_MODEL` parameters (the built-in tiny model's class) keeps torch's plain
paths everywhere (:func:`small_model`): BLAS, the unfused output layer, for-each AdamW — at its size the fused ones
gain nothing, and its documented runs keep their bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unison import gemm, threads
from unison.threads import SMALL_MODEL


@dataclass(frozen=True)
class ModelSizes:
    """What the decisions need to know about a model: its hidden size, MLP width and parameter count."""

    hidden: int
    intermediate: int
    params: int


def model_sizes(model_dir) -> ModelSizes:
    """The sizes of the model in ``model_dir``, read from its architecture (built on the meta device, no weights)."""
    from unison.models import model_shell

    shell = model_shell(Path(model_dir))
    cfg = shell.config
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    return ModelSizes(int(hidden), int(inter), sum(p.numel() for p in shell.parameters()))


def small_model(model) -> bool:
    """A loaded model under :data:`SMALL_MODEL` parameters."""
    return sum(p.numel() for p in model.parameters()) < SMALL_MODEL


@dataclass(frozen=True)
class Runtime:
    """This process's decisions (each prints as its start-up phrase)."""

    threads: threads.Threads
    gemm: gemm.Gemm


def setup(threads_setting, gemm_setting, model_dir, device: str = "cpu", world_size: int = 1, fp32: bool = True,
          log=None) -> Runtime:
    """Read the model's sizes, decide and apply the thread count, then the matmul library (``log`` gets a line
    each)."""
    sizes = model_sizes(model_dir)
    t = threads.setup(threads_setting, params=sizes.params, log=log)
    g = gemm.setup(gemm_setting, sizes.hidden, sizes.intermediate, sizes.params, device=device,
                   world_size=world_size, fp32=fp32, log=log)
    return Runtime(t, g)
