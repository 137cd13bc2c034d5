"""Loading the configuration: YAML files, ``--set`` overrides, unknown keys with the nearest valid name, wrong
values in one line naming the key, data paths next to the config, and the run's ``config.yaml``."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from unison.config.schema import Config
from unison.data_io import read_text
from unison.errors import UnisonError


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, f in model.model_fields.items():
        keys.append(prefix + name)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _known_keys(ann, prefix + name + ".")
    return keys


def _check_keys(data: Any, model: type[BaseModel], prefix: str = "") -> None:
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        if key not in model.model_fields:
            full = prefix + str(key)
            close = difflib.get_close_matches(full, _known_keys(Config), n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else "see docs/config.md for the keys"
            raise UnisonError(f"unknown config key '{full}': {hint}")
        ann = model.model_fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if not isinstance(value, dict):
                raise UnisonError(f"config key '{prefix}{key}' must be a section (mapping), "
                                  f"got {type(value).__name__}")
            _check_keys(value, ann, prefix + key + ".")


def _validation_message(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    return f"config key '{loc}': {e['msg']} (got {e.get('input')!r}): fix the value"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], parsed value). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise UnisonError(f"--set '{text}' is not key=value: write e.g. --set train.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise UnisonError(f"--set '{text}' has an empty key: write e.g. --set train.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_float(value):
        value = float(value)
    return key.split("."), value


def _looks_float(s: str) -> bool:
    try:
        float(s)
        return any(c in s.lower() for c in ".e") and not s.lower().startswith(("nan", "inf", "-inf"))
    except ValueError:
        return False


def read_yaml(path: str | Path) -> dict:
    """A YAML config file as a dict, with one-line errors for missing or malformed files."""
    path = Path(path)
    if path.is_dir():
        raise UnisonError(f"config file '{path}' is a directory: pass a YAML file "
                          f"(see configs/ for examples)")
    if not path.is_file():
        raise UnisonError(f"config file '{path}' does not exist: pass a YAML file "
                          f"(see configs/ for examples)")
    text = read_text(path, what="config file")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UnisonError(f"config file '{path}' is not valid YAML{where} ({what}): fix the syntax there") from e
    if not isinstance(data, dict):
        raise UnisonError(f"config file '{path}' must hold a mapping of keys, got {type(data).__name__}")
    _fix_yaml_floats(data)
    return data


def merge(base: dict, update: dict) -> dict:
    """Recursive dict merge (``update`` wins)."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Apply ``--set`` overrides to ``data``, check the keys, validate."""
    data = merge({}, data)
    raw: dict[tuple, str] = {}
    for text in overrides or []:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UnisonError(f"--set '{text}': '{k}' is not a section")
        node[keys[-1]] = value
        raw[tuple(keys)] = text.split("=", 1)[1]
    _check_keys(data, Config)
    for _ in range(len(raw) + 1):
        try:
            return Config.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = tuple(str(p) for p in err["loc"])
            if err["type"] != "string_type" or loc not in raw or isinstance(_get(data, loc), str):
                raise UnisonError(_validation_message(e)) from e
            _get(data, loc[:-1])[loc[-1]] = raw[loc]  # --set key=Solve: {problem} means the text as written
    raise AssertionError("unreachable")  # pragma: no cover


def _get(data: dict, keys):
    for k in keys:
        data = data[k]
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults), apply ``--set`` overrides, validate, and make every path
    absolute (:func:`resolve_paths`: a path written in the file is looked for next to the file first,
    one given with ``--set`` in the working directory first), so that the run's config.yaml finds
    everything again on --resume, from any directory."""
    cfg = config_from_dict(read_yaml(path) if path is not None else {}, overrides)
    return resolve_paths(cfg, Path(path).resolve().parent if path is not None else None, override_keys(overrides))


#: the config keys that name a file or directory (task.reward too: its module part, below)
PATH_KEYS = ("model", "task.path", "task.eval_path", "vllm.sync_dir")


def override_keys(overrides: list[str] | None) -> set[str]:
    """The dotted keys that ``--set`` overrides name."""
    return {t.split("=", 1)[0].strip() for t in overrides or [] if "=" in t}


def resolve_paths(cfg: Config, config_dir: Path | None = None, from_cli: set[str] = frozenset()) -> Config:
    """``cfg`` with every relative path made absolute. A path read from the config file is looked for
    next to the file first, then in the working directory (a same-named file in the working directory
    does not win over the config's own); one given on the command line (``from_cli``) the other way
    round. A reward ``module:function`` whose ``module.py`` is found that way becomes that file's path.
    A path found nowhere is left as written (the check that reads it names it); ``vllm.sync_dir``, a
    directory unison creates, is taken from the working directory."""
    def bases(key: str) -> list[Path]:
        here = [config_dir] if config_dir is not None else []
        return [Path.cwd(), *here] if key in from_cli else [*here, Path.cwd()]

    def find(value: str, key: str) -> str:
        p = Path(value).expanduser()
        if p.is_absolute():
            return str(p)
        for base in bases(key):
            if (base / p).exists():
                return str((base / p).resolve())
        return value

    cfg = cfg.model_copy(deep=True)
    for key in PATH_KEYS:
        section, _, name = key.rpartition(".")
        node = getattr(cfg, section) if section else cfg
        value = getattr(node, name)
        if not value or value.startswith(BUILTIN):
            continue
        if key == "vllm.sync_dir":
            setattr(node, name, str(Path(value).expanduser().resolve()))
        else:
            setattr(node, name, find(value, key))
    for key in ("reward", "env"):  # module:name, its module.py found as a path is
        spec = getattr(cfg.task, key)
        if spec and ":" in spec:
            module, fn = spec.rsplit(":", 1)
            file = module if module.endswith(".py") else module.replace(".", "/") + ".py"
            found = find(file, f"task.{key}")
            if found != file or Path(file).is_absolute():
                setattr(cfg.task, key, f"{found}:{fn}")
    template = cfg.task.chat_template  # a jinja file (the other values name templates unison has)
    if template not in ("auto", "model") and not template.startswith(BUILTIN):
        cfg.task.chat_template = find(template, "task.chat_template")
    return cfg


BUILTIN = "builtin:"


def _fix_yaml_floats(node) -> None:
    """YAML 1.1 reads ``1e-5`` as a string; turn such strings back into floats."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str) and _looks_float(v):
                node[k] = float(v)
            else:
                _fix_yaml_floats(v)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
