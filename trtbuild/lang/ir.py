"""The expressions a program appends to its state: text, ``gen``, ``select`` and role blocks (SGLang's primitives).

Expressions are plain frozen values: building one checks its arguments (a bad regex or JSON schema raises
``RequestError`` where ``gen`` is called) and runs nothing; ``ProgramState += expr`` runs it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError
from ..runtime.sampling import SamplingParams
from .choices import ChoicesMethod

GEN_MAX_TOKENS = 128  # a gen's max_tokens unless given (SGLang's default)


class Expr:
    """Something a program appends to its state; ``"text" + expr`` and ``expr + expr`` make a ``Concat``."""

    def __add__(self, other: Expr | str) -> Concat:
        return Concat((*_parts(self), *_parts(other)))

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat((*_parts(other), *_parts(self)))


def _parts(x: Expr | str) -> tuple[Expr | str, ...]:
    if isinstance(x, Concat):
        return x.parts
    if isinstance(x, str | Expr):
        return (x,)
    raise TypeError(f"a program appends strings and trtbuild.lang expressions, not {type(x).__name__}")


@dataclass(frozen=True)
class Concat(Expr):
    """Parts appended one after the other."""

    parts: tuple[Expr | str, ...]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text at the end of the state and store it as variable ``name``."""

    name: str
    params: SamplingParams


@dataclass(frozen=True)
class Select(Expr):
    """Append the one of ``choices`` the model picks (by ``method``) and store it as variable ``name``."""

    name: str
    choices: tuple[str, ...]  # distinct, non-empty
    method: ChoicesMethod
    temperature: float  # of CONSTRAINED_DECODING's request; 0 for the ranking methods

    def decoding_params(self) -> SamplingParams:
        """CONSTRAINED_DECODING's request: a grammar admitting exactly the choices (runtime/grammar.py)."""
        regex = "|".join(_escape(c) for c in self.choices)
        max_tokens = max(len(c.encode("utf-8")) for c in self.choices) + 1  # a token holds at least one byte; + EOS
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens, regex=regex)


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # a tool's result (``tools.call_tool``), as OpenAI's chat messages carry it


@dataclass(frozen=True)
class RoleBlock(Expr):
    """A chat message of ``role`` whose content is ``parts``, rendered by the engine's chat template."""

    role: Role
    parts: tuple[Expr | str, ...] = field(default=())


def gen(
    name: str,
    *,
    max_tokens: int | None = GEN_MAX_TOKENS,
    stop: str | Sequence[str] = (),
    temperature: float = 0.0,
    regex: str | None = None,
    json_schema: dict[str, Any] | None = None,
    **sampling: Any,
) -> Gen:
    """Generate into variable ``name`` (greedy unless ``temperature`` > 0); any other ``SamplingParams`` field may
    be given (``top_p``, ``seed``, ...). ``regex`` / ``json_schema`` constrain the text (structured output)."""
    _check_name(name)
    params = SamplingParams(
        max_tokens=max_tokens,
        stop=stop,
        temperature=temperature,
        regex=regex,
        json_schema=json_schema,
        **sampling,
    )
    if params.n != 1:
        raise RequestError("gen makes one completion: use fork(n) for several")
    return Gen(name, params)


def select(
    name: str,
    choices: Sequence[str],
    *,
    choices_method: ChoicesMethod = ChoicesMethod.TOKEN_LENGTH_NORMALIZED,
    temperature: float = 0.0,
) -> Select:
    """Pick one of ``choices`` into variable ``name``. By default (SGLang's) every choice is scored by the mean
    log-probability of its tokens given the state, all in one batched submission, and the best is taken
    (``ProgramState.get_meta_info(name)`` holds the scores); ``choices_method`` picks another ``ChoicesMethod``.
    ``temperature`` > 0 samples, for ``CONSTRAINED_DECODING`` only."""
    _check_name(name)
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise RequestError("select needs a list of non-empty strings as choices")
    if not isinstance(choices_method, ChoicesMethod):
        names = ", ".join(m.name for m in ChoicesMethod)
        raise RequestError(f"choices_method must be a trtbuild.lang.ChoicesMethod ({names}), got {choices_method!r}")
    if choices_method.ranks and temperature != 0:
        raise RequestError("select's temperature applies to ChoicesMethod.CONSTRAINED_DECODING only")
    expr = Select(name, tuple(dict.fromkeys(choices)), choices_method, temperature)
    if not choices_method.ranks:
        expr.decoding_params()  # checks the temperature now
    return expr


def _escape(text: str) -> str:
    """``text`` as a literal in the grammar library's regex syntax (Rust's: every ASCII punctuation may be escaped)."""
    return "".join("\\" + ch if ch.isascii() and not ch.isalnum() and not ch.isspace() else ch for ch in text)


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise RequestError(f"a variable name must be a non-empty string, got {name!r}")


def system(*parts: Expr | str) -> RoleBlock:
    return RoleBlock(Role.SYSTEM, _flatten(parts))


def user(*parts: Expr | str) -> RoleBlock:
    return RoleBlock(Role.USER, _flatten(parts))


def assistant(*parts: Expr | str) -> RoleBlock:
    return RoleBlock(Role.ASSISTANT, _flatten(parts))


def tool(*parts: Expr | str) -> RoleBlock:
    """A tool message: the result of a call (``s[name].content`` of a ``call_tool``), as the chat template shows it."""
    return RoleBlock(Role.TOOL, _flatten(parts))


def _flatten(parts: tuple[Expr | str, ...]) -> tuple[Expr | str, ...]:
    out: list[Expr | str] = []
    for p in parts:
        if isinstance(p, RoleBlock):
            raise RequestError("role blocks do not nest")
        out.extend(_parts(p))
    return tuple(out)
