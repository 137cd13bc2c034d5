"""The data that flows through the loop: completions from a rollout engine and the padded batch.

Layout of :class:`RolloutBatch` (one row per response)::

    tokens         [B, L]  prompt + response, right-padded with pad_id
    attention_mask [B, L]  1 on prompt and response tokens, 0 on padding
    response_mask  [B, L]  1 exactly on the tokens the model sampled (EOS included when generated);
                           a multi-turn episode's environment/tool tokens sit in the response span
                           with 0 here, so every loss, metric and correction ignores them
    logp_mu        [B, L]  log μ(tokens[t] | tokens[<t]) from the rollout engine, 0 off-response

Per-token tensors are aligned with ``tokens``: position ``t`` holds the
log-probability of ``tokens[:, t]`` given everything before it. Keeping one
alignment everywhere removes the classic off-by-one of shifted logits.
``version`` is the policy version (weight updates applied) that sampled each row's first token,
``token_version`` (when a weight sync reached the engine mid-response) each token's.
Later stages fill ``logp_old`` (the learner's score pass), ``rewards``,
``advantages`` and correction ``weights``. ``extras`` holds what some runs have: ``routing`` (MoE:
the engine's expert choices, [B, L, layers, k]) and ``support`` (top-p / top-k: the size of the
support each response token was sampled from, [B, L], 0 = the whole vocabulary) and ``kv_scale`` (a quantized KV
cache: the scales each row's cache held, [B, layers, 2, KV heads]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Completion:
    """One sampled response, as a rollout engine returns it."""

    prompt_ids: list[int]
    token_ids: list[int]
    #: log μ of each sampled token under the distribution actually sampled
    #: from (temperature, top-k and top-p applied).
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length" (max tokens)
    prompt_index: int = 0
    sample_index: int = 0
    #: MoE models: the experts each input token selected in the engine, [inputs, layers, k]
    #: (inputs = prompt + response − 1: the last token is never fed back)
    routing: torch.Tensor | None = None
    #: the policy version (weight updates applied) the engine held when it sampled the first token
    version: int = 0
    #: the version that sampled each token of ``token_ids``, where a weight sync reached the engine
    #: mid-response (the vLLM server with in-flight syncs continues the response under the new weights);
    #: None: every token is ``version``. An episode's environment tokens carry the version of the model
    #: token before them (nothing scores them).
    token_versions: list[int] | None = None
    #: top-p / top-k sampling: the size c of the support each token was drawn from (its c most probable
    #: tokens; 0 = the whole vocabulary), for sampling-mask replay; None when the engine did not record it
    support: list[int] | None = None
    #: a quantized KV cache (rollout.kv_cache_dtype): the scales the engine's cache held this response's keys and
    #: values under, [layers, 2, KV heads] (unison/kvcache.py); None without one
    kv_scale: torch.Tensor | None = None
    #: multi-turn episodes (unison/tasks/env.py): 1 where ``token_ids[i]`` was sampled by the model,
    #: 0 where the environment or a tool put it there (log μ is 0 there and nothing scores it);
    #: None = every token was sampled (a single-turn response)
    mask: list[int] | None = None
    #: multi-turn episodes: the :class:`unison.tasks.env.EpisodeRecord` (turns, messages, reward)
    episode: object | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have the same length")
        if self.mask is not None and len(self.mask) != len(self.token_ids):
            raise ValueError("token_ids and mask must have the same length")
        if self.token_versions is not None:
            tv = self.token_versions
            if len(tv) != len(self.token_ids):
                raise ValueError("token_ids and token_versions must have the same length")
            if any(b < a for a, b in zip(tv, tv[1:])):
                raise ValueError(f"token_versions must not decrease along a response: {tv}")
            if tv:
                self.version = tv[0]

    def set_version(self, v: int) -> None:
        """The whole response was sampled by version ``v``."""
        self.version, self.token_versions = v, None

    def versions_of_tokens(self) -> list[int]:
        """The version that sampled each token of ``token_ids``."""
        return list(self.token_versions) if self.token_versions is not None else [self.version] * len(self.token_ids)

    @property
    def versions(self) -> tuple[int, int]:
        """The versions of the first and the last token: equal unless a sync reached the engine mid-response."""
        return self.version, (self.token_versions[-1] if self.token_versions else self.version)

    @property
    def num_sampled(self) -> int:
        """Tokens the model sampled (the response length; a multi-turn episode's model tokens)."""
        return len(self.token_ids) if self.mask is None else int(sum(self.mask))


@dataclass
class RolloutBatch:
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    logp_mu: torch.Tensor
    prompt_lens: torch.Tensor      # [B]
    response_lens: torch.Tensor    # [B]
    group_ids: torch.Tensor        # [B] index of the prompt each response answers
    truncated: torch.Tensor        # [B] bool: finished by max tokens, not EOS
    #: [B] the policy version that sampled each response's first token (the oldest of its tokens)
    version: torch.Tensor | None = None
    #: [B, L] the version that sampled each response token (a response a weight sync reached mid-way spans
    #: two or more); prompt and padding positions hold the row's ``version``. None: each row is ``version``
    token_version: torch.Tensor | None = None
    logp_old: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def token_versions(self, default: int = 0) -> torch.Tensor:
        """[B, L] the version of every position (``token_version``, else each row's ``version``, else ``default``)."""
        if self.token_version is not None:
            return self.token_version
        if self.version is not None:
            return self.version[:, None].expand(self.tokens.shape).clone()
        return torch.full(self.tokens.shape, default, dtype=torch.int64)

    def version_parts(self, default: int = 0):
        """``(u, rows, where)`` for every version u in the batch: the rows that hold a token of version u and
        ``where`` [len(rows), L], the positions of those rows that u sampled (prompt and padding positions go
        with the row's first version, so the parts cover every position once)."""
        tv = self.token_versions(default)
        for u in sorted(set(tv.unique().tolist())):
            at = tv == u
            rows = at.any(dim=1).nonzero().squeeze(-1)
            yield int(u), rows, at[rows]

    def spanning(self) -> torch.Tensor:
        """[B] bool: the response's tokens were sampled by more than one version."""
        if self.token_version is None:
            return torch.zeros(self.size, dtype=torch.bool)
        m = self.response_mask.bool()
        hi = torch.where(m, self.token_version, torch.iinfo(torch.int64).min).amax(dim=1)
        return hi > self.version

    def select(self, idx: torch.Tensor | list[int]) -> RolloutBatch:
        """Rows ``idx`` of every per-row tensor (for mini-batches)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                out[name] = value[idx]
            elif name == "extras":
                out[name] = {k: v[idx] if isinstance(v, torch.Tensor) else v for k, v in value.items()}
            else:
                out[name] = value
        return RolloutBatch(**out)


def by_version(batch: RolloutBatch, score_fn, default: int = 0, out: torch.Tensor | None = None,
               skip: frozenset | set = frozenset()) -> torch.Tensor:
    """[B, L] log-probs of ``batch``, each position from the version that sampled it: ``score_fn(sub_batch, u)``
    scores the rows holding tokens of version u (not those in ``skip``: ``out`` keeps its values there).
    ``default``: the version of a batch that records none."""
    out = torch.zeros(batch.tokens.shape, dtype=torch.float32) if out is None else out
    for u, rows, where in batch.version_parts(default):
        if u in skip:
            continue
        scored = score_fn(batch.select(rows), u).to(out.device, out.dtype)
        out[rows] = torch.where(where.to(out.device), scored, out[rows])
    return out


def collate(completions: list[Completion], pad_id: int, layout: tuple[int, int] | None = None) -> RolloutBatch:
    """Pad completions into a :class:`RolloutBatch`: prompts at column 0, right-padded; or, with
    ``layout = (prompt_width, total)`` (exact mode), every prompt left-padded to end at column
    ``prompt_width`` and every row ``total`` wide — the rollout engine's cache layout."""
    if not completions:
        raise ValueError("collate needs at least one completion")
    B = len(completions)
    L = max(len(c.prompt_ids) + len(c.token_ids) for c in completions) if layout is None else layout[1]
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    resp = torch.zeros((B, L), dtype=torch.float32)
    logp_mu = torch.zeros((B, L), dtype=torch.float32)
    for i, c in enumerate(completions):
        p, r = len(c.prompt_ids), len(c.token_ids)
        s = 0 if layout is None else layout[0] - p  # where the prompt starts
        if s < 0 or s + p + r > L:
            raise ValueError(f"completion {i} ({p} + {r} tokens) does not fit the layout {layout}")
        tokens[i, s:s + p] = torch.tensor(c.prompt_ids, dtype=torch.long)
        if r:
            tokens[i, s + p:s + p + r] = torch.tensor(c.token_ids, dtype=torch.long)
            m = torch.ones(r) if c.mask is None else torch.tensor(c.mask, dtype=torch.float32)
            logp_mu[i, s + p:s + p + r] = torch.tensor(c.logprobs, dtype=torch.float32) * m
            resp[i, s + p:s + p + r] = m
        attention[i, s:s + p + r] = 1
    extras = {}
    if any(c.routing is not None for c in completions):  # [B, L, layers, k], -1 where unknown
        shape = next(c.routing for c in completions if c.routing is not None).shape[1:]
        routing = torch.full((B, L, *shape), -1, dtype=torch.int64)
        for i, c in enumerate(completions):
            if c.routing is not None:
                s = 0 if layout is None else layout[0] - len(c.prompt_ids)
                routing[i, s:s + c.routing.shape[0]] = c.routing.long()
        extras["routing"] = routing
    if any(c.support is not None and any(c.support) for c in completions):  # [B, L], 0 = the whole vocabulary
        support = torch.zeros((B, L), dtype=torch.int64)
        for i, c in enumerate(completions):
            if c.support:
                s = (0 if layout is None else layout[0] - len(c.prompt_ids)) + len(c.prompt_ids)
                support[i, s:s + len(c.support)] = torch.tensor(c.support, dtype=torch.int64)
        extras["support"] = support
    if any(c.kv_scale is not None for c in completions):  # [B, layers, 2, KV heads]
        if any(c.kv_scale is None for c in completions):
            raise ValueError("some completions carry KV-cache scales and some do not: one engine samples a batch")
        extras["kv_scale"] = torch.stack([c.kv_scale.float() for c in completions])
    first = torch.tensor([c.version for c in completions], dtype=torch.int64)
    token_version = None
    if any(c.token_versions is not None for c in completions):
        token_version = first[:, None].repeat(1, L)
        for i, c in enumerate(completions):
            if c.token_versions:
                s = (0 if layout is None else layout[0] - len(c.prompt_ids)) + len(c.prompt_ids)
                token_version[i, s:s + len(c.token_versions)] = torch.tensor(c.token_versions, dtype=torch.int64)
    return RolloutBatch(
        tokens=tokens, attention_mask=attention, response_mask=resp, logp_mu=logp_mu, extras=extras,
        prompt_lens=torch.tensor([len(c.prompt_ids) for c in completions]),
        response_lens=torch.tensor([c.num_sampled for c in completions]),
        group_ids=torch.tensor([c.prompt_index for c in completions]),
        truncated=torch.tensor([c.finish_reason == "length" for c in completions]),
        version=first, token_version=token_version,
    )


def micro_batches(rows: torch.Tensor, world_size: int, max_rows: int, budget: int | None = None,
                  lengths: torch.Tensor | None = None, packing: bool = False) -> list[list[torch.Tensor]]:
    """Each rank's micro-batches of ``rows``: rank r takes rows[r::world_size], split into pieces of at most
    ``max_rows`` rows and — with a token ``budget`` (and the rows' ``lengths``) — at most that many tokens (rows ×
    the piece's longest row, or with ``packing`` the rows' own lengths: rows are grouped by length, longest first,
    as verl's dynamic batch size does). Every rank computes every rank's share (no communication)."""
    if budget is None or lengths is None:
        return [list(rows[r::world_size].split(max_rows)) for r in range(world_size)]
    out = []
    for r in range(world_size):
        mine = rows[r::world_size]
        order = mine[torch.argsort(lengths[mine], descending=True, stable=True)].tolist()
        groups, cur, widest, used = [], [], 0, 0
        for i in order:
            L = int(lengths[i])
            need = used + L if packing else (len(cur) + 1) * max(widest, L)  # packed: no padding
            if cur and (len(cur) == max_rows or need > budget):
                groups.append(torch.tensor(cur))
                cur, widest, used = [], 0, 0
            cur.append(i)
            widest, used = max(widest, L), used + L
        if cur:
            groups.append(torch.tensor(cur))
        out.append(groups)
    return out
