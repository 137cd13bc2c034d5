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


# ---------------------------------------------------------------------- math grader guards (issue 13)
# Inline copies of rows of sanity_math_1460.jsonl (line numbers of that file), so these run anywhere.
ROW_385 = {"problem": "... Suppose that $(a_{100},b_{100}) = (2,4)$. What is $a_1 + b_1$?  Express your "
                      "answer using exponential notation.", "answer": "\\frac{1}{2^{98}}"}
ROW_1255 = {"problem": "Given that $x+\\sin y=2008$ and $x+2008 \\cos y=2007$, where $0 \\leq y \\leq "
                       "\\frac{\\pi}{2}$, find the value of $x+y$.", "answer": "2007 + \\frac\\pi 2"}
ROW_83 = {"problem": "... Find $p(a,b,c).$", "answer": "a + b + c"}
ROW_165 = {"problem": "... What is the height of the triangle, $h$, in terms of the side length of the "
                      "square, $s$?", "answer": "2s"}
ROW_342 = {"problem": "...", "answer": "\\dfrac{2469}{20,\\!000}"}


def _math_task(tmp_path, rows):
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return make_task(TaskConfig(name="math", path=str(p), eval_size=0))


def _boxed(ans):
    return f"So the final answer is $\\boxed{{{ans}}}$."


def _grade(task, row, answers):
    item = next(it for it in task.train if it.answer == row["answer"])
    return [task.score(_boxed(a), item) for a in answers]


def test_math_grader_tiny_fraction_off_by_a_factor_of_two_is_wrong(tmp_path):
    # math-verify 0.9.0 compares exact numbers with (a − b).evalf(chop=True): a difference of
    # 2^-98 ≈ 3e-30 is chopped to 0, so 2/2^98 "equalled" 1/2^98.
    task = _math_task(tmp_path, [ROW_385])
    assert _grade(task, ROW_385, ["\\frac{1}{2^{98}}", "2^{-98}", "\\frac{2}{2^{98}}", "\\frac{1}{2^{97}}",
                                  "0"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_math_grader_braceless_frac_in_gold(tmp_path):
    # `\frac\pi 2` was parsed as `\frac{\}{p}i 2` = 2: the right answer failed and "2" passed.
    task = _math_task(tmp_path, [ROW_1255])
    assert _grade(task, ROW_1255, ["2007 + \\frac{\\pi}{2}", "2007+\\frac\\pi2", "\\frac{4014+\\pi}{2}",
                                   "2", "2007"]) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_grader_keeps_bare_letter_variables_and_separators(tmp_path):
    # math-verify strips trailing bare-letter "units" (c, s, ...): the gold `a + b + c` became the
    # string "a +" and `2s` became 2; `20,\!000` left the gold unparsed.
    task = _math_task(tmp_path, [ROW_83, ROW_165, ROW_342])
    assert _grade(task, ROW_83, ["a+b+c", "a + b + c", "c + b + a", "a + c", "a + b + d"]) == [1, 1, 1, 0, 0]
    assert _grade(task, ROW_165, ["2s", "s \\cdot 2", "2", "3s"]) == [1.0, 1.0, 0.0, 0.0]
    assert _grade(task, ROW_342, ["\\dfrac{2469}{20,\\!000}", "\\frac{2469}{20000}", "0.12345",
                                  "\\frac{2469}{2000}"]) == [1.0, 1.0, 1.0, 0.0]


def test_math_grader_guards_on_the_shared_rows(shared_data):
    rows = [json.loads(line) for line in open(shared_data / "sanity_math_1460.jsonl")]
    assert rows[384]["answer"] == ROW_385["answer"] and rows[1254]["answer"] == ROW_1255["answer"]
    assert rows[82]["answer"] == ROW_83["answer"] and rows[164]["answer"] == ROW_165["answer"]
    task = make_task(TaskConfig(name="math", path=str(shared_data / "sanity_math_1460.jsonl"), eval_size=0))
    by_answer = {it.answer: it for it in task.train}
    for row, right, wrong in [(rows[384], "2^{-98}", "\\frac{2}{2^{98}}"),
                              (rows[1254], "2007 + \\frac{\\pi}{2}", "2"),
                              (rows[82], "a+b+c", "a + c"), (rows[164], "2s", "2")]:
        item = by_answer[row["answer"]]
        assert task.score(_boxed(right), item) == 1.0, row
        assert task.score(_boxed(wrong), item) == 0.0, row
        assert task.score(_boxed(row["answer"]), item) == 1.0, row  # the reference as written


def test_normalisers_by_hand():
    from unison.tasks.math import normalize_answer_text, normalize_fracs, normalize_gold

    assert normalize_fracs("2007 + \\frac\\pi 2") == "2007 + \\frac{\\pi}{2}"
    assert normalize_fracs("\\frac12 + \\dfrac 3 4 + \\tfrac{5}6") == "\\frac{1}{2} + \\dfrac{3}{4} + \\tfrac{5}{6}"
    assert normalize_fracs("\\frac{\\frac\\pi 2}{3}") == "\\frac{\\frac{\\pi}{2}}{3}"
    for untouched in ("\\frac{a}{b}", "\\frac", "\\frac{1", "\\fraction", "x/2"):
        assert normalize_fracs(untouched) == untouched
    assert normalize_answer_text("\\boxed{\\frac{1}{29,\\!322,\\!216}.}") == "\\boxed{\\frac{1}{29322216}}"
    assert normalize_answer_text("\\boxed{(1,234)}") == "\\boxed{(1,234)}"  # a tuple, not a thousands mark
    assert normalize_gold("30^\\circ.") == "30^\\circ" and normalize_gold("1, 2, ...") == "1, 2, ..."


def test_numbers_agree_uses_a_relative_tolerance():
    import sympy

    from unison.tasks.math import numbers_agree

    tiny = sympy.Integer(2) ** -98
    assert not numbers_agree(tiny, 2 * tiny) and numbers_agree(tiny, sympy.Rational(1, 2**98))
    assert not numbers_agree(sympy.Float("1e-8"), sympy.Float("2e-8"))
    assert numbers_agree(sympy.Rational(1, 3), sympy.Float("0.333333"))  # math-verify's 6 decimals
    assert not numbers_agree(sympy.Integer(0), sympy.Integer(10) ** -20)
    assert numbers_agree(sympy.Symbol("x"), sympy.Integer(2))  # not numbers: no objection
    assert not numbers_agree(sympy.Tuple(1, tiny), sympy.Tuple(1, 2 * tiny))


# ---------------------------------------------------------------------- math eval split (issue 13)
@pytest.mark.parametrize("rows,eval_size,held_out", [
    (16, 200, 1), (9, 200, 0), (100, 200, 10), (1460, 200, 146), (2000, 200, 200), (5000, 200, 200),
    (1460, 0, 0), (1460, 50, 50)])
def test_math_eval_split_never_holds_out_more_than_a_tenth(tmp_path, rows, eval_size, held_out):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"problem": f"{i}+0?", "answer": str(i)}) + "\n" for i in range(rows)))
    task = make_task(TaskConfig(name="math", path=str(p), eval_size=eval_size))
    assert len(task.eval) == held_out and len(task.train) == rows - held_out
    assert not {it.prompt for it in task.train} & {it.prompt for it in task.eval}
    again = make_task(TaskConfig(name="math", path=str(p), eval_size=eval_size))
    assert [it.prompt for it in again.eval] == [it.prompt for it in task.eval]  # seeded


