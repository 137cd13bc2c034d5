"""Which library multiplies fp32 matrices on the CPU: config ``gemm: auto | blas | onednn | LEARNER/ENGINE``.

torch sends an fp32 ``F.linear`` on the CPU to the BLAS it was built with (MKL on x86) and bf16 /
fp16 ones to oneDNN. Both are fast on the CPUs their makers tune for; elsewhere they are not. On
the 2-core AMD EPYC (AVX-512) this project measures on, MKL ran a 2048³ fp32 product at 164–189
GFLOP/s and oneDNN at 374–393 on one host (at ≈ 200 both on another), and the linears of SmolLM2-135M
1.3–2.7× faster under oneDNN (``benchmarks/rollout_throughput.py`` reports both peaks). Two roles decide
apart, because their products differ in shape: the **learner** multiplies micro-batches of hundreds of
rows, the native **engine** decodes with one row per response (32 in a typical batch), where a library
that re-packs the weight matrix on every call spends much of the product doing it. So:

* ``blas``: torch's default, nothing changed;
* ``onednn``: every fp32 ``nn.Linear`` of the models unison loads (:func:`unison.models.load_model`:
  the learner's, SFT's) runs through oneDNN's fp32 matmul (``torch.ops.mkldnn._linear_pointwise``, full
  fp32 — no bf16/tf32 shortcut), forward and backward (:class:`_Linear`: the input and weight gradients
  are oneDNN products of transposed views, no copies); the native engine's fast path multiplies by
  weights **pre-packed** into oneDNN's blocked layout once per weight sync (:func:`pack`; one more copy
  of its matmul weights; bitwise the products of the unpacked weights, tested). Other dtypes, autocast
  regions, CUDA tensors and sharded (DTensor) weights keep torch's path;
* ``LEARNER/ENGINE`` (e.g. ``blas/onednn``): each role its own library (what ``auto`` writes when they differ);
* ``auto`` (default): ``blas`` for models under :data:`unison.threads.SMALL_MODEL` parameters (their
  matmuls are too small for the library to matter, and the built-in tiny model's runs keep their
  bits), off the CPU, in torchrun jobs, and for a role that computes in bf16/fp16; otherwise both are
  **measured** at start on the model's own two MLP shapes, interleaved, best of :data:`ROUNDS`, at the
  run's thread count — at :data:`ROWS` rows for the learner, at the rollout batch's rows with the weights
  pre-packed for the engine — and oneDNN is taken for a role when it is at least :data:`MARGIN` × faster
  there (and agrees with BLAS to fp32 rounding). The measurement is kept per CPU, torch version, thread count and
  shape (``$UNISON_HOME/gemm.json``, as ``compile: auto`` keeps its own): a machine decides once, and its runs do
  not flip between libraries on a noisy timing. The choices and the measured ratios are printed at start.

**bf16 / fp16 products on a CPU without native kernels for them** (AVX2-only; fp16 on AVX-512 without
AVX512-FP16; or oneDNN switched off, :func:`half_kernels`): torch's own path there is a generic loop, 10–15× slower
than the fp32 product of the same shape at 512 rows, and 87% of a bf16 demo run's time (profiled with oneDNN off
and torch's AVX2 kernels on the Xeon here). Every such product unison makes (:func:`torch_linear`: the models'
``nn.Linear`` layers under :func:`apply`, the output layer, the native engine's decode, the quantization-aware
learner's) is instead the **fp32
product of the rounded bf16 / fp16 operands, rounded once to bf16 / fp16** — forward and backward, autocast's casts
included (:class:`_HalfLinear`). A product of two bf16 (or fp16) numbers is exact in fp32, so this is the arithmetic
torch's loop and a GPU's tensor cores do (fp32 accumulation, one rounding), in another summation order. Both
engines take it on such a CPU, so it adds no mismatch between them; exact mode keeps its own products.

The two libraries round differently (~1e-7 relative in fp32): a run's choice is written to its
``config.yaml`` so that ``--resume`` continues with the same one.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from unison.config.values import parse_gemm
from unison.data_io import add_to_json_cache, read_json_cache
from unison.errors import UnisonError
from unison.threads import SMALL_MODEL, cpu_name, size_text

#: oneDNN is taken by ``auto`` only this much faster than BLAS (a tie keeps torch's default). It was 1.3, which on the
#: Intel Xeon here left the engine's 1.18–1.20× on the table 9 decisions in 10 (benchmarks/gemm_auto.py)
MARGIN = 1.1
#: interleaved timing rounds per library (the best of each counts; the order alternates, ABBA)
ROUNDS = 5
#: rows of the learner's measured products (a micro-batch's worth of tokens)
ROWS = 256
#: rows of the engine's measured products when the run does not say (one decode step of 32 responses)
DECODE_ROWS = 32

#: this process's choices (what :func:`setup` decided): the learner's (models loaded afterwards follow it) and
#: the native engine's (its fast path's products, read when an engine is built)
_choice = "blas"
_engine = "blas"


@dataclass(frozen=True)
class Gemm:
    """The fp32 matmul library of each role of this process, and why."""

    name: str
    reason: str
    #: the native engine's library ("" = the learner's) and why
    engine: str = ""
    engine_reason: str = ""

    def __post_init__(self):
        if not self.engine:
            object.__setattr__(self, "engine", self.name)
            object.__setattr__(self, "engine_reason", self.reason)

    @property
    def value(self) -> str:
        """The setting that reproduces these choices (``config.yaml``): ``blas``, ``onednn`` or ``LEARNER/ENGINE``."""
        return self.name if self.engine == self.name else f"{self.name}/{self.engine}"

    def __str__(self) -> str:
        if self.engine == self.name and self.engine_reason == self.reason:
            return f"fp32 matmuls {self.name} ({self.reason})"
        packed = ", pre-packed" if self.engine == "onednn" else ""
        return (f"fp32 matmuls: learner {self.name} ({self.reason}), engine {self.engine}{packed} "
                f"({self.engine_reason})")


def split(value) -> tuple[str, str]:
    """``(learner, engine)`` of a setting: ``auto``, ``blas``, ``onednn`` name both roles, ``X/Y`` each its own."""
    text = parse_gemm(value)
    learner, _, engine = text.partition("/")
    return learner, engine or learner


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def decide(setting, hidden: int, intermediate: int, params: int, device: str = "cpu", world_size: int = 1,
           fp32: bool = True, engine_fp32: bool | None = None, decode_rows: int = DECODE_ROWS, vocab: int = 0,
           cache: Path | None = None) -> Gemm:
    """The library of each role for ``setting`` and its reason (``auto`` measures, or reads an earlier measurement
    of this machine from ``cache``); nothing is changed. ``fp32``: the learner computes in fp32; ``engine_fp32``: the
    engine does (default: as the learner)."""
    learner, engine = split(setting)
    engine_fp32 = fp32 if engine_fp32 is None else engine_fp32

    def measured(role, fn, **shape):
        key = json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "role": role, "hidden": hidden, "intermediate": intermediate, **shape}, sort_keys=True)
        stored = read_json_cache(cache).get(key) if cache is not None else None
        if isinstance(stored, list) and len(stored) == 2:
            return float(stored[0]), bool(stored[1]), f"measured earlier ({cache})"
        ratio, agree = fn(hidden, intermediate)
        if cache is not None:
            add_to_json_cache(cache, key, [ratio, agree])
        return ratio, agree, "measured"

    a = _decide_role(learner, hidden, intermediate, params, device, world_size, fp32,
                     lambda: measured("learner", measure, rows=ROWS), None)
    b = _decide_role(engine, hidden, intermediate, params, device, world_size, engine_fp32,
                     lambda: measured("engine", lambda h, i: measure_packed(h, i, rows=decode_rows, vocab=vocab),
                                      rows=decode_rows, vocab=vocab), decode_rows)
    return Gemm(a[0], a[1], b[0], b[1])


def _decide_role(setting: str, hidden, intermediate, params, device, world_size, fp32, measure_fn,
                 decode_rows: int | None) -> tuple[str, str]:
    """One role's library: the learner's (``decode_rows`` None) or the native engine's (a decode step's rows)."""
    if setting == "onednn":
        if device != "cpu" or world_size > 1:
            raise UnisonError(f"gemm onednn routes one process's CPU matmuls ({'device ' + device if device != 'cpu' else 'a torchrun job'} "
                              f"here): set gemm=auto or gemm=blas")
        if not onednn_available():
            raise UnisonError("gemm onednn: this torch build has no oneDNN (torch.backends.mkldnn): set gemm=blas")
        return "onednn", "gemm: onednn"
    if setting == "blas":
        return "blas", "gemm: blas"
    if device != "cpu":
        return "blas", f"auto: device {device}"
    if world_size > 1:
        return "blas", "auto: a torchrun job"
    if not fp32:
        return "blas", "auto: no fp32 matmuls in this run" if decode_rows is None else "auto: no fp32 decode here"
    if params < SMALL_MODEL:
        return "blas", f"auto: a {size_text(params)}-parameter model's matmuls are too small to measure"
    if not onednn_available():
        return "blas", "auto: no oneDNN in this torch"
    ratio, agree, when = measure_fn()
    at = f" at {decode_rows} rows" if decode_rows is not None else ""
    if not agree:
        return "blas", "auto: oneDNN's fp32 products disagreed with BLAS's here"
    if ratio >= MARGIN:
        return "onednn", f"auto: {ratio:.1f}x BLAS{at} on this CPU, {when}"
    shown = int(ratio * 100) / 100  # rounded down: a ratio just under the margin never reads as the margin itself
    return "blas", f"auto: oneDNN {shown:.2f}x BLAS{at} on this CPU, {when} (under {MARGIN}x)"


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

    return _race(blas, onednn, rounds)


def measure_packed(hidden: int, intermediate: int, rows: int = DECODE_ROWS, rounds: int = ROUNDS,
                   vocab: int = 0) -> tuple[float, bool]:
    """:func:`measure` for the engine: BLAS against oneDNN with the weights pre-packed (:func:`pack`), at a decode
    step's ``rows``, on the products of one decode step in their proportions: the fused gate/up and down of one
    layer and, with ``vocab``, the output layer's share of a layer (its product over the layers it follows is
    a quarter to a half of a small model's step)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(2 * intermediate, hidden), (hidden, intermediate)]
    if vocab:
        shapes.append((vocab, hidden))
    xs = [torch.randn(rows, k, generator=g) for _, k in shapes]
    ws = [torch.randn(n, k, generator=g) for n, k in shapes]
    ps = [pack(w, rows) for w in ws]

    def blas():
        return [F.linear(x, w) for x, w in zip(xs, ws)]

    def onednn():
        return [_onednn(x, p, None) for x, p in zip(xs, ps)]

    return _race(blas, onednn, rounds * 4)  # products of a few hundred microseconds: more rounds


