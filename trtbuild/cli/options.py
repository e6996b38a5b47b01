"""CLI options generated from the config dataclasses, so flags, defaults and help can never drift from the code.

Each dataclass field ``foo_bar`` becomes ``--foo-bar`` with its type (enums as choices), default and the help text
in the field's metadata (after Polygraphy's shared argument groups).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Iterable
from typing import Any

import click

from ..configio import from_dict


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
    values = {k: kwargs.pop(k) for k in list(kwargs) if k in names and kwargs[k] is not None}
    values.update({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in fixed.items()})
    return from_dict(cls, values, path="options")
