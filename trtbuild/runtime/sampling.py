"""Sampling parameters and the sampler: logits -> next tokens (vLLM semantics, numpy only).

Processing order for each row (vLLM v1): penalties (repetition, frequency, presence) -> greedy argmax when
``temperature == 0``; otherwise temperature -> min-p -> top-k -> top-p -> one draw from the request's generator.
Rows are processed one at a time, so a request's result never depends on the rest of the batch. Structured output
(``regex`` / ``json_schema``) masks a row's logits before all of this (``grammar.py``, applied by ``LLM``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request, and when to stop. Invalid values raise ``RequestError``.

    The CLI flags, JSON-lines input fields and the server's request fields all build one of these, so a value means
    the same everywhere (``top_k`` -1 or 0: all tokens, stored as None)."""

    temperature: float = 1.0  # 0 = greedy (exact argmax)
    top_k: int | None = None  # keep the k most likely tokens; None = all (-1 and 0 are read as None, as in vLLM)
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p; 1 = all
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely token's probability; 0 = off
    repetition_penalty: float = 1.0  # logits of prompt/output tokens: > 0 divided by it, <= 0 multiplied; 1 = off
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the generated tokens
    seed: int | None = None  # per-request generator seed: same seed, same tokens, whatever the batch; None = random
    max_tokens: int | None = 16  # tokens to generate at most; None = until the engine's max_seq_len
    stop: tuple[str, ...] = ()  # stop strings (checked by the detokenizing layer, not the scheduler)
    stop_token_ids: tuple[int, ...] = ()  # tokens that finish the request (kept in the output)
    n: int = 1  # completions per prompt (the LLM layer fans them out as separate sequences)
    logprobs: int | None = None  # also return the chosen token's logprob and this many top logprobs; None = no
    # Prompt log-probabilities (vLLM's): for each prompt position p >= prompt_logprobs_from (position 0 has none),
    # the logprob of prompt token p given the tokens before it, under the model's raw logits (no penalties or
    # temperature), and this many top alternatives; None = none. Such a request reuses prefix-cache blocks only
    # before position prompt_logprobs_from - 1, whose logits it needs (docs/runner.md, "Prompt logprobs").
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 1  # the first prompt position scored (SGLang's logprob_start_len); >= 1
    ignore_eos: bool = False  # keep generating past the model's EOS tokens
    # Structured output (runtime/grammar.py), at most one: the output matches this regex (Rust regex syntax, whole
    # output), or is JSON valid under this JSON schema; it ends with EOS right after a complete match.
    regex: str | None = None
    json_schema: dict[str, Any] | None = field(default=None, hash=False)  # a dict: left out of the hash

    def __post_init__(self) -> None:
        # Lists (and a single stop string) are accepted and stored as tuples: the params stay immutable and hashable.
        if not isinstance(self.stop, str | Sequence) or isinstance(self.stop, bytes):
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(self.stop_token_ids, Sequence):
            raise RequestError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_types(self)
        if self.top_k in (-1, 0):  # vLLM's and OpenAI clients' spellings of "all tokens": one value inside
            object.__setattr__(self, "top_k", None)
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0 (0 = greedy)"),
            (self.top_k is None or self.top_k >= 1, "top_k must be >= 1 (or -1 / 0: all tokens)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.n >= 1, "n must be >= 1"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs must be >= 0"),
            (self.prompt_logprobs_from >= 1, "prompt_logprobs_from must be >= 1 (position 0 has no logprob)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)
        if self.regex is not None or self.json_schema is not None:
            _check_structured(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTEGERS = ("n", "prompt_logprobs_from")
_OPTIONAL_INTEGERS = ("top_k", "seed", "max_tokens", "logprobs", "prompt_logprobs")


def is_int(x: object) -> bool:
    """Whether ``x`` is an integer of a request: a Python or numpy integer, not a bool."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _check_types(params: SamplingParams) -> None:
    """``RequestError`` for a value of the wrong type (e.g. ``"5"`` from a JSON file), before any comparison."""

    for name in _NUMBERS:
        value = getattr(params, name)
        if not (is_int(value) or isinstance(value, float | np.floating)):
            raise RequestError(f"{name} must be a number, got {value!r}")
    for name in _INTEGERS + _OPTIONAL_INTEGERS:
        value = getattr(params, name)
        if not is_int(value) and not (value is None and name in _OPTIONAL_INTEGERS):
            raise RequestError(f"{name} must be an integer, got {value!r}")
    if not isinstance(params.ignore_eos, bool):
        raise RequestError(f"ignore_eos must be true or false, got {params.ignore_eos!r}")
    if params.regex is not None and not isinstance(params.regex, str):
        raise RequestError(f"regex must be a string, got {params.regex!r}")
    if params.json_schema is not None and not isinstance(params.json_schema, dict):
        raise RequestError(f"json_schema must be a JSON schema object, got {params.json_schema!r}")


def _check_structured(params: SamplingParams) -> None:
    """``RequestError`` for a regex / JSON schema the grammar library rejects, or one combined with what it excludes."""
    from .grammar import grammar_text

    if params.regex is not None and params.json_schema is not None:
        raise RequestError("give at most one of regex and json_schema")
    if params.ignore_eos:
        raise RequestError("ignore_eos cannot be combined with regex / json_schema (the grammar ends the output)")
    grammar_text(params)


class SamplingRequest(Protocol):
    """What the sampler reads from a request (``sequence.Sequence`` is one)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: np.random.Generator | None


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token under the processed distribution (log_softmax of processed logits)."""

    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # up to k most likely unfiltered tokens, (token id, logprob), most likely first


@dataclass(frozen=True)
class SamplerOutput:
    """One step's sampled tokens, row b for request b."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # None where the request asked for none


def apply_penalties(
    logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> None:
    """Apply repetition, frequency and presence penalties to one row of logits in place (vLLM semantics)."""
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.fromiter((*prompt_ids, *output_ids), dtype=np.int64))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and len(output_ids):
        tokens, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        logits[tokens] -= params.frequency_penalty * counts + params.presence_penalty


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax of a 1-D row; -inf entries stay -inf."""
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def apply_min_p(logits: np.ndarray, min_p: float) -> None:
    """Mask (to -inf) tokens whose probability is below ``min_p`` times the largest probability."""
    probs = np.exp(logits - logits.max())  # unnormalised: the largest is 1, so the threshold is min_p itself
    logits[probs < min_p] = -np.inf


def apply_top_k(logits: np.ndarray, k: int) -> None:
    """Keep the ``k`` largest logits (and any tied with the k-th); mask the rest to -inf."""
    live = logits[np.isfinite(logits)]  # np.partition is slow on many equal (-inf) values: leave them out
    if k < live.shape[0]:
        logits[logits < kth_largest(live, k)] = -np.inf


def apply_top_p(logits: np.ndarray, p: float) -> None:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``p``; mask the rest to -inf.

    Ties are ordered by token id. Sorts only the most likely ``TOP_P_CANDIDATES`` tokens when they reach ``p``
    (the usual case for a language model), else 4 times as many, and so on up to the whole row (a flat
    distribution: random prompts, high temperatures); the result is the same either way.
    """
    probs = np.exp(log_softmax(logits))
    live = np.flatnonzero(probs > 0)  # tokens already masked (or underflowed) are never kept
    live_probs = probs[live]
    m = TOP_P_CANDIDATES
    order = _top_sorted(live_probs, m)
    cum = np.cumsum(live_probs[order])
    while cum[-1] < p and order.shape[0] < live.shape[0]:
        m *= 4
        order = _top_sorted(live_probs, m)
        cum = np.cumsum(live_probs[order])
    keep = cum - live_probs[order] < p  # the mass of the strictly more likely tokens is still short of p
    keep[0] = True  # the most likely token always stays
    dropped = np.ones(logits.shape[0], dtype=bool)
    dropped[live[order[keep]]] = False
    logits[dropped] = -np.inf


TOP_P_CANDIDATES = 1024  # tokens sorted first by apply_top_p


def _top_sorted(values: np.ndarray, m: int) -> np.ndarray:
    """Indices of every value >= the m-th largest (ties included), largest first, ties by lower index.

    Cumulative sums over it equal the first entries of those over the full stable sort, at O(V + m log m) cost.
    """
    n = values.shape[0]
    if m <= 0:
        return np.zeros(0, dtype=np.int64)
    candidates = np.arange(n) if m >= n else np.flatnonzero(values >= kth_largest(values, m))
    return candidates[np.argsort(-values[candidates], kind="stable")]


SAMPLE_STRIDE = 8  # kth_largest's sample: every 8th value


def kth_largest(values: np.ndarray, m: int) -> float:
    """The ``m``-th largest of ``values`` (1 <= m <= len), as ``np.partition`` gives it, in a fraction of its time
    on a vocabulary row.

    A strided sample's ``2m / SAMPLE_STRIDE``-th largest is a threshold t with about 2m values at or above it. When
    at least m are, the m largest are among them and the m-th is found there; else (a row ordered against the
    sample) the whole row is partitioned. Exact either way.
    """
    n = values.shape[0]
    if n >= 16 * m:
        sample = values[::SAMPLE_STRIDE]
        j = min(sample.shape[0], 2 * m // SAMPLE_STRIDE + 1)
        above = values[values >= np.partition(sample, sample.shape[0] - j)[sample.shape[0] - j]]
        if above.shape[0] >= m:
            return float(np.partition(above, above.shape[0] - m)[above.shape[0] - m])
    return float(np.partition(values, n - m)[n - m])


class Sampler:
    """Turns a step's logits into one token per request (see the module docstring for the order of operations)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)  # for requests without their own seed

    def process(self, logits: np.ndarray, request: SamplingRequest) -> np.ndarray:
        """The processed float64 logits of one row: penalties, then (unless greedy) temperature and the filters."""
        params = request.sampling_params
        row = logits.astype(np.float64, copy=True)
        apply_penalties(row, params, request.prompt_token_ids, request.output_token_ids)
        if params.greedy:
            return row
        row /= params.temperature
        if params.min_p > 0:
            apply_min_p(row, params.min_p)
        if params.top_k is not None:
            apply_top_k(row, params.top_k)
        if params.top_p < 1:
            apply_top_p(row, params.top_p)
        return row

    def sample(
        self, logits: np.ndarray, requests: Sequence[SamplingRequest], draws: Sequence[float | None] | None = None
    ) -> SamplerOutput:
        """Pick a token for each row of float32 ``logits [B, V]``; row b belongs to ``requests[b]``.

        Greedy rows take the exact argmax (lowest id on ties). Random rows make one uniform draw from the request's
        generator (or the sampler's own when unseeded) and invert the cumulative distribution; ``draws[b]``, where
        given, is row b's draw already made (``uniform``; a sampler that splits a batch draws for all its rows in
        row order).
        """
        if logits.ndim != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {logits.shape} do not match {len(requests)} requests")
        # Plain greedy rows (no penalties, no logprobs) in one argmax over the float32 rows: the same tokens as the
        # float64 path below (float32 -> float64 is exact and keeps the order; ties go to the lowest id in both).
        plain = [b for b, r in enumerate(requests) if _plain_greedy(r.sampling_params)]
        token_ids: list[int] = [0] * len(requests)
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if plain:
            rows = logits if len(plain) == len(requests) else logits[plain]
            for b, token in zip(plain, np.argmax(rows, axis=1).tolist(), strict=True):
                token_ids[b] = token
        done = set(plain)
        for b, (row_logits, request) in enumerate(zip(logits, requests, strict=True)):
            if b in done:
                continue
            params = request.sampling_params
            row = self.process(row_logits, request)
            if params.greedy:
                token = int(np.argmax(row))
            else:
                u = draws[b] if draws is not None and draws[b] is not None else self.uniform(request)
                token = draw(row, u, filtered=params.top_k is not None or params.top_p < 1 or params.min_p > 0)
            token_ids[b] = token
            logprobs[b] = None if params.logprobs is None else token_logprobs(log_softmax(row), token, params.logprobs)
        return SamplerOutput(token_ids, logprobs)

    def uniform(self, request: SamplingRequest) -> float:
        """A random row's one draw in [0, 1): from the request's own generator, else the sampler's."""
        rng = request.generator if request.generator is not None else self._rng
        return float(rng.random())

    def join(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """Rows of several steps' logits, stacked in order."""
        return np.concatenate(parts)


def draw(row: np.ndarray, u: float, *, filtered: bool = True) -> int:
    """The token at the uniform draw ``u`` of the processed float64 ``row`` (-inf: filtered out): the cumulative
    distribution inverted in token-id order.

    With ``filtered`` (a filter ran: most of the row may be -inf), only the tokens kept are summed: a filtered
    token's weight is 0, and adding 0 leaves every partial sum as it was, so the token is the one a sum over the
    whole row gives, for a fraction of its exponentials.
    """
    kept = np.flatnonzero(row > -np.inf) if filtered else None
    if kept is not None and kept.shape[0] < row.shape[0]:
        weights = np.exp(row[kept] - row.max())
    else:
        kept, weights = None, np.exp(row - row.max())
    cdf = np.cumsum(weights)
    target = min(u * cdf[-1], np.nextafter(cdf[-1], 0.0))  # below the total (u * total may round up)
    at = min(int(np.searchsorted(cdf, target, side="right")), cdf.shape[0] - 1)
    return at if kept is None else int(kept[at])


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the row first (penalties) or reads it after (logprobs)."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
        and params.logprobs is None
    )


def token_logprobs(lp: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """``token``'s entry of the log-probabilities ``lp`` (one row) and the ``k`` largest finite ones."""
    live = np.flatnonzero(np.isfinite(lp))  # filtered tokens are not listed
    top = live[_top_sorted(lp[live], k)[:k]]
    return TokenLogprobs(float(lp[token]), [(int(t), float(lp[t])) for t in top])