# ---------------------------------------------------------------------- non-UTF-8 data (issue 13)
@pytest.mark.parametrize("name", ["math", "arithmetic"])
def test_task_file_that_is_not_utf8_is_one_clear_error(tmp_path, name):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes('{"problem": "caf\u00e9?", "prompt": "caf\u00e9", "answer": "1"}\n'.encode("utf-8")
                  + '{"problem": "na\u00efve?", "prompt": "na\u00efve", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(UnisonError) as e:
        make_task(TaskConfig(name=name, path=str(p), digits=1, train_size=8, eval_size=0))
    assert str(e.value) == f"data file '{p}' is not UTF-8 text (line 2): re-save it as UTF-8"


def test_jsonl_with_a_byte_order_mark_and_line_separators_reads(tmp_path):
    from unison.data_io import read_jsonl

    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "a\u2028b"}\n\n{"prompt": "c"}\n'.encode("utf-8"))
    lines = []
    assert [r["prompt"] for r in read_jsonl(p, {"prompt": str}, line_numbers=lines)] == ["a\u2028b", "c"]
    assert lines == [1, 3]


def test_scratchpad_task_is_deterministic_long_and_graded_on_the_final_answer():
    from unison.models import build_char_tokenizer
    from unison.tasks.scratchpad import ScratchpadTask, working

    a = ScratchpadTask(operands=7, digits=2, train_size=50, eval_size=10, seed=3)
    b = ScratchpadTask(operands=7, digits=2, train_size=50, eval_size=10, seed=3)
    assert [(i.prompt, i.answer) for i in a.train + a.eval] == [(i.prompt, i.answer) for i in b.train + b.eval]
    assert not {i.prompt for i in a.train} & {i.prompt for i in a.eval}
    tok = build_char_tokenizer()
    for it in a.train:
        ref = a.demonstration(it)
        assert a.score(ref, it) == 1.0
        assert 64 <= len(tok(ref, add_special_tokens=False)["input_ids"]) <= 512  # long answers
        wrong = ref[:-1] + str((int(ref[-1]) + 1) % 10)  # the last digit of the result corrupted
        assert a.score(wrong, it) == 0.0 and a.score(ref.replace("#", ""), it) == 0.0
    assert working([12, 34, 56]) == "12+34=46\n46+56=102\n#102"
    direct = ScratchpadTask(operands=7, train_size=8, eval_size=0, style="direct")
    assert direct.demonstration(direct.train[0]) == "#" + direct.train[0].answer
    mixed = ScratchpadTask(operands=7, train_size=200, eval_size=0, style="mixed")
    worked = sum("\n" in mixed.demonstration(i) for i in mixed.train)
    assert 70 <= worked <= 130  # about half of the problems show the working


def test_a_jsonl_task_from_an_older_config_yaml_keeps_its_prompts_as_written(tmp_path):
    """Run directories written before task.template defaulted to null hold the math default: for a jsonl task it
    means "the prompts as written", as it did then (a resume must not format rows with {problem})."""
    from unison.tasks.jsonl import JsonlTask
    from unison.tasks.math import MATH_TEMPLATE

    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    assert JsonlTask(str(p), template=MATH_TEMPLATE).train[0].prompt == "2+2="
    assert JsonlTask(str(p), template="Q: {prompt}").train[0].prompt == "Q: 2+2="
