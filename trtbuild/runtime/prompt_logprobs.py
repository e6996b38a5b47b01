"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's): which logits rows a step needs, and the
logprobs they give.

The logits at position p predict the token at p + 1, so prompt token p (p >= ``prompt_logprobs_from`` >= 1) is
scored by the row of position p - 1: a request asks for the rows of positions ``prompt_logprobs_from - 1`` to
``num_prompt_tokens - 2``, in whichever steps compute them (a chunked prefill spreads them over its chunks). The
last prompt position's row is the sample row, as for any request. Since a prefix-cache hit computes no logits,
such a request reuses cached blocks only before position ``prompt_logprobs_from - 1`` (``Sequence.prefix_hit_limit``);
its own blocks are cached for others as usual. A request preempted and recomputed scores its rows again, writing
the same entries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .sampling import TokenLogprobs, token_logprobs
from .sequence import Sequence

NO_ROWS = range(0)


def prompt_rows(seq: Sequence, num_new: int) -> range:
    """Offsets into ``seq``'s next ``num_new`` tokens (from ``num_computed_tokens``) whose logits score a prompt
    token; empty for a request without ``prompt_logprobs``."""
    params = seq.sampling_params
    if params.prompt_logprobs is None:
        return NO_ROWS
    start = seq.num_computed_tokens
    first = max(params.prompt_logprobs_from - 1, start)
    end = min(seq.num_prompt_tokens - 1, start + num_new)  # positions up to num_prompt_tokens - 2
    return range(first - start, max(first, end) - start)


def logits_rows(rows: range, num_new: int) -> list[int]:
    """A chunk's logits rows: its prompt rows, then its last token's row (the sample row) unless it is among them.

    Invariant: the last row is always the chunk's last token, as in a step without prompt logprobs."""
    last = num_new - 1
    return [*rows, last] if not rows or rows[-1] != last else list(rows)


def record(scores: list[TokenLogprobs | None], seq: Sequence, rows: range, logits: np.ndarray) -> None:
    """Write the prompt logprobs given by ``logits`` (host rows, one per offset of ``rows`` into the chunk starting
    at ``seq.num_computed_tokens``) into ``scores`` (one entry per prompt token), before the step is applied."""
    lp = logits.astype(np.float64)
    lp -= lp.max(axis=1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    k, start, prompt = seq.sampling_params.prompt_logprobs, seq.num_computed_tokens, seq.prompt_token_ids
    for i, r in enumerate(rows):
        p = start + r + 1  # the prompt position this row scores
        scores[p] = token_logprobs(lp[i], prompt[p], k)


# Rows a device tensor is widened to float32 at a time on its way to the host: that copy is bounded whatever the
# step's row count (a GPU engine reserves room for it: ``backends.torch.memory.step_reserve``).
HOST_COPY_ROWS = 256


def to_host(logits: Any) -> np.ndarray:
    """Rows of a session's ``step_logits`` as float32 numpy: a device tensor (the torch and TensorRT sessions',
    duck-typed: the runner imports no torch) is copied to the host ``HOST_COPY_ROWS`` rows at a time."""
    if isinstance(logits, np.ndarray):
        return logits
    out = np.empty(tuple(logits.shape), dtype=np.float32)
    for start in range(0, out.shape[0], HOST_COPY_ROWS):
        out[start : start + HOST_COPY_ROWS] = logits[start : start + HOST_COPY_ROWS].float().cpu().numpy()
    return out
