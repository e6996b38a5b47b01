"""How ``select`` picks among its choices (SGLang's ``choices_method``), and the scores it keeps for them.

The ranking methods score every choice by the log-probabilities of its tokens given the state (the runner's prompt
logprobs), all choices in one submission: the choices' requests share the state's prefix blocks, which the
scheduler computes once (``kv_groups.waits_for``). ``CONSTRAINED_DECODING`` is one request decoding under a grammar
that admits exactly the choices instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class ChoicesMethod(enum.Enum):
    """``select(..., choices_method=...)``."""

    # SGLang's default: the choice whose tokens have the highest mean logprob (its length-normalised logprob).
    TOKEN_LENGTH_NORMALIZED = "token_length_normalized"
    # SGLang's greedy_token_selection: keep the choices whose first token has the highest logprob, then among them
    # those whose second token has, and so on (a choice that ran out of tokens counts its mean logprob).
    GREEDY_TOKEN_SELECTION = "greedy_token_selection"
    # One request decoding greedily (or sampling, with temperature > 0) under a grammar admitting exactly the
    # choices: the greedy path through the choices' tokens, no scores (outlines' ``choice``).
    CONSTRAINED_DECODING = "constrained_decoding"

    @property
    def ranks(self) -> bool:
        """Whether the method scores every choice (and so keeps ``SelectScores``)."""
        return self is not ChoicesMethod.CONSTRAINED_DECODING


@dataclass(frozen=True)
class SelectScores:
    """What a ranking ``select`` measured (``ProgramState.get_meta_info(name)``; SGLang's select meta info).

    Invariants: one entry per choice in each tuple, in the choices' order; ``token_logprobs[i]`` holds the logprob
    of each token of choice i given the state and its earlier tokens (at least one; the tokens are those of the
    state's text followed by the choice, from the first that differs from the state's own encoding);
    ``normalized_logprobs[i]`` is their mean; ``chosen`` indexes the pick.
    """

    method: ChoicesMethod
    choices: tuple[str, ...]
    token_logprobs: tuple[tuple[float, ...], ...]
    normalized_logprobs: tuple[float, ...]
    chosen: int

    @classmethod
    def rank(cls, method: ChoicesMethod, choices: tuple[str, ...], logprobs: list[list[float]]) -> SelectScores:
        """Score ``choices`` from their tokens' ``logprobs`` and pick one by ``method`` (ties: the earlier)."""
        normalized = tuple(float(np.mean(lps)) for lps in logprobs)
        if method is ChoicesMethod.TOKEN_LENGTH_NORMALIZED:
            chosen = int(np.argmax(normalized))
        elif method is ChoicesMethod.GREEDY_TOKEN_SELECTION:
            chosen = _greedy_token_selection(logprobs, normalized)
        else:
            raise ValueError(f"{method} does not rank choices")
        return cls(method, choices, tuple(tuple(lps) for lps in logprobs), normalized, chosen)


def _greedy_token_selection(logprobs: list[list[float]], normalized: tuple[float, ...]) -> int:
    """SGLang's ``GreedyTokenSelection``: a matrix of the choices' token logprobs (a shorter choice padded with its
    mean), narrowed column by column to the choices at the column's maximum until one is left."""
    width = max(len(lps) for lps in logprobs)
    matrix = np.array([[*lps, *[mean] * (width - len(lps))] for lps, mean in zip(logprobs, normalized, strict=True)])
    remaining = np.arange(len(logprobs))
    for j in range(width):
        column = matrix[remaining, j]
        remaining = remaining[column == column.max()]
        if len(remaining) == 1:
            break
    return int(remaining[0])
