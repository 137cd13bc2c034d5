import json

import pytest

from unison.config import TaskConfig
from unison.errors import UnisonError
from unison.tasks import RewardFn, make_reward, make_task
from unison.tasks.arithmetic import ArithmeticTask


def test_arithmetic_is_deterministic_disjoint_and_exact():
    a = ArithmeticTask(digits=2, operators=["+", "-"], train_size=50, eval_size=10, seed=1)
    b = ArithmeticTask(digits=2, operators=["+", "-"], train_size=50, eval_size=10, seed=1)
    assert [i.prompt for i in a.train] == [i.prompt for i in b.train]
    assert not {i.prompt for i in a.train} & {i.prompt for i in a.eval}
    item = a.train[0]
    x, y = item.prompt[:2], item.prompt[3:5]
    assert item.answer == str(int(x) + int(y) if item.prompt[2] == "+" else int(x) - int(y))
    assert a.score(f" {item.answer} ", item) == 1.0
    assert a.score(item.answer + "0", item) == 0.0
    with pytest.raises(UnisonError, match="distinct problems"):
        ArithmeticTask(digits=1, train_size=100, eval_size=10)


def test_math_task_grades_real_rows_with_math_verify(shared_data):
    task = make_task(TaskConfig(name="math", path=str(shared_data / "sanity_math_1460.jsonl"), eval_size=0))
    assert len(task.train) == 1460
    rows = [json.loads(line) for line in open(shared_data / "sanity_math_1460.jsonl")][:40]
    by_prompt = {it.prompt: it for it in task.train}
    for row in rows:
        item = next(it for p, it in by_prompt.items() if p.startswith(row["problem"]))
        assert task.score(f"So the final answer is $\\boxed{{{row['answer']}}}$.", item) == 1.0, row
        assert task.score("So the final answer is $\\boxed{123456789}$.", item) == 0.0, row


def test_math_task_reports_malformed_rows(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n')
    with pytest.raises(UnisonError, match="m.jsonl:2: missing field 'answer'"):
        make_task(TaskConfig(name="math", path=str(p)))


def test_reasoning_gym_task_uses_its_scorer():
    task = make_task(TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", train_size=5, eval_size=2))
    item = task.train[0]
    assert task.score(item.answer, item) == 1.0
    assert task.score("not a number", item) == 0.0
    with pytest.raises(UnisonError, match="no dataset"):
        make_task(TaskConfig(name="reasoning_gym", dataset="no_such_gym"))


def test_reward_wrapper_truncation_errors_and_custom(tmp_path, monkeypatch):
    task = ArithmeticTask(digits=1, train_size=5, eval_size=0)
    item = task.train[0]
    r = RewardFn(task, truncated_reward=0.0)
    assert r(item.answer, item, truncated=False) == 1.0
    assert r(item.answer, item, truncated=True) == 0.0
    boom = RewardFn(task, custom=lambda resp, it: 1 / 0)
    assert boom("x", item, truncated=False) == 0.0 and boom.errors == 1
    (tmp_path / "my_rewards.py").write_text("def length(resp, item):\n    return len(resp) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = make_reward(task, TaskConfig(digits=1, reward="my_rewards:length"))
    assert custom("abc", item, truncated=False) == pytest.approx(0.3)
    with pytest.raises(UnisonError, match="has no function"):
        make_reward(task, TaskConfig(reward="my_rewards:nope"))


def test_score_completions_decodes_and_flags_truncation(tiny_dir):
    from unison.batch import Completion
    from unison.models import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    task = ArithmeticTask(digits=1, train_size=2, eval_size=0)
    items = task.train
    eos = tok.eos_token_id
    comps = [Completion(prompt_ids=[1], token_ids=tok(items[0].answer, add_special_tokens=False)["input_ids"] + [eos],
                        logprobs=[0.0] * (len(items[0].answer) + 1), finish_reason="stop", prompt_index=0),
             Completion(prompt_ids=[1], token_ids=tok(items[1].answer, add_special_tokens=False)["input_ids"],
                        logprobs=[0.0] * len(items[1].answer), finish_reason="length", prompt_index=1),
             Completion(prompt_ids=[1], token_ids=tok("x", add_special_tokens=False)["input_ids"],
                        logprobs=[0.0], finish_reason="stop", prompt_index=1)]
    # right and finished; right but cut at max tokens (truncated -> 0); wrong
    assert RewardFn(task).score_completions(comps, items, tok) == [1.0, 0.0, 0.0]
