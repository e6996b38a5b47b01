"""What ``LLM.generate`` and its siblings accept, checked before anything is queued: the prompts (text or token ids,
one or a list) paired with their ``SamplingParams``, each prompt tokenized and its ids checked against the
vocabulary. Every error is a ``RequestError`` naming the prompt (``prompt i: ...``), so an invalid call queues
nothing (``LLM`` then queues the ``PreparedRequest`` s all or none).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import RequestError
from .grammar import Grammars
from .sampling import SamplingParams
from .sampling import is_int as is_token  # a token id is an integer of a request
from .tokenizer import Tokenizer

Prompt = str | Sequence[int]  # text, or token ids
Messages = Sequence[Mapping[str, Any]]  # a chat: [{"role": "user", "content": "..."}, ...]


class PreparedRequest(NamedTuple):
    """A checked prompt: its text (None for token ids), its token ids, its params."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


def pair_prompts(
    prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[tuple[Prompt, Any]]:
    """``generate``'s arguments as (prompt, params) pairs: one prompt (text or token ids) or a list of them, with
    one ``SamplingParams`` for all (default ``SamplingParams()``) or one each."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and is_token(prompts[0])):
        prompts = [prompts]  # one text prompt, or one token-id prompt
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    elif not isinstance(params, Sequence) or isinstance(params, str):
        raise RequestError(f"params must be a SamplingParams or a list of them, not {type(params).__name__}")
    params = list(params)
    if len(params) != len(prompts):
        raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    return list(zip(prompts, params, strict=True))


def prepare(
    index: int,
    prompt: Prompt,
    params: Any,
    *,
    tokenizer: Callable[[str], Tokenizer],
    grammars: Callable[[], Grammars],
    vocab_size: int,
) -> PreparedRequest:
    """Prompt ``index`` checked and tokenized. ``tokenizer(what)`` gives the engine's tokenizer or raises the
    ``RequestError`` saying ``what`` needs it; ``grammars()`` the structured-output compiler (made on first use)."""
    try:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"expected SamplingParams, got {type(params).__name__}")
        if params.stop:
            tokenizer("stop strings")
        if params.regex is not None or params.json_schema is not None:
            grammars().check(params)
        if isinstance(prompt, str):
            return PreparedRequest(prompt, tokenizer("a text prompt").encode(prompt), params)
        if not isinstance(prompt, Sequence) or not all(is_token(t) for t in prompt):
            raise RequestError("a prompt is a string or a list of token ids")
        ids = [operator.index(t) for t in prompt]
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        return PreparedRequest(None, ids, params)
    except RequestError as e:
        raise RequestError(f"prompt {index}: {e}") from None
