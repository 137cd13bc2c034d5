"""Reading JSONL input with errors that name the file, the line and the field."""

from __future__ import annotations

import json
import os
import tempfile
from importlib import resources
from pathlib import Path

from unison.errors import UnisonError


def read_text(path: Path, what: str = "data file") -> str:
    """A UTF-8 text file's contents (a leading byte-order mark is dropped). Bytes that are
    not UTF-8 are a :class:`UnisonError` naming the file and the line, never a traceback."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        lineno = data[:e.start].count(b"\n") + 1
        raise UnisonError(f"{what} '{path}' is not UTF-8 text (line {lineno}): "
                          f"re-save it as UTF-8") from None
    return text


def read_jsonl(path: str | Path, required: dict[str, type | tuple[type, ...]] | None = None,
               alternatives: dict[str, tuple[str, ...]] | None = None,
               line_numbers: list[int] | None = None) -> list[dict]:
    """Rows of a JSONL file, each checked to be an object with ``required`` fields and types.

    ``alternatives`` maps a required field to other accepted names (the first
    present wins and is copied under the required name). Blank lines are skipped;
    ``line_numbers``, when given, receives the 1-based line of each returned row
    (for errors that point back into the file). The file must be UTF-8.
    """
    path = resolve_data_path(path)
    if not path.exists():
        raise UnisonError(f"data file '{path}' does not exist: check the path")
    if not path.is_file():
        raise UnisonError(f"data path '{path}' is not a file: pass a .jsonl file")
    required = required or {}
    alternatives = alternatives or {}
    rows = []
    # split on "\n" only: JSON strings may hold U+2028 and friends, which str.splitlines breaks on
    for lineno, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UnisonError(f"{path}:{lineno}: not valid JSON ({e.msg}): "
                              f"write one JSON object per line") from e
        if not isinstance(row, dict):
            raise UnisonError(f"{path}:{lineno}: expected a JSON object, got "
                              f"{type(row).__name__}: write one object per line")
        for name, typ in required.items():
            if name not in row:
                for alt in alternatives.get(name, ()):
                    if alt in row:
                        row[name] = row[alt]
                        break
            if name not in row:
                names = " or ".join(repr(n) for n in (name, *alternatives.get(name, ())))
                raise UnisonError(f"{path}:{lineno}: missing field {names}: add it to every row")
            if not isinstance(row[name], typ) or isinstance(row[name], bool) and typ is not bool:
                want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
                raise UnisonError(f"{path}:{lineno}: field '{name}' must be {want}, got "
                                  f"{type(row[name]).__name__}: fix that row")
        rows.append(row)
        if line_numbers is not None:
            line_numbers.append(lineno)
    if not rows:
        raise UnisonError(f"data file '{path}' has no rows: add at least one JSON object")
    return rows


def read_json_cache(path: Path) -> dict:
    """A per-machine cache of measurements (``$UNISON_HOME/*.json``): its entries, or none if it is absent or
    damaged (a measurement is then made again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def add_to_json_cache(path: Path, key: str, value) -> None:
    """Add one measurement (atomically: a reader never sees half a file; a failure to write costs a re-measure)."""
    try:
        data = read_json_cache(path)
        data[key] = value
        atomic_write_text(path, json.dumps(data, indent=1))
    except OSError:
        pass


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file and rename: never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_metrics(path: str | Path, on_torn=None) -> list[dict]:
    """The rows of a ``metrics.jsonl``. A last line cut short (the expected trace of a
    SIGKILL during a write) is dropped — ``on_torn(message)`` hears of it; a damaged line
    anywhere else is an error."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UnisonError(f"'{path}' is not UTF-8 text: restore it from a copy or delete it") from e
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # torn last line
                if on_torn is not None:
                    on_torn(f"{path}:{i + 1}: the last line is cut short (a run killed while writing it) "
                            f"and is ignored")
                break
            raise UnisonError(f"{path}:{i + 1}: not valid JSON ({e.msg}): the file is damaged; "
                              f"remove that line") from e
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UnisonError(f"{path}:{i + 1}: not a metrics row (no integer \"step\"): remove that line")
        rows.append(row)
    return rows


#: data sets shipped in the package (unison/data/math/README.md: origin and licence of each)
BUILTIN_DATA = {"sanity_math": "sanity_math_1460.jsonl", "math500": "math500.jsonl", "aime2024": "aime2024.jsonl",
                "amc23": "amc23.jsonl"}


def resolve_data_path(path: str | Path, what: str = "task.path") -> Path:
    """A data file's path: ``builtin:NAME`` names a set shipped with unison, anything else is a path."""
    text = str(path)
    if not text.startswith("builtin:"):
        return Path(text).expanduser()
    name = text[len("builtin:"):]
    if name not in BUILTIN_DATA:
        import difflib

        close = difflib.get_close_matches(name, list(BUILTIN_DATA), n=1)
        hint = f"did you mean 'builtin:{close[0]}'? " if close else ""
        raise UnisonError(f"{what} '{text}' is not a data set shipped with unison: {hint}choose one of "
                          f"{', '.join('builtin:' + n for n in BUILTIN_DATA)}, or give a path")
    from importlib import resources

    return Path(str(resources.files("unison") / "data" / "math" / BUILTIN_DATA[name]))


def load_prompts(path: str | None, line_numbers: list[int] | None = None) -> list[str]:
    """Prompt strings from a JSONL file (field ``prompt``, or ``problem``), or the built-in ones.
    ``line_numbers``, when given, receives each prompt's line in its file."""
    if path is None:
        ref = resources.files("unison") / "data" / "prompts.jsonl"
        with resources.as_file(ref) as p:
            rows = read_jsonl(p, {"prompt": str}, line_numbers=line_numbers)
    else:
        rows = read_jsonl(path, {"prompt": str}, {"prompt": ("problem",)}, line_numbers=line_numbers)
    return [r["prompt"] for r in rows]


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when the tokenizer has one."""
    out = []
    for p in prompts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(p)["input_ids"]
        out.append(list(ids))
    return out
