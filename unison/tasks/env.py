"""Environments: multi-turn episodes with tools, token in / token out (``task.name: env``).

Write a class with two methods (subclassing :class:`Env` is optional) and, if it has any, its tools::

    class Guess:                                 # one instance per episode, created with no arguments
        tools = [calc]                           # plain functions (type hints + an "Args:" docstring)

        def reset(self, item) -> list[dict]:     # item: a row of task.path (unison.tasks.Item)
            return [{"role": "user", "content": item["question"]}]

        def step(self, text: str) -> tuple[list[dict], float | None, bool]:
            ...                                  # the model's turn (no tool call in it), as text
            return [{"role": "user", "content": "higher"}], None, False   # new messages, reward, done

``task.env: module:Class`` finds ``module.py`` next to the config (as ``task.reward``). An episode:
``reset`` gives the first messages; the chat template renders them with the tools' schemas
(unison/chat.py) and the rollout engine samples the model's turn. A turn that calls tools (in the
template's own format) gets their results as ``tool`` messages; any other turn goes to ``step`` (a
turn cut at ``rollout.max_new_tokens`` too, as sampled). ``done`` (or ``task.max_turns`` model turns, or
``task.max_episode_tokens``: the episode is then truncated) ends the episode; its reward is the
last one ``step`` gave, or ``task.reward`` called on the whole conversation as ``f(messages,
item)`` when that is set. Rollouts are batched: every live episode's next turn is one
``engine.generate`` call.

**Token in, token out**: each turn's prompt is the previous ids + the ids sampled + the template's
ids for the new messages (:meth:`unison.chat.ChatTemplate.append_ids`); the completion carries
exactly those ids, with a mask that marks the model's tokens (only they carry log μ and are
trained on; unison/batch.py).

Faults: ``reset``, ``step`` or a tool that raises ends that episode with reward 0, counted like a
raising reward (``reward/error_count``; the run stops after ``task.reward_error_patience`` steps of
nothing but errors). A tool call the model got wrong (unknown name, unreadable, wrong arguments)
is answered with an error message as the tool result and counted in ``rollout/tool_errors``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass, field

from unison.batch import Completion
from unison.chat import ChatTemplate
from unison.chat import ToolCall
from unison.chat import ToolCallError
from unison.chat import resolve_template
from unison.chat import tool_schema
from unison.data_io import read_jsonl
from unison.errors import UnisonError
from unison.models import load_tokenizer
from unison.rollout.base import mix64, row_seeds
from unison.tasks import Item, Task, load_callable, split_holdout
from unison.tasks import task_class


class Env:
    """The interface (documentation; any class with these methods works)."""

    #: tool functions the model may call (JSON schemas from their signatures and docstrings)
    tools: list = []

    def reset(self, item: Item) -> list[dict]:
        """The first messages of the episode, e.g. ``[{"role": "user", "content": ...}]``."""
        raise NotImplementedError

    def step(self, text: str) -> tuple[list[dict], float | None, bool]:
        """The model's turn as text -> (new messages, reward or None, done)."""
        raise NotImplementedError


@dataclass
class EpisodeRecord:
    """What happened in one episode (``Completion.episode``), for rewards, logs and metrics."""

    #: the conversation as messages (what ``task.reward`` receives)
    messages: list[dict]
    #: ``(start, end, "model" | "env")`` spans of ``Completion.token_ids``, in order
    segments: list[tuple[int, int, str]] = field(default_factory=list)
    #: the indices in ``messages`` of the model's turns, in order (an environment may add assistant messages of
    #: its own: only these were sampled)
    model_messages: list[int] = field(default_factory=list)
    turns: int = 0
    #: model turns cut at rollout.max_new_tokens (the environment read them as they were)
    cut_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    #: why the episode failed (an environment or tool that raised): scored 0, counted
    error: str | None = None
    #: done | max_turns (still going after task.max_turns model turns) | episode_tokens (task.max_episode_tokens
    #: reached) | error
    end: str = "done"


@dataclass(frozen=True)
class EpisodeSpec:
    """Everything a process needs to run episodes (picklable: the async worker runs them)."""

    env: str
    tokenizer_dir: str
    template: str
    tools: tuple[str, ...]  # JSON schemas, as JSON text
    format: str | None
    max_turns: int
    max_episode_tokens: int
    model: str


_RUNTIMES: dict = {}


