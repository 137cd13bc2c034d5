"""Reward for the SmolLM2 experiment: 1 when the last number the response writes is the sum (a response
cut at rollout.max_new_tokens scores task.truncated_reward, 0, without a call), else 0."""
import re


def reward(response: str, item) -> float:
    numbers = re.findall(r"-?\d+", response)
    return 1.0 if numbers and numbers[-1] == item.answer else 0.0
