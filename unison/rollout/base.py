"""The rollout-engine interface, sampling parameters and the sampling rule engines share.

Every engine implements :class:`RolloutEngine`; the RL loop sees nothing else.

Sampling is **batch-composition invariant**: the random number behind the
token of response row ``b`` at step ``t`` is a hash of (row seed, t), and the
row seed is a hash of (the prompt's seed, the sample's index). A prompt's
samples therefore do not depend on which other prompts share the batch, how
many rows are still decoding, or which rank of a ``torchrun`` job generates
them: N ranks that each generate their share of the prompt groups produce
exactly what one process produces for all of them (given equal logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from collections.abc import Callable, Iterable

import torch

from unison.errors import UnisonError


@runtime_checkable
class RolloutEngine(Protocol):
    """What the loop needs from a rollout engine (μ).

    ``generate`` returns prompt-major :class:`~unison.batch.Completion` objects with log μ of
    every sampled token. ``sync_weights(update)`` takes the policy's weights as named tensors
    (:class:`WeightUpdate`, pushed by the rollout source; an engine never sees the learner) —
    a collective stream when the learner is sharded: every rank calls it. The tensors come in
    the engine's ``weight_dtype`` (cast on the learner's side; ``None``: the fp32 masters as
    held, e.g. for an engine that quantizes them itself). ``sleep``/``wake`` free and restore the engine's GPU memory
    around the update (no-ops where meaningless). ``dp_rank``/``dp_size``: this process's
    place among the engine replicas that split a step's prompt groups (the ranks of one
    tensor-parallel vLLM engine share a replica and generate the same groups).
    """

    name: str
    dtype: torch.dtype
    pad_id: int
    eos_ids: list[int]
    dp_rank: int
    dp_size: int
    weight_dtype: torch.dtype | None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list: ...

    def sync_weights(self, update: WeightUpdate) -> dict[str, float]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class WeightUpdate:
    """What a weight sync hands an engine (:meth:`Weights.update_for`).

    ``tensors``: ``(HF name, full tensor)`` in the engine's ``weight_dtype``, streamed (a collective when the
    learner is sharded: every rank consumes it to the end). ``shapes()``: what the stream yields, in its order,
    without materialising it (a weight transfer announces it first; called only by an engine that needs it). ``probe_logprobs``: the policy's log-probs
    (temperature 1) of the engine's ``probe_ids``, for an engine that checks its copy against them (a server).
    """

    tensors: Iterable[tuple[str, torch.Tensor]]
    shapes: Callable[[], list[tuple[str, tuple[int, ...]]]] | None = None
    probe_logprobs: list[float] | None = None


@dataclass
class Weights:
    """The policy's weights of one version as every engine can take them, without naming who holds them: what the
    trainer hands the rollout source (:meth:`~unison.rollout.source.RolloutSource.publish`); built from a learner
    in :mod:`unison.sync`, the one place the two meet.

    ``export(dtype)``: ``(HF name, full tensor)`` cast to ``dtype`` (``None``: the fp32 masters), streamed — a
    collective when the learner is sharded, every rank consumes it to the end. ``shapes()``: what ``export`` yields, in
    its order, nothing materialised. ``probe(ids, pad_id)``: the policy's log-probs (temperature 1) of a probe
    sequence, for an engine that checks its copy against them (a server). ``device``: where the policy lives."""

    export: Callable[[torch.dtype | None], Iterable[tuple[str, torch.Tensor]]]
    shapes: Callable[[], list[tuple[str, tuple[int, ...]]]]
    probe: Callable[[list[int], int], list[float]]
    device: str = "cpu"

    def update_for(self, engine) -> WeightUpdate:
        """The :class:`WeightUpdate` ``engine`` takes: the tensors in its ``weight_dtype``, and the probe's log-probs
        when it checks its copy (collective when sharded: every rank calls it)."""
        ids = getattr(engine, "probe_ids", None)
        return WeightUpdate(self.export(engine.weight_dtype), shapes=self.shapes,
                            probe_logprobs=self.probe(ids, engine.pad_id) if ids else None)


def push(engine, weights: Weights) -> dict[str, float]:
    """Sync ``engine`` to ``weights`` now; the engine's sync metrics."""
    return engine.sync_weights(weights.update_for(engine))


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout engine samples.

    ``temperature`` divides the logits; 0 means greedy (log μ reported as 0,
    a point mass). ``top_k`` (0 = off) and ``top_p`` (1.0 = off) truncate the
    support and renormalise: the reported log μ is then that of the truncated
    distribution, which differs from the learner's π at the same temperature.
    That bias is real (users hit it in every framework); keep both off for RL
    unless you mean it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int = 0
    #: keep sampling past EOS up to ``max_tokens`` (as vLLM's ``ignore_eos``):
    #: fixed-length responses for benchmarks and length studies.
    ignore_eos: bool = False
    #: one seed per prompt (the trainer derives them from the step seed and the prompt's place in
    #: the global batch); None: derived from ``seed`` and the prompt's index in this call
    prompt_seeds: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.n < 1:
            raise UnisonError(f"n={self.n} is invalid: sample at least one response per prompt")
        if self.temperature < 0:
            raise UnisonError(f"temperature={self.temperature} is invalid: use 0 (greedy) or a positive value")
        if not 0.0 < self.top_p <= 1.0:
            raise UnisonError(f"top_p={self.top_p} is invalid: use a value in (0, 1]")
        if self.top_k < 0:
            raise UnisonError(f"top_k={self.top_k} is invalid: use 0 (off) or a positive integer")
        if self.max_tokens < 1:
            raise UnisonError(f"max_tokens={self.max_tokens} is invalid: generate at least one token")


