"""Math word problems from JSONL (``problem``, ``answer``), graded with math-verify.

math-verify (0.9.0) decides equality; unison adds guards where it is known
to be wrong (issue 13):

* **brace-less fractions.** ``\\frac\\pi 2`` is parsed as ``\\frac{\\}{p}i 2`` (= 2),
  so the gold ``2007 + \\frac\\pi 2`` rejected the right answer and accepted ``2``.
  :func:`normalize_fracs` braces every argument of ``\\frac``/``\\dfrac``/``\\tfrac``
  (``\\frac\\pi 2`` → ``\\frac{\\pi}{2}``, ``\\frac12`` → ``\\frac{1}{2}``) in the gold
  answer and in the response before parsing.
* **bare-letter "units" and separators.** :func:`parse_gold` keeps variables such as
  the ``c`` of ``a + b + c`` that math-verify's unit stripping deletes, and
  :func:`normalize_answer_text` drops ``,\\!`` thousands separators and a final period
  inside ``\\boxed{}`` (gold and responses).
* **tiny numbers.** math-verify compares two exact numbers through
  ``(a − b).evalf(chop=True)``, and ``chop`` zeroes any difference below about
  1e-15 whatever the magnitude: ``\\frac{2}{2^{98}}`` "equals" ``\\frac{1}{2^{98}}``.
  Floats are compared by rounding to 6 decimals, so 1e-8 "equals" 2e-8. After
  math-verify says equal, :func:`numbers_agree` also requires the two values (when
  both are numbers, or tuples of numbers) to agree to a relative tolerance:
  ``REL_TOL_EXACT`` = 1e-9 when both are exact, ``REL_TOL_FLOAT`` = 1e-2 when a
  float is involved (its writer rounded it). Values a factor of 2 apart are never equal.
"""

from __future__ import annotations

import re

from unison.data_io import read_jsonl
from unison.errors import UnisonError
from unison.tasks import Item, Task, split_holdout

#: the math task's default prompt template (``task.template``): Paper A's instruction after the problem
MATH_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."

#: relative tolerance between two exact numbers math-verify called equal (evaluated to 30 digits)
REL_TOL_EXACT = 1e-9
#: relative tolerance when either side holds a float (math-verify itself requires 6 equal decimals)
REL_TOL_FLOAT = 1e-2

_FRAC = re.compile(r"\\[dt]?frac(?![a-zA-Z])")


def _take_arg(tex: str, j: int) -> tuple[str | None, int]:
    """One TeX macro argument starting at ``tex[j]`` (spaces skipped): a brace group, a
    control sequence or one character, returned braced, and the index after it."""
    while j < len(tex) and tex[j] in " \t\n":
        j += 1
    if j >= len(tex) or tex[j] == "}":
        return None, j
    if tex[j] == "{":
        depth, k = 0, j
        while k < len(tex):
            if tex[k] == "\\":
                k += 2
                continue
            depth += {"{": 1, "}": -1}.get(tex[k], 0)
            if depth == 0:
                return "{" + normalize_fracs(tex[j + 1:k]) + "}", k + 1
            k += 1
        return None, j  # unbalanced: leave the text alone
    if tex[j] == "\\":
        m = re.compile(r"\\(?:[a-zA-Z]+|.)").match(tex, j)
        if m is None:
            return None, j
        return "{" + m.group(0) + "}", m.end()
    return "{" + tex[j] + "}", j + 1


def normalize_fracs(tex: str) -> str:
    """Brace both arguments of every ``\\frac``, ``\\dfrac``, ``\\tfrac``: ``\\frac\\pi 2`` →
    ``\\frac{\\pi}{2}``, ``\\frac12`` → ``\\frac{1}{2}``, ``\\frac{1}2`` → ``\\frac{1}{2}``.
    Braced arguments are kept (their insides normalised); anything unparsable is left as is."""
    out, i = [], 0
    while (m := _FRAC.search(tex, i)) is not None:
        out.append(tex[i:m.end()])
        num, j = _take_arg(tex, m.end())
        den, k = _take_arg(tex, j) if num is not None else (None, j)
        if num is None or den is None:
            i = m.end()
            continue
        out.append(num + den)
        i = k
    out.append(tex[i:])
    return "".join(out)


def numbers_agree(gold, pred) -> bool:
    """False only when ``gold`` and ``pred`` are numbers (or equal-length tuples of numbers)
    whose values differ by more than the relative tolerance; True ("no objection") for
    anything else: symbols, sets, relations, strings, or values that cannot be evaluated."""
    import sympy

    if isinstance(gold, sympy.Tuple) and isinstance(pred, sympy.Tuple):
        return len(gold) != len(pred) or all(numbers_agree(g, p) for g, p in zip(gold, pred))
    if not (isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr)):
        return True
    try:
        from math_verify.errors import TimeoutException
        from math_verify.utils import timeout

        return timeout(5)(_numbers_agree)(gold, pred)
    except (Exception, TimeoutException):  # noqa: BLE001 - the guard never makes grading raise
        return True


def _numbers_agree(gold, pred) -> bool:
    import sympy

    if not (gold.is_number and pred.is_number):
        return True
    a, b = sympy.N(gold, 30), sympy.N(pred, 30)
    if not (a.is_finite and b.is_finite):
        return True
    scale = max(abs(a), abs(b))
    if scale == 0:
        return True
    tol = REL_TOL_FLOAT if gold.has(sympy.Float) or pred.has(sympy.Float) else REL_TOL_EXACT
    return bool(abs(a - b) <= tol * scale)


