"""The reward of the custom-task example (docs/tasks.md, "Bring your own task").

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
    """Partial credit that even the built-in tiny model, which starts from random weights, can climb:
    how well the letters the response uses match the letters of the answer (F1 of the two sets:
    "seven" -> {s, e, v, n}). 1.0 when the response uses exactly the answer's letters, 0 when it
    shares none. A trained model on a real task would be scored on the answer itself."""
    target = set(item["answer"].lower())
    used = set(response.strip().lower())
    hit = len(target & used)
    if not hit:
        return 0.0
    precision, recall = hit / len(used), hit / len(target)
    return 2 * precision * recall / (precision + recall)
