"""Math word problems from JSONL (``problem``, ``answer``), graded with math-verify."""

from __future__ import annotations

import random

from unison.data_io import read_jsonl
from unison.errors import UnisonError
from unison.tasks import Item, Task


class MathTask(Task):
    """Prompt = ``template.format(problem=...)`` (inside the chat template when the
    tokenizer has one). A response scores 1 when math-verify finds its final
    answer equal to the reference, else 0."""

    name = "math"

    def __init__(self, path: str, eval_path: str | None = None, eval_size: int = 0,
                 template: str = "{problem}", seed: int = 0):
        try:
            import math_verify  # noqa: F401
        except ImportError as e:
            raise UnisonError("the math task needs math-verify: pip install 'math-verify==0.9.0'") from e
        rows = read_jsonl(path, {"problem": str, "answer": (str, int, float)})
        items = [Item(prompt=template.format(problem=r["problem"]), answer=str(r["answer"])) for r in rows]
        if eval_path:
            ev = read_jsonl(eval_path, {"problem": str, "answer": (str, int, float)})
            self.train = items
            self.eval = [Item(prompt=template.format(problem=r["problem"]), answer=str(r["answer"]))
                         for r in ev]
        else:
            order = list(range(len(items)))
            random.Random(seed).shuffle(order)
            k = min(eval_size, len(items) - 1)
            self.eval = [items[i] for i in order[:k]]
            self.train = [items[i] for i in order[k:]]
        self._gold = {}

    def score(self, response: str, item: Item) -> float:
        from math_verify import parse, verify

        gold = self._gold.get(item.answer)
        if gold is None:
            ans = item.answer
            gold = parse(ans if "\\boxed" in ans else "\\boxed{" + ans + "}")
            self._gold[item.answer] = gold
        return 1.0 if verify(gold, parse(response)) else 0.0

    def demonstration(self, item: Item) -> str:
        return f"The answer is $\\boxed{{{item.answer}}}$."