_M32 = 0xFFFFFFFF


def mix64(*values: int) -> int:
    """A 64-bit hash (splitmix64 steps) of integers: seeds derived from seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        h = (h + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def row_seeds(params: SamplingParams, num_prompts: int) -> list[int]:
    """The seed of every response row, prompt-major (prompt 0's n samples, then prompt 1's...)."""
    seeds = params.prompt_seeds
    if seeds is None:
        seeds = [mix64(params.seed, j) for j in range(num_prompts)]
    elif len(seeds) != num_prompts:
        raise UnisonError(f"{len(seeds)} prompt seeds for {num_prompts} prompts: pass one per prompt")
    return [mix64(s, i) for s in seeds for i in range(params.n)]


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h · c) mod 2³² for uint32 values held in int64, without int64 overflow."""
    return ((h & 0xFFFF) * c + ((((h >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection with good avalanche)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_uniforms(seeds: torch.Tensor, t: int) -> torch.Tensor:
    """One uniform in (0, 1) per row for decode step ``t``: a hash of (row seed, t), fp64."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _fmix32(lo ^ _fmix32(hi ^ 0x5BD1E995))
    h = _fmix32(h ^ _mul32(torch.full_like(h, t + 1), 0x9E3779B9))
    return (h.double() + 0.5) / 2.0**32


def sample_tokens(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor,
                  t: int, return_support: bool = False):
    """Sample one token per row from ``logits`` [b, V] for decode step ``t``.

    ``seeds`` [b] (int64) are the rows' seeds (:func:`row_seeds`). Inverse-CDF
    sampling with the row's own uniform: the draw of a row never depends on
    the other rows. Returns ``(tokens [b], logp [b])`` where ``logp`` is the
    log-probability of the sampled token under the distribution it was drawn
    from, computed in fp32. With ``return_support`` also the size of the support each row
    sampled from, [b] int (0 = the whole vocabulary: no top-p / top-k): under truncation the kept
    set is always the c most probable tokens, so its size c is the whole record the learner needs
    to renormalise over it (sampling-mask replay, ``rollout.replay_sampling_mask``).
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        zeros = torch.zeros_like(tokens, dtype=torch.float32)
        return (tokens, zeros, torch.zeros_like(tokens)) if return_support else (tokens, zeros)
    # x / 1.0 is x, bit for bit: at temperature 1 the [rows × vocabulary] division (a pass and a buffer) is skipped
    logp = torch.log_softmax(logits if params.temperature == 1.0 else logits / params.temperature, dim=-1)
    truncated = bool(params.top_k or params.top_p < 1.0)
    if truncated:
        logp = _truncate(logp, params.top_k, params.top_p)
    cdf = logp.double().exp().cumsum(-1)
    u = row_uniforms(seeds.to(cdf.device), t) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp(max=logp.shape[-1] - 1)
    out = tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    if not return_support:
        return out
    kept = torch.isfinite(logp).sum(-1) if truncated else torch.zeros_like(tokens)
    return (*out, kept)


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask the support to top-k, then top-p over the top-k survivors renormalised (the order and the
    renormalisation of HF's warpers and vLLM's sampler), and renormalise (log space)."""
    if top_k and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
        if top_p < 1.0:
            logp = torch.log_softmax(logp, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_lp.exp()
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logp, dim=-1)


def support_logsumexp(logits: torch.Tensor, targets: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row's logits over the support it was sampled from: its ``sizes[i]`` largest
    (sampling-mask replay; 0 = every logit). Top-k and top-p both keep the c most probable tokens, so c
    is the whole record. The target always counts: where it ranks just below the c-th (a near-tie that
    this forward orders differently from the sampler's), it takes the c-th's place."""
    full = torch.logsumexp(logits, dim=-1)
    trunc = sizes > 0
    if not bool(trunc.any()):
        return full
    rows = trunc.nonzero().squeeze(-1)
    lg, c = logits[rows], sizes[rows].to(logits.device)
    top = torch.topk(lg, int(c.max()), dim=-1).values  # [n, k], descending
    cols = torch.arange(top.shape[1], device=lg.device)[None, :]
    tgt = lg.gather(-1, targets[rows][:, None])
    last = (cols == (c - 1)[:, None])
    swap = last & (tgt < top.gather(-1, (c - 1)[:, None]))
    vals = torch.where(swap, tgt, top).masked_fill(cols >= c[:, None], float("-inf"))
    return full.index_put((rows,), torch.logsumexp(vals, dim=-1))
