"""Structured output: a sequence's tokens constrained to a regex or a JSON schema (``SamplingParams.regex`` /
``json_schema``), by a grammar per sequence that masks the logits before sampling.

The grammar engine is llguidance (MIT; a Rust extension with no Python dependencies, imported lazily): it reads the
engine's ``tokenizer.json`` as is and compiles a regex or a JSON schema in milliseconds (an Earley parser over a
lazily built lexer: no index over the vocabulary), then computes a mask in tens of microseconds per sequence. None of
the grammar machinery is ours: this module turns ``SamplingParams`` into llguidance grammars, keeps one matcher per
sequence, and applies its masks. One engine step (``LLM._step``)::

    masks = grammars.start_masks(matchers of the step's sampled sequences)  # a worker thread (llguidance drops the GIL)
    logits = <the engine step>                                               # runs meanwhile
    masks.apply(logits)                 # disallowed tokens -> -inf (waits for the worker if it is not done)
    sampled = sampler.sample(logits, ...)
    matcher.advance(token)              # for every constrained sequence, with the token it got

A mask allows EOS only where the grammar accepts the text so far, and only EOS once the grammar is complete, so a
constrained output ends with EOS right after a complete match (or stops at ``max_tokens``, cut short). Whitespace in
JSON is fixed (``", "`` and ``": "``, none elsewhere), so a model cannot spend its tokens on blank space.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import RequestError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


def call_schema(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of a function call ``{"name": <one of functions>, "arguments": <its parameters' schema>}``
    (``functions``: name -> parameters schema), as tool calls are generated (serve's ``tools``, lang's
    ``call_tool``): the name fixed per branch, so the arguments always validate for the function named."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class Constrained(Protocol):
    """What the grammar reads from a request's params (``SamplingParams`` is one)."""

    regex: str | None
    json_schema: dict[str, Any] | None


# JSON whitespace the grammars allow: json.dumps' separators, nothing else (llguidance's default allows any amount
# of whitespace between tokens, where a small model can loop). A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}  # OpenAI's response_format {"type": "json_object"}
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per engine (by their text)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise RequestError("structured output (regex / json_schema) needs llguidance: pip install llguidance") from None
    return llguidance


def grammar_text(params: Constrained) -> str | None:
    """The llguidance grammar of ``params`` (regex or JSON schema), or None when the output is unconstrained."""
    if params.regex is not None:
        return _regex_grammar(params.regex)
    if params.json_schema is not None:
        try:
            schema = json.dumps(params.json_schema)  # key order kept: properties come out in it
        except (TypeError, ValueError) as e:
            raise RequestError(f"json_schema is not JSON ({e})") from None
        return _schema_grammar(schema)
    return None


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _regex_grammar(regex: str) -> str:
    llg = _llguidance()
    grammar = llg.LLMatcher.grammar_from_regex(regex)
    _check(llg, grammar, f"regex {regex!r}")
    return grammar


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _schema_grammar(schema: str) -> str:
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise RequestError(f"json_schema: {_one_line(str(e))}") from None
    _check(llg, grammar, "json_schema")
    return grammar


def _check(llg: Any, grammar: str, what: str) -> None:
    """``RequestError`` (one line) when llguidance rejects ``grammar`` (checked without a tokenizer)."""
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise RequestError(f"{what} is not supported: {_one_line(messages[0])}")


def _one_line(message: str) -> str:
    """llguidance's (possibly multi-line) error as one line: a regex parser's ``error: ...`` line when present."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    detail = next((ln[len("error: ") :] for ln in lines if ln.startswith("error: ")), None)
    return detail if detail is not None else (lines[0] if lines else "rejected by the grammar library")


@dataclass
class GrammarTimes:
    """Seconds of structured output's work, summed over steps: what the engine loop spends is ``wait + apply``."""

    masks: float = 0.0  # the worker computing masks (overlaps the engine step)
    wait: float = 0.0  # the engine loop waiting for the worker after its engine step
    apply: float = 0.0  # masking the logits and advancing the matchers
    steps: int = 0  # steps with at least one constrained sequence
    rows: int = 0  # masks computed


class GrammarMatcher:
    """One sequence's grammar state: advanced by every token the sequence gets."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher  # llguidance.LLMatcher

    def advance(self, token: int) -> None:
        """Feed the token the sequence got (one the mask allowed; EOS included)."""
        self._matcher.consume_token(token)

    @property
    def accepting(self) -> bool:
        """True when the tokens so far are a complete match (EOS is allowed now)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        """llguidance's error once the matcher has failed (a resource limit, a token it refused), else None."""
        return self._matcher.get_error() if self._matcher.is_error() else None


