"""Bring your own task: prompts from JSONL, your reward function (``task.name: jsonl``).

Each row needs ``prompt`` (or ``problem``); ``answer`` is optional; every other field is kept and
reaches the reward function as ``item.fields`` (``item["difficulty"]``). The prompt goes to the
model as written — through the model's chat template when it has one — or through
``task.template`` when you set one (``{prompt}`` and any field of the row, e.g.
``"Q: {prompt}\\nA:"``). There is no built-in verifier: ``task.reward: module:function`` scores
each response, called as ``f(response: str, item: Item) -> float``.
"""

from __future__ import annotations

from unison.data_io import read_jsonl
from unison.errors import UnisonError
from unison.tasks import Item, Task, split_holdout
from unison.tasks.math import MATH_TEMPLATE


def _items(path: str, template: str | None) -> list[Item]:
    lines: list[int] = []
    rows = read_jsonl(path, {"prompt": str}, {"prompt": ("problem",)}, line_numbers=lines)
    items = []
    for row, n in zip(rows, lines):
        prompt = row["prompt"]
        if template:
            try:
                prompt = template.format(**row)
            except (KeyError, IndexError, ValueError) as e:
                raise UnisonError(f"{path}:{n}: task.template {template!r} does not fit this row ({type(e).__name__}: "
                                  f"{e}): use {{prompt}} and the row's fields {sorted(row)}") from e
        answer = row.get("answer")
        items.append(Item(prompt=prompt, answer="" if answer is None else str(answer),
                          meta={"source": f"{path}:{n}"}, fields=dict(row)))
    return items


class JsonlTask(Task):
    name = "jsonl"

    def __init__(self, path: str, eval_path: str | None = None, eval_size: int = 0, template: str | None = None,
                 seed: int = 0):
        # None: the prompts as written (a config.yaml written before the default became None holds the math one)
        self.template = None if not template or template == MATH_TEMPLATE else template
        items = _items(path, self.template)
        if eval_path:
            self.train, self.eval = items, _items(eval_path, self.template)
        else:
            self.train, self.eval = split_holdout(items, eval_size, seed)

    def score(self, response: str, item: Item) -> float:  # pragma: no cover - task.reward is required
        raise UnisonError("task 'jsonl' has no built-in verifier: set task.reward=module:function")
