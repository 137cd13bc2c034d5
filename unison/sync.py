"""Weight syncs: the one place a learner meets an engine. The learner's weights become a
:class:`~unison.rollout.base.Weights` handle (export, shapes, the probe's log-probs) that the rollout source and the
engines take; nothing under ``unison/rollout/`` names a learner. Also the ledger's check that an in-process engine
holds what the last sync should have loaded.
"""

from __future__ import annotations

from unison.batch import Completion, collate
from unison.rollout.base import Weights, WeightUpdate, push


def weights_of(learner) -> Weights:
    """The learner's current weights as a :class:`Weights` handle (nothing exported until an engine asks)."""
    return Weights(export=learner.export_weights, shapes=learner.export_shapes,
                   probe=lambda ids, pad_id: probe_logprobs(learner, ids, pad_id),
                   device=str(getattr(learner, "device", "cpu")))


def weight_update(engine, learner) -> WeightUpdate:
    """The learner's weights as the named tensors ``engine`` takes (in its ``weight_dtype``), and for an engine
    that checks its copy on a probe sequence, the learner's log-probs of it (collective when sharded: every rank
    calls it, and the engine consumes the stream on every rank)."""
    return weights_of(learner).update_for(engine)


def sync(engine, learner) -> dict[str, float]:
    """Sync ``engine`` to the learner's weights now; the engine's sync metrics."""
    return push(engine, weights_of(learner))


def stale_tensors(engine, learner) -> tuple[int, int]:
    """``(tensors that differ, tensors compared)`` between what an in-process native engine holds and what the
    learner's current weights make it hold after a sync (the mismatch ledger's stale-engine check)."""
    return engine.stale_weights(learner.export_weights(engine.weight_dtype))


def probe_logprobs(learner, ids: list[int], pad_id: int) -> list[float]:
    """The learner's log-probs of ``ids[1:]`` after ``ids[0]`` at temperature 1 — a server's prompt log-probs
    are the raw model's, whatever the sampling temperature (a collective when sharded)."""
    batch = collate([Completion(prompt_ids=ids[:1], token_ids=ids[1:], logprobs=[0.0] * (len(ids) - 1),
                                finish_reason="length")], pad_id)
    return learner.score(batch, temperature=1.0)[0, 1:len(ids)].tolist()


__all__ = ["Weights", "WeightUpdate", "probe_logprobs", "push", "stale_tensors", "sync", "weight_update",
           "weights_of"]
