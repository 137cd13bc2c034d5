"""The reward of the custom-task example (README, "Bring your own task").

unison calls it once per sampled response: ``reward(response, item) -> float``.

* ``response``: the model's text after the prompt, special tokens removed;
* ``item``: the problem (``unison.tasks.Item``): ``item.prompt``, ``item.answer`` ("" when the row
  has none) and every field of the JSONL row — ``item["answer"]``, ``item["topic"]``,
  ``item.get("hint", "")``.

Responses cut off at ``rollout.max_new_tokens`` score ``task.truncated_reward`` (0) without a call;
set ``task.truncated_reward: null`` to grade them too. An exception scores 0 and is counted
(``reward/error_count``); a run in which every call raises stops after ``task.reward_error_patience``
steps with the error.
"""


def reward(response: str, item) -> float:
    """How much of the answer the response spells out from its first character: 1.0 for the exact
    answer, partial credit for a correct start (a signal even a small model can climb)."""
    target = item["answer"].lower()
    got = response.strip().lower()
    n = 0
    while n < min(len(got), len(target)) and got[n] == target[n]:
        n += 1
    return n / len(target) if got != target else 1.0
