"""CLI options generated from the config dataclasses, so flags, defaults and help can never drift from the code.

Each dataclass field ``foo_bar`` becomes ``--foo-bar`` with its type (enums as choices), default and the help text
in the field's metadata (after Polygraphy's shared argument groups). ``--recipe FILE`` (``recipe_option``) makes
a recipe's config the defaults: ``config_with_defaults`` merges it under the flags the user typed.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from ..configio import from_dict, read_json, to_dict
from ..errors import ConfigError, TrtbuildError

if TYPE_CHECKING:
    from ..recipe import Recipe


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


class ByteSize(click.ParamType):
    """A size in bytes: ``268435456``, ``256MiB``, ``1G`` (binary units)."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"--{param.name.replace('_', '-')}: {value!r} is not a size (e.g. 512MiB, 2G)")
        unit = (m.group(2) or "b")[0].lower()
        return int(float(m.group(1)) * 1024 ** "bkmgt".index(unit))


class OutputPath(click.ParamType):
    """An output file or directory of a command (``-o``, ``--output``): its parent directory must already exist.

    The command creates the output itself (a file, or a checkpoint / engine / artifacts directory) but never a
    missing chain of directories above it, as ``cp`` and ``mkdir`` (without ``-p``) do not: a mistyped path is an
    error, not a new directory tree. A file output must not be an existing directory.
    """

    name = "path"

    def __init__(self, *, directory: bool) -> None:
        self.directory = directory

    def convert(self, value: Any, param: Any, ctx: Any) -> Path:
        path = Path(value)
        flag = max(param.opts, key=len) if param is not None else "output"
        parent = path.absolute().parent
        if not parent.is_dir():
            what = "is not a directory" if parent.exists() else "does not exist"
            raise TrtbuildError(f"{flag} {path}: the directory {parent} {what} (create it first)")
        if not self.directory and path.is_dir():
            raise TrtbuildError(f"{flag} {path}: a directory (expected a file name)")
        return path


def dataclass_options(cls: type, *, exclude: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding one click option per field of ``cls`` (minus ``exclude``); values arrive as kwargs."""
    hints = typing.get_type_hints(cls)
    skip = set(exclude)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for f in reversed(dataclasses.fields(cls)):
            if f.name in skip or not f.init:
                continue
            tp, flag = hints[f.name], "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            help_text = f.metadata.get("help", "")
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
                tp = args[0]  # ``X | None``: an optional flag of type X
            if typing.get_origin(tp) is list:  # repeatable flag; the dataclass default applies when none is given
                (item,) = typing.get_args(tp)
                fn = click.option(flag, f.name, type=item, multiple=True, default=None, help=help_text)(fn)
                continue
            if isinstance(tp, type) and issubclass(tp, enum.Enum):
                option = click.option(
                    flag,
                    f.name,
                    type=click.Choice([m.value for m in tp]),
                    default=default.value if default is not None else None,
                    show_default=True,
                    help=help_text,
                )
            elif tp is bool:
                option = click.option(
                    flag + "/--no-" + f.name.replace("_", "-"),
                    f.name,
                    default=default,
                    show_default=True,
                    help=help_text,
                )
            else:
                option = click.option(flag, f.name, type=tp, default=default, show_default=True, help=help_text)
            fn = option(fn)
        return fn

    return decorate


def config_from_options(cls: type, kwargs: dict[str, Any], **fixed: Any) -> Any:
    """Build ``cls`` from the option values in ``kwargs`` (popped) plus ``fixed`` values, type-checked."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    # Unset flags (None, or an empty repeatable flag) leave the dataclass default in place.
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items() if v is not None and v != ()}
    values.update({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in fixed.items()})
    return from_dict(cls, values, path="options")


def recipe_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator adding ``--recipe FILE``; the value arrives as ``recipe`` (a ``Path`` or None)."""
    return click.option(
        "--recipe",
        "recipe",
        type=click.Path(path_type=Path),
        default=None,
        help="recipe YAML whose values are the defaults; flags given here override them",
    )(fn)


def load_recipe_option(path: Path | None) -> Recipe | None:
    """The recipe named by ``--recipe`` (None without one); a bad file raises a one-line ``ConfigError``."""
    from ..recipe import load_recipe

    return None if path is None else load_recipe(path)


def explicit_options(kwargs: dict[str, Any]) -> set[str]:
    """Names in ``kwargs`` whose values the user typed (command line or environment), not click defaults."""
    ctx = click.get_current_context()
    defaults = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)
    return {name for name in kwargs if ctx.get_parameter_source(name) not in defaults}


def config_with_defaults(cls: type, kwargs: dict[str, Any], defaults: Any | None, **fixed: Any) -> Any:
    """Like ``config_from_options``, but fields not given on the command line come from ``defaults`` (a ``cls``).

    This is how ``--recipe`` works: the recipe's config supplies the defaults, explicit flags override them, and
    the merged values are type-checked by ``from_dict`` again. ``fixed`` values win over both.
    """
    if defaults is None:
        return config_from_options(cls, kwargs, **fixed)
    explicit = explicit_options(kwargs)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in to_dict(defaults).items() if k in names}
    for k in [k for k in kwargs if k in names]:
        v = kwargs.pop(k)
        if k in explicit and v is not None:
            values[k] = v
    values.update({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in fixed.items()})
    return from_dict(cls, values, path="options")


class JsonObjectFile(click.ParamType):
    """A JSON file holding one object (``run --json-schema FILE``): the value is the parsed dict."""

    name = "file"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, dict):
            return value
        flag = "--" + param.name.replace("_", "-") if param is not None else "value"
        return read_json(Path(value), f"{flag} {value}")
