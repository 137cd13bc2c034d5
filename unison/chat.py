"""Chat templates for multi-turn episodes: token in / token out, tool-call formats, start-up checks.

A multi-turn episode (unison/tasks/env.py) never re-renders what the model sampled. Its first
prompt is the chat template's rendering of the environment's first messages; after each model
turn the next prompt is the previous ids, then the sampled ids as sampled, then the template's
ids for the *new* messages only (:meth:`ChatTemplate.append_ids`): the text the template adds
after the model's turn (the rest of its end-of-turn marker and the new messages, up to the next
generation prompt), tokenized on its own. The learner trains on exactly those ids.

That is only the conversation the template would render when the template is
**prefix-preserving**: rendering n turns gives the rendering of n − 1 turns plus the appended
part. Some are not (Qwen3's drops the ``<think>`` blocks of earlier assistant turns): the
start-up check :meth:`ChatTemplate.check` renders a probe conversation both ways and refuses such
a template in one line (the fix: ``task.chat_template`` pointing at one that keeps earlier turns).

Tools are plain Python functions; their JSON schemas (from the signature and the Google-style
docstring, transformers' ``get_json_schema``) go to the model through the template
(``apply_chat_template(tools=...)``). The model's calls are parsed in the template's own format,
found at start-up by rendering a probe call and reading it back (:func:`detect_format`):

* ``hermes`` — ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3,
  Hermes), a JSON list inside the tags too (SmolLM2's trained format);
* ``llama3_json`` — the whole message one JSON object ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3);
* ``pythonic`` — ``[name(arg=value, ...)]`` (Llama 3.2 / 4 pythonic, unison's ``builtin:tiny``).

Built-in templates (``task.chat_template: builtin:NAME``): ``tiny`` — a minimal template for any
tokenizer (the built-in tiny model has none), pythonic tool calls; ``chatml-tools`` — ChatML with
SmolLM2's trained tool format, for ChatML models whose own template ignores tools (SmolLM2's).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

from unison.errors import UnisonError

TINY_TEMPLATE = (
    "{%- if tools %}{{- 'S:tools ' }}{%- for t in tools %}"
    "{{- t.function.name + '(' + (t.function.parameters.properties | join(', ')) + ')' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- 'S:' + m.content + '\n' }}"
    "{%- elif m.role == 'user' %}{{- 'U:' + m.content + '\n' }}"
    "{%- elif m.role == 'assistant' %}{{- 'A:' + (m.content or '') }}"
    "{%- if m.tool_calls %}{{- '[' }}{%- for c in m.tool_calls %}"
    "{%- set f = c.function if c.function is defined else c %}{{- f.name + '(' }}"
    "{%- for k, v in f.arguments.items() %}{{- k + '=' + (v | tojson) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}{{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' }}{%- endif %}"
    "{{- eos_token }}"
    "{%- elif m.role == 'tool' %}{{- 'T:' + m.content + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'A:' }}{%- endif %}"
)

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- 'You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "You have access to the following tools:\n<tools>' }}{{- tools | tojson }}{{- '</tools>\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list \\'[]\\'.\n<tool_call>[\n"
    "{\"name\": \"func_name1\", \"arguments\": {\"argument1\": \"value1\", \"argument2\": \"value2\"}},\n"
    "(more tool calls as required)\n]</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\n' + (m.content or '') }}"
    "{%- if m.tool_calls %}{{- '<tool_call>[\n' }}{%- for c in m.tool_calls %}"
    "{%- set f = c.function if c.function is defined else c %}"
    "{{- '{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}' }}"
    "{%- if not loop.last %}{{- ',\n' }}{%- endif %}{%- endfor %}{{- '\n]</tool_call>' }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + m.content + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

BUILTIN_TEMPLATES = {"tiny": TINY_TEMPLATE, "chatml-tools": CHATML_TOOLS_TEMPLATE}


# ----------------------------------------------------------------------------- tool calls
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class ToolCallError(ValueError):
    """The model wrote a tool call that cannot be read (answered to the model, counted)."""


def _call(obj, key_args: tuple[str, ...]) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError(f"a tool call must be an object with a 'name', got {json.dumps(obj)[:80]}")
    args = next((obj[k] for k in key_args if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the arguments of '{obj['name']}' are not JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"the arguments of '{obj['name']}' must be an object")
    return ToolCall(obj["name"], args)


def parse_hermes(text: str) -> list[ToolCall] | None:
    """``<tool_call>JSON</tool_call>`` blocks; JSON an object or a list of objects. None: no call."""
    if "<tool_call>" not in text:
        return None
    bodies = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.S)
    if len(bodies) != text.count("<tool_call>"):
        raise ToolCallError("a <tool_call> is not closed with </tool_call>")
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the tool call is not JSON ({e.msg}): {body.strip()[:80]}") from None
        for o in obj if isinstance(obj, list) else [obj]:
            calls.append(_call(o, ("arguments", "parameters")))
    return calls


def parse_llama3_json(text: str) -> list[ToolCall] | None:
    """The whole message one JSON object (or several separated by ';'), ``parameters`` or ``arguments``."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return None
    calls, dec, pos = [], json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the tool call is not JSON ({e.msg}): {body[:80]}") from None
        calls.append(_call(obj, ("parameters", "arguments")))
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            raise ToolCallError(f"text after the tool call: {rest[:40]!r}")
        pos = len(body) - len(rest) + 1
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return calls