def _race(blas, onednn, rounds: int) -> tuple[float, bool]:
    """BLAS's best time over oneDNN's, interleaved for ``rounds``, and whether their products agree to fp32
    rounding (the comparison is also both sides' warm-up)."""
    agree = all(float((a - b).abs().max()) <= 1e-4 * float(b.abs().max()) for a, b in zip(onednn(), blas()))
    t_blas, t_onednn = alternated(blas, onednn, rounds)
    return t_blas / max(t_onednn, 1e-9), agree


def alternated(a, b, rounds: int) -> tuple[float, float]:
    """The best seconds of each of two functions timed in alternated (ABBA) rounds, so that a slow moment of the
    machine falls on both sides alike."""
    best = {a: float("inf"), b: float("inf")}
    for r in range(rounds):
        for fn in (a, b) if r % 2 == 0 else (b, a):
            t0 = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - t0)
    return best[a], best[b]


def setup(setting, hidden: int = 0, intermediate: int = 0, params: int = 0, device: str = "cpu", world_size: int = 1,
          fp32: bool = True, engine_fp32: bool | None = None, decode_rows: int = DECODE_ROWS, vocab: int = 0,
          cache: Path | None = None, log=None) -> Gemm:
    """Decide (:func:`decide`, for a model of these sizes) and make it this process's choice: models loaded from now
    on follow it. ``log`` gets one line."""
    global _choice, _engine
    g = decide(setting, hidden, intermediate, params, device, world_size, fp32, engine_fp32, decode_rows, vocab, cache)
    _choice, _engine = g.name, g.engine
    if log is not None:
        log(str(g))
    return g