class _Runtime:
    """Per process and spec: the tokenizer, the template, the environment class."""

    def __init__(self, spec: EpisodeSpec):
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.tokenizer_dir)
        self.template = ChatTemplate(self.tokenizer, spec.template, [json.loads(t) for t in spec.tools], spec.model)
        self.template.format = spec.format
        self.env_cls = load_callable(spec.env, what="environment")
        self.env_name = getattr(self.env_cls, "__name__", spec.env)

    @classmethod
    def get(cls, spec: EpisodeSpec) -> _Runtime:
        if spec not in _RUNTIMES:
            _RUNTIMES[spec] = cls(spec)
        return _RUNTIMES[spec]


def _check_messages(msgs, where: str) -> list[dict]:
    if not isinstance(msgs, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
        raise TypeError(f"{where} must return a list of {{'role': str, 'content': str}} messages, got {msgs!r:.80}")
    return [dict(m) for m in msgs]


def _error(e: BaseException) -> str:
    msg = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {msg}"


class _Episode:
    def __init__(self, rt: _Runtime, item: Item, index: int, sample: int, seed: int):
        self.rt, self.item, self.index, self.sample, self.seed = rt, item, index, sample, seed
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        #: top-p / top-k: the support size each model token was sampled from (0 on the environment's tokens)
        self.support: list[int] = []
        self.record = EpisodeRecord(messages=[])
        self.finish_reason, self.done = "stop", False
        self.token_versions: list[int] = []  # the version of each token after the prompt (model and environment)
        self.version: int | None = None  # the first model turn's
        self.routing: list = []
        self.routed = 0
        #: a quantized KV cache: the scales of the first model turn (they hold until the engine's next weight sync)
        self.kv_scale = None
        try:
            self.env = rt.env_cls()
            self.record.messages = _check_messages(self.env.reset(item), f"{rt.env_name}.reset")
            self.tools = {getattr(f, "__name__", str(f)): f for f in (getattr(self.env, "tools", None) or ())}
            self.prompt = rt.template.prompt_ids(self.record.messages)
        except UnisonError:
            raise
        except Exception as e:  # noqa: BLE001 - the environment's bug: this episode scores 0
            self.prompt = [rt.tokenizer.eos_token_id or 0]
            self.fail(f"{rt.env_name}.reset raised {_error(e)}")
        self.ids = list(self.prompt)

    @property
    def room(self) -> int:
        """Tokens the episode may still add (model and environment) under task.max_episode_tokens."""
        return self.rt.spec.max_episode_tokens - (len(self.ids) - len(self.prompt))

    def _append(self, toks, lps, model: bool, support=None, versions=None) -> None:
        start = len(self.ids) - len(self.prompt)
        self.ids += toks
        # the environment's tokens: the version of the model token before them (nothing scores them)
        self.token_versions += versions if model else [self.token_versions[-1] if self.token_versions
                                                       else self.version or 0] * len(toks)
        self.logprobs += lps if model else [0.0] * len(toks)
        self.mask += [1 if model else 0] * len(toks)
        self.support += list(support) if support is not None else [0] * len(toks)
        if toks:
            self.record.segments.append((start, start + len(toks), "model" if model else "env"))

    def finish(self, reason: str, end: str) -> None:
        self.finish_reason, self.record.end, self.done = reason, end, True

    def fail(self, why: str) -> None:
        self.record.error = why
        self.finish("stop", "error")

    def model_turn(self, c, turn: int) -> None:
        """Take the turn the engine sampled; answer it (tools or ``step``); append what follows."""
        rt, tok = self.rt, self.rt.tokenizer
        toks, lps = list(c.token_ids), list(c.logprobs)
        sup = list(c.support) if c.support is not None else None  # sampling-mask replay needs it, turn by turn
        versions = c.versions_of_tokens()
        cut = len(toks) > self.room
        if cut:
            toks, lps, versions = toks[:self.room], lps[:self.room], versions[:self.room]
            sup = sup[:self.room] if sup is not None else None
        if c.routing is not None:  # the experts of the inputs this call fed for the first time
            upto = len(self.ids) + len(toks) - 1
            self.routing.append(c.routing[self.routed:upto])
            self.routed = upto
        self.version = c.version if self.version is None else self.version
        self.kv_scale = c.kv_scale if self.kv_scale is None else self.kv_scale
        self._append(toks, lps, model=True, support=sup, versions=versions)
        self.record.turns += 1
        self.record.model_messages.append(len(self.record.messages))  # the message this turn becomes
        if cut or not toks:  # task.max_episode_tokens: nothing more fits
            self.record.messages.append({"role": "assistant", "content": tok.decode(toks, skip_special_tokens=False)})
            return self.finish("length", "episode_tokens")
        if c.finish_reason == "length":  # cut at rollout.max_new_tokens: the environment still reads it, and the
            text, stop_text = tok.decode(toks, skip_special_tokens=False), None  # template's whole closing follows
            self.record.cut_turns += 1
        else:
            text = tok.decode(toks[:-1], skip_special_tokens=False)  # the stop token is the template's closing
            stop_text = tok.decode(toks[-1:], skip_special_tokens=False)
        self.record.messages.append({"role": "assistant", "content": text})
        new = self._answer(text)
        if self.done:
            return
        if turn + 1 >= rt.spec.max_turns:  # no turn left to read what would be appended
            return self.finish("length", "max_turns")
        try:
            delta = rt.template.append_ids(self.record.messages, new, stop_text, turn)
        except UnisonError as e:
            return self.fail(str(e))
        if len(delta) >= self.room:
            return self.finish("length", "episode_tokens")
        self.record.messages += new
        self._append(delta, [], model=False)

    def _answer(self, text: str) -> list[dict]:
        """Tool results for a turn that calls tools, else the environment's step (which may end it)."""
        rt, rec = self.rt, self.record
        try:
            calls = rt.template.parse(text) if self.tools else None
        except ToolCallError as e:
            rec.tool_calls += 1
            rec.tool_errors += 1
            return [{"role": "tool", "name": "error", "content": f"error: {e}"}]
        if calls:
            out = []
            for call in calls:
                out.append({"role": "tool", "name": call.name, "content": self._run_tool(call)})
                if self.done:
                    return []
            return out
        try:
            result = self.env.step(text)
            if not (isinstance(result, tuple) and len(result) == 3):
                raise TypeError(f"{rt.env_name}.step must return (messages, reward or None, done), got {result!r:.80}")
            new, reward, done = result
            new = _check_messages(new, f"{rt.env_name}.step")
            if reward is not None:
                rec.reward = float(reward)
        except Exception as e:  # noqa: BLE001 - the environment's bug: this episode scores 0
            self.fail(f"{rt.env_name}.step raised {_error(e)}")
            return []
        if done:
            self.finish("stop", "done")
        return new

    def _run_tool(self, call) -> str:
        rec = self.record
        rec.tool_calls += 1
        fn = self.tools.get(call.name)
        if fn is None:
            rec.tool_errors += 1
            return f"error: unknown tool '{call.name}'; the tools are {', '.join(sorted(self.tools))}"
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            rec.tool_errors += 1
            return f"error: {call.name}: {e}"
        try:
            out = fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - a raising tool fails the episode (counted like a reward)
            rec.tool_errors += 1
            self.fail(f"tool {call.name} raised {_error(e)}")
            return ""
        return out if isinstance(out, str) else json.dumps(out)

    def completion(self):
        import torch

        n = len(self.prompt)
        return Completion(prompt_ids=list(self.prompt), token_ids=self.ids[n:], logprobs=self.logprobs,
                          finish_reason=self.finish_reason, prompt_index=self.index, sample_index=self.sample,
                          routing=torch.cat(self.routing) if self.routing else None,
                          version=self.version or 0, mask=self.mask, episode=self.record,
                          token_versions=self.token_versions if len(set(self.token_versions)) > 1 else None,
                          support=self.support if any(self.support) else None, kv_scale=self.kv_scale)


@dataclass
class Episodes:
    """A batch of episodes to run (what a job carries instead of prompt ids): ``run`` drives the engine
    turn by turn. ``params.n`` episodes per item (a GRPO group), seeded as the engines seed samples."""

    spec: EpisodeSpec
    items: list[Item]

    def __len__(self) -> int:
        return len(self.items)

    def run(self, engine, params) -> list:
        rt = _Runtime.get(self.spec)
        seeds = row_seeds(params, len(self.items))
        eps = [_Episode(rt, item, j, s, seeds[j * params.n + s])
               for j, item in enumerate(self.items) for s in range(params.n)]
        for turn in range(self.spec.max_turns):
            live = [e for e in eps if not e.done]
            if not live:
                break
            p = dataclasses.replace(params, n=1, max_tokens=max(1, min(params.max_tokens, max(e.room for e in live))),
                                    prompt_seeds=tuple(mix64(e.seed, turn) for e in live))
            for e, c in zip(live, engine.generate([list(e.ids) for e in live], p)):
                e.model_turn(c, turn)
        for e in eps:
            if not e.done:
                e.finish("length", "max_turns")
        return [e.completion() for e in eps]


def episode_metrics(records: list[EpisodeRecord]) -> dict[str, float]:
    """``rollout/turns_mean`` (model turns per episode), ``rollout/tool_calls_mean``, ``rollout/tool_errors``
    (tool calls that failed, this step), ``rollout/env_errors`` (episodes an environment or tool ended),
    ``rollout/cut_turns_fraction`` (model turns cut at rollout.max_new_tokens)."""
    if not records:
        return {}
    n = len(records)
    return {"rollout/turns_mean": sum(r.turns for r in records) / n,
            "rollout/cut_turns_fraction": sum(r.cut_turns for r in records) / max(sum(r.turns for r in records), 1),
            "rollout/tool_calls_mean": sum(r.tool_calls for r in records) / n,
            "rollout/tool_errors": sum(r.tool_errors for r in records),
            "rollout/env_errors": sum(r.error is not None for r in records)}


def with_model_tokens(completions, rewards):
    """The completions the learner can train on, with their rewards: an episode that failed before the
    model's first turn (its ``reset`` raised) has no token to score (its reward was counted)."""
    keep = [i for i, c in enumerate(completions) if c.num_sampled]
    if len(keep) == len(completions):
        return completions, rewards
    return [completions[i] for i in keep], [rewards[i] for i in keep]


def is_multi_turn(cfg) -> bool:
    """The config's task is multi-turn (its class says so: :attr:`unison.tasks.Task.multi_turn`)."""
    return task_class(cfg.task.name).multi_turn


def model_token_budget(cfg) -> int:
    """The most tokens the model samples in one response or episode (Dr.GRPO's constant normaliser)."""
    if not is_multi_turn(cfg):
        return cfg.rollout.max_new_tokens
    return min(cfg.task.max_turns * cfg.rollout.max_new_tokens, cfg.task.max_episode_tokens)


def tokens_after_prompt(cfg) -> int:
    """The most tokens a sequence has after its (first) prompt: the response, or the episode's turns."""
    return cfg.task.max_episode_tokens if is_multi_turn(cfg) else cfg.rollout.max_new_tokens


# ----------------------------------------------------------------------------- tasks
class EnvTask(Task):
    """``task.name: env``: items from ``task.path`` (JSONL rows, every field reaches ``reset``),
    the environment ``task.env``."""

    name = "env"
    multi_turn = True

    def __init__(self, cfg, items: list[Item] | None = None, env: str | None = None):
        self.cfg = cfg
        self.env = env or cfg.env
        if not self.env:
            raise UnisonError(f"task.name is '{cfg.name}' but task.env is not set: name your environment class, "
                              f"e.g. task.env=my_env:MyEnv (docs/tasks.md, 'Multi-turn environments and tools')")
        self.env_cls = load_callable(self.env, what="environment")
        self.env_name = getattr(self.env_cls, "__name__", self.env)
        for meth in ("reset", "step"):
            if not callable(getattr(self.env_cls, meth, None)):
                raise UnisonError(f"environment {self.env} has no {meth}() method: see the interface in "
                                  f"unison/tasks/env.py (reset(item) -> messages, step(text) -> (messages, "
                                  f"reward, done))")
        try:
            probe = self.env_cls()
        except Exception as e:  # noqa: BLE001
            raise UnisonError(f"environment {self.env} cannot be created with no arguments ({_error(e)}): "
                              f"give its __init__ defaults for everything") from None

        self.tool_schemas = [tool_schema(f) for f in (getattr(probe, "tools", None) or ())]
        if items is None:
            if not cfg.path:
                raise UnisonError("task.name is 'env' but task.path is not set: point it at a JSONL file of the "
                                  "items your environment's reset(item) takes")
            items = _rows(cfg.path)
            if cfg.eval_path:
                self.train, self.eval = items, _rows(cfg.eval_path)
            else:
                self.train, self.eval = split_holdout(items, cfg.eval_size, cfg.seed)
        self.template = None
        self.spec: EpisodeSpec | None = None
        #: what resolving the chat template said (printed at start), e.g. that a built-in one is used
        self.template_note: str | None = None

    # ------------------------------------------------------------------ start-up
    def prepare(self, tokenizer, model: str | None = None):
        """Choose and check the chat template for this tokenizer (one-line refusals at start-up); ``model``
        names the model in them (default: its directory's name)."""
        if self.template is not None:
            return self.template
        from pathlib import Path

        model = model or Path(str(tokenizer.name_or_path)).name

        text, self.template_note = resolve_template(tokenizer, self.cfg.chat_template, bool(self.tool_schemas), model)
        self.template = ChatTemplate(tokenizer, text, self.tool_schemas, model).prepare()
        self.spec = EpisodeSpec(self.env, str(tokenizer.name_or_path), text,
                                tuple(json.dumps(s) for s in self.tool_schemas), self.template.format,
                                self.cfg.max_turns, self.cfg.max_episode_tokens, model)
        return self.template

    def first_messages(self, item: Item) -> list[dict]:
        try:
            return _check_messages(self.env_cls().reset(item), f"{self.env_name}.reset")
        except Exception as e:  # noqa: BLE001 - at start-up: a one-line refusal naming the item
            where = item.meta.get("source") or "an item"
            raise UnisonError(f"environment {self.env}: reset({where}) raised {_error(e)}: fix the environment "
                              f"or the item") from None

    def encode(self, tokenizer, item: Item) -> list[int]:
        """The first prompt's ids (the template's rendering of ``reset(item)``)."""
        return self.prepare(tokenizer).prompt_ids(self.first_messages(item))

    def episodes(self, items: list[Item]) -> Episodes:
        if self.spec is None:
            raise RuntimeError("EnvTask.prepare(tokenizer) must run before episodes")
        return Episodes(self.spec, list(items))

    def score(self, messages, item: Item) -> float:
        raise ValueError(f"the environment {self.env_name} ended the episode without a reward and task.reward is "
                         f"not set: return a reward from step() when done, or set task.reward")

    # ------------------------------------------------------------------ warm start
    def demonstration_ids(self, tokenizer, item: Item) -> tuple[list[int], list[int]] | None:
        """A supervised demonstration as ``(ids, mask)`` (1 on the model's tokens), from the environment's
        ``demonstration(item)``: the messages after ``reset``, assistant turns as text or as
        ``{"role": "assistant", "tool_calls": [{"name": ..., "arguments": {...}}]}``. Built with the same
        token-in/token-out path as the episodes; None when the environment has no demonstrations."""
        demo = getattr(self.env_cls, "demonstration", None)
        if demo is None:
            return None
        t = self.prepare(tokenizer)
        history = self.first_messages(item)
        ids = t.prompt_ids(history)
        mask = [0] * len(ids)
        eos = tokenizer.eos_token_id
        stop_text = tokenizer.decode([eos], skip_special_tokens=False)
        turns = list(demo(item))
        for k, m in enumerate(turns):
            if m["role"] != "assistant":
                continue
            calls = [ToolCall(c["name"], dict(c["arguments"])) for c in m.get("tool_calls") or ()]
            text = t.call_text(calls) if calls else m["content"]
            turn = t.ids(text) + [eos]
            ids, mask = ids + turn, mask + [1] * len(turn)
            history = history + [{"role": "assistant", "content": text}]
            new = []
            for x in turns[k + 1:]:
                if x["role"] == "assistant":
                    break
                new.append(x)
            if k + 1 + len(new) < len(turns):
                delta = t.append_ids(history, new, stop_text, k)
                ids, mask = ids + delta, mask + [0] * len(delta)
                history = history + new
        return ids, mask


def _rows(path: str) -> list[Item]:
    lines: list[int] = []
    rows = read_jsonl(path, line_numbers=lines)
    return [Item(prompt=str(r.get("prompt", "")), answer="" if r.get("answer") is None else str(r["answer"]),
                 meta={"source": f"{path}:{n}"}, fields=dict(r)) for r, n in zip(rows, lines)]


def describe(task: EnvTask, cfg) -> str:
    """The start-up line of a multi-turn run."""
    t = task.template
    tools = f", tools {', '.join(s['function']['name'] for s in task.tool_schemas)} (calls read as {t.format})" \
        if task.tool_schemas else ""
    note = f"; {task.template_note}" if task.template_note else ""
    return (f"[train] episodes of {task.env}: up to {cfg.task.max_turns} model turns of at most "
            f"{cfg.rollout.max_new_tokens} tokens, {cfg.task.max_episode_tokens} tokens after the first prompt"
            f"{tools}; token in / token out, the chat template checked prefix-preserving{note}")
