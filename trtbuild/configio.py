"""Typed (de)serialization of config dataclasses: JSON files, recipes and CLI flags all go through here.

``from_dict`` checks every key and type against the dataclass annotations and names the offending key path
(``build.max_seq_len: expected int, got str``), so a config file can never silently disagree with the code. A
misspelt key or enum value gets the closest known one (``build.max_seq_lne: unknown key (did you mean
'max_seq_len'?)``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    """Plain JSON-able form of a config dataclass (enums by value, paths as strings, tuples as lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, list | tuple):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys, missing keys and wrong types."""
    return _convert(cls, data, path or cls.__name__)


def _suggest(key: str, known: list[str]) -> str:
    """``did you mean 'x'?`` for a close match of ``key`` among ``known`` (difflib), else the list of known keys."""
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: no variant of {tp} accepts {value!r}")
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {_convert(key_tp, k, path): _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields), key=str)
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key ({_suggest(str(unknown[0]), sorted(fields))})")
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _convert(hints[name], value[name], f"{path}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{path}.{name}: missing key")
        try:
            return tp(**kwargs)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{path}: {e}") from None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            choices = [str(m.value) for m in tp]
            close = difflib.get_close_matches(str(value), choices, n=1) if isinstance(value, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(choices)}{hint}") from None
    if tp is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{path}: expected a path string, got {type(value).__name__}")
        return Path(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected float, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {type(value).__name__}")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"{path}: unsupported annotation {tp!r}")


def write_json(path: Path, data: object) -> None:
    """``data`` as indented JSON with sorted keys (byte-stable: engines built twice are identical)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path, label: str | None = None) -> dict:
    """A file holding one JSON object; a missing, unreadable or malformed file, or one holding something else, is a
    one-line ``ConfigError`` that starts with ``label`` (default: the path)."""
    label = label or str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{label}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{label}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a JSON object, got {type(data).__name__}")
    return data


def json_lines(text: str, name: str) -> Iterator[tuple[str, Any]]:
    """``(where, value)`` for each non-blank line of JSON-lines ``text``; ``where`` is ``name:N``, N the line's number
    in the text (blank lines count). A line that is not JSON is a one-line ``ConfigError`` naming it."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{name}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}:{n}: not valid JSON ({e.msg})") from None
