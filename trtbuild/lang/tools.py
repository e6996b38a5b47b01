"""Tools in programs: ``call_tool(name, functions)`` has the model call one of the Python ``functions`` between
``gen`` steps, and ``tool(...)`` hands its result back as a tool message.

The functions are described by their signatures: each parameter's type hint becomes a JSON schema (``str``,
``int``, ``float``, ``bool``, ``None``, ``Literal[...]``, ``Enum`` subclasses, ``list[X]`` / ``tuple[X, ...]``,
``dict[str, X]``, ``X | Y`` / ``Optional[X]``; an unannotated parameter takes any JSON value), parameters without a
default are required, and the docstring's first paragraph is the description. The call is generated under the JSON
schema of a call of any of them, ``{"name": <function>, "arguments": {...}}`` (structured output, as serve's
``tool_choice="required"``), so it always parses and its arguments validate; the interpreter then runs the function
with those arguments and stores a ``ToolCall`` (name, arguments, result) as the variable.

The chat template is handed the functions (its ``tools`` variable, OpenAI's format) for the request that makes the
call where it renders them; otherwise describe them in the program's own messages.
"""

from __future__ import annotations

import enum
import inspect
import json
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError
from ..runtime.grammar import call_schema
from ..runtime.sampling import SamplingParams
from .ir import Expr, _check_name

CALL_MAX_TOKENS = 256  # a call's max_tokens unless given: room for the wrapper and a few arguments
JSON_TYPES: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    dict: {"type": "object"},
    list: {"type": "array"},
}


@dataclass(frozen=True)
class Function:
    """A Python function offered to the model, with the JSON schema of its keyword arguments."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Function:
        """``fn`` described by its signature and docstring (``RequestError`` for a parameter it cannot describe)."""
        if not callable(fn) or not getattr(fn, "__name__", None):
            raise RequestError(f"a tool must be a named Python function, not {fn!r}")
        try:
            hints = typing.get_type_hints(fn)
            signature = inspect.signature(fn)
        except (NameError, TypeError, ValueError) as e:
            raise RequestError(f"tool {fn.__name__}: cannot read its signature ({e})") from None
        properties, required = {}, []
        for p in signature.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                raise RequestError(f"tool {fn.__name__}: parameter {p.name} must be passable by keyword")
            properties[p.name] = _schema(hints.get(p.name, Any), f"tool {fn.__name__}, parameter {p.name}")
            if p.default is p.empty:
                required.append(p.name)
        parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        description = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        return cls(fn, fn.__name__, description, parameters)

    def openai(self) -> dict[str, Any]:
        """The OpenAI function tool a chat template's ``tools`` variable takes."""
        spec = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": spec}


def _schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of values of type ``hint``."""
    if hint is Any:
        return {}
    if hint in JSON_TYPES:
        return dict(JSON_TYPES[hint])
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [m.value for m in hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema(a, where) for a in args]}
    if origin in (list, Sequence) and len(args) == 1:
        return {"type": "array", "items": _schema(args[0], where)}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return {"type": "array", "items": _schema(args[0], where)}
    if origin is dict and len(args) == 2 and args[0] is str:
        return {"type": "object", "additionalProperties": _schema(args[1], where)}
    raise RequestError(f"{where}: type {hint!r} has no JSON schema (use str, int, float, bool, Literal, list, dict)")


@dataclass(frozen=True)
class ToolCall:
    """What ``call_tool`` stores: the function the model called, its arguments, and what the function returned."""

    name: str
    arguments: dict[str, Any]
    result: Any

    @property
    def content(self) -> str:
        """The result as a tool message's content: a string as it is, anything else as JSON."""
        return self.result if isinstance(self.result, str) else json.dumps(self.result)


@dataclass(frozen=True)
class CallTool(Expr):
    """Generate a call of one of ``functions`` under its JSON schema, run it, store the ``ToolCall`` as ``name``."""

    name: str
    functions: tuple[Function, ...]
    params: SamplingParams  # the constrained request that makes the call

    def run(self, text: str) -> ToolCall:
        """Run the call the model wrote (``text``, which the grammar made a call of one of ``functions``)."""
        call = json.loads(text)
        [function] = [f for f in self.functions if f.name == call["name"]]
        return ToolCall(function.name, call["arguments"], function.fn(**call["arguments"]))


def call_tool(
    name: str,
    functions: Sequence[Callable[..., Any]],
    *,
    max_tokens: int | None = CALL_MAX_TOKENS,
    temperature: float = 0.0,
    **sampling: Any,
) -> CallTool:
    """Have the model call one of ``functions`` (in an assistant block); the call runs and its ``ToolCall`` is
    stored as variable ``name``. Greedy unless ``temperature`` > 0; other ``SamplingParams`` fields may be given."""
    _check_name(name)
    if isinstance(functions, str) or not functions:
        raise RequestError("call_tool needs a list of Python functions")
    described = tuple(Function.of(f) for f in functions)
    if len({f.name for f in described}) != len(described):
        raise RequestError("call_tool: the functions' names must be unique")
    schema = call_schema({f.name: f.parameters for f in described})
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, json_schema=schema, **sampling)
    if params.n != 1:
        raise RequestError("call_tool makes one call: use fork(n) for several")
    return CallTool(name, described, params)
