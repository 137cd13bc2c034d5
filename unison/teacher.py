"""The teacher of on-policy distillation (``distill.teacher``): a second model that scores the student's
samples token by token — in unison's own fp32 scoring pass, or served by vLLM (``distill.teacher_url``: its
``prompt_logprobs``) — and the per-token advantages and metrics those scores give (the math:
unison/algorithms/distill.py)."""

from __future__ import annotations

import torch

from unison.algorithms.distill import reverse_kl_advantages, reverse_kl_metrics
from unison.errors import UnisonError
from unison.logprobs import selected_positions
from unison.mismatch import k1, k3
from unison.models import load_tokenizer, resolve_model_dir
from unison.models import logit_transform
from unison.policy import Scorer, ScoringOptions
from unison.rollout import SamplingParams
from unison.rollout.native import NativeEngine
from unison.rollout.vllm_server import VLLMServerEngine
from unison.sides import Side


def check_tokenizer(teacher_tok, student_tok, teacher: str, student: str) -> None:
    """Distillation compares the log-probabilities of the same token ids: the vocabularies must be one."""
    if teacher_tok.get_vocab() != student_tok.get_vocab():
        raise UnisonError(f"distill.teacher '{teacher}' has another tokenizer than the student '{student}' "
                          f"({len(teacher_tok)} vs {len(student_tok)} tokens, or the same size with other ids): "
                          f"its log-probabilities are of other token ids; pick a teacher of the student's family")


class Teacher:
    """Scores batches with the teacher's weights, frozen, at the rollout's temperature (the student's π_old
    is scored at it too, so the reverse KL compares like with like)."""

    def __init__(self, distill, options: ScoringOptions, student_tokenizer, student: str = "the student",
                 vllm=None, dist=None):
        d = distill
        try:
            self.model_dir = resolve_model_dir(d.teacher)
        except UnisonError as e:
            raise UnisonError(f"distill.teacher: {e}") from None
        check_tokenizer(load_tokenizer(self.model_dir), student_tokenizer, d.teacher, student)
        self.coef, self.task_reward, self.estimator = d.coef, d.task_reward, d.estimator
        # the teacher scores its full distribution: never renormalised over the support the *student* sampled from
        # (top-p / top-k), which would make log π_T = log q(y) − log Σ_{top-c} q and 0 where the student kept one
        # token; a served teacher's prompt log-probs are the full distribution too, so the two paths agree
        self.scorer = Scorer(self.model_dir, Side(dtype=torch.float32, support_replay=False), options, dist=dist)
        self.scorer.model.requires_grad_(False)
        self.temperature = options.temperature
        self._engine = None  # the teacher's generation path, built the first time the ledger measures it
        #: distill.teacher_url: the served teacher (a vLLM server; no weight sync: it is frozen)
        self.served = None
        if d.teacher_url:
            self.served = VLLMServerEngine(self.model_dir, url=d.teacher_url, weight_sync="none",
                                           request_timeout_s=vllm.request_timeout_s if vllm else 600.0,
                                           retries=vllm.retries if vllm else 3)

    @classmethod
    def from_config(cls, cfg, student_tokenizer, dist=None) -> Teacher:
        """The run's teacher (``distill``), scoring at the rollout's temperature in the learner's micro-batches."""
        t = cfg.train
        options = ScoringOptions(cfg.device, cfg.rollout.temperature, t.micro_batch_size, t.micro_batch_tokens,
                                 t.logprob_chunk)
        return cls(cfg.distill, options, student_tokenizer, cfg.model, cfg.vllm, dist)

    # ------------------------------------------------------------------ the full-vocabulary target
    def hidden(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The teacher's last hidden states [n, d_T] at the positions the student's forward scores
        (:func:`unison.policy.selected_positions`, in the same order), in fp32 whatever the student's autocast:
        what ``distill.estimator: full`` takes the teacher's next-token distributions from."""
        lm = self.scorer.model
        kw = {"position_ids": position_ids} if position_ids is not None else {}
        with torch.no_grad(), torch.autocast(tokens.device.type, enabled=False):
            out = lm.base_model(input_ids=tokens, attention_mask=attention_mask, use_cache=False, **kw)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h[:, :-1][selected_positions(tokens, attention_mask, positions)]

    def log_probs(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
        """log π_T(·|s) [n, V] of hidden states ``h`` from :meth:`hidden`: the teacher's output layer (and logit
        transform, e.g. soft-capping) at ``temperature``, fp32, no gradient."""
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            z = self.scorer.model.get_output_embeddings()(h).float()
            transform = logit_transform(self.scorer.model.config)
            if transform is not None:
                z = transform(z)
            if temperature != 1.0:
                z = z / temperature
            return torch.log_softmax(z, dim=-1)

    def check_full(self, student_vocab: int) -> None:
        """``distill.estimator: full`` compares two distributions over one vocabulary, row for row."""
        rows = self.scorer.model.get_output_embeddings().weight.shape[0]
        if rows != student_vocab:
            raise UnisonError(f"distill.estimator=full compares the next-token distributions over the vocabulary, but "
                              f"the teacher's output layer has {rows} rows and the student's {student_vocab}: use "
                              f"distill.estimator=sampled (the sampled token's log-probs only)")

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
        if self.scorer.sharded:
            return {}
        if self._engine is None:
            self._engine = NativeEngine(self.model_dir, Side(), device=str(self.scorer.device))
        gen = self._engine.score(batch, SamplingParams(temperature=self.temperature))
        mask = batch.response_mask
        return {"ledger/teacher_k1": float(k1(teacher, gen, mask)), "ledger/teacher_k3": float(k3(teacher, gen, mask))}

    def advantages(self, batch, learner, scored_old: torch.Tensor | None,
                   measure_path: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """[B, L] per-token advantages for ``batch`` (its ``advantages`` [B], the task's, are added with
        ``distill.task_reward``) and the ``distill/*`` metrics. The student term is the learner's own score:
        ``scored_old`` when the step's score pass made it, else one score pass here — never log μ, which is
        what ``batch.logp_old`` holds under ``policy.anchor: bypass``. ``measure_path``: add the ledger's
        ``teacher`` term (:meth:`path_term`). With ``distill.estimator: full`` the reverse KL is a loss term of its
        own (the learner's, :meth:`hidden`): the advantages are the task's alone (or 0), the metrics the same."""
        with torch.no_grad():
            teacher = self.score(batch)
            student = scored_old if scored_old is not None else learner.score(batch)
        mask = batch.response_mask
        coef = 0.0 if self.estimator == "full" else self.coef
        adv = reverse_kl_advantages(student, teacher, mask, coef, batch.advantages if self.task_reward else None)
        metrics = reverse_kl_metrics(student, batch.logp_mu, teacher, mask)
        if measure_path:
            metrics.update(self.path_term(batch, teacher))
        return adv, metrics
