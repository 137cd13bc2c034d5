"""The teacher of on-policy distillation (``distill.teacher``): a second model that scores the student's
samples token by token — in unison's own fp32 scoring pass, or served by vLLM (``distill.teacher_url``: its
``prompt_logprobs``) — and the per-token advantages and metrics those scores give (the math:
unison/algorithms/distill.py)."""

from __future__ import annotations

import torch

from unison.algorithms.distill import reverse_kl_advantages, reverse_kl_metrics
from unison.errors import UnisonError
from unison.models import load_tokenizer, resolve_model_dir
from unison.policy import Scorer


def check_tokenizer(teacher_tok, student_tok, teacher: str, student: str) -> None:
    """Distillation compares the log-probabilities of the same token ids: the vocabularies must be one."""
    if teacher_tok.get_vocab() != student_tok.get_vocab():
        raise UnisonError(f"distill.teacher '{teacher}' has another tokenizer than the student '{student}' "
                          f"({len(teacher_tok)} vs {len(student_tok)} tokens, or the same size with other ids): "
                          f"its log-probabilities are of other token ids; pick a teacher of the student's family")


class Teacher:
    """Scores batches with the teacher's weights, frozen, at the rollout's temperature (the student's π_old
    is scored at it too, so the reverse KL compares like with like)."""

    def __init__(self, cfg, student_tokenizer, dist=None):
        d = cfg.distill
        try:
            self.model_dir = resolve_model_dir(d.teacher)
        except UnisonError as e:
            raise UnisonError(f"distill.teacher: {e}") from None
        check_tokenizer(load_tokenizer(self.model_dir), student_tokenizer, d.teacher, cfg.model)
        self.coef, self.task_reward = d.coef, d.task_reward
        self.scorer = Scorer(self.model_dir, compute_dtype=torch.float32, device=cfg.device,
                             temperature=cfg.rollout.temperature, dist=dist,
                             micro_batch_size=cfg.train.micro_batch_size, logprob_chunk=cfg.train.logprob_chunk,
                             micro_batch_tokens=cfg.train.micro_batch_tokens,
                             replay_sampling_mask=cfg.rollout.replay_sampling_mask)
        self.scorer.model.requires_grad_(False)
        self.temperature = cfg.rollout.temperature
        self._engine = None  # the teacher's generation path, built the first time the ledger measures it
        #: distill.teacher_url: the served teacher (a vLLM server; no weight sync: it is frozen)
        self.served = None
        if d.teacher_url:
            from unison.rollout.vllm_server import VLLMServerEngine

            self.served = VLLMServerEngine(self.model_dir, url=d.teacher_url, weight_sync="none",
                                           request_timeout_s=cfg.vllm.request_timeout_s, retries=cfg.vllm.retries)

    def score(self, batch) -> torch.Tensor:
        """log π_teacher of every position of ``batch`` ([B, L], 0 off the response): the served teacher's prompt
        log-probs, or the local scoring pass."""
        if self.served is None:
            return self.scorer.score(batch)
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        rows = [batch.tokens[i][batch.attention_mask[i].bool()].tolist() for i in range(batch.size)]
        for i, lps in enumerate(self.served.score(rows, parallel=True)):
            cols = batch.attention_mask[i].bool().nonzero().squeeze(-1)[1:]  # every token after the first
            out[i, cols] = torch.tensor(lps, dtype=torch.float32)
        return out * batch.response_mask

    def path_term(self, batch, teacher: torch.Tensor) -> dict[str, float]:
        """The mismatch ledger's ``teacher`` term: the teacher's generation path — the native engine over its
        weights, the prefill pass its decode is checked against (the ledger's decode term) — against the scoring
        path the advantages used (``teacher``, log π_teacher: the local fp32 pass, or the server's prompt log-probs
        with ``distill.teacher_url``). k1 and k3 of log π_teacher against the engine's
        log-probabilities, over the model's response tokens; outside the log μ → log π chain (its own terms add
        up to mismatch/k1 without it). A teacher served in another engine would put its own difference here
        (e.g. an adapter dropped from a scoring endpoint). One process only: a sharded teacher has no engine."""
        from unison.mismatch import k1, k3
        from unison.rollout import SamplingParams
        from unison.rollout.native import NativeEngine

        if self.scorer.sharded:
            return {}
        if self._engine is None:
            self._engine = NativeEngine(self.model_dir, torch.float32, device=str(self.scorer.device))
        gen = self._engine.score(batch, SamplingParams(temperature=self.temperature))
        mask = batch.response_mask
        return {"ledger/teacher_k1": float(k1(teacher, gen, mask)), "ledger/teacher_k3": float(k3(teacher, gen, mask))}

    def advantages(self, batch, learner, scored_old: torch.Tensor | None,
                   measure_path: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """[B, L] per-token advantages for ``batch`` (its ``advantages`` [B], the task's, are added with
        ``distill.task_reward``) and the ``distill/*`` metrics. The student term is the learner's own score:
        ``scored_old`` when the step's score pass made it, else one score pass here — never log μ, which is
        what ``batch.logp_old`` holds under ``policy.anchor: bypass``. ``measure_path``: add the ledger's
        ``teacher`` term (:meth:`path_term`)."""
        with torch.no_grad():
            teacher = self.score(batch)
            student = scored_old if scored_old is not None else learner.score(batch)
        mask = batch.response_mask
        adv = reverse_kl_advantages(student, teacher, mask, self.coef,
                                    batch.advantages if self.task_reward else None)
        metrics = reverse_kl_metrics(student, batch.logp_mu, teacher, mask)
        if measure_path:
            metrics.update(self.path_term(batch, teacher))
        return adv, metrics
