"""``task.name: guess_number``: find a secret number from "higher" / "lower" replies, in few turns.

An item is a secret in 1..10^digits − 1 (``task.digits``, generated from ``task.seed``). The user
states the range; each model turn is a guess (the first integer in it); the environment replies
"higher", "lower" or ends the episode when the guess is right. Reward: 1 − (turns − 1) /
``task.max_turns`` when solved (1 for a first-turn hit), 0 when the turns run out (the episode is
then truncated and scores ``task.truncated_reward``). Binary search needs ⌈log2(10^digits)⌉ turns.
"""

from __future__ import annotations

import random
import re

from unison.errors import UnisonError
from unison.tasks import Item
from unison.tasks.env import EnvTask

class GuessNumberEnv:
    """One game."""

    def reset(self, item: Item) -> list[dict]:
        self.secret, self.hi, self.turns = int(item.answer), int(item["hi"]), 0
        self.max_turns = int(item.get("max_turns", 8))
        return [{"role": "user", "content": f"I am thinking of a whole number from 1 to {self.hi}. Guess it: reply "
                                            f"with one number. I will say higher or lower."}]

    def step(self, text: str):
        self.turns += 1
        m = re.search(r"-?\d+", text)
        if m is None:
            return [{"role": "user", "content": "Reply with one number."}], None, False
        guess = int(m.group())
        if guess == self.secret:
            return [], max(0.0, 1.0 - (self.turns - 1) / self.max_turns), True
        return [{"role": "user", "content": "Higher." if guess < self.secret else "Lower."}], None, False


class GuessNumberTask(EnvTask):
    name = "guess_number"

    def __init__(self, cfg):
        hi = 10**cfg.digits - 1
        if cfg.train_size + cfg.eval_size > 10 * hi:
            raise UnisonError(f"guess_number with {cfg.digits} digit(s) draws secrets from 1..{hi}: lower "
                              f"task.train_size + task.eval_size to at most {10 * hi}")
        rng = random.Random(cfg.seed)
        items = [Item(prompt=f"1..{hi}", answer=str(rng.randint(1, hi)), meta={"source": f"guess_number game {i}"},
                      fields={"hi": hi, "max_turns": cfg.max_turns}) for i in range(cfg.train_size + cfg.eval_size)]
        super().__init__(cfg, items=items, env=cfg.env or "unison.tasks.guess:GuessNumberEnv")
        self.train, self.eval = items[:cfg.train_size], items[cfg.train_size:]
