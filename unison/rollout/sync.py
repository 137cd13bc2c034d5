"""Weight syncs: the one place a learner meets an engine. The learner's weights go to an engine as named tensors in
the engine's ``weight_dtype`` (:class:`~unison.rollout.base.WeightUpdate`); an engine never holds the learner.
"""

from __future__ import annotations

from unison.rollout.base import WeightUpdate


def weight_update(engine, learner) -> WeightUpdate:
    """The learner's weights as the named tensors ``engine`` takes (in its ``weight_dtype``), and for an engine
    that checks its copy on a probe sequence, the learner's log-probs of it: the one place a learner meets an
    engine (collective when sharded: every rank calls it, and the engine consumes the stream on every rank)."""
    ids = getattr(engine, "probe_ids", None)
    return WeightUpdate(learner.export_weights(engine.weight_dtype), shapes=learner.export_shapes,
                        probe_logprobs=probe_logprobs(learner, ids, engine.pad_id) if ids else None)


def push(engine, learner) -> dict[str, float]:
    """Sync ``engine`` to the learner's weights now; the engine's sync metrics."""
    return engine.sync_weights(weight_update(engine, learner))


def probe_logprobs(learner, ids: list[int], pad_id: int) -> list[float]:
    """The learner's log-probs of ``ids[1:]`` after ``ids[0]`` at temperature 1 — a server's prompt log-probs
    are the raw model's, whatever the sampling temperature (a collective when sharded)."""
    from unison.batch import Completion, collate

    batch = collate([Completion(prompt_ids=ids[:1], token_ids=ids[1:], logprobs=[0.0] * (len(ids) - 1),
                                finish_reason="length")], pad_id)
    return learner.score(batch, temperature=1.0)[0, 1:len(ids)].tolist()