def use(value: str) -> None:
    """Make ``value`` (``blas``, ``onednn`` or ``LEARNER/ENGINE``, decided elsewhere: the async worker takes its
    run's) this process's choice."""
    global _choice, _engine
    learner, engine = split(value)
    if "auto" in (learner, engine):
        raise ValueError("gemm.use takes a decided choice, not auto")
    _choice, _engine = learner, engine


def current() -> str:
    """This process's choices as a setting (:attr:`Gemm.value`)."""
    return _choice if _engine == _choice else f"{_choice}/{_engine}"


def engine_choice() -> str:
    """The native engine's library in this process."""
    return _engine


def packs_half(dtype: torch.dtype, params: int) -> bool:
    """Whether the native engine pre-packs its bf16 / fp16 matrices (:func:`pack`). torch already sends those
    products to oneDNN, which then re-packs the weight on every call; packed once per sync they give the same bits
    (tested) and were 1.4–1.9× faster in bf16 (1.1–1.25× in fp16) at SmolLM2's shapes and 1–32 rows on the Intel Xeon
    here (AMX). Only where oneDNN has native kernels for the dtype (:func:`half_kernels`; untried elsewhere), and not
    for models under :data:`SMALL_MODEL` parameters (the tiny model's 64-wide product at one row ran 0.17×)."""
    return params >= SMALL_MODEL and half_kernels(dtype)