class Grammars:
    """The engine's grammar compiler and mask worker (one per ``LLM``; llguidance's tokenizer is built lazily)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits) vocabulary
        self.eos_token_ids = tuple(eos_token_ids)
        self._llg_tokenizer: Any = None
        self._templates: dict[str, Any] = {}  # grammar text -> a fresh matcher (copied for each sequence)
        self._executor: Any = None  # llguidance.LLExecutor
        self._worker: ThreadPoolExecutor | None = None
        self.times = GrammarTimes()

    def _llg(self) -> Any:
        if self._llg_tokenizer is None:
            if not self.eos_token_ids:
                raise RequestError("structured output needs the engine's EOS token ids (its config has none)")
            llg = _llguidance()
            # tokenizer.json as is: llguidance reads the token bytes of BPE, byte-fallback and word-level models.
            try:
                self._llg_tokenizer = llg.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
                )
            except ValueError as e:
                raise RequestError(f"structured output: llguidance cannot read this tokenizer ({e})") from None
            self._executor = llg.LLExecutor(num_threads=1)
        return self._llg_tokenizer

    def check(self, params: Constrained) -> None:
        """``RequestError`` now when ``params``' grammar does not compile for this engine's tokenizer."""
        text = grammar_text(params)
        if text is not None:
            self._template(text)

    def matcher(self, params: Constrained) -> GrammarMatcher | None:
        """A new matcher for one sequence of ``params``; None when its output is unconstrained."""
        text = grammar_text(params)
        return None if text is None else GrammarMatcher(self._template(text).deep_copy())

    def _template(self, text: str) -> Any:
        template = self._templates.get(text)
        if template is None:
            tokenizer = self._llg()
            llg = _llguidance()
            template = llg.LLMatcher(tokenizer, text, log_level=0)
            if template.is_error():
                raise RequestError(f"the grammar does not compile: {_one_line(template.get_error())}")
            if len(self._templates) >= GRAMMAR_CACHE_SIZE:
                self._templates.pop(next(iter(self._templates)))
            self._templates[text] = template
        return template

    def start_masks(self, rows: Sequence[tuple[int, GrammarMatcher]]) -> StepMasks:
        """Start computing the masks of ``rows`` ((logits row, matcher)) on the worker thread; returns at once."""
        words = (self._llg().vocab_size + 31) // 32
        bitmask = np.full((len(rows), words), -1, dtype=np.int32)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trtbuild-grammar")
        future = self._worker.submit(self._fill, [m for _, m in rows], bitmask)
        self.times.steps += 1
        self.times.rows += len(rows)
        return StepMasks([r for r, _ in rows], bitmask, future, self.eos_token_ids, self.times)

    def _fill(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        t0 = time.perf_counter()
        fill_next_token_bitmask_par(self._executor, [(m._matcher, i) for i, m in enumerate(matchers)], bitmask)
        self.times.masks += time.perf_counter() - t0

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


@dataclass
class StepMasks:
    """One step's grammar masks, being computed: ``bitmask[i]`` (bit t of word t // 32: token t allowed) belongs
    to logits row ``rows[i]``."""

    rows: list[int]
    bitmask: np.ndarray
    future: Future[None]
    eos_token_ids: tuple[int, ...]
    times: GrammarTimes

    def allowed(self, vocab: int) -> Iterator[tuple[int, np.ndarray]]:
        """(logits row, boolean mask of its ``vocab`` tokens) per constrained row, once the worker is done."""
        t0 = time.perf_counter()
        self.future.result()
        self.times.wait += time.perf_counter() - t0
        bits = np.unpackbits(self.bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
        if bits.shape[1] < vocab:  # logits past the tokenizer's vocabulary (padding) are never allowed
            bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
        for row, allowed in zip(self.rows, bits[:, :vocab], strict=True):
            if not allowed.any():  # a failed matcher allows nothing: end the sequence rather than sample noise
                allowed[list(self.eos_token_ids)] = True
            yield row, allowed

    def apply(self, logits: Any) -> Any:
        """The logits with every disallowed token at -inf: host numpy logits are masked in place and returned; a
        device tensor (a GPU engine's, read-only outside its inference mode) gets a masked copy."""
        if isinstance(logits, np.ndarray):
            for row, allowed in self.allowed(logits.shape[-1]):
                t0 = time.perf_counter()
                np.putmask(logits[row], ~allowed, -np.inf)
                self.times.apply += time.perf_counter() - t0
            return logits
        disallowed = np.zeros(tuple(logits.shape), dtype=bool)
        for row, allowed in self.allowed(logits.shape[-1]):
            disallowed[row] = ~allowed
        t0 = time.perf_counter()
        masked = logits.masked_fill(logits.new_tensor(disallowed).bool(), float("-inf"))
        self.times.apply += time.perf_counter() - t0
        return masked
