"""The mismatch ledger: where a step's training–inference mismatch comes from.

The sampled tokens are scored along a chain of log-probabilities that starts at the rollout engine's
own log μ and ends at the learner's log π_old, changing one thing at a time:

    log μ (decode)                                 the engine as it sampled: decode path, KV cache
      -> the engine, one prefill pass              decode:       caches and decode kernels vs prefill
      -> the learner, as the engine ran            engine:       the learner's forward vs the engine's, same
                                                                 version, quantizer, support and routing
      -> without the quantizer                     quantization: the rollout's weight format (absent when
                                                                 the learner is quantization-aware)
      -> without the quantized KV cache            kv_cache:     the keys and values the engine's fp8 cache rounded
                                                                 (absent when the learner is KV-cache-aware)
      -> over the whole vocabulary                 truncation:   the log-mass outside the top-p/top-k support
                                                                 (absent with sampling-mask replay)
      -> with the learner's own routing            routing:      MoE expert choices (absent with routing replay)
      -> compiled or eager as the learner runs     compile:      Inductor's kernels on one side only (absent when
                                                                 the engine and the learner both compile, or neither)
      -> at the current version                    staleness:    the updates since the sample was drawn
      -> through the adapters  = log π_old         merge:        LoRA: the engine's merged weights W + (α/r)·B·A
                                                                 against the learner's adapters beside W (absent
                                                                 without LoRA, and with the quantization-aware
                                                                 learner, which merges as the engine does)

Adjacent log-ratios telescope, so the k1 terms ``mean(log p_prev − log p_next)`` add up exactly (to fp32
rounding of the means) to the total ``mismatch/k1 = mean(log μ − log π_old)``. Each term is also given
as the k3 of its pair (non-negative; they add up to the total k3 only up to cross terms). A term that
does not differ in this run is absent (zero, no scoring pass); one that cannot be measured here (an engine
that cannot re-score, older weights that are not kept) is merged into its neighbour and named in
``unmeasured``. Cost: one scoring pass per term present, on the steps the ledger runs.

No framework measures this: each logs one aggregate number, and the root-causing is done by hand with
single-knob A/B runs. A *decode* term far above the engine term is the signature of a stale engine — a
prefix or KV cache that outlived a weight sync — and the trainer warns about it once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from unison.batch import by_version
from unison.errors import UnisonError
from unison.mismatch import k1, k3
from unison.rollout import SamplingParams
from unison.rollout.native import NativeEngine
from unison.sides import KNOBS, Side
from unison.sync import stale_tensors

TERMS = ("decode", "engine", "quantization", "kv_cache", "truncation", "routing", "compile", "staleness", "merge")

#: the stale-engine rule (docs/ledger.md, measured): a decode term whose k3 exceeds this absolute level **and**
#: this multiple of the engine term is not a kernel difference. On the tiny model the decode path differs from
#: a prefill pass by k3 ≈ 8e-13 (fp32) and ≈ 7.8e-5 (bf16); one update of staleness at lr 1e-4 is 2–6e-3
STALE_DECODE_K3 = 1e-3
STALE_DECODE_RATIO = 3.0


@dataclass
class Plan:
    """Which terms this run has, and which of them it can measure."""

    present: list[str]
    unmeasured: dict[str, str] = field(default_factory=dict)  # term -> why it cannot be measured here

    @property
    def measured(self) -> list[str]:
        return [t for t in self.present if t not in self.unmeasured]


def plan(engine: Side, learner: Side, *, truncated: bool, moe: bool, asynchronous: bool, can_rescore: str | None,
         can_score_old: bool, lora: bool = False, can_score_merged: bool = True) -> Plan:
    """The terms of a run: ``decode`` and ``engine`` always; the knobs where the engine's and the learner's
    :class:`~unison.sides.Side` differ (:meth:`Side.differs`: quantization, truncation where sampling ``truncated``
    the support, routing for a ``moe`` model, compile); ``staleness`` when ``asynchronous``; ``merge`` with ``lora``
    adapters (absent under the quantization-aware learner, which merges as the engine does). ``can_rescore`` is None
    when the engine can re-score its samples, else why not; ``can_score_old`` / ``can_score_merged``: the learner can
    score under older / merged weights (one process)."""
    present = ["decode", "engine", *engine.differs(learner, truncated=truncated, moe=moe)]
    if asynchronous:
        present.append("staleness")
    if lora and learner.quantization == "none":
        present.append("merge")
    unmeasured = {}
    if can_rescore is not None:
        unmeasured["decode"] = can_rescore
    if asynchronous and not can_score_old:
        unmeasured["staleness"] = "the learner cannot score with older weights here (FSDP2 shards them; LoRA under the quantization-aware learner merges its own adapters)"
    if "merge" in present and not can_score_merged:
        unmeasured["merge"] = "the learner cannot score under merged weights here (FSDP2 shards them)"
    return Plan(present, unmeasured)


class Ledger:
    """Measures the chain on a batch. ``rescore(batch, version)``: the engine's prefill log μ of a batch whose
    rows were all sampled at ``version`` (None when the engine cannot); ``weights(version)``: the learner's
    weights of an older version (None when not kept)."""

    def __init__(self, learner, plan_: Plan, engine: Side, rescore=None, weights=None, held_weights=None):
        self.learner, self.plan, self.rescore, self.weights = learner, plan_, rescore, weights
        #: the engine's numerics: the learner scores "as the engine ran" with its knobs (:meth:`Side.toward`)
        self.engine = engine
        #: ``held_weights() -> (tensors that differ, tensors)``: the engine's weights against what the learner's
        #: current ones make it hold (an in-process engine; None where the engine's weights are out of reach)
        self.held_weights = held_weights
        self._held: tuple[int, int] | None = None
        self.warned = False
        #: (step, {term: the learner's log-probs after that term's change}) of the last :meth:`measure`
        self._passes: tuple[int, dict[str, torch.Tensor]] | None = None
        self._merged_now: dict[str, torch.Tensor] | None = None  # the current weights merged, during prepare

    def split(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The passes the numerics/staleness split reuses from the last :meth:`measure` of ``step``, when it scored
        them: (the learner under the weights that sampled each token, the learner under the current weights merged
        — LoRA: the engine's form — or None where the chain goes straight from the first to π_old)."""
        if self._passes is None or self._passes[0] != step:
            return None
        passes = self._passes[1]
        if "staleness" in passes:
            return passes["behave"], passes["staleness"] if "merge" in passes else None
        if "merge" in passes:  # nothing stale in the batch: every token under the current weights, merged
            return passes["premerge"], passes["premerge"]
        return None

    def token_terms(self, step: int, size: int, rows: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Each term's per-token log-ratio (log p_prev − log p_next) from the last :meth:`measure` of ``step``, on a
        batch of ``size`` rows of which it measured ``rows`` ([size, L], 0 elsewhere) — what ``unison view`` shows;
        None when that step measured nothing."""
        found = getattr(self, "_token_terms", None)
        if found is None or found[0] != step:
            return None
        out = {}
        for term, x in found[1].items():
            full = torch.zeros((size, x.shape[1]), dtype=x.dtype)
            full[rows] = x.cpu()
            out[term] = full
        return out

    def prepare(self, batch, step: int) -> list[tuple[str, torch.Tensor]]:
        """Every pass of the chain but its last (the trainer's own π_old), on every row of ``batch``: log μ, the
        engine's re-score, the learner's passes. ``step`` is the learner's version (0-based: the weights this
        step started from), so this runs **before the update** — after it the learner holds version step + 1,
        and a pass "as the engine ran" would measure the update too."""
        mu = batch.logp_mu
        present, measured = self.plan.present, self.plan.measured
        self._held = self.held_weights() if self.held_weights is not None else None  # before the update: version step
        stale = "staleness" in measured and bool((batch.token_versions(step) != step).any())
        knobs = [t for t, _ in KNOBS if t in present]
        # the learner "as the engine ran": its own side with the engine's knobs (quantizer, sampled support and
        # routing, compiled or not), at the sample's version (the current one when older weights are not kept:
        # staleness is then part of the engine term), LoRA's adapters merged into the weights as the engine holds them
        final = self.learner.side
        state = {"side": final.toward(self.engine, *knobs), "current": not stale, "merged": "merge" in measured}
        terms = ["engine", *knobs, *(["staleness"] if stale else []), *(["merge"] if "merge" in measured else [])]
        if "merge" in measured:
            self._merged_now = dict(self.learner.export_weights())  # W + (α/r)·B·A in fp32, under the base names
        chain: list[tuple[str, torch.Tensor]] = [("mu", mu)]
        if "decode" in measured:
            chain.append(("decode", by_version(batch, self.rescore, step)))
        try:
            for term in terms[:-1]:
                if term == "staleness":
                    state["current"] = True
                elif term == "merge":
                    state["merged"] = False
                elif term != "engine":
                    state["side"] = state["side"].toward(final, term)
                chain.append((term, self._learner_scores(batch, step, state)))
        finally:
            self._merged_now = None
        chain.append((terms[-1], None))  # every knob as the trainer has it: the trainer's own π_old
        return chain

    def measure(self, batch, logp_pi: torch.Tensor, step: int, chain=None, rows=None) -> dict[str, float]:
        """The ledger of ``batch`` (``logp_pi``: the learner's log π_old of its rows, as the trainer computed
        it): ``ledger/<term>_k1`` and ``_k3`` for every measured term, ``ledger/total_k1`` and ``_k3``.
        ``chain``: :meth:`prepare` of the batch ``rows`` were selected from (before the update); without it
        the chain is scored now, with the learner's present weights as version ``step``."""
        if chain is None:
            chain = self.prepare(batch, step)
        elif rows is not None:
            chain = [(t, x if x is None else x[rows]) for t, x in chain]
        chain = chain[:-1] + [(chain[-1][0], logp_pi)]
        mask, mu = batch.response_mask, batch.logp_mu
        passes = {term: x for term, x in chain}
        names = [term for term, _ in chain]
        if "staleness" in passes:  # the learner under the weights that sampled: the pass before staleness
            passes["behave"] = chain[names.index("staleness") - 1][1]
        if "merge" in passes:
            passes["premerge"] = chain[names.index("merge") - 1][1]
        self._passes = (step, passes)
        out = {}
        self._token_terms = (step, {})
        for (_, prev), (term, nxt) in zip(chain, chain[1:]):
            out[f"ledger/{term}_k1"] = float(k1(nxt, prev, mask))
            out[f"ledger/{term}_k3"] = float(k3(nxt, prev, mask))
            self._token_terms[1][term] = ((prev - nxt) * mask).detach()
        out["ledger/total_k1"] = float(k1(logp_pi, mu, mask))
        out["ledger/total_k3"] = float(k3(logp_pi, mu, mask))
        if self._held is not None:
            out["ledger/engine_stale_weights"] = self._held[0] / max(self._held[1], 1)
        return out

    def _learner_scores(self, batch, step, state):
        """The learner's log-probs computing as ``state["side"]``, under the current weights (``state["current"]``)
        or each token's sampling version's, merged as the engine holds them (``state["merged"]``) or through the
        adapters."""
        now = self._merged_now if state["merged"] else None  # the current version: merged, or through the adapters
        with self.learner.as_side(state["side"]):
            if state["current"]:
                return self.learner.score(batch, weights=now)

            def at(sub, u):
                w = now if u == step else self.weights(u)
                if u != step and w is None:
                    raise UnisonError(f"the ledger needs the weights of version {u}, which are not kept")
                return self.learner.score(sub, weights=w)

            return by_version(batch, at, step)

    def check_stale(self, metrics: dict, log) -> None:
        """Warn once when the engine sampled from something other than the weights it claims: its weights are
        not what the last sync should have put there (a sync that did not reach it: this shows under the
        *engine* term, not the decode one), or the decode term says its caches or decode kernels are not those
        weights' (STALE_DECODE_K3, STALE_DECODE_RATIO)."""
        if self.warned:
            return
        if metrics.get("ledger/engine_stale_weights"):
            self.warned = True
            log(f"[train] WARNING the rollout engine does not hold the weights it claims: "
                f"{metrics['ledger/engine_stale_weights']:.0%} of its tensors differ from what the last weight "
                f"sync should have loaded (a sync that did not reach the engine; its samples come from older "
                f"weights, and the ledger's engine term, {metrics.get('ledger/engine_k3', float('nan')):.2g}, "
                f"is that staleness, not kernels; docs/ledger.md)")
            return
        dec, eng = metrics.get("ledger/decode_k3"), metrics.get("ledger/engine_k3")
        if dec is None or not math.isfinite(dec):
            return
        if dec > STALE_DECODE_K3 and dec > STALE_DECODE_RATIO * max(eng or 0.0, 0.0):
            self.warned = True
            log(f"[train] WARNING the rollout engine's own log μ differs from a prefill pass of the weights it "
                f"claims by k3 {dec:.2g} ({dec / max(eng or 1e-30, 1e-30):.0f}× the engine-vs-learner term): the "
                f"likely cause is a stale engine — a prefix or KV cache kept across a weight sync (reset it after "
                f"every load) — or decode kernels that differ from the prefill ones (docs/ledger.md)")


def shares(metrics: dict) -> str:
    """The console line: each measured term's share of the summed k3 terms."""
    terms = [(t, metrics[f"ledger/{t}_k3"]) for t in TERMS if f"ledger/{t}_k3" in metrics]
    total = sum(max(v, 0.0) for _, v in terms)
    if not terms or total <= 0:
        return "ledger: no mismatch (every term 0)"
    return "ledger: " + " | ".join(f"{t} {100 * max(v, 0.0) / total:.0f}%" for t, v in terms) + \
        f" (shares of Σk3 = {total:.2g}; total k1 {metrics['ledger/total_k1']:.2g})"


# ------------------------------------------------------------------ wiring a run's ledger
def build_ledger(cfg, learner, source, model_dir, engine: Side) -> Ledger | None:
    """The ledger of a training run (``mismatch.ledger``), or None: off, exact mode (nothing to measure),
    ``mismatch.decompose_every`` 0. ``on`` refuses a run in which a term cannot be measured. ``engine``: the
    engine's numerics (the run's machine)."""
    r = cfg.rollout
    if cfg.mismatch.ledger == "off" or engine.exact or not cfg.mismatch.decompose_every:
        return None
    rescore, why = _rescorer(cfg, source, model_dir, engine, str(learner.device))
    keeps_old = source.max_staleness == 0 or source.weights(0) is not None
    p = plan(engine, learner.side, truncated=r.top_p < 1.0 or bool(r.top_k), moe=learner.moe,
             asynchronous=r.max_staleness > 0, can_rescore=why,
             can_score_old=learner.can_score_other_weights and keeps_old, lora=learner.peft is not None,
             can_score_merged=not learner.sharded)
    if cfg.mismatch.ledger == "on" and p.unmeasured:
        term, reason = next(iter(p.unmeasured.items()))
        raise UnisonError(f"mismatch.ledger=on, but its {term} term cannot be measured in this run ({reason}): "
                          f"set mismatch.ledger=auto (that term is then merged into its neighbour) or off")

    held = (lambda: stale_tensors(source.engine, learner)) if isinstance(source.engine, NativeEngine) else None
    return Ledger(learner, p, engine, rescore=rescore, weights=source.weights, held_weights=held)


def _rescorer(cfg, source, model_dir, side: Side, device):
    """``(fn(batch, version) -> the engine's log μ by a prefill pass, None)``, or ``(None, why not)``. A synchronous
    native engine still holds the weights it sampled with; a worker's engine is rebuilt here, in the trainer's
    process, and loaded with the ring's weights of the version asked for."""
    r = cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    engine = source.engine
    if isinstance(engine, NativeEngine):
        return (lambda batch, version: engine.score(batch, params)), None
    if source.max_staleness and cfg.engine == "native":
        held: dict = {}

        def rescore(batch, version):
            if "engine" not in held:
                held["engine"] = NativeEngine(model_dir, side, device)  # as the worker's: its compiled layers too
            if held.get("version") != version:
                held["engine"].load_weights(source.weights(version).items())
                held["version"] = version
            return held["engine"].score(batch, params)

        return rescore, None
    return None, f"engine {cfg.engine} ({cfg.vllm.mode}) does not re-score its samples for unison"