def half_kernels(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bf16 / fp16) natively in oneDNN: AVX512-BF16 (or AMX) for bf16,
    AVX512-FP16 / AMX-FP16 for fp16 — not an AVX2-only or plain AVX-512 CPU, where oneDNN would emulate them
    (nor with oneDNN switched off, ``torch.backends.mkldnn.enabled = False``: torch then uses its generic loop)."""
    if not onednn_available() or not torch.backends.mkldnn.enabled:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.cpu._is_avx512_bf16_supported() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float16 and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` [out, in] (fp32, or bf16 / fp16: :func:`packs_half`; CPU) in oneDNN's blocked layout for products of
    about ``rows`` rows: :func:`packed_linear` multiplies by it without re-packing it each call. Its products are
    bitwise those of the unpacked weight through oneDNN (torch's own path for bf16 and fp16)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), rows)


# ``unison::onednn_linear``: :func:`_onednn` as an operator torch.compile sees as one opaque call (Inductor cannot
# lower oneDNN's own), defined with the plain dispatcher rather than ``torch.library.custom_op`` (whose Python wrapper
# cost ~30 µs a call: 120 calls per decode step)
_LIB = torch.library.Library("unison", "DEF")
_LIB.define("onednn_linear(Tensor x, Tensor w, Tensor? b) -> Tensor")
_LIB.impl("onednn_linear", lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""),
          "CompositeExplicitAutograd")


@torch.library.register_fake("unison::onednn_linear")
def _(x, w, b):
    return x.new_empty((x.shape[0], w.shape[0]))


_onednn_op = torch.ops.unison.onednn_linear


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ b)`` for a weight from :func:`pack` (or a plain fp32 one), any leading dims of ``x``."""
    return _unrows(_onednn(_rows(x), w, b), x.shape)