_THOUSANDS = re.compile(r"(?<=\d)(?:,\\!|\{,\})(?=\d{3}(?!\d))")
_TRAILING_PERIOD = re.compile(r"(?<!\.)\s*\.\s*$")
_BOXED = re.compile(r"\\boxed\s*(?=\{)")
#: markup that says a gold answer carries units or text (math-verify's unit stripping is wanted)
_UNIT_MARKUP = re.compile(r"\\(?:text|mbox|mathrm|textrm|operatorname)(?![a-zA-Z])|\\circ|%|\$")


def _strip_boxed_periods(text: str) -> str:
    """``\\boxed{7\\text{ hours}.}`` → ``\\boxed{7\\text{ hours}}``: a final period inside a box."""
    out, i = [], 0
    while (m := _BOXED.search(text, i)) is not None:
        arg, k = _take_arg(text, m.end())
        if arg is None:
            out.append(text[i:m.end()])
            i = m.end()
            continue
        out.append(text[i:m.end()] + "{" + _TRAILING_PERIOD.sub("", text[m.end() + 1:k - 1]) + "}")
        i = k
    out.append(text[i:])
    return "".join(out)


def normalize_answer_text(text: str) -> str:
    """What unison does to every response before math-verify parses it: fractions braced
    (:func:`normalize_fracs`), explicit thousands separators dropped (``20,\\!000`` and
    ``20{,}000`` → ``20000``: math-verify cannot parse ``\\frac{2469}{20,000}``), and a final
    period inside ``\\boxed{...}`` removed (``7\\text{ hours}.`` does not parse)."""
    return _strip_boxed_periods(_THOUSANDS.sub("", normalize_fracs(text)))


def normalize_gold(answer: str) -> str:
    """A reference answer made parseable: :func:`normalize_answer_text`, and a trailing
    period removed."""
    return _TRAILING_PERIOD.sub("", normalize_answer_text(str(answer).strip()))


def _no_units_config():
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(normalization_config=NormalizationConfig(
        basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all",
        equations=False)), ExprExtractionConfig()]


def parse_gold(answer: str) -> tuple[list, bool]:
    """The reference answer as math-verify parses it (normalised, boxed), and whether
    responses must also be parsed without unit stripping.

    math-verify strips trailing "units" that include bare letters (c, d, g, h, l, m, s, t, ...):
    the gold ``a + b + c`` parses as the string ``a +`` and ``2s`` as ``2`` (so ``\\boxed{2}``
    scored 1). A gold answer without unit or text markup is pure math: when unit stripping
    changes it, it is parsed without, and so are responses (in addition to the usual parse)."""
    from math_verify import parse

    ans = normalize_gold(answer)
    boxed = ans if "\\boxed" in ans else "\\boxed{" + ans + "}"
    gold = parse(boxed)
    if not _UNIT_MARKUP.search(ans):
        plain = parse(boxed, extraction_config=_no_units_config())
        if plain and [str(x) for x in plain] != [str(x) for x in gold]:
            return plain, True
    return gold, False


def answers_equal(gold: list, pred: list) -> bool:
    """math-verify's ``verify`` over every (gold, prediction) pair of parses, with
    :func:`numbers_agree` as a second opinion on each pair it accepts."""
    from math_verify import verify

    return any(verify(g, p) and numbers_agree(g, p) for g in gold for p in pred)


class MathTask(Task):
    """Prompt = ``template.format(problem=...)`` (inside the chat template when the
    tokenizer has one). A response scores 1 when math-verify finds its final
    answer equal to the reference (with the guards above), else 0.

    Without ``eval_path``, :func:`unison.tasks.split_holdout` holds rows of ``path`` out for eval."""

    name = "math"

    def __init__(self, path: str, eval_path: str | None = None, eval_size: int = 0,
                 template: str | None = None, seed: int = 0):
        try:
            import math_verify  # noqa: F401
        except ImportError as e:
            raise UnisonError("the math task needs math-verify: pip install 'math-verify==0.9.0'") from e
        #: the prompt template (``task.template``; None: :data:`MATH_TEMPLATE`)
        self.template = template = MATH_TEMPLATE if template is None else template
        lines: list[int] = []
        rows = read_jsonl(path, {"problem": str, "answer": (str, int, float)}, line_numbers=lines)
        items = [Item(prompt=template.format(problem=r["problem"]), answer=str(r["answer"]),
                      meta={"source": f"{path}:{n}"}) for r, n in zip(rows, lines)]
        if eval_path:
            ev = read_jsonl(eval_path, {"problem": str, "answer": (str, int, float)})
            self.train = items
            self.eval = [Item(prompt=template.format(problem=r["problem"]), answer=str(r["answer"]))
                         for r in ev]
        else:
            self.train, self.eval = split_holdout(items, eval_size, seed)
        self._gold = {}

    def score(self, response: str, item: Item) -> float:
        from math_verify import parse

        got = self._gold.get(item.answer)
        if got is None:
            got = self._gold[item.answer] = parse_gold(item.answer)
        gold, no_units = got
        text = normalize_answer_text(response)
        pred = parse(text)
        if no_units:
            pred = pred + parse(text, extraction_config=_no_units_config())
        return 1.0 if answers_equal(gold, pred) else 0.0

    def demonstration(self, item: Item) -> str:
        return f"The answer is $\\boxed{{{item.answer}}}$."
