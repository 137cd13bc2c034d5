"""Any reasoning-gym dataset by name, scored by the dataset's own scorer."""

from __future__ import annotations

from unison.errors import UnisonError
from unison.tasks import Item, Task


class ReasoningGymTask(Task):
    name = "reasoning_gym"

    def __init__(self, dataset: str, train_size: int = 2000, eval_size: int = 200, seed: int = 0):
        try:
            import reasoning_gym
        except ImportError as e:
            raise UnisonError("the reasoning_gym task needs reasoning-gym: "
                              "pip install 'reasoning-gym==0.1.25'") from e
        try:
            self.ds = reasoning_gym.create_dataset(dataset, size=train_size + eval_size, seed=seed)
        except Exception as e:  # noqa: BLE001 - unknown names raise various types
            raise UnisonError(f"reasoning-gym has no dataset '{dataset}' ({e}): "
                              f"see reasoning_gym.factory for the names") from e
        items = [Item(prompt=x["question"], answer=str(x["answer"]), meta={"entry": x}) for x in self.ds]
        self.train, self.eval = items[:train_size], items[train_size:]

    def score(self, response: str, item: Item) -> float:
        return float(self.ds.score_answer(response.strip(), item.meta["entry"]) or 0.0)
