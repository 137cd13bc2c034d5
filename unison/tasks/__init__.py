"""Tasks: prompts with reference answers, and a verifier that turns a response into a reward.

``make_task(cfg)`` builds one from a :class:`unison.config.TaskConfig`.
Rewards go through :class:`RewardFn`, which scores truncated responses with
``truncated_reward`` and counts (never raises) verifier errors.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from unison.errors import UnisonError


@dataclass
class Item:
    """One problem, as a reward function receives it: ``item.prompt`` (the text before any chat
    template), ``item.answer`` (the reference, ``""`` when the data has none) and, for data read
    from JSONL, every field of its row in ``item.fields``. ``item["answer"]``, ``item["my_field"]``
    and ``item.get("my_field", default)`` read the row's fields (and ``prompt``/``answer``)."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)

    def __getitem__(self, key: str):
        if key in self.fields:
            return self.fields[key]
        if key in ("prompt", "answer"):
            return getattr(self, key)
        raise KeyError(f"{key!r}: this item's fields are {sorted({'prompt', 'answer', *self.fields})}")

    def get(self, key: str, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return key in self.fields or key in ("prompt", "answer")


def eval_holdout(n_rows: int, eval_size: int) -> int:
    """Rows held out for eval when ``task.eval_path`` is not given: ``eval_size``, but never
    more than a tenth of the file (rounded down), so a small file stays training data."""
    return max(0, min(eval_size, n_rows // 10))


def split_holdout(items: list, eval_size: int, seed: int) -> tuple[list, list]:
    """``(train, eval)`` of a file's rows: :func:`eval_holdout` of them, by a shuffle seeded with ``seed``, are held
    out for eval; the rest train, in the shuffled order."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    k = eval_holdout(len(items), eval_size)
    return [items[i] for i in order[k:]], [items[i] for i in order[:k]]


class Task:
    """A task has a train split, an eval split and a verifier ``score(response, item)``."""

    name = "task"
    #: its items are multi-turn episodes (unison/tasks/env.py): run turn by turn, not as prompts
    multi_turn = False
    train: list[Item]
    eval: list[Item]

    def score(self, response: str, item: Item) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def encode(self, tokenizer, item: Item) -> list[int]:
        """Prompt token ids: through the chat template when the tokenizer has one."""
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": item.prompt}],
                                                add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(tokenizer(item.prompt)["input_ids"])

    def demonstration(self, item: Item) -> str:
        """The target text for supervised warm start."""
        return item.answer


class RewardFn:
    """Wraps a verifier: truncated responses get ``truncated_reward``; a raising verifier scores 0."""

    def __init__(self, task: Task, custom: Callable | None = None, truncated_reward: float | None = 0.0):
        self.task = task
        self.custom = custom
        self.fn = custom or task.score
        self.truncated_reward = truncated_reward
        #: verifier calls made and calls that raised (cumulative; truncated responses scored with
        #: ``truncated_reward`` make no call), and the last error, for the console
        self.calls = 0
        self.errors = 0
        self.last_error: str | None = None

    def __call__(self, response: str, item: Item, truncated: bool) -> float:
        if truncated and self.truncated_reward is not None:
            return float(self.truncated_reward)
        self.calls += 1
        try:
            return float(self.fn(response, item))
        except Exception as e:  # noqa: BLE001 - a reward bug must never kill the run mid-step
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:200]
            return 0.0

    def score_completions(self, completions, items: list[Item], tokenizer) -> list[float]:
        """Reward of each completion against ``items[c.prompt_index]`` (text decoded
        without special tokens; finished by max tokens counts as truncated)."""
        return [self.score_episode(c, items[c.prompt_index]) if c.episode is not None else
                self(tokenizer.decode(c.token_ids, skip_special_tokens=True), items[c.prompt_index],
                     c.finish_reason == "length") for c in completions]

    def score_episode(self, c, item: Item) -> float:
        """A multi-turn episode (unison/tasks/env.py): one that an environment or tool ended by raising
        scores 0 and counts as a call that raised; a truncated one scores ``truncated_reward``; else
        ``task.reward(messages, item)`` when set, or the reward the environment gave."""
        ep, truncated = c.episode, c.finish_reason == "length"
        if ep.error is not None:
            self.calls += 1
            self.errors += 1
            self.last_error = ep.error[:200]
            return 0.0
        if self.custom is not None:
            return self(ep.messages, item, truncated)
        if truncated and self.truncated_reward is not None:
            return float(self.truncated_reward)
        if ep.reward is not None:
            self.calls += 1
            return float(ep.reward)
        if truncated:  # nothing graded it: no reward from the environment, no task.reward
            return 0.0
        return self(ep.messages, item, False)  # the task's score: says that nothing gives a reward


def load_callable(spec: str, what: str = "reward") -> Callable:
    """``module:function`` or ``path/to/file.py:function`` -> the function (UnisonError naming
    what is missing); ``what`` names it in errors (``environment``: ``module:Class``). A config's
    ``module:function`` whose ``module.py`` sits next to the config file is turned into the file's
    path when the config is read (unison/config/load.py)."""
    kind = "Class" if what == "environment" else "function"
    if ":" not in spec:
        example = "my_env:MyEnv" if what == "environment" else "my_rewards:exact_match"
        raise UnisonError(f"{what} '{spec}' is not module:{kind}: write e.g. {example}")
    mod_name, fn_name = spec.rsplit(":", 1)
    try:
        if mod_name.endswith(".py"):
            mod = _import_file(mod_name)
        else:
            mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is not None and mod_name != e.name and not mod_name.startswith(e.name + "."):
            raise UnisonError(f"{what} module '{mod_name}' does not import: it needs '{e.name}', "
                              f"which is not installed") from e
        key = "env" if what == "environment" else "reward"
        raise UnisonError(f"cannot import {what} module '{mod_name}' ({e}): put {mod_name.split('.')[0]}.py next to "
                          f"the config file, give its path (task.{key}=path/to/file.py:{kind}), or put it on "
                          f"PYTHONPATH") from e
    except Exception as e:  # noqa: BLE001 - a SyntaxError or a raising module body is the user's
        where = f" ({e.filename}:{e.lineno})" if isinstance(e, SyntaxError) else ""
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        raise UnisonError(f"{what} module '{mod_name}' does not import{where}: {type(e).__name__}: "
                          f"{msg}; fix the module") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise UnisonError(f"{what} '{spec}': module '{mod_name}' has no {kind.lower()} '{fn_name}'")
    return fn


def _import_file(path: str):
    import importlib.util
    import sys
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ModuleNotFoundError(f"no file {path}", name=p.stem)
    name = f"unison_reward_{p.stem}"
    spec = importlib.util.spec_from_file_location(name, p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    sys.path.insert(0, str(p.parent))  # the module's own imports of its neighbours
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(p.parent))
    return mod


#: task name -> the class that builds it (``module:Class``, imported when asked for)
TASKS = {"arithmetic": "unison.tasks.arithmetic:ArithmeticTask", "scratchpad": "unison.tasks.scratchpad:ScratchpadTask",
         "math": "unison.tasks.math:MathTask", "jsonl": "unison.tasks.jsonl:JsonlTask",
         "reasoning_gym": "unison.tasks.gym:ReasoningGymTask", "env": "unison.tasks.env:EnvTask",
         "calculator": "unison.tasks.calculator:CalculatorTask", "guess_number": "unison.tasks.guess:GuessNumberTask"}


def task_class(name: str) -> type[Task]:
    """The class of task ``name`` (what a config can ask about it before the task is built: ``multi_turn``)."""
    if name not in TASKS:
        raise UnisonError(f"unknown task '{name}': choose {', '.join(list(TASKS)[:-1])} or {list(TASKS)[-1]}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_task(cfg, evaluate: bool = True) -> Task:
    """The task ``cfg`` names. ``evaluate=False`` (a run that never evaluates: ``train.eval_every`` 0,
    ``unison filter``): a jsonl task keeps every row of its file for training instead of holding some out."""
    if cfg.name == "arithmetic":
        from unison.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(digits=cfg.digits, operators=cfg.operators, train_size=cfg.train_size,
                              eval_size=cfg.eval_size, seed=cfg.seed, path=cfg.path)
    if cfg.name == "scratchpad":
        from unison.tasks.scratchpad import ScratchpadTask

        return ScratchpadTask(operands=cfg.operands, digits=cfg.digits, train_size=cfg.train_size,
                              eval_size=cfg.eval_size, seed=cfg.seed, style=cfg.style, path=cfg.path)
    if cfg.name == "math":
        from unison.tasks.math import MathTask

        if not cfg.path:
            raise UnisonError("task.name is 'math' but task.path is not set: "
                              "point it at a JSONL file of {problem, answer} rows")
        return MathTask(cfg.path, eval_path=cfg.eval_path, eval_size=cfg.eval_size,
                        template=cfg.template, seed=cfg.seed)
    if cfg.name == "jsonl":
        from unison.tasks.jsonl import JsonlTask

        if not cfg.path:
            raise UnisonError("task.name is 'jsonl' but task.path is not set: point it at a JSONL file with a "
                              "'prompt' (or 'problem') field per row")
        if not cfg.reward:
            raise UnisonError("task.name is 'jsonl' but task.reward is not set: name your reward function, "
                              "e.g. task.reward=my_reward:score (docs/tasks.md, 'Bring your own task')")
        return JsonlTask(cfg.path, eval_path=cfg.eval_path, eval_size=cfg.eval_size if evaluate else 0,
                         template=cfg.template, seed=cfg.seed)
    if cfg.name == "reasoning_gym":
        from unison.tasks.gym import ReasoningGymTask

        if not cfg.dataset:
            raise UnisonError("task.name is 'reasoning_gym' but task.dataset is not set: "
                              "name a reasoning-gym dataset, e.g. basic_arithmetic")
        return ReasoningGymTask(cfg.dataset, train_size=cfg.train_size, eval_size=cfg.eval_size,
                                seed=cfg.seed)
    if cfg.name == "env":
        from unison.tasks.env import EnvTask

        return EnvTask(cfg)
    if cfg.name == "calculator":
        from unison.tasks.calculator import CalculatorTask

        return CalculatorTask(cfg)
    if cfg.name == "guess_number":
        from unison.tasks.guess import GuessNumberTask

        return GuessNumberTask(cfg)
    raise UnisonError(f"unknown task '{cfg.name}': choose arithmetic, scratchpad, math, jsonl, reasoning_gym, env, "
                      f"calculator or guess_number")


def make_reward(task: Task, cfg) -> RewardFn:
    custom = load_callable(cfg.reward) if cfg.reward else None
    return RewardFn(task, custom=custom, truncated_reward=cfg.truncated_reward)
