"""Tokenization drift: what re-tokenizing a multi-turn conversation would have trained on.

unison trains on the ids the engine sampled (token in / token out, unison/chat.py). A framework
that instead decodes each model turn to text, re-renders the conversation with the chat template
and tokenizes it again trains on ids y' that can differ from the sampled y: BPE merges across a
boundary, a non-canonical tokenization the model sampled ("hel" + "lo" re-tokenized as "hello"),
special tokens dropped by the decode, whitespace a template trims. Its log μ then belongs to
other tokens. Two numbers say how much that matters (prime-rl's token-in endpoint, its PR 1422,
reported "significant reductions in KL mismatch" from removing it):

* ``mismatch/retokenize_fraction`` — model turns whose re-tokenized ids differ from the sampled ones;
* ``mismatch/retokenize_k3`` — the token-mean k3 a re-tokenizing framework would have trained with:
  the learner scores the re-rendered conversation y' (log π'), and per model token
  r = log π'(y'_t) − log μ(y_t) where a turn's ids survived (the context may still have moved), or,
  where they did not, the turn's whole log-ratio Σ log π'(y'_turn) − Σ log μ(y_turn) spread evenly
  over its sampled tokens; k3 = mean(e^r − 1 − r) over the sampled tokens (compare ``mismatch/k3``,
  the same quantity on the ids actually trained on);
* ``mismatch/retokenize_token_fraction`` — the share of model tokens in turns that changed.

One self-contained function (:func:`retokenize_metrics`), called by the trainer every
``mismatch.decompose_every`` steps and by ``unison probe --task``; one extra score pass.
"""

from __future__ import annotations

import torch

from unison.batch import Completion, collate

LOG_CLAMP = 20.0


def retokenized(c, template) -> tuple[list[int], list[list[int]]] | None:
    """``(y', the indices of y' that re-tokenize each model turn)`` for one episode, or None when it has
    no model turn. The conversation is rebuilt as a re-tokenizing framework would: each model turn
    decoded without special tokens, the environment's messages as they were (assistant messages an
    environment adds included: the model's turns are known by their place, ``EpisodeRecord.model_messages``),
    all rendered at once; each turn's span is found where the template rendered it."""
    ep = c.episode
    turns = [(a, b) for a, b, kind in ep.segments if kind == "model"]
    if not turns:
        return None
    tok = template.tokenizer
    model = dict(zip(ep.model_messages, turns))  # the messages the model sampled (not an environment's own)
    msgs, spans = [], []
    for i, m in enumerate(ep.messages):
        if i not in model:
            msgs.append(m)
            continue
        a, b = model[i]
        ids = c.token_ids[a:b]
        content = tok.decode(ids, skip_special_tokens=True)
        start = len(template.text(msgs, True))
        msgs.append({"role": "assistant", "content": content})
        # where the template put the content: verbatim after the generation prompt, or as it rewrote it (a
        # template that trims whitespace): the span is found in the rendering, not assumed
        rendered = template.text(msgs, False)
        body = content if rendered.startswith(content, start) else content.strip()
        at = rendered.find(body, start) if body else start
        at = start if at < 0 else at
        stop = tok.decode(ids[-1:], skip_special_tokens=False) if ids else ""
        ends_with_stop = bool(ids) and template.closing.startswith(stop) and not content.endswith(stop)
        spans.append((at, at + len(body) + (len(stop) if ends_with_stop else 0)))
    text = template.text(msgs, False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    where = [[j for j, (x, y) in enumerate(offsets) if y > x and x < e and y > s] for s, e in spans]
    return ids, where


def retokenize_metrics(learner, completions, template, pad_id: int) -> dict[str, float]:
    """The drift figures above for the episodes among ``completions`` (collective when the learner is
    sharded: every rank passes the same completions)."""
    rows, found = [], []
    for c in completions:
        if c.episode is None:
            continue
        r = retokenized(c, template)
        if r is None:
            continue
        ids, where = r
        mask = [0] * (len(ids) - 1)
        for js in where:
            for j in js:
                if j >= 1:
                    mask[j - 1] = 1
        rows.append(Completion(prompt_ids=ids[:1], token_ids=ids[1:], logprobs=[0.0] * (len(ids) - 1),
                               finish_reason="stop", mask=mask))
        found.append((c, ids, where))
    if not rows:
        return {}
    logp = learner.score(collate(rows, pad_id))
    k3_sum, tokens, changed_tokens, turns, changed = 0.0, 0, 0, 0, 0
    for i, (c, ids, where) in enumerate(found):
        model = [(a, b) for a, b, kind in c.episode.segments if kind == "model"]
        for (a, b), js in zip(model, where):
            mu = torch.tensor(c.logprobs[a:b], dtype=torch.float64)
            pi = logp[i, torch.tensor(js, dtype=torch.long)].double() if js else torch.zeros(0, dtype=torch.float64)
            same = [ids[j] for j in js] == list(c.token_ids[a:b])
            if same:
                r = pi - mu
            else:
                r = ((pi.sum() - mu.sum()) / max(b - a, 1)).expand(b - a)
            r = r.clamp(-LOG_CLAMP, LOG_CLAMP)
            k3_sum += float((torch.expm1(r) - r).sum())
            tokens += b - a
            turns += 1
            if not same:
                changed += 1
                changed_tokens += b - a
    return {"mismatch/retokenize_fraction": changed / max(turns, 1),
            "mismatch/retokenize_k3": k3_sum / max(tokens, 1),
            "mismatch/retokenize_token_fraction": changed_tokens / max(tokens, 1)}
