"""What ``LLM`` returns (RequestOutput, CompletionOutput, RequestMetrics, EngineStats) and the state behind it.

``CompletionState`` follows one scheduled sequence: it detokenizes each appended token, finds stop strings (the
scheduler's stop hook), keeps the logprobs and timings, and hands out stream deltas that a stop string can never
take back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .grammar import GrammarMatcher
from .kv_offload.tiers import TierStats
from .sampling import TokenLogprobs
from .sequence import FinishReason, Sequence
from .tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class RequestMetrics:
    """Timings (seconds, from the request's arrival in ``generate``) and token counts of one completion."""

    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int  # times the request was preempted and its tokens recomputed
    ttft: float  # time to first token; nan when none was generated (aborted)
    e2e_latency: float  # arrival to finish

    @property
    def tpot(self) -> float:
        """Time per output token after the first; nan with fewer than two output tokens."""
        n = self.num_output_tokens - 1
        return (self.e2e_latency - self.ttft) / n if n > 0 else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after the first per second of decoding (1 / tpot); nan with fewer than two."""
        tpot = self.tpot
        return 1.0 / tpot if tpot > 0 else math.nan


@dataclass(frozen=True)
class CompletionOutput:
    """One generated completion of a prompt (``index`` < ``SamplingParams.n``)."""

    index: int
    text: str  # detokenized output without EOS/stop tokens' text, cut right before a stop string; "" without tokenizer
    token_ids: list[int]  # every generated token, EOS / stop token included
    finish_reason: FinishReason | None  # None only while unfinished (streaming)
    stop_reason: int | str | None  # the stop token id or stop string that finished it, else None
    logprobs: list[TokenLogprobs] | None  # one per token id when SamplingParams.logprobs is set, else None
    metrics: RequestMetrics


@dataclass(frozen=True)
class RequestOutput:
    """The result for one prompt: its completions, and shortcuts to the first one (``text``, ``metrics``, ...)."""

    request_id: str
    prompt: str | None  # the prompt text, or None for a token-id prompt
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for position 0 and those before
    # prompt_logprobs_from (prompt_logprobs.py), else that token's logprob and top alternatives; None otherwise.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics


@dataclass(frozen=True)
class EngineStats:
    """Counters of the engine loop since the LLM was made or ``reset_stats`` was called."""

    num_steps: int  # scheduler steps
    num_engine_calls: int  # session.step calls (a step can be split into several)
    num_computed_tokens: int  # tokens run through the model (prompt chunks, recomputes and decodes)
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens found there
    peak_used_blocks: int  # KV-cache blocks in use at the fullest point (after a step's allocation)
    num_blocks: int  # usable KV-cache blocks
    waste_slots: int  # sum over steps of allocated KV slots not holding a computed token (after each step)
    allocated_slots: int  # sum over steps of allocated KV slots (after each step)
    kv_offload: tuple[TierStats, ...] = ()  # each KV offload tier's counters, top tier first (none when it is off)
    kv_offload_loaded_blocks: int = 0  # blocks loaded back from the offload tiers into the pool
    # A model of two KV-cache groups (runtime/kv_groups.py): the sliding layers' group, as the two above are the full
    # layers'; None for a model of one kind.
    peak_used_sliding_blocks: int | None = None
    num_sliding_blocks: int | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated KV slots holding no token, averaged over steps (slot-weighted)."""
        return self.waste_slots / self.allocated_slots if self.allocated_slots else 0.0


class CompletionState:
    """The live state of one completion while its sequence runs (owned by ``LLM``; one per scheduled sequence).

    Invariant: ``text[:streamed]`` was handed out by ``take_delta`` and is a prefix of every later ``text`` — a
    stop string found later starts at or after ``streamed``, because the text that could begin one is held back.
    """

    def __init__(
        self,
        seq: Sequence,
        index: int,
        detokenizer: IncrementalDetokenizer | None,
        eos_token_ids: tuple[int, ...],
        arrival: float,
    ) -> None:
        self.seq = seq
        self.index = index
        self.text = ""  # detokenized so far, cut at a stop string once one is found
        self.streamed = 0  # characters of text handed out by take_delta
        self.logprobs: list[TokenLogprobs] | None = None if seq.sampling_params.logprobs is None else []
        # One entry per prompt token, written as the steps computing their rows run (RequestOutput.prompt_logprobs).
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if seq.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * seq.num_prompt_tokens
        self.cancelled = False  # set by an abandoned stream; the LLM aborts the request before its next step
        self.grammar: GrammarMatcher | None = None  # structured output: the sequence's grammar state (LLM sets it)
        self._detokenizer = detokenizer
        params = seq.sampling_params
        # Tokens whose text is left out (vLLM): stop token ids, and EOS tokens unless ignore_eos.
        eos = () if params.ignore_eos else eos_token_ids
        self._silent = frozenset((*params.stop_token_ids, *eos))
        self._stops = params.stop
        self._arrival = arrival
        self._first_token_time: float | None = None
        self._finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return self._finish_time is not None

    def on_token(self, token: int, now: float) -> str | None:
        """The scheduler's stop hook for the token just appended: returns the stop string now in the text, or None."""
        if self._first_token_time is None:
            self._first_token_time = now
        if self._detokenizer is None or token in self._silent:
            return None
        start = len(self.text)
        self.text += self._detokenizer.append(token)
        return self._cut_at_stop(start)

    def _cut_at_stop(self, new_from: int) -> str | None:
        """Cut ``text`` before the earliest stop string ending after ``new_from``; return that stop string."""
        found: tuple[int, str] | None = None
        for stop in self._stops:
            i = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if i >= 0 and (found is None or i < found[0]):
                found = (i, stop)
        if found is None:
            return None
        self.text = self.text[: found[0]]
        return found[1]

    def finish(self, now: float) -> None:
        """Mark the completion done; the detokenizer's held-back tail joins the text unless a stop string cut it."""
        if self._detokenizer is not None and not isinstance(self.seq.stop_reason, str):
            self.text += self._detokenizer.flush()
        self._finish_time = now

    def take_delta(self) -> str:
        """Text not yet handed out, minus (while unfinished) a tail that could be the start of a stop string."""
        end = len(self.text)
        if not self.finished:
            end -= max(
                (k for s in self._stops for k in range(min(len(s) - 1, end), 0, -1) if self.text.endswith(s[:k])),
                default=0,
            )
        delta = self.text[self.streamed : end]
        self.streamed = max(self.streamed, end)
        return delta

    def output(self) -> CompletionOutput:
        seq, now = self.seq, self._finish_time
        first = self._first_token_time
        ttft = math.nan if first is None else first - self._arrival
        metrics = RequestMetrics(
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            ttft=ttft,
            e2e_latency=(now if now is not None else math.nan) - self._arrival,
        )
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            metrics=metrics,
        )