def parse_pythonic(text: str) -> list[ToolCall] | None:
    """``[name(arg=literal, ...), ...]`` as the whole message."""
    body = text.strip()
    started = re.match(r"\[\s*[A-Za-z_]\w*\s*\(", body) is not None  # "[name(": a call was begun
    if not (body.startswith("[") and body.endswith("]")):
        if started:
            raise ToolCallError(f"the tool call is not closed with ')]': {body[:80]}")
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as e:
        if started:
            raise ToolCallError(f"the tool call is not valid: {e.msg}: {body[:80]}") from None
        return None
    if not isinstance(tree, ast.List) or not tree.elts or not all(isinstance(e, ast.Call) for e in tree.elts):
        return None
    calls = []
    for e in tree.elts:
        if not isinstance(e.func, ast.Name) or e.args:
            raise ToolCallError(f"write tool calls as name(arg=value): {ast.unparse(e)[:80]}")
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in e.keywords}
        except ValueError:
            raise ToolCallError(f"tool arguments must be literals: {ast.unparse(e)[:80]}") from None
        calls.append(ToolCall(e.func.id, args))
    return calls


FORMATS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "pythonic": parse_pythonic}

_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "some text"}},
                   "required": ["text"]}}}
_PROBE_CALL = ToolCall("probe_tool", {"text": "hi"})


def tool_schema(fn) -> dict:
    """The JSON schema of a tool function, from its signature and docstring (transformers'
    ``get_json_schema``: type hints on every argument, a Google-style ``Args:`` section)."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
        raise UnisonError(f"tool '{name}': no JSON schema from its signature and docstring ({e}): give every "
                          f"argument a type hint and document it under 'Args:' in the docstring") from None


# ----------------------------------------------------------------------------- the template
def resolve_template(tokenizer, setting: str, needs_tools: bool, model: str) -> tuple[str, str | None]:
    """``(jinja template, note)`` for ``task.chat_template`` = ``auto`` | ``model`` | ``builtin:NAME`` |
    a path. ``auto``: the model's own; a tokenizer without one gets ``builtin:tiny``, a ChatML model whose
    template ignores tools ``builtin:chatml-tools`` (the note says so). ``model``: the model's own or a
    one-line refusal."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default") or next(iter(own.values()))
    if setting.startswith("builtin:"):
        name = setting[len("builtin:"):]
        if name not in BUILTIN_TEMPLATES:
            raise UnisonError(f"task.chat_template '{setting}' is not a built-in template: choose "
                              f"{', '.join('builtin:' + k for k in BUILTIN_TEMPLATES)}, auto, model or a .jinja file")
        return BUILTIN_TEMPLATES[name], None
    if setting not in ("auto", "model"):
        path = Path(setting).expanduser()
        if not path.is_file():
            raise UnisonError(f"task.chat_template '{setting}' is not a file: give a jinja template file, auto, "
                              f"model or builtin:tiny")
        return path.read_text(encoding="utf-8"), None
    if own is None:
        if setting == "model":
            raise UnisonError(f"model {model} has no chat template: set task.chat_template=builtin:tiny (unison's "
                              f"minimal template) or a jinja file")
        return TINY_TEMPLATE, f"model {model} has no chat template: using unison's builtin:tiny"
    if needs_tools and not supports_tools(tokenizer, own):
        if setting == "auto" and "<|im_start|>" in tokenizer.get_vocab():
            return CHATML_TOOLS_TEMPLATE, (f"the chat template of model {model} does not render tools: using "
                                           f"unison's builtin:chatml-tools (ChatML with SmolLM2's tool format)")
        raise UnisonError(f"the chat template of model {model} does not render tools, and the environment has "
                          f"tools: set task.chat_template to a template that does (builtin:chatml-tools for "
                          f"ChatML models, or a jinja file), or give the environment no tools")
    return own, None


def supports_tools(tokenizer, template: str) -> bool:
    """Whether ``template`` shows tools to the model and renders an assistant's tool calls readably."""
    t = ChatTemplate(tokenizer, template, [_PROBE_TOOL], model="")
    msgs = [{"role": "user", "content": "q"}]
    if t.text(msgs, True) == t.text(msgs, True, tools=None):
        return False
    try:
        return t.detect_format() is not None
    except Exception:  # noqa: BLE001 - a template that raises on tool calls does not support them
        return False


