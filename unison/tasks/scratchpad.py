"""Long answers that can grow: chained sums with the working written out.

``12+34+56+78=`` is answered with one line per partial sum and the result after
``#``::

    12+34=46
    46+56=102
    102+78=180
    #180

With 7 two-digit operands a worked answer is 60–80 characters (tokens of the
built-in character tokenizer); the bare answer (``#180``) is 4. The verifier reads
only what follows the last ``#``: the working is free, and it is where a small
model gets the sum right. ``style`` sets what supervised warm start demonstrates:
``full`` (always the working), ``direct`` (the bare answer), or ``mixed`` (half of
the problems each way, by a hash of the prompt) — after a mixed warm start the
model can answer either way, and RL can lengthen its answers if the working pays
(Paper B's surge in response length).
"""

from __future__ import annotations

import random
import re
import zlib

from unison.data_io import read_jsonl
from unison.errors import UnisonError
from unison.tasks import Item, Task

_PROMPT = re.compile(r"^\s*(\d+(?:\+\d+)+)=\s*$")


def operands_of(prompt: str) -> list[int]:
    m = _PROMPT.match(prompt)
    if not m:
        raise UnisonError(f"scratchpad prompt {prompt!r} is not a chained sum like '12+34+56=': fix the data file")
    return [int(x) for x in m.group(1).split("+")]


def working(ops: list[int]) -> str:
    """The worked answer: one line per partial sum, then ``#total``."""
    lines, acc = [], ops[0]
    for x in ops[1:]:
        lines.append(f"{acc}+{x}={acc + x}")
        acc += x
    return "\n".join(lines) + f"\n#{acc}"


class ScratchpadTask(Task):
    name = "scratchpad"

    def __init__(self, operands: int = 7, digits: int = 2, train_size: int = 2000, eval_size: int = 200,
                 seed: int = 0, style: str = "full", path: str | None = None):
        if operands < 2:
            raise UnisonError(f"task.operands={operands}: a chained sum needs at least 2 operands")
        self.style = style
        lo, hi = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
        rng = random.Random(seed)
        seen, items = set(), []
        while len(items) < train_size + eval_size:
            ops = tuple(rng.randint(lo, hi) for _ in range(operands))
            if ops in seen:
                continue
            seen.add(ops)
            items.append(Item(prompt="+".join(map(str, ops)) + "=", answer=str(sum(ops))))
        self.train, self.eval = items[:train_size], items[train_size:]
        if path:  # a fixed prompt set (e.g. from `unison filter`) replaces the generated train split
            lines: list[int] = []
            rows = read_jsonl(path, {"prompt": str, "answer": (str, int)}, line_numbers=lines)
            self.train = []
            for r, n in zip(rows, lines):
                if sum(operands_of(r["prompt"])) != int(r["answer"]):
                    raise UnisonError(f"{path}:{n}: answer {r['answer']} is not the sum of the prompt: fix that row")
                self.train.append(Item(prompt=r["prompt"], answer=str(r["answer"]), meta={"source": f"{path}:{n}"}))
            taken = {it.prompt for it in self.train}
            self.eval = [it for it in self.eval if it.prompt not in taken]

    def demonstration(self, item: Item) -> str:
        ops = operands_of(item.prompt)
        worked = self.style == "full" or (self.style == "mixed" and zlib.crc32(item.prompt.encode()) % 2 == 0)
        return working(ops) if worked else f"#{sum(ops)}"

    def score(self, response: str, item: Item) -> float:
        if "#" not in response:
            return 0.0
        return 1.0 if response.rsplit("#", 1)[1].strip() == item.answer else 0.0
