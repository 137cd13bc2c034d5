"""Which library multiplies fp32 matrices on the CPU: config ``gemm: auto | blas | onednn``.

torch sends an fp32 ``F.linear`` on the CPU to the BLAS it was built with (MKL on x86) and bf16 /
fp16 ones to oneDNN. Both are fast on the CPUs their makers tune for; elsewhere they are not. On
the 2-core AMD EPYC (AVX-512) this project measures on, MKL ran a 2048³ fp32 product at 164–189
GFLOP/s and oneDNN at 374–393, and the linears of SmolLM2-135M 1.3–2.7× faster under oneDNN
(``benchmarks/rollout_throughput.py`` reports both peaks). So:

* ``blas``: torch's default, nothing changed;
* ``onednn``: every fp32 ``nn.Linear`` of the models unison loads (:func:`unison.models.load_model`:
  the learner's, the native engine's, SFT's) and the engine's fused projections run through oneDNN's
  fp32 matmul (``torch.ops.mkldnn._linear_pointwise``, full fp32 — no bf16/tf32 shortcut), forward
  and backward (:class:`_Linear`: the input and weight gradients are oneDNN products of transposed
  views, no copies). Other dtypes, autocast regions, CUDA tensors and sharded (DTensor) weights keep
  torch's path;
* ``auto`` (default): ``blas`` for models under :data:`unison.threads.SMALL_MODEL` parameters (their
  matmuls are too small for the library to matter, and the built-in tiny model's runs keep their
  bits), off the CPU, in torchrun jobs, and when nothing computes in fp32; otherwise both are
  **measured** at start on the model's own two MLP shapes, interleaved, best of :data:`ROUNDS`, at the
  run's thread count, and oneDNN is taken when it is at least :data:`MARGIN` × faster (and agrees
  with BLAS to fp32 rounding). The choice and the measured ratio are printed at start.

The two libraries round differently (~1e-7 relative in fp32): a run's choice is written to its
``config.yaml`` so that ``--resume`` continues with the same one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unison.config.values import parse_gemm
from unison.errors import UnisonError
from unison.threads import SMALL_MODEL, size_text

#: oneDNN is taken by ``auto`` only this much faster than BLAS (below it, within a busy machine's noise)
MARGIN = 1.3
#: interleaved timing rounds per library (the best of each counts)
ROUNDS = 3
#: rows of the measured products (a micro-batch's worth of tokens; decode batches are smaller)
ROWS = 256

#: this process's choice (what :func:`setup` decided); models loaded afterwards follow it
_choice = "blas"


@dataclass(frozen=True)
class Gemm:
    """The fp32 matmul library of this process and why."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"fp32 matmuls {self.name} ({self.reason})"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def decide(setting, hidden: int, intermediate: int, params: int, device: str = "cpu", world_size: int = 1,
           fp32: bool = True) -> Gemm:
    """The library for ``setting`` and its reason (``auto`` measures); nothing is changed."""
    setting = parse_gemm(setting)
    if setting == "onednn":
        if device != "cpu" or world_size > 1:
            raise UnisonError(f"gemm onednn routes one process's CPU matmuls ({'device ' + device if device != 'cpu' else 'a torchrun job'} "
                              f"here): set gemm=auto or gemm=blas")
        if not onednn_available():
            raise UnisonError("gemm onednn: this torch build has no oneDNN (torch.backends.mkldnn): set gemm=blas")
        return Gemm("onednn", "gemm: onednn")
    if setting == "blas":
        return Gemm("blas", "gemm: blas")
    if device != "cpu":
        return Gemm("blas", f"auto: device {device}")
    if world_size > 1:
        return Gemm("blas", "auto: a torchrun job")
    if not fp32:
        return Gemm("blas", "auto: no fp32 matmuls in this run")
    if params < SMALL_MODEL:
        return Gemm("blas", f"auto: a {size_text(params)}-parameter model's matmuls are too small to measure")
    if not onednn_available():
        return Gemm("blas", "auto: no oneDNN in this torch")
    ratio, agree = measure(hidden, intermediate)
    if not agree:
        return Gemm("blas", "auto: oneDNN's fp32 products disagreed with BLAS's here")
    if ratio >= MARGIN:
        return Gemm("onednn", f"auto: {ratio:.1f}x BLAS on this CPU, measured")
    return Gemm("blas", f"auto: oneDNN {ratio:.2f}x BLAS on this CPU, measured (under {MARGIN}x)")