class ChatTemplate:
    """One jinja chat template over one tokenizer, with the tools' schemas."""

    def __init__(self, tokenizer, template: str, tools: list[dict] | None = None, model: str = "the model"):
        self.tokenizer, self.template, self.tools, self.model = tokenizer, template, tools or None, model
        self._closing: str | None = None
        self.format: str | None = None  # the tool-call format (detect_format), when there are tools

    # ------------------------------------------------------------------ rendering
    def text(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None | bool = True) -> str:
        tools = self.tools if tools is True else tools
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                      add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja errors, raise_exception() in the template
            raise UnisonError(f"the chat template of model {self.model} failed to render the conversation "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): set "
                              f"task.chat_template to a template that can") from None

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: the rendering of the environment's first messages, generation prompt included."""
        return self.ids(self.text(messages, True))

    @property
    def closing(self) -> str:
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        if self._closing is None:
            u = [{"role": "user", "content": "q"}]
            full = self.text(u + [{"role": "assistant", "content": "XYZZY"}], False)
            self._closing = full[full.rindex("XYZZY") + len("XYZZY"):]
        return self._closing

    def bridge(self, stop_text: str | None) -> str:
        """The part of the closing the model did not sample: the closing after the model's stop token
        when the closing starts with it (``<|im_end|>`` + ``\\n``), else the whole closing."""
        c = self.closing
        return c[len(stop_text):] if stop_text and c.startswith(stop_text) else c

    def append_ids(self, history: list[dict], new: list[dict], stop_text: str | None, turn: int = 0) -> list[int]:
        """The ids that follow a model turn ending the conversation ``history`` (whose last message is that
        turn, as text): the rest of the closing, then the template's rendering of ``new`` up to the next
        generation prompt — tokenized alone, appended to the sampled ids, never re-rendered."""
        before = self.text(history, False)
        after = self.text(history + list(new), True)
        if not after.startswith(before):
            raise UnisonError(f"the chat template of model {self.model} is not prefix-preserving at turn {turn + 1} "
                              f"of an episode (rendering the conversation rewrote earlier turns): set "
                              f"task.chat_template to a template that keeps earlier turns as written")
        return self.ids(self.bridge(stop_text) + after[len(before):])

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Refuse (one line) a template that is not prefix-preserving: every assistant turn must render as
        the generation prompt + its content + the closing, and the rendering of n turns must begin with the
        rendering of n − 1 turns. The probe conversation has an earlier ``<think>`` block (Qwen3's template
        drops those) and, with tools, a tool call and its result."""
        msgs = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}]
        if self.tools:
            msgs += [{"role": "user", "content": "Use the tool for 3+3."},
                     {"role": "assistant", "content": self.call_text([_PROBE_CALL])},
                     {"role": "tool", "name": _PROBE_CALL.name, "content": "6"},
                     {"role": "assistant", "content": "6"}]
        msgs += [{"role": "user", "content": "And 5+5?"}, {"role": "assistant", "content": "10"},
                 {"role": "user", "content": "Thanks."}]
        full = self.text(msgs, True)
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            turn = self.text(msgs[:k], True) + m["content"] + self.closing
            ok = self.text(msgs[:k + 1], False) == turn and full.startswith(turn)
            if not ok:
                n = sum(1 for x in msgs[:k + 1] if x["role"] == "assistant")
                raise UnisonError(
                    f"the chat template of model {self.model} is not prefix-preserving: the conversation rendered "
                    f"with {n + 1} assistant turns does not begin with the rendering of the first {n} plus what was "
                    f"sampled (it rewrites earlier turns, e.g. drops their <think> blocks), so the ids a model "
                    f"samples turn by turn are not the conversation it is trained on: set task.chat_template to a "
                    f"jinja template that keeps earlier turns as written (docs/config.md)")

    def detect_format(self) -> str | None:
        """The tool-call format the template writes: render a probe call, read it back with each parser."""
        u = [{"role": "user", "content": "q"}]
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "id": "call_0",
                                "function": {"name": _PROBE_CALL.name, "arguments": dict(_PROBE_CALL.arguments)}}]}
        before, full = self.text(u, True), self.text(u + [call], False)
        if not full.startswith(before):
            return None
        body = full[len(before):]
        if self.closing and body.endswith(self.closing):
            body = body[:-len(self.closing)]
        for name, parse in FORMATS.items():
            try:
                if parse(body) == [_PROBE_CALL]:
                    return name
            except ToolCallError:
                continue
        return None

    def call_text(self, calls: list[ToolCall]) -> str:
        """An assistant turn that makes ``calls``, as the template writes it (demonstrations, checks)."""
        u = [{"role": "user", "content": "q"}]
        msg = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "id": f"call_{i}",
                               "function": {"name": c.name, "arguments": dict(c.arguments)}}
                              for i, c in enumerate(calls)]}
        before, full = self.text(u, True), self.text(u + [msg], False)
        body = full[len(before):]
        return body[:-len(self.closing)] if self.closing and body.endswith(self.closing) else body

    def parse(self, text: str) -> list[ToolCall] | None:
        """The tool calls in an assistant turn (None: none, the turn is an answer); ToolCallError if
        malformed."""
        return FORMATS[self.format](text) if self.format else None

    def prepare(self) -> ChatTemplate:
        """Start-up checks: the tool-call format (with tools), prefix preservation."""
        if self.tools:
            self.format = self.detect_format()
            if self.format is None:
                raise UnisonError(f"the chat template of model {self.model} writes tool calls in a format unison "
                                  f"cannot read back ({', '.join(FORMATS)}): set task.chat_template to one that "
                                  f"uses one of them")
        self.check()
        return self
