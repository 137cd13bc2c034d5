"""A complete multi-turn environment with a tool (docs/tasks.md, "Multi-turn environments and tools").

The model is asked how many letters a word has. It may call ``word_length`` (a plain function: its
JSON schema comes from the type hints and the ``Args:`` docstring) and then answers; a wrong answer
is told to try again once. Reward: 1 for a right first answer, 0.5 for a right second one.
"""


def word_length(word: str) -> int:
    """The number of letters in a word.

    Args:
        word: the word to measure
    """
    return len(word)


class LengthEnv:
    tools = [word_length]  # offered to the model through its chat template

    def reset(self, item):  # item: a row of data.jsonl (item["word"])
        self.answer, self.tries = str(len(item["word"])), 0
        return [{"role": "user", "content": f"How many letters has {item['word']}?"}]

    def step(self, text):  # the model's turn (one without a tool call), as text
        self.tries += 1
        if text.strip() == self.answer:
            return [], 1.0 / self.tries, True  # new messages, reward, done
        if self.tries == 2:
            return [], 0.0, True
        return [{"role": "user", "content": "No. Try again."}], None, False
