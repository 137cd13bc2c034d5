"""``task.name: calculator``: arithmetic the model solves with a ``calc(expression)`` tool, then answers.

An item is a problem ``a OP b`` with operands of ``task.digits`` digits (``task.operators``;
generated from ``task.seed``, nothing downloaded). The episode: the user asks, the model calls
``calc`` in its chat template's tool-call format, reads the result, and answers with the number
alone. Reward 1 when the answer is the exact result *and* the model called ``calc`` with an
expression that has that value; 0 otherwise — so guessing without the tool earns nothing.

Demonstrations for ``unison sft`` (:meth:`CalculatorEnv.demonstration`): the call with the
problem's expression, the tool's result, the answer; with ``task.style: mixed`` half of them answer
directly instead (``direct``: all), so the warm-started model uses the tool only some of the time and
RL has something to learn: when to call it.
"""

from __future__ import annotations

import ast
import operator
import random

from unison.errors import UnisonError
from unison.tasks import Item
from unison.tasks.env import EnvTask

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only integers, +, - and * are allowed")


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: the expression, e.g. 12*34
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return str(_eval(tree.body))
    except (SyntaxError, ValueError, RecursionError) as e:  # the model's mistake: it reads the error
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"


class CalculatorEnv:
    """One episode of the calculator task. Its ``calc`` tool is a method, so the episode sees every
    result it returned; the turn without a tool call is the answer (``step``), which ends the episode."""

    def __init__(self):
        self.results: list[str] = []
        self.tools = [self.calc]

    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers with +, - and *.

        Args:
            expression: the expression, e.g. 12*34
        """
        out = calc(expression)
        self.results.append(out)
        return out

    def reset(self, item: Item) -> list[dict]:
        self.answer = item.answer
        return [{"role": "user", "content": item.prompt}]

    def step(self, text: str):
        """Reward 1 when the answer is the exact result and a calc call returned it; the episode ends."""
        return [], 1.0 if text.strip() == self.answer and self.answer in self.results else 0.0, True

    @staticmethod
    def demonstration(item: Item) -> list[dict]:
        """The turns after ``reset`` for ``unison sft``: the call, its result, the answer — or, for an item
        marked ``demo: direct`` (``task.style``), the answer alone, as a model that does not use the tool."""
        expr = item.prompt
        if item.get("demo") == "direct":
            return [{"role": "assistant", "content": item.answer}]
        return [{"role": "assistant", "tool_calls": [{"name": "calc", "arguments": {"expression": expr}}]},
                {"role": "tool", "name": "calc", "content": calc(expr)},
                {"role": "assistant", "content": item.answer}]


class CalculatorTask(EnvTask):
    name = "calculator"

    def __init__(self, cfg):
        ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
        lo, hi = (0, 9) if cfg.digits == 1 else (10 ** (cfg.digits - 1), 10**cfg.digits - 1)
        space = (hi - lo + 1) ** 2 * len(cfg.operators)
        if cfg.train_size + cfg.eval_size > space:
            raise UnisonError(f"calculator with {cfg.digits} digit(s) and {''.join(cfg.operators)} has only "
                              f"{space} distinct problems, fewer than task.train_size + task.eval_size: lower them "
                              f"or add digits")
        rng, seen, items = random.Random(cfg.seed), set(), []
        while len(items) < cfg.train_size + cfg.eval_size:
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(list(cfg.operators))
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            direct = cfg.style == "direct" or (cfg.style == "mixed" and rng.random() < 0.5)
            items.append(Item(prompt=f"{a}{op}{b}", answer=str(ops[op](a, b)),
                              meta={"source": f"calculator problem {len(items)}"},
                              fields={"demo": "direct" if direct else "tool"}))
        super().__init__(cfg, items=items, env=cfg.env or "unison.tasks.calculator:CalculatorEnv")
        self.train, self.eval = items[:cfg.train_size], items[cfg.train_size:]