# ----------------------------------------------------------------------------- the oneDNN path
def _onednn(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x2 @ w.T (+ b)`` for 2-D ``x2`` by oneDNN, in ``x2``'s dtype; ``w`` may be a transposed view or packed
    (:func:`pack`). Under torch.compile through :func:`_onednn_op` (Inductor cannot lower oneDNN's own operator);
    in eager directly (no Python dispatch per call)."""
    if torch.compiler.is_compiling():
        return _onednn_op(x2, w, b)
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


@functools.cache
def _half_route(dtype: torch.dtype, mkldnn_enabled: bool) -> bool:
    """:func:`half_kernels`' answer, once per dtype and oneDNN switch (``mkldnn_enabled`` is the cache's key)."""
    return not half_kernels(dtype)


def half_route(dtype: torch.dtype) -> bool:
    """Whether this process computes ``dtype`` (bf16 / fp16) products on the CPU as fp32 products of the rounded
    operands (:class:`_HalfLinear`): where the CPU has no native kernels for it (:func:`half_kernels`)."""
    return dtype in (torch.bfloat16, torch.float16) and _half_route(dtype, torch.backends.mkldnn.enabled)


def engine_copies(dtype: torch.dtype, device: str, exact: bool) -> bool:
    """Whether the native engine multiplies by fp32 copies of its ``dtype`` weights (unison/rollout/decode.py,
    ``FastWeights.copies``): a half dtype on a CPU without kernels for it (:func:`half_route`), outside exact mode.
    Its products are then fp32 ones, and its library is decided as an fp32 engine's (unison/machine.py)."""
    return device == "cpu" and not exact and half_route(dtype)


def _half_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype | None:
    """The half dtype a CPU product of ``x`` and ``w`` computes in, where :func:`half_route` takes it: theirs, or
    autocast's for fp32 operands; None otherwise."""
    if x.device.type != "cpu" or type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dim() != 2:
        return None
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if torch.is_autocast_enabled("cpu") and x.dtype in floats and w.dtype in floats:  # autocast casts both
        dtype = torch.get_autocast_dtype("cpu")
    elif x.dtype == w.dtype:
        dtype = x.dtype
    else:
        return None
    return dtype if half_route(dtype) else None


def _half_product(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x2 @ w.T (+ b)`` of operands already in ``dtype``: computed in fp32, rounded once to ``dtype``."""
    return F.linear(x2.float(), w.float(), None if b is None else b.float()).to(dtype)


def _half_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype):
    """(``x @ w.T (+ b)`` in ``dtype`` by :func:`_half_product`, any leading dims of ``x``; ``x``'s rows and ``w``
    in ``dtype``, which the backward keeps), outside autocast."""
    x2, wh = _rows(x).to(dtype), w.to(dtype)
    with torch.autocast("cpu", enabled=False):
        y = _half_product(x2, wh, None if b is None else b.to(dtype), dtype)
    return _unrows(y, x.shape), x2, wh


class _HalfLinear(torch.autograd.Function):
    """``F.linear`` in bf16 / fp16 as fp32 products of the rounded operands, each rounded once to the dtype:
    y = ⌊x̃ w̃ᵀ + b̃⌉, dx = ⌊dy w̃⌉, dW = ⌊dyᵀ x̃⌉, db = ⌊Σ dy⌉ (x̃: x in the dtype; each gradient then in its
    operand's own dtype, as autocast's casts give it)."""

    @staticmethod
    def forward(ctx, x, w, b, dtype):
        y, x2, wh = _half_forward(x, w, b, dtype)
        ctx.save_for_backward(x2, wh)
        ctx.meta = (x.shape, x.dtype, w.dtype, None if b is None else b.dtype, dtype)
        return y

    @staticmethod
    def backward(ctx, gy):
        x2, wh = ctx.saved_tensors
        shape, x_dtype, w_dtype, b_dtype, dtype = ctx.meta
        g = _rows(gy).to(dtype).float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _unrows((g @ wh.float()).to(dtype), shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x2.float()).to(dtype).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(dtype).to(b_dtype)
        return gx, gw, gb, None


def torch_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except a bf16 / fp16 product on a CPU without native kernels for it (:func:`half_route`),
    which is the fp32 product of the rounded operands rounded once (:class:`_HalfLinear`)."""
    dtype = _half_dtype(x, w)
    if dtype is None:
        return F.linear(x, w, b)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _HalfLinear.apply(x, w, b, dtype)
    return _half_forward(x, w, b, dtype)[0]


def rounded_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ b)`` for bf16 / fp16 ``x`` by fp32 copies ``w`` / ``b`` of half weights (the native engine's, on a
    CPU that takes :func:`half_route`): the fp32 product rounded once to ``x``'s dtype — bitwise
    :func:`torch_linear` on the half weights, without casting the weight on every call."""
    return F.linear(x.float(), w, b).to(x.dtype)


def packed_rounded(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rounded_product` by a :func:`pack`-ed fp32 copy: oneDNN's fp32 product, rounded once to ``x``'s dtype
    (the half route's arithmetic, summed in oneDNN's order as an fp32 engine on ``gemm: onednn`` sums)."""
    return _unrows(_onednn(_rows(x).float(), w, b), x.shape).to(x.dtype)


def decode_product(packed: bool, copies: bool, dtype: torch.dtype):
    """The native engine's product function: by packed weights (:func:`pack`) or plain ones, and by fp32 copies of
    half weights (``copies``: :func:`half_route`) or by the weights in the engine's dtype."""
    if copies:
        return packed_rounded if packed else rounded_product
    return packed_linear if packed else plain_product(dtype)


def plain_product(dtype: torch.dtype):
    """The product function for unpacked weights in ``dtype``, chosen once (the native engine's decode calls it per
    product): :func:`torch_linear` where ``dtype`` takes the half route, else ``F.linear`` itself."""
    return torch_linear if half_route(dtype) else F.linear


def _routable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Plain fp32 CPU tensors outside autocast: what the oneDNN path computes exactly as torch would in fp32."""
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and type(w) in (torch.Tensor, torch.nn.Parameter) and type(x) in (torch.Tensor, torch.nn.Parameter)
            and w.dim() == 2 and x.dim() >= 1 and (b is None or (b.dtype == torch.float32 and b.dim() == 1))
            and not torch.is_autocast_enabled("cpu"))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` by this process's library."""
    if _choice != "onednn" or not _routable(x, w, b):
        return torch_linear(x, w, b)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _Linear.apply(x, w, b)
    return _unrows(_onednn(_rows(x), w, b), x.shape)


def _module_forward(self, x):
    return linear(x, self.weight, self.bias)


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Route ``model``'s ``nn.Linear`` layers through :func:`linear` when this process chose oneDNN, or where the
    CPU lacks native bf16 / fp16 kernels (:func:`half_route`) — their parameters, state dict and hooks untouched;
    otherwise nothing. Returns ``model``."""
    if _choice != "onednn" and not (half_route(torch.bfloat16) or half_route(torch.float16)):
        return model
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = _module_forward.__get__(m)
    return model
