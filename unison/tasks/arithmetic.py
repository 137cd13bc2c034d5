"""Built-in arithmetic: ``a OP b=`` -> the exact result. Deterministic from a seed."""

from __future__ import annotations

import random

from unison.data_io import read_jsonl
from unison.errors import UnisonError
from unison.tasks import Item, Task

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask(Task):
    """Operands have exactly ``digits`` digits (1 digit: 0–9). The train and eval
    splits are disjoint sets of distinct problems. Exact-match verifier: the
    response, stripped of surrounding whitespace, must equal the result."""

    name = "arithmetic"

    def __init__(self, digits: int = 2, operators=("+",), train_size: int = 2000, eval_size: int = 200,
                 seed: int = 0, path: str | None = None):
        lo, hi = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
        ops = list(operators)
        space = (hi - lo + 1) ** 2 * len(ops)
        if train_size + eval_size > space:
            raise UnisonError(f"arithmetic with {digits} digit(s) and {''.join(ops)} has only {space} "
                              f"distinct problems, fewer than task.train_size + task.eval_size "
                              f"= {train_size + eval_size}: lower them or add digits")
        rng = random.Random(seed)
        seen, problems = set(), []
        while len(problems) < train_size + eval_size:
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            problems.append(Item(prompt=f"{a}{op}{b}=", answer=str(_OPS[op](a, b))))
        self.train, self.eval = problems[:train_size], problems[train_size:]
        if path:  # a fixed prompt set (e.g. from `unison filter`) replaces the generated train split
            lines: list[int] = []
            rows = read_jsonl(path, {"prompt": str, "answer": (str, int)}, line_numbers=lines)
            self.train = [Item(prompt=r["prompt"], answer=str(r["answer"]), meta={"source": f"{path}:{n}"})
                          for r, n in zip(rows, lines)]
            taken = {it.prompt for it in self.train}
            self.eval = [it for it in self.eval if it.prompt not in taken]

    def score(self, response: str, item: Item) -> float:
        return 1.0 if response.strip() == item.answer else 0.0