def measure(hidden: int, intermediate: int, rows: int = ROWS, rounds: int = ROUNDS) -> tuple[float, bool]:
    """BLAS time over oneDNN time for the model's two MLP products ([rows, hidden] → intermediate and
    back) at this process's thread count, and whether the two agree to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    x1, w1 = torch.randn(rows, hidden, generator=g), torch.randn(intermediate, hidden, generator=g)
    x2, w2 = torch.randn(rows, intermediate, generator=g), torch.randn(hidden, intermediate, generator=g)

    def blas():
        return F.linear(x1, w1), F.linear(x2, w2)

    def onednn():
        return _onednn(x1, w1, None), _onednn(x2, w2, None)

    agree = all(float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
                for a, b in zip(onednn(), blas()))  # also the warm-up of both
    best = {blas: float("inf"), onednn: float("inf")}
    for _ in range(rounds):
        for fn in best:
            t0 = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - t0)
    return best[blas] / max(best[onednn], 1e-9), agree


def setup(setting, hidden: int = 0, intermediate: int = 0, params: int = 0, device: str = "cpu", world_size: int = 1,
          fp32: bool = True, log=None) -> Gemm:
    """Decide (:func:`decide`, for a model of these sizes) and make it this process's choice: models loaded from now
    on follow it. ``log`` gets one line."""
    global _choice
    g = decide(setting, hidden, intermediate, params, device, world_size, fp32)
    _choice = g.name
    if log is not None:
        log(str(g))
    return g


def use(name: str) -> None:
    """Make ``name`` (``blas`` or ``onednn``, decided elsewhere: the async worker takes its run's) this
    process's choice."""
    global _choice
    if parse_gemm(name) == "auto":
        raise ValueError("gemm.use takes a decided choice, not auto")
    _choice = name


def current() -> str:
    return _choice


# ----------------------------------------------------------------------------- the oneDNN path
def _onednn(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x2 @ w.T (+ b)`` for 2-D ``x2`` by oneDNN, fp32 throughout; ``w`` may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _unrows(y: torch.Tensor, shape) -> torch.Tensor:
    """``y`` [rows, n] back to ``shape[:-1] + (n,)``; a 2-D result is returned as it is, not as a view of
    itself (autograd adds a gradient into a tensor in place only when nothing else holds its storage)."""
    return y if len(shape) == 2 else y.view(*shape[:-1], y.shape[-1])


class _Linear(torch.autograd.Function):
    """``F.linear`` with oneDNN products forward and backward: dx = dy·W, dW = dyᵀ·x, db = Σ dy."""

    @staticmethod
    def forward(ctx, x, w, b):
        x2 = _rows(x)
        ctx.save_for_backward(x2, w)
        ctx.shape, ctx.has_bias = x.shape, b is not None
        return _unrows(_onednn(x2, w, b), x.shape)

    @staticmethod
    def backward(ctx, gy):
        x2, w = ctx.saved_tensors
        g2 = _rows(gy)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _unrows(_onednn(g2, w.t(), None), ctx.shape)
        if ctx.needs_input_grad[1]:
            gw = _onednn(g2.t(), x2.t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def _routable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Plain fp32 CPU tensors outside autocast: what the oneDNN path computes exactly as torch would in fp32."""
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and type(w) in (torch.Tensor, torch.nn.Parameter) and type(x) in (torch.Tensor, torch.nn.Parameter)
            and w.dim() == 2 and x.dim() >= 1 and (b is None or (b.dtype == torch.float32 and b.dim() == 1))
            and not torch.is_autocast_enabled("cpu"))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` by this process's library."""
    if _choice != "onednn" or not _routable(x, w, b):
        return F.linear(x, w, b)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _Linear.apply(x, w, b)
    return _unrows(_onednn(_rows(x), w, b), x.shape)


def _module_forward(self, x):
    return linear(x, self.weight, self.bias)


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Route ``model``'s ``nn.Linear`` layers through :func:`linear` when this process chose oneDNN
    (their parameters, state dict and hooks untouched); with BLAS, nothing. Returns ``model``."""
    if _choice != "onednn":
        return model
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = _module_forward.__get__(m)
    return model
