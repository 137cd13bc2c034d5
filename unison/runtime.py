"""What a process decides about the machine before it loads a model: its torch threads, its fp32 matmul library
and how its memory allocator treats freed buffers.

Every command that runs a model calls :func:`setup` once, after its inputs are checked (an error stays one line)
and before any model is loaded (models loaded afterwards follow the matmul choice): the model's sizes are read
once from its architecture (:func:`model_sizes`, no weights), the thread count is decided and given to torch
(unison/threads.py), then the matmul library, measured at that thread count where ``auto`` measures
(unison/gemm.py). The decisions and their reasons come back for the start-up line.

The allocator (:func:`keep_freed_memory`): glibc hands a freed buffer above its mmap threshold back to the system
and maps a new one at the next request, so every large temporary — a decode step's [rows × vocabulary] sampling
buffers, the learner's log-prob chunks — is page-faulted in afresh each time. unison asks glibc to keep such buffers
for reuse. Measured on SmolLM2-135M (AMD EPYC, 2 threads, fp32): the native engine's decode 1.3× faster (the
sampler's passes 8 → 4 ms a step), an update 1.07×, the same peak memory. A user who sets glibc's own
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` keeps them; elsewhere than glibc nothing changes.

A model under :data:`unison.threads.SMALL_MODEL` parameters (the built-in tiny model's class) keeps torch's plain
paths everywhere (:func:`small_model`): BLAS, the unfused output layer, for-each AdamW — at its size the fused ones
gain nothing, and its documented runs keep their bits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from unison import gemm, threads
from unison.models import model_shell, unison_home
from unison.threads import SMALL_MODEL, cpu_name  # noqa: F401 - cpu_name: re-exported


@dataclass(frozen=True)
class ModelSizes:
    """What the decisions need to know about a model: its hidden size, MLP width and parameter count."""

    hidden: int
    intermediate: int
    params: int
    vocab: int = 0


def model_sizes(model_dir) -> ModelSizes:
    """The sizes of the model in ``model_dir``, read from its architecture (built on the meta device, no weights)."""
    shell = model_shell(Path(model_dir))
    cfg = shell.config
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    return ModelSizes(int(hidden), int(inter), sum(p.numel() for p in shell.parameters()),
                      int(getattr(cfg, "vocab_size", 0) or 0))


def small_model(model) -> bool:
    """A loaded model under :data:`SMALL_MODEL` parameters."""
    return sum(p.numel() for p in model.parameters()) < SMALL_MODEL


@dataclass(frozen=True)
class Runtime:
    """This process's decisions (each prints as its start-up phrase)."""

    threads: threads.Threads
    gemm: gemm.Gemm
    sizes: ModelSizes


#: glibc's mallopt parameters and the values unison sets: buffers up to 1 GiB come from the heap (not fresh
#: mappings), and freed memory at the top of the heap is kept up to 2 GiB rather than returned at once
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 1 << 30, 1 << 31
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Ask glibc to keep large freed buffers for reuse (the module docstring); once per process. True when it does
    (here or by the user's own glibc settings), False where it cannot (not glibc)."""
    global _kept
    if _kept is not None:
        return _kept
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        _kept = True  # the user's own glibc settings, read when the process started
        return _kept
    _kept = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                              TRIM_THRESHOLD))
        except (OSError, AttributeError):  # musl and others: no glibc mallopt
            _kept = False
    return _kept


def setup(threads_setting, gemm_setting, model_dir, device: str = "cpu", world_size: int = 1, fp32: bool = True,
          engine_fp32: bool | None = None, decode_rows: int = gemm.DECODE_ROWS, log=None) -> Runtime:
    """Read the model's sizes, decide and apply the thread count, then the matmul library of each role (``fp32``:
    the learner computes in fp32; ``engine_fp32``: the native engine does, default as the learner; ``decode_rows``:
    the responses one decode step carries). ``log`` gets a line each."""
    keep_freed_memory()
    sizes = model_sizes(model_dir)
    t = threads.setup(threads_setting, params=sizes.params, log=log)
    g = gemm.setup(gemm_setting, sizes.hidden, sizes.intermediate, sizes.params, device=device,
                   world_size=world_size, fp32=fp32, engine_fp32=engine_fp32, decode_rows=decode_rows,
                   vocab=sizes.vocab, cache=unison_home() / "gemm.json", log=log)
    return Runtime(t, g, sizes)


def die_with_parent(parent: int) -> None:  # pragma: no cover - subprocess
    """In a child process: the kernel SIGKILLs it when the thread that started it exits (Linux
    ``PR_SET_PDEATHSIG``), so a parent killed by a signal it cannot handle leaves no worker behind; it exits at
    once if ``parent`` is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(0)
